// Progress lines the commands that validate share.
#pragma once
#include <functional>
#include <string>

#include "eval/experiment.h"

namespace kvcc::cli {

// A validation pass's progress on stderr, "<what>: document d/D, t/T tokens (r tok/s)": one line
// redrawn in place on a terminal (ended when the pass ends), otherwise a line at the start, every
// 5% of the tokens and the end (log files stay short).
std::function<void(const ValidateProgress&)> validate_progress(std::string what);

}  // namespace kvcc::cli
