"""The continuous-batching policy and the device adapter pool, without a model."""

from __future__ import annotations

import pytest
import torch

from lora_cluster.adapter_format import LoraWeights, ModelShapes
from lora_cluster.engine.adapters.pool import AdapterPool
from lora_cluster.engine.sample.detokenizer import IncrementalDetokenizer
from lora_cluster.engine.schedule.scheduler import Gate, Scheduler
from lora_cluster.engine.schedule.sequence import SeqStatus, Sequence
from lora_cluster.errors import AdapterCapacityError, EngineOverloadedError
from lora_cluster.request.sampling_params import SamplingParams


def _seq(rid: str, prompt_len: int, adapter: str | None = None, priority: int = 0) -> Sequence:
    return Sequence(
        rid, adapter, list(range(1, prompt_len + 1)), SamplingParams(), IncrementalDetokenizer(None), None,
        priority=priority,
    )


def _ids(seqs: list[Sequence]) -> list[str]:
    return [q.request_id for q in seqs]


def _decoding(s: Scheduler, *seqs: Sequence) -> None:
    """Admit `seqs` (in one step) and play the engine: each computes its prompt and samples a token."""
    for seq in seqs:
        s.add(seq)
    out = s.schedule()
    assert _ids([q for q, _ in out.prefills]) == _ids(list(seqs)), "precondition: all are admitted"
    for seq, n in out.prefills:
        seq.num_computed += n
        seq.output_ids.append(7)


class Gates:
    """Adapter gate fake: per-adapter answers; records whether a new slot could be claimed."""

    def __init__(self, answers: dict[str | None, Gate]):
        self.answers, self.calls, self.released = answers, [], []

    def acquire(self, seq: Sequence, may_claim: bool) -> Gate:
        self.calls.append((seq.request_id, may_claim))
        gate = self.answers.get(seq.adapter_id, Gate.READY)
        return gate if may_claim or gate is not Gate.BLOCKED else Gate.BLOCKED

    def release(self, seq: Sequence) -> None:
        self.released.append(seq.request_id)


def _scheduler(gates: Gates, slots: int = 4, budget: int = 16, max_waiting: int = 10) -> Scheduler:
    return Scheduler(
        max_num_seqs=slots,
        max_num_batched_tokens=budget,
        max_waiting=max_waiting,
        acquire=gates.acquire,
        release=gates.release,
    )


def test_chunked_prefill_shares_steps_with_decodes():
    s = _scheduler(Gates({}), budget=8)
    a, b = _seq("a", 3), _seq("b", 20)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(q.request_id, n) for q, n in out.prefills] == [("a", 3), ("b", 5)], (
        "prompts are prefilled in arrival order, the last one chunked to the token budget"
    )
    a.num_computed, b.num_computed = 3, 5
    a.output_ids.append(7)
    out = s.schedule()
    assert [q.request_id for q in out.decodes] == ["a"], "a sequence past its prompt decodes"
    assert [(q.request_id, n) for q, n in out.prefills] == [("b", 7)], (
        "an unfinished prompt continues in the same step, with the budget left after the decodes (8 - 1)"
    )


def test_pending_adapter_does_not_block_others_and_failures_surface():
    gates = Gates({"loading": Gate.PENDING, "broken": Gate.FAILED})
    s = _scheduler(gates)
    for seq in (_seq("p", 2, "loading"), _seq("f", 2, "broken"), _seq("ok", 2, "ready")):
        s.add(seq)
    out = s.schedule()
    assert [q.request_id for q, _ in out.prefills] == ["ok"], (
        "a request whose adapter is ready runs although earlier ones wait for or failed on theirs"
    )
    assert [q.request_id for q in out.failed] == ["f"], "a request whose adapter failed is reported failed"
    assert out.failed[0].status is SeqStatus.FINISHED, "a request whose adapter failed is finished"
    assert [q.request_id for q in s.waiting] == ["p"], "a request whose adapter is loading keeps waiting"


def test_blocked_adapter_stops_later_slot_claims():
    gates = Gates({"rare": Gate.BLOCKED})
    s = _scheduler(gates)
    for seq in (_seq("rare", 2, "rare"), _seq("later", 2, "other")):
        s.add(seq)
    s.schedule()
    assert gates.calls == [("rare", True), ("later", False)], (
        "once an adapter is blocked on a slot, later requests may not claim a new adapter slot"
    )


