// Stats format v1: exact round trip of random contents, merge against sums and reservoirs computed
// naively over the union of the two shards' rows, and every kind of bad input giving a clear
// one-line error without leaving output behind.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "formats/error.h"
#include "formats/h5.h"
#include "formats/sha256.h"
#include "formats/stats.h"
#include "formats_test_util.h"

namespace kvcc {
namespace {

using testing::error_of;

void expect_equal_stats(const Stats& a, const Stats& b) {
  EXPECT_EQ(a.producer, b.producer);
  EXPECT_EQ(a.created, b.created);
  EXPECT_EQ(a.command, b.command);
  EXPECT_EQ(fingerprint_fields(a.config), fingerprint_fields(b.config));
  EXPECT_EQ(a.config.max_position, b.config.max_position);
  EXPECT_EQ(a.config.bos_id, b.config.bos_id);
  EXPECT_EQ(a.config.eos_id, b.config.eos_id);
  EXPECT_EQ(a.config.add_bos, b.config.add_bos);
  EXPECT_EQ(a.fingerprint.id, b.fingerprint.id);
  EXPECT_EQ(a.fingerprint.fields, b.fingerprint.fields);
  EXPECT_EQ(a.fingerprint.weights_sha256, b.fingerprint.weights_sha256);
  EXPECT_EQ(a.provenance.data_sha256, b.provenance.data_sha256);
  EXPECT_EQ(a.provenance.tokens, b.provenance.tokens);
  EXPECT_EQ(a.provenance.sequences, b.provenance.sequences);
  EXPECT_EQ(a.provenance.seed, b.provenance.seed);
  EXPECT_EQ(a.provenance.max_seq_len, b.provenance.max_seq_len);
  EXPECT_EQ(a.provenance.tokenizer, b.provenance.tokenizer);
  ASSERT_EQ(a.heads.size(), b.heads.size());
  for (size_t i = 0; i < a.heads.size(); ++i) {
    const HeadStats &x = a.heads[i], &y = b.heads[i];
    EXPECT_EQ(x.query_m2, y.query_m2);
    EXPECT_EQ(x.output_m2, y.output_m2);
    EXPECT_EQ(x.p2_m2, y.p2_m2);
    EXPECT_EQ(x.key_m2, y.key_m2);
    EXPECT_EQ(x.value_m2, y.value_m2);
    EXPECT_EQ(x.key_min, y.key_min);
    EXPECT_EQ(x.key_max, y.key_max);
    EXPECT_EQ(x.value_min, y.value_min);
    EXPECT_EQ(x.value_max, y.value_max);
    EXPECT_EQ(x.query_count, y.query_count);
    EXPECT_EQ(x.output_count, y.output_count);
    EXPECT_EQ(x.kv_count, y.kv_count);
    EXPECT_EQ(x.p2_weight, y.p2_weight);
    const Reservoir &r = a.reservoirs[i], &s = b.reservoirs[i];
    EXPECT_EQ(r.capacity, s.capacity);
    EXPECT_EQ(r.group, s.group);
    EXPECT_EQ(r.d, s.d);
    EXPECT_EQ(r.q, s.q);
    EXPECT_EQ(r.key_pre, s.key_pre);
    EXPECT_EQ(r.key, s.key);
    EXPECT_EQ(r.value, s.value);
    EXPECT_EQ(r.position, s.position);
    EXPECT_EQ(r.doc, s.doc);
    EXPECT_EQ(r.priority, s.priority);
    EXPECT_EQ(r.heldout, s.heldout);
  }
}

TEST(StatsFormat, RoundTripIsExact) {
  testing::ScratchDir dir;
  const ModelConfig c = testing::small_config();
  auto rs = testing::random_stats(c, testing::small_fingerprint(c), 10, 25, 1);
  // Edge cases: an empty reservoir and a head that saw nothing (±inf ranges).
  rs.stats.reservoirs[1] = Reservoir{10, c.group(), c.head_dim, {}, {}, {}, {}, {}, {}, {}, {}};
  rs.stats.heads[2].resize(c.head_dim);
  const std::string path = dir.file("stats.h5");
  write_stats(rs.stats, path);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"stats.h5"});
  const Stats back = read_stats(path);
  expect_equal_stats(rs.stats, back);
  EXPECT_TRUE(verify_stats(back).empty()) << verify_stats(back).front();
  EXPECT_TRUE(verify_stats_file(path).empty());
  EXPECT_EQ(back.heads[2].key_min[0], std::numeric_limits<double>::infinity());

