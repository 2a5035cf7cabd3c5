// Trainer checkpoints: the save protocol, `latest`, pruning, and resuming on any world size.
// Layout and the crash-safety argument: docs/checkpoints.md.
#include "checkpoints/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "kernels/base/atomic_file.h"
#include "kernels/base/error.h"
#include "data/formats/safetensors.h"

namespace retain::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::string_view kStepPrefix = "step-";
constexpr std::string_view kTmpSuffix = ".tmp";
constexpr std::string_view kOptPrefix = "optimizer-rank";
constexpr const char* kLatest = "latest";
constexpr const char* kGatesFile = "gates.safetensors";
constexpr const char* kStateFile = "state.json";

std::optional<int64_t> parse_int(std::string_view s) {
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// "step-00000100" -> 100; nullopt for anything else (".tmp" names included).
std::optional<int64_t> parse_step_dir_name(std::string_view name) {
  if (!name.starts_with(kStepPrefix)) return std::nullopt;
  const std::string_view digits = name.substr(kStepPrefix.size());
  if (digits.size() < 8 || !all_digits(digits)) return std::nullopt;
  return parse_int(digits);
}

// "optimizer-rank00003-of-00004.safetensors" -> (3, 4); nullopt for anything else.
std::optional<std::pair<int64_t, int64_t>> parse_optimizer_file_name(std::string_view name) {
  constexpr std::string_view of = "-of-", ext = ".safetensors";
  if (!name.starts_with(kOptPrefix) || !name.ends_with(ext)) return std::nullopt;
  const std::string_view mid = name.substr(kOptPrefix.size(), name.size() - kOptPrefix.size() - ext.size());
  const size_t sep = mid.find(of);
  if (sep == std::string_view::npos) return std::nullopt;
  const std::string_view r = mid.substr(0, sep), w = mid.substr(sep + of.size());
  if (r.size() < 5 || w.size() < 5 || !all_digits(r) || !all_digits(w)) return std::nullopt;
  const auto rv = parse_int(r), wv = parse_int(w);
  if (!rv || !wv) return std::nullopt;
  return std::make_pair(*rv, *wv);
}

// The slice of the padded flat vector rank `rank` of `world` owns (the optimizer's sharding).
std::pair<int64_t, int64_t> shard_of(int64_t flat_size, int64_t rank, int64_t world) {
  const int64_t per = (flat_size + world - 1) / world;
  return {rank * per, (rank + 1) * per};
}

// Makes a rename or file creation inside `dir` durable. File systems that cannot fsync a
// directory (EINVAL) order metadata themselves.
void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) fail("{}: cannot open directory to sync it: {}", dir.string(), std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL) fail("{}: cannot sync directory: {}", dir.string(), std::strerror(err));
}

json parse_json_file(const fs::path& path) {
  const std::string text = read_file(path.string());
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", path.string(), e.what());
  }
}

// state.json's step and world_size, validated.
struct StateHeader {
  json state;
  int64_t step = 0, world_size = 0;
};
StateHeader read_state(const fs::path& dir) {
  const fs::path path = dir / kStateFile;
  if (!fs::is_regular_file(path)) fail("{}: missing", path.string());
  StateHeader h;
  h.state = parse_json_file(path);
  if (!h.state.is_object()) fail("{}: not a JSON object", path.string());
  for (const char* key : {"step", "world_size"}) {
    const auto it = h.state.find(key);
    if (it == h.state.end() || !it->is_number_integer())
      fail("{}: field '{}' is missing or not an integer", path.string(), key);
  }
  h.step = h.state["step"].get<int64_t>();
  h.world_size = h.state["world_size"].get<int64_t>();
  if (h.step < 0) fail("{}: step {} is negative", path.string(), h.step);
  if (h.world_size < 1) fail("{}: world_size {} is not positive", path.string(), h.world_size);
  if (const auto named = parse_step_dir_name(dir.filename().string()); named && *named != h.step)
    fail("{}: step {} disagrees with its directory name {}", path.string(), h.step, dir.filename().string());
  return h;
}

