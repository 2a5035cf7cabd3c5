#!/usr/bin/env python3
"""The GPU verification ledger: which verification step has passed on which GPU, for which
sources, and the runner that advances it by one device call (docs/gpu-ledger.md says how).

docs/gpu-ledger.json holds the steps (name, command, priority, the source files each depends
on, a time limit) and every recorded run (commit, the SHA-256 of the step's sources, the
device, driver and CUDA, date, verdict, wall seconds, key figures, a log excerpt on failure).
A step counts as verified only for the sources it ran on: change one of its files and it is
due again. Standard library only: the device image's python3 runs it.

usage: gpu_ledger.py COMMAND [options]   (gpu_ledger.py COMMAND --help for each)
  status   what is verified for this tree's sources, step by step
  plan     the order `run --next` would take
  run      run steps (--next: those not yet PASS, a failed one first; --only: named ones)
  hashes   the sources' SHA-256 per step (launch/gpu-bundle.sh stores them in the bundle)
  render   write docs/gpu-ledger.md from the JSON
  check    the JSON's layout, every source pattern matching a file, the Markdown up to date
  absorb   add the runs of a returned ledger (a device call's $OUT) to this tree's ledger
  preflight  a bundle (launch/gpu-bundle.sh's .tar.xz) against this tree, before a device call
"""
import argparse
import collections
import datetime
import glob
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time

PROG = "gpu_ledger"
VERDICTS = ("PASS", "FAIL", "CUT", "UNAVAILABLE")
STEP_KEYS = {"name": str, "command": str, "priority": int, "sources": list, "limit_s": int}
RUN_KEYS = {"step": str, "commit": str, "sources_sha256": str, "device": str, "driver": str, "cuda": str,
            "date": str, "verdict": str, "wall_s": (int, float), "figures": dict, "log_excerpt": str}
EXIT_UNAVAILABLE = 69  # a step's tool cannot run on this machine (EX_UNAVAILABLE)
EXIT_PARTIAL = 75      # a resumable step stopped for time (EX_TEMPFAIL): recorded as CUT
GTEST_SKIPPED = re.compile(r"^\[  SKIPPED \] ([A-Za-z0-9_/]+\.[A-Za-z0-9_/]+)", re.M)
GTEST_PASSED = re.compile(r"^\[  PASSED  \] (\d+) tests?\.", re.M)
GTEST_FAILED = re.compile(r"^\[  FAILED  \] (\d+) tests?, listed below", re.M)
FIGURE = re.compile(r"^FIGURE ([A-Za-z0-9_.:/-]+)=(.*)$", re.M)
# Skips that are right on a one-GPU machine: StepCudaNoDevice checks the error without a GPU.
EXPECTED_SKIPS = r"^StepCudaNoDevice\.DeviceWeightsWithoutAGpuSayWhy$"
# Kept at the end of a deadline to pack what comes back; no step is started with less than
# MIN_STEP_S left. (The environment may shrink both, for tests/launch/test_gpu_ledger.py.)
RESERVE_S = int(os.environ.get("GPU_LEDGER_RESERVE_S", "10"))
MIN_STEP_S = int(os.environ.get("GPU_LEDGER_MIN_STEP_S", "20"))


class LedgerError(Exception):
    """One line for the user: what is wrong and where."""


def fail(msg, code=1):
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    sys.exit(code)


# ---- the file ------------------------------------------------------------------------------

def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise LedgerError(f"{path}: cannot read ({e.strerror})")
    except ValueError as e:
        raise LedgerError(f"{path}: not JSON ({e})")
    validate(doc, path)
    return doc


