#!/usr/bin/env python3
"""Optional live cross-check of gate export and import on fresh random gates.

For random tiny Qwen3 models (retain-make-tiny) and random gates of both kinds:
  * import: gates written here with torch.save (bf16, f16 or f32; a dbtrimkv shared tensor as
    one storage under every layer's name, as the authors' state_dict holds it) go through
    `retain-export --from X.pth --format safetensors --dtype f32`; the values must equal
    torch's, exactly;
  * export: `retain-export --format trimkv|safetensors|gguf --dtype bf16|f32`, read back with
    torch.load(weights_only=True), safetensors and gguf.GGUFReader: the same values, names,
    shapes (GGUF ne reversed) and the documented metadata;
  * the authors' package (trimkv, in the Python named by $RETAIN_TRIMKV_PYTHON, default
    ~/.cache/retain/venvs/trimkv/bin/python; skipped where missing) loads the exported
    TRIM-KV directory and its gated forward on random packed documents equals
    `retain-forward --gates DIR` within 1e-4 (relative L2).
Needs torch, safetensors, gguf; without them exits 77 (CTest: skipped).
"""
import argparse
import os
import random
import subprocess
import sys
import tempfile

from live_common import import_or_skip, run_tool, tools_present

HERE = os.path.dirname(os.path.abspath(__file__))
AUTHORS = os.path.join(os.path.dirname(HERE), "fixtures", "export", "authors_forward.py")
SUFFIX = {"linear1.weight": "fc1.weight", "linear1.bias": "fc1.bias", "linear2.weight": "fc2.weight",
          "linear2.bias": "fc2.bias", "linear3.weight": "fc3.weight", "bias": "bias"}


