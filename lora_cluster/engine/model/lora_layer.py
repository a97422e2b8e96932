"""The engine's LoRA layer: which kernel path each token takes, and the fused shrinks.

Per step (`StepLoraPlan`, host-side, no device reads):
* Every index handed to the ops is a row of the projection's pool tensors (`AdapterPool.rows`: the
  adapters that target a projection hold its lowest rows), -1 for tokens whose adapter does not
  target it, which the ops treat as base tokens; so each projection's segments, and the span of rows
  a batched CPU matmul reads, cover only the adapters that target it.
* Decode tokens come first in the batch (see `engine.model.batch`). When `decode_kernel` says so, they
  go through the gathered BGMV path (one launch over per-token weights instead of one matmul per
  adapter segment); the remaining rows (prefill chunks, or every row when BGMV is off) go through
  SGMV over their segments. `auto` (`use_bgmv`): BGMV with the Triton kernels, which read each
  token's weights in place, when the decode tokens' adapter runs are short; SGMV with the CPU ops,
  whose BGMV must copy the gathered weights: measured slower there for every mix, 0.6-0.7x with 32
  distinct adapters (benchmarks/bench_lora_layer.py, docs/bench_lora_layer.md). The CPU SGMV ops
  themselves run many short segments as one bmm over the pool's rows read in place
  (`lora_kernels.slot_batch`; docs/bench_decode.md).
* DoRA adapters (`adapters.dora`): when a step has DoRA rows, `StepLora.dora_slot` gives each
  token's slot, and each projection's bias-free base output is scaled per row by the pool's
  `dora[m]` (g - 1, zero for plain LoRA and base rows) before the LoRA delta is added.
* Fused groups (q/k/v, gate/up) share one shrink over stacked A (the pool stores A rank-major,
  [rank, group member, in], so the first G*r rows are ranks < r of all members): the shrink
  writes [rows, G*r] and each member's expand reads its strided column slice `h[:, j::G]`, as
  vLLM's stacked LoRA does. Ranks beyond an adapter's own are zero rows, so results are unchanged.

`LoraLayer.add` then runs the chosen ops for one projection (or fused group) of one layer; the
shrink's intermediate lives in a workspace allocated once and grown when needed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from lora_kernels import LoraMeta, LoraOps

from lora_cluster.engine.adapters.pool import AdapterPool

# auto mode: BGMV for decode tokens (Triton only) when their adapter runs average at most this many
# tokens: a 16-row SGMV tile then computes >= 14 masked rows per segment (not measured on a GPU here)
BGMV_MAX_MEAN_RUN = 2.0


def fused_shrink(setting: bool | None, ops_name: str) -> bool:
    """Whether q/k/v and gate/up share one shrink: as configured, else with the Triton kernels only
    (one launch instead of up to three; on CPU whole runs of the distinct-decode benchmark measured
    the unfused layer 3-5% faster, the fused one reading every member's rank rows for every adapter
    segment, docs/bench_decode.md)."""
    return setting if setting is not None else ops_name == "triton"


def use_bgmv(mode: str, decode_slots: Sequence[int], ops_name: str = "triton") -> bool:
    """Whether the decode tokens (slots in batch order) take the BGMV path (see the module docstring)."""
    if mode == "sgmv" or not decode_slots:
        return False
    if mode == "bgmv":
        return True
    if ops_name != "triton":
        return False
    runs = sum(1 for _ in itertools.groupby(decode_slots))
    return len(decode_slots) >= 2 and len(decode_slots) / runs <= BGMV_MAX_MEAN_RUN


@dataclass(frozen=True)
class StepLora:
    """LoRA metadata of one step: rows [0, bgmv_rows) by BGMV, rows [bgmv_rows, T) by SGMV. Its
    indices are rows of each projection's pool tensors (`AdapterPool.rows`), -1 where a token's
    adapter does not target the projection (or it has none)."""

    bgmv_rows: int
    token_row: dict[str, torch.Tensor]  # projection or group -> [bgmv_rows] pool row of each BGMV row
    bgmv_rank: dict[str, int]  # projection or group -> width of its BGMV shrink (0 = skip)
    metas: dict[str, LoraMeta]  # projection or group -> segments of rows [bgmv_rows, T) (pool rows)
    # DoRA: each token's slot, or num_slots (a zero row) for tokens of other adapters or none; None
    # when no token of the step has a DoRA adapter
    dora_slot: torch.Tensor | None = None


def seg_ranks(key: str, seg_slots: Sequence[int], module_ranks: dict[str, list[int]],
              groups: dict[str, tuple[str, ...]]) -> list[int]:  # fmt: skip
    """Rank of each segment for a projection, or for a fused group: G x its members' largest rank."""
    if key in groups:
        members = groups[key]
        return [len(members) * max(module_ranks[m][s] for m in members) if s >= 0 else 0 for s in seg_slots]
    ranks = module_ranks[key]
    return [ranks[s] if s >= 0 else 0 for s in seg_slots]


