"""load_policy reads every container retain-export writes, to the same values, and refuses
anything else with one ValueError line naming the file."""
import json
import os
import shutil

import pytest
import torch
from conftest import POLICIES, RECALL, run, tool
from safetensors.torch import load_file, save_file

from retain_kv import load_policy


def same(a, b):
    return a.kind == b.kind and len(a.layers) == len(b.layers) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a.layers, b.layers))


def export(src, fmt, out, dtype="f32"):
    run([tool("retain-export"), "--from", src, "--format", fmt, "--out", out, "--dtype", dtype, "--model", RECALL])
    return out


@pytest.mark.parametrize("kind", ["trimkv", "dbtrimkv", "kvpop"])
def test_every_export_container(kind, tmp_path):
    original = load_policy(POLICIES[kind])
    formats = ["safetensors", "gguf"] + (["trimkv"] if kind != "kvpop" else [])
    for fmt in formats:
        path = export(POLICIES[kind], fmt, str(tmp_path / f"p.{fmt}"))
        got = load_policy(path)
        assert same(got, original), fmt
        assert (got.window, got.sinks, got.topk) == (original.window, original.sinks, original.topk)
        if fmt == "trimkv":  # the authors' directory, and its trimkv_weights.pth alone
            assert same(load_policy(os.path.join(path, "trimkv_weights.pth")), original)
    # --dtype bf16 (the default): the values rounded to bfloat16
    got = load_policy(export(POLICIES[kind], "gguf", str(tmp_path / "bf16.gguf"), "bf16"))
    for x, y in zip(got.layers, original.layers):
        assert all(torch.equal(x[k], y[k].to(torch.bfloat16).float()) for k in x)
    assert original.kind == kind and original.kv_heads == 2 and len(original.layers) == 2
    if kind == "kvpop":
        assert (original.window, original.sinks, original.topk, original.head_dim) == (16, 4, 32, 64)


def refused(path, *words):
    with pytest.raises(ValueError) as e:
        load_policy(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_not_a_policy(tmp_path):
    refused(str(tmp_path / "missing.safetensors"), "no such file")
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    refused(str(empty), "not a safetensors, GGUF or torch.save file")
    (tmp_path / "noise.bin").write_bytes(os.urandom(4096))
    refused(str(tmp_path / "noise.bin"), "not a safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    refused(str(tmp_path / "config.json"), "not a safetensors")
    refused(str(tmp_path), "without trimkv_weights.pth")
    refused(os.path.join(RECALL, "model.safetensors"), "unexpected tensor 'model.embed_tokens.weight'")
    data = open(POLICIES["trimkv"], "rb").read()
    for cut in (7, 100, len(data) // 2, len(data) - 1):
        (tmp_path / "cut.safetensors").write_bytes(data[:cut])
        refused(str(tmp_path / "cut.safetensors"), "not a safetensors")
    gguf = export(POLICIES["kvpop"], "gguf", str(tmp_path / "k.gguf"))
    blob = open(gguf, "rb").read()
    for cut in (6, 40, 300, len(blob) // 2):
        (tmp_path / "cut.gguf").write_bytes(blob[:cut])
        refused(str(tmp_path / "cut.gguf"), "GGUF")
    torch.save([1, 2, 3], tmp_path / "list.pth")
    refused(str(tmp_path / "list.pth"), "not a dict of named tensors")
    (tmp_path / "bad.pth").write_bytes(b"PK\x03\x04" + os.urandom(200))
    refused(str(tmp_path / "bad.pth"), "torch.save")


def test_damaged_policies(tmp_path):
    t = load_file(POLICIES["dbtrimkv"])
    meta = {"format": "retain-gates", "gate_kind": "dbtrimkv"}

    def write(name, tensors, metadata=meta):
        path = str(tmp_path / name)
        save_file(tensors, path, metadata=metadata)
        return path

    name = "model.layers.1.self_attn.retention_gate.linear3.weight"
    changed = dict(t, **{name: t[name] + 1})
    refused(write("untied.safetensors", changed), "shared tensor 'linear3.weight' differs")
    refused(write("kind.safetensors", t, {"gate_kind": "trimkv"}), "gate_kind 'trimkv'")
    nan = dict(t, **{name: t[name] * float("nan")})
    refused(write("nan.safetensors", nan), "non-finite")
    missing = {k: v for k, v in t.items() if not k.startswith("model.layers.1.self_attn.retention_gate.linear2.bias")}
    refused(write("missing.safetensors", missing), "missing tensor 'model.layers.1.self_attn.retention_gate.linear2.bias'")
    shape = dict(t, **{"model.layers.0.self_attn.retention_gate.linear1.bias": torch.zeros(3)})
    refused(write("shape.safetensors", shape), "has shape [3]")
    ints = dict(t, **{"model.layers.0.self_attn.retention_gate.bias": torch.zeros(2, dtype=torch.int32)})
    refused(write("ints.safetensors", ints), "dtype torch.int32")
    gap = {k.replace("layers.1.", "layers.2."): v for k, v in t.items()}
    refused(write("gap.safetensors", gap), "not 0 … 1")
    k = load_file(POLICIES["kvpop"])
    refused(write("nogeom.safetensors", k, {"gate_kind": "kvpop"}), "without 'window'")
    src = tmp_path / "authors"
    shutil.copytree(export(POLICIES["trimkv"], "trimkv", str(tmp_path / "t.trimkv")), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["retention_gate"] = "rg10"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gate_kind 'dbtrimkv' but the tensors are trimkv gates"):
        load_policy(str(src))
