// BFloat16 activations on the host pool: a Runtime loaded with RuntimeOptions::activations =
// BFloat16 and fed bfloat16 q, k, v gives, for prefill and decode, exactly the bfloat16 rounding of
// what a float32 Runtime gives on the same values widened, and leaves its pool byte for byte equal
// (runtime/activations.h's contract), over steps that cross the sink's end, the ring's wrap and
// history page flushes. Through the C ABI too, which refuses an unknown activation type by name.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/fp16.h"
#include "runtime/kvcc_c.h"
#include "runtime/kvcc_runtime.h"
#include "cache_test_util.h"

namespace kvcc {
namespace {

constexpr int kLayers = 2, kHeads = 4, kKv = 2, kD = 32;

RuntimeOptions options(Activations act) {
  RuntimeOptions o;
  o.max_pages = 32;
  o.max_sequences = 4;
  o.memory = PoolMemory::Host;
  o.activations = act;
  return o;
}

// n random values that bfloat16 holds exactly: as bfloat16 words and widened to float.
struct Bf16Values {
  std::vector<uint16_t> bits;
  std::vector<float> wide;
};
Bf16Values random_bf16(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Bf16Values v;
  for (size_t i = 0; i < n; ++i) {
    v.bits.push_back(bf16_from_float(nd(rng)));
    v.wide.push_back(float_from_bf16(v.bits.back()));
  }
  return v;
}

// Number of elements where got (bfloat16) is not the rounding of want (float32).
size_t rounding_mismatches(const std::vector<uint16_t>& got, const std::vector<float>& want) {
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) bad += got[i] != bf16_from_float(want[i]);
  return bad;
}

bool pools_equal(const Runtime& a, const Runtime& b) {
  Runtime& x = const_cast<Runtime&>(a);
  Runtime& y = const_cast<Runtime&>(b);
  return x.cache().pool_bytes() == y.cache().pool_bytes() &&
         std::memcmp(x.cache().pages_base(), y.cache().pages_base(), x.cache().pool_bytes()) == 0;
}

TEST(RuntimeActivations, BFloat16CallsEqualRoundedFloat32Calls) {
  const Artifact art = testing::small_runtime_artifact(kLayers, kHeads, kKv, kD);
  const EngineShape e{kLayers, kHeads, kKv, kD};
  Runtime f32(art, e, options(Activations::Float32)), bf16(art, e, options(Activations::BFloat16));
  EXPECT_EQ(bf16.activations(), Activations::BFloat16);
  std::vector<int> seqs;
  for (int i = 0; i < 2; ++i) {
    seqs.push_back(f32.cache().add_sequence());
    ASSERT_EQ(bf16.cache().add_sequence(), seqs.back());
  }
  std::mt19937 rng(7);
  const size_t kv_row = size_t(kKv) * kD, q_row = size_t(kHeads) * kD;
  // Sink 8, ring 32, pages of 16 (small_runtime_artifact): prefill 20 tokens of sequence 0 (past
  // the sink), then steps of 1-25 tokens that flush pages and wrap both rings.
  struct Step {
    std::vector<int> seqs, counts;
  };
  const std::vector<Step> steps = {{{0}, {20}},      {{0, 1}, {1, 5}},   {{1, 0}, {17, 1}}, {{0, 1}, {16, 1}},
                                   {{0, 1}, {1, 1}}, {{1, 0}, {25, 13}}, {{0, 1}, {1, 1}}};
  size_t checked = 0;
  for (size_t si = 0; si < steps.size(); ++si) {
    const Step& st = steps[si];
    int rows = 0;
    for (int c : st.counts) rows += c;
    f32.begin_append(st.seqs, st.counts);
    bf16.begin_append(st.seqs, st.counts);
    for (int l = 0; l < kLayers; ++l) {
      const Bf16Values k = random_bf16(size_t(rows) * kv_row, rng), v = random_bf16(size_t(rows) * kv_row, rng);
      if (st.counts[0] > 1) {  // the first sequence's new tokens through prefill (its rows come first)
        const int T = st.counts[0];
        const Bf16Values q = random_bf16(size_t(T) * q_row, rng);
        std::vector<float> want(q.wide.size());
        std::vector<uint16_t> got(q.wide.size(), 0xffff);
        f32.prefill(l, st.seqs[0], T, q.wide.data(), k.wide.data(), v.wide.data(), want.data());
        bf16.prefill(l, st.seqs[0], T, q.bits.data(), k.bits.data(), v.bits.data(), got.data());
        ASSERT_EQ(rounding_mismatches(got, want), 0u) << "prefill, step " << si << " layer " << l;
        checked += want.size();
      }
      f32.append(l, k.wide.data(), v.wide.data());
      bf16.append(l, k.bits.data(), v.bits.data());
      const Bf16Values q = random_bf16(st.seqs.size() * q_row, rng);
      std::vector<float> want(q.wide.size());
      std::vector<uint16_t> got(q.wide.size(), 0xffff);
      f32.decode(l, st.seqs, q.wide.data(), want.data());
      bf16.decode(l, st.seqs, q.bits.data(), got.data());
      ASSERT_EQ(rounding_mismatches(got, want), 0u) << "decode, step " << si << " layer " << l;
      checked += want.size();
    }
    ASSERT_TRUE(pools_equal(f32, bf16)) << "the pools differ after step " << si;
  }
  // The steps crossed what they were meant to (sequence 0: 20 + 1 + 1 + 16 + 1 + 13 + 1 = 53 tokens).
  const KvTiers t = tiers_of(f32.geometry(), f32.cache().length(0));
  EXPECT_EQ(f32.cache().length(0), 53);
  EXPECT_GT(t.hist_tokens, 0);
  EXPECT_GT(f32.cache().length(1), f32.geometry().sink + f32.geometry().recent);  // ring wrapped, pages flushed
  EXPECT_GT(checked, 0u);
}

TEST(RuntimeActivations, CAbiTakesBFloat16AndRefusesUnknownTypes) {
  const std::string path = ::testing::TempDir() + "kvcc_activations_test.kvcc.h5";
  write_artifact(testing::small_runtime_artifact(kLayers, kHeads, kKv, kD), path);
  kvcc_runtime* rt = nullptr;
  EXPECT_EQ(kvcc_runtime_load_limits(path.c_str(), kLayers, kHeads, kKv, kD, 8, 2, 0, 0, 1, 0, 0, 0, 7, &rt),
            KVCC_BAD_ARGUMENT);
  EXPECT_NE(std::string(kvcc_last_error()).find("KVCC_BFLOAT16"), std::string::npos) << kvcc_last_error();
  EXPECT_EQ(rt, nullptr);
  ASSERT_EQ(
      kvcc_runtime_load_limits(path.c_str(), kLayers, kHeads, kKv, kD, 8, 2, 0, 0, 1, 0, 0, 0, KVCC_BFLOAT16, &rt),
      KVCC_OK)
      << kvcc_last_error();
  // The same step through the C++ Runtime in float32 is the reference.
  Runtime ref(testing::small_runtime_artifact(kLayers, kHeads, kKv, kD), EngineShape{kLayers, kHeads, kKv, kD},
              options(Activations::Float32));
  int s = -1;
  ASSERT_EQ(kvcc_add_sequence(rt, &s), KVCC_OK);
  ASSERT_EQ(ref.cache().add_sequence(), s);
  std::mt19937 rng(3);
  const int counts[] = {3};
  ASSERT_EQ(kvcc_begin_append(rt, 1, &s, counts), KVCC_OK) << kvcc_last_error();
  ref.begin_append({s}, {3});
  for (int l = 0; l < kLayers; ++l) {
    const Bf16Values k = random_bf16(3 * size_t(kKv) * kD, rng), v = random_bf16(3 * size_t(kKv) * kD, rng);
    ASSERT_EQ(kvcc_append(rt, l, k.bits.data(), v.bits.data(), nullptr), KVCC_OK) << kvcc_last_error();
    ref.append(l, k.wide.data(), v.wide.data());
    const Bf16Values q = random_bf16(size_t(kHeads) * kD, rng);
    std::vector<uint16_t> got(q.bits.size(), 0xffff);
    std::vector<float> want(q.bits.size());
    ASSERT_EQ(kvcc_decode(rt, l, 1, &s, q.bits.data(), got.data(), nullptr), KVCC_OK) << kvcc_last_error();
    ref.decode(l, {s}, q.wide.data(), want.data());
    EXPECT_EQ(rounding_mismatches(got, want), 0u) << "layer " << l;
  }
  kvcc_runtime_free(rt);
}

TEST(RuntimeActivations, UnknownActivationTypeIsRefused) {
  RuntimeOptions o = options(Activations::Float32);
  o.activations = static_cast<Activations>(3);
  EXPECT_THROW(
      Runtime(testing::small_runtime_artifact(kLayers, kHeads, kKv, kD), EngineShape{kLayers, kHeads, kKv, kD}, o),
      Error);
}

}  // namespace
}  // namespace kvcc
