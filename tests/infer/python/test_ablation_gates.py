"""The ablation gates: the linear trimkv gate (retain-train --gate-hidden 0, TRIM-KV Fig. 10:
logβ = logsigmoid(W·h + b)) and gates reading [k ‖ v] after RoPE (--gate-input kv, DBTrimKV Tables
4–5). retain_kv reads them from every container retain-export writes for them (the authors' layout
has neither: the export refuses), scores the linear gate bit for bit as its float64-checked formula
in float32, and decodes under RetainCache and RetainPress exactly as retain-generate does."""
import json
import os
import random

import numpy as np
import pytest
import torch
from conftest import RECALL, greedy, hf_generate, retain_generate, run, tool
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from retain_kv import RetainCache, RetainPress, load_policy
from retain_kv.policy import Policy
from retain_kv.scoring import GateStep, gate_log_beta


def linear_gates(path, seed=7):
    """Random linear gates for models/recall-qwen3: W ~ N(0, 1.5²/D), logit biases U(1, 4) (β from
    ~0.73 to ~0.98: the ranking moves with h and with age)."""
    with open(os.path.join(RECALL, "config.json")) as f:
        c = json.load(f)
    L, D, K = c["num_hidden_layers"], c["hidden_size"], c["num_key_value_heads"]
    g = torch.Generator().manual_seed(seed)
    t = {}
    for l in range(L):
        t[f"model.layers.{l}.self_attn.retention_gate.linear.weight"] = torch.randn(K, D, generator=g) * 1.5 / D ** 0.5
        t[f"model.layers.{l}.self_attn.retention_gate.bias"] = 1 + 3 * torch.rand(K, generator=g)
    save_file(t, path, metadata={"gate_kind": "trimkv", "gate_hidden": "0"})
    return path


def kv_gates(path, seed=9, G=24):
    """Random dbtrimkv gates reading [k ‖ v] for models/recall-qwen3 (input width 2·K·head_dim)."""
    with open(os.path.join(RECALL, "config.json")) as f:
        c = json.load(f)
    L, K, d = c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"]
    g = torch.Generator().manual_seed(seed)
    w3, b = torch.randn(K, G, generator=g) * 1.5 / G ** 0.5, 1 + 3 * torch.rand(K, generator=g)
    t = {}
    for l in range(L):
        p = f"model.layers.{l}.self_attn.retention_gate."
        t[p + "linear1.weight"] = torch.randn(G, 2 * K * d, generator=g) * 1.5 / (2 * K * d) ** 0.5
        t[p + "linear1.bias"] = torch.randn(G, generator=g) * 0.5
        t[p + "linear2.weight"] = torch.randn(G, G, generator=g) * 1.5 / G ** 0.5
        t[p + "linear2.bias"] = torch.randn(G, generator=g) * 0.5
        t[p + "linear3.weight"], t[p + "bias"] = w3.clone(), b.clone()
    save_file(t, path, metadata={"gate_kind": "dbtrimkv", "gate_hidden": str(G), "gate_input": "kv"})
    return path


def test_reads_every_container_and_the_authors_layout_is_refused(tmp_path):
    src = linear_gates(str(tmp_path / "linear.safetensors"))
    original = load_policy(src)
    assert (original.kind, original.gate_hidden) == ("trimkv", 0)
    for fmt in ("safetensors", "gguf"):
        out = str(tmp_path / f"x.{fmt}")
        run([tool("retain-export"), "--from", src, "--format", fmt, "--out", out, "--dtype", "f32", "--model", RECALL])
        got = load_policy(out)
        assert got.gate_hidden == 0 and len(got.layers) == len(original.layers), fmt
        for x, y in zip(got.layers, original.layers):
            assert x.keys() == y.keys() == {"linear.weight", "bias"} and all(torch.equal(x[k], y[k]) for k in x), fmt
    out = str(tmp_path / "authors")
    with pytest.raises(RuntimeError, match="has no linear gate"):
        run([tool("retain-export"), "--from", src, "--format", "trimkv", "--out", out, "--model", RECALL])
    assert not os.path.exists(out)


