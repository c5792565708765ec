#include "calibrate/accumulators.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "formats/error.h"

namespace kvcc {
namespace {

// Rows converted to double per dsyrk call: large enough for BLAS efficiency, small enough that
// the scratch stays in cache-friendly territory (512 × 128 doubles = 512 KiB).
constexpr int kSyrkBlockRows = 512;

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

void mirror_upper(std::vector<double>& m, int d) {
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < i; ++j) m[size_t(i) * d + j] = m[size_t(j) * d + i];
}

const ModelConfig& checked_heads(const ModelConfig& config) {
  KVCC_REQUIRE(
      config.n_layers > 0 && config.n_kv_heads > 0 && config.head_dim > 0 && config.n_heads % config.n_kv_heads == 0,
      "stats accumulator: model config has invalid head counts");
  return config;
}

}  // namespace

uint64_t reservoir_priority(uint64_t seed, uint32_t doc, int32_t position) {
  const uint64_t token = (uint64_t(doc) << 32) | uint32_t(position);
  return splitmix64(splitmix64(seed) ^ splitmix64(token ^ 0xA0761D6478BD642Full));
}

ReservoirSampler::ReservoirSampler(const ModelConfig& config, int capacity, uint64_t seed)
    : n_heads_(config.n_heads),
      n_kv_(config.n_kv_heads),
      d_(config.head_dim),
      group_(config.group()),
      capacity_(capacity),
      seed_(seed) {
  KVCC_REQUIRE(capacity >= 0, "stats accumulator: negative reservoir capacity");
  reservoirs_.resize(size_t(config.n_layers) * size_t(config.n_kv_heads));
  for (auto& r : reservoirs_) {
    r.capacity = capacity;
    r.group = group_;
    r.d = d_;
  }
  pending_ = reservoirs_;
}

uint64_t ReservoirSampler::threshold(size_t index) const {
  const Reservoir& res = reservoirs_[index];
  return int(res.size()) >= capacity_ ? *std::max_element(res.priority.begin(), res.priority.end()) : UINT64_MAX;
}

void ReservoirSampler::preselect(const std::vector<std::pair<uint32_t, int>>& sequences) {
  struct Token {
    uint64_t priority;
    uint32_t doc;
    int position;
  };
  std::vector<Token> tokens;
  for (const auto& [doc, T] : sequences)
    for (int t = 0; t < T; ++t) tokens.push_back({reservoir_priority(seed_, doc, t), doc, t});
  // Stable: on equal priorities the earlier sequence's token comes first and the later is dropped.
  std::stable_sort(tokens.begin(), tokens.end(),
                   [](const Token& a, const Token& b) { return a.priority < b.priority; });
  kept_.clear();
  size_t kept = 0;
  for (size_t i = 0; i < tokens.size() && kept < size_t(capacity_); ++i) {
    if (i > 0 && tokens[i].priority == tokens[i - 1].priority) continue;
    kept_[tokens[i].doc].push_back(tokens[i].position);
    ++kept;
  }
  preselected_ = true;
}

std::vector<int> ReservoirSampler::candidates(int layer, uint32_t doc, int T) const {
  if (capacity_ == 0 || T <= 0) return {};
  if (preselected_) {
    const auto it = kept_.find(doc);
    return it == kept_.end() ? std::vector<int>{} : it->second;
  }
  std::vector<uint64_t> priority(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t) priority[size_t(t)] = reservoir_priority(seed_, doc, t);
  std::vector<int> order(static_cast<size_t>(T));
  std::iota(order.begin(), order.end(), 0);
  const size_t keep = std::min(size_t(capacity_), size_t(T));
  std::partial_sort(order.begin(), order.begin() + ptrdiff_t(keep), order.end(),
                    [&](int a, int b) { return priority[size_t(a)] < priority[size_t(b)]; });
  order.resize(keep);
  // Only rows below a full reservoir's largest priority can enter it; thresholds only fall as
  // rows are offered, so cutting at the highest one of the layer keeps every row that can enter.
  uint64_t limit = 0;
  for (int h = 0; h < n_kv_; ++h) limit = std::max(limit, threshold(size_t(layer * n_kv_ + h)));
  size_t n = 0;
  while (n < order.size() && priority[size_t(order[n])] < limit) ++n;
  order.resize(n);
  return order;
}