def validate(doc, path):
    if not isinstance(doc, dict) or not isinstance(doc.get("steps"), list) or not isinstance(doc.get("runs"), list):
        raise LedgerError(f"{path}: not a ledger (top-level 'steps' and 'runs' lists)")
    groups = doc.get("groups", {})
    if not isinstance(groups, dict) or not all(isinstance(v, list) for v in groups.values()):
        raise LedgerError(f"{path}: 'groups' must map names to lists of patterns")
    names = set()
    for i, s in enumerate(doc["steps"]):
        where = f"{path}: steps[{i}]"
        if not isinstance(s, dict):
            raise LedgerError(f"{where}: not an object")
        for key, kind in STEP_KEYS.items():
            if not isinstance(s.get(key), kind) or isinstance(s.get(key), bool):
                raise LedgerError(f"{where}: '{key}' missing or not {kind.__name__}")
        if not re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", s["name"]):
            raise LedgerError(f"{where}: name '{s['name']}' (lower-case letters, digits, '.', '_', '-')")
        if s["name"] in names:
            raise LedgerError(f"{where}: step '{s['name']}' appears twice")
        names.add(s["name"])
        if s["limit_s"] <= 0:
            raise LedgerError(f"{where} ({s['name']}): limit_s must be positive")
        if not s["sources"] or not all(isinstance(p, str) and p for p in s["sources"]):
            raise LedgerError(f"{where} ({s['name']}): sources must be a non-empty list of patterns")
        for p in s["sources"]:
            if p.startswith("@") and p[1:] not in groups:
                raise LedgerError(f"{where} ({s['name']}): no source group '{p[1:]}'")
        if "skips_ok" in s:
            try:
                re.compile(s["skips_ok"])
            except re.error as e:
                raise LedgerError(f"{where} ({s['name']}): skips_ok is not a regex ({e})")
    for i, r in enumerate(doc["runs"]):
        where = f"{path}: runs[{i}]"
        if not isinstance(r, dict):
            raise LedgerError(f"{where}: not an object")
        for key, kind in RUN_KEYS.items():
            if not isinstance(r.get(key), kind) or isinstance(r.get(key), bool):
                raise LedgerError(f"{where}: '{key}' missing or of the wrong type")
        if r["verdict"] not in VERDICTS:
            raise LedgerError(f"{where}: verdict '{r['verdict']}' (one of {', '.join(VERDICTS)})")


def save(doc, path):
    """Written beside and renamed: a ledger is whole or untouched."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text(path, text):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


# ---- sources -------------------------------------------------------------------------------

def expand(patterns, groups):
    out = []
    for p in patterns:
        out.extend(expand(groups[p[1:]], groups) if p.startswith("@") else [p])
    return out


def matched_files(patterns, root):
    """The regular files the patterns match under root, '!pattern' removing matches; sorted."""
    files = set()
    for p in patterns:
        neg = p.startswith("!")
        hits = {os.path.relpath(h, root) for h in glob.glob(os.path.join(root, p[1:] if neg else p), recursive=True)
                if os.path.isfile(h)}
        files = files - hits if neg else files | hits
    return sorted(f for f in files if "__pycache__" not in f.split(os.sep))


def sources_sha256(step, groups, root):
    """SHA-256 over 'sha256(content)  path' lines of the step's files, sorted by path: a changed,
    added, removed or renamed file changes it."""
    h = hashlib.sha256()
    for rel in matched_files(expand(step["sources"], groups), root):
        with open(os.path.join(root, rel), "rb") as f:
            h.update(f"{hashlib.sha256(f.read()).hexdigest()}  {rel}\n".encode())
    return h.hexdigest()


def all_hashes(doc, root):
    groups = doc.get("groups", {})
    return {s["name"]: sources_sha256(s, groups, root) for s in doc["steps"]}


# ---- what is due ---------------------------------------------------------------------------

def runs_of(doc, name):
    return [r for r in doc["runs"] if r["step"] == name]


def state(doc, step, sha):
    """(word, run): 'verified' with the PASS run for these sources; else 'failed' (the latest
    run failed), 'stale' (passed on other sources), 'cut', 'unavailable' or 'never run'."""
    runs = runs_of(doc, step["name"])
    for r in reversed(runs):
        if r["sources_sha256"] == sha and r["verdict"] == "PASS":
            return "verified", r
    if not runs:
        return "never run", None
    last = runs[-1]
    if last["verdict"] == "FAIL":
        return "failed", last
    if last["verdict"] == "CUT":
        return "cut", last
    if last["verdict"] == "UNAVAILABLE":
        return "unavailable", last
    return "stale", last


def plan(doc, hashes):
    """The steps not PASS for their sources: a step whose latest run failed first (it stays first
    in line after a fix), then by priority, then in file order."""
    due = []
    for i, s in enumerate(doc["steps"]):
        word, _ = state(doc, s, hashes[s["name"]])
        if word != "verified":
            due.append((0 if word == "failed" else 1, s["priority"], i, s))
    return [s for *_, s in sorted(due, key=lambda x: x[:3])]


def select(doc, only):
    """Steps named by --only: exact names or a prefix followed by '.', in priority order."""
    wanted = [w for w in only.split(",") if w]
    steps = sorted(doc["steps"], key=lambda s: s["priority"])
    out = []
    for w in wanted:
        hits = [s for s in steps if s["name"] == w or s["name"].startswith(w + ".")]
        if not hits:
            raise LedgerError(f"--only: no step named '{w}' or '{w}.*' (gpu_ledger.py status lists them)")
        out.extend(h for h in hits if h not in out)
    return sorted(out, key=lambda s: s["priority"])


# ---- running -------------------------------------------------------------------------------

def device_facts():
    """(device, driver, cuda) from nvidia-smi; 'unknown' where it cannot tell."""
    def ask(args):
        try:
            p = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
            return p.stdout.strip() if p.returncode == 0 else ""
        except (OSError, subprocess.TimeoutExpired):
            return ""
    q = ask(["--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]).splitlines()
    device, driver = "unknown", "unknown"
    if q:
        parts = [x.strip() for x in q[0].split(",")]
        if len(parts) >= 3:
            device, driver = f"{parts[0]}, {parts[1]}" + (f" (×{len(q)})" if len(q) > 1 else ""), parts[2]
    m = re.search(r"CUDA Version:\s*([0-9.]+)", ask([]))
    cuda = f"driver API {m.group(1)}" if m else "unknown"
    return device, driver, cuda


def log_excerpt(text, limit=3000):
    """The lines that say what failed (gtest failures, errors) and the log's last lines."""
    lines = text.splitlines()
    key = [ln for ln in lines if re.search(r"\[  FAILED  \]|Failure|[Ee]rror|Expected|Which is|TIMEOUT|CUT", ln)]
    tail = lines[-25:]
    picked = key[:25] + (["..."] if key else []) + tail
    out = "\n".join(picked)
    return out[-limit:]


