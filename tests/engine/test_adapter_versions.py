"""A changed adapter is never served from an old copy: re-registering a name (or shadowing a source
adapter) takes effect for new requests, while requests already running finish on the weights they
started with.

Regression tests: before the fix, `register` dropped only the host and disk copies, so the device
slot (and a finished fetch) kept answering with the old weights.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import GREEDY

from lora_cluster.engine import Engine

PROMPT = "the river"


@pytest.fixture(params=["tiered", "folder"])
def engine(make_engine, request, tmp_path) -> Iterator[Engine]:
    engine = make_engine(max_loras=2, max_lora_rank=32, adapter_store=request.param,
                         disk_cache_dir=str(tmp_path / "disk"))
    yield engine
    engine.close()


def _tokens(engine: Engine, adapter_id: str) -> list[int]:
    return engine.generate([PROMPT], [adapter_id], GREEDY)[0].token_ids


def test_shadowing_a_source_adapter_serves_the_new_weights(engine, demo_zoo):
    own_a1 = _tokens(engine, "a1")
    own_a0 = _tokens(engine, "a0")
    assert own_a0 != own_a1, "the two demo adapters answer differently (else this test proves nothing)"
    engine.loader.register("a0", str(demo_zoo.adapters_dir / "a1"))
    assert _tokens(engine, "a0") == own_a1, "a0 now names a1's weights, not the copy in its device slot"


def test_re_registering_a_name_serves_the_new_weights(engine, demo_zoo):
    own = {a: _tokens(engine, a) for a in ("a2", "a3")}
    engine.loader.register("x", str(demo_zoo.adapters_dir / "a2"))
    assert _tokens(engine, "x") == own["a2"], "x serves a2's weights"
    engine.loader.register("x", str(demo_zoo.adapters_dir / "a3"))
    assert _tokens(engine, "x") == own["a3"], "x re-registered serves a3's weights"


def test_a_busy_adapter_is_replaced_for_new_requests_only(engine, demo_zoo):
    own = {a: _tokens(engine, a) for a in ("a4", "a5")}
    engine.loader.register("y", str(demo_zoo.adapters_dir / "a4"))
    engine.add_request("before", PROMPT, "y", GREEDY)
    for _ in range(3):
        engine.step()  # "before" runs on a4's weights
    assert engine.unload_adapter("y") is False, "unload refuses an adapter a running request uses"
    engine.loader.register("y", str(demo_zoo.adapters_dir / "a5"))
    engine.add_request("after", PROMPT, "y", GREEDY)
    finals = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
        if len(finals) == 2:
            break
    assert finals.get("before") == own["a4"], "the running request finishes on the weights it started with"
    assert finals.get("after") == own["a5"], "a request queued after the change gets the new weights"
    assert engine.stats().num_running == 0, "both requests released their slots"
    assert engine.pool.refs("y") == 0, "no adapter slot reference leaks"
