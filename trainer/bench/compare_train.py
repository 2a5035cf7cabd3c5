#!/usr/bin/env python3
"""retain's training step against the TRIM-KV authors' (trimkv 0.1.5) on the same model, shapes
and tokens (a benchmark, not a test).

Runs `retain-bench train --dump-batch` (which writes the batches it times), then
trainer/bench/bench_reference.py on those batches with the trimkv venv's Python, and writes
  OUT/compare.md    a markdown table: seq, gate, tokens/s each and their ratio, peak GB each, the
                    first step's loss each and their relative difference (a reference row that
                    failed — out of memory, no CPU backward — shows its error)
  OUT/compare.png   tokens/s and peak memory vs T for both (matplotlib)
  OUT/retain.json, OUT/reference.json, OUT/batch.json   the raw results and the batches
with the device line, versions and date. --write-docs replaces the section between
`<!-- train-vs-reference:begin -->` and `<!-- train-vs-reference:end -->` in --docs-file
(default docs/benchmarks.md; appended at the end when the markers are missing).

    python3 trainer/bench/compare_train.py --model tests/fixtures/trainer/model --device cpu \\
        --seq 128,256 --gate-hidden 16 --out build/compare-train
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BEGIN, END = "<!-- train-vs-reference:begin -->", "<!-- train-vs-reference:end -->"


def run(cmd, env=None):
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
    sys.stderr.write(r.stdout)
    if r.returncode != 0:
        sys.exit(f"compare_train.py: {os.path.basename(cmd[0])} {cmd[1] if len(cmd) > 1 else ''} failed "
                 f"(exit {r.returncode})")
    return r.stdout


def fmt(x, spec):
    return "—" if x is None else format(x, spec)


def table(retain, ref, command):
    refs = {(r["seq"], r["gate"]): r for r in ref["rows"]}
    lines = [
        f"retain: {retain['device']}, {retain['date']}; reference: trimkv {ref['versions']['trimkv']}, torch "
        f"{ref['versions']['torch']}, transformers {ref['versions']['transformers']} ({ref['dtype']}) on "
        f"{ref['device']}, {ref['date']}. Model `{retain['model']}`, G {retain['gate_hidden']}, M "
        f"{retain['memory']:g}, {retain['docs']} document(s) per sequence, median of {retain['iters']} steps after "
        f"{retain['warmup']} warm-up. Peak memory: CUDA allocator high-water mark, or the process's peak "
        f"resident set on the CPU.",
        "",
        f"`{command}`",
        "",
        "| T | gate | retain tokens/s | reference tokens/s | ratio | retain peak GB | reference peak GB | "
        "retain loss@1 | reference loss@1 | rel. diff |",
        "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in retain["rows"]:
        f = refs.get((r["seq"], r["gate"]), {"error": "not run"})
        if "error" in f:
            lines.append(f"| {r['seq']} | {r['gate']} | {r['tokens_per_s']:.1f} | error: {f['error']} | — | "
                         f"{r['peak_gb']:.3f} | — | {r['first_loss']:.5f} | — | — |")
            continue
        rel = abs(r["first_loss"] - f["first_loss"]) / max(abs(f["first_loss"]), 1e-30)
        lines.append(f"| {r['seq']} | {r['gate']} | {r['tokens_per_s']:.1f} | {f['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] / f['tokens_per_s']:.2f}× | {r['peak_gb']:.3f} | {f['peak_gb']:.3f} | "
                     f"{r['first_loss']:.5f} | {f['first_loss']:.5f} | {rel:.2e} |")
    return "\n".join(lines) + "\n"


def plot(retain, ref, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, data, style in (("retain", retain, "-o"), ("reference", ref, "--s")):
        for gate in sorted({r["gate"] for r in data["rows"]}):
            ok = [r for r in data["rows"] if r["gate"] == gate and "error" not in r]
            if not ok:
                continue
            ax1.plot([r["seq"] for r in ok], [r["tokens_per_s"] for r in ok], style, label=f"{name} {gate}")
            ax2.plot([r["seq"] for r in ok], [r["peak_gb"] for r in ok], style, label=f"{name} {gate}")
    for ax, ylabel in ((ax1, "tokens/s"), (ax2, "peak memory (GB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"training step: retain ({retain['device']}) vs trimkv {ref['versions']['trimkv']} "
                 f"({ref['device']}), {retain['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_docs(path, section):
    text = open(path).read() if os.path.exists(path) else ""
    block = f"{BEGIN}\n{section}{END}"
    if BEGIN in text and END in text and text.index(BEGIN) < text.index(END):
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n## Training step: retain vs the TRIM-KV reference\n\n" + block + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--seq", default=None, help="T, comma-separated (default: 8192,32768 on cuda, 128,256 on cpu)")
    ap.add_argument("--gate", default="trimkv,dbtrimkv")
    ap.add_argument("--gate-hidden", type=int, default=512)
    ap.add_argument("--memory", type=float, default=128)
    ap.add_argument("--docs", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "build", "bin"))
    ap.add_argument("--python", default=os.environ.get("RETAIN_TRIMKV_PYTHON", os.path.expanduser(
        "~/.cache/retain/venvs/trimkv/bin/python")), help="a Python with trimkv 0.1.5 (default: $RETAIN_TRIMKV_PYTHON, else ~/.cache/retain/venvs/trimkv/bin/python)")
    ap.add_argument("--out", default=os.path.join(REPO, "build", "compare-train"))
    ap.add_argument("--write-docs", action="store_true", help="replace the marked section of --docs-file")
    ap.add_argument("--docs-file", default=os.path.join(REPO, "docs", "benchmarks.md"))
    a = ap.parse_args()

    os.makedirs(a.out, exist_ok=True)
    device = a.device
    common = ["--gate", a.gate, "--gate-hidden", str(a.gate_hidden), "--memory", f"{a.memory:g}", "--iters",
              str(a.iters), "--warmup", str(a.warmup), "--seed", str(a.seed)]
    batch, rj, fj = (os.path.join(a.out, n) for n in ("batch.json", "retain.json", "reference.json"))
    cmd = [os.path.join(a.bin_dir, "retain-bench"), "train", "--model", a.model, "--docs", str(a.docs),
           "--dump-batch", batch, "--json", rj] + common
    if device:
        cmd += ["--device", device]
    if a.seq:
        cmd += ["--seq", a.seq]
    elif device != "cuda":
        cmd += ["--seq", "128,256"]
    run(cmd)
    retain = json.load(open(rj))
    ref_device = device or ("cpu" if retain["device"] == "cpu" else "cuda")
    run([a.python, os.path.join(REPO, "trainer", "bench", "bench_reference.py"), "--model", a.model, "--batch", batch,
         "--device", ref_device, "--json", fj] + common)
    ref = json.load(open(fj))

    command = "python3 trainer/bench/compare_train.py " + " ".join(
        x for x in sys.argv[1:] if x != "--write-docs")
    md = table(retain, ref, command)
    png = os.path.join(a.out, "compare.png")
    plot(retain, ref, png)
    md_path = os.path.join(a.out, "compare.md")
    with open(md_path, "w") as f:
        f.write(md + f"\n![tokens/s and peak memory vs T]({os.path.basename(png)})\n")
    print(md)
    print(f"wrote {md_path} and {png}")
    if a.write_docs:
        write_docs(a.docs_file, md)
        print(f"updated the train-vs-reference section of {a.docs_file} (the plot stays in {png})")


if __name__ == "__main__":
    main()
