#include "calibrate/driver.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <future>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <utility>

#include "calibrate/accumulators.h"
#include "calibrate/gpu_layers.h"
#include "calibrate/layer_sensitivity.h"
#include "calibrate/mpi_reduce.h"
#include "formats/error.h"
#include "formats/h5_common.h"
#include "formats/model_file.h"
#include "formats/sha256.h"
#include "model/tokenizer.h"
#include "model/forward.h"

namespace kvcc {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// CPU time of the whole process (all threads): on a shared machine it measures the work done,
// where wall time also measures the neighbours.
double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

long peak_rss_kib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;  // KiB on Linux
}

// Wraps the accumulator to measure the time spent in statistics, apart from the forward pass.
class TimedObserver final : public AttentionObserver {
 public:
  explicit TimedObserver(AttentionObserver& inner) : inner_(inner) {}
  void on_qkv(const SequenceTaps& taps) override {
    const auto t0 = Clock::now();
    const double c0 = process_cpu_seconds();
    inner_.on_qkv(taps);
    cpu_seconds_ += process_cpu_seconds() - c0;
    seconds_ += seconds_since(t0);
  }
  void on_probs(const SequenceTaps& taps, int q_head, const float* probs, const float* output) override {
    const auto t0 = Clock::now();
    const double c0 = process_cpu_seconds();
    inner_.on_probs(taps, q_head, probs, output);
    cpu_seconds_ += process_cpu_seconds() - c0;
    seconds_ += seconds_since(t0);
  }
  double seconds() const { return seconds_; }
  double cpu_seconds() const { return cpu_seconds_; }

 private:
  AttentionObserver& inner_;
  double seconds_ = 0.0;
  double cpu_seconds_ = 0.0;
};

uint64_t layer_bytes(const LayerWeights& w) {
  uint64_t n = 0;
  for (const auto* v : {&w.attn_norm, &w.wq, &w.wk, &w.wv, &w.wo, &w.bq, &w.bk, &w.bv, &w.q_norm, &w.k_norm,
                        &w.mlp_norm, &w.w_gate, &w.w_up, &w.w_down})
    n += v->size() * sizeof(float);
  return n;
}

LayerTensors tensors_of(const LayerWeights& w) {
  auto p = [](const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
  LayerTensors t;
  t.attn_norm = p(w.attn_norm);
  t.wq = p(w.wq);
  t.wk = p(w.wk);
  t.wv = p(w.wv);
  t.wo = p(w.wo);
  t.bq = p(w.bq);
  t.bk = p(w.bk);
  t.bv = p(w.bv);
  t.q_norm = p(w.q_norm);
  t.k_norm = p(w.k_norm);
  t.mlp_norm = p(w.mlp_norm);
  t.w_gate = p(w.w_gate);
  t.w_up = p(w.w_up);
  t.w_down = p(w.w_down);
  return t;
}

// "cpu" -> -1; "gpu" -> device 0, or under mpirun the rank's local rank (one GPU per rank);
// "gpu:N" -> N. The runner refuses a device the machine does not have.
int parse_device(const std::string& device) {
  if (device == "cpu") return -1;
  if (device == "gpu") {
    const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    return local ? std::max(0, std::atoi(local)) : 0;
  }
  if (device.rfind("gpu:", 0) == 0 && device.size() > 4 &&
      device.find_first_not_of("0123456789", 4) == std::string::npos && device.size() < 10)
    return std::stoi(device.substr(4));
  throw Error("--device '" + device + "' is not cpu, gpu or gpu:N");
}

}  // namespace

