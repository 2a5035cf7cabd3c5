"""What the live cross-checks against transformers share: skipping (exit 77) when the Python
packages are missing, a quiet offline transformers, and running retain's tools."""
import importlib
import os
import subprocess
import sys

SKIP = 77  # CTest SKIP_RETURN_CODE
# The TRIM-KV authors' package lives in a venv of its own (it pins transformers 4.57.1).
TRIMKV_PYTHON = os.environ.get("RETAIN_TRIMKV_PYTHON", os.path.expanduser("~/.cache/retain/venvs/trimkv/bin/python"))


def import_or_skip(prog, modules):
    """Exits SKIP, naming what is missing, unless every module imports."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # ImportError, or a broken install (e.g. OSError from a .so)
            missing.append(f"{name} ({type(e).__name__}: {e})")
    if missing:
        print(f"{prog}: skipped: cannot import " + "; ".join(missing), flush=True)
        sys.exit(SKIP)


def trimkv_python_or_skip(prog, python, modules):
    """Exits SKIP, saying why, unless `python` is an executable that imports every module."""
    if not os.access(python, os.X_OK):
        print(f"{prog}: skipped: no trimkv Python at {python} (set RETAIN_TRIMKV_PYTHON)", flush=True)
        sys.exit(SKIP)
    if subprocess.run([python, "-c", "import " + ", ".join(modules)], capture_output=True).returncode != 0:
        print(f"{prog}: skipped: {', '.join(modules)} not all importable in {python}", flush=True)
        sys.exit(SKIP)


class Checks:
    """Named checks: each prints an "ok" or "FAIL" line; `bad` counts the failures."""

    def __init__(self):
        self.bad = 0

    def __call__(self, ok, what):
        print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        self.bad += not ok

    def verdict(self, prog):
        """The last line, and the exit status: 1 when a check failed."""
        print(f"{prog}: " + ("FAIL" if self.bad else "ok"))
        return 1 if self.bad else 0


def quiet_transformers():
    """(torch, transformers), offline and without warnings or progress bars."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass
    return torch, transformers


def tools_present(prog, bin_dir, tools):
    """True when every tool is an executable in bin_dir; otherwise says which is not."""
    for tool in tools:
        if not os.access(os.path.join(bin_dir, tool), os.X_OK):
            print(f"{prog}: {tool} not found in {bin_dir} (build the project first)", flush=True)
            return False
    return True


def run_tool(args):
    """Runs a command; a non-zero exit raises with its stderr."""
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {r.returncode}: {r.stderr.strip()}")
    return r
