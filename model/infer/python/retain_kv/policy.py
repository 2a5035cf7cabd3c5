"""load_policy: a retain policy from any container retain-export writes (docs/formats.md) —
retain-gates safetensors (trimkv, dbtrimkv), the TRIM-KV authors' directory (config.json +
trimkv_weights.pth), a bare trimkv_weights.pth, KVPOP scorer safetensors, and the GGUF adapters.
Every check of the C++ reader (model/gates/gate_file.cpp, model/kvpop/scorers.cpp) is made
here too; every problem is one ValueError "<path>: <what is wrong>"."""
import json
import os
import re
from dataclasses import dataclass, field

import torch

from .gguf import read_gguf

GATE_SUFFIXES = {
    "linear": ["linear.weight", "bias"],  # a trimkv gate with G = 0: logβ = logsigmoid(W·h + b)
    "trimkv": ["linear1.weight", "linear1.bias", "linear2.weight", "bias"],
    "dbtrimkv": ["linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias", "linear3.weight", "bias"],
}
SHARED = ("linear3.weight", "bias")  # dbtrimkv: one tensor for all layers, written under every layer's name
KVPOP_SUFFIXES = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "igate.weight", "igate.bias", "fgate.weight",
                  "fgate.bias", "out.weight", "out.bias", "decay"]
_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(retention_gate|kvpop)\.(.+)$")
_GGUF_NAME = re.compile(r"^blk\.(\d+)\.(retention_gate|kvpop)\.(.+)$")
_GGUF_GATE = {"fc.weight": "linear.weight", "fc1.weight": "linear1.weight", "fc1.bias": "linear1.bias",
              "fc2.weight": "linear2.weight", "fc2.bias": "linear2.bias", "fc3.weight": "linear3.weight",
              "bias": "bias"}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass
class Policy:
    """A loaded policy. `layers[l]` maps a suffix (DESIGN §4/§5 names) to a float32 tensor."""
    kind: str                 # "trimkv", "dbtrimkv" or "kvpop"
    source: str               # the path it was read from (named in every error)
    layers: list              # per layer: {suffix: tensor}
    kv_heads: int
    hidden: int = 0           # gates: the gate input width D (hidden_size; 2·K·head_dim for gate_input "kv")
    gate_hidden: int = 0      # gates: G
    gate_input: str = "hidden"  # gates: what they read, h ("hidden") or [k ‖ v] after RoPE ("kv"; width 2·K·d)
    head_dim: int = 0         # kvpop: d
    window: int = 0           # kvpop geometry (from the file's metadata)
    sinks: int = 0
    topk: int = 0
    decay_min: float = 0.999  # kvpop: the range log γ is mapped into (metadata decay_min/decay_max;
    decay_max: float = 0.999999  # absent: the KVPOP paper's, retain-train's default)
    decay_every: int = 1      # kvpop: ŝ_i(q) = score_i + ⌊(q − i)/n⌋·log γ (metadata decay_every; absent: 1)
    metadata: dict = field(default_factory=dict)

    def min_budget(self):
        """The smallest budget the policy runs with (as retain-generate's min_budget)."""
        return self.sinks + self.window + 1 if self.kind == "kvpop" else 1

    def check_model(self, config):
        """Raises ValueError "<file>: ..." unless the policy fits a transformers Qwen3 config."""
        L, K = config.num_hidden_layers, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        want = f"{len(self.layers)} layers × {self.kv_heads} KV heads"
        have = f"{L} layers × {K} KV heads"
        if self.kind == "kvpop":
            want, have = want + f" × head_dim {self.head_dim}", have + f" × head_dim {head_dim}"
            fits = self.head_dim == head_dim
        elif self.gate_input == "kv":
            want, have = want + f" × [k ‖ v] width {self.hidden}", have + f" × 2·K·head_dim {2 * K * head_dim}"
            fits = self.hidden == 2 * K * head_dim
        else:
            want, have = want + f" × hidden {self.hidden}", have + f" × hidden {config.hidden_size}"
            fits = self.hidden == config.hidden_size
        if not fits or len(self.layers) != L or self.kv_heads != K:
            raise ValueError(f"{self.source}: {self.kind} policy for {want}, the model has {have}")

    def to(self, device):
        """The tensors moved to `device` (float32), in place; returns self."""
        self.layers = [{k: v.to(device=device, dtype=torch.float32) for k, v in layer.items()} for layer in self.layers]
        return self


