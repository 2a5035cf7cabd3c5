#!/usr/bin/env python3
"""The KVPOP training target log m (DESIGN §5) on held-out recall tasks, by position and token kind
(docs/results.md, "Why KVPOP recalls 32%"). Independent of retain's C++: transformers' Qwen3 in
float64 with eager attention gives the dense probabilities p_{d→t}, and
m_{κ,t} = max over κ's query heads of Σ_{d ≥ t+w} p_{d→t}.

    build/bin/retain-eval --model models/recall-qwen3 --task recall --context 1024 --pairs 8 --samples 2 \\
        --seed 1000 --dump-task /tmp/probe.jsonl
    PY=$(launch/python-env.sh)   # or any Python with torch and transformers
    $PY launch/kvpop-target-stats.py --model models/recall-qwen3 --tasks /tmp/probe.jsonl --window 16

Prints, per task, layer and KV head, the mean log m of early filler (positions 4..99), late filler
(800 .. T−w−1), the records whose key is not asked, and the asked record (with its best token's log m
and that token's rank among all tokens s ≤ t < T − w by log m).
"""
import argparse
import json

import torch
from transformers import Qwen3ForCausalLM

PAIR, QUERY, RECORD = 1, 3, 6  # PAIR k1 k2 ARROW v1 v2 (model/infer/recall_task.h)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tasks", required=True, help="retain-eval --dump-task JSON lines (queries 1)")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--sinks", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = Qwen3ForCausalLM.from_pretrained(a.model, attn_implementation="eager", dtype=torch.float64).eval()
    H, K = model.config.num_attention_heads, model.config.num_key_value_heads
    G, W = H // K, a.window
    for n, line in enumerate(open(a.tasks)):
        ids = json.loads(line)["input_ids"]
        T = len(ids)
        q = max(p for p, t in enumerate(ids) if t == QUERY)  # QUERY k1 k2 ARROW v1 v2
        rec = [p for p, t in enumerate(ids) if t == PAIR]
        asked = [p for p in rec if ids[p + 1:p + 3] == ids[q + 1:q + 3]][0]
        rtoks = {r + o for r in rec for o in range(RECORD)}
        with torch.no_grad():
            att = model(torch.tensor([ids]), output_attentions=True).attentions  # L × [1, H, T, T]
        for l, p in enumerate(att):
            for kv in range(K):
                mass = torch.stack([torch.tril(p[0, kv * G + g], diagonal=-W).sum(0) for g in range(G)])
                lm = mass.max(0).values.clamp_min(1e-300).log()

                def mean(ps):
                    v = [lm[t].item() for t in ps if t + W < T]
                    return sum(v) / len(v)

                early = [t for t in range(a.sinks, 100) if t not in rtoks]
                late = [t for t in range(800, T - W) if t not in rtoks and t < q]
                unasked = [r + o for r in rec if r != asked for o in range(RECORD)]
                mine = [asked + o for o in range(RECORD)]
                order = sorted(range(a.sinks, T - W), key=lambda t: -lm[t].item())
                best = max(mine, key=lambda t: lm[t].item())
                print(f"task {n} layer {l} kv {kv}: early filler {mean(early):6.2f}  late filler {mean(late):6.2f}  "
                      f"records not asked {mean(unasked):6.2f}  asked record (at {asked}) {mean(mine):6.2f}, "
                      f"best token {lm[best].item():6.2f} rank {order.index(best) + 1}")


if __name__ == "__main__":
    main()
