#include "calibrate/mpi_reduce.h"

#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "formats/error.h"

#ifdef KVCC_HAVE_MPI
#define OMPI_SKIP_MPICXX 1  // the C API only; the deprecated C++ bindings warn under -Wextra
#include <mpi.h>
#endif

namespace kvcc {
namespace {

int launched_world_size() {
  const char* env = std::getenv("OMPI_COMM_WORLD_SIZE");
  return env ? std::atoi(env) : 0;
}

#ifdef KVCC_HAVE_MPI
template <typename T>
void append_bytes(std::vector<char>& out, const std::vector<T>& v) {
  const char* p = reinterpret_cast<const char*>(v.data());
  out.insert(out.end(), p, p + v.size() * sizeof(T));
}

template <typename T>
void read_bytes(const char*& p, const char* end, std::vector<T>& v, size_t n) {
  KVCC_REQUIRE(size_t(end - p) >= n * sizeof(T), "MPI reduce: truncated reservoir message");
  v.resize(n);
  std::memcpy(v.data(), p, n * sizeof(T));
  p += n * sizeof(T);
}

// All reservoirs of one rank as bytes: per (layer, head) the row count, then each field.
std::vector<char> serialize_reservoirs(const std::vector<Reservoir>& reservoirs) {
  std::vector<char> out;
  for (const Reservoir& r : reservoirs) {
    const uint64_t n = r.size();
    const char* np = reinterpret_cast<const char*>(&n);
    out.insert(out.end(), np, np + sizeof n);
    append_bytes(out, r.q);
    append_bytes(out, r.key_pre);
    append_bytes(out, r.key);
    append_bytes(out, r.value);
    append_bytes(out, r.position);
    append_bytes(out, r.doc);
    append_bytes(out, r.priority);
    append_bytes(out, r.heldout);
  }
  return out;
}

void merge_serialized_reservoirs(std::vector<Reservoir>& into, const char* p, const char* end) {
  for (Reservoir& target : into) {
    uint64_t n = 0;
    KVCC_REQUIRE(size_t(end - p) >= sizeof n, "MPI reduce: truncated reservoir message");
    std::memcpy(&n, p, sizeof n);
    p += sizeof n;
    Reservoir r;
    r.capacity = target.capacity;
    r.group = target.group;
    r.d = target.d;
    const size_t d = size_t(target.d), g = size_t(target.group);
    read_bytes(p, end, r.q, n * g * d);
    read_bytes(p, end, r.key_pre, n * d);
    read_bytes(p, end, r.key, n * d);
    read_bytes(p, end, r.value, n * d);
    read_bytes(p, end, r.position, n);
    read_bytes(p, end, r.doc, n);
    read_bytes(p, end, r.priority, n);
    read_bytes(p, end, r.heldout, n);
    if (n > 0) reservoir_merge(target, r);
  }
  KVCC_REQUIRE(p == end, "MPI reduce: reservoir message has trailing bytes");
}

void reduce_in_place(void* buf, int count, MPI_Datatype type, MPI_Op op, const MpiWorld& w) {
  if (w.rank == 0) MPI_Reduce(MPI_IN_PLACE, buf, count, type, op, 0, MPI_COMM_WORLD);
  else MPI_Reduce(buf, nullptr, count, type, op, 0, MPI_COMM_WORLD);
}

int checked_count(size_t n) {
  KVCC_REQUIRE(n <= size_t(INT_MAX), "MPI reduce: statistics too large for one message");
  return int(n);
}
#endif

}  // namespace

MpiSession::MpiSession() {
  const int launched = launched_world_size();
#ifdef KVCC_HAVE_MPI
  if (launched > 0) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) MPI_Init(nullptr, nullptr);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_.size);
    world_.active = true;
  }
#else
  KVCC_REQUIRE(launched <= 1,
               "launched by mpirun with " + std::to_string(launched) + " ranks, but this kvcc was built without MPI");
#endif
}

MpiSession::~MpiSession() {
#ifdef KVCC_HAVE_MPI
  if (world_.active) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
#endif
}

