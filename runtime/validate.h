// `kvcc validate` as a library call: runs a model over text with each artifact's quantised KV cache
// in place of full-precision K/V and measures the quality lost against the same run with a
// full-precision cache.
//
// Cache policy (the CUDA runtime's, formats/kv_layout.h tiers_of): per layer and KV head the first
// S tokens stay full precision (sink), the last post-sink tokens stay full precision in a ring of
// W, and when a token arrives while the ring holds W its oldest P tokens are quantised as one page
// by the artifact's method (formats/kv_codec.h roundtrip_layer_page, all KV heads of the layer at
// once); a page never changes afterwards. One difference from the runtime: the windows here hold
// float32 (or double), the runtime's hold BF16 (the runtime cache path below has none).
//
// Modes:
//   pseudo-decode (KVarN §3.2): each document in blocks of B tokens; per layer the block's queries
//     attend to the cache of earlier blocks (as quantised) and to the block's own K/V causally in
//     full precision; then the block's K/V are appended (pages quantised as the policy says). The
//     K/V appended come from the quantised run's own hidden states, so error accumulates across
//     layers and blocks as in decoding.
//   static: the same, but the K/V appended to the cache are those of the full-precision run (the
//     prefix computed in full precision, then quantised): error does not feed back through the
//     cache, only through the block's own layers.
//
// Precision: float (default) runs every layer operation in float32 as the plain forward pass does;
// double runs the same operations in double (runtime/forward.h), the slow exact-check mode: the
// full-precision reference then equals the plain double forward pass to ~1e-15 relative whatever
// the block size (in float, GEMM accumulation order follows the block shape: ~1e-8). Codecs take
// float rows: in double mode a page is rounded to float for the codec and the stored page is the
// double rows plus the codec's change, x + (codec(fl(x)) − fl(x)): a codec that returns its input
// unchanged leaves the double rows exact, a real codec's error is the one it makes in float.
//
// Cache path (ValidateCache): codec (default) is the simulation above. runtime runs the quantised
// attention through the serving code instead: a kvcc::Runtime (runtime/kvcc_runtime.h) built from
// the artifact with its recipe's windows and page size, one sequence per document; per block it
// calls begin_append once, then per layer prefill (the block over the cache plus itself, causally;
// its own K/V rotated and BF16-rounded as the ring holds them) and append. So windows hold BF16 in
// the rotated basis and pages are the INT2 bytes the kernels read. The pool is the host one (the
// CPU reference kernels append_ref / prefill_ref) or the device one (the CUDA kernels); per scheme,
// ValidateDevice picks it. The full-precision reference stays the float plain path. Float
// precision only; methods the runtime serves only (check_artifact_for_engine).
//
// Error bars: documents are the independent samples. Every mean here is token-weighted (Σ over
// predictions / count); its standard error treats each document as one cluster (see
// clustered_standard_error). Δppl's is that of the per-document paired differences of NLL
// against the reference run, carried through exp (delta method).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/kv_codec.h"
#include "formats/model_file.h"
#include "runtime/kv_cache.h"

