// Gates out of and into retain (checkpoints/export): torch.save archives, GGUF, safetensors, the
// TRIM-KV authors' directory. The references are files written or read by programs nobody on
// the team wrote (tests/fixtures/export/make_fixtures.py): PyTorch's torch.save (its pickle
// byte for byte, strided views, shared storages), llama.cpp's gguf.GGUFWriter, and the authors'
// package, whose gated forward over an exported directory gives the logits retain-forward must
// reproduce. Exports are deterministic (golden bytes) and round-trip byte-identically; damaged
// inputs of every format are one-line errors.
#include <gtest/gtest.h>

#include <zip.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include "checkpoints/export/gate_export.h"
#include "data/formats/gguf.h"
#include "data/formats/torch_file.h"
#include "data/formats/torch_pickle.h"
#include "kernels/base/atomic_file.h"
#include "model/config.h"
#include "data/formats/safetensors.h"
#include "tests/trainer/train_helpers.h"

namespace retain {
namespace {

namespace fs = std::filesystem;
using trainer::test::bin;
using trainer::test::bytes_equal;
using trainer::test::Result;
using trainer::test::run;
using trainer::test::TempDir;

const std::string kFix = RETAIN_FIXTURES_DIR;
const std::string kExport = kFix + "/export";

Qwen3Config model_config(const std::string& hf) { return Qwen3Config::load(kFix + "/hf/" + hf + "/config.json"); }

std::string zip_record(const std::string& path, const std::string& suffix) {
  int err = 0;
  zip_t* z = zip_open(path.c_str(), ZIP_RDONLY, &err);
  EXPECT_NE(z, nullptr) << path;
  std::string out;
  for (zip_int64_t i = 0; z && i < zip_get_num_entries(z, 0); ++i) {
    const std::string name = zip_get_name(z, static_cast<zip_uint64_t>(i), 0);
    if (name.size() < suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    zip_stat_t st;
    zip_stat_index(z, static_cast<zip_uint64_t>(i), 0, &st);
    zip_file_t* f = zip_fopen_index(z, static_cast<zip_uint64_t>(i), 0);
    out.resize(st.size);
    EXPECT_EQ(zip_fread(f, out.data(), st.size), static_cast<zip_int64_t>(st.size));
    zip_fclose(f);
  }
  if (z) zip_discard(z);
  return out;
}

// A file or a directory's files, byte for byte.
void expect_same_bytes(const std::string& a, const std::string& b) {
  if (fs::is_directory(a)) {
    ASSERT_TRUE(fs::is_directory(b)) << b;
    std::set<std::string> na, nb;
    for (const auto& e : fs::directory_iterator(a)) na.insert(e.path().filename().string());
    for (const auto& e : fs::directory_iterator(b)) nb.insert(e.path().filename().string());
    ASSERT_EQ(na, nb) << a << " vs " << b;
    for (const std::string& n : na) expect_same_bytes(a + "/" + n, b + "/" + n);
    return;
  }
  EXPECT_TRUE(read_file(a) == read_file(b)) << a << " and " << b << " differ";
}

// ---- torch.save archives --------------------------------------------------------------------

TEST(TorchFile, ReadsWhatPyTorchWrote) {
  for (const char* name : {"mixed", "plain", "single", "many"}) {
    SCOPED_TRACE(name);
    const auto got = formats::torchfile::read_torch_file(kExport + "/torch/" + name + ".pth");
    const formats::SafetensorsFile want = formats::SafetensorsFile::open(kExport + "/torch/" + name + ".expected.safetensors");
    ASSERT_EQ(got.size(), want.names().size());
    for (const auto& [n, t] : got) {
      ASSERT_TRUE(want.contains(n)) << n;
      EXPECT_TRUE(bytes_equal(t, want.tensor(n))) << n << ": " << shape_str(t.shape()) << " " << dtype_name(t.dtype());
    }
  }
  // dict order is kept (the first and last keys of mixed.pth)
  const auto mixed = formats::torchfile::read_torch_file(kExport + "/torch/mixed.pth");
  EXPECT_EQ(mixed.front().first, "bf16.weight");
  EXPECT_EQ(mixed.back().first, "empty");
}

// The pickle retain writes is PyTorch's, byte for byte (memo numbering, SETITEM/SETITEMS
// batches, BININT widths, a 5-dimension MARK…TUPLE), and the archive reads back unchanged.
TEST(TorchFile, WritesPyTorchsPickleByteForByte) {
  TempDir dir;
  for (const char* name : {"plain", "single", "many"}) {
    SCOPED_TRACE(name);
    const std::string theirs = kExport + "/torch/" + std::string(name) + ".pth";
    const auto tensors = formats::torchfile::read_torch_file(theirs);
    const std::string ours = dir / (std::string(name) + ".pth");
    formats::torchfile::write_torch_file(ours, tensors);
    EXPECT_TRUE(zip_record(ours, "/data.pkl") == zip_record(theirs, "/data.pkl"));
    EXPECT_EQ(zip_record(ours, "/version"), zip_record(theirs, "/version"));
    EXPECT_EQ(zip_record(ours, "/byteorder"), "little");
    const auto back = formats::torchfile::read_torch_file(ours);
    ASSERT_EQ(back.size(), tensors.size());
    for (size_t i = 0; i < back.size(); ++i) {
      EXPECT_EQ(back[i].first, tensors[i].first);
      EXPECT_TRUE(bytes_equal(back[i].second, tensors[i].second)) << back[i].first;
    }
    // Deterministic: the same tensors give the same bytes.
    formats::torchfile::write_torch_file(dir / "again.pth", tensors);
    // The archive folder is named after the file, so compare under one name.
    formats::torchfile::write_torch_file(dir / "x.pth", tensors);
    const std::string first = read_file(dir / "x.pth");
    formats::torchfile::write_torch_file(dir / "x.pth", tensors);
    EXPECT_TRUE(read_file(dir / "x.pth") == first);
  }
}

std::string pickle_error(const std::string& bytes) {
  try {
    formats::torchfile::parse_state_dict(bytes, "test.pkl");
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    return msg;
  }
  return "no error";
}

// Pickle bytes: PROTO 2, then the given opcodes.
std::string pk(const std::string& body) {
  std::string out("\x80\x02", 2);
  out.append(body);
  return out;
}
std::string binunicode(const std::string& s) {
  std::string out = "X";
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((s.size() >> (8 * i)) & 0xff));
  out.append(s);
  return out;
}

// Nothing in a pickle is executed: any global beyond the tensor-rebuild allow-list, any other
// opcode, and any non-tensor value is refused with one line.
TEST(TorchFile, RefusesAnythingButAStateDict) {
  // A list or dict put into itself through the memo (a fuzzer's finding: the shared_ptr cycle
  // leaked): EMPTY_LIST BINPUT 0 BINGET 0 APPEND; EMPTY_DICT BINPUT 0 BINUNICODE BINGET 0 SETITEM.
  EXPECT_NE(pickle_error(pk(std::string("]q\x00h\x00" "a.", 6))).find("a list that contains itself"), std::string::npos);
  EXPECT_NE(pickle_error(pk(std::string("}q\x00", 3).append(binunicode("k")).append(std::string("h\x00s.", 4)))).find("a dict that contains itself"),
            std::string::npos);
  EXPECT_NE(pickle_error(pk(std::string("cos\nsystem\n").append(binunicode("ls")).append("\x85R."))).find("global 'os.system' is not allowed"),
            std::string::npos);
  EXPECT_NE(pickle_error(pk("cbuiltins\neval\n.")).find("not allowed"), std::string::npos);
  EXPECT_NE(pickle_error(pk(std::string("}").append(binunicode("a")).append("K\x05s."))).find("'a' is a int, not a tensor"), std::string::npos);
  EXPECT_NE(pickle_error(pk("].")).find("holds a list, not a dict"), std::string::npos);
  EXPECT_NE(pickle_error(pk("}")).find("truncated"), std::string::npos);
  EXPECT_NE(pickle_error(pk("}X\xff\xff\xff\x7f")).find("runs past the end"), std::string::npos);
  EXPECT_NE(pickle_error(pk("}}.")).find("STOP with 2 values"), std::string::npos);
  EXPECT_NE(pickle_error(pk("I1\n.")).find("unsupported pickle opcode 0x49"), std::string::npos);
  EXPECT_NE(pickle_error(pk("h\x07")).find("memo entry 7 was never stored"), std::string::npos);
  EXPECT_NE(pickle_error(std::string("\x80\x09}.", 4)).find("pickle protocol 9"), std::string::npos);
  EXPECT_NE(pickle_error(pk("ccollections\nOrderedDict\n)R.")).find("no error"), std::string::npos);  // an empty dict is fine
}

// ---- gates from every container ---------------------------------------------------------------

std::map<std::string, Tensor> gate_fixture(const std::string& c, DType as) {
  const formats::SafetensorsFile f = formats::SafetensorsFile::open(kFix + "/gates/" + c + "/gates.safetensors");
  std::map<std::string, Tensor> out;
  for (const std::string& n : f.names()) out[n] = f.tensor(n).to_dtype(as).to_dtype(DType::F32);
  return out;
}

void expect_gates_equal(const gates::RetentionGates& g, const std::map<std::string, Tensor>& want) {
  size_t n = 0;
  for (const auto& [name, t] : g.named_tensors()) {
    ASSERT_TRUE(want.count(name)) << name;
    EXPECT_TRUE(bytes_equal(t, want.at(name))) << name;
    ++n;
  }
  EXPECT_EQ(n, want.size());
}

TEST(GateImport, TorchSaveGatesLoad) {
  const auto a = gates::load_gates(kExport + "/torch/trimkv_tied_gqa2_bf16.pth", model_config("tied_gqa2_bf16"));
  EXPECT_EQ(a.format, gates::Format::pth);
  EXPECT_EQ(a.gates.kind(), gates::GateKind::trimkv);
  expect_gates_equal(a.gates, gate_fixture("trimkv_tied_gqa2_f32", DType::BF16));
  // The authors' way: their model's state_dict, DBTrimKV's tied tensors sharing one storage.
  const auto b = gates::load_gates(kExport + "/torch/dbtrimkv_mha_published.pth", model_config("mha_f16_oldstyle"));
  EXPECT_EQ(b.gates.kind(), gates::GateKind::dbtrimkv);
  expect_gates_equal(b.gates, gate_fixture("dbtrimkv_mha_f16", DType::F32));
}

TEST(GateImport, GgufWrittenByLlamaCppsWriterLoads) {
  const auto g = gates::load_gates(kExport + "/gguf/reference_trimkv.gguf", model_config("tied_gqa2_bf16"));
  EXPECT_EQ(g.format, gates::Format::gguf);
  auto want = gate_fixture("trimkv_tied_gqa2_f32", DType::F32);
  for (auto& [n, t] : want)  // the reference stores fc1.weight as F16
    if (n.ends_with("linear1.weight")) t = t.to_dtype(DType::F16).to_dtype(DType::F32);
  expect_gates_equal(g.gates, want);
  EXPECT_EQ(g.info.memory, 512.0);
  EXPECT_EQ(g.gates.bias_init(), 18.0);
  EXPECT_EQ(g.info.base_model, "retain-tests/tied_gqa2_bf16");
}

TEST(GateImport, EveryGoldenExportLoadsBack) {
  struct C {
    const char* file;
    const char* model;
    const char* gates;
    DType dtype;
  };
  for (const C& c : {C{"trimkv_tied_gqa2", "tied_gqa2_bf16", "trimkv_tied_gqa2_f32", DType::F32},
                     C{"dbtrimkv_mha", "mha_f16_oldstyle", "dbtrimkv_mha_f16", DType::F32},
                     C{"trimkv_tied_gqa2.gguf", "tied_gqa2_bf16", "trimkv_tied_gqa2_f32", DType::BF16},
                     C{"dbtrimkv_mha.gguf", "mha_f16_oldstyle", "dbtrimkv_mha_f16", DType::F32},
                     C{"dbtrimkv_mha.safetensors", "mha_f16_oldstyle", "dbtrimkv_mha_f16", DType::BF16}}) {
    SCOPED_TRACE(c.file);
    const auto g = gates::load_gates(kExport + "/golden/" + c.file, model_config(c.model));
    expect_gates_equal(g.gates, gate_fixture(c.gates, c.dtype));
    EXPECT_EQ(g.info.base_model, std::string("retain-tests/") + c.model);
    EXPECT_EQ(g.info.base_config_sha256.size(), 64u);
  }
}

TEST(GateImport, ShapeMismatchNamesTheTensor) {
  try {
    gates::load_gates(kExport + "/torch/trimkv_tied_gqa2_bf16.pth", model_config("mha_f16_oldstyle"));
    FAIL() << "gates for another model were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'model.layers.0.self_attn.retention_gate.linear2.weight' has shape"),
              std::string::npos)
        << e.what();
  }
}

