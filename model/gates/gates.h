// Retention gates (DESIGN §4): per layer, a small MLP on the input-RMSNorm output h that
// gives every KV head a log retention rate logβ ≤ 0 per token.
//   trimkv:   logβ = logsigmoid(W2·silu(W1·h + b1) + b)
//   linear:   logβ = logsigmoid(W·h + b)          (a trimkv gate with G = 0: TRIM-KV's Fig. 10 ablation)
//   dbtrimkv: logβ = logsigmoid(W3·silu(W2·silu(W1·h + b1) + b2) + b), W3 and b shared by all layers
// The gates own their parameters, their gradients and their file format (model/gates/gate_file.cpp);
// they never know about ranks. float32 (bias gradients summed in float64). Parameters and
// gradients are CPU tensors (the optimizer, checkpoints, all-reduce and exporters use them);
// forward/backward are written once, through kernels/' ops (ops::linear*, kernels/gate_mlp.h), and
// run on the device of h: CPU, or CUDA against a device mirror of the parameters (sync_to_device /
// add_device_grads_to_host).
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/tensor.h"
#include "model/config.h"
#include "model/param_set.h"

namespace retain::gates {

enum class GateKind { trimkv, dbtrimkv };
// What a gate reads: the input-RMSNorm output h [T, D] (DESIGN §4), or the token's attention key and
// value after k_norm and RoPE, x = [k_1 … k_K ‖ v_1 … v_K] [T, 2·K·head_dim] (DBTrimKV Tables 4–5's
// ablation; the same cached quantities a KVPOP scorer reads).
enum class GateInput { hidden, kv };
// "hidden" / "kv"; anything else fails with "<what>: unknown gate input '<s>' (...)".
GateInput parse_gate_input(std::string_view s, std::string_view what = "gate input");
std::string_view gate_input_name(GateInput input);
// "trimkv" / "dbtrimkv"; anything else fails with "<what>: unknown gate kind '<s>' (...)".
GateKind parse_gate_kind(std::string_view s, std::string_view what = "gate kind");
std::string_view gate_kind_name(GateKind kind);

struct GateDims {
  GateKind kind = GateKind::trimkv;
  int64_t layers = 0;       // L = num_hidden_layers
  int64_t hidden = 0;       // the gate input width: D = hidden_size, or 2·K·head_dim for GateInput::kv
  int64_t gate_hidden = 0;  // G (DESIGN default 512 for new gates); 0: the linear trimkv gate
  int64_t kv_heads = 0;     // K = num_key_value_heads (one logβ per KV head)
  GateInput input = GateInput::hidden;
};

// The input width a model gives gates reading `input`: hidden_size, or 2·K·head_dim.
int64_t gate_input_width(const Qwen3Config& config, GateInput input);

// "model.layers.{l}.self_attn.retention_gate.{suffix}"
std::string gate_tensor_name(int64_t layer, std::string_view suffix);

using GateParameter = Parameter;  // model/param_set.h

// What backward() needs from forward() besides the input h: the pre-activations.
struct GateActivations {
  Tensor a1;  // W1·h + b1            F32 [T, G] (empty for the linear gate)
  Tensor a2;  // W2·silu(a1) + b2     F32 [T, G] (dbtrimkv only)
  Tensor z;   // the logit before logsigmoid, F32 [T, K]
};

class RetentionGates : public ParameterSet {
 public:
  RetentionGates() = default;

  // Fresh gates: weights N(0, 0.02) drawn in parameter order from std::mt19937_64(seed),
  // b1 = b2 = 0, b = bias_init (DESIGN default 18: logβ ≈ −1.5e-8, i.e. plain attention).
  static RetentionGates init(const GateDims& dims, double bias_init, uint64_t seed);
  // Gates from a safetensors file (F32/BF16/F16, converted to F32) for the model `config`:
  // the kind comes from the tensor names (linear3 ⇒ dbtrimkv) and must agree with
  // __metadata__ gate_kind and with `expect` when given; G comes from the shapes. Any
  // missing, unexpected, mis-shaped, non-float or non-finite tensor, a layer-count or
  // KV-head mismatch, or differing copies of a shared tensor is one retain::Error
  // "<path>: <problem>".
  static RetentionGates load(const std::string& path, const Qwen3Config& config,
                             std::optional<GateKind> expect = std::nullopt);
  // The same checks and conversion for tensors read from any container (a torch.save
  // archive, GGUF: model/gates/gate_containers.h), named as in a gate file, with
  // metadata as a gate file's __metadata__ would hold it (gate_kind, bias_init). `source`
  // names the container in errors.
  static RetentionGates from_tensors(const std::string& source, const std::map<std::string, Tensor>& tensors,
                                     const std::map<std::string, std::string>& metadata, const Qwen3Config& config,
                                     std::optional<GateKind> expect = std::nullopt);
  // Writes F32 tensors under the DESIGN names (a shared tensor under every layer's name),
  // atomically, with __metadata__: format, gate_kind, gate_hidden, num_hidden_layers,
  // num_key_value_heads, hidden_size, bias_init (when known), then `extra` (which wins).
  void save(const std::string& path, const std::map<std::string, std::string>& extra = {}) const override;

