// Accumulates the calibration statistics of formats/stats.h (HeadStats sums and reservoirs) while
// the forward pass runs, as an AttentionObserver. Every sum is float64 and built from SYRKs over
// blocks of rows (never per-vector outer products); matrices are accumulated in their upper
// triangle and mirrored once in export_into().
#pragma once
#include <cstdint>
#include <vector>

#include "formats/model_config.h"
#include "formats/stats.h"
#include "model/observer.h"

namespace kvcc {

// Sampling priority of the token at (doc, position): one 64-bit hash, the same in every layer and
// KV head, so all reservoirs hold the same tokens and a sample of q can be paired with its k and v
// across layers. Smaller is kept.
uint64_t reservoir_priority(uint64_t seed, uint32_t doc, int32_t position);

// A document's tokens are held out (never used for fitting) when doc % 5 == 4.
inline bool is_heldout_doc(uint32_t doc) { return doc % 5 == 4; }

class StatsAccumulator final : public AttentionObserver {
 public:
  // reservoir_capacity: rows kept per (layer, KV head); 0 disables sampling.
  StatsAccumulator(const ModelConfig& config, int reservoir_capacity, uint64_t seed);

  void on_qkv(const SequenceTaps& taps) override;
  void on_probs(const SequenceTaps& taps, int q_head, const float* probs, const float* output) override;

  // Copies the sums (matrices made symmetric) and reservoirs into stats.heads / stats.reservoirs,
  // replacing what was there; `stats` must describe the same model shape.
  void export_into(Stats& stats) const;
  // The same, moving instead of copying (reservoirs can be large); the accumulator is spent.
  void move_into(Stats& stats) &&;

  const ModelConfig& config() const { return config_; }

 private:
  HeadStats& head(int layer, int h) { return heads_[size_t(layer * config_.n_kv_heads + h)]; }
  // C += Σ rows rowᵀ (upper triangle) for `n` rows of width d taken at `src + i * stride`, each
  // scaled by `row_scale[i]` when given; converts blocks to double for dsyrk.
  void syrk_rows(std::vector<double>& c, const float* src, int n, int64_t stride, const double* row_scale = nullptr);
  void sample_reservoir(const SequenceTaps& taps);

  ModelConfig config_;
  int d_ = 0;
  int group_ = 0;
  uint64_t seed_ = 0;
  std::vector<HeadStats> heads_;
  std::vector<Reservoir> reservoirs_;
  // Candidate rows not yet merged, per (layer, KV head): merging copies the whole reservoir, so
  // candidates are batched and merged once capacity/4 of them have gathered (reservoir_merge is
  // "keep the smallest priorities of the union", so batching does not change the result).
  std::vector<Reservoir> pending_;
  void flush_pending(size_t index);

  // Per sequence: w_j = Σ_heads Σ_i p_ij² for each KV head [n_kv, T], and how many of the group's
  // query heads have reported; p2 is accumulated once all r heads of a group are in.
  uint32_t current_doc_ = 0;
  int current_layer_ = -1;
  int current_T_ = 0;
  std::vector<double> p2_weights_;
  std::vector<int> heads_seen_;
  std::vector<double> block_;  // scratch: a block of rows in double
};

}  // namespace kvcc