def runs_of(slots: Sequence[int]) -> tuple[list[int], list[int]]:
    """Maximal runs of equal slot: (slot of each run, its length)."""
    pairs = [(s, sum(1 for _ in g)) for s, g in itertools.groupby(slots)]
    return [s for s, _ in pairs], [n for _, n in pairs]


def pool_rows(slots: Sequence[int], ranks: Sequence[int], rows: Sequence[int]) -> list[int]:
    """The pool row of each slot for one projection (`rows`: slot -> row), -1 where its rank is 0."""
    return [rows[s] if r else -1 for s, r in zip(slots, ranks, strict=True)]


class StepLoraPlan:
    """The host side of a step's `StepLora`: its index lists (`lists`, packed by the caller into
    device tensors) and `build`, which wraps the packed tensors. `rows` maps each projection and
    group to the pool row of each slot (`AdapterPool.rows`)."""

    def __init__(self, token_slots: Sequence[int], num_decodes: int, module_ranks: dict[str, list[int]],
                 rows: dict[str, list[int]], groups: dict[str, tuple[str, ...]], mode: str,
                 ops_name: str = "triton", dora_slots: Sequence[bool] = ()):  # fmt: skip
        dora = {s for s in set(token_slots) if s >= 0 and s < len(dora_slots) and dora_slots[s]}
        none = len(dora_slots)
        self.dora_slot = [s if s in dora else none for s in token_slots] if dora else None
        d = num_decodes if use_bgmv(mode, token_slots[:num_decodes], ops_name) else 0
        self.bgmv_rows = d
        bgmv_slots, rest = list(token_slots[:d]), list(token_slots[d:])
        self.keys = [*module_ranks, *groups]
        used = sorted({s for s in bgmv_slots if s >= 0})
        self.bgmv_rank = {k: max(seg_ranks(k, used, module_ranks, groups), default=0) for k in self.keys}
        self.token_row = {
            k: pool_rows(bgmv_slots, seg_ranks(k, bgmv_slots, module_ranks, groups), rows[k])
            for k in self.keys
        }
        seg_slot, self.seg_len = runs_of(rest)
        self.indptr = [0, *itertools.accumulate(self.seg_len)]
        self.ranks = {k: seg_ranks(k, seg_slot, module_ranks, groups) for k in self.keys}
        self.seg_row = {k: pool_rows(seg_slot, self.ranks[k], rows[k]) for k in self.keys}

    def lists(self) -> list[list[int]]:
        dora = [self.dora_slot] if self.dora_slot is not None else []
        return [*self.token_row.values(), self.indptr, *self.seg_row.values(), *self.ranks.values(), *dora]

    def build(self, tensors: Sequence[torch.Tensor]) -> StepLora:
        n = len(self.keys)
        token_row, indptr = tensors[:n], tensors[n]
        seg_row, ranks = tensors[n + 1 : 2 * n + 1], tensors[2 * n + 1 : 3 * n + 1]
        dora_slot = tensors[3 * n + 1] if self.dora_slot is not None else None
        common = {
            "seg_indptr": indptr, "seg_indptr_list": tuple(self.indptr), "seg_len_list": tuple(self.seg_len),
            "max_seg_len": max(self.seg_len, default=0),
        }  # fmt: skip
        metas = {
            k: LoraMeta(seg_slot=seg_row[i], seg_slot_list=tuple(self.seg_row[k]),
                        seg_rank=ranks[i], seg_rank_list=tuple(self.ranks[k]),
                        max_rank=max(self.ranks[k], default=0), **common)
            for i, k in enumerate(self.keys)
        }  # fmt: skip
        token_rows = dict(zip(self.keys, token_row, strict=True))
        return StepLora(self.bgmv_rows, token_rows, self.bgmv_rank, metas, dora_slot)


