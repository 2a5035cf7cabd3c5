#!/usr/bin/env python3
"""PyTorch peers of `retain-bench attention` (docs/benchmarks.md, "Attention kernels").

Same shapes and the same FLOP formula as retain-bench, one run on one device:
  flex   FlexAttention (torch.compile'd) with the retention score_mod
         score + (q_idx - kv_idx) * logb[h_kv, kv_idx] and a causal + same-document block
         mask: the reference implementation's path (gradients into q, k, v and logb).
  sdpa   scaled_dot_product_attention, dense causal (no documents, no decay), cuDNN / flash
         backends on CUDA: the ceiling.
  capacity (torch)  S(t) = sum_i exp((t - i) * logb_i) and the local hinge, chunked over query
         rows with checkpointing, forward + autograd backward (for T <= --capacity-max-seq).
FLOPs: fwd = 4 * (T^2 / (2 * docs)) * H * d (FlashAttention's convention: T^2/2 causal pairs,
the diagonal counted half), bwd = 2.5 * fwd, fwd+bwd = 3.5 * fwd. SDPA ignores documents, so
its count uses docs = 1 (the work it does). With --retain-bench PATH the script also runs
`PATH attention` with the same arguments and prints retain's rows beside the peers with the
ratios retain/flex and retain/sdpa (TFLOP/s over TFLOP/s: > 1 means retain is faster).

Runs on CPU for tiny shapes (`--device cpu --seq 256 --heads 2 --kv-heads 1 --head-dim 64`);
where FlexAttention is unavailable the row says so and the run goes on.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--seq", default="8192,32768,131072", help="sequence lengths, comma-separated")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--docs", type=int, default=1, help="equal-length documents per sequence")
    p.add_argument("--layers", type=int, default=1, help="layers of the capacity run")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--capacity-max-seq", type=int, default=32768,
                   help="skip the torch capacity reference above this T (it is slow)")
    p.add_argument("--retain-bench", metavar="PATH", help="also run PATH attention and print ratios")
    p.add_argument("--json", metavar="FILE", help="write all rows as JSON")
    p.add_argument("--check", action="store_true",
                   help="first check that the flex score_mod computes retain's math (T=300, 3 documents)")
    a = p.parse_args()
    try:
        a.seq = [int(x) for x in a.seq.split(",")]
    except ValueError:
        p.error(f"--seq: {a.seq!r} is not a comma-separated list of integers")
    if any(t <= 0 or t % a.docs for t in a.seq):
        p.error("every --seq must be positive and a multiple of --docs")
    if a.heads % a.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    return a


def fwd_flops(T, H, d, docs):
    return 4.0 * (T * T / (2.0 * docs)) * H * d


class Timer:
    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device == "cuda"

    def ms(self, fn):
        torch = self.torch
        if self.cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def median(self, fn, warmup, iters):
        for _ in range(warmup):
            self.ms(fn)
        return statistics.median(self.ms(fn) for _ in range(iters))


def inputs(torch, a, T, device):
    g = torch.Generator(device="cpu").manual_seed(T)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    H, K, d = a.heads, a.kv_heads, a.head_dim
    q = torch.randn(1, H, T, d, generator=g).to(device, dt)
    k = torch.randn(1, K, T, d, generator=g).to(device, dt)
    v = torch.randn(1, K, T, d, generator=g).to(device, dt)
    dout = torch.randn(1, H, T, d, generator=g).to(device, dt)
    # logb = logsigmoid(18 + 0.5 N(0,1)): gates at their initial bias, as retain-bench.
    logb = torch.nn.functional.logsigmoid(18 + 0.5 * torch.randn(a.layers, K, T, generator=g, dtype=torch.float64))
    logb = logb.float().to(device)
    doc = (torch.arange(T) // (T // a.docs)).to(device=device, dtype=torch.int32)
    return q, k, v, dout, logb, doc


def time_fwd_bwd(timer, a, run_fwd, params, dout):
    """ms of forward, backward (retain_graph on one graph) and forward+backward."""
    torch = timer.torch

    def fwd():
        with torch.no_grad():
            run_fwd()

    out = run_fwd()

    def bwd():
        for p in params:
            p.grad = None
        out.backward(dout, retain_graph=True)

    def fwd_bwd():
        for p in params:
            p.grad = None
        run_fwd().backward(dout)

    return (timer.median(fwd, a.warmup, a.iters), timer.median(bwd, a.warmup, a.iters),
            timer.median(fwd_bwd, a.warmup, a.iters))


def bench_flex(torch, timer, a, T, device, q, k, v, dout, logb, doc):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    group = a.heads // a.kv_heads
    lb = logb[0].clone().requires_grad_(True)  # [K, T]

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx).to(torch.float32) * lb[h // group, kv_idx]

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])

    lb_const = lb.detach()

    def score_mod_const(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx).to(torch.float32) * lb_const[h // group, kv_idx]

    # _compile=True builds the mask block by block: the eager path materializes T×T booleans
    # (17 GB at 128K).
    block_mask = create_block_mask(mask_mod, None, None, T, T, device=device, _compile=(device == "cuda"))
    flex = torch.compile(flex_attention, dynamic=False)
    # Forward alone on inputs without gradients (FlexAttention on CPU has no backward).
    fwd_only = timer.median(lambda: flex(q, k, v, score_mod=score_mod_const, block_mask=block_mask, enable_gqa=True),
                            max(1, a.warmup), a.iters)  # the first call compiles
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))

    def run_fwd():
        return flex(qq, kk, vv, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)

    try:
        _, b, fb = time_fwd_bwd(timer, argparse.Namespace(warmup=max(1, a.warmup), iters=a.iters), run_fwd,
                                [qq, kk, vv, lb], dout)
    except Exception as e:  # noqa: BLE001 - e.g. no backward on this device
        return fwd_only, None, None, f"backward unavailable: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
    return fwd_only, b, fb, ""


def bench_sdpa(torch, timer, a, T, device, q, k, v, dout):
    """(fwd, bwd, fwd+bwd, note). GQA natively (enable_gqa) where the chosen backends take it,
    else with K/V expanded to H heads before timing (the expansion is then not timed)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION] if device == "cuda" else \
        [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    group = a.heads // a.kv_heads
    for gqa in (True, False):
        if gqa:
            qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        else:
            qq = q.clone().requires_grad_(True)
            kk, vv = (x.repeat_interleave(group, dim=1).requires_grad_(True) for x in (k, v))

        def run_fwd():
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=gqa)

        try:
            f, b, fb = time_fwd_bwd(timer, a, run_fwd, [qq, kk, vv], dout)
            return f, b, fb, "" if gqa else "K/V expanded to H heads (backends without GQA)"
        except RuntimeError:
            if not gqa:
                raise
    raise AssertionError("unreachable")