// Throws unless `dir` holds state.json, gates.safetensors and one optimizer shard per rank.
void check_complete(const fs::path& dir) {
  if (!fs::is_directory(dir)) fail("{}: no such checkpoint directory", dir.string());
  const StateHeader h = read_state(dir);
  if (!fs::is_regular_file(dir / kGatesFile)) fail("{}: missing", (dir / kGatesFile).string());
  for (int64_t r = 0; r < h.world_size; ++r) {
    const fs::path shard = dir / optimizer_file_name(static_cast<int>(r), static_cast<int>(h.world_size));
    if (!fs::is_regular_file(shard)) fail("{}: missing (state.json world_size is {})", shard.string(), h.world_size);
  }
}

// The complete-looking checkpoint directories under `root` by step (final names only).
std::map<int64_t, fs::path> step_dirs(const fs::path& root) {
  std::map<int64_t, fs::path> out;
  for (const auto& e : fs::directory_iterator(root))
    if (const auto step = parse_step_dir_name(e.path().filename().string()); step && e.is_directory())
      out[*step] = e.path();
  return out;
}

// Runs `body` on this rank, then agrees with every rank on whether all succeeded (the
// all_reduce is also the barrier between protocol phases). A failing rank rethrows its own
// error; the others throw one that points at it. Nobody is left waiting in a collective.
void phase(dist::Comm& comm, const std::string& what, const std::function<void()>& body) {
  std::string error;
  try {
    body();
  } catch (const std::exception& e) {
    error = e.what();
    if (error.empty()) error = "unknown error";
  }
  double failures = error.empty() ? 0.0 : 1.0;
  comm.all_reduce(&failures, 1);
  if (!error.empty()) throw Error(error);
  if (failures > 0)
    throw PeerSaveError(
        fmt::format("{}: failed on {} other rank(s); see their messages", what, static_cast<int64_t>(failures)));
}

void check_request(const SaveRequest& req, int rank, int world, const int64_t main_header[3]) {
  const OptimizerShard& o = req.optimizer;
  if (req.step != main_header[0] || o.flat_size != main_header[1] || o.t != main_header[2])
    fail("save_checkpoint: rank {} saves step {} (flat_size {}, t {}) but rank 0 step {} (flat_size {}, t {})", rank,
         req.step, o.flat_size, o.t, main_header[0], main_header[1], main_header[2]);
  if (req.step < 0 || o.flat_size < 0 || o.t < 0)
    fail("save_checkpoint: negative step {}, flat_size {} or t {}", req.step, o.flat_size, o.t);
  const auto [b, e] = shard_of(o.flat_size, rank, world);
  if (o.begin != b || o.end != e)
    fail("save_checkpoint: rank {} of {} holds [{}, {}) of {} scalars; its shard is [{}, {})", rank, world, o.begin,
         o.end, o.flat_size, b, e);
  const size_t n = static_cast<size_t>(e - b);
  if (o.m.size() != n || o.v.size() != n)
    fail("save_checkpoint: rank {}: m has {} and v {} values for a shard of {}", rank, o.m.size(), o.v.size(), n);
  for (int64_t i = std::max(o.flat_size, b); i < e; ++i)
    if (o.m[size_t(i - b)] != 0.0f || o.v[size_t(i - b)] != 0.0f)
      fail("save_checkpoint: rank {}: padding entry {} (>= flat_size {}) is not zero", rank, i, o.flat_size);
  if (rank == 0) {
    if (!req.gates) fail("save_checkpoint: no gates to save");
    if (!req.state.is_null() && !req.state.is_object()) fail("save_checkpoint: the trainer state must be a JSON object");
  }
}

