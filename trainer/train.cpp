#include "trainer/train.h"

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>

#include <spdlog/spdlog.h>

#include "model/gates/gate_containers.h"
#include "model/kvpop/scorer_containers.h"
#include "checkpoints/checkpoint.h"
#include "data/loader.h"
#include "data/packed_dataset.h"
#include "data/tokenizer/sha256.h"
#include "kernels/base/atomic_file.h"
#include "kernels/base/cli.h"
#include "kernels/base/error.h"
#include "kernels/base/fault.h"
#include "model/kvpop/scorers.h"
#include "kernels/base/nvtx.h"
#include "kernels/base/run_lock.h"
#include "kernels/cuda/memory.h"
#include "kernels/device.h"
#include "model/device_weights.h"
#include "data/formats/safetensors.h"
#include "model/weights.h"
#include "trainer/config_file.h"
#include "trainer/fsdp.h"
#include "trainer/flat_params.h"
#include "trainer/flops.h"
#include "trainer/kvpop_train.h"
#include "trainer/metrics.h"
#include "trainer/optim.h"
#include "trainer/signals.h"
#include "trainer/step.h"
#include "trainer/update.h"
#include "trainer/weight_setup.h"

namespace retain::trainer {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

// What both training and --dump-grads open: the frozen model, the dataset (checked against the
// model), the weight provider for this world and the batch geometry.
struct Inputs {
  std::shared_ptr<const Qwen3Checkpoint> model;
  std::optional<data::PackedDataset> data;
  std::unique_ptr<WeightProvider> weights;
  int64_t global_batch = 0;
  LossConfig loss;
  // --context-parallel N > 1: this rank's group of N (consecutive world ranks), else none.
  std::unique_ptr<dist::Comm> context_group;
};

// The context-parallel group of this rank: world ranks [g·N, g·N + N), g = rank / N. Collective.
// With --timeout, the group's ring has a watchdog of its own: a rank hung inside the ring is named
// (by its world rank) and the job ends, as for the world's collectives.
std::unique_ptr<dist::Comm> make_context_group(const TrainConfig& cfg, dist::Comm& comm) {
  if (cfg.context_parallel <= 1) return nullptr;
  auto group = comm.split(comm.rank() / cfg.context_parallel, comm.rank() % cfg.context_parallel);
  group->set_timeout(cfg.timeout);
  return group;
}

// Runs f() on every rank and agrees on the outcome: when any rank fails, every rank throws a
// CollectiveError, and only the lowest failing rank's message is printed (setup errors such as
// a missing file are usually the same on every rank).
template <typename F>
void collectively(dist::Comm& comm, F&& f) {
  std::string error;
  try {
    f();
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::vector<double> failed(static_cast<size_t>(comm.size()), 0.0);
  failed[static_cast<size_t>(comm.rank())] = error.empty() ? 0.0 : 1.0;
  comm.all_reduce(failed.data(), failed.size());
  int first = -1;
  for (int r = 0; r < comm.size() && first < 0; ++r)
    if (failed[static_cast<size_t>(r)] > 0) first = r;
  if (first < 0) return;
  const bool mine = first == comm.rank();
  const std::string prefix = comm.size() > 1 ? fmt::format("rank {}: ", first) : std::string();
  throw CollectiveError(mine ? prefix + error : std::string("another rank failed"), mine);
}

// Opens and checks everything on this rank; no collectives (see collectively()).
Inputs open_inputs(const TrainConfig& cfg, const dist::Comm& comm) {
  Inputs in;
  in.model = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(cfg.model_dir));
  const Qwen3Config& mc = in.model->config();
  // Before any weight reaches the GPU: the attention kernels exist for these head sizes only.
  if (cfg.device == Device::CUDA && mc.head_dim != 64 && mc.head_dim != 128)
    fail("{}/config.json: head_dim {} has no CUDA attention kernel (64 and 128 have); train it with --device cpu",
         cfg.model_dir, mc.head_dim);
  in.data.emplace(data::PackedDataset::open(cfg.data_path));
  const data::PackedDataset& ds = *in.data;
  data::check_dataset_matches_model(ds, cfg.model_dir, mc.vocab_size);
  if (cfg.seq_len > 0 && cfg.seq_len != ds.seq_len())
    fail("{}: sequences are {} tokens long, but --seq-len is {}", cfg.data_path, ds.seq_len(), cfg.seq_len);
  if (ds.seq_len() > mc.max_position_embeddings)
    fail("{}: sequences of {} tokens exceed the model's max_position_embeddings {} ({}/config.json)", cfg.data_path,
         ds.seq_len(), mc.max_position_embeddings, cfg.model_dir);

  const int64_t N = cfg.context_parallel;
  if (N < 1 || comm.size() % N != 0)
    fail("--context-parallel {}: the {} ranks do not divide into groups of {}", N, comm.size(), N);
  if (N > 1 && cfg.micro_batch * ds.seq_len() < 2 * N)
    fail("--context-parallel {}: a micro-batch of {} tokens cannot be cut into 2 × {} chunks", N,
         cfg.micro_batch * ds.seq_len(), N);
  const int64_t world = comm.size() / N;  // data-parallel groups
  in.global_batch = cfg.global_batch > 0 ? cfg.global_batch : world * cfg.micro_batch;
  if (cfg.micro_batch <= 0) fail("--micro-batch must be positive, got {}", cfg.micro_batch);
  if (in.global_batch % (world * cfg.micro_batch) != 0)
    fail("--global-batch {} is not a multiple of {} {} × --micro-batch {}", in.global_batch, world,
         N > 1 ? "context-parallel groups" : "ranks", cfg.micro_batch);
  if (in.global_batch > ds.num_sequences())
    fail("{}: {} sequences, fewer than one global batch of {}", cfg.data_path, ds.num_sequences(), in.global_batch);

  in.loss.memory = cfg.memory;
  in.loss.mode = cfg.global_capacity() ? ops::CapacityMode::global : ops::CapacityMode::local;
  in.loss.kl_weight = cfg.kl_weight;
  in.loss.kl = cfg.kl;
  in.loss.ntp_weight = cfg.ntp_weight;
  in.loss.cap_weight = cfg.cap_weight;
  in.loss.loss_chunk = cfg.loss_chunk;
  static_assert(TrainConfig{}.capacity_skip == ops::kExactSkipExponent, "the default skip is the exact one");
  in.loss.capacity_skip = cfg.capacity_skip;
  return in;
}

// This rank's share of every global batch, in the seeded order of cfg.seed: its data-parallel
// group's (the ranks of a context-parallel group read the same sequences).
data::LoaderOptions loader_options(const TrainConfig& cfg, const Inputs& in, const dist::Comm& comm) {
  data::LoaderOptions o;
  o.global_batch = in.global_batch;
  o.rank = comm.rank() / cfg.context_parallel;
  o.world_size = comm.size() / cfg.context_parallel;
  o.seed = cfg.seed;
  return o;
}

// This rank's frozen weights (trainer/weight_setup.h), and on CUDA a line saying where they live.
void make_weight_provider(const TrainConfig& cfg, Inputs& in, dist::Comm& comm) {
  collectively(comm, [&] {
    StepWeights w = make_step_weights(in.model, cfg.device, comm, cfg.fsdp_force_gather);
    if (cfg.device == Device::CUDA && comm.is_main_rank())
      spdlog::info("device cuda:{} ({}); {} {:.2f} GB there ({} comm{})", w.gpu, cuda::device_name(),
                   w.whole_model ? "the model's weights take" : "this rank's weight shards take", w.gb, comm.backend(),
                   comm.size() == 1 && !w.whole_model ? "; layers gathered through it: --fsdp-force-gather" : "");
    in.weights = std::move(w.weights);
  });
}

// Rank 0's FSDP counters (when the weights are sharded or force-gathered), for the log: how
// many layers were gathered and how many the prefetch had ready.
void log_fsdp_stats(const WeightProvider& weights, const dist::Comm& comm) {
  const auto* fsdp = dynamic_cast<const FsdpWeightProvider*>(&weights);
  if (fsdp == nullptr || !fsdp->gathers() || !comm.is_main_rank()) return;
  const FsdpStats& s = fsdp->stats();
  spdlog::info("fsdp: {} layer requests, {} layer all-gathers ({} prefetched and used, {} prefetched and discarded, "
               "{} waited for), {} embedding/lm_head all-gathers",
               s.layer_requests, s.layer_gathers, s.prefetch_hits, s.prefetch_misses, s.waited_gathers,
               s.global_gathers);
}

gates::RetentionGates initial_gates(const TrainConfig& cfg, const Qwen3Config& mc) {
  if (!cfg.init_gates.empty()) {  // any container
    gates::RetentionGates g = gates::load_gates(cfg.init_gates, mc, cfg.gate).gates;
    if (g.dims().input != cfg.gate_input)
      fail("--init-gates {}: these gates read {}, but --gate-input is {}", cfg.init_gates,
           gates::gate_input_name(g.dims().input), gates::gate_input_name(cfg.gate_input));
    return g;
  }
  const gates::GateDims dims{cfg.gate,        mc.num_hidden_layers, gates::gate_input_width(mc, cfg.gate_input),
                             cfg.gate_hidden, mc.num_key_value_heads, cfg.gate_input};
  return gates::RetentionGates::init(dims, cfg.bias_init, cfg.seed);
}

// Names a non-finite loss component, or "" when all are finite.
std::string nonfinite_loss(const StepLosses& l) {
  if (!std::isfinite(l.kl())) return fmt::format("the KL loss is {}", l.kl());
  if (!std::isfinite(l.ntp())) return fmt::format("the NTP loss is {}", l.ntp());
  if (!std::isfinite(l.cap())) return fmt::format("the capacity loss is {}", l.cap());
  return {};
}

// What the loop trains: DESIGN §4 retention gates or §5 kvpop scorers. The loop owns the
// optimizer, the checkpoints, the metrics and stopping; a trainee owns its parameters and
// computes one step's gradients on this rank.
class Trainee {
 public:
  virtual ~Trainee() = default;
  virtual ParameterSet& params() = 0;
  // Replaces the values with a checkpoint's parameter file (its gates.safetensors).
  virtual void load(const std::string& path) = 0;
  // ADDS this rank's part of the global gradient into params() (collective), fills the step's
  // loss fields of m on every rank; returns "" or names what is not finite.
  virtual std::string step(WeightProvider& weights, const std::vector<MicroBatch>& mbs, bool log_step, StepMetrics& m,
                           dist::Comm& comm) = 0;
  virtual std::string what() const = 0;                                   // for the log
  virtual std::map<std::string, std::string> final_metadata() const = 0;  // of RUN/gates.safetensors
  virtual std::string summary(const StepMetrics& first, const StepMetrics& last) const = 0;
  // --dump-grads: the last step's loss scalars and metadata.
  virtual void dump_extras(std::vector<std::pair<std::string, Tensor>>& out,
                           std::map<std::string, std::string>& meta) const = 0;
};

Tensor scalar_tensor(double x) { return Tensor::from_vector<double>({x}, {}); }

class GateTrainee : public Trainee {
 public:
  GateTrainee(const TrainConfig& cfg, const LossConfig& loss, const Qwen3Config& mc, dist::Comm* context_group)
      : cfg_(cfg), loss_(loss), mc_(mc), gates_(initial_gates(cfg, mc)), context_group_(context_group) {}
  ParameterSet& params() override { return gates_; }
  void load(const std::string& path) override { gates_ = gates::RetentionGates::load(path, mc_, cfg_.gate); }
  std::string step(WeightProvider& weights, const std::vector<MicroBatch>& mbs, bool log_step, StepMetrics& m,
                   dist::Comm& comm) override {
    RetentionStats stats;
    last_ = compute_gradients(weights, gates_, mbs, loss_, comm, log_step ? &stats : nullptr, nullptr, context_group_);
    m.loss = last_.total(loss_);
    m.kl = last_.kl();
    m.ntp = last_.ntp();
    m.cap = last_.cap();
    m.tokens = last_.tokens;
    m.mean_beta = stats.mean_beta;
    m.effective_cache = stats.effective_cache;
    return nonfinite_loss(last_);
  }
  std::string what() const override {
    return fmt::format("{} gates, {} parameters", gates::gate_kind_name(cfg_.gate), gates_.num_parameters());
  }
  std::map<std::string, std::string> final_metadata() const override {
    return {{"memory", fmt::format("{}", cfg_.memory)}};
  }
  std::string summary(const StepMetrics& a, const StepMetrics& b) const override {
    return fmt::format("steps {}..{}: loss {:.4f} → {:.4f}, capacity {:.4f} → {:.4f}, KL {:.4f} → {:.4f}, NTP {:.4f} → {:.4f}",
                       a.step, b.step, a.loss, b.loss, a.cap, b.cap, a.kl, b.kl, a.ntp, b.ntp);
  }
  void dump_extras(std::vector<std::pair<std::string, Tensor>>& out,
                   std::map<std::string, std::string>& meta) const override {
    out.emplace_back("loss/total", scalar_tensor(last_.total(loss_)));
    out.emplace_back("loss/kl", scalar_tensor(last_.kl()));
    out.emplace_back("loss/ntp", scalar_tensor(last_.ntp()));
    out.emplace_back("loss/cap", scalar_tensor(last_.cap()));
    meta.insert({{"gate_kind", std::string(gates::gate_kind_name(cfg_.gate))},
                 {"memory", fmt::format("{}", cfg_.memory)},
                 {"kl_weight", fmt::format("{}", cfg_.kl_weight)},
                 {"kl", ops::kl_direction_name(cfg_.kl)},
                 {"ntp_weight", fmt::format("{}", cfg_.ntp_weight)},
                 {"cap_weight", fmt::format("{}", cfg_.cap_weight)},
                 {"loss_positions", std::to_string(last_.positions)},
                 {"cap_positive", std::to_string(last_.cap_positive)}});
    spdlog::info("loss {:.6f} (kl {:.6f}, ntp {:.6f}, cap {:.6f})", last_.total(loss_), last_.kl(), last_.ntp(),
                 last_.cap());
  }

