// Accumulates the calibration statistics of formats/stats.h (HeadStats sums and reservoirs) while
// the forward pass runs, as an AttentionObserver. Every sum is float64 and built from SYRKs over
// blocks of rows (never per-vector outer products); matrices are accumulated in their upper
// triangle and mirrored once in export_into().
#pragma once
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "formats/model_config.h"
#include "formats/stats.h"
#include "model/observer.h"

namespace kvcc {

// Sampling priority of the token at (doc, position): one 64-bit hash, the same in every layer and
// KV head, so all reservoirs hold the same tokens and a sample of q can be paired with its k and v
// across layers. Smaller is kept.
uint64_t reservoir_priority(uint64_t seed, uint32_t doc, int32_t position);

// Copies the upper triangle of each of the five d×d sums into the lower one (the sums accumulate
// only the upper triangle).
void mirror_upper_triangles(HeadStats& hs, int d);

// A document's tokens are held out (never used for fitting) when doc % 5 == 4.
inline bool is_heldout_doc(uint32_t doc) { return doc % 5 == 4; }

// The reservoirs of sampled token rows per (layer, KV head). Priorities depend on neither layer nor
// head, so every reservoir holds the same tokens and one candidate list serves a whole layer.
class ReservoirSampler {
 public:
  // capacity: rows kept per (layer, KV head); 0 disables sampling.
  ReservoirSampler(const ModelConfig& config, int capacity, uint64_t seed);

  int capacity() const { return capacity_; }
  // Chooses the kept tokens up front: the `capacity` smallest distinct priorities over every token
  // of `sequences` (doc, T) — what merging all of them would keep (priorities are 64-bit hashes,
  // so distinct tokens collide with negligible probability; on a collision the earlier sequence's
  // token is kept). Afterwards candidates() returns only kept positions and offer() appends their
  // rows without merging (the GPU path: fewer rows gathered and no merge copies).
  void preselect(const std::vector<std::pair<uint32_t, int>>& sequences);
  // The positions of a sequence of T tokens that may still enter `layer`'s reservoirs, in
  // ascending priority (at most capacity of them; empty when sampling is off).
  std::vector<int> candidates(int layer, uint32_t doc, int T) const;
  // Offers the rows at `positions` (a prefix-closed list from candidates(), same layer and doc).
  // Row i of q [·, n_heads·d], key_pre / key / value [·, n_kv·d] is the token at positions[i]
  // when `packed`, else the token at row positions[i] (whole-sequence arrays).
  void offer(int layer, uint32_t doc, const std::vector<int>& positions, bool packed, const float* q,
             const float* key_pre, const float* key, const float* value);
  // Moves the reservoirs (pending rows merged) into stats.reservoirs; the sampler is spent.
  void move_into(Stats& stats) &&;

 private:
  uint64_t threshold(size_t index) const;  // largest kept priority of a full reservoir, else max
  void flush_pending(size_t index);

  int n_heads_ = 0, n_kv_ = 0, d_ = 0, group_ = 0, capacity_ = 0;
  uint64_t seed_ = 0;
  std::vector<Reservoir> reservoirs_;
  // Candidate rows not yet merged, per (layer, KV head): merging copies the whole reservoir, so
  // candidates are batched and merged once capacity/4 of them have gathered (reservoir_merge is
  // "keep the smallest priorities of the union", so batching does not change the result).
  std::vector<Reservoir> pending_;
  bool preselected_ = false;
  std::unordered_map<uint32_t, std::vector<int>> kept_;  // doc -> kept positions, ascending priority
};

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

  ModelConfig config_;
  int d_ = 0;
  int group_ = 0;
  std::vector<HeadStats> heads_;
  ReservoirSampler sampler_;

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