CalibrationSet prepare_calibration_set(const CalibrationOptions& options, const ModelConfig& config) {
  KVCC_REQUIRE(options.data_path.empty() != options.ids_path.empty(),
               "give exactly one calibration input: a text file (--data) or a token id file (--ids)");
  CalibrationSet set;
  int max_len = options.max_seq_len;
  const int model_max = config.max_position > 0 ? config.max_position : 2048;
  if (max_len == 0) max_len = std::min(model_max, 2048);
  KVCC_REQUIRE(max_len > 0, "--max-seq-len must be positive");
  KVCC_REQUIRE(max_len <= model_max, "--max-seq-len " + std::to_string(max_len) +
                                         " exceeds the model's maximum position " + std::to_string(model_max));
  set.max_seq_len = max_len;

  // Appends one document after truncation and the token budget; returns false when the budget is spent.
  auto add = [&](std::vector<int32_t> ids, uint32_t doc) {
    if (options.max_tokens > 0 && set.tokens >= options.max_tokens) return false;
    if (ids.size() > size_t(max_len)) ids.resize(size_t(max_len));
    if (options.max_tokens > 0) ids.resize(size_t(std::min<uint64_t>(ids.size(), options.max_tokens - set.tokens)));
    if (ids.empty()) return true;
    for (int32_t id : ids)
      KVCC_REQUIRE(id >= 0 && id < config.vocab, "token id " + std::to_string(id) + " in document " +
                                                     std::to_string(doc) + " is outside the model's vocabulary of " +
                                                     std::to_string(config.vocab) +
                                                     " (ids made by another tokenizer?)");
    set.tokens += ids.size();
    set.sequences.push_back(std::move(ids));
    set.doc_index.push_back(doc);
    return true;
  };
  auto report = [&](uint64_t done, uint64_t total) {
    if (!options.progress) return;
    CalibrationProgress p;
    p.stage = "tokenize";
    p.tokens_done = done;
    p.tokens_total = total;
    options.progress(p);
  };

  if (!options.ids_path.empty()) {
    KVCC_REQUIRE(std::filesystem::is_regular_file(options.ids_path),
                 "token id file '" + options.ids_path + "' does not exist or is not a file");
    set.data_sha256 = sha256_file_hex(options.ids_path);
    set.tokenizer_kind = "ids";
    const auto docs = read_token_id_file(options.ids_path);
    for (size_t i = 0; i < docs.size(); ++i)
      if (!add(docs[i], uint32_t(i))) break;
    KVCC_REQUIRE(set.tokens > 0, "token id file '" + options.ids_path + "' holds no tokens");
    return set;
  }

  const std::string text = read_text_file(options.data_path, "calibration text");
  set.data_sha256 = sha256_hex(text);
  const std::vector<std::string> docs = split_documents(text, options.separator);
  KVCC_REQUIRE(!docs.empty(),
               "calibration text '" + options.data_path + "' holds no documents (empty or whitespace only)");
  const auto tokenizer = Tokenizer::for_model(options.model_path, config.vocab, options.tokenizer_path);
  set.tokenizer_kind = tokenizer->kind();
  for (size_t i = 0; i < docs.size(); ++i) {
    if (!add(tokenizer->encode(docs[i], config.add_bos), uint32_t(i))) break;
    report(i + 1, docs.size());
  }
  KVCC_REQUIRE(set.tokens > 0, "calibration text '" + options.data_path + "' gave no tokens");
  return set;
}

