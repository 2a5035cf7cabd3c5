// retain-train: trains retention gates on a frozen Qwen3 (DESIGN §7). One process is a
// one-rank world; under mpirun every rank runs this same main (rank 0 alone prints).
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "kernels/base/cli.h"
#include "kernels/device.h"
#include "trainer/config_file.h"
#include "kernels/dist/comm.h"
#include "trainer/signals.h"
#include "trainer/train.h"
#include "trainer/train_config.h"

using namespace retain;

namespace {

constexpr const char* kUsage =
    "Usage: retain-train --model DIR --data FILE.h5 --out RUN_DIR [--gate trimkv|dbtrimkv|kvpop]\n"
    "                    [--memory M] [--cap-weight λ] [--kl-weight W] [--ntp-weight W] [--kl reverse]\n"
    "                    [--bias-init B] [--gate-hidden G] [--gate-input hidden|kv] [--lr LR] [--steps N]\n"
    "                    [--seed S]\n"
    "                    [--resume] [--dump-grads FILE.safetensors] [--config run.toml]\n"
    "                    [more options below]\n"
    "       mpirun -np N retain-train ...   (data parallel; frozen weights sharded FSDP-style)\n\n"
    "Trains TRIM-KV (trimkv) or DBTrimKV (dbtrimkv) retention gates on the frozen Qwen3 in DIR\n"
    "with the packed dataset FILE.h5 (retain-pack): loss = kl-weight·KL(teacher‖student) (--kl\n"
    "reverse: KL(student‖teacher)) +\n"
    "ntp-weight·NTP + cap-weight·capacity(M) (docs/math.md). RUN_DIR receives config.json,\n"
    "metrics.jsonl, checkpoints/step-XXXXXXXX/ (every --save-every steps, the last --keep-last\n"
    "kept, `checkpoints/latest` naming the newest) and, at the end, gates.safetensors.\n"
    "--gate kvpop --topk K [--window 64 --sinks 4] [--no-margin-weight] trains KVPOP scorers\n"
    "instead (DESIGN §5: layer-local pairwise loss on the frozen model's future attention;\n"
    "gates.safetensors then holds the scorers).\n"
    "SIGTERM/SIGINT save a checkpoint and exit; --resume continues the run exactly.\n"
    "--dump-grads runs one optimizer-free step on the first batch and writes every gate\n"
    "parameter, its gradient (grad/NAME), the losses (loss/*) and the batch (batch/*).\n"
    "--config FILE reads options from TOML (`lr = 3e-3`, `global_batch = 8`); the command line\n"
    "wins. Every run writes RUN_DIR/config.toml: `--config RUN_DIR/config.toml --out NEW` repeats it.";

// An NCCL comm over the ranks of `host` when --comm asks for one (auto: on cuda with several
// ranks, or with --fsdp-force-gather, whose point is NCCL's gather path on one GPU), else
// null: the run uses `host` itself.
std::unique_ptr<dist::Comm> nccl_comm_if_wanted(const trainer::TrainConfig& c, dist::Comm& host) {
  const bool nccl = c.comm == "nccl" || (c.comm == "auto" && c.device == Device::CUDA &&
                                         (host.size() > 1 || c.fsdp_force_gather) && dist::nccl_built());
  if (!nccl) return nullptr;
  bind_local_gpu(dist::node_local_rank(host));  // NCCL's communicator belongs to the current device
  return dist::make_nccl_comm(host);
}

// `nccl` receives the NCCL comm when the run uses one (main keeps it, to abort through it).
int run(int argc, char** argv, dist::Comm& host_comm, std::unique_ptr<dist::Comm>& nccl) {
  trainer::TrainConfig c;
  std::string gate = "trimkv";
  std::string device;
  double timeout = 0;  // c.timeout once the device is known (its default depends on it)
  std::string kl;      // c.kl, parsed below
  std::string gate_input;  // c.gate_input, parsed below
  cli::po::options_description opts("Options");
  opts.add_options()
      ("model", cli::po::value(&c.model_dir)->required(), "frozen Qwen3 (Hugging Face directory)")
      ("data", cli::po::value(&c.data_path)->required(), "packed dataset (.h5 from retain-pack)")
      ("out", cli::po::value(&c.run_dir), "run directory (required unless --dump-grads)")
      ("gate", cli::po::value(&gate)->default_value("trimkv"),
       "trimkv (local capacity), dbtrimkv (global) or kvpop (mLSTM scorers, DESIGN §5)")
      ("window", cli::po::value(&c.window)->default_value(64), "kvpop: protected window w")
      ("sinks", cli::po::value(&c.sinks)->default_value(4), "kvpop: sink tokens s")
      ("topk", cli::po::value(&c.topk)->default_value(0), "kvpop: top-k eligible keys k (required; budget = s + w + k)")
      ("no-margin-weight", cli::po::bool_switch(), "kvpop: weight every decision 1 instead of |Δ target| / its mean")
      ("decay-every", cli::po::value(&c.decay_every)->default_value(1),
       "kvpop: the decay steps every n tokens, ŝ_i(q) = score_i + floor((q − i)/n)·log γ (the KVPOP paper's n; "
       "1: (q − i)·log γ)")
      ("decay-min", cli::po::value(&c.decay_min)->default_value(0.999, "0.999"),
       "kvpop: lower end γ_min of the decay range; log γ = log γ_min + (log γ_max − log γ_min)·σ(θ)")
      ("decay-max", cli::po::value(&c.decay_max)->default_value(0.999999, "0.999999"),
       "kvpop: upper end γ_max of the decay range (default range: the KVPOP paper's Table 2)")
      ("target-cutoff", cli::po::value(&c.target_cutoff)->default_value("effective"),
       "kvpop: effective (the paper: the boundary key, y and the margin from log m + the same decay, with the "
       "scorer's current γ) or raw (from log m alone)")
      ("memory", cli::po::value(&c.memory)->default_value(128), "memory budget M of the capacity loss (tokens)")
      ("cap-weight", cli::po::value(&c.cap_weight)->default_value(1.0), "λ: weight of the capacity loss")
      ("capacity", cli::po::value(&c.capacity),
       "local or global: the capacity loss per (layer, KV head) with budget M, or over all of them with budget "
       "L·K·M (default: local for trimkv, global for dbtrimkv, DESIGN §4)")
      ("capacity-skip", cli::po::value(&c.capacity_skip)->default_value(60),
       "E: skip capacity tiles whose every term is below e^-E; 60 is exact to float rounding, a smaller E is "
       "faster and approximate (each capacity sum moves by < T·e^-E)")
      ("kl-weight", cli::po::value(&c.kl_weight)->default_value(0.5), "weight of the KL term")
      ("kl", cli::po::value(&kl)->default_value("forward"),
       "forward: KL(teacher‖student) (DESIGN §4); reverse: KL(student‖teacher) (TRIM-KV Fig. 9's ablation)")
      ("ntp-weight", cli::po::value(&c.ntp_weight)->default_value(0.5), "weight of the next-token loss")
      ("bias-init", cli::po::value(&c.bias_init)->default_value(18.0), "initial gate bias b (18: β≈1, plain attention)")
      ("gate-hidden", cli::po::value(&c.gate_hidden)->default_value(512),
       "gate hidden size G for new gates; 0: a linear gate logβ = logsigmoid(W·h + b) (trimkv only)")
      ("gate-input", cli::po::value(&gate_input)->default_value("hidden"),
       "what the gates read: hidden (the input-RMSNorm output h, DESIGN §4) or kv (the token's keys after k_norm "
       "and RoPE and its values, [k ‖ v], DBTrimKV Tables 4–5's ablation)")
      ("init-gates", cli::po::value(&c.init_gates), "start from these gates instead of fresh ones (.safetensors, .gguf, .pth or a TRIM-KV directory)")
      ("lr", cli::po::value(&c.lr)->default_value(2e-4, "2e-4"), "peak learning rate (AdamW)")
      ("min-lr", cli::po::value(&c.min_lr)->default_value(0.0), "learning rate at the end of the cosine")
      ("warmup", cli::po::value(&c.warmup)->default_value(0), "linear warmup steps")
      ("weight-decay", cli::po::value(&c.weight_decay)->default_value(1e-6, "1e-6"), "AdamW decoupled weight decay")
      ("adam-beta1", cli::po::value(&c.adam_beta1)->default_value(0.9, "0.9"), "AdamW β1, in [0, 1)")
      ("adam-beta2", cli::po::value(&c.adam_beta2)->default_value(0.999, "0.999"),
       "AdamW β2, in [0, 1) (the KVPOP paper uses 0.95)")
      ("clip", cli::po::value(&c.clip)->default_value(1.0), "global gradient-norm clip (0: off)")
      ("steps", cli::po::value(&c.steps)->default_value(100), "optimizer steps")
      ("global-batch", cli::po::value(&c.global_batch)->default_value(0),
       "sequences per optimizer step over all ranks (0: one micro-batch per rank)")
      ("micro-batch", cli::po::value(&c.micro_batch)->default_value(1),
       "sequences per forward pass on one rank, or on one context-parallel group (global-batch / (groups × "
       "micro-batch) are accumulated)")
      ("context-parallel", cli::po::value(&c.context_parallel)->default_value(1),
       "split each micro-batch's tokens over N ranks (a front and a back chunk each; attention and the capacity "
       "sums pass the other chunks around a ring): the world is ranks/N data-parallel groups of N. Same results "
       "as one rank, to rounding; for sequences longer than one rank holds. trimkv, dbtrimkv and kvpop; CPU, "
       "and CUDA (unverified on a GPU)")
      ("loss-chunk", cli::po::value(&c.loss_chunk)->default_value(1024), "tokens per KL/NTP logits chunk")
      ("seq-len", cli::po::value(&c.seq_len)->default_value(0), "expected sequence length (0: the dataset's)")
      ("seed", cli::po::value(&c.seed)->default_value(0), "seed of the gate init and the data order")
      ("save-every", cli::po::value(&c.save_every)->default_value(100), "checkpoint every N steps (and at the end)")
      ("keep-last", cli::po::value(&c.keep_last)->default_value(3), "checkpoints kept (0: all)")
      ("log-every", cli::po::value(&c.log_every)->default_value(1), "metrics line every N steps")
      ("stop-after", cli::po::value(&c.stop_after)->default_value(0),
       "save a checkpoint and exit after N steps of this invocation (0: run to --steps)")
      ("timeout", cli::po::value(&timeout),
       "end the job (exit 75) when a collective has waited this many seconds for a rank that hung or "
       "stopped, naming it; set it well above the longest step (default: 600 on cuda, 0 = wait forever on cpu)")
      ("device", cli::po::value(&device),
       "cpu or cuda (default: $RETAIN_DEVICE, else cuda when a GPU is visible, else cpu). On cuda each rank uses "
       "the GPU of its node-local rank; one rank holds the whole model in bf16, several shard it (FSDP)")
      ("comm", cli::po::value(&c.comm)->default_value("auto"),
       "auto, mpi or nccl: the collectives' backend. auto: nccl on cuda with several ranks or --fsdp-force-gather "
       "(when built with NCCL), else mpi. mpi on cuda stages device buffers through the host (slow; lets ranks "
       "share a GPU)")
      ("fsdp-force-gather", cli::po::bool_switch(&c.fsdp_force_gather),
       "shard the frozen weights (FSDP) and all-gather each layer through the comm even in a one-rank world, "
       "where they are otherwise used in place: on one GPU this runs the multi-GPU path (layer buffers, the "
       "prefetch on NCCL's stream, comm_ms/comm_exposed_ms in the metrics) to measure the overlap. Same values, "
       "more memory and time")
      ("resume", cli::po::bool_switch(&c.resume), "continue the run in --out from its latest checkpoint")
      ("dump-grads", cli::po::value(&c.dump_grads), "write one step's gradients to FILE.safetensors and exit")
      ("config", cli::po::value<std::string>(), "read options from a TOML file (keys = option names; the command line wins)");
  // Every rank parses the same argv the same way, so every rank reaches the same verdict (a
  // usage error, --help, or a run) and they all leave together; rank 0 alone prints.
  std::vector<std::string> stray;
  opts.add_options()("help,h", "print this help and exit");
  cli::po::options_description hidden;
  hidden.add_options()("stray", cli::po::value(&stray));
  cli::po::options_description all;
  all.add(opts).add(hidden);
  cli::po::positional_options_description positional;
  positional.add("stray", -1);
  cli::po::variables_map vm;
  cli::po::store(cli::po::command_line_parser(argc, argv).options(all).positional(positional).run(), vm);
  if (vm.count("config") && !vm.count("help")) {
    // Stored after the command line: program_options keeps the first value, so the command line wins.
    const std::vector<std::string> file_args = trainer::config_file_arguments(vm["config"].as<std::string>(), opts);
    cli::po::store(cli::po::command_line_parser(file_args).options(opts).run(), vm);
  }
  if (vm.count("help")) {
    if (host_comm.is_main_rank()) std::cout << kUsage << "\n\n" << opts << "\n";
    return 0;
  }
  cli::po::notify(vm);
  cli::check_finite_numbers(vm);  // --lr inf, --bias-init nan, in either the command line or --config
  if (!stray.empty()) throw cli::UsageError(fmt::format("unexpected argument '{}'", stray.front()));
  c.kvpop = gate == "kvpop";
  if (!c.kvpop && gate != "trimkv" && gate != "dbtrimkv")  // a command-line mistake: exit 2
    throw cli::UsageError(fmt::format("--gate: unknown gate kind '{}' (expected trimkv, dbtrimkv or kvpop)", gate));
  if (!c.kvpop) c.gate = gates::parse_gate_kind(gate, "--gate");
  c.margin_weight = !vm["no-margin-weight"].as<bool>();
  if (c.kvpop) {
    if (c.topk < 1)
      throw cli::UsageError(fmt::format("--gate kvpop needs --topk K ≥ 1 (the eligible keys kept besides sinks and "
                                        "window), got {}", c.topk));
    if (c.window < 1 || c.sinks < 0)
      throw cli::UsageError(fmt::format("--window must be ≥ 1 and --sinks ≥ 0, got {} and {}", c.window, c.sinks));
    if (c.decay_every < 1) throw cli::UsageError(fmt::format("--decay-every must be ≥ 1, got {}", c.decay_every));
    if (!(c.decay_min > 0) || !(c.decay_min <= 1))
      throw cli::UsageError(fmt::format("--decay-min must be in (0, 1], got {}", c.decay_min));
    if (!(c.decay_max >= c.decay_min) || !(c.decay_max <= 1))
      throw cli::UsageError(
          fmt::format("--decay-max must be in [--decay-min, 1] = [{}, 1], got {}", c.decay_min, c.decay_max));
    if (c.target_cutoff != "effective" && c.target_cutoff != "raw")
      throw cli::UsageError(
          fmt::format("--target-cutoff: unknown rule '{}' (expected effective or raw)", c.target_cutoff));
  } else if (vm["no-margin-weight"].as<bool>() || !vm["topk"].defaulted() || !vm["window"].defaulted() ||
             !vm["sinks"].defaulted() || !vm["decay-every"].defaulted() || !vm["decay-min"].defaulted() ||
             !vm["decay-max"].defaulted() || !vm["target-cutoff"].defaulted()) {
    throw cli::UsageError("--window, --sinks, --topk, --no-margin-weight, --decay-every, --decay-min, --decay-max and "
                          "--target-cutoff are for --gate kvpop");
  }
  if (!(c.adam_beta1 >= 0 && c.adam_beta1 < 1))
    throw cli::UsageError(fmt::format("--adam-beta1 must be in [0, 1), got {}", c.adam_beta1));
  if (!(c.adam_beta2 >= 0 && c.adam_beta2 < 1))
    throw cli::UsageError(fmt::format("--adam-beta2 must be in [0, 1), got {}", c.adam_beta2));
  if (c.dump_grads.empty() && c.run_dir.empty()) throw cli::UsageError("--out is required (unless --dump-grads)");
  if (c.steps < 1) throw cli::UsageError(fmt::format("--steps must be ≥ 1, got {}", c.steps));
  if (c.loss_chunk <= 0) throw cli::UsageError(fmt::format("--loss-chunk must be positive, got {}", c.loss_chunk));
  if (c.micro_batch <= 0) throw cli::UsageError(fmt::format("--micro-batch must be positive, got {}", c.micro_batch));
  if (c.global_batch < 0) throw cli::UsageError(fmt::format("--global-batch must be ≥ 0, got {}", c.global_batch));
  if (c.context_parallel < 1)
    throw cli::UsageError(fmt::format("--context-parallel must be ≥ 1, got {}", c.context_parallel));
  if (c.gate_hidden < 0) throw cli::UsageError(fmt::format("--gate-hidden must be ≥ 0, got {}", c.gate_hidden));
  if (c.gate_hidden == 0 && c.gate != gates::GateKind::trimkv && !c.kvpop)
    throw cli::UsageError("--gate-hidden 0 (the linear gate, TRIM-KV Fig. 10) is for --gate trimkv; dbtrimkv needs G > 0");
  if (!(c.memory >= 0) || !std::isfinite(c.memory))
    throw cli::UsageError(fmt::format("--memory must be a finite number ≥ 0, got {}", c.memory));
  if (!(c.capacity_skip > 0) || !std::isfinite(c.capacity_skip))
    throw cli::UsageError(fmt::format("--capacity-skip must be a finite number > 0, got {}", c.capacity_skip));
  if (c.kvpop && !vm["capacity-skip"].defaulted())
    throw cli::UsageError("--capacity-skip is for the gates' capacity loss, not --gate kvpop");
  if (vm.count("capacity") && c.capacity != "local" && c.capacity != "global")
    throw cli::UsageError(fmt::format("--capacity must be local or global, got '{}'", c.capacity));
  if (c.kvpop && vm.count("capacity"))
    throw cli::UsageError("--capacity is for the gates' capacity loss, not --gate kvpop");
  if (gate_input != "hidden" && gate_input != "kv")
    throw cli::UsageError(fmt::format("--gate-input must be hidden or kv, got '{}'", gate_input));
  c.gate_input = gates::parse_gate_input(gate_input, "--gate-input");
  if (c.kvpop && !vm["gate-input"].defaulted())
    throw cli::UsageError("--gate-input is for the retention gates; kvpop scorers always read [k ‖ v]");
  if (kl != "forward" && kl != "reverse")
    throw cli::UsageError(fmt::format("--kl must be forward or reverse, got '{}'", kl));
  c.kl = ops::parse_kl_direction(kl);
  if (c.kvpop && !vm["kl"].defaulted())
    throw cli::UsageError("--kl is for the gates' quality loss, not --gate kvpop (its loss is the pairwise ranking)");
  if (!(c.lr >= 0) || !(c.min_lr >= 0)) throw cli::UsageError("--lr and --min-lr must be ≥ 0");
  // AdamW moves each parameter by about lr per step: above 10 no rate trains anything (a typo).
  constexpr double kMaxLr = 10;
  if (c.lr > kMaxLr) throw cli::UsageError(fmt::format("--lr {} is above {} (AdamW steps are lr-sized)", c.lr, kMaxLr));
  if (c.min_lr > c.lr)
    throw cli::UsageError(fmt::format("--min-lr {} exceeds --lr {} (the cosine decays from --lr to --min-lr)", c.min_lr, c.lr));
  for (const auto& [name, w] : {std::pair{"--kl-weight", c.kl_weight}, std::pair{"--ntp-weight", c.ntp_weight},
                                std::pair{"--cap-weight", c.cap_weight}})
    if (!(w >= 0) || !std::isfinite(w)) throw cli::UsageError(fmt::format("{} must be a finite number ≥ 0, got {}", name, w));
  if (!c.kvpop && c.kl_weight == 0 && c.ntp_weight == 0 && c.cap_weight == 0)
    throw cli::UsageError("--kl-weight, --ntp-weight and --cap-weight are all 0: the loss would be 0, nothing to train");
  if (c.warmup < 0) throw cli::UsageError(fmt::format("--warmup must be ≥ 0, got {}", c.warmup));
  if (!(c.weight_decay >= 0) || !(c.clip >= 0))
    throw cli::UsageError("--weight-decay and --clip must be ≥ 0");
  // AdamW's decoupled decay multiplies each parameter by 1 − lr·wd every step: at or above 1 it
  // zeroes or flips the parameters.
  if (c.lr * c.weight_decay >= 1)
    throw cli::UsageError(fmt::format("--weight-decay {} with --lr {}: lr × weight decay must stay below 1 (AdamW "
                                      "scales the parameters by 1 − lr·wd each step)",
                                      c.weight_decay, c.lr));
  if (c.save_every <= 0 || c.log_every <= 0 || c.keep_last < 0 || c.stop_after < 0 || c.seq_len < 0)
    throw cli::UsageError("--save-every and --log-every must be ≥ 1; --keep-last, --stop-after and --seq-len ≥ 0");
  if (!(timeout >= 0) || !std::isfinite(timeout))
    throw cli::UsageError(fmt::format("--timeout must be a finite number of seconds ≥ 0, got {}", timeout));
  if (c.comm != "auto" && c.comm != "mpi" && c.comm != "nccl")
    throw cli::UsageError(fmt::format("--comm: unknown backend '{}' (expected auto, mpi or nccl)", c.comm));
  if (!device.empty() && device != "cpu" && device != "cuda")
    throw cli::UsageError(fmt::format("--device: unknown device '{}' (expected cpu or cuda)", device));
  c.device = resolve_device(device);  // a missing GPU: one line, exit 1
  if (c.comm == "nccl" && c.device != Device::CUDA) throw cli::UsageError("--comm nccl needs --device cuda");
  // A GPU step is seconds, so 10 minutes in one collective means a rank is gone; a CPU step of a
  // large model can legitimately keep ranks waiting longer.
  c.timeout = vm.count("timeout") ? timeout : c.device == Device::CUDA ? 600.0 : 0.0;
  nccl = nccl_comm_if_wanted(c, host_comm);  // collective: every rank chooses alike
  dist::Comm& comm = nccl ? *nccl : host_comm;
  // Every rank parsed the same argv: collective, before any other. The default (cuda) gives way
  // where the MPI library cannot host the watchdog (no MPI_THREAD_MULTIPLE): every rank alike.
  try {
    comm.set_timeout(c.timeout);
  } catch (const Error& e) {
    if (vm.count("timeout")) throw;
    if (comm.is_main_rank()) spdlog::warn("no collective watchdog (--timeout 0): {}", e.what());
    c.timeout = 0;
  }
  if (!c.dump_grads.empty()) {
    trainer::dump_gradients(c, comm);
    return 0;
  }
  return trainer::run_training(c, comm);
}

// After a stop signal the checkpoint is saved and every rank is done, but MPI_Finalize (when
// `comm` goes) exchanges with mpirun, and an mpirun that was itself signalled (a scheduler
// preempting the job) is busy with its kill sequence: SIGCONT, 1 s, SIGTERM, 1 s, SIGKILL
// (odls_base_sigkill_timeout), answering nobody meanwhile. Finalizing would wait for the
// SIGKILL; so if it takes longer than half a second, the rank leaves with status 0 without it.
void leave_soon_after_a_stop_signal() {
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    std::fflush(nullptr);
    std::_Exit(0);
  }).detach();
}

}  // namespace

