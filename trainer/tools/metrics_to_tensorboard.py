#!/usr/bin/env python3
"""Turns a retain-train run's metrics.jsonl into TensorBoard event files, once or live.

    python3 trainer/tools/metrics_to_tensorboard.py RUN_DIR [--logdir DIR] [--follow]
    tensorboard --logdir RUN_DIR/tensorboard

Scalars per step: loss/total, loss/kl, loss/ntp, loss/cap, optim/lr, optim/grad_norm,
speed/tokens_per_s, speed/step_seconds, and per layer retention/mean_beta/layer_L and
retention/effective_cache/layer_L, with the step's wall time. --follow keeps reading the
file as the run appends to it (run it beside retain-train; it ends when the run's final
gates.safetensors appears, or on Ctrl-C); a resumed run's repeated steps overwrite nothing,
TensorBoard shows the latest value per step. Weights & Biases imports these files
(`wandb sync --sync-tensorboard RUN_DIR/tensorboard`).

Needs the `tensorboard` package (`pip install tensorboard`); PyTorch's SummaryWriter is used
when torch is present, else tensorboard's own writer.
"""
import argparse
import datetime
import json
import os
import sys
import time

SCALARS = {
    "loss": "loss/total", "kl": "loss/kl", "ntp": "loss/ntp", "cap": "loss/cap", "lr": "optim/lr",
    "grad_norm": "optim/grad_norm", "tokens_per_s": "speed/tokens_per_s", "step_seconds": "speed/step_seconds",
    # --gate kvpop runs (their "loss" is L_kvpop; they have no kl/ntp/cap)
    "agreement": "kvpop/agreement", "gamma": "kvpop/gamma", "decisions": "kvpop/decisions",
}
PER_LAYER = {"mean_beta": "retention/mean_beta", "effective_cache": "retention/effective_cache"}


def writer_for(logdir):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            sys.exit("metrics_to_tensorboard.py: error: needs the tensorboard package (pip install tensorboard)")
    return SummaryWriter(log_dir=logdir)


def wall_time(record):
    t = record.get("time")
    if not t:
        return None
    return datetime.datetime.strptime(t, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.timezone.utc).timestamp()


def write_record(w, record):
    step = int(record["step"])
    wt = wall_time(record)
    for key, tag in SCALARS.items():
        if isinstance(record.get(key), (int, float)):
            w.add_scalar(tag, record[key], step, walltime=wt)
    for key, tag in PER_LAYER.items():
        for layer, v in enumerate(record.get(key) or []):
            if isinstance(v, (int, float)):
                w.add_scalar(f"{tag}/layer_{layer}", v, step, walltime=wt)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--logdir", help="where the event files go (default RUN_DIR/tensorboard)")
    p.add_argument("--follow", action="store_true", help="keep reading as the run appends, until it finishes")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between reads with --follow")
    a = p.parse_args()
    path = os.path.join(a.run_dir, "metrics.jsonl")
    if not os.path.isfile(path) and not a.follow:
        sys.exit(f"metrics_to_tensorboard.py: error: {path}: no such file (is {a.run_dir} a retain-train run?)")
    logdir = a.logdir or os.path.join(a.run_dir, "tensorboard")
    w = writer_for(logdir)
    offset, line_no, records = 0, 0, 0
    try:
        while True:
            # Checked before reading: lines written before the final gates are then all read.
            finished = os.path.isfile(os.path.join(a.run_dir, "gates.safetensors"))
            if os.path.isfile(path):
                with open(path) as f:
                    f.seek(offset)
                    while True:
                        line = f.readline()
                        if not line.endswith("\n"):  # a line still being written: read it next time
                            break
                        offset += len(line.encode())
                        line_no += 1
                        if not line.strip():
                            continue
                        try:
                            write_record(w, json.loads(line))
                        except (ValueError, KeyError) as e:
                            sys.exit(f"metrics_to_tensorboard.py: error: {path}:{line_no}: {e}")
                        records += 1
                w.flush()
            if not a.follow or finished:
                break
            time.sleep(a.poll)
    except KeyboardInterrupt:
        pass
    w.close()
    print(f"metrics_to_tensorboard.py: {records} steps from {path} into {logdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
