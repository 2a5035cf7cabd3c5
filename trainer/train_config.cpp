#include "trainer/train_config.h"

#include <map>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

namespace retain::trainer {

nlohmann::json to_json(const TrainConfig& c) {
  nlohmann::json j = {
      {"model", c.model_dir},
      {"data", c.data_path},
      {"out", c.run_dir},
      {"gate", c.kvpop ? std::string("kvpop") : std::string(gates::gate_kind_name(c.gate))},
      {"gate_hidden", c.gate_hidden},
      {"bias_init", c.bias_init},
      {"init_gates", c.init_gates},
      {"memory", c.memory},
      {"cap_weight", c.cap_weight},
      {"kl_weight", c.kl_weight},
      {"ntp_weight", c.ntp_weight},
      {"loss_chunk", c.loss_chunk},
      {"capacity", c.global_capacity() ? "global" : "local"},
      {"lr", c.lr},
      {"min_lr", c.min_lr},
      {"warmup", c.warmup},
      {"weight_decay", c.weight_decay},
      {"adam_beta1", c.adam_beta1},
      {"adam_beta2", c.adam_beta2},
      {"clip", c.clip},
      {"steps", c.steps},
      {"global_batch", c.global_batch},
      {"micro_batch", c.micro_batch},
      {"seed", c.seed},
      {"save_every", c.save_every},
      {"keep_last", c.keep_last},
      {"log_every", c.log_every},
      {"stop_after", c.stop_after},
      {"seq_len", c.seq_len},
      {"timeout", c.timeout},
      {"comm", c.comm},
      {"device", std::string(device_name(c.device))},
  };
  // Only an approximate skip is written, so configs of the exact default stay as before.
  if (c.capacity_skip != TrainConfig{}.capacity_skip) j["capacity_skip"] = c.capacity_skip;
  if (c.fsdp_force_gather) j["fsdp_force_gather"] = true;  // only when set, likewise
  if (c.context_parallel > 1) j["context_parallel"] = c.context_parallel;  // likewise
  if (c.kl != ops::KlDirection::forward) j["kl"] = ops::kl_direction_name(c.kl);  // likewise
  if (c.gate_input != gates::GateInput::hidden) j["gate_input"] = gates::gate_input_name(c.gate_input);  // likewise
  if (c.kvpop) {  // only kvpop runs have them, so gate runs' configs are as before
    j["window"] = c.window;
    j["sinks"] = c.sinks;
    j["topk"] = c.topk;
    j["margin_weight"] = c.margin_weight;
    j["decay_every"] = c.decay_every;
    j["decay_min"] = c.decay_min;
    j["decay_max"] = c.decay_max;
    j["target_cutoff"] = c.target_cutoff;
  }
  return j;
}

std::string trajectory_difference(const nlohmann::json& saved, const nlohmann::json& now) {
  // loss_chunk only changes float rounding inside a chunk's GEMM, not the math, but an exact
  // resume needs it equal too.
  static const char* const kFields[] = {"model",  "data",         "gate",       "gate_hidden", "bias_init",
                                        "init_gates", "memory",   "cap_weight", "kl_weight",   "ntp_weight",
                                        "loss_chunk", "lr",       "min_lr",     "warmup",      "weight_decay",
                                        "clip",   "global_batch", "micro_batch", "seed",       "seq_len",
                                        "window", "sinks",        "topk",        "margin_weight", "capacity_skip",
                                        "adam_beta1", "adam_beta2", "decay_every", "decay_min", "decay_max",
                                        "target_cutoff", "kl", "capacity", "gate_input"};
  // Fields that configs written before they existed lack: such a run used these values (a kvpop
  // run then ranked its targets by raw log m). Filled in only where the other side has the
  // field, so gate runs (no kvpop fields) still compare as before.
  static const std::pair<const char*, nlohmann::json> kBefore[] = {
      {"adam_beta1", 0.9},   {"adam_beta2", 0.999},     {"decay_every", 1},
      {"decay_min", 0.999},  {"decay_max", 0.999999},   {"target_cutoff", "raw"}};
  nlohmann::json s = saved;
  for (const auto& [f, v] : kBefore)
    if (!s.contains(f) && now.contains(f) && (std::string_view(f).starts_with("adam") || s.contains("window")))
      s[f] = v;
  // Fields written only when they differ from their default: absent means the default.
  static const std::map<std::string, nlohmann::json> kImplicit = {{"kl", "forward"}, {"gate_input", "hidden"}};
  for (const char* f : kFields) {
    if (const auto d = kImplicit.find(f); d != kImplicit.end() && s.contains(f) != now.contains(f)) {
      const nlohmann::json& a = s.contains(f) ? s[f] : d->second;
      const nlohmann::json& b = now.contains(f) ? now[f] : d->second;
      if (a != b) return fmt::format("{}: {} in the checkpoint, {} now", f, a.dump(), b.dump());
      continue;
    }
    const bool in_saved = s.contains(f), in_now = now.contains(f);
    if (!in_saved || !in_now) {
      if (in_saved != in_now) return fmt::format("{}: missing in the {}", f, in_saved ? "new config" : "checkpoint");
      continue;
    }
    if (s[f] != now[f]) return fmt::format("{}: {} in the checkpoint, {} now", f, s[f].dump(), now[f].dump());
  }
  // The cosine runs to `steps`: changing it moves every later learning rate, unless the
  // schedule is flat (lr == min_lr).
  if (saved.contains("steps") && now.contains("steps") && saved["steps"] != now["steps"] && saved.contains("lr") &&
      saved.contains("min_lr") && saved["lr"] != saved["min_lr"])
    return fmt::format("steps: {} in the checkpoint, {} now (the learning-rate schedule runs to --steps; keep it, "
                       "or use --lr equal to --min-lr)",
                       saved["steps"].dump(), now["steps"].dump());
  return {};
}

}  // namespace retain::trainer
