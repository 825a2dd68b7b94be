// The register-blocked bf16 matmul of linear_avx512_bf16_cpu.cpp as templates, shared with the
// quantized matmul (which widens its weights into this layout for many-row steps):
// out[r][col0 + 16 t + c] = sum_k x[r][k] * W[16 t + c][k] over weights in 16-column pair-interleaved
// slices ([K / 2, 16, 2] bf16 each, slice_elems apart).
#pragma once

#include <torch/extension.h>

#include <cstdint>

#include "avx512_utils.h"

#if defined(__AVX512BF16__)
namespace pagedserve {
namespace bf16_blocks {
// A bf16 pair of x read as one 32-bit lane (the type may alias the tensor's bf16 storage).
typedef int32_t __attribute__((may_alias)) bf16_pair;

// out[r][col0 + 16 t + c] for R rows of x and T 16-column slices: one pass over K with R x T
// float32 sums in registers. w points at slice 0; slices are slice_elems apart. PF: how many pair
// rows (64 bytes each) ahead to prefetch.
template <int R, int T, int PF>
inline void output_block(const at::BFloat16* x, int64_t K, const at::BFloat16* w, int64_t slice_elems, int64_t N,
                         int64_t col0, const float* bias, at::BFloat16* out) {
  __m512 sums[R][T];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int t = 0; t < T; ++t) sums[r][t] = _mm512_setzero_ps();
  const auto* pairs = reinterpret_cast<const bf16_pair*>(x);
  const int64_t k_pairs = K / 2;
  for (int64_t p = 0; p < k_pairs; ++p) {
    __m512bh weights[T];
#pragma GCC unroll 3
    for (int t = 0; t < T; ++t) {
      const at::BFloat16* row = w + t * slice_elems + p * 32;
      _mm_prefetch(reinterpret_cast<const char*>(row + PF * 32), _MM_HINT_T0);  // never faults, even past the end
      weights[t] = (__m512bh)_mm512_loadu_si512(row);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(pairs[r * k_pairs + p]);
#pragma GCC unroll 3
      for (int t = 0; t < T; ++t) sums[r][t] = _mm512_dpbf16_ps(sums[r][t], xr, weights[t]);
    }
  }
#pragma GCC unroll 3
  for (int t = 0; t < T; ++t) {
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + col0 + 16 * t) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) pagedserve::store_bf16x16(out + r * N + col0 + 16 * t, _mm512_add_ps(sums[r][t], b));
  }
}

// output_block<R, T> for a runtime slice count (the last group of a thread's range may be short).
template <int R, int T, int PF>
inline void block_slices(int64_t slices, const at::BFloat16* x, int64_t K, const at::BFloat16* w, int64_t slice_elems,
                         int64_t N, int64_t col0, const float* bias, at::BFloat16* out) {
  if constexpr (T == 1) {
    output_block<R, 1, PF>(x, K, w, slice_elems, N, col0, bias, out);
  } else if (slices == T) {
    output_block<R, T, PF>(x, K, w, slice_elems, N, col0, bias, out);
  } else {
    block_slices<R, T - 1, PF>(slices, x, K, w, slice_elems, N, col0, bias, out);
  }
}

// block_slices for a runtime row count (the last group of rows may be short).
template <int R, int T, int PF>
inline void block_rows(int64_t rows, int64_t slices, const at::BFloat16* x, int64_t K, const at::BFloat16* w,
                       int64_t slice_elems, int64_t N, int64_t col0, const float* bias, at::BFloat16* out) {
  if constexpr (R == 1) {
    block_slices<1, T, PF>(slices, x, K, w, slice_elems, N, col0, bias, out);
  } else if (rows == R) {
    block_slices<R, T, PF>(slices, x, K, w, slice_elems, N, col0, bias, out);
  } else {
    block_rows<R - 1, T, PF>(rows, slices, x, K, w, slice_elems, N, col0, bias, out);
  }
}

}  // namespace bf16_blocks
}  // namespace pagedserve
#endif