def test_kv_gates_round_trip_and_must_fit_the_model(tmp_path, recall_model):
    src = kv_gates(str(tmp_path / "kv.safetensors"))
    original = load_policy(src)
    assert (original.kind, original.gate_input, original.hidden) == ("dbtrimkv", "kv", 256)
    original.check_model(recall_model.config)
    for fmt in ("safetensors", "gguf"):
        out = str(tmp_path / f"x.{fmt}")
        run([tool("retain-export"), "--from", src, "--format", fmt, "--out", out, "--dtype", "f32", "--model", RECALL])
        got = load_policy(out)
        assert got.gate_input == "kv", fmt
        for x, y in zip(got.layers, original.layers):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), fmt
    with pytest.raises(RuntimeError, match=r"has no gate reading \[k ‖ v\]"):
        run([tool("retain-export"), "--from", src, "--format", "trimkv", "--out", str(tmp_path / "a"), "--model", RECALL])
    original.gate_input = "hidden"  # the same tensors read as gates of h: they do not fit
    with pytest.raises(ValueError, match=r"kv.safetensors: dbtrimkv policy for .* × hidden 256, the model has"):
        original.check_model(recall_model.config)
    bad = str(tmp_path / "bad.safetensors")
    save_file(load_file(src), bad, metadata={"gate_input": "keys"})
    with pytest.raises(ValueError, match=r"bad.safetensors: metadata gate_input 'keys' is neither"):
        load_policy(bad)


def test_damaged_linear_files(tmp_path):
    src = linear_gates(str(tmp_path / "linear.safetensors"))
    tensors = {k: v for k, v in load_policy(src).layers[0].items()}
    bad = str(tmp_path / "bad.safetensors")
    t = {f"model.layers.{l}.self_attn.retention_gate.{k}": v.clone() for l in range(len(load_policy(src).layers))
         for k, v in tensors.items()}
    save_file(t, bad, metadata={"gate_hidden": "16"})
    with pytest.raises(ValueError, match=r"bad.safetensors: metadata says gate_hidden 16 but the tensors are a linear"):
        load_policy(bad)
    t["model.layers.0.self_attn.retention_gate.linear1.bias"] = torch.zeros(4)
    save_file(t, bad)
    with pytest.raises(ValueError, match=r"bad.safetensors: unexpected tensor .*linear1.bias"):
        load_policy(bad)


def test_gate_step_is_the_linear_formula():
    """GateStep (all layers' gates per decoding step) equals gate_log_beta bit for bit, and
    gate_log_beta equals the float64 formula to float32 rounding."""
    g, L, D, K = torch.Generator().manual_seed(3), 3, 48, 4
    layers = [{"linear.weight": torch.randn(K, D, generator=g) * 0.3, "bias": torch.randn(K, generator=g) * 3}
              for _ in range(L)]
    policy = Policy(kind="trimkv", source="random", layers=layers, kv_heads=K, hidden=D, gate_hidden=0)
    step = GateStep(policy, torch.device("cpu"))
    for trial in range(10):
        hs = [torch.randn(1, 1, D, generator=g) * 10 ** (trial % 4 - 1) for _ in range(L)]
        for l, h in enumerate(hs):
            step.keep(l, h)
        got = step.run()
        want = torch.cat([gate_log_beta(policy, l, h[0]).t() for l, h in enumerate(hs)]).numpy()
        assert np.array_equal(got.view(np.int32), np.ascontiguousarray(want).view(np.int32))
        for l, h in enumerate(hs):
            z = h[0].double() @ layers[l]["linear.weight"].double().T + layers[l]["bias"].double()
            exact = torch.nn.functional.logsigmoid(z)
            assert torch.allclose(gate_log_beta(policy, l, h[0]).double(), exact, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("gate,budget,chunk", [("linear", 24, 0), ("linear", 24, 37), ("linear", 150, 64),
                                               ("kv", 24, 0), ("kv", 40, 37)])
def test_decodes_as_retain_generate(recall_model, tmp_path, gate, budget, chunk):
    """RetainCache and RetainPress: the tokens and kept positions of retain-generate (the linear gate
    under trimkv's per-head eviction, the [k ‖ v] gates under dbtrimkv's global one)."""
    gates, policy = ((linear_gates(str(tmp_path / "linear.safetensors")), "trimkv") if gate == "linear" else
                     (kv_gates(str(tmp_path / "kv.safetensors")), "dbtrimkv"))
    prompt, new = [random.Random(budget + chunk).randrange(16, 256) for _ in range(300)], 12
    want = retain_generate(tmp_path, RECALL, gates, policy, budget, prompt, new, chunk)
    cache = RetainCache(recall_model, gates, budget)
    got = hf_generate(recall_model, cache, prompt, new) if chunk == 0 else greedy(recall_model, cache, prompt, new,
                                                                                  chunk)
    assert got == want["generated_ids"]
    assert cache.kept_positions() == want["kept_positions"]
    press = RetainPress(gates, budget)
    with press(recall_model):
        got = (hf_generate(recall_model, DynamicCache(), prompt, new) if chunk == 0 else
               greedy(recall_model, DynamicCache(), prompt, new, chunk))
    assert got == want["generated_ids"]
    assert press.kept_positions() == want["kept_positions"]
