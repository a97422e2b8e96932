#!/usr/bin/env bash
# The checks of issue 12 that need a GPU, in one run of under 10 minutes (first run: 2026-12-04 on an
# H200, docs/gpu_check_h200.md, with the wheels it names in .whl/).
#
#   OUT=/tmp/gpu_check bash benchmarks/gpu_check.sh
#
# Only some steps: STEPS="kernels families" (names as below); all of them when STEPS is unset.
#
# Run from the repository root on a CUDA machine whose python3 has torch, triton, transformers and
# peft (the project itself need not be installed: it runs from the source tree). Packages missing
# there can travel as wheels in .whl/ (installed into /tmp/site first). Each step has its own time
# limit and writes its log under $OUT, so one that fails or runs out leaves the others' results.
#  1. The Triton LoRA kernels, the paged-attention kernel (sliding windows, soft-caps) and the MoE
#     experts kernels (grouped GEMM + per-pair expert LoRA, float32 and bfloat16) against their torch
#     references, compiled for the GPU (on CPU they run under TRITON_INTERPRET=1).
#  2. The decode step of 32 distinct rank-8 adapters vs the base model: the ~1.0B model of
#     Llama-3.2-1B's dims, then the ~88M demo model (benchmarks/bench_decode_step.py).
#  3. The engine's tests on the GPU (float32, where they compare with PEFT), a fixed KV block count
#     so that engines alive together in one process fit.
#  3b. Every model family (tests/engine/test_family_parity.py: Llama 3, Mistral, Qwen2, Qwen3, Gemma 2/3 and
#     Gemma 3 multimodal, Phi-3/4-mini, Granite, OLMo 2, SmolLM3, Qwen3-MoE, Mixtral) token-exact with
#     PEFT on the GPU, float32, through the engine's CUDA path: Triton LoRA kernels, the Triton paged
#     decode with sliding windows and soft-caps, and the Triton MoE experts with LoRA on the experts;
#     then tests/engine/test_moe.py (expert LoRA loading, both checkpoint layouts) and tests/engine/test_dora.py (DoRA
#     adapters mixed with LoRA and base rows, PEFT-exact). On CPU the same tests run
#     the same path with LORA_CLUSTER_KERNEL=triton TRITON_INTERPRET=1 (docs/model_families.md).
#  4. Whole distinct-adapter generations vs base-only and PEFT's mixed batch (bench_engine.py).
#  5. The memory plan on the device: KV blocks and adapter slots from gpu_memory_utilization.
set -u -o pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:$PWD/kernels:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, say how it ended
    local name=$1 limit=$2
    shift 2
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then
        return 0
    fi
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    tail -n 4 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > "$OUT/summary.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
    >> "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
step kernels 150 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_kernels.py tests/kernels/test_paged_attention.py \
    tests/kernels/test_moe_kernels.py
step decode_1b 170 python3 benchmarks/bench_decode_step.py --size 1b --zoo /tmp/zoo/1b --reps 10 --iters 20 \
    --out "$OUT/decode_1b.md"
step decode_base 110 python3 benchmarks/bench_decode_step.py --zoo /tmp/zoo/base96 --reps 10 --iters 20 \
    --qv-only --out "$OUT/decode_base.md"
LORA_CLUSTER_DTYPE=float32 LORA_CLUSTER_NUM_KV_BLOCKS=1024 step engine_tests 100 python3 -m pytest -q \
    -p no:cacheprovider tests/engine/test_engine_parity.py tests/engine/test_logprobs.py tests/store/test_merge.py \
    tests/engine/test_paged_kv.py tests/kernels/test_lora_slot_batch.py tests/engine/test_engine_behaviour.py
LORA_CLUSTER_DTYPE=float32 LORA_CLUSTER_NUM_KV_BLOCKS=512 step families 300 python3 -m pytest -q \
    -p no:cacheprovider tests/engine/test_family_parity.py tests/engine/test_moe.py tests/engine/test_dora.py
LORA_CLUSTER_NUM_KV_BLOCKS=2048 step bench_engine 90 python3 benchmarks/bench_engine.py \
    --scenario distinct-decode --zoo /tmp/zoo/base96 --reps 3 --out "$OUT/bench_engine.md"
step memory_plan 60 python3 -c '
from lora_cluster.demo import build_demo_zoo
from lora_cluster.engine import build_engine
zoo = build_demo_zoo("/tmp/zoo/1b", num_adapters=0, size="1b")
e = build_engine(model=str(zoo.model_dir), max_loras=64, max_lora_rank=16)
m, bs = e.memory, e.config.kv_block_size
print(e.device, e.dtype, m)
print(f"KV {m.kv_bytes / 2**30:.1f} GiB in {m.num_kv_blocks} blocks of {bs} tokens: "
      f"{m.num_kv_blocks * bs // 2048} sequences of 2048 tokens, {m.num_kv_blocks * bs // 300} of 300")
print(f"adapter pool {m.adapter_pool_bytes / 2**30:.2f} GiB in {m.num_adapter_slots} slots; "
      f"buffer {m.buffer_bytes / 2**30:.1f} GiB")
'
