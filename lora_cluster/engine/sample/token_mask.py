"""The token masks of a step's constrained rows: filled while the forward pass runs, where that is free.

Policy: `TokenMasks.start` takes the rows a step samples; when none is constrained it returns None
and the step pays nothing. Otherwise each constrained row's bitmask (V bits) is filled from its
matcher by llguidance only (native, the GIL released; no torch op, whose intra-op threads would
compete with the forward's). Where the forward pass runs on an accelerator, the CPU is free meanwhile,
so one worker thread (`executor`) fills the masks while it runs. Where the forward pass runs on the
CPU, torch's threads already take every core: a worker would only take turns with them (measured:
+10-13% step time for 8 of 32 rows on the tiny demo model, against +4% of CPU work), so with no
`executor` the masks are filled on the step thread when `apply` first needs them. `apply`
waits for it, unpacks the bits where the logits are (`allowed_tokens`: one numpy unpack on the
CPU, shifts on an accelerator) and sets the disallowed logits of those rows to -inf in place
(`mask_rows_`: three torch ops on the constrained rows only; unconstrained rows are untouched). The
engine masks the model's logits first (logprobs are those of the masked distribution), then applies
the logit controls, temperature, top-k/top-p and the greedy argmax to the masked logits.
`keep_allowed` restores the masked row when the controls left a constrained row no token at all
(e.g. `min_tokens` forbids the only token the grammar allows): the grammar wins over the controls.

Invariant: the matchers are touched by the worker only between `start` and the end of `wait`; the
step thread calls `wait` (through `apply`) before it advances them, and a failed step ends every
sequence it sampled, so their matchers are never advanced after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor, Future
from typing import Protocol

import llguidance
import numpy as np
import torch

from lora_cluster.engine.sample.guided_state import GuidedState
from lora_cluster.errors import EngineStepError

_BITS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int, width: int, device: torch.device) -> torch.Tensor:
    """The tokens a bitmask allows, as bool [rows, width] on `device`: column j < `vocab_size` is bit
    j % 32 of int32 word j // 32 of its row (llguidance's little-endian layout); the columns from
    `vocab_size` to `width` (logits padded wider than the vocabulary) are False. `bitmask` [rows,
    ceil(vocab_size / 32)] is on the CPU: for a CPU `device` numpy unpacks it in one pass
    (`unpack_bitmask_numpy`), else it is copied (V / 8 bytes a row) and unpacked by shifts on the
    device (`unpack_bitmask_torch`)."""
    words = bitmask.shape[1]
    if words * 32 < vocab_size or width < vocab_size:
        raise ValueError(f"a bitmask of {words} words and logits of width {width} cannot cover "
                         f"{vocab_size} tokens")
    if device.type == "cpu":
        return unpack_bitmask_numpy(bitmask, vocab_size, width)
    return unpack_bitmask_torch(bitmask.to(device, non_blocking=True), vocab_size, width)


def unpack_bitmask_numpy(bitmask: torch.Tensor, vocab_size: int, width: int) -> torch.Tensor:
    """`allowed_tokens` on the CPU: one `np.unpackbits` of the words' little-endian bytes."""
    packed = bitmask.numpy().astype("<i4", copy=False).view(np.uint8)
    bits = np.unpackbits(packed, axis=1, count=vocab_size, bitorder="little").view(np.bool_)
    if width > vocab_size:
        bits = np.concatenate([bits, np.zeros((bits.shape[0], width - vocab_size), dtype=np.bool_)], axis=1)
    return torch.from_numpy(bits)


def unpack_bitmask_torch(bitmask: torch.Tensor, vocab_size: int, width: int) -> torch.Tensor:
    """`allowed_tokens` where `bitmask` is (any device): each word shifted by 0..31."""
    rows = bitmask.shape[0]
    shifted = (bitmask[:, :, None] >> _BITS.to(bitmask.device)) & 1  # [rows, words, 32], little-endian
    allowed = shifted.reshape(rows, -1)[:, :vocab_size].bool()
    if width > vocab_size:
        allowed = torch.cat([allowed, allowed.new_zeros((rows, width - vocab_size))], dim=1)
    return allowed