void ReservoirSampler::offer(int layer, uint32_t doc, const std::vector<int>& positions, bool packed, const float* q,
                             const float* key_pre, const float* key, const float* value) {
  if (capacity_ == 0 || positions.empty()) return;
  KVCC_REQUIRE(key_pre != nullptr, "stats accumulator: reservoir sampling needs pre-RoPE keys");
  const int64_t q_stride = int64_t(n_heads_) * d_;
  const int64_t kv_stride = int64_t(n_kv_) * d_;
  const uint8_t heldout = is_heldout_doc(doc) ? 1 : 0;
  const size_t batch = size_t(capacity_) / 4 + 1;
  for (int h = 0; h < n_kv_; ++h) {
    const size_t index = size_t(layer * n_kv_ + h);
    // Preselected rows go straight into the reservoir (sorted once in move_into).
    Reservoir& add = preselected_ ? reservoirs_[index] : pending_[index];
    uint64_t limit = preselected_ ? UINT64_MAX : threshold(index);
    for (size_t i = 0; i < positions.size(); ++i) {
      const int t = positions[i];
      const uint64_t p = reservoir_priority(seed_, doc, t);
      if (p >= limit) break;  // positions are ascending in priority
      const int64_t row = packed ? int64_t(i) : int64_t(t);
      const float* qr = q + row * q_stride + int64_t(h) * group_ * d_;
      add.q.insert(add.q.end(), qr, qr + int64_t(group_) * d_);
      const float* kp = key_pre + row * kv_stride + int64_t(h) * d_;
      add.key_pre.insert(add.key_pre.end(), kp, kp + d_);
      const float* k = key + row * kv_stride + int64_t(h) * d_;
      add.key.insert(add.key.end(), k, k + d_);
      const float* v = value + row * kv_stride + int64_t(h) * d_;
      add.value.insert(add.value.end(), v, v + d_);
      add.position.push_back(t);
      add.doc.push_back(doc);
      add.priority.push_back(p);
      add.heldout.push_back(heldout);
      if (!preselected_ && add.size() >= batch) {
        flush_pending(index);
        limit = threshold(index);
      }
    }
  }
}

void ReservoirSampler::flush_pending(size_t index) {
  Reservoir& add = pending_[index];
  if (add.size() == 0) return;
  reservoir_merge(reservoirs_[index], add);
  Reservoir empty;  // frees the batch's memory rather than keeping its capacity around
  empty.capacity = add.capacity;
  empty.group = add.group;
  empty.d = add.d;
  add = std::move(empty);
}

void ReservoirSampler::move_into(Stats& stats) && {
  for (size_t i = 0; i < reservoirs_.size(); ++i) {
    if (preselected_) {  // rows in ascending priority, as reservoir_merge leaves them
      Reservoir sorted;
      sorted.capacity = reservoirs_[i].capacity;
      sorted.group = reservoirs_[i].group;
      sorted.d = reservoirs_[i].d;
      reservoir_merge(sorted, reservoirs_[i]);
      reservoirs_[i] = std::move(sorted);
    }
    flush_pending(i);
  }
  stats.reservoirs = std::move(reservoirs_);
}

void mirror_upper_triangles(HeadStats& hs, int d) {
  mirror_upper(hs.query_m2, d);
  mirror_upper(hs.output_m2, d);
  mirror_upper(hs.p2_m2, d);
  mirror_upper(hs.key_m2, d);
  mirror_upper(hs.value_m2, d);
}

StatsAccumulator::StatsAccumulator(const ModelConfig& config, int reservoir_capacity, uint64_t seed)
    : config_(checked_heads(config)),
      d_(config.head_dim),
      group_(config.group()),
      sampler_(config, reservoir_capacity, seed) {
  const size_t n = size_t(config.n_layers) * size_t(config.n_kv_heads);
  heads_.resize(n);
  for (auto& h : heads_) h.resize(d_);
  block_.resize(size_t(kSyrkBlockRows) * size_t(d_));
}

void StatsAccumulator::syrk_rows(std::vector<double>& c, const float* src, int n, int64_t stride,
                                 const double* row_scale) {
  for (int start = 0; start < n; start += kSyrkBlockRows) {
    const int rows = std::min(kSyrkBlockRows, n - start);
    for (int i = 0; i < rows; ++i) {
      const float* row = src + (start + i) * stride;
      double* dst = block_.data() + size_t(i) * d_;
      const double s = row_scale ? row_scale[start + i] : 1.0;
      for (int k = 0; k < d_; ++k) dst[k] = s * double(row[k]);
    }
    // Row-major A [rows, d]: C (d×d, upper) += Aᵀ A.
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, d_, rows, 1.0, block_.data(), d_, 1.0, c.data(), d_);
  }
}