def figures_of(text):
    figs = {k: v.strip() for k, v in FIGURE.findall(text)}
    passed = GTEST_PASSED.findall(text)
    failed = GTEST_FAILED.findall(text)
    if passed:
        figs.setdefault("tests_passed", str(sum(int(x) for x in passed)))
    if failed:
        figs.setdefault("tests_failed", str(sum(int(x) for x in failed)))
    return figs


def run_command(command, env, log_path, limit, cwd):
    """Runs `bash -c command` in its own process group with output to log_path; kills the group
    at the limit. Returns (rc, timed_out, seconds)."""
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        p = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = p.wait(timeout=limit)
            return rc, False, time.monotonic() - t0
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            return None, True, time.monotonic() - t0


def verdict_of(step, rc, timed_out, cut, text):
    """(verdict, note): a step's run read from its exit status and output."""
    if timed_out:
        return ("CUT", "cut at the deadline") if cut else ("FAIL", f"timed out after {step['limit_s']} s")
    if rc == EXIT_UNAVAILABLE:
        return "UNAVAILABLE", "its tool cannot run on this machine"
    if rc == EXIT_PARTIAL:
        return "CUT", "stopped for time, resumable"
    if rc != 0:
        return "FAIL", f"exit {rc}"
    allowed = re.compile(EXPECTED_SKIPS + ("|" + step["skips_ok"] if step.get("skips_ok") else ""))
    skipped = sorted({t for t in GTEST_SKIPPED.findall(text) if not allowed.search(t)})
    if skipped:
        return "FAIL", "skipped on a GPU machine: " + ", ".join(skipped)
    return "PASS", ""


