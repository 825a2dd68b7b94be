// Greedy sampling for CPUs: the index of each row's largest logit, read straight from the model's
// bf16 (or float32) logits without a float32 copy of the whole [rows, vocab] matrix.
// Matches torch.max(dim=-1).indices: the first index among equal maxima, and a row holding NaN
// answers its first NaN.
//
// argmax_rows: logits [rows, vocab] (rows contiguous) -> int64 [rows]
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "avx512_utils.h"

namespace {

template <typename scalar_t>
int64_t argmax_row_scalar(const scalar_t* row, int64_t begin, int64_t end, int64_t best, float best_value) {
  for (int64_t i = begin; i < end; ++i) {
    const float v = static_cast<float>(row[i]);
    if (std::isnan(v)) return i;
    if (v > best_value || best < 0) {
      best_value = v;
      best = i;
    }
  }
  return best;
}

#if defined(__AVX512F__)
inline __m512 load16(const at::BFloat16* p) { return pagedserve::load_bf16x16(p); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// Four independent sets of 16 lanes (so the compare-and-select chains overlap) each keep their
// running maximum and its first index; ties across lanes go to the smaller index. A NaN anywhere
// hands the row to the scalar scan, which stops at the first one.
constexpr int64_t kLanes = 16, kChains = 4;

inline void keep_greater(__m512& best, __m512i& best_index, __m512 v, __m512i index) {
  const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
  best = _mm512_mask_mov_ps(best, greater, v);
  best_index = _mm512_mask_mov_epi32(best_index, greater, index);
}

template <typename scalar_t>
int64_t argmax_row(const scalar_t* row, int64_t vocab) {
  constexpr int64_t kBlock = kLanes * kChains;
  const int64_t block_end = vocab - vocab % kBlock;
  if (block_end == 0) return argmax_row_scalar(row, 0, vocab, -1, 0.f);
  __m512 best[kChains];
  __m512i best_index[kChains];
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 nan = 0;
  for (int64_t c = 0; c < kChains; ++c) {
    best[c] = load16(row + c * kLanes);
    best_index[c] = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(c * kLanes)));
    nan |= _mm512_cmp_ps_mask(best[c], best[c], _CMP_UNORD_Q);
  }
  for (int64_t i = kBlock; i < block_end; i += kBlock) {
    for (int64_t c = 0; c < kChains; ++c) {
      const __m512 v = load16(row + i + c * kLanes);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      keep_greater(best[c], best_index[c], v, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(i + c * kLanes))));
    }
    if (nan) return argmax_row_scalar(row, 0, vocab, -1, 0.f);
  }
  if (nan) return argmax_row_scalar(row, 0, vocab, -1, 0.f);
  alignas(64) float values[kChains][kLanes];
  alignas(64) int32_t indices[kChains][kLanes];
  for (int64_t c = 0; c < kChains; ++c) {
    _mm512_store_ps(values[c], best[c]);
    _mm512_store_si512(indices[c], best_index[c]);
  }
  int64_t winner = indices[0][0];
  float winner_value = values[0][0];
  for (int64_t c = 0; c < kChains; ++c) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const float value = values[c][l];
      if (value > winner_value || (value == winner_value && indices[c][l] < winner)) {
        winner_value = value;
        winner = indices[c][l];
      }
    }
  }
  return argmax_row_scalar(row, block_end, vocab, winner, winner_value);
}
#else
template <typename scalar_t>
int64_t argmax_row(const scalar_t* row, int64_t vocab) {
  return argmax_row_scalar(row, 0, vocab, -1, 0.f);
}
#endif

}  // namespace

torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.device().is_cpu(), "logits must be on the CPU");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1, "logits must be [rows, vocab] with contiguous rows");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "vocab too large");
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat, "logits must be bfloat16 or float32");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  int64_t* dst = out.data_ptr<int64_t>();
  AT_DISPATCH_SWITCH(logits.scalar_type(), "argmax_rows",
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      const auto* src = logits.data_ptr<at::BFloat16>();
      at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row(src + r * stride, vocab);
      });
    })
    AT_DISPATCH_CASE(at::kFloat, [&] {
      const auto* src = logits.data_ptr<float>();
      at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row(src + r * stride, vocab);
      });
    }));
  return out;
}
