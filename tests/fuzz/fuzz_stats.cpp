// libFuzzer target: the stats readers (kvcc compile / verify / inspect / merge-stats).
#include "formats/h5_common.h"
#include "formats/stats.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcc;
  if (!fuzz::write_input(data, size)) return 0;
  const std::string& path = fuzz::scratch_path();
  fuzz::attempt([&] { h5::detect_format(path); });
  fuzz::attempt([&] { verify_stats_file(path); });
  fuzz::attempt([&] { read_stats(path); });
  fuzz::attempt([&] { read_stats_summary(path); });
  return 0;
}