namespace kvcc {

enum class ValidateMode { PseudoDecode, Static };
ValidateMode validate_mode_from_name(const std::string& name);  // throws Error on an unknown name
const char* validate_mode_name(ValidateMode mode);

enum class ValidatePrecision { Float, Double };
ValidatePrecision validate_precision_from_name(const std::string& name);  // float | double
const char* validate_precision_name(ValidatePrecision precision);

enum class ValidateCache { Codec, Runtime };
ValidateCache validate_cache_from_name(const std::string& name);  // codec | runtime

// Which pool a runtime-path scheme uses. auto: the device one when the build has CUDA, a device is
// present and the shape is in the GPU kernels' scope (head_dim 128, group = head_dim, 64-token
// pages, <= 64 KV heads), else the host one; gpu: the device one or an Error saying why not.
enum class ValidateDevice { Auto, Cpu, Gpu };
ValidateDevice validate_device_from_name(const std::string& name);  // auto | cpu | gpu
bool cuda_device_present();  // built with CUDA and cudaGetDeviceCount > 0

// Quantise + dequantise one page of n tokens of all KV heads of (layer, side): rows and out are
// [n, n_kv * d] (token-major; KV head h holds channels [h*d, (h+1)*d)), at positions
// first_position.. (CommVQ codes keys pre-RoPE, so it needs them). Per layer because a quantiser
// group may span several KV heads (small head_dim).
using PageCodec = std::function<void(int layer, KvSide side, const float* rows, int n,
                                     int64_t first_position, float* out)>;

// What one evaluated cache does: its windows and page size, and the page codec.
struct CacheScheme {
  std::string name;  // shown in tables ("oscar", a file name, ...)
  int sink = 64, recent = 256, page_size = 64;
  PageCodec codec;   // null: pages are kept in full precision (the reference)
  const Artifact* artifact = nullptr;  // for bit accounting; null for hand-made schemes
  // Runtime path (header): codec is unused, the windows above must be the artifact recipe's.
  ValidateCache cache = ValidateCache::Codec;
  PoolMemory pool = PoolMemory::Host;
};
// The scheme an artifact's recipe describes (codec = kv_codec roundtrip_layer_page; CommVQ:
// commvq_roundtrip_keys/values per KV head with the model's RoPE). The artifact must outlive the
// scheme.
CacheScheme scheme_from_artifact(const Artifact& artifact, const std::string& name,
                                 const ModelConfig& config);

// The runtime-path scheme of an artifact: its recipe's windows, the pool `device` picks. Throws
// Error naming the artifact and the reason when the runtime cannot serve it (method, bits,
// spanning group, windows the cache refuses) or when gpu is asked for and cannot be had.
CacheScheme runtime_scheme_from_artifact(const Artifact& artifact, const std::string& name,
                                         const ModelConfig& config, ValidateDevice device);

// Throws Error naming what differs when the artifact was compiled for another model (fingerprint,
// layer/head counts, head_dim or RoPE convention).
void check_artifact_matches(const Artifact& artifact, const ModelFile& model,
                            const std::string& artifact_name);

// One scheme on one document: means over that document's predictions.
struct DocumentMetrics {
  double nll = 0, kl = 0, top1_agreement = 0;
  double ppl_rel_change = 0;  // exp(nll − reference nll of the document) − 1
};

struct SchemeMetrics {
  std::string name, method;
  std::string cache = "codec";  // codec | runtime/cpu | runtime/gpu: the path and pool that ran it
  double nll = 0;            // mean negative log-likelihood (nats) of the next token
  double perplexity = 0;
  double ppl_rel_change = 0;  // perplexity / reference perplexity − 1
  double kl = 0;             // mean KL(full ‖ quantised) of next-token distributions (nats)
  double top1_agreement = 0; // fraction of positions whose argmax equals the reference's
  // Standard errors across documents (NaN with fewer than 2): of kl, and of ppl_rel_change from
  // the per-document paired NLL differences against the reference (header comment).
  double kl_stderr = 0, ppl_rel_change_stderr = 0;
  std::vector<double> layer_rel_error;  // per layer: Σ‖o − o_ref‖² / Σ‖o_ref‖² of attention outputs
  double nominal_bits = 0, effective_bits = 0;  // 0 for schemes without an artifact
  std::vector<DocumentMetrics> per_document;    // in the order of ValidationResult::doc_lengths
};

struct ValidationResult {
  std::string model, mode, precision;
  int block = 0;
  uint64_t documents = 0, tokens = 0, predictions = 0;
  std::vector<int64_t> doc_lengths;       // tokens of each evaluated document (predictions: length − 1)
  std::vector<double> reference_doc_nll;  // the reference's mean NLL per document
  double reference_nll = 0, reference_perplexity = 0;
  std::vector<SchemeMetrics> schemes;
  double seconds = 0;
};

struct ValidateProgress {
  uint64_t documents_done = 0, documents_total = 0, tokens_done = 0, tokens_total = 0;
  double elapsed_s = 0;
};

// Runs every scheme and the full-precision reference over the documents, block by block in
// lockstep (one document's blocks at a time, so memory holds one block's logits per scheme).
// documents: token ids; each needs at least 2 tokens. Throws Error on no usable document, and on a
// runtime-path scheme with double precision.
ValidationResult validate_schemes(const ModelFile& model, const std::vector<std::vector<int32_t>>& documents,
                                  const std::vector<CacheScheme>& schemes, ValidateMode mode, int block,
                                  const std::function<void(const ValidateProgress&)>& progress = {},
                                  ValidatePrecision precision = ValidatePrecision::Float);

// Standard error of the weighted mean μ = Σ wᵢxᵢ / Σ wᵢ of per-document values xᵢ (weights wᵢ:
// the documents' prediction counts) with documents as independent clusters:
// √(D/(D−1) · Σ wᵢ²(xᵢ − μ)²) / Σ wᵢ; with equal weights it is the sample s.d. / √D. NaN when
// fewer than 2 documents.
double clustered_standard_error(const std::vector<double>& values, const std::vector<double>& weights);

// Token-weighted effective bits over the evaluated documents: Σ_docs len·effective_bits(len) / Σ len,
// i.e. the bits of every document's final cache over its elements.
double effective_bits_at_lengths(const Recipe& recipe, int head_dim, const std::vector<int64_t>& lengths);

// The documents a validation runs on: text (split by `separator`, tokenized by the model's
// tokenizer with its BOS policy) or a pre-tokenized id file; each truncated to max_seq_len
// (0: min(max_position, 2048)); stops after max_tokens in total (0: all). Throws Error on an
// empty input.
struct ValidateData {
  std::string data_path, ids_path, tokenizer_path, separator = "<|endoftext|>";
  uint64_t max_tokens = 0;
  int max_seq_len = 0;
};
std::vector<std::vector<int32_t>> load_validation_documents(const ModelFile& model, const ValidateData& data);

// Output forms.
std::string format_table(const ValidationResult& result);
std::string to_json(const ValidationResult& result);  // pretty JSON
// Quality (KL, log scale) against effective bits, one labelled point per scheme with a ±1
// standard-error bar.
std::string to_svg(const ValidationResult& result);

}  // namespace kvcc
