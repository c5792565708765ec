#include "formats/json_int.h"

#include <nlohmann/json.hpp>

#include "formats/error.h"

namespace kvcc {

int32_t json_int32(const nlohmann::json& value, const std::string& what, int64_t min, int64_t max) {
  bool ok = false;
  int64_t v = 0;
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    ok = u <= uint64_t(std::numeric_limits<int64_t>::max());
    v = ok ? int64_t(u) : 0;
  } else if (value.is_number_integer()) {
    v = value.get<int64_t>();
    ok = true;
  }
  KVCC_REQUIRE(ok && v >= min && v <= max && v >= std::numeric_limits<int32_t>::min() &&
                   v <= std::numeric_limits<int32_t>::max(),
               what + " must be an integer from " + std::to_string(min) + " to " + std::to_string(max) + ", got " +
                   value.dump());
  return int32_t(v);
}

}  // namespace kvcc
