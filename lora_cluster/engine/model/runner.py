"""One engine step on the model: the step's batch, the decoder forward pass over it, with per-token
LoRA from the adapter pool, and the sample room's pipeline on its logits; one runner for every
family, following the model's `FamilySpec` (`engine.model.family`).

`prepare` lays out the scheduler's decision as a `StepBatch` (`engine.model.batch`); `run` starts the
constrained rows' masks, runs `forward` and samples (`engine.sample.pipeline`).

One step runs every scheduled token (prefill chunks and decodes together) through the base
weights once; each projection (or fused q/k/v, gate/up group) then adds its LoRA delta through
`engine.model.lora_layer` (gathered BGMV for decode rows, SGMV segments for the others), so that any mix
of adapters and base-only rows shares the pass. Attention reads the paged KV cache
(`engine.model.attention`, with each layer's sliding window and soft-cap). What a family changes is
data in its spec: which norms a layer applies (before/after attention and MLP), q/k norms, the
embedding, residual, score and logit scales, soft-capping, each layer's window and rope table (or
none), the MLP activation, and a mixture-of-experts block in place of the MLP (`engine.model.moe`).
Math follows transformers' modeling code of each family (RMSNorm in float32, rotate-half RoPE,
gated MLP), which the parity tests use as the oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lora_kernels import LoraOps
from lora_kernels.moe_experts import ExpertLora, get_moe_experts
from lora_kernels.paged_attention import get_paged_attention

from lora_cluster.engine.adapters.pool import AdapterPool
from lora_cluster.engine.model.attention import layer_attention
from lora_cluster.engine.model.base_model import BaseModel, LayerWeights
from lora_cluster.engine.model.batch import StepBatch, build_step_batch
from lora_cluster.engine.model.family import FamilySpec
from lora_cluster.engine.model.lora_layer import LoraLayer, StepLora
from lora_cluster.engine.model.moe import moe_block
from lora_cluster.engine.model.rope import rope_tables, rotate
from lora_cluster.engine.model.step_buffers import StepBuffers
from lora_cluster.engine.sample.pipeline import SampledTokens, StepSampler
from lora_cluster.engine.schedule.kv_cache import BlockAllocator, PagedKVCache
from lora_cluster.engine.schedule.scheduler import SchedulerOutput

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, spec: FamilySpec) -> torch.Tensor:
    """RMSNorm over the last dim in float32, scaled by `weight + spec.norm_offset`; the weight is
    applied after the cast back to x's dtype (Llama) or before it (`norm_weight_in_float32`)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if spec.norm_weight_in_float32:
        return (h * (weight.float() + spec.norm_offset)).to(dtype)
    return (weight + spec.norm_offset) * h.to(dtype) if spec.norm_offset else weight * h.to(dtype)


