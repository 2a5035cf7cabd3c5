#!/usr/bin/env python3
"""Bounded-KV decoding speed and memory per policy and budget (docs/benchmarks.md).

Runs `retain-generate` (greedy, --ignore-eos) on a long prompt for every policy and budget and
prints a markdown table of its own report: decode tokens/s, the eviction share of the decode
time, the K/V bytes the cache holds at the end, and the process's peak RSS. Best of --repeat
runs by decode tokens/s (the machine may be shared).
"""
import argparse
import re
import subprocess
import sys

LINE = re.compile(r"(\d+) prompt tokens in ([\d.]+) ms \(([\d.]+) tokens/s\), (\d+) new tokens \((\d+) decode steps, ([\d.]+) tokens/s\)")
CACHE = re.compile(r"cache: (\d+) entries .*?at most (\d+) per KV head\), ([\d.]+) MiB of K/V in F32; eviction ([\d.]+)% of the decode time \(([\d.]+) us per step\); peak RSS ([\d.]+) MiB")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--gates", required=True)
    ap.add_argument("--prompt-file", required=True)
    ap.add_argument("--policies", default="full,window,h2o,trimkv,dbtrimkv")
    ap.add_argument("--budgets", default="256,512,1024,2048,4096")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    print("| policy | budget | prompt tok/s | decode tok/s | ms / decode step | eviction share | eviction µs / step | cache entries | K/V MiB | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for policy in a.policies.split(","):
        for budget in (["-"] if policy == "full" else a.budgets.split(",")):
            best = None
            for _ in range(a.repeat):
                cmd = [f"{a.bin_dir}/retain-generate", "--model", a.model, "--gates", a.gates, "--policy", policy,
                       "--prompt-file", a.prompt_file, "--max-new", str(a.max_new), "--greedy", "--ignore-eos",
                       "--prefill-chunk", str(a.prefill_chunk)] + ([] if budget == "-" else ["--budget", budget])
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    sys.exit(f"{' '.join(cmd)}: {r.stderr.strip()}")
                m, c = LINE.search(r.stderr), CACHE.search(r.stderr)
                row = dict(prompt=float(m[3]), decode=float(m[6]), entries=int(c[1]), kv=float(c[3]),
                           evict=float(c[4]), evict_us=float(c[5]), rss=float(c[6]))
                if best is None or row["decode"] > best["decode"]:
                    best = row
            print(f"| {policy} | {budget} | {best['prompt']:.0f} | {best['decode']:.0f} | {1000 / best['decode']:.3f} | "
                  f"{best['evict']:.1f}% | {best['evict_us']:.1f} | {best['entries']} | {best['kv']:.2f} | {best['rss']:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
