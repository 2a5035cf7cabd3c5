#!/usr/bin/env bash
# Prints the Python of the venv that retain_kv's tests run in (tests/infer/python), creating it
# first when it is missing: ~/.cache/retain/venvs/retain-kv-py<version>-<hash> (RETAIN_VENV_ROOT
# overrides the folder), the hash over model/infer/python/requirements-test.txt and the trimkv pin —
# a changed pin makes a new venv, an unchanged one is reused. Built in a temporary folder
# and renamed into place, under a lock, so an interrupted or concurrent run never leaves half a venv.
# torch comes from PyPI (the CPU-only index is not reachable here): the CUDA build, which runs on
# the CPU. The requirements are a pinned closure installed with --no-deps, less the CUDA libraries
# torch only loads when it computes on a GPU (GPU_ONLY below: cuDNN, cuBLAS, cuFFT, cuSOLVER,
# cuSPARSE, NVRTC, the runtime...): 3.5 GB installed instead of 5.9 (docs/inference.md). It keeps
# those torch's libraries link at import (cuFile, cuSPARSELt, NVSHMEM, NCCL) and Triton (torch's
# compiler probes it; the authors' trimkv imports it). RETAIN_VENV_GPU=1 installs everything.
# Exit 1 with one line on stderr when it cannot be built (no network, no python3-venv).
set -euo pipefail
cd "$(dirname "$0")/.."
REQ=model/infer/python/requirements-test.txt
TRIMKV=trimkv==0.1.5
PY=${RETAIN_PYTHON:-python3}
if ! command -v "$PY" >/dev/null; then
  echo "python-env.sh: no $PY to build the venv with (set RETAIN_PYTHON)" >&2
  exit 1
fi
version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
GPU_ONLY='^(cuda-toolkit|cuda-bindings|cuda-pathfinder|nvidia-cudnn-cu13|nvidia-cublas|nvidia-cuda-cccl|nvidia-cuda-cupti|nvidia-cuda-nvrtc|nvidia-cuda-runtime|nvidia-cufft|nvidia-cusolver|nvidia-cusparse|nvidia-nvjitlink|nvidia-nvtx)=='
[ "${RETAIN_VENV_GPU:-0}" = 1 ] && GPU_ONLY='^$'
key=$({ cat "$REQ"; echo "$TRIMKV"; echo "$GPU_ONLY"; } | sha256sum | cut -c1-12)
root=${RETAIN_VENV_ROOT:-$HOME/.cache/retain/venvs}
venv=$root/retain-kv-py$version-$key
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
  mkdir -p "$root"
  exec 9>"$venv.lock"
  flock 9
  if [ ! -f "$venv/.complete" ]; then
    tmp=$venv.tmp.$$
    rm -rf "$tmp" "$venv"
    echo "python-env.sh: creating $venv (one time, a few minutes)" >&2
    start=$(date +%s)
    if ! { "$PY" -m venv "$tmp" >&2 &&
           grep -vE "$GPU_ONLY" "$REQ" > "$tmp/requirements.txt" &&
           "$tmp/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r "$tmp/requirements.txt" >&2 &&
           "$tmp/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$TRIMKV" >&2; }; then
      rm -rf "$tmp"
      echo "python-env.sh: could not build the venv from $REQ (is PyPI reachable?)" >&2
      exit 1
    fi
    touch "$tmp/.complete"
    mv "$tmp" "$venv"
    echo "python-env.sh: venv ready in $(( $(date +%s) - start )) s" >&2
  fi
fi
echo "$venv/bin/python"
