#!/usr/bin/env python3
"""The training-step comparison's reference side on the CPU (trainer/bench/, issue 14).

1. The authors' gated attention (trimkv's `retention_gated_attention_forward`, the
   FlexAttention score_mod (t − i)·logβ_i) run the way bench_reference.py runs it on the CPU —
   PyTorch's eager FlexAttention with its CPU device check lifted — gives the forward and the
   gradients into q, k, v and logβ of plain attention in float64, on packed documents with GQA (groups of 1, 2, 3 and 4).
2. compare_train.py on two tiny --define-shape models made by retain-make-tiny (GQA 2 with its
   own lm_head; GQA 4, tied, YaRN x4), T 64 with both gate kinds, M 24 so that the capacity
   term is active: retain's first-step loss and the authors' agree within 1e-5 relative, row
   by row. Also: --time-budget 0 runs nothing and exits 75; T 262144 (beyond the models'
   positions) makes retain-bench fail, recorded as error rows; a second call with both shapes
   skips the first shape's rows (resume) and adds the other's; --loss-tol 1e-12 shows **FAIL**
   and exits 1; --write-docs on a copy of docs/benchmarks.md replaces only the marked section
   and copies the plot; the Qwen3 shape flags equal launch/gpu-verify.sh's.
3. --gate-init zero-output:2 (both sides: the gates' output projection 0, bias 2, so logβ =
   logsigmoid(2) ≈ −0.127 for every token whatever the random weights): in the same OUT, tiny-a's
   T 64 rows run again as new rows (the random-init rows are not reused, and stay as they were);
   the loss of each agrees with the reference within 1e-5 although the decay is visible (the KL
   term is > 1e-3, against ~0 at bias 18, and the loss differs from the random-init row's by
   > 1e-3 relative); trimkv's and dbtrimkv's losses are equal (the same constant logβ); the table
   shows the gate init. Then tiny-b at M 4 in another OUT, where the capacity term is active
   under that decay (the retention sum reaches ≈ 8.4 > M): the losses agree within 1e-5 too.

Part 1 runs inside the trimkv Python ($RETAIN_TRIMKV_PYTHON, default
~/.cache/retain/venvs/trimkv/bin/python); without it the check exits 77 (CTest: skipped).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from live_common import TRIMKV_PYTHON, Checks, import_or_skip, tools_present, trimkv_python_or_skip  # noqa: E402


def flex_check():
    """Part 1, in the trimkv Python: returns the worst relative error over the cases."""
    sys.path.insert(0, os.path.join(REPO, "trainer", "bench"))
    import bench_reference

    bench_reference.stub_flash_attn()
    bench_reference.eager_flex_on_cpu()
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    from trimkv.attn import flex_attn

    worst = 0.0
    for case, (T, H, K, d, docs) in enumerate([(96, 4, 2, 16, [40, 56]), (70, 2, 2, 8, [70]),
                                               (128, 8, 2, 32, [20, 50, 58]),
                                               (50, 6, 2, 16, [25, 25])]):
        g = torch.Generator().manual_seed(100 + case)
        q = torch.randn(1, H, T, d, generator=g, dtype=torch.float64)
        k = torch.randn(1, K, T, d, generator=g, dtype=torch.float64)
        v = torch.randn(1, K, T, d, generator=g, dtype=torch.float64)
        lb = -torch.rand(1, K, T, generator=g, dtype=torch.float64) * 0.3  # logβ in [−0.3, 0]
        dout = torch.randn(1, T, H, d, generator=g, dtype=torch.float64)
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(docs)])
        scale = d ** -0.5

        def mask_mod(b, h, qi, ki):
            return (qi >= ki) & (doc[qi] == doc[ki])

        block_mask = create_block_mask(mask_mod, 1, None, T, T, device="cpu")
        leaves = [x.float().requires_grad_() for x in (q, k, v, lb)]
        out, _, _ = flex_attn.retention_gated_attention_forward(
            None, leaves[0], leaves[1], leaves[2], block_mask, leaves[3], scaling=scale)
        (out.double() * dout).sum().backward()

        ref_leaves = [x.clone().requires_grad_() for x in (q, k, v, lb)]
        rq, rk, rv, rlb = ref_leaves
        grp = H // K
        t = torch.arange(T)
        kk, vv, ll = (x.repeat_interleave(grp, dim=1) for x in (rk, rv, rlb))
        s = (rq @ kk.transpose(-1, -2)) * scale + (t[:, None] - t[None, :]).double() * ll[:, :, None, :]
        allowed = (t[:, None] >= t[None, :]) & (doc[:, None] == doc[None, :])
        s = s.masked_fill(~allowed, float("-inf"))
        ref = (torch.softmax(s, -1) @ vv).transpose(1, 2)
        (ref * dout).sum().backward()

        pairs = [("out", out.detach().double(), ref.detach())] + [
            (n, a.grad.double(), b.grad) for n, a, b in zip(("dq", "dk", "dv", "dlogβ"), leaves, ref_leaves)]
        for name, got, want in pairs:
            rel = float((got - want).norm() / want.norm())
            worst = max(worst, rel)
            print(f"  case {case} (T {T}, H {H}, K {K}, d {d}, docs {docs}): {name} relative error {rel:.2e}")
    return worst


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin-dir", default=os.path.join(REPO, "build", "bin"))
    p.add_argument("--trimkv-python", default=TRIMKV_PYTHON)
    p.add_argument("--flex-only", action="store_true", help=argparse.SUPPRESS)  # part 1, in the trimkv Python
    a = p.parse_args()

    if a.flex_only:
        worst = flex_check()
        print(f"flex worst {worst:.3e}")
        return 0 if worst < 1e-5 else 1

    trimkv_python_or_skip("train_reference_check", a.trimkv_python, ["torch", "transformers", "matplotlib"])
    import_or_skip("train_reference_check", ["matplotlib"])  # compare_train.py's plot, in this Python
    if not tools_present("train_reference_check", a.bin_dir, ["retain-bench", "retain-make-tiny"]):
        return 1

    print("part 1: trimkv's retention_gated_attention_forward on eager CPU FlexAttention vs float64", flush=True)
    r = subprocess.run([a.trimkv_python, os.path.abspath(__file__), "--flex-only"], capture_output=True, text=True)
    sys.stdout.write(r.stdout)
    if r.returncode != 0:
        print(f"train_reference_check: FAIL: part 1 exited {r.returncode}: {r.stderr.strip()[-2000:]}")
        return 1

    print("part 2: compare_train.py: first-step losses of retain and trimkv, resume, error rows, docs markers",
          flush=True)
    return compare_train_check(a).verdict("train_reference_check")


# Two tiny shapes for compare_train.py's --shapes: GQA 2 with separate lm_head; GQA 4, tied, YaRN x4.
TINY = {"tiny-a": "--layers 2 --hidden 32 --heads 4 --kv-heads 2 --head-dim 16 --intermediate 48 --vocab 300 "
                  "--no-tie --seed 3",
        "tiny-b": "--layers 2 --hidden 32 --heads 4 --kv-heads 1 --head-dim 16 --intermediate 48 --vocab 300 "
                  "--tie --yarn-factor 4 --seed 4"}
TOO_LONG = 262144  # > the models' max_position_embeddings (131072): retain-bench refuses it, an error row


def check_visible(check, vis, random_rows, what, capacity=False):
    """Part 3's rows (key -> row, --gate-init zero-output:2): both sides report that init, the
    losses agree within 1e-5, the KL shows the decay, trimkv's and dbtrimkv's losses are equal,
    and (with random_rows) the loss moved away from the random-init row's."""
    for k in sorted(vis):
        x = vis[k]
        mine, theirs = x["retain"], x["reference"]
        if "error" in mine or "error" in theirs:
            check(False, f"{k} zero-output:2: {mine.get('error') or theirs.get('error')}")
            continue
        inits = (x.get("retain_run", {}).get("gate_init"), x.get("reference_run", {}).get("gate_init"))
        rel = abs(mine["first_loss"] - theirs["first_loss"]) / abs(theirs["first_loss"])
        moved = ""
        ok = inits == ("zero-output:2", "zero-output:2") and rel < 1e-5 and mine["first_kl"] > 1e-3
        if random_rows is not None:
            base = random_rows[k]["retain"]["first_loss"]
            shift = abs(mine["first_loss"] - base) / abs(base)
            ok = ok and shift > 1e-3
            moved = f", {shift:.1e} from the random-init loss {base:.7f}"
        if capacity:
            ok = ok and mine["first_cap"] > 1e-3 and theirs["first_cap"] > 1e-3
        check(ok, f"{k[0]} T {k[1]} {k[2]} zero-output:2 ({what}): inits {inits}, loss retain {mine['first_loss']:.7f} "
                  f"trimkv {theirs['first_loss']:.7f} (relative {rel:.1e}{moved}), KL {mine['first_kl']:.4f}, "
                  f"capacity {mine['first_cap']:.5f} / {theirs['first_cap']:.5f}")
    losses = {k[2]: v["retain"].get("first_loss") for k, v in vis.items()}
    ref = {k[2]: v["reference"].get("first_loss") for k, v in vis.items()}
    same = None not in (losses.get("trimkv"), losses.get("dbtrimkv"), ref.get("trimkv"), ref.get("dbtrimkv"))
    check(same and abs(losses["trimkv"] - losses["dbtrimkv"]) <= 1e-6 * abs(losses["trimkv"])
          and abs(ref["trimkv"] - ref["dbtrimkv"]) <= 1e-6 * abs(ref["trimkv"]),
          f"zero-output:2 ({what}): trimkv's and dbtrimkv's losses are equal on each side (the same logβ): "
          f"retain {losses}, trimkv {ref}")