void StatsAccumulator::on_qkv(const SequenceTaps& taps) {
  KVCC_REQUIRE(taps.layer >= 0 && taps.layer < config_.n_layers, "stats accumulator: layer index out of range");
  const int T = taps.T;
  const int n_kv = config_.n_kv_heads;
  const int64_t q_stride = int64_t(config_.n_heads) * d_;
  const int64_t kv_stride = int64_t(n_kv) * d_;

  current_layer_ = taps.layer;
  current_doc_ = taps.doc;
  current_T_ = T;
  p2_weights_.assign(size_t(n_kv) * size_t(T), 0.0);
  heads_seen_.assign(size_t(n_kv), 0);

  for (int h = 0; h < n_kv; ++h) {
    HeadStats& hs = head(taps.layer, h);
    // The group's r query heads are contiguous in a token's q row, so the group's queries are
    // T·r rows of width d: r consecutive rows per token, then a jump to the next token.
    const float* q_group = taps.q + int64_t(h) * group_ * d_;
    for (int k = 0; k < group_; ++k) syrk_rows(hs.query_m2, q_group + k * d_, T, q_stride);
    hs.query_count += uint64_t(T) * uint64_t(group_);

    const float* key = taps.key + int64_t(h) * d_;
    const float* value = taps.value + int64_t(h) * d_;
    syrk_rows(hs.key_m2, key, T, kv_stride);
    syrk_rows(hs.value_m2, value, T, kv_stride);
    hs.kv_count += uint64_t(T);
    for (int t = 0; t < T; ++t) {
      const float* kr = key + t * kv_stride;
      const float* vr = value + t * kv_stride;
      for (int c = 0; c < d_; ++c) {
        hs.key_min[c] = std::min(hs.key_min[c], double(kr[c]));
        hs.key_max[c] = std::max(hs.key_max[c], double(kr[c]));
        hs.value_min[c] = std::min(hs.value_min[c], double(vr[c]));
        hs.value_max[c] = std::max(hs.value_max[c], double(vr[c]));
      }
    }
  }
  sampler_.offer(taps.layer, taps.doc, sampler_.candidates(taps.layer, taps.doc, T), false, taps.q, taps.key_pre,
                 taps.key, taps.value);
}

void StatsAccumulator::on_probs(const SequenceTaps& taps, int q_head, const float* probs, const float* output) {
  KVCC_REQUIRE(taps.layer == current_layer_ && taps.doc == current_doc_ && taps.T == current_T_,
               "stats accumulator: on_probs without a matching on_qkv");
  KVCC_REQUIRE(q_head >= 0 && q_head < config_.n_heads, "stats accumulator: query head out of range");
  const int T = taps.T;
  const int h = q_head / group_;
  HeadStats& hs = head(taps.layer, h);

  syrk_rows(hs.output_m2, output, T, d_);
  hs.output_count += uint64_t(T);

  // w_j += Σ_i p_ij²; row i has non-zeros only for j ≤ i, so the upper triangle is skipped.
  double* w = p2_weights_.data() + size_t(h) * size_t(T);
  for (int i = 0; i < T; ++i) {
    const float* row = probs + int64_t(i) * T;
    for (int j = 0; j <= i; ++j) w[j] += double(row[j]) * double(row[j]);
  }
  if (++heads_seen_[size_t(h)] == group_) {
    // Σ_j w_j v_j v_jᵀ as a SYRK of rows scaled by sqrt(w_j).
    std::vector<double> sqrt_w(size_t(T), 0.0);
    double total = 0.0;
    for (int j = 0; j < T; ++j) {
      sqrt_w[size_t(j)] = std::sqrt(w[j]);
      total += w[j];
    }
    syrk_rows(hs.p2_m2, taps.value + int64_t(h) * d_, T, int64_t(config_.n_kv_heads) * d_, sqrt_w.data());
    hs.p2_weight += total;
  }
}

void StatsAccumulator::export_into(Stats& stats) const {
  StatsAccumulator copy = *this;
  std::move(copy).move_into(stats);
}

void StatsAccumulator::move_into(Stats& stats) && {
  KVCC_REQUIRE(stats.config.n_layers == config_.n_layers && stats.config.n_kv_heads == config_.n_kv_heads &&
                   stats.config.head_dim == config_.head_dim,
               "stats accumulator: exporting into stats of a different model shape");
  stats.heads = std::move(heads_);
  for (auto& hs : stats.heads) mirror_upper_triangles(hs, d_);
  std::move(sampler_).move_into(stats);
}

}  // namespace kvcc