def capacity_loss_torch(lb, doc, memory, rows=256):
    """Σ of the local hinge max(0, (S − M)/max(p − M, 1)) over (l, κ, t) for lb [L, K, T], doc [T]:
    S[l, κ, t] = Σ_{i ≤ t, doc_i = doc_t} exp((t − i)·lb[l, κ, i]), chunked over query rows with
    checkpointing so that autograd keeps O(rows·T) memory."""
    import torch
    from torch.utils.checkpoint import checkpoint

    device, T = lb.device, lb.shape[-1]
    idx = torch.arange(T, device=device)
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=device), doc[1:] != doc[:-1]])
    run_start = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), 0).values
    pos = (idx - run_start).to(torch.float64)

    def chunk_loss(lb, t0, t1):
        t = torch.arange(t0, t1, device=device)
        i = torch.arange(0, t1, device=device)
        dist = (t[:, None] - i[None, :]).to(lb.dtype)  # [rows, keys]
        allowed = (dist >= 0) & (doc[t][:, None] == doc[i][None, :])
        terms = torch.exp(dist.clamp(min=0)[None, None] * lb[:, :, None, :t1])  # [L, K, rows, keys]
        S = torch.where(allowed, terms, torch.zeros((), device=device, dtype=lb.dtype)).sum(-1, dtype=torch.float64)
        den = torch.clamp(pos[t0:t1] - memory, min=1.0)
        return torch.relu((S - memory) / den).sum()

    return sum(checkpoint(chunk_loss, lb, t0, min(T, t0 + rows), use_reentrant=False) for t0 in range(0, T, rows))


