"""Progress bars for long work (building the demo zoo, preloading adapters), on stderr.

Policy: a bar is shown only when asked for (`enabled=True`, e.g. `lora-cluster demo --progress`) or,
by default (`enabled=None`), when stderr is a terminal; never in logs, pipes or Ray workers unless
asked. Bars use tqdm (already a dependency of transformers and huggingface_hub), imported only
when a bar is shown. A bar never changes what the work does.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def wanted(enabled: bool | None) -> bool:
    """Whether to show a bar: `enabled`, or when None, whether stderr is a terminal."""
    if enabled is not None:
        return enabled
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def _bar(total: int, desc: str, unit: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=True)


def progress(items: Sequence[T], *, desc: str, unit: str = "it", enabled: bool | None = None) -> Iterator[T]:
    """Iterate `items`, advancing a bar after each one when a bar is `wanted`."""
    if not wanted(enabled) or not items:
        yield from items
        return
    bar = _bar(len(items), desc, unit)
    try:
        for item in items:
            yield item
            bar.update(1)
    finally:
        bar.close()


def track_futures(futures: Iterable[Future[Any]], *, desc: str, unit: str = "it",
                  enabled: bool | None = None) -> None:
    """A bar that advances as each of `futures` completes (background work; returns at once). The bar
    closes itself when the last one is done."""
    futures = list(futures)
    if not wanted(enabled) or not futures:
        return
    bar = _bar(len(futures), desc, unit)
    lock = threading.Lock()
    left = [len(futures)]

    def one_done(_future: Future[Any]) -> None:
        with lock:
            bar.update(1)
            left[0] -= 1
            if left[0] == 0:
                bar.close()

    for future in futures:
        future.add_done_callback(one_done)
