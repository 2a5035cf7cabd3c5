// KVPOP scorers out of and into retain (model/kvpop/scorer_containers.h, checkpoints/export/kvpop_export.h, retain-export):
// exports byte-identical to golden files that gguf.GGUFReader and safetensors read back
// (tests/fixtures/kvpop/make_export_fixture.py), re-exports identical, a GGUF written by
// llama.cpp's gguf.GGUFWriter read to the same values, --init-gates from a GGUF giving the
// same step as from safetensors, --format trimkv refused, wrong containers one-line errors.
#include <gtest/gtest.h>

#include <filesystem>

#include "checkpoints/export/kvpop_export.h"
#include "model/kvpop/scorer_containers.h"
#include "kernels/base/atomic_file.h"
#include "data/formats/gguf.h"
#include "data/formats/safetensors.h"
#include "tests/trainer/train_helpers.h"

namespace retain {
namespace {

using trainer::test::bin;
using trainer::test::bytes_equal;
using trainer::test::Result;
using trainer::test::run;
using trainer::test::TempDir;

const std::string kFix = RETAIN_FIXTURES_DIR;
const std::string kScorers = kFix + "/kvpop/step/scorers.safetensors";
const std::string kGolden = kFix + "/kvpop/export";
const std::string kIdentity = "retain-tests/kvpop-trainer-model";

Qwen3Config model_config() { return Qwen3Config::load(trainer::test::kModel + "/config.json"); }

Result export_(const std::string& args, const TempDir& dir) { return run(bin("retain-export") + " " + args, dir); }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(KvpopExport, GoldenBytesAndRoundTrip) {
  TempDir dir;
  struct C {
    const char* format;
    const char* dtype;
    const char* file;
  };
  for (const C c : {C{"gguf", "f32", "kvpop_f32.gguf"}, C{"gguf", "bf16", "kvpop_bf16.gguf"},
                    C{"safetensors", "bf16", "kvpop_bf16.safetensors"}}) {
    SCOPED_TRACE(c.file);
    const std::string first = dir / (std::string("1_") + c.file), second = dir / (std::string("2_") + c.file);
    Result r = export_("--from " + kScorers + " --model " + trainer::test::kModel + " --base-model " + kIdentity +
                           " --format " + c.format + " --dtype " + c.dtype + " --out " + first,
                       dir);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_TRUE(read_file(first) == read_file(kGolden + "/" + c.file)) << first << " differs from the golden file";
    // An export exported again (→ import → export) is the same file; the identity travels with it.
    r = export_("--from " + first + " --model " + trainer::test::kModel + " --format " + c.format + " --dtype " +
                    c.dtype + " --out " + second,
                dir);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_TRUE(read_file(second) == read_file(first)) << second << " differs from " << first;
  }
}

TEST(KvpopExport, F32ExportsAndLlamaCppsGgufReadToTheSameValues) {
  const formats::SafetensorsFile want = formats::SafetensorsFile::open(kScorers);
  for (const char* f : {"reference_kvpop.gguf", "kvpop_f32.gguf"}) {
    SCOPED_TRACE(f);
    const kvpop::LoadedScorers got = kvpop::load_scorers(kGolden + "/" + f, model_config());
    EXPECT_EQ(got.format, gates::Format::gguf);
    ASSERT_TRUE(got.scorers.geometry().has_value());
    EXPECT_EQ(*got.scorers.geometry(), (kvpop::PolicyGeometry{6, 2, 3}));
    EXPECT_EQ(got.info.base_model, kIdentity);
    const auto named = got.scorers.named_tensors();
    ASSERT_EQ(named.size(), want.names().size());
    for (const auto& [n, t] : named) EXPECT_TRUE(bytes_equal(t, want.tensor(n))) << n;
  }
  // BF16: the same values rounded to BF16.
  const auto bf = kvpop::load_scorers(kGolden + "/kvpop_bf16.safetensors", model_config());
  for (const auto& [n, t] : bf.scorers.named_tensors())
    EXPECT_TRUE(bytes_equal(t, want.tensor(n).to_dtype(DType::BF16).to_dtype(DType::F32))) << n;
}

TEST(KvpopExport, InitGatesFromGgufTrainsAsFromSafetensors) {
  TempDir dir;
  const std::string data = trainer::test::pack_fixture_corpus(dir);
  auto dump = [&](const std::string& init, const std::string& out) {
    const Result r = run(bin("retain-train") + " --model " + trainer::test::kModel + " --data " + data +
                             " --gate kvpop --window 6 --sinks 2 --topk 3 --global-batch 2 --seed 3 --init-gates " +
                             init + " --dump-grads " + out,
                         dir);
    EXPECT_EQ(r.code, 0) << r.err;
    return read_file(out);
  };
  const std::string want = dump(kScorers, dir / "want.safetensors");
  EXPECT_TRUE(dump(kGolden + "/kvpop_f32.gguf", dir / "got.safetensors") == want);
}

// The decay (retain-train --decay-every/--decay-min/--decay-max) through export and import: the
// safetensors' __metadata__ and the GGUF's retention.decay_* (score_version 2) carry it, an
// import restores it exactly, an export of an import is the same file; a file without the keys
// (the golden files) reads as every 1 in [0.999, 0.999999].
TEST(KvpopExport, DecayRoundTrip) {
  TempDir dir;
  const Qwen3Config config = model_config();
  kvpop::Scorers sc = kvpop::Scorers::load(kScorers, config);
  EXPECT_EQ(sc.decay(), kvpop::Decay{});
  EXPECT_EQ(kvpop::load_scorers(kGolden + "/kvpop_f32.gguf", config).scorers.decay(), kvpop::Decay{});
  const kvpop::Decay decay{5, 0.9, 0.9999};
  sc.set_decay(decay);
  const std::string src = dir / "src.safetensors";
  sc.save(src);
  EXPECT_EQ(kvpop::Scorers::load(src, config).decay(), decay);
  for (const char* format : {"safetensors", "gguf"}) {
    SCOPED_TRACE(format);
    const std::string first = dir / (std::string("1.") + format), second = dir / (std::string("2.") + format);
    Result r = export_("--from " + src + " --model " + trainer::test::kModel + " --base-model " + kIdentity +
                           " --format " + format + " --dtype f32 --out " + first,
                       dir);
    ASSERT_EQ(r.code, 0) << r.err;
    const kvpop::LoadedScorers got = kvpop::load_scorers(first, config);
    EXPECT_EQ(got.scorers.decay(), decay);
    const formats::SafetensorsFile want = formats::SafetensorsFile::open(src);
    for (const auto& [n, t] : got.scorers.named_tensors()) EXPECT_TRUE(bytes_equal(t, want.tensor(n))) << n;
    r = export_("--from " + first + " --model " + trainer::test::kModel + " --format " + format +
                    " --dtype f32 --out " + second,
                dir);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_TRUE(read_file(second) == read_file(first)) << second << " differs from " << first;
  }
  const formats::gguf::File g = formats::gguf::read_file(dir / "1.gguf");
  ASSERT_NE(g.find("retention.score_version"), nullptr);
  EXPECT_EQ(std::get<uint64_t>(g.find("retention.score_version")->v), 2u);
  EXPECT_EQ(std::get<uint64_t>(g.find("retention.decay_every")->v), 5u);
  EXPECT_EQ(std::get<double>(g.find("retention.decay_min")->v), 0.9);
  EXPECT_EQ(formats::SafetensorsFile::open(dir / "1.safetensors").metadata().at("decay_every"), "5");
  // A bad decay in a file is one error naming the file and the key.
  std::map<std::string, std::string> meta = {{"decay_every", "0"}};
  EXPECT_NE(error_of([&] { kvpop::decay_from_metadata("f.safetensors", meta); }).find("f.safetensors: __metadata__ decay_every must be at least 1, got 0"),
            std::string::npos);
  meta = {{"decay_min", "x"}};
  EXPECT_NE(error_of([&] { kvpop::decay_from_metadata("f.safetensors", meta); }).find("decay_min = 'x' is not a number"),
            std::string::npos);
}

TEST(KvpopExport, RefusalsAreOneLineErrors) {
  TempDir dir;
  Result r = export_("--from " + kScorers + " --model " + trainer::test::kModel + " --format trimkv --out " +
                         (dir / "tk"),
                     dir);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("--format trimkv: " + kScorers + " holds kvpop scorers"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir / "tk"));
  // A retention-gate GGUF or a .pth is not a scorer container.
  const std::string gates_gguf = kFix + "/export/golden/trimkv_tied_gqa2.gguf";
  EXPECT_EQ(error_of([&] { kvpop::load_scorers(gates_gguf, model_config()); }),
            gates_gguf + ": not a kvpop GGUF adapter (general.type 'adapter', adapter.type 'retention_gate')");
  const std::string pth = kFix + "/export/torch/plain.pth";
  EXPECT_NE(error_of([&] { kvpop::load_scorers(pth, model_config()); }).find("not kvpop scorers"),
            std::string::npos);
  EXPECT_FALSE(kvpop::holds_kvpop(gates_gguf));
  EXPECT_TRUE(kvpop::holds_kvpop(kGolden + "/reference_kvpop.gguf"));
}

}  // namespace
}  // namespace retain
