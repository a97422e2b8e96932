"""Which prefill chunks an engine step carries (`replica_policy.prefill_plan`): the most urgent first, an
urgent prefill alone, less urgent chunks within a per-step share; outputs unchanged."""

from __future__ import annotations

from helpers import greedy

from lora_cluster.engine import SamplingParams
from lora_cluster.engine.sample.detokenizer import IncrementalDetokenizer
from lora_cluster.engine.schedule.scheduler import Gate, Scheduler, SchedulerOutput
from lora_cluster.engine.schedule.sequence import Sequence
from lora_cluster.request.sampling_params import SamplingParams as Params

URGENT, STANDARD, BATCH = 0, 1, 2


def _seq(rid: str, prompt_len: int, priority: int) -> Sequence:
    return Sequence(rid, None, list(range(1, prompt_len + 1)), Params(), IncrementalDetokenizer(None), None,
                    priority=priority)  # fmt: skip


def _scheduler(*, slots: int = 4, budget: int = 64, chunk: int | None = None,
               urgent: int | None = URGENT) -> Scheduler:
    return Scheduler(max_num_seqs=slots, max_num_batched_tokens=budget, max_waiting=16,
                     acquire=lambda seq, may_claim: Gate.READY, release=lambda seq: None,
                     less_urgent_chunk=chunk, urgent_priority=urgent)  # fmt: skip


def _play(out: SchedulerOutput) -> list[tuple[str, int]]:
    """Play the engine for one step: compute the planned tokens, sample one where a prompt ends.
    Returns the step's prefill chunks (request id, tokens)."""
    for seq in out.decodes:
        seq.num_computed += 1
        seq.output_ids.append(7)
    for seq, n in out.prefills:
        seq.num_computed += n
        if seq.num_computed == seq.num_tokens:
            seq.output_ids.append(7)
    return [(q.request_id, n) for q, n in out.prefills]


def test_running_prefills_get_the_budget_most_urgent_first():
    s = _scheduler(budget=8, urgent=None)
    low = _seq("low", 20, BATCH)
    s.add(low)
    assert _play(s.schedule()) == [("low", 8)], "precondition: the batch prompt starts alone"
    mid = _seq("mid", 20, STANDARD)
    s.add(mid)
    _play(s.schedule())
    assert _play(s.schedule()) == [("mid", 8)], (
        "with both prompts in flight, the more urgent one gets the step budget, though admitted later")


def test_an_urgent_prefill_runs_without_less_urgent_prefills_and_they_resume_next_step():
    s = _scheduler(budget=64)
    decoding, prompt = _seq("decoding", 4, BATCH), _seq("prompt", 40, STANDARD)
    s.add(decoding)
    _play(s.schedule())
    s.add(prompt)
    s.add(_seq("urgent", 10, URGENT))
    out = s.schedule()
    assert [q.request_id for q in out.decodes] == ["decoding"], "less urgent decodes still run"
    assert _play(out) == [("urgent", 10)], "the urgent prompt's step carries no less urgent prefill chunk"
    assert prompt in s.running, "the less urgent prompt was admitted all the same (it keeps its slot)"
    assert _play(s.schedule()) == [("prompt", 40)], "it prefills at the next step"


def test_less_urgent_prefills_share_a_bounded_number_of_tokens_per_step():
    s = _scheduler(slots=4, budget=64, chunk=6)
    s.add(_seq("standard", 20, STANDARD))
    s.add(_seq("batch", 20, BATCH))
    s.add(_seq("batch-later", 20, BATCH))
    assert _play(s.schedule()) == [("standard", 6)], (
        "less urgent prompts take at most 6 tokens of a step in all, the most urgent first")
    assert [q.request_id for q in s.waiting] == ["batch", "batch-later"], (
        "a less urgent request is not admitted without a share of the step: its slot stays free")
    s.add(_seq("urgent", 30, URGENT))
    assert _play(s.schedule()) == [("urgent", 30)], "an urgent prompt takes the whole budget it needs"
    chunks = [_play(s.schedule()) for _ in range(3)]
    assert chunks == [[("standard", 6)], [("standard", 6)], [("standard", 2), ("batch", 4)]], (
        "less urgent prompts continue 6 tokens a step, the next one admitted with what is left")


def test_without_an_urgent_priority_every_prefill_shares_the_step_as_before():
    s = _scheduler(budget=64, chunk=6, urgent=None)
    s.add(_seq("urgent", 10, URGENT))
    s.add(_seq("batch", 20, BATCH))
    assert _play(s.schedule()) == [("urgent", 10), ("batch", 20)], (
        "a bare scheduler (no urgent priority) neither bounds nor separates prefill chunks")


def test_engine_outputs_are_the_same_with_short_less_urgent_chunks(make_engine):
    engine = make_engine(max_loras=2, max_num_seqs=3, max_num_batched_tokens=32, less_urgent_prefill_chunk=3)
    prompts = ["the cat sat on the mat and looked at the quiet river for a long while",
               "once upon a time there was a small village by the sea where fishermen lived",
               "ring the bell", "a long road winds through the hills past farms and forests"]
    adapters = ["a0", None, "a1", "a0"]
    params = [greedy(6),
              SamplingParams(max_new_tokens=6, temperature=0.9, seed=5, ignore_eos=True),
              greedy(6),
              SamplingParams(max_new_tokens=6, temperature=0.9, seed=6, ignore_eos=True)]
    alone = [engine.generate([p], adapter_ids=[a], sampling=s)[0]
             for p, a, s in zip(prompts, adapters, params, strict=True)]
    together = engine.generate(prompts, adapter_ids=adapters, sampling=params,
                               priorities=[BATCH, STANDARD, URGENT, BATCH])
    for i, (a, t) in enumerate(zip(alone, together, strict=True)):
        assert t.token_ids == a.token_ids, f"request {i}: the same tokens with short chunks as alone"
    stats = engine.stats()
    assert stats.free_seq_slots == 3 and not stats.running_by_priority, "every slot is free at the end"
