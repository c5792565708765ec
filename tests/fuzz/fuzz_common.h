// Shared by the libFuzzer targets: each input is written to a per-process scratch file (the kvcc
// readers take paths) and handed to every reader a command reaches; kvcc::Error is the expected
// way to refuse a corrupt file, anything else (a crash, a sanitizer report, a hang past -timeout,
// an allocation past -malloc_limit_mb) is a finding.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "formats/error.h"

namespace kvcc::fuzz {

inline const std::string& scratch_path() {
  static const std::string path = [] {
    const char* dir = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    return std::string(dir) + "/kvcc_fuzz_" + std::to_string(::getpid()) + ".h5";
  }();
  return path;
}

inline bool write_input(const uint8_t* data, size_t size) {
  FILE* f = std::fopen(scratch_path().c_str(), "wb");
  if (!f) return false;
  const bool ok = std::fwrite(data, 1, size, f) == size;
  return std::fclose(f) == 0 && ok;
}

// A per-process scratch directory, for readers that take a directory (a model or zoo directory)
// or decide by a file's name; removed at exit. Fixture files the input needs beside it (the rest
// of a model directory) are symbolic links to tests/data, fixed by the target, never fuzzed.
inline const std::string& scratch_dir() {
  // Never destroyed, so that the atexit handler can still read it.
  static const std::string* dir = [] {
    auto* d = new std::string(scratch_path() + ".d");
    std::filesystem::remove_all(*d);
    std::filesystem::create_directories(*d);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(scratch_dir(), ec);
    });
    return d;
  }();
  return *dir;
}

// Writes the input as scratch_dir()/name and returns its path ("" when it cannot be written).
inline std::string write_input_as(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch_dir() + "/" + name;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return "";
  const bool ok = std::fwrite(data, 1, size, f) == size;
  return std::fclose(f) == 0 && ok ? path : "";
}

// Links tests/data/RELATIVE into the scratch directory as `name` (once per process). The
// environment's KVCC_FUZZ_DATA_DIR replaces the build's tests/data (a copy of the tree elsewhere).
inline void link_fixture(const std::string& relative, const std::string& name) {
  const char* data_dir = std::getenv("KVCC_FUZZ_DATA_DIR");
  const std::filesystem::path target = std::filesystem::path(data_dir ? data_dir : KVCC_FUZZ_DATA_DIR) / relative;
  if (!std::filesystem::exists(target)) {
    std::fprintf(stderr, "fuzz fixture %s is missing\n", target.c_str());
    std::abort();
  }
  const std::filesystem::path link = std::filesystem::path(scratch_dir()) / name;
  std::error_code ec;
  std::filesystem::remove(link, ec);
  std::filesystem::create_symlink(target, link);
}

template <class F>
void attempt(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    // KVCC_FUZZ_VERBOSE=1 shows why each input was refused (to check that seeds get through).
    static const bool verbose = std::getenv("KVCC_FUZZ_VERBOSE") != nullptr;
    if (verbose) std::fprintf(stderr, "refused: %s\n", e.what());
  }
}

// What a command does with an opened ModelFile: every tensor converted whole, the first and an
// out-of-range row read, config and fingerprint read (a template: ModelFile without its header).
template <class Model>
void exercise_model(const Model& model) {
  model.config();
  model.fingerprint();
  for (const std::string& name : model.tensor_names()) {
    model.tensor_dtype(name);
    model.tensor_f32(name);
    const std::vector<int64_t> shape = model.tensor_shape(name);
    if (shape.size() != 2 || shape[0] <= 0) continue;
    std::vector<float> row(static_cast<size_t>(shape[1]));
    model.tensor_rows_f32(name, 0, 1, row.data());
    attempt([&] { model.tensor_rows_f32(name, shape[0], 1, row.data()); });
  }
}

}  // namespace kvcc::fuzz