def test_kv_slots_lowest_first_and_released_once():
    gates = Gates({})
    s = _scheduler(gates, slots=2)
    seqs = [_seq(str(i), 2) for i in range(3)]
    for seq in seqs:
        s.add(seq)
    s.schedule()
    assert [q.kv_slot for q in seqs[:2]] == [0, 1], "KV slots are handed out lowest first"
    assert seqs[2].status is SeqStatus.WAITING, "a request beyond the free KV slots waits"
    s.finish(seqs[0])
    s.finish(seqs[0])
    assert gates.released == ["0"], "finishing a sequence twice releases its adapter once"
    s.schedule()
    assert seqs[2].kv_slot == 0, "the waiting request gets the freed KV slot"


def test_overloaded_queue_refuses():
    s = _scheduler(Gates({}), max_waiting=1)
    s.add(_seq("a", 2))
    with pytest.raises(EngineOverloadedError, match="max_waiting=1"):
        s.add(_seq("b", 2))


def _weights(aid: str, rank: int) -> LoraWeights:
    return LoraWeights(
        aid,
        rank,
        frozenset({"q_proj"}),
        {"q_proj": 2.0},
        {(0, "q_proj"): torch.ones(rank, 4)},
        {(0, "q_proj"): torch.ones(6, rank)},
    )


def test_pool_refcounts_lru_and_capacity():
    now = [0.0]
    pool = AdapterPool(
        ModelShapes(1, {"q_proj": (4, 6), "v_proj": (4, 6)}),
        num_slots=2,
        max_rank=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
        clock=lambda: now[0],
    )
    s0 = pool.allocate(_weights("x", 2))
    assert pool.module_ranks == {"q_proj": [2, 0], "v_proj": [0, 0]}, "ranks per module and slot"
    row = pool.rows["q_proj"][s0]
    assert torch.equal(pool.b["q_proj"][0, row, :, :2], torch.full((6, 2), 2.0)), "scaling is folded into B"
    assert pool.b["q_proj"][0, row, :, 2:].abs().sum() == 0, "columns past the rank are zero"
    x_slot = pool.acquire("x")
    now[0] = 1.0
    pool.allocate(_weights("y", 4))
    y_slot = pool.acquire("y")
    with pytest.raises(AdapterCapacityError, match="all 2 adapter slots"):
        pool.allocate(_weights("z", 2))
    pool.release(y_slot)
    assert pool.allocate(_weights("z", 2)) != s0, "the idle y is evicted, not the referenced x"
    assert pool.slot_of("y") is None, "y left the device"
    assert pool.evict("x") is False, "a referenced adapter cannot be evicted"
    pool.release(x_slot)
    assert pool.evict("x") is True, "an unreferenced adapter can be evicted"


def test_pool_retires_a_busy_old_version_and_frees_it_with_its_last_reference():
    pool = AdapterPool(ModelShapes(1, {"q_proj": (4, 6)}), num_slots=2, max_rank=4, dtype=torch.float32,
                       device=torch.device("cpu"))
    old = _weights("x", 2)
    old_slot = pool.allocate(old)
    running = pool.acquire("x")
    pool.retire("x")
    assert pool.slot_of("x") is None, "a retired version is not found by new requests"
    new = _weights("x", 4)
    new.version = 1
    new_slot = pool.allocate(new)
    assert new_slot != old_slot, "the new version takes another slot while the old one runs"
    assert pool.version_of("x") == 1, "the id now maps to the new version"
    assert pool.module_ranks["q_proj"][old_slot] == 2, "the running sequence keeps the old weights"
    pool.acquire("x")
    assert not pool.can_allocate(), "the retired busy slot is not a victim"
    pool.release(running)
    assert pool.can_allocate(), "the retired slot is freed with its last reference"


