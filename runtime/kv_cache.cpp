#include "runtime/kv_cache.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "formats/error.h"

#if defined(KVCC_HAVE_CUDA)
#include <cuda_runtime.h>

#include "runtime/cuda_util.cuh"
#endif

namespace kvcc {

namespace {
void check_geometry(const KvGeometry& g, PoolMemory memory) {
  KVCC_REQUIRE(g.n_layers > 0 && g.n_kv_heads > 0 && g.head_dim > 0,
               "kv cache: layers, KV heads and head_dim must be positive");
  // The layout (formats/kv_layout.h) packs a row's 2-bit codes 4 to a byte: code rows of head_dim/4
  // bytes, so a host pool (the CPU reference kernels) takes any multiple of 4. A device pool keeps
  // the multiple of 16 (its kernels' scope is runtime/served.h's, checked by the Runtime).
  const int multiple = memory == PoolMemory::Host ? 4 : 16;
  KVCC_REQUIRE(g.head_dim % multiple == 0,
               std::string("kv cache: head_dim must be a multiple of ") + std::to_string(multiple) + " for a " +
                   (memory == PoolMemory::Host ? "host" : "device") + " pool, got " + std::to_string(g.head_dim));
  KVCC_REQUIRE(g.group > 0 && g.head_dim % g.group == 0, "kv cache: group " + std::to_string(g.group) +
                                                             " does not divide head_dim " + std::to_string(g.head_dim));
  KVCC_REQUIRE(g.page_tokens > 0 && g.page_tokens % 16 == 0,
               "kv cache: page size must be a positive multiple of 16, got " + std::to_string(g.page_tokens));
  KVCC_REQUIRE(g.key_group_tokens >= 0 && (g.key_group_tokens == 0 || g.page_tokens % g.key_group_tokens == 0),
               "kv cache: per-channel key groups of " + std::to_string(g.key_group_tokens) +
                   " tokens must divide the page of " + std::to_string(g.page_tokens) + " tokens");
  KVCC_REQUIRE(g.key_pair_bytes == 2 || g.key_pair_bytes == 4,
               "kv cache: a per-channel key pair takes 2 or 4 bytes, not " + std::to_string(g.key_pair_bytes));
  KVCC_REQUIRE(g.sink >= 0, "kv cache: negative sink size");
  KVCC_REQUIRE(g.recent >= g.page_tokens, "kv cache: the recent window (" + std::to_string(g.recent) +
                                              ") must hold at least one page (" + std::to_string(g.page_tokens) + ")");
}
}  // namespace

KvCache::KvCache(const KvCacheConfig& config) : config_(config) {
  check_geometry(config.geometry, config.memory);
  KVCC_REQUIRE(config.max_pages >= 0 && config.max_pages < (int64_t(1) << 31), "kv cache: page count out of range");
  KVCC_REQUIRE(config.max_sequences > 0, "kv cache: max_sequences must be positive");
  const KvGeometry& g = config.geometry;
  layout_ = PageLayout(g, config.widths);
  if (config.memory == PoolMemory::Device) {
    const std::string problem = layout_.kernel_problem();
    KVCC_REQUIRE(problem.empty(),
                 "kv cache: a device pool cannot hold these widths: " + problem + "; the host pool serves them");
  }
  pages_region_bytes_ = size_t(config.max_pages) * layout_.page_bytes();
  pool_bytes_ = pages_region_bytes_ + size_t(config.max_sequences) * g.window_slot_bytes();
  if (config.memory == PoolMemory::Host) {
    pool_ = static_cast<uint8_t*>(std::aligned_alloc(256, (pool_bytes_ + 255) / 256 * 256));
    KVCC_REQUIRE(pool_ != nullptr,
                 "kv cache: cannot allocate " + std::to_string(pool_bytes_) + " bytes of host memory");
    std::memset(pool_, 0, pool_bytes_);
  } else {
#if defined(KVCC_HAVE_CUDA)
    require_hopper();  // the kernels that read and write a device pool are built for sm_90 only
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, pool_bytes_);
    KVCC_REQUIRE(e == cudaSuccess, "kv cache: cannot allocate " + std::to_string(pool_bytes_) +
                                       " bytes of device memory: " + cudaGetErrorString(e));
    pool_ = static_cast<uint8_t*>(p);
    cudaMemset(pool_, 0, pool_bytes_);
#else
    throw Error("kv cache: a device pool needs kvcc built with CUDA");
#endif
  }
  sequences_.resize(size_t(config.max_sequences));
  refcount_.assign(size_t(config.max_pages), 0);
  free_pages_.reserve(size_t(config.max_pages));
  for (int64_t p = config.max_pages - 1; p >= 0; --p) free_pages_.push_back(int32_t(p));
}

