// The one exception type kvcc throws for anything a user can cause (a wrong path, a corrupt file,
// a mismatched model, NaNs). Its message is one line that names the cause; the CLI prints it to
// stderr and exits non-zero. Programming errors stay as assertions.
#pragma once
#include <stdexcept>
#include <string>

namespace kvcc {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Throws Error(message) unless cond holds.
inline void require(bool cond, const std::string& message) {
  if (!cond) throw Error(message);
}

}  // namespace kvcc
