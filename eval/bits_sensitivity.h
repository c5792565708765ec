// What each layer's keys and values cost the model when quantised: the loss side of `kvcc compile
// --bits-budget --sensitivity-model` (compile/allocate.h, CompileOptions::side_kl).
//
// For every (layer, side) one cache scheme quantises that side of that layer alone with the
// artifact's codec (its windows and pages, eval/scheme.h's cache policy) and passes every other
// side through exactly; validate_schemes runs them all against the full-precision model, and each
// scheme's mean KL(full ‖ quantised) of the next-token distribution is that side's cost.
#pragma once
#include <functional>
#include <vector>

#include "eval/experiment.h"
#include "formats/artifact.h"
#include "formats/model_file.h"

namespace kvcc {

// KL per (layer, side), index layer·2 + side (0 keys, 1 values), measured on `documents` in
// `mode` with blocks of `block` tokens. The artifact must have the model's shape (layers, KV heads,
// head_dim; the caller checks that it was compiled for this model: check_artifact_matches) and be
// on the codec path (scheme_from_artifact). progress as validate_schemes'.
std::vector<double> measure_side_kl(const ModelFile& model, const std::vector<std::vector<int32_t>>& documents,
                                    const Artifact& artifact, ValidateMode mode, int block,
                                    const std::function<void(const ValidateProgress&)>& progress = {});

}  // namespace kvcc
