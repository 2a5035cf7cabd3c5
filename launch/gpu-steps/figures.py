#!/usr/bin/env python3
"""Key figures of a verification step's JSON, as `FIGURE key=value` lines that
launch/gpu_ledger.py records with the step's run in docs/gpu-ledger.json.

usage: figures.py attention FILE.json   retain vs FlexAttention and SDPA (bench_attention.py --json)
       figures.py train FILE.json       retain-bench train --json: step time, peak memory, MFU
       figures.py capacity FILE.json    retain-bench attention --json: capacity's share of the step
Exit 1 with one line when the file is not what the subcommand reads.
"""
import json
import sys

K = 1024


def short(seq):
    return f"{seq // K}k" if seq % K == 0 else str(seq)


def attention(doc):
    for r in doc.get("ratios", []):
        if r.get("op") != "gated fwd+bwd":
            continue
        t = short(r["seq"])
        for key, value in (("retain_over_flex", r.get("retain_over_flex")),
                           ("retain_over_sdpa_cudnn", r.get("retain_over_sdpa_cudnn"))):
            print(f"FIGURE {t}.{key}={'n/a' if value is None else f'{value:.2f}'}")
    for r in doc.get("rows", []):
        if r.get("op") == "gated fwd+bwd" and r.get("ms") is not None:  # null: that peer could not run it
            print(f"FIGURE {short(r['seq'])}.{r.get('impl', '?')}_fwd_bwd_ms={r['ms']:.2f}")


def train(doc):
    for r in doc["rows"]:
        t = f"{short(r['seq'])}.{r['gate']}"
        print(f"FIGURE {t}.step_s={r['step_ms'] / 1e3:.2f}")
        print(f"FIGURE {t}.peak_gb={r['peak_gb']:.2f}")
        print(f"FIGURE {t}.tokens_per_s={r['tokens_per_s']:.0f}")
        print(f"FIGURE {t}.mfu={'n/a' if r.get('mfu') is None else format(r['mfu'], '.3f')}")


def capacity(doc):
    for r in doc["rows"]:
        if str(r.get("op", "")).startswith("capacity") and "share_of_gated_fwd_bwd" in r:
            print(f"FIGURE {short(r['seq'])}.capacity_share_pct={100 * r['share_of_gated_fwd_bwd']:.2f}")
            print(f"FIGURE {short(r['seq'])}.capacity_ms={r['ms']:.2f}")


def main(argv):
    if len(argv) != 2 or argv[0] not in ("attention", "train", "capacity"):
        print(__doc__.strip(), file=sys.stderr if argv[:1] not in (["-h"], ["--help"]) else sys.stdout)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    try:
        with open(argv[1]) as f:
            doc = json.load(f)
        {"attention": attention, "train": train, "capacity": capacity}[argv[0]](doc)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"figures.py: {argv[1]}: not a {argv[0]} JSON file ({type(e).__name__}: {e})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