class LoraLayer:
    """Adds the LoRA deltas of a step (see the module docstring)."""

    def __init__(self, pool: AdapterPool, ops: LoraOps, splits: dict[str, tuple[str, int, int]], fused: bool):
        self.pool, self.ops = pool, ops
        self.groups = pool.groups if fused else {}
        # fused output key ("qkv", "gate_up") -> [(member, column range)] in output column order
        self.members: dict[str, list[tuple[str, int, int]]] = {}
        for m, (key, lo, hi) in splits.items():
            self.members.setdefault(key, []).append((m, lo, hi))
        self._work = torch.empty(0)
        # per-layer views of the pool's tensors, made once (they never move: see AdapterPool)
        self._a = {m: t.unbind(0) for m, t in pool.a.items()}
        self._b = {m: t.unbind(0) for m, t in pool.b.items()}
        self._a_fused = {g: t.unbind(0) for g, t in pool.a_fused.items()}

    def _buffer(self, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        """A [rows, cols] view of the workspace: float32 for triton (its shrink accumulates and stores
        float32, as its add_lora does), else `like`'s dtype (BLAS `out=` needs one dtype)."""
        dtype = torch.float32 if self.ops.name == "triton" else like.dtype
        work = self._work
        if work.numel() < rows * cols or work.dtype != dtype or work.device != like.device:
            size = max(rows * cols, 2 * work.numel())
            work = self._work = torch.empty(size, dtype=dtype, device=like.device)
        return work[: rows * cols].view(rows, cols)

    def add(self, step: StepLora, layer: int, key: str, out: torch.Tensor, x: torch.Tensor,
            bias: torch.Tensor | None = None) -> None:  # fmt: skip
        """out += LoRA(x) for projection `key` ("o_proj", "down_proj") or fused output `key` ("qkv",
        "gate_up", whose members write their column ranges of `out`). `out` holds the base output
        plus `bias` (the projection's, or None): DoRA rows first scale their bias-free base output
        (`adapters.dora`), then every row adds its (for DoRA, row-scaled) LoRA delta."""
        if step.dora_slot is not None:
            for m, lo, hi in self.members.get(key, [(key, 0, out.shape[1])]):
                base = out[:, lo:hi] if bias is None else out[:, lo:hi] - bias[lo:hi]
                out[:, lo:hi] += self.pool.dora[m][layer][step.dora_slot] * base
        if key in self.groups:
            self._fused(step, layer, key, out, x)
            return
        for m, lo, hi in self.members.get(key, [(key, 0, out.shape[1])]):
            self._single(step, layer, m, out[:, lo:hi], x)

    def _single(self, step: StepLora, layer: int, m: str, out: torch.Tensor, x: torch.Tensor) -> None:
        a, b = self._a[m][layer], self._b[m][layer]
        d = step.bgmv_rows
        r = step.bgmv_rank.get(m, 0)
        if r:
            h = self._buffer(d, r, x)
            self.ops.bgmv_shrink(h, x[:d], a, step.token_row[m])
            self.ops.bgmv_expand(out[:d], h, b, step.token_row[m], add=True)
        meta = step.metas[m]
        if meta.max_rank:
            self.ops.add_lora(out[d:] if d else out, x[d:] if d else x, a, b, meta)

    def _fused(self, step: StepLora, layer: int, g: str, out: torch.Tensor, x: torch.Tensor) -> None:
        members, n = self.members[g], len(self.members[g])
        a = self._a_fused[g][layer]
        d = step.bgmv_rows
        width = step.bgmv_rank.get(g, 0)
        if width:
            h = self._buffer(d, width, x)
            self.ops.bgmv_shrink(h, x[:d], a, step.token_row[g])
            for j, (m, lo, hi) in enumerate(members):
                if step.bgmv_rank[m]:
                    b = self._b[m][layer]
                    self.ops.bgmv_expand(out[:d, lo:hi], h[:, j::n], b, step.token_row[m])
        meta = step.metas[g]
        if meta.max_rank:
            h = self._buffer(x.shape[0] - d, meta.max_rank, x)
            self.ops.sgmv_shrink(h, x[d:], a, meta)
            for j, (m, lo, hi) in enumerate(members):
                if step.metas[m].max_rank:
                    self.ops.sgmv_expand(out[d:, lo:hi], h[:, j::n], self._b[m][layer], step.metas[m])
