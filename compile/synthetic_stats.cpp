#include "compile/synthetic_stats.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "compile/rotation.h"
#include "formats/error.h"

namespace kvcc {

namespace {

using RowMat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

std::vector<double> to_vector(const RowMat& m) { return std::vector<double>(m.data(), m.data() + m.size()); }

uint64_t token_priority(uint64_t seed, uint32_t doc, int32_t pos) {
  GaussianStream s(seed ^ (uint64_t(doc) << 32) ^ uint64_t(uint32_t(pos)) ^ 0x5eedull);
  return s.next_u64();
}

}  // namespace

Stats make_synthetic_stats(const SyntheticSpec& spec) {
  KVCC_REQUIRE(spec.n_layers > 0 && spec.n_kv_heads > 0 && spec.group > 0 && spec.head_dim > 1 && spec.docs > 0 &&
                   spec.doc_len > 0,
               "synthetic stats: every dimension must be positive");
  const int d = spec.head_dim, r = spec.group;
  const int n_tokens = spec.docs * spec.doc_len;

  Stats stats;
  stats.producer = "kvcc synthetic";
  stats.command = "make_synthetic_stats";
  ModelConfig& c = stats.config;
  c.architecture = "llama";
  c.n_layers = spec.n_layers;
  c.n_kv_heads = spec.n_kv_heads;
  c.n_heads = spec.n_kv_heads * r;
  c.head_dim = d;
  c.hidden = c.n_heads * d;
  c.intermediate = 4 * c.hidden;
  c.vocab = 256;
  c.max_position = spec.doc_len;
  stats.fingerprint = make_fingerprint(c, "synthetic");
  stats.provenance.tokens = uint64_t(n_tokens);
  stats.provenance.sequences = uint64_t(spec.docs);
  stats.provenance.seed = spec.seed;
  stats.provenance.max_seq_len = spec.doc_len;
  stats.provenance.data_sha256 = "synthetic";

  // Which tokens the reservoir keeps: the same in every layer and head (as calibration does).
  std::vector<int> kept(static_cast<size_t>(n_tokens));
  std::iota(kept.begin(), kept.end(), 0);
  if (spec.reservoir_capacity > 0 && spec.reservoir_capacity < n_tokens) {
    std::vector<uint64_t> prio(static_cast<size_t>(n_tokens));
    for (int t = 0; t < n_tokens; ++t)
      prio[size_t(t)] = token_priority(spec.seed, uint32_t(t / spec.doc_len), t % spec.doc_len);
    std::nth_element(kept.begin(), kept.begin() + spec.reservoir_capacity, kept.end(),
                     [&](int a, int b) { return prio[size_t(a)] < prio[size_t(b)]; });
    kept.resize(size_t(spec.reservoir_capacity));
    std::sort(kept.begin(), kept.end());
  }

  const double inv_sqrt_d = 1.0 / std::sqrt(double(d));
  for (int layer = 0; layer < spec.n_layers; ++layer)
    for (int h = 0; h < spec.n_kv_heads; ++h) {
      GaussianStream gauss(derive_seed(spec.seed, layer, h, 7));
      const Matrix basis = random_orthogonal(d, derive_seed(spec.seed, layer, h, 8));
      Eigen::Map<const RowMat> bq(basis.data(), d, d);
      RowMat q(n_tokens * r, d), k(n_tokens, d), v(n_tokens, d);
      Eigen::VectorXd q_scale(d);
      for (int i = 0; i < d; ++i) q_scale(i) = 3.0 * std::exp(-0.5 * double(i) / spec.query_decay);
      for (int row = 0; row < n_tokens * r; ++row) {
        Eigen::RowVectorXd z(d);
        for (int i = 0; i < d; ++i) z(i) = gauss.next() * q_scale(i);
        q.row(row) = z * bq.transpose();
      }
      // A few large key channels (the usual post-RoPE outliers), a shared top-query component.
      const int big[3] = {1 % d, (d / 2 + 1) % d, (5 + layer + h) % d};
      for (int t = 0; t < n_tokens; ++t) {
        for (int i = 0; i < d; ++i) k(t, i) = gauss.next();
        for (int b : big) k(t, b) = 6.0 * gauss.next() + 4.0;
        k.row(t) += 1.5 * gauss.next() * bq.col(0).transpose();
        for (int i = 0; i < d; ++i) v(t, i) = gauss.next() * (0.5 + 1.5 * double(i % 7 == 0));
      }
      // Causal softmax attention within each document.
      RowMat out(n_tokens * r, d);
      Eigen::VectorXd p2w = Eigen::VectorXd::Zero(n_tokens);
      for (int doc = 0; doc < spec.docs; ++doc) {
        const int base = doc * spec.doc_len;
        for (int i = 0; i < spec.doc_len; ++i)
          for (int g = 0; g < r; ++g) {
            const int qrow = (base + i) * r + g;
            Eigen::VectorXd logits = k.middleRows(base, i + 1) * q.row(qrow).transpose() * inv_sqrt_d;
            const double mx = logits.maxCoeff();
            Eigen::VectorXd p = (logits.array() - mx).exp();
            p /= p.sum();
            out.row(qrow) = p.transpose() * v.middleRows(base, i + 1);
            p2w.segment(base, i + 1) += p.cwiseProduct(p);
          }
      }
      HeadStats& hs = stats.heads.emplace_back();
      hs.query_m2 = to_vector(q.transpose() * q);
      hs.query_count = uint64_t(n_tokens * r);
      hs.output_m2 = to_vector(out.transpose() * out);
      hs.output_count = uint64_t(n_tokens * r);
      hs.p2_m2 = to_vector(v.transpose() * p2w.asDiagonal() * v);
      hs.p2_weight = p2w.sum();
      hs.key_m2 = to_vector(k.transpose() * k);
      hs.value_m2 = to_vector(v.transpose() * v);
      hs.kv_count = uint64_t(n_tokens);
      hs.key_min.resize(static_cast<size_t>(d));
      hs.key_max.resize(static_cast<size_t>(d));
      hs.value_min.resize(static_cast<size_t>(d));
      hs.value_max.resize(static_cast<size_t>(d));
      for (int i = 0; i < d; ++i) {
        hs.key_min[size_t(i)] = k.col(i).minCoeff();
        hs.key_max[size_t(i)] = k.col(i).maxCoeff();
        hs.value_min[size_t(i)] = v.col(i).minCoeff();
        hs.value_max[size_t(i)] = v.col(i).maxCoeff();
      }

      Reservoir& res = stats.reservoirs.emplace_back();
      res.capacity = spec.reservoir_capacity > 0 ? spec.reservoir_capacity : n_tokens;
      res.group = r;
      res.d = d;
      for (int t : kept) {
        const uint32_t doc = uint32_t(t / spec.doc_len);
        const int32_t pos = t % spec.doc_len;
        for (int g = 0; g < r; ++g)
          for (int i = 0; i < d; ++i) res.q.push_back(float(q(t * r + g, i)));
        for (int i = 0; i < d; ++i) {
          res.key.push_back(float(k(t, i)));
          res.key_pre.push_back(float(k(t, i)));  // synthetic: no RoPE
          res.value.push_back(float(v(t, i)));
        }
        res.position.push_back(pos);
        res.doc.push_back(doc);
        res.priority.push_back(token_priority(spec.seed, doc, pos));
        res.heldout.push_back(doc % 5 == 4 ? 1 : 0);
      }
    }
  return stats;
}

}  // namespace kvcc