class Runner:
    def __init__(self, args, doc, hashes, commit, built_with):
        self.a, self.doc, self.hashes, self.commit, self.built_with = args, doc, hashes, commit, built_with
        self.t0 = time.monotonic()
        self.summary = []
        self.device, self.driver, self.cuda = device_facts()
        if built_with:
            self.cuda += f"; built with {built_with}"
        os.makedirs(os.path.join(args.work, "logs"), exist_ok=True)
        os.makedirs(args.out, exist_ok=True)

    def left(self):
        return self.a.deadline - (time.monotonic() - self.t0) if self.a.deadline else None

    def say(self, line):
        print(line, flush=True)
        self.summary.append(line)

    def pack(self):
        """What comes back, rewritten after every step (a call cut short still returns it): the
        ledger, its Markdown, the summary, and one archive of the logs — four files."""
        out = self.a.out
        save(self.doc, os.path.join(out, "gpu-ledger.json"))
        write_text(os.path.join(out, "gpu-ledger.md"), render(self.doc))
        write_text(os.path.join(out, "summary.txt"), "\n".join(self.summary) + "\n")
        tmp = os.path.join(out, "gpu-verify.tar.gz.tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            for name in sorted(os.listdir(self.a.work)):
                if name in ("models", "site", "keep"):  # large or installed, not results
                    continue
                tar.add(os.path.join(self.a.work, name), arcname=name)
        os.replace(tmp, os.path.join(out, "gpu-verify.tar.gz"))

    def run_step(self, step):
        name, limit, cut_possible = step["name"], step["limit_s"], False
        left = self.left()
        if left is not None:
            left -= RESERVE_S
            if left < MIN_STEP_S:
                self.say(f"{name:<44} NOT RUN (deadline)")
                return None
            if left < limit:
                limit, cut_possible = int(left), True
        log_path = os.path.join(self.a.work, "logs", f"{name}.log")
        env = dict(os.environ, BIN=self.a.bin, WORK=self.a.work, REPO=self.a.root, STEP=name,
                   LEDGER_STEP_LIMIT=str(limit))
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"=== {name}: {step['command']}\n")
        rc, timed_out, wall = run_command(step["command"], env, log_path, limit, self.a.root)
        with open(log_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        verdict, note = verdict_of(step, rc, timed_out, cut_possible, text)
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"=== {name}: {verdict} after {wall:.0f} s{': ' + note if note else ''}\n")
        run = {"step": name, "commit": self.commit, "sources_sha256": self.hashes[name], "device": self.device,
               "driver": self.driver, "cuda": self.cuda,
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "verdict": verdict, "wall_s": round(wall, 1), "figures": figures_of(text),
               "log_excerpt": "" if verdict == "PASS" else (note + "\n" + log_excerpt(text)).strip()}
        if note and verdict != "PASS":
            run["figures"].setdefault("note", note)
        self.doc["runs"].append(run)
        figs = ", ".join(f"{k}={v}" for k, v in run["figures"].items() if k != "note")
        self.say(f"{name:<44} {verdict:<12} {wall:6.0f} s  {note if verdict != 'PASS' else figs}".rstrip())
        self.pack()
        return verdict

    def run(self, steps):
        self.say(f"gpu-verify {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ} commit {self.commit}"
                 f" on {self.device}, driver {self.driver}, {self.cuda}"
                 + (f"; deadline {self.a.deadline} s" if self.a.deadline else ""))
        self.say(f"{len(steps)} step(s): " + (", ".join(s["name"] for s in steps) or "none (every step verified)"))
        verdicts = [self.run_step(s) for s in steps]
        done = [v for v in verdicts if v]
        counts = {v: done.count(v) for v in VERDICTS if done.count(v)}
        not_run = verdicts.count(None)
        status = 1 if "FAIL" in done else (3 if not_run or set(done) - {"PASS"} else 0)
        self.say(f"--- exit {status}: " + (", ".join(f"{n} {v}" for v, n in counts.items()) or "nothing ran")
                 + (f", {not_run} not run" if not_run else "")
                 + f"; {sum(1 for s in self.doc['steps'] if state(self.doc, s, self.hashes[s['name']])[0] == 'verified')}"
                 f" of {len(self.doc['steps'])} steps verified for these sources")
        self.pack()
        return status


# ---- Markdown ------------------------------------------------------------------------------

def cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def latest(doc, name, verdict=None):
    for r in reversed(doc["runs"]):
        if r["step"] == name and (verdict is None or r["verdict"] == verdict):
            return r
    return None


