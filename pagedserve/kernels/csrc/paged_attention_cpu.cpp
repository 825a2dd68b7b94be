// Paged decode attention for CPUs: one query token per sequence attends to its whole context,
// read in place through the block table (no gather copy). Accumulates in float32.
//
// q:            [num_seqs, num_heads, head_dim]
// kv_cache:     [2, num_blocks, block_size, num_kv_heads, head_dim]  (0 = keys, 1 = values)
// block_tables: [num_seqs, max_num_blocks] int64
// seq_lens:     [num_seqs] int64
// returns       [num_seqs, num_heads, head_dim] in q's dtype
//
// write_kv_cache_ stores each new token's keys and values at its slot (block * block_size + offset).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "amx_utils.h"
#include "avx512_utils.h"
#include "paged_kv_layout.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

#if defined(__AVX512F__)
using pagedserve::exp_avx512;
using pagedserve::max_avx512;
using pagedserve::tail_mask;
using pagedserve::softmax_avx512;
using pagedserve::load_bf16x16;
using pagedserve::store_bf16x16;
#endif

// The shapes of one decode call, and where each context token of a sequence lives in the cache.
struct DecodeLayout {
  int64_t num_seqs, num_heads, num_kv_heads, group, block_size, max_num_blocks;
  int64_t token_stride;   // elements between consecutive slots: num_kv_heads * head_dim
  int64_t values_offset;  // elements from the first key to the first value
  const int64_t* tables;
  const int64_t* lens;

  DecodeLayout(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
               const torch::Tensor& seq_lens)
      : num_seqs(q.size(0)), num_heads(q.size(1)), num_kv_heads(kv_cache.size(3)), group(num_heads / num_kv_heads),
        block_size(kv_cache.size(2)), max_num_blocks(block_tables.size(1)), token_stride(num_kv_heads * q.size(2)),
        values_offset(kv_cache.size(1) * kv_cache.size(2) * token_stride),
        tables(block_tables.data_ptr<int64_t>()), lens(seq_lens.data_ptr<int64_t>()) {}

  // fn(first_seq, end_seq) once per thread, on contiguous runs of sequences of about equal work
  // (context tokens plus a fixed cost per sequence). at::parallel_for alone splits by count, and a
  // few long contexts among short ones (a mixed load) would leave the other thread waiting.
  template <typename F>
  void parallel_over_sequences(const F& fn) const {
    constexpr int64_t kCostPerSequence = 64;  // in context tokens: queries, softmax, output
    const int64_t parts = std::min<int64_t>(at::get_num_threads(), num_seqs);
    if (parts <= 1) {
      fn(0, num_seqs);
      return;
    }
    int64_t total = 0;
    for (int64_t seq = 0; seq < num_seqs; ++seq) total += lens[seq] + kCostPerSequence;
    std::vector<int64_t> bounds(parts + 1, num_seqs);
    bounds[0] = 0;
    int64_t done = 0, part = 1;
    for (int64_t seq = 0; seq < num_seqs && part < parts; ++seq) {
      done += lens[seq] + kCostPerSequence;
      while (part < parts && done * parts >= total * part) bounds[part++] = seq + 1;
    }
    at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) fn(bounds[p], bounds[p + 1]);
    });
  }

  // rows[t] = element offset of context token t (t < len) of sequence seq within the keys (or the values)
  void rows(int64_t seq, int64_t len, std::vector<int64_t>& rows) const {
    pagedserve::context_rows(tables + seq * max_num_blocks, block_size, token_stride, len, rows);
  }
};

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <typename scalar_t>
void decode_attention_kernel(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                             const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  const int64_t head_dim = q.size(2);
  const DecodeLayout L(q, kv_cache, block_tables, seq_lens);

  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_base = kv_cache.data_ptr<scalar_t>();
  const scalar_t* v_base = k_base + L.values_offset;
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, L.num_seqs * L.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(L.group * head_dim);
    std::vector<float> acc(L.group * head_dim);
    std::vector<float> scores;
    std::vector<float> row(head_dim);
    std::vector<int64_t> rows;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t seq = work / L.num_kv_heads;
      const int64_t kv_head = work % L.num_kv_heads;
      const int64_t len = L.lens[seq];
      L.rows(seq, len, rows);
      for (int64_t g = 0; g < L.group; ++g) {
        const scalar_t* src = q_ptr + (seq * L.num_heads + kv_head * L.group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = to_float(src[d]) * fscale;
      }
      scores.assign(L.group * len, 0.f);
      // scores[g][t] = q_g . k_t  (each key row converted to float once, used by the whole group)
      for (int64_t t = 0; t < len; ++t) {
        const scalar_t* k = k_base + rows[t] + kv_head * head_dim;
        float* kf = row.data();
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) kf[d] = to_float(k[d]);
        for (int64_t g = 0; g < L.group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * kf[d];
          scores[g * len + t] = s;
        }
      }
      // softmax over t, per query head
      for (int64_t g = 0; g < L.group; ++g) {
        float* sg = scores.data() + g * len;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      // acc[g] = sum_t p[g][t] * v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const scalar_t* v = v_base + rows[t] + kv_head * head_dim;
        float* vf = row.data();
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) vf[d] = to_float(v[d]);
        for (int64_t g = 0; g < L.group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * vf[d];
        }
      }
      for (int64_t g = 0; g < L.group; ++g) {
        scalar_t* dst = out_ptr + (seq * L.num_heads + kv_head * L.group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });
}

