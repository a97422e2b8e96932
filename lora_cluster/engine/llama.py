"""The Llama-family forward pass over a mixed batch, with per-token LoRA from the adapter pool.

One step runs every scheduled token (prefill chunks and decodes together) through the base
weights once; each projection (or fused q/k/v, gate/up group) then adds its LoRA delta through
`engine.lora_layer` (gathered BGMV for decode rows, SGMV segments for the others), so that any mix
of adapters and base-only rows shares the pass. Attention reads the paged KV cache: decodes through
the block tables (the Triton kernel in place on CUDA, a gather + SDPA otherwise), prefill chunks
over their sequence's gathered blocks. Math follows
transformers' LlamaForCausalLM (RMSNorm in float32, rotate-half RoPE, SiLU-gated MLP), which the
parity tests use as the oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lora_kernels import LoraOps
from lora_kernels.paged_attention import gather_blocks, get_paged_attention
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lora_cluster.engine.adapters.pool import AdapterPool
from lora_cluster.engine.batch import StepBatch
from lora_cluster.engine.kv_cache import PagedKVCache
from lora_cluster.engine.lora_layer import LoraLayer
from lora_cluster.engine.model_loader import BaseModel
from lora_cluster.errors import ConfigError

_STATIC_ROPE = ("default", "linear", "llama3", "yarn", "proportional")


def rope_tables(model: BaseModel, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_len, head_dim] for every position, as transformers computes them."""
    config = model.config
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in _STATIC_ROPE:
        raise ConfigError(f"model {model.name!r}: rope_type {rope_type!r} is not supported ({_STATIC_ROPE})")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = model.dims.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scale = 1.0
    else:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    freqs = torch.arange(max_len, dtype=torch.float)[:, None] * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(device), (emb.sin() * scale).to(device)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class LlamaRunner:
    """Runs steps of one base model against the engine's KV cache and adapter pool."""

    def __init__(
        self,
        model: BaseModel,
        kv: PagedKVCache,
        pool: AdapterPool,
        ops: LoraOps,
        device: torch.device,
        *,
        fused_lora: bool = True,
    ):
        self.model, self.kv, self.pool, self.ops = model, kv, pool, ops
        self.paged_attention = get_paged_attention("triton" if ops.name == "triton" else "torch", device)
        self.cos, self.sin = rope_tables(model, kv.max_len, device)
        d = model.dims
        self._splits = {  # projection -> (fused output tensor key, column range)
            "q_proj": ("qkv", 0, d.q_dim),
            "k_proj": ("qkv", d.q_dim, d.q_dim + d.kv_dim),
            "v_proj": ("qkv", d.q_dim + d.kv_dim, d.q_dim + 2 * d.kv_dim),
            "gate_proj": ("gate_up", 0, d.intermediate),
            "up_proj": ("gate_up", d.intermediate, 2 * d.intermediate),
        }
        self.lora = LoraLayer(pool, ops, self._splits, fused_lora)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Run the step; returns float32 logits [N, vocab] of `batch.sample_rows` (followed by the
        prompt-logprob rows when `batch.logit_rows` is set)."""
        m, d = self.model, self.model.dims
        eps = d.rms_norm_eps
        h = F.embedding(batch.input_ids, m.embed)
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        for i, layer in enumerate(m.layers):
            x = _rms_norm(h, layer.input_norm, eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            self.lora.add(batch.lora, i, "qkv", qkv, x)
            q = qkv[:, : d.q_dim].view(-1, d.num_heads, d.head_dim)
            k = qkv[:, d.q_dim : d.q_dim + d.kv_dim].view(-1, d.num_kv_heads, d.head_dim)
            v = qkv[:, d.q_dim + d.kv_dim :].view(-1, d.num_kv_heads, d.head_dim)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            self.kv.write(i, batch.kv_index, k, v)
            attn = self._attention(batch, i, q).reshape(-1, d.q_dim)
            o = F.linear(attn, layer.o, layer.o_bias)
            self.lora.add(batch.lora, i, "o_proj", o, attn)
            h = h + o
            x = _rms_norm(h, layer.post_norm, eps)
            gu = F.linear(x, layer.gate_up, layer.gate_up_bias)
            self.lora.add(batch.lora, i, "gate_up", gu, x)
            act = F.silu(gu[:, : d.intermediate]) * gu[:, d.intermediate :]
            down = F.linear(act, layer.down, layer.down_bias)
            self.lora.add(batch.lora, i, "down_proj", down, act)
            h = h + down
        rows = batch.sample_rows if batch.logit_rows is None else batch.logit_rows
        last = _rms_norm(h[rows], m.norm, eps)
        return F.linear(last, m.lm_head).float()

    def _attention(self, batch: StepBatch, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, heads, head_dim] -> attention output [T, heads, head_dim]."""
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]
        out = torch.empty_like(q)
        d = batch.num_decodes
        if d:
            scale = q.shape[-1] ** -0.5
            self.paged_attention(
                out[:d], q[:d], k_cache, v_cache, batch.decode_blocks, batch.decode_lens,
                batch.decode_max_len, scale,
            )  # fmt: skip
        for p in batch.prefills:
            n, ctx = p.end - p.start, p.ctx_start + p.end - p.start
            qp = q[p.start : p.end].transpose(0, 1)[None]
            kp, vp = gather_blocks(k_cache, p.blocks[None], ctx), gather_blocks(v_cache, p.blocks[None], ctx)
            if p.ctx_start == 0:
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            else:
                mask = torch.arange(ctx, device=q.device)[None, :] <= (
                    p.ctx_start + torch.arange(n, device=q.device)[:, None]
                )
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True)
            out[p.start : p.end] = o[0].transpose(0, 1)
        return out
