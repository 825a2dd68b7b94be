// Weight-only quantized linear layers (4-bit and 8-bit integers, group-wise scales and optional
// zero-points) with AVX512-BF16 dot products: y = x @ W.T (+ b), W[n][k] = scale[n][g] * q[n][k] + zero[n][g]
// for g = k / group_size.
//
// A decode step is bound by the bytes of weight it streams; here each 16-column slice of the
// quantized weight is read once per 8 rows, its integers widened to bf16 in registers (one logic op
// per 32 nibbles, see kBf16Magic; an exact int -> float conversion for 8 bits), multiplied with bf16
// activations by vdpbf16ps and summed per group in float32; the group's scale (and zero-point,
// times the group's activation sum) is applied once per group.
//
// Layouts (packed once at load by pagedserve/models/quantization.py):
//   4 bits: qweight [N / 16, K / 4, 32] uint8: chunk q of slice n covers k = 4q .. 4q + 3; byte i = 2c + j
//           holds W[16 n + c][4q + j] in its low nibble and W[16 n + c][4q + 2 + j] in its high nibble,
//           each stored as q + offset (offset 8 for signed values -8..7, 0 for unsigned 0..15);
//   8 bits: qweight [N / 16, K / 2, 32] int8: chunk p of slice n covers k = 2p, 2p + 1; byte i = 2c + j
//           holds W[16 n + c][2p + j];
//   scales, zeros: [N / 16, K / group_size, 16] float16 (zeros may be empty: none).
// linear_quant_avx512: x [..., K] bf16 -> [..., N] bf16 (float32 sums, rounded once).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

#include "avx512_utils.h"
#include "bf16_matmul_blocks.h"

namespace {

#if defined(__AVX512VNNI__)
constexpr bool kHasVnni = true;  // 4-bit weights can multiply int8 activations (linear_quant_vnni)
#else
constexpr bool kHasVnni = false;
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr int kRowGroup = 8;  // rows whose sums share each weight vector
constexpr int kDirectRows = 16;  // up to this many rows, weights are widened in registers (see linear_quant_dispatch)

// 16 float16 values (a slice's scales or zero-points of one group) as float32.
inline __m512 load_half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The term each group adds per unit of activation sum: zero - scale * subtracted (zeros may be none).
inline __m512 group_zero_term(__m512 s, const at::Half* zeros, int64_t at, __m512 subtracted) {
  const __m512 z = zeros != nullptr ? load_half16(zeros + at) : _mm512_setzero_ps();
  return _mm512_fnmadd_ps(s, subtracted, z);
}

typedef int32_t __attribute__((may_alias)) bf16_pair;

// 32 int8 values (one pair row of a slice) as the bf16 operand of vdpbf16ps; exact (|q| <= 128).
inline __m512bh int8x32_to_bf16(const uint8_t* chunk) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// A 4-bit value q (0..15) OR-ed into the bf16 bit pattern of 128.0 reads as exactly 128 + q: widening
// a nibble to a vdpbf16ps operand takes one logic op; each group's sums then carry 128 (+ offset)
// times the group's activation sum, taken off with the zero-point.
constexpr int16_t kBf16Magic = 0x4300;  // bf16 128.0

// R rows x T 16-column slices: sums over all K, group by group. w: slice 0's quantized bytes, slices
// slice_bytes apart (scales and zeros slice_scales apart); xsum: [R][groups] activation sums (read
// with zeros and for 4 bits). Each (row, slice) keeps two partial sums per group, one per weight vector of a
// 4-bit chunk, so that few rows still give the dot products independent chains.
template <int Bits, int R, int T>
inline void block_rows_slices(const at::BFloat16* x, int64_t K, const uint8_t* w, int64_t slice_bytes,
                              const at::Half* scales, const at::Half* zeros, int64_t slice_scales, int64_t group_size,
                              const float* xsum, int64_t groups, int offset, const float* bias, int64_t N,
                              int64_t col0, at::BFloat16* out) {
  __m512 acc[R][T];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  const auto* pairs = reinterpret_cast<const bf16_pair*>(x);
  const int64_t k_pairs = K / 2, group_pairs = group_size / 2;
  const __m512i low_nibble = _mm512_set1_epi16(0x0F), magic = _mm512_set1_epi16(kBf16Magic);
  // 4 bits: the weights read as 128 + stored = 128 + offset + q
  const __m512 bias_per_value = _mm512_set1_ps(Bits == 4 ? 128.f + static_cast<float>(offset) : 0.f);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part0[R][T], part1[R][T];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) part0[r][t] = part1[r][t] = _mm512_setzero_ps();
    const int64_t p_begin = g * group_pairs, p_end = p_begin + group_pairs;
    if constexpr (Bits == 4) {
      for (int64_t p = p_begin; p < p_end; p += 2) {
        __m512bh w0[T], w1[T];
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) {
          const uint8_t* chunk = w + t * slice_bytes + p * 16;  // 32 bytes per 2 pairs
          // prefetch removed
          const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)));
          w0[t] = (__m512bh)_mm512_ternarylogic_epi32(words, low_nibble, magic, 0xEA);  // (words & 0x0F) | magic
          w1[t] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(words, 4), magic);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512bh x0 = (__m512bh)_mm512_set1_epi32(pairs[r * k_pairs + p]);
          const __m512bh x1 = (__m512bh)_mm512_set1_epi32(pairs[r * k_pairs + p + 1]);
