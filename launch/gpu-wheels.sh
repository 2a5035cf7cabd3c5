#!/usr/bin/env bash
# Downloads, as wheels into DIR (default .whl/, git-ignored), the Python packages that the TRIM-KV
# authors' code needs and the lent GPU machines lack: their image has transformers 5.x, and
# trimkv 0.1.5 pins transformers 4.57.1 (with tokenizers < 0.23 and huggingface_hub < 1.0).
# Those machines reach no package index, so the wheels travel with the working tree: carry DIR
# beside the bundle (device `run` with carry [".gpu.tar.xz", ".whl"]); there,
# `launch/gpu-verify.sh --only reference` installs them into a private folder (the image's own
# transformers stays as it is) and times the reference trainer beside retain.
# usage: launch/gpu-wheels.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in -h|--help) sed -n 2,9p "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
dest=${1:-.whl}
# The versions the trimkv venv of the CPU checks uses (tests/live), for CPython 3.12 on x86-64
# Linux (the device image's python3).
pkgs=(transformers==4.57.1 tokenizers==0.22.2 huggingface_hub==0.36.2 trimkv==0.1.5)
rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any -d "$dest.tmp" "${pkgs[@]}" ||
  { echo "gpu-wheels: pip could not download ${pkgs[*]} (no package index here?)" >&2; rm -rf "$dest.tmp"; exit 1; }
rm -rf "$dest" && mv "$dest.tmp" "$dest"
echo "gpu-wheels: $(ls "$dest" | wc -l) wheels, $(du -sh "$dest" | cut -f1) in $dest: $(ls "$dest" | tr '\n' ' ')"
