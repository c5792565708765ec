// The ZIP reader/writer, the safe pickle reader/writer and the OSCAR .pt reader/writer, checked
// against bytes made by independent implementations (CPython's pickle, PyTorch's torch.save,
// tests/reference/make_oscar_refs.py) and against identities (round trips, CRC check values).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <unistd.h>

#include "formats/error.h"
#include "zoo/oscar_pt.h"
#include "zoo/pickle.h"
#include "formats/sha256.h"
#include "zoo/zip.h"
#include <nlohmann/json.hpp>

namespace fs = std::filesystem;
using namespace kvcc;

namespace {

const std::string kData = std::string(KVCC_SOURCE_DIR) + "/tests/data/oscar";

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(char(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

const StorageLoader kNoStorage = [](const std::string& key) -> std::string {
  ADD_FAILURE() << "storage " << key << " loaded";
  return {};
};

std::string float_sha(const std::vector<float>& v) { return sha256_hex(v.data(), v.size() * sizeof(float)); }

fs::path temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("kvcc_test_oscar_pt_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// Byte offsets of the method field in the first local header and in the first central entry.
void set_method(std::string& zip, uint16_t method) {
  zip[8] = char(method & 0xff);
  zip[9] = char(method >> 8);
  const size_t cd = zip.find(std::string("PK\x01\x02", 4));
  ASSERT_NE(cd, std::string::npos);
  zip[cd + 10] = char(method & 0xff);
  zip[cd + 11] = char(method >> 8);
}

}  // namespace

TEST(Zip, Crc32CheckValue) {
  // The CRC-32/ISO-HDLC check value of "123456789".
  EXPECT_EQ(crc32("123456789", 9), 0xCBF43926u);
  // Streaming equals one shot.
  EXPECT_EQ(crc32("6789", 4, crc32("12345", 5)), 0xCBF43926u);
}

TEST(Zip, RoundTripAlignedAndZip64) {
  for (bool zip64 : {false, true}) {
    ZipWriter w(64, zip64);
    w.add("a/data.pkl", "hello");
    w.add("a/data/0", std::string(1000, '\x7f'));
    w.add("a/empty", "");
    const std::string bytes = w.finish();
    const ZipReader r = ZipReader::from_bytes(bytes, "mem");
    ASSERT_EQ(r.entries().size(), 3u);
    EXPECT_EQ(r.read("a/data.pkl"), "hello");
    EXPECT_EQ(r.read("a/data/0"), std::string(1000, '\x7f'));
    EXPECT_EQ(r.read("a/empty"), "");
    for (const auto& e : r.entries()) EXPECT_EQ(e.data_offset % 64, 0u) << e.name;
    // zip64 end records are present exactly when asked for (or needed).
    EXPECT_EQ(bytes.find(std::string("PK\x06\x06", 4)) != std::string::npos, zip64);
  }
}

TEST(Zip, ReadsTorchArchiveWithDataDescriptorsAndZip64End) {
  // Written by torch.save (PyTorch 2.x): local headers carry data descriptors and "FB" padding,
  // the archive ends with zip64 records.
  const ZipReader r = ZipReader::open(kData + "/strided.pt");
  ASSERT_NE(r.find("strided/data.pkl"), nullptr);
  EXPECT_EQ(r.read("strided/byteorder"), "little");
  for (const auto& e : r.entries()) {
    if (e.name.find("/data/") != std::string::npos) {
      EXPECT_EQ(e.data_offset % 64, 0u) << e.name;
    }
  }
}

TEST(Zip, CorruptionRefused) {
  ZipWriter w;
  w.add("x/data.pkl", "payload-bytes");
  std::string bytes = w.finish();
  const ZipReader good = ZipReader::from_bytes(bytes, "good");
  const uint64_t at = good.find("x/data.pkl")->data_offset;
  bytes[size_t(at) + 3] ^= 0x20;
  const ZipReader bad = ZipReader::from_bytes(bytes, "bad.pt");
  try {
    bad.read("x/data.pkl");
    FAIL() << "CRC corruption not detected";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CRC-32 mismatch"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bad.pt"), std::string::npos) << e.what();
  }
}

TEST(Zip, CompressedTruncatedAndNonZipRefused) {
  ZipWriter w;
  w.add("x/data.pkl", "payload");
  const std::string bytes = w.finish();
  std::string deflated = bytes;
  set_method(deflated, 8);
  try {
    ZipReader::from_bytes(deflated, "d.zip");
    FAIL() << "deflate accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("deflate"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ZipReader::from_bytes(bytes.substr(0, bytes.size() - 5), "t.zip"), Error);
  EXPECT_THROW(ZipReader::from_bytes(bytes.substr(10), "t.zip"), Error);
  EXPECT_THROW(ZipReader::from_bytes("not a zip at all, just text that is long enough", "n.zip"), Error);
  EXPECT_THROW(ZipReader::open("/nonexistent/kvcc.pt"), Error);
}

TEST(Pickle, ReadsCPythonProtocol2And4) {
  // pickle.dumps({'a': [1, 2.5, 'x', True, None], 'b': (-3, 2**40, -(2**40)), 'c': {7: 'seven'}}, protocol=p)
  const char* hex[] = {
      "80027d71002858010000006171015d7102284b014740040000000000005801000000787103884e6558010000006271044afdffffff8a06"
      "0000000000018a060000000000ff87710558010000006371067d71074b075805000000736576656e710873752e",
      "8004954a000000000000007d94288c0161945d94284b014740040000000000008c017894884e658c0162944afdffffff8a060000000000"
      "018a060000000000ff87948c0163947d944b078c05736576656e9473752e"};
  for (const char* h : hex) {
    const PyValue v = unpickle(from_hex(h), kNoStorage, "cpython");
    ASSERT_TRUE(v.is(PyValue::Kind::Dict));
    const PyValue* a = v.get("a");
    ASSERT_TRUE(a && a->is(PyValue::Kind::List) && a->items.size() == 5);
    EXPECT_EQ(a->items[0].integer, 1);
    EXPECT_EQ(a->items[1].real, 2.5);
    EXPECT_EQ(a->items[2].text, "x");
    EXPECT_TRUE(a->items[3].is(PyValue::Kind::Bool) && a->items[3].boolean);
    EXPECT_TRUE(a->items[4].is(PyValue::Kind::None));
    const PyValue* b = v.get("b");
    ASSERT_TRUE(b && b->is(PyValue::Kind::Tuple) && b->items.size() == 3);
    EXPECT_EQ(b->items[0].integer, -3);
    EXPECT_EQ(b->items[1].integer, int64_t(1) << 40);
    EXPECT_EQ(b->items[2].integer, -(int64_t(1) << 40));
    const PyValue* c = v.get("c");
    ASSERT_TRUE(c && c->get_int_key(7));
    EXPECT_EQ(c->get_int_key(7)->text, "seven");
  }
  // collections.OrderedDict([('k', 1)]), protocol 2: REDUCE of the allowed global, then SETITEM.
  const PyValue od =
      unpickle(from_hex("800263636f6c6c656374696f6e730a4f726465726564446963740a71002952710158010000006b71024b01732e"),
               kNoStorage, "cpython");
  ASSERT_TRUE(od.get("k"));
  EXPECT_EQ(od.get("k")->integer, 1);
}

TEST(Pickle, ForbiddenGlobalRefusedBeforeAnythingIsBuilt) {
  const fs::path dir = temp_dir("evil");
  const fs::path marker = dir / "pwned";
  // CPython protocol 0 payload: os.system("touch <marker>"), the classic pickle exploit.
  const std::string evil = "cos\nsystem\n(S'touch " + marker.string() + "'\ntR.";
  try {
    unpickle(evil, kNoStorage, "evil.pkl");
    FAIL() << "os.system accepted";
  } catch (const Error& e) {
    // The scan meets GLOBAL first and names it (protocol-0 STRING comes later).
    EXPECT_NE(std::string(e.what()).find("os.system"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(marker));
  // A valid tensor prefix followed by a forbidden opcode: refused by the scan, so the storage loader
  // (the first thing building the tensor would call) is never reached.
  PyTensor t;
  t.shape = {2};
  t.data = {1.f, 2.f};
  std::vector<std::string> storages;
  std::string pkl = pickle_dumps(PyValue::list({PyValue::from_tensor(t)}), storages);
  pkl.insert(pkl.size() - 1, "b");  // BUILD before STOP
  int loads = 0;
  const StorageLoader counting = [&](const std::string&) {
    ++loads;
    return storages[0];
  };
  try {
    unpickle(pkl, counting, "build.pkl");
    FAIL() << "BUILD accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("BUILD"), std::string::npos) << e.what();
  }
  EXPECT_EQ(loads, 0);
  // Other refusals name what they met.
  const std::pair<std::string, std::string> cases[] = {
      {"\x80\x02"
       "cbuiltins\neval\n.",
       "builtins.eval"},
      {"\x80\x02"
       "ctorch\nHalfStorage\n.",
       "float32"},
      {"\x80\x02"
       "(i__main__\nX\n.",
       "INST"},
      {"\x80\x02"
       "\x81.",
       "NEWOBJ"},
      {"\x80\x02"
       "\x82\x01.",
       "EXT1"},
      {"\x80\x04\x8c\x02os\x8c\x06system\x93.", "os.system"},  // STACK_GLOBAL
  };
  for (const auto& [bytes, name] : cases) {
    try {
      unpickle(bytes, kNoStorage, "case");
      ADD_FAILURE() << "accepted: " << name;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  }
  fs::remove_all(dir);
}

TEST(Pickle, MalformedInputIsAnError) {
  EXPECT_THROW(unpickle("\x80\x02}", kNoStorage, "trunc"), Error);              // no STOP
  EXPECT_THROW(unpickle("\x80\x02X\xff\xff\xff\x7f", kNoStorage, "t"), Error);  // string past the end
  EXPECT_THROW(unpickle("\x80\x02"
                        "a.",
                        kNoStorage, "t"),
               Error);                                               // APPEND on empty stack
  EXPECT_THROW(unpickle("\x80\x02h\x05.", kNoStorage, "t"), Error);  // memo key never set
  // A list that contains itself: refused instead of recursing forever.
  const char self_ref[] =
      "\x80\x02]q\x00h\x00"
      "a.";
  EXPECT_THROW(unpickle(std::string(self_ref, sizeof self_ref - 1), kNoStorage, "t"), Error);
}

// Pickle shares what the memo holds; the values kvcc builds are trees. x = (x, x) twenty-two
// times is 46 bytes of pickle and 2^23 - 1 values, refused by the bound on what a file of that
// size may expand to, while ordinary sharing (a string fetched from the memo a thousand times)
// reads.
TEST(Pickle, SharedMemoEntriesCannotExpandWithoutBound) {
  std::string doubling = "\x80\x02)";
  for (int i = 0; i < 22; ++i) doubling += "2\x86";  // DUP, TUPLE2
  doubling += ".";
  try {
    unpickle(doubling, kNoStorage, "doubling.pkl");
    ADD_FAILURE() << "a pickle of 2^23 values in 46 bytes was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expands to more than"), std::string::npos) << e.what();
  }

  std::string shared(
      "\x80\x02]q\x00X\x06\x00\x00\x00weightq\x01"  // [], 'weight' put in the memo
      "0(",                                         // POP, MARK
      20);
  for (int i = 0; i < 1000; ++i) shared += "h\x01";  // BINGET 1
  shared += "e.";                                    // APPENDS
  const PyValue v = unpickle(shared, kNoStorage, "shared.pkl");
  ASSERT_EQ(v.kind, PyValue::Kind::List);
  ASSERT_EQ(v.items.size(), 1000u);
  EXPECT_EQ(v.items[999].text, "weight");
}

TEST(Pickle, TorchSaveRoundTrip) {
  PyTensor a;
  a.shape = {2, 3};
  a.data = {1, 2, 3, 4, 5, -6.5f};
  PyTensor scalar;
  scalar.shape = {};
  scalar.data = {42};
  const PyValue v =
      PyValue::dict({{PyValue::from_string("a"), PyValue::from_tensor(a)},
                     {PyValue::from_int(3), PyValue::from_tensor(scalar)},
                     {PyValue::from_string("f"), PyValue::from_float(-0.125)},
                     {PyValue::from_string("big"), PyValue::from_int(-(int64_t(1) << 50))},
                     {PyValue::from_string("t"), PyValue::tuple({PyValue::from_bool(false), PyValue::none()})}});
  const PyValue back = torch_load_bytes(torch_save_bytes(v, "archive"), "mem");
  ASSERT_TRUE(back.get("a") && back.get("a")->is(PyValue::Kind::Tensor));
  EXPECT_EQ(back.get("a")->tensor->shape, a.shape);
  EXPECT_EQ(back.get("a")->tensor->data, a.data);
  ASSERT_TRUE(back.get_int_key(3));
  EXPECT_TRUE(back.get_int_key(3)->tensor->shape.empty());
  EXPECT_EQ(back.get_int_key(3)->tensor->data, std::vector<float>{42});
  EXPECT_EQ(back.get("f")->real, -0.125);
  EXPECT_EQ(back.get("big")->integer, -(int64_t(1) << 50));
  EXPECT_FALSE(back.get("t")->items[0].boolean);
}

TEST(Pickle, ReadsTorchStridedAndOffsetViews) {
  // torch.save({"t": arange(6).reshape(2,3).t(), "view": arange(10)[3:7], "expanded": arange(3).expand(2, 3), "n": 7,
  // "f": 0.25, "s": "x",
  //             "l": [1, -2, 2**40], "tup": (True, None)}) made by make_oscar_refs.py --small.
  const PyValue v = torch_load(kData + "/strided.pt");
  const PyTensor& t = *v.get("t")->tensor;
  EXPECT_EQ(t.shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(t.data, (std::vector<float>{0, 3, 1, 4, 2, 5}));  // the transpose, gathered by stride
  const PyTensor& view = *v.get("view")->tensor;
  EXPECT_EQ(view.data, (std::vector<float>{3, 4, 5, 6}));  // storage offset 3
  const PyTensor& expanded = *v.get("expanded")->tensor;   // stride 0: 6 elements from a 3-float storage
  EXPECT_EQ(expanded.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(expanded.data, (std::vector<float>{0, 1, 2, 0, 1, 2}));
  EXPECT_EQ(v.get("n")->integer, 7);
  EXPECT_EQ(v.get("f")->real, 0.25);
  EXPECT_EQ(v.get("s")->text, "x");
  EXPECT_EQ(v.get("l")->items[2].integer, int64_t(1) << 40);
  EXPECT_TRUE(v.get("tup")->items[0].boolean);
  EXPECT_TRUE(v.get("tup")->items[1].is(PyValue::Kind::None));
}

TEST(OscarPt, ReadsTorchWrittenPerHeadFile) {
  const OscarRotationSet s = read_oscar_pt(kData + "/tiny_v2_k.pt");
  EXPECT_EQ(s.format_version, 2);
  EXPECT_EQ(s.heads, 2);
  EXPECT_EQ(s.head_dim, 4);
  EXPECT_EQ(s.source_grouping, "kv_head");
  ASSERT_EQ(s.layers.size(), 2u);
  const auto refs = nlohmann::json::parse(read_bytes(kData + "/tiny_v2_k.json"));
  for (const auto& l : s.layers) {
    const auto& r = refs.at(std::to_string(l.layer_id));
    EXPECT_EQ(float_sha(l.rotation), r.at("rotation_sha256").get<std::string>());
    EXPECT_EQ(float_sha(l.eigenvalues), r.at("eigenvalues_sha256").get<std::string>());
  }
  // Written back by kvcc, read again: identical.
  const fs::path dir = temp_dir("v2");
  write_oscar_pt(s, (dir / "k.pt").string());
  const OscarRotationSet back = read_oscar_pt((dir / "k.pt").string());
  EXPECT_EQ(back.format_version, 2);
  EXPECT_EQ(back.heads, 2);
  for (size_t i = 0; i < s.layers.size(); ++i) {
    EXPECT_EQ(back.layers[i].rotation, s.layers[i].rotation);
    EXPECT_EQ(back.layers[i].eigenvalues, s.layers[i].eigenvalues);
  }
  fs::remove_all(dir);
}

TEST(OscarPt, RefusesWrongStructure) {
  const fs::path dir = temp_dir("bad");
  auto save = [&](const PyValue& v) {
    const std::string p = (dir / "bad.pt").string();
    torch_save(v, p, "bad");
    return p;
  };
  PyTensor r;
  r.shape = {3, 4};  // not square
  r.data.assign(12, 0.f);
  const PyValue layer = PyValue::dict({{PyValue::from_string("rotation"), PyValue::from_tensor(r)}});
  const PyValue bad_shape =
      PyValue::dict({{PyValue::from_string("format_version"), PyValue::from_int(1)},
                     {PyValue::from_string("layers"), PyValue::dict({{PyValue::from_int(0), layer}})}});
  EXPECT_THROW(read_oscar_pt(save(bad_shape)), Error);
  const PyValue bad_version = PyValue::dict({{PyValue::from_string("format_version"), PyValue::from_int(7)},
                                             {PyValue::from_string("layers"), PyValue::dict()}});
  try {
    read_oscar_pt(save(bad_version));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("format_version 7"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_oscar_pt(save(PyValue::list({}))), Error);
  fs::remove_all(dir);
}