 private:
  const TrainConfig& cfg_;
  LossConfig loss_;
  const Qwen3Config& mc_;
  gates::RetentionGates gates_;
  dist::Comm* context_group_;
  StepLosses last_;
};

class KvpopTrainee : public Trainee {
 public:
  KvpopTrainee(const TrainConfig& cfg, const Qwen3Config& mc, dist::Comm* context_group)
      : cfg_(cfg), mc_(mc), context_group_(context_group) {
    settings_.window = cfg.window;
    settings_.sinks = cfg.sinks;
    settings_.topk = cfg.topk;
    settings_.decay = decay_of(cfg);
    settings_.effective_cutoff = cfg.target_cutoff == "effective";
    const kvpop::PolicyGeometry geometry{cfg.window, cfg.sinks, cfg.topk};
    if (cfg.init_gates.empty()) {
      scorers_ = kvpop::Scorers::init(kvpop::Scorers::dims_for(mc), geometry, cfg.seed);
    } else {  // fine-tuning released scorers: this run's geometry is what they are trained for now
      scorers_ = kvpop::load_scorers(cfg.init_gates, mc).scorers;  // safetensors or GGUF
      scorers_.set_geometry(geometry);
    }
    scorers_.set_decay(settings_.decay);  // and this run's decay (θ keeps its value, read in the new range)
  }
  static kvpop::Decay decay_of(const TrainConfig& c) { return {c.decay_every, c.decay_min, c.decay_max}; }
  ParameterSet& params() override { return scorers_; }
  void load(const std::string& path) override {
    scorers_ = kvpop::Scorers::load(path, mc_);
    const kvpop::PolicyGeometry want{cfg_.window, cfg_.sinks, cfg_.topk};
    if (scorers_.geometry() && *scorers_.geometry() != want)
      fail("{}: scorers for window {} sinks {} topk {}, but this run has window {} sinks {} topk {}", path,
           scorers_.geometry()->window, scorers_.geometry()->sinks, scorers_.geometry()->topk, want.window, want.sinks,
           want.topk);
    scorers_.set_geometry(want);
    if (scorers_.decay() != settings_.decay)
      fail("{}: scorers for decay every {} in [{}, {}], but this run has every {} in [{}, {}]", path,
           scorers_.decay().every, scorers_.decay().gamma_min, scorers_.decay().gamma_max, settings_.decay.every,
           settings_.decay.gamma_min, settings_.decay.gamma_max);
  }
  std::string step(WeightProvider& weights, const std::vector<MicroBatch>& mbs, bool, StepMetrics& m,
                   dist::Comm& comm) override {
    m.gamma = mean_gamma(scorers_, settings_.decay);  // before this step's update, like the loss and the agreement
    last_ = compute_kvpop_gradients(weights, scorers_, mbs, settings_, cfg_.margin_weight, comm, context_group_);
    m.kvpop = true;
    m.loss = last_.loss;
    m.decisions = last_.decisions;
    m.agreement = last_.agreement();
    m.tokens = last_.tokens;
    return std::isfinite(last_.loss) ? std::string() : fmt::format("the kvpop loss is {}", last_.loss);
  }
  std::string what() const override {
    return fmt::format("kvpop scorers (window {}, sinks {}, top-k {}), {} parameters", cfg_.window, cfg_.sinks,
                       cfg_.topk, scorers_.num_parameters());
  }
  std::map<std::string, std::string> final_metadata() const override { return {}; }
  std::string summary(const StepMetrics& a, const StepMetrics& b) const override {
    return fmt::format("steps {}..{}: loss {:.4f} → {:.4f}, agreement {:.3f} → {:.3f}, γ {:.6f} → {:.6f}", a.step, b.step,
                       a.loss, b.loss, a.agreement, b.agreement, a.gamma, b.gamma);
  }
  void dump_extras(std::vector<std::pair<std::string, Tensor>>& out,
                   std::map<std::string, std::string>& meta) const override {
    out.emplace_back("loss/kvpop", scalar_tensor(last_.loss));
    meta.insert({{"gate_kind", "kvpop"},
                 {"window", std::to_string(cfg_.window)},
                 {"sinks", std::to_string(cfg_.sinks)},
                 {"topk", std::to_string(cfg_.topk)},
                 {"margin_weight", cfg_.margin_weight ? "1" : "0"},
                 {"decay_every", std::to_string(cfg_.decay_every)},
                 {"decay_min", fmt::format("{}", cfg_.decay_min)},
                 {"decay_max", fmt::format("{}", cfg_.decay_max)},
                 {"target_cutoff", cfg_.target_cutoff},
                 {"decisions", std::to_string(last_.decisions)},
                 {"margin_sum", fmt::format("{}", last_.margin_sum)},
                 {"agreed", std::to_string(last_.agreed)}});
    spdlog::info("loss/kvpop {:.6f} over {} decisions (agreement {:.3f})", last_.loss, last_.decisions,
                 last_.agreement());
  }

