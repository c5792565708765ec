// CommVQ benchmark: EM training time per (layer, KV head) and the CPU reference's scoring
// throughput. Options: bench_commvq --help.
//
// Rows, in order of preference:
//   --model/--text: layer-0 pre-RoPE keys and values of KV head H computed by the model itself
//     (embedding, RMSNorm, k/v projections: model/forward.h) over the text's documents, N rows
//     (e.g. gutenberg-27m over ../shared/text/gutenberg_heldout.txt);
//   --stats: the reservoir rows of (L, H) of a stats file;
//   otherwise (or to fill up to N): synthetic Gaussian rows with a skewed spectrum (channel scale
//     0.93^c, a few large-mean channels). The output says which.
// --max-stages S trains only the first S stages of each side and extrapolates the full time
// (stages cost about the same each), to keep a 2-core run short.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_args.h"
#include "compile/commvq.h"
#include "formats/error.h"
#include "formats/fp16.h"
#include "formats/model_file.h"
#include "formats/stats.h"
#include "model/tokenizer.h"
#include "runtime/commvq_score.h"
#include "model/forward.h"

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
// Process CPU seconds (all threads): on a shared machine wall time overstates the cost.
double cpu_seconds() { return double(std::clock()) / CLOCKS_PER_SEC; }

std::vector<float> skewed_rows(size_t n, int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(n * size_t(d));
  for (size_t i = 0; i < n; ++i)
    for (int c = 0; c < d; ++c)
      x[i * d + c] = (c % 17 == 3 ? 4.0f : 0.0f) + g(rng) * 3.0f * std::pow(0.93f, float(c % (d / 2)));
  return x;
}

