// The GPU layer loop's stand-in for builds without CUDA: the driver asks gpu_calibration_built()
// first and refuses --device gpu by name, so the runner's members are never reached.
#include "calibrate/gpu_layers.h"
#include "formats/error.h"

namespace kvcc {

bool gpu_calibration_built() { return false; }

struct GpuLayerRunner::Impl {};

GpuLayerRunner::GpuLayerRunner(const ModelConfig&, const std::vector<float>&, int, int) {
  throw Error("--device gpu: this kvcc was built without CUDA (rebuild where nvcc is installed)");
}
GpuLayerRunner::~GpuLayerRunner() = default;
void GpuLayerRunner::run_layer(int, const LayerTensors&, const std::vector<GpuSequence>&, bool, ReservoirSampler&,
                               const std::function<void(uint64_t)>&) {}
std::vector<HeadStats> GpuLayerRunner::head_stats() const { return {}; }
double GpuLayerRunner::stats_seconds() const { return 0.0; }
std::string GpuLayerRunner::device_name() const { return {}; }

}  // namespace kvcc
