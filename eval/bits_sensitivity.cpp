#include "eval/bits_sensitivity.h"

#include <algorithm>
#include <memory>
#include <string>
#include <variant>

#include "eval/scheme.h"
#include "formats/error.h"

namespace kvcc {

std::vector<double> measure_side_kl(const ModelFile& model, const std::vector<std::vector<int32_t>>& documents,
                                    const Artifact& artifact, ValidateMode mode, int block,
                                    const std::function<void(const ValidateProgress&)>& progress) {
  const ModelConfig& c = model.config();
  KVCC_REQUIRE(
      artifact.n_layers == c.n_layers && artifact.n_kv_heads == c.n_kv_heads && artifact.head_dim == c.head_dim,
      "sensitivity: the artifact's shape (" + std::to_string(artifact.n_layers) + " layers, " +
          std::to_string(artifact.n_kv_heads) + " KV heads, head_dim " + std::to_string(artifact.head_dim) +
          ") is not the model's");
  const CacheScheme whole = scheme_from_artifact(artifact, "all", c);
  const PageCodec codec = std::get<CodecPath>(whole.path).codec;
  KVCC_REQUIRE(codec != nullptr, "sensitivity: the artifact's scheme has no page codec");
  const size_t row = size_t(c.n_kv_heads) * c.head_dim;
  std::vector<CacheScheme> schemes;
  for (int l = 0; l < c.n_layers; ++l)
    for (int s = 0; s < 2; ++s) {
      PageCodec one_side = [codec, l, s, row](int layer, KvSide side, const float* rows, int n, int64_t first,
                                              float* out) {
        if (layer == l && int(side) == s) codec(layer, side, rows, n, first, out);
        else std::copy(rows, rows + size_t(n) * row, out);
      };
      CacheScheme one{"layer " + std::to_string(l) + (s ? " values" : " keys"),
                      whole.sink,
                      whole.recent,
                      whole.page_size,
                      whole.artifact,
                      CodecPath{std::move(one_side)}};
      schemes.push_back(std::move(one));
    }
  const ValidationResult r = validate_schemes(model, documents, schemes, mode, block, progress);
  std::vector<double> kl;
  // KL >= 0; a sum of rounded terms may land a hair below when the side changes almost nothing.
  for (const SchemeMetrics& m : r.schemes) kl.push_back(std::max(m.kl, 0.0));
  return kl;
}

}  // namespace kvcc