#if defined(__AVX512F__)
// AVX-512 path for bf16 caches and head_dim = 16 * DV: one key/value row is converted once into
// DV registers and used by every query head of its group.
template <int DV>
void decode_attention_bf16_avx512(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                                  const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  constexpr int64_t head_dim = 16 * DV;
  const DecodeLayout L(q, kv_cache, block_tables, seq_lens);
  const auto* q_ptr = q.data_ptr<at::BFloat16>();
  const auto* k_base = kv_cache.data_ptr<at::BFloat16>();
  const auto* v_base = k_base + L.values_offset;
  auto* out_ptr = out.data_ptr<at::BFloat16>();
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));

  // NOTE: one work item is a whole sequence, so each cached row (all KV heads) is read once,
  // front to back, which keeps the hardware prefetcher streaming.
  L.parallel_over_sequences([&](int64_t begin, int64_t end) {
    std::vector<__m512> qv(L.num_heads * DV);
    std::vector<__m512> acc(L.num_heads * DV);
    std::vector<float> scores;
    std::vector<int64_t> rows;
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = L.lens[seq];
      L.rows(seq, len, rows);
      for (int64_t h = 0; h < L.num_heads; ++h) {
        const auto* src = q_ptr + (seq * L.num_heads + h) * head_dim;
        for (int d = 0; d < DV; ++d) qv[h * DV + d] = _mm512_mul_ps(load_bf16x16(src + 16 * d), vscale);
      }
      scores.resize(L.num_heads * len);
      for (int64_t t = 0; t < len; ++t) {
        const auto* k_row = k_base + rows[t];
        for (int64_t kv_head = 0; kv_head < L.num_kv_heads; ++kv_head) {
          __m512 kr[DV];
          for (int d = 0; d < DV; ++d) kr[d] = load_bf16x16(k_row + kv_head * head_dim + 16 * d);
          for (int64_t h = kv_head * L.group; h < (kv_head + 1) * L.group; ++h) {
            __m512 s = _mm512_mul_ps(qv[h * DV], kr[0]);
            for (int d = 1; d < DV; ++d) s = _mm512_fmadd_ps(qv[h * DV + d], kr[d], s);
            scores[h * len + t] = _mm512_reduce_add_ps(s);
          }
        }
      }
      for (int64_t h = 0; h < L.num_heads; ++h) softmax_avx512(scores.data() + h * len, len);
      for (auto& a : acc) a = _mm512_setzero_ps();
      for (int64_t t = 0; t < len; ++t) {
        const auto* v_row = v_base + rows[t];
        for (int64_t kv_head = 0; kv_head < L.num_kv_heads; ++kv_head) {
          __m512 vr[DV];
          for (int d = 0; d < DV; ++d) vr[d] = load_bf16x16(v_row + kv_head * head_dim + 16 * d);
          for (int64_t h = kv_head * L.group; h < (kv_head + 1) * L.group; ++h) {
            const __m512 p = _mm512_set1_ps(scores[h * len + t]);
            for (int d = 0; d < DV; ++d) acc[h * DV + d] = _mm512_fmadd_ps(p, vr[d], acc[h * DV + d]);
          }
        }
      }
      for (int64_t h = 0; h < L.num_heads; ++h) {
        auto* dst = out_ptr + (seq * L.num_heads + h) * head_dim;
        for (int d = 0; d < DV; ++d) store_bf16x16(dst + 16 * d, acc[h * DV + d]);
      }
    }
  });
}
#endif