def render(doc):
    """The Markdown view of the JSON alone (what passed where, on which sources); whether a PASS
    still holds for a tree is `gpu_ledger.py status` (it hashes that tree's files)."""
    steps = sorted(doc["steps"], key=lambda s: s["priority"])
    passed = sum(1 for s in steps if latest(doc, s["name"], "PASS"))
    out = ["# GPU verification ledger", "",
           "Generated from [gpu-ledger.json](gpu-ledger.json) by `python3 launch/gpu_ledger.py render`; do not edit.",
           "A step is verified only for the sources it passed on (the SHA-256 of its files, listed below):",
           "`python3 launch/gpu_ledger.py status` says which PASS still holds for the tree at hand, and",
           "`launch/gpu-verify.sh --next` runs the rest in priority order on a lent GPU, a step whose last run",
           "failed first ([benchmarks](benchmarks.md#the-gpu-ledger) has the whole device call).", "",
           f"**{passed} of {len(steps)} steps have passed on a GPU at some commit; {len(doc['runs'])} runs recorded.**",
           "", "| priority | step | last run | last PASS | limit | what it checks |", "|---|---|---|---|---|---|"]
    for s in steps:
        r, p = latest(doc, s["name"]), latest(doc, s["name"], "PASS")
        last = "never run" if r is None else f"{r['verdict']} {r['date'][:10]}, {r['device'].split(',')[0]}, {r['commit']}"
        good = "—" if p is None else f"{p['date'][:10]} at {p['commit']}, sources {p['sources_sha256'][:12]}"
        out.append(f"| {s['priority']} | `{s['name']}` | {cell(last)} | {cell(good)} | {s['limit_s']} s | "
                   f"{cell(s.get('what', ''))} |")
    out += ["", "## Runs, newest first", ""]
    if not doc["runs"]:
        out.append("No step has run on a GPU yet.")
    else:
        out += ["| date | step | verdict | wall | device | driver, CUDA | commit | sources | figures |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in reversed(doc["runs"]):
            figs = "; ".join(f"{k} {v}" for k, v in r["figures"].items())
            out.append(f"| {r['date']} | `{r['step']}` | {r['verdict']} | {r['wall_s']:.0f} s | {cell(r['device'])} | "
                       f"{cell(r['driver'])}, {cell(r['cuda'])} | {r['commit']} | {r['sources_sha256'][:12]} | "
                       f"{cell(figs)} |")
        failures = [r for r in reversed(doc["runs"]) if r["log_excerpt"]]
        if failures:
            out += ["", "## Log excerpts of the runs that did not pass", ""]
            for r in failures:
                out += [f"**{r['step']}**, {r['date']}, {r['verdict']}:", "", "```", r["log_excerpt"], "```", ""]
    out += ["", "## Steps: commands and sources", "",
            "`$BIN` is the bundle's programs, `$WORK` the call's scratch folder (its logs come back), `$REPO` the tree.", ""]
    for s in steps:
        out += [f"- `{s['name']}` (priority {s['priority']}, {s['limit_s']} s; sources "
                + ", ".join(f"`{p}`" for p in s["sources"]) + ")", "", "  ```", f"  {s['command']}", "  ```"]
    groups = doc.get("groups", {})
    if groups:
        out += ["", "Source groups: " + "; ".join(f"`@{k}` = " + ", ".join(f"`{p}`" for p in v)
                                              for k, v in groups.items()) + "."]
    return "\n".join(out).rstrip() + "\n"


# ---- commands ------------------------------------------------------------------------------

def git_commit(root):
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short=10", "HEAD"], capture_output=True,
                              text=True, timeout=30)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=60).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def read_manifest(path):
    try:
        with open(path, encoding="utf-8") as f:
            m = json.load(f)
        if not isinstance(m.get("sources_sha256"), dict):
            raise ValueError("no sources_sha256")
        return m
    except (OSError, ValueError) as e:
        raise LedgerError(f"{path}: not a bundle manifest ({e})")


