// The calibration driver end to end on a real model (../shared/models/tinystories-656k): the stats
// against a direct computation from the forward pass, shards merged against the single run,
// `mpirun -n 1/2/3` against the single run, and the errors a user can cause.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "calibrate/driver.h"
#include "formats/error.h"
#include "formats/model_file.h"
#include "formats/stats.h"
#include "model/tokenizer.h"
#include "model/forward.h"
#include "one_blas_thread.h"

namespace kvcc {
namespace {

namespace fs = std::filesystem;

const std::string kShared = KVCC_SHARED_DIR;
const std::string kModel = kShared + "/models/tinystories-656k";
const std::string kText = kShared + "/text/tinystories_valid_100.txt";

#define REQUIRE_SHARED()                                                                       \
  do {                                                                                         \
    if (!fs::exists(kModel + "/config.json") || !fs::exists(kText))                            \
      GTEST_SKIP() << "needs ../shared/models/tinystories-656k and tinystories_valid_100.txt"; \
  } while (0)

// A fresh directory under the system temp dir, removed at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "kvcc-calib-XXXXXX").string();
    path = mkdtemp(tmpl.data());
  }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

CalibrationOptions small_options() {
  CalibrationOptions o;
  o.model_path = kModel;
  o.data_path = kText;
  o.max_tokens = 2500;
  o.max_seq_len = 160;  // several documents get truncated
  o.reservoir = 40;
  o.seed = 7;
  return o;
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

void expect_sums_equal(const Stats& got, const Stats& want, double rel) {
  ASSERT_EQ(got.heads.size(), want.heads.size());
  for (size_t i = 0; i < want.heads.size(); ++i) {
    const HeadStats& a = got.heads[i];
    const HeadStats& b = want.heads[i];
    auto cmp = [&](const std::vector<double>& x, const std::vector<double>& y, const char* what) {
      ASSERT_EQ(x.size(), y.size()) << what;
      const double tol = rel * max_abs(y);
      for (size_t k = 0; k < y.size(); ++k) ASSERT_NEAR(x[k], y[k], tol) << what << " head " << i;
    };
    cmp(a.query_m2, b.query_m2, "query_m2");
    cmp(a.output_m2, b.output_m2, "output_m2");
    cmp(a.p2_m2, b.p2_m2, "p2_m2");
    cmp(a.key_m2, b.key_m2, "key_m2");
    cmp(a.value_m2, b.value_m2, "value_m2");
    EXPECT_NEAR(a.p2_weight, b.p2_weight, rel * b.p2_weight);
    EXPECT_EQ(a.query_count, b.query_count);
    EXPECT_EQ(a.output_count, b.output_count);
    EXPECT_EQ(a.kv_count, b.kv_count);
    EXPECT_EQ(a.key_min, b.key_min);
    EXPECT_EQ(a.key_max, b.key_max);
    EXPECT_EQ(a.value_min, b.value_min);
    EXPECT_EQ(a.value_max, b.value_max);
  }
  EXPECT_EQ(got.provenance.tokens, want.provenance.tokens);
  EXPECT_EQ(got.provenance.sequences, want.provenance.sequences);
}

// Reservoirs hold the same rows in the same (priority) order, bit for bit.
void expect_reservoirs_identical(const Stats& got, const Stats& want) {
  ASSERT_EQ(got.reservoirs.size(), want.reservoirs.size());
  for (size_t i = 0; i < want.reservoirs.size(); ++i) {
    const Reservoir& a = got.reservoirs[i];
    const Reservoir& b = want.reservoirs[i];
    ASSERT_EQ(a.size(), b.size()) << "reservoir " << i;
    EXPECT_EQ(a.priority, b.priority) << "reservoir " << i;
    EXPECT_EQ(a.doc, b.doc);
    EXPECT_EQ(a.position, b.position);
    EXPECT_EQ(a.heldout, b.heldout);
    EXPECT_EQ(a.q, b.q);
    EXPECT_EQ(a.key_pre, b.key_pre);
    EXPECT_EQ(a.key, b.key);
    EXPECT_EQ(a.value, b.value);
  }
}

// The single-process run every scale-out test compares against (computed once).
const Stats& single_run() {
  static const Stats stats = calibrate_model(small_options());
  return stats;
}

TEST(CalibrateDriver, QueryMomentEqualsDirectComputationFromForwardTaps) {
  REQUIRE_SHARED();
  const Stats& stats = single_run();
  const CalibrationOptions options = small_options();

  // Independently: tokenize, embed, and compute q of layers 0 and 1 with the runtime's layer ops.
  const ModelFile model = ModelFile::open(kModel);
  const ModelConfig& c = model.config();
  const auto tokenizer = Tokenizer::for_model(kModel, c.vocab);
  std::ifstream in(kText);
  std::stringstream text;
  text << in.rdbuf();
  const auto docs = split_documents(text.str());
  const int d = c.head_dim, r = c.group();
  // Layer 0 goes through layer_forward in the driver; the last layer takes its attention-only path.
  const int last = c.n_layers - 1;
  std::vector<LayerWeights> weights;
  for (int layer = 0; layer < c.n_layers; ++layer) weights.push_back(load_layer(model, layer));
  std::vector<double> m0(size_t(d) * d, 0.0), m_last(m0);
  uint64_t tokens = 0, sequences = 0;
  for (size_t i = 0; i < docs.size() && tokens < options.max_tokens; ++i) {
    auto ids = tokenizer->encode(docs[i], c.add_bos);
    ids.resize(std::min<size_t>({ids.size(), size_t(options.max_seq_len), options.max_tokens - tokens}));
    const int T = int(ids.size());
    tokens += uint64_t(T);
    ++sequences;
    std::vector<float> x(size_t(T) * c.hidden), q(size_t(T) * c.n_heads * d), k(size_t(T) * c.n_kv_heads * d),
        v(k.size()), kp(k.size());
    embed(model, ids.data(), T, x.data());
    for (int layer = 0; layer <= last; ++layer) {
      if (layer == 0 || layer == last) {
        attention_qkv(c, weights[size_t(layer)], x.data(), T, 0, q.data(), kp.data(), k.data(), v.data());
        std::vector<double>& m = layer == 0 ? m0 : m_last;
        for (int t = 0; t < T; ++t)
          for (int hq = 0; hq < r; ++hq) {  // KV head 0's group: query heads 0..r-1
            const float* row = q.data() + (size_t(t) * c.n_heads + hq) * d;
            for (int a = 0; a < d; ++a)
              for (int b = 0; b < d; ++b) m[size_t(a) * d + b] += double(row[a]) * double(row[b]);
          }
      }
      if (layer < last) layer_forward(c, weights[size_t(layer)], layer, uint32_t(i), x.data(), T);
    }
  }
  ASSERT_EQ(tokens, options.max_tokens);
  EXPECT_EQ(stats.provenance.tokens, tokens);
  EXPECT_EQ(stats.provenance.sequences, sequences);
  EXPECT_EQ(stats.provenance.max_seq_len, options.max_seq_len);
  EXPECT_EQ(stats.provenance.seed, options.seed);
  EXPECT_EQ(stats.provenance.data_sha256.size(), 64u);
  for (int layer : {0, last}) {
    const HeadStats& hs = stats.head(layer, 0);
    const std::vector<double>& want = layer == 0 ? m0 : m_last;
    const double tol = 1e-6 * max_abs(want);
    for (size_t k = 0; k < want.size(); ++k) ASSERT_NEAR(hs.query_m2[k], want[k], tol) << "layer " << layer;
  }
  for (int layer = 0; layer <= last; ++layer) {
    for (int h = 0; h < c.n_kv_heads; ++h) {
      EXPECT_EQ(stats.head(layer, h).query_count, tokens * uint64_t(r));
      EXPECT_EQ(stats.head(layer, h).output_count, tokens * uint64_t(r));
      EXPECT_EQ(stats.head(layer, h).kv_count, tokens);
      EXPECT_EQ(stats.reservoir(layer, h).size(), size_t(options.reservoir));
    }
  }
  // Every layer and head sampled the same tokens.
  for (const Reservoir& res : stats.reservoirs) EXPECT_EQ(res.priority, stats.reservoirs[0].priority);
}

TEST(CalibrateDriver, WrittenFileReadsBackEqual) {
  REQUIRE_SHARED();
  TempDir dir;
  const CalibrationSummary summary = run_calibration(small_options(), dir / "stats.h5");
  EXPECT_TRUE(summary.wrote_output);
  EXPECT_EQ(summary.tokens, single_run().provenance.tokens);
  EXPECT_GT(summary.peak_rss_kib, 0);
  const Stats back = read_stats(dir / "stats.h5");
  expect_sums_equal(back, single_run(), 0.0);
  expect_reservoirs_identical(back, single_run());
  EXPECT_EQ(back.fingerprint.id, ModelFile::open(kModel).fingerprint().id);
}

TEST(CalibrateDriver, MergedShardsEqualSingleRun) {
  REQUIRE_SHARED();
  for (int n : {2, 3}) {
    CalibrationOptions o = small_options();
    o.shard_count = n;
    o.shard_index = 0;
    Stats merged = calibrate_model(o);
    for (int i = 1; i < n; ++i) {
      o.shard_index = i;
      merge_stats(merged, calibrate_model(o));
    }
    SCOPED_TRACE("shards " + std::to_string(n));
    expect_sums_equal(merged, single_run(), 1e-12);
    expect_reservoirs_identical(merged, single_run());
  }
}

std::string shell_quote(const std::string& s) { return "'" + s + "'"; }

// Runs a shell command; returns its exit status and stderr+stdout.
int run_command(const std::string& cmd, std::string* output = nullptr) {
  std::string full = cmd + " 2>&1";
  FILE* pipe = popen(full.c_str(), "r");
  if (!pipe) return -1;
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  const int status = pclose(pipe);
  if (output) *output = out;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string cli_args(const std::string& output) {
  const CalibrationOptions o = small_options();
  return " calibrate-model --model " + shell_quote(kModel) + " --data " + shell_quote(kText) + " --tokens " +
         std::to_string(o.max_tokens) + " --max-seq-len " + std::to_string(o.max_seq_len) + " --reservoir " +
         std::to_string(o.reservoir) + " --seed " + std::to_string(o.seed) + " -o " + shell_quote(output);
}

TEST(CalibrateDriver, MpirunRanksEqualSingleRun) {
  REQUIRE_SHARED();
#ifndef KVCC_HAVE_MPI
  GTEST_SKIP() << "kvcc was built without MPI";
#endif
  if (run_command("command -v mpirun") != 0) GTEST_SKIP() << "mpirun is not installed";
  TempDir dir;
  for (int ranks : {1, 2, 3}) {
    const std::string out = dir / ("mpi" + std::to_string(ranks) + ".h5");
    std::string log;
    const int rc = run_command(std::string("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ") +
                                   test::kOneBlasThreadEnv + "mpirun -n " + std::to_string(ranks) +
                                   " --oversubscribe " + shell_quote(KVCC_BINARY) + cli_args(out),
                               &log);
    ASSERT_EQ(rc, 0) << log;
    SCOPED_TRACE("mpirun -n " + std::to_string(ranks));
    const Stats stats = read_stats(out);
    expect_sums_equal(stats, single_run(), 1e-12);
    expect_reservoirs_identical(stats, single_run());
    EXPECT_EQ(stats.provenance.data_sha256, single_run().provenance.data_sha256);
  }
}

TEST(CalibrateDriver, CliWritesTheSameStatsAndReportsProgress) {
  REQUIRE_SHARED();
  TempDir dir;
  std::string log;
  ASSERT_EQ(run_command(test::kOneBlasThreadEnv + shell_quote(KVCC_BINARY) + cli_args(dir / "cli.h5"), &log), 0) << log;
  const int n_layers = ModelFile::open(kModel).config().n_layers;
  const std::string last_line = "layer " + std::to_string(n_layers) + "/" + std::to_string(n_layers);
  EXPECT_NE(log.find(last_line), std::string::npos) << log;  // plain progress lines (no tty)
  EXPECT_NE(log.find("peak memory"), std::string::npos) << log;
  const Stats stats = read_stats(dir / "cli.h5");
  expect_sums_equal(stats, single_run(), 0.0);
  EXPECT_NE(stats.command.find("calibrate-model"), std::string::npos);
}

TEST(CalibrateDriver, BadInputGivesClearErrors) {
  REQUIRE_SHARED();
  TempDir dir;
  auto message_of = [](const CalibrationOptions& o, const std::string& out = "") {
    try {
      if (out.empty()) calibrate_model(o);
      else run_calibration(o, out);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };

  CalibrationOptions o = small_options();
  o.model_path = dir / "no-such-model";
  EXPECT_NE(message_of(o).find("no-such-model"), std::string::npos) << message_of(o);

  std::ofstream(dir / "empty.txt") << "  \n<|endoftext|>\n\n<|endoftext|>  ";
  o = small_options();
  o.data_path = dir / "empty.txt";
  EXPECT_NE(message_of(o).find("no documents"), std::string::npos) << message_of(o);

  o = small_options();
  o.data_path = dir / "missing.txt";
  EXPECT_NE(message_of(o).find("missing.txt"), std::string::npos) << message_of(o);

  // Token ids from a bigger vocabulary than the model's.
  std::ofstream(dir / "ids.txt") << "1 5 9\n1 4000 7\n";
  o = small_options();
  o.data_path.clear();
  o.ids_path = dir / "ids.txt";
  EXPECT_NE(message_of(o).find("outside the model's vocabulary"), std::string::npos) << message_of(o);

  // A model directory whose tokenizer belongs to another model (vocab 4096 vs 2048).
  const std::string other_tokenizer = kShared + "/models/gutenberg-27m/tokenizer.json";
  if (fs::exists(other_tokenizer)) {
    const fs::path mixed = dir.path / "mixed";
    fs::create_directory(mixed);
    fs::create_symlink(kModel + "/config.json", mixed / "config.json");
    fs::create_symlink(kModel + "/model.safetensors", mixed / "model.safetensors");
    fs::create_symlink(other_tokenizer, mixed / "tokenizer.json");
    o = small_options();
    o.model_path = mixed.string();
    const std::string msg = message_of(o);
    EXPECT_TRUE(msg.find("4096") != std::string::npos && msg.find("2048") != std::string::npos)
        << "expected both vocabulary sizes in: " << msg;
  }

  o = small_options();
  EXPECT_NE(message_of(o, dir / "no-such-dir/stats.h5").find("no-such-dir"), std::string::npos);

  o.shard_index = 2;
  o.shard_count = 2;
  EXPECT_NE(message_of(o).find("shard"), std::string::npos);

  // Devices: a name that is none of cpu / gpu / gpu:N, and a GPU no machine has (refused for a
  // build without CUDA, a machine without a GPU and one with fewer GPUs alike), nothing written.
  for (const char* bad : {"tpu", "gpu:", "gpu:-1", "gpu:1x", "GPU"}) {
    o = small_options();
    o.device = bad;
    EXPECT_NE(message_of(o).find(std::string("--device '") + bad + "'"), std::string::npos) << message_of(o);
  }
  o = small_options();
  o.device = "gpu:4096";
  EXPECT_NE(message_of(o, dir / "gpu.h5").find("--device gpu:4096"), std::string::npos)
      << message_of(o, dir / "gpu.h5");
  EXPECT_FALSE(fs::exists(dir / "gpu.h5"));

  // The CLI prints the error on one line and exits 1.
  std::string log;
  EXPECT_EQ(run_command(shell_quote(KVCC_BINARY) + " calibrate-model --model " + shell_quote(dir / "nope") +
                            " --data " + shell_quote(kText) + " -o " + shell_quote(dir / "x.h5"),
                        &log),
            1);
  EXPECT_NE(log.find("kvcc: error:"), std::string::npos) << log;
  EXPECT_NE(log.find("nope"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(dir / "x.h5"));
}

}  // namespace
}  // namespace kvcc
