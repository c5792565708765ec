// Each subcommand lives in one cmd_*.cpp and registers itself with a static Command object:
//   static kvcc::cli::Command reg{"inspect", 10, [](CLI::App& app) { ... return run_fn; }};
// `order` sorts `kvcc --help`. A subcommand is a thin layer: parse flags, call the library, print.
#pragma once
#include <CLI/CLI.hpp>
#include <cmath>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace kvcc::cli {

// Registers the subcommand's options on `sub` and returns the function that runs it (exit code).
using Setup = std::function<std::function<int()>(CLI::App& sub)>;

struct Command {
  Command(std::string name, int order, std::string description, Setup setup);
};

struct Registered {
  std::string name;
  int order;
  std::string description;
  Setup setup;
};
std::vector<Registered>& registry();

// The check of an integer option: a plain decimal number in [min, max], else CLI11 refuses it
// with "--option: must be ..." (exit 105). Without it CLI11 wraps "-5" given to an unsigned option
// to 2^64-5 and reads "010" as octal.
CLI::Validator whole_number(long long min, unsigned long long max);

// The whole of text as a finite number (CLI11's PositiveNumber and Range let "nan" through, every
// comparison with NaN being false, and "inf" too).
inline bool parse_finite(const std::string& text, double& v) {
  size_t used = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    return false;
  }
  return used == text.size() && std::isfinite(v);
}

// The check of a real option: a finite number > 0.
inline CLI::Validator positive_real() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        double v = 0;
        if (!parse_finite(text, v) || v <= 0) return "must be a finite number > 0, got '" + text + "'";
        return std::string();
      },
      "> 0");
}

// The check of a real option in [lo, hi].
inline CLI::Validator real_in(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        double v = 0;
        if (!parse_finite(text, v) || v < lo || v > hi) {
          std::ostringstream m;
          m << "must be a finite number in [" << lo << ", " << hi << "], got '" << text << "'";
          return m.str();
        }
        return std::string();
      },
      "");
}

// True when stderr is a terminal (progress bars) — plain lines otherwise.
bool stderr_is_tty();

}  // namespace kvcc::cli