// Damage anywhere in any container — truncation at every length, random byte changes — is
// either harmless (a changed value) or one retain::Error line: never a crash (also under ASan).
TEST(GateImport, DamagedFilesAreOneLineErrors) {
  TempDir dir;
  std::mt19937 rng(5);
  for (const char* f : {"torch/trimkv_tied_gqa2_bf16.pth", "golden/trimkv_tied_gqa2.gguf", "golden/dbtrimkv_mha.safetensors"}) {
    SCOPED_TRACE(f);
    const std::string good = read_file(kExport + "/" + f);
    const Qwen3Config cfg = model_config(std::string(f).find("mha") != std::string::npos ? "mha_f16_oldstyle" : "tied_gqa2_bf16");
    const std::string path = dir / fs::path(f).filename().string();
    int errors = 0, tries = 0;
    auto attempt = [&](const std::string& bytes) {
      write_file_atomic(path, bytes);
      ++tries;
      try {
        gates::load_gates(path, cfg);
      } catch (const Error& e) {
        ++errors;
        EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
      }
    };
    for (size_t len = 0; len < good.size(); len += 1 + good.size() / 41) attempt(good.substr(0, len));
    for (int k = 0; k < 60; ++k) {
      std::string bad = good;
      for (int flips = 1 + static_cast<int>(rng() % 3); flips > 0; --flips)
        bad[rng() % bad.size()] = static_cast<char>(rng());
      attempt(bad);
    }
    EXPECT_GE(errors, 41) << "every truncation is an error (" << tries << " tries)";
  }
}

