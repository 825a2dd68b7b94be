// Where a request's context tokens sit in a paged KV cache [2, num_blocks, block_size, num_kv_heads, head_dim].
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pagedserve {

// rows[t] = element offset of context token t (t < len) within the keys (or the values), for the
// request whose block table is `table`, walking the table once: no division per token in the
// kernels' inner loops. token_stride = num_kv_heads * head_dim.
inline void context_rows(const int64_t* table, int64_t block_size, int64_t token_stride, int64_t len,
                         std::vector<int64_t>& rows) {
  rows.resize(len);
  for (int64_t t0 = 0, b = 0; t0 < len; t0 += block_size, ++b) {
    const int64_t first = table[b] * block_size * token_stride;
    const int64_t n = std::min(block_size, len - t0);
    for (int64_t i = 0; i < n; ++i) rows[t0 + i] = first + i * token_stride;
  }
}

}  // namespace pagedserve
