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

}  // namespace kvcc

// Throws kvcc::Error(message) unless cond holds. A macro so that the message (often a string
// built from numbers and names) is evaluated only when the check fails: checks sit in loops over
// tokens and logits, where building a string per call cost more than the work checked.
#define KVCC_REQUIRE(cond, ...)         \
  do {                                  \
    if (!(cond)) [[unlikely]]           \
      throw ::kvcc::Error(__VA_ARGS__); \
  } while (0)