def mask_rows_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Set to -inf, in place, the logits [N, W] of rows `rows` (int64 [k], on the CPU) that their
    bitmask rows (int32 [k, ceil(V / 32)], on the CPU) do not allow (`allowed_tokens`); the other rows
    are untouched. Three torch ops on the k rows whatever k is; returns `logits`. Runs in inference
    mode, so that the forward pass's logits (inference tensors) can be written in place."""
    allowed = allowed_tokens(bitmask, vocab_size, logits.shape[-1], logits.device)
    index = rows.to(logits.device, non_blocking=True)
    with torch.inference_mode():
        masked = torch.where(allowed, logits.index_select(0, index), float("-inf"))
        return logits.index_copy_(0, index, masked)


class GuidedRow(Protocol):
    """What the masks read of a sequence (engine.schedule.sequence.Sequence has it)."""

    guided: GuidedState | None


class TokenMasks:
    """The masks of one step's constrained rows (see the module docstring)."""

    def __init__(self, rows: list[int], matchers: list[llguidance.LLMatcher], vocab_size: int,
                 executor: Executor | None):
        self.rows, self.vocab_size = rows, vocab_size
        self._index = np.array(rows, dtype=np.int64)
        self._bitmask = np.zeros((len(rows), (vocab_size + 31) // 32), dtype=np.int32)
        self._matchers: list[llguidance.LLMatcher] | None = matchers
        self._future: Future[None] | None = None
        if executor is not None:
            self._future, self._matchers = executor.submit(self._fill, matchers), None

    @classmethod
    def start(cls, seqs: Sequence[GuidedRow], vocab_size: int,
              executor: Executor | None) -> TokenMasks | None:
        """Begin filling the masks of the constrained rows among `seqs` on `executor` (None: on the
        calling thread, at the first `wait`); None when no row is constrained."""
        rows, matchers = [], []
        for i, seq in enumerate(seqs):
            if seq.guided is None:
                continue
            if seq.guided.matcher is None:
                raise EngineStepError("a constrained sequence was scheduled before its grammar was ready")
            rows.append(i)
            matchers.append(seq.guided.matcher)
        return cls(rows, matchers, vocab_size, executor) if rows else None

    def _fill(self, matchers: list[llguidance.LLMatcher]) -> None:
        """On the worker, or the step thread without one: llguidance only (native, GIL released; no
        torch op, whose intra-op threads would compete with the forward pass's)."""
        row_bytes = self._bitmask.shape[1] * 4
        base = self._bitmask.ctypes.data
        for j, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(base + j * row_bytes, row_bytes)

    def wait(self) -> torch.Tensor:
        """The filled bitmask [constrained rows, ceil(V / 32)] (int32, on the CPU); blocks until filled
        (without an executor: fills it now, once)."""
        if self._future is not None:
            self._future.result()
        elif self._matchers is not None:
            matchers, self._matchers = self._matchers, None
            self._fill(matchers)
        return torch.from_numpy(self._bitmask)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [N, W] (W >= V: columns from V on are no token of the grammar's) with the
        constrained rows' disallowed tokens set to -inf, in place; returns `logits`. The bitmask is
        unpacked where the logits are (on a GPU, after a copy of V / 8 bytes per row)."""
        return mask_rows_(logits, self.wait(), torch.from_numpy(self._index), self.vocab_size)

    def keep_allowed(self, controlled: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """`controlled`, with each constrained row that the controls left without any finite logit
        replaced by its `masked` row."""
        if controlled is masked:
            return controlled
        index = torch.from_numpy(self._index).to(controlled.device, non_blocking=True)
        empty = torch.isneginf(controlled.index_select(0, index)).all(dim=-1)
        if not bool(empty.any()):
            return controlled
        lost = index[empty]
        return controlled.clone().index_copy_(0, lost, masked.index_select(0, lost))