#pragma GCC unroll 4
          for (int t = 0; t < T; ++t) {
            part0[r][t] = _mm512_dpbf16_ps(part0[r][t], x0, w0[t]);
            part1[r][t] = _mm512_dpbf16_ps(part1[r][t], x1, w1[t]);
          }
        }
      }
    } else {
      for (int64_t p = p_begin; p < p_end; p += 2) {  // group_size is even: pairs come two by two within groups of 4+
        __m512bh w0[T], w1[T];
        const bool two = p + 1 < p_end;
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) {
          const uint8_t* chunk = w + t * slice_bytes + p * 32;  // 32 bytes per pair
          // prefetch removed
          w0[t] = int8x32_to_bf16(chunk);
          w1[t] = two ? int8x32_to_bf16(chunk + 32) : (__m512bh)_mm512_setzero_si512();
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512bh x0 = (__m512bh)_mm512_set1_epi32(pairs[r * k_pairs + p]);
          const __m512bh x1 = (__m512bh)_mm512_set1_epi32(two ? pairs[r * k_pairs + p + 1] : 0);
#pragma GCC unroll 4
          for (int t = 0; t < T; ++t) {
            part0[r][t] = _mm512_dpbf16_ps(part0[r][t], x0, w0[t]);
            part1[r][t] = _mm512_dpbf16_ps(part1[r][t], x1, w1[t]);
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      const int64_t at = t * slice_scales + g * 16;
      const __m512 s = load_half16(scales + at);
      const __m512 z = group_zero_term(s, zeros, at, bias_per_value);  // W = s * read - s * (128 + offset) + zero
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        acc[r][t] = _mm512_fmadd_ps(_mm512_add_ps(part0[r][t], part1[r][t]), s, acc[r][t]);
        if (xsum != nullptr) acc[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), z, acc[r][t]);
      }
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < T; ++t) {
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + col0 + 16 * t) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) pagedserve::store_bf16x16(out + r * N + col0 + 16 * t, _mm512_add_ps(acc[r][t], b));
  }
}

// block_rows_slices for a runtime slice count (a thread's last block may be short).
template <int Bits, int R, int T>
inline void block_slices(int64_t slices, const at::BFloat16* x, int64_t K, const uint8_t* w, int64_t slice_bytes,
                         const at::Half* scales, const at::Half* zeros, int64_t slice_scales, int64_t group_size,
                         const float* xsum, int64_t groups, int offset, const float* bias, int64_t N, int64_t col0,
                         at::BFloat16* out) {
  if constexpr (T == 1) {
    block_rows_slices<Bits, R, 1>(x, K, w, slice_bytes, scales, zeros, slice_scales, group_size, xsum, groups, offset,
                                  bias, N, col0, out);
  } else if (slices == T) {
    block_rows_slices<Bits, R, T>(x, K, w, slice_bytes, scales, zeros, slice_scales, group_size, xsum, groups, offset,
                                  bias, N, col0, out);
  } else {
    block_slices<Bits, R, T - 1>(slices, x, K, w, slice_bytes, scales, zeros, slice_scales, group_size, xsum, groups,
                                 offset, bias, N, col0, out);
  }
}

