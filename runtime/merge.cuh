// The log-sum-exp merge of split-K partials, shared by decode's merge kernels and prefill's
// finish. A split s of an output row left its running max m_s (log2 units), its sum l_s and its
// unnormalised output o_s (-inf, 0 and 0 where it saw no key); the row is
//   Σ_s o_s·2^(m_s − M) / Σ_s l_s·2^(m_s − M),  M = max_s m_s.
// Host and device code (KVCC_HD), so the CPU tests run the same arithmetic.
#pragma once
#include <cmath>
#include <cstddef>

#include "formats/host_device.h"

// #pragma unroll in device code; nothing for the host compiler (which would warn about it).
#if defined(__CUDA_ARCH__)
#define KVCC_MERGE_UNROLL _Pragma("unroll")
#else
#define KVCC_MERGE_UNROLL
#endif

namespace kvcc {

// Running log-sum-exp of one output element over splits first, first + step, ... < n_splits: per
// round, the (max, sum) and the output of kChunk splits are loaded together (one round of
// independent loads instead of one dependent load after another). Split s's partials are
// part_ml[2e], part_ml[2e + 1] and part_o[e·row + j], e = entry(s). Every split wrote its partial
// (zeros where it saw no key), so only the count guards them.
template <int kChunk, int kRow, class Entry>
KVCC_HD void merge_run(const float* part_o, const float* part_ml, Entry entry, int j, int n_splits, int first, int step,
                       float& m_run, float& l_run, float& acc) {
  m_run = -INFINITY;
  l_run = acc = 0.0f;
  for (int s0 = first; s0 < n_splits; s0 += step * kChunk) {
    float m[kChunk], l[kChunk], o[kChunk];
    KVCC_MERGE_UNROLL
    for (int i = 0; i < kChunk; ++i) {
      const int s = s0 + step * i;
      const size_t e = entry(s);
      m[i] = s < n_splits ? part_ml[e * 2] : -INFINITY;
      l[i] = s < n_splits ? part_ml[e * 2 + 1] : 0.0f;
      o[i] = s < n_splits ? part_o[e * kRow + j] : 0.0f;
    }
    float mc = m_run;
    KVCC_MERGE_UNROLL
    for (int i = 0; i < kChunk; ++i) mc = fmaxf(mc, m[i]);
    if (mc == -INFINITY) continue;
    const float alpha = m_run == -INFINITY ? 0.0f : exp2f(m_run - mc);
    l_run *= alpha;
    acc *= alpha;
    KVCC_MERGE_UNROLL
    for (int i = 0; i < kChunk; ++i) {
      const float w = m[i] == -INFINITY ? 0.0f : exp2f(m[i] - mc);
      l_run = fmaf(w, l[i], l_run);
      acc = fmaf(w, o[i], acc);
    }
    m_run = mc;
  }
}

// Four runs (m[k], l[k], acc[k·stride]) of disjoint sets of splits, combined in a fixed order:
// the merged, normalised output (0 when no run saw a key).
KVCC_HD float merge_slices(const float* m, const float* l, const float* acc, int stride) {
  const float mall = fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3]));
  float w[4];
  KVCC_MERGE_UNROLL
  for (int k = 0; k < 4; ++k) w[k] = m[k] == -INFINITY ? 0.0f : exp2f(m[k] - mall);
  const float sum = (w[0] * acc[0] + w[1] * acc[stride]) + (w[2] * acc[2 * stride] + w[3] * acc[3 * stride]);
  const float lsum = (w[0] * l[0] + w[1] * l[1]) + (w[2] * l[2] + w[3] * l[3]);
  return lsum > 0.0f ? sum / lsum : 0.0f;
}

}  // namespace kvcc