  // The summary read is the same without the reservoirs' row arrays.
  Stats summary = read_stats_summary(path);
  for (size_t i = 0; i < summary.reservoirs.size(); ++i) {
    EXPECT_TRUE(summary.reservoirs[i].q.empty() && summary.reservoirs[i].key.empty() &&
                summary.reservoirs[i].key_pre.empty() && summary.reservoirs[i].value.empty());
    summary.reservoirs[i].q = back.reservoirs[i].q;
    summary.reservoirs[i].key_pre = back.reservoirs[i].key_pre;
    summary.reservoirs[i].key = back.reservoirs[i].key;
    summary.reservoirs[i].value = back.reservoirs[i].value;
  }
  expect_equal_stats(summary, back);
}

TEST(StatsFormat, MakeEmptyStatsShapes) {
  const ModelConfig c = testing::small_config(2, 6, 3, 16);
  Stats s = make_empty_stats(c, testing::small_fingerprint(c), 64);
  ASSERT_EQ(s.heads.size(), 6u);
  ASSERT_EQ(s.reservoirs.size(), 6u);
  EXPECT_EQ(s.head(1, 2).query_m2.size(), 256u);
  EXPECT_EQ(s.head(1, 2).key_min.size(), 16u);
  EXPECT_EQ(s.reservoir(1, 2).capacity, 64);
  EXPECT_EQ(s.reservoir(1, 2).group, 2);
  EXPECT_EQ(s.reservoir(1, 2).d, 16);
  EXPECT_EQ(s.producer, std::string("kvcc ") + KVCC_VERSION);
  EXPECT_EQ(s.created.size(), 20u);  // 2026-01-01T00:00:00Z
}