 private:
  const TrainConfig& cfg_;
  const Qwen3Config& mc_;
  dist::Comm* context_group_;
  kvpop::StepSettings settings_;
  kvpop::Scorers scorers_;
  KvpopLosses last_;
};

std::unique_ptr<Trainee> make_trainee(const TrainConfig& cfg, const Inputs& in) {
  if (cfg.kvpop) return std::make_unique<KvpopTrainee>(cfg, in.model->config(), in.context_group.get());
  return std::make_unique<GateTrainee>(cfg, in.loss, in.model->config(), in.context_group.get());
}

// The first parameter whose (global) gradient holds a NaN/Inf, agreed over ranks.
std::string nonfinite_gradient(const ParameterSet& gates, dist::Comm& comm) {
  const auto& params = gates.parameters();
  std::vector<double> bad(params.size(), 0.0);
  for (size_t p = 0; p < params.size(); ++p) {
    const float* g = params[p].grad.data<float>();
    for (int64_t i = 0; i < params[p].grad.numel(); ++i)
      if (!std::isfinite(g[i])) {
        bad[p] = 1;
        break;
      }
  }
  comm.all_reduce(bad.data(), bad.size());
  for (size_t p = 0; p < params.size(); ++p)
    if (bad[p] > 0) return fmt::format("the gradient of {} is not finite", params[p].name());
  return "the gradient norm is not finite";
}

// Rank 0's string on every rank.
std::string broadcast_string(dist::Comm& comm, const std::string& s) {
  uint64_t n = s.size();
  comm.broadcast(&n, sizeof n, 0);
  std::string out = comm.is_main_rank() ? s : std::string(n, '\0');
  if (n > 0) comm.broadcast(out.data(), n, 0);
  return out;
}

bool stderr_is_tty() { return isatty(STDERR_FILENO) == 1; }

// GB: the CUDA pool's high-water mark since the step began, or the process's peak resident set.
double peak_memory_gb(Device device) {
  if (device == Device::CUDA) return static_cast<double>(cuda::device_memory_stats().peak) / 1e9;
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) != 0) return std::numeric_limits<double>::quiet_NaN();
  return static_cast<double>(usage.ru_maxrss) * 1024.0 / 1e9;  // Linux reports kilobytes
}

}  // namespace

