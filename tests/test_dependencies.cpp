// The dependency rule of CMakeLists.txt, checked: every #include of every library source file is
// read, and an edge outside the allowed table fails the test: a quoted include of another kvcc
// folder that the including library may not use, or a system header of a third-party library
// that belongs to another library (BLAS in the runtime, say). The checker is also run on a small
// tree with planted wrong edges, so a checker that finds nothing fails too.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

// Library folder -> the kvcc folders its files may include (itself implied).
const std::map<std::string, std::set<std::string>> kAllowed = {
    {"formats", {}},
    {"model", {"formats"}},
    {"runtime", {"formats"}},
    {"calibrate", {"model", "formats"}},
    {"compile", {"formats"}},
    {"zoo", {"formats"}},
    {"eval", {"model", "runtime", "formats"}},
    {"cli", {"calibrate", "compile", "eval", "zoo", "model", "runtime", "formats"}},
};

// Third-party headers (by prefix) -> the only libraries that may include them; the link line of
// CMakeLists.txt follows the same table.
const std::vector<std::pair<std::string, std::set<std::string>>> kSystemOwners = {
    {"cblas", {"model", "calibrate", "compile"}},
    {"lapacke", {"compile"}},
    {"pcre2", {"model"}},
    {"unicode/", {"model"}},
    {"mpi.h", {"calibrate"}},
    {"CLI/", {"cli"}},
    {"cublas", {"calibrate"}},
    {"cuda_runtime", {"runtime", "eval", "calibrate"}},
    {"cuda_bf16", {"runtime"}},
    {"cuda_fp16", {"runtime"}},
    {"hdf5", {"formats"}},
};

struct Violation {
  std::string file, include;
};

std::vector<Violation> check_tree(const fs::path& root) {
  const std::regex include_re(R"(^\s*#\s*include\s*([<"])([^>"]+)[>"])");
  std::vector<Violation> out;
  for (const auto& [lib, allowed] : kAllowed) {
    const fs::path dir = root / lib;
    if (!fs::is_directory(dir)) continue;
    for (const auto& entry : fs::recursive_directory_iterator(dir)) {
      const std::string ext = entry.path().extension().string();
      if (!entry.is_regular_file() || (ext != ".h" && ext != ".cpp" && ext != ".cu" && ext != ".cuh")) continue;
      std::ifstream in(entry.path());
      std::string line;
      while (std::getline(in, line)) {
        std::smatch m;
        if (!std::regex_search(line, m, include_re)) continue;
        const std::string target = m[2];
        const std::string file = fs::relative(entry.path(), root).string();
        if (m[1] == "\"") {
          const auto slash = target.find('/');
          const std::string folder = slash == std::string::npos ? lib : target.substr(0, slash);
          if (folder != lib && !allowed.count(folder)) out.push_back({file, target});
        } else {
          for (const auto& [prefix, owners] : kSystemOwners)
            if (target.rfind(prefix, 0) == 0 && !owners.count(lib)) out.push_back({file, target});
        }
      }
    }
  }
  return out;
}

std::string describe(const std::vector<Violation>& v) {
  std::string s;
  for (const Violation& x : v) s += "  " + x.file + " includes " + x.include + "\n";
  return s;
}

TEST(Dependencies, EveryIncludeIsAnAllowedEdge) {
  const fs::path root = KVCC_SOURCE_DIR;
  size_t libraries = 0;
  for (const auto& [lib, allowed] : kAllowed) libraries += fs::is_directory(root / lib) ? 1 : 0;
  ASSERT_EQ(libraries, kAllowed.size()) << "a library folder of the table is missing";
  const std::vector<Violation> v = check_tree(root);
  EXPECT_TRUE(v.empty()) << "includes outside the dependency table (tests/test_dependencies.cpp):\n" << describe(v);
}

TEST(Dependencies, PlantedWrongEdgesAreFound) {
  const fs::path root = fs::temp_directory_path() / ("kvcc_deps_" + std::to_string(::getpid()));
  fs::remove_all(root);
  auto write = [&](const std::string& rel, const std::string& text) {
    fs::create_directories((root / rel).parent_path());
    std::ofstream(root / rel) << text;
  };
  write("runtime/ok.cpp", "#include \"runtime/kv_cache.h\"\n#include \"formats/error.h\"\n#include <vector>\n");
  write("runtime/bad.cpp", "#include \"model/forward.h\"\n  #  include <cblas.h>\n");
  write("formats/bad.h", "#include \"compile/fit.h\"\n");
  write("eval/ok.cpp",
        "#include \"runtime/kvcc_runtime.h\"\n#include \"model/tokenizer.h\"\n#include <cuda_runtime.h>\n");
  write("zoo/bad.cpp", "#include <pcre2.h>\n");
  const std::vector<Violation> v = check_tree(root);
  fs::remove_all(root);
  std::set<std::string> found;
  for (const Violation& x : v) found.insert(x.file + " " + x.include);
  const std::set<std::string> expected = {"runtime/bad.cpp model/forward.h", "runtime/bad.cpp cblas.h",
                                          "formats/bad.h compile/fit.h", "zoo/bad.cpp pcre2.h"};
  EXPECT_EQ(found, expected) << describe(v);
}

}  // namespace
