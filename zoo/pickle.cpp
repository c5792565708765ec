#include "zoo/pickle.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <unordered_map>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "zoo/zip.h"

namespace kvcc {

// ---------------------------------------------------------------------------------------------
// PyValue

PyValue PyValue::from_bool(bool b) {
  PyValue v;
  v.kind = Kind::Bool;
  v.boolean = b;
  return v;
}
PyValue PyValue::from_int(int64_t i) {
  PyValue v;
  v.kind = Kind::Int;
  v.integer = i;
  return v;
}
PyValue PyValue::from_float(double f) {
  PyValue v;
  v.kind = Kind::Float;
  v.real = f;
  return v;
}
PyValue PyValue::from_string(std::string s) {
  PyValue v;
  v.kind = Kind::String;
  v.text = std::move(s);
  return v;
}
PyValue PyValue::list(std::vector<PyValue> items) {
  PyValue v;
  v.kind = Kind::List;
  v.items = std::move(items);
  return v;
}
PyValue PyValue::tuple(std::vector<PyValue> items) {
  PyValue v;
  v.kind = Kind::Tuple;
  v.items = std::move(items);
  return v;
}
PyValue PyValue::dict(std::vector<std::pair<PyValue, PyValue>> entries) {
  PyValue v;
  v.kind = Kind::Dict;
  v.entries = std::move(entries);
  return v;
}
PyValue PyValue::from_tensor(PyTensor t) {
  PyValue v;
  v.kind = Kind::Tensor;
  v.tensor = std::make_shared<PyTensor>(std::move(t));
  return v;
}

const PyValue* PyValue::get(std::string_view key) const {
  if (kind != Kind::Dict) return nullptr;
  for (const auto& [k, val] : entries)
    if (k.kind == Kind::String && k.text == key) return &val;
  return nullptr;
}

const PyValue* PyValue::get_int_key(int64_t key) const {
  if (kind != Kind::Dict) return nullptr;
  for (const auto& [k, val] : entries)
    if (k.kind == Kind::Int && k.integer == key) return &val;
  return nullptr;
}

const char* kind_name(PyValue::Kind k) {
  switch (k) {
    case PyValue::Kind::None:
      return "None";
    case PyValue::Kind::Bool:
      return "bool";
    case PyValue::Kind::Int:
      return "int";
    case PyValue::Kind::Float:
      return "float";
    case PyValue::Kind::String:
      return "str";
    case PyValue::Kind::List:
      return "list";
    case PyValue::Kind::Tuple:
      return "tuple";
    case PyValue::Kind::Dict:
      return "dict";
    case PyValue::Kind::Tensor:
      return "tensor";
  }
  return "?";
}

std::string PyValue::repr() const {
  switch (kind) {
    case Kind::None:
      return "None";
    case Kind::Bool:
      return boolean ? "True" : "False";
    case Kind::Int:
      return std::to_string(integer);
    case Kind::Float:
      return std::to_string(real);
    case Kind::String:
      return "'" + text + "'";
    case Kind::Tensor: {
      std::string s = "tensor[";
      for (size_t i = 0; i < tensor->shape.size(); ++i) s += (i ? "," : "") + std::to_string(tensor->shape[i]);
      return s + "]";
    }
    default:
      return std::string(kind_name(kind)) + " of " + std::to_string(kind == Kind::Dict ? entries.size() : items.size());
  }
}

namespace {

// ---------------------------------------------------------------------------------------------
// Opcodes

enum Op : uint8_t {
  MARK = '(',
  STOP = '.',
  POP = '0',
  POP_MARK = '1',
  DUP = '2',
  BININT = 'J',
  BININT1 = 'K',
  BININT2 = 'M',
  NONE = 'N',
  BINPERSID = 'Q',
  REDUCE = 'R',
  BINUNICODE = 'X',
  APPEND = 'a',
  GLOBAL = 'c',
  DICT = 'd',
  EMPTY_DICT = '}',
  APPENDS = 'e',
  BINGET = 'h',
  LONG_BINGET = 'j',
  LIST = 'l',
  EMPTY_LIST = ']',
  BINPUT = 'q',
  LONG_BINPUT = 'r',
  SETITEM = 's',
  TUPLE = 't',
  EMPTY_TUPLE = ')',
  SETITEMS = 'u',
  BINFLOAT = 'G',
  PROTO = 0x80,
  TUPLE1 = 0x85,
  TUPLE2 = 0x86,
  TUPLE3 = 0x87,
  NEWTRUE = 0x88,
  NEWFALSE = 0x89,
  LONG1 = 0x8a,
  SHORT_BINUNICODE = 0x8c,
  BINUNICODE8 = 0x8d,
  STACK_GLOBAL = 0x93,
  MEMOIZE = 0x94,
  FRAME = 0x95,
};

// Names of the opcodes outside the subset, so a refusal says which one it met.
const char* refused_opcode_name(uint8_t code) {
  static const std::map<uint8_t, const char*> names = {{'i', "INST"},         {'o', "OBJ"},
                                                       {0x81, "NEWOBJ"},      {0x92, "NEWOBJ_EX"},
                                                       {'b', "BUILD"},        {0x82, "EXT1"},
                                                       {0x83, "EXT2"},        {0x84, "EXT4"},
                                                       {'P', "PERSID"},       {'I', "INT"},
                                                       {'L', "LONG"},         {'F', "FLOAT"},
                                                       {'S', "STRING"},       {'V', "UNICODE"},
                                                       {'T', "BINSTRING"},    {'U', "SHORT_BINSTRING"},
                                                       {'B', "BINBYTES"},     {'C', "SHORT_BINBYTES"},
                                                       {0x8e, "BINBYTES8"},   {0x96, "BYTEARRAY8"},
                                                       {0x97, "NEXT_BUFFER"}, {0x98, "READONLY_BUFFER"},
                                                       {0x8f, "EMPTY_SET"},   {0x90, "ADDITEMS"},
                                                       {0x91, "FROZENSET"},   {0x8b, "LONG4"},
                                                       {'g', "GET"},          {'p', "PUT"}};
  auto it = names.find(code);
  return it == names.end() ? "unknown" : it->second;
}

constexpr const char* kAllowedGlobals[] = {"torch._utils._rebuild_tensor_v2", "torch.FloatStorage",
                                           "collections.OrderedDict"};

bool global_allowed(const std::string& dotted) {
  for (const char* g : kAllowedGlobals)
    if (dotted == g) return true;
  return false;
}

std::string hex_byte(uint8_t b) {
  const char* digits = "0123456789abcdef";
  return std::string("0x") + digits[b >> 4] + digits[b & 15];
}

struct Instr {
  uint8_t code;
  size_t pos;
  std::string_view arg;  // the raw argument bytes (strings: the text; GLOBAL: "module\nname")
};

uint64_t le(std::string_view s) {
  uint64_t v = 0;
  for (size_t i = s.size(); i-- > 0;) v = (v << 8) | uint8_t(s[i]);
  return v;
}

// Decodes the instruction at `pos`; refuses opcodes outside the subset.
Instr decode(std::string_view in, size_t pos, const std::string& label) {
  auto need = [&](size_t n) {
    KVCC_REQUIRE(pos + 1 <= in.size() && n <= in.size() - pos - 1,
                 label + ": truncated pickle (opcode at byte " + std::to_string(pos) + " runs past the end)");
  };
  need(0);
  const uint8_t code = uint8_t(in[pos]);
  auto fixed = [&](size_t n) {
    need(n);
    return Instr{code, pos, in.substr(pos + 1, n)};
  };
  auto counted = [&](size_t width) {
    need(width);
    const uint64_t n = le(in.substr(pos + 1, width));
    KVCC_REQUIRE(n <= in.size(),
                 label + ": truncated pickle (string at byte " + std::to_string(pos) + " runs past the end)");
    need(width + size_t(n));
    return Instr{code, pos, in.substr(pos + 1 + width, size_t(n))};
  };
  switch (code) {
    case MARK:
    case STOP:
    case POP:
    case POP_MARK:
    case DUP:
    case NONE:
    case BINPERSID:
    case REDUCE:
    case APPEND:
    case DICT:
    case EMPTY_DICT:
    case APPENDS:
    case LIST:
    case EMPTY_LIST:
    case SETITEM:
    case TUPLE:
    case EMPTY_TUPLE:
    case SETITEMS:
    case TUPLE1:
    case TUPLE2:
    case TUPLE3:
    case NEWTRUE:
    case NEWFALSE:
    case STACK_GLOBAL:
    case MEMOIZE:
      return fixed(0);
    case PROTO:
    case BININT1:
    case BINGET:
    case BINPUT:
      return fixed(1);
    case BININT2:
      return fixed(2);
    case BININT:
    case LONG_BINGET:
    case LONG_BINPUT:
      return fixed(4);
    case BINFLOAT:
    case FRAME:
      return fixed(8);
    case BINUNICODE:
      return counted(4);
    case SHORT_BINUNICODE:
      return counted(1);
    case BINUNICODE8:
      return counted(8);
    case LONG1:
      return counted(1);
    case GLOBAL: {
      const size_t a = in.find('\n', pos + 1);
      const size_t b = a == std::string_view::npos ? a : in.find('\n', a + 1);
      KVCC_REQUIRE(b != std::string_view::npos,
                   label + ": truncated pickle (GLOBAL at byte " + std::to_string(pos) + ")");
      return Instr{code, pos, in.substr(pos + 1, b - pos - 1)};
    }
    default:
      throw Error(label + ": pickle opcode " + refused_opcode_name(code) + " (" + hex_byte(code) + ") at byte " +
                  std::to_string(pos) + " is not supported; refused before anything was built");
  }
}

size_t instr_size(const Instr& ins) {
  switch (ins.code) {
    case BINUNICODE:
      return 1 + 4 + ins.arg.size();
    case SHORT_BINUNICODE:
    case LONG1:
      return 1 + 1 + ins.arg.size();
    case BINUNICODE8:
      return 1 + 8 + ins.arg.size();
    case GLOBAL:
      return 1 + ins.arg.size() + 1;
    default:
      return 1 + ins.arg.size();
  }
}

std::string global_dotted(std::string_view arg) {
  const size_t nl = arg.find('\n');
  return std::string(arg.substr(0, nl)) + "." + std::string(arg.substr(nl + 1));
}

void refuse_global(const std::string& dotted, const std::string& label) {
  std::string why = "only torch._utils._rebuild_tensor_v2, torch.FloatStorage and collections.OrderedDict are allowed";
  if (dotted.rfind("torch.", 0) == 0 && dotted.size() > 7 && dotted.find("Storage") != std::string::npos)
    why = "only float32 tensors (torch.FloatStorage) are supported";
  throw Error(label + ": pickle global '" + dotted + "' is not allowed (" + why +
              "); refused before anything was built");
}

// ---------------------------------------------------------------------------------------------
// Reader

struct Node;
using NodeP = std::shared_ptr<Node>;
struct Node {
  enum class K { None, Bool, Int, Float, String, List, Tuple, Dict, Tensor, Global, Storage } k = K::None;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // String; Global: "module.name"; Storage: key
  std::vector<NodeP> items;
  std::vector<std::pair<NodeP, NodeP>> dict;
  std::shared_ptr<PyTensor> tensor;
  std::shared_ptr<const std::string> storage;  // Storage: raw bytes
  int64_t numel = 0;                           // Storage: element count
};

const char* node_kind(Node::K k) {
  switch (k) {
    case Node::K::Global:
      return "global";
    case Node::K::Storage:
      return "storage";
    default:
      return kind_name(PyValue::Kind(int(k)));
  }
}

class Unpickler {
 public:
  Unpickler(std::string_view in, const StorageLoader& load, const std::string& label)
      : in_(in), load_(load), label_(label) {}
  // A hostile pickle can make a container hold itself (a shared_ptr cycle); emptying every node
  // the reader made breaks such cycles so nothing leaks.
  ~Unpickler() {
    for (auto& n : made_) {
      n->items.clear();
      n->dict.clear();
    }
  }
  Unpickler(const Unpickler&) = delete;
  Unpickler& operator=(const Unpickler&) = delete;

