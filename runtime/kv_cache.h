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

struct KvCacheConfig {
  KvGeometry geometry;
  int64_t max_pages = 0;  // INT2 history pages in the pool
  int max_sequences = 0;  // window slots (live sequences at once)
  PoolMemory memory = PoolMemory::Host;
};

class KvCache {
 public:
  explicit KvCache(const KvCacheConfig& config);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const KvGeometry& geometry() const { return config_.geometry; }
  const KvCacheConfig& config() const { return config_; }
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

  bool live(int seq) const;
  int64_t length(int seq) const;
  const std::vector<int32_t>& page_table(int seq) const;

  int64_t pages_in_use() const { return pages_in_use_; }
  int64_t pages_free() const { return int64_t(free_pages_.size()); }
  int sequences_live() const { return sequences_live_; }
  // Counts every change of sequences, lengths or page tables (add, fork, free, grow): a plan made
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
