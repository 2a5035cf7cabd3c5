#!/usr/bin/env python3
"""bench_reference.py survives a failed row and frees it (trainer/bench/, issue 14).

On the committed tiny model, T 64 with both gate kinds, on the CPU: the test hook
BENCH_REFERENCE_FAIL_PHASE=student_forward makes row 0 (trimkv) raise torch.OutOfMemoryError
after its student forward, when the teacher logits, the student's output, the model and the
optimizer all exist. Checks:
  - the script exits 0 and writes both rows to its JSON;
  - row 0 is an error row: "out of memory, student forward: ...", no timings;
  - row 1 (dbtrimkv) succeeds: tokens/s, peak memory and a finite first-step loss;
  - nothing of either row is left: the tensor bytes still reachable after a row's cleanup
    (BENCH_REFERENCE_REPORT_ALIVE=1) exceed those before the first row by less than half the
    smaller of one row's teacher logits (T · vocab · 4 bytes) and the model's weights.

Runs inside the trimkv Python ($RETAIN_TRIMKV_PYTHON, default
~/.cache/retain/venvs/trimkv/bin/python; how to make it: bench_reference.py's docstring);
without it the check exits 77 (CTest: skipped). About 15 s.
"""
import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from live_common import TRIMKV_PYTHON, Checks, trimkv_python_or_skip  # noqa: E402

MODEL = os.path.join(REPO, "tests", "fixtures", "trainer", "model")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trimkv-python", default=TRIMKV_PYTHON)
    a = p.parse_args()
    trimkv_python_or_skip("bench_reference_check", a.trimkv_python, ["torch", "transformers"])

    cfg = json.load(open(os.path.join(MODEL, "config.json")))
    vocab, T = cfg["vocab_size"], 64
    weights_mb = os.path.getsize(os.path.join(MODEL, "model.safetensors")) * 2 / 1e6  # bf16 file, float32 model
    logits_mb = T * vocab * 4 / 1e6
    rng = random.Random(7)
    batch = {"batches": [{"seq": T, "ids": [rng.randrange(vocab) for _ in range(T)],
                          "doc": [0] * (T // 2) + [1] * (T // 2)}]}
    with tempfile.TemporaryDirectory(prefix="retain-bench-ref-") as tmp:
        batch_path, out = os.path.join(tmp, "batch.json"), os.path.join(tmp, "reference.json")
        with open(batch_path, "w") as f:
            json.dump(batch, f)
        env = dict(os.environ, BENCH_REFERENCE_FAIL_PHASE="student_forward", BENCH_REFERENCE_FAIL_ROW="0",
                   BENCH_REFERENCE_REPORT_ALIVE="1", HF_HUB_OFFLINE="1")
        cmd = [a.trimkv_python, os.path.join(REPO, "trainer", "bench", "bench_reference.py"), "--model", MODEL,
               "--batch", batch_path, "--device", "cpu", "--gate", "trimkv,dbtrimkv", "--gate-hidden", "16",
               "--memory", "24", "--iters", "1", "--warmup", "0", "--json", out]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        print("\n".join(line for line in r.stdout.splitlines() if line.strip()))
        if r.returncode != 0 or not os.path.exists(out):
            print(f"bench_reference_check: FAIL: bench_reference.py exited {r.returncode}: {r.stderr.strip()[-2000:]}")
            return 1
        result = json.load(open(out))
        rows = result["rows"]

    check = Checks()

    check(len(rows) == 2, f"two rows written ({len(rows)})")
    if len(rows) != 2:
        return 1
    failed, nxt = rows
    check(failed.get("gate") == "trimkv" and failed.get("error", "").startswith("out of memory, student forward:")
          and "tokens_per_s" not in failed, f"row 0 is an error row: {failed.get('error')!r}")
    loss = nxt.get("first_loss")
    check(nxt.get("gate") == "dbtrimkv" and "error" not in nxt and nxt.get("tokens_per_s", 0) > 0
          and isinstance(loss, float) and math.isfinite(loss) and nxt.get("peak_gb", 0) > 0,
          f"row 1 succeeds after it (loss {loss}, {nxt.get('tokens_per_s', 0):.1f} tokens/s, error "
          f"{nxt.get('error')!r})")
    before = result.get("alive_tensor_mb_before_rows")
    limit = min(logits_mb, weights_mb) / 2
    for i, row in enumerate(rows):
        left = row.get("alive_tensor_mb")
        if left is None or before is None:
            check(False, f"row {i}: alive_tensor_mb reported (and alive_tensor_mb_before_rows)")
            continue
        check(left - before < limit, f"row {i} freed: {left:.3f} MB of tensors alive after its cleanup, {before:.3f} "
              f"MB before the first row (excess {left - before:+.3f} MB, limit {limit:.3f} MB: half of the smaller "
              f"of one row's teacher logits {logits_mb:.3f} MB and the model {weights_mb:.3f} MB)")
    return check.verdict("bench_reference_check")


if __name__ == "__main__":
    sys.exit(main())
