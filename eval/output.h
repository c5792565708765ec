// The forms a validation result is shown in: a text table, JSON (per-document metrics included,
// for paired comparisons) and an SVG plot.
#pragma once
#include <string>

#include "eval/experiment.h"

namespace kvcc {

std::string format_table(const ValidationResult& result);
std::string to_json(const ValidationResult& result);  // pretty JSON
// Quality (KL, log scale) against effective bits, one labelled point per scheme with a ±1
// standard-error bar.
std::string to_svg(const ValidationResult& result);

}  // namespace kvcc
