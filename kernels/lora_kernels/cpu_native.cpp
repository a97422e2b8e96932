// lora_kernels.native: add_lora for decode-like batches on CPU, each token's weights read in place.
// Semantics, shapes and the policy that calls it: kernels/lora_kernels/native.py.
// Only the headers it needs (ATen's Tensor, its thread pool, torch's pybind11 casters), not
// <torch/extension.h>, which includes the whole C++ frontend: the build takes 17 s here instead of 43.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <string>
#include <vector>

namespace {

void check_rows(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == dims && t.stride(dims - 1) == 1, name, " must be ", dims, "-D with unit last stride");
}

// One token: h = a[:r] @ x (r dot products of length K), then out += h @ b_t[:r] (length N). Rows are
// taken four at a time, so that four independent sums share each load of x (shrink) and each load
// and store of out (expand). Built for the CPU at hand at run time (x86-64-v3 or v4 where present).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void token_lora(float* __restrict ot, const float* __restrict xt, const float* __restrict a, int64_t as1,
                const float* __restrict b, int64_t bs1, int64_t K, int64_t N, int64_t r, float* __restrict h) {
  int64_t j = 0;
  for (; j + 4 <= r; j += 4) {
    const float *a0 = a + j * as1, *a1 = a0 + as1, *a2 = a1 + as1, *a3 = a2 + as1;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t k = 0; k < K; ++k) {
      const float xk = xt[k];
      s0 += a0[k] * xk;
      s1 += a1[k] * xk;
      s2 += a2[k] * xk;
      s3 += a3[k] * xk;
    }
    h[j] = s0; h[j + 1] = s1; h[j + 2] = s2; h[j + 3] = s3;
  }
  for (; j < r; ++j) {
    const float* aj = a + j * as1;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < K; ++k) acc += aj[k] * xt[k];
    h[j] = acc;
  }
  j = 0;
  for (; j + 4 <= r; j += 4) {
    const float *b0 = b + j * bs1, *b1 = b0 + bs1, *b2 = b1 + bs1, *b3 = b2 + bs1;
    const float h0 = h[j], h1 = h[j + 1], h2 = h[j + 2], h3 = h[j + 3];
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) ot[n] += h0 * b0[n] + h1 * b1[n] + h2 * b2[n] + h3 * b3[n];
  }
  for (; j < r; ++j) {
    const float* bj = b + j * bs1;
    const float hj = h[j];
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) ot[n] += hj * bj[n];
  }
}

// out[t] += (x[t] @ a[s, :r].T) @ b_t[s, :r] for every token t of a segment with slot s >= 0 and rank
// r = min(seg_rank, R) > 0; other rows of out untouched. a: [L, R, K], b_t: [L, R, N] (the pool's B
// stored rank-major), x: [T, K], out: [T, N]; any row strides, unit last stride.
// Returns "" when done, else why the segments were refused (nothing written). native.add_lora checks
// every tensor attribute first and raises in Python; the TORCH_CHECKs below are a second line only.
// The segments' values are checked here, in the loop that reads them anyway, and reported as a
// returned message, not thrown: a C++ exception crossing into Python crashed the process on a
// toolchain other than torch's (native.py, "Refused inputs").
std::string add_lora(at::Tensor out, at::Tensor x, at::Tensor a, at::Tensor b_t,
                     at::Tensor seg_indptr, at::Tensor seg_slot, at::Tensor seg_rank) {
  check_rows(out, "out", 2);
  check_rows(x, "x", 2);
  check_rows(a, "lora_a", 3);
  check_rows(b_t, "lora_b.mT", 3);
  const int64_t T = x.size(0), K = x.size(1), N = out.size(1), L = a.size(0), R = a.size(1);
  TORCH_CHECK(out.size(0) == T && a.size(2) == K && b_t.size(0) == L && b_t.size(1) == R && b_t.size(2) == N,
              "add_lora: shapes do not match");
  for (const auto* t : {&seg_indptr, &seg_slot, &seg_rank})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 1 && t->is_contiguous() && t->scalar_type() == at::kLong,
                "add_lora: segment tensors must be contiguous 1-D int64 CPU tensors");
  const int64_t S = seg_slot.size(0);
  TORCH_CHECK(seg_indptr.size(0) == S + 1 && seg_rank.size(0) == S, "add_lora: segment tensors' sizes");
  const int64_t* ip = seg_indptr.data_ptr<int64_t>();
  const int64_t* ss = seg_slot.data_ptr<int64_t>();
  const int64_t* sr = seg_rank.data_ptr<int64_t>();
  if (ip[0] != 0 || ip[S] != T)
    return "add_lora: segments do not cover the tokens: seg_indptr runs from " + std::to_string(ip[0]) +
           " to " + std::to_string(ip[S]) + ", not from 0 to " + std::to_string(T);
  std::vector<int64_t> slot(T, -1), rank(T, 0);
  for (int64_t s = 0; s < S; ++s) {
    if (ip[s] > ip[s + 1] || ip[s + 1] > T)
      return "add_lora: segment boundaries out of order: seg_indptr[" + std::to_string(s) + ":" +
             std::to_string(s + 2) + "] = " + std::to_string(ip[s]) + ", " + std::to_string(ip[s + 1]);
    if (ss[s] < -1 || ss[s] >= L)
      return "add_lora: seg_slot[" + std::to_string(s) + "] = " + std::to_string(ss[s]) + " outside [-1, " +
             std::to_string(L) + ")";
    for (int64_t t = ip[s]; t < ip[s + 1]; ++t) {
      slot[t] = ss[s];
      rank[t] = std::min(sr[s], R);
    }
  }
  float* O = out.data_ptr<float>();
  const float* X = x.data_ptr<float>();
  const float* A = a.data_ptr<float>();
  const float* B = b_t.data_ptr<float>();
  const int64_t os = out.stride(0), xs = x.stride(0), as0 = a.stride(0), as1 = a.stride(1);
  const int64_t bs0 = b_t.stride(0), bs1 = b_t.stride(1);
  // tokens split over torch's intra-op threads when built with OpenMP (native.py), in blocks of at
  // least GRAIN tokens: a token's work (~2 us) is about the cost of waking a thread
  constexpr int64_t GRAIN = 4;
  at::parallel_for(0, T, GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> h(R);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = slot[t], r = rank[t];
      if (s < 0 || r <= 0) continue;
      // the first 512 bytes of each of the next token's rows, so that the hardware prefetcher's streams
      // are under way when they are summed (prefetching the whole rows measured slower)
      if (t + 1 < end && slot[t + 1] >= 0) {
        const char* na = reinterpret_cast<const char*>(A + slot[t + 1] * as0);
        const char* nb = reinterpret_cast<const char*>(B + slot[t + 1] * bs0);
        const int64_t nr = rank[t + 1], na_bytes = std::min<int64_t>(512, K * 4);
        const int64_t nb_bytes = std::min<int64_t>(512, N * 4);  // within the row
        for (int64_t j = 0; j < nr; ++j) {
          for (int64_t off = 0; off < na_bytes; off += 64) __builtin_prefetch(na + j * as1 * 4 + off);
          for (int64_t off = 0; off < nb_bytes; off += 64) __builtin_prefetch(nb + j * bs1 * 4 + off);
        }
      }
      token_lora(O + t * os, X + t * xs, A + s * as0, as1, B + s * bs0, bs1, K, N, r, h.data());
    }
  });
  return std::string();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_lora", &add_lora, "LoRA of a decode-like batch, weights read in place; \"\" or why refused",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