bool mpi_any_failed(const MpiWorld& world, bool failed) {
#ifdef KVCC_HAVE_MPI
  if (world.active && world.size > 1) {
    int local = failed ? 1 : 0, any = 0;
    MPI_Allreduce(&local, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return any != 0;
  }
#endif
  (void)world;
  return failed;
}

void mpi_reduce_stats(Stats& stats, const MpiWorld& world) {
  (void)stats;
  if (!world.active || world.size <= 1) return;
#ifdef KVCC_HAVE_MPI
  // Sums: five d×d matrices and the p2 weight per head, in one message.
  std::vector<double> sums;
  std::vector<uint64_t> counts;
  std::vector<double> mins, maxs;
  for (const HeadStats& h : stats.heads) {
    for (const auto* m : {&h.query_m2, &h.output_m2, &h.p2_m2, &h.key_m2, &h.value_m2})
      sums.insert(sums.end(), m->begin(), m->end());
    sums.push_back(h.p2_weight);
    counts.insert(counts.end(), {h.query_count, h.output_count, h.kv_count});
    mins.insert(mins.end(), h.key_min.begin(), h.key_min.end());
    mins.insert(mins.end(), h.value_min.begin(), h.value_min.end());
    maxs.insert(maxs.end(), h.key_max.begin(), h.key_max.end());
    maxs.insert(maxs.end(), h.value_max.begin(), h.value_max.end());
  }
  counts.push_back(stats.provenance.tokens);
  counts.push_back(stats.provenance.sequences);
  reduce_in_place(sums.data(), checked_count(sums.size()), MPI_DOUBLE, MPI_SUM, world);
  reduce_in_place(counts.data(), checked_count(counts.size()), MPI_UINT64_T, MPI_SUM, world);
  reduce_in_place(mins.data(), checked_count(mins.size()), MPI_DOUBLE, MPI_MIN, world);
  reduce_in_place(maxs.data(), checked_count(maxs.size()), MPI_DOUBLE, MPI_MAX, world);

  // Reservoirs: gather every rank's rows to rank 0, which keeps the smallest priorities.
  const std::vector<char> mine = serialize_reservoirs(stats.reservoirs);
  int my_bytes = checked_count(mine.size());
  std::vector<int> bytes(size_t(world.size), 0), offsets(size_t(world.size), 0);
  MPI_Gather(&my_bytes, 1, MPI_INT, bytes.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  std::vector<char> all;
  if (world.rank == 0) {
    size_t total = 0;
    for (int r = 0; r < world.size; ++r) {
      offsets[size_t(r)] = checked_count(total);
      total += size_t(bytes[size_t(r)]);
    }
    all.resize(total);
  }
  MPI_Gatherv(mine.data(), my_bytes, MPI_CHAR, all.data(), bytes.data(), offsets.data(), MPI_CHAR, 0, MPI_COMM_WORLD);
  if (world.rank != 0) return;

  size_t si = 0, ci = 0, mi = 0, xi = 0;
  for (HeadStats& h : stats.heads) {
    for (auto* m : {&h.query_m2, &h.output_m2, &h.p2_m2, &h.key_m2, &h.value_m2})
      for (double& v : *m) v = sums[si++];
    h.p2_weight = sums[si++];
    h.query_count = counts[ci++];
    h.output_count = counts[ci++];
    h.kv_count = counts[ci++];
    for (auto* v : {&h.key_min, &h.value_min})
      for (double& x : *v) x = mins[mi++];
    for (auto* v : {&h.key_max, &h.value_max})
      for (double& x : *v) x = maxs[xi++];
  }
  stats.provenance.tokens = counts[ci++];
  stats.provenance.sequences = counts[ci++];
  for (int r = 1; r < world.size; ++r) {
    const char* begin = all.data() + offsets[size_t(r)];
    merge_serialized_reservoirs(stats.reservoirs, begin, begin + bytes[size_t(r)]);
  }
#endif
}

}  // namespace kvcc