def cmd_run(a):
    doc = load(a.ledger)
    for d in (a.work, a.out):
        if os.path.realpath(d) == os.path.realpath(a.root):
            raise LedgerError(f"{d}: would write into the repository root")
    hashes = all_hashes(doc, a.root)
    commit, built_with = git_commit(a.root), ""
    if a.manifest:
        m = read_manifest(a.manifest)
        commit, built_with = m.get("commit", commit), m.get("nvcc", "")
        stale = sorted(n for n in hashes if n in m["sources_sha256"] and m["sources_sha256"][n] != hashes[n])
        if stale:
            print(f"{PROG}: warning: the bundle was built from other sources than this tree for "
                  f"{', '.join(stale)}: their runs are recorded for the bundle's sources "
                  "(rebuild it with launch/gpu-bundle.sh)", file=sys.stderr)
        hashes.update({n: h for n, h in m["sources_sha256"].items() if n in hashes})
    steps = select(doc, a.only) if a.only else plan(doc, hashes)
    if a.dry_run:
        for s in steps:
            print(f"{s['name']:<44} {s['limit_s']:>4} s  {s['command']}")
        return 0
    return Runner(a, doc, hashes, commit, built_with).run(steps)


def cmd_status(a):
    doc = load(a.ledger)
    hashes = all_hashes(doc, a.root)
    n = 0
    for s in sorted(doc["steps"], key=lambda s: s["priority"]):
        word, r = state(doc, s, hashes[s["name"]])
        n += word == "verified"
        last = "" if r is None else f"  ({r['verdict']} {r['date'][:10]} on {r['device'].split(',')[0]}, {r['commit']})"
        print(f"{s['priority']:>5}  {s['name']:<44} {word}{last}")
    print(f"{n} of {len(doc['steps'])} steps verified for this tree's sources")
    return 0


def cmd_plan(a):
    doc = load(a.ledger)
    for s in plan(doc, all_hashes(doc, a.root)):
        print(f"{s['name']:<44} {s['limit_s']:>4} s")
    return 0


def cmd_hashes(a):
    doc = load(a.ledger)
    print(json.dumps(all_hashes(doc, a.root), indent=2))
    return 0


def md_path(ledger):
    return os.path.splitext(ledger)[0] + ".md"


def cmd_render(a):
    doc = load(a.ledger)
    write_text(md_path(a.ledger), render(doc))
    print(f"{PROG}: wrote {md_path(a.ledger)}")
    return 0


def cmd_check(a):
    doc = load(a.ledger)
    groups, bad = doc.get("groups", {}), []
    for s in doc["steps"]:
        for p in expand(s["sources"], groups):
            if not p.startswith("!") and not matched_files([p], a.root):
                bad.append(f"step {s['name']}: source pattern '{p}' matches no file")
    for name, pats in groups.items():
        for p in pats:
            if not p.startswith(("!", "@")) and not matched_files([p], a.root):
                bad.append(f"group {name}: source pattern '{p}' matches no file")
    try:
        with open(md_path(a.ledger), encoding="utf-8") as f:
            md = f.read()
    except OSError:
        md = None
    if md != render(doc):
        bad.append(f"{md_path(a.ledger)} is not what the JSON gives: run python3 launch/gpu_ledger.py render")
    for b in bad:
        print(f"{PROG}: {b}", file=sys.stderr)
    if not bad:
        print(f"{PROG}: {a.ledger}: {len(doc['steps'])} steps, {len(doc['runs'])} runs; every pattern matches; "
              f"{md_path(a.ledger)} is up to date")
    return 1 if bad else 0


def cmd_absorb(a):
    doc = load(a.ledger)
    new = load(a.returned)
    # The returned ledger is this one as it was at the call plus the call's runs: take the runs it
    # holds more often than this one does (a multiset difference; runs alike in every field count).
    key = lambda r: json.dumps(r, sort_keys=True)  # noqa: E731
    have = collections.Counter(key(r) for r in doc["runs"])
    added = []
    for r in new["runs"]:
        if have[key(r)] > 0:
            have[key(r)] -= 1
        else:
            added.append(r)
    names = {s["name"] for s in doc["steps"]}
    unknown = sorted({r["step"] for r in added} - names)
    if unknown:
        raise LedgerError(f"{a.returned}: runs of steps this ledger does not have: {', '.join(unknown)}")
    doc["runs"] = sorted(doc["runs"] + added, key=lambda r: r["date"])  # stable: same-second runs keep their order
    save(doc, a.ledger)
    write_text(md_path(a.ledger), render(doc))
    print(f"{PROG}: {len(added)} run(s) added to {a.ledger}; wrote {md_path(a.ledger)}")
    return 0


