// An artifact's recipe as a JSON object, one spelling for every writer: `kvcc inspect --json`, the
// C ABI's kvcc_artifact_describe and the recipe in the safetensors container's metadata. Json is
// nlohmann::json (keys sorted) or nlohmann::ordered_json (keys in Recipe's order).
#pragma once
#include <nlohmann/json.hpp>

#include "formats/artifact.h"

namespace kvcc {

template <class Json>
Json recipe_json(const Recipe& r) {
  return Json{{"method", r.method},
              {"key_bits", r.key_bits},
              {"value_bits", r.value_bits},
              {"group", r.group},
              {"sink", r.sink},
              {"recent", r.recent},
              {"page_size", r.page_size},
              {"value_target", r.value_target},
              {"granularity", r.granularity},
              {"composition", r.composition},
              {"seed", r.seed},
              {"params", r.params}};
}

}  // namespace kvcc
