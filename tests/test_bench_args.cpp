// The benchmarks' shared options (bench/bench_args.h): values parse as declared, every malformed
// or unknown argument is refused (a mistyped flag must not run a default measurement), and each
// built benchmark answers --help and an unknown option before it touches a device or a file.
#include "bench/bench_args.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace kvcc::bench {
namespace {

// argv of a command line (the program's name first).
struct Argv {
  explicit Argv(std::vector<std::string> a) : args(std::move(a)) {
    args.insert(args.begin(), "prog");
    for (std::string& s : args) ptrs.push_back(s.data());
  }
  int argc() const { return int(ptrs.size()); }
  char** argv() { return ptrs.data(); }
  std::vector<std::string> args;
  std::vector<char*> ptrs;
};

struct Values {
  std::string name = "def";
  int count = 7;
  double ratio = 0.5;
  bool flag = true;
  std::vector<std::string> rest;
};

Args declare(Values& v, bool positional = false) {
  Args a("prog", "What prog measures.");
  a.option("--name", &v.name, "a name")
      .option("--count", &v.count, "a count", 1)
      .option("--ratio", &v.ratio, "a ratio", 0.0, 1.0)
      .option("--flag", &v.flag, "a switch")
      .example("prog --count 3");
  if (positional) a.positional(&v.rest, "FILE ...", "inputs");
  return a;
}

std::string error_of(std::vector<std::string> args, Values& v, bool positional = false) {
  Argv a(std::move(args));
  return declare(v, positional).parse_or_error(a.argc(), a.argv());
}

TEST(BenchArgs, ValuesParseAsDeclared) {
  Values v;
  EXPECT_EQ(error_of({"--name", "x:y", "--count", "12", "--ratio", "0.25", "--flag", "0"}, v), "");
  EXPECT_EQ(v.name, "x:y");
  EXPECT_EQ(v.count, 12);
  EXPECT_EQ(v.ratio, 0.25);
  EXPECT_FALSE(v.flag);
  Values d;  // nothing given: the defaults stay
  EXPECT_EQ(error_of({}, d), "");
  EXPECT_EQ(d.name, "def");
  EXPECT_EQ(d.count, 7);
  Values e;  // an empty value is a value (e.g. --configs '' for no shapes)
  EXPECT_EQ(error_of({"--name", ""}, e), "");
  EXPECT_EQ(e.name, "");
  Values p;
  EXPECT_EQ(error_of({"a.bin", "--count", "2", "-5"}, p, true), "");  // "-5" is not a flag
  EXPECT_EQ(p.rest, (std::vector<std::string>{"a.bin", "-5"}));
}

TEST(BenchArgs, MalformedAndUnknownArgumentsAreRefused) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--cout", "3"}, "unknown option --cout"},
      {{"--count"}, "--count needs a value"},
      {{"--count", "0"}, "--count takes at least 1, not 0"},
      {{"--count", "-3"}, "--count takes at least 1, not -3"},
      {{"--count", "12x"}, "--count takes an integer, not '12x'"},
      {{"--count", "1e3"}, "--count takes an integer, not '1e3'"},
      {{"--count", ""}, "--count takes an integer, not ''"},
      {{"--count", "99999999999"}, "--count takes at most 2147483647, not 99999999999"},
      {{"--ratio", "1.5"}, "--ratio takes between 0 and 1, not 1.5"},
      {{"--ratio", "nan"}, "--ratio takes a number, not 'nan'"},
      {{"--ratio", "0.5.1"}, "--ratio takes a number, not '0.5.1'"},
      {{"--flag", "yes"}, "--flag takes 0 or 1, not 'yes'"},
      {{"stray"}, "unexpected argument 'stray'"},
      {{"--count", "2", "--help"}, "help"},
      {{"-h"}, "help"},
  };
  for (const auto& [args, want] : cases) {
    Values v;
    EXPECT_EQ(error_of(args, v), want) << args[0];
  }
}

TEST(BenchArgs, UsageListsEveryOptionWithItsDefault) {
  Values v;
  const std::string u = declare(v, true).usage();
  EXPECT_EQ(u.rfind("What prog measures.\n\nusage: prog [OPTIONS] [FILE ...]\n", 0), 0u) << u;
  for (const char* line :
       {"--name TEXT", "a name [default: def]", "--count N", "a count (>= 1) [default: 7]", "--ratio X",
        "(0 to 1) [default: 0.5]", "--flag 0|1", "[default: 1]", "--help", "FILE ...", "examples:\n  prog --count 3\n"})
    EXPECT_NE(u.find(line), std::string::npos) << line << " in\n" << u;
}

