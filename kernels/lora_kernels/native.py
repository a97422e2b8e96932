"""A C++ kernel for decode-like LoRA batches on CPU: each token's adapter weights read in place.

``add_lora(out, x, lora_a, lora_b, meta)`` has the semantics of every ``add_lora`` of this package
(see :mod:`lora_kernels`): ``out[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T`` for the tokens of each
segment with slot ``s >= 0``, sliced to the segment's rank; other rows untouched.

Why: a decode step of many distinct adapters is bound by reading each adapter's weights once from
memory. The torch ops cannot read them per token in place: the slot-batched ``bmm``
(:mod:`lora_kernels.slot_batch`) gathers each projection's input rows into a padded layout and
scatters its results back (zero-fill, copy, add), and the gathered BGMV copies the weights. Those
copies and the ~8 torch calls around each projection cost as much as the weight reads themselves
(docs/bench_decode.md). The kernel makes one pass per token, the tokens split over torch's
intra-op threads (:func:`openmp_flags`):
``h = A[s, :r] x`` (r dot products), then ``out[t] += h B[s, :r]`` (r axpys), reading nothing but
the token's input, its adapter's rank rows and its output row. Rank rows go four at a time (four
independent sums per load of the input, one load and store of the output row per four rows), and
the start of the next token's rows is prefetched while the current one is summed: 1.2-1.3x faster
per step's weights than one row at a time (``benchmarks/bench_native_kernel.py``).

Policy: :func:`lora_kernels.cpu.add_lora` calls it for decode-like batches (many short segments,
``slot_batch.decode_like``; the span of slots does not matter, no padding is read), when :func:`load`
has built it, and the tensors are float32 with a
unit last stride (``out`` may be a column slice of a fused output); longer segments (prefill) keep
BLAS, which amortises each adapter's weights over many rows.

Built by :func:`load` with ``torch.utils.cpp_extension`` from ``cpu_native.cpp`` beside this file:
it needs a C++ compiler and ninja, takes ~17 s once on a 2-core machine (it includes only the ATen
and pybind11 headers it uses), and is cached by torch (in
``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``, see :func:`build_folder`). Compiled
with ``-O3`` and no ``-march`` flag, so that a cached build runs on any CPU of the architecture; on
x86-64 with GCC the per-token function is cloned for x86-64-v4 (AVX-512) and v3 (AVX2, FMA) and
the clone for the CPU at hand is chosen when the module loads (``target_clones``).
Without a compiler, :func:`load` returns False with the reason in :func:`load_error`, and the
torch ops are used. Torch guards the build folder with a lock file that every load, cached or not,
waits for without a time limit, and a process killed while building leaves it behind: every later
load would hang (a replica that never starts). So :func:`load` first takes its own lock on the folder,
an advisory ``flock`` that the kernel releases when its holder exits, however it exits
(:func:`build_lock`): holding it, no live process of ours is building, so a torch lock found there
was left by a killed one and is removed. A build under way in another process is waited for, at
most ``BUILD_WAIT_S``; past that :func:`load` fails (the torch ops stay) with the reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from .meta import LoraMeta

__all__ = [
    "add_lora", "build_folder", "build_lock", "load", "load_error", "loaded", "openmp_flags", "supports",
]

SOURCE = Path(__file__).with_name("cpu_native.cpp")
NAME = "lora_cluster_cpu_lora"
BUILD_WAIT_S = 600.0  # the longest a load waits for another process's build (one takes ~17 s)
BUILD_LOCK = "lora_cluster.build.lock"  # our lock file in the build folder (torch's is "lock")
_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None


def load() -> bool:
    """Build (once per source version; torch caches it) and load the kernel; True when it is ready.
    Thread-safe; a failed build is not retried in this process."""
    global _module, _error
    with _lock:
        if _module is None and _error is None:
            try:
                from torch.utils import cpp_extension

                folder = build_folder()
                folder.mkdir(parents=True, exist_ok=True)
                omp = openmp_flags()
                with build_lock(folder, BUILD_WAIT_S):
                    (folder / "lock").unlink(missing_ok=True)  # under our lock: a killed build's
                    _module = cpp_extension.load(
                        name=NAME, sources=[str(SOURCE)], extra_cflags=["-O3", *(omp or ["-fopenmp-simd"])],
                        extra_ldflags=omp, build_directory=str(folder), verbose=False,
                    )  # fmt: skip
            except Exception as e:  # no compiler, no ninja, a failed build: the torch ops stay
                last = (str(e).strip().splitlines() or [""])[-1]
                _error = f"{type(e).__name__}: {last}"
        return _module is not None


def openmp_flags() -> list[str]:
    """``["-fopenmp"]`` when this process has GNU OpenMP loaded as ``libgomp.so.1`` (torch's own
    runtime, which torch loads with itself), else ``[]``. The kernel built with it links
    ``libgomp.so.1``, which the loader then finds already loaded: its tokens are split over the
    threads of torch's own OpenMP runtime, the ones torch's matmuls use, and no second runtime
    enters the process. Elsewhere (another runtime, another platform) it is built without OpenMP
    and runs on the calling thread. Two threads read a step's weights 1.6x faster than one here
    (``benchmarks/bench_native_kernel.py --threads 2``)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    loaded = {Path(line.split()[-1]).name for line in maps.splitlines() if "gomp" in line}
    return ["-fopenmp"] if loaded == {"libgomp.so.1"} else []


