#!/usr/bin/env python3
"""The training-step comparison's reference side on the CPU (trainer/bench/, issue 14).

1. The authors' gated attention (trimkv's `retention_gated_attention_forward`, the
   FlexAttention score_mod (t − i)·logβ_i) run the way bench_reference.py runs it on the CPU —
   PyTorch's eager FlexAttention with its CPU device check lifted — gives the forward and the
   gradients into q, k, v and logβ of plain attention in float64, on packed documents with GQA (groups of 1, 2, 3 and 4).
2. compare_train.py on the committed tiny model (T 64 and 128, both gate kinds, M 24 so that
   the capacity term is active): retain's first-step loss and the authors' agree within 1e-5
   relative, row by row.

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
from live_common import SKIP, tools_present  # noqa: E402


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
    p.add_argument("--trimkv-python", default=os.environ.get(
        "RETAIN_TRIMKV_PYTHON", os.path.expanduser("~/.cache/retain/venvs/trimkv/bin/python")))
    p.add_argument("--flex-only", action="store_true", help=argparse.SUPPRESS)  # part 1, in the trimkv Python
    a = p.parse_args()

    if a.flex_only:
        worst = flex_check()
        print(f"flex worst {worst:.3e}")
        return 0 if worst < 1e-5 else 1

    if not os.access(a.trimkv_python, os.X_OK):
        print(f"train_reference_check: skipped: no trimkv Python at {a.trimkv_python} (set RETAIN_TRIMKV_PYTHON)")
        return SKIP
    probe = subprocess.run([a.trimkv_python, "-c", "import torch, transformers, matplotlib"], capture_output=True)
    if probe.returncode != 0 or subprocess.run([sys.executable, "-c", "import matplotlib"],
                                               capture_output=True).returncode != 0:
        print("train_reference_check: skipped: torch, transformers or matplotlib missing")
        return SKIP
    if not tools_present("train_reference_check", a.bin_dir, ["retain-bench"]):
        return 1

    print("part 1: trimkv's retention_gated_attention_forward on eager CPU FlexAttention vs float64", flush=True)
    r = subprocess.run([a.trimkv_python, os.path.abspath(__file__), "--flex-only"], capture_output=True, text=True)
    sys.stdout.write(r.stdout)
    if r.returncode != 0:
        print(f"train_reference_check: FAIL: part 1 exited {r.returncode}: {r.stderr.strip()[-2000:]}")
        return 1

    print("part 2: compare_train.py, first-step losses of retain and trimkv", flush=True)
    with tempfile.TemporaryDirectory(prefix="retain-train-ref-") as out:
        cmd = [sys.executable, os.path.join(REPO, "trainer", "bench", "compare_train.py"), "--model",
               os.path.join(REPO, "tests", "fixtures", "trainer", "model"), "--device", "cpu", "--seq", "64,128",
               "--gate-hidden", "16", "--memory", "24", "--docs", "2", "--iters", "1", "--warmup", "0",
               "--bin-dir", a.bin_dir, "--python", a.trimkv_python, "--out", out]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"train_reference_check: FAIL: compare_train.py exited {r.returncode}: {r.stderr.strip()[-2000:]}")
            return 1
        retain = {(x["seq"], x["gate"]): x for x in json.load(open(os.path.join(out, "retain.json")))["rows"]}
        ref = {(x["seq"], x["gate"]): x for x in json.load(open(os.path.join(out, "reference.json")))["rows"]}
    bad = 0
    for key in sorted(retain):
        mine, theirs = retain[key], ref.get(key, {"error": "missing"})
        if "error" in theirs or "first_loss" not in mine:
            print(f"  T {key[0]} {key[1]}: FAIL: {theirs.get('error', 'no retain loss')}")
            bad += 1
            continue
        rel = abs(mine["first_loss"] - theirs["first_loss"]) / abs(theirs["first_loss"])
        ok = rel < 1e-5 and mine["first_cap"] > 0 and theirs["first_cap"] > 0
        print(f"  T {key[0]} {key[1]}: loss retain {mine['first_loss']:.7f} trimkv {theirs['first_loss']:.7f} "
              f"(relative {rel:.1e}), capacity {mine['first_cap']:.5f} / {theirs['first_cap']:.5f}"
              f"{'' if ok else '  FAIL'}")
        bad += not ok
    if len(retain) != 4:
        print(f"train_reference_check: FAIL: {len(retain)} retain rows, expected 4")
        bad += 1
    print("train_reference_check: " + ("FAIL" if bad else "ok"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
