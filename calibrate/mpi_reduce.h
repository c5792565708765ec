// MPI scale-out of calibration: under `mpirun -n N kvcc calibrate-model ...` each rank runs the
// documents with index % N == rank and the statistics are reduced to rank 0 (sums, counts, ranges,
// reservoirs), which writes the file. Without MPI (or not launched by mpirun) everything here is a
// one-process no-op, so the driver has one code path.
#pragma once
#include "formats/stats.h"

namespace kvcc {

struct MpiWorld {
  bool active = false;  // MPI was initialised by us (launched by mpirun)
  int rank = 0;
  int size = 1;
};

// Initialises MPI when the process was launched by Open MPI's mpirun (OMPI_COMM_WORLD_SIZE is set)
// and kvcc was built with MPI; finalises on destruction. Throws Error when launched by mpirun with
// several ranks but built without MPI (every rank would otherwise compute and write everything).
class MpiSession {
 public:
  MpiSession();
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  const MpiWorld& world() const { return world_; }

 private:
  MpiWorld world_;
};

// True on every rank when `failed` is true on any rank (so all ranks stop together instead of
// waiting forever in a collective for a rank that threw).
bool mpi_any_failed(const MpiWorld& world, bool failed);

// Sums every rank's statistics into rank 0's `stats` (sums and counts add, ranges widen,
// reservoirs merge by priority; provenance tokens and sequences add). Other ranks' `stats` are
// left as they were. A no-op for a world of one.
void mpi_reduce_stats(Stats& stats, const MpiWorld& world);

}  // namespace kvcc
