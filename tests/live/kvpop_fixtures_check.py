#!/usr/bin/env python3
"""Live check of tests/fixtures/kvpop: regenerates the fixtures with the installed torch and
mlstm-kernels into a temporary folder and compares every tensor with the committed files, so
the committed references are what the script and mlstm-kernels produce (not edited, not
stale). Exits 77 (skipped) when torch, safetensors or mlstm_kernels cannot be imported."""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from live_common import import_or_skip  # noqa: E402

PROG = "kvpop_fixtures_check"
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "kvpop")


def main():
    import_or_skip(PROG, ["torch", "safetensors", "mlstm_kernels"])
    import torch
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, os.path.join(FIXTURES, "make_fixtures.py"), "--out", tmp], check=True)
        bad = 0
        for name in ("mlstm.safetensors", "layer.safetensors"):
            want, got = load_file(os.path.join(FIXTURES, name)), load_file(os.path.join(tmp, name))
            if sorted(want) != sorted(got):
                print(f"{PROG}: {name}: tensors differ: {sorted(set(want) ^ set(got))}")
                bad += 1
                continue
            for key in sorted(want):
                a, b = want[key], got[key]
                same = a.shape == b.shape and a.dtype == b.dtype and (
                    torch.equal(a, b) if not a.is_floating_point()
                    else torch.allclose(a.double(), b.double(), rtol=1e-12, atol=1e-14, equal_nan=True))
                if not same:
                    print(f"{PROG}: {name}:{key} differs from a fresh run")
                    bad += 1
    print(f"{PROG}: {'FAILED' if bad else 'ok'}: {bad} differences")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
