#!/usr/bin/env python3
"""Exposed FSDP weight all-gather per training step, estimated from one GPU's measured step.

usage: trainer/bench/fsdp_estimate.py --json FILE --busbw GB/s [--ranks N] [--model DIR]

FSDP (trainer/fsdp.h) keeps 1/N of every layer's bf16 weights per rank and gathers layer
l+1 on the communication stream while layer l computes, in each of the step's three passes over
the layers (teacher forward, student forward, recomputation + backward); the tied
embedding/lm_head is gathered three times (the teacher's and the student's embedding lookups,
the loss's lm_head). With one GPU lent, nothing crosses GPUs, so this script
estimates what N ranks would expose:

  gather(bytes) = bytes * (N - 1) / N / busbw        (NCCL's all_gather bus bandwidth)
  per pass p:   exposed_p = gather(layer) + (L - 1) * max(0, gather(layer) - compute_p / L)
  per step:     exposed = sum over the 3 passes + 3 * gather(embedding)

where compute_p is the pass's measured time in FILE (`retain-bench train --json`: phase_ms
teacher, student, backward) spread evenly over the L layers, and a layer's bytes are its
projections and MLP in bf16 and its norms in F32, from the model's config.json. The first layer of every
pass and the embedding are counted as fully exposed (nothing to hide them behind).
--busbw is an input, not a measurement of this script: take nccl-tests' all_gather_perf
"busbw" on the target machine. Prints, per row of FILE, the estimate and its share of the
step; issue 13's target is < 2% for Qwen3-4B at 32K on one node.
Exit status: 0, 1 for an unreadable input, 2 for a usage error.
"""
import argparse
import json
import os
import sys


def layer_and_embedding_bytes(config):
    D = config["hidden_size"]
    H = config["num_attention_heads"]
    K = config.get("num_key_value_heads", H)
    d = config.get("head_dim") or D // H
    inter = config["intermediate_size"]
    V = config["vocab_size"]
    projections = D * H * d + 2 * D * K * d + H * d * D + 3 * D * inter  # q, k, v, o; gate, up, down
    norms = 2 * D + 2 * d  # input/post-attention RMSNorm, q_norm, k_norm: F32, gathered with the layer
    return 2 * projections + 4 * norms, 2 * V * D  # bf16 projections and embedding


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--json", required=True, help="retain-bench train --json output")
    ap.add_argument("--busbw", type=float, required=True, help="all-gather bus bandwidth, GB/s (10^9 B/s)")
    ap.add_argument("--ranks", type=int, default=8, help="ranks sharing the weights (default 8: one node)")
    ap.add_argument("--model", help="model directory (default: the one FILE names)")
    a = ap.parse_args(argv)
    if a.busbw <= 0 or a.ranks < 2:
        ap.error("--busbw must be > 0 and --ranks >= 2")
    try:
        with open(a.json) as f:
            doc = json.load(f)
        model = a.model or doc["model"]
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
        layers = config["num_hidden_layers"]
        layer_bytes, embedding_bytes = layer_and_embedding_bytes(config)
        rows = doc["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"fsdp_estimate: {a.json}: cannot read the step or its model ({e})", file=sys.stderr)
        return 1
    bw = a.busbw * 1e9
    share = (a.ranks - 1) / a.ranks
    gather_layer_ms = 1e3 * layer_bytes * share / bw
    gather_embedding_ms = 1e3 * embedding_bytes * share / bw
    print(f"FSDP estimate: {os.path.basename(os.path.normpath(model))}, {layers} layers of {layer_bytes / 1e6:.1f} MB "
          f"bf16, embedding {embedding_bytes / 1e6:.1f} MB; {a.ranks} ranks at an all-gather bus bandwidth of "
          f"{a.busbw:g} GB/s (given): {gather_layer_ms:.3f} ms per layer, {gather_embedding_ms:.3f} ms embedding")
    for r in rows:
        exposed = 3 * gather_embedding_ms
        for phase in ("teacher", "student", "backward"):
            per_layer = r["phase_ms"][phase] / layers
            exposed += gather_layer_ms + (layers - 1) * max(0.0, gather_layer_ms - per_layer)
        pct = 100.0 * exposed / r["step_ms"]
        print(f"  T={r['seq']} {r['gate']}: step {r['step_ms']:.1f} ms, exposed all-gather {exposed:.2f} ms "
              f"= {pct:.3f}% of the step (estimate)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
