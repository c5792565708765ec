// The HDF5 layer: every dtype round-trips exactly, attributes round-trip, and each failure is a
// one-line kvcc::Error naming the file and object. Also the atomic writer leaves nothing behind.
#include <gtest/gtest.h>

#include <limits>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/h5.h"
#include "formats_test_util.h"

namespace kvcc {
namespace {

using testing::error_of;

TEST(H5, DatasetsOfEveryTypeRoundTrip) {
  testing::ScratchDir dir;
  const std::string path = dir.file("t.h5");
  std::vector<double> f64 = {1.0 / 3.0, -0.0, std::numeric_limits<double>::denorm_min(), 1e300, -7.25, 2.0};
  std::vector<float> f32 = {1.0f / 3.0f, -1e-30f, 3.5f, 1e30f};
  std::vector<int32_t> i32 = {std::numeric_limits<int32_t>::min(), -1, 0, std::numeric_limits<int32_t>::max()};
  std::vector<int64_t> i64 = {std::numeric_limits<int64_t>::min(), 42, std::numeric_limits<int64_t>::max()};
  std::vector<uint8_t> u8 = {0, 1, 255};
  std::vector<uint16_t> u16 = {0, 65535, 12345};
  std::vector<uint32_t> u32 = {0, 4294967295u};
  std::vector<uint64_t> u64 = {0, std::numeric_limits<uint64_t>::max(), 1ull << 63};
  std::vector<float> empty;
  {
    h5::File f = h5::File::create(path);
    h5::Group g = f.create_group("g");
    g.write("f64", {2, 3}, f64);
    g.write("f32", {4}, f32);
    g.write("i32", {2, 2}, i32);
    g.write("i64", {3}, i64);
    g.write("u8", {3}, u8);
    g.write("u16", {3, 1}, u16);
    g.write("u32", {2}, u32);
    g.write("u64", {3}, u64);
    g.write("empty", {0, 5, 4}, empty);
    g.set_attr("s", std::string("héllo, wörld"));
    g.set_attr("i", int64_t(-123456789012345));
    g.set_attr("u", std::numeric_limits<uint64_t>::max());
    g.set_attr("d", 0.1);
    g.set_attr("b", true);
    g.set_attr("d", 0.25);  // replacing an attribute works
    f.close();
  }
  h5::File f = h5::File::open(path);
  h5::Group g = f.group("g");
  h5::Shape shape;
  EXPECT_EQ(g.read<double>("f64", nullptr, &shape), f64);
  EXPECT_EQ(shape, (h5::Shape{2, 3}));
  EXPECT_EQ(g.read<float>("f32"), f32);
  EXPECT_EQ(g.read<int32_t>("i32"), i32);
  EXPECT_EQ(g.read<int64_t>("i64"), i64);
  EXPECT_EQ(g.read<uint8_t>("u8"), u8);
  EXPECT_EQ(g.read<uint16_t>("u16", h5::Shape{3, 1}), u16);
  EXPECT_EQ(g.read<uint32_t>("u32"), u32);
  EXPECT_EQ(g.read<uint64_t>("u64"), u64);
  EXPECT_TRUE(g.read<float>("empty", h5::Shape{0, 5, 4}).empty());
  EXPECT_EQ(g.attr_string("s"), "héllo, wörld");
  EXPECT_EQ(g.attr_int("i"), -123456789012345);
  EXPECT_EQ(g.attr_uint("u"), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(g.attr_double("d"), 0.25);
  EXPECT_TRUE(g.attr_bool("b"));
  EXPECT_EQ(g.children(), (std::vector<std::string>{"empty", "f32", "f64", "i32", "i64", "u16", "u32", "u64", "u8"}));
  EXPECT_EQ(g.attr_names(), (std::vector<std::string>{"b", "d", "i", "s", "u"}));
}

TEST(H5, CreationOrderIsKeptWhenTracked) {
  testing::ScratchDir dir;
  const std::string path = dir.file("t.h5");
  {
    h5::File f = h5::File::create(path);
    h5::Group g = f.create_group("ordered", true);
    for (const char* name : {"zeta", "alpha", "mid"}) g.write(name, {1}, std::vector<double>{1.0});
    f.close();
  }
  EXPECT_EQ(h5::File::open(path).group("ordered").children(), (std::vector<std::string>{"zeta", "alpha", "mid"}));
}

TEST(H5, ErrorsNameFileAndObject) {
  testing::ScratchDir dir;
  const std::string path = dir.file("stats.h5");
  {
    h5::File f = h5::File::create(path);
    h5::Group g = f.create_group("layers").create_group("3");
    g.write("x", {2}, std::vector<double>{1, 2});
    g.set_attr("name", std::string("n"));
    f.close();
  }
  h5::File f = h5::File::open(path);
  h5::Group g = f.group("layers").group("3");
  EXPECT_EQ(error_of([&] { g.read<double>("query_m2"); }), path + ": missing dataset /layers/3/query_m2");
  EXPECT_EQ(error_of([&] { f.group("model"); }), path + ": missing group /model");
  EXPECT_EQ(error_of([&] { g.read<float>("x"); }), path + ": /layers/3/x has dtype float64, expected float32");
  EXPECT_EQ(error_of([&] { g.read<double>("x", h5::Shape{3}); }), path + ": /layers/3/x has shape [2], expected [3]");
  EXPECT_EQ(error_of([&] { g.attr_int("count"); }), path + ": /layers/3: missing attribute count");
  EXPECT_EQ(error_of([&] { g.attr_int("name"); }), path + ": /layers/3: attribute name is not an integer");
  EXPECT_EQ(error_of([&] {
              g.write("bad", {2, 2}, std::vector<double>{1, 2, 3});
            }),
            path + ": /layers/3/bad: 3 values do not fill shape [2, 2]");
}

TEST(H5, MissingNonHdf5AndTruncatedFiles) {
  testing::ScratchDir dir;
  EXPECT_EQ(error_of([&] { h5::File::open(dir.file("nope.h5")); }), dir.file("nope.h5") + ": no such file");
  testing::write_bytes(dir.file("text.h5"), "this is not HDF5 at all\n");
  EXPECT_EQ(error_of([&] { h5::File::open(dir.file("text.h5")); }),
            dir.file("text.h5") + ": not an HDF5 file (or truncated)");
  EXPECT_CONTAINS(error_of([&] { h5::File::open(dir.path()); }), "is a directory");

  const std::string full = dir.file("full.h5");
  {
    h5::File f = h5::File::create(full);
    f.write("big", {4096}, std::vector<double>(4096, 1.5));
    f.close();
  }
  const std::string bytes = testing::read_bytes(full);
  testing::write_bytes(dir.file("cut.h5"), bytes.substr(0, bytes.size() / 2));
  EXPECT_EQ(error_of([&] { h5::File::open(dir.file("cut.h5")); }), dir.file("cut.h5") + ": truncated HDF5 file (" +
                                                                       std::to_string(bytes.size() / 2) + " of its " +
                                                                       std::to_string(bytes.size()) + " bytes)");
}

TEST(H5, VersionParsing) {
  EXPECT_EQ(h5::parse_version("1.0", "f"), (std::pair<int, int>{1, 0}));
  EXPECT_EQ(h5::parse_version("12.34", "f"), (std::pair<int, int>{12, 34}));
  EXPECT_CONTAINS(error_of([] { h5::parse_version("1", "f"); }), "malformed format_version \"1\"");
  EXPECT_CONTAINS(error_of([] { h5::parse_version("1.0beta", "f"); }), "malformed");
}

TEST(AtomicFile, ReplacesTargetAndCleansUpOnError) {
  testing::ScratchDir dir;
  const std::string target = dir.file("out.bin");
  write_bytes_atomically(target, "first");
  write_bytes_atomically(target, "second");
  EXPECT_EQ(testing::read_bytes(target), "second");
  EXPECT_TRUE(dir.temporaries().empty());

  std::string seen_tmp;
  EXPECT_EQ(error_of([&] {
              write_file_atomically(target, [&](const std::string& tmp) {
                seen_tmp = tmp;
                testing::write_bytes(tmp, "half written");
                throw Error("simulated failure");
              });
            }),
            "simulated failure");
  EXPECT_NE(seen_tmp.find(target + kTempMarker), std::string::npos);
  EXPECT_EQ(testing::read_bytes(target), "second");  // the old file is untouched
  EXPECT_TRUE(dir.temporaries().empty());
  EXPECT_EQ(dir.entries().size(), 1u);

  EXPECT_CONTAINS(error_of([&] { write_bytes_atomically(dir.file("no/such/dir/x.bin"), "x"); }),
                  "cannot create output in " + dir.file("no/such/dir"));
}

}  // namespace
}  // namespace kvcc
