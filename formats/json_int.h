// Integers from JSON files (config.json, tokenizer.json) into the 32-bit ints kvcc uses, checked:
// nlohmann's get<int>() narrows a 64-bit value silently (4294967298 becomes 2).
#pragma once
#include <cstdint>
#include <limits>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace kvcc {

// `value` as an int32 when it is a JSON integer in [min, max]; otherwise throws Error
// "<what> must be an integer from MIN to MAX, got VALUE". `what` names the key and the file
// (e.g. "config.json: field 'num_hidden_layers'").
int32_t json_int32(const nlohmann::json& value, const std::string& what,
                   int64_t min = std::numeric_limits<int32_t>::min(),
                   int64_t max = std::numeric_limits<int32_t>::max());

}  // namespace kvcc
