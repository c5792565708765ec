// kvcc calibrate-model: run a model over text and write its attention statistics (stats.h5).
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "calibrate/driver.h"
#include "cli/command.h"
#include "formats/atomic_file.h"
#include "formats/error.h"

namespace kvcc::cli {
namespace {

// Parses "I/N" into shard index and count.
void parse_shard(const std::string& text, int& index, int& count) {
  const size_t slash = text.find('/');
  bool ok = slash != std::string::npos && slash > 0 && slash + 1 < text.size();
  try {
    if (ok) {
      size_t used = 0;
      index = std::stoi(text.substr(0, slash), &used);
      ok = used == slash;
      count = std::stoi(text.substr(slash + 1), &used);
      ok = ok && used == text.size() - slash - 1;
    }
  } catch (const std::exception&) {
    ok = false;
  }
  KVCC_REQUIRE(ok && count >= 1 && index >= 0 && index < count,
               "--shard '" + text + "' is not I/N with 0 <= I < N (e.g. --shard 0/4)");
}

std::string format_duration(double s) {
  if (!(s >= 0) || s > 1e7) return "--:--";
  const long total = long(s + 0.5);
  char buf[32];
  if (total >= 3600) std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", total / 3600, total / 60 % 60, total % 60);
  else std::snprintf(buf, sizeof buf, "%ld:%02ld", total / 60, total % 60);
  return buf;
}

// Draws the progress: a redrawn bar on a terminal, a line per layer (and every 10 s) otherwise.
class ProgressPrinter {
 public:
  explicit ProgressPrinter(bool tty) : tty_(tty) {}

  void operator()(const CalibrationProgress& p) {
    if (p.stage == "tokenize") {
      if (tty_ && p.elapsed_s - last_draw_ >= 0.1) {
        std::fprintf(stderr, "\rtokenizing: document %" PRIu64 " of %" PRIu64, p.tokens_done, p.tokens_total);
        last_draw_ = p.elapsed_s;
      }
      return;
    }
    if (p.stage == "sensitivity") {
      if (tty_) std::fprintf(stderr, "\r\033[K");
      std::fprintf(stderr, "layer sensitivity: layer %d/%d done (%" PRIu64 " tokens, twice), elapsed %s\n", p.layer + 1,
                   p.n_layers, p.tokens_done, format_duration(p.elapsed_s).c_str());
      return;
    }
    if (p.stage == "embed") {
      if (tty_) std::fprintf(stderr, "\r\033[K");
      std::fprintf(stderr, "calibrating on %" PRIu64 " tokens, %d layers\n", p.tokens_total, p.n_layers);
      layers_t0_ = p.elapsed_s;
      layer_t0_ = p.elapsed_s;
      current_layer_ = 0;
      return;
    }
    if (p.layer != current_layer_) {
      current_layer_ = p.layer;
      layer_t0_ = last_layer_end_;
    }
    const bool layer_done = p.tokens_done == p.tokens_total;
    const double layer_elapsed = p.elapsed_s - layer_t0_;
    const double rate = layer_elapsed > 0 ? double(p.tokens_done) / layer_elapsed : 0.0;
    const double done_units = double(p.layer) * double(p.tokens_total) + double(p.tokens_done);
    const double all_units = double(p.n_layers) * double(p.tokens_total);
    const double elapsed = p.elapsed_s - layers_t0_;
    const double eta = done_units > 0 ? elapsed * (all_units - done_units) / done_units : -1.0;
    if (layer_done) last_layer_end_ = p.elapsed_s;
    if (tty_) {
      if (!layer_done && p.elapsed_s - last_draw_ < 0.1) return;
      last_draw_ = p.elapsed_s;
      constexpr int kWidth = 30;
      const int filled = all_units > 0 ? int(kWidth * done_units / all_units) : 0;
      std::string bar(size_t(filled), '#');
      bar.resize(kWidth, '.');
      std::fprintf(stderr, "\r\033[Klayer %d/%d [%s] %3.0f%%  %.0f tok/s  ETA %s", p.layer + 1, p.n_layers, bar.c_str(),
                   100.0 * done_units / all_units, rate, format_duration(eta).c_str());
      if (layer_done && p.layer + 1 == p.n_layers) std::fprintf(stderr, "\n");
    } else if (layer_done || p.elapsed_s - last_draw_ >= 10.0) {
      last_draw_ = p.elapsed_s;
      std::fprintf(stderr, "layer %d/%d: %" PRIu64 "/%" PRIu64 " tokens, %.0f tok/s, elapsed %s, ETA %s\n", p.layer + 1,
                   p.n_layers, p.tokens_done, p.tokens_total, rate, format_duration(elapsed).c_str(),
                   format_duration(eta).c_str());
    }
  }