// block_slices for a runtime row count (the last group of rows may be short).
template <int Bits, int R, int T>
inline void block_rows(int64_t rows, int64_t slices, const at::BFloat16* x, int64_t K, const uint8_t* w,
                       int64_t slice_bytes, const at::Half* scales, const at::Half* zeros, int64_t slice_scales,
                       int64_t group_size, const float* xsum, int64_t groups, int offset, const float* bias,
                       int64_t N, int64_t col0, at::BFloat16* out) {
  if constexpr (R == 1) {
    block_slices<Bits, 1, T>(slices, x, K, w, slice_bytes, scales, zeros, slice_scales, group_size, xsum, groups, offset,
                             bias, N, col0, out);
  } else if (rows == R) {
    block_slices<Bits, R, T>(slices, x, K, w, slice_bytes, scales, zeros, slice_scales, group_size, xsum, groups, offset,
                             bias, N, col0, out);
  } else {
    block_rows<Bits, R - 1, T>(rows, slices, x, K, w, slice_bytes, scales, zeros, slice_scales, group_size, xsum,
                               groups, offset, bias, N, col0, out);
  }
}

// R rows at a time (the last group shorter) over blocks of T slices.
template <int Bits, int R, int T>
void linear_quant_rows(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* w, const at::Half* scales,
                       const at::Half* zeros, int64_t group_size, int offset, const float* xsum, const float* bias,
                       int64_t n_slices, at::BFloat16* out) {
  const int64_t N = n_slices * 16, groups = K / group_size;
  const int64_t slice_bytes = Bits == 4 ? K * 8 : K * 16, slice_scales = groups * 16;
  // NOTE: threads split the output columns, so each weight byte is read from memory by one thread;
  // the row groups of one block reuse its bytes from L1/L2.
  at::parallel_for(0, n_slices, 4 * T, [&](int64_t begin, int64_t end) {
    for (int64_t s0 = begin; s0 < end; s0 += T) {
      const int64_t slices = std::min<int64_t>(T, end - s0);
      const uint8_t* ws = w + s0 * slice_bytes;
      const at::Half* ss = scales + s0 * slice_scales;
      const at::Half* zs = zeros != nullptr ? zeros + s0 * slice_scales : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += R) {
        block_rows<Bits, R, T>(std::min<int64_t>(R, M - m0), slices, x + m0 * K, K, ws, slice_bytes, ss, zs,
                               slice_scales, group_size, xsum != nullptr ? xsum + m0 * groups : nullptr, groups, offset,
                               bias, N, s0 * 16, out + m0 * N);
      }
    }
  });
}

// Many rows: the integer path would widen each weight once per 8 rows; instead each block of
// kWideSlices slices is dequantized once into bf16 (pair-interleaved, as linear_avx512_bf16 reads
// it) in a per-thread buffer that stays in L1/L2, and the bf16 register blocks (8 rows x 3 slices)
// run over it. The weights are rounded to bf16 on the way (one rounding, as a bf16 model's are).
constexpr int kWideSlices = 3;

// q (integer values as float, 32 per pair row: lanes 0-15 = columns 0-7 x 2, 16-31 = columns 8-15 x 2)
// times the columns' scale plus zero, stored as one bf16 pair row.
inline void store_dequantized_pair_row(__m512 q_lo, __m512 q_hi, __m512 s_lo, __m512 s_hi, __m512 z_lo, __m512 z_hi,
                                       at::BFloat16* dst) {
  const __m512 lo = _mm512_fmadd_ps(q_lo, s_lo, z_lo), hi = _mm512_fmadd_ps(q_hi, s_hi, z_hi);
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// One slice [K / 2, 16, 2] bf16 from its quantized bytes, scales and zeros.
template <int Bits>
void dequantize_slice(const uint8_t* w, const at::Half* scales, const at::Half* zeros, int64_t K, int64_t group_size,
                      int offset, at::BFloat16* dst) {
  const __m512i pair_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i pair_hi = _mm512_add_epi32(pair_lo, _mm512_set1_epi32(8));
  const __m512i low_nibble = _mm512_set1_epi16(0x0F);
  const int64_t groups = K / group_size, group_pairs = group_size / 2;
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 s = load_half16(scales + g * 16);
    const __m512 z = group_zero_term(s, zeros, g * 16, _mm512_set1_ps(static_cast<float>(offset)));  // stored = q + offset
    const __m512 s_lo = _mm512_permutexvar_ps(pair_lo, s), s_hi = _mm512_permutexvar_ps(pair_hi, s);
    const __m512 z_lo = _mm512_permutexvar_ps(pair_lo, z), z_hi = _mm512_permutexvar_ps(pair_hi, z);
    for (int64_t p = g * group_pairs; p < (g + 1) * group_pairs; p += (Bits == 4 ? 2 : 1)) {
      if constexpr (Bits == 4) {
        const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 16)));
        const __m512i low = _mm512_and_si512(words, low_nibble), high = _mm512_srli_epi16(words, 4);
        store_dequantized_pair_row(_mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(low))),
                                   _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(low, 1))), s_lo,
                                   s_hi, z_lo, z_hi, dst + p * 32);
        store_dequantized_pair_row(_mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(high))),
                                   _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(high, 1))), s_lo,
                                   s_hi, z_lo, z_hi, dst + (p + 1) * 32);
      } else {
        const uint8_t* chunk = w + p * 32;
        store_dequantized_pair_row(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk)))),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 16)))), s_lo,
            s_hi, z_lo, z_hi, dst + p * 32);
      }
    }
  }
}