#if defined(__AVX512BF16__)
// Sums of 16 vectors at once: element j of the result is the sum of all 16 lanes of v[j].
// A transpose-and-add tree (45 instructions) instead of 16 horizontal reductions (~8 each).
inline __m512 hsum16_avx512(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int m = 0; m < 4; ++m) {  // per 128-bit lane L: the lane-L sums of v[4m .. 4m+3]
    const __m512d c = _mm512_castps_pd(w[2 * m]), d = _mm512_castps_pd(w[2 * m + 1]);
    x[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  const __m512 p01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 p23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(p01, p23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(p01, p23, _MM_SHUFFLE(3, 1, 3, 1)));
}

using pagedserve::as_bh;

// Rows are prefetched twice: into L1 a few tokens ahead of use, and into L2 far ahead, so that the
// L1 requests (at most ~16 line fills in flight per core) find their lines in L2 instead of
// memory. Both are issued a few rows at a time inside the compute loops: a burst of ~100
// prefetches stalls the core until line-fill buffers free up, and then compute and memory stop
// overlapping (measurements in docs/design/cpu-performance.md).
constexpr int64_t kPrefetchAhead = 24;       // key rows (all KV heads), into L1, in context tokens
constexpr int64_t kFarPrefetchAhead = 128;   // key rows, into L2
// Values are read one KV head (a slice of each row) at a time, so each token takes less time: look further ahead.
constexpr int64_t kValuePrefetchAhead = 2 * kPrefetchAhead;
constexpr int64_t kFarValuePrefetchAhead = 2 * kFarPrefetchAhead;
// A sequence's first rows have no earlier tokens to be prefetched behind: while one sequence's keys
// are scored, its first kStartRows value rows and the next sequence's first kStartRows key rows go
// into L2, kStartRowsPerStep rows per key-pass step. It pays at short contexts (16-100 tokens)
// and makes no difference from a few hundred on.
constexpr int64_t kStartRows = 32, kStartRowsPerStep = 4;

// Ask for one cached token row ahead of use: rows sit in blocks scattered over the cache, so the
// hardware prefetcher loses the stream at every block boundary.
// Hint: _MM_HINT_T0 into L1 (the default), _MM_HINT_T1 into L2.
template <int Hint = _MM_HINT_T0>
inline void prefetch_row(const uint16_t* row, int64_t elements) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < elements * 2; off += 64) _mm_prefetch(p + off, static_cast<_mm_hint>(Hint));
}

// prefetch_row for the tokens t + ahead, t in [first, last), that lie before len.
template <int Hint = _MM_HINT_T0>
inline void prefetch_rows_ahead(const uint16_t* base, const int64_t* rows, int64_t first, int64_t last, int64_t ahead,
                                int64_t len, int64_t elements) {
  for (int64_t t = first + ahead; t < std::min(last + ahead, len); ++t) prefetch_row<Hint>(base + rows[t], elements);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
using pagedserve::amx_tiles_usable;
using pagedserve::TileConfig;

// Scores of 16 context tokens against one KV head's group of query heads with AMX:
// tile 1 = 16 key rows x 32 dims (read in place, rows token_stride apart), tile 2 = the group's
// queries for those 32 dims in the pair-interleaved (VNNI) layout, tile 0 += tile 1 x tile 2,
// i.e. [16 tokens, group] float32.
struct AmxScoreTiles {
  explicit AmxScoreTiles(int64_t group) { configure(group); }
  // (Again) the shapes above; loading a configuration clears every tile.
  static void configure(int64_t group) {
    TileConfig config;
    config.rows[0] = 16;
    config.colsb[0] = static_cast<uint16_t>(group * 4);
    config.rows[1] = 16;
    config.colsb[1] = 64;
    config.rows[2] = 16;
    config.colsb[2] = static_cast<uint16_t>(group * 4);
    _tile_loadconfig(&config);
  }
  ~AmxScoreTiles() { _tile_release(); }
  AmxScoreTiles(const AmxScoreTiles&) = delete;
  AmxScoreTiles& operator=(const AmxScoreTiles&) = delete;
};

// q_vnni[c][r][g][j] = q_g[32c + 2r + j]: the group's queries as tile-2 operands, one per 32-dim chunk c.
inline void pack_group_queries(const uint16_t* q_group, int64_t group, int64_t head_dim, uint16_t* q_vnni) {
  for (int64_t c = 0; c < head_dim / 32; ++c) {
    for (int64_t r = 0; r < 16; ++r) {
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t j = 0; j < 2; ++j) q_vnni[((c * 16 + r) * group + g) * 2 + j] = q_group[g * head_dim + 32 * c + 2 * r + j];
      }
    }
  }
}
#endif

// How many query heads accumulate their values together: their float32 sums stay in registers.
template <int NC>
constexpr int64_t kMaxValueHeads = NC <= 2 ? 6 : 3;

