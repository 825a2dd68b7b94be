// Paged prefill attention for bf16 caches: the query tokens of each prompt chunk attend causally
// to their request's whole context (a cached prefix included), read through the block table, with
// no per-request gather or PyTorch call. Two back ends for the matrix products, picked at run time:
// AMX tiles where the CPU and the OS offer them, else AVX512-BF16 dot products (vdpbf16ps) in
// registers (without AMX, PyTorch's CPU flash attention took half of a 500-token prefill).
//
// q:               [num_tokens, num_heads, head_dim] bf16: the prefill requests' query tokens, request by request
// kv_cache:        [2, num_blocks, block_size, num_kv_heads, head_dim] bf16, this step's keys/values already written
// block_tables:    [num_reqs, max_num_blocks] int64
// seq_lens:        [num_reqs] int64: context length after this step (>= the request's query count)
// query_start_loc: [num_reqs + 1] int64: request i's queries are rows query_start_loc[i] .. query_start_loc[i + 1]
// returns          [num_tokens, num_heads, head_dim] bf16
//
// Query i of a request with n queries and context length L sits at position L - n + i and sees keys
// 0 .. L - n + i. Per request and KV head, keys and values are first laid out as matrix operands
// (keys transposed in 32-bit pairs, values pair-interleaved: the VNNI layout both back ends read),
// once, then shared by every block of 16 queries of that head group: scores S = Q K^T for 16
// queries x 16 keys at a time, an exact float32 softmax per query row, probabilities rounded to
// bf16 (as a bf16 attention matmul does), O = P V for 16 queries x head_dim.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx_utils.h"
#include "avx512_utils.h"
#include "paged_kv_layout.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDSERVE_HAS_AMX_PREFILL 1
#else
#define PAGEDSERVE_HAS_AMX_PREFILL 0
#endif

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t kOperand = 512;  // bf16 elements of one 16 x 64-byte operand (a tile, or 16 zmm rows)

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

using pagedserve::as_bh;

struct PrefillLayout {
  int64_t num_reqs, num_heads, num_kv_heads, group, block_size, max_num_blocks, token_stride, values_offset;
  const int64_t* tables;
  const int64_t* lens;
  const int64_t* starts;
  std::vector<int64_t> packed_offset;  // per request: first element of its packed keys (and values)

  // rows[t] = element offset of context token t of request req within the keys (or the values)
  void rows(int64_t req, std::vector<int64_t>& rows) const {
    pagedserve::context_rows(tables + req * max_num_blocks, block_size, token_stride, lens[req], rows);
  }
};

// One request's keys and values of one KV head as operands, padded with zeros to a multiple of 32 tokens:
// keys_t[chunk of 16 keys][c][r][n][j] = K[16 chunk + n][32 c + 2 r + j]   (B operand of S = Q K^T)
// values[chunk of 32 keys][b][r][d][j] = V[32 chunk + 2 r + j][16 b + d]   (B operand of O = P V)
template <int NC>
void pack_context(const uint16_t* k_head, const uint16_t* v_head, const std::vector<int64_t>& rows, int64_t len,
                  uint16_t* keys_t, uint16_t* values) {
  constexpr int64_t D = 32 * NC;
  const int64_t padded = round_up(len, 32);
  for (int64_t t = 0; t < padded; ++t) {
    const int64_t chunk = t / 16, n = t % 16;
    for (int64_t c = 0; c < NC; ++c) {
      uint32_t* dst = reinterpret_cast<uint32_t*>(keys_t + (chunk * NC + c) * kOperand) + n;
      for (int64_t r = 0; r < 16; ++r) {
        uint32_t pair = 0;
        if (t < len) std::memcpy(&pair, k_head + rows[t] + 32 * c + 2 * r, 4);
        dst[16 * r] = pair;
      }
    }
    const int64_t vchunk = t / 32, r = (t % 32) / 2, j = t % 2;
    for (int64_t b = 0; b < D / 16; ++b) {
      uint16_t* dst = values + (vchunk * (D / 16) + b) * kOperand + r * 32 + j;
      for (int64_t d = 0; d < 16; ++d) dst[2 * d] = t < len ? v_head[rows[t] + 16 * b + d] : 0;
    }
  }
}