def random_gates(torch, kind, L, D, K, G, dtype, g):
    """An OrderedDict as the authors' state_dict holds it (shared dbtrimkv tensors: one object)."""
    import collections

    def w(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    out = collections.OrderedDict()
    shared = {"linear3.weight": w(K, G, scale=1.5 / G ** 0.5), "bias": w(K) + 1.5} if kind == "dbtrimkv" else {}
    for layer in range(L):
        p = f"model.layers.{layer}.self_attn.retention_gate."
        out[p + "linear1.weight"] = w(G, D, scale=1.5 / D ** 0.5)
        out[p + "linear1.bias"] = w(G, scale=0.1)
        if kind == "trimkv":
            out[p + "linear2.weight"] = w(K, G, scale=1.5 / G ** 0.5)
            out[p + "bias"] = w(K) + 1.5
        else:
            out[p + "linear2.weight"] = w(G, G, scale=1.5 / G ** 0.5)
            out[p + "linear2.bias"] = w(G, scale=0.1)
            out[p + "linear3.weight"] = shared["linear3.weight"]
            out[p + "bias"] = shared["bias"]
    return out


def check_case(torch, a, case, rng, tmp):
    from safetensors import safe_open

    import gguf

    kind = rng.choice(["trimkv", "dbtrimkv"])
    K = rng.choice([1, 2, 4])
    L, G, heads = rng.choice([1, 2, 3]), rng.choice([8, 16, 24]), K * rng.choice([1, 2])
    model = os.path.join(tmp, f"m{case}")
    run_tool([os.path.join(a.bin_dir, "retain-make-tiny"), "--out", model, "--layers", str(L), "--heads", str(heads),
              "--kv-heads", str(K), "--hidden", "64", "--head-dim", "16", "--seed", str(rng.randrange(1 << 30))])
    dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
    gates = random_gates(torch, kind, L, 64, K, G, dtype, torch.Generator().manual_seed(rng.randrange(1 << 30)))
    pth = os.path.join(tmp, f"g{case}.pth")
    torch.save(gates, pth)
    label = f"case {case}: {kind} L={L} K={K} G={G} {dtype}"

    exp = lambda *args: run_tool([os.path.join(a.bin_dir, "retain-export"), "--model", model] + list(args))  # noqa
    imported = os.path.join(tmp, f"imported{case}.safetensors")
    exp("--from", pth, "--format", "safetensors", "--dtype", "f32", "--out", imported)
    with safe_open(imported, "pt") as f:
        assert set(f.keys()) == set(gates), label
        for k, v in gates.items():
            assert torch.equal(f.get_tensor(k), v.float()), f"{label}: import {k}"

    for fmt, out_dtype in (("trimkv", "f32"), ("safetensors", "bf16"), ("gguf", rng.choice(["bf16", "f32"]))):
        out = os.path.join(tmp, f"e{case}.{fmt}")
        exp("--from", imported, "--format", fmt, "--dtype", out_dtype, "--out", out)
        tdt = torch.bfloat16 if out_dtype == "bf16" else torch.float32
        want = {k: v.float().to(tdt) for k, v in gates.items()}
        if fmt == "trimkv":
            got = torch.load(os.path.join(out, "trimkv_weights.pth"), weights_only=True)
            assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items()), label
        elif fmt == "safetensors":
            with safe_open(out, "pt") as f:
                assert f.metadata()["format"] == "retain-gates" and f.metadata()["gate_kind"] == kind, label
                assert all(torch.equal(f.get_tensor(k), v) for k, v in want.items()), label
        else:
            r = gguf.GGUFReader(out)
            assert r.fields["retention.kind"].contents() == kind and r.fields["general.type"].contents() == "adapter"
            by = {t.name: t for t in r.tensors}
            import numpy as np

            for k, v in want.items():
                layer, suffix = k.split(".")[2], k.split("retention_gate.")[1]
                t = by[f"blk.{layer}.retention_gate.{SUFFIX[suffix]}"]
                raw = np.asarray(t.data)
                vals = (torch.from_numpy(raw.view(np.uint16).astype(np.int32)).to(torch.int16).view(torch.bfloat16)
                        if out_dtype == "bf16" else torch.from_numpy(raw.astype(np.float32)))
                assert list(t.shape) == list(reversed(v.shape)) and torch.equal(vals.reshape(v.shape), v), f"{label}: {k}"

    if not a.trimkv_python:
        return label + ": import and export OK (authors' package skipped)"
    # Random packed documents through the authors' forward and retain-forward.
    T = rng.randrange(20, 60)
    ids = [rng.randrange(512) for _ in range(T)]
    docs, d = [], 0
    while len(docs) < T:
        docs += [d] * rng.randrange(1, 25)
        d += 1
    docs = docs[:T]
    theirs, ours = os.path.join(tmp, f"a{case}.safetensors"), os.path.join(tmp, f"r{case}.safetensors")
    trimkv_dir = os.path.join(tmp, f"e{case}.trimkv")
    r = subprocess.run([a.trimkv_python, AUTHORS, "--dir", trimkv_dir, "--model", model, "--ids", " ".join(map(str, ids)),
                        "--docs", " ".join(map(str, docs)), "--out", theirs], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{label}: the authors' forward failed: {r.stderr.strip()[-2000:]}")
    run_tool([os.path.join(a.bin_dir, "retain-forward"), "--model", model, "--gates", trimkv_dir,
              "--ids", " ".join(map(str, ids)), "--doc-ids", " ".join(map(str, docs)), "--out", ours])
    from safetensors.torch import load_file

    x, y = load_file(ours)["logits"].double(), load_file(theirs)["logits"].double()
    rel = ((x - y).norm() / y.norm()).item()
    assert rel <= 1e-4, f"{label}: retain-forward vs the authors' forward: rel {rel:.2e}"
    return f"{label}: import, export and the authors' forward OK (rel {rel:.1e}, T={T})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--cases", type=int, default=4)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--trimkv-python", default=os.environ.get(
        "RETAIN_TRIMKV_PYTHON", os.path.expanduser("~/.cache/retain/venvs/trimkv/bin/python")))
    a = p.parse_args()
    import_or_skip("export_crosscheck", ["torch", "safetensors", "gguf", "numpy"])
    if not tools_present("export_crosscheck", a.bin_dir, ["retain-make-tiny", "retain-export", "retain-forward"]):
        return 1
    if a.trimkv_python and not os.access(a.trimkv_python, os.X_OK):
        print(f"export_crosscheck: no trimkv Python at {a.trimkv_python}: the authors' forward is skipped")
        a.trimkv_python = None
    import torch

    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"export_crosscheck: seed {seed}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for case in range(a.cases):
            try:
                print(check_case(torch, a, case, rng, tmp), flush=True)
            except (AssertionError, RuntimeError) as e:
                print(f"export_crosscheck: FAILED (seed {seed}): {e}", flush=True)
                return 1
    print(f"export_crosscheck: {a.cases} cases passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
