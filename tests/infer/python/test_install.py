"""`pip install ./model/infer/python` gives an importable retain_kv named retain-kv (built offline
with the venv's setuptools), and the package imports without kvpress."""
import os
import shutil
import subprocess
import sys

from conftest import REPO


def test_pip_install(tmp_path):
    target, source = tmp_path / "site", tmp_path / "src"
    # From a copy: setuptools writes build/ and *.egg-info beside the sources it builds.
    shutil.copytree(os.path.join(REPO, "model", "infer", "python"), source,
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(source)],
                   check=True, capture_output=True, cwd=tmp_path)
    code = ("import importlib.metadata as m, sys, retain_kv; "
            "assert 'kvpress' not in sys.modules, 'retain_kv imported kvpress'; "
            "print(retain_kv.__file__, m.version('retain-kv'), ' '.join(sorted(retain_kv.__all__)))")
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env,
                         cwd=tmp_path).stdout.split()
    assert out[0].startswith(str(target)) and out[1] == "0.1.0"
    assert out[2:] == ["Policy", "RetainCache", "RetainPress", "load_policy", "remove_hooks"]
