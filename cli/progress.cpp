#include "cli/progress.h"

#include <algorithm>
#include <cstdio>
#include <memory>

#include "cli/command.h"

namespace kvcc::cli {

std::function<void(const ValidateProgress&)> validate_progress(std::string what) {
  const bool tty = stderr_is_tty();
  auto next_line = std::make_shared<uint64_t>(0);  // tokens at which the next plain line is due
  return [tty, next_line, what = std::move(what)](const ValidateProgress& p) {
    const bool done = p.tokens_done >= p.tokens_total;
    if (!tty) {
      if (p.tokens_done < *next_line && !done) return;
      const uint64_t step = std::max<uint64_t>(1, (p.tokens_total + 19) / 20);
      *next_line = (p.tokens_done / step + 1) * step;
    }
    const double rate = p.elapsed_s > 0 ? double(p.tokens_done) / p.elapsed_s : 0;
    std::fprintf(stderr, "%s%s: document %llu/%llu, %llu/%llu tokens (%.0f tok/s)%s", tty ? "\r" : "", what.c_str(),
                 (unsigned long long)p.documents_done, (unsigned long long)p.documents_total,
                 (unsigned long long)p.tokens_done, (unsigned long long)p.tokens_total, rate, !tty || done ? "\n" : "");
    if (done) *next_line = 0;  // a next pass starts over
  };
}

}  // namespace kvcc::cli
