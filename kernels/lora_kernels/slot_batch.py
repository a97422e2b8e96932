"""Slot-batched CPU LoRA: one batched matmul over the pool's slots, read in place, instead of a
Python loop over adapter segments.

When a batch holds many short segments (a decode step of many distinct adapters), the per-segment
loop of :mod:`lora_kernels.cpu` pays two BLAS calls of Python and dispatch (~7 us measured) per
segment and projection, far more than the matvec itself. Here the tokens are laid out by slot
instead: the span of slots the batch uses, ``[lo, lo + span)``, is a contiguous slice of the pool
(``lora_a[lo : lo + span]``), so one ``bmm`` per shrink or expand reads each slot's weights where
they lie (no gathered copy, unlike the CPU BGMV). Token ``t`` of slot ``s`` sits at row ``k`` of
batch entry ``s - lo`` of a zero-padded [span, depth, K] input, ``k`` counting the tokens of ``s``
before it and ``depth`` the most tokens any slot has.

Costs and the policy (:func:`use_slot_batch`): the bmm reads the whole span's weights at the
op's full width, also slots no token uses (and rank rows past an adapter's own, zero in the pool,
so results are unchanged), and computes ``span * depth`` rows; the loop reads only each segment's
own rank rows but pays Python and dispatch per segment. The engine's pool gives each projection's
rows only to the adapters that target it (``AdapterPool.rows``, passed here as the "slots"), so a
span does not cover adapters that skip the projection. Measured in the engine on the
distinct-decode step (docs/bench_decode.md): a decode step's LoRA is bound by streaming the
weights from memory and by the per-op gathers, scatters and Python around them; the bmm is faster
than the loop (~20x its calls), most on two threads (it splits the batch over threads; the loop's
small matmuls run on one). The policy takes it when segments are
many and short, the layout dense: at least ``MIN_SEGMENTS`` adapter segments with a non-zero rank,
at most ``MAX_MEAN_RUN`` tokens per segment (longer runs: the loop's matmuls get rows to amortise
their calls, measured as fast from 4 on), at most ``MAX_SPAN_PER_SEGMENT`` slots read per such
segment and ``MAX_PAD_PER_TOKEN`` padded rows per adapter token.

Invariant relied on: a slot's rows beyond its rank (and of projections it does not target) are
zero, as the engine's pool keeps them and as :mod:`lora_kernels.reference` assumes. Rows of slots
that no token uses are read but never written back, so their content does not matter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from .meta import LoraMeta

__all__ = [
    "MAX_MEAN_RUN", "MAX_PAD_PER_TOKEN", "MAX_SPAN_PER_SEGMENT", "MIN_SEGMENTS", "SlotBatch", "add_lora",
    "decode_like", "expand", "shrink", "slot_batch", "use_slot_batch",
]  # fmt: skip

MIN_SEGMENTS = 4  # fewer adapter segments: the loop's few calls cost no more than the batched one
MAX_MEAN_RUN = 2.0  # tokens per adapter segment
MAX_SPAN_PER_SEGMENT = 4.0  # slots read per adapter segment with a non-zero rank
MAX_PAD_PER_TOKEN = 2.0  # padded rows (span * depth) per adapter token


@dataclass(frozen=True)
class SlotBatch:
    """Where a batch's adapter tokens sit in the [span, depth] slot layout (see the module docstring).

    ``rows`` [n] are the batch rows of the adapter tokens (slot >= 0) and ``pos`` [n] their flat
    index ``(slot - lo) * depth + k`` in the layout; both None when the layout is the batch itself
    (every row an adapter token, row ``i`` of slot ``lo + i``): then no copy is made at all. When
    the layout is dense (every position holds a token: ``span * depth == n``), ``pos`` is None and
    ``rows`` lists the batch row at each position, so the padded input is one gather and results
    come back in ``rows`` order without a reordering copy. ``row_range`` is (first, end) when
    ``rows`` are consecutive ascending rows (the engine puts base rows, slot -1, first), so that
    results are written through a slice instead of a scatter.
    """

    lo: int
    span: int
    depth: int
    num_tokens: int  # adapter tokens (slot >= 0)
    rows: Tensor | None
    pos: Tensor | None
    row_range: tuple[int, int] | None = None


@functools.lru_cache(maxsize=32)  # one entry per (step, device): the projections of a step share it
def _layout(seg_slot: tuple[int, ...], seg_len: tuple[int, ...], device: torch.device) -> SlotBatch | None:
    used = [s for s in seg_slot if s >= 0]
    if not used:
        return None
    lo, span = min(used), max(used) - min(used) + 1
    if len(used) == len(seg_slot) == span and max(seg_len) == 1 and seg_slot == tuple(range(lo, lo + span)):
        return SlotBatch(lo, span, 1, span, None, None)
    filled = [0] * span  # tokens of each slot placed so far
    rows: list[int] = []
    slot_of_row: list[int] = []
    start = 0
    for s, n in zip(seg_slot, seg_len, strict=True):
        if s >= 0:
            rows.extend(range(start, start + n))
            slot_of_row.extend([s - lo] * n)
        start += n
    ks = []
    for i in slot_of_row:
        ks.append(filled[i])
        filled[i] += 1
    depth = max(filled)
    pos: list[int] | None = [i * depth + k for i, k in zip(slot_of_row, ks, strict=True)]
    if span * depth == len(rows):  # dense: list the rows by position instead
        by_pos = [0] * len(rows)
        for r, p in zip(rows, pos, strict=True):
            by_pos[p] = r
        rows, pos = by_pos, None
    as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    row_range = (rows[0], rows[0] + len(rows)) if rows == list(range(rows[0], rows[0] + len(rows))) else None
    pos_t = None if pos is None else as_tensor(pos)
    return SlotBatch(lo, span, depth, len(rows), as_tensor(rows), pos_t, row_range)


def slot_batch(meta: LoraMeta, device: torch.device) -> SlotBatch | None:
    """The slot layout of ``meta``'s adapter tokens on ``device``; None when no token has an adapter.
    Host-side only (``meta``'s tuples); cached, so the projections of one step build it once."""
    return _layout(meta.seg_slot_list, meta.seg_len_list, torch.device(device))


def _active(meta: LoraMeta) -> int | None:
    """Adapter segments with a non-zero rank for this op when they are many and short (at least
    ``MIN_SEGMENTS``, at most ``MAX_MEAN_RUN`` tokens each on average), else None."""
    active = tokens = 0
    for s, r, n in zip(meta.seg_slot_list, meta.seg_rank_list, meta.seg_len_list, strict=True):
        if s >= 0 and r:
            active, tokens = active + 1, tokens + n
    return active if active >= MIN_SEGMENTS and tokens <= MAX_MEAN_RUN * active else None


def decode_like(meta: LoraMeta) -> bool:
    """Many short adapter segments: the part of the policy that does not depend on the layout (the
    native kernel, which reads no padding, takes such batches whatever their span)."""
    return _active(meta) is not None


def use_slot_batch(meta: LoraMeta, sb: SlotBatch | None) -> bool:
    """Whether the batched path runs for ``meta`` (the policy of the module docstring)."""
    active = None if sb is None else _active(meta)
    return (
        active is not None
        and sb.span <= MAX_SPAN_PER_SEGMENT * active
        and sb.span * sb.depth <= MAX_PAD_PER_TOKEN * sb.num_tokens
    )


def _padded(sb: SlotBatch, v: Tensor) -> Tensor:
    """[span, depth, C] contiguous layout of the adapter rows of ``v`` [T, C] (``v`` itself when the
    layout is the batch and ``v`` is contiguous: a strided operand would send ``bmm`` to a per-batch
    loop of small matmuls, several times slower)."""
    if sb.rows is None:
        return v.contiguous().unsqueeze(1)
    if sb.pos is None:  # dense
        if sb.row_range:
            return v[sb.row_range[0] : sb.row_range[1]].contiguous().view(sb.span, sb.depth, v.shape[1])
        return v.index_select(0, sb.rows).view(sb.span, sb.depth, v.shape[1])
    padded = v.new_zeros(sb.span * sb.depth, v.shape[1])
    src = v[sb.row_range[0] : sb.row_range[1]] if sb.row_range else v.index_select(0, sb.rows)
    padded.index_copy_(0, sb.pos, src)
    return padded.view(sb.span, sb.depth, v.shape[1])


def _write(out: Tensor, sb: SlotBatch, d: Tensor, add: bool) -> None:
    """out[rows] (+)= d [n, C] (rows in ``sb.rows`` order); other rows untouched. Through a slice
    when the rows are consecutive; else a scatter into zeros and one add (index_add_ on CPU scatters
    row by row, measured ~10x slower)."""
    if sb.row_range is not None or sb.rows is None:
        o = out if sb.rows is None else out[sb.row_range[0] : sb.row_range[1]]
        if add:
            o.add_(d)
        else:
            o.copy_(d)
    elif add:
        out.add_(d.new_zeros(out.shape).index_copy_(0, sb.rows, d))
    else:
        out.index_copy_(0, sb.rows, d)


def _unpadded(sb: SlotBatch, p: Tensor) -> Tensor:
    """[n, C] rows of the layout ``p`` [span, depth, C] of the adapter tokens, in ``sb.rows`` order."""
    flat = p.view(sb.span * sb.depth, p.shape[2])
    return flat if sb.pos is None else flat.index_select(0, sb.pos)


def shrink(out: Tensor, x: Tensor, lora_a: Tensor, sb: SlotBatch, scale: float = 1.0) -> None:
    """out[T, R_out] = scale * x[T, K] @ lora_a[s, :R_out].T for the adapter rows; other rows = 0."""
    r_out = out.shape[1]
    w = lora_a[sb.lo : sb.lo + sb.span, :r_out].mT  # [span, K, R_out] view of the pool
    if sb.rows is None and out.is_contiguous():
        torch.bmm(_padded(sb, x), w, out=out.unsqueeze(1))
    else:
        if sb.rows is not None:
            out.zero_()
        _write(out, sb, _unpadded(sb, torch.bmm(_padded(sb, x), w)), add=False)
    if scale != 1.0:
        out.mul_(scale)


def expand(out: Tensor, y: Tensor, lora_b: Tensor, sb: SlotBatch, add: bool = True) -> None:
    """out[T, N] (+)= y[T, R_in] @ lora_b[s, :, :R_in].T for the adapter rows; other rows untouched."""
    r_in = min(y.shape[1], lora_b.shape[2])
    w = lora_b.mT[sb.lo : sb.lo + sb.span, :r_in]  # [span, R_in, N] view of the pool
    ys = y if r_in == y.shape[1] else y[:, :r_in]
    _write(out, sb, _unpadded(sb, torch.bmm(_padded(sb, ys), w)), add)


def add_lora(out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, sb: SlotBatch, max_rank: int) -> None:
    """out[T, N] += (x @ lora_a[s, :max_rank].T) @ lora_b[s, :, :max_rank].T for the adapter rows."""
    a = lora_a[sb.lo : sb.lo + sb.span, :max_rank].mT  # [span, K, r]
    b = lora_b.mT[sb.lo : sb.lo + sb.span, :max_rank]  # [span, r, N]
    _write(out, sb, _unpadded(sb, torch.bmm(torch.bmm(_padded(sb, x), a), b)), add=True)