// p[0:seen] = bf16(softmax(scale * s[0:seen])) in three passes (max; exponentials and their sum,
// kept in s; normalize and round); p[seen:] is left as it is.
inline void softmax_to_bf16(float* s, int64_t seen, float scale, uint16_t* p) {
  auto mask = [seen](int64_t t) { return pagedserve::tail_mask(seen - t); };
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 vshift = _mm512_set1_ps(pagedserve::max_avx512(s, seen) * scale);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t t = 0; t < seen; t += 16) {
    const __mmask16 m = mask(t);
    const __m512 e = _mm512_maskz_mov_ps(m, pagedserve::exp_avx512(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, s + t), vscale, vshift)));
    _mm512_storeu_ps(s + t, e);  // s has room: rows are `width` >= round_up(seen, 32) floats long
    vsum = _mm512_add_ps(vsum, e);
  }
  const __m512 vinv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
  for (int64_t t = 0; t < seen; t += 16) {
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(s + t), vinv));
    _mm256_mask_storeu_epi16(p + t, mask(t), reinterpret_cast<__m256i>(b));
  }
}

// The two matrix products of one block of 16 queries, with vdpbf16ps in registers. Each takes a
// 32-bit pair of the A operand (two query dims, or two keys' probabilities) broadcast to all lanes,
// against one 64-byte row of a packed B operand (16 keys, or 16 output dims, times that pair).
struct Dpbf16Products {

  // S[n][k] (float32, rows `width` apart) for the 16 queries of q_block ([16, D] bf16) and keys
  // k < width (a multiple of 32, within the packed keys): two 16-key chunks x 8 queries per pass.
  template <int NC>
  void scores(const uint16_t* q_block, const uint16_t* keys_t, int64_t width, float* s) {
    constexpr int64_t pairs_per_query = 16 * NC;
    const auto* q_pairs = reinterpret_cast<const uint32_t*>(q_block);
    for (int64_t chunk = 0; chunk < width / 16; chunk += 2) {
      for (int64_t m0 = 0; m0 < 16; m0 += 8) {
        __m512 acc[8][2];
#pragma GCC unroll 8
        for (int m = 0; m < 8; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
#pragma GCC unroll 2
        for (int c = 0; c < NC; ++c) {
          const uint16_t* k0 = keys_t + (chunk * NC + c) * kOperand;
          const uint16_t* k1 = k0 + NC * kOperand;
          for (int r = 0; r < 16; ++r) {
            const __m512i b0 = _mm512_loadu_si512(k0 + 32 * r), b1 = _mm512_loadu_si512(k1 + 32 * r);
#pragma GCC unroll 8
            for (int m = 0; m < 8; ++m) {
              const __m512i a = _mm512_set1_epi32(static_cast<int>(q_pairs[(m0 + m) * pairs_per_query + 16 * c + r]));
              acc[m][0] = _mm512_dpbf16_ps(acc[m][0], as_bh(a), as_bh(b0));
              acc[m][1] = _mm512_dpbf16_ps(acc[m][1], as_bh(a), as_bh(b1));
            }
          }
        }
#pragma GCC unroll 8
        for (int m = 0; m < 8; ++m) {
          _mm512_storeu_ps(s + (m0 + m) * width + 16 * chunk, acc[m][0]);
          _mm512_storeu_ps(s + (m0 + m) * width + 16 * chunk + 16, acc[m][1]);
        }
      }
    }
  }

  // O [16 queries, D] (float32, rows D apart) = P V, P = probs [16, width] bf16, M queries per pass
  // (their M x D/16 sums stay in registers).
  template <int NC>
  void values(const uint16_t* probs, int64_t width, const uint16_t* values, float* o) {
    constexpr int M = NC == 2 ? 6 : 3;
    int64_t m0 = 0;
    for (; m0 + M <= 16; m0 += M) values_rows<NC, M>(probs, width, values, m0, o);
    if constexpr (16 % M != 0) values_rows<NC, 16 % M>(probs, width, values, m0, o);
  }

  template <int NC, int M>
  static void values_rows(const uint16_t* probs, int64_t width, const uint16_t* values, int64_t m0, float* o) {
    constexpr int B = 2 * NC;  // 16-dim slices of the output
    const auto* p_pairs = reinterpret_cast<const uint32_t*>(probs) + m0 * (width / 2);
    __m512 acc[M][B];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) acc[m][b] = _mm512_setzero_ps();
    }
    for (int64_t chunk = 0; chunk < width / 32; ++chunk) {
      const uint16_t* v_chunk = values + chunk * B * kOperand;
      for (int r = 0; r < 16; ++r) {
        __m512i v[B];
#pragma GCC unroll 8
        for (int b = 0; b < B; ++b) v[b] = _mm512_loadu_si512(v_chunk + b * kOperand + 32 * r);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const __m512i a = _mm512_set1_epi32(static_cast<int>(p_pairs[m * (width / 2) + 16 * chunk + r]));
#pragma GCC unroll 8
          for (int b = 0; b < B; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], as_bh(a), as_bh(v[b]));
        }
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) _mm512_storeu_ps(o + (m0 + m) * 32 * NC + 16 * b, acc[m][b]);
    }
  }
};

