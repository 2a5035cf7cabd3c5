#!/usr/bin/env python3
"""retain's training step against the TRIM-KV authors' (trimkv 0.1.5) on the same models, shapes
and tokens: issue 14's one command (a benchmark, not a test).

    python3 trainer/bench/compare_train.py --shapes 0.6B,1.7B,4B --device cuda \\
        --out build/compare-train --write-docs

For every model, T (--seq) and gate kind (--gate), one row, run as two processes:
  retain     `retain-bench train --seq T --gate G --dump-batch` (which writes the tokens it timed)
  reference  trainer/bench/bench_reference.py on those tokens, with the trimkv venv's Python
             (--python; how to make it: bench_reference.py's docstring)
A failure of either side (out of memory, a crash, --row-timeout) is recorded as that side's error
and the run goes on. Models: --model DIR, or --shapes NAME,... — random-weight HF-layout Qwen3
checkpoints that build/bin/retain-make-tiny writes into a temporary folder (deleted when the
shape's rows are done; --keep-models DIR keeps and reuses them), with these flags (the same as
launch/gpu-verify.sh's train phase):
  0.6B  --layers 28 --hidden 1024 --heads 16 --kv-heads 8 --intermediate 3072 --tie
  1.7B  --layers 28 --hidden 2048 --heads 16 --kv-heads 8 --intermediate 6144 --tie
  4B    --layers 36 --hidden 2560 --heads 32 --kv-heads 8 --intermediate 9728 --tie
each with --head-dim 128 --vocab 151936 --yarn-factor 4 --seed 1. --define-shape 'NAME=FLAGS'
adds a shape with retain-make-tiny FLAGS of its own (the live check uses tiny ones).

Gates: --gate-init random (default) is both sides' own fresh init, bias 18 with N(0, 0.02) weights
from different RNGs: logβ ≈ −1.5e-8, so the gates barely touch the loss and the loss check shows
little of the gated math. --gate-init zero-output:B (e.g. zero-output:2) zeroes the gates' output
projection on both sides (trimkv: linear2.weight, dbtrimkv: the shared linear3.weight) and sets
their bias to B: logβ = logsigmoid(B) (≈ −0.127 for B = 2) for every token whatever the random
weights are, so the first-step losses (KL, NTP, capacity) must agree with a clearly visible decay
(and trimkv's and dbtrimkv's are then equal: the same logβ). Each side's JSON must report the init
it was asked for, else that side is an error row and a **FAIL**.

Resume: rows accumulate in OUT/compare.json, written after every row; a re-run with the same
settings (--gate-hidden, --memory, --docs, --iters, --warmup, --seed, --device) skips the rows it
holds for the same model, T, gate and --gate-init (--retry-errors runs error rows again), so a
long run can be split over several calls of a device limited to 10 minutes each (--time-budget S:
start no row after S seconds; exit 75 while rows remain). Writes, from all the rows held:
  OUT/compare.md    a markdown table per model, T, gate and gate init: tokens/s of each and
                    their ratio, peak GB of each and their ratio, the first step's loss of
                    each, their relative difference and a verdict against --loss-tol (default
                    1e-2 where the reference ran in bf16, i.e. on a GPU; 1e-5 in float32 on the
                    CPU): "ok" or "**FAIL**"
  OUT/compare.png   tokens/s and peak memory against T, both trainers, one line per gate (and
                    gate init, where the rows have more than one)
  OUT/compare.json  the rows (each side's JSON row, device, versions, date, the command)
--write-docs replaces what lies between `<!-- train-vs-reference:begin -->` and
`<!-- train-vs-reference:end -->` in --docs-file (default docs/benchmarks.md) with the table and
a link to the plot, copied to images/train-vs-reference.png beside that file. --table-only
renders from OUT/compare.json without running anything. Exit status: 0; 1 when a row's losses
disagree beyond the tolerance or a side ran other gates than --gate-init (after writing
everything); 75 when --time-budget left rows undone.

On the CPU (tiny model; the timings mean nothing there, the losses do):
    python3 trainer/bench/compare_train.py --model tests/fixtures/trainer/model --device cpu \\
        --seq 128,256 --gate-hidden 16 --out build/compare-train
"""
import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_reference import gate_init_name, parse_gate_init  # noqa: E402 (stdlib-only at import)
BEGIN, END = "<!-- train-vs-reference:begin -->", "<!-- train-vs-reference:end -->"
DOCS_IMAGE = os.path.join("images", "train-vs-reference.png")
# retain-make-tiny flags of the Qwen3 shapes (launch/gpu-verify.sh's train phase has the same).
SHAPES = {
    "0.6B": "--layers 28 --hidden 1024 --heads 16 --kv-heads 8 --intermediate 3072 --tie",
    "1.7B": "--layers 28 --hidden 2048 --heads 16 --kv-heads 8 --intermediate 6144 --tie",
    "4B": "--layers 36 --hidden 2560 --heads 32 --kv-heads 8 --intermediate 9728 --tie",
}
SHAPE_COMMON = "--head-dim 128 --vocab 151936 --yarn-factor 4 --seed 1"
# Settings that must match for rows of one OUT to sit in one table.
SETTINGS = ("device", "gate_hidden", "memory", "docs", "iters", "warmup", "seed")
INCOMPLETE = 75

