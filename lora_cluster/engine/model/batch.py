"""Metadata of one engine step, built by a small pure function from the scheduler's decision.

Token order: decoding sequences (one token each) first, then prefill chunks; within each part
sequences are sorted by adapter slot (stable), each sequence's tokens kept contiguous, so that the
tokens of one adapter form one segment for the SGMV kernels and the decode rows [0, D) can take the
gathered BGMV path as one block (see `engine.model.lora_layer`).

KV: every token gets its flat index in the paged cache (`block * block_size + offset`, from its
sequence's block table in the `BlockAllocator`); decoding sequences attend together through their
block tables (`decode_blocks`, `decode_lens`); prefill chunks attend one sequence at a time over
their blocks. All index tensors come from one `StepBuffers.pack` (one host-to-device copy).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from lora_cluster.engine.model.lora_layer import StepLora, StepLoraPlan
from lora_cluster.engine.model.step_buffers import StepBuffers
from lora_cluster.engine.schedule.kv_cache import BlockAllocator
from lora_cluster.engine.schedule.sequence import Sequence


@dataclass(frozen=True)
class PrefillSpan:
    """A prefill chunk of one sequence (its prompt, or prompt + output when recomputed after a
    preemption): batch tokens [start, end) at positions [ctx_start, ctx_start + n)."""

    blocks: torch.Tensor  # the sequence's KV blocks that hold positions [0, ctx_start + n)
    start: int
    end: int
    ctx_start: int


@dataclass(frozen=True)
class StepBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    kv_index: torch.Tensor  # [T] int64, flat paged-KV index of each token (block * block_size + offset)
    lora: StepLora  # which rows take BGMV, and the segments of the others per projection / fused group
    prefills: tuple[PrefillSpan, ...]
    num_decodes: int  # D: rows [0, D) are the decoding sequences' tokens
    decode_blocks: torch.Tensor  # [D, W] int64 block table of each decoding sequence (padded with 0)
    decode_lens: torch.Tensor  # [D] int64 tokens each attends to (its own included)
    decode_max_len: int  # max(decode_lens), 0 without decodes
    sample_rows: torch.Tensor  # [N] batch token index whose logits are sampled
    sampled: tuple[Sequence, ...]  # [N] the sequence each sampled row belongs to
    # rows whose logits the forward returns: `sample_rows`, then the prompt-logprob rows (see below)
    logit_rows: torch.Tensor | None = None
    # (sequence, first prompt position, count): logits rows N.. (in this order) of prompt positions
    # whose next prompt token's logprob the sequence asked for (SamplingParams.prompt_logprobs)
    prompt_logprob_spans: tuple[tuple[Sequence, int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class _Layout:
    """The step's index lists, filled one sequence (decode or prefill chunk) at a time in batch order."""

    block_size: int
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    kv_index: list[int] = field(default_factory=list)
    lora_slots: list[int] = field(default_factory=list)
    spans: list[tuple[list[int], int, int, int]] = field(default_factory=list)  # blocks, start, end, ctx
    decode_tables: list[list[int]] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[Sequence, int, int]] = field(default_factory=list)

    def add(self, seq: Sequence, n: int, is_decode: bool, table: list[int]) -> None:
        """Tokens [num_computed, num_computed + n) of `seq`, whose KV block table is `table`."""
        bs, start, first = self.block_size, len(self.ids), seq.num_computed
        self.ids.extend(seq.token_at(i) for i in range(first, first + n))
        self.positions.extend(range(first, first + n))
        self.kv_index.extend(table[p // bs] * bs + p % bs for p in range(first, first + n))
        self.lora_slots.extend([seq.lora_slot] * n)
        if is_decode:
            self.decode_tables.append(table)
            self.decode_lens.append(first + 1)
        else:
            self.spans.append((table[: -(-(first + n) // bs)], start, start + n, first))
            lo, hi = _prompt_logprob_positions(seq, first, n)
            if hi > lo:
                self.prompt_rows.extend(range(start + lo - first, start + hi - first))
                self.prompt_spans.append((seq, lo, hi - lo))
        if first + n == seq.num_tokens:  # the chunk reaches the sequence's end: sample its next token
            self.sample_rows.append(len(self.ids) - 1)
            self.sampled.append(seq)


def build_step_batch(
    decodes: Seq[Sequence],
    prefills: Seq[tuple[Sequence, int]],
    module_ranks: dict[str, list[int]],
    device: torch.device,
    *,
    rows: dict[str, list[int]],
    kv_blocks: BlockAllocator,
    buffers: StepBuffers | None = None,
    groups: dict[str, tuple[str, ...]] | None = None,
    decode_kernel: str = "auto",
    ops_name: str = "cpu",
    dora_slots: Seq[bool] = (),
) -> StepBatch:
    """Lay out the step's tokens (see module docstring) and derive every index the forward needs.

    `rows`: the pool row of each slot per projection and group (`AdapterPool.rows`); `groups`: fused
    LoRA groups (the pool's, when the engine fuses shrinks); `decode_kernel` and
    `ops_name` (the LoRA ops implementation) choose the path of decode rows (`lora_layer.use_bgmv`);
    `dora_slots`: whether each slot holds a DoRA adapter (`AdapterPool.dora_slots`)."""
    work = [(s, 1, True) for s in decodes] + [(s, n, False) for s, n in prefills]
    work.sort(key=lambda item: (not item[2], item[0].lora_slot))
    out = _Layout(kv_blocks.block_size)
    for seq, n, is_decode in work:
        out.add(seq, n, is_decode, kv_blocks.table(seq.kv_slot))
    num_decodes = len(out.decode_lens)
    lora = StepLoraPlan(
        out.lora_slots, num_decodes, module_ranks, rows, groups or {}, decode_kernel, ops_name, dora_slots
    )
    width = max((len(t) for t in out.decode_tables), default=0)
    flat_tables = [b for t in out.decode_tables for b in (*t, *[0] * (width - len(t)))]
    lists = [out.ids, out.positions, out.kv_index, out.decode_lens, flat_tables, out.sample_rows,
             *(b for b, *_ in out.spans)]  # fmt: skip
    packed = (buffers or StepBuffers(device)).pack([*lists, *lora.lists()])
    input_ids, positions_t, kv_index_t, lens_t, tables_t, sample_t, *rest = packed
    span_blocks, lora_tensors = rest[: len(out.spans)], rest[len(out.spans) :]
    logit_rows = out.sample_rows + out.prompt_rows
    return StepBatch(
        input_ids=input_ids,
        positions=positions_t,
        kv_index=kv_index_t,
        lora=lora.build(lora_tensors),
        prefills=tuple(PrefillSpan(b, *rest) for b, (_, *rest) in zip(span_blocks, out.spans, strict=True)),
        num_decodes=num_decodes,
        decode_blocks=tables_t.view(num_decodes, width),
        decode_lens=lens_t,
        decode_max_len=max(out.decode_lens, default=0),
        sample_rows=sample_t,
        sampled=tuple(out.sampled),
        logit_rows=torch.tensor(logit_rows, dtype=torch.int64, device=device) if out.prompt_rows else None,
        prompt_logprob_spans=tuple(out.prompt_spans),
    )


def _prompt_logprob_positions(seq: Sequence, first: int, n: int) -> tuple[int, int]:
    """Positions [lo, hi) of a prefill chunk [first, first + n) whose logits give prompt-token logprobs
    the sequence still lacks (position j gives prompt token j + 1's; recomputed chunks give none)."""
    have = seq.prompt_logprobs
    if have is None:
        return 0, 0
    return max(first, len(have) - 1), min(first + n, len(seq.prompt_ids) - 1)

