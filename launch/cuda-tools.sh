#!/usr/bin/env bash
# Finds CUDA's disassembler tools, cuobjdump and nvdisasm (cuobjdump -sass runs nvdisasm from
# PATH), which the CUDA toolkit in /usr/local/cuda may lack: PATH, then /usr/local/cuda/bin, then
# BUILD_DIR/tools, where NVIDIA's PyPI wheels (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm, ~6 MB)
# are unpacked the first time. Prints the folder holding both; exit 1 with one line when they
# cannot be had (no package index here). Used by launch/sass-report.sh and launch/test.sh (the
# SASS checks of tests/cuda/test_sass_report.py).
# usage: launch/cuda-tools.sh [BUILD_DIR]   (default ${BUILD_DIR:-build})
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in -h|--help) sed -n 2,8p "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
tools="${1:-${BUILD_DIR:-build}}/tools"
for dir in $(dirname "$(command -v cuobjdump 2>/dev/null || echo /nonexistent/x)") /usr/local/cuda/bin "$tools"; do
  if [ -x "$dir/cuobjdump" ] && [ -x "$dir/nvdisasm" ]; then (cd "$dir" && pwd); exit 0; fi
done
mkdir -p "$tools/wheel"
# Pinned: the SASS checks parse this version's listing (it reads nvcc 13.0's sm_90a code).
version=13.5.37
for name in cuobjdump nvdisasm; do
  wheel=nvidia-cuda-$name
  if ! ls "$tools"/wheel/"${wheel//-/_}"-$version-*.whl >/dev/null 2>&1; then
    python3 -m pip download --quiet --no-deps --dest "$tools/wheel" "$wheel==$version" >&2 ||
      { echo "cuda-tools: pip could not download $wheel (install CUDA's $name instead)" >&2; exit 1; }
  fi
  file=$(ls "$tools"/wheel/"${wheel//-/_}"-$version-*.whl | head -n 1)
  # Unpacked beside, then renamed: a run cut short leaves no half-written tool.
  python3 -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); n = [f for f in z.namelist() if f.endswith('/bin/' + sys.argv[3])][0]; open(sys.argv[2], 'wb').write(z.read(n))" \
    "$file" "$tools/$name.tmp.$$" "$name" ||
    { rm -f "$tools/$name.tmp.$$"; echo "cuda-tools: $file: no bin/$name in it" >&2; exit 1; }
  chmod +x "$tools/$name.tmp.$$" && mv "$tools/$name.tmp.$$" "$tools/$name"
done
(cd "$tools" && pwd)
