"""A checkpoint's tensors, taken into the engine's layout one layer at a time.

`Checkpoint` holds the weights read from a model's safetensors and hands each one over once (`take`
pops it, converted to the engine's device and dtype), so that the loader keeps no second copy. A
layer lands in one layout whatever the checkpoint's: q/k/v fused as `qkv` and gate/up as `gate_up`
(concatenated from separate projections, or taken as they are from a checkpoint that stores
`qkv_proj` / `gate_up_proj`); a mixture-of-experts layer's router and experts land in
`MoeWeights` (experts stacked: gate/up [E, 2I, hidden], down [E, hidden, I]) from the per-expert
names (`experts.{e}.w1/w3/w2` under `block_sparse_moe` for Mixtral,
`experts.{e}.gate_proj/up_proj/down_proj` for Qwen3-MoE) or transformers' stacked
`experts.gate_up_proj` / `down_proj`. A missing weight the family needs is a `ConfigError` naming it.
"""

from __future__ import annotations

import torch

from lora_cluster.engine.model.base_model import LayerWeights, ModelDims
from lora_cluster.engine.model.family import FamilySpec
from lora_cluster.engine.model.moe import MoeWeights
from lora_cluster.engine.model.moe_spec import MoeSpec
from lora_cluster.errors import ConfigError

# where the decoder's weights sit: `model.` for a causal LM; a multimodal checkpoint's text decoder
# under `language_model.model.` (as saved) or `model.language_model.` (its other tools' names)
DECODER_PREFIXES = ("model", "language_model.model", "model.language_model")


class Checkpoint:
    """The weights of model `name` (see the module docstring), for a family `spec` of size `dims`."""

    def __init__(self, name: str, weights: dict[str, torch.Tensor], spec: FamilySpec, dims: ModelDims, *,
                 dtype: torch.dtype, device: torch.device):
        self.name, self.spec, self.dims = name, spec, dims
        self._w, self._dtype, self._device = weights, dtype, device
        self.base = next((b for b in DECODER_PREFIXES if f"{b}.embed_tokens.weight" in weights), "model")

    def take(self, name: str) -> torch.Tensor | None:
        """The tensor `name` on the engine's device and dtype (None: absent); it leaves the checkpoint."""
        t = self._w.pop(name, None)
        return None if t is None else t.to(device=self._device, dtype=self._dtype)

    def need(self, name: str) -> torch.Tensor:
        t = self.take(name)
        if t is None:
            raise ConfigError(f"model {self.name!r}: weight {name!r} is missing from the checkpoint")
        return t

    def layer(self, i: int) -> LayerWeights:
        """Layer i's weights in the engine's layout."""
        spec, p = self.spec, f"{self.base}.layers.{i}"
        qkv, qkv_bias, gate_up, gate_up_bias = self._projections(p)
        moe = self._experts(p, spec.moe) if spec.moe else None
        if qkv is None or (gate_up is None and moe is None):
            raise ConfigError(f"model {self.name!r}: layer {i} lacks attention or MLP projections")
        qk = (lambda n: self.need(f"{p}.self_attn.{n}.weight")) if spec.qk_norm else (lambda n: None)
        return LayerWeights(
            pre_attn_norm=self._norm(p, spec.norms.pre_attn),
            qkv=qkv,
            qkv_bias=qkv_bias,
            o=self.need(f"{p}.self_attn.o_proj.weight"),
            o_bias=self.take(f"{p}.self_attn.o_proj.bias"),
            post_attn_norm=self._norm(p, spec.norms.post_attn),
            pre_mlp_norm=self._norm(p, spec.norms.pre_mlp),
            gate_up=gate_up,
            gate_up_bias=gate_up_bias,
            down=None if moe else self.need(f"{p}.mlp.down_proj.weight"),
            down_bias=self.take(f"{p}.mlp.down_proj.bias"),
            post_mlp_norm=self._norm(p, spec.norms.post_mlp),
            q_norm=qk("q_norm"),
            k_norm=qk("k_norm"),
            moe=moe,
        )

    def lm_head(self, embed: torch.Tensor, tied: bool) -> torch.Tensor:
        """The output projection: the checkpoint's, else the embedding when the config ties them."""
        lm_head = self.take("lm_head.weight")
        if lm_head is None and self.base == "language_model.model":
            lm_head = self.take("language_model.lm_head.weight")
        if lm_head is None:
            if not tied:
                raise ConfigError(f"model {self.name!r}: lm_head.weight is missing and embeddings are not "
                                  "tied")
            lm_head = embed
        return lm_head

    def _fused(self, prefix: str, names: tuple[str, ...], suffix: str) -> torch.Tensor | None:
        parts = [self.take(f"{prefix}.{n}.{suffix}") for n in names]
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            raise ConfigError(f"model {self.name!r}: {prefix} has {suffix} for only some of {names}")
        return torch.cat(parts, dim=0).contiguous()

    def _norm(self, prefix: str, name: str | None) -> torch.Tensor | None:
        return None if name is None else self.need(f"{prefix}.{name}.weight")

    def _projections(self, p: str) -> tuple[torch.Tensor | None, ...]:
        """(qkv, qkv bias, gate_up, gate_up bias) of layer prefix `p`, in the engine's fused layout."""
        attn, mlp = f"{p}.self_attn", f"{p}.mlp"
        if self.spec.fused_checkpoint:
            take = self.take
            return (take(f"{attn}.qkv_proj.weight"), take(f"{attn}.qkv_proj.bias"),
                    take(f"{mlp}.gate_up_proj.weight"), take(f"{mlp}.gate_up_proj.bias"))  # fmt: skip
        qkv, gate_up = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
        return (self._fused(attn, qkv, "weight"), self._fused(attn, qkv, "bias"),
                self._fused(mlp, gate_up, "weight"), self._fused(mlp, gate_up, "bias"))  # fmt: skip

    def _experts(self, p: str, moe: MoeSpec) -> MoeWeights:
        """Layer prefix `p`'s router and stacked experts (see the module docstring)."""
        found = (f"{p}.{n}" for n in ("mlp", "block_sparse_moe") if f"{p}.{n}.gate.weight" in self._w)
        mlp = next(found, f"{p}.mlp")
        router = self.need(f"{mlp}.gate.weight")
        stacked = self.take(f"{mlp}.experts.gate_up_proj")
        if stacked is not None:
            gate_up, down = stacked.contiguous(), self.need(f"{mlp}.experts.down_proj").contiguous()
        else:
            mixtral = f"{mlp}.experts.0.w1.weight" in self._w
            g, u, d = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            e, need = f"{mlp}.experts", self.need
            gate_up = torch.stack([torch.cat([need(f"{e}.{x}.{g}.weight"), need(f"{e}.{x}.{u}.weight")])
                                   for x in range(moe.num_experts)])  # fmt: skip
            down = torch.stack([need(f"{e}.{x}.{d}.weight") for x in range(moe.num_experts)])
        hidden = self.dims.hidden
        want = (moe.num_experts, 2 * moe.intermediate, hidden)
        if tuple(gate_up.shape) != want or tuple(down.shape) != (want[0], hidden, moe.intermediate):
            raise ConfigError(f"model {self.name!r}: {mlp} experts are {tuple(gate_up.shape)} / "
                              f"{tuple(down.shape)}, not {want} as the config says")
        return MoeWeights(router, gate_up, down)
