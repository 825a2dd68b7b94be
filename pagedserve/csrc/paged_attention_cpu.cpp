// Paged decode attention for CPUs: one query token per sequence attends to its whole context,
// read in place through the block table (no gather copy). Accumulates in float32.
//
// q:            [num_seqs, num_heads, head_dim]
// kv_cache:     [2, num_blocks, block_size, num_kv_heads, head_dim]  (0 = keys, 1 = values)
// block_tables: [num_seqs, max_num_blocks] int64
// seq_lens:     [num_seqs] int64
// returns       [num_seqs, num_heads, head_dim] in q's dtype
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <typename scalar_t>
void decode_attention_kernel(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                             const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  const int64_t num_seqs = q.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(1);
  const int64_t block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_num_blocks = block_tables.size(1);

  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_base = kv_cache.data_ptr<scalar_t>();
  const scalar_t* v_base = k_base + num_blocks * block_size * num_kv_heads * head_dim;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t token_stride = num_kv_heads * head_dim;  // between consecutive slots
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim);
    std::vector<float> acc(group * head_dim);
    std::vector<float> scores;
    std::vector<float> row(head_dim);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t seq = work / num_kv_heads;
      const int64_t kv_head = work % num_kv_heads;
      const int64_t len = lens[seq];
      const int64_t* table = tables + seq * max_num_blocks;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = q_ptr + (seq * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = to_float(src[d]) * fscale;
      }
      scores.assign(group * len, 0.f);
      // scores[g][t] = q_g . k_t  (each key row converted to float once, used by the whole group)
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const scalar_t* k = k_base + slot * token_stride + kv_head * head_dim;
        float* kf = row.data();
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) kf[d] = to_float(k[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * kf[d];
          scores[g * len + t] = s;
        }
      }
      // softmax over t, per query head
      for (int64_t g = 0; g < group; ++g) {
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
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const scalar_t* v = v_base + slot * token_stride + kv_head * head_dim;
        float* vf = row.data();
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) vf[d] = to_float(v[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * vf[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = out_ptr + (seq * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "q must be [seqs, heads, dim], kv_cache [2, blocks, bs, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache must have the same dtype");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "heads must be a multiple of kv heads");
  q = q.contiguous();
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  block_tables = block_tables.to(torch::kInt64).contiguous();
  seq_lens = seq_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_kernel<scalar_t>(q, kv_cache, block_tables, seq_lens, scale, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
}
