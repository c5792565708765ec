// The paged mixed-precision KV cache: one pool (host memory for the CPU reference, device memory
// for the CUDA kernels; the same bookkeeping either way), a page allocator with reference counts
// (forks share history pages), and per-sequence window slots (sink + recent ring). Layout in
// formats/kv_layout.h.
//
// History pages are written once, when full, and never modified afterwards, so sharing them
// between forks needs no copy-on-write; the only mutable per-sequence state is the window slot,
// which a fork copies.
//
// Out of memory (no free page or no free window slot) throws kvcc::Error and leaves the cache as
// it was: the caller can free sequences and retry.
//
// Token eviction (plan_compaction / commit_compaction; the data moves are runtime/compact_ref's)
// is the one operation that rewrites pages: it writes only pages this sequence holds alone
// (reference count 1) or fresh ones, never a page shared with a fork.
#pragma once
#include <cstdint>
#include <vector>

#include "formats/error.h"
#include "formats/kv_layout.h"

namespace kvcc {

enum class PoolMemory { Host, Device };

// Thrown when the pool has no free page or window slot; the cache is unchanged.
struct CacheFull : Error {
  using Error::Error;
};

// One row moved by a compaction, in every layer and KV head. page kCompactWindow is the
// sequence's window slot, whose row r < S is sink row r and row S + s ring slot s; any other page
// is a page id, row the token's row in it.
constexpr int32_t kCompactWindow = -1;
struct CompactRowMove {
  int32_t src_page = 0, src_row = 0;
  int32_t dst_page = 0, dst_row = 0;
};

// What evicting all but `kept` tokens of a sequence does (KvCache::plan_compaction). The kept
// tokens are re-tiered as if the sequence had been built from them alone: with m kept tokens the
// layout is tiers_of(m), kept token j taking logical position j. Rows move between tiers:
//   BF16 -> BF16: copied; INT2 -> INT2: codes and params copied (every row is self-contained);
//   BF16 -> INT2: quantised exactly as append does (from the BF16 row);
//   INT2 -> BF16: dequantised and rounded to BF16 (the one lossy move: the original BF16 row is
//   gone; such a row is re-quantised from the rounded values if it later returns to history).
// Positions (RoPE) live in the stored keys, so the kept rows attend exactly as before.
struct CompactionPlan {
  int seq = -1;
  uint64_t version = 0;  // the cache version the plan was made at
  int64_t old_length = 0, new_length = 0;
  std::vector<int64_t> kept;          // old positions kept, increasing
  std::vector<int32_t> new_pages;     // the page table after the compaction
  std::vector<int32_t> fresh_pages;   // ids taken from the free pool (shared pages are never written)
  std::vector<char> reused;           // [new pages]: 1 when the page is an old page whose rows all stay in place
  std::vector<CompactRowMove> moves;  // rows that change place (all sources are read before any write)
  int64_t pages_released = 0;         // pages that return to the pool on commit
};

struct KvCacheConfig {
  KvGeometry geometry;
  int64_t max_pages = 0;  // INT2 history pages in the pool
  int max_sequences = 0;  // window slots (live sequences at once)
  PoolMemory memory = PoolMemory::Host;
  // Code widths per (layer, KV head), [n_layers · n_kv_heads] (kv_layout.h PageLayout); empty:
  // 2 bits everywhere. A device pool takes one key and one value width a layer (the CUDA kernels
  // take a layer's blocks as PageLayout::layer_blocks).
  std::vector<BlockWidths> widths;
  // The engine owns the page tables and window slots (RuntimeOptions::engine_tables): the
  // allocator is off (add_sequence, fork, grow and compaction throw Error) and mirror_sequence
  // records what the engine's tables say.
  bool engine_tables = false;
};

class KvCache {
 public:
  explicit KvCache(const KvCacheConfig& config);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const KvGeometry& geometry() const { return config_.geometry; }
  const KvCacheConfig& config() const { return config_; }
  // Where each (layer, KV head) block of a page is, and its code widths.
  const PageLayout& layout() const { return layout_; }
  // The block (page, layer, head): a host or device address, per memory().
  uint8_t* page_block(int32_t page, int layer, int head) const {
    return pool_ + layout_.block_offset(page, layer, head);
  }
  PoolMemory memory() const { return config_.memory; }