def bench_capacity(torch, timer, a, T, device, logb, doc, memory=1024.0):
    """Torch reference timing of capacity fwd+bwd (local hinge; no padding in these inputs)."""
    lb = logb.clone().requires_grad_(True)  # [L, K, T]

    def fwd_bwd():
        lb.grad = None
        capacity_loss_torch(lb, doc, memory).backward()

    return timer.median(fwd_bwd, min(a.warmup, 1), max(1, min(a.iters, 3)))


def check_flex(torch, device, T=300, H=4, K=2, d=64, docs=3):
    """The flex row computes retain's math: its output vs a dense float64 evaluation of
    softmax(q·k·d^-1/2 + (t - i)·logb[h_kv, i]) over allowed pairs (DESIGN §4). Returns the
    relative error ‖Δ‖/‖ref‖."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    g = torch.Generator(device="cpu").manual_seed(1)
    q, k, v = (torch.randn(1, n, T, d, generator=g, dtype=torch.float64) for n in (H, K, K))
    lb = -torch.rand(K, T, generator=g, dtype=torch.float64) * 0.2
    doc = torch.arange(T) * docs // T
    t, i = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (i <= t) & (doc[:, None] == doc[None, :])
    kh = torch.arange(H) // (H // K)
    scores = (q[0] @ k[0, kh].transpose(-1, -2)) / math.sqrt(d) + (t - i) * lb[kh][:, None, :]
    ref = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1) @ v[0, kh]

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    qd, kd, vd = (x.to(device, dt) for x in (q, k, v))
    lbd, docd = lb.float().to(device), doc.to(device)
    group = H // K

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx).to(torch.float32) * lbd[h // group, kv_idx]

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (docd[q_idx] == docd[kv_idx])

    bm = create_block_mask(mask_mod, None, None, T, T, device=device)
    out = torch.compile(flex_attention, dynamic=False)(qd, kd, vd, score_mod=score_mod, block_mask=bm,
                                                       enable_gqa=True)
    got = out[0].double().cpu()
    return ((got - ref).norm() / ref.norm()).item()


def run_retain(a):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "retain.json")
        cmd = [a.retain_bench, "attention", "--device", a.device, "--seq", ",".join(map(str, a.seq)),
               "--heads", str(a.heads), "--kv-heads", str(a.kv_heads), "--head-dim", str(a.head_dim),
               "--docs", str(a.docs), "--layers", str(a.layers), "--iters", str(a.iters),
               "--warmup", str(a.warmup), "--json", path]
        print("running:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        with open(path) as f:
            return json.load(f)["rows"]


def main():
    a = parse_args()
    try:
        import torch
    except ImportError:
        print("bench_attention.py: torch is not installed", file=sys.stderr)
        return 77
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench_attention.py: error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 1
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"bench_attention.py: torch {torch.__version__} on {name}; H {a.heads} K {a.kv_heads} d {a.head_dim} "
          f"docs {a.docs}; median of {a.iters}")
    timer = Timer(torch, a.device)
    rows = []
    if a.check:
        err = check_flex(torch, a.device)
        bound = 2e-2 if a.device == "cuda" else 1e-5
        print(f"check: flex gated forward vs dense float64 reference: rel. error {err:.2e} (bound {bound:g})")
        if not err <= bound:
            print("bench_attention.py: error: the flex score_mod does not compute the gated attention",
                  file=sys.stderr)
            return 1

    def add(T, impl, op, ms, flops=None, note=""):
        row = {"seq": T, "impl": impl, "op": op, "ms": ms, "note": note}
        if flops is not None and ms is not None:
            row["tflops"] = flops / (ms * 1e-3) / 1e12
        rows.append(row)
        tf = f"{row['tflops']:.4g}" if "tflops" in row else "-"
        ms_text = f"{ms:.3f}" if ms is not None else "-"
        print(f"{T:>8}  {impl:<6} {op:<22} {ms_text:>11} {tf:>9}  {note}", flush=True)

    print(f"{'seq':>8}  {'impl':<6} {'op':<22} {'ms':>11} {'TFLOP/s':>9}")
    for T in a.seq:
        q, k, v, dout, logb, doc = inputs(torch, a, T, a.device)
        F = fwd_flops(T, a.heads, a.head_dim, a.docs)
        try:
            f, b, fb, note = bench_flex(torch, timer, a, T, a.device, q, k, v, dout, logb, doc)
            add(T, "flex", "gated fwd", f, F)
            add(T, "flex", "gated bwd", b, 2.5 * F, note)
            add(T, "flex", "gated fwd+bwd", fb, 3.5 * F, note)
        except Exception as e:  # noqa: BLE001 - report any failure of the peer and go on
            msg = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            for op in ("gated fwd", "gated bwd", "gated fwd+bwd"):
                add(T, "flex", op, None, note=msg)
        Fd = fwd_flops(T, a.heads, a.head_dim, 1)
        try:
            f, b, fb, note = bench_sdpa(torch, timer, a, T, a.device, q, k, v, dout)
            add(T, "sdpa", "dense fwd", f, Fd, note)
            add(T, "sdpa", "dense bwd", b, 2.5 * Fd, note)
            add(T, "sdpa", "dense fwd+bwd", fb, 3.5 * Fd, note)
        except Exception as e:  # noqa: BLE001
            msg = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            for op in ("dense fwd", "dense bwd", "dense fwd+bwd"):
                add(T, "sdpa", op, None, note=msg)
        if T <= a.capacity_max_seq:
            c = bench_capacity(torch, timer, a, T, a.device, logb, doc)
            add(T, "torch", f"capacity fwd+bwd (L={a.layers})", c)
        else:
            add(T, "torch", f"capacity fwd+bwd (L={a.layers})", None, note=f"skipped: T > --capacity-max-seq")
        del q, k, v, dout
        if a.device == "cuda":
            torch.cuda.empty_cache()

    if a.retain_bench:
        retain = run_retain(a)
        print("\nretain vs peers (ratio = retain TFLOP/s / peer TFLOP/s; > 1: retain faster)")
        print(f"{'seq':>8}  {'op':<14} {'retain ms':>10} {'flex ms':>10} {'sdpa ms':>10} {'retain/flex':>11} "
              f"{'retain/sdpa':>11}")
        for T in a.seq:
            for op, peer_op in (("gated fwd", "dense fwd"), ("gated bwd", "dense bwd"),
                                ("gated fwd+bwd", "dense fwd+bwd")):
                r = next((x for x in retain if x["seq"] == T and x["op"] == op), None)
                fl = next((x for x in rows if x["seq"] == T and x["impl"] == "flex" and x["op"] == op), None)
                sd = next((x for x in rows if x["seq"] == T and x["impl"] == "sdpa" and x["op"] == peer_op), None)
                rf = r["tflops"] / fl["tflops"] if r and fl and "tflops" in fl else None
                rs = r["tflops"] / sd["tflops"] if r and sd and "tflops" in sd else None

                def fmt(x, spec):
                    return format(x, spec) if x is not None else "-"
                print(f"{T:>8}  {op:<14} {fmt(r and r['ms'], '10.3f'):>10} {fmt(fl and fl['ms'], '10.3f'):>10} "
                      f"{fmt(sd and sd['ms'], '10.3f'):>10} {fmt(rf, '11.2f'):>11} {fmt(rs, '11.2f'):>11}")
            for r in retain:
                if r["seq"] == T and r["op"].startswith("capacity"):
                    share = f"  ({100 * r['share_of_gated_fwd_bwd']:.2f}% of gated fwd+bwd)" \
                        if "share_of_gated_fwd_bwd" in r else ""
                    print(f"{T:>8}  retain {r['op']}: {r['ms']:.3f} ms{share}")
        rows += [dict(x, impl="retain") for x in retain]

    if a.json:
        with open(a.json + ".tmp", "w") as f:
            json.dump({"tool": "bench_attention.py", "torch": torch.__version__, "device": name,
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(a),
                       "flops": "fwd = 4*(T^2/(2*docs))*H*d (sdpa: docs=1), bwd = 2.5*fwd, fwd+bwd = 3.5*fwd",
                       "rows": rows}, f, indent=2)
        os.replace(a.json + ".tmp", a.json)
        print("wrote", a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