KvCache::~KvCache() {
  if (config_.memory == PoolMemory::Host) {
    std::free(pool_);
  } else {
#if defined(KVCC_HAVE_CUDA)
    cudaFree(pool_);
#endif
  }
}

KvCache::Sequence& KvCache::seq_at(int seq) {
  KVCC_REQUIRE(seq >= 0 && seq < int(sequences_.size()) && sequences_[size_t(seq)].live,
               "kv cache: no live sequence " + std::to_string(seq));
  return sequences_[size_t(seq)];
}
const KvCache::Sequence& KvCache::seq_at(int seq) const {
  KVCC_REQUIRE(seq >= 0 && seq < int(sequences_.size()) && sequences_[size_t(seq)].live,
               "kv cache: no live sequence " + std::to_string(seq));
  return sequences_[size_t(seq)];
}

int KvCache::take_slot() {
  for (size_t s = 0; s < sequences_.size(); ++s)
    if (!sequences_[s].live) return int(s);
  throw CacheFull("kv cache: out of sequence slots (all " + std::to_string(sequences_.size()) +
                  " in use); free a sequence first");
}

int KvCache::add_sequence() {
  KVCC_REQUIRE(!config_.engine_tables,
               "kv cache: the engine owns this cache's page tables (engine_tables); its allocator is off");
  ++version_;
  const int s = take_slot();
  sequences_[size_t(s)] = Sequence{true, 0, {}};
  ++sequences_live_;
  return s;
}

int KvCache::fork(int parent, void* stream) {
  KVCC_REQUIRE(!config_.engine_tables,
               "kv cache: the engine owns this cache's page tables (engine_tables); its allocator is off");
  ++version_;
  const Sequence& p = seq_at(parent);
  const int s = take_slot();
  const KvGeometry& g = config_.geometry;
  uint8_t* dst = reinterpret_cast<uint8_t*>(windows_base()) + size_t(s) * g.window_slot_bytes();
  const uint8_t* src = reinterpret_cast<uint8_t*>(windows_base()) + size_t(parent) * g.window_slot_bytes();
  if (config_.memory == PoolMemory::Host) {
    std::memcpy(dst, src, g.window_slot_bytes());
  } else {
#if defined(KVCC_HAVE_CUDA)
    cudaError_t e =
        cudaMemcpyAsync(dst, src, g.window_slot_bytes(), cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream));
    KVCC_REQUIRE(e == cudaSuccess, std::string("kv cache: fork copy failed: ") + cudaGetErrorString(e));
#endif
  }
  sequences_[size_t(s)] = Sequence{true, p.length, p.pages};
  for (int32_t page : p.pages) ++refcount_[size_t(page)];
  ++sequences_live_;
  return s;
}

void KvCache::free_sequence(int seq) {
  KVCC_REQUIRE(!config_.engine_tables,
               "kv cache: the engine owns this cache's page tables (engine_tables); its allocator is off");
  ++version_;
  Sequence& s = seq_at(seq);
  for (int32_t page : s.pages) {
    if (--refcount_[size_t(page)] == 0) {
      free_pages_.push_back(page);
      --pages_in_use_;
    }
  }
  s = Sequence{};
  --sequences_live_;
}

std::vector<std::vector<int32_t>> KvCache::grow_batch(const std::vector<int>& seqs,
                                                      const std::vector<int64_t>& new_tokens) {
  KVCC_REQUIRE(!config_.engine_tables,
               "kv cache: the engine owns this cache's page tables (engine_tables); its allocator is off");
  ++version_;
  KVCC_REQUIRE(seqs.size() == new_tokens.size(), "kv cache: grow_batch needs one count per sequence");
  const KvGeometry& g = config_.geometry;
  std::vector<int64_t> need(seqs.size());
  int64_t total = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const Sequence& s = seq_at(seqs[i]);
    KVCC_REQUIRE(new_tokens[i] >= 0, "kv cache: negative token count");
    for (size_t j = 0; j < i; ++j)
      KVCC_REQUIRE(seqs[j] != seqs[i], "kv cache: sequence " + std::to_string(seqs[i]) + " appears twice in one batch");
    need[i] = history_pages(g, s.length + new_tokens[i]) - int64_t(s.pages.size());
    total += need[i];
  }
  if (total > int64_t(free_pages_.size()))
    throw CacheFull("kv cache: out of pages (need " + std::to_string(total) + ", " +
                    std::to_string(free_pages_.size()) + " free of " + std::to_string(config_.max_pages) +
                    "); free a sequence first");
  std::vector<std::vector<int32_t>> added(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    Sequence& s = seq_at(seqs[i]);
    for (int64_t k = 0; k < need[i]; ++k) {
      const int32_t page = free_pages_.back();
      free_pages_.pop_back();
      refcount_[size_t(page)] = 1;
      ++pages_in_use_;
      s.pages.push_back(page);
      added[i].push_back(page);
    }
    s.length += new_tokens[i];
  }
  return added;
}

