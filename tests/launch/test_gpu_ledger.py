#!/usr/bin/env python3
"""The GPU ledger's logic without a GPU (launch/gpu_ledger.py, launch/gpu-verify.sh): on a scratch
tree with stub steps, `run --next` goes in priority order, skips a step already PASS for the same
sources, runs it again after one of its files changes, cuts the running step at the deadline and
leaves the rest NOT RUN, puts a failed step first the next time, reads verdicts (an unexpected
gtest skip fails, exit 69 is UNAVAILABLE), records figures, the device and a log excerpt, and
returns at most 8 files. On the repository: the ledger is valid, every source pattern matches a
file, docs/gpu-ledger.md is up to date, and every GPU test program is a step and in the bundle.

usage: test_gpu_ledger.py REPO_ROOT
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

REPO = os.path.abspath(sys.argv.pop(1) if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", ".."))
LEDGER_PY = os.path.join(REPO, "launch", "gpu_ledger.py")
GPU_VERIFY = os.path.join(REPO, "launch", "gpu-verify.sh")


def step(name, priority, command, sources, limit=60, **extra):
    return dict({"name": name, "priority": priority, "command": command, "sources": sources, "limit_s": limit}, **extra)


def names_of(dry_run_output):
    """The step names a --dry-run lists, one per line."""
    return [line.split()[0] for line in dry_run_output.splitlines() if line.strip()]


class Scratch:
    """A tree with source files, a ledger, a fake nvidia-smi, and the folders a run writes."""

    def __init__(self, steps):
        self.tmp = tempfile.TemporaryDirectory()
        self.root = os.path.join(self.tmp.name, "tree")
        for d in ("src", "bin", "fakebin"):
            os.makedirs(os.path.join(self.root if d == "src" else self.tmp.name, d), exist_ok=True)
        for name in ("a.txt", "b.txt", "c.txt"):
            self.write(f"src/{name}", name)
        self.ledger = os.path.join(self.root, "ledger.json")
        with open(self.ledger, "w") as f:
            json.dump({"groups": {"ab": ["src/a.txt", "src/b.txt"]}, "steps": steps, "runs": []}, f)
        smi = os.path.join(self.tmp.name, "fakebin", "nvidia-smi")
        with open(smi, "w") as f:
            f.write('#!/bin/sh\nif [ $# -eq 0 ]; then echo "| NVIDIA-SMI 580.1   Driver Version: 580.1   CUDA Version: 13.0 |"; '
                    'else echo "NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04"; fi\n')
        os.chmod(smi, 0o755)
        self.out = os.path.join(self.tmp.name, "out")
        self.work = os.path.join(self.tmp.name, "work")

    def write(self, rel, text):
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)

    def run(self, *args, deadline=0):
        """One device call: `run` with the returned ledger taken back in, as a session would."""
        env = dict(os.environ, PATH=os.path.join(self.tmp.name, "fakebin") + os.pathsep + os.environ["PATH"],
                   GPU_LEDGER_RESERVE_S="1", GPU_LEDGER_MIN_STEP_S="2")
        cmd = [sys.executable, LEDGER_PY, "run", "--ledger", self.ledger, "--root", self.root,
               "--bin", os.path.join(self.tmp.name, "bin"), "--work", self.work, "--out", self.out,
               *args] + (["--deadline", str(deadline)] if deadline else [])
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        returned = os.path.join(self.out, "gpu-ledger.json")
        if os.path.exists(returned):
            a = subprocess.run([sys.executable, LEDGER_PY, "absorb", "--ledger", self.ledger, "--root", self.root,
                                returned], capture_output=True, text=True)
            assert a.returncode == 0, a.stderr
        return p

    def runs(self):
        with open(self.ledger) as f:
            return json.load(f)["runs"]

    def close(self):
        self.tmp.cleanup()


class LedgerRuns(unittest.TestCase):
    def setUp(self):
        self.s = Scratch([
            step("late", 30, "echo late", ["src/c.txt"]),
            step("first", 10, 'echo "[  PASSED  ] 3 tests."; echo "FIGURE speed=1.50"', ["@ab"]),
            step("second", 20, 'test -f "$REPO/fixed" || { echo "error: second is broken"; exit 1; }', ["src/b.txt"]),
        ])
        self.addCleanup(self.s.close)

    def test_priority_order_skip_rerun_and_failed_first(self):
        p = self.s.run("--next")
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)  # "second" fails
        runs = self.s.runs()
        self.assertEqual([r["step"] for r in runs], ["first", "second", "late"], "priority order, not file order")
        self.assertEqual([r["verdict"] for r in runs], ["PASS", "FAIL", "PASS"])
        first = runs[0]
        self.assertEqual(first["figures"], {"speed": "1.50", "tests_passed": "3"})
        self.assertEqual(first["device"], "NVIDIA H100 80GB HBM3, 81559 MiB")
        self.assertEqual(first["driver"], "580.159.04")
        self.assertIn("13.0", first["cuda"])
        self.assertEqual(first["log_excerpt"], "")
        self.assertIn("error: second is broken", runs[1]["log_excerpt"])
        self.assertRegex(first["sources_sha256"], r"^[0-9a-f]{64}$")

        # Nothing changed: only the failed step is due.
        p = self.s.run("--next", "--dry-run")
        self.assertEqual(names_of(p.stdout), ["second"], p.stdout)

        # "late"'s source changes and "second" is fixed: the failed step stays first, then priority.
        self.s.write("src/c.txt", "changed")
        self.s.write("fixed", "")
        self.s.write("src/b.txt", "the fix")  # b.txt is also "first"'s (through @ab): it is due again
        p = self.s.run("--next")
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual([r["step"] for r in self.s.runs()[3:]], ["second", "first", "late"])

        # Every step PASS for these sources: --next runs nothing, and says so.
        p = self.s.run("--next")
        self.assertEqual(p.returncode, 0)
        self.assertEqual(len(self.s.runs()), 6)
        self.assertIn("none (every step verified)", p.stdout)
        status = subprocess.run([sys.executable, LEDGER_PY, "status", "--ledger", self.s.ledger, "--root", self.s.root],
                                capture_output=True, text=True).stdout
        self.assertIn("3 of 3 steps verified", status)

    def test_only_runs_named_steps_even_when_passed(self):
        self.s.write("fixed", "")
        self.assertEqual(self.s.run("--next").returncode, 0)
        p = self.s.run("--only", "late")
        self.assertEqual(p.returncode, 0)
        self.assertEqual([r["step"] for r in self.s.runs()], ["first", "second", "late", "late"])
        p = self.s.run("--only", "nosuch")
        self.assertEqual(p.returncode, 1)
        self.assertIn("no step named 'nosuch'", p.stderr)

    def test_returns_at_most_eight_files(self):
        self.s.run("--next")
        files = sorted(os.listdir(self.s.out))
        self.assertEqual(files, ["gpu-ledger.json", "gpu-ledger.md", "gpu-verify.tar.gz", "summary.txt"])
        self.assertLessEqual(len(files), 8)
        import tarfile
        with tarfile.open(os.path.join(self.s.out, "gpu-verify.tar.gz")) as tar:
            log = tar.extractfile("logs/second.log").read().decode()
        self.assertIn("error: second is broken", log)


class LedgerVerdicts(unittest.TestCase):
    def test_deadline_cuts_the_running_step_and_leaves_the_rest(self):
        s = Scratch([step("quick", 1, "true", ["src/a.txt"]),
                     step("slow", 2, "sleep 60", ["src/a.txt"], limit=50),
                     step("after", 3, "true", ["src/b.txt"])])
        self.addCleanup(s.close)
        p = s.run("--next", deadline=6)
        self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
        self.assertEqual([(r["step"], r["verdict"]) for r in s.runs()], [("quick", "PASS"), ("slow", "CUT")])
        with open(os.path.join(s.out, "summary.txt")) as f:
            summary = f.read()
        self.assertRegex(summary, r"after +NOT RUN \(deadline\)")
        self.assertLess(s.runs()[1]["wall_s"], 10)
        # A cut step is not verified: it leads the next call (priority order, nothing failed).
        p = s.run("--next", "--dry-run")
        self.assertEqual(names_of(p.stdout), ["slow", "after"])

    def test_own_time_limit_is_a_failure(self):
        s = Scratch([step("hangs", 1, "sleep 60", ["src/a.txt"], limit=2)])
        self.addCleanup(s.close)
        p = s.run("--next")
        self.assertEqual(p.returncode, 1)
        self.assertEqual(s.runs()[0]["verdict"], "FAIL")
        self.assertIn("timed out after 2 s", s.runs()[0]["log_excerpt"])

    def test_skips_unavailable_and_partial(self):
        s = Scratch([
            step("skips", 1, 'echo "[  SKIPPED ] GatedAttentionCudaWgmma.SmallShapes/0 (0 ms)"', ["src/a.txt"]),
            step("allowed", 2, 'echo "[  SKIPPED ] CommCuda.NcclOnTwoRanks (0 ms)"; '
                               'echo "[  SKIPPED ] StepCudaNoDevice.DeviceWeightsWithoutAGpuSayWhy (0 ms)"',
                 ["src/a.txt"], skips_ok=r"^CommCuda\.Nccl"),
            step("tool", 3, "exit 69", ["src/a.txt"]),
            step("resumable", 4, "exit 75", ["src/a.txt"]),
        ])
        self.addCleanup(s.close)
        p = s.run("--next")
        self.assertEqual(p.returncode, 1)
        v = {r["step"]: r for r in s.runs()}
        self.assertEqual(v["skips"]["verdict"], "FAIL")
        self.assertIn("GatedAttentionCudaWgmma.SmallShapes/0", v["skips"]["log_excerpt"])
        self.assertEqual(v["allowed"]["verdict"], "PASS")
        self.assertEqual(v["tool"]["verdict"], "UNAVAILABLE")
        self.assertEqual(v["resumable"]["verdict"], "CUT")

    def test_bundle_manifest_names_the_sources_recorded(self):
        s = Scratch([step("one", 1, "true", ["src/a.txt"])])
        self.addCleanup(s.close)
        manifest = os.path.join(s.tmp.name, "manifest.json")
        with open(manifest, "w") as f:
            json.dump({"commit": "abc1234567", "nvcc": "nvcc release 13.0", "sources_sha256": {"one": "0" * 64}}, f)
        p = s.run("--next", "--manifest", manifest)
        self.assertIn("built from other sources than this tree for one", p.stderr)
        r = s.runs()[0]
        self.assertEqual((r["commit"], r["sources_sha256"]), ("abc1234567", "0" * 64))
        self.assertIn("built with nvcc release 13.0", r["cuda"])
        # Recorded for the bundle's sources, not this tree's: the step is still due here.
        p = s.run("--next", "--dry-run")
        self.assertEqual(names_of(p.stdout), ["one"])

    def test_damaged_ledgers_are_one_line_errors(self):
        s = Scratch([step("one", 1, "true", ["src/a.txt"])])
        self.addCleanup(s.close)
        cases = {"not JSON": "{", "no steps": "{}",
                 "duplicate": json.dumps({"steps": [step("a", 1, "x", ["src/a.txt"])] * 2, "runs": []}),
                 "bad group": json.dumps({"steps": [step("a", 1, "x", ["@nope"])], "runs": []}),
                 "bad verdict": json.dumps({"steps": [], "runs": [dict(step="a", commit="c", sources_sha256="s",
                     device="d", driver="v", cuda="c", date="t", verdict="OK", wall_s=1, figures={}, log_excerpt="")]})}
        for what, text in cases.items():
            with open(s.ledger, "w") as f:
                f.write(text)
            p = subprocess.run([sys.executable, LEDGER_PY, "status", "--ledger", s.ledger, "--root", s.root],
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, 1, what)
            self.assertEqual(len(p.stderr.strip().splitlines()), 1, (what, p.stderr))
            self.assertIn(s.ledger, p.stderr, what)


class TheRepositorysLedger(unittest.TestCase):
    def test_check_passes(self):
        p = subprocess.run([sys.executable, LEDGER_PY, "check"], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)

    def test_every_gpu_test_program_is_a_step_and_bundled(self):
        programs = set()
        for dirpath, _, files in os.walk(os.path.join(REPO, "tests")):
            if "CMakeLists.txt" in files:
                with open(os.path.join(dirpath, "CMakeLists.txt")) as f:
                    programs |= set(re.findall(r"\btest_[a-z0-9_]*cuda[a-z0-9_]*\b", f.read()))
        programs.add("test_gated_attention_long")
        with open(os.path.join(REPO, "docs", "gpu-ledger.json")) as f:
            commands = " ".join(s["command"] for s in json.load(f)["steps"])
        with open(os.path.join(REPO, "launch", "gpu-bundle.sh")) as f:
            bins = re.search(r"^bins=\((.*?)\)", f.read(), re.S | re.M).group(1).split()
        for prog in sorted(programs):
            self.assertRegex(commands, rf"\$BIN/{prog}\b|\b{prog}\b", f"no ledger step runs {prog}")
            self.assertIn(prog, bins, f"gpu-bundle.sh does not pack {prog}")

    def test_first_steps_follow_the_issues_priorities(self):
        with open(os.path.join(REPO, "docs", "gpu-ledger.json")) as f:
            steps = sorted(json.load(f)["steps"], key=lambda s: s["priority"])
        names = [s["name"] for s in steps]
        order = ["emu", "kernels.", "step.", "bench.headline-32k", "train.4b-128k-trimkv", "sanitizer.memcheck.",
                 "train-tests", "comm.one-rank"]
        firsts = [next(i for i, n in enumerate(names) if n.startswith(o)) for o in order]
        self.assertEqual(firsts, sorted(firsts), list(zip(order, firsts)))

    def test_gpu_verify_usage_errors(self):
        for args in (["--only", "Bad Name"], ["--deadline", "soon"], ["--frobnicate"], ["--out"], [],
                     ["--next", "--only", "emu"]):
            p = subprocess.run(["bash", GPU_VERIFY, *args], capture_output=True, text=True)
            self.assertEqual(p.returncode, 2, args)
            self.assertEqual(len(p.stderr.strip().splitlines()), 1, (args, p.stderr))
            self.assertTrue(p.stderr.startswith("gpu-verify: "), p.stderr)

    def test_gpu_verify_dry_run_lists_the_plan(self):
        p = subprocess.run(["bash", GPU_VERIFY, "--next", "--dry-run", "--bundle", "/nonexistent.tar.xz"],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertTrue(p.stdout.startswith("emu ") or "emu " in p.stdout, p.stdout[:200])


if __name__ == "__main__":
    unittest.main(verbosity=2)