_child = None  # the running side's process, ended when this one is


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run_side(cmd, timeout, env=None):
    """Runs cmd, echoing its output to stderr. Returns (exit status, last lines of its output);
    status None when it ran past timeout seconds (it is then killed)."""
    global _child
    log("+ " + " ".join(shlex.quote(c) for c in cmd))
    tail = []
    try:
        _child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                  errors="replace")
    except OSError as e:
        return 127, [f"{type(e).__name__}: {e}"]
    timed_out = []
    timer = None
    if timeout:
        def kill():
            timed_out.append(True)
            _child.kill()
        timer = threading.Timer(timeout, kill)
        timer.start()
    try:
        for line in _child.stdout:
            sys.stderr.write(line)
            tail = (tail + [line.rstrip("\n")])[-40:]
        rc = _child.wait()
    finally:
        if timer:
            timer.cancel()
        if _child.poll() is None:  # this process is ending (SIGTERM, an exception): so does the side
            _child.kill()
            _child.wait()
        _child = None
    return (None if timed_out else rc), tail


def failure(tool, rc, tail, timeout):
    """The one-line error of a side that failed."""
    if rc is None:
        return f"timed out after {timeout:g} s (--row-timeout)"
    lines = [x.strip() for x in tail if x.strip()]
    said = next((x for x in reversed(lines) if "error" in x.lower() or "out of memory" in x.lower()),
                lines[-1] if lines else "no output")
    for prefix in (f"{tool}: error: ", f"{tool}: "):
        if said.startswith(prefix):
            said = said[len(prefix):]
            break
    kind = "out of memory, " if "out of memory" in said.lower() else ""
    how = f"killed by signal {-rc}" if rc < 0 else f"exit {rc}"
    return f"{kind}{tool} {how}: {said[:300]}"


def side_args(a):
    """The settings both sides take under the same names."""
    return ["--gate-hidden", str(a.gate_hidden), "--memory", f"{a.memory:g}", "--iters", str(a.iters), "--warmup",
            str(a.warmup), "--seed", str(a.seed), "--gate-init", a.gate_init]


def run_retain(a, model_dir, T, gate, batch, tmp):
    """retain's side of one row (tmp: the row's fresh folder): (row, run info)."""
    out = os.path.join(tmp, "retain.json")
    cmd = [os.path.join(a.bin_dir, "retain-bench"), "train", "--model", model_dir, "--seq", str(T), "--gate", gate,
           "--docs", str(a.docs)] + side_args(a) + ["--dump-batch", batch, "--json", out]
    if a.device:
        cmd += ["--device", a.device]
    rc, tail = run_side(cmd, a.row_timeout)
    if rc != 0 or not os.path.exists(out):
        return {"seq": T, "gate": gate, "error": failure("retain-bench", rc, tail, a.row_timeout)}, {}
    j = json.load(open(out))
    info = {k: j.get(k) for k in ("device", "date", "peak_tflops", "flops", "gate_init")}
    return init_applied(a, "retain-bench", j, j["rows"][0]), info