std::vector<int32_t> KvCache::grow(int seq, int64_t new_tokens) { return grow_batch({seq}, {new_tokens})[0]; }

namespace {
struct RowAt {
  int32_t page, row;
  bool operator==(const RowAt& o) const { return page == o.page && row == o.row; }
};
// Where logical position pos of a sequence with tiers t and page table `pages` is stored.
RowAt row_at(const KvGeometry& g, const KvTiers& t, const std::vector<int32_t>& pages, int64_t pos) {
  if (pos < t.sink_count) return {kCompactWindow, int32_t(pos)};
  const int64_t post = pos - t.sink_count;
  if (post < t.hist_tokens) return {pages[size_t(post / g.page_tokens)], int32_t(post % g.page_tokens)};
  return {kCompactWindow, int32_t(g.sink + ring_slot(g, post))};
}
}  // namespace

CompactionPlan KvCache::plan_compaction(int seq, const std::vector<int64_t>& kept) const {
  KVCC_REQUIRE(!config_.engine_tables,
               "kv cache: the engine owns this cache's page tables (engine_tables); its allocator is off");
  const Sequence& s = seq_at(seq);
  const KvGeometry& g = config_.geometry;
  for (size_t j = 0; j < kept.size(); ++j) {
    KVCC_REQUIRE(kept[j] >= 0 && kept[j] < s.length, "kv cache: kept token " + std::to_string(kept[j]) +
                                                         " outside sequence " + std::to_string(seq) + " of length " +
                                                         std::to_string(s.length));
    KVCC_REQUIRE(j == 0 || kept[j] > kept[j - 1], "kv cache: kept tokens must be strictly increasing; " +
                                                      std::to_string(kept[j]) + " follows " +
                                                      std::to_string(kept[j - 1]));
  }
  CompactionPlan plan;
  plan.seq = seq;
  plan.version = version_;
  plan.old_length = s.length;
  plan.new_length = int64_t(kept.size());
  plan.kept = kept;
  const KvTiers t0 = tiers_of(g, plan.old_length), t1 = tiers_of(g, plan.new_length);
  const int64_t n_new_pages = t1.hist_tokens / g.page_tokens;
  const int P = g.page_tokens;

  // New pages made of exactly one old page's P rows, in order, keep that page (shared or not).
  plan.new_pages.assign(size_t(n_new_pages), -1);
  plan.reused.assign(size_t(n_new_pages), 0);
  std::vector<char> old_kept(s.pages.size(), 0);  // old page stays in the table
  for (int64_t k = 0; k < n_new_pages; ++k) {
    const int64_t j0 = t1.sink_count + k * P;
    const int64_t i0 = kept[size_t(j0)], i1 = kept[size_t(j0 + P - 1)];
    const int64_t post = i0 - t0.sink_count;
    if (i1 - i0 != P - 1 || post < 0 || post >= t0.hist_tokens || post % P != 0) continue;
    const size_t q = size_t(post / P);
    plan.new_pages[size_t(k)] = s.pages[q];
    plan.reused[size_t(k)] = 1;
    old_kept[q] = 1;
  }
  // The others: pages this sequence alone holds and drops (their rows are read before any
  // write), then fresh ones from the top of the free stack (the ones grow would take).
  std::vector<int32_t> spare;
  for (size_t q = 0; q < s.pages.size(); ++q)
    if (!old_kept[q] && refcount_[size_t(s.pages[q])] == 1) spare.push_back(s.pages[q]);
  size_t next_spare = 0;
  for (int64_t k = 0; k < n_new_pages; ++k) {
    if (plan.reused[size_t(k)]) continue;
    if (next_spare < spare.size()) {
      plan.new_pages[size_t(k)] = spare[next_spare++];
      continue;
    }
    const size_t f = plan.fresh_pages.size();
    if (f >= free_pages_.size())
      throw CacheFull("kv cache: compaction of sequence " + std::to_string(seq) + " needs " +
                      std::to_string(n_new_pages - k + int64_t(f)) + " fresh pages (its pages are shared), " +
                      std::to_string(free_pages_.size()) + " free; free a sequence first");
    const int32_t page = free_pages_[free_pages_.size() - 1 - f];
    plan.fresh_pages.push_back(page);
    plan.new_pages[size_t(k)] = page;
  }
  // Marks over the pool, not a search of the new table per old page (quadratic at 128K tokens).
  std::vector<char> in_new(refcount_.size(), 0);
  for (const int32_t page : plan.new_pages) in_new[size_t(page)] = 1;
  for (const int32_t page : s.pages)
    if (refcount_[size_t(page)] == 1 && !in_new[size_t(page)]) ++plan.pages_released;
  for (int64_t j = 0; j < plan.new_length; ++j) {
    const RowAt src = row_at(g, t0, s.pages, kept[size_t(j)]);
    const RowAt dst = row_at(g, t1, plan.new_pages, j);
    if (src == dst) continue;  // in place (a reused page's rows always are)
    plan.moves.push_back({src.page, src.row, dst.page, dst.row});
  }
  return plan;
}