#if PAGEDSERVE_HAS_AMX_PREFILL
// The same products with AMX tiles (configure_full_tiles): 0-3 float32 results (scores, or 16
// queries x 16 dims of the output each); 4: the A operand (queries, or probabilities); 6, 7: B
// operands (keys, or values). One object per thread: it holds the tile configuration while it lives.
struct AmxProducts {
  AmxProducts() { pagedserve::configure_full_tiles(); }
  ~AmxProducts() { _tile_release(); }
  AmxProducts(const AmxProducts&) = delete;
  AmxProducts& operator=(const AmxProducts&) = delete;

  template <int NC>
  void scores(const uint16_t* q_block, const uint16_t* keys_t, int64_t width, float* s) {
    constexpr int64_t D = 32 * NC;
    for (int64_t chunk = 0; chunk < width / 16; ++chunk) {
      _tile_zero(0);
      for (int c = 0; c < NC; ++c) {
        _tile_loadd(4, q_block + 32 * c, D * 2);
        _tile_loadd(6, keys_t + (chunk * NC + c) * kOperand, 64);
        _tile_dpbf16ps(0, 4, 6);
      }
      _tile_stored(0, s + 16 * chunk, width * 4);
    }
  }

  // 64 output dims (four tiles) at a time
  template <int NC>
  void values(const uint16_t* probs, int64_t width, const uint16_t* values, float* o) {
    constexpr int64_t D = 32 * NC;
    for (int64_t half = 0; half < D / 64; ++half) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t chunk = 0; chunk < width / 32; ++chunk) {
        const uint16_t* v = values + (chunk * (D / 16) + 4 * half) * kOperand;
        _tile_loadd(4, probs + 32 * chunk, width * 2);
        _tile_loadd(6, v, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, v + kOperand, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, v + 2 * kOperand, 64);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, v + 3 * kOperand, 64);
        _tile_dpbf16ps(3, 4, 7);
      }
      _tile_stored(0, o + 64 * half, D * 4);
      _tile_stored(1, o + 64 * half + 16, D * 4);
      _tile_stored(2, o + 64 * half + 32, D * 4);
      _tile_stored(3, o + 64 * half + 48, D * 4);
    }
  }
};
#endif

template <int NC, typename Products>
void prefill_attention(const torch::Tensor& q, const torch::Tensor& kv_cache, const PrefillLayout& L, double scale,
                       torch::Tensor& out) {
  constexpr int64_t D = 32 * NC;
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* k_base = reinterpret_cast<const uint16_t*>(kv_cache.data_ptr<at::BFloat16>());
  const auto* v_base = k_base + L.values_offset;
  auto* out_ptr = out.data_ptr<at::BFloat16>();
  const float fscale = static_cast<float>(scale);
  const int64_t packed_total = L.packed_offset[L.num_reqs];
  std::vector<uint16_t> keys_t(packed_total), values(packed_total);

  // 1. keys and values as matrix operands, once per (request, KV head)
  at::parallel_for(0, L.num_reqs * L.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> rows;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t req = w / L.num_kv_heads, kv = w % L.num_kv_heads;
      L.rows(req, rows);
      const int64_t offset = L.packed_offset[req] + kv * round_up(L.lens[req], 32) * D;
      pack_context<NC>(k_base + kv * D, v_base + kv * D, rows, L.lens[req], keys_t.data() + offset, values.data() + offset);
    }
  });

  // 2. one work item = 16 queries of one head of one request
  std::vector<int64_t> first_item(L.num_reqs + 1, 0);
  for (int64_t i = 0; i < L.num_reqs; ++i) {
    first_item[i + 1] = first_item[i] + L.num_heads * ((L.starts[i + 1] - L.starts[i] + 15) / 16);
  }
  at::parallel_for(0, first_item[L.num_reqs], 1, [&](int64_t begin, int64_t end) {
    Products products;
    alignas(64) uint16_t q_block[16 * D];
    alignas(64) float out_block[16 * D];
    std::vector<float> scores;
    std::vector<uint16_t> probs;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t req = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const int64_t num_q = L.starts[req + 1] - L.starts[req], q_blocks = (num_q + 15) / 16;
      const int64_t head = (item - first_item[req]) / q_blocks, qb = (item - first_item[req]) % q_blocks;
      const int64_t kv = head / L.group, len = L.lens[req];
      const int64_t first_pos = len - num_q + 16 * qb;  // position of this block's first query
      const int64_t n_rows = std::min<int64_t>(16, num_q - 16 * qb);
      const int64_t keys = first_pos + n_rows;  // keys seen by the block's last query
      const int64_t width = round_up(keys, 32);  // <= the packed length, round_up(len, 32)
      const int64_t offset = L.packed_offset[req] + kv * round_up(len, 32) * D;

      std::memset(q_block, 0, sizeof(q_block));
      for (int64_t n = 0; n < n_rows; ++n) {
        std::memcpy(q_block + n * D, q_ptr + ((L.starts[req] + 16 * qb + n) * L.num_heads + head) * D, D * 2);
      }
      // S [16 queries, width] (float32); only each row's causal part is read below
      scores.resize(16 * width);
      products.template scores<NC>(q_block, keys_t.data() + offset, width, scores.data());
      // P [16 queries, width] (bf16): causal softmax per query row, zeros past its last key and in padding rows
      probs.assign(16 * width, 0);
      for (int64_t n = 0; n < n_rows; ++n) {
        softmax_to_bf16(scores.data() + n * width, first_pos + n + 1, fscale, probs.data() + n * width);
      }
      // O [16 queries, D] = P V
      products.template values<NC>(probs.data(), width, values.data() + offset, out_block);
      for (int64_t n = 0; n < n_rows; ++n) {
        auto* dst = out_ptr + ((L.starts[req] + 16 * qb + n) * L.num_heads + head) * D;
        for (int64_t d = 0; d < D; d += 16) pagedserve::store_bf16x16(dst + d, _mm512_load_ps(out_block + n * D + d));
      }
    }
  });
}
#endif  // __AVX512BF16__

}  // namespace

