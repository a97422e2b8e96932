"""A merge request: which adapters to merge per request, with what weights and strategy (LoRAX's
`merged_adapters`), validated where it is made; the merge itself is `store.merge`.

A merged adapter's id is `merged/<hash of its spec>`: requests for the same merge share it (routing
affinity, the device slot and the host tier). The strategies (`linear`, `ties`, `dare_linear`,
`dare_ties`) and what `density` and `majority_sign_method` mean are described in `store.merge`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from lora_cluster.errors import RequestError
from lora_cluster.request.adapter_id import check_adapter_id

STRATEGIES = ("linear", "ties", "dare_linear", "dare_ties")
SIGN_METHODS = ("total", "frequency")
MERGED_PREFIX = "merged/"


@dataclass(frozen=True)
class MergeSpec:
    """What to merge (see the module docstring). Build it with `MergeSpec.parse` (validated)."""

    ids: tuple[str, ...]
    weights: tuple[float, ...]
    strategy: str = "linear"
    density: float = 1.0
    majority_sign_method: str = "total"

    @classmethod
    def parse(cls, ids: Sequence[str], weights: Sequence[float], strategy: str | None = None,
              density: float | None = None, majority_sign_method: str | None = None, *,
              max_ids: int) -> MergeSpec:
        """A validated spec (LoRAX's defaults: linear, density 1, total); RequestError names the field."""
        ids, weights = list(ids or []), list(weights or [])
        if not ids:
            raise RequestError("merged_adapters.ids must not be empty")
        if len(ids) > max_ids:
            raise RequestError(f"merged_adapters.ids has {len(ids)} adapters; the limit is {max_ids} "
                               "(max_merged_adapter_ids)")
        if len(weights) != len(ids):
            raise RequestError(f"merged_adapters has {len(ids)} ids but {len(weights)} weights")
        numbers = all(isinstance(w, int | float) and not isinstance(w, bool) for w in weights)
        if not numbers or not all(math.isfinite(w) for w in weights):
            raise RequestError("merged_adapters.weights must be finite numbers")
        for aid in ids:
            check_adapter_id(aid)
            if aid.startswith(MERGED_PREFIX):
                raise RequestError(f"merged_adapters.ids cannot name a merged adapter ({aid!r})")
        strategy = strategy or "linear"
        if strategy not in STRATEGIES:
            raise RequestError(f"merged_adapters.merge_strategy must be one of {', '.join(STRATEGIES)}, "
                               f"got {strategy!r}")
        sign = majority_sign_method or "total"
        if sign not in SIGN_METHODS:
            raise RequestError("merged_adapters.majority_sign_method must be one of "
                               f"{', '.join(SIGN_METHODS)}, got {sign!r}")
        density = 1.0 if density is None else float(density)
        if not 0.0 <= density <= 1.0:
            raise RequestError(f"merged_adapters.density must be in [0, 1], got {density!r}")
        if strategy.startswith("dare") and density == 0.0:
            raise RequestError("merged_adapters.density must be > 0 for dare merges (kept entries are "
                               "divided by it)")
        return cls(tuple(ids), tuple(float(w) for w in weights), strategy, density, sign)

    @property
    def adapter_id(self) -> str:
        """`merged/<32 hex digits>`: the same for every request with this spec."""
        canonical = json.dumps([self.ids, self.weights, self.strategy, self.density,
                                self.majority_sign_method])
        return MERGED_PREFIX + hashlib.sha256(canonical.encode()).hexdigest()[:32]


def is_merged_id(adapter_id: str) -> bool:
    return adapter_id.startswith(MERGED_PREFIX)