TEST(StatsFormat, MergeEqualsNaiveUnion) {
  const ModelConfig c = testing::small_config();
  const ModelFingerprint fp = testing::small_fingerprint(c);
  const int capacity = 12;
  auto a = testing::random_stats(c, fp, capacity, 20, 11);
  auto b = testing::random_stats(c, fp, capacity, 30, 22);
  Stats merged = a.stats;
  merge_stats(merged, b.stats);

  // Naive: the sums over the union of rows, and the `capacity` smallest priorities of the union.
  auto naive = testing::random_stats(c, fp, capacity, 0, 0);
  const int d = c.head_dim, r = c.group();
  for (size_t hi = 0; hi < merged.heads.size(); ++hi) {
    std::vector<const testing::TokenRows*> all;
    for (const auto& t : a.rows[hi]) all.push_back(&t);
    for (const auto& t : b.rows[hi]) all.push_back(&t);
    std::vector<double> q2(size_t(d * d)), k2(size_t(d * d)), v2(size_t(d * d));
    std::vector<double> kmin(size_t(d), 1e300), kmax(size_t(d), -1e300);
    for (const auto* t : all) {
      for (int g = 0; g < r; ++g) testing::add_outer(q2, t->q.data() + g * d, d);
      testing::add_outer(k2, t->key.data(), d);
      testing::add_outer(v2, t->value.data(), d);
      for (int i = 0; i < d; ++i) {
        kmin[size_t(i)] = std::min(kmin[size_t(i)], double(t->key[size_t(i)]));
        kmax[size_t(i)] = std::max(kmax[size_t(i)], double(t->key[size_t(i)]));
      }
    }
    const HeadStats& m = merged.heads[hi];
    for (size_t k = 0; k < q2.size(); ++k) {
      EXPECT_NEAR(m.query_m2[k], q2[k], 1e-9 * (1 + std::abs(q2[k])));
      EXPECT_NEAR(m.key_m2[k], k2[k], 1e-9 * (1 + std::abs(k2[k])));
      EXPECT_NEAR(m.value_m2[k], v2[k], 1e-9 * (1 + std::abs(v2[k])));
    }
    EXPECT_EQ(m.key_min, kmin);
    EXPECT_EQ(m.key_max, kmax);
    EXPECT_EQ(m.query_count, uint64_t(50 * r));
    EXPECT_EQ(m.kv_count, 50u);
    EXPECT_DOUBLE_EQ(m.p2_weight, a.stats.heads[hi].p2_weight + b.stats.heads[hi].p2_weight);

    std::sort(all.begin(), all.end(), [](auto* x, auto* y) { return x->priority < y->priority; });
    const Reservoir& res = merged.reservoirs[hi];
    ASSERT_EQ(res.size(), size_t(capacity));
    for (int i = 0; i < capacity; ++i) {
      EXPECT_EQ(res.priority[size_t(i)], all[size_t(i)]->priority);
      EXPECT_EQ(res.position[size_t(i)], all[size_t(i)]->position);
      EXPECT_EQ(res.doc[size_t(i)], all[size_t(i)]->doc);
      EXPECT_EQ(res.heldout[size_t(i)], uint8_t(all[size_t(i)]->doc % 5 == 4));
      EXPECT_TRUE(std::equal(all[size_t(i)]->q.begin(), all[size_t(i)]->q.end(), res.q.begin() + i * r * d));
      EXPECT_TRUE(std::equal(all[size_t(i)]->key.begin(), all[size_t(i)]->key.end(), res.key.begin() + i * d));
      EXPECT_TRUE(
          std::equal(all[size_t(i)]->key_pre.begin(), all[size_t(i)]->key_pre.end(), res.key_pre.begin() + i * d));
      EXPECT_TRUE(std::equal(all[size_t(i)]->value.begin(), all[size_t(i)]->value.end(), res.value.begin() + i * d));
    }
  }
  EXPECT_EQ(merged.provenance.tokens, 50u);
  EXPECT_EQ(merged.provenance.sequences, 6u);
  EXPECT_EQ(merged.provenance.data_sha256, "merged:" + sha256_hex("data11\ndata22\n"));

  // Order does not matter.
  Stats other = b.stats;
  merge_stats(other, a.stats);
  for (size_t hi = 0; hi < merged.heads.size(); ++hi) {
    EXPECT_EQ(other.reservoirs[hi].priority, merged.reservoirs[hi].priority);
    EXPECT_EQ(other.reservoirs[hi].value, merged.reservoirs[hi].value);
  }
  EXPECT_EQ(other.provenance.data_sha256, merged.provenance.data_sha256);
  (void)naive;
}

