// kvcc merge-stats: sum calibration statistics of the same model (shards of one calibration run,
// or runs over different text) into one stats file.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/h5_common.h"
#include "formats/stats.h"

namespace kvcc::cli {
namespace {

Command reg{
    "merge-stats", 25, "Merge calibration stats files of one model by summation",
    [](CLI::App& app) -> std::function<int()> {
      auto inputs = std::make_shared<std::vector<std::string>>();
      auto output = std::make_shared<std::string>();
      app.add_option("INPUTS", *inputs, "Two or more stats files of the same model")->required()->expected(2, -1);
      app.add_option("-o,--output", *output, "Merged stats file to write (HDF5)")->required();
      app.footer(
          "Sums, counts and token totals add, per-channel ranges widen, and each reservoir keeps the\n"
          "smallest sampling priorities of the union (so shards merged equal one run over all the\n"
          "documents). Refuses files of different models, naming what differs. The output is written\n"
          "to a temporary file and renamed, so a failure leaves nothing behind; an output that names an\n"
          "input is refused.\n\n"
          "Example:\n"
          "  kvcc calibrate-model --model M --data text.txt --shard 0/2 -o s0.h5\n"
          "  kvcc calibrate-model --model M --data text.txt --shard 1/2 -o s1.h5\n"
          "  kvcc merge-stats s0.h5 s1.h5 -o stats.h5");
      return [inputs, output]() {
        require_output_is_not_input(*output, *inputs);
        const size_t n = inputs->size();
        // Progress per file on a terminal; in scripts stderr stays for the one-line error.
        const bool progress = stderr_is_tty();
        Stats merged = read_stats(inputs->front());
        if (progress)
          std::fprintf(stderr, "kvcc merge-stats: [1/%zu] %s: %llu tokens\n", n, inputs->front().c_str(),
                       static_cast<unsigned long long>(merged.provenance.tokens));
        for (size_t i = 1; i < n; ++i) {
          const std::string& path = (*inputs)[i];
          const Stats next = read_stats(path);
          try {
            merge_stats(merged, next);
          } catch (const Error& e) {
            throw Error(inputs->front() + " vs " + path + ": " + e.what());
          }
          if (progress)
            std::fprintf(stderr, "kvcc merge-stats: [%zu/%zu] %s: %llu tokens\n", i + 1, n, path.c_str(),
                         static_cast<unsigned long long>(next.provenance.tokens));
        }
        merged.producer = h5::default_producer();
        merged.created = h5::utc_now_iso8601();
        merged.command = h5::process_command_line();
        write_stats(merged, *output);
        std::printf("wrote %s: %llu tokens in %llu sequences from %zu files\n", output->c_str(),
                    static_cast<unsigned long long>(merged.provenance.tokens),
                    static_cast<unsigned long long>(merged.provenance.sequences), n);
        return 0;
      };
    }};

}  // namespace
}  // namespace kvcc::cli