// out[g][d] = sum_t p_g[t] * v_t[d] for G query heads sharing one KV head, t < len: two tokens
// at a time, their value rows interleaved so that one vdpbf16ps adds p_t * v_t + p_t+1 * v_t+1.
// v_head: that KV head's first value element; rows: token row offsets; probs: G rows len_pad apart.
template <int NC, int G>
void accumulate_values_for(const uint16_t* v_head, const int64_t* rows, int64_t len,
                           const uint16_t* probs, int64_t len_pad, float* out) {
  constexpr int64_t head_dim = 32 * NC;
  __m512 acc[G][NC][2];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) acc[g][c][0] = acc[g][c][1] = _mm512_setzero_ps();
  }
  prefetch_rows_ahead(v_head, rows, 0, kValuePrefetchAhead, 0, len, head_dim);
  for (int64_t t = 0; t < len; t += 2) {
    prefetch_rows_ahead(v_head, rows, t, t + 2, kValuePrefetchAhead, len, head_dim);
    const uint16_t* a_row = v_head + rows[t];
    const bool has_b = t + 1 < len;  // never read past the context: a stale slot may hold anything
    __m512i vlo[NC], vhi[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) {
      const __m512i a = _mm512_loadu_si512(a_row + 32 * c);
      const __m512i b = has_b ? _mm512_loadu_si512(v_head + rows[t + 1] + 32 * c) : _mm512_setzero_si512();
      vlo[c] = _mm512_unpacklo_epi16(a, b);  // per 128-bit lane L: dims 8L..8L+3 of a and b, interleaved
      vhi[c] = _mm512_unpackhi_epi16(a, b);  // dims 8L+4..8L+7
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      uint32_t pair;
      std::memcpy(&pair, probs + g * len_pad + t, sizeof(pair));  // p_t (low half), p_t+1 (high)
      const __m512i p = _mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) {
        acc[g][c][0] = _mm512_dpbf16_ps(acc[g][c][0], as_bh(p), as_bh(vlo[c]));
        acc[g][c][1] = _mm512_dpbf16_ps(acc[g][c][1], as_bh(p), as_bh(vhi[c]));
      }
    }
  }
  alignas(64) float lo[16], hi[16];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NC; ++c) {  // undo the interleaving: position 4L + r holds dim 8L + r (lo) / 8L + 4 + r (hi)
      _mm512_store_ps(lo, acc[g][c][0]);
      _mm512_store_ps(hi, acc[g][c][1]);
      for (int lane = 0; lane < 4; ++lane) {
        for (int r = 0; r < 4; ++r) {
          out[g * head_dim + 32 * c + 8 * lane + r] = lo[4 * lane + r];
          out[g * head_dim + 32 * c + 8 * lane + 4 + r] = hi[4 * lane + r];
        }
      }
    }
  }
}

