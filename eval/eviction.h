// Which tokens a cache keeps: token-eviction scores and what a continuation loses when a long
// history is cut to a budget (the measurement behind `kvcc eviction`; EpiCache, docs/eviction.md).
//
// Protocol. A "conversation" is m passages of H/m tokens from m documents far apart in the text
// (different books in the held-out sets), followed by the next C tokens of the first passage's
// document: the continuation must recall the oldest passage, the case recency-based caches lose.
// The history is prefilled in full precision (whole, or block by block under the budget:
// block_prefill); then, per layer and KV head, a policy keeps ceil(H / ratio) of its tokens
// (always the first `sink` and the last `recent`, the rest by score; with layer budgets, the
// layers share that total unevenly: EvictionOptions::layer_budgets) and the continuation runs
// over the kept tokens plus itself, causally (one causal pass over the continuation equals
// decoding it token by token: nothing is evicted meanwhile). Measured against
// the same continuation over the full history: KL(full ‖ evicted) of the next-token
// distributions, ΔNLL of the true next tokens, top-1 agreement; documents are the independent
// samples (clustered standard errors, eval/experiment.h).
//
// Scores of history token j for one (layer, KV head), summed over the group's query heads:
//   window     : none — StreamingLLM: the sink and the most recent tokens
//   h2o        : Σ_i p_ij over every history query i ≥ j (H2O's accumulated attention)
//   snapkv     : Σ_i p_ij over the last `observation` history queries, max-pooled over `pool`
//                neighbouring positions (SnapKV)
//   emitted    : SnapKV's score as the runtime emits it (Runtime::attention_scores): the same
//                queries' softmax over the history as the cache holds it (through the INT2 codec
//                on "+int2" rows), no attention matrix kept; without INT2 it is snapkv
//   qmoment    : kⱼᵀ E[q qᵀ] kⱼ with E[q qᵀ] the calibrated query second moment of the layer and
//                KV head (stats.h5): the expected squared logit of the key — no query, no
//                attention matrix
//   qgauss     : μᵀkⱼ/√d + ½ kⱼᵀΣkⱼ/d = log E[exp(q·kⱼ/√d)] for a Gaussian query q ~ N(μ, Σ):
//                the log of the key's expected unnormalised attention weight (μ: the mean of the
//                stats' reservoir queries, Σ = E[q qᵀ] − μμᵀ)
//   keynorm    : ‖kⱼ‖² (the same without the query statistics)
//   vatp       : snapkv's attention times ‖vⱼ‖₁ before the pooling (VATP, Guo et al. 2024: a
//                token attended to but with a small value moves the output little)
//   epicache   : EpiCache (Kim et al. 2025), one cache per episode: the history in blocks of
//                `block` tokens, each embedded as the mean of its tokens' input embeddings less
//                the mean over the blocks; k-means (cosine) into `episodes` episodes; per episode, the SnapKV score
//                of its medoid block appended after the history (the "patched prompt": its
//                queries' attention on every history key, max-pooled); the continuation is
//                routed to the episode whose centroid is nearest the embedding of its first
//                `route` tokens (embedded the same way) and runs over that episode's cache. Every episode's cache holds
//                the same budget.
// With merges (EvictionOptions::merges), the evicted tokens are folded into the kept ones instead
// of dropped (merge_evicted).
// With an artifact, "+int2" rows also quantise the history as the artifact's cache would hold it
// (pages past the sink and before the ring, eval/scheme.h) before evicting; the continuation's
// own rows stay full precision (they are in the recent ring).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "eval/scheme.h"
#include "formats/model_file.h"
#include "formats/stats.h"
#include "model/forward.h"

