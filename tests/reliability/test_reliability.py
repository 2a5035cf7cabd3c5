#!/usr/bin/env python3
"""The red-team suite (issue 40, docs/reliability.md): every tool tried as a careless and a hostile
user would — hostile containers, absurd options, outputs that name inputs, two writers at once, a
full disk, FIFOs and devices where files belong, inputs sized to exhaust memory. Each case is a
class of failure, tried on every tool it applies to: the tool must end (no crash, no hang) with
one line on stderr, the documented exit status, and nothing lost or half-written.

usage: test_reliability.py BIN_DIR FIXTURES_DIR [unittest arguments, e.g. a class name]
"""
import contextlib
import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import zipfile
import zlib

BIN = os.path.abspath(sys.argv.pop(1))
FIXTURES = os.path.abspath(sys.argv.pop(1))
TINY = os.path.join(FIXTURES, "trainer", "model")
CORPUS = os.path.join(FIXTURES, "trainer", "corpus.jsonl")
RECALL = os.path.join(os.path.dirname(os.path.dirname(FIXTURES)), "models", "recall-qwen3")


def run(args, timeout=60, cwd=None, env=None):
    """(exit status, stdout, stderr) of a tool; a signal is a negative status; a hang fails."""
    e = dict(os.environ, RETAIN_DEVICE="cpu", OMP_NUM_THREADS="1", **(env or {}))
    try:
        p = subprocess.run([os.path.join(BIN, args[0])] + [str(a) for a in args[1:]], capture_output=True, text=True,
                           timeout=timeout, cwd=cwd, env=e)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{args[0]} did not end within {timeout} s: {args}")
    return p.returncode, p.stdout, p.stderr


class Case(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="retain-reliability-")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

    def path(self, *parts):
        return os.path.join(self.tmp, *parts)

    def fails(self, args, code, needle, timeout=60, **kw):
        """The tool ends with `code` and one stderr line holding `needle`; returns that line."""
        rc, out, err = run(args, timeout=timeout, **kw)
        self.assertEqual(rc, code, f"{args}: exit {rc}, stderr: {err[-2000:]}")
        # Progress and log lines may precede it (stderr is the tools' log); the error is one line.
        lines = [ln for ln in err.splitlines() if "error" in ln]
        self.assertEqual(len(lines), 1, f"{args}: not one error line: {err[-2000:]}")
        self.assertIn(needle, lines[0], f"{args}")
        self.assertTrue(lines[0].startswith(args[0] + ": error: "), lines[0])
        self.assertNotIn("terminate called", err)
        return lines[0]

    def no_leftovers(self, folder):
        """Nothing half-written: no temporary, spill or .old file in `folder`."""
        left = [n for n in os.listdir(folder) if ".tmp." in n or ".spill." in n or ".old." in n]
        self.assertEqual(left, [], f"left behind in {folder}")

    def packed(self):
        out = self.path("t.h5")
        if not os.path.exists(out):
            rc, _, err = run(["retain-pack", "--tokenizer", TINY, "--input", CORPUS, "--out", out, "--seq-len", 64,
                              "--quiet"])
            self.assertEqual(rc, 0, err)
        return out


# ---- hostile containers ------------------------------------------------------------------

def pth(path, pickle):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickle)
        z.writestr("archive/version", "3\n")


def tuple_chain(depth):  # ((((…)))): TUPLE1 around the last, depth times
    return b"\x80\x02)" + b"\x85" * depth + b"."


def list_memo_chain(depth):
    # Lists L0..Ln memoized, then L(i+1).append(L(i)) from the top down: each append sees an
    # empty list (depth 1), yet the chain nests n deep — a depth check at append time cannot see it.
    p = bytearray(b"\x80\x02")
    for i in range(depth + 1):
        p += b"]r" + struct.pack("<I", i) + b"0"  # EMPTY_LIST, LONG_BINPUT i, POP
    for i in range(depth - 1, -1, -1):
        p += b"j" + struct.pack("<I", i + 1) + b"j" + struct.pack("<I", i) + b"a0"  # get, get, APPEND, POP
    p += b"j" + struct.pack("<I", depth) + b"."
    return bytes(p)


def object_flood(n):  # n empty tuples appended to one list: the stack stays small, the objects do not
    return b"\x80\x02]" + b")a" * n + b"."


