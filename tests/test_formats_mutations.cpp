// Corrupt files must never crash, hang or exhaust memory: every reader either succeeds or throws
// kvcc::Error. Deterministic mutants of real files (the published artifacts and a small stats file
// written by write_stats) are each read in a forked child with a time limit (alarm) and an address
// space limit (RLIMIT_AS), so a segfault, a hang or a multi-gigabyte allocation shows up as a
// failed child, not as a crashed test. The crashers the fuzzers found (tests/fuzz/regressions) are
// replayed the same way.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <random>
#include <sstream>

#include "compile/synthetic_stats.h"
#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/h5.h"
#include "formats/h5_common.h"
#include "formats/stats.h"
#include "formats_test_util.h"

#if defined(__SANITIZE_ADDRESS__)
#define KVCC_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVCC_UNDER_ASAN 1
#endif
#endif

namespace kvcc {
namespace {

namespace fs = std::filesystem;

constexpr unsigned kChildSeconds = 20;                // a read of these small files takes milliseconds
constexpr size_t kChildExtraBytes = size_t(1) << 30;  // address space beyond the parent's

// Every reader a command reaches on an untrusted file: detect_format (verify, inspect), then the
// artifact readers (verify, inspect, validate, the runtime) or the stats readers (verify, inspect,
// compile, merge-stats). All of them are tried on every file: a reader given the other kind of
// file must refuse it with an Error too.
void read_everything(const std::string& path) {
  auto attempt = [](auto&& f) {
    try {
      f();
    } catch (const Error&) {}
  };
  attempt([&] { h5::detect_format(path); });
  attempt([&] { verify_artifact_file(path); });
  attempt([&] { read_artifact(path); });
  attempt([&] { verify_stats_file(path); });
  attempt([&] { read_stats(path); });
  attempt([&] { read_stats_summary(path); });
}

size_t virtual_size_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmSize:", 0) == 0) return size_t(std::stoull(line.substr(7))) * 1024;
  return 0;
}

// "" when reading `path` in a child ends normally; otherwise what happened.
std::string read_in_child(const std::string& path) {
  const size_t limit = virtual_size_bytes() + kChildExtraBytes;
  const pid_t pid = ::fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
#ifndef KVCC_UNDER_ASAN  // ASan reserves terabytes of shadow address space
    rlimit rl{limit, limit};
    ::setrlimit(RLIMIT_AS, &rl);
#else
    (void)limit;
#endif
    ::alarm(kChildSeconds);
    int code = 0;
    try {
      read_everything(path);
    } catch (const std::bad_alloc&) {
      code = 3;
    } catch (const std::exception&) {
      code = 4;
    } catch (...) {
      code = 5;
    }
    ::_exit(code);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  if (WIFEXITED(status)) {
    switch (WEXITSTATUS(status)) {
      case 0:
        return "";
      case 3:
        return "std::bad_alloc (memory bound exceeded)";
      case 4:
        return "an exception other than kvcc::Error";
      case 5:
        return "a non-standard exception";
      default:
        return "exit status " + std::to_string(WEXITSTATUS(status));
    }
  }
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    if (sig == SIGALRM) return "hang (no result within " + std::to_string(kChildSeconds) + " s)";
    return std::string("signal ") + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "unknown status";
}

// Byte ranges [offset, offset + size) of the raw data of every contiguous dataset: mutating them
// only changes values (which checksums and value checks catch), so most mutations go elsewhere.
void collect_raw_ranges(const h5::Group& g, std::vector<std::pair<size_t, size_t>>& out) {
  for (const std::string& name : g.children()) {
    try {
      collect_raw_ranges(g.group(name), out);
      continue;
    } catch (const Error&) {}
    const h5::Dataset ds = g.dataset(name);
    const int64_t offset = ds.file_offset();
    if (offset < 0) continue;
    size_t element = 8;
    switch (ds.dtype()) {
      case h5::DType::Float32:
      case h5::DType::Int32:
      case h5::DType::UInt32:
        element = 4;
        break;
      case h5::DType::UInt16:
        element = 2;
        break;
      case h5::DType::UInt8:
        element = 1;
        break;
      default:
        break;
    }
    out.emplace_back(size_t(offset), size_t(offset) + size_t(h5::element_count(ds.shape())) * element);
  }
}

struct Source {
  std::string name;  // for messages and saved mutants
  std::string bytes;
  std::vector<size_t> metadata_positions;  // byte positions outside every dataset's raw data
};

Source load_source(const std::string& name, const std::string& path) {
  Source s;
  s.name = name;
  s.bytes = testing::read_bytes(path);
  std::vector<std::pair<size_t, size_t>> raw;
  {
    h5::File f = h5::File::open(path);
    collect_raw_ranges(f, raw);
  }
  std::vector<char> is_raw(s.bytes.size(), 0);
  for (const auto& [begin, end] : raw)
    for (size_t i = begin; i < std::min(end, s.bytes.size()); ++i) is_raw[i] = 1;
  for (size_t i = 0; i < s.bytes.size(); ++i)
    if (!is_raw[i]) s.metadata_positions.push_back(i);
  return s;
}

// 1-3 edits at seeded positions (mostly metadata): a bit flip, a random byte, or a little-endian
// "interesting" 1/2/4/8-byte value (0, all ones, sign bits, sizes just past powers of two).
std::string mutate(const Source& src, std::mt19937_64& rng) {
  std::string b = src.bytes;
  const int edits = 1 + int(rng() % 3);
  static const uint64_t kInteresting[] = {0,          1,          0xff,           0x7f,
                                          0x80,       0xffff,     0x8000,         0x7fffffff,
                                          0x80000000, 0xffffffff, 0x100000000ull, 0x7fffffffffffffffull,
                                          ~0ull,      0x40000000, 0x10001};
  for (int e = 0; e < edits; ++e) {
    size_t pos;
    if (rng() % 8 != 0 && !src.metadata_positions.empty())
      pos = src.metadata_positions[rng() % src.metadata_positions.size()];
    else pos = rng() % b.size();
    switch (rng() % 4) {
      case 0:
        b[pos] = char(uint8_t(b[pos]) ^ uint8_t(1u << (rng() % 8)));
        break;
      case 1:
        b[pos] = char(rng() & 0xff);
        break;
      default: {
        const uint64_t v = kInteresting[rng() % std::size(kInteresting)];
        const size_t width = size_t(1) << (rng() % 4);
        for (size_t i = 0; i < width && pos + i < b.size(); ++i) b[pos + i] = char((v >> (8 * i)) & 0xff);
      }
    }
  }
  return b;
}

std::string small_stats_file(const testing::ScratchDir& dir) {
  SyntheticSpec spec;
  spec.n_layers = 2;
  spec.n_kv_heads = 2;
  spec.group = 2;
  spec.head_dim = 16;
  spec.docs = 10;
  spec.doc_len = 16;
  Stats s = make_synthetic_stats(spec);
  s.command = "kvcc test";
  s.provenance.data_sha256 = "synthetic";
  s.provenance.tokenizer = "ids";
  const std::string path = dir.file("stats.h5");
  write_stats(s, path);
  return path;
}

// Runs `count` mutants of `src`; returns one line per mutant whose read did not end normally.
// With KVCC_SAVE_MUTANTS=DIR set, those mutants are saved there (to add to tests/fuzz/regressions).
std::vector<std::string> run_mutants(const Source& src, int count, uint64_t seed, const testing::ScratchDir& dir) {
  std::vector<std::string> failures;
  std::mt19937_64 rng(seed);
  const std::string path = dir.file("mutant.h5");
  for (int i = 0; i < count; ++i) {
    const std::string bytes = mutate(src, rng);
    testing::write_bytes(path, bytes);
    const std::string what = read_in_child(path);
    if (what.empty()) continue;
    failures.push_back(src.name + " mutant " + std::to_string(i) + " (seed " + std::to_string(seed) + "): " + what);
    if (const char* save = std::getenv("KVCC_SAVE_MUTANTS")) {
      std::string stem = src.name;
      std::replace(stem.begin(), stem.end(), '/', '_');
      testing::write_bytes(
          std::string(save) + "/" + stem + "-" + std::to_string(seed) + "-" + std::to_string(i) + ".h5", bytes);
    }
  }
  return failures;
}

std::string join(const std::vector<std::string>& lines) {
  std::ostringstream o;
  for (const auto& l : lines) o << "  " << l << "\n";
  return o.str();
}

TEST(FormatsMutations, UnmodifiedFilesReadInTheChild) {
  testing::ScratchDir dir;
  for (const std::string& path : testing::published_artifacts()) EXPECT_EQ(read_in_child(path), "") << path;
  EXPECT_EQ(read_in_child(small_stats_file(dir)), "");
}

TEST(FormatsMutations, ArtifactMutantsNeverCrashHangOrExhaustMemory) {
  testing::ScratchDir dir;
  const std::vector<std::string> artifacts = testing::published_artifacts();
  ASSERT_FALSE(artifacts.empty());
  std::vector<std::string> failures;
  uint64_t seed = 1;
  int total = 0;
  for (const std::string& path : artifacts) {
    const Source src = load_source(fs::relative(path, fs::path(KVCC_SOURCE_DIR) / "zoo" / "published").string(), path);
    const int count = src.bytes.size() > (1u << 20) ? 50 : 100;  // the 4 MB files are slower to read
    const auto f = run_mutants(src, count, seed++, dir);
    failures.insert(failures.end(), f.begin(), f.end());
    total += count;
  }
  EXPECT_TRUE(failures.empty()) << failures.size() << " of " << total << " artifact mutants failed:\n"
                                << join(failures);
}

TEST(FormatsMutations, StatsMutantsNeverCrashHangOrExhaustMemory) {
  testing::ScratchDir dir;
  const Source src = load_source("stats.h5", small_stats_file(dir));
  const auto failures = run_mutants(src, 400, 1000, dir);
  EXPECT_TRUE(failures.empty()) << failures.size() << " of 400 stats mutants failed:\n" << join(failures);
}

// The crashers kept by scripts/fuzz.sh and the failing mutants saved from this test.
TEST(FormatsMutations, RegressionFilesNeverCrashHangOrExhaustMemory) {
  const fs::path dir = fs::path(KVCC_SOURCE_DIR) / "tests" / "fuzz" / "regressions";
  if (!fs::exists(dir)) GTEST_SKIP() << "no " << dir;
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && e.path().filename().string()[0] != '.' && e.path().extension() != ".md")
      files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  std::vector<std::string> failures;
  for (const std::string& path : files)
    if (const std::string what = read_in_child(path); !what.empty()) failures.push_back(path + ": " + what);
  EXPECT_TRUE(failures.empty()) << failures.size() << " of " << files.size() << " regression files failed:\n"
                                << join(failures);
}