int main(int argc, char** argv) {
  cli::setup_logging();
  std::unique_ptr<dist::Comm> comm;
  try {
    comm = dist::make_comm();
  } catch (const std::exception& e) {
    std::cerr << "retain-train: error: " << e.what() << "\n";
    return 1;
  }
  const bool main_rank = comm->is_main_rank();
  if (!main_rank) spdlog::set_level(spdlog::level::err);  // rank 0 alone prints progress
  std::unique_ptr<dist::Comm> nccl;  // over `comm`'s ranks, when the run uses NCCL; goes first
  try {
    const int code = run(argc, argv, *comm, nccl);
    if (code == 0 && trainer::stop_signal() != 0 && comm->size() > 1) leave_soon_after_a_stop_signal();
    return code;
  } catch (const trainer::CollectiveError& e) {
    // Raised on every rank together: each exits on its own, one of them says why.
    if (e.print()) std::cerr << "retain-train: error: " << e.what() << "\n";
    return 1;
  } catch (const cli::UsageError& e) {  // same argv on every rank
    if (main_rank) std::cerr << "retain-train: error: " << e.what() << " (see --help)\n";
    return 2;
  } catch (const cli::po::error& e) {
    if (main_rank) std::cerr << "retain-train: error: " << e.what() << " (see --help)\n";
    return 2;
  } catch (const std::exception& e) {
    // One rank failed alone: the others would wait for it in their next collective forever.
    if (comm->size() == 1) {
      std::cerr << "retain-train: error: " << e.what() << "\n";
      return 1;
    }
    // One write(2) per line: ranks failing together must not interleave their messages.
    const std::string line = fmt::format("retain-train: error: rank {}: {}\n", comm->rank(), e.what());
    if (::write(STDERR_FILENO, line.data(), line.size()) < 0) {
    }
    (nccl ? *nccl : *comm).abort(1);  // NCCL's communicator too: peers in a collective get an error
  }
}
