// kvcc memory: how many sequences of a given context fit in a memory budget, in the INT2 paged
// cache and in a BF16 paged cache of the same page size (runtime/memory.h).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/kv_layout.h"
#include "runtime/kvcc_runtime.h"
#include "runtime/memory.h"

namespace kvcc::cli {
namespace {

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// "80GiB", "1.5TB", "4096", "512M": a number and a unit. Binary units KiB..TiB and the bare
// K, M, G, T; decimal KB..TB; B or none: bytes. Returns bytes (rounded down).
int64_t parse_bytes(const std::string& text) {
  const std::string s = trim(text);
  KVCC_REQUIRE(s.empty() || s[0] != '-', "--budget: budget must be positive, got '" + s + "'");
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  const std::string number = s.substr(0, i), unit = lower(trim(s.substr(i)));
  KVCC_REQUIRE(!number.empty() && number.find_first_of("0123456789") != std::string::npos &&
                   number.find('.') == number.rfind('.'),
               "--budget: '" + s + "' is not a size (e.g. 80GiB, 1.5TB, 4096)");
  struct Unit {
    const char* name;
    long double bytes;
  };
  const Unit units[] = {{"", 1},
                        {"b", 1},
                        {"k", 1024.0L},
                        {"kib", 1024.0L},
                        {"m", 1048576.0L},
                        {"mib", 1048576.0L},
                        {"g", 1073741824.0L},
                        {"gib", 1073741824.0L},
                        {"t", 1099511627776.0L},
                        {"tib", 1099511627776.0L},
                        {"kb", 1e3L},
                        {"mb", 1e6L},
                        {"gb", 1e9L},
                        {"tb", 1e12L}};
  const Unit* u = nullptr;
  for (const Unit& c : units)
    if (unit == c.name) u = &c;
  KVCC_REQUIRE(u != nullptr, "--budget: unknown unit '" + trim(s.substr(i)) + "' in '" + s +
                                 "' (B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB or K, M, G, T = powers "
                                 "of 1024)");
  const long double bytes = std::strtold(number.c_str(), nullptr) * u->bytes;
  KVCC_REQUIRE(bytes < 9.2e18L, "--budget: '" + s + "' is too large");
  const int64_t b = int64_t(std::floor(bytes));
  KVCC_REQUIRE(b > 0, "--budget: budget must be positive, got '" + s + "'");
  return b;
}

// "32768,131072" or "32K,128K" (K = 1024, M = 1048576 tokens).
std::vector<int64_t> parse_contexts(const std::string& text) {
  std::vector<int64_t> out;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    const std::string item = trim(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    KVCC_REQUIRE(item.empty() || item[0] != '-', "--context: context must be positive, got '" + item + "'");
    size_t i = 0;
    while (i < item.size() && std::isdigit(static_cast<unsigned char>(item[i]))) ++i;
    const std::string unit = lower(item.substr(i));
    KVCC_REQUIRE(i > 0 && i <= 15 && (unit.empty() || unit == "k" || unit == "m"),
                 "--context: '" + item + "' is not a token count (e.g. 32768 or 32K; K = 1024, M = 1048576)");
    const int64_t n = std::stoll(item.substr(0, i)) * (unit == "k" ? 1024 : unit == "m" ? 1048576 : 1);
    KVCC_REQUIRE(n > 0, "--context: context must be positive, got '" + item + "'");
    out.push_back(n);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// A whole number in decimal (CLI11 would read "010" as octal); the range is checked by the
// functions that take it, which name the quantity.
int parse_int(const char* flag, const std::string& text) {
  const std::string s = trim(text);
  size_t i = !s.empty() && (s[0] == '-' || s[0] == '+') ? 1 : 0;
  const size_t digits = s.size() - i;
  bool ok = digits > 0 && digits <= 9;
  for (; i < s.size(); ++i) ok = ok && std::isdigit(static_cast<unsigned char>(s[i]));
  KVCC_REQUIRE(ok, std::string(flag) + ": '" + s + "' is not a whole number");
  return std::stoi(s);
}

struct Args {
  std::string artifact, context, budget;
  std::string layers, kv_heads, head_dim, group;
  std::string sink = std::to_string(KvGeometry{}.sink), recent = std::to_string(KvGeometry{}.recent),
              page_size = std::to_string(KvGeometry{}.page_tokens);
  std::string ranks = "1";
};

const char* const kShapeFlags[] = {"--layers", "--kv-heads", "--head-dim", "--group",
                                   "--sink",   "--recent",   "--page-size"};

int run(const Args& a, const CLI::App& app) {
  KvGeometry g;
  std::string source;
  std::vector<BlockWidths> widths;  // the artifact's (layer, KV head) code widths
  if (!a.artifact.empty()) {
    for (const char* f : kShapeFlags)
      KVCC_REQUIRE(app.count(f) == 0, std::string("--artifact excludes ") + f +
                                          " (the artifact gives the model's shape and its recipe's windows)");
    const Artifact art = read_artifact(a.artifact);
    g = cache_geometry(art);  // the runtime's own layout of the recipe
    widths = cache_widths(art);
    source = a.artifact + ": ";
  } else {
    KVCC_REQUIRE(app.count("--layers") && app.count("--kv-heads") && app.count("--head-dim"),
                 "give --artifact FILE, or the model's shape: --layers, --kv-heads and --head-dim");
    g.n_layers = parse_int("--layers", a.layers);
    g.n_kv_heads = parse_int("--kv-heads", a.kv_heads);
    g.head_dim = parse_int("--head-dim", a.head_dim);
    g.group = app.count("--group") ? parse_int("--group", a.group) : g.head_dim;
    g.sink = parse_int("--sink", a.sink);
    g.recent = parse_int("--recent", a.recent);
    g.page_tokens = parse_int("--page-size", a.page_size);
  }
  const int model_kv = g.n_kv_heads, ranks = parse_int("--ranks", a.ranks);
  if (ranks != 1) {
    g.n_kv_heads = kv_head_slice(g.n_kv_heads, 0, ranks).end;  // checks the division
    if (!widths.empty()) {                                     // the rank whose slice takes the most bytes a page
      std::vector<BlockWidths> most;
      size_t most_bytes = 0;
      for (int r = 0; r < ranks; ++r) {
        const KvHeadRange s = kv_head_slice(model_kv, r, ranks);
        std::vector<BlockWidths> w;
        for (size_t i = 0; i < widths.size(); ++i)
          if (int(i % size_t(model_kv)) >= s.begin && int(i % size_t(model_kv)) < s.end) w.push_back(widths[i]);
        const size_t bytes = PageLayout(g, w).page_bytes();
        if (bytes > most_bytes) most = w, most_bytes = bytes;
      }
      widths = most;
    }
  }
  const std::vector<int64_t> contexts = parse_contexts(a.context);
  const int64_t budget = parse_bytes(a.budget);
  std::vector<SequenceMemory> rows;
  for (int64_t c : contexts) rows.push_back(sequence_memory(g, c, budget, widths));  // checks the geometry

  const std::string keys = g.per_channel_keys() ? "; keys per channel over " + std::to_string(g.key_group_tokens) +
                                                      " tokens, " + std::to_string(g.key_pair_bytes) + "-byte pairs"
                                                : "";
  std::printf("%s%d layers x %d KV heads, head_dim %d, group %d%s; sink %d, recent %d, page %d tokens\n",
              source.c_str(), g.n_layers, model_kv, g.head_dim, g.group, keys.c_str(), g.sink, g.recent, g.page_tokens);
  if (!widths.empty() && !PageLayout(g, widths).two_bit()) {
    int lo[2] = {4, 4}, hi[2] = {1, 1};
    for (const BlockWidths& w : widths)
      for (int side = 0; side < 2; ++side) {
        lo[side] = std::min(lo[side], side ? w.value : w.key);
        hi[side] = std::max(hi[side], side ? w.value : w.key);
      }
    std::printf("code bits per (layer, KV head): keys %d-%d, values %d-%d (the artifact's own widths)\n", lo[0], hi[0],
                lo[1], hi[1]);
  }
  if (ranks != 1)
    std::printf("per rank of %d (tensor parallel): %d KV heads each; the budget is one rank's\n", ranks, g.n_kv_heads);
  std::printf("budget %.2f GiB (%lld bytes)\n\n", double(budget) / double(int64_t(1) << 30),
              static_cast<long long>(budget));
  std::printf("%10s  %-21s  %-29s  %-21s\n", "", "bytes/token/layer", "bytes/sequence", "sequences fitting");
  std::printf("%10s  %10s %10s  %14s %14s  %10s %10s  %6s\n", "context", "INT2", "BF16", "INT2", "BF16", "INT2", "BF16",
              "ratio");
  for (const SequenceMemory& m : rows)
    std::printf("%10lld  %10.1f %10.1f  %14lld %14lld  %10lld %10lld  %5.2fx\n", static_cast<long long>(m.context),
                m.int2_token_layer, m.bf16_token_layer, static_cast<long long>(m.int2_bytes),
                static_cast<long long>(m.bf16_bytes), static_cast<long long>(m.int2_sequences),
                static_cast<long long>(m.bf16_sequences), m.ratio());
  return 0;
}

Command reg{
    "memory", 75, "How many sequences of a context fit in a memory budget: INT2 cache vs BF16 pages",
    [](CLI::App& app) -> std::function<int()> {
      auto a = std::make_shared<Args>();
      app.add_option("--artifact", a->artifact, "An artifact (*.kvcc.h5): the model's shape and the recipe's windows")
          ->type_name("FILE");
      app.add_option("--layers", a->layers, "Layers (without --artifact)")->type_name("INT");
      app.add_option("--kv-heads", a->kv_heads, "KV heads (without --artifact)")->type_name("INT");
      app.add_option("--head-dim", a->head_dim, "head_dim (without --artifact)")->type_name("INT");
      app.add_option("--group", a->group, "Channels per (scale, zero) pair (default: head_dim)")->type_name("INT");
      app.add_option("--sink", a->sink, "BF16 sink tokens")->capture_default_str()->type_name("INT");
      app.add_option("--recent", a->recent, "BF16 recent-window tokens")->capture_default_str()->type_name("INT");
      app.add_option("--page-size", a->page_size, "Tokens per page (both caches)")
          ->capture_default_str()
          ->type_name("INT");
      app.add_option("--context", a->context, "Context lengths, comma-separated (32768,131072 or 32K,128K)")
          ->required()
          ->type_name("N[,N...]");
      app.add_option("--budget", a->budget, "Memory for the cache (80GiB, 1.5TB, 512M, bytes)")
          ->required()
          ->type_name("SIZE");
      app.add_option("--ranks", a->ranks, "Tensor-parallel ranks: the cache of one rank's KV heads")
          ->capture_default_str()
          ->type_name("INT");
      app.footer(
          "Per sequence of context L, the INT2 cache holds its window slot (BF16 K and V sink and\n"
          "recent ring, allocated whole, however short the sequence) and its history in whole INT2\n"
          "pages (kv_layout.h); the BF16 paged cache ceil(L / page) pages of page x 2 (K, V) x\n"
          "head_dim x 2 bytes, per layer and KV head. bytes/token/layer: a sequence's bytes / L /\n"
          "layers (all KV heads of a layer); sequences: floor(budget / bytes per sequence); ratio:\n"
          "BF16 bytes / INT2 bytes per sequence. Cache pool only (no workspace, no weights).\n"
          "Sizes: B, KB, MB, GB, TB (powers of 1000); KiB, MiB, GiB, TiB or K, M, G, T (powers of 1024).\n\n"
          "Example (Llama-3.1-8B):\n"
          "  kvcc memory --layers 32 --kv-heads 8 --head-dim 128 --sink 64 --recent 256 --page-size 64 \\\n"
          "      --context 32K,128K --budget 80GiB\n"
          "  kvcc memory --artifact model.oscar.kvcc.h5 --context 131072 --budget 80GiB --ranks 2");
      const CLI::App* sub = &app;
      return [a, sub] { return run(*a, *sub); };
    }};

}  // namespace
}  // namespace kvcc::cli