Stats calibrate_model(const CalibrationOptions& options, CalibrationSummary* summary) {
  const auto t0 = Clock::now();
  KVCC_REQUIRE(options.shard_count >= 1 && options.shard_index >= 0 && options.shard_index < options.shard_count,
               "shard " + std::to_string(options.shard_index) + "/" + std::to_string(options.shard_count) +
                   " is invalid (want I/N with 0 <= I < N)");
  KVCC_REQUIRE(options.reservoir >= 0, "--reservoir must not be negative");
  const int gpu = parse_device(options.device);
  KVCC_REQUIRE(gpu < 0 || gpu_calibration_built(),
               "--device " + options.device + ": this kvcc was built without CUDA (rebuild where nvcc is installed)");
  const ModelFile model = ModelFile::open(options.model_path);
  const ModelConfig& config = model.config();
  const CalibrationSet set = prepare_calibration_set(options, config);

  // This process's sequences: global document index % shard_count == shard_index.
  std::vector<size_t> local;
  std::vector<size_t> offset;  // token offset of each local sequence in the hidden states
  uint64_t local_tokens = 0;
  int longest = 0;
  for (size_t s = 0; s < set.sequences.size(); ++s) {
    if (int(set.doc_index[s] % uint32_t(options.shard_count)) != options.shard_index) continue;
    local.push_back(s);
    offset.push_back(size_t(local_tokens));
    local_tokens += set.sequences[s].size();
    longest = std::max(longest, int(set.sequences[s].size()));
  }

  auto report = [&](const char* stage, int layer, uint64_t done) {
    if (!options.progress) return;
    CalibrationProgress p;
    p.stage = stage;
    p.layer = layer;
    p.n_layers = config.n_layers;
    p.tokens_done = done;
    p.tokens_total = local_tokens;
    p.elapsed_s = seconds_since(t0);
    options.progress(p);
  };

  // Hidden states of every local calibration token: the only memory that grows with the data.
  const size_t hidden = size_t(config.hidden);
  std::vector<float> x(size_t(local_tokens) * hidden);
  for (size_t i = 0; i < local.size(); ++i) {
    const auto& ids = set.sequences[local[i]];
    embed(model, ids.data(), int(ids.size()), x.data() + offset[i] * hidden);
  }
  report("embed", 0, local_tokens);

  StatsAccumulator accumulator(config, gpu < 0 ? options.reservoir : 0, options.seed);
  TimedObserver observer(accumulator);
  ReservoirSampler gpu_sampler(config, gpu < 0 ? 0 : options.reservoir, options.seed);
  std::unique_ptr<GpuLayerRunner> runner;
  std::vector<GpuSequence> gpu_sequences;
  if (gpu >= 0 && local_tokens > 0) {
    for (size_t i = 0; i < local.size(); ++i)
      gpu_sequences.push_back({set.doc_index[local[i]], int(set.sequences[local[i]].size()), offset[i]});
    std::vector<std::pair<uint32_t, int>> docs;
    for (const GpuSequence& g : gpu_sequences) docs.emplace_back(g.doc, g.T);
    gpu_sampler.preselect(docs);
    runner = std::make_unique<GpuLayerRunner>(config, x, longest, gpu);
    std::vector<float>().swap(x);  // the hidden states live on the device now
  }
  const int d = config.head_dim;
  // Scratch for the last layer, whose MLP nobody reads: only its attention runs.
  std::vector<float> q, key_pre, key, value, attn;
  uint64_t max_layer_bytes = 0;
  const auto forward_t0 = Clock::now();
  const double forward_c0 = process_cpu_seconds();
  // On the GPU the next layer's weights are read and converted while the current one runs.
  std::future<LayerWeights> next;
  if (runner) next = std::async(std::launch::async, [&] { return load_layer(model, 0); });
  for (int layer = 0; layer < config.n_layers && local_tokens > 0; ++layer) {
    const LayerWeights weights = runner ? next.get() : load_layer(model, layer);
    max_layer_bytes = std::max(max_layer_bytes, layer_bytes(weights));
    const bool last = layer == config.n_layers - 1;
    if (runner) {
      if (!last) next = std::async(std::launch::async, [&, layer] { return load_layer(model, layer + 1); });
      runner->run_layer(layer, tensors_of(weights), gpu_sequences, last, gpu_sampler,
                        [&](uint64_t done) { report("layer", layer, done); });
      continue;
    }
    if (last) {
      q.resize(size_t(longest) * config.n_heads * d);
      attn.resize(q.size());
      key_pre.resize(size_t(longest) * config.n_kv_heads * d);
      key.resize(key_pre.size());
      value.resize(key_pre.size());
    }
    uint64_t done = 0;
    for (size_t i = 0; i < local.size(); ++i) {
      const uint32_t doc = set.doc_index[local[i]];
      const int T = int(set.sequences[local[i]].size());
      float* xs = x.data() + offset[i] * hidden;
      if (!last) {
        layer_forward(config, weights, layer, doc, xs, T, &observer);
      } else {
        attention_qkv(config, weights, xs, T, 0, q.data(), key_pre.data(), key.data(), value.data());
        SequenceTaps taps;
        taps.layer = layer;
        taps.doc = doc;
        taps.T = T;
        taps.q = q.data();
        taps.key_pre = key_pre.data();
        taps.key = key.data();
        taps.value = value.data();
        causal_attention(config, T, q.data(), key.data(), value.data(), attn.data(), &observer, &taps);
      }
      done += uint64_t(T);
      report("layer", layer, done);
    }
  }
  const double layers_seconds = seconds_since(forward_t0);
  const double layers_cpu_seconds = process_cpu_seconds() - forward_c0;

  Stats stats = make_empty_stats(config, model.fingerprint(), options.reservoir);
  if (gpu < 0) {
    std::move(accumulator).move_into(stats);
  } else {
    if (runner) stats.heads = runner->head_stats();
    std::move(gpu_sampler).move_into(stats);
  }
  stats.producer = std::string("kvcc ") + KVCC_VERSION;
  stats.created = h5::utc_now_iso8601();
  stats.command = options.command;
  stats.provenance.data_sha256 = set.data_sha256;
  stats.provenance.tokens = local_tokens;
  stats.provenance.sequences = local.size();
  stats.provenance.seed = options.seed;
  stats.provenance.max_seq_len = set.max_seq_len;
  stats.provenance.tokenizer = set.tokenizer_kind;
  if (options.sensitivity_block > 0 && !set.sequences.empty() &&
      int(set.doc_index[0] % uint32_t(options.shard_count)) == options.shard_index) {
    std::vector<std::vector<int32_t>> docs;
    uint64_t tokens = 0;
    for (size_t s = 0; s < set.sequences.size() && tokens < options.sensitivity_tokens; ++s) {
      docs.push_back(set.sequences[s]);
      tokens += set.sequences[s].size();
    }
    stats.sensitivity = measure_layer_sensitivity(model, docs, options.sensitivity_block, options.sensitivity_sink,
                                                  [&](int layer) { report("sensitivity", layer, tokens); });
  }

  if (summary) {
    summary->tokens = local_tokens;
    summary->sequences = local.size();
    const double stats_seconds = runner ? runner->stats_seconds() : observer.seconds();
    summary->stats_seconds = stats_seconds;
    summary->forward_seconds = layers_seconds - stats_seconds;
    summary->stats_cpu_seconds = observer.cpu_seconds();
    summary->forward_cpu_seconds = layers_cpu_seconds - observer.cpu_seconds();
    summary->hidden_state_bytes = uint64_t(local_tokens) * hidden * sizeof(float);
    summary->device = runner ? runner->device_name() : gpu >= 0 ? options.device : "cpu";
    summary->layer_weight_bytes = max_layer_bytes;
    summary->seconds = seconds_since(t0);
    summary->peak_rss_kib = peak_rss_kib();
  }
  return stats;
}

