// CPU reference of the append kernel (same semantics as runtime/append.cu): rotate the new keys
// and values (x·R), round to BF16, write sink and ring, and quantise every page that the new
// length moves into history (clip + quantise + pack, codec_scalar.h; per-channel keys over the
// page's tokens, formats/page_row_codec.h). Tokens enter history from their BF16-rounded rotated
// rows, a page at a time when it is full, so appending T tokens at once gives the same bytes as
// appending them one by one.
#pragma once
#include <cstdint>
#include <vector>

#include "formats/kv_layout.h"
#include "runtime/kv_cache.h"

namespace kvcc {

// One layer's append to several sequences. Sequence i's new tokens are rows
// row_offset[i] .. row_offset[i] + counts[i] - 1 of the k/v arrays [rows, n_kv, d]; the cache has
// already grown by counts[i] (KvCache::grow) and old_lengths[i] is its length before.
struct AppendBatch {
  std::vector<int> seqs;
  std::vector<int64_t> old_lengths;
  std::vector<int> counts;
  std::vector<int64_t> row_offsets;
};
AppendBatch make_append_batch(const std::vector<int>& seqs, const std::vector<int64_t>& old_lengths,
                              const std::vector<int>& counts);

// A rotation R (d × d, x_rot = x·R, finite) in the cache's fixed point (formats/kv_rotation.h):
// q[i·d + j] = Rq_ij and e[j], the exponent of column j.
struct FixedRotation {
  int d = 0;
  std::vector<int32_t> q;
  std::vector<int> e;
};
FixedRotation fixed_rotation(const float* rot, int d);
// The rotated row the cache stores for x (d values): out_j = bf16(x·R)_j in kv_rotation.h's exact
// arithmetic (rot null: bf16(x)). The CUDA append and prefill compute the same integers, so host
// and device pools hold the same bytes.
void rotate_kv_row(const float* x, const FixedRotation* rot, int d, float* out);

// k, v: [rows, n_kv, d] post-RoPE, unrotated. rot_k, rot_v: [n_kv, d, d] (x_rot = x·R), or null
// when the rows are already rotated. codecs: [n_kv] for this layer. The cache must be a host pool.
void append_ref(KvCache& cache, int layer, const AppendBatch& batch, const float* k, const float* v, const float* rot_k,
                const float* rot_v, const HeadCodec* codecs);

}  // namespace kvcc