class HostileContainers(Case):
    """A .pth whose pickle nests 200,000 deep, hides its depth behind memo references, or creates
    millions of objects: one line, exit 1, in every tool that reads gates — never SIGSEGV."""

    def test_every_reader_ends_with_one_line(self):
        data = self.packed()
        for name, pickle, needle in (("tuples", tuple_chain(200000), "nested more than 64 deep"),
                                     ("lists", list_memo_chain(200000), "archive/data.pkl"),
                                     ("flood", object_flood(2000000), "objects")):
            f = self.path(name + ".pth")
            pth(f, pickle)
            with self.subTest(pickle=name):
                self.fails(["retain-forward", "--model", TINY, "--ids", "1 2 3", "--gates", f, "--out",
                            self.path("l.safetensors")], 1, needle)
                self.fails(["retain-export", "--from", f, "--format", "safetensors", "--model", TINY, "--out",
                            self.path("g.safetensors")], 1, needle)
                self.fails(["retain-train", "--model", TINY, "--data", data, "--out", self.path("run"), "--steps", 1,
                            "--init-gates", f], 1, needle)
                self.assertFalse(os.path.exists(self.path("l.safetensors")) or os.path.exists(self.path("run")))


class AbsurdOptions(Case):
    """Numbers that cannot be right are command-line mistakes (exit 2, one line naming the
    option) in every tool, before any work."""

    def test_non_finite_and_out_of_range_numbers(self):
        data = self.packed()
        train = ["retain-train", "--model", TINY, "--data", data, "--out", self.path("run"), "--steps", 1]
        cases = [
            (train + ["--lr", "inf"], "--lr must be a finite number"),
            (train + ["--lr", "nan"], "--lr must be a finite number"),
            (train + ["--lr", "1e300"], "--lr 1e+300 is above 10"),
            (train + ["--weight-decay", "1e30"], "lr × weight decay must stay below 1"),
            (train + ["--bias-init", "nan"], "--bias-init must be a finite number"),
            (train + ["--memory", "inf"], "--memory must be a finite number"),
            (train + ["--cap-weight", "-inf"], "--cap-weight must be a finite number"),
            (train + ["--adam-beta2", "nan"], "--adam-beta2 must be a finite number"),
            (train + ["--adam-beta1", "1"], "--adam-beta1 must be in [0, 1)"),
            (train + ["--gate", "kvpop", "--topk", 3, "--decay-every", 0], "--decay-every must be ≥ 1"),
            (train + ["--gate", "kvpop", "--topk", 3, "--decay-max", "inf"], "--decay-max must be a finite number"),
            (["retain-generate", "--model", TINY, "--policy", "trimkv", "--budget", 4, "--prompt-ids", "1 2",
              "--lookahead=-1"], "--lookahead must be >= 0"),
            (["retain-eval", "--model", TINY, "--task", "recall", "--policy", "trimkv", "--budget", 4,
              "--lookahead=-5", "--out", self.path("m.json")], "--lookahead must be >= 0"),
            (["retain-generate", "--model", TINY, "--policy", "full", "--prompt-ids", "1 2", "--temperature", "-1"],
             "--temperature must be >= 0"),
            (["retain-generate", "--model", TINY, "--policy", "full", "--prompt-ids", "1 2", "--temperature", "nan"],
             "--temperature must be a finite number"),
            (["retain-make-tiny", "--out", self.path("m"), "--yarn-factor", "inf"], "--yarn-factor must be a finite"),
            (["retain-make-tiny", "--out", self.path("m"), "--max-gib", "nan"], "--max-gib must be a finite"),
            (["retain-bench", "train", "--model", TINY, "--device", "cpu", "--memory", "inf"], "--memory must be a finite"),
            (["retain-bench", "attention", "--device", "cpu", "--capacity-skip", "nan"], "--capacity-skip must be a finite"),
            (["retain-pack", "--tokenizer", TINY, "--out", self.path("x.h5"), "--seq-len", 64, "--threads", 40000,
              CORPUS], "--threads must be between 1 and 1024"),
            (["retain-pack", "--tokenizer", TINY, "--out", self.path("x.h5"), "--seq-len", 64, "--threads", 0, CORPUS],
             "--threads must be between 1 and 1024"),
        ]
        for args, needle in cases:
            with self.subTest(args=" ".join(map(str, args[3:]))):
                self.fails(args, 2, needle)
        self.assertEqual(sorted(os.listdir(self.tmp)), ["t.h5"], "a refused command line wrote nothing")