CalibrationSummary run_calibration(const CalibrationOptions& options, const std::string& output_path) {
  const auto t0 = Clock::now();
  KVCC_REQUIRE(!output_path.empty(), "no output path given (-o stats.h5)");
  const std::filesystem::path out(output_path);
  const std::filesystem::path dir = out.has_parent_path() ? out.parent_path() : ".";
  KVCC_REQUIRE(std::filesystem::is_directory(dir), "output directory '" + dir.string() + "' does not exist");

  MpiSession mpi;
  const MpiWorld& world = mpi.world();
  CalibrationOptions local = options;
  if (world.active && world.size > 1) {
    KVCC_REQUIRE(options.shard_count == 1,
                 "--shard cannot be combined with mpirun: the ranks already split the documents");
    local.shard_index = world.rank;
    local.shard_count = world.size;
  }
  CalibrationSummary summary;
  Stats stats;
  std::string error;
  try {
    stats = calibrate_model(local, &summary);
  } catch (const Error& e) {
    error = e.what();
  }
  if (mpi_any_failed(world, !error.empty()))
    throw Error(error.empty() ? "another MPI rank failed (its message is above)" : error);
  mpi_reduce_stats(stats, world);
  summary.ranks = world.size;
  if (world.rank == 0) {
    write_stats(stats, output_path);
    summary.wrote_output = true;
    summary.tokens = stats.provenance.tokens;
    summary.sequences = stats.provenance.sequences;
  }
  summary.seconds = seconds_since(t0);
  summary.peak_rss_kib = peak_rss_kib();
  return summary;
}

}  // namespace kvcc