  // Every tensor under its file name(s), in file order (a shared tensor under every layer's
  // name, sharing one value): what save() writes and what the exporters write.
  std::vector<std::pair<std::string, Tensor>> named_tensors() const override;

  const GateDims& dims() const { return dims_; }
  // A trimkv gate without a hidden layer (G = 0): one "linear.weight" [K, D] and "bias" [K] per layer.
  bool is_linear() const { return dims_.gate_hidden == 0; }
  bool reads_kv() const { return dims_.input == GateInput::kv; }
  // The gate's input for a layer: h itself (F32 [T, D]) for hidden gates; for kv gates a new
  // F32 [T, 2·K·d] tensor [k3 ‖ v3] from the rotated keys k3 and the values v3 (F32 [T, K, d]).
  // On the device of its arguments. The trainer adds the gradient of a kv gate's input into dk
  // (before the RoPE backward) and dv with ops::split_columns_add.
  Tensor input_of(const Tensor& h, const Tensor& k3, const Tensor& v3) const;
  GateKind kind() const { return dims_.kind; }
  // The bias b was initialised to (from init(), or a loaded file's __metadata__ bias_init).
  std::optional<double> bias_init() const { return bias_init_; }

  // logβ F32 [T, K] for layer `layer` from its input h F32 [T, D] (D = dims().hidden: input_of()'s
  // result). With `saved`, keeps what backward() needs (O(T·G) floats). Runs on h's device: with h
  // on CUDA it reads the device mirror (sync_to_device() first) and logβ and *saved are CUDA tensors.
  Tensor forward(int64_t layer, const Tensor& h, GateActivations* saved = nullptr) const;
  // Given dlog_beta = ∂loss/∂logβ F32 [T, K] for the h and activations of forward(layer):
  // adds ∂loss/∂θ into the parameter gradients and, when dh is given, adds ∂loss/∂h into
  // *dh (F32 [T, D]) — the trainer sums it with the q/k/v paths before the RMSNorm backward.
  // With h on CUDA every tensor argument must be on CUDA too, and ∂loss/∂θ goes into the
  // mirror gradients (add_device_grads_to_host() moves it into the CPU gradients). Mixed
  // devices, or CUDA without sync_to_device(), are one-line errors.
  void backward(int64_t layer, const Tensor& h, const GateActivations& saved, const Tensor& dlog_beta,
                Tensor* dh = nullptr);

  // The CUDA mirror: one device copy of every parameter (a shared dbtrimkv tensor has one) and
  // a device gradient for each. sync_to_device() copies every CPU value into the mirror
  // (allocating it on the first call) and zeroes the mirror gradients. The mirror cannot see
  // later changes to the CPU values, so the trainer syncs after every optimizer step (and
  // after loading or resuming). A copy of the gates starts without a mirror; a move keeps it.
  // Without a CUDA build or device: one-line error.
  void sync_to_device();
  // Adds the mirror gradients into the CPU gradients (float32 adds, in parameter order) and
  // zeroes the mirror gradients. Fails (one line) before any sync_to_device().
  void add_device_grads_to_host();
  bool has_device_mirror() const { return !mirror_.values.empty(); }

  // Every parameter once (shared ones once), in file order: layer by layer, then the shared ones.
  std::vector<GateParameter>& parameters() override { return params_; }
  const std::vector<GateParameter>& parameters() const override { return params_; }

 private:
  struct LayerSlots {  // indices into params_
    int w1 = -1, b1 = -1, w2 = -1, b2 = -1, w3 = -1, b = -1;
  };
  // Allocates zeroed parameters and gradients for `dims` under their names.
  explicit RetentionGates(const GateDims& dims);
  const Tensor& value(int slot) const { return params_[static_cast<size_t>(slot)].value; }
  Tensor& grad(int slot) { return params_[static_cast<size_t>(slot)].grad; }
  // A parameter's value and gradient on `device`: the CPU tensors, or their device mirror.
  const Tensor& value_on(int slot, Device device) const;
  Tensor& grad_on(int slot, Device device);

  // Device values and gradients, indexed as params_. Copying drops it: two gate sets sharing
  // one device buffer would overwrite each other's values and gradients.
  struct DeviceMirror {
    std::vector<Tensor> values, grads;
    DeviceMirror() = default;
    DeviceMirror(const DeviceMirror&) {}
    DeviceMirror(DeviceMirror&&) = default;
    DeviceMirror& operator=(const DeviceMirror& other) {
      if (this != &other) values.clear(), grads.clear();
      return *this;
    }
    DeviceMirror& operator=(DeviceMirror&&) = default;
  };

  GateDims dims_;
  std::optional<double> bias_init_;
  std::vector<GateParameter> params_;
  std::vector<LayerSlots> slots_;
  DeviceMirror mirror_;
};

// Numerically stable log σ(x) = min(x, 0) − log1p(exp(−|x|)) (never log(sigmoid(x)), which
// is 0 in float32 for x > 17 and −inf for x < −88).
float log_sigmoid(float x);

}  // namespace retain::gates