  // A new empty sequence; its id is its window slot. Throws Error when no slot is free.
  int add_sequence();
  // A new sequence with the parent's tokens: shares its history pages, copies its window slot
  // (on `stream`, a cudaStream_t, for a device pool). Throws Error when no slot is free.
  int fork(int parent, void* stream = nullptr);
  // Releases the sequence's slot and its references to pages.
  void free_sequence(int seq);

  // Grows the sequence by `new_tokens`: allocates the history pages its new length needs and
  // returns their ids (in order). The caller then writes the tokens with an append kernel, given
  // the old length. All or nothing: throws Error (and changes nothing) when pages run out.
  std::vector<int32_t> grow(int seq, int64_t new_tokens);
  // Grows several sequences at once, all or nothing across the batch.
  std::vector<std::vector<int32_t>> grow_batch(const std::vector<int>& seqs, const std::vector<int64_t>& new_tokens);

  // Plans the eviction of every token of `seq` except `kept` (strictly increasing positions in
  // [0, length)); changes nothing. A new page whose P tokens are exactly one old page's keeps that
  // page; the others are written into pages the sequence holds alone and will drop, then into
  // fresh pages. Throws Error on a bad list, CacheFull when fresh pages run out (only possible
  // when the sequence shares pages with a fork).
  CompactionPlan plan_compaction(int seq, const std::vector<int64_t>& kept) const;
  // Applies a plan's bookkeeping once its rows have been moved: the new page table and length,
  // fresh pages taken, dropped pages released. Throws Error (changing nothing) when the cache
  // changed since the plan was made.
  void commit_compaction(const CompactionPlan& plan);

  // Engine tables only: slot `seq` now holds a sequence of `length` tokens whose history pages are
  // `pages` (at least history_pages(length) of them, each in [0, max_pages)), as the engine's
  // tables say; no page is taken from the pool or counted. The host pool's Runtime does this for
  // each step, so that the reference kernels read the engine's tables. Throws Error on a bad slot,
  // length or page id.
  void mirror_sequence(int seq, int64_t length, const int32_t* pages, int64_t n_pages);

  bool live(int seq) const;
  int64_t length(int seq) const;
  const std::vector<int32_t>& page_table(int seq) const;

  int64_t pages_in_use() const { return pages_in_use_; }
  int64_t pages_free() const { return int64_t(free_pages_.size()); }
  int sequences_live() const { return sequences_live_; }
  // Counts every change of sequences, lengths or page tables (add, fork, free, grow, compaction): a plan made
  // from the tables is current while this is unchanged.
  uint64_t version() const { return version_; }
  int page_refcount(int32_t page) const { return refcount_[size_t(page)]; }
  // Bytes of the pool in use: pages in use (each once, however many sequences share it) plus the
  // window slots of live sequences.
  size_t bytes_in_use() const;
  size_t pool_bytes() const { return pool_bytes_; }

  // Pool regions (host or device addresses, per memory()).
  uint8_t* pages_base() const { return pool_; }
  uint16_t* windows_base() const { return reinterpret_cast<uint16_t*>(pool_ + pages_region_bytes_); }

 private:
  struct Sequence {
    bool live = false;
    int64_t length = 0;
    std::vector<int32_t> pages;
  };
  Sequence& seq_at(int seq);
  const Sequence& seq_at(int seq) const;
  int take_slot();

  KvCacheConfig config_;
  PageLayout layout_;
  uint8_t* pool_ = nullptr;
  size_t pool_bytes_ = 0;
  size_t pages_region_bytes_ = 0;
  std::vector<Sequence> sequences_;
  std::vector<int> refcount_;
  std::vector<int32_t> free_pages_;  // a stack; the lowest ids are handed out first
  int64_t pages_in_use_ = 0;
  int sequences_live_ = 0;
  uint64_t version_ = 0;
};

}  // namespace kvcc