void write_shard(const fs::path& path, const OptimizerShard& o, int rank, int world) {
  const int64_t n = o.end - o.begin;
  formats::write_safetensors(path.string(),
                    {{"m", Tensor::from_vector(o.m, {n})}, {"v", Tensor::from_vector(o.v, {n})}},
                    {{"format", "retain-optimizer-shard"},
                     {"optimizer", "adamw"},
                     {"t", std::to_string(o.t)},
                     {"flat_size", std::to_string(o.flat_size)},
                     {"begin", std::to_string(o.begin)},
                     {"end", std::to_string(o.end)},
                     {"rank", std::to_string(rank)},
                     {"world_size", std::to_string(world)}});
}

// Points `latest` at the newest complete checkpoint older than `step`, or removes it: used
// before replacing a checkpoint that `latest` names, so that it never names a half-replaced one.
void retarget_latest_below(const fs::path& root, int64_t step) {
  const fs::path latest = root / kLatest;
  std::optional<fs::path> target;
  for (const auto& [s, dir] : step_dirs(root)) {
    if (s >= step) break;
    try {
      check_complete(dir);
      target = dir;
    } catch (const Error&) {
    }
  }
  if (target)
    write_file_atomic(latest.string(), target->filename().string() + "\n");
  else
    fs::remove(latest);
  fsync_dir(root);
}

// Deletes the oldest checkpoints older than `step` beyond keep_last (the new one counts).
void prune(const fs::path& root, int64_t step, int keep_last) {
  if (keep_last <= 0) return;
  std::vector<fs::path> older;
  for (const auto& [s, dir] : step_dirs(root))
    if (s < step) older.push_back(dir);
  const size_t keep_older = static_cast<size_t>(keep_last - 1);
  if (older.size() <= keep_older) return;
  for (size_t i = 0; i < older.size() - keep_older; ++i) {
    std::error_code ec;
    fs::remove_all(older[i], ec);
    if (ec) spdlog::warn("{}: cannot remove old checkpoint: {}", older[i].string(), ec.message());
  }
}

// Rank 0, after every shard is in `tmp`: the rest of the checkpoint, the rename, `latest`.
void finalize(const fs::path& root, const fs::path& tmp, const fs::path& final_dir, const SaveRequest& req, int world) {
  req.gates->save((tmp / kGatesFile).string(), {{"step", std::to_string(req.step)}});
  json state = req.state.is_null() ? json::object() : req.state;
  state["step"] = req.step;
  state["world_size"] = world;
  write_file_atomic((tmp / kStateFile).string(), state.dump(2) + "\n");
  fsync_dir(tmp);

  // A directory of this step already exists: either the debris of a save that was killed
  // between its rename and `latest` (not named by `latest`), or a checkpoint of the same step
  // saved again. `latest` must stop naming it before it goes.
  if (fs::exists(final_dir)) {
    const fs::path latest = root / kLatest;
    if (fs::exists(latest)) {
      std::string named = read_file(latest.string());
      if (!named.empty() && named.back() == '\n') named.pop_back();
      if (named == final_dir.filename().string()) retarget_latest_below(root, req.step);
    }
    fs::remove_all(final_dir);
  }
  fs::rename(tmp, final_dir);
  fsync_dir(root);
  write_file_atomic((root / kLatest).string(), final_dir.filename().string() + "\n");
  fsync_dir(root);
  // The checkpoint is complete and `latest` names it: pruning old ones can only warn.
  try {
    prune(root, req.step, req.keep_last);
  } catch (const std::exception& e) {
    spdlog::warn("{}: cannot prune old checkpoints: {}", root.string(), e.what());
  }
}

int64_t meta_int(const formats::SafetensorsFile& f, const char* key) {
  const auto& meta = f.metadata();
  const auto it = meta.find(key);
  if (it == meta.end()) fail("{}: __metadata__ has no '{}'", f.path(), key);
  const auto v = parse_int(it->second);
  if (!v) fail("{}: __metadata__ '{}' is not an integer: '{}'", f.path(), key, it->second);
  return *v;
}

