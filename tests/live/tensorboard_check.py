#!/usr/bin/env python3
"""Live check of trainer/tools/metrics_to_tensorboard.py: a short retain-train run on a tiny
model, its metrics.jsonl turned into event files (once, and with --follow while the run
writes), read back with TensorBoard's own EventAccumulator: every step's loss, KL, NTP,
capacity, lr and per-layer mean β equal the JSON values (float32). Needs tensorboard (and
torch or tensorboardX for the writer); exits 77 without them."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from live_common import import_or_skip, run_tool, tools_present

HERE = os.path.dirname(os.path.abspath(__file__))
SIDECAR = os.path.join(os.path.dirname(os.path.dirname(HERE)), "trainer", "tools", "metrics_to_tensorboard.py")


def check(run_dir, logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    assert records, "no metrics"
    for key, tag in (("loss", "loss/total"), ("kl", "loss/kl"), ("ntp", "loss/ntp"), ("cap", "loss/cap"),
                     ("lr", "optim/lr")):
        got = {e.step: e.value for e in acc.Scalars(tag)}
        for r in records:
            want = r[key]
            assert abs(got[r["step"]] - want) <= 1e-6 * max(1.0, abs(want)), (tag, r["step"], got[r["step"]], want)
    layers = len(records[0]["mean_beta"])
    for layer in range(layers):
        got = {e.step: e.value for e in acc.Scalars(f"retention/mean_beta/layer_{layer}")}
        assert len(got) == len(records)
    return len(records)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--bin-dir", required=True)
    a = p.parse_args()
    import_or_skip("tensorboard_check", ["tensorboard"])
    try:
        import torch.utils.tensorboard  # noqa: F401
    except Exception:  # noqa: BLE001
        import_or_skip("tensorboard_check", ["tensorboardX"])
    if not tools_present("tensorboard_check", a.bin_dir, ["retain-make-tiny", "retain-pack", "retain-train"]):
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        model, data, run = (os.path.join(tmp, x) for x in ("m", "d.h5", "run"))
        run_tool([os.path.join(a.bin_dir, "retain-make-tiny"), "--out", model])
        corpus = os.path.join(tmp, "c.jsonl")
        with open(corpus, "w") as f:
            for i in range(40):
                f.write(json.dumps({"text": f"document {i}: " + "retention gates keep tokens " * (i % 7 + 3)}) + "\n")
        run_tool([os.path.join(a.bin_dir, "retain-pack"), "--tokenizer", model, "--input", corpus, "--out", data,
                  "--seq-len", "64", "-q"])
        # --follow from before the run starts, while it writes.
        follower = subprocess.Popen([sys.executable, SIDECAR, run, "--follow", "--poll", "0.2",
                                     "--logdir", os.path.join(tmp, "tb-follow")], stdout=subprocess.PIPE, text=True)
        run_tool([os.path.join(a.bin_dir, "retain-train"), "--model", model, "--data", data, "--out", run,
                  "--gate-hidden", "8", "--memory", "8", "--steps", "12", "--global-batch", "2", "--lr", "0.01"])
        out, _ = follower.communicate(timeout=60)
        assert follower.returncode == 0, out
        n_follow = check(run, os.path.join(tmp, "tb-follow"))
        run_tool([sys.executable, SIDECAR, run])
        n_once = check(run, os.path.join(run, "tensorboard"))
    print(f"tensorboard_check: {n_once} steps (and {n_follow} with --follow) read back by EventAccumulator")
    return 0


if __name__ == "__main__":
    sys.exit(main())
