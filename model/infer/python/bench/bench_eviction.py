#!/usr/bin/env python3
"""What eviction costs a decoding step of a stock transformers Qwen3 under RetainCache, on the CPU,
measured as docs/benchmarks.md's bounded-decoding table measures retain-generate: the tiny random
Qwen3 (2 layers, hidden 64, 4 query / 2 KV heads, head_dim 32), a 4700-byte prompt prefilled in
chunks of 512 with eviction after each, then 256 greedy tokens.

Eviction is what issue 37 counts: scoring (the gate MLP's logβ of the new token, or the KVPOP
mLSTM step, its delayed readout and the booking of the ranks) + selection + compaction (booking the
new entries, the choice, the moves), each from the hooks' own timers over the one-token forwards.
Per policy and budget: the decode step time, scoring and selection + compaction per step, their
total, the total's share of this row's own step (as benchmarks.md: the step includes it) and of the
plain DynamicCache step (row "full": the whole sequence, no hooks) of the same run, and the memory
the layers' keys and values occupy at the end (their storages, spare slots included).

Rounds outermost: every row runs once per round, and each row keeps its best round by decode speed
(the machine may be shared; a load change then hits all rows alike). One torch thread (see
docs/inference.md).

    python model/infer/python/bench/bench_eviction.py --bin-dir build/bin --prompt-file README.md
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import DynamicCache, Qwen3ForCausalLM  # noqa: E402

from retain_kv import RetainCache  # noqa: E402


def make_models(bin_dir, out):
    """The tiny model with trimkv and dbtrimkv gates (retain-make-tiny) and random kvpop scorers."""
    paths = {}
    for kind in ("trimkv", "dbtrimkv"):
        d = os.path.join(out, kind)
        subprocess.run([os.path.join(bin_dir, "retain-make-tiny"), "--out", d, "--layers", "2", "--hidden", "64",
                        "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--gates", kind, "--gate-hidden", "16",
                        "--bias-init", "2", "--seed", "1"], check=True, capture_output=True)
        paths[kind] = os.path.join(d, "gates.safetensors")
    g = torch.Generator().manual_seed(1)
    K, r, x = 2, 16, 64
    shapes = {"q_proj.weight": (K, r, x), "k_proj.weight": (K, r, x), "v_proj.weight": (K, r, x), "igate.weight": (K, x),
              "igate.bias": (K,), "fgate.weight": (K, x), "fgate.bias": (K,), "out.weight": (K, r), "out.bias": (K,),
              "decay": (K,)}
    scorers = {f"model.layers.{l}.self_attn.kvpop.{s}": torch.randn(shape, generator=g) * 0.02
               for l in range(2) for s, shape in shapes.items()}
    paths["kvpop"] = os.path.join(out, "kvpop.safetensors")
    save_file(scorers, paths["kvpop"], metadata={"gate_kind": "kvpop", "window": "64", "sinks": "4", "topk": "32"})
    return os.path.join(out, "trimkv"), paths


def kv_mib(cache):
    """MiB of the distinct storages the layers' keys and values live in."""
    storages = {}
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values()) / 2**20


def run(model, cache, ids, chunk, new):
    """Prefill in chunks, then `new` greedy tokens; returns the decode wall time and steps."""
    with torch.no_grad():
        for a in range(0, ids.shape[1], chunk):
            logits = model(ids[:, a:a + chunk], past_key_values=cache, cache_position=torch.arange(a, min(a + chunk, ids.shape[1]))).logits
        token, pos = logits[:, -1:].argmax(-1), ids.shape[1]
        t0 = time.perf_counter()
        for i in range(new - 1):
            token = model(token, past_key_values=cache, cache_position=torch.tensor([pos + i])).logits[:, -1:].argmax(-1)
        return time.perf_counter() - t0, new - 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--prompt-file", required=True, help="its first --prompt-bytes bytes are the prompt")
    ap.add_argument("--prompt-bytes", type=int, default=4700)
    ap.add_argument("--policies", default="trimkv,dbtrimkv,kvpop")
    ap.add_argument("--budgets", default="256,512,1024,2048,4096")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, gates = make_models(a.bin_dir, tmp)
        model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
        with open(a.prompt_file, "rb") as f:
            text = f.read()[:a.prompt_bytes].decode("utf-8", errors="ignore")
        ids = torch.tensor([Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).encode(text).ids])
        print(f"prompt {ids.shape[1]} tokens, chunks of {a.prefill_chunk}, {a.max_new} new tokens, torch "
              f"{torch.__version__}, 1 thread, best of {a.repeat} rounds; load average before: "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
        rows = [("full", None)] + [(p, int(b)) for p in a.policies.split(",") for b in a.budgets.split(",")]
        best = {}
        for round_ in range(a.repeat):
            for policy, budget in rows:
                cache = DynamicCache() if budget is None else RetainCache(model, gates[policy], budget)
                wall, steps = run(model, cache, ids, a.prefill_chunk, a.max_new)
                r = getattr(cache, "retention", None)  # its timers of the one-token (decoding) forwards
                ev, sc = (r.decode_evict_s, r.decode_score_s) if r is not None else (0.0, 0.0)
                if (policy, budget) not in best or wall < best[policy, budget][0]:
                    heads = max(l.keys.shape[-2] for l in cache.layers)
                    best[policy, budget] = (wall, steps, ev, sc, kv_mib(cache), heads)
                print(f"round {round_ + 1}: {policy} {budget or '-'} {1e3 * wall / steps:.3f} ms/step",
                      file=sys.stderr, flush=True)
        plain = best["full", None][0] / best["full", None][1]
        print("| policy | budget | ms / decode step | scoring µs / step | selection + compaction µs / step | "
              "eviction µs / step (total) | share of this step | share of the plain step | "
              "entries per head (max) | K/V MiB allocated |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for policy, budget in rows:
            wall, steps, ev, sc, kv, heads = best[policy, budget]
            total = (ev + sc) / steps
            print(f"| {policy} | {budget or '-'} | {1e3 * wall / steps:.3f} | {1e6 * sc / steps:.1f} | "
                  f"{1e6 * ev / steps:.1f} | {1e6 * total:.1f} | {100 * total * steps / wall:.1f}% | "
                  f"{100 * total / plain:.1f}% | {heads} | {kv:.2f} |", flush=True)


if __name__ == "__main__":
    main()