def test_pool_reused_slot_clears_the_previous_adapters_rows():
    pool = AdapterPool(
        ModelShapes(1, {"q_proj": (4, 6)}),
        num_slots=1,
        max_rank=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    pool.allocate(_weights("big", 4))
    assert pool.evict("big"), "precondition: an unreferenced adapter can be evicted"
    row = pool.rows["q_proj"][pool.allocate(_weights("small", 2))]
    assert pool.a["q_proj"][0, row, 2:].abs().sum() == 0, "A rows of the previous adapter are cleared"
    assert pool.b["q_proj"][0, row, :, 2:].abs().sum() == 0, "B columns of the previous adapter are cleared"
    assert pool.a["q_proj"][0, row, :2].abs().sum() > 0, "the new adapter's rows are written"


def _targeting(aid: str, modules: tuple[str, ...], value: float) -> LoraWeights:
    a = {(0, m): torch.full((2, 4), value) for m in modules}
    b = {(0, m): torch.full((6, 2), value) for m in modules}
    return LoraWeights(aid, 2, frozenset(modules), dict.fromkeys(modules, 1.0), a, b)


def test_pool_gives_a_projections_rows_only_to_the_adapters_that_target_it():
    """Rows per storage unit (docs/bench_decode.md): the adapters of a projection sit in its lowest
    rows, so a batched matmul over them reads no other adapter's zero padding."""
    shapes = ModelShapes(1, {m: (4, 6) for m in ("q_proj", "k_proj", "v_proj", "o_proj")})
    pool = AdapterPool(shapes, num_slots=4, max_rank=2, dtype=torch.float32, device=torch.device("cpu"))
    qv = pool.allocate(_targeting("qv", ("q_proj", "v_proj"), 1.0))
    o1 = pool.allocate(_targeting("o1", ("o_proj",), 2.0))
    o2 = pool.allocate(_targeting("o2", ("o_proj",), 3.0))
    assert (pool.rows["o_proj"][o1], pool.rows["o_proj"][o2]) == (0, 1), "o_proj's adapters take rows 0, 1"
    assert pool.rows["o_proj"][qv] == -1, "an adapter has no row in a projection it does not target"
    assert (pool.rows["q_proj"][o1], pool.rows["q_proj"][qv]) == (-1, 0), "q/k/v rows: q/v adapters only"
    assert pool.rows["k_proj"] is pool.rows["qkv"], "the members of a fused group share the group's rows"
    assert float(pool.a["o_proj"][0, 1, 0, 0]) == 3.0, "o2's weights are in its row, not in its slot"
    assert pool.evict("o1"), "precondition: an unreferenced adapter can be evicted"
    assert pool.rows["o_proj"][o1] == -1, "an evicted adapter's rows are freed"
    o3 = pool.allocate(_targeting("o3", ("o_proj",), 4.0))
    assert pool.rows["o_proj"][o3] == 0, "the lowest free row is reused"
    assert float(pool.a["o_proj"][0, 0].abs().sum()) == 4.0 * 8, "the reused row holds only the new weights"


def test_waiting_sequences_are_admitted_by_priority_then_arrival():
    s = _scheduler(Gates({}), slots=1)
    for rid, priority in (("p2", 2), ("p0", 0), ("p1", 1), ("p0-later", 0)):
        s.add(_seq(rid, 2, priority=priority))
    out = s.schedule()
    assert _ids([q for q, _ in out.prefills]) == ["p0"], "the most urgent request is admitted first"
    assert _ids(s.waiting) == ["p0-later", "p1", "p2"], (
        "the queue stays in (priority, arrival) order: lower priority values first, arrival within one"
    )


def test_an_urgent_sequence_preempts_the_least_urgent_latest_arrival():
    gates = Gates({})
    s = _scheduler(gates, slots=3)
    a, b, c = _seq("a", 3, priority=1), _seq("b", 3, priority=5), _seq("c", 3, priority=5)
    _decoding(s, a, b, c)
    slot_of_c = c.kv_slot
    urgent = _seq("urgent", 4, priority=0)
    s.add(urgent)
    out = s.schedule()
    assert _ids(out.preempted) == ["c"], "the victim has the largest priority value, then the latest arrival"
    assert gates.released == ["c"], "the victim gives back its adapter reference"
    assert c.status is SeqStatus.WAITING, "the victim goes back to waiting"
    assert c.kv_slot is None, "the victim holds no KV slot"
    assert c.num_computed == 0, "the victim's KV cache is forgotten: it is recomputed"
    assert c.output_ids == [7], "the victim keeps the tokens it generated"
    assert c.num_preemptions == 1, "the victim counts its preemption"
    assert s.num_preemptions == 1, "the scheduler counts preemptions"
    assert urgent.kv_slot == slot_of_c, "the urgent request takes the freed KV slot"
    assert _ids(out.decodes) == ["a", "b"], "the other running requests decode as before"
    assert [(q.request_id, n) for q, n in out.prefills] == [("urgent", 4)], "the urgent request prefills"
    assert _ids(s.waiting) == ["c"], "the victim waits for a slot again"


def test_as_many_victims_as_urgent_sequences_and_victims_keep_their_place():
    s = _scheduler(Gates({}), slots=2)
    a, b = _seq("a", 3, priority=5), _seq("b", 3, priority=5)
    _decoding(s, a, b)
    late = _seq("late", 2, priority=5)
    s.add(late)
    for rid in ("u1", "u2"):
        s.add(_seq(rid, 2, priority=0))
    out = s.schedule()
    assert _ids(out.preempted) == ["b", "a"], "two urgent requests preempt two requests, latest arrival first"
    assert _ids(s.running) == ["u1", "u2"], "the urgent requests run"
    assert _ids(s.waiting) == ["a", "b", "late"], (
        "preempted requests wait in their arrival order, ahead of later arrivals of their priority"
    )


def test_no_preemption_for_an_equally_or_less_urgent_sequence():
    gates = Gates({})
    s = _scheduler(gates, slots=1)
    running = _seq("running", 3, priority=3)
    _decoding(s, running)
    for seq in (_seq("equal", 2, priority=3), _seq("lower", 2, priority=9)):
        s.add(seq)
    out = s.schedule()
    assert out.preempted == [], "nothing is preempted for a request that is not strictly more urgent"
    assert _ids(out.decodes) == ["running"], "the running request keeps decoding"
    assert gates.calls == [("running", True)], (
        "requests that cannot get a KV slot are not asked for their adapter"
    )


def test_a_sequence_whose_adapter_is_not_ready_preempts_nobody():
    s = _scheduler(Gates({"loading": Gate.PENDING}), slots=1)
    running = _seq("running", 3, priority=5)
    _decoding(s, running)
    s.add(_seq("urgent", 2, "loading", priority=0))
    out = s.schedule()
    assert out.preempted == [], "an urgent request that cannot run yet (adapter loading) evicts nobody"
    assert _ids(out.decodes) == ["running"], "the running request keeps decoding"


def test_a_preempted_sequence_recomputes_prompt_and_output_in_chunks():
    s = _scheduler(Gates({}), slots=1, budget=4)
    victim = _seq("victim", 3, priority=5)
    _decoding(s, victim)
    victim.output_ids.append(8)
    victim.num_computed += 1  # two tokens generated, the last not yet computed
    urgent = _seq("urgent", 2, priority=0)
    s.add(urgent)
    assert _ids(s.schedule().preempted) == ["victim"], "precondition: the request is preempted"
    s.finish(urgent)
    out = s.schedule()
    assert [(q.request_id, n) for q, n in out.prefills] == [("victim", 4)], (
        "re-admitted, it prefills its prompt and output again, chunked to the step budget"
    )
    victim.num_computed += 4
    out = s.schedule()
    assert _ids(out.decodes) == ["victim"], "with only its last token left, it decodes that token"


def test_the_victims_share_of_the_step_budget_goes_to_the_urgent_sequence():
    s = _scheduler(Gates({}), slots=1, budget=1)
    _decoding(s, _seq("victim", 1, priority=5))
    s.add(_seq("urgent", 3, priority=0))
    out = s.schedule()
    assert out.decodes == [], "the preempted request does not decode in this step"
    assert [(q.request_id, n) for q, n in out.prefills] == [("urgent", 1)], (
        "the token the victim would have decoded is the urgent request's prefill budget"
    )


def test_a_patient_urgent_sequence_waits_for_a_slot_until_its_patience_ends_then_preempts():
    gates = Gates({})
    now = [100.0]
    s = Scheduler(max_num_seqs=2, max_num_batched_tokens=16, max_waiting=10, acquire=gates.acquire,
                  release=gates.release, clock=lambda: now[0])
    a, b = _seq("a", 3, priority=5), _seq("b", 3, priority=5)
    _decoding(s, a, b)
    urgent = _seq("urgent", 4, priority=0)
    urgent.preempt_at = 100.25
    s.add(urgent)
    out = s.schedule()
    assert out.preempted == [], "within its patience it preempts nobody"
    assert _ids(s.waiting) == ["urgent"], "it waits for a slot"
    assert _ids(out.decodes) == ["a", "b"], "the less urgent sequences keep decoding"
    now[0] = 100.25
    out = s.schedule()
    assert _ids(out.preempted) == ["b"], "once its patience ends it preempts the least urgent, latest arrival"
    assert [(q.request_id, n) for q, n in out.prefills] == [("urgent", 4)], "and prefills in its slot"


def test_a_patient_urgent_sequence_takes_a_slot_that_frees_without_preempting():
    gates = Gates({})
    s = Scheduler(max_num_seqs=2, max_num_batched_tokens=16, max_waiting=10, acquire=gates.acquire,
                  release=gates.release, clock=lambda: 0.0)
    a, b = _seq("a", 3, priority=5), _seq("b", 3, priority=5)
    _decoding(s, a, b)
    urgent = _seq("urgent", 4, priority=0)
    urgent.preempt_at = 1.0
    s.add(urgent)
    s.schedule()
    s.finish(a)
    out = s.schedule()
    assert out.preempted == [], "a slot freed: nobody is preempted"
    assert [(q.request_id, n) for q, n in out.prefills] == [("urgent", 4)], "the urgent sequence takes it"