def run_reference(a, model_dir, T, gate, batch, device, tmp):
    """The reference side of one row on the batch retain-bench wrote: (row, run info)."""
    if not os.path.exists(batch):
        return {"seq": T, "gate": gate, "error": "not run: retain-bench wrote no batch"}, {}
    out = os.path.join(tmp, "reference.json")
    cmd = [a.python, os.path.join(REPO, "trainer", "bench", "bench_reference.py"), "--model", model_dir, "--batch",
           batch, "--gate", gate] + side_args(a) + ["--json", out]
    if device:
        cmd += ["--device", device]
    rc, tail = run_side(cmd, a.row_timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if rc != 0 or not os.path.exists(out):
        return {"seq": T, "gate": gate, "error": failure("bench_reference.py", rc, tail, a.row_timeout)}, {}
    j = json.load(open(out))
    info = {k: j.get(k) for k in ("device", "date", "versions", "dtype", "gate_init")}
    return init_applied(a, "bench_reference.py", j, j["rows"][0]), info


def init_applied(a, tool, j, row):
    """The side's row, or an error row marked init_mismatch (a **FAIL**, exit 1) when its JSON does
    not report the --gate-init it was given (a tool that ignored or predates the option timed other
    gates)."""
    said = j.get("gate_init")
    try:
        same = said is not None and parse_gate_init(said) == parse_gate_init(a.gate_init)
    except ValueError:
        same = False
    if same or "error" in row:
        return row
    return {"seq": row.get("seq"), "gate": row.get("gate"), "init_mismatch": True,
            "error": f"{tool} ran gates {said!r}, not --gate-init {a.gate_init}"}


def git_commit():
    r = subprocess.run(["git", "-C", REPO, "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                       text=True)
    return r.stdout.strip() if r.returncode == 0 else None


# ---- the accumulated rows -------------------------------------------------------------------

def load_store(path, settings):
    if not os.path.exists(path):
        return {"tool": "compare_train.py", "settings": settings, "rows": []}
    store = json.load(open(path))
    if settings is not None and store.get("settings") != settings:
        sys.exit(f"compare_train.py: {path} holds rows made with other settings ({store.get('settings')}); "
                 f"these are {settings}: use another --out, or the same settings to resume")
    return store


def save_store(path, store):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(store, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def key(r):
    """A row's identity: rows made before --gate-init existed used the random init."""
    return (r["model"], r["seq"], r["gate"], r.get("gate_init", "random"))


def has_error(r):
    return "error" in r["retain"] or "error" in r["reference"]


# ---- the table and the plot -----------------------------------------------------------------

def fmt(x, spec):
    return "—" if x is None else format(x, spec)


def tolerance(a, store):
    if a.loss_tol is not None:
        return a.loss_tol
    dtypes = {r.get("reference_run", {}).get("dtype") for r in store["rows"]} - {None}
    return 1e-2 if "bfloat16" in dtypes or store["settings"].get("device") == "cuda" else 1e-5


def verdict(r, tol):
    """(relative difference, verdict) of a row's first-step losses."""
    mine, theirs = r["retain"].get("first_loss"), r["reference"].get("first_loss")
    if r["retain"].get("init_mismatch") or r["reference"].get("init_mismatch"):
        return None, "**FAIL**"
    if has_error(r) or mine is None or theirs is None:
        return None, "—"
    rel = abs(mine - theirs) / max(abs(theirs), 1e-30)
    return rel, ("ok" if rel <= tol else "**FAIL**")


def ordered(store, wanted=None):
    """Rows in (model order of first appearance, T, gate) order; wanted: keys that must appear
    (missing ones become placeholders)."""
    rows = {key(r): r for r in store["rows"]}
    for k in wanted or []:
        rows.setdefault(k, {"model": k[0], "seq": k[1], "gate": k[2], "gate_init": k[3], "missing": True})
    models = []
    for k in list(rows):
        if k[0] not in models:
            models.append(k[0])
    gates = {"trimkv": 0, "dbtrimkv": 1}
    def init_order(r):
        init = r.get("gate_init", "random")
        return (init != "random", parse_gate_init(init) or 0.0, init)

    return sorted(rows.values(), key=lambda r: (models.index(r["model"]), init_order(r), r["seq"],
                                                gates.get(r["gate"], 9), r["gate"]))


def describe_runs(store):
    rows = store["rows"]
    s = store["settings"]

    def uniq(vals):
        return ", ".join(sorted({v for v in vals if v})) or "—"

    dates = sorted(d for r in rows for d in (r.get("retain_run", {}).get("date"), r.get("reference_run", {}).get("date"))
                   if d)
    versions = uniq(f"trimkv {v.get('trimkv')}, torch {v.get('torch')}, transformers {v.get('transformers')}"
                    for v in (r.get("reference_run", {}).get("versions") for r in rows) if v)
    lines = [
        f"- retain: {uniq(r.get('retain_run', {}).get('device') for r in rows)} (commit "
        f"{uniq(r.get('commit') for r in rows)}); reference: {versions}, "
        f"{uniq(r.get('reference_run', {}).get('dtype') for r in rows)} on "
        f"{uniq(r.get('reference_run', {}).get('device') for r in rows)}.",
        f"- Dates (UTC): {dates[0] if dates else '—'} to {dates[-1] if dates else '—'}.",
        f"- G {s['gate_hidden']}, M {s['memory']:g}, {s['docs']} document(s) per sequence, median of {s['iters']} "
        f"steps after {s['warmup']} warm-up, seed {s['seed']}. Peak memory: the CUDA allocator's high-water mark "
        f"(retain: its pool; reference: torch.cuda.max_memory_allocated), or the process's peak resident set "
        f"on the CPU.",
        "- Commands:",
        "",
    ]
    for c in sorted({r.get("command") for r in rows if r.get("command")}):
        lines.append(f"  `{c}`")
    return lines


def table(store, tol, wanted=None):
    lines = describe_runs(store) + [
        "",
        f"Loss check: the first step's losses must agree within {tol:g} relative (bf16 on a GPU: 1e-2; "
        f"float32 on the CPU: 1e-5); **FAIL** marks a row where they do not. Gate init: random = each "
        f"side's own fresh gates (bias 18, N(0, 0.02) weights: logβ ≈ −1.5e-8, the gates barely touch the "
        f"loss); zero-output:B = output projection 0 and bias B on both sides (logβ = logsigmoid(B) for "
        f"every token: the same visible decay, so trimkv's and dbtrimkv's losses are equal too).",
        "",
        "| model | T | gate | gate init | retain tokens/s | reference tokens/s | ratio | retain peak GB | "
        "reference peak GB | "
        "peak ratio | retain loss@1 | reference loss@1 | rel. diff | losses agree |",
        "|:---|---:|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|",
    ]
    fails = 0
    for r in ordered(store, wanted):
        head = f"| {r['model']} | {r['seq']} | {r['gate']} | {r.get('gate_init', 'random')} |"
        if r.get("missing"):
            lines.append(head + " not run yet | | | | | | | | | |")
            continue
        me, th = r["retain"], r["reference"]

        def side(x, field, spec):
            return f"error: {x['error']}" if "error" in x else fmt(x.get(field), spec)

        ok = not has_error(r)
        ratio = fmt(me["tokens_per_s"] / th["tokens_per_s"], ".2f") + "×" if ok else "—"
        pratio = fmt(me["peak_gb"] / th["peak_gb"], ".2f") + "×" if ok and th.get("peak_gb") else "—"
        rel, v = verdict(r, tol)
        fails += v == "**FAIL**"
        mem_me = "—" if "error" in me else fmt(me.get("peak_gb"), ".3f")
        mem_th = "—" if "error" in th else fmt(th.get("peak_gb"), ".3f")
        loss_me = "—" if "error" in me else fmt(me.get("first_loss"), ".5f")
        loss_th = "—" if "error" in th else fmt(th.get("first_loss"), ".5f")
        lines.append(f"{head} {side(me, 'tokens_per_s', '.1f')} | {side(th, 'tokens_per_s', '.1f')} | {ratio} | "
                     f"{mem_me} | {mem_th} | {pratio} | {loss_me} | {loss_th} | {fmt(rel, '.2e')} | {v} |")
    return "\n".join(lines) + "\n", fails


def plot(store, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = store["rows"]
    models, inits = [], []
    for r in ordered(store):
        if r["model"] not in models:
            models.append(r["model"])
        if r.get("gate_init", "random") not in inits:
            inits.append(r.get("gate_init", "random"))
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.6 * len(models)), squeeze=False)
    for m, (ax1, ax2) in zip(models, axes):
        for side, style in (("retain", "-o"), ("reference", "--s")):
            for n, (init, gate) in enumerate((i, g) for i in inits for g in ("trimkv", "dbtrimkv")):
                ok = sorted((r for r in rows if r["model"] == m and r["gate"] == gate
                             and r.get("gate_init", "random") == init and "error" not in r[side]),
                            key=lambda r: r["seq"])
                if not ok:
                    continue
                label = f"{side} {gate}" + (f" {init}" if len(inits) > 1 else "")
                ax1.plot([r["seq"] for r in ok], [r[side]["tokens_per_s"] for r in ok], style, color=f"C{n}",
                         label=label)
                ax2.plot([r["seq"] for r in ok], [r[side]["peak_gb"] for r in ok], style, color=f"C{n}",
                         label=label)
        for ax, ylabel in ((ax1, "tokens/s"), (ax2, "peak memory (GB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("T (tokens)")
            ax.set_ylabel(ylabel)
            ax.set_title(m, fontsize=9)
            ax.grid(True, alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
    devices = sorted({r.get("retain_run", {}).get("device") for r in rows} - {None})
    dates = sorted(r.get("retain_run", {}).get("date", "") for r in rows if r.get("retain_run", {}).get("date"))
    fig.suptitle(f"training step: retain vs trimkv 0.1.5 on {', '.join(devices) or '?'}"
                 f"{', ' + dates[-1][:10] if dates else ''} (error rows, e.g. out of memory, have no point)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_docs(path, section, png):
    text = open(path).read()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        sys.exit(f"compare_train.py: {path} needs one {BEGIN} … {END} pair to write into")
    image = os.path.join(os.path.dirname(os.path.abspath(path)), DOCS_IMAGE)
    os.makedirs(os.path.dirname(image), exist_ok=True)
    shutil.copyfile(png, image)
    block = f"{BEGIN}\n{section}\n![tokens/s and peak memory against T, retain and the reference]({DOCS_IMAGE})\n{END}"
    text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return image


# ---- main -----------------------------------------------------------------------------------

def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="one model directory (its rows are labelled with --label)")
    src.add_argument("--shapes", help="comma-separated shape names: 0.6B, 1.7B, 4B or --define-shape names")
    ap.add_argument("--label", help="the model's name in the table with --model (default: the folder's name)")
    ap.add_argument("--define-shape", action="append", default=[], metavar="NAME=FLAGS",
                    help="a shape for --shapes: NAME and its retain-make-tiny flags")
    ap.add_argument("--keep-models", metavar="DIR", help="make the --shapes models in DIR/NAME, keep and reuse them")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--seq", default=None,
                    help="T, comma-separated (default: 8192,32768,131072 with --shapes or on cuda, else 128,256)")
    ap.add_argument("--gate", default="trimkv,dbtrimkv")
    ap.add_argument("--gate-hidden", type=int, default=512)
    ap.add_argument("--memory", type=float, default=128)
    ap.add_argument("--docs", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--gate-init", default="random",
                    help="random (each side's fresh gates, bias 18) or zero-output:B (both sides: output weights 0, "
                         "bias B: logβ = logsigmoid(B) everywhere); part of each row's identity")
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "build", "bin"))
    ap.add_argument("--python", default=os.environ.get("RETAIN_TRIMKV_PYTHON", os.path.expanduser(
        "~/.cache/retain/venvs/trimkv/bin/python")), help="a Python with trimkv 0.1.5 (default: "
                    "$RETAIN_TRIMKV_PYTHON, else ~/.cache/retain/venvs/trimkv/bin/python)")
    ap.add_argument("--out", default=os.path.join(REPO, "build", "compare-train"))
    ap.add_argument("--retry-errors", action="store_true", help="run the rows held as errors again")
    ap.add_argument("--row-timeout", type=float, default=None, metavar="S",
                    help="end a side that runs longer than S seconds (an error row)")
    ap.add_argument("--time-budget", type=float, default=None, metavar="S",
                    help="start no row after S seconds (exit 75 while rows remain: run again to go on)")
    ap.add_argument("--loss-tol", type=float, default=None,
                    help="relative tolerance of the first-step losses (default: 1e-2 bf16/GPU, 1e-5 CPU)")
    ap.add_argument("--table-only", action="store_true", help="render OUT/compare.json; run nothing")
    ap.add_argument("--write-docs", action="store_true", help="replace the marked section of --docs-file")
    ap.add_argument("--docs-file", default=os.path.join(REPO, "docs", "benchmarks.md"))
    a = ap.parse_args()
    defined = {}
    for d in a.define_shape:
        name, sep, flags = d.partition("=")
        if not sep or not name or "," in name:
            ap.error(f"--define-shape {d!r}: expected NAME=FLAGS")
        defined[name] = flags
    a.shape_flags = {}
    if a.shapes:
        for name in a.shapes.split(","):
            if name in defined:
                a.shape_flags[name] = (name, defined[name])
            elif name in SHAPES:
                a.shape_flags[name] = (f"Qwen3-{name}", f"{SHAPES[name]} {SHAPE_COMMON}")
            else:
                ap.error(f"--shapes: unknown shape '{name}' (known: {', '.join(list(SHAPES) + list(defined))})")
    elif not a.model and not a.table_only:
        ap.error("give --model DIR or --shapes (or --table-only)")
    seq = a.seq or ("8192,32768,131072" if a.shapes or a.device == "cuda" else "128,256")
    try:
        a.seq_list = [int(x) for x in seq.split(",")]
    except ValueError:
        ap.error(f"--seq: {seq!r} is not a comma-separated list of integers")
    try:
        a.gate_init = gate_init_name(parse_gate_init(a.gate_init))
    except ValueError as e:
        ap.error(str(e))
    a.gates = a.gate.split(",")
    for g in a.gates:
        if g not in ("trimkv", "dbtrimkv"):
            ap.error(f"--gate: '{g}' is not trimkv or dbtrimkv")
    return a


def main():
    a = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks (temporary models)
    os.makedirs(a.out, exist_ok=True)
    store_path = os.path.join(a.out, "compare.json")
    settings = {k: getattr(a, k) for k in SETTINGS}
    store = load_store(store_path, None if a.table_only else settings)
    if a.table_only and not store["rows"]:
        sys.exit(f"compare_train.py: --table-only: no rows in {store_path}")
    command = "python3 trainer/bench/compare_train.py " + " ".join(
        shlex.quote(x) for x in sys.argv[1:] if x not in ("--write-docs", "--table-only", "--retry-errors"))

    # The models, in order: (label, directory or None, make-tiny flags or None).
    if a.table_only:
        models = []
    elif a.model:
        models = [(a.label or os.path.basename(os.path.normpath(a.model)), a.model, None)]
    else:
        models = [(label, None, flags) for label, flags in a.shape_flags.values()]
    wanted = [(m[0], T, g, a.gate_init) for m in models for T in a.seq_list for g in a.gates]
    done = {key(r): r for r in store["rows"]}

    to_run = [k for k in wanted if k not in done or (a.retry_errors and has_error(done[k]))]

    def pending(label):
        return [(T, g) for (m, T, g, _) in to_run if m == label]

    start = time.monotonic()
    skipped = len(wanted) - len(to_run)
    if skipped:
        log(f"compare_train.py: {skipped} row(s) already in {store_path}: skipped")
    out_of_time = False
    commit = git_commit()
    def over_budget():
        return a.time_budget is not None and time.monotonic() - start > a.time_budget

    for label, model_dir, flags in models:
        todo = pending(label)
        if not todo or out_of_time:
            continue
        if over_budget():
            out_of_time = True
            continue
        made = None
        try:
            if model_dir is None:  # a shape: make it
                if a.keep_models:
                    model_dir = os.path.join(os.path.abspath(a.keep_models), label)
                    os.makedirs(a.keep_models, exist_ok=True)
                else:
                    made = tempfile.mkdtemp(prefix=f"retain-{label}-")
                    model_dir = os.path.join(made, label)
                if not os.path.isdir(model_dir):  # made under another name, renamed when complete
                    partial = model_dir + ".partial"
                    shutil.rmtree(partial, ignore_errors=True)
                    # --max-gib: the tool's size guard (1 GiB) is for typos; Qwen3-4B is 7.5 GiB.
                    rc, tail = run_side([os.path.join(a.bin_dir, "retain-make-tiny"), "--out", partial, "--max-gib", "16"]
                                        + shlex.split(flags), None)
                    if rc != 0:
                        sys.exit(f"compare_train.py: retain-make-tiny for {label} failed: "
                                 f"{tail[-1] if tail else rc}")
                    os.rename(partial, model_dir)
            for T, g in todo:
                if over_budget():
                    out_of_time = True
                    break
                log(f"compare_train.py: {label} T={T} {g} --gate-init {a.gate_init}")
                with tempfile.TemporaryDirectory(prefix="retain-compare-") as tmp:
                    batch = os.path.join(tmp, "batch.json")
                    mine, mine_run = run_retain(a, model_dir, T, g, batch, tmp)
                    ref_device = a.device or ({"cpu": "cpu"}.get(mine_run.get("device"), "cuda")
                                              if mine_run else None)
                    theirs, theirs_run = run_reference(a, model_dir, T, g, batch, ref_device, tmp)
                row = {"model": label, "seq": T, "gate": g, "gate_init": a.gate_init, "retain": mine,
                       "reference": theirs,
                       "retain_run": mine_run, "reference_run": theirs_run, "commit": commit,
                       "command": command, "make_tiny": flags}
                store["rows"] = [r for r in store["rows"] if key(r) != key(row)] + [row]
                save_store(store_path, store)
                done[key(row)] = row
        finally:
            if made:
                shutil.rmtree(made, ignore_errors=True)

    tol = tolerance(a, store)
    md, fails = table(store, tol, wanted)
    png = os.path.join(a.out, "compare.png")
    md_path = os.path.join(a.out, "compare.md")
    with open(md_path, "w") as f:
        f.write(md)
        if store["rows"]:
            plot(store, png)
            f.write(f"\n![tokens/s and peak memory against T]({os.path.basename(png)})\n")
    print(md)
    print(f"wrote {md_path}{', ' + png if store['rows'] else ''} and {store_path}")
    if a.write_docs and not store["rows"]:
        print(f"compare_train.py: no rows yet: {a.docs_file} left as it is", file=sys.stderr)
    elif a.write_docs:
        image = write_docs(a.docs_file, md, png)
        print(f"replaced the train-vs-reference section of {a.docs_file}; the plot is {image}")
    remaining = [k for k in wanted if k not in done]
    if fails:
        print(f"compare_train.py: the first-step losses disagree beyond {tol:g}, or a side ran other gates than "
              f"--gate-init, in {fails} row(s) (FAIL above)",
              file=sys.stderr)
        return 1
    if remaining:
        print(f"compare_train.py: --time-budget reached with {len(remaining)} row(s) to run: run the same command "
              f"again to go on", file=sys.stderr)
        return INCOMPLETE
    return 0


if __name__ == "__main__":
    sys.exit(main())
