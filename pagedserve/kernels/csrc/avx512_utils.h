// Shared AVX-512 helpers for the CPU kernels: bf16 <-> float32 conversion (round to nearest even,
// as c10::BFloat16 does), tail masks, a vectorized exp, a max and an in-place softmax.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace pagedserve {

inline __m512 load_bf16x16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store_bf16x16(at::BFloat16* p, __m512 v) {
  // round to nearest even, as c10::BFloat16 does for finite values
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

// exp(x) as 2^(x log2 e) with a degree-6 polynomial for 2^f on f in [-0.5, 0.5]; relative error
// ~2e-7; inputs below -87 give 0, inputs above ~88 give inf.
inline __m512 exp_avx512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));  // f * ln 2
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Lanes [0, n) of 16: all of them for n >= 16, none for n <= 0.
inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1u);
}

// max(s[0:len]), -inf for len 0; nothing past len is read.
inline float max_avx512(const float* s, int64_t len) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 m = tail_mask(len - t);
    vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_maskz_loadu_ps(m, s + t));
  }
  return _mm512_reduce_max_ps(vmax);
}

// In place: s[0:len] = softmax(s[0:len]).
inline void softmax_avx512(float* s, int64_t len) {
  const int64_t vec_end = len - len % 16;
  const float mx = max_avx512(s, len);
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t t = 0; t < vec_end; t += 16) {
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + t), vmx));
    _mm512_storeu_ps(s + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  float sum = _mm512_reduce_add_ps(vsum);
  for (int64_t t = vec_end; t < len; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  const __m512 vinv = _mm512_set1_ps(1.f / sum);
  for (int64_t t = 0; t < vec_end; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), vinv));
  for (int64_t t = vec_end; t < len; ++t) s[t] *= 1.f / sum;
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// Lanes [0, n) of 16 bf16 values as float32; the others read as 0 (nothing past n is touched).
inline __m512 load_bf16_masked(const at::BFloat16* p, int64_t n) {
  const __m256i raw = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1u), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Lanes [0, n) stored as bf16.
inline void store_bf16_masked(at::BFloat16* p, __m512 v, int64_t n) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1u), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

// v rounded to the nearest bf16 and widened back: what a bf16 tensor op stores for a float result.
inline __m512 round_bf16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
#endif  // AVX512BW && AVX512VL

#if defined(__AVX512BF16__)
// 32 bf16 values held in an integer register, as the operand type of vdpbf16ps.
inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }
#endif

}  // namespace pagedserve
#endif