template <int NC>
void accumulate_values(int64_t heads, const uint16_t* v_head, const int64_t* rows, int64_t len,
                       const uint16_t* probs, int64_t len_pad, float* out) {
  switch (heads) {
    case 1: return accumulate_values_for<NC, 1>(v_head, rows, len, probs, len_pad, out);
    case 2: return accumulate_values_for<NC, 2>(v_head, rows, len, probs, len_pad, out);
    case 3: return accumulate_values_for<NC, 3>(v_head, rows, len, probs, len_pad, out);
    case 4: if constexpr (kMaxValueHeads<NC> >= 4) return accumulate_values_for<NC, 4>(v_head, rows, len, probs, len_pad, out);
    [[fallthrough]];
    case 5: if constexpr (kMaxValueHeads<NC> >= 5) return accumulate_values_for<NC, 5>(v_head, rows, len, probs, len_pad, out);
    [[fallthrough]];
    case 6: if constexpr (kMaxValueHeads<NC> >= 6) return accumulate_values_for<NC, 6>(v_head, rows, len, probs, len_pad, out);
    [[fallthrough]];
    default: TORCH_CHECK(false, "accumulate_values: bad head count ", heads);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Below this many context tokens the two tile reconfigurations per sequence cost more than the
// tile multiplies save (even at 80 tokens, ahead at 150 since the softmax is folded into the value
// rounds).
constexpr int64_t kAmxValueMinTokens = 128;

// The value sums of one KV head's group of query heads with AMX, for head_dim = 64. Tiles (this
// configuration replaces the score tiles' shapes): 0 = the group's probabilities for 32 tokens
// [group, 32] bf16; 1 and 2 = values of 16 token pairs x 16 dims, each pair's two rows interleaved
// (VNNI); 4-7 = the float32 sums [group, 16 dims] of the four dim slices.
inline void configure_value_tiles(int64_t group) {
  TileConfig config;
  config.rows[0] = static_cast<uint8_t>(group);
  config.colsb[0] = 64;
  for (int t = 1; t <= 2; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  for (int t = 4; t < 8; ++t) {
    config.rows[t] = static_cast<uint8_t>(group);
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// out[g][d] = sum_t softmax(scores_g)[t] * v_t[d] for t < len, head_dim 64, 32 tokens per round:
// each pair of value rows is interleaved as the vdpbf16ps path does (unpacklo / unpackhi per
// 128-bit lane) into a staging buffer that the tile loads read; the sums come out in that
// interleaved dim order. The softmax is folded in: each round computes exp(score - max) for its
// 32 tokens (rounded to bf16 for the tiles), and the sums are divided by the exponentials' float
// sum at the end, so the exponentials overlap the value reads. v_head: the KV head's first value
// element; scores: the group's scaled scores, rows len_pad apart, len_pad a multiple of 32 (rows
// past len are never read: a stale slot may hold NaN).
inline void accumulate_values_amx(const uint16_t* v_head, const int64_t* rows, int64_t len, const float* scores,
                                  int64_t len_pad, int64_t group, float* out) {
  alignas(64) uint16_t staged[4][16][32];  // [dims 0-31 lo, dims 0-31 hi, dims 32-63 lo, hi][token pair][pair-interleaved]
  alignas(64) float sums[4][16][16];       // [slice][query head][column]
  alignas(64) uint16_t probs[16][32];      // [query head][token of the round]: exp(score - max) as bf16
  __m512 vmax[16], vsum[16];
  for (int64_t g = 0; g < group; ++g) {
    vmax[g] = _mm512_set1_ps(max_avx512(scores + g * len_pad, len));
    vsum[g] = _mm512_setzero_ps();
  }
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  prefetch_rows_ahead(v_head, rows, 0, kValuePrefetchAhead, 0, len, 64);
  for (int64_t t0 = 0; t0 < len; t0 += 32) {
    for (int64_t pair = 0; pair < 16; ++pair) {
      const int64_t t = t0 + 2 * pair;
      prefetch_rows_ahead(v_head, rows, t, t + 2, kValuePrefetchAhead, len, 64);
      prefetch_rows_ahead<_MM_HINT_T1>(v_head, rows, t, t + 2, kFarValuePrefetchAhead, len, 64);
      for (int c = 0; c < 2; ++c) {
        const __m512i a = t < len ? _mm512_loadu_si512(v_head + rows[t] + 32 * c) : _mm512_setzero_si512();
        const __m512i b = t + 1 < len ? _mm512_loadu_si512(v_head + rows[t + 1] + 32 * c) : _mm512_setzero_si512();
        _mm512_store_si512(staged[2 * c][pair], _mm512_unpacklo_epi16(a, b));
        _mm512_store_si512(staged[2 * c + 1][pair], _mm512_unpackhi_epi16(a, b));
      }
    }
    // this round's probabilities, not yet divided by their sum (the sums are, at the end): the
    // exponentials run here, between value reads, rather than in a pass of their own before them
    const __mmask16 m0 = tail_mask(len - t0), m1 = tail_mask(len - t0 - 16);
    for (int64_t g = 0; g < group; ++g) {
      const float* s = scores + g * len_pad + t0;
      const __m512 e0 = _mm512_maskz_mov_ps(m0, exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(s), vmax[g])));
      const __m512 e1 = _mm512_maskz_mov_ps(m1, exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + 16), vmax[g])));
      vsum[g] = _mm512_add_ps(vsum[g], _mm512_add_ps(e0, e1));
      _mm512_store_si512(probs[g], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0)));
    }
    _tile_loadd(0, probs, 64);
    _tile_loadd(1, staged[0], 64);
    _tile_dpbf16ps(4, 0, 1);
    _tile_loadd(2, staged[1], 64);
    _tile_dpbf16ps(5, 0, 2);
    _tile_loadd(1, staged[2], 64);
    _tile_dpbf16ps(6, 0, 1);
    _tile_loadd(2, staged[3], 64);
    _tile_dpbf16ps(7, 0, 2);
  }
  _tile_stored(4, sums[0], 64);
  _tile_stored(5, sums[1], 64);
  _tile_stored(6, sums[2], 64);
  _tile_stored(7, sums[3], 64);
  for (int64_t g = 0; g < group; ++g) {  // column 4L + r of a lo slice is dim 8L + r, of a hi slice 8L + 4 + r
    const float inv = 1.f / _mm512_reduce_add_ps(vsum[g]);
    for (int c = 0; c < 2; ++c) {
      for (int lane = 0; lane < 4; ++lane) {
        for (int r = 0; r < 4; ++r) {
          out[g * 64 + 32 * c + 8 * lane + r] = sums[2 * c][g][4 * lane + r] * inv;
          out[g * 64 + 32 * c + 8 * lane + 4 + r] = sums[2 * c + 1][g][4 * lane + r] * inv;
        }
      }
    }
  }
}
#endif