def cmd_preflight(a):
    """A stale bundle wastes a lent call: its manifest's hashes must be this tree's."""
    try:
        with tarfile.open(a.bundle, "r:xz") as tar:
            member = next((m for m in tar.getmembers() if m.name.endswith("/manifest.json")), None)
            if member is None:
                raise LedgerError(f"{a.bundle}: no manifest.json in it (rebuild it with launch/gpu-bundle.sh)")
            m = json.load(tar.extractfile(member))
    except (OSError, tarfile.TarError, ValueError) as e:
        raise LedgerError(f"{a.bundle}: not a readable bundle ({e})")
    if not isinstance(m.get("sources_sha256"), dict):
        raise LedgerError(f"{a.bundle}: its manifest.json has no sources_sha256")
    doc = load(a.ledger)
    here = all_hashes(doc, a.root)
    size = os.path.getsize(a.bundle)
    print(f"{PROG}: bundle {a.bundle}: commit {m.get('commit')}, built {m.get('built')}, {size / 2**20:.1f} MiB")
    stale = sorted(n for n in here if m["sources_sha256"].get(n) != here[n])
    if stale:
        raise LedgerError(f"{a.bundle} is stale for {len(stale)} step(s) ({', '.join(stale[:5])}"
                          f"{', ...' if len(stale) > 5 else ''}): rebuild it (./launch/build.sh && ./launch/gpu-bundle.sh)")
    if size > 48 * 2**20:
        raise LedgerError(f"{a.bundle}: {size / 2**20:.0f} MiB leaves under 16 MiB of a device call's 64 MiB")
    due = plan(doc, here)
    print(f"{PROG}: the bundle matches this tree's sources; --next runs {len(due)} step(s), first "
          + ", ".join(s["name"] for s in due[:8]) + (", ..." if len(due) > 8 else ""))
    return 0


def main(argv):
    root_default = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(prog="gpu_ledger.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(q):
        q.add_argument("--ledger", default=os.path.join(root_default, "docs", "gpu-ledger.json"))
        q.add_argument("--root", default=root_default, help="the tree the source patterns are read in")
        return q

    r = common(sub.add_parser("run", help="run steps and record them"))
    g = r.add_mutually_exclusive_group(required=True)
    g.add_argument("--next", action="store_true", help="the steps not yet PASS for their sources")
    g.add_argument("--only", metavar="STEPS", help="comma-separated step names or prefixes (run even if PASS)")
    r.add_argument("--deadline", type=int, default=0, metavar="S",
                   help="start no step after S seconds and cut the running one there (0: none)")
    r.add_argument("--bin", required=True, help="the folder of the programs ($BIN in commands)")
    r.add_argument("--work", required=True, help="scratch: logs, JSON, models ($WORK in commands)")
    r.add_argument("--out", required=True, help="what comes back: the ledger, its Markdown, summary, logs")
    r.add_argument("--manifest", help="the bundle's manifest.json: its commit and sources' hashes are recorded")
    r.add_argument("--dry-run", action="store_true", help="print the steps and run nothing")
    for name, helptext in (("status", "verified steps for this tree"), ("plan", "the order of --next"),
                           ("hashes", "sources' SHA-256 per step"), ("render", "write the Markdown"),
                           ("check", "layout, patterns, Markdown up to date")):
        common(sub.add_parser(name, help=helptext))
    pf = common(sub.add_parser("preflight", help="a bundle against this tree, before a device call"))
    pf.add_argument("bundle", help="the .tar.xz launch/gpu-bundle.sh wrote")
    ab = common(sub.add_parser("absorb", help="add a returned ledger's runs"))
    ab.add_argument("returned", help="the gpu-ledger.json a device call returned")
    a = p.parse_args(argv)
    if getattr(a, "deadline", 0) < 0:
        p.error("--deadline must be >= 0")
    try:
        return {"run": cmd_run, "status": cmd_status, "plan": cmd_plan, "hashes": cmd_hashes, "render": cmd_render,
                "check": cmd_check, "absorb": cmd_absorb,
                "preflight": cmd_preflight}[a.cmd](a)
    except LedgerError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted", 130)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