template <int Bits>
void linear_quant_wide(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* w, const at::Half* scales,
                       const at::Half* zeros, int64_t group_size, int offset, const float* bias, int64_t n_slices,
                       at::BFloat16* out) {
  const int64_t N = n_slices * 16, groups = K / group_size, slice_elems = K * 16;
  const int64_t slice_bytes = Bits == 4 ? K * 8 : K * 16, slice_scales = groups * 16;
  at::parallel_for(0, n_slices, kWideSlices, [&](int64_t begin, int64_t end) {
    std::vector<at::BFloat16> buffer(kWideSlices * slice_elems);  // this thread's dequantized block
    for (int64_t s0 = begin; s0 < end; s0 += kWideSlices) {
      const int64_t slices = std::min<int64_t>(kWideSlices, end - s0);
      for (int64_t t = 0; t < slices; ++t) {
        const int64_t s = s0 + t;
        dequantize_slice<Bits>(w + s * slice_bytes, scales + s * slice_scales,
                               zeros != nullptr ? zeros + s * slice_scales : nullptr, K, group_size, offset,
                               buffer.data() + t * slice_elems);
      }
      for (int64_t m0 = 0; m0 < M; m0 += kRowGroup) {
        pagedserve::bf16_blocks::block_rows<kRowGroup, kWideSlices, 32>(std::min<int64_t>(kRowGroup, M - m0), slices,
                                                                         x + m0 * K, K, buffer.data(), slice_elems, N,
                                                                         s0 * 16, bias, out + m0 * N);
      }
    }
  });
}

// Few rows: more slices per block, so that the dot products have independent chains.
#if defined(__AVX512VNNI__)
// 4-bit weights with int8 activations (any row count; the default for 4 bits where the CPU has
// AVX512-VNNI): integer dot products (vpdpbusd, 4 products per lane where vdpbf16ps has 2) against
// activations quantized to int8 per row and weight group (scale = the group's max |x| / 127, as
// llama.cpp's Q8 activations), summed exactly in int32 per group and scaled once per group. A
// chunk's 32 bytes widen into the 16 lanes of 4 consecutive nibbles each with one shift and one
// logic op. About 2x fewer instructions per weight than the bf16 paths, at every row count.
struct QuantizedRows {
  std::vector<int8_t> values;  // [M, K]
  std::vector<float> scales;   // [M, groups]
  std::vector<float> sums;     // [M, groups]: sum of the quantized x (times its scale), for zero-points and offsets
};

inline QuantizedRows quantize_rows(const at::BFloat16* x, int64_t M, int64_t K, int64_t group_size) {
  const int64_t groups = K / group_size;
  QuantizedRows q{std::vector<int8_t>(M * K), std::vector<float>(M * groups), std::vector<float>(M * groups)};
  for (int64_t i = 0; i < M * groups; ++i) {
    const at::BFloat16* xg = x + i * group_size;
    float amax = 0.f;
    for (int64_t j = 0; j < group_size; ++j) amax = std::max(amax, std::fabs(static_cast<float>(xg[j])));
    const float scale = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
    int32_t qsum = 0;  // the quantized values' sum: offsets and zero-points then cancel exactly
    for (int64_t j = 0; j < group_size; ++j) {
      const int8_t v = static_cast<int8_t>(std::nearbyint(static_cast<float>(xg[j]) * inverse));
      q.values[i * group_size + j] = v;
      qsum += v;
    }
    q.scales[i] = scale;
    q.sums[i] = scale * static_cast<float>(qsum);
  }
  return q;
}