int run_training(const TrainConfig& cfg, dist::Comm& comm) {
  const bool main_rank = comm.is_main_rank();
  Inputs in;
  collectively(comm, [&] { in = open_inputs(cfg, comm); });
  in.context_group = make_context_group(cfg, comm);
  const Qwen3Config& mc = in.model->config();
  const data::PackedDataset& ds = *in.data;
  const nlohmann::json config_json = to_json(cfg);

  // The run directory: a fresh run refuses one that already has checkpoints. Nothing is created
  // before the first step has run (a bad --init-gates, bad token ids, a NaN in step 1 leave no
  // half-made run behind); its parent folder must exist, as for every tool's output.
  // Rank 0 holds the run directory's lock (kernels/base/run_lock.h) until the run ends: a second
  // run into it, or a --resume of it while this one goes, stops here naming this process.
  std::optional<RunLock> run_lock;
  collectively(comm, [&] {
    if (!main_rank) return;
    const fs::path parent = fs::absolute(cfg.run_dir).lexically_normal().parent_path();
    if (!fs::is_directory(parent)) fail("--out {}: the folder {} does not exist", cfg.run_dir, parent.string());
    if (fs::exists(cfg.run_dir) && !fs::is_directory(cfg.run_dir)) fail("--out {}: is not a directory", cfg.run_dir);
    std::error_code ec;
    for (const std::string& in : {cfg.model_dir, cfg.data_path, cfg.init_gates})
      if (!in.empty() && fs::exists(cfg.run_dir, ec) && fs::equivalent(cfg.run_dir, in, ec))
        fail("--out {}: is also an input ({}); a run writes its config.json and checkpoints there", cfg.run_dir, in);
    run_lock.emplace(RunLock::acquire(cfg.run_dir));
    if (fs::is_directory(cfg.run_dir)) ckpt::remove_stale_temporaries(cfg.run_dir);
  });
  // Rank 0 alone reads `latest` and tells the others: on a shared file system with stale
  // caches, ranks reading it themselves could load different checkpoints.
  std::optional<std::string> resume_dir;
  std::string latest_name;
  collectively(comm, [&] {
    if (!main_rank) return;
    const std::optional<std::string> latest = ckpt::latest_checkpoint(cfg.run_dir);
    if (latest && !cfg.resume)
      fail("{}: the run directory already has checkpoints (latest: {}); pass --resume to continue it, or choose "
           "another --out",
           cfg.run_dir, fs::path(*latest).filename().string());
    if (latest) latest_name = *latest;
  });
  latest_name = broadcast_string(comm, latest_name);
  if (cfg.resume && !latest_name.empty()) resume_dir = latest_name;

  // Parameters, optimizer shard, data cursor: from the latest checkpoint or fresh.
  std::unique_ptr<Trainee> trainee;
  collectively(comm, [&] { trainee = make_trainee(cfg, in); });
  ParameterSet& gates = trainee->params();  // the same object after a load()
  AdamWConfig adam_cfg;
  adam_cfg.lr = cfg.lr;
  adam_cfg.weight_decay = cfg.weight_decay;
  adam_cfg.beta1 = cfg.adam_beta1;
  adam_cfg.beta2 = cfg.adam_beta2;
  // The fp32 master values and the AdamW state of this rank's shard (trainer/update.h); the
  // parameters hold a copy, written back after every update.
  ShardedUpdate update(gates, comm, adam_cfg);
  AdamW& adam = update.adam();
  const int64_t n = update.flat_size();
  const ShardRange range = update.range();
  data::Cursor cursor{cfg.seed, 0, 0};
  int64_t step = 0;
  collectively(comm, [&] {
    if (!resume_dir) return;
    const ckpt::Loaded loaded =
        ckpt::load_checkpoint(*resume_dir, n, range.begin, range.end, [&](const nlohmann::json& state) {
          const std::string diff = trajectory_difference(state.at("config"), config_json);
          if (!diff.empty()) fail("{}: cannot resume with a different configuration: {}", *resume_dir, diff);
        });
    trainee->load(loaded.gates_path);
    adam.set_state(loaded.optimizer.t, loaded.optimizer.m, loaded.optimizer.v);
    cursor = data::Cursor::from_json(loaded.state.at("cursor"), in.global_batch, ds.num_sequences(),
                                     *resume_dir + "/state.json");
    step = loaded.step;
  });
  if (resume_dir) {
    // Every rank must continue from the same state (its own shard of it).
    double mine[2] = {static_cast<double>(step), static_cast<double>(adam.t())}, most[2] = {mine[0], mine[1]},
           least[2] = {-mine[0], -mine[1]};
    comm.all_reduce_max(most, 2);
    comm.all_reduce_max(least, 2);
    if (most[0] != -least[0] || most[1] != -least[1])
      throw CollectiveError(fmt::format("{}: the ranks loaded different states (steps {}..{}, optimizer steps {}..{}); "
                                        "is the run directory on a file system every rank sees alike?",
                                        *resume_dir, -least[0], most[0], -least[1], most[1]),
                            main_rank);
  }
  if (main_rank) {
    if (resume_dir)
      spdlog::info("resuming {} at step {}", *resume_dir, step);
    else if (cfg.resume)
      spdlog::info("--resume: {} has no checkpoint yet; starting a new run", cfg.run_dir);
  }
  // Creates the run directory, config.json and metrics.jsonl: after the first step of a fresh run.
  std::optional<MetricsLog> metrics_log;
  const int64_t start_step = step;  // metrics.jsonl keeps the lines up to here (a resume drops later ones)
  bool materialized = false;
  auto materialize = [&] {
    if (materialized) return;
    collectively(comm, [&] {
      if (!main_rank) return;
      const bool fresh = fs::create_directory(cfg.run_dir);  // the parent exists (checked above)
      try {
        write_file_atomic(cfg.run_dir + "/config.json", config_json.dump(2) + "\n");
        write_file_atomic(cfg.run_dir + "/config.toml", config_toml(config_json));  // --config reads it back
        metrics_log.emplace(cfg.run_dir + "/metrics.jsonl", start_step);
      } catch (...) {  // a full disk: a run that cannot start leaves no half-made folder behind
        metrics_log.reset();
        std::error_code ec;
        if (fresh) fs::remove_all(cfg.run_dir, ec);
        throw;
      }
    });
    materialized = true;
  };
  make_weight_provider(cfg, in, comm);

  data::Loader loader(ds, loader_options(cfg, in, comm), cursor);

  Schedule schedule;
  schedule.lr = cfg.lr;
  schedule.min_lr = cfg.min_lr;
  schedule.warmup_steps = cfg.warmup;
  schedule.total_steps = cfg.steps;

  if (main_rank) {
    spdlog::info("model {}: {} layers, hidden {}, {} heads / {} KV heads; {}", cfg.model_dir, mc.num_hidden_layers,
                 mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads, trainee->what());
    const int64_t groups = comm.size() / cfg.context_parallel;
    const int64_t accumulated = in.global_batch / (groups * cfg.micro_batch);
    auto plural = [](int64_t n, const char* one, const char* many) { return fmt::format("{} {}", n, n == 1 ? one : many); };
    spdlog::info("data {}: {} of {} tokens; global batch {} ({} × {} of {}), {} per epoch", cfg.data_path,
                 plural(ds.num_sequences(), "sequence", "sequences"), ds.seq_len(), in.global_batch,
                 cfg.context_parallel > 1
                     ? fmt::format("{} of {} ranks", plural(groups, "context-parallel group", "context-parallel groups"),
                                   cfg.context_parallel)
                     : plural(comm.size(), "rank", "ranks"),
                 plural(accumulated, "micro-batch", "micro-batches"), cfg.micro_batch,
                 plural(loader.steps_per_epoch(), "step", "steps"));
  }

  update.reload_values();  // a resumed checkpoint's values
  std::optional<ProgressDisplay> progress;
  if (main_rank) progress.emplace(cfg.steps, stderr_is_tty(), std::max<int64_t>(cfg.log_every, 1));

  auto save = [&](int64_t done) {
    ckpt::SaveRequest req;
    req.step = done;
    req.gates = &gates;
    req.state = {{"config", config_json}, {"cursor", loader.cursor().to_json(in.global_batch, ds.num_sequences())}};
    req.optimizer.t = adam.t();
    req.optimizer.flat_size = n;
    req.optimizer.begin = range.begin;
    req.optimizer.end = range.end;
    req.optimizer.m = adam.m();
    req.optimizer.v = adam.v();
    req.keep_last = cfg.keep_last;
    const std::string dir = ckpt::save_checkpoint(comm, cfg.run_dir, req);
    if (main_rank) {
      progress->finish();  // on a terminal, end the bar's line first (the bar resumes below)
      spdlog::info("saved {}", dir);
    }
    return dir;
  };

  // MFU: against the bf16 peak of this rank's GPU, where it is known (never a guessed figure).
  const std::optional<double> peak_tflops =
      cfg.device == Device::CUDA ? bf16_peak_tflops(cuda::device_name()) : std::nullopt;
  // The gates' own dims (an --init-gates file or a resumed run may differ from --gate-hidden).
  const auto* gate_set = dynamic_cast<const gates::RetentionGates*>(&gates);
  const gates::GateDims gate_dims =
      gate_set ? gate_set->dims()
               : gates::GateDims{cfg.gate, mc.num_hidden_layers, mc.hidden_size, cfg.gate_hidden, mc.num_key_value_heads};

  install_stop_signal_handlers();
  const auto run_start = Clock::now();
  const int64_t first_step = step;
  std::string last_saved;
  bool stopped = false;
  std::string stop_reason;
  std::optional<StepMetrics> first_metrics, last_metrics;  // of this invocation, for the summary
  while (step < cfg.steps) {
    if (fault::hangs_at(comm.rank(), step + 1)) fault::hang_forever();  // tests only (kernels/base/fault.h)
    const auto t0 = Clock::now();
    const NvtxRange step_range("step");
    const data::PackedBatch batch = loader.next();
    const std::vector<MicroBatch> micro_batches = make_micro_batches(batch, cfg.micro_batch);
    if (cfg.device == Device::CUDA) cuda::reset_device_memory_peak();
    if (cfg.device == Device::CPU) reset_host_tensor_peak();
    gates.zero_grad();
    const bool log_step = (step + 1) % std::max<int64_t>(cfg.log_every, 1) == 0 || step + 1 == cfg.steps;
    StepMetrics m;
    std::string bad;
    try {
      bad = trainee->step(*in.weights, micro_batches, log_step, m, comm);
    } catch (const CollectiveError&) {
      throw;
    } catch (const Error& e) {  // e.g. "layer 3: gated_attention: log_beta[17, 0] = nan ..."
      fail("step {}: {} (the last good checkpoint is {})", step + 1, e.what(),
           last_saved.empty() ? (resume_dir ? *resume_dir : std::string("none")) : last_saved);
    }

    // Gradient: this rank's part → reduce-scatter → the global gradient of this rank's shard.
    std::optional<NvtxRange> phase_range(std::in_place, "reduce");
    const double grad_norm = update.reduce_gradients();
    if (bad.empty() && !std::isfinite(grad_norm)) bad = nonfinite_gradient(gates, comm);
    if (!bad.empty())  // the losses and the norm are global: every rank stops here together
      throw CollectiveError(fmt::format("step {}: {}; stopping (the last good checkpoint is {})", step + 1, bad,
           last_saved.empty() ? (resume_dir ? *resume_dir : std::string("none")) : last_saved), main_rank);

    const double lr = schedule.at(step);
    phase_range.emplace("optimizer");
    update.apply(lr, cfg.clip);
    phase_range.reset();
    ++step;
    if (fault::overflows_after(step))  // tests only (kernels/base/fault.h): values gone to ±inf
      for (Parameter& p : gates.parameters()) std::fill_n(p.value.data<float>(), p.value.numel(), 1e30f * 1e30f);
    materialize();

    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    dist::CommTimes comm_times = comm.take_device_times();  // local; never blocks
    double ring_mb = std::numeric_limits<double>::quiet_NaN();
    if (in.context_group) {  // the ring's transfers count too (the group's own clock)
      ring_mb = static_cast<double>(in.context_group->take_ring_bytes()) / 1e6;
      const dist::CommTimes ring = in.context_group->take_device_times();
      auto add = [](double& a, double b) { a = std::isnan(a) ? b : std::isnan(b) ? a : a + b; };
      add(comm_times.busy_seconds, ring.busy_seconds);
      add(comm_times.exposed_seconds, ring.exposed_seconds);
    }
    if (main_rank) {
      m.comm_ms = comm_times.busy_seconds * 1e3;
      m.comm_exposed_ms = comm_times.exposed_seconds * 1e3;
      m.ring_mb = ring_mb;
      m.step = step;
      m.total_steps = cfg.steps;
      m.lr = lr;
      m.grad_norm = grad_norm;
      m.step_seconds = seconds;
      m.tokens_per_s = seconds > 0 ? static_cast<double>(m.tokens) / seconds : 0.0;
      if (!cfg.kvpop && seconds > 0) {
        // (this rank's share: a context-parallel rank computes 1/N of its micro-batches)
        m.tflops = step_flops(mc, gate_dims, micro_batch_shapes(micro_batches)).total() / cfg.context_parallel /
                   seconds / 1e12;
        if (peak_tflops) m.mfu = m.tflops / *peak_tflops;
      }
      m.peak_memory_gb = peak_memory_gb(cfg.device);
      if (cfg.device == Device::CPU) m.tensor_peak_gb = static_cast<double>(host_tensor_memory().peak) / 1e9;
      const double elapsed = std::chrono::duration<double>(Clock::now() - run_start).count();
      m.eta_seconds = elapsed / static_cast<double>(step - first_step) * static_cast<double>(cfg.steps - step);
      if (log_step) metrics_log->write(m);
      progress->update(m);
      if (!first_metrics) first_metrics = m;
      last_metrics = m;
    }

    // Stop signals: any rank's signal stops every rank at the same step; --stop-after likewise.
    double signal = stop_signal() != 0 ? 1.0 : 0.0;
    comm.all_reduce(&signal, 1);
    if (signal > 0) stop_reason = stop_signal() ? fmt::format("signal {}", stop_signal()) : "a signal on another rank";
    if (signal == 0 && cfg.stop_after > 0 && step - first_step == cfg.stop_after && step < cfg.steps) {
      signal = 1;
      stop_reason = "--stop-after";
    }
    const bool save_now = step % std::max<int64_t>(cfg.save_every, 1) == 0 || step == cfg.steps || signal > 0;
    if (save_now) {
      // A full disk or an I/O error: the save left `latest` on the last complete checkpoint.
      // Every rank stops here together; the rank whose write failed says why.
      try {
        last_saved = save(step);
      } catch (const ckpt::PeerSaveError& e) {
        throw CollectiveError(e.what(), false);
      } catch (const Error& e) {
        const std::string prefix = comm.size() > 1 ? fmt::format("rank {}: ", comm.rank()) : std::string();
        throw CollectiveError(fmt::format("{}step {}: saving the checkpoint failed: {} (the last complete checkpoint is {})",
                                          prefix, step, e.what(),
                                          last_saved.empty() ? (resume_dir ? *resume_dir : std::string("none")) : last_saved),
                              true);
      }
    }
    if (signal > 0) {
      stopped = true;
      break;
    }
  }
  if (main_rank) {
    progress->finish();
    if (first_metrics && last_metrics->step > first_metrics->step)
      spdlog::info("{}", trainee->summary(*first_metrics, *last_metrics));
    if (stopped)
      spdlog::info("stopped after step {} ({}); continue with --resume", step, stop_reason);
    // launch/mpirun.sh asks through RETAIN_STOP_FILE whether a signal ended the job cleanly
    // (mpirun itself exits 1 once it has forwarded a signal, however the ranks ended).
    if (stopped)
      if (const char* f = std::getenv("RETAIN_STOP_FILE"); f && *f)
        write_file_atomic(f, fmt::format("stopped {}\n", step));
    if (step >= cfg.steps) {
      // The base model by identity (an absolute directory) and content (its config's hash).
      std::map<std::string, std::string> meta = trainee->final_metadata();
      meta["base_model"] = fs::absolute(cfg.model_dir).lexically_normal().string();
      meta["base_config_sha256"] = data::sha256_file(fs::path(cfg.model_dir) / "config.json");
      meta["step"] = std::to_string(step);
      gates.save(cfg.run_dir + "/gates.safetensors", meta);
      spdlog::info("done: {} steps; gates {}/gates.safetensors, checkpoint {}", step, cfg.run_dir,
                   last_saved.empty() ? std::string("(none new)") : last_saved);
    }
  }
  log_fsdp_stats(*in.weights, comm);
  comm.barrier();
  return 0;
}

