#include "trainer/flops.h"

#include <array>
#include <string>
#include <utility>

namespace retain::trainer {

StepFlops step_flops(const Qwen3Config& c, const gates::GateDims& g, const std::vector<MicroBatchShape>& mbs) {
  const double D = static_cast<double>(c.hidden_size), H = static_cast<double>(c.num_attention_heads),
               K = static_cast<double>(c.num_key_value_heads), d = static_cast<double>(c.head_dim),
               I = static_cast<double>(c.intermediate_size), L = static_cast<double>(c.num_hidden_layers),
               V = static_cast<double>(c.vocab_size), G = static_cast<double>(g.gate_hidden),
               GK = static_cast<double>(g.kv_heads);
  const double dense_per_token = 2 * D * (H * d + 2 * K * d) + 2 * H * d * D + 6 * D * I;
  const double attention_per_pair = 4 * d * H;
  const double GD = static_cast<double>(g.hidden);  // the gate's input width (D, or 2·K·d for [k ‖ v])
  const double gate_per_token = g.gate_hidden == 0  // the linear gate: W [K, GD]
                                    ? 2 * GD * GK
                                    : 2 * (GD * G + G * GK) + (g.kind == gates::GateKind::dbtrimkv ? 2 * G * G : 0);
  StepFlops f;
  for (const MicroBatchShape& mb : mbs) {
    double tokens = 0, pairs = 0;
    for (int64_t n : mb.doc_lengths) {
      const double x = static_cast<double>(n);
      tokens += x;
      pairs += x * (x + 1) / 2;
    }
    const double frozen = L * (tokens * dense_per_token + pairs * attention_per_pair);
    const double gate = L * tokens * gate_per_token;
    f.teacher += frozen;
    f.student += frozen + gate;
    f.recompute += frozen + gate;
    f.backward += L * (tokens * dense_per_token + 2.5 * pairs * attention_per_pair) + 2 * gate;
    f.loss += 3 * 2 * D * V * static_cast<double>(mb.loss_positions);
    if (mbs.size() > 1) f.count_pass += frozen + gate;
  }
  return f;
}

std::optional<double> bf16_peak_tflops(std::string_view name) {
  // Exact driver names only: a near match (an NVL or PCIe variant, a cut-down export part)
  // can have a different clock and SM count, and a wrong MFU is worse than none.
  static const std::array<std::pair<std::string_view, double>, 7> kPeaks{{
      {"NVIDIA H100 80GB HBM3", 989.4},  // H100 SXM5
      {"NVIDIA H100 PCIe", 756.0},
      {"NVIDIA H200", 989.4},  // H200 SXM
      {"NVIDIA A100-SXM4-80GB", 312.0},
      {"NVIDIA A100-SXM4-40GB", 312.0},
      {"NVIDIA A100-PCIE-40GB", 312.0},
      {"NVIDIA A100 80GB PCIe", 312.0},
  }};
  for (const auto& [n, peak] : kPeaks)
    if (n == name) return peak;
  return std::nullopt;
}

}  // namespace retain::trainer
