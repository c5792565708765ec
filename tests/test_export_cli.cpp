// `kvcc export`: HDF5 -> safetensors -> HDF5 through the command line on a published artifact and
// on one `kvcc compile` just made, compared with the input through the artifact reader; and the
// refusals (unknown format, output = input, missing, foreign and corrupt inputs) with their
// messages, leaving no output and no temporary file behind.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "compile/synthetic_stats.h"
#include "formats/artifact.h"
#include "formats/artifact_safetensors.h"
#include "formats/safetensors_writer.h"
#include "formats/stats.h"
#include "formats_test_util.h"

namespace kvcc {
namespace {

namespace fs = std::filesystem;
using testing::read_bytes;
using testing::ScratchDir;
using testing::write_bytes;

const std::string kPublished =
    std::string(KVCC_SOURCE_DIR) + "/zoo/published/stories260k/oscar-int2-g8-p2/artifact.18c4045de0f2.kvcc.h5";

struct CliRun {
  int status;
  std::string out, err;
};

CliRun kvcc(const ScratchDir& dir, const std::string& args) {
  const std::string out = dir.file("stdout.txt"), err = dir.file("stderr.txt");
  const int status = std::system((std::string(KVCC_BINARY) + " " + args + " > " + out + " 2> " + err).c_str());
  CliRun r{status, read_bytes(out), read_bytes(err)};
  std::remove(out.c_str());
  std::remove(err.c_str());
  return r;
}

TEST(ExportCli, RoundTripOfAPublishedArtifact) {
  ScratchDir dir;
  const std::string st = dir.file("a.safetensors"), back = dir.file("back.kvcc.h5");
  CliRun r = kvcc(dir, "export " + kPublished + " --format safetensors -o " + st);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("reads back equal"), std::string::npos) << r.out;
  EXPECT_EQ(artifact_container(st), ArtifactContainer::Safetensors);
  r = kvcc(dir, "export " + st + " --format hdf5 -o " + back);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(artifact_container(back), ArtifactContainer::Hdf5);
  const Artifact original = read_artifact(kPublished);
  EXPECT_EQ(artifact_difference(original, read_artifact(st)), "");
  EXPECT_EQ(artifact_difference(original, read_artifact(back)), "");
  // verify and inspect take either container.
  r = kvcc(dir, "verify " + st);
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("OK"), std::string::npos) << r.out;
  r = kvcc(dir, "inspect " + st);
  EXPECT_EQ(r.status, 0) << r.err;
  // The same report but for the file name on its first line.
  const std::string h5_out = kvcc(dir, "inspect " + kPublished).out;
  EXPECT_EQ(r.out.substr(r.out.find('\n')), h5_out.substr(h5_out.find('\n')));
  // An existing output is replaced (atomically, like every kvcc writer).
  write_bytes(st, "old contents");
  ASSERT_EQ(kvcc(dir, "export " + back + " --format safetensors -o " + st).status, 0);
  EXPECT_EQ(artifact_difference(original, read_artifact(st)), "");
  EXPECT_TRUE(dir.temporaries().empty());
}

TEST(ExportCli, RoundTripOfAFreshlyCompiledArtifact) {
  ScratchDir dir;
  SyntheticSpec spec;
  spec.head_dim = 16;
  spec.docs = 10;
  spec.doc_len = 32;
  write_stats(make_synthetic_stats(spec), dir.file("stats.h5"));
  for (const char* method : {"oscar", "turboquant", "commvq"}) {
    const std::string h5 = dir.file(std::string(method) + ".kvcc.h5"), st = dir.file("m.safetensors"),
                      back = dir.file("m.back.kvcc.h5");
    CliRun r = kvcc(dir, "compile " + dir.file("stats.h5") + " --method " + method + " -o " + h5);
    ASSERT_EQ(r.status, 0) << method << ": " << r.err;
    ASSERT_EQ(kvcc(dir, "export " + h5 + " --format safetensors -o " + st).status, 0) << method;
    ASSERT_EQ(kvcc(dir, "export " + st + " --format hdf5 -o " + back).status, 0) << method;
    EXPECT_EQ(artifact_difference(read_artifact(h5), read_artifact(back)), "") << method;
  }
}

TEST(ExportCli, RefusesBadRequestsAndInputs) {
  ScratchDir dir;
  const std::string st = dir.file("a.safetensors"), out = dir.file("out.kvcc.h5");
  ASSERT_EQ(kvcc(dir, "export " + kPublished + " --format safetensors -o " + st).status, 0);

  CliRun r = kvcc(dir, "export " + st + " --format onnx -o " + out);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("--format"), std::string::npos) << r.err;
  r = kvcc(dir, "export " + st + " --format hdf5 -o " + st);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("is the input"), std::string::npos) << r.err;
  EXPECT_EQ(artifact_container(st), ArtifactContainer::Safetensors);  // untouched
  r = kvcc(dir, "export " + dir.file("absent.safetensors") + " --format hdf5 -o " + out);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("absent.safetensors"), std::string::npos) << r.err;
  // A safetensors file that is not an artifact.
  write_safetensors_f32(dir.file("weights.safetensors"), {{"w", {2}, {1.0f, 2.0f}}});
  r = kvcc(dir, "export " + dir.file("weights.safetensors") + " --format hdf5 -o " + out);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("not a kvcc artifact"), std::string::npos) << r.err;
  // Corrupt and truncated inputs.
  std::string bytes = read_bytes(st);
  bytes[bytes.size() - 5] ^= 0x01;
  write_bytes(dir.file("corrupt.safetensors"), bytes);
  r = kvcc(dir, "export " + dir.file("corrupt.safetensors") + " --format hdf5 -o " + out);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("checksum mismatch"), std::string::npos) << r.err;
  write_bytes(dir.file("cut.safetensors"), read_bytes(st).substr(0, bytes.size() / 2));
  r = kvcc(dir, "export " + dir.file("cut.safetensors") + " --format hdf5 -o " + out);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("cut.safetensors"), std::string::npos) << r.err;
  EXPECT_FALSE(testing::file_exists(out));
  EXPECT_TRUE(dir.temporaries().empty());
}

}  // namespace
}  // namespace kvcc