def nan_model(path):
    """A copy of the tiny model whose first weight tensor is NaN (BF16 0x7FC0 or F32 NaN)."""
    shutil.copytree(TINY, path)
    f = os.path.join(path, "model.safetensors")
    with open(f, "r+b") as s:
        n = struct.unpack("<Q", s.read(8))[0]
        header = json.loads(s.read(n))
        name = next(k for k in header if k != "__metadata__")
        begin, end = header[name]["data_offsets"]
        pattern = b"\xc0\x7f" if header[name]["dtype"] in ("BF16", "F16") else struct.pack("<f", float("nan"))
        s.seek(8 + n + begin)
        s.write(pattern * ((end - begin) // len(pattern)))


class NonFiniteModels(Case):
    """A model with NaN weights is refused where its outputs would be used, not scored as null."""

    def test_eval_and_generate_refuse_nan_logits(self):
        m = self.path("nan-model")
        nan_model(m)
        self.fails(["retain-eval", "--model", m, "--task", "recall", "--policy", "full", "--samples", 1, "--context", 64,
                    "--out", self.path("metrics.json")], 1, "logits are not finite")
        self.assertFalse(os.path.exists(self.path("metrics.json")))
        self.fails(["retain-generate", "--model", m, "--policy", "full", "--prompt-ids", "1 2 3"], 1,
                   "logits are not finite")


class EveryGateContainer(Case):
    """What --help promises: the gates retain-export writes are read by every tool that reads gates."""

    def test_generate_eval_plot_read_every_export(self):
        src = os.path.join(RECALL, "policies", "trimkv.safetensors")
        outs = {}
        for fmt, name in (("gguf", "g.gguf"), ("trimkv", "dir"), ("safetensors", "g.safetensors")):
            outs[fmt] = self.path(name)
            rc, _, err = run(["retain-export", "--from", src, "--format", fmt, "--model", RECALL, "--out", outs[fmt]])
            self.assertEqual(rc, 0, err)
        outs["pth"] = os.path.join(outs["trimkv"], "trimkv_weights.pth")
        kept = {}
        for fmt, f in outs.items():
            with self.subTest(container=fmt):
                j = self.path(fmt + ".json")
                rc, _, err = run(["retain-generate", "--model", RECALL, "--gates", f, "--policy", "trimkv", "--budget",
                                  16, "--prompt-ids", " ".join(str(16 + i % 200) for i in range(40)), "--max-new", 3,
                                  "--greedy", "--json", j])
                self.assertEqual(rc, 0, err)
                with open(j) as h:
                    kept[fmt] = json.load(h)["kept_positions"]
                rc, _, err = run(["retain-plot", "retention", "--model", RECALL, "--gates", f, "--ids", "20 21 22 23",
                                  "--out", self.path(fmt + ".png")])
                self.assertEqual(rc, 0, err)
                rc, _, err = run(["retain-eval", "--model", RECALL, "--gates", f, "--task", "recall", "--policy",
                                  "trimkv", "--budget", 32, "--samples", 1, "--context", 128, "--out",
                                  self.path(fmt + "-metrics.json")])
                self.assertEqual(rc, 0, err)
        # bf16 exports round the gates; the decisions at this budget do not move.
        self.assertEqual(kept["gguf"], kept["pth"])


class OutputsThatNameInputs(Case):
    """An output that is one of the tool's inputs — or replaces a file inside an input folder —
    is refused before any work, and the input is untouched."""

    def test_every_tool(self):
        data = self.packed()
        model = self.path("model")
        shutil.copytree(TINY, model)
        weights = os.path.join(model, "model.safetensors")
        before = open(weights, "rb").read()
        metrics = self.path("metrics.jsonl")
        with open(metrics, "w") as f:
            f.write(json.dumps({"step": 1, "loss": 1.0, "kl": 0.5, "ntp": 0.5, "cap": 0.0, "lr": 0.1}) + "\n")
        prompt = self.path("prompt.txt")
        with open(prompt, "w") as f:
            f.write("hello")
        cases = [
            (["retain-forward", "--model", model, "--ids", "1 2", "--out", weights], "input folder"),
            (["retain-forward", "--model", model, "--ids", "1 2", "--out", model], "is also an input"),
            (["retain-pack", "--tokenizer", model, "--out", os.path.join(model, "tokenizer.json"), "--seq-len", 64,
              CORPUS], "input folder"),
            (["retain-pack", "--tokenizer", model, "--out", data, "--seq-len", 64, data], "is also an input"),
            (["retain-eval", "--model", model, "--data", data, "--policy", "full", "--out", data], "is also an input"),
            (["retain-eval", "--model", model, "--data", data, "--policy", "full", "--out", self.path("m.json"),
              "--plot", os.path.join(model, "config.json")], "input folder"),
            (["retain-generate", "--model", model, "--policy", "full", "--prompt-file", prompt, "--json", prompt],
             "is also an input"),
            (["retain-plot", "losses", "--metrics", metrics, "--out", metrics], "is also an input"),
            (["retain-train", "--model", model, "--data", data, "--out", model, "--steps", 1], "is also an input"),
            (["retain-train", "--model", model, "--data", data, "--dump-grads", data], "is also an input"),
            (["retain-bench", "train", "--model", model, "--device", "cpu", "--seq", 64, "--json", weights],
             "input folder"),
            (["retain-export", "--from", os.path.join(RECALL, "policies", "trimkv.safetensors"), "--format",
              "safetensors", "--model", RECALL, "--force", "--out", os.path.join(RECALL, "config.json")],
             "input folder"),
        ]
        for args, needle in cases:
            with self.subTest(tool=args[0], out=args[-1]):
                self.fails(args, 1, needle)
        self.assertEqual(open(weights, "rb").read(), before)


class MakeTinyKeepsWhatIsThere(Case):
    def test_existing_folder_needs_force_and_is_replaced_whole(self):
        out = self.path("m")
        rc, _, err = run(["retain-make-tiny", "--out", out, "--gates", "trimkv"])
        self.assertEqual(rc, 0, err)
        cfg = open(os.path.join(out, "config.json")).read()
        self.fails(["retain-make-tiny", "--out", out, "--layers", 3], 1, "already exists and is not empty")
        self.assertEqual(open(os.path.join(out, "config.json")).read(), cfg)
        self.assertTrue(os.path.exists(os.path.join(out, "gates.safetensors")))
        rc, _, err = run(["retain-make-tiny", "--out", out, "--layers", 3, "--force"])
        self.assertEqual(rc, 0, err)
        self.assertFalse(os.path.exists(os.path.join(out, "gates.safetensors")), "no stale gates after --force")
        self.assertEqual(json.load(open(os.path.join(out, "config.json")))["num_hidden_layers"], 3)
        os.makedirs(self.path("empty"))
        rc, _, err = run(["retain-make-tiny", "--out", self.path("empty")])
        self.assertEqual(rc, 0, err)
        self.no_leftovers(self.tmp)


class RunLocks(Case):
    """Two runs into one --out, or a --resume of a running run: the second stops naming the first."""

    def test_second_run_and_early_resume_are_refused(self):
        data = self.packed()
        out = self.path("run")
        args = ["--model", TINY, "--data", data, "--out", out, "--gate-hidden", 8, "--log-every", 100000,
                "--save-every", 400]
        env = dict(os.environ, RETAIN_DEVICE="cpu", OMP_NUM_THREADS="1")
        first = subprocess.Popen([os.path.join(BIN, "retain-train")] + [str(a) for a in args + ["--steps", 4000]],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.addCleanup(first.kill)
        lock = self.path(".run.lock")
        for _ in range(200):
            if os.path.exists(lock) and open(lock).read():
                break
            time.sleep(0.05)
        self.assertTrue(os.path.exists(lock), "the run holds no lock file")
        if first.poll() is not None:
            self.skipTest("the first run ended before the second could start (a machine this fast needs more steps)")
        line = self.fails(["retain-train"] + args + ["--steps", 4000], 1, f"in use by another run (PID {first.pid}")
        self.fails(["retain-train"] + args + ["--steps", 4000, "--resume"], 1, f"PID {first.pid}")
        self.assertIn("choose another --out", line)
        # A stop by SIGTERM (save, exit 0) releases the lock too; the runs that end normally and
        # are resumed into the same --out (tests/trainer) show the normal end does. (Waiting for
        # the 4000 steps took 15–20 s of CI.)
        first.send_signal(signal.SIGTERM)
        self.assertEqual(first.wait(timeout=300), 0, first.stderr.read())
        self.assertFalse(os.path.exists(lock), "the lock file stays after the run")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            steps = [json.loads(ln)["step"] for ln in f]
        self.assertEqual(steps, sorted(set(steps)), "every step once in metrics.jsonl")


class ResourceLimits(Case):
    """Sizes that would exhaust memory are refused at their limit, with little memory used."""

    def child_peak_mib(self):
        return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024

    def test_config_sizes(self):
        for key, value in (("num_hidden_layers", 10**6), ("vocab_size", 10**12), ("hidden_size", 10**9),
                           ("head_dim", 10**6), ("max_position_embeddings", 10**12), ("intermediate_size", 10**10)):
            m = self.path(key)
            shutil.copytree(TINY, m)
            cfg = json.load(open(os.path.join(m, "config.json")))
            cfg[key] = value
            json.dump(cfg, open(os.path.join(m, "config.json"), "w"))
            with self.subTest(key=key):
                self.fails(["retain-forward", "--model", m, "--ids", "1 2", "--out", self.path("l.safetensors")], 1,
                           f"'{key}' is {value}, above retain's limit", timeout=20)
        self.assertLess(self.child_peak_mib(), 1024)

    def test_records_without_a_newline(self):
        bomb = self.path("bomb.jsonl.gz")  # 256 MiB of one line in ~250 KB
        with open(bomb, "wb") as f:
            z = zlib.compressobj(9, zlib.DEFLATED, 16 + 15)
            chunk = b"a" * (1 << 20)
            for _ in range(256):
                f.write(z.compress(chunk))
            f.write(z.flush())
        self.fails(["retain-pack", "--tokenizer", TINY, "--out", self.path("o.h5"), "--seq-len", 64, bomb], 1,
                   "bomb.jsonl.gz:1: a line longer than 64 MiB", timeout=60)
        self.assertLess(self.child_peak_mib(), 1024)
        self.no_leftovers(self.tmp)
        self.assertFalse(os.path.exists(self.path("o.h5")))

    def test_non_files_where_files_belong(self):
        data = self.packed()
        fifo_model = self.path("fifo-model")
        shutil.copytree(TINY, fifo_model)
        os.remove(os.path.join(fifo_model, "model.safetensors"))
        os.mkfifo(os.path.join(fifo_model, "model.safetensors"))
        fifo = self.path("fifo")
        os.mkfifo(fifo)
        cfg_fifo = self.path("cfg-fifo")
        shutil.copytree(TINY, cfg_fifo)
        os.remove(os.path.join(cfg_fifo, "config.json"))
        os.mkfifo(os.path.join(cfg_fifo, "config.json"))
        cases = [
            (["retain-forward", "--model", fifo_model, "--ids", "1 2", "--out", self.path("l.safetensors")], "a FIFO"),
            (["retain-forward", "--model", cfg_fifo, "--ids", "1 2", "--out", self.path("l.safetensors")], "a FIFO"),
            (["retain-forward", "--model", TINY, "--ids", "1 2", "--gates", fifo, "--out", self.path("l.safetensors")],
             "a FIFO"),
            (["retain-train", "--model", TINY, "--data", fifo, "--out", self.path("run"), "--steps", 1], "a FIFO"),
            (["retain-pack", "--tokenizer", fifo, "--out", self.path("o.h5"), "--seq-len", 64, CORPUS], "a FIFO"),
            (["retain-pack", "--tokenizer", TINY, "--out", self.path("o.h5"), "--seq-len", 64, fifo], "a FIFO"),
            (["retain-pack", "--tokenizer", TINY, "--out", self.path("o.h5"), "--seq-len", 64, "/dev/zero"],
             "a character device"),
            (["retain-export", "--from", fifo, "--format", "gguf", "--model", TINY, "--out", self.path("g.gguf")],
             "a FIFO"),
            (["retain-plot", "losses", "--metrics", fifo, "--out", self.path("p.png")], "a FIFO"),
            (["retain-eval", "--model", TINY, "--data", fifo, "--policy", "full"], "a FIFO"),
        ]
        for args, needle in cases:
            with self.subTest(args=" ".join(map(str, args))):
                self.fails(args, 1, needle, timeout=20)
        self.assertFalse(os.path.exists(data + ".x"))


@contextlib.contextmanager
def tmpfs(test, path, kib):
    """A small tmpfs at `path` (root only; the test is skipped visibly otherwise)."""
    os.makedirs(path)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", path], capture_output=True, text=True)
    if p.returncode != 0:
        test.skipTest(f"cannot mount a tmpfs here ({p.stderr.strip() or 'not root'}): the full-disk cases need one")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


def fill(folder, leave_bytes=0):
    """Fills the file system of `folder`, then frees `leave_bytes`."""
    f = os.path.join(folder, "filler")
    fd = os.open(f, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while os.write(fd, b"x" * 4096) > 0:
            pass
    except OSError:  # ENOSPC: full
        pass
    os.close(fd)
    if leave_bytes:
        os.truncate(f, max(0, os.path.getsize(f) - leave_bytes))


class FullDisk(Case):
    """Every tool that writes, on a full disk: exit 1 with one line naming the output, the output
    absent (or its previous version intact), and no temporary left behind."""

    def writers(self, mnt, data, prev):
        m = os.path.join(mnt, "out")
        src = os.path.join(RECALL, "policies", "trimkv.safetensors")
        return [
            ("retain-forward", ["retain-forward", "--model", TINY, "--ids", "1 2 3", "--out", m + ".safetensors"], m + ".safetensors"),
            ("retain-pack", ["retain-pack", "--tokenizer", TINY, "--out", m + ".h5", "--seq-len", 64, CORPUS], m + ".h5"),
            ("retain-export", ["retain-export", "--from", src, "--format", "gguf", "--model", RECALL, "--out", m + ".gguf"], m + ".gguf"),
            ("retain-export trimkv", ["retain-export", "--from", src, "--format", "trimkv", "--model", RECALL, "--out", m + "-dir"], m + "-dir"),
            ("retain-eval", ["retain-eval", "--model", RECALL, "--task", "recall", "--policy", "full", "--samples", 1,
                             "--context", 64, "--out", m + ".json"], m + ".json"),
            ("retain-generate", ["retain-generate", "--model", TINY, "--policy", "full", "--prompt-ids", "1 2",
                                 "--json", m + "-gen.json"], m + "-gen.json"),
            ("retain-plot", ["retain-plot", "losses", "--metrics", prev, "--out", m + ".png"], m + ".png"),
            ("retain-make-tiny", ["retain-make-tiny", "--out", m + "-tiny"], m + "-tiny"),
            ("retain-train", ["retain-train", "--model", TINY, "--data", data, "--out", m + "-run", "--steps", 2,
                              "--gate-hidden", 8], m + "-run"),
            ("retain-train --dump-grads", ["retain-train", "--model", TINY, "--data", data, "--dump-grads",
                                           m + "-grads.safetensors", "--gate-hidden", 8], m + "-grads.safetensors"),
            ("retain-bench", ["retain-bench", "train", "--model", TINY, "--device", "cpu", "--seq", 64, "--iters", 1,
                              "--warmup", 0, "--gate-hidden", 8, "--json", m + "-bench.json"], m + "-bench.json"),
        ]

    def test_every_writer(self):
        data = self.packed()
        metrics = self.path("metrics.jsonl")
        with open(metrics, "w") as f:
            for s in range(1, 4):
                f.write(json.dumps({"step": s, "loss": 1.0 / s, "kl": 0.5, "ntp": 0.5, "cap": 0.0, "lr": 0.1}) + "\n")
        with tmpfs(self, self.path("mnt"), 64) as mnt:
            fill(mnt)
            for name, args, out in self.writers(mnt, data, metrics):
                with self.subTest(tool=name):
                    rc, _, err = run(args, timeout=120)
                    self.assertEqual(rc, 1, f"{name}: exit {rc}: {err[-1500:]}")
                    lines = [ln for ln in err.splitlines() if ln.strip() and "error" in ln]
                    self.assertEqual(len(lines), 1, err[-1500:])
                    self.assertFalse(os.path.exists(out), f"{name} left {out}")
                    self.no_leftovers(mnt)

    def test_a_run_with_room_for_its_lock_but_not_its_config(self):
        data = self.packed()
        with tmpfs(self, self.path("mnt"), 64) as mnt:
            fill(mnt, leave_bytes=8192)
            rc, _, err = run(["retain-train", "--model", TINY, "--data", data, "--out", os.path.join(mnt, "run"),
                              "--steps", 2, "--gate-hidden", 8], timeout=120)
            self.assertEqual(rc, 1, err)
            self.assertIn("No space left on device", err)
            self.assertEqual(sorted(os.listdir(mnt)), ["filler"], "a run that cannot start leaves nothing behind")

    def test_previous_png_survives(self):
        metrics = self.path("metrics.jsonl")
        with open(metrics, "w") as f:
            for s in range(1, 4):
                f.write(json.dumps({"step": s, "loss": 1.0 / s, "kl": 0.5, "ntp": 0.5, "cap": 0.0, "lr": 0.1}) + "\n")
        with tmpfs(self, self.path("mnt"), 256) as mnt:
            png = os.path.join(mnt, "l.png")
            rc, _, err = run(["retain-plot", "losses", "--metrics", metrics, "--out", png])
            self.assertEqual(rc, 0, err)
            good = open(png, "rb").read()
            fill(mnt)
            self.fails(["retain-plot", "losses", "--metrics", metrics, "--out", png], 1, "not written completely")
            self.assertEqual(open(png, "rb").read(), good)
            self.no_leftovers(mnt)


class TwoWriters(Case):
    """Two runs of a tool writing the same output at once: each ends cleanly (or the second is
    refused), and what is there afterwards is one whole output, never a mix or a half."""

    def test_every_writer(self):
        data = self.packed()
        o = self.path("o")
        src = os.path.join(RECALL, "policies", "trimkv.safetensors")
        writers = [
            (["retain-forward", "--model", TINY, "--ids", "1 2 3", "--out", o + ".safetensors"], o + ".safetensors"),
            (["retain-pack", "--tokenizer", TINY, "--out", o + ".h5", "--seq-len", 64, CORPUS], o + ".h5"),
            (["retain-export", "--from", src, "--format", "gguf", "--model", RECALL, "--force", "--out", o + ".gguf"], o + ".gguf"),
            (["retain-generate", "--model", TINY, "--policy", "full", "--prompt-ids", "1 2", "--json", o + ".json"], o + ".json"),
            (["retain-make-tiny", "--out", o + "-tiny", "--force"], o + "-tiny"),
        ]
        for args, out in writers:
            with self.subTest(tool=args[0]):
                results = [None, None]

                def go(i):
                    results[i] = run(args, timeout=120)

                ts = [threading.Thread(target=go, args=(i,)) for i in range(2)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                for rc, _, err in results:
                    self.assertIn(rc, (0, 1), err)
                self.assertIn(0, [r[0] for r in results], [r[2] for r in results])
                self.assertTrue(os.path.exists(out))
                self.no_leftovers(self.tmp)
                # Whole: the reader that needs every byte takes it.
                if out.endswith(".safetensors"):
                    with open(out, "rb") as f:
                        n = struct.unpack("<Q", f.read(8))[0]
                        header = json.loads(f.read(n))
                    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
                    self.assertEqual(os.path.getsize(out), 8 + n + end)
                if out.endswith(".gguf"):
                    rc, _, err = run(["retain-generate", "--model", RECALL, "--gates", out, "--policy", "trimkv",
                                      "--budget", 8, "--prompt-ids", "20 21 22", "--max-new", 1])
                    self.assertEqual(rc, 0, err)
                if out.endswith(".h5"):
                    rc, _, err = run(["retain-train", "--model", TINY, "--data", out, "--dump-grads",
                                      self.path("g.safetensors"), "--gate-hidden", 8])
                    self.assertEqual(rc, 0, err)
                if out.endswith(".json"):
                    json.load(open(out))
                if out.endswith("-tiny"):
                    rc, _, err = run(["retain-forward", "--model", out, "--ids", "1 2", "--out", self.path("t.safetensors")])
                    self.assertEqual(rc, 0, err)


if __name__ == "__main__":
    unittest.main(verbosity=2)
