#!/usr/bin/env python3
"""kernels/bench/bench_attention.py on the CPU (issue 11's peer benchmark), tiny shapes:

1. --check: the FlexAttention row (trimkv 0.1.5's call: score_mod, kernel_options={}, GQA)
   matches float64 attention in its output and its gradients dq, dk, dv and dlogβ (≤ 1e-5).
2. A run with --retain-bench: the flex rows say how FlexAttention was compiled (dynamic=True
   asked by default), every SDPA row names the backend it was pinned to, and the JSON holds
   the retain/flex and retain/sdpa ratios per backend (retain_over_sdpa_cudnn is the issue's
   target on a GPU; on the CPU there is no cuDNN row, so it is null).
3. --no-flex-dynamic compiles FlexAttention with dynamic=False.

Skipped (exit 77) without torch. About 30 s.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from live_common import Checks, import_or_skip, tools_present  # noqa: E402

SCRIPT = os.path.join(REPO, "kernels", "bench", "bench_attention.py")
SHAPE = ["--device", "cpu", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--iters", "1", "--warmup", "0"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin-dir", default=os.path.join(REPO, "build", "bin"))
    a = p.parse_args()
    import_or_skip("bench_attention_check", ["torch"])
    if not tools_present("bench_attention_check", a.bin_dir, ["retain-bench"]):
        return 1
    check = Checks()

    with tempfile.TemporaryDirectory(prefix="retain-bench-attn-") as tmp:
        out = os.path.join(tmp, "peers.json")
        cmd = [sys.executable, SCRIPT, "--seq", "128,256", "--check", "--retain-bench",
               os.path.join(a.bin_dir, "retain-bench"), "--json", out] + SHAPE
        r = subprocess.run(cmd, capture_output=True, text=True)
        print(r.stdout)
        if r.returncode != 0 or not os.path.exists(out):
            print(f"bench_attention_check: FAIL: bench_attention.py exited {r.returncode}: {r.stderr.strip()[-2000:]}")
            return 1
        errs = dict(re.findall(r"check: flex (\S+) vs dense float64 reference: rel\. error (\S+)", r.stdout))
        check(sorted(errs) == sorted(["out", "dq", "dk", "dv", "dlogβ"])
              and all(float(e) <= 1e-5 for e in errs.values()),
              f"--check: flex output and gradients within 1e-5 of float64 ({errs})")
        j = json.load(open(out))
        flex = [x for x in j["rows"] if x["impl"] == "flex" and x["op"] == "gated fwd"]
        check(len(flex) == 2 and all(x["ms"] and "torch.compile dynamic=" in x["note"] for x in flex)
              and j["args"]["flex_dynamic"] is True and "dynamic=True" in j["flex"],
              f"flex rows timed, dynamic=True asked, each row says how it was compiled ({flex[0]['note']!r})")
        sdpa = [x for x in j["rows"] if x["impl"] == "sdpa"]
        check(len(sdpa) == 6 and all(x.get("backend") in ("flash", "math") and x["ms"] for x in sdpa),
              f"6 SDPA rows, each pinned to one backend ({sorted({x.get('backend') for x in sdpa})})")
        check(re.search(r"^\s+256\s+sdpa/(flash|math)\s+dense fwd\+bwd", r.stdout, re.M) is not None,
              "the table names the SDPA backend")
        ratios = j.get("ratios", [])
        check(len(ratios) == 6 and all(x["retain_over_sdpa_cudnn"] is None and x["retain_over_sdpa"]
                                       and all(v > 0 for v in x["retain_over_sdpa"].values()) for x in ratios)
              and all(x["retain_over_flex"] > 0 for x in ratios if x["op"] == "gated fwd"),
              "ratios retain/flex (forward: the CPU has no flex backward) and retain/sdpa per backend in the JSON")

        r = subprocess.run([sys.executable, SCRIPT, "--seq", "128", "--no-flex-dynamic", "--json", out] + SHAPE,
                           capture_output=True, text=True)
        j = json.load(open(out)) if r.returncode == 0 else {"rows": []}
        flex = [x for x in j["rows"] if x["impl"] == "flex" and x["op"] == "gated fwd"]
        check(r.returncode == 0 and len(flex) == 1 and flex[0]["note"] == "torch.compile dynamic=False",
              f"--no-flex-dynamic: dynamic=False ({flex[0]['note'] if flex else r.stderr.strip()[-300:]!r})")
    return check.verdict("bench_attention_check")


if __name__ == "__main__":
    sys.exit(main())
