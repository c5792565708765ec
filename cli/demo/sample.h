// Sampling text from a model with the CPU forward pass (model/forward.h), one token at a time with
// a float32 key/value cache per layer (full precision: the model's own distribution). `kvcc demo`
// uses it to make its calibration and held-out documents from the model itself, so that it needs
// no text from outside the repository.
#pragma once
#include <cstdint>
#include <vector>

#include "formats/model_file.h"
#include "model/forward.h"

namespace kvcc::demo {

// The model run one position at a time: step(id) feeds the token at the next position and returns
// the logits [vocab] of the token after it. Each step is the forward pass's own layer operations
// on one row (attention_qkv at that position, prefix_causal_attention over the cached keys and
// values, attention_output_and_mlp), so its logits equal the rows of a whole-sequence forward pass
// up to float32 rounding. Holds every layer's weights (meant for small models).
class IncrementalDecoder {
 public:
  IncrementalDecoder(const ModelFile& model, int max_tokens);
  const std::vector<float>& step(int32_t id);  // Error past max_tokens or on an id outside the vocabulary
  void reset() { pos_ = 0; }
  int position() const { return pos_; }

 private:
  const ModelFile& model_;
  int max_tokens_, pos_ = 0;
  std::vector<LayerWeights> layers_;
  std::vector<std::vector<float>> keys_, values_;  // per layer [max_tokens, n_kv * head_dim]
  std::vector<float> x_, q_, attn_, logits_;
};

struct SampleOptions {
  int max_tokens = 256;           // tokens per document, counting the leading BOS
  double temperature = 1.0;       // softmax temperature of the next-token distribution
  uint64_t seed = 1;              // one std::mt19937_64 stream for all documents
  std::vector<int32_t> stop_ids;  // a sampled one of these ends the document (not included)
};

// n_docs documents, each starting with the model's BOS (ModelConfig::bos_id, or 1 without one),
// continued by sampling until a stop id or max_tokens. The same seed gives the same documents on
// the same build and machine (the random stream is raw mt19937_64 output, not a library
// distribution; a BLAS with other blocking may round logits differently and so, rarely, pick
// another token). A document that ends before its second token is redrawn from the same stream.
std::vector<std::vector<int32_t>> sample_documents(const ModelFile& model, int n_docs, const SampleOptions& options);

}  // namespace kvcc::demo
