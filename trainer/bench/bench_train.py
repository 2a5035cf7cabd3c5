#!/usr/bin/env python3
"""retain-train throughput on the CPU (a benchmark, not a test).

Makes a random Qwen3 with retain-make-tiny (--layers/--hidden/... below), packs this
repository's README.md and docs/*.md into --seq-len sequences with retain-pack, then runs
retain-train for --steps steps in each launch configuration and reports the median over the
steps after the first of: seconds per step and tokens per second (non-padding tokens of the
global batch / step wall time, from RUN/metrics.jsonl). Every configuration runs the same
global batch, so the rows compare how the same work is spread:

  1 rank × T threads   one process, OpenMP over T threads (OMP_NUM_THREADS=T)
  N ranks × 1 thread   mpirun -np N (launch/mpirun.sh), FSDP-sharded weights, data parallel
(OMP_WAIT_POLICY=PASSIVE unless set, as launch/mpirun.sh does.)

    python3 trainer/bench/bench_train.py --bin-dir build/bin --seq-len 1024 --global-batch 4 --steps 6
    python3 trainer/bench/bench_train.py ... --gate kvpop --window 64 --topk 64   (KVPOP scorers, DESIGN §5)

Prints a markdown table. Needs only the Python standard library and the built tools.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr.strip()}")
    return r


def median_step(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = rows[1:]  # the first step pays for page faults and the first gathers
    return statistics.median(r["step_seconds"] for r in rows), statistics.median(r["tokens_per_s"] for r in rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "build", "bin"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--gate", default="trimkv", help="trimkv, dbtrimkv or kvpop")
    ap.add_argument("--window", type=int, default=64, help="kvpop: window w")
    ap.add_argument("--topk", type=int, default=64, help="kvpop: top-k")
    ap.add_argument("--gate-hidden", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="cores to use (default: all)")
    a = ap.parse_args()

    work = tempfile.mkdtemp(prefix="retain_bench_train_")
    try:
        model = os.path.join(work, "model")
        run([os.path.join(a.bin_dir, "retain-make-tiny"), "--out", model, "--layers", str(a.layers), "--hidden",
             str(a.hidden), "--heads", str(a.heads), "--kv-heads", str(a.kv_heads), "--head-dim", str(a.head_dim),
             "--intermediate", str(a.intermediate), "--vocab", str(a.vocab), "--seed", "1"])
        docs = [os.path.join(REPO, "README.md")] + sorted(
            os.path.join(REPO, "docs", f) for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md"))
        data = os.path.join(work, "data.h5")
        run([os.path.join(a.bin_dir, "retain-pack"), "--tokenizer", model, "--format", "txt", "--txt-mode", "line",
             "--seq-len", str(a.seq_len), "--packing", "bfd", "--quiet", "--out", data] + docs)
        common = ["--model", model, "--data", data, "--gate", a.gate, "--steps", str(a.steps), "--global-batch",
                  str(a.global_batch), "--save-every", str(10 ** 9)]
        if a.gate == "kvpop":
            common += ["--window", str(a.window), "--sinks", "4", "--topk", str(a.topk)]
        else:
            common += ["--gate-hidden", str(a.gate_hidden), "--bias-init", "4", "--memory", "64", "--loss-chunk", "256"]
        configs = [(1, 1), (1, a.threads)]
        for ranks in (2, 4):
            if ranks <= a.threads and a.global_batch % ranks == 0:
                configs.append((ranks, 1))
        print(f"model: {a.layers} layers, hidden {a.hidden}, {a.heads}/{a.kv_heads} heads, head_dim {a.head_dim}, "
              f"intermediate {a.intermediate}, vocab {a.vocab}; "
              f"{f'kvpop w={a.window} k={a.topk}' if a.gate == 'kvpop' else f'{a.gate} G={a.gate_hidden}'}; "
              f"{a.global_batch} sequences × {a.seq_len} tokens per step; median of steps 2..{a.steps}\n")
        print("| launch | s/step | tokens/s | tokens/s per core |")
        print("|---|---|---|---|")
        base = None
        for ranks, threads in configs:
            if (ranks, threads) in configs[:configs.index((ranks, threads))]:
                continue
            out = os.path.join(work, f"run-{ranks}x{threads}")
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as launch/mpirun.sh sets it
            train = [os.path.join(a.bin_dir, "retain-train"), "--out", out] + common
            if ranks == 1:
                run(train, env)
            else:
                env["RETAIN_MPI_OVERSUBSCRIBE"] = "1"
                run([os.path.join(REPO, "launch", "mpirun.sh"), "-np", str(ranks), "--"] + train, env)
            sec, tps = median_step(out)
            base = base or tps
            print(f"| {ranks} rank{'s' if ranks > 1 else ''} × {threads} thread{'s' if threads > 1 else ''} | "
                  f"{sec:.3f} | {tps:,.0f} | {tps / (ranks * threads):,.0f} |", flush=True)
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
