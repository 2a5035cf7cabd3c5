#!/usr/bin/env bash
# Packs what launch/gpu-verify.sh runs into one folder that can be copied to a GPU machine
# without retain's build dependencies (HDF5, MPI, OpenBLAS, ...): the CUDA test binaries,
# retain-bench, the scripts they need, and every shared library they load that is not part of
# the C runtime or the NVIDIA driver. usage: launch/gpu-bundle.sh [DIR] (default .gpu/)
# Then, on the GPU machine: launch/gpu-verify.sh --bundle DIR
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in -h|--help) sed -n 2,6p "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
dest=${1:-.gpu}
build=${BUILD_DIR:-build}
bins=(test_gated_attention_cuda test_gated_attention_long test_capacity_cuda test_kvpop_cuda test_ops_cuda
      test_gemm_cuda test_loss_cuda test_gates_cuda test_step_cuda test_comm_cuda retain-bench retain-make-tiny)
for b in "${bins[@]}"; do
  [ -x "$build/bin/$b" ] || { echo "gpu-bundle: $build/bin/$b is missing: run launch/build.sh first" >&2; exit 1; }
done
rm -rf "$dest.tmp" && mkdir -p "$dest.tmp/bin" "$dest.tmp/lib"
for b in "${bins[@]}"; do cp "$build/bin/$b" "$dest.tmp/bin/"; done
# Libraries by the path the loader resolves here; the C and C++ runtimes (libc, libm, libdl,
# libpthread, librt, the loader, libstdc++, libgcc_s: a newer system has newer ones, which
# Python there needs too) and the driver (libcuda) stay behind.
for b in "${bins[@]}"; do ldd "$build/bin/$b"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libdl|libpthread|librt|ld-linux-x86-64|libcuda|libstdc\+\+|libgcc_s)\.so' |
  while read -r lib; do cp -L "$lib" "$dest.tmp/lib/"; done
rm -rf "$dest" && mv "$dest.tmp" "$dest"
echo "gpu-bundle: $dest: $(ls "$dest/bin" | wc -l) programs, $(ls "$dest/lib" | wc -l) libraries, $(du -sh "$dest" | cut -f1)"