def load_policy(path):
    """A Policy from a file or directory retain-export writes; ValueError naming the file otherwise."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        return _from_trimkv_dir(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PK\x03\x04":
        return _gates(path, _torch_state_dict(path), {})
    if magic == b"GGUF":
        return _from_gguf(path)
    return _from_safetensors(path)


def _fail(path, what):
    raise ValueError(f"{path}: {what}")


def _torch_state_dict(path):
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged archive, or a pickle that needs more than tensors
        _fail(path, f"cannot be read as a torch.save state dict ({type(e).__name__}: {str(e).splitlines()[0]})")
    if not isinstance(sd, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in sd.items()):
        _fail(path, "is a torch.save file but not a dict of named tensors")
    return dict(sd)


def _from_trimkv_dir(path):
    weights = os.path.join(path, "trimkv_weights.pth")
    if not os.path.isfile(weights):
        _fail(path, "a directory without trimkv_weights.pth is not a policy "
                    "(retain-export --format trimkv writes config.json + trimkv_weights.pth)")
    meta = {}
    cfg_path = os.path.join(path, "config.json")
    if os.path.isfile(cfg_path):
        try:
            with open(cfg_path) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            _fail(cfg_path, f"is not JSON ({e})")
        kinds = {"rg": "trimkv", "rg10": "dbtrimkv"}
        if "retention_gate" in cfg:
            if cfg["retention_gate"] not in kinds:
                _fail(cfg_path, f"retention_gate is {cfg['retention_gate']!r}; retain reads 'rg' (trimkv) and "
                                f"'rg10' (dbtrimkv)")
            meta["gate_kind"] = kinds[cfg["retention_gate"]]
    return _gates(weights, _torch_state_dict(weights), meta)


def _from_safetensors(path):
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors' own reader validates the header and offsets
        _fail(path, f"is not a policy: not a safetensors, GGUF or torch.save file ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else 'unreadable'})")
    if meta.get("gate_kind") == "kvpop" or any(".kvpop." in k for k in tensors):
        return _kvpop(path, tensors, meta)
    return _gates(path, tensors, meta)


def _from_gguf(path):
    meta, raw = read_gguf(path)
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") not in ("retention_gate", "kvpop"):
        _fail(path, f"is a GGUF file but not a retain adapter (general.type {meta.get('general.type')!r}, "
                    f"adapter.type {meta.get('adapter.type')!r})")
    kvpop = meta["adapter.type"] == "kvpop"
    tensors = {}
    for name, t in raw.items():
        m = _GGUF_NAME.match(name)
        suffix = m and (m.group(3) if kvpop else _GGUF_GATE.get(m.group(3)))
        if not m or m.group(2) != ("kvpop" if kvpop else "retention_gate") or not suffix:
            _fail(path, f"unexpected tensor '{name}'")
        tensors[f"model.layers.{m.group(1)}.self_attn.{m.group(2)}.{suffix}"] = t
    out = {k[len("retention."):]: str(v) for k, v in meta.items() if k.startswith("retention.")}
    if "kind" in out:
        out["gate_kind"] = out.pop("kind")
    return _kvpop(path, tensors, out) if kvpop else _gates(path, tensors, out)


def _by_layer(path, tensors, module):
    """{layer: {suffix: tensor}} for names of `module`; any other name is an error."""
    layers = {}
    for name, t in tensors.items():
        m = _NAME.match(name)
        if not m or m.group(2) != module:
            _fail(path, f"unexpected tensor '{name}' (not a model.layers.N.self_attn.{module}.* tensor)")
        if t.dtype not in _FLOATS:
            _fail(path, f"tensor '{name}' has dtype {t.dtype}; policy tensors are F32, BF16, F16 or F64")
        t = t.to(torch.float32)
        if not torch.isfinite(t).all():
            _fail(path, f"tensor '{name}' has a non-finite value")
        layers.setdefault(int(m.group(1)), {})[m.group(3)] = t
    if not layers:
        _fail(path, "holds no policy tensors")
    if sorted(layers) != list(range(len(layers))):
        _fail(path, f"layer indices {sorted(layers)} are not 0 … {len(layers) - 1}")
    return [layers[l] for l in range(len(layers))]


def _check_suffixes(path, layers, suffixes, module):
    for l, layer in enumerate(layers):
        for s in suffixes:
            if s not in layer:
                _fail(path, f"missing tensor 'model.layers.{l}.self_attn.{module}.{s}'")
        for s in layer:
            if s not in suffixes:
                _fail(path, f"unexpected tensor 'model.layers.{l}.self_attn.{module}.{s}'")


def _expect(path, layers, module, shapes):
    for l, layer in enumerate(layers):
        for s, shape in shapes.items():
            if list(layer[s].shape) != list(shape):
                _fail(path, f"tensor 'model.layers.{l}.self_attn.{module}.{s}' has shape {list(layer[s].shape)}, "
                            f"expected {list(shape)}")


def _gates(path, tensors, meta):
    if meta.get("gate_kind") == "kvpop":
        return _kvpop(path, tensors, meta)
    layers = _by_layer(path, tensors, "retention_gate")
    kind = "dbtrimkv" if "linear3.weight" in layers[0] else "trimkv"
    linear = "linear.weight" in layers[0]  # the linear gate (G = 0), a trimkv gate
    if linear and kind == "dbtrimkv":
        _fail(path, "holds both linear.weight (a linear trimkv gate) and linear3.weight (dbtrimkv gates)")
    if meta.get("gate_kind", kind) != kind:
        _fail(path, f"metadata says gate_kind {meta['gate_kind']!r} but the tensors are {kind} gates")
    if "gate_hidden" in meta and (str(meta["gate_hidden"]) in ("0", "0.0")) != linear:
        _fail(path, f"metadata says gate_hidden {meta['gate_hidden']} but the tensors are "
                    + ("a linear gate (linear.weight, G = 0)" if linear else "MLP gates (linear1.weight)"))
    _check_suffixes(path, layers, GATE_SUFFIXES["linear" if linear else kind], "retention_gate")
    K = layers[0]["bias"].shape[0] if layers[0]["bias"].dim() == 1 else -1
    if linear:
        G, D = 0, layers[0]["linear.weight"].shape[-1]
        shapes = {"linear.weight": (K, D), "bias": (K,)}
    else:
        G, D = layers[0]["linear1.weight"].shape
        shapes = {"linear1.weight": (G, D), "linear1.bias": (G,), "bias": (K,)}
        shapes.update({"linear2.weight": (K, G)} if kind == "trimkv" else
                      {"linear2.weight": (G, G), "linear2.bias": (G,), "linear3.weight": (K, G)})
    _expect(path, layers, "retention_gate", shapes)
    if kind == "dbtrimkv":
        for s in SHARED:
            for l, layer in enumerate(layers):
                if not torch.equal(layer[s], layers[0][s]):
                    _fail(path, f"shared tensor '{s}' differs between layer 0 and layer {l} (dbtrimkv ties it)")
    gate_input = str(meta.get("gate_input", "hidden"))
    if gate_input not in ("hidden", "kv"):
        _fail(path, f"metadata gate_input {gate_input!r} is neither 'hidden' nor 'kv'")
    return Policy(kind=kind, source=path, layers=layers, kv_heads=K, hidden=D, gate_hidden=G, gate_input=gate_input,
                  metadata=meta)


def _kvpop(path, tensors, meta):
    if meta.get("gate_kind", "kvpop") != "kvpop":
        _fail(path, f"metadata says gate_kind {meta['gate_kind']!r} but the tensors are kvpop scorers")
    layers = _by_layer(path, tensors, "kvpop")
    _check_suffixes(path, layers, KVPOP_SUFFIXES, "kvpop")
    q = layers[0]["q_proj.weight"]
    if q.dim() != 3 or q.shape[2] != 4 * q.shape[1]:
        _fail(path, f"tensor 'model.layers.0.self_attn.kvpop.q_proj.weight' has shape {list(q.shape)}, "
                    f"expected [K, r, 4r]")
    K, r = q.shape[0], q.shape[1]
    x = 4 * r
    _expect(path, layers, "kvpop", {"q_proj.weight": (K, r, x), "k_proj.weight": (K, r, x), "v_proj.weight": (K, r, x),
                                     "igate.weight": (K, x), "fgate.weight": (K, x), "igate.bias": (K,),
                                     "fgate.bias": (K,), "out.weight": (K, r), "out.bias": (K,), "decay": (K,)})
    geometry = {}
    for key in ("window", "sinks", "topk"):
        if key not in meta:
            _fail(path, f"kvpop scorers without '{key}' in their metadata: the kvpop policy needs window, sinks "
                        f"and topk (retain-train writes them)")
        try:
            geometry[key] = int(meta[key])
        except ValueError:
            _fail(path, f"metadata {key} = {meta[key]!r} is not an integer")
        if geometry[key] < 0:
            _fail(path, f"metadata {key} = {meta[key]!r} is negative")
    if geometry["window"] < 1:
        _fail(path, f"metadata window must be at least 1, got {geometry['window']}")
    # The decay (retain-train --decay-every/--decay-min/--decay-max; docs/formats.md).
    every = meta.get("decay_every", "1")
    try:
        geometry["decay_every"] = int(every)
    except ValueError:
        _fail(path, f"metadata decay_every = {every!r} is not an integer")
    if geometry["decay_every"] < 1:
        _fail(path, f"metadata decay_every must be at least 1, got {geometry['decay_every']}")
    for key in ("decay_min", "decay_max"):
        if key in meta:
            try:
                geometry[key] = float(meta[key])
            except ValueError:
                _fail(path, f"metadata {key} = {meta[key]!r} is not a number")
    lo, hi = geometry.get("decay_min", 0.999), geometry.get("decay_max", 0.999999)
    if not (0 < lo <= hi <= 1):
        _fail(path, f"metadata decay range [{lo}, {hi}] must satisfy 0 < decay_min ≤ decay_max ≤ 1")
    return Policy(kind="kvpop", source=path, layers=layers, kv_heads=K, head_dim=2 * r, metadata=meta, **geometry)


def as_policy(policy):
    """A Policy from a Policy, a path, or a string path."""
    return policy if isinstance(policy, Policy) else load_policy(policy)


__all__ = ["Policy", "load_policy", "as_policy"]