class ModelRunner:
    """Runs steps of one base model against the engine's KV cache and adapter pool.

    `lora` (the LoRA layer over the pool, with `ops`), `kv_blocks` (the scheduler's block tables),
    `buffers` (the step's index tensors) and `sampler` are the caller's; `decode_kernel` chooses the
    decode rows' LoRA path (`lora_layer.use_bgmv`)."""

    def __init__(
        self,
        model: BaseModel,
        kv: PagedKVCache,
        pool: AdapterPool,
        ops: LoraOps,
        device: torch.device,
        *,
        lora: LoraLayer,
        sampler: StepSampler,
        kv_blocks: BlockAllocator,
        buffers: StepBuffers,
        decode_kernel: str = "auto",
    ):
        self.model, self.kv, self.pool, self.ops, self.device = model, kv, pool, ops, device
        self.lora, self.sampler, self.kv_blocks, self.buffers = lora, sampler, kv_blocks, buffers
        self.decode_kernel = decode_kernel
        self.paged_attention = get_paged_attention("triton" if ops.name == "triton" else "torch", device)
        self.moe_experts = get_moe_experts("triton" if ops.name == "triton" else "torch", device)
        self.spec = spec = model.spec
        self.ropes = rope_tables(model.text_config, spec.ropes, kv.max_len, device, model.embed.dtype)
        self.act = _ACTIVATIONS[spec.activation]
        self.scale = spec.attn_scale or model.dims.head_dim**-0.5
        # the embedding scale in the weights' dtype, as transformers multiplies it
        self.embed_scale = torch.tensor(spec.embed_scale, dtype=model.embed.dtype, device=device)

    def prepare(self, plan: SchedulerOutput) -> StepBatch:
        """The batch of the scheduler's decision `plan` (decodes and prefill chunks)."""
        return build_step_batch(
            plan.decodes, plan.prefills, self.pool.module_ranks, self.device, rows=self.pool.rows,
            kv_blocks=self.kv_blocks, buffers=self.buffers, groups=self.lora.groups,
            decode_kernel=self.decode_kernel, ops_name=self.ops.name, dora_slots=self.pool.dora_slots,
        )  # fmt: skip

    def run(self, batch: StepBatch) -> SampledTokens:
        """Run the step's forward pass and sample each of `batch.sampled`'s next token (their prompt
        logprobs recorded on the way)."""
        masks = self.sampler.start_masks(batch.sampled)
        logits = self.forward(batch)
        return self.sampler.sample(logits, batch.sampled, masks, batch.prompt_logprob_spans)

    def close(self) -> None:
        self.sampler.close()

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Run the step; returns float32 logits [N, vocab] of `batch.sample_rows` (followed by the
        prompt-logprob rows when `batch.logit_rows` is set)."""
        m, d, spec = self.model, self.model.dims, self.spec
        eps = d.rms_norm_eps

        def norm(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
            return x if weight is None else rms_norm(x, weight, eps, spec)

        h = F.embedding(batch.input_ids, m.embed)
        if spec.embed_scale != 1.0:
            h = h * self.embed_scale
        tables = {key: (cos[batch.positions], sin[batch.positions]) for key, (cos, sin) in self.ropes.items()}
        expert_rows = self._expert_rows(batch.lora) if self.pool.expert_a else None
        for i, layer in enumerate(m.layers):
            ls = spec.layers[i]
            x = norm(h, layer.pre_attn_norm)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            self.lora.add(batch.lora, i, "qkv", qkv, x, layer.qkv_bias)
            q, k = qkv[:, : d.q_dim], qkv[:, d.q_dim : d.q_dim + d.kv_dim]
            if spec.qk_norm == "all":
                q, k = norm(q, layer.q_norm), norm(k, layer.k_norm)
            q, k = q.reshape(-1, d.num_heads, d.head_dim), k.reshape(-1, d.num_kv_heads, d.head_dim)
            v = qkv[:, d.q_dim + d.kv_dim :].view(-1, d.num_kv_heads, d.head_dim)
            if spec.qk_norm == "head":
                q, k = norm(q, layer.q_norm), norm(k, layer.k_norm)
            if ls.rope is not None:
                cos, sin = tables[ls.rope]
                q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            self.kv.write(i, batch.kv_index, k, v)
            attn = layer_attention(
                batch, self.paged_attention, self.kv.k[i], self.kv.v[i], q, scale=self.scale,
                window=ls.window, softcap=spec.attn_softcap,
            ).reshape(-1, d.q_dim)  # fmt: skip
            o = F.linear(attn, layer.o, layer.o_bias)
            self.lora.add(batch.lora, i, "o_proj", o, attn, layer.o_bias)
            h = self._residual(h, norm(o, layer.post_attn_norm))
            x = norm(h, layer.pre_mlp_norm)
            down = self._mlp(batch, i, layer, x, expert_rows)
            h = self._residual(h, norm(down, layer.post_mlp_norm))
        rows = batch.sample_rows if batch.logit_rows is None else batch.logit_rows
        logits = F.linear(norm(h[rows], m.norm), m.lm_head)
        if spec.logits_divisor != 1.0:
            logits = logits / spec.logits_divisor
        if spec.final_softcap:
            logits = torch.tanh(logits / spec.final_softcap) * spec.final_softcap
        return logits.float()

    def _expert_rows(self, step: StepLora) -> tuple[torch.Tensor, int] | None:
        """The step's LoRA on the experts: each token's row in the pool's expert tensors (-1: none)
        and the largest expert rank among them; None when no token's adapter targets the experts.
        Both expert projections share one row per adapter (the pool's unit "experts")."""
        keys = [k for k in self.pool.expert_a if step.bgmv_rank.get(k) or step.metas[k].max_rank]
        if not keys:
            return None
        rank = max(max(step.bgmv_rank.get(k, 0), step.metas[k].max_rank) for k in keys)
        per_key = [torch.cat([step.token_row[k][: step.bgmv_rows], step.metas[k].token_slot]) for k in keys]
        rows = per_key[0] if len(per_key) == 1 else torch.maximum(*per_key)
        return rows, rank

    def _mlp(self, batch: StepBatch, i: int, layer: LayerWeights, x: torch.Tensor,
             expert_rows: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:  # fmt: skip
        """Layer i's MLP on x [T, hidden]: the MoE block (`engine.model.moe`) with the LoRA of each token's
        adapter on its chosen experts (`expert_rows`), else the gated MLP with its LoRA deltas."""
        if layer.moe is not None and self.spec.moe is not None:
            lora = None
            if expert_rows is not None:
                a, b = self.pool.expert_a, self.pool.expert_b
                gu, dn = "experts.gate_up_proj", "experts.down_proj"
                lora = ExpertLora(expert_rows[0], a[gu][i], b[gu][i], a[dn][i], b[dn][i], expert_rows[1])
            return moe_block(x, layer.moe, self.spec.moe, self.act, self.moe_experts, lora)
        inter = self.model.dims.intermediate
        gu = F.linear(x, layer.gate_up, layer.gate_up_bias)
        self.lora.add(batch.lora, i, "gate_up", gu, x, layer.gate_up_bias)
        act = self.act(gu[:, :inter]) * gu[:, inter:]
        down = F.linear(act, layer.down, layer.down_bias)
        self.lora.add(batch.lora, i, "down_proj", down, act, layer.down_bias)
        return down

    def _residual(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """h + out, the block's output scaled by the family's residual multiplier (Granite)."""
        return h + out * self.spec.residual_scale if self.spec.residual_scale != 1.0 else h + out