// The F32 [n] tensor `name` of an optimizer shard, checked finite (and non-negative for v).
const float* shard_values(const formats::SafetensorsFile& f, const Tensor& t, const char* name, int64_t n) {
  if (t.dtype() != DType::F32 || t.shape() != Shape{n})
    fail("{}: tensor '{}' is {} {}; expected F32 [{}]", f.path(), name, dtype_name(t.dtype()), shape_str(t.shape()), n);
  const float* p = t.data<float>();
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(p[i]) || (name[0] == 'v' && p[i] < 0.0f))
      fail("{}: tensor '{}' has an invalid value ({}) at index {}", f.path(), name, p[i], i);
  return p;
}

}  // namespace

std::string step_dir_name(int64_t step) { return fmt::format("step-{:08d}", step); }

std::string optimizer_file_name(int rank, int world_size) {
  return fmt::format("optimizer-rank{:05d}-of-{:05d}.safetensors", rank, world_size);
}

std::string checkpoints_dir(const std::string& run_dir) { return (fs::path(run_dir) / "checkpoints").string(); }

std::string save_checkpoint(dist::Comm& comm, const std::string& run_dir, const SaveRequest& req) {
  const int rank = comm.rank(), world = comm.size();
  const fs::path root = checkpoints_dir(run_dir);
  const std::string name = step_dir_name(req.step);
  const fs::path tmp = root / (name + std::string(kTmpSuffix)), final_dir = root / name;

  // Every rank must save the same step of the same optimizer: compare with rank 0's.
  int64_t header[3] = {req.step, req.optimizer.flat_size, req.optimizer.t};
  comm.broadcast(header, sizeof(header), 0);

  const std::string what = fmt::format("save_checkpoint {}", final_dir.string());
  try {
    phase(comm, what, [&] {
      check_request(req, rank, world, header);
      if (rank == 0) {
        fs::create_directories(root);
        fs::remove_all(tmp);
        fs::create_directory(tmp);
        fsync_dir(root);
      }
    });
    phase(comm, what, [&] { write_shard(tmp / optimizer_file_name(rank, world), req.optimizer, rank, world); });
    phase(comm, what, [&] {
      if (rank == 0) finalize(root, tmp, final_dir, req, world);
    });
  } catch (const Error&) {
    // Every rank is past its last collective here; what a failed save left is debris.
    std::error_code ignored;
    if (rank == 0) fs::remove_all(tmp, ignored);
    throw;
  }
  return final_dir.string();
}

std::optional<std::string> latest_checkpoint(const std::string& run_dir) {
  const fs::path root = checkpoints_dir(run_dir), latest = root / kLatest;
  if (!fs::exists(latest)) return std::nullopt;
  std::string named = read_file(latest.string());
  if (!named.empty() && named.back() == '\n') named.pop_back();
  if (!parse_step_dir_name(named)) fail("{}: does not name a checkpoint directory: '{}'", latest.string(), named);
  const fs::path dir = root / named;
  try {
    check_complete(dir);
  } catch (const Error& e) {
    fail("{}: names {}, which is not a complete checkpoint: {}", latest.string(), dir.string(), e.what());
  }
  return dir.string();
}

void remove_stale_temporaries(const std::string& run_dir) {
  const fs::path root = checkpoints_dir(run_dir);
  if (!fs::is_directory(root)) return;
  std::vector<fs::path> stale;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string n = e.path().filename().string();
    const bool step_tmp = n.ends_with(kTmpSuffix) && parse_step_dir_name(n.substr(0, n.size() - kTmpSuffix.size()));
    if (step_tmp || n.starts_with(std::string(kLatest) + ".tmp.")) stale.push_back(e.path());
  }
  for (const fs::path& p : stale) {
    spdlog::info("removing {} (left by an interrupted checkpoint save)", p.string());
    fs::remove_all(p);
  }
}

