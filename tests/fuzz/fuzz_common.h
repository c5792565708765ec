// Shared by the libFuzzer targets: each input is written to a per-process scratch file (the kvcc
// readers take paths) and handed to every reader a command reaches; kvcc::Error is the expected
// way to refuse a corrupt file, anything else (a crash, a sanitizer report, a hang past -timeout,
// an allocation past -malloc_limit_mb) is a finding.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

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

template <class F>
void attempt(F&& f) {
  try {
    f();
  } catch (const Error&) {}
}

}  // namespace kvcc::fuzz