def compare_train_check(a):
    """Part 2: compare_train.py on the tiny shapes. Returns its Checks."""
    import re
    import shutil

    check = Checks()

    script = os.path.join(REPO, "trainer", "bench", "compare_train.py")
    docs = os.path.join(REPO, "docs", "benchmarks.md")
    with tempfile.TemporaryDirectory(prefix="retain-train-ref-") as tmp:
        out = os.path.join(tmp, "out")
        base = [sys.executable, script, "--device", "cpu", "--seq", f"64,{TOO_LONG}", "--gate-hidden", "16",
                "--memory", "24", "--docs", "2", "--iters", "1", "--warmup", "0", "--bin-dir", a.bin_dir,
                "--python", a.trimkv_python, "--out", out] + [f"--define-shape={k}={v}" for k, v in TINY.items()]

        def run(extra, what, expect=(0, 1, 75)):
            r = subprocess.run(base + extra, capture_output=True, text=True)
            print(f"  compare_train.py {' '.join(extra)}: exit {r.returncode}", flush=True)
            if r.returncode not in expect:
                print(f"train_reference_check: compare_train.py ({what}) exited {r.returncode}: "
                      f"{r.stderr.strip()[-2000:]}")
            return r

        def rows(where=None, init="random"):
            path = os.path.join(where or out, "compare.json")
            return {(x["model"], x["seq"], x["gate"]): x for x in json.load(open(path))["rows"]
                    if x.get("gate_init", "random") == init} if os.path.exists(path) else {}

        # A time budget already spent: no row runs, exit 75 (rows remain).
        r = run(["--shapes", "tiny-a", "--time-budget", "0"], "budget")
        check(r.returncode == 75 and not rows(), "--time-budget 0: exit 75 and no row run")

        # One shape: two rows at T 64 and two error rows at T 262144.
        r = run(["--shapes", "tiny-a"], "tiny-a")
        first = rows()
        check(r.returncode == 0 and len(first) == 4, f"tiny-a: exit 0, 4 rows ({len(first)})")
        for g in ("trimkv", "dbtrimkv"):
            e = first.get(("tiny-a", TOO_LONG, g), {})
            check("max_position_embeddings" in e.get("retain", {}).get("error", "")
                  and e.get("reference", {}).get("error", "").startswith("not run"),
                  f"tiny-a T {TOO_LONG} {g}: an error row ({e.get('retain', {}).get('error')!r})")
        check(len(re.findall(r"error: [^|]*max_position_embeddings",
                             open(os.path.join(out, "compare.md")).read())) == 2,
              "compare.md shows the two error rows")

        # Resume: the tiny-a rows are skipped (unchanged), tiny-b's run.
        r = run(["--shapes", "tiny-a,tiny-b"], "resume")
        second = rows()
        check(r.returncode == 0 and "4 row(s) already in" in r.stderr and len(second) == 8
              and all(second[k] == v for k, v in first.items()),
              f"resume: tiny-a's 4 rows skipped and unchanged, tiny-b's 4 added ({len(second)} rows)")

        for k in sorted(k for k in second if k[1] == 64):
            x = second[k]
            mine, theirs = x["retain"], x["reference"]
            if "error" in mine or "error" in theirs:
                check(False, f"{k}: {mine.get('error') or theirs.get('error')}")
                continue
            rel = abs(mine["first_loss"] - theirs["first_loss"]) / abs(theirs["first_loss"])
            check(rel < 1e-5 and mine["first_cap"] > 0 and theirs["first_cap"] > 0,
                  f"{k[0]} T {k[1]} {k[2]}: loss retain {mine['first_loss']:.7f} trimkv {theirs['first_loss']:.7f} "
                  f"(relative {rel:.1e}), capacity {mine['first_cap']:.5f} / {theirs['first_cap']:.5f}")
        md = open(os.path.join(out, "compare.md")).read()
        check(md.count("| ok |") == 4 and "| **FAIL** |" not in md,
              "compare.md: 4 rows whose losses agree (ok), no FAIL")

        # A tolerance no row meets: FAIL in the table, exit 1.
        r = run(["--table-only", "--loss-tol", "1e-12"], "tolerance")
        md = open(os.path.join(out, "compare.md")).read()
        check(r.returncode == 1 and md.count("| **FAIL** |") == 4, "--loss-tol 1e-12: 4 rows FAIL, exit 1")

        # --write-docs on a copy of docs/benchmarks.md: only the marked section changes.
        copy = os.path.join(tmp, "docs", "benchmarks.md")
        os.makedirs(os.path.dirname(copy))
        shutil.copyfile(docs, copy)
        begin, end = "<!-- train-vs-reference:begin -->", "<!-- train-vs-reference:end -->"
        before = open(copy).read()
        r = run(["--table-only", "--write-docs", "--docs-file", copy], "docs")
        after = open(copy).read()
        ok = r.returncode == 0 and before.count(begin) == 1 and after.count(begin) == 1 and after.count(end) == 1
        if ok:
            outside = (before[:before.index(begin)], before[before.index(end):])
            inside = after[after.index(begin):after.index(end)]
            ok = (after[:after.index(begin)], after[after.index(end):]) == outside and \
                "| tiny-b | 64 | dbtrimkv | random |" in inside and "(images/train-vs-reference.png)" in inside and \
                os.path.getsize(os.path.join(tmp, "docs", "images", "train-vs-reference.png")) > 0
        r2 = run(["--table-only", "--write-docs", "--docs-file", copy], "docs again")
        check(ok and r2.returncode == 0 and open(copy).read() == after,
              "--write-docs replaces only the marked section of a copy of docs/benchmarks.md (twice: same text), "
              "links the plot and copies it to images/train-vs-reference.png")

        # Part 3: the visible-gate init. Same OUT: new rows, the random-init ones untouched.
        before_rows = rows()
        r = run(["--shapes", "tiny-a", "--seq", "64", "--gate-init", "zero-output:2"], "zero-output")
        vis = rows(init="zero-output:2")
        check(r.returncode == 0 and "already in" not in r.stderr and len(vis) == 2 and rows() == before_rows,
              f"--gate-init zero-output:2 in the same OUT: 2 new rows ({len(vis)}), none reused, the 8 random-init "
              f"rows unchanged")
        check_visible(check, vis, second, "M 24")
        md = open(os.path.join(out, "compare.md")).read()
        check(md.count("| zero-output:2 |") == 2 and md.count("| random |") == 8,
              "compare.md shows the gate init of every row (2 zero-output:2, 8 random)")

        # The capacity term under the visible decay: tiny-b at M 4 (retention sums up to ≈ 8.4).
        out4 = os.path.join(tmp, "out-m4")
        r = run(["--shapes", "tiny-b", "--seq", "64", "--memory", "4", "--gate-init", "zero-output:2", "--out", out4],
                "zero-output M 4")
        vis4 = rows(out4, "zero-output:2")
        check(r.returncode == 0 and len(vis4) == 2, f"--gate-init zero-output:2 --memory 4: 2 rows ({len(vis4)})")
        check_visible(check, vis4, None, "M 4", capacity=True)

        # A bad value is a usage error before anything runs.
        r = run(["--shapes", "tiny-a", "--gate-init", "zero-output:inf"], "bad init", expect=(2,))
        check(r.returncode == 2 and "zero-output:B" in r.stderr, "--gate-init zero-output:inf: usage error (exit 2)")

    # The Qwen3 shapes: compare_train.py's table and launch/gpu-verify.sh's train phase agree.
    sys.path.insert(0, os.path.join(REPO, "trainer", "bench"))
    import compare_train

    verify = open(os.path.join(REPO, "launch", "gpu-verify.sh")).read()
    theirs = dict(re.findall(r'^\s*([0-9.]+B)\) shape=["(]([^")]+)[")]', verify, re.M))
    if theirs:
        check(theirs == compare_train.SHAPES and compare_train.SHAPE_COMMON in " ".join(verify.split()),
              "the Qwen3 shapes of compare_train.py equal launch/gpu-verify.sh's")
    else:
        print("  (launch/gpu-verify.sh has no shape table of its own)")
    return check



if __name__ == "__main__":
    sys.exit(main())