Loaded load_checkpoint(const std::string& ckpt_dir, int64_t flat_size, int64_t begin, int64_t end,
                       const std::function<void(const nlohmann::json& state)>& check_state) {
  RETAIN_CHECK(flat_size >= 0 && begin >= 0 && begin <= end, "bad range [{}, {}) of {}", begin, end, flat_size);
  const fs::path dir = ckpt_dir;
  if (!fs::is_directory(dir)) fail("{}: no such checkpoint directory", dir.string());
  StateHeader h = read_state(dir);
  if (check_state) check_state(h.state);
  const int64_t world = h.world_size;

  Loaded out;
  out.step = h.step;
  out.state = std::move(h.state);
  out.gates_path = (dir / kGatesFile).string();
  if (!fs::is_regular_file(out.gates_path)) fail("{}: missing", out.gates_path);
  {
    const formats::SafetensorsFile gates = formats::SafetensorsFile::open(out.gates_path);
    if (gates.metadata().count("step") && meta_int(gates, "step") != h.step)
      fail("{}: __metadata__ step {} but state.json says {}", out.gates_path, gates.metadata().at("step"), h.step);
  }

  // Exactly the shards of world_size ranks, nothing else.
  std::set<std::string> expected;
  for (int64_t r = 0; r < world; ++r) expected.insert(optimizer_file_name(int(r), int(world)));
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.starts_with(kOptPrefix) && !expected.count(n)) {
      const auto parsed = parse_optimizer_file_name(n);
      if (parsed && parsed->second != world)
        fail("{}: a shard of a {}-rank save, but state.json says world_size {}", e.path().string(), parsed->second, world);
      fail("{}: unexpected file in the checkpoint", e.path().string());
    }
  }

  OptimizerShard& o = out.optimizer;
  o.flat_size = flat_size;
  o.begin = begin;
  o.end = end;
  o.m.assign(size_t(end - begin), 0.0f);
  o.v.assign(size_t(end - begin), 0.0f);
  const int64_t have_end = std::min(end, flat_size);  // beyond flat_size: padding, 0
  std::optional<int64_t> t;
  for (int64_t r = 0; r < world; ++r) {
    const fs::path path = dir / optimizer_file_name(int(r), int(world));
    if (!fs::is_regular_file(path)) fail("{}: missing (state.json world_size is {})", path.string(), world);
    const formats::SafetensorsFile f = formats::SafetensorsFile::open(path.string());
    if (const int64_t w = meta_int(f, "world_size"); w != world)
      fail("{}: __metadata__ world_size {} but state.json says {}", f.path(), w, world);
    if (const int64_t n = meta_int(f, "flat_size"); n != flat_size)
      fail("{}: optimizer state of {} scalars, but the gates have {}", f.path(), n, flat_size);
    const int64_t shard_t = meta_int(f, "t");
    if (shard_t < 0) fail("{}: __metadata__ t {} is negative", f.path(), shard_t);
    if (t && shard_t != *t) fail("{}: __metadata__ t {} but rank 0's shard has t {}", f.path(), shard_t, *t);
    t = shard_t;
    const auto [sb, se] = shard_of(flat_size, r, world);
    if (meta_int(f, "begin") != sb || meta_int(f, "end") != se)
      fail("{}: holds [{}, {}); rank {} of {} must hold [{}, {})", f.path(), meta_int(f, "begin"), meta_int(f, "end"),
           r, world, sb, se);
    if (f.names() != std::vector<std::string>{"m", "v"})
      fail("{}: must hold exactly the tensors m and v, has [{}]", f.path(), fmt::join(f.names(), ", "));
    const Tensor mt = f.tensor("m"), vt = f.tensor("v");
    const float* m = shard_values(f, mt, "m", se - sb);
    const float* v = shard_values(f, vt, "v", se - sb);
    for (int64_t i = std::max(flat_size, sb); i < se; ++i)
      if (m[i - sb] != 0.0f || v[i - sb] != 0.0f)
        fail("{}: padding entry {} (>= flat_size {}) is not zero", f.path(), i, flat_size);
    for (int64_t i = std::max(begin, sb); i < std::min(have_end, se); ++i) {
      o.m[size_t(i - begin)] = m[i - sb];
      o.v[size_t(i - begin)] = v[i - sb];
    }
  }
  o.t = t.value_or(0);
  return out;
}

}  // namespace retain::ckpt