void dump_gradients(const TrainConfig& cfg, dist::Comm& comm) {
  Inputs in;
  std::unique_ptr<Trainee> trainee;
  collectively(comm, [&] {
    if (comm.is_main_rank()) cli::check_output("--dump-grads", cfg.dump_grads, {cfg.model_dir, cfg.data_path, cfg.init_gates});
    in = open_inputs(cfg, comm);
  });
  in.context_group = make_context_group(cfg, comm);
  collectively(comm, [&] { trainee = make_trainee(cfg, in); });
  ParameterSet& gates = trainee->params();
  make_weight_provider(cfg, in, comm);
  const data::PackedDataset& ds = *in.data;
  data::Loader loader(ds, loader_options(cfg, in, comm));
  const data::PackedBatch batch = loader.next();
  gates.zero_grad();
  StepMetrics m;
  trainee->step(*in.weights, make_micro_batches(batch, cfg.micro_batch), false, m, comm);
  log_fsdp_stats(*in.weights, comm);

  // The global gradient on every rank, then the global batch in rank order.
  const int64_t n = flat_size(gates);
  std::vector<float> grads(static_cast<size_t>(n));
  flatten_grads(gates, grads.data());
  comm.all_reduce(grads.data(), grads.size());
  // (Every rank of a context-parallel group read the same sequences: its first rank's are kept.)
  const int64_t B = in.global_batch, S = ds.seq_len(), local = batch.input_ids.dim(0), W = comm.size();
  Tensor all_ids = Tensor::empty({W * local, S}, DType::I32), all_docs = Tensor::empty({W * local, S}, DType::I32),
         all_mask = Tensor::empty({W * local, S}, DType::U8);
  comm.all_gather_bytes(batch.input_ids.data<int32_t>(), all_ids.data<int32_t>(), static_cast<size_t>(local * S) * 4);
  comm.all_gather_bytes(batch.doc_ids.data<int32_t>(), all_docs.data<int32_t>(), static_cast<size_t>(local * S) * 4);
  comm.all_gather_bytes(batch.target_mask.data<uint8_t>(), all_mask.data<uint8_t>(), static_cast<size_t>(local * S));
  if (!comm.is_main_rank()) return;
  Tensor ids = Tensor::empty({B, S}, DType::I32), docs = Tensor::empty({B, S}, DType::I32),
         mask = Tensor::empty({B, S}, DType::U8);
  for (int64_t g = 0; g * local < B; ++g) {
    const int64_t from = g * cfg.context_parallel * local;
    ids.rows(g * local, (g + 1) * local).copy_from(all_ids.rows(from, from + local));
    docs.rows(g * local, (g + 1) * local).copy_from(all_docs.rows(from, from + local));
    mask.rows(g * local, (g + 1) * local).copy_from(all_mask.rows(from, from + local));
  }

  unflatten_grads(gates, grads.data());  // the global gradient
  std::vector<std::pair<std::string, Tensor>> out;
  for (const Parameter& p : gates.parameters())
    for (const std::string& name : p.file_names) {
      out.emplace_back(name, p.value);
      out.emplace_back("grad/" + name, p.grad);
    }
  std::map<std::string, std::string> meta = {{"format", "retain-dump-grads"},
                                              {"world_size", std::to_string(comm.size())}};
  trainee->dump_extras(out, meta);
  out.emplace_back("batch/input_ids", ids);
  out.emplace_back("batch/doc_ids", docs);
  out.emplace_back("batch/target_mask", mask);
  formats::write_safetensors(cfg.dump_grads, out, meta);
  spdlog::info("wrote {}: {} parameter tensors", cfg.dump_grads, gates.parameters().size());
}

}  // namespace retain::trainer
