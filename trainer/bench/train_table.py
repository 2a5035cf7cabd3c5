#!/usr/bin/env python3
"""The table of `retain-bench train --json` results, and issue 12's targets.

usage: trainer/bench/train_table.py FILE.json [FILE.json ...]

Prints one Markdown row per (model, T, gate): step time, tokens/s, TFLOP/s, MFU, peak memory
and each phase's share of the step, then a verdict line for every row of a Qwen3-4B-shaped
model (hidden 2560, 36 layers) at T = 131,072 against the targets of issue 12: peak memory
<= 50 GB (10^9 bytes, the memory pool's high-water mark) and step time <= 60 s.
A missed target is printed as MISSED; the exit status is 0 whenever the files could be read
(a missed target is a finding, not an error), 1 for an unreadable file, 2 for a usage error.
"""
import json
import os
import sys

PHASES = ("teacher", "student", "capacity", "loss", "backward", "optimizer")
TARGET_T = 131072
TARGET_PEAK_GB = 50.0
TARGET_STEP_S = 60.0


def model_shape(model_dir):
    """(name, hidden, layers) of the model directory, from its config.json when it is still there."""
    name = os.path.basename(os.path.normpath(model_dir))
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            c = json.load(f)
        return name, c.get("hidden_size"), c.get("num_hidden_layers")
    except (OSError, ValueError):
        return name, None, None


def is_qwen3_4b(name, hidden, layers):
    if hidden is not None and layers is not None:
        return hidden == 2560 and layers == 36
    return "4b" in name.lower()  # the directory is gone (gpu-verify deletes it): go by its name


def load(path):
    try:
        with open(path) as f:
            doc = json.load(f)
        rows = doc["rows"]
        model = doc["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"train_table: {path}: not a retain-bench train JSON file ({e})")
    return doc, model, rows


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    lines = ["| model | device | T | gate | step s | tokens/s | TFLOP/s | MFU | peak GB | "
             + " | ".join(f"{p} %" for p in PHASES) + " |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|" + "---:|" * len(PHASES)]
    verdicts = []
    for path in argv:
        doc, model, rows = load(path)
        name, hidden, layers = model_shape(model)
        for r in rows:
            step_ms = r["step_ms"]
            shares = [100.0 * r["phase_ms"].get(p, 0.0) / step_ms if step_ms > 0 else None for p in PHASES]
            mfu = r.get("mfu")
            lines.append(f"| {name} | {doc.get('device', '?')} | {r['seq']} | {r['gate']} | {step_ms / 1e3:.2f} | "
                         f"{r['tokens_per_s']:.0f} | {fmt(r.get('tflops'), '.1f')} | "
                         f"{'n/a' if mfu is None else format(100 * mfu, '.1f') + ' %'} | {r['peak_gb']:.2f} | "
                         + " | ".join(fmt(s, ".1f") for s in shares) + " |")
            if r["seq"] == TARGET_T and is_qwen3_4b(name, hidden, layers):
                peak_ok = r["peak_gb"] <= TARGET_PEAK_GB
                step_ok = step_ms / 1e3 <= TARGET_STEP_S
                verdicts.append(f"TARGET {name} {r['gate']} T={TARGET_T}: peak {r['peak_gb']:.2f} GB "
                                f"(<= {TARGET_PEAK_GB:.0f}) {'MET' if peak_ok else 'MISSED'}; step "
                                f"{step_ms / 1e3:.2f} s (<= {TARGET_STEP_S:.0f}) {'MET' if step_ok else 'MISSED'}")
    print("\n".join(lines))
    if verdicts:
        print()
        print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
