// libFuzzer target: a zoo's index.json (zoo list / show / verify / find / publish read it). The
// input is the index of a scratch zoo directory holding nothing else, so verify_zoo reports the
// listed files missing (or, for paths that escape the directory, must refuse them).
#include "fuzz_common.h"
#include "zoo/zoo.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcc;
  if (fuzz::write_input_as(zoo::kIndexName, data, size).empty()) return 0;
  fuzz::attempt([&] {
    const zoo::Index index = zoo::read_index(fuzz::scratch_dir());
    for (const zoo::ZooEntry& entry : index.entries) {
      fuzz::attempt([&] { zoo::entry_from_json(zoo::entry_to_json(entry)); });
      fuzz::attempt([&] { zoo::render_model_card(entry); });
      fuzz::attempt([&] { zoo::model_card_path(entry); });
      fuzz::attempt([&] { zoo::resolve_entry(index, entry.id); });
      fuzz::attempt([&] { zoo::find_for_fingerprint(index, entry.fingerprint); });
    }
    fuzz::attempt([&] { zoo::resolve_entry(index, "tinystories"); });
  });
  fuzz::attempt([&] { zoo::verify_zoo(fuzz::scratch_dir()); });
  return 0;
}
