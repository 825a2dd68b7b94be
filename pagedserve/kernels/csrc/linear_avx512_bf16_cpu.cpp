// bf16 linear layers with AVX512-BF16 dot products (vdpbf16ps), for CPUs without AMX: y = x @ W.T (+ b).
//
// oneDNN's packed bf16 matmul streams a decode step's weights at well under the memory bandwidth
// for the few rows of a decode step. This kernel keeps a block of outputs in registers across the
// whole reduction, streaming each 16-column slice of the weight once (1-8 rows) or once per
// 8 rows (more rows, from L1/L2 after the first). It is faster than oneDNN's packed weights at every
// row count measured, 1-2,048 (docs/design/cpu-performance.md).
//
// pack_linear_weight_vnni: W [N, K] -> [N / 16, K / 2, 16, 2]: for each 16-column slice n, the
//     pair-interleaved (VNNI) layout one vdpbf16ps consumes: packed[n][p][c][j] = W[16 n + c][2 p + j].
// linear_avx512_bf16: x [..., K] bf16, packed as above, bias [N] or None -> [..., N] bf16, float32
//     sums (pairs of products added in order of k), rounded once to bf16 (as oneDNN does).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "avx512_utils.h"
#include "bf16_matmul_blocks.h"

namespace {

#if defined(__AVX512BF16__)
constexpr int kRowGroup = 8;  // rows whose sums share each weight load
using pagedserve::bf16_blocks::block_rows;

// T: 16-column slices per register block; up to 8 rows one slice at a time (memory-bound: one
// weight stream per block), more rows three at a time (8 x 3 sums: each weight load feeds 8 products).
template <int T, int PF>
void linear_rows(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* w, int64_t n_slices,
                 const float* bias, at::BFloat16* out) {
  const int64_t N = n_slices * 16, slice_elems = K * 16;
  // NOTE: threads split the output columns, so each weight byte is read from memory by one thread.
  at::parallel_for(0, n_slices, T, [&](int64_t begin, int64_t end) {
    for (int64_t s0 = begin; s0 < end; s0 += T) {
      const int64_t slices = std::min<int64_t>(T, end - s0);
      for (int64_t m0 = 0; m0 < M; m0 += kRowGroup) {
        block_rows<kRowGroup, T, PF>(std::min<int64_t>(kRowGroup, M - m0), slices, x + m0 * K, K, w + s0 * slice_elems,
                                     slice_elems, N, s0 * 16, bias, out + m0 * N);
      }
    }
  });
}
#endif

}  // namespace

bool has_avx512_bf16_linear() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

torch::Tensor pack_linear_weight_vnni(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight must be bfloat16 [out, in]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 2 == 0, "the AVX512-BF16 linear needs out_features % 16 == 0 and even in_features, got ",
              N, " x ", K);
  // [N/16, 16 (c), K/2, 2 (j)] -> [N/16, K/2, 16 (c), 2 (j)]
  return weight.contiguous().view({N / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

torch::Tensor linear_avx512_bf16(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(has_avx512_bf16_linear(), "linear_avx512_bf16: these kernels were built without AVX512-BF16");
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x must be bfloat16 [..., in] on the CPU");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.size(2) == 16 &&
                  packed.size(3) == 2,
              "packed must come from pack_linear_weight_vnni");
  const int64_t K = x.size(-1), n_slices = packed.size(0), N = n_slices * 16;
  TORCH_CHECK(packed.size(1) * 2 == K, "x has ", K, " features, the weight ", packed.size(1) * 2);
  torch::Tensor bias_f32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bias must have ", N, " elements");
    bias_f32 = bias->to(torch::kFloat32).contiguous();
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  auto out = torch::empty(out_shape, x.options());
  const torch::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  if (M == 0) return out;
#if defined(__AVX512BF16__)
  const auto* x_ptr = rows.data_ptr<at::BFloat16>();
  const auto* w_ptr = packed.data_ptr<at::BFloat16>();
  const float* b_ptr = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
  auto* out_ptr = out.data_ptr<at::BFloat16>();
  if (M <= kRowGroup) {
    linear_rows<1, 16>(x_ptr, M, K, w_ptr, n_slices, b_ptr, out_ptr);
  } else {
    linear_rows<3, 32>(x_ptr, M, K, w_ptr, n_slices, b_ptr, out_ptr);
  }
#endif
  return out;
}