// ---------------------------------------------------------------- one test per fixed hole

// What `f` does in a forked child under the same bounds: the kvcc::Error message it throws,
// "(no error)", or read_in_child-style description of a crash, hang or exhausted memory.
template <class F>
std::string outcome_in_child(F&& f) {
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  const size_t limit = virtual_size_bytes() + kChildExtraBytes;
  const pid_t pid = ::fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    ::close(fds[0]);
#ifndef KVCC_UNDER_ASAN
    rlimit rl{limit, limit};
    ::setrlimit(RLIMIT_AS, &rl);
#else
    (void)limit;
#endif
    ::alarm(kChildSeconds);
    std::string message = "(no error)";
    int code = 0;
    try {
      f();
    } catch (const Error& e) {
      message = e.what();
    } catch (const std::bad_alloc&) {
      code = 3;
    } catch (const std::exception&) {
      code = 4;
    }
    if (::write(fds[1], message.data(), message.size()) < 0) code = 6;
    ::_exit(code);
  }
  ::close(fds[1]);
  std::string message;
  char buf[4096];
  ssize_t got;
  while ((got = ::read(fds[0], buf, sizeof buf)) > 0) message.append(buf, size_t(got));
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return message;
  if (WIFEXITED(status)) return "child exit status " + std::to_string(WEXITSTATUS(status)) + " (3: bad_alloc)";
  if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM) return "hang";
  return "crash: signal " + std::to_string(WIFSIGNALED(status) ? WTERMSIG(status) : -1);
}