  PyValue run() {
    scan();
    return to_value(*execute(), 0);
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { throw Error(label_ + ": " + what); }

  NodeP make(Node::K k) {
    auto n = std::make_shared<Node>();
    n->k = k;
    made_.push_back(n);
    return n;
  }

  // Pass 1: every opcode must be in the subset and every GLOBAL allowed, before anything is built.
  void scan() {
    size_t pos = 0;
    while (true) {
      const Instr ins = decode(in_, pos, label_);
      if (ins.code == GLOBAL) {
        const std::string dotted = global_dotted(ins.arg);
        if (!global_allowed(dotted)) refuse_global(dotted, label_);
      }
      if (ins.code == PROTO && uint8_t(ins.arg[0]) > 5)
        fail("pickle protocol " + std::to_string(uint8_t(ins.arg[0])) + " is not supported");
      pos += instr_size(ins);
      if (ins.code == STOP) return;
    }
  }

  NodeP pop() {
    if (stack_.size() <= floor()) fail("malformed pickle (stack underflow)");
    NodeP n = stack_.back();
    stack_.pop_back();
    return n;
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  std::vector<NodeP> pop_to_mark() {
    if (marks_.empty()) fail("malformed pickle (no MARK)");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<NodeP> items(stack_.begin() + std::ptrdiff_t(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  NodeP& top() {
    if (stack_.size() <= floor()) fail("malformed pickle (stack underflow)");
    return stack_.back();
  }

  void set_item(Node& d, NodeP key, NodeP value) {
    if (d.k != Node::K::Dict) fail(std::string("malformed pickle (SETITEM on a ") + node_kind(d.k) + ")");
    if (key->k != Node::K::String && key->k != Node::K::Int)
      fail(std::string("unsupported dict key type ") + node_kind(key->k) + " (only str and int keys)");
    for (auto& [k, v] : d.dict) {
      if (k->k == key->k && (key->k == Node::K::String ? k->s == key->s : k->i == key->i)) {
        v = std::move(value);
        return;
      }
    }
    d.dict.emplace_back(std::move(key), std::move(value));
  }

  NodeP tuple_of(std::vector<NodeP> items) {
    auto t = make(Node::K::Tuple);
    t->items = std::move(items);
    return t;
  }

  NodeP execute() {
    size_t pos = 0;
    while (true) {
      const Instr ins = decode(in_, pos, label_);
      pos += instr_size(ins);
      switch (ins.code) {
        case PROTO:
        case FRAME:
          break;
        case MARK:
          marks_.push_back(stack_.size());
          break;
        case STOP: {
          NodeP result = pop();
          if (!stack_.empty() || !marks_.empty()) fail("malformed pickle (values left on the stack at STOP)");
          return result;
        }
        case POP:
          pop();
          break;
        case POP_MARK:
          pop_to_mark();
          break;
        case DUP:
          stack_.push_back(top());
          break;
        case NONE:
          stack_.push_back(make(Node::K::None));
          break;
        case NEWTRUE:
        case NEWFALSE: {
          auto n = make(Node::K::Bool);
          n->b = ins.code == NEWTRUE;
          stack_.push_back(n);
          break;
        }
        case BININT1:
        case BININT2:
        case BININT:
        case LONG1: {
          auto n = make(Node::K::Int);
          if (ins.code == BININT) {
            n->i = int32_t(uint32_t(le(ins.arg)));
          } else if (ins.code == LONG1) {
            if (ins.arg.size() > 8) fail("integer of " + std::to_string(ins.arg.size()) + " bytes is too large");
            uint64_t u = le(ins.arg);
            if (!ins.arg.empty() && ins.arg.size() < 8 && (uint8_t(ins.arg.back()) & 0x80))
              u |= ~uint64_t(0) << (8 * ins.arg.size());  // sign-extend
            n->i = int64_t(u);
          } else {
            n->i = int64_t(le(ins.arg));
          }
          stack_.push_back(n);
          break;
        }
        case BINFLOAT: {
          uint64_t bits = 0;
          for (char c : ins.arg) bits = (bits << 8) | uint8_t(c);  // big-endian
          auto n = make(Node::K::Float);
          std::memcpy(&n->f, &bits, 8);
          stack_.push_back(n);
          break;
        }
        case BINUNICODE:
        case SHORT_BINUNICODE:
        case BINUNICODE8: {
          auto n = make(Node::K::String);
          n->s = std::string(ins.arg);
          stack_.push_back(n);
          break;
        }
        case EMPTY_DICT:
          stack_.push_back(make(Node::K::Dict));
          break;
        case EMPTY_LIST:
          stack_.push_back(make(Node::K::List));
          break;
        case EMPTY_TUPLE:
          stack_.push_back(make(Node::K::Tuple));
          break;
        case TUPLE:
          stack_.push_back(tuple_of(pop_to_mark()));
          break;
        case TUPLE1:
        case TUPLE2:
        case TUPLE3: {
          const size_t n = size_t(ins.code - TUPLE1 + 1);
          std::vector<NodeP> items(n);
          for (size_t i = n; i-- > 0;) items[i] = pop();
          stack_.push_back(tuple_of(std::move(items)));
          break;
        }
        case LIST: {
          auto l = make(Node::K::List);
          l->items = pop_to_mark();
          stack_.push_back(l);
          break;
        }
        case DICT: {
          auto items = pop_to_mark();
          if (items.size() % 2) fail("malformed pickle (DICT with an odd number of items)");
          auto d = make(Node::K::Dict);
          for (size_t i = 0; i < items.size(); i += 2) set_item(*d, items[i], items[i + 1]);
          stack_.push_back(d);
          break;
        }
        case APPEND: {
          NodeP v = pop();
          NodeP& l = top();
          if (l->k != Node::K::List) fail("malformed pickle (APPEND to a non-list)");
          l->items.push_back(std::move(v));
          break;
        }
        case APPENDS: {
          auto items = pop_to_mark();
          NodeP& l = top();
          if (l->k != Node::K::List) fail("malformed pickle (APPENDS to a non-list)");
          for (auto& v : items) l->items.push_back(std::move(v));
          break;
        }
        case SETITEM: {
          NodeP v = pop();
          NodeP k = pop();
          set_item(*top(), std::move(k), std::move(v));
          break;
        }
        case SETITEMS: {
          auto items = pop_to_mark();
          if (items.size() % 2) fail("malformed pickle (SETITEMS with an odd number of items)");
          NodeP& d = top();
          for (size_t i = 0; i < items.size(); i += 2) set_item(*d, items[i], items[i + 1]);
          break;
        }
        case BINPUT:
        case LONG_BINPUT:
          memo_[uint32_t(le(ins.arg))] = top();
          break;
        case MEMOIZE:
          memo_[uint32_t(memo_.size())] = top();
          break;
        case BINGET:
        case LONG_BINGET: {
          auto it = memo_.find(uint32_t(le(ins.arg)));
          if (it == memo_.end()) fail("malformed pickle (memo key " + std::to_string(le(ins.arg)) + " not set)");
          stack_.push_back(it->second);
          break;
        }
        case GLOBAL: {
          auto g = make(Node::K::Global);
          g->s = global_dotted(ins.arg);
          stack_.push_back(g);
          break;
        }
        case STACK_GLOBAL: {
          NodeP name = pop(), module = pop();
          if (name->k != Node::K::String || module->k != Node::K::String)
            fail("malformed pickle (STACK_GLOBAL of non-strings)");
          auto g = make(Node::K::Global);
          g->s = module->s + "." + name->s;
          if (!global_allowed(g->s)) refuse_global(g->s, label_);
          stack_.push_back(g);
          break;
        }
        case BINPERSID:
          stack_.push_back(persistent_load(*pop()));
          break;
        case REDUCE: {
          NodeP args = pop();
          NodeP fn = pop();
          stack_.push_back(reduce(*fn, *args));
          break;
        }
        default:
          fail("internal: unhandled opcode " + hex_byte(ins.code));
      }
    }
  }

  // ('storage', torch.FloatStorage, key, location, numel)
  NodeP persistent_load(const Node& pid) {
    const bool shape_ok = pid.k == Node::K::Tuple && pid.items.size() == 5 && pid.items[0]->k == Node::K::String &&
                          pid.items[0]->s == "storage" && pid.items[1]->k == Node::K::Global &&
                          pid.items[2]->k == Node::K::String && pid.items[4]->k == Node::K::Int;
    if (!shape_ok) fail("unsupported persistent id (expected ('storage', torch.FloatStorage, key, location, numel))");
    if (pid.items[1]->s != "torch.FloatStorage") refuse_global(pid.items[1]->s, label_);
    const std::string& key = pid.items[2]->s;
    const int64_t numel = pid.items[4]->i;
    if (numel < 0) fail("storage '" + key + "' has a negative size");
    auto it = storages_.find(key);
    if (it == storages_.end()) {
      auto bytes = std::make_shared<const std::string>(load_(key));
      it = storages_.emplace(key, bytes).first;
    }
    if (uint64_t(it->second->size()) < uint64_t(numel) * 4)
      fail("storage '" + key + "' holds " + std::to_string(it->second->size()) + " bytes, fewer than " +
           std::to_string(numel) + " float32 values need (truncated?)");
    auto s = make(Node::K::Storage);
    s->s = key;
    s->storage = it->second;
    s->numel = numel;
    return s;
  }

  std::vector<int64_t> int_tuple(const Node& n, const char* what) {
    if (n.k != Node::K::Tuple) fail(std::string("tensor ") + what + " is not a tuple");
    std::vector<int64_t> v;
    for (const auto& x : n.items) {
      if (x->k != Node::K::Int || x->i < 0)
        fail(std::string("tensor ") + what + " holds a non-integer or negative entry");
      v.push_back(x->i);
    }
    return v;
  }

  NodeP reduce(const Node& fn, const Node& args) {
    if (fn.k != Node::K::Global) fail(std::string("malformed pickle (REDUCE of a ") + node_kind(fn.k) + ")");
    if (args.k != Node::K::Tuple) fail("malformed pickle (REDUCE arguments are not a tuple)");
    if (fn.s == "collections.OrderedDict") {
      if (!args.items.empty()) fail("collections.OrderedDict with arguments is not supported");
      return make(Node::K::Dict);
    }
    if (fn.s != "torch._utils._rebuild_tensor_v2") fail("calling " + fn.s + " is not supported");
    // (storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata])
    const auto& a = args.items;
    if (a.size() != 6 && a.size() != 7) fail("_rebuild_tensor_v2 with " + std::to_string(a.size()) + " arguments");
    if (a[0]->k != Node::K::Storage) fail("_rebuild_tensor_v2 without a storage");
    if (a[1]->k != Node::K::Int || a[1]->i < 0) fail("tensor storage offset is not a non-negative int");
    const auto shape = int_tuple(*a[2], "size");
    const auto stride = int_tuple(*a[3], "stride");
    if (shape.size() != stride.size()) fail("tensor size and stride differ in length");
    if (a[4]->k != Node::K::Bool) fail("tensor requires_grad is not a bool");
    if (a[5]->k != Node::K::Dict || !a[5]->dict.empty()) fail("tensors with backward hooks are not supported");
    if (a.size() == 7 && !(a[6]->k == Node::K::None || (a[6]->k == Node::K::Dict && a[6]->dict.empty())))
      fail("tensors with python attributes (metadata) are not supported");
    const Node& storage = *a[0];
    // Stride-0 views (torch's expand) may legitimately hold more elements than their storage, so
    // the element count is bounded separately (2^31 floats = 8 GiB) from the storage extent.
    uint64_t numel = 1, last = uint64_t(a[1]->i);
    for (size_t i = 0; i < shape.size(); ++i) {
      if (shape[i] > (int64_t(1) << 31) || stride[i] > (int64_t(1) << 40)) fail("tensor dimension too large");
      numel *= uint64_t(shape[i]);
      if (numel > (uint64_t(1) << 31)) fail("tensor of more than 2^31 elements is not supported");
      if (shape[i] > 0) last += uint64_t(shape[i] - 1) * uint64_t(stride[i]);
    }
    if (numel > 0 && last >= uint64_t(storage.numel))
      fail("tensor of shape " + std::to_string(shape.size()) + "-D reads past its storage '" + storage.s + "' (" +
           std::to_string(storage.numel) + " elements)");
    PyTensor t;
    t.shape = shape;
    t.data.resize(size_t(numel));
    const char* base = storage.storage->data();
    std::vector<int64_t> index(shape.size(), 0);
    for (size_t e = 0; e < numel; ++e) {
      uint64_t off = uint64_t(a[1]->i);
      for (size_t d = 0; d < shape.size(); ++d) off += uint64_t(index[d]) * uint64_t(stride[d]);
      std::memcpy(&t.data[e], base + off * 4, 4);  // little-endian storage on a little-endian host
      for (size_t d = shape.size(); d-- > 0;) {
        if (++index[d] < shape[d]) break;
        index[d] = 0;
      }
    }
    auto n = make(Node::K::Tensor);
    n->tensor = std::make_shared<PyTensor>(std::move(t));
    return n;
  }

  // The value is a tree, the pickle a graph: a memo entry fetched twice is copied twice, so a few
  // bytes of gets can stand for 2^64 values. What the tree may hold is bounded by the input size.
  PyValue to_value(const Node& n, int depth) {
    if (depth > 64) fail("pickle nests deeper than 64 levels (or refers to itself)");
    values_left_ -= 1 + int64_t(n.s.size()) / 16;
    if (values_left_ < 0)
      fail("pickle expands to more than " + std::to_string(value_budget()) + " values (" + std::to_string(in_.size()) +
           " bytes that share memo entries over and over)");
    PyValue v;
    switch (n.k) {
      case Node::K::None:
        return v;
      case Node::K::Bool:
        return PyValue::from_bool(n.b);
      case Node::K::Int:
        return PyValue::from_int(n.i);
      case Node::K::Float:
        return PyValue::from_float(n.f);
      case Node::K::String:
        return PyValue::from_string(n.s);
      case Node::K::List:
      case Node::K::Tuple: {
        std::vector<PyValue> items;
        for (const auto& x : n.items) items.push_back(to_value(*x, depth + 1));
        return n.k == Node::K::List ? PyValue::list(std::move(items)) : PyValue::tuple(std::move(items));
      }
      case Node::K::Dict: {
        std::vector<std::pair<PyValue, PyValue>> entries;
        for (const auto& [k, x] : n.dict) entries.emplace_back(to_value(*k, depth + 1), to_value(*x, depth + 1));
        return PyValue::dict(std::move(entries));
      }
      case Node::K::Tensor:
        v.kind = PyValue::Kind::Tensor;
        v.tensor = n.tensor;
        return v;
      case Node::K::Global:
        fail("a bare global (" + n.s + ") is not a supported value");
      case Node::K::Storage:
        fail("a bare storage is not a supported value");
    }
    return v;
  }

  int64_t value_budget() const { return 16 * int64_t(in_.size()) + 65536; }

  std::string_view in_;
  int64_t values_left_ = value_budget();
  const StorageLoader& load_;
  const std::string& label_;
  std::vector<NodeP> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint32_t, NodeP> memo_;
  std::map<std::string, std::shared_ptr<const std::string>> storages_;
  std::vector<NodeP> made_;
};

// ---------------------------------------------------------------------------------------------
// Writer (protocol 2)

void put_le(std::string& out, uint64_t v, int width) {
  for (int i = 0; i < width; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
}

class Pickler {
 public:
  explicit Pickler(std::vector<std::string>& storages) : storages_(storages) {}

  std::string dumps(const PyValue& v) {
    out_.push_back(char(PROTO));
    out_.push_back(2);
    write(v);
    out_.push_back(char(STOP));
    return std::move(out_);
  }

 private:
  void write_int(int64_t i) {
    if (i >= 0 && i < 256) {
      out_.push_back(char(BININT1));
      put_le(out_, uint64_t(i), 1);
    } else if (i >= 0 && i < 65536) {
      out_.push_back(char(BININT2));
      put_le(out_, uint64_t(i), 2);
    } else if (i >= std::numeric_limits<int32_t>::min() && i <= std::numeric_limits<int32_t>::max()) {
      out_.push_back(char(BININT));
      put_le(out_, uint64_t(uint32_t(int32_t(i))), 4);
    } else {
      out_.push_back(char(LONG1));
      out_.push_back(8);
      put_le(out_, uint64_t(i), 8);
    }
  }
  void write_string(const std::string& s) {
    out_.push_back(char(BINUNICODE));
    put_le(out_, s.size(), 4);
    out_ += s;
  }
  void write_global(const char* module, const char* name) {
    out_.push_back(char(GLOBAL));
    out_ += module;
    out_.push_back('\n');
    out_ += name;
    out_.push_back('\n');
  }
  void write_int_tuple(const std::vector<int64_t>& v) {
    if (v.empty()) {
      out_.push_back(char(EMPTY_TUPLE));
      return;
    }
    out_.push_back(char(MARK));
    for (int64_t x : v) write_int(x);
    out_.push_back(char(TUPLE));
  }

  void write(const PyValue& v) {
    switch (v.kind) {
      case PyValue::Kind::None:
        out_.push_back(char(NONE));
        break;
      case PyValue::Kind::Bool:
        out_.push_back(char(v.boolean ? NEWTRUE : NEWFALSE));
        break;
      case PyValue::Kind::Int:
        write_int(v.integer);
        break;
      case PyValue::Kind::Float: {
        uint64_t bits;
        std::memcpy(&bits, &v.real, 8);
        out_.push_back(char(BINFLOAT));
        for (int i = 7; i >= 0; --i) out_.push_back(char((bits >> (8 * i)) & 0xff));
        break;
      }
      case PyValue::Kind::String:
        write_string(v.text);
        break;
      case PyValue::Kind::List:
        out_.push_back(char(EMPTY_LIST));
        if (!v.items.empty()) {
          out_.push_back(char(MARK));
          for (const auto& x : v.items) write(x);
          out_.push_back(char(APPENDS));
        }
        break;
      case PyValue::Kind::Tuple:
        if (v.items.empty()) {
          out_.push_back(char(EMPTY_TUPLE));
          break;
        }
        out_.push_back(char(MARK));
        for (const auto& x : v.items) write(x);
        out_.push_back(char(TUPLE));
        break;
      case PyValue::Kind::Dict:
        out_.push_back(char(EMPTY_DICT));
        if (!v.entries.empty()) {
          out_.push_back(char(MARK));
          for (const auto& [k, x] : v.entries) {
            KVCC_REQUIRE(k.kind == PyValue::Kind::String || k.kind == PyValue::Kind::Int,
                         "pickle writer: dict keys must be str or int");
            write(k);
            write(x);
          }
          out_.push_back(char(SETITEMS));
        }
        break;
      case PyValue::Kind::Tensor:
        write_tensor(*v.tensor);
        break;
    }
  }

  void write_tensor(const PyTensor& t) {
    uint64_t numel = 1;
    for (int64_t s : t.shape) {
      KVCC_REQUIRE(s >= 0, "pickle writer: negative tensor dimension");
      numel *= uint64_t(s);
    }
    KVCC_REQUIRE(numel == t.data.size(), "pickle writer: tensor data does not match its shape");
    std::vector<int64_t> stride(t.shape.size(), 1);
    for (size_t d = t.shape.size(); d-- > 1;) stride[d - 1] = stride[d] * std::max<int64_t>(t.shape[d], 1);
    const std::string key = std::to_string(storages_.size());
    storages_.emplace_back(reinterpret_cast<const char*>(t.data.data()), t.data.size() * 4);

    write_global("torch._utils", "_rebuild_tensor_v2");
    out_.push_back(char(MARK));
    out_.push_back(char(MARK));  // persistent id ('storage', torch.FloatStorage, key, 'cpu', numel)
    write_string("storage");
    write_global("torch", "FloatStorage");
    write_string(key);
    write_string("cpu");
    write_int(int64_t(numel));
    out_.push_back(char(TUPLE));
    out_.push_back(char(BINPERSID));
    write_int(0);  // storage offset
    write_int_tuple(t.shape);
    write_int_tuple(stride);
    out_.push_back(char(NEWFALSE));  // requires_grad
    write_global("collections", "OrderedDict");
    out_.push_back(char(EMPTY_TUPLE));
    out_.push_back(char(REDUCE));  // backward_hooks = OrderedDict()
    out_.push_back(char(TUPLE));
    out_.push_back(char(REDUCE));
  }

  std::vector<std::string>& storages_;
  std::string out_;
};

}  // namespace

PyValue unpickle(std::string_view bytes, const StorageLoader& load, const std::string& label) {
  return Unpickler(bytes, load, label).run();
}

std::string pickle_dumps(const PyValue& value, std::vector<std::string>& storages) {
  return Pickler(storages).dumps(value);
}

PyValue torch_load_bytes(std::string bytes, const std::string& label) {
  const ZipReader zip = ZipReader::from_bytes(std::move(bytes), label);
  // torch.save puts everything under one folder ("<stem>/data.pkl"); find it.
  std::string prefix;
  int found = 0;
  for (const auto& e : zip.entries()) {
    const size_t slash = e.name.find('/');
    if (slash != std::string::npos && e.name.compare(slash, std::string::npos, "/data.pkl") == 0) {
      prefix = e.name.substr(0, slash + 1);
      ++found;
    }
  }
  KVCC_REQUIRE(found == 1, label + ": not a torch.save archive (" +
                               (found == 0 ? std::string("no <name>/data.pkl entry") : "several data.pkl entries") +
                               ")");
  if (const ZipEntry* order = zip.find(prefix + "byteorder")) {
    const std::string bo = zip.read(*order);
    KVCC_REQUIRE(bo == "little", label + ": byte order '" + bo + "' is not supported (only little-endian)");
  }
  const std::string pkl = zip.read(prefix + "data.pkl");
  const StorageLoader load = [&](const std::string& key) {
    const ZipEntry* e = zip.find(prefix + "data/" + key);
    KVCC_REQUIRE(e != nullptr, label + ": storage '" + key + "' is missing from the archive");
    return zip.read(*e);
  };
  return unpickle(pkl, load, label);
}

PyValue torch_load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KVCC_REQUIRE(bool(in), "cannot open " + path);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  KVCC_REQUIRE(!in.bad(), "cannot read " + path);
  return torch_load_bytes(std::move(bytes), path);
}

std::string torch_save_bytes(const PyValue& value, const std::string& archive_name) {
  KVCC_REQUIRE(!archive_name.empty() && archive_name.find('/') == std::string::npos,
               "torch archive name must be a plain name");
  std::vector<std::string> storages;
  const std::string pkl = pickle_dumps(value, storages);
  const std::string p = archive_name + "/";
  ZipWriter zip(64);
  zip.add(p + "data.pkl", pkl);
  zip.add(p + ".format_version", "1");
  zip.add(p + ".storage_alignment", "64");
  zip.add(p + "byteorder", "little");
  for (size_t i = 0; i < storages.size(); ++i) zip.add(p + "data/" + std::to_string(i), storages[i]);
  zip.add(p + "version", "3\n");
  // torch records a 40-digit serialization id; ours is derived from the content (reproducible).
  std::string id;
  uint32_t h = crc32(pkl.data(), pkl.size());
  while (id.size() < 40) {
    h = crc32(&h, sizeof h, h);
    id += std::to_string(h % 10);
  }
  zip.add(p + ".data/serialization_id", id);
  return zip.finish();
}

void torch_save(const PyValue& value, const std::string& path, const std::string& archive_name) {
  write_bytes_atomically(path, torch_save_bytes(value, archive_name));
}

}  // namespace kvcc
