// Writes the stats seed for fuzz_stats (a small, fully populated stats file made by the project's
// own writer): make_seeds OUT.h5. The artifact seeds are the published artifacts, and their
// safetensors form for the other container: make_seeds --safetensors ARTIFACT OUT.safetensors.
#include <cstdio>
#include <random>

#include <string>

#include "formats/artifact.h"
#include "formats/artifact_safetensors.h"
#include "formats/stats.h"

int main(int argc, char** argv) {
  using namespace kvcc;
  if (argc == 4 && std::string(argv[1]) == "--safetensors") {
    write_artifact_safetensors(read_artifact(argv[2]), argv[3]);
    return 0;
  }
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT.h5 | --safetensors ARTIFACT OUT.safetensors\n", argv[0]);
    return 2;
  }
  ModelConfig c;
  c.architecture = "llama";
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 8;
  c.hidden = 32;
  c.intermediate = 128;
  c.vocab = 256;
  c.max_position = 512;
  Stats s = make_empty_stats(c, make_fingerprint(c, "fuzz"), 16);
  s.command = "make_seeds";
  s.provenance.data_sha256 = "seed";
  s.provenance.tokenizer = "ids";
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal;
  const int d = c.head_dim, r = c.group();
  for (size_t i = 0; i < s.heads.size(); ++i) {
    HeadStats& hs = s.heads[i];
    Reservoir& res = s.reservoirs[i];
    for (int t = 0; t < 12; ++t) {
      std::vector<float> q(size_t(r) * size_t(d)), k(static_cast<size_t>(d)), v(static_cast<size_t>(d));
      for (auto& x : q) x = normal(rng);
      for (auto& x : k) x = normal(rng);
      for (auto& x : v) x = normal(rng);
      for (int a = 0; a < d; ++a)
        for (int b = 0; b < d; ++b) {
          for (int g = 0; g < r; ++g)
            hs.query_m2[size_t(a * d + b)] += double(q[size_t(g * d + a)]) * q[size_t(g * d + b)];
          hs.key_m2[size_t(a * d + b)] += double(k[size_t(a)]) * k[size_t(b)];
          hs.value_m2[size_t(a * d + b)] += double(v[size_t(a)]) * v[size_t(b)];
          hs.output_m2[size_t(a * d + b)] += double(v[size_t(a)]) * v[size_t(b)];
          hs.p2_m2[size_t(a * d + b)] += double(v[size_t(a)]) * v[size_t(b)];
        }
      for (int a = 0; a < d; ++a) {
        hs.key_min[size_t(a)] = std::min(hs.key_min[size_t(a)], double(k[size_t(a)]));
        hs.key_max[size_t(a)] = std::max(hs.key_max[size_t(a)], double(k[size_t(a)]));
        hs.value_min[size_t(a)] = std::min(hs.value_min[size_t(a)], double(v[size_t(a)]));
        hs.value_max[size_t(a)] = std::max(hs.value_max[size_t(a)], double(v[size_t(a)]));
      }
      res.q.insert(res.q.end(), q.begin(), q.end());
      res.key_pre.insert(res.key_pre.end(), k.begin(), k.end());
      res.key.insert(res.key.end(), k.begin(), k.end());
      res.value.insert(res.value.end(), v.begin(), v.end());
      res.position.push_back(t);
      res.doc.push_back(uint32_t(t / 3));
      res.priority.push_back(uint64_t(t) * 1000 + 7);
      res.heldout.push_back(uint8_t((t / 3) % 5 == 4));
    }
    hs.query_count = 12 * uint64_t(r);
    hs.output_count = hs.query_count;
    hs.kv_count = 12;
    hs.p2_weight = 12;
  }
  write_stats(s, argv[1]);
  return 0;
}