template <int R, int T>
inline void vnni_block(const int8_t* qx, const float* sx, const float* xsum, int64_t K, const uint8_t* w,
                       int64_t slice_bytes, const at::Half* scales, const at::Half* zeros, int64_t slice_scales,
                       int64_t group_size, int64_t groups, int offset, const float* bias, int64_t N, int64_t col0,
                       at::BFloat16* out) {
  __m512 acc[R][T];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  typedef int32_t __attribute__((may_alias)) quad;
  const auto* quads = reinterpret_cast<const quad*>(qx);
  const int64_t k_quads = K / 4, group_quads = group_size / 4;
  const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[R][T];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) dot[r][t] = _mm512_setzero_si512();
    for (int64_t q = g * group_quads; q < (g + 1) * group_quads; ++q) {
      __m512i wv[T];
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        // lane c: bytes 2c and 2c+1 of the chunk; low nibbles are k = 4q, 4q+1, high ones 4q+2, 4q+3
        const __m512i d = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + t * slice_bytes + q * 32)));
        wv[t] = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), nibbles, 0xA8);  // (d | d << 12) & 0x0F0F0F0F
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i xq = _mm512_set1_epi32(quads[r * k_quads + q]);
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], wv[t], xq);
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      const int64_t at = t * slice_scales + g * 16;
      const __m512 s = load_half16(scales + at);
      const __m512 z = group_zero_term(s, zeros, at, _mm512_set1_ps(static_cast<float>(offset)));  // stored = q + offset
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 scale = _mm512_mul_ps(s, _mm512_set1_ps(sx[r * groups + g]));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][t]), scale, acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), z, acc[r][t]);
      }
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < T; ++t) {
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + col0 + 16 * t) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) pagedserve::store_bf16x16(out + r * N + col0 + 16 * t, _mm512_add_ps(acc[r][t], b));
  }
}

template <int R, int T>
inline void vnni_rows(int64_t rows, int64_t slices, const int8_t* qx, const float* sx, const float* xsum, int64_t K,
                      const uint8_t* w, int64_t slice_bytes, const at::Half* scales, const at::Half* zeros,
                      int64_t slice_scales, int64_t group_size, int64_t groups, int offset, const float* bias,
                      int64_t N, int64_t col0, at::BFloat16* out) {
  if constexpr (R > 1) {
    if (rows < R) {
      vnni_rows<R - 1, T>(rows, slices, qx, sx, xsum, K, w, slice_bytes, scales, zeros, slice_scales, group_size,
                          groups, offset, bias, N, col0, out);
      return;
    }
  }
  if constexpr (T > 1) {
    if (slices < T) {
      vnni_rows<R, T - 1>(rows, slices, qx, sx, xsum, K, w, slice_bytes, scales, zeros, slice_scales, group_size,
                          groups, offset, bias, N, col0, out);
      return;
    }
  }
  vnni_block<R, T>(qx, sx, xsum, K, w, slice_bytes, scales, zeros, slice_scales, group_size, groups, offset, bias, N,
                   col0, out);
}

template <int R, int T>
void linear_quant_vnni(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* w, const at::Half* scales,
                       const at::Half* zeros, int64_t group_size, int offset, const float* bias, int64_t n_slices,
                       at::BFloat16* out) {
  const int64_t N = n_slices * 16, groups = K / group_size;
  const int64_t slice_bytes = K * 8, slice_scales = groups * 16;
  const QuantizedRows q = quantize_rows(x, M, K, group_size);
  at::parallel_for(0, n_slices, 4 * T, [&](int64_t begin, int64_t end) {
    for (int64_t s0 = begin; s0 < end; s0 += T) {
      const int64_t slices = std::min<int64_t>(T, end - s0);
      for (int64_t m0 = 0; m0 < M; m0 += R) {
        vnni_rows<R, T>(std::min<int64_t>(R, M - m0), slices, q.values.data() + m0 * K, q.scales.data() + m0 * groups,
                        q.sums.data() + m0 * groups, K, w + s0 * slice_bytes, slice_bytes, scales + s0 * slice_scales,
                        zeros != nullptr ? zeros + s0 * slice_scales : nullptr, slice_scales, group_size, groups, offset,
                        bias, N, s0 * 16, out + m0 * N);
      }
    }
  });
}
#endif

