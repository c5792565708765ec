// The merge loop shared by the HF BPE model and the llama2.c tokenizer: repeatedly merge the
// adjacent pair with the best priority (smallest value; ties go to the leftmost pair) until no
// adjacent pair can merge. A heap with lazily discarded stale entries makes it O(n log n), so a
// whole document can be one "word" (metaspace tokenizers without a pre-tokenizer).
#pragma once
#include <cstdint>
#include <optional>
#include <queue>
#include <vector>

namespace kvcc::detail {

struct MergeResult {
  double priority;  // smaller merges first
  int32_t merged_id;
};

// `lookup(left_id, right_id)` returns the merge of that pair, or nullopt when the pair never merges.
template <class Lookup>
std::vector<int32_t> bpe_merge(const std::vector<int32_t>& initial_ids, const Lookup& lookup) {
  const int n = static_cast<int>(initial_ids.size());
  if (n < 2) return initial_ids;
  struct Symbol {
    int32_t id;
    int prev, next;  // -1 at the ends
    bool alive;
  };
  std::vector<Symbol> symbols(n);
  for (int i = 0; i < n; ++i) symbols[i] = {initial_ids[i], i - 1, i + 1 < n ? i + 1 : -1, true};

  // The pair's ids are recorded so an entry whose symbols have since changed is recognised as stale.
  struct Candidate {
    double priority;
    int pos;
    int32_t left_id, right_id, merged_id;
    bool operator<(const Candidate& o) const {  // std::priority_queue pops the largest
      if (priority != o.priority) return priority > o.priority;
      return pos > o.pos;
    }
  };
  std::priority_queue<Candidate> queue;
  auto push_pair = [&](int pos) {
    const int next = symbols[pos].next;
    if (next < 0) return;
    if (auto merge = lookup(symbols[pos].id, symbols[next].id))
      queue.push({merge->priority, pos, symbols[pos].id, symbols[next].id, merge->merged_id});
  };
  for (int i = 0; i + 1 < n; ++i) push_pair(i);

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0 || left.id != top.left_id) continue;
    Symbol& right = symbols[left.next];
    if (right.id != top.right_id) continue;
    left.id = top.merged_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(top.pos);
  }
  std::vector<int32_t> out;
  for (int i = 0; i >= 0; i = symbols[i].next) out.push_back(symbols[i].id);
  return out;
}

// The UTF-8 length of the character starting with `lead` (1 for a stray continuation byte).
inline int utf8_char_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 1;
}

}  // namespace kvcc::detail
