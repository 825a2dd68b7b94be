// bf16 linear layers with AMX tiles for the small row counts of decode steps: y = x @ W.T (+ b).
//
// oneDNN's blocked bf16 matmul reads the weights well below the memory bandwidth for the 1-64 rows
// of a decode step; this kernel streams them once per step in the order the tile unit consumes
// them and reaches the memory bandwidth at small row counts. Past ~200 rows oneDNN is faster (the
// model's Linear switches over, see layers.py; measurements in docs/design/cpu-performance.md).
//
// pack_linear_weight_amx: W [N, K] -> [N / 16, K / 32, 16, 16, 2]: for each 16-column block n and
//     32-deep slice k, one 1 KB tile operand in the pair-interleaved (VNNI) layout:
//     packed[n][k][r][c][j] = W[16 n + c][32 k + 2 r + j].
// linear_amx:  x [M, K] bf16 (contiguous rows), packed as above, bias [N] or None -> [M, N] bf16,
//     float32 accumulation, rounded once to bf16 (as oneDNN does).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "amx_utils.h"
#include "avx512_utils.h"

torch::Tensor pack_linear_weight_vnni(torch::Tensor weight);  // linear_avx512_bf16_cpu.cpp

namespace {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
constexpr int64_t kRowChunk = 128;  // rows of x per pass over a thread's weights: its slice of x stays in L2

// Tiles (configure_full_tiles): 0-3 float32 sums C[mi][ni] (tile 2 mi + ni); 4-5: 16 rows x 32 of x;
// 6-7: weight operands.

// out[m0 + 16 mi + r][16 (nb0 + ni) + c] for MT x NT tiles of 16 x 16 outputs: one pass over K.
// x: [rows_pad, K] (rows_pad >= m0 + 16 MT); w: packed; sums: scratch [16, 16] float32.
template <int MT, int NT>
void tile_block(const uint16_t* x, int64_t K, const uint16_t* w, int64_t m0, int64_t nb0, int64_t rows,
                int64_t N, const float* bias, at::BFloat16* out, float* sums) {
  const int64_t k_slices = K / 32;
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if constexpr (MT == 2) _tile_zero(2);
  if constexpr (MT == 2 && NT == 2) _tile_zero(3);
  const uint16_t* w0 = w + nb0 * k_slices * 512;  // 512 elements = one 1 KB operand
  const uint16_t* w1 = w0 + k_slices * 512;
  const uint16_t* x0 = x + m0 * K;
  const uint16_t* x1 = x0 + 16 * K;
  for (int64_t k = 0; k < k_slices; ++k) {
    _tile_loadd(4, x0 + 32 * k, K * 2);
    if constexpr (MT == 2) _tile_loadd(5, x1 + 32 * k, K * 2);
    _tile_loadd(6, w0 + 512 * k, 64);
    if constexpr (NT == 2) _tile_loadd(7, w1 + 512 * k, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  auto emit = [&](int mi, int ni) {  // sums holds tile C[mi][ni]
    const int64_t col = (nb0 + ni) * 16;
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps();
    for (int64_t r = 0; r < 16 && m0 + 16 * mi + r < rows; ++r) {
      pagedserve::store_bf16x16(out + (m0 + 16 * mi + r) * N + col, _mm512_add_ps(_mm512_load_ps(sums + 16 * r), b));
    }
  };
  _tile_stored(0, sums, 64);
  emit(0, 0);
  if constexpr (NT == 2) {
    _tile_stored(1, sums, 64);
    emit(0, 1);
  }
  if constexpr (MT == 2) {
    _tile_stored(2, sums, 64);
    emit(1, 0);
  }
  if constexpr (MT == 2 && NT == 2) {
    _tile_stored(3, sums, 64);
    emit(1, 1);
  }
}
#endif

}  // namespace

bool has_amx_linear() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
  return pagedserve::amx_tiles_usable();
#else
  return false;
#endif
}

torch::Tensor pack_linear_weight_amx(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight must be bfloat16 [out, in]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "AMX linear needs out_features % 16 == 0 and in_features % 32 == 0, got ", N, " x ", K);
  // The tile operands are the pair-interleaved slices [N/16, K/2, 16, 2] cut into 32-deep slices.
  return pack_linear_weight_vnni(weight).view({N / 16, K / 32, 16, 16, 2});
}

torch::Tensor linear_amx(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(has_amx_linear(), "linear_amx: this CPU (or its OS) offers no AMX bf16 tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x must be bfloat16 [rows, in] on the CPU");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.size(2) == 16 &&
                  packed.size(3) == 16 && packed.size(4) == 2,
              "packed must come from pack_linear_weight_amx");
  const int64_t rows = x.size(0), K = x.size(1), n_blocks = packed.size(0), N = n_blocks * 16;
  TORCH_CHECK(packed.size(1) * 32 == K, "x has ", K, " features, the weight ", packed.size(1) * 32);
  torch::Tensor bias_f32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bias must have ", N, " elements");
    bias_f32 = bias->to(torch::kFloat32).contiguous();
  }
  auto out = torch::empty({rows, N}, x.options());
  if (rows == 0) return out;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
  // tiles read 16 rows at a time: a partial last tile reads zero rows, not past the tensor
  const int64_t rows_pad = (rows + 15) / 16 * 16;
  torch::Tensor a = x.contiguous();
  if (rows_pad != rows) {
    a = torch::zeros({rows_pad, K}, x.options());
    a.narrow(0, 0, rows).copy_(x);
  }
  const auto* x_ptr = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
  const auto* w_ptr = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* b_ptr = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
  auto* out_ptr = out.data_ptr<at::BFloat16>();
  // NOTE: threads split the output columns, so each weight byte is read by one thread, once per row chunk.
  at::parallel_for(0, (n_blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    pagedserve::configure_full_tiles();
    alignas(64) float sums[16 * 16];
    for (int64_t chunk = 0; chunk < rows_pad; chunk += kRowChunk) {
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t nb0 = 2 * pair;
        const bool two_n = nb0 + 1 < n_blocks;
        for (int64_t m0 = chunk; m0 < std::min(chunk + kRowChunk, rows_pad); m0 += 32) {
          const bool two_m = m0 + 16 < rows_pad;
          if (two_m && two_n) tile_block<2, 2>(x_ptr, K, w_ptr, m0, nb0, rows, N, b_ptr, out_ptr, sums);
          else if (two_m) tile_block<2, 1>(x_ptr, K, w_ptr, m0, nb0, rows, N, b_ptr, out_ptr, sums);
          else if (two_n) tile_block<1, 2>(x_ptr, K, w_ptr, m0, nb0, rows, N, b_ptr, out_ptr, sums);
          else tile_block<1, 1>(x_ptr, K, w_ptr, m0, nb0, rows, N, b_ptr, out_ptr, sums);
        }
      }
    }
    _tile_release();
  });
#endif
  return out;
}