namespace kvcc {

enum class EvictionScore { Window, H2O, SnapKV, Emitted, QueryMoment, QueryGaussian, KeyNorm, EpiCache, ValueAware };
// window | h2o | snapkv | emitted | qmoment | qgauss | keynorm | epicache | vatp
const char* eviction_score_name(EvictionScore score);
std::vector<EvictionScore> all_eviction_scores();

// The positions kept from n history tokens: the first `sink`, the last `recent`, then the
// highest scores (ties to the later position) until `budget` tokens; ascending. A budget below
// sink + recent keeps the sink and the most recent budget − sink. scores may be empty (window).
std::vector<int32_t> select_kept(const std::vector<double>& scores, int64_t n, int64_t budget, int sink, int recent);

// qmoment scores of n keys (rows of `stride` floats, the head's d channels first): kᵀ M k with M
// [d, d] row-major.
std::vector<double> query_moment_scores(const std::vector<double>& m, const float* keys, int64_t n, size_t stride,
                                        int d);
// vatp scores: attention[j] · ‖v_j‖₁ over n values (rows of `stride` floats, the head's d channels first).
std::vector<double> value_aware_scores(const std::vector<double>& attention, const float* values, int64_t n,
                                       size_t stride, int d);
// qgauss scores: (μᵀk)/√d + ½ kᵀΣk/d with Σ [d, d] row-major.
std::vector<double> query_gaussian_scores(const std::vector<double>& mean, const std::vector<double>& cov,
                                          const float* keys, int64_t n, size_t stride, int d);

// k-means on unit vectors (cosine), rows [n, dim]: assignments [n] in [0, k) and unit centroids
// [k, dim]. Deterministic: farthest-point initialisation from row 0, then Lloyd iterations until
// nothing moves (at most 100). k is capped at n.
struct Clusters {
  std::vector<int> assignment;
  std::vector<double> centroids;
  int k = 0;
};
Clusters cosine_kmeans(const std::vector<double>& rows, int n, int dim, int k);

// Per-layer kept-token counts: `total` tokens split in proportion to `weights` (one per layer,
// each > 0), every count within [lo, hi] (lo <= hi): clamp(λ·w_l, lo, hi) with λ such that they
// sum to total (layers at a bound stay there, the others are proportional to their weights), then
// rounded by largest remainder (ties to the lower layer). The counts sum to total clamped to
// [L·lo, L·hi].
std::vector<int64_t> allocate_layer_budgets(const std::vector<double>& weights, int64_t total, int64_t lo, int64_t hi);

// The emitted score of KV head g: the W observation queries q [W, n_heads·d] (post-RoPE, at
// positions n−W..n−1) attend causally over keys [n, n_kv·d]; per position, the softmax weights
// summed over the queries and the group's query heads (1/√d scale, float64).
std::vector<double> observation_scores(const ModelConfig& c, const float* q, int W, const float* keys, int64_t n,
                                       int g);

// Max-pool with window `width` (odd, centred; 1: unchanged).
std::vector<double> max_pool(const std::vector<double>& x, int width);

// How the evicted tokens of one (layer, KV head) leave the cache (docs/eviction.md, "Merging
// evicted tokens"). Each evicted token i joins the kept token j whose key is most similar to its
// own (cosine of the post-RoPE keys as the cache holds them; ties to the earlier kept position)
// when that cosine is at least the threshold; the others are dropped. With a_c the attention mass
// the observation queries put on token c and S_j = {j} ∪ {i merged into j}, M_j = Σ_{c∈S_j} a_c:
//   none    : every evicted token is dropped
//   value   : k_j unchanged, v_j ← Σ_{S_j} a_c v_c / M_j, and the entry's logit gains ln(M_j / a_j)
//             (it stands for |S_j| tokens: softmax weight e^{q·k_j/√d}·M_j/a_j). Exact when the
//             merged keys equal k_j (then a_c = a_j and every query weighs them alike).
//   kv      : the same with k_j ← Σ_{S_j} a_c k_c / M_j too (a weighted average of keys and values
//             with the same log mass)
//   average : kv without the log mass (D2O's weighted averaging: the merged entry counts as one token)
enum class EvictionMerge { None, Value, KeyValue, Average };
// none | value | kv | average
const char* eviction_merge_name(EvictionMerge merge);
std::vector<EvictionMerge> all_eviction_merges();

// Merges the evicted rows of one KV head into its kept rows: keys / values hold n rows of `stride`
// floats, the head's d channels first; kept: ascending positions in [0, n) (select_kept); mass:
// a_c per position (finite, >= 0; > 0 on kept positions). Rewrites the kept rows in place (the
// evicted ones are left as they were) and returns, per kept row, the log mass ln(M_j / a_j) its
// logit gains (0 where nothing merged, and always for none and average). `merged`, if given,
// receives the number of evicted tokens merged. threshold > 1 merges nothing (= none).
std::vector<float> merge_evicted(EvictionMerge merge, double threshold, float* keys, float* values, int64_t n,
                                 size_t stride, int d, const std::vector<int32_t>& kept,
                                 const std::vector<double>& mass, int64_t* merged = nullptr);

// Attention of T continuation queries (positions n0.., q [T, n_heads*d] post-RoPE) over, per KV
// head g, the history rows kept[g] (positions into hist_k / hist_v [n0, n_kv*d]) and the
// continuation's own rows causally (cont_k / cont_v [T, n_kv*d]). out [T, n_heads*d]. With every
// history row kept it is the model's prefix_causal_attention up to float rounding. log_mass, if
// given: per KV head, per kept row, a term added to that row's logit (merge_evicted's; the
// continuation's rows get none).
void attention_over_kept(const ModelConfig& c, int64_t n0, int T, const float* q, const float* hist_k,
                         const float* hist_v, const std::vector<std::vector<int32_t>>& kept, const float* cont_k,
                         const float* cont_v, float* out, const std::vector<std::vector<float>>* log_mass = nullptr);

// Query statistics per (layer · n_kv + KV head), for the scores that need no query: qmoment's
// normalised E[q qᵀ] [d, d], qgauss's mean [d] and covariance [d, d] (run_eviction fills them from
// the calibration stats).
struct QueryStatistics {
  std::vector<std::vector<double>> moment, mean, cov;
};

struct EvictionOptions {
  int history = 1024;      // H: history tokens (all passages)
  int continuation = 256;  // C: continuation tokens scored
  int passages = 3;        // m
  std::vector<double> ratios = {2, 4, 6};
  std::vector<EvictionScore> scores = all_eviction_scores();
  int sink = 4, recent = 32;                 // always kept
  int observation = 32, pool = 7;            // snapkv
  int conversations = 8;                     // at most this many
  int episodes = 4, block = 64, route = 16;  // epicache
  // Per-layer budget weights (Artifact::layer_budgets): the layers share L·ceil(H / ratio) tokens
  // per KV head by allocate_layer_budgets (at least sink + recent, at most H each). Empty: every
  // layer keeps ceil(H / ratio).
  std::vector<double> layer_budgets;
  // Evicted tokens dropped or merged (merge_evicted): every score and ratio runs once per entry.
  // The masses are the attention the score's queries put on each token: the episode's medoid
  // block for epicache, the last `observation` history queries for the others.
  std::vector<EvictionMerge> merges = {EvictionMerge::None};
  // An evicted token merges only if its key's cosine with the nearest kept key is at least this;
  // the default, -1, merges every evicted token (measured best: docs/eviction.md).
  double merge_threshold = -1;
  // Block-wise prefill (EpiCache's bounded memory): 0 prefills the whole history, then evicts;
  // B > 0 runs it in blocks of B tokens that attend to the cache as it stands, evicting to the
  // budget after every block (block_prefill). Every score but emitted.
  int prefill_block = 0;
};

// Block-wise prefill of one history under a budget (EpiCache, docs/eviction.md "Block-wise
// prefill"). The history ids[0, H) runs in blocks of options.prefill_block tokens at their own
// positions; in every layer a block's queries attend to the cache's kept rows (with their log
// masses) and to the block causally, and the block's keys and values join the cache. After each
// block, per layer l and KV head, a cache over budgets[l] rows keeps budgets[l] of them by
// select_kept (sink, recent, then the score), merging the rest when `merge` says so:
//   window               : none;
//   h2o                  : the attention every query so far put on the row;
//   snapkv / vatp        : the attention of the block's last `observation` queries (vatp: times
//                          ‖v‖₁), max-pooled over the candidate rows in position order;
//   qmoment/qgauss/keynorm: from the key (qs needed for the first two);
//   epicache             : the attention of `patched` (options.block ids: the episode's medoid
//                          block) appended after the block, max-pooled (EpiCache's patched prompt).
// Merge masses are epicache's patched-prompt attention, the block's observation attention for the
// other scores; a row merged twice keeps its earlier log mass plus the new one (its mass already
// counts its group). With every budget >= H nothing is evicted and the rows are the full
// prefill's up to float rounding; with one block (prefill_block >= H) the kept sets are those of
// the full prefill's eviction.
struct BlockPrefill {
  std::vector<std::vector<float>> keys, values;           // per layer [H, n_kv·d]; rows of evicted positions are stale
  std::vector<std::vector<std::vector<int32_t>>> kept;    // [layer][KV head]: ascending positions
  std::vector<std::vector<std::vector<float>>> log_mass;  // [layer][KV head]: per kept row (0: unmerged)
  // The most rows the cache held at once per KV head, summed over the layers, the block and the
  // patched prompt included (the whole history at once: layers · H).
  int64_t peak_rows = 0;
  int64_t evicted = 0, merged = 0;  // rows evicted over every layer, KV head and block; of them, merged
};
BlockPrefill block_prefill(const ModelFile& model, const std::vector<LayerWeights>& weights, const int32_t* ids, int H,
                           EvictionScore score, const std::vector<int64_t>& budgets, EvictionMerge merge,
                           const int32_t* patched, const EvictionOptions& options, const QueryStatistics* qs = nullptr);

struct EvictionRow {
  std::string score;  // eviction_score_name, or "full"
  double ratio = 1;   // token compression H / kept
  bool int2 = false;
  std::string merge = "none";  // eviction_merge_name
  double merged = 0;           // of the evicted tokens, the fraction merged (mean over conversations)
  double kl = 0, kl_stderr = 0, delta_nll = 0, delta_nll_stderr = 0, top1 = 0;
  int64_t peak_rows = 0;  // BlockPrefill::peak_rows (whole prefill: layers · H, + layers · block for epicache)
};

struct EvictionResult {
  std::string model, artifact, stats;
  int history = 0, continuation = 0, passages = 0, conversations = 0, sink = 0, recent = 0;
  int layers = 0;            // the model's
  double reference_nll = 0;  // mean NLL of the continuation over the full history
  // epicache: conversations whose routed episode's medoid block lies in the first passage (the
  // one the continuation continues); -1 without epicache.
  int epicache_routed_first = -1;
  std::vector<double> layer_budgets;  // EvictionOptions::layer_budgets (empty: uniform)
  double merge_threshold = 0;         // EvictionOptions::merge_threshold
  int prefill_block = 0;              // EvictionOptions::prefill_block
  std::vector<EvictionRow> rows;
  double seconds = 0;
};

// The conversations of the protocol above from tokenized documents (each needs H/m tokens, the
// first one H/m + C + 1): passage k from document i + k·⌊D/m⌋. Later passages drop their BOS.
// Throws Error when fewer than one conversation can be built.
std::vector<std::vector<int32_t>> build_conversations(const std::vector<std::vector<int32_t>>& documents,
                                                      const EvictionOptions& options, int bos_id);

// Runs every (score, ratio) with and (when `int2` is given) without INT2 on every conversation.
// stats: needed for qmoment (skipped without). progress(done, total) after each conversation.
EvictionResult run_eviction(const ModelFile& model, const std::vector<std::vector<int32_t>>& conversations,
                            const Stats* stats, const CacheScheme* int2, const EvictionOptions& options,
                            const std::function<void(int, int)>& progress = {});

}  // namespace kvcc
