#!/usr/bin/env python3
"""Optional live cross-check of bounded-KV decoding against the TRIM-KV authors' TrimKVCache.

Random tiny Qwen3 models (`retain-make-tiny`: 1-3 layers, GQA 1/2/4, YaRN or not, tied or not)
get random trimkv gates (tests/fixtures/generate/make_fixtures.py's random_gates) and a random
prompt; `retain-generate --policy trimkv --greedy --json` and the authors' `TrimKVCache` under
Hugging Face `generate` (make_fixtures.py's run_reference, same budget and buffer) must give
the same tokens and the same kept positions per layer and KV head. A case whose greedy margin
(top-1 minus top-2 logit) falls below 1e-4 at some step is skipped as ambiguous (reported).

Needs torch, transformers 4.57 (trimkv's pin), safetensors and trimkv 0.1.5. Without them it
exits 77 (CTest: skipped) — unless RETAIN_TRIMKV_PYTHON (default
~/.cache/retain/venvs/trimkv/bin/python, the venv of tests/fixtures/export/README.md) names a
Python that has them, which it then re-runs itself with.
"""

import argparse
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from live_common import SKIP, import_or_skip, run_tool, tools_present  # noqa: E402

REFERENCE_SCRIPT = os.path.join(os.path.dirname(HERE), "fixtures", "generate", "make_fixtures.py")


def load_reference():
    spec = importlib.util.spec_from_file_location("retain_generate_fixture_reference", REFERENCE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--cases", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    prog = "generate_crosscheck"

    other = os.environ.get("RETAIN_TRIMKV_PYTHON",
                           os.path.expanduser("~/.cache/retain/venvs/trimkv/bin/python"))
    try:
        ref = load_reference()
        ref.install_cpu_workarounds()
        import torch  # noqa: F401
        import trimkv.cache_utils  # noqa: F401
    except Exception as e:
        if other and not os.environ.get("RETAIN_TRIMKV_REEXEC") and os.access(other, os.X_OK):
            os.environ["RETAIN_TRIMKV_REEXEC"] = "1"  # once: the other Python may lack them too
            os.execv(other, [other, os.path.abspath(__file__)] + sys.argv[1:])
        print(f"{prog}: skipped: cannot import torch/transformers/trimkv ({type(e).__name__}: {e})", flush=True)
        sys.exit(SKIP)
    import_or_skip(prog, ["torch", "transformers", "safetensors", "trimkv"])
    import torch
    from safetensors.torch import save_file

    if not tools_present(prog, args.bin_dir, ["retain-make-tiny", "retain-generate"]):
        sys.exit(1)
    rng = random.Random(args.seed)
    failures = checked = ambiguous = 0
    tmp = tempfile.mkdtemp(prefix="retain_gen_live_")
    try:
        for case in range(args.cases):
            kv = rng.choice([1, 2, 4])
            opt = dict(layers=rng.randint(1, 3), hidden=rng.choice([32, 64]), kv=kv, heads=kv * rng.choice([1, 2, 4]),
                       head_dim=rng.choice([16, 32]), vocab=rng.randint(259, 400), tie=rng.random() < 0.5,
                       yarn=rng.choice([0, 0, 4]), seed=rng.randrange(2**31), G=rng.choice([8, 16]),
                       budget=rng.randint(3, 16), buffer=rng.randint(1, 3), prompt=rng.randint(10, 60),
                       new=rng.randint(4, 24))
            d = os.path.join(tmp, f"m{case}")
            cmd = [os.path.join(args.bin_dir, "retain-make-tiny"), "--out", d, "--layers", str(opt["layers"]),
                   "--hidden", str(opt["hidden"]), "--heads", str(opt["heads"]), "--kv-heads", str(opt["kv"]),
                   "--head-dim", str(opt["head_dim"]), "--vocab", str(opt["vocab"]),
                   "--tie" if opt["tie"] else "--no-tie", "--yarn-factor", str(opt["yarn"]), "--seed", str(opt["seed"])]
            run_tool(cmd)
            gen = torch.Generator().manual_seed(opt["seed"])
            gates = ref.random_gates(opt["layers"], opt["hidden"], opt["G"], opt["kv"], gen)
            gates_path = os.path.join(d, "gates.safetensors")
            save_file(gates, gates_path, metadata={"format": "retain-gates", "gate_kind": "trimkv"})
            prompt = torch.randint(0, opt["vocab"], (opt["prompt"],), generator=gen).tolist()
            want_ids, logits, want_kept, _ = ref.run_reference(d, gates, opt["G"], opt["budget"], opt["buffer"], prompt,
                                                               opt["new"])
            top2 = torch.topk(logits, 2, dim=-1).values
            margin = float((top2[:, 0] - top2[:, 1]).min())
            if margin < 1e-4:
                ambiguous += 1
                print(f"case {case}: greedy margin {margin:.2g} < 1e-4, skipped ({opt})")
                continue
            out = os.path.join(d, "out.json")
            run_tool([os.path.join(args.bin_dir, "retain-generate"), "--model", d, "--gates", gates_path,
                      "--policy", "trimkv", "--budget", str(opt["budget"]), "--buffer", str(opt["buffer"]), "--greedy",
                      "--ignore-eos", "--max-new", str(opt["new"]), "--prompt-ids", " ".join(map(str, prompt)),
                      "--json", out])
            with open(out) as f:
                got = json.load(f)
            checked += 1
            ok = got["generated_ids"] == want_ids and got["kept_positions"] == want_kept
            if not ok:
                failures += 1
                print(f"case {case}: MISMATCH {opt}\n  retain tokens {got['generated_ids']}\n  trimkv tokens {want_ids}")
            else:
                print(f"case {case}: ok ({opt['layers']} layers, {opt['heads']}/{opt['kv']} heads, yarn {opt['yarn']}, "
                      f"budget {opt['budget']}, buffer {opt['buffer']}, {opt['prompt']}+{opt['new']} tokens)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{prog}: {checked} cases checked, {failures} mismatches, {ambiguous} ambiguous")
    sys.exit(1 if failures or not checked else 0)


if __name__ == "__main__":
    main()