// Layer-0 pre-RoPE keys and values of KV head `head` for the first `rows` tokens of the text.
void model_rows(const std::string& model_dir, const std::string& text_path, int head, size_t rows,
                kvcc::ModelConfig& config, std::vector<float>& keys, std::vector<float>& values) {
  const kvcc::ModelFile model = kvcc::ModelFile::open(model_dir);
  config = model.config();
  const auto tokenizer = kvcc::Tokenizer::for_model(model_dir, config.vocab);
  std::FILE* f = std::fopen(text_path.c_str(), "rb");
  KVCC_REQUIRE(f != nullptr, "cannot open " + text_path);
  std::string text;
  char buf[65536];
  for (size_t got; (got = std::fread(buf, 1, sizeof buf, f)) > 0;) text.append(buf, got);
  std::fclose(f);
  const kvcc::LayerWeights w = kvcc::load_layer(model, 0);
  const int d = config.head_dim, kv = config.n_kv_heads * d;
  KVCC_REQUIRE(head < config.n_kv_heads, "--head outside the model");
  const int max_t = 2048;
  for (const std::string& doc : kvcc::split_documents(text)) {
    std::vector<int32_t> ids = tokenizer->encode(doc, config.add_bos);
    for (size_t t0 = 0; t0 < ids.size() && keys.size() < rows * size_t(d); t0 += max_t) {
      const int T = int(std::min<size_t>(max_t, ids.size() - t0));
      std::vector<float> x(size_t(T) * config.hidden), q(size_t(T) * config.n_heads * d), kp(size_t(T) * kv),
          k(size_t(T) * kv), v(size_t(T) * kv);
      kvcc::embed(model, ids.data() + t0, T, x.data());
      kvcc::attention_qkv(config, w, x.data(), T, int(t0), q.data(), kp.data(), k.data(), v.data());
      for (int t = 0; t < T && keys.size() < rows * size_t(d); ++t) {
        keys.insert(keys.end(), kp.begin() + long(size_t(t) * kv + size_t(head) * d),
                    kp.begin() + long(size_t(t) * kv + size_t(head + 1) * d));
        values.insert(values.end(), v.begin() + long(size_t(t) * kv + size_t(head) * d),
                      v.begin() + long(size_t(t) * kv + size_t(head + 1) * d));
      }
    }
    if (keys.size() >= rows * size_t(d)) break;
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string stats_path, model_dir, text_path;
  int max_stages = 0;
  int layer = 0, head = 0, bits = 1, threads = 2, iterations = 30, context = 32768;
  int n_rows = 100000;
  double temp_start = 0, temp_end = 0;  // 0: CommvqOptions' defaults
  kvcc::bench::Args("bench_commvq",
                    "CommVQ: EM training time per (layer, KV head) and the CPU reference's scoring throughput.")
      .option("--model", &model_dir, "rows from this model's layer 0 (pre-RoPE keys, values) over --text")
      .option("--text", &text_path, "the text --model runs over")
      .option("--stats", &stats_path, "rows from this stats file's reservoir of (--layer, --head)")
      .option("--layer", &layer, "layer of --stats", 0)
      .option("--head", &head, "KV head", 0)
      .option("--rows", &n_rows, "training rows (synthetic ones fill up to it)", 1)
      .option("--bits", &bits, "bits per element preset, 1 or 2", 1)
      .option("--threads", &threads, "training threads", 1)
      .option("--iterations", &iterations, "EM iterations", 1)
      .option("--max-stages", &max_stages, "stages trained per side, the rest extrapolated (0: all)", 0)
      .option("--context", &context, "tokens scored", 1)
      .option("--temp-start", &temp_start, "first iteration's temperature (0: the default)", 0.0, 1e6)
      .option("--temp-end", &temp_end, "last iteration's temperature (0: the default)", 0.0, 1e6)
      .example("bench_commvq --model ../shared/models/gutenberg-27m --text ../shared/text/gutenberg_heldout.txt")
      .parse(argc, argv);
  if (bits != 1 && bits != 2) {
    std::fprintf(stderr, "bench_commvq: --bits takes 1 or 2, not %d\n", bits);
    return 2;
  }
  const size_t rows = size_t(n_rows);
  try {
    kvcc::ModelConfig config;
    config.head_dim = 128;
    config.rope_theta = 500000.0;
    std::vector<float> keys, values;
    std::string source = "synthetic (skewed spectrum)";
    size_t real_rows = 0;
    if (!model_dir.empty()) {
      KVCC_REQUIRE(!text_path.empty(), "--model needs --text");
      model_rows(model_dir, text_path, head, rows, config, keys, values);
      real_rows = keys.size() / size_t(config.head_dim);
      layer = 0;
      source = std::to_string(real_rows) + " layer-0 rows of KV head " + std::to_string(head) + " computed by " +
               model_dir + " over " + text_path;
      if (real_rows < rows) source += " + " + std::to_string(rows - real_rows) + " synthetic (skewed spectrum)";
    } else if (!stats_path.empty()) {
      const kvcc::Stats stats = kvcc::read_stats(stats_path);
      config = stats.config;
      KVCC_REQUIRE(layer < config.n_layers && head < config.n_kv_heads, "layer/head outside the model");
      const kvcc::Reservoir& res = stats.reservoir(layer, head);
      real_rows = std::min(rows, res.size());
      keys.assign(res.key_pre.begin(), res.key_pre.begin() + real_rows * res.d);
      values.assign(res.value.begin(), res.value.begin() + real_rows * res.d);
      source = std::to_string(real_rows) + " reservoir rows of " + stats_path + " layer " + std::to_string(layer) +
               " head " + std::to_string(head);
      if (real_rows < rows) source += " + " + std::to_string(rows - real_rows) + " synthetic (skewed spectrum)";
    }
    const int d = config.head_dim;
    if (real_rows < rows) {
      const auto extra = skewed_rows(rows - real_rows, d, 1234);
      keys.insert(keys.end(), extra.begin(), extra.end());
      const auto extra_v = skewed_rows(rows - real_rows, d, 5678);
      values.insert(values.end(), extra_v.begin(), extra_v.end());
    }
    kvcc::CommvqTrainOptions o;
    o.budget = kvcc::commvq_budget(bits, d);
    o.threads = threads;
    o.iterations = iterations;
    o.seed = 1;
    if (temp_start > 0) o.temp_start = temp_start;
    if (temp_end > 0) o.temp_end = temp_end;
    o.progress = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
    const kvcc::CommvqBudget full = o.budget;
    if (max_stages > 0) {
      o.budget.key_stages = std::min(o.budget.key_stages, max_stages);
      o.budget.value_stages = std::min(o.budget.value_stages, max_stages);
    }
    std::printf("rows: %zu x d=%d, %s\n", rows, d, source.c_str());
    std::printf("budget: %d-bit preset, key %d stages x %d bits, value %d stages x %d bits, %d threads\n", bits,
                o.budget.key_stages, 2 * o.budget.key_half_bits, o.budget.value_stages, o.budget.value_code_bits,
                threads);

    auto t0 = Clock::now();
    const double cpu0 = cpu_seconds();
    std::vector<kvcc::CommvqStageReport> krep, vrep;
    kvcc::CommvqCodec codec;
    codec.key = kvcc::train_commvq_keys(keys.data(), rows, d, config.rope_style, o, &krep);
    const double key_s = seconds_since(t0);
    const double key_cpu = cpu_seconds() - cpu0;
    t0 = Clock::now();
    codec.value = kvcc::train_commvq_values(values.data(), rows, d, {}, o, &vrep);
    const double value_s = seconds_since(t0);
    const double value_cpu = cpu_seconds() - cpu0 - key_cpu;
    int key_iters = 0, value_iters = 0;
    for (auto& s : krep) key_iters += int(s.iteration_error.size());
    for (auto& s : vrep) value_iters += int(s.iteration_error.size());
    std::printf(
        "key EM: %.1f s wall, %.1f s CPU (%d iterations over %d stages, %.3f s/iteration), relative "
        "error^2 %.5f -> %.5f\n",
        key_s, key_cpu, key_iters, int(krep.size()), key_s / std::max(1, key_iters), krep.front().error_before,
        krep.back().error_after);
    std::printf("value EM: %.1f s wall, %.1f s CPU (%d iterations over %d stages), relative error^2 %.5f -> %.5f\n",
                value_s, value_cpu, value_iters, int(vrep.size()), vrep.front().error_before, vrep.back().error_after);
    if (o.budget.key_stages < full.key_stages || o.budget.value_stages < full.value_stages)
      std::printf(
          "EM per (layer, head), extrapolated to %d key + %d value stages: %.1f s wall, %.1f s CPU\n", full.key_stages,
          full.value_stages,
          key_s / o.budget.key_stages * full.key_stages + value_s / o.budget.value_stages * full.value_stages,
          key_cpu / o.budget.key_stages * full.key_stages + value_cpu / o.budget.value_stages * full.value_stages);
    else std::printf("EM per (layer, head): %.1f s wall, %.1f s CPU\n", key_s + value_s, key_cpu + value_cpu);

    // Scoring throughput of the CPU reference over `context` encoded tokens.
    const size_t n = std::min<size_t>(size_t(context), rows);
    const kvcc::CommvqEncoded ek = kvcc::commvq_encode_keys(codec.key, keys.data(), n);
    const kvcc::CommvqEncoded ev = kvcc::commvq_encode_values(codec.value, values.data(), n);
    std::vector<int32_t> pos(n);
    for (size_t i = 0; i < n; ++i) pos[i] = int32_t(i);
    const auto inv_freq = kvcc::rope_inv_freq(config);
    std::vector<float> q(static_cast<size_t>(d)), out(static_cast<size_t>(d));
    std::mt19937 rng(3);
    std::normal_distribution<float> g(0.0f, 1.0f);
    for (float& x : q) x = g(rng);
    const int reps = 5;
    t0 = Clock::now();
    const double attend_cpu0 = cpu_seconds();
    for (int r = 0; r < reps; ++r)
      kvcc::commvq_attend(codec, inv_freq, q.data(), ek, pos.data(), ev, 1.0f / std::sqrt(float(d)), out.data());
    const double attend_s = seconds_since(t0) / reps;
    const double attend_cpu = (cpu_seconds() - attend_cpu0) / reps;
    std::printf(
        "CPU reference attention (table scores + code-weighted values), 1 query over %zu tokens: "
        "%.2f ms wall (%.2f M tokens/s), %.2f ms CPU (%.2f M tokens/s)\n",
        n, attend_s * 1e3, double(n) / attend_s / 1e6, attend_cpu * 1e3, double(n) / attend_cpu / 1e6);
    return 0;
  } catch (const kvcc::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
