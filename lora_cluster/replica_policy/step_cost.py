"""The metering rule: how one engine step's measured time is split over the sequences it ran.

A step's wall time (batch preparation to the last token taken, `Engine.step`) is device time that someone
must be charged for. It is split over the step's sequences in proportion to their *work units*:

    units = (prefill_tokens + decode_tokens) * (1 + rank / RANK_UNIT)

- `prefill_tokens`: the prompt (or recomputed) tokens the step computed for the sequence; tokens
  found in the prefix cache are not computed, so a cached token costs nothing here: the cost it
  actually had is the step in which it was first computed, charged to the request that computed it.
- `decode_tokens`: 1 for a decoding sequence.
- `rank`: the LoRA rank of the sequence's adapter (0 for the base model). A LoRA layer adds about
  `2 * rank * hidden` multiply-adds per projection to the base's `hidden * hidden`; on the demo and
  typical 7B models with ranks 8-64 the measured extra is a few percent per 16 of rank, so
  `RANK_UNIT = 256`: a rank-64 token counts 1.25 base tokens. The constant is a rule, not a
  measurement of each device; it only moves cost between the sequences of one step.

Invariant (conservation): the shares of a step sum to its measured time exactly (up to float
rounding), whatever the units; a step with no units (impossible for a non-empty step) charges its
time evenly. Nothing is lost, so per replica attributed time + idle time = busy time + idle time.
Plain Python, no torch: the engine and the simulator both call it.
"""

from __future__ import annotations

from dataclasses import dataclass

RANK_UNIT = 256  # a token of a rank-RANK_UNIT adapter counts double a base-model token


@dataclass(frozen=True)
class SeqWork:
    """What one sequence asked of one step."""

    request_id: str
    prefill_tokens: int = 0  # tokens computed in a prefill chunk (cached tokens are not computed)
    decode_tokens: int = 0  # 1 when the sequence decoded this step
    rank: int = 0  # its adapter's LoRA rank; 0 for the base model


def work_units(work: SeqWork) -> float:
    """The sequence's weight in its step (see the module docstring)."""
    return (work.prefill_tokens + work.decode_tokens) * (1.0 + work.rank / RANK_UNIT)


def split_step(elapsed_s: float, works: list[SeqWork]) -> dict[str, float]:
    """Each request's share of a step that took `elapsed_s` seconds; the shares sum to `elapsed_s`.

    A request listed twice (never, in one step) has its shares added."""
    if not works or elapsed_s <= 0.0:
        return {w.request_id: 0.0 for w in works}
    units = [work_units(w) for w in works]
    total = sum(units)
    shares: dict[str, float] = {}
    for w, u in zip(works, units, strict=True):
        share = elapsed_s * (u / total if total > 0 else 1.0 / len(works))
        shares[w.request_id] = shares.get(w.request_id, 0.0) + share
    return shares


__all__ = ["RANK_UNIT", "SeqWork", "split_step", "work_units"]
