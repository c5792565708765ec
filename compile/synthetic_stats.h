// In-memory calibration statistics from synthetic attention, for tests and the compile benchmark:
// queries with a skewed spectrum in a random basis, keys with a few large channels and a component
// aligned with the queries' top directions, values with uneven channel scales, causal softmax
// attention within each document. Every stats sum is computed from the same rows that fill the
// reservoirs, so tests can check the compiler against values computed directly from the rows.
#pragma once
#include <cstdint>

#include "formats/stats.h"

namespace kvcc {

struct SyntheticSpec {
  int n_layers = 2;
  int n_kv_heads = 2;
  int group = 2;  // query heads per KV head
  int head_dim = 64;
  int docs = 20;               // documents; doc % 5 == 4 is held out
  int doc_len = 64;            // tokens per document
  int reservoir_capacity = 0;  // 0: keep every token
  double query_decay = 8.0;    // eigenvalue i of the query moment ∝ exp(-i / query_decay)
  uint64_t seed = 1;
};

Stats make_synthetic_stats(const SyntheticSpec& spec);

}  // namespace kvcc