// scores[g * len_pad + i] = scale * q_g . k_(t0 + i) for i < n and the G = group query heads of one
// KV head, 16 tokens at a time: one partial-sum vector per (token, head), reduced together.
// keys: that KV head's slice of the cache; rows: the offsets of tokens t0 ..; qv: the group's queries.
template <int NC>
inline void score_chunk_dpbf16(const uint16_t* keys, const int64_t* rows, int64_t n, const __m512i* qv, int64_t group,
                               __m512 vscale, __m512* partial, float* scores, int64_t len_pad) {
  for (int64_t i = 0; i < 16; ++i) {
    if (i >= n) {
      for (int64_t g = 0; g < group; ++g) partial[g * 16 + i] = _mm512_setzero_ps();
      continue;
    }
    __m512i kr[NC];
    for (int c = 0; c < NC; ++c) kr[c] = _mm512_loadu_si512(keys + rows[i] + 32 * c);
    for (int64_t g = 0; g < group; ++g) {
      __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), as_bh(qv[g * NC]), as_bh(kr[0]));
      for (int c = 1; c < NC; ++c) s = _mm512_dpbf16_ps(s, as_bh(qv[g * NC + c]), as_bh(kr[c]));
      partial[g * 16 + i] = s;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const __m512 sums = _mm512_mul_ps(hsum16_avx512(partial + g * 16), vscale);
    _mm512_mask_storeu_ps(scores + g * len_pad, tail_mask(n), sums);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The same scores with AMX (tiles configured by AmxScoreTiles): keys = the first of 16 key rows of
// one block, token_stride apart; q_vnni = the group's packed queries. Rows n .. 15 lie in the same
// block (block sizes are multiples of 16 here) and their scores are dropped.
template <int NC>
inline void score_chunk_amx(const uint16_t* keys, int64_t token_stride, const uint16_t* q_vnni, int64_t group, int64_t n,
                            float scale, float* scores, int64_t len_pad, float* tile_out /* [16, group] */) {
  _tile_zero(0);
  for (int c = 0; c < NC; ++c) {
    _tile_loadd(1, keys + 32 * c, token_stride * 2);
    _tile_loadd(2, q_vnni + c * 16 * group * 2, group * 4);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, tile_out, group * 4);
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t i = 0; i < n; ++i) scores[g * len_pad + i] = tile_out[i * group + g] * scale;
  }
}
#endif

