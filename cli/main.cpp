// kvcc: one executable, one subcommand per cmd_*.cpp. Errors a user can cause (kvcc::Error, bad
// flags) print one line to stderr and exit non-zero; nothing else leaks (no HDF5 dumps, no traces).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>

#include "cli/command.h"
#include "formats/error.h"

namespace kvcc::cli {

std::vector<Registered>& registry() {
  static std::vector<Registered> r;
  return r;
}

Command::Command(std::string name, int order, std::string description, Setup setup) {
  registry().push_back({std::move(name), order, std::move(description), std::move(setup)});
}

CLI::Validator whole_number(long long min, unsigned long long max) {
  // Help shows ">= 1" for the usual bound (the type's), "0..4096" otherwise.
  const bool open_ended = max >= 2147483647ULL;
  const std::string shown = open_ended ? ">= " + std::to_string(min) : std::to_string(min) + ".." + std::to_string(max);
  const std::string range = "a whole number from " + std::to_string(min) + " to " + std::to_string(max);
  return CLI::Validator(
      [min, max, range](std::string& text) -> std::string {
        const std::string bad = "must be " + range + ", got '" + text + "'";
        size_t i = 0;
        const bool negative = !text.empty() && text[0] == '-';
        if (negative || (!text.empty() && text[0] == '+')) i = 1;
        if (i == text.size() || text.size() - i > 20) return bad;
        unsigned long long magnitude = 0;
        for (; i < text.size(); ++i) {
          if (text[i] < '0' || text[i] > '9') return bad;
          const unsigned digit = unsigned(text[i] - '0');
          if (magnitude > (~0ULL - digit) / 10) return bad;
          magnitude = magnitude * 10 + digit;
        }
        if (negative && magnitude > 0) {
          if (min >= 0 || magnitude - 1 > static_cast<unsigned long long>(-(min + 1))) return bad;
        } else if (magnitude > max || (min > 0 && magnitude < static_cast<unsigned long long>(min))) {
          return bad;
        }
        // What CLI11 converts, in canonical form (it reads base 0: a leading zero would be octal).
        text = (negative && magnitude > 0 ? "-" : "") + std::to_string(magnitude);
        return std::string();
      },
      shown);
}

bool stderr_is_tty() { return isatty(fileno(stderr)) != 0; }

}  // namespace kvcc::cli

int main(int argc, char** argv) {
  using namespace kvcc::cli;
  CLI::App app{
      "kvcc: calibrate a model's attention, compile rotations and ~2-bit KV-cache quantizers into\n"
      "versioned artifacts, and validate and serve them.\n\n"
      "Pipeline: calibrate-model -> stats.h5 -> compile -> artifact.kvcc.h5 -> validate / runtime / zoo\n"
      "Run `kvcc SUBCOMMAND --help` for each step's inputs, outputs and an example.",
      "kvcc"};
  app.set_version_flag("--version", std::string("kvcc ") + KVCC_VERSION);
  app.require_subcommand(1);
  app.fallthrough(false);

  auto& reg = registry();
  std::stable_sort(reg.begin(), reg.end(), [](const Registered& a, const Registered& b) { return a.order < b.order; });
  std::map<CLI::App*, std::function<int()>> runners;
  for (auto& r : reg) {
    CLI::App* sub = app.add_subcommand(r.name, r.description);
    runners[sub] = r.setup(*sub);
  }
  // Bare `kvcc` is a usage error: the help (on stderr, stdout stays for results) and exit 2.
  if (argc <= 1) {
    std::cerr << "kvcc: a subcommand is required\n\n" << app.help();
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (auto& [sub, run] : runners)
      if (sub->parsed()) return run();
  } catch (const kvcc::Error& e) {
    std::cerr << "kvcc: error: " << e.what() << "\n";
    return 1;
  } catch (const std::bad_alloc&) {
    std::cerr << "kvcc: error: out of memory\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "kvcc: internal error: " << e.what() << "\n";
    return 2;
  }
  return 1;
}
