"""Why the engine's Gemma 2 logprobs can differ from PEFT's on a GPU: one run that names the cause.

tests/engine/test_family_parity.py::test_mixed_batch_matches_peft[gemma2] failed on an H200 (float32,
torch 2.11, transformers 5.17): tokens equal PEFT's, the base row r0's first logprob off by more than
1e-4 (the other families pass at 1e-4). This builds the test's case (the tiny Gemma 2 zoo: sliding
window 8, attention soft-cap 2.0, final logit soft-cap 3.0; 6 requests, 4 first, 2 joining while
they decode, chunked prefills of at most 24 tokens) and runs it through several engines, each compared
with PEFT teacher-forced on the engine's own prompt + output, as the test does:

* the engine on ``--device`` (its default kernels there: Triton LoRA and paged decode on CUDA), float32;
* on CUDA also the engine with ``kernel=reference`` (torch LoRA ops and the torch paged decode: no
  Triton at all), and the default engine with TF32 matmuls forced on, to show how large a
  reduced-precision matmul's error would be on this case;
* the engine on CPU, float32 (the path the test passes on here).

PEFT runs on the CPU, as in the test, and on ``--device`` too. For each engine, per request and for
the first ``--tokens`` tokens: |engine logprob - PEFT logprob| of the chosen token and the largest
|logit difference|, against PEFT on CPU and on the device. It also prints the attention implementation
transformers chose (``config._attn_implementation``), the engine's attention paths (prefill: explicit
matmul + tanh soft-cap + float32 softmax, ``lora_cluster.engine.model.attention.dense_attention``,
whenever the model soft-caps; decode: the paged kernel), and the float32 matmul settings of torch.

Reading it: a difference present on CPU too (engine CPU vs PEFT CPU) is a modelling difference
(e.g. transformers' attention choice); present only for the CUDA engine but the same with
``kernel=reference`` is torch's CUDA arithmetic (cuBLAS order of sums, tanh, softmax); gone with
``kernel=reference`` means a Triton kernel. The engine vs PEFT both on the device tells whether the
test's CPU-side reference is what moves.

Run (from the repository root; under 60 s on a GPU, ~1 min on a 2-core CPU):
  PYTHONPATH=$PWD:$PWD/kernels python benchmarks/gpu_diag_gemma2.py [--device cuda|cpu] [--tokens 4]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

PROMPTS = [  # tests/engine/test_family_parity.py's
    "the quick brown fox jumps over the lazy dog near the river",
    "a long story begins when the morning light falls over the quiet river and the town",
    "one two three four five six seven eight nine ten",
    "what is the weather like today in the mountains and by the sea",
]
NEW_TOKENS, TOP, TOL = 12, 3, 1e-4


@contextlib.contextmanager
def tf32(on: bool) -> Iterator[None]:
    """TF32 for CUDA float32 matmuls (and cuDNN) on or off inside the block; restored after."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def precision_settings() -> str:
    m = torch.backends.cuda.matmul
    parts = [f"float32_matmul_precision={torch.get_float32_matmul_precision()}",
             f"cuda.matmul.allow_tf32={m.allow_tf32}", f"cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}"]
    for name in ("fp32_precision",):
        if hasattr(m, name):
            parts.append(f"cuda.matmul.{name}={getattr(m, name)}")
    return ", ".join(parts)


def matmul_error(device: str) -> str:
    """The relative error of float32 matmuls on `device` against float64: ~1e-7 when they are IEEE
    float32, ~1e-4 or more for TF32 (10-bit mantissa) or another reduced-precision path."""
    g = torch.Generator().manual_seed(0)
    parts = []
    for name, a_shape, b_shape in (("linear [24, 64] x [64, 192]", (24, 64), (64, 192)),
                                   ("attention scores [1, 4, 16, 16] x [1, 4, 16, 24]", (1, 4, 16, 16),
                                    (1, 4, 16, 24))):  # fmt: skip
        a, b = torch.randn(*a_shape, generator=g, dtype=torch.float64), torch.randn(*b_shape, generator=g,
                                                                                   dtype=torch.float64)
        got = torch.matmul(a.float().to(device), b.float().to(device)).double().cpu()
        want = torch.matmul(a.float().double(), b.float().double())
        parts.append(f"{name}: {float((got - want).abs().max() / want.abs().max()):.1e}")
    return "; ".join(parts)