// bf16 decode with AVX512-BF16 dot products (vdpbf16ps): NC 32-wide chunks per head (head_dim = 32 * NC).
// Scores: 16 context tokens at a time, with AMX tiles where the CPU and the OS allow them, else with
// vdpbf16ps (score_chunk_*). Values: two tokens at a time, their rows interleaved so that one vdpbf16ps adds p_t * v_t + p_t+1 * v_t+1;
// the probabilities are rounded to bf16 for that, as a bf16 attention matmul does. With AMX and
// head_dim 64 the same interleaved pairs feed tile multiplies instead, the softmax folded into
// the value rounds (accumulate_values_amx: less compute, and less time at long contexts read from
// memory).
template <int NC>
void decode_attention_bf16_dpbf16(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                                  const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  constexpr int64_t head_dim = 32 * NC;
  const DecodeLayout L(q, kv_cache, block_tables, seq_lens);
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* k_base = reinterpret_cast<const uint16_t*>(kv_cache.data_ptr<at::BFloat16>());
  const auto* v_base = k_base + L.values_offset;
  auto* out_ptr = out.data_ptr<at::BFloat16>();
  const float fscale = static_cast<float>(scale);
  const __m512 vscale = _mm512_set1_ps(fscale);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  // AMX scores read 16 equally spaced key rows at once: 16-token chunks must not straddle blocks.
  const bool use_amx = L.block_size % 16 == 0 && L.group <= 16 && amx_tiles_usable();
#endif

  L.parallel_over_sequences([&](int64_t begin, int64_t end) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    std::optional<AmxScoreTiles> tiles;
    if (use_amx) tiles.emplace(L.group);
    std::vector<uint16_t> q_vnni(use_amx ? L.num_kv_heads * NC * 16 * L.group * 2 : 0);
    alignas(64) float tile_out[16 * 16];
#endif
    std::vector<__m512i> qv(L.num_heads * NC);
    std::vector<__m512> partial(L.group * 16);
    std::vector<float> head_out(kMaxValueHeads<NC> * head_dim);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    std::vector<float> group_out(use_amx && NC == 2 ? L.group * head_dim : 0);
#endif
    std::vector<float> scores;
    std::vector<uint16_t> probs;
    std::vector<int64_t> rows, next_rows;
    if (begin < end) L.rows(begin, L.lens[begin], next_rows);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = L.lens[seq];
      std::swap(rows, next_rows);
      const int64_t next_len = seq + 1 < end ? L.lens[seq + 1] : 0;
      if (next_len > 0) L.rows(seq + 1, next_len, next_rows);
      // Into L2 while this sequence's keys are scored: its first value rows and the next
      // sequence's first key rows, whose first reads would otherwise wait on memory.
      const int64_t start_values = std::min<int64_t>(kStartRows, len), start_keys = std::min<int64_t>(kStartRows, next_len);
      int64_t start_done = 0;
      auto prefetch_starts = [&](int64_t count) {
        const int64_t stop = std::min(start_done + count, start_values + start_keys);
        for (; start_done < stop; ++start_done) {
          if (start_done < start_values) prefetch_row<_MM_HINT_T1>(v_base + rows[start_done], L.token_stride);
          else prefetch_row<_MM_HINT_T1>(k_base + next_rows[start_done - start_values], L.token_stride);
        }
      };
      const int64_t len_pad = (len + 31) / 32 * 32;  // whole 16-token score chunks and 32-token value rounds
      for (int64_t h = 0; h < L.num_heads; ++h) {
        for (int c = 0; c < NC; ++c) qv[h * NC + c] = _mm512_loadu_si512(q_ptr + (seq * L.num_heads + h) * head_dim + 32 * c);
      }
      scores.resize(L.num_heads * len_pad);  // t < len is written below; nothing reads the padding
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      for (int64_t kv_head = 0; use_amx && kv_head < L.num_kv_heads; ++kv_head) {
        pack_group_queries(q_ptr + (seq * L.num_heads + kv_head * L.group) * head_dim, L.group, head_dim,
                           q_vnni.data() + kv_head * NC * 16 * L.group * 2);
      }
#endif
      prefetch_rows_ahead(k_base, rows.data(), 0, kPrefetchAhead, 0, len, L.token_stride);
      for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, len - t0);
        for (int64_t kv_head = 0; kv_head < L.num_kv_heads; ++kv_head) {
          // this head's share of the prefetches for the chunk kPrefetchAhead (kFarPrefetchAhead) tokens on
          const int64_t first = t0 + kv_head * 16 / L.num_kv_heads, last = t0 + (kv_head + 1) * 16 / L.num_kv_heads;
          prefetch_rows_ahead(k_base, rows.data(), first, last, kPrefetchAhead, len, L.token_stride);
          prefetch_rows_ahead<_MM_HINT_T1>(k_base, rows.data(), first, last, kFarPrefetchAhead, len, L.token_stride);
          prefetch_starts(kStartRowsPerStep);
          float* head_scores = scores.data() + kv_head * L.group * len_pad + t0;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
          if (use_amx) {
            score_chunk_amx<NC>(k_base + rows[t0] + kv_head * head_dim, L.token_stride,
                                q_vnni.data() + kv_head * NC * 16 * L.group * 2, L.group, n, fscale, head_scores, len_pad,
                                tile_out);
            continue;
          }
#endif
          score_chunk_dpbf16<NC>(k_base + kv_head * head_dim, rows.data() + t0, n, qv.data() + kv_head * L.group * NC,
                                 L.group, vscale, partial.data(), head_scores, len_pad);
        }
      }
      prefetch_starts(start_values + start_keys);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if constexpr (NC == 2) {
        if (use_amx && len >= kAmxValueMinTokens) {
          configure_value_tiles(L.group);
          for (int64_t kv_head = 0; kv_head < L.num_kv_heads; ++kv_head) {
            const int64_t h0 = kv_head * L.group;
            accumulate_values_amx(v_base + kv_head * head_dim, rows.data(), len, scores.data() + h0 * len_pad, len_pad,
                                  L.group, group_out.data());
            for (int64_t g = 0; g < L.group; ++g) {
              auto* dst = out_ptr + (seq * L.num_heads + h0 + g) * head_dim;
              for (int d = 0; d < head_dim / 16; ++d) store_bf16x16(dst + 16 * d, _mm512_loadu_ps(group_out.data() + g * head_dim + 16 * d));
            }
          }
          AmxScoreTiles::configure(L.group);
          continue;
        }
      }