TEST(StatsFormat, ReservoirMergeSkipsDuplicatesAndAdoptsShape) {
  std::mt19937_64 rng(5);
  const int d = 4, r = 2;
  auto rows = testing::random_rows(6, r, d, rng);
  auto to_reservoir = [&](std::initializer_list<int> which, int capacity) {
    Reservoir res{capacity, r, d, {}, {}, {}, {}, {}, {}, {}, {}};
    for (int i : which) {
      const auto& t = rows[size_t(i)];
      res.q.insert(res.q.end(), t.q.begin(), t.q.end());
      res.key_pre.insert(res.key_pre.end(), t.key_pre.begin(), t.key_pre.end());
      res.key.insert(res.key.end(), t.key.begin(), t.key.end());
      res.value.insert(res.value.end(), t.value.begin(), t.value.end());
      res.position.push_back(t.position);
      res.doc.push_back(t.doc);
      res.priority.push_back(t.priority);
      res.heldout.push_back(uint8_t(t.doc % 5 == 4));
    }
    return res;
  };
  Reservoir target;  // empty, d == 0: takes the other's shape
  target.capacity = 10;
  reservoir_merge(target, to_reservoir({0, 1, 2, 3}, 10));
  reservoir_merge(target, to_reservoir({2, 3, 4, 5}, 10));  // 2 and 3 are duplicates
  ASSERT_EQ(target.size(), 6u);
  EXPECT_EQ(target.d, d);
  EXPECT_TRUE(std::is_sorted(target.priority.begin(), target.priority.end()));
  Reservoir wrong{10, r, d + 1, {}, {}, {}, {}, {}, {}, {}, {}};
  EXPECT_CONTAINS(error_of([&] { reservoir_merge(target, wrong); }), "different shapes");
}

TEST(StatsFormat, MergeRefusesDifferentModels) {
  const ModelConfig c = testing::small_config(3);
  const ModelConfig deeper = testing::small_config(4);
  auto a = testing::random_stats(c, testing::small_fingerprint(c), 5, 5, 1);
  auto b = testing::random_stats(deeper, testing::small_fingerprint(deeper), 5, 5, 2);
  auto w = testing::random_stats(c, testing::small_fingerprint(c, "otherweights"), 5, 5, 3);
  Stats x = a.stats;
  EXPECT_EQ(error_of([&] { merge_stats(x, b.stats); }), "cannot merge stats of different models: n_layers: 3 vs 4");
  EXPECT_EQ(error_of([&] { merge_stats(x, w.stats); }), "cannot merge stats of different models: weights: differ");
  expect_equal_stats(x, a.stats);  // untouched
}

// Writes good stats, then lets `damage` edit the file in place through the HDF5 API.
template <class F>
std::string damaged(const testing::ScratchDir& dir, F&& damage) {
  const ModelConfig c = testing::small_config();
  auto rs = testing::random_stats(c, testing::small_fingerprint(c), 4, 6, 9);
  const std::string path = dir.file("damaged.h5");
  write_stats(rs.stats, path);
  {
    h5::File f = h5::File::open_rw(path);
    damage(f);
    h5::seal_attributes(f);
    f.close();
  }
  return path;
}

