#!/usr/bin/env python3
"""retain-bench train end to end on a tiny head_dim-64 model (the CUDA attention kernels take 64
and 128; the committed fixture model's 16 has none): make the model with retain-make-tiny, run
`retain-bench train --device DEVICE --json FILE` on it for both gate kinds, and check the table
it prints and every key of the JSON (gpu-verify's train phase and trainer/bench read them).

The rules checked: step time, every phase and tokens/s are numbers ≥ 0 (step and tokens/s > 0),
TFLOP/s and peak memory > 0, MFU null exactly when peak_tflops is (the device is not in the
peak table, trainer/flops.h) and TFLOP/s over the peak otherwise; the table's MFU column "n/a"
exactly then. Prints "bench train json: ok" at the end (CTest's pass pattern) and exits 1 with
the reasons otherwise. On the CUDA emulator (CTest bench.train_cuda_emu) the timings are the
emulator's and mean nothing; the device is not in the table, so MFU must be n/a.
--gate-init INIT is passed on; the JSON's gate_init and the header line "gates: --gate-init INIT"
must say it (default "random"), and with zero-output:B (logβ = logsigmoid(B) for either kind)
trimkv's and dbtrimkv's first-step losses must be equal (CTest bench.train_gate_init_cpu).

    bench_train_check.py --bin-dir build-emu/bin --device cuda [--expect-mfu na|number|any]
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

ROW_KEYS = {"seq", "gate", "step_ms", "phase_ms", "tokens_per_s", "tflops", "flops", "mfu", "peak_gb",
            "reserved_peak_gb", "device_used_gb",
            "first_loss", "first_kl", "first_ntp", "first_cap"}
FLOP_PASSES = {"teacher", "student", "recompute", "backward", "loss", "count_pass"}
PHASES = {"teacher", "student", "capacity", "loss", "backward", "optimizer"}
TOP_KEYS = {"tool", "date", "device", "model", "docs", "gate_hidden", "memory", "seed", "gate_init", "iters",
            "warmup", "peak_tflops", "flops", "rows"}


def number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True, help="the directory of retain-make-tiny and retain-bench")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seq", type=int, default=64, help="T (default 64)")
    ap.add_argument("--expect-mfu", default="any", choices=["na", "number", "any"],
                    help="na: the device must not be in the peak table (the emulator); number: it must be")
    ap.add_argument("--gate-init", default=None, help="passed to retain-bench train (default: not given: random)")
    args = ap.parse_args()
    errors = []
    want_init = args.gate_init or "random"

    with tempfile.TemporaryDirectory(prefix="retain_bench_train_") as tmp:
        model = os.path.join(tmp, "model")
        subprocess.run([os.path.join(args.bin_dir, "retain-make-tiny"), "--out", model, "--layers", "2", "--hidden",
                        "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--intermediate", "128",
                        "--vocab", "300", "--seed", "5"], check=True, stdout=subprocess.DEVNULL)
        out = os.path.join(tmp, "train.json")
        cmd = [os.path.join(args.bin_dir, "retain-bench"), "train", "--model", model, "--device", args.device,
               "--seq", str(args.seq), "--gate-hidden", "16", "--iters", "1", "--warmup", "0", "--json", out]
        if args.gate_init:
            cmd += ["--gate-init", args.gate_init]
        print("$ " + " ".join(cmd), flush=True)
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sys.stdout.write(r.stdout)
        if r.returncode != 0:
            sys.stdout.write(r.stderr)
            print(f"retain-bench exited {r.returncode}")
            return 1
        with open(out) as f:
            j = json.load(f)

    if set(j) != TOP_KEYS:
        errors.append(f"top-level keys {sorted(j)}, expected {sorted(TOP_KEYS)}")
    peak = j.get("peak_tflops")
    if peak is not None and not (number(peak) and peak > 0):
        errors.append(f"peak_tflops {peak!r}")
    if args.expect_mfu == "na" and peak is not None:
        errors.append(f"device {j.get('device')!r} has a peak ({peak}), expected none")
    if args.expect_mfu == "number" and peak is None:
        errors.append(f"device {j.get('device')!r} is not in the peak table")
    if j.get("tool") != "retain-bench train":
        errors.append(f"tool {j.get('tool')!r}")
    if j.get("gate_init") != want_init:
        errors.append(f"gate_init {j.get('gate_init')!r}, expected {want_init!r}")
    if not re.search(rf"^gates: --gate-init {re.escape(want_init)} \(", r.stdout, re.M):
        errors.append(f"no header line 'gates: --gate-init {want_init} (...)'")
    rows = j.get("rows", [])
    if sorted((r.get("seq"), r.get("gate")) for r in rows) != [(args.seq, "dbtrimkv"), (args.seq, "trimkv")]:
        errors.append(f"rows {[(r.get('seq'), r.get('gate')) for r in rows]}")
    for row in rows:
        at = f"row {row.get('seq')} {row.get('gate')}"
        if set(row) != ROW_KEYS:
            errors.append(f"{at}: keys {sorted(row)}, expected {sorted(ROW_KEYS)}")
            continue
        if set(row["phase_ms"]) != PHASES:
            errors.append(f"{at}: phases {sorted(row['phase_ms'])}, expected {sorted(PHASES)}")
        for k, v in row["phase_ms"].items():
            if not (number(v) and v >= 0):
                errors.append(f"{at}: phase_ms.{k} {v!r}")
        flops = row["flops"]
        if not isinstance(flops, dict) or set(flops) != FLOP_PASSES | {"total"}:
            errors.append(f"{at}: flops {flops!r}, expected the passes {sorted(FLOP_PASSES)} and total")
        else:
            parts = sum(flops[k] for k in FLOP_PASSES)
            if not (number(flops["total"]) and flops["total"] > 0 and abs(flops["total"] - parts) <= 1e-9 * parts):
                errors.append(f"{at}: flops.total {flops['total']!r} is not the sum of the passes ({parts})")
            elif number(row["tflops"]) and number(row["step_ms"]) and row["step_ms"] > 0:
                want = flops["total"] / (row["step_ms"] * 1e-3) / 1e12
                if abs(row["tflops"] - want) > 1e-6 * want:
                    errors.append(f"{at}: tflops {row['tflops']!r}, expected flops.total / step time = {want}")
        if args.device == "cuda":  # the pool holds at least what it handed out; the card has the model
            if not (number(row["reserved_peak_gb"]) and number(row["peak_gb"])
                    and row["reserved_peak_gb"] >= row["peak_gb"] - 1e-9):
                errors.append(f"{at}: reserved_peak_gb {row['reserved_peak_gb']!r} below peak_gb {row['peak_gb']!r}")
            if not (number(row["device_used_gb"]) and row["device_used_gb"] > 0):
                errors.append(f"{at}: device_used_gb {row['device_used_gb']!r}, expected a number > 0")
        elif row["reserved_peak_gb"] is not None or row["device_used_gb"] is not None:
            errors.append(f"{at}: reserved_peak_gb / device_used_gb on the CPU, expected null")
        for k in ("step_ms", "tokens_per_s", "tflops", "peak_gb"):
            if not (number(row[k]) and row[k] > 0):
                errors.append(f"{at}: {k} {row[k]!r}, expected a number > 0")
        for k in ("first_loss", "first_kl", "first_ntp", "first_cap"):
            if not number(row[k]):
                errors.append(f"{at}: {k} {row[k]!r}")
        if peak is None and row["mfu"] is not None:
            errors.append(f"{at}: mfu {row['mfu']!r} without a peak")
        if peak is not None and not (number(row["mfu"]) and abs(row["mfu"] - row["tflops"] / peak) <= 1e-9):
            errors.append(f"{at}: mfu {row['mfu']!r}, expected tflops / peak = {row['tflops'] / peak}")
        if number(row["step_ms"]) and number(row["tokens_per_s"]):
            want = args.seq / (row["step_ms"] * 1e-3)
            if abs(row["tokens_per_s"] - want) > 1e-6 * want:
                errors.append(f"{at}: tokens_per_s {row['tokens_per_s']} for {args.seq} tokens in {row['step_ms']} ms")

    if want_init.startswith("zero-output:"):  # the same constant logβ for both kinds: the same loss
        losses = {row.get("gate"): row.get("first_loss") for row in rows}
        if len(set(losses.values())) != 1:
            errors.append(f"zero-output init: the kinds' first-step losses differ: {losses}")

    # The printed table: one line per row, its MFU column "n/a" exactly when there is no peak.
    for gate in ("trimkv", "dbtrimkv"):
        line = re.search(rf"^ *{args.seq} {gate} .*$", r.stdout, re.M)
        if not line:
            errors.append(f"no table line for {args.seq} {gate}")
        elif (" n/a " in line.group(0)) != (peak is None):
            errors.append(f"table line {line.group(0)!r}: MFU column does not match peak_tflops {peak}")

    for e in errors:
        print("FAIL: " + e)
    if errors:
        return 1
    mfu = "n/a" if peak is None else "a number"
    print(f"bench train json: ok ({len(rows)} rows on {j['device']}, MFU {mfu}); gates {want_init}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