#endif
      probs.resize(L.num_heads * len_pad);  // every entry is written below
      for (int64_t h = 0; h < L.num_heads; ++h) {
        float* s = scores.data() + h * len_pad;
        softmax_avx512(s, len);
        for (int64_t t = 0; t < len_pad; t += 16) {  // probabilities past len are 0
          const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail_mask(len - t), s + t));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs.data() + h * len_pad + t), reinterpret_cast<__m256i>(b));
        }
      }
      for (int64_t kv_head = 0; kv_head < L.num_kv_heads; ++kv_head) {
        for (int64_t g0 = 0; g0 < L.group; g0 += kMaxValueHeads<NC>) {
          const int64_t h0 = kv_head * L.group + g0;
          const int64_t heads = std::min<int64_t>(kMaxValueHeads<NC>, L.group - g0);
          accumulate_values<NC>(heads, v_base + kv_head * head_dim, rows.data(), len,
                                probs.data() + h0 * len_pad, len_pad, head_out.data());
          for (int64_t g = 0; g < heads; ++g) {
            auto* dst = out_ptr + (seq * L.num_heads + h0 + g) * head_dim;
            for (int d = 0; d < head_dim / 16; ++d) store_bf16x16(dst + 16 * d, _mm512_loadu_ps(head_out.data() + g * head_dim + 16 * d));
          }
        }
      }
    }
  });
}
#endif

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "q must be [seqs, heads, dim], kv_cache [2, blocks, bs, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache must have the same dtype");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "q and kv_cache must be on the CPU");
  TORCH_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) == q.size(2), "kv_cache head_dim must match q");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && seq_lens.numel() == q.size(0),
              "one block table row and one length per sequence");
  q = q.contiguous();
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  block_tables = block_tables.to(torch::kInt64).contiguous();
  seq_lens = seq_lens.to(torch::kInt64).contiguous();
  {
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    const int64_t capacity = block_tables.size(1) * kv_cache.size(2);
    for (int64_t i = 0; i < q.size(0); ++i) TORCH_CHECK(lens[i] >= 0 && lens[i] <= capacity, "a sequence is longer than its block table");
  }
  auto out = torch::empty_like(q);
#if defined(__AVX512BF16__)
  if (q.scalar_type() == at::kBFloat16 && (q.size(2) == 64 || q.size(2) == 128)) {
    if (q.size(2) == 64) {
      decode_attention_bf16_dpbf16<2>(q, kv_cache, block_tables, seq_lens, scale, out);
    } else {
      decode_attention_bf16_dpbf16<4>(q, kv_cache, block_tables, seq_lens, scale, out);
    }
    return out;
  }
#endif
#if defined(__AVX512F__)
  if (q.scalar_type() == at::kBFloat16 && (q.size(2) == 64 || q.size(2) == 128)) {
    if (q.size(2) == 64) {
      decode_attention_bf16_avx512<4>(q, kv_cache, block_tables, seq_lens, scale, out);
    } else {
      decode_attention_bf16_avx512<8>(q, kv_cache, block_tables, seq_lens, scale, out);
    }
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_kernel<scalar_t>(q, kv_cache, block_tables, seq_lens, scale, out);
  });
  return out;
}

void write_kv_cache_(torch::Tensor kv_cache, torch::Tensor key, torch::Tensor value, torch::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be a contiguous [2, blocks, bs, kv_heads, dim]");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "key and value must have the cache's dtype");
  const int64_t num_tokens = key.size(0);
  const int64_t row = kv_cache.size(3) * kv_cache.size(4);  // elements of one token's keys (or values)
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(1) * key.size(2) == row && value.sizes() == key.sizes(),
              "key and value must be [tokens, kv_heads, dim] like the cache");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 && value.stride(1) == value.size(2),
              "each token's keys and values must be contiguous");
  slot_mapping = slot_mapping.to(torch::kInt64).contiguous();
  TORCH_CHECK(slot_mapping.numel() == num_tokens, "one slot per token");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  const int64_t bytes = row * kv_cache.element_size();
  auto* k_dst = static_cast<char*>(kv_cache.data_ptr());
  auto* v_dst = k_dst + num_slots * bytes;
  const auto* k_src = static_cast<const char*>(key.data_ptr());
  const auto* v_src = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::memcpy(k_dst + slots[t] * bytes, k_src + t * k_stride, bytes);
    std::memcpy(v_dst + slots[t] * bytes, v_src + t * v_stride, bytes);
  }
}