TEST(StatsFormat, BadInputGivesClearErrors) {
  testing::ScratchDir dir;
  const ModelConfig c = testing::small_config();
  auto rs = testing::random_stats(c, testing::small_fingerprint(c), 4, 6, 9);
  const std::string good = dir.file("good.h5");
  write_stats(rs.stats, good);

  // Truncated and not-HDF5.
  const std::string bytes = testing::read_bytes(good);
  testing::write_bytes(dir.file("cut.h5"), bytes.substr(0, bytes.size() * 2 / 3));
  EXPECT_CONTAINS(error_of([&] { read_stats(dir.file("cut.h5")); }),
                  dir.file("cut.h5") + ": truncated HDF5 file (" + std::to_string(bytes.size() * 2 / 3) + " of its ");
  testing::write_bytes(dir.file("notes.txt"), "q k v\n");
  EXPECT_EQ(error_of([&] { read_stats(dir.file("notes.txt")); }),
            dir.file("notes.txt") + ": not an HDF5 file (or truncated)");

  // Missing dataset.
  std::string path = damaged(dir, [](h5::File& f) { H5Ldelete(f.id(), "/layers/1/kv0/query_m2", H5P_DEFAULT); });
  EXPECT_EQ(error_of([&] { read_stats(path); }), path + ": missing dataset /layers/1/kv0/query_m2");

  // Wrong major version; a newer minor with unknown additions is read.
  path = damaged(dir, [](h5::File& f) { f.set_attr("format_version", std::string("2.0")); });
  EXPECT_EQ(error_of([&] { read_stats(path); }),
            path + ": kvcc-stats format_version 2.0 is not supported (this kvcc reads 1.x)");
  path = damaged(dir, [](h5::File& f) {
    f.set_attr("format_version", std::string("1.9"));
    f.create_group("future_addition").set_attr("x", 1);
    f.group("layers").group("0").group("kv1").write("future_matrix", {2}, std::vector<double>{1, 2});
  });
  EXPECT_NO_THROW(read_stats(path));

  // An artifact is not stats.
  path = damaged(dir, [](h5::File& f) { f.set_attr("format", std::string("kvcc-artifact")); });
  EXPECT_EQ(error_of([&] { read_stats(path); }), path + ": is a kvcc-artifact file, expected kvcc-stats");

  // Shapes against the config.
  path = damaged(dir, [](h5::File& f) {
    h5::Group g = f.group("layers").group("2").group("kv1");
    H5Ldelete(g.id(), "key_m2", H5P_DEFAULT);
    g.write("key_m2", {8, 7}, std::vector<double>(56, 0.0));
  });
  EXPECT_EQ(error_of([&] { read_stats(path); }), path + ": /layers/2/kv1/key_m2 has shape [8, 7], expected [8, 8]");

  // NaN in a sum.
  path = damaged(dir, [](h5::File& f) {
    h5::Dataset ds = f.group("layers").group("0").group("kv0").dataset("value_m2");
    std::vector<double> v(64, 1.0);
    v[9] = std::nan("");
    H5Dwrite(ds.id(), H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
  });
  EXPECT_EQ(error_of([&] { read_stats(path); }), path + ": /layers/0/kv0/value_m2: contains NaN or inf");
  // verify lists the problem instead of throwing.
  auto problems = verify_stats_file(path);
  ASSERT_FALSE(problems.empty());
  EXPECT_EQ(problems.front(), path + ": /layers/0/kv0/value_m2: contains NaN or inf");

  // A config edited to disagree with its fingerprint.
  path = damaged(dir, [](h5::File& f) { f.group("model").set_attr("n_heads", 8); });
  EXPECT_CONTAINS(error_of([&] { read_stats(path); }), "model config does not match its fingerprint");
}

TEST(StatsFormat, VerifyFindsAsymmetryAndBadFlags) {
  const ModelConfig c = testing::small_config();
  auto rs = testing::random_stats(c, testing::small_fingerprint(c), 4, 6, 9);
  rs.stats.heads[3].query_m2[1] += 1.0;  // (0,1) no longer equals (1,0)
  rs.stats.reservoirs[0].heldout[0] ^= 1;
  auto problems = verify_stats(rs.stats);
  ASSERT_EQ(problems.size(), 2u);
  EXPECT_CONTAINS(problems[0], "/layers/0/kv0/reservoir: heldout flag disagrees");
  EXPECT_CONTAINS(problems[1], "/layers/1/kv1/query_m2: not symmetric");
}

TEST(StatsFormat, WriterRefusesInconsistentStatsAndLeavesNothing) {
  testing::ScratchDir dir;
  const ModelConfig c = testing::small_config();
  auto rs = testing::random_stats(c, testing::small_fingerprint(c), 4, 6, 9);
  rs.stats.heads[4].key_m2.pop_back();
  EXPECT_EQ(error_of([&] { write_stats(rs.stats, dir.file("out.h5")); }),
            "/layers/2/kv0/key_m2 has 63 values, expected 8x8");
  EXPECT_TRUE(dir.entries().empty());
  rs = testing::random_stats(c, testing::small_fingerprint(c), 4, 6, 9);
  EXPECT_CONTAINS(error_of([&] { write_stats(rs.stats, dir.file("missing_dir/out.h5")); }), "cannot create output");
  EXPECT_TRUE(dir.entries().empty());
}

}  // namespace
}  // namespace kvcc