// With int8 activations (4 bits, VNNI): linear_quant_vnni. Otherwise up to kDirectRows rows: weights
// widened to bf16 in registers; more: dequantized blocks (see kWideSlices).
template <int Bits>
void linear_quant_dispatch(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* w, const at::Half* scales,
                           const at::Half* zeros, int64_t group_size, int offset, const float* xsum, const float* bias,
                           int64_t n_slices, at::BFloat16* out, bool use_vnni) {
#if defined(__AVX512VNNI__)
  if constexpr (Bits == 4) {
    if (use_vnni) {
      if (M <= 2) {
        linear_quant_vnni<2, 4>(x, M, K, w, scales, zeros, group_size, offset, bias, n_slices, out);
      } else {
        linear_quant_vnni<kRowGroup, 1>(x, M, K, w, scales, zeros, group_size, offset, bias, n_slices, out);
      }
      return;
    }
  }
#endif
  if (M <= 2) {
    linear_quant_rows<Bits, 2, 4>(x, M, K, w, scales, zeros, group_size, offset, xsum, bias, n_slices, out);
    return;
  }
  if (M <= 4) {
    linear_quant_rows<Bits, 4, 2>(x, M, K, w, scales, zeros, group_size, offset, xsum, bias, n_slices, out);
  } else if (M <= kDirectRows) {
    linear_quant_rows<Bits, kRowGroup, 1>(x, M, K, w, scales, zeros, group_size, offset, xsum, bias, n_slices, out);
  } else {
    linear_quant_wide<Bits>(x, M, K, w, scales, zeros, group_size, offset, bias, n_slices, out);
  }
}
#endif

}  // namespace

bool has_quant_linear() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

bool has_int8_activation_linear() { return has_quant_linear() && kHasVnni; }

torch::Tensor linear_quant_avx512(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros,
                                  int64_t bits, int64_t group_size, int64_t offset, c10::optional<torch::Tensor> bias,
                                  bool int8_activations) {
  TORCH_CHECK(has_quant_linear(), "linear_quant_avx512: these kernels were built without AVX512-BF16");
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x must be bfloat16 [..., in] on the CPU");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(qweight.dim() == 3 && qweight.size(2) == 32 && qweight.is_contiguous() && qweight.element_size() == 1,
              "qweight must be a packed [N / 16, chunks, 32] byte tensor");
  const int64_t K = x.size(-1), n_slices = qweight.size(0), N = n_slices * 16;
  TORCH_CHECK(qweight.size(1) * (bits == 4 ? 4 : 2) == K, "x has ", K, " features, the weight ",
              qweight.size(1) * (bits == 4 ? 4 : 2));
  TORCH_CHECK(group_size > 0 && K % group_size == 0 && group_size % (bits == 4 ? 4 : 2) == 0,
              "group_size ", group_size, " must divide ", K, " and be a multiple of ", bits == 4 ? 4 : 2);
  const int64_t groups = K / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == n_slices * groups * 16,
              "scales must be float16 [N / 16, groups, 16]");
  const bool has_zeros = zeros.numel() > 0;
  TORCH_CHECK(!has_zeros || (zeros.scalar_type() == at::kHalf && zeros.is_contiguous() && zeros.numel() == scales.numel()),
              "zeros must be empty or float16 like scales");
  TORCH_CHECK(offset >= 0 && offset < 16, "offset must be in [0, 16)");
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
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  // [M, groups]: each group's activation sum, for the zero-points and the 4-bit values' bias
  std::vector<float> xsum;
  const bool use_vnni = kHasVnni && int8_activations && bits == 4;
  const bool need_xsum = (has_zeros || bits == 4) && M <= kDirectRows && !use_vnni;
  if (need_xsum) {
    xsum.assign(M * groups, 0.f);
    const auto* xr = rows.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M * groups; ++i) {
      float sum = 0.f;
      for (int64_t j = 0; j < group_size; ++j) sum += static_cast<float>(xr[i * group_size + j]);
      xsum[i] = sum;
    }
  }
  const auto* x_ptr = rows.data_ptr<at::BFloat16>();
  const auto* w_ptr = static_cast<const uint8_t*>(qweight.data_ptr());
  const auto* s_ptr = scales.data_ptr<at::Half>();
  const at::Half* z_ptr = has_zeros ? zeros.data_ptr<at::Half>() : nullptr;
  const float* xs_ptr = need_xsum ? xsum.data() : nullptr;
  const float* b_ptr = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
  auto* out_ptr = out.data_ptr<at::BFloat16>();
  if (bits == 4) {
    linear_quant_dispatch<4>(x_ptr, M, K, w_ptr, s_ptr, z_ptr, group_size, static_cast<int>(offset), xs_ptr, b_ptr, n_slices,
                         out_ptr, use_vnni);
  } else {
    linear_quant_dispatch<8>(x_ptr, M, K, w_ptr, s_ptr, z_ptr, group_size, 0, xs_ptr, b_ptr, n_slices, out_ptr, false);
  }
#endif
  return out;
}
