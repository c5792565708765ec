// Zoo model cards (README.md per entry): written by publish with the hub's front matter and the
// entry's method, bits, windows and measured quality (numbers taken from the attached validation
// report, formatted here independently); `zoo verify` reports a missing or stale card; an
// identical re-publish with --replace rewrites the card and nothing else; replaced entries take
// their card along; the tracked zoo/published cards are current.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "formats/artifact.h"
#include "formats/sha256.h"
#include "formats_test_util.h"
#include "zoo/zoo.h"

namespace kvcc {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::read_bytes;
using testing::ScratchDir;
using testing::write_bytes;

struct Cards : ::testing::Test {
  fs::path dir, zoo;
  ModelConfig c = testing::small_config();
  ModelFingerprint fp = testing::small_fingerprint(c);
  void SetUp() override {
    dir = fs::temp_directory_path() / ("kvcc_test_zoo_cards_" + std::to_string(::getpid()) + "_" +
                                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
    zoo = dir / "zoo";
  }
  void TearDown() override { fs::remove_all(dir); }
  std::string artifact(const std::string& name, uint64_t seed, const std::string& model_id = "small-test") {
    Artifact a = testing::random_artifact(c, fp, seed);
    a.model_id = model_id;
    const std::string p = (dir / name).string();
    write_artifact(a, p);
    return p;
  }
  std::string card_of(const zoo::ZooEntry& e) { return read_bytes((zoo / zoo::model_card_path(e)).string()); }
};

std::string fmt(const char* f, double v) {
  char buf[48];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

TEST_F(Cards, PublishWritesTheCardWithFrontMatterAndQuality) {
  zoo::PublishOptions o;
  o.validation = {{"mode", "pseudo-decode"},
                  {"tokens", 4096},
                  {"documents", 3},
                  {"reference", {{"perplexity", 22.320117}}},
                  {"schemes",
                   {{{"name", "small.oscar"},
                     {"method", "oscar"},
                     {"cache", "codec"},
                     {"perplexity", 22.513731},
                     {"ppl_rel_change", 0.0086744},
                     {"ppl_rel_change_stderr", 0.0016156},
                     {"kl", 0.0091804},
                     {"kl_stderr", 0.0019102},
                     {"top1_agreement", 0.946005},
                     {"effective_bits", 2.595764}},
                    {{"name", "small.hadamard"}, {"method", "hadamard"}, {"kl", 0.5}}}}};
  const zoo::PublishResult r = zoo::publish(artifact("a.kvcc.h5", 1), zoo.string(), o);
  const std::string card = card_of(r.entry);
  EXPECT_EQ(card.rfind("---\nbase_model: \"small-test\"\nlibrary_name: kvcc\ntags:\n- kvcc\n", 0), 0u) << card;
  EXPECT_NE(card.find("\n- \"oscar\"\n- \"int2\"\n---\n"), std::string::npos) << card;
  const Recipe& rec = read_artifact((dir / "a.kvcc.h5").string()).recipe;
  EXPECT_NE(card.find("| windows | BF16 sink " + std::to_string(rec.sink) + " tokens, BF16 recent " +
                      std::to_string(rec.recent) + " tokens |"),
            std::string::npos)
      << card;
  EXPECT_NE(card.find("| page size | " + std::to_string(rec.page_size) + " tokens |"), std::string::npos);
  EXPECT_NE(card.find("| key / value bits | 2 / 2 (nominal 2.000) |"), std::string::npos) << card;
  // The oscar row carries the report's numbers; the other method's row is not this entry's.
  EXPECT_NE(card.find("| small.oscar | codec | 22.5137 | " + fmt("%.5f", 0.0086744) + " ± " + fmt("%.5f", 0.0016156) +
                      " | " + fmt("%.5f", 0.0091804) + " ± " + fmt("%.5f", 0.0019102) + " | 0.9460 | 2.596 |"),
            std::string::npos)
      << card;
  EXPECT_EQ(card.find("small.hadamard"), std::string::npos);
  EXPECT_NE(card.find("BF16 reference 22.3201"), std::string::npos);
  EXPECT_TRUE(zoo::verify_zoo(zoo.string()).ok());
}

TEST_F(Cards, AbsentQualityIsSaidNotInvented) {
  const zoo::PublishResult r = zoo::publish(artifact("a.kvcc.h5", 1), zoo.string(), {});
  EXPECT_NE(card_of(r.entry).find("No measured quality"), std::string::npos);
  zoo::PublishOptions o;
  o.validation = {{"perplexity", 12.5}};  // a report without results per scheme
  const zoo::PublishResult r2 = zoo::publish(artifact("b.kvcc.h5", 2, "other-model"), zoo.string(), o);
  const std::string card = card_of(r2.entry);
  EXPECT_NE(card.find("holds no result for method `oscar`"), std::string::npos) << card;
  EXPECT_EQ(card.find("12.5"), std::string::npos);
}

TEST_F(Cards, VerifyNoticesMissingAndStaleCardsAndRepublishRewritesOnlyTheCard) {
  zoo::PublishOptions o;
  o.notes = "notes with `code` | pipes\nand lines";
  o.validation = {{"schemes", json::array()}};
  const std::string a = artifact("a.kvcc.h5", 1);
  const zoo::PublishResult r = zoo::publish(a, zoo.string(), o);
  const fs::path card = zoo / zoo::model_card_path(r.entry);
  const std::string good = read_bytes(card.string());
  const std::string index_before = read_bytes((zoo / zoo::kIndexName).string());
  const fs::path art = zoo / r.entry.file("artifact")->path;
  const std::string art_before = read_bytes(art.string());

  fs::remove(card);
  zoo::VerifyReport v = zoo::verify_zoo(zoo.string());
  ASSERT_EQ(v.missing.size(), 1u);
  EXPECT_EQ(v.missing[0], zoo::model_card_path(r.entry) + " (" + r.entry.id + "): model card");
  write_bytes(card.string(), good + "edited\n");
  v = zoo::verify_zoo(zoo.string());
  ASSERT_EQ(v.corrupt.size(), 1u);
  EXPECT_NE(v.corrupt[0].find("stale model card"), std::string::npos);
  EXPECT_TRUE(v.extra.empty());

  // Without --replace the duplicate is refused as before; with it, only the card is rewritten.
  EXPECT_THROW(zoo::publish(a, zoo.string(), o), Error);
  o.replace = true;
  const zoo::PublishResult again = zoo::publish(a, zoo.string(), o);
  EXPECT_TRUE(again.unchanged);
  EXPECT_EQ(read_bytes(card.string()), good);
  EXPECT_EQ(read_bytes((zoo / zoo::kIndexName).string()), index_before);
  EXPECT_EQ(read_bytes(art.string()), art_before);
  EXPECT_TRUE(zoo::verify_zoo(zoo.string()).ok());
  // Other notes make it a real replacement (a new revision and a new card).
  o.notes = "new notes";
  const zoo::PublishResult changed = zoo::publish(a, zoo.string(), o);
  EXPECT_FALSE(changed.unchanged);
  EXPECT_NE(read_bytes(card.string()), good);
  EXPECT_TRUE(zoo::verify_zoo(zoo.string()).ok());
}

TEST_F(Cards, ReplacedEntryTakesItsCardAndFolderAlong) {
  const std::string a = artifact("a.kvcc.h5", 1);
  const zoo::PublishResult r = zoo::publish(a, zoo.string(), {});
  // The same model under another model id: a second entry, each folder with its card.
  Artifact renamed = read_artifact(a);
  renamed.model_id = "renamed";
  write_artifact(renamed, (dir / "b.kvcc.h5").string());
  zoo::publish((dir / "b.kvcc.h5").string(), zoo.string(), {});
  EXPECT_TRUE(fs::exists(zoo / "renamed" / r.entry.recipe_tag / zoo::kModelCardName));
  EXPECT_TRUE(fs::exists(zoo / zoo::model_card_path(r.entry)));
  // A different model under the first id replaces it and its folder goes, card included.
  ModelConfig other = c;
  other.n_layers = 2;
  Artifact moved = testing::random_artifact(other, testing::small_fingerprint(other, "other"), 9);
  moved.model_id = "small-test";
  moved.recipe.value_target = "p2";  // another recipe tag, so the old folder is no longer used
  write_artifact(moved, (dir / "c.kvcc.h5").string());
  zoo::PublishOptions o;
  o.replace = true;
  const zoo::PublishResult m = zoo::publish((dir / "c.kvcc.h5").string(), zoo.string(), o);
  ASSERT_EQ(m.replaced, std::vector<std::string>{r.entry.id});
  EXPECT_FALSE(fs::exists(zoo / r.entry.model_id / r.entry.recipe_tag));
  EXPECT_TRUE(fs::exists(zoo / zoo::model_card_path(m.entry)));
  EXPECT_TRUE(zoo::verify_zoo(zoo.string()).ok());
}

TEST_F(Cards, HubMetadataWhenKnown) {
  const zoo::PublishResult plain = zoo::publish(artifact("a.kvcc.h5", 1), zoo.string(), {});
  EXPECT_FALSE(zoo::entry_to_json(plain.entry).contains("base_model"));  // indexes stay as they were
  EXPECT_EQ(card_of(plain.entry).find("license:"), std::string::npos);
  zoo::PublishOptions o;
  o.base_model = "karpathy/tinyllamas";
  o.license = "mit";
  const zoo::PublishResult r = zoo::publish(artifact("b.kvcc.h5", 2, "stories"), zoo.string(), o);
  EXPECT_EQ(
      card_of(r.entry).rfind("---\nbase_model: \"karpathy/tinyllamas\"\nlibrary_name: kvcc\nlicense: \"mit\"\n", 0), 0u)
      << card_of(r.entry);
  const zoo::Index index = zoo::read_index(zoo.string());
  const zoo::ZooEntry& back = *index.find(r.entry.id);
  EXPECT_EQ(back.base_model, "karpathy/tinyllamas");
  EXPECT_EQ(back.license, "mit");
  EXPECT_TRUE(zoo::verify_zoo(zoo.string()).ok());
  o.base_model = "a\nb: c";
  EXPECT_THROW(zoo::publish(artifact("c.kvcc.h5", 3, "third"), zoo.string(), o), Error);
  o.base_model = "";
  o.license = "MIT License";
  EXPECT_THROW(zoo::publish(artifact("c.kvcc.h5", 3, "third"), zoo.string(), o), Error);
}

// The tracked zoo's cards are the ones its index renders (regenerate: docs/zoo.md).
TEST(ZooCardsPublished, TrackedCardsAreCurrent) {
  const std::string published = std::string(KVCC_SOURCE_DIR) + "/zoo/published";
  const zoo::VerifyReport v = zoo::verify_zoo(published);
  EXPECT_TRUE(v.missing.empty()) << v.missing[0];
  EXPECT_TRUE(v.corrupt.empty()) << v.corrupt[0];
  EXPECT_TRUE(v.ok());
  for (const zoo::ZooEntry& e : zoo::read_index(published).entries) {
    const std::string card = read_bytes(published + "/" + zoo::model_card_path(e));
    EXPECT_NE(card.find("## Measured quality\n\nFrom the attached `kvcc validate` report"), std::string::npos) << e.id;
  }
}

}  // namespace
}  // namespace kvcc