def run_engine(zoo: Any, device: str, *, torch_decode: bool = False, alone: bool = False,
               **overrides: object) -> tuple[dict[str, Any], dict[str, list], str]:  # fmt: skip
    """The test's requests through an engine on `device` (float32); returns the final outputs by
    request id, each request's sampled logit rows, and a line naming the engine's paths.
    `torch_decode`: the torch paged decode instead of the engine's choice; `alone`: r0 only."""
    from lora_kernels.paged_attention import paged_decode_attention

    from lora_cluster.engine import SamplingParams, build_engine

    engine = build_engine(model=str(zoo.model_dir), adapter_source=str(zoo.adapters_dir), max_loras=3,
                          max_lora_rank=64, max_num_seqs=8, max_num_batched_tokens=24, device=device,
                          dtype="float32", num_kv_blocks=512, **overrides)  # fmt: skip
    runner = engine.runner
    if torch_decode:
        runner.paged_attention = paged_decode_attention
    spec = runner.spec
    paged = runner.paged_attention
    prefill = ("explicit matmul + tanh soft-cap + float32 softmax (attention.dense_attention)"
               if spec.attn_softcap else "torch SDPA (attention.dense_attention)")  # fmt: skip
    paths = (f"device={engine.device} dtype={engine.dtype} lora ops={runner.lora.ops.name} "
             f"prefill attention: {prefill}; decode attention: {paged.__module__}.{paged.__name__}; "
             f"attn_softcap={spec.attn_softcap} final_softcap={spec.final_softcap} scale={runner.scale:g} "
             f"windows={sorted({ls.window for ls in spec.layers}, key=str)}")  # fmt: skip
    captured: dict[str, list] = {}
    forward = runner.forward

    def spy(batch: Any) -> torch.Tensor:
        logits = forward(batch)
        for seq, row in zip(batch.sampled, logits, strict=True):
            captured.setdefault(seq.request_id, []).append(row.detach().float().cpu())
        return logits

    runner.forward = spy
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)
    aids = [None, *zoo.adapter_ids, None]
    requests = [(f"r{i}", PROMPTS[i % len(PROMPTS)], aid) for i, aid in enumerate(aids)]
    if alone:
        requests = requests[:1]
    finals: dict[str, Any] = {}
    try:
        for rid, prompt, aid in requests[:4]:
            engine.add_request(rid, prompt, aid, sampling)
        for _ in range(5):
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        for rid, prompt, aid in requests[4:]:
            engine.add_request(rid, prompt, aid, sampling)
        while engine.has_unfinished():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
    finally:
        engine.close()
    return finals, captured, paths


def load_peft(zoo: Any, device: str, dtype: torch.dtype = torch.float32) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(zoo.model_dir, dtype=dtype)
    first = zoo.adapter_ids[0]
    model = PeftModel.from_pretrained(base, zoo.adapters_dir / first, adapter_name=first)
    for adapter_id in zoo.adapter_ids[1:]:
        model.load_adapter(zoo.adapters_dir / adapter_id, adapter_name=adapter_id)
    return model.to(device, dtype).eval()


