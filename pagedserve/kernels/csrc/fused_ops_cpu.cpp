// Fused element-wise ops of the Llama layer for bf16 on AVX-512 CPUs. Each one replaces a chain of
// small PyTorch ops (and their intermediate tensors) with one pass over the rows, and rounds to
// bf16 exactly where the chain of bf16 tensor ops would, so results match the PyTorch path up to
// float32 summation order.
//
// rms_norm:        weight * bf16(rms_norm(x)); with a residual, first residual += x (bf16, in place)
//                  and the residual is normalized                                    [rows, hidden]
// rotary_embedding_: rotate-half rope of qk [tokens, heads, head_dim] in place with cos/sin
//                  [tokens, 1, head_dim / 2]
// silu_and_mul:    bf16(silu(gate)) * up for x = [gate | up]                        [rows, 2 * inter]
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "avx512_utils.h"

namespace {

constexpr int64_t kRowGrain = 16;  // rows per parallel task: small batches stay on one thread

void check_weight(const torch::Tensor& weight, const torch::Tensor& x) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.numel() == x.size(1), "weight must be bfloat16 [hidden]");
}

void check_bf16_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, features] with contiguous rows");
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
using pagedserve::exp_avx512;
using pagedserve::load_bf16_masked;
using pagedserve::round_bf16;
using pagedserve::store_bf16_masked;

// out_row = weight * bf16(row * rsqrt(mean(row^2) + eps)) for one row of already-rounded values.
void norm_row(const at::BFloat16* row, const at::BFloat16* weight, at::BFloat16* out, int64_t hidden, float eps) {
  __m512 sumsq = _mm512_setzero_ps();
  for (int64_t j = 0; j < hidden; j += 16) {
    const __m512 v = load_bf16_masked(row + j, std::min<int64_t>(16, hidden - j));
    sumsq = _mm512_fmadd_ps(v, v, sumsq);
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(sumsq) / static_cast<float>(hidden) + eps);
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t j = 0; j < hidden; j += 16) {
    const int64_t n = std::min<int64_t>(16, hidden - j);
    const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16_masked(row + j, n), vinv));
    store_bf16_masked(out + j, _mm512_mul_ps(load_bf16_masked(weight + j, n), normed), n);
  }
}
#endif

}  // namespace

bool has_fused_bf16_ops() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  return true;
#else
  return false;
#endif
}

torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  check_bf16_rows(x, "x");
  if (residual) {
    check_bf16_rows(*residual, "residual");
    TORCH_CHECK(x.sizes() == residual->sizes(), "x and residual must have the same shape");
  }
  check_weight(weight, x);
  weight = weight.contiguous();
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const int64_t hidden = x.size(1);
  const auto* x_ptr = x.data_ptr<at::BFloat16>();
  at::BFloat16* r_ptr = residual ? residual->data_ptr<at::BFloat16>() : nullptr;
  const int64_t r_stride = residual ? residual->stride(0) : 0;
  const auto* w_ptr = weight.data_ptr<at::BFloat16>();
  auto* o_ptr = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const at::BFloat16* row = x_ptr + i * x.stride(0);
      if (r_ptr != nullptr) {  // residual += x, then normalize the residual
        at::BFloat16* r = r_ptr + i * r_stride;
        for (int64_t j = 0; j < hidden; j += 16) {
          const int64_t n = std::min<int64_t>(16, hidden - j);
          store_bf16_masked(r + j, _mm512_add_ps(load_bf16_masked(r + j, n), load_bf16_masked(row + j, n)), n);
        }
        row = r;
      }
      norm_row(row, w_ptr, o_ptr + i * hidden, hidden, static_cast<float>(eps));
    }
  });
#else
  TORCH_CHECK(false, "fused bf16 ops need AVX-512 (F, BW, VL)");
#endif
  return out;
}

void rotary_embedding_(torch::Tensor qk, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(qk.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
              "qk, cos and sin must be bfloat16");
  TORCH_CHECK(qk.device().is_cpu(), "qk must be on the CPU");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1, "qk must be [tokens, heads, head_dim] with contiguous heads");
  const int64_t half = qk.size(2) / 2;
  TORCH_CHECK(qk.size(2) % 2 == 0 && cos.size(-1) == half && sin.size(-1) == half && cos.stride(-1) == 1 && sin.stride(-1) == 1,
              "cos and sin must be [tokens, 1, head_dim / 2] with contiguous rows");
  TORCH_CHECK(cos.size(0) == qk.size(0) && sin.size(0) == qk.size(0), "one cos/sin row per token");
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const int64_t num_heads = qk.size(1);
  auto* qk_ptr = qk.data_ptr<at::BFloat16>();
  const auto* cos_ptr = cos.data_ptr<at::BFloat16>();
  const auto* sin_ptr = sin.data_ptr<at::BFloat16>();
  at::parallel_for(0, qk.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const at::BFloat16* c_row = cos_ptr + i * cos.stride(0);
      const at::BFloat16* s_row = sin_ptr + i * sin.stride(0);
      for (int64_t h = 0; h < num_heads; ++h) {
        at::BFloat16* x = qk_ptr + i * qk.stride(0) + h * qk.stride(1);
        for (int64_t j = 0; j < half; j += 16) {
          const int64_t n = std::min<int64_t>(16, half - j);
          const __m512 c = load_bf16_masked(c_row + j, n), s = load_bf16_masked(s_row + j, n);
          const __m512 x1 = load_bf16_masked(x + j, n), x2 = load_bf16_masked(x + half + j, n);
          // [x1 * cos - x2 * sin, x2 * cos + x1 * sin], each product and sum rounded as bf16 ops round
          const __m512 o1 = _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, c)), round_bf16(_mm512_mul_ps(x2, s)));
          const __m512 o2 = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c)), round_bf16(_mm512_mul_ps(x1, s)));
          store_bf16_masked(x + j, o1, n);
          store_bf16_masked(x + half + j, o2, n);
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "fused bf16 ops need AVX-512 (F, BW, VL)");
#endif
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  check_bf16_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must be [rows, 2 * intermediate]");
  const int64_t inter = x.size(1) / 2;
  auto out = torch::empty({x.size(0), inter}, x.options());
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const auto* x_ptr = x.data_ptr<at::BFloat16>();
  auto* o_ptr = out.data_ptr<at::BFloat16>();
  const __m512 one = _mm512_set1_ps(1.f);
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const at::BFloat16* gate = x_ptr + i * x.stride(0);
      const at::BFloat16* up = gate + inter;
      for (int64_t j = 0; j < inter; j += 16) {
        const int64_t n = std::min<int64_t>(16, inter - j);
        const __m512 g = load_bf16_masked(gate + j, n);
        const __m512 act = round_bf16(_mm512_div_ps(g, _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
        store_bf16_masked(o_ptr + i * inter + j, _mm512_mul_ps(act, load_bf16_masked(up + j, n)), n);
      }
    }
  });
#else
  TORCH_CHECK(false, "fused bf16 ops need AVX-512 (F, BW, VL)");
#endif
  return out;
}