 private:
  bool tty_;
  double last_draw_ = -1.0;
  double layers_t0_ = 0.0, layer_t0_ = 0.0, last_layer_end_ = 0.0;
  int current_layer_ = 0;
};

// Under mpirun only rank 0 talks.
bool is_lead_rank() {
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  return rank == nullptr || std::string(rank) == "0";
}

struct Flags {
  CalibrationOptions options;
  std::string output;
  std::string shard;
};

Command reg{
    "calibrate-model", 20, "Run a model over calibration text and write its attention statistics (stats.h5)",
    [](CLI::App& app) -> std::function<int()> {
      auto flags = std::make_shared<Flags>();
      CalibrationOptions& o = flags->options;
      app.add_option("--model", o.model_path,
                     "Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or "
                     "llama2.c checkpoint (.bin)")
          ->required();
      auto* data = app.add_option("--data", o.data_path, "Calibration text; documents are separated by --separator");
      auto* ids = app.add_option("--ids", o.ids_path,
                                 "Pre-tokenized input instead of --data: one document per line, "
                                 "whitespace-separated token ids");
      data->excludes(ids);
      app.add_option("--tokenizer", o.tokenizer_path, "Tokenizer file (default: the model's own, found beside it)");
      app.add_option("--tokens", o.max_tokens, "Stop after this many tokens in total (default: all)")
          ->transform(whole_number(1, ~0ULL));
      app.add_option("--max-seq-len", o.max_seq_len,
                     "Truncate each document to this many tokens (default: min(model context, 2048))")
          ->transform(whole_number(1, 2147483647));
      app.add_option("--reservoir", o.reservoir, "Sampled token rows kept per layer and KV head")
          ->transform(whole_number(1, 2147483647))
          ->capture_default_str();
      app.add_option("--seed", o.seed, "Seed of the reservoir sampling")
          ->transform(whole_number(0, ~0ULL))
          ->capture_default_str();
      app.add_option("--separator", o.separator, "Document separator in the text")->capture_default_str();
      app.add_option("--shard", flags->shard,
                     "Process only documents with index % N == I (I/N); merge the shards with "
                     "`kvcc merge-stats`");
      app.add_option("--layer-sensitivity", o.sensitivity_block,
                     "Also measure EpiCache's layer sensitivity with blocks of this many tokens (the first "
                     "documents run again with a block-prefill mask; kvcc compile --layer-budgets sensitivity "
                     "turns it into per-layer eviction budgets); 0: not measured")
          ->transform(whole_number(0, 2147483647))
          ->capture_default_str();
      app.add_option("--sensitivity-sink", o.sensitivity_sink,
                     "With --layer-sensitivity: tokens at the start every block still sees")
          ->transform(whole_number(0, 2147483647))
          ->capture_default_str();
      app.add_option("--sensitivity-tokens", o.sensitivity_tokens,
                     "With --layer-sensitivity: measure on the first documents holding at least this many tokens")
          ->transform(whole_number(1, ~0ULL))
          ->capture_default_str();
      app.add_option("--device", o.device,
                     "Where the layers run: cpu (OpenBLAS), gpu or gpu:N (CUDA device N: cuBLAS in float32, "
                     "statistics in float64 on the device; the same statistics to float32 rounding)")
          ->capture_default_str();
      app.add_option("-o,--output", flags->output, "Statistics file to write (HDF5)")->required();
      app.footer(
          "Runs the model one layer at a time over every calibration token (memory: one layer's\n"
          "weights plus the hidden states of the calibration set) and accumulates, per layer and KV\n"
          "head, the query second moment, the value targets, key/value moments and ranges, and a\n"
          "reservoir of sampled rows (documents with index % 5 == 4 are held out). Refuses a model\n"
          "whose weights hold NaN or Inf (naming the tensor) or whose config has a negative or\n"
          "non-finite rms_norm_eps or rope_theta, and an output that names an input.\n"
          "With --layer-sensitivity B it also runs the first documents with a block-prefill mask\n"
          "(blocks of B tokens see the sink, half the previous block and themselves) and stores, per\n"
          "layer, how similar the keys stay to the causal run's (EpiCache's layer sensitivity).\n\n"
          "Example:\n"
          "  kvcc calibrate-model --model ../shared/models/tinystories-656k \\\n"
          "      --data ../shared/text/tinystories_valid_100.txt --tokens 20000 -o stats.h5\n"
          "  kvcc compile stats.h5 --method oscar --key-bits 2 --value-bits 2 -o model.kvcc.h5\n\n"
          "On a GPU: `--device gpu` keeps the hidden states on the device and uploads one layer's\n"
          "weights at a time (the next one is read while the current one runs), so a model larger\n"
          "than the GPU's memory still calibrates; --layer-sensitivity's extra runs stay on the CPU.\n\n"
          "Scale-out: `mpirun -n 4 kvcc calibrate-model ...` splits documents over ranks and rank 0\n"
          "writes the reduced file; or run `--shard 0/2` and `--shard 1/2` anywhere and\n"
          "`kvcc merge-stats a.h5 b.h5 -o stats.h5` (equal to one run up to float64 rounding).");
      return [flags]() -> int {
        CalibrationOptions options = flags->options;
        require_output_is_not_input(flags->output,
                                    {options.model_path, options.data_path, options.ids_path, options.tokenizer_path});
        KVCC_REQUIRE(!options.data_path.empty() || !options.ids_path.empty(),
                     "give the calibration input: --data TEXT or --ids FILE");
        if (!flags->shard.empty()) parse_shard(flags->shard, options.shard_index, options.shard_count);
        // The command as a user would retype it: given flags only (defaults left out).
        options.command = "kvcc calibrate-model --model " + options.model_path +
                          (options.ids_path.empty() ? " --data " + options.data_path : " --ids " + options.ids_path);
        if (options.max_tokens > 0) options.command += " --tokens " + std::to_string(options.max_tokens);
        if (options.max_seq_len > 0) options.command += " --max-seq-len " + std::to_string(options.max_seq_len);
        options.command +=
            " --reservoir " + std::to_string(options.reservoir) + " --seed " + std::to_string(options.seed);
        if (!options.tokenizer_path.empty()) options.command += " --tokenizer " + options.tokenizer_path;
        if (options.separator != CalibrationOptions{}.separator)
          options.command += " --separator '" + options.separator + "'";
        if (!flags->shard.empty()) options.command += " --shard " + flags->shard;
        if (options.device != "cpu") options.command += " --device " + options.device;
        if (options.sensitivity_block > 0) {
          KVCC_REQUIRE(options.sensitivity_block >= 2, "--layer-sensitivity must be 0 (off) or at least 2 tokens");
          options.command += " --layer-sensitivity " + std::to_string(options.sensitivity_block) +
                             " --sensitivity-sink " + std::to_string(options.sensitivity_sink) +
                             " --sensitivity-tokens " + std::to_string(options.sensitivity_tokens);
        }
        options.command += " -o " + flags->output;
        const bool lead = is_lead_rank();
        auto printer = std::make_shared<ProgressPrinter>(stderr_is_tty());
        if (lead) options.progress = [printer](const CalibrationProgress& p) { (*printer)(p); };
        const CalibrationSummary s = run_calibration(options, flags->output);
        if (!s.wrote_output) return 0;
        const double mib = 1024.0 * 1024.0;
        const double cpu = s.forward_cpu_seconds + s.stats_cpu_seconds;
        std::fprintf(stderr, "calibrated %" PRIu64 " tokens in %" PRIu64 " sequences%s in %.1f s (%.0f tok/s) on %s\n",
                     s.tokens, s.sequences, s.ranks > 1 ? (" on " + std::to_string(s.ranks) + " ranks").c_str() : "",
                     s.seconds, s.seconds > 0 ? double(s.tokens) / s.seconds : 0.0, s.device.c_str());
        if (s.device == "cpu")
          std::fprintf(stderr,
                       "  this process: CPU time forward %.2f s, statistics %.2f s (%.0f%% of the layers' time)",
                       s.forward_cpu_seconds, s.stats_cpu_seconds, cpu > 0 ? 100.0 * s.stats_cpu_seconds / cpu : 0.0);
        else  // the GPU's statistics time is device time (events), the forward the rest of the layers' wall time
          std::fprintf(stderr,
                       "  this process: layers forward %.2f s, statistics %.2f s on the GPU (%.0f%% of the forward)",
                       s.forward_seconds, s.stats_seconds,
                       s.forward_seconds > 0 ? 100.0 * s.stats_seconds / s.forward_seconds : 0.0);
        std::fprintf(stderr, "; peak memory %.1f MiB on the host (largest layer %.1f MiB + hidden states %.1f MiB)\n",
                     double(s.peak_rss_kib) / 1024.0, double(s.layer_weight_bytes) / mib,
                     double(s.hidden_state_bytes) / mib);
        std::printf("wrote %s\n", flags->output.c_str());
        return 0;
      };
    }};

}  // namespace
}  // namespace kvcc::cli