def peft_logits(model: Any, adapter_id: str | None, ids: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    with torch.no_grad():
        if adapter_id is None:
            with model.disable_adapter():
                return model(torch.tensor([ids], device=device)).logits[0].float().cpu()
        model.set_adapter(adapter_id)
        return model(torch.tensor([ids], device=device)).logits[0].float().cpu()


def compare(label: str, finals: dict[str, Any], captured: dict[str, list], pefts: dict[str, Any],
            tokens: int) -> None:  # fmt: skip
    """Per request: the largest |logprob diff| over the first `tokens` tokens and each of them, and
    the largest |logit diff|, against each PEFT model."""
    print(f"\n== {label}")
    for where, model in pefts.items():
        worst = 0.0
        for rid in sorted(finals, key=lambda r: int(r[1:])):
            out = finals[rid]
            ref = peft_logits(model, out.adapter_id, out.prompt_token_ids + out.token_ids)
            ref = ref[out.prompt_tokens - 1 : out.prompt_tokens - 1 + NEW_TOKENS]
            ref_lp = torch.log_softmax(ref, dim=-1)
            lp_diff = [abs(lp.logprob - ref_lp[i, lp.token_id].item()) for i, lp in enumerate(out.logprobs)]
            logit_diff = (torch.stack(captured[out.request_id]) - ref).abs()
            same = ref.argmax(-1).tolist() == out.token_ids
            worst = max(worst, max(lp_diff))
            firsts = " ".join(f"{d:.1e}" for d in lp_diff[:tokens])
            print(f"  vs PEFT {where:11s} {rid} ({out.adapter_id or 'base'}): tokens "
                  f"{'equal' if same else 'DIFFER'};"
                  f" |dlogprob| first {tokens}: {firsts}; max {max(lp_diff):.1e};"
                  f" max |dlogit| {logit_diff.max():.1e} (token 0: {logit_diff[0].max():.1e})")  # fmt: skip
        verdict = "within" if worst <= TOL else "OVER"
        print(f"  vs PEFT {where}: worst |dlogprob| {worst:.2e} ({verdict} {TOL})")


def compare_pefts(finals: dict[str, Any], pefts: dict[str, Any]) -> None:
    """PEFT against PEFT (each other reference vs the first, on the engine's ids): how far torch's
    own arithmetic moves between devices and precisions on this model."""
    (first, ref_model), *others = pefts.items()
    for where, model in others:
        worst_lp = worst_logit = 0.0
        for out in finals.values():
            ids = out.prompt_token_ids + out.token_ids
            a, b = peft_logits(ref_model, out.adapter_id, ids), peft_logits(model, out.adapter_id, ids)
            sl = slice(out.prompt_tokens - 1, out.prompt_tokens - 1 + NEW_TOKENS)
            worst_logit = max(worst_logit, float((a[sl] - b[sl]).abs().max()))
            lp = (torch.log_softmax(a[sl], -1) - torch.log_softmax(b[sl], -1)).abs()
            worst_lp = max(worst_lp, float(lp.max()))
        print(f"  PEFT {where} vs PEFT {first}: max |dlogprob| {worst_lp:.2e}, "
              f"max |dlogit| {worst_logit:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=4, help="tokens per request to list")
    ap.add_argument("--arch", default="gemma2")
    ap.add_argument("--variants", action="store_true", help="the device's variants on the CPU too (a check)")
    args = ap.parse_args()
    import transformers

    from lora_cluster.demo_families import ADAPTERS, build_family_zoo

    start = time.monotonic()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"python {sys.version.split()[0]}")
    print(f"matmul settings: {precision_settings()}")
    print(f"float32 matmul error vs float64 on {args.device}: {matmul_error(args.device)}")
    if args.device != "cpu":
        with tf32(True):
            print(f"  the same with TF32 on (for scale): {matmul_error(args.device)}")
    with tempfile.TemporaryDirectory(prefix="gemma2-diag-") as tmp:
        zoo = build_family_zoo(Path(tmp) / args.arch, args.arch, num_adapters=len(ADAPTERS))
        pefts = {"cpu": load_peft(zoo, "cpu")}
        if args.device != "cpu":
            pefts[args.device] = load_peft(zoo, args.device)
        pefts["cpu float64"] = load_peft(zoo, "cpu", torch.float64)
        for where, model in pefts.items():
            cfg = model.get_base_model().config
            impl = getattr(cfg, "_attn_implementation", "?")
            print(f"transformers on {where}: _attn_implementation={impl}, "
                  f"attn_logit_softcapping={cfg.attn_logit_softcapping}, "
                  f"final_logit_softcapping={cfg.final_logit_softcapping}")  # fmt: skip
        dev = args.device
        runs = [(f"engine on {dev}, default kernels", dev, {}, False)]
        if dev != "cpu" or args.variants:
            runs += [(f"engine on {dev}, kernel=reference (torch LoRA ops and paged decode: no Triton)", dev,
                      {"kernel": "reference"}, False),
                     (f"engine on {dev}, default kernels but the torch paged decode", dev,
                      {"torch_decode": True}, False),
                     (f"engine on {dev}, default kernels, r0 alone (no batch)", dev, {"alone": True}, False),
                     (f"engine on {dev}, default kernels, TF32 matmuls ON (for scale)", dev, {}, True)]
        if dev != "cpu":
            runs.append(("engine on cpu (float32)", "cpu", {}, False))
        for n, (label, device, overrides, allow_tf32) in enumerate(runs):
            t0 = time.monotonic()
            with tf32(allow_tf32):
                finals, captured, paths = run_engine(zoo, device, **overrides)
            print(f"\n{label}: {paths} ({time.monotonic() - t0:.1f} s)")
            compare(label, finals, captured, pefts, args.tokens)
            if n == 0:
                print("\n== PEFT against PEFT on the engine's ids")
                compare_pefts(finals, pefts)
    print(f"\ndone in {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()
