#!/usr/bin/env python3
"""Before/after for eviction's cost on a busy machine: two versions of retain_kv (this checkout's
and another's, e.g. a worktree of the commit before a change) decode the same prompt in lockstep
(one step of each, the order alternating), each on its own copy of bench_eviction.py's tiny
model, so that a change of load hits both alike; per step, eviction (scoring + selection +
compaction) from the hooks' timers. Prints per row the median per-step µs of each version and
the median of the paired differences, and checks that both kept the same entries.

    python model/infer/python/bench/ab_eviction.py --bin-dir build/bin --prompt-file README.md \\
        --old /path/to/other/checkout --rows kvpop:1024,dbtrimkv:4096 --reps 2
"""
import argparse
import importlib
import os
import shutil
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import Qwen3ForCausalLM  # noqa: E402

import bench_eviction  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--prompt-file", required=True)
    ap.add_argument("--prompt-bytes", type=int, default=4700)
    ap.add_argument("--old", required=True, help="a checkout whose model/infer/python/retain_kv is the 'old' version")
    ap.add_argument("--rows", default="trimkv:1024,dbtrimkv:1024,kvpop:1024", help="policy:budget,...")
    ap.add_argument("--reps", type=int, default=2, help="decoding runs per row (255 paired steps each)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(os.path.join(a.old, "model", "infer", "python", "retain_kv"), os.path.join(tmp, "retain_kv_old"))
        sys.path.insert(0, tmp)
        pk = {"old": importlib.import_module("retain_kv_old"), "new": importlib.import_module("retain_kv")}
        model_dir, gates = bench_eviction.make_models(a.bin_dir, tmp)
        models = {v: Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
                  for v in pk}  # (each package hooks its own model)
        with open(a.prompt_file, "rb") as f:
            text = f.read()[:a.prompt_bytes].decode("utf-8", errors="ignore")
        ids = torch.tensor([Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).encode(text).ids])
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        for row in a.rows.split(","):
            policy, budget = row.split(":")[0], int(row.split(":")[1])
            per = {v: ([], [], []) for v in pk}  # total, scoring, selection + compaction per step
            for _ in range(a.reps):
                caches, token = {}, {}
                with torch.no_grad():
                    for v in pk:
                        c = caches[v] = pk[v].RetainCache(models[v], gates[policy], budget)
                        for s in range(0, ids.shape[1], 512):
                            logits = models[v](ids[:, s:s + 512], past_key_values=c,
                                               cache_position=torch.arange(s, min(s + 512, ids.shape[1]))).logits
                        token[v] = logits[:, -1:].argmax(-1)
                    for i in range(255):
                        for v in (list(pk) if i % 2 else list(pk)[::-1]):
                            r = caches[v].retention
                            s0, e0 = r.decode_score_s, r.decode_evict_s
                            token[v] = models[v](token[v], past_key_values=caches[v],
                                                 cache_position=torch.tensor([ids.shape[1] + i])).logits[:, -1:].argmax(-1)
                            ds, de = r.decode_score_s - s0, r.decode_evict_s - e0
                            for lst, x in zip(per[v], (ds + de, ds, de)):
                                lst.append(1e6 * x)
                if caches["old"].kept_positions() != caches["new"].kept_positions():
                    raise SystemExit(f"{row}: the two versions kept different entries")
            med = {v: [float(np.median(x)) for x in per[v]] for v in pk}
            diff = float(np.median(np.array(per["new"][0]) - np.array(per["old"][0])))
            print(f"{row:14} old {med['old'][0]:6.1f} µs (scoring {med['old'][1]:6.1f}, selection {med['old'][2]:6.1f})  "
                  f"new {med['new'][0]:6.1f} µs (scoring {med['new'][1]:6.1f}, selection {med['new'][2]:6.1f})  "
                  f"paired difference {diff:+6.1f} µs ({100 * diff / med['old'][0]:+.0f} %)", flush=True)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