TEST(BenchArgs, SplitFieldsAndIntegerTuples) {
  EXPECT_TRUE(split("", ',').empty());
  EXPECT_EQ(split("a,,b", ','), (std::vector<std::string>{"a", "", "b"}));
  EXPECT_EQ(split("32:8:1:32768", ':').size(), 4u);
  std::vector<long> f;
  EXPECT_TRUE(split_ints("32:8:1:32768", ':', 4, f));
  EXPECT_EQ(f, (std::vector<long>{32, 8, 1, 32768}));
  EXPECT_TRUE(split_ints("2/-1", '/', 2, f));  // signs parse; the caller checks ranges
  EXPECT_EQ(f, (std::vector<long>{2, -1}));
  EXPECT_FALSE(split_ints("32:8:1", ':', 4, f));      // too few
  EXPECT_FALSE(split_ints("32:8:1:2:3", ':', 4, f));  // too many
  EXPECT_FALSE(split_ints("32:8::1", ':', 4, f));     // an empty field
  EXPECT_FALSE(split_ints("32:8:1:4k", ':', 4, f));   // not a number
  EXPECT_FALSE(split_ints("32:8:1:99999999999", ':', 4, f));
}

TEST(BenchArgs, ShapesAndChoicesAreCheckedWhole) {
  std::vector<std::vector<int>> shapes;
  EXPECT_EQ(parse_shapes("32:8:1:32768,8:8:0:16", "Hq:Hkv:ctx:T", 0, 1, shapes), "");
  EXPECT_EQ(shapes, (std::vector<std::vector<int>>{{32, 8, 1, 32768}, {8, 8, 0, 16}}));
  for (const char* bad : {"32:5:1:1", "0:8:1:1", "32:8:-1:16", "32:8:0:0", "32:8:1", "32:8:1:x"}) {
    std::vector<std::vector<int>> out;
    EXPECT_EQ(parse_shapes(bad, "Hq:Hkv:ctx:T", 0, 1, out),
              "--configs takes Hq:Hkv:ctx:T (Hq a positive multiple of Hkv, then >= 0 and >= 1), not '" +
                  std::string(bad) + "'");
  }
  std::vector<std::string> picked;
  EXPECT_EQ(parse_choices("--keys", "per-channel,per-token", {"per-token", "per-channel"}, picked), "");
  EXPECT_EQ(picked, (std::vector<std::string>{"per-channel", "per-token"}));
  std::vector<std::string> none;
  EXPECT_EQ(parse_choices("--keys", "", {"per-token"}, none), "");  // an empty list picks nothing
  EXPECT_TRUE(none.empty());
  EXPECT_EQ(parse_choices("--keys", "per-token,per-tok", {"per-token", "per-channel"}, picked),
            "--keys takes per-token, per-channel (comma-separated), not 'per-tok'");
}

// Each built benchmark, run as a user would: --help prints its usage (exit 0), an unknown option
// is refused (exit 2), and neither writes a file in the working directory.
TEST(BenchArgs, EveryBenchmarkAnswersHelpAndRefusesAnUnknownOption) {
  const std::vector<std::string> names = split(KVCC_BENCHES, ',');
  ASSERT_GE(names.size(), 4u) << KVCC_BENCHES;  // the CPU benchmarks at least
  char tmpl[] = "/tmp/kvcc_bench_args_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::filesystem::path dir = tmpl;
  auto run = [&](const std::string& name, const std::string& args, std::string& out) {
    const std::string cmd = "cd " + dir.string() + " && " + std::string(KVCC_BENCH_DIR) + "/" + name + " " + args +
                            " >stdout.txt 2>stderr.txt";
    const int status = std::system(cmd.c_str());
    out.clear();
    for (const char* f : {"stdout.txt", "stderr.txt"}) {
      std::ifstream in(dir / f);
      out.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    std::filesystem::remove(dir / "stdout.txt");
    std::filesystem::remove(dir / "stderr.txt");
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  for (const std::string& name : names) {
    std::string out;
    EXPECT_EQ(run(name, "--help", out), 0) << name << ": " << out;
    EXPECT_NE(out.find("usage: " + name), std::string::npos) << name << ": " << out;
    EXPECT_EQ(run(name, "--no-such-option 1", out), 2) << name << ": " << out;
    EXPECT_NE(out.find(name + ": unknown option --no-such-option"), std::string::npos) << name << ": " << out;
    EXPECT_TRUE(std::filesystem::is_empty(dir)) << name << " wrote a file";
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvcc::bench
