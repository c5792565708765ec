// A small, safe reader and writer for the pickle subset that torch.save uses for plain data:
// dicts (and collections.OrderedDict), lists, tuples, ints, floats, strings, bools, None and
// float32 tensors (torch._utils._rebuild_tensor_v2 over persistent-id storages, torch.FloatStorage).
//
// Safety: nothing is ever executed. The reader first scans every opcode: an opcode outside the
// subset or a GLOBAL outside the allow-list is refused with an Error naming it before any value is
// built; "calls" (REDUCE) of the three allowed globals only build values. The writer emits
// protocol 2 that torch.load(..., weights_only=True) accepts.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvcc {

struct PyTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;  // contiguous, row-major
};

struct PyValue {
  enum class Kind { None, Bool, Int, Float, String, List, Tuple, Dict, Tensor };
  Kind kind = Kind::None;
  bool boolean = false;
  int64_t integer = 0;
  double real = 0;
  std::string text;
  std::vector<PyValue> items;                        // List, Tuple
  std::vector<std::pair<PyValue, PyValue>> entries;  // Dict, insertion order
  std::shared_ptr<PyTensor> tensor;

  static PyValue none() { return {}; }
  static PyValue from_bool(bool b);
  static PyValue from_int(int64_t i);
  static PyValue from_float(double f);
  static PyValue from_string(std::string s);
  static PyValue list(std::vector<PyValue> items);
  static PyValue tuple(std::vector<PyValue> items);
  static PyValue dict(std::vector<std::pair<PyValue, PyValue>> entries = {});
  static PyValue from_tensor(PyTensor t);

  bool is(Kind k) const { return kind == k; }
  // Dict lookup by string or integer key; nullptr when absent (or not a dict).
  const PyValue* get(std::string_view key) const;
  const PyValue* get_int_key(int64_t key) const;
  std::string repr() const;  // short, for error messages
};

const char* kind_name(PyValue::Kind k);

// Resolves a persistent-id storage: returns the raw bytes stored under `key`.
using StorageLoader = std::function<std::string(const std::string& key)>;

// Reads one pickle. `label` names the source in errors. Storages are loaded through `load`.
PyValue unpickle(std::string_view bytes, const StorageLoader& load, const std::string& label);

// Writes `value` as protocol 2; every tensor's float32 bytes are appended to `storages` and
// referenced by its index as the persistent-id key ("0", "1", ...).
std::string pickle_dumps(const PyValue& value, std::vector<std::string>& storages);

// torch.save zip archives: "<archive>/data.pkl" + "<archive>/data/<key>" storages.
PyValue torch_load(const std::string& path);
// Writes atomically; `archive_name` is the folder inside the zip (torch uses the file's stem).
void torch_save(const PyValue& value, const std::string& path, const std::string& archive_name);
// The archive bytes torch_save writes (for tests that corrupt them).
std::string torch_save_bytes(const PyValue& value, const std::string& archive_name);
PyValue torch_load_bytes(std::string bytes, const std::string& label);

}  // namespace kvcc
