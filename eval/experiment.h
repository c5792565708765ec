// The quality experiment behind `kvcc validate`: runs a model over documents with each scheme's
// quantised KV cache (eval/scheme.h) in place of full-precision K/V and measures the quality lost
// against the same run with a full-precision cache.
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
// double runs the same operations in double (model/forward.h), the slow exact-check mode: the
// full-precision reference then equals the plain double forward pass to ~1e-15 relative whatever
// the block size (in float, GEMM accumulation order follows the block shape: ~1e-8). Codecs take
// float rows: in double mode a page is rounded to float for the codec and the stored page is the
// double rows plus the codec's change, x + (codec(fl(x)) − fl(x)): a codec that returns its input
// unchanged leaves the double rows exact, a real codec's error is the one it makes in float.
// The runtime path runs in float only (the kernels take float32 activations).
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

#include "eval/scheme.h"
#include "formats/artifact.h"
#include "formats/model_file.h"

namespace kvcc {

enum class ValidateMode { PseudoDecode, Static };
const char* validate_mode_name(ValidateMode mode);  // pseudo-decode | static

enum class ValidatePrecision { Float, Double };
const char* validate_precision_name(ValidatePrecision precision);  // float | double

// One scheme on one document: means over that document's predictions.
struct DocumentMetrics {
  double nll = 0, kl = 0, top1_agreement = 0;
  double ppl_rel_change = 0;  // exp(nll − reference nll of the document) − 1
  // Over its predictions from position late_from on (validate_schemes' late_from; 0 without any).
  int64_t late_predictions = 0;
  double late_nll = 0, late_kl = 0;
};

// The predictions made at positions >= from (query positions; position p predicts token p + 1),
// measured on their own: the long-range use of the cache (validate --late-from). The means are
// token-weighted over those predictions, the standard errors clustered over the documents that
// have any (NaN with fewer than 2).
struct LateMetrics {
  uint64_t predictions = 0;
  double kl = 0, kl_stderr = 0, top1_agreement = 0;
  double ppl_rel_change = 0, ppl_rel_change_stderr = 0;  // exp(late nll − reference late nll) − 1
};

struct SchemeMetrics {
  std::string name, method;
  std::string cache = "codec";  // CacheScheme::path_name(): the path and pool that ran it
  double nll = 0;               // mean negative log-likelihood (nats) of the next token
  double perplexity = 0;
  double ppl_rel_change = 0;  // perplexity / reference perplexity − 1
  double kl = 0;              // mean KL(full ‖ quantised) of next-token distributions (nats)
  double top1_agreement = 0;  // fraction of positions whose argmax equals the reference's
  // Standard errors across documents (NaN with fewer than 2): of kl, and of ppl_rel_change from
  // the per-document paired NLL differences against the reference (header comment).
  double kl_stderr = 0, ppl_rel_change_stderr = 0;
  std::vector<double> layer_rel_error;  // per layer: Σ‖o − o_ref‖² / Σ‖o_ref‖² of attention outputs
  // 0 for schemes without an artifact. effective: the published accounting (every token past sink +
  // recent quantised); stored: what the paged cache holds (whole pages; formats/kv_codec.h).
  double nominal_bits = 0, effective_bits = 0, stored_bits = 0;
  std::vector<DocumentMetrics> per_document;  // in the order of ValidationResult::doc_lengths
  LateMetrics late;                           // with ValidationResult::late_from > 0
};

struct ValidationResult {
  std::string model, mode, precision;
  int block = 0;
  uint64_t documents = 0, tokens = 0, predictions = 0;
  std::vector<int64_t> doc_lengths;       // tokens of each evaluated document (predictions: length − 1)
  std::vector<double> reference_doc_nll;  // the reference's mean NLL per document
  double reference_nll = 0, reference_perplexity = 0;
  double reference_nll_stderr = 0;  // clustered over documents (NaN with one)
  int64_t late_from = 0;            // > 0: SchemeMetrics::late measured from this position on
  uint64_t late_predictions = 0;
  double reference_late_nll = 0;
  std::vector<SchemeMetrics> schemes;
  double seconds = 0;
};

struct ValidateProgress {
  uint64_t documents_done = 0, documents_total = 0, tokens_done = 0, tokens_total = 0;
  double elapsed_s = 0;
};

// Receives the logits of every scored position: run 0 is the full-precision reference, run i the
// i-th scheme; row counts the predictions in document then position order (each run's rows arrive
// in order); logits and logprobs (its log-softmax) are [vocab], in double whatever the precision.
using LogitsSink =
    std::function<void(size_t run, uint64_t row, const double* logits, const double* logprobs, int vocab)>;

// Runs every scheme and the full-precision reference over the documents, block by block in
// lockstep (one document's blocks at a time, so memory holds one block's logits per scheme).
// With no schemes it measures the full-precision model alone (reference_nll and its se).
// documents: token ids; documents of fewer than 2 tokens are skipped. late_from > 0 also measures
// the predictions from that position on (SchemeMetrics::late). Throws Error on no usable
// document, a negative late_from, and on a runtime-path scheme with double precision.
ValidationResult validate_schemes(const ModelFile& model, const std::vector<std::vector<int32_t>>& documents,
                                  const std::vector<CacheScheme>& schemes, ValidateMode mode, int block,
                                  const std::function<void(const ValidateProgress&)>& progress = {},
                                  ValidatePrecision precision = ValidatePrecision::Float, const LogitsSink& logits = {},
                                  int64_t late_from = 0);

// Standard error of the weighted mean μ = Σ wᵢxᵢ / Σ wᵢ of per-document values xᵢ (weights wᵢ:
// the documents' prediction counts) with documents as independent clusters:
// √(D/(D−1) · Σ wᵢ²(xᵢ − μ)²) / Σ wᵢ; with equal weights it is the sample s.d. / √D. NaN when
// fewer than 2 documents.
double clustered_standard_error(const std::vector<double>& values, const std::vector<double>& weights);

// Token-weighted effective bits over the evaluated documents: Σ_docs len·effective_bits(len) / Σ len,
// i.e. the bits of every document's final cache over its elements.
double effective_bits_at_lengths(const Recipe& recipe, int head_dim, const std::vector<int64_t>& lengths);
// The same for an artifact's own accounting (per-side widths counted at their bits).
double effective_bits_at_lengths(const Artifact& artifact, const std::vector<int64_t>& lengths);
// The same average of stored_bits (what the paged cache holds at each length).
double stored_bits_at_lengths(const Artifact& artifact, const std::vector<int64_t>& lengths);

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

}  // namespace kvcc