void KvCache::commit_compaction(const CompactionPlan& plan) {
  KVCC_REQUIRE(plan.version == version_, "kv cache: a compaction plan made before the cache changed");
  Sequence& s = seq_at(plan.seq);
  KVCC_REQUIRE(s.length == plan.old_length, "kv cache: a compaction plan for another length");
  for (size_t f = 0; f < plan.fresh_pages.size(); ++f)
    KVCC_REQUIRE(free_pages_[free_pages_.size() - 1 - f] == plan.fresh_pages[f],
                 "kv cache: a compaction plan's fresh pages are no longer free");
  ++version_;
  free_pages_.resize(free_pages_.size() - plan.fresh_pages.size());
  for (int32_t page : plan.fresh_pages) {
    refcount_[size_t(page)] = 1;
    ++pages_in_use_;
  }
  // Old pages the new table keeps (reused or rewritten) keep their reference; the rest drop it.
  std::vector<char> in_new(refcount_.size(), 0);
  for (const int32_t page : plan.new_pages) in_new[size_t(page)] = 1;
  for (const int32_t page : s.pages) {
    if (in_new[size_t(page)]) continue;
    if (--refcount_[size_t(page)] == 0) {
      free_pages_.push_back(page);
      --pages_in_use_;
    }
  }
  s.pages = plan.new_pages;
  s.length = plan.new_length;
}

void KvCache::mirror_sequence(int seq, int64_t length, const int32_t* pages, int64_t n_pages) {
  KVCC_REQUIRE(config_.engine_tables, "kv cache: mirror_sequence is for a cache whose engine owns the page tables");
  KVCC_REQUIRE(seq >= 0 && seq < int(sequences_.size()), "kv cache: window slot " + std::to_string(seq) +
                                                             " outside [0, " + std::to_string(sequences_.size()) + ")");
  const int64_t need = history_pages(config_.geometry, length);
  KVCC_REQUIRE(length >= 0 && n_pages >= need, "kv cache: sequence " + std::to_string(seq) + " of " +
                                                   std::to_string(length) + " tokens needs " + std::to_string(need) +
                                                   " history pages, " + std::to_string(n_pages) + " given");
  for (int64_t p = 0; p < need; ++p)
    KVCC_REQUIRE(pages[p] >= 0 && pages[p] < config_.max_pages,
                 "kv cache: page id " + std::to_string(pages[p]) + " of sequence " + std::to_string(seq) +
                     " outside the pool [0, " + std::to_string(config_.max_pages) + ")");
  ++version_;
  Sequence& s = sequences_[size_t(seq)];
  if (!s.live) ++sequences_live_;
  s = Sequence{true, length, std::vector<int32_t>(pages, pages + need)};
}

bool KvCache::live(int seq) const { return seq >= 0 && seq < int(sequences_.size()) && sequences_[size_t(seq)].live; }
int64_t KvCache::length(int seq) const { return seq_at(seq).length; }
const std::vector<int32_t>& KvCache::page_table(int seq) const { return seq_at(seq).pages; }

size_t KvCache::bytes_in_use() const {
  const KvGeometry& g = config_.geometry;
  return size_t(pages_in_use_) * layout_.page_bytes() + size_t(sequences_live_) * g.window_slot_bytes();
}

}  // namespace kvcc