// A TRIM-KV directory whose config.json is damaged or names another gate type.
TEST(GateImport, DamagedTrimkvDirectoryIsOneLineError) {
  TempDir dir;
  const std::string d = dir / "tk";
  fs::create_directory(d);
  fs::copy_file(kExport + "/golden/trimkv_tied_gqa2/trimkv_weights.pth", d + "/trimkv_weights.pth");
  const std::string cfg = read_file(kExport + "/golden/trimkv_tied_gqa2/config.json");
  auto error_of = [&](const std::string& config_text) {
    write_file_atomic(d + "/config.json", config_text);
    try {
      gates::load_gates(d, model_config("tied_gqa2_bf16"));
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error_of(cfg), "no error");
  EXPECT_NE(error_of(cfg.substr(0, cfg.size() / 2)).find("config.json: not valid JSON"), std::string::npos);
  std::string rg7 = cfg;
  rg7.replace(rg7.find("\"rg\""), 4, "\"rg7\"");
  EXPECT_NE(error_of(rg7).find("retention_gate \"rg7\""), std::string::npos);
  std::string rg10 = cfg;
  rg10.replace(rg10.find("\"rg\""), 4, "\"rg10\"");
  EXPECT_NE(error_of(rg10).find("gate_kind dbtrimkv but the tensors are trimkv gates"), std::string::npos);
  fs::remove(d + "/config.json");
  try {
    gates::load_gates(d, model_config("tied_gqa2_bf16"));
    ADD_FAILURE() << "a TRIM-KV directory without config.json was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("config.json: cannot read"), std::string::npos) << e.what();
  }
}

// ---- retain-export -----------------------------------------------------------------------------

struct Golden {
  const char* gates;
  const char* model;
  const char* format;
  const char* dtype;
  const char* out;
};
const Golden kGolden[] = {
    {"trimkv_tied_gqa2_f32", "tied_gqa2_bf16", "trimkv", "f32", "trimkv_tied_gqa2"},
    {"dbtrimkv_mha_f16", "mha_f16_oldstyle", "trimkv", "f32", "dbtrimkv_mha"},
    {"trimkv_tied_gqa2_f32", "tied_gqa2_bf16", "gguf", "bf16", "trimkv_tied_gqa2.gguf"},
    {"dbtrimkv_mha_f16", "mha_f16_oldstyle", "gguf", "f32", "dbtrimkv_mha.gguf"},
    {"dbtrimkv_mha_f16", "mha_f16_oldstyle", "safetensors", "bf16", "dbtrimkv_mha.safetensors"},
};

Result export_(const std::string& args, const TempDir& dir) { return run(bin("retain-export") + " " + args, dir); }

// retain-export writes exactly the files the reference readers checked (make_fixtures.py), and
// exporting an export again (→ import → export) gives the same bytes.
TEST(Export, GoldenBytesAndRoundTrip) {
  TempDir dir;
  for (const Golden& g : kGolden) {
    SCOPED_TRACE(g.out);
    const std::string model = kFix + "/hf/" + g.model;
    const std::string first = dir / (std::string("1_") + g.out);
    Result r = export_(std::string("--from ") + kFix + "/gates/" + g.gates + "/gates.safetensors --model " + model +
                           " --base-model retain-tests/" + g.model + " --format " + g.format + " --dtype " + g.dtype +
                           " --out " + first,
                       dir);
    ASSERT_EQ(r.code, 0) << r.err;
    expect_same_bytes(first, kExport + "/golden/" + g.out);
    const std::string second = dir / (std::string("2_") + g.out);
    r = export_("--from " + first + " --model " + model + " --format " + g.format + " --dtype " + g.dtype + " --out " +
                    second,
                dir);
    ASSERT_EQ(r.code, 0) << r.err;
    expect_same_bytes(second, first);
  }
}

// The authors' package loaded the exported directories (make_fixtures.py) and ran its gated
// forward; retain-forward --gates DIR gives the same logits.
TEST(Export, AuthorsForwardEqualsRetainForward) {
  TempDir dir;
  for (const auto& [name, model] : {std::pair{"trimkv_tied_gqa2", "tied_gqa2_bf16"}, std::pair{"dbtrimkv_mha", "mha_f16_oldstyle"}}) {
    SCOPED_TRACE(name);
    const formats::SafetensorsFile want = formats::SafetensorsFile::open(kExport + "/golden/" + name + ".authors_logits.safetensors");
    auto list = [](const Tensor& t) {
      std::string s;
      for (int64_t i = 0; i < t.numel(); ++i) {
        if (i) s.push_back(' ');
        s.append(std::to_string(t.data<int64_t>()[i]));
      }
      return s;
    };
    const std::string out = dir / (std::string(name) + ".safetensors");
    const Result r = run(bin("retain-forward") + " --model " + kFix + "/hf/" + model + " --gates " + kExport +
                             "/golden/" + name + " --ids \"" + list(want.tensor("input_ids")) + "\" --doc-ids \"" +
                             list(want.tensor("doc_ids")) + "\" --out " + out,
                         dir);
    ASSERT_EQ(r.code, 0) << r.err;
    const double e = trainer::test::rel_diff(formats::SafetensorsFile::open(out).tensor("logits"), want.tensor("logits"));
    EXPECT_LE(e, 1e-4);
    RecordProperty(name, std::to_string(e));
  }
}

// retain-train --dump-grads from the trainer fixture's model and the packed corpus `data`, its gates
// --init-gates `init` (`gate` the --gate value and its options): the dump file's bytes.
std::string dump_grads(const std::string& data, const std::string& gate, const std::string& init,
                       const std::string& out, const TempDir& dir) {
  const Result r = run(bin("retain-train") + " --model " + trainer::test::kModel + " --data " + data + " --gate " +
                           gate + " --init-gates " + init + " --dump-grads " + out +
                           " --memory 4 --global-batch 2 --seed 3",
                       dir);
  EXPECT_EQ(r.code, 0) << r.err;
  return read_file(out);
}

// retain-export of `src` (gates for the trainer fixture's model) as `fmt`, in float32.
Result export_f32(const std::string& src, const std::string& fmt, const std::string& out, const TempDir& dir) {
  return export_("--from " + src + " --model " + trainer::test::kModel + " --format " + fmt + " --dtype f32 --out " + out,
                 dir);
}

// retain-train --init-gates takes every container: a .pth and a TRIM-KV directory exported from
// the trainer fixture's gates give the same --dump-grads file as the safetensors original.
TEST(Export, TrainInitGatesFromEveryContainer) {
  TempDir dir;
  const std::string data = trainer::test::pack_fixture_corpus(dir);
  const std::string src = trainer::test::kFixtures + "/gates-dbtrimkv.safetensors";
  auto dump = [&](const std::string& init, const std::string& out) { return dump_grads(data, "dbtrimkv", init, out, dir); };
  const std::string want = dump(src, dir / "want.safetensors");
  for (const char* fmt : {"trimkv", "gguf"}) {
    const std::string out = dir / (std::string("x.") + fmt);
    const Result r = export_f32(src, fmt, out, dir);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_TRUE(dump(out, dir / (std::string("got_") + fmt + ".safetensors")) == want) << fmt;
  }
  EXPECT_TRUE(dump(dir / "x.trimkv/trimkv_weights.pth", dir / "got_pth.safetensors") == want);
}

// The ablation gates of tests/fixtures/trainer — the linear gate (G = 0, gates-trimkv-linear) and
// dbtrimkv gates reading [k ‖ v] (gates-dbtrimkv-kv): safetensors and GGUF exports read back bit for
// bit, with the same kind of gate, and give the same --dump-grads; the authors' directory, which has
// neither, is a one-line refusal that leaves nothing behind.
TEST(Export, AblationGatesRoundTripAndTheAuthorsLayoutRefusesThem) {
  TempDir dir;
  const std::string data = trainer::test::pack_fixture_corpus(dir);
  const Qwen3Config config = Qwen3Config::load(trainer::test::kModel + "/config.json");
  struct Case {
    const char *file, *kind, *args, *refusal;
  };
  for (const Case& c : {Case{"trimkv-linear", "trimkv", "", "has no linear gate"},
                        Case{"dbtrimkv-kv", "dbtrimkv", " --gate-input kv", "has no gate reading [k ‖ v]"}}) {
    SCOPED_TRACE(c.file);
    const std::string src = trainer::test::kFixtures + "/gates-" + c.file + ".safetensors";
    const gates::RetentionGates want_gates = gates::RetentionGates::load(src, config);
    auto dump = [&](const std::string& init, const std::string& out) {
      return dump_grads(data, std::string(c.kind) + c.args, init, out, dir);
    };
    const std::string want = dump(src, dir / "want.safetensors");
    for (const char* fmt : {"safetensors", "gguf"}) {
      const std::string out = dir / (std::string(c.file) + "." + fmt);
      const Result r = export_f32(src, fmt, out, dir);
      ASSERT_EQ(r.code, 0) << r.err;
      const gates::RetentionGates back = gates::load_gates(out, config).gates;
      EXPECT_EQ(back.is_linear(), want_gates.is_linear()) << fmt;
      EXPECT_EQ(back.reads_kv(), want_gates.reads_kv()) << fmt;
      ASSERT_EQ(back.parameters().size(), want_gates.parameters().size()) << fmt;
      for (size_t i = 0; i < back.parameters().size(); ++i)
        EXPECT_TRUE(bytes_equal(back.parameters()[i].value, want_gates.parameters()[i].value))
            << fmt << " " << back.parameters()[i].name();
      EXPECT_TRUE(dump(out, dir / (std::string("got_") + fmt + ".safetensors")) == want) << fmt;
    }
    const Result r = export_("--from " + src + " --model " + trainer::test::kModel + " --format trimkv --out " +
                                 (dir / "authors"),
                             dir);
    EXPECT_EQ(r.code, 1) << r.err;
    EXPECT_NE(r.err.find(c.refusal), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    for (const auto& e : fs::directory_iterator(dir.path()))
      EXPECT_EQ(e.path().filename().string().find("authors"), std::string::npos) << e.path();
  }
}

TEST(Export, BadInvocationsAreOneLineErrors) {
  TempDir dir;
  const std::string gates = kFix + "/gates/trimkv_tied_gqa2_f32/gates.safetensors";
  const std::string model = kFix + "/hf/tied_gqa2_bf16";
  auto expect = [&](const std::string& args, int code, const std::string& needle) {
    const Result r = export_(args, dir);
    EXPECT_EQ(r.code, code) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << args << "\n" << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  };
  expect("--from " + gates + " --model " + model + " --format onnx --out " + (dir / "x"), 2, "--format must be");
  expect("--from " + gates + " --model " + model + " --format gguf --dtype f16 --out " + (dir / "x"), 2, "--dtype");
  expect("--from " + (dir / "missing") + " --format gguf --out " + (dir / "x"), 1, "no such file");
  expect("--from " + gates + " --format gguf --out " + (dir / "x"), 1, "cannot tell the base model");
  expect("--from " + gates + " --model " + kFix + "/hf/mha_f16_oldstyle --format gguf --out " + (dir / "x"), 1,
         "retention_gate.linear2.weight' has shape [2, 16], expected [4, 16]");
  expect("--from " + gates + " --model " + model + " --format gguf --out " + (dir / "nofolder/x.gguf"), 1,
         "does not exist");
  write_file_atomic(dir / "exists.gguf", "x");
  expect("--from " + gates + " --model " + model + " --format gguf --out " + (dir / "exists.gguf"), 1,
         "already exists (pass --force");
  EXPECT_EQ(read_file(dir / "exists.gguf"), "x");
  EXPECT_EQ(export_("--from " + gates + " --model " + model + " --format gguf --force --out " + (dir / "exists.gguf"), dir).code, 0);
  // Nothing half-written: a failed export leaves no output and no temporaries.
  for (const auto& e : fs::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
}

}  // namespace
}  // namespace retain