def build_folder() -> Path:
    """Where :func:`load` builds and caches the kernel: one folder per Python version under
    ``TORCH_EXTENSIONS_DIR``, else under torch's default build root."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"{NAME}_py{sys.version_info.major}{sys.version_info.minor}"


@contextlib.contextmanager
def build_lock(folder: Path, wait_s: float, poll_s: float = 0.1) -> Iterator[None]:
    """Hold the exclusive advisory lock ``BUILD_LOCK`` of `folder` (see the module docstring); raises
    TimeoutError when another process holds it for `wait_s` seconds. Released on exit, and by the
    operating system when the holding process dies."""
    fd = os.open(folder / BUILD_LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"another process has been building the kernel for {wait_s:g} s "
                                       f"(BUILD_WAIT_S)") from None
                time.sleep(poll_s)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def loaded() -> bool:
    """Whether :func:`load` has built the kernel in this process."""
    return _module is not None


def load_error() -> str | None:
    """Why :func:`load` failed (None: it did not, or was not called)."""
    return _error


def supports(out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor) -> bool:
    """Whether the kernel is loaded and takes these tensors (float32 CPU, unit last strides)."""
    f32 = torch.float32
    return (
        _module is not None and out.dtype == f32 and x.dtype == f32 and lora_a.dtype == f32
        and lora_b.dtype == f32 and out.is_cpu and x.is_cpu and lora_a.is_cpu and lora_b.is_cpu
        and out.stride(-1) == 1 and x.stride(-1) == 1 and lora_a.stride(-1) == 1 and lora_b.stride(-2) == 1
    )  # fmt: skip


def add_lora(out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, meta: LoraMeta) -> None:
    """out[T, N] += (x[T, K] @ lora_a[s].T) @ lora_b[s].T per token with slot s >= 0 (see the module
    docstring); ``lora_a`` [L, R, K], ``lora_b`` [L, N, R] (as the pool exposes them). Call
    :func:`supports` first.

    Refused inputs raise RuntimeError in Python and write nothing: when the kernel is not loaded; naming
    the tensor and what it must be for a wrong dtype or device (float32 on the CPU), number of dims,
    last stride (unit), a shape that does not agree with the others, or segment tensors (``meta``'s,
    1-D int64 on the CPU; made contiguous here) of the wrong sizes; with the kernel's message, from
    its own pass over the segments, for boundaries that do not run from 0 to T in order or a slot
    outside ``[-1, L)``. No C++ exception is thrown for any of them: one thrown by ``TORCH_CHECK`` in
    the extension crashed the process (SIGSEGV) instead of becoming a RuntimeError where the extension
    was built with a toolchain other than torch's (the H200 check, torch 2.11).

    Cost: the attribute checks are comparisons of tensor metadata (~2 us a call). The segment values
    are checked by the kernel in the loop over segments it runs anyway (it returns why it refused
    them, before writing anything; nothing thrown), not by torch ops here: those (a diff, a
    comparison, an ``aminmax`` and reads of their results) would add several microseconds per
    projection per decode step, a sizeable share of a call of ~15-60 us. The extension's
    ``TORCH_CHECK`` of the attributes remains, as a second line only.
    """
    if _module is None:
        raise RuntimeError("the native CPU LoRA kernel is not loaded (lora_kernels.native.load)")
    if lora_b.dim() != 3:
        raise RuntimeError(f"native add_lora: lora_b must be 3-D [L, N, R], got shape {tuple(lora_b.shape)}")
    b_t = lora_b.mT
    for t, name, dims in ((out, "out", 2), (x, "x", 2), (lora_a, "lora_a", 3), (b_t, "lora_b.mT", 3)):
        _check_rows(t, name, dims)
    n_tok, k_in, n_out, slots, rank = x.shape[0], x.shape[1], out.shape[1], lora_a.shape[0], lora_a.shape[1]
    if out.shape[0] != n_tok or lora_a.shape[2] != k_in or b_t.shape != (slots, rank, n_out):
        raise RuntimeError(f"native add_lora: shapes do not match: out {tuple(out.shape)} (T, N), x "
                           f"{tuple(x.shape)} (T, K), lora_a {tuple(lora_a.shape)} (L, R, K), lora_b "
                           f"{tuple(lora_b.shape)} (L, N, R)")  # fmt: skip
    indices = [t.contiguous() for t in (meta.seg_indptr, meta.seg_slot, meta.seg_rank)]
    for t, name in zip(indices, ("seg_indptr", "seg_slot", "seg_rank"), strict=True):
        if t.dtype != torch.int64 or t.dim() != 1 or not t.is_cpu:
            raise RuntimeError(f"native add_lora: meta.{name} must be a 1-D int64 CPU tensor, got "
                               f"{t.dtype} of shape {tuple(t.shape)} on {t.device}")  # fmt: skip
    sizes = [t.shape[0] for t in indices]
    if sizes[0] != sizes[1] + 1 or sizes[2] != sizes[1]:
        raise RuntimeError(f"native add_lora: meta.seg_indptr must have one more entry than seg_slot "
                           f"and seg_rank as many: sizes {sizes}")
    refused = _module.add_lora(out, x, lora_a, b_t, *indices)
    if refused:
        raise RuntimeError(f"native {refused}")


def _check_rows(t: Tensor, name: str, dims: int) -> None:
    """RuntimeError unless `t` is a float32 CPU tensor of `dims` dims with a unit last stride."""
    if t.dtype != torch.float32 or not t.is_cpu:
        raise RuntimeError(f"native add_lora: {name} must be a float32 CPU tensor, got {t.dtype} "
                           f"on {t.device}")
    if t.dim() != dims:
        raise RuntimeError(f"native add_lora: {name} must be {dims}-D, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise RuntimeError(f"native add_lora: {name} must have a unit last stride, got strides {t.stride()}")
