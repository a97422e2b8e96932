"""Optional int8 host copies: symmetric per-channel quantization of LoRA A and B.

Each row of a matrix (a rank row of A [r, in], an output channel of B [out, r]) gets its own float32
scale `max|row| / 127`, so the host copy takes about a quarter of the float32 bytes. The error of
a value is at most half a quantization step of its row (`scale / 2`); the test measures the
relative Frobenius error of A, B and of the product B @ A against the float copy. Device slots
always receive float weights: `dequantize` runs in the loader thread, off the step loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lora_cluster.adapter_format import LoraWeights


@dataclass
class QTensor:
    q: torch.Tensor  # int8, same shape as the original
    scale: torch.Tensor  # float32 [rows]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4


def quantize_rows(t: torch.Tensor) -> QTensor:
    t = t.float()
    scale = t.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(t / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QTensor(q.contiguous(), scale.contiguous())


def dequantize_rows(qt: QTensor) -> torch.Tensor:
    return qt.q.float() * qt.scale[:, None]


@dataclass
class Int8LoraWeights:
    """An int8 host copy of a `LoraWeights` (same metadata, quantized A and B)."""

    adapter_id: str
    rank: int
    target_modules: frozenset[str]
    scaling: dict[str, float]
    a: dict[tuple[int, str], QTensor]
    b: dict[tuple[int, str], QTensor]
    # DoRA magnitude vectors, kept float32 (one value per output feature: not worth quantizing)
    magnitude: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.a.values(), *self.b.values())) + sum(
            t.numel() * t.element_size() for t in self.magnitude.values())

    def tensors(self) -> list[torch.Tensor]:
        return [*(t for q in (*self.a.values(), *self.b.values()) for t in (q.q, q.scale)),
                *self.magnitude.values()]


def quantize(weights: LoraWeights) -> Int8LoraWeights:
    return Int8LoraWeights(
        adapter_id=weights.adapter_id, rank=weights.rank, target_modules=weights.target_modules,
        scaling=dict(weights.scaling),
        a={k: quantize_rows(t) for k, t in weights.a.items()},
        b={k: quantize_rows(t) for k, t in weights.b.items()},
        magnitude=dict(weights.magnitude),
    )


def dequantize(weights: Int8LoraWeights) -> LoraWeights:
    return LoraWeights(
        adapter_id=weights.adapter_id, rank=weights.rank, target_modules=weights.target_modules,
        scaling=dict(weights.scaling),
        a={k: dequantize_rows(t) for k, t in weights.a.items()},
        b={k: dequantize_rows(t) for k, t in weights.b.items()},
        magnitude=dict(weights.magnitude),
    )