// Replaces dataset PATH/NAME of an HDF5 file by one of `dims` doubles (or int32s) whose storage
// is never written: HDF5 allows it (reads give the fill value), so a tiny file can declare
// gigabytes.
void declare_unwritten_dataset(const std::string& file, const std::string& group, const std::string& name,
                               const std::vector<hsize_t>& dims, hid_t type, hid_t dcpl = H5P_DEFAULT) {
  h5::silence_hdf5_errors();
  const hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  const hid_t g = H5Gopen2(f, group.c_str(), H5P_DEFAULT);
  ASSERT_GE(g, 0);
  if (H5Lexists(g, name.c_str(), H5P_DEFAULT) > 0) {
    ASSERT_GE(H5Ldelete(g, name.c_str(), H5P_DEFAULT), 0);
  }
  const hid_t space = H5Screate_simple(int(dims.size()), dims.data(), nullptr);
  const hid_t d = H5Dcreate2(g, name.c_str(), type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
  ASSERT_GE(d, 0);
  H5Dclose(d);
  H5Sclose(space);
  H5Gclose(g);
  ASSERT_GE(H5Fclose(f), 0);
}

std::string copy_of(const testing::ScratchDir& dir, const std::string& from, const std::string& name) {
  testing::write_bytes(dir.file(name), testing::read_bytes(from));
  return dir.file(name);
}

std::string small_artifact() {
  return (fs::path(KVCC_SOURCE_DIR) / "zoo/published/stories260k/random-int2-g8/artifact.87ed29584bb7.kvcc.h5")
      .string();
}

// A 229 KB stats file declared 2^31 reservoir rows and compile allocated 8 GB for them before
// comparing the count with the capacity.
TEST(FormatsUntrusted, ReservoirRowsBeyondTheFileAreRefusedBeforeAllocating) {
  testing::ScratchDir dir;
  const std::string path = small_stats_file(dir);
  {
    h5::File f = h5::File::open_rw(path);
    f.group("layers").group("1").group("kv0").group("reservoir").set_attr("capacity", int64_t(2147483647));
    h5::seal_attributes(f);
    f.close();
  }
  declare_unwritten_dataset(path, "/layers/1/kv0/reservoir", "position", {2147483647}, H5T_STD_I32LE);
  const std::string what = outcome_in_child([&] { read_stats(path); });
  EXPECT_CONTAINS(what,
                  "/layers/1/kv0/reservoir/position: shape [2147483647] needs 8589934588 bytes, more than a file of");
  EXPECT_CONTAINS(outcome_in_child([&] { verify_stats_file(path); }), "more than a file of");
}

// libhdf5 1.10 copies a compact dataset's extent out of the bytes its layout message holds
// without comparing the sizes: a fuzzed artifact whose layout claimed fewer bytes than the shape
// needs made H5Dread copy from a null buffer (SEGV under verify).
TEST(FormatsUntrusted, CompactStorageShorterThanItsShapeIsRefused) {
  testing::ScratchDir dir;
  const std::string path = dir.file("compact.h5");
  const std::vector<double> values = {1.5, -2.25, 3.0e10, 0.125};
  {
    h5::silence_hdf5_errors();
    const hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    ASSERT_GE(H5Pset_layout(dcpl, H5D_COMPACT), 0);
    const hsize_t dims[1] = {values.size()};
    const hid_t space = H5Screate_simple(1, dims, nullptr);
    const hid_t d = H5Dcreate2(f, "x", H5T_IEEE_F64LE, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    ASSERT_GE(d, 0);
    ASSERT_GE(H5Dwrite(d, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()), 0);
    H5Dclose(d);
    H5Sclose(space);
    H5Pclose(dcpl);
    ASSERT_GE(H5Fclose(f), 0);
  }
  const auto read_x = [&] {
    if (h5::File::open(path).read<double>("x") != values) throw Error("values differ");
  };
  EXPECT_EQ(outcome_in_child(read_x), "(no error)");
  // The layout message (version 3): version, class 0 = compact, a 2-byte size, then the bytes.
  std::string bytes = testing::read_bytes(path);
  const std::string message =
      std::string("\x03\x00\x20\x00", 4) + std::string(reinterpret_cast<const char*>(values.data()), 8 * values.size());
  const size_t at = bytes.find(message);
  ASSERT_NE(at, std::string::npos);
  ASSERT_EQ(bytes.find(message, at + 1), std::string::npos);
  for (const int size : {0, 8}) {
    bytes[at + 2] = char(size);
    testing::write_bytes(path, bytes);
    EXPECT_CONTAINS(outcome_in_child(read_x), "/x: compact storage holds " + std::to_string(size) +
                                                  " bytes, its shape [4] needs 32 (corrupt file)");
  }
}

// capacity 2^32 + 150 was read as int 150, so a file claiming a 4-billion-row capacity passed as
// a 150-row one.
TEST(FormatsUntrusted, CountsAreCheckedNotNarrowed) {
  testing::ScratchDir dir;
  const std::string path = small_stats_file(dir);
  {
    h5::File f = h5::File::open_rw(path);
    f.group("layers").group("0").group("kv1").group("reservoir").set_attr("capacity", (int64_t(1) << 32) + 160);
    h5::seal_attributes(f);
    f.close();
  }
  EXPECT_CONTAINS(outcome_in_child([&] { read_stats(path); }),
                  "/layers/0/kv1/reservoir: attribute capacity = 4294967456 is out of range [0, 2147483647]");

  const std::string art = copy_of(dir, small_artifact(), "a.kvcc.h5");
  {
    h5::File f = h5::File::open_rw(art);
    f.group("recipe").set_attr("page_size", (int64_t(1) << 32) + 64);
    h5::seal_attributes(f);
    f.close();
  }
  EXPECT_CONTAINS(outcome_in_child([&] { read_artifact(art); }),
                  "/recipe: attribute page_size = 4294967360 is out of range");
}

// A 2.2 MB artifact made readers allocate 2 GB: an array's shape was trusted before reading.
TEST(FormatsUntrusted, ArtifactArraysBeyondTheFileAreRefusedBeforeAllocating) {
  testing::ScratchDir dir;
  const std::string art = copy_of(dir, small_artifact(), "a.kvcc.h5");
  {
    h5::File f = h5::File::open_rw(art);
    f.group("layers").group("0").group("kv0").group("key").create_group("extras", true);
    h5::seal_attributes(f);
    f.close();
  }
  declare_unwritten_dataset(art, "/layers/0/kv0/key/extras", "codebook", {1u << 28}, H5T_IEEE_F64LE);
  EXPECT_CONTAINS(outcome_in_child([&] { verify_artifact_file(art); }),
                  "/layers/0/kv0/key/extras/codebook: shape [268435456] needs 2147483648 bytes, more than a file of");
  // A rotation of the wrong shape is refused by its shape, before its 128 GB are allocated.
  const std::string art2 = copy_of(dir, small_artifact(), "b.kvcc.h5");
  declare_unwritten_dataset(art2, "/layers/1/kv0/value", "rotation", {1u << 17, 1u << 17}, H5T_IEEE_F64LE);
  EXPECT_CONTAINS(outcome_in_child([&] { read_artifact(art2); }), "rotation has shape [131072, 131072], expected");
}

// A dataset whose bytes live in another file (HDF5 "external storage") would make kvcc read any
// file the artifact names.
TEST(FormatsUntrusted, ExternalStorageIsRefused) {
  testing::ScratchDir dir;
  const std::string art = copy_of(dir, small_artifact(), "a.kvcc.h5");
  testing::write_bytes(dir.file("outside"), std::string(4096, 'x'));
  {
    h5::File f = h5::File::open_rw(art);
    f.group("layers").group("0").group("kv0").group("key").create_group("extras", true);
    h5::seal_attributes(f);
    f.close();
  }
  const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
  ASSERT_GE(H5Pset_external(dcpl, dir.file("outside").c_str(), 0, 4096), 0);
  declare_unwritten_dataset(art, "/layers/0/kv0/key/extras", "ext", {512}, H5T_IEEE_F64LE, dcpl);
  H5Pclose(dcpl);
  EXPECT_CONTAINS(outcome_in_child([&] { verify_artifact_file(art); }), "ext: external storage is not supported");
}

// Structures kvcc never writes are refused before libhdf5 parses them: a chunked dataset's chunk
// index (a B-tree libhdf5 walks unchecked), and dense link or attribute storage (fractal heaps
// indexed by v2 B-trees), which libhdf5 writes only when asked for the newer format.
TEST(FormatsUntrusted, ChunkedAndDenseStorageAreRefusedBeforeLibhdf5ParsesThem) {
  testing::ScratchDir dir;
  const std::string refusal = "chunked storage is not supported";
  // A chunked dataset made by libhdf5 itself.
  const std::string art = copy_of(dir, small_artifact(), "a.kvcc.h5");
  {
    h5::File f = h5::File::open_rw(art);
    f.group("layers").group("0").group("kv0").group("key").create_group("extras", true);
    h5::seal_attributes(f);
    f.close();
  }
  const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
  const hsize_t chunk = 64;
  ASSERT_GE(H5Pset_chunk(dcpl, 1, &chunk), 0);
  declare_unwritten_dataset(art, "/layers/0/kv0/key/extras", "chunked", {512}, H5T_IEEE_F64LE, dcpl);
  H5Pclose(dcpl);
  EXPECT_CONTAINS(outcome_in_child([&] { verify_artifact_file(art); }), refusal);
  // A contiguous dataset's layout message (v1 header: type 8, then version 3, class 1) turned
  // into a chunked one: its "chunk index" is whatever bytes follow.
  const std::string good = testing::read_bytes(small_artifact());
  size_t layout = std::string::npos;
  for (size_t at = good.find(std::string("\x08\0", 2)); at != std::string::npos && layout == std::string::npos;
       at = good.find(std::string("\x08\0", 2), at + 1))
    if (at + 10 < good.size() && good[at + 8] == 3 && good[at + 9] == 1 && good[at + 2] == 0x18 && good[at + 3] == 0)
      layout = at;
  ASSERT_NE(layout, std::string::npos);
  std::string bad = good;
  bad[layout + 9] = 2;
  testing::write_bytes(dir.file("class.kvcc.h5"), bad);
  EXPECT_CONTAINS(outcome_in_child([&] { verify_artifact_file(dir.file("class.kvcc.h5")); }), refusal);
  // Dense attributes, then dense links, on the root of a file in the newer format.
  for (const bool links : {false, true}) {
    const std::string path = dir.file(links ? "links.h5" : "attrs.h5");
    const hid_t fapl = H5Pcreate(H5P_FILE_ACCESS), fcpl = H5Pcreate(H5P_FILE_CREATE);
    ASSERT_GE(H5Pset_libver_bounds(fapl, H5F_LIBVER_LATEST, H5F_LIBVER_LATEST), 0);
    ASSERT_GE(links ? H5Pset_link_phase_change(fcpl, 0, 0) : H5Pset_attr_phase_change(fcpl, 0, 0), 0);
    const hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, fcpl, fapl);
    ASSERT_GE(f, 0);
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t a = H5Acreate2(f, "capacity", H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
    const int64_t one = 1;
    ASSERT_GE(H5Awrite(a, H5T_NATIVE_INT64, &one), 0);
    H5Aclose(a);
    const hid_t g = H5Gcreate2(f, "layers", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    ASSERT_GE(g, 0);
    H5Gclose(g);
    H5Sclose(space);
    H5Pclose(fapl);
    H5Pclose(fcpl);
    ASSERT_GE(H5Fclose(f), 0);
    EXPECT_CONTAINS(outcome_in_child([&] { read_stats(path); }),
                    links ? "dense link storage (a fractal heap) is not supported"
                          : "dense attribute storage (a fractal heap) is not supported");
  }
}

// Variable-length strings live in a global heap collection whose object sizes libhdf5 1.10
// trusts: a corrupt size crashed H5HG_read (heap overflow / overlapping memcpy under ASan), a
// zero-sized free-space object hung its parser.
TEST(FormatsUntrusted, CorruptGlobalHeapIsRefused) {
  testing::ScratchDir dir;
  const std::string good = testing::read_bytes(small_artifact());
  const size_t heap = good.find(std::string("GCOL\1\0\0\0", 8));
  ASSERT_NE(heap, std::string::npos);
  auto put_u64 = [](std::string& b, size_t at, uint64_t v) {
    for (int i = 0; i < 8; ++i) b[at + size_t(i)] = char((v >> (8 * i)) & 0xff);
  };
  // The first object's size (collection header 16 bytes, then index 2, refcount 2, reserved 4).
  std::string bad = good;
  put_u64(bad, heap + 16 + 8, uint64_t(1) << 40);
  testing::write_bytes(dir.file("big.h5"), bad);
  EXPECT_CONTAINS(outcome_in_child([&] { verify_artifact_file(dir.file("big.h5")); }),
                  "corrupt HDF5 file (global heap at 2048: object 1 overruns it)");
  // The collection's own size.
  bad = good;
  put_u64(bad, heap + 8, 0);
  testing::write_bytes(dir.file("size.h5"), bad);
  EXPECT_CONTAINS(outcome_in_child([&] { read_artifact(dir.file("size.h5")); }),
                  "global heap at 2048 has an invalid size 0");
}

// Files opened read-only have their variable-length strings read from the checked heap copies
// (h5.cpp read_vlen_string_raw), files opened for writing through libhdf5: both give the same
// strings for every attribute of a published artifact.
void collect_strings(const h5::Group& g, std::vector<std::string>& out) {
  for (const std::string& a : g.attr_names()) {
    try {
      out.push_back(g.path() + "@" + a + "=" + g.attr_string(a));
    } catch (const Error&) {  // not a string
    }
  }
  for (const std::string& name : g.children()) {
    try {
      collect_strings(g.group(name), out);
    } catch (const Error&) {
      const h5::Dataset ds = g.dataset(name);
      out.push_back(ds.path() + "@sha256=" + ds.attr_string("sha256"));
    }
  }
}

TEST(FormatsUntrusted, StringsReadFromTheCheckedHeapsAreThoseLibhdf5Reads) {
  testing::ScratchDir dir;
  for (const std::string& path : testing::published_artifacts()) {
    if (testing::read_bytes(path).size() > (1u << 20)) continue;
    const std::string copy = copy_of(dir, path, "a.h5");
    std::vector<std::string> checked, trusted;
    collect_strings(h5::File::open(copy), checked);
    collect_strings(h5::File::open_rw(copy), trusted);
    EXPECT_EQ(checked, trusted) << path;
    EXPECT_GT(checked.size(), 50u) << path;
  }
}

// libhdf5 1.10 decodes an object's attribute messages without checking that the value (points x
// type size) and the name (copied with strdup) fit in the message; scripts/fuzz.sh found reads
// past the object header (heap overflow under ASan, SEGV). The headers are now checked first.
TEST(FormatsUntrusted, AttributeMessagesAreCheckedBeforeLibhdf5DecodesThem) {
  testing::ScratchDir dir;
  const std::string good = testing::read_bytes(small_artifact());
  // The version 1 attribute message of /model/fingerprint's `fields`: header (8 bytes), name
  // (padded to 8), datatype (20 bytes padded to 24: class 9 = variable-length, size at +4).
  const std::string key("\1\0\7\0\24\0\10\0fields\0", 15);
  const size_t msg = good.find(key);
  ASSERT_NE(msg, std::string::npos);
  ASSERT_EQ(good.find(key, msg + 1), std::string::npos);
  std::string bad = good;
  bad[msg + 16 + 4] = 20;  // a 20-byte "variable-length" value in a 16-byte slot
  testing::write_bytes(dir.file("size.h5"), bad);
  EXPECT_CONTAINS(outcome_in_child([&] { read_artifact(dir.file("size.h5")); }),
                  "/model: fingerprint: corrupt object header (attribute: unsupported datatype (class 9, 20 bytes))");
  bad = good;
  bad[msg + 14] = 'x';  // the name's terminator
  bad[msg + 15] = 'x';
  testing::write_bytes(dir.file("name.h5"), bad);
  EXPECT_CONTAINS(outcome_in_child([&] { verify_artifact_file(dir.file("name.h5")); }),
                  "corrupt object header (attribute name is not terminated)");
}

// An object header's size is bounded by the file before libhdf5 loads it: a corrupt size made
// H5Fopen (the root group) or H5Gopen2 allocate gigabytes (scripts/fuzz.sh, -malloc_limit_mb).
TEST(FormatsUntrusted, ObjectHeaderSizesAreBoundedByTheFile) {
  testing::ScratchDir dir;
  std::string bad = testing::read_bytes(small_artifact());
  ASSERT_EQ(bad.compare(0, 8, "\x89HDF\r\n\x1a\n"), 0);
  ASSERT_EQ(bad[8], 0);  // superblock version 0: the root group's header address at 64
  uint64_t root = 0;
  for (int i = 7; i >= 0; --i) root = (root << 8) | uint8_t(bad[64 + size_t(i)]);
  ASSERT_EQ(bad[root], 1);  // a version 1 object header: its size at +8
  bad[root + 8] = '\0';
  bad[root + 9] = '\0';
  bad[root + 10] = '\0';
  bad[root + 11] = char(0xf0);  // 4 GB
  testing::write_bytes(dir.file("root.h5"), bad);
  EXPECT_CONTAINS(outcome_in_child([&] { read_artifact(dir.file("root.h5")); }),
                  "root group: corrupt object header (object header chunk outside the file)");
  // A base address moves every address of the file (and so the root header) elsewhere.
  bad = testing::read_bytes(small_artifact());
  bad[24] = char(0xff);
  testing::write_bytes(dir.file("base.h5"), bad);
  EXPECT_CONTAINS(outcome_in_child([&] { read_stats(dir.file("base.h5")); }),
                  "corrupt HDF5 file (base address 255 (expected 0))");
}

// An attribute's datatype is decoded by libhdf5 whatever its class: an enumeration's member names
// are copied with strdup, as many as the type claims (CI's fuzzing turned the vlen class of
// /format into an enumeration of 257 members: strdup read past the object header). Only the
// classes kvcc reads get past the header check.
TEST(FormatsUntrusted, AttributeTypesOtherThanNumbersAndStringsAreRefusedBeforeDecoding) {
  testing::ScratchDir dir;
  const std::string good = testing::read_bytes(small_artifact());
  // The root's `format` attribute: a version 1 message, its name padded to 8, then the datatype.
  const std::string key("\1\0\7\0\24\0\10\0format\0\0", 16);
  const size_t msg = good.find(key);
  ASSERT_NE(msg, std::string::npos);
  ASSERT_EQ(uint8_t(good[msg + 16]), 0x19);  // version 1, class 9 (variable-length)
  for (const auto& [class_byte, what] :
       std::vector<std::pair<char, std::string>>{{char(0x18), "(class 8, 16 bytes)"},
                                                 {char(0x16), "(class 6, 16 bytes)"},
                                                 {char(0x1a), "(class 10, 16 bytes)"}}) {
    std::string bad = good;
    bad[msg + 16] = class_byte;
    bad[msg + 17] = char(0xff);  // 255 (+ 256 from the next byte) enumeration members, say
    testing::write_bytes(dir.file("type.h5"), bad);
    EXPECT_CONTAINS(outcome_in_child([&] { verify_artifact_file(dir.file("type.h5")); }),
                    "corrupt object header (attribute: unsupported datatype " + what);
  }
}

// Old-style groups (what kvcc and h5py write by default) keep their links in a B-tree of symbol
// table nodes naming them by offsets into a local heap. libhdf5 loads the heap at the symbol table
// message's address unchecked: scripts/fuzz.sh found an undefined address (a NULL read in its
// metadata accumulator: SEGV) and a heap claiming a 12.9 GB data segment (allocated before being
// read). The heap, the B-tree and its nodes are now checked against the file first.
TEST(FormatsUntrusted, OldStyleGroupsAreCheckedBeforeLibhdf5LoadsThem) {
  testing::ScratchDir dir;
  const std::string good = testing::read_bytes(small_artifact());
  // Every group's object header holds a symbol table message (type 0x11, 16 bytes: B-tree and
  // local heap addresses); the first after the root's is /layers'.
  const std::string stab("\x11\0\x10\0\0\0\0\0", 8);
  const size_t root_msg = good.find(stab);
  ASSERT_NE(root_msg, std::string::npos);
  const size_t msg = good.find(stab, root_msg + 1);
  ASSERT_NE(msg, std::string::npos);
  auto le64 = [&](size_t at) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | uint8_t(good[at + size_t(i)]);
    return v;
  };
  const uint64_t heap = le64(msg + 16);
  ASSERT_EQ(good.substr(size_t(heap), 4), "HEAP");
  struct Case {
    size_t at;
    std::string bytes, expected;
  };
  const std::vector<Case> cases = {
      {msg + 16, std::string(8, '\xff'), "symbol table: no local heap at 18446744073709551615"},
      {msg + 8, std::string(8, '\xff'), "symbol table: no group B-tree node at 18446744073709551615"},
      // The data segment's size: 12.9 GB (0x3_0000_0000).
      {size_t(heap) + 8, std::string("\0\0\0\0\3\0\0\0", 8), "outside the file"},
      // The free list's head inside the data, its block's size past it.
      {size_t(heap) + 16, std::string("\x08\0\0\0\0\0\0\0", 8), "corrupt local heap free list"},
  };
  for (const Case& c : cases) {
    std::string bad = good;
    bad.replace(c.at, c.bytes.size(), c.bytes);
    if (c.expected == "corrupt local heap free list") {
      const uint64_t data = le64(size_t(heap) + 24);
      bad.replace(size_t(data) + 8 + 8, 8, std::string(8, '\x7f'));  // the block at offset 8: its size
    }
    testing::write_bytes(dir.file("group.h5"), bad);
    EXPECT_CONTAINS(outcome_in_child([&] { read_artifact(dir.file("group.h5")); }), c.expected) << c.expected;
    EXPECT_CONTAINS(outcome_in_child([&] { verify_artifact_file(dir.file("group.h5")); }), c.expected) << c.expected;
  }
}

// A soft or external link could make a reader open any object or any other file.
TEST(FormatsUntrusted, SoftAndExternalLinksAreRefused) {
  testing::ScratchDir dir;
  const std::string art = copy_of(dir, small_artifact(), "a.kvcc.h5");
  {
    h5::File f = h5::File::open_rw(art);
    ASSERT_GE(H5Ldelete(f.id(), "recipe", H5P_DEFAULT), 0);
    ASSERT_GE(H5Lcreate_soft("/model", f.id(), "recipe", H5P_DEFAULT, H5P_DEFAULT), 0);
    ASSERT_GE(H5Ldelete(f.id(), "provenance", H5P_DEFAULT), 0);
    ASSERT_GE(
        H5Lcreate_external(small_artifact().c_str(), "/provenance", f.id(), "provenance", H5P_DEFAULT, H5P_DEFAULT), 0);
    f.close();
  }
  EXPECT_CONTAINS(outcome_in_child([&] { read_artifact(art); }),
                  "/: provenance is not a hard link (soft and external links are not supported)");
}

TEST(FormatsUntrusted, HugeLayerCountWithAConsistentFingerprintIsRefusedWithoutAllocating) {
  testing::ScratchDir dir;
  const std::string art = copy_of(dir, small_artifact(), "a.kvcc.h5");
  {
    h5::File f = h5::File::open_rw(art);
    h5::Group model = f.group("model");
    ModelFingerprint fp = h5::read_fingerprint(model);
    for (auto& [name, value] : fp.fields)
      if (name == "n_layers") value = "1073741824";
    fp.id = fingerprint_id(fp.fields, fp.weights_sha256);
    H5Ldelete(model.id(), "fingerprint", H5P_DEFAULT);
    h5::write_fingerprint(model, fp);
    model.set_attr("n_layers", int64_t(1) << 30);
    h5::seal_attributes(f);
    f.close();
  }
  EXPECT_CONTAINS(outcome_in_child([&] { read_artifact(art); }), "missing group /layers/");
}

}  // namespace
}  // namespace kvcc
