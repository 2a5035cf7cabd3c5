// Everything a training run is configured by: the command line of retain-train resolved into
// one struct, written to RUN/config.json and into every checkpoint, and compared on --resume.
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "kernels/loss.h"
#include "model/gates/gates.h"

namespace retain::trainer {

struct TrainConfig {
  // Inputs and outputs.
  std::string model_dir, data_path, run_dir;
  bool resume = false;
  std::string dump_grads;  // non-empty: one optimizer-free step on the first batch, then exit

  // Gates (DESIGN §4).
  gates::GateKind gate = gates::GateKind::trimkv;
  int64_t gate_hidden = 512;
  gates::GateInput gate_input = gates::GateInput::hidden;  // --gate-input: h, or [k ‖ v] after RoPE
  double bias_init = 18.0;
  std::string init_gates;  // optional: start from this gate file instead of a fresh init

  // KVPOP scorers (DESIGN §5) instead of gates (--gate kvpop); `gate` is then unused.
  bool kvpop = false;
  int64_t window = 64, sinks = 4, topk = 0;
  bool margin_weight = true;  // --no-margin-weight: a = 1
  // The decay of the effective score (kernels/kvpop.h Decay): --decay-every n, --decay-min,
  // --decay-max (the range log γ is mapped into; the KVPOP paper's Table 2 by default).
  int64_t decay_every = 1;
  double decay_min = 0.999, decay_max = 0.999999;
  // --target-cutoff: "effective" (the paper: rank targets by log m plus the decay) or "raw"
  // (log m alone, retain's rule before it).
  std::string target_cutoff = "effective";
  // Loss (DESIGN §4).
  double memory = 128;  // M
  double cap_weight = 1.0, kl_weight = 0.5, ntp_weight = 0.5;
  ops::KlDirection kl = ops::KlDirection::forward;  // --kl: KL(teacher‖student), or reverse
  int64_t loss_chunk = 1024;  // tokens per KL/NTP chunk
  double capacity_skip = 60;  // E: capacity tiles below e^-E skipped (60: exact, ops::kExactSkipExponent)

  // Optimization.
  double lr = 2e-4, min_lr = 0, weight_decay = 1e-6, clip = 1.0;
  double adam_beta1 = 0.9, adam_beta2 = 0.999;  // --adam-beta1, --adam-beta2 (the KVPOP paper: 0.9, 0.95)
  int64_t warmup = 0;
  int64_t steps = 100;
  int64_t global_batch = 0;  // sequences per optimizer step over all ranks (0: one micro-batch per data-parallel group)
  // --context-parallel N: each micro-batch split over N ranks (trainer/context_parallel.h); the
  // world is world/N data-parallel groups of N. Not part of the trajectory: the values are the
  // same (to rounding), so a run may resume with another N.
  int context_parallel = 1;
  int64_t micro_batch = 1;   // sequences per forward pass on one rank
  uint64_t seed = 0;

  // Bookkeeping.
  int64_t save_every = 100;
  int keep_last = 3;
  int64_t log_every = 1;
  int64_t stop_after = 0;  // > 0: save and stop after this many steps of this invocation (time-sliced jobs)
  int64_t seq_len = 0;  // 0: the dataset's; otherwise must equal it
  double timeout = 0;   // > 0: a collective waiting this many seconds ends the job (Comm::set_timeout)
  std::string comm = "auto";  // --comm: auto, mpi or nccl (the backend actually used: Comm::backend())
  // --fsdp-force-gather: the FSDP provider (and its gathers through the comm) in a one-rank
  // world too, to measure the overlap on one GPU (trainer::FsdpOptions::force_gather). Not part
  // of the trajectory: the values are the same.
  bool fsdp_force_gather = false;
  // Where the step computes (--device). Not part of the trajectory: a run may resume on the
  // other device (the numbers then differ by rounding, bf16 on CUDA).
  Device device = Device::CPU;

  // --capacity: "" (DESIGN §4: the local hinge for trimkv, the global one for dbtrimkv), or
  // "local" / "global" whatever the gates (DBTrimKV's Tables 4–5 ablate untied gates under the
  // global capacity).
  std::string capacity;
  bool global_capacity() const { return capacity.empty() ? gate == gates::GateKind::dbtrimkv : capacity == "global"; }
};

nlohmann::json to_json(const TrainConfig& c);

// The fields that define the trajectory of a run (model, data, gates, loss, optimizer, batch,
// seed; steps too, unless the schedule is flat, since the cosine runs to it). A resume must
// agree on all of them, or it would not continue the same run; it may change save/log
// cadence, keep_last and stop_after. Returns "" or a one-line description of the
// first difference ("lr: 0.0002 in the checkpoint, 0.001 now").
std::string trajectory_difference(const nlohmann::json& saved, const nlohmann::json& now);

}  // namespace retain::trainer