bool has_prefill_attention() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

bool has_amx_prefill_attention() {
#if PAGEDSERVE_HAS_AMX_PREFILL
  return pagedserve::amx_tiles_usable();
#else
  return false;
#endif
}

torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                      torch::Tensor seq_lens, torch::Tensor query_start_loc, double scale, bool allow_amx) {
  TORCH_CHECK(has_prefill_attention(), "paged_prefill_attention: built without AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "q must be [tokens, heads, dim], kv_cache [2, blocks, bs, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv_cache.scalar_type() == at::kBFloat16, "q and kv_cache must be bfloat16");
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "q and kv_cache must be on the CPU");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.size(0) == 2 && kv_cache.size(4) == q.size(2), "kv_cache must be contiguous, head_dim as q's");
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128, "head_dim must be 64 or 128");
  TORCH_CHECK(kv_cache.size(2) % 16 == 0, "block_size must be a multiple of 16");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "heads must be a multiple of kv heads");
  q = q.contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  seq_lens = seq_lens.to(torch::kInt64).contiguous();
  query_start_loc = query_start_loc.to(torch::kInt64).contiguous();
  const int64_t num_reqs = seq_lens.numel();
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_reqs && query_start_loc.numel() == num_reqs + 1,
              "one block table row, one length and one query range per request");
  auto out = torch::empty_like(q);
#if defined(__AVX512BF16__)
  PrefillLayout L;
  L.num_reqs = num_reqs;
  L.num_heads = q.size(1);
  L.num_kv_heads = kv_cache.size(3);
  L.group = L.num_heads / L.num_kv_heads;
  L.block_size = kv_cache.size(2);
  L.max_num_blocks = block_tables.size(1);
  L.token_stride = L.num_kv_heads * q.size(2);
  L.values_offset = kv_cache.size(1) * kv_cache.size(2) * L.token_stride;
  L.tables = block_tables.data_ptr<int64_t>();
  L.lens = seq_lens.data_ptr<int64_t>();
  L.starts = query_start_loc.data_ptr<int64_t>();
  TORCH_CHECK(L.starts[0] == 0 && L.starts[num_reqs] == q.size(0), "query_start_loc must run from 0 to the number of query tokens");
  L.packed_offset.assign(num_reqs + 1, 0);
  for (int64_t i = 0; i < num_reqs; ++i) {
    const int64_t num_q = L.starts[i + 1] - L.starts[i];
    TORCH_CHECK(num_q > 0 && num_q <= L.lens[i], "each request needs 1 .. seq_len queries");
    TORCH_CHECK(L.lens[i] <= L.max_num_blocks * L.block_size, "a sequence is longer than its block table");
    L.packed_offset[i + 1] = L.packed_offset[i] + L.num_kv_heads * round_up(L.lens[i], 32) * q.size(2);
  }
#if PAGEDSERVE_HAS_AMX_PREFILL
  if (allow_amx && has_amx_prefill_attention()) {
    if (q.size(2) == 64) {
      prefill_attention<2, AmxProducts>(q, kv_cache, L, scale, out);
    } else {
      prefill_attention<4, AmxProducts>(q, kv_cache, L, scale, out);
    }
    return out;
  }
#endif
  if (q.size(2) == 64) {
    prefill_attention<2, Dpbf16Products>(q, kv_cache, L, scale, out);
  } else {
    prefill_attention<4, Dpbf16Products>(q, kv_cache, L, scale, out);
  }
#endif
  return out;
}
