#!/usr/bin/env bash
# Packs what launch/gpu-verify.sh runs into one folder that can be copied to a GPU machine
# without retain's build dependencies (HDF5, MPI, OpenBLAS, ...): the CUDA test binaries,
# retain-bench, the scripts they need, and every shared library they load that is not part of
# the C runtime or the NVIDIA driver. usage: launch/gpu-bundle.sh [DIR] (default .gpu/)
# Where mpirun is Open MPI, DIR/mpi also holds a relocatable one-node Open MPI runtime (mpirun,
# its plugins and help files, the PMIx it uses; DIR/mpi/env.sh points them at DIR), so that
# test_comm_cuda can run as two ranks on a GPU machine without MPI.
# It also writes DIR.tar.xz (~20 MB; the folder is ~100 MB, mostly OpenBLAS): that archive is
# what to carry to a device machine whose transfer limit the folder exceeds.
# It writes DIR/manifest.json: the commit and the SHA-256 of every ledger step's sources.
# Then, on the GPU machine: launch/gpu-verify.sh --bundle DIR.tar.xz --next --deadline 500
# (docs/benchmarks.md, "The GPU ledger": the whole device call).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in -h|--help) sed -n 2,13p "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
dest=${1:-.gpu}
build=${BUILD_DIR:-build}
bins=(test_cuda_emu test_gated_attention_cuda test_gated_attention_long test_attention_span_cuda test_capacity_cuda test_capacity_span_cuda test_kvpop_cuda test_ops_cuda
      test_gemm_cuda test_loss_cuda test_gates_cuda test_step_cuda test_kvpop_step_cuda test_comm_cuda test_train_cuda
      retain-bench retain-make-tiny retain-train retain-pack retain-forward retain-eval)
for b in "${bins[@]}"; do
  [ -x "$build/bin/$b" ] || { echo "gpu-bundle: $build/bin/$b is missing: run launch/build.sh first" >&2; exit 1; }
done
rm -rf "$dest.tmp" && mkdir -p "$dest.tmp/bin" "$dest.tmp/lib"
for b in "${bins[@]}"; do cp "$build/bin/$b" "$dest.tmp/bin/"; done
# The NVTX injection library TrainCuda.NvtxRangesCoverEveryPhase loads (gpu-verify.sh points
# RETAIN_NVTX_RECORDER at it); a build without the CUDA toolkit has none, and no ranges.
[ ! -f "$build/lib/libretain_nvtx_recorder.so" ] || cp "$build/lib/libretain_nvtx_recorder.so" "$dest.tmp/lib/"
# The kernels' static instruction counts per loop (launch/sass-report.sh: needs cuobjdump, or
# pip to fetch it); gpu-verify.sh puts them beside ncu's executed-instruction counts.
if BUILD_DIR=$build launch/sass-report.sh >"$dest.tmp/sass-report.txt" 2>/dev/null; then
  echo "gpu-bundle: sass-report.txt (the kernels' loops from their SASS)"
else
  rm -f "$dest.tmp/sass-report.txt"
  echo "gpu-bundle: no SASS report (no cuobjdump here)"
fi
# Libraries by the path the loader resolves here; the C and C++ runtimes (libc, libm, libdl,
# libpthread, librt, the loader, libstdc++, libgcc_s: a newer system has newer ones, which
# Python there needs too), the driver (libcuda), and cuBLAS and NCCL (0.7 GB; a GPU machine has
# its own, which gpu-verify.sh finds) stay behind. copy_deps FILE... copies those of FILE...
# that $dest.tmp/lib lacks.
copy_deps() {
  for f in "$@"; do ldd "$f"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
    { grep -Ev '/(libc|libm|libdl|libpthread|librt|ld-linux-x86-64|libcuda|libstdc\+\+|libgcc_s|libcublas|libcublasLt|libnccl)\.so' || true; } |
    while read -r lib; do
      [ -e "$dest.tmp/lib/$(basename "$lib")" ] || cp -L "$lib" "$dest.tmp/lib/"
    done
}
copy_deps "${bins[@]/#/$build/bin/}"
# The manifest the ledger records runs under (docs/gpu-ledger.md): the commit and, per step, the
# SHA-256 of the sources this build was made from; `launch/gpu-verify.sh --preflight` compares
# it with the tree before a device call.
nvcc_version=$( (nvcc --version || /usr/local/cuda/bin/nvcc --version) 2>/dev/null | sed -n 's/^Cuda compilation tools, //p')
commit=$(git rev-parse --short=10 HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || commit+="+dirty"
python3 launch/gpu_ledger.py hashes >"$dest.tmp/hashes.json"
python3 - "$dest.tmp" "$commit" "${nvcc_version:-no nvcc}" <<'PY'
import datetime, json, os, sys
d, commit, nvcc = sys.argv[1:]
with open(os.path.join(d, "hashes.json")) as f:
    hashes = json.load(f)
os.remove(os.path.join(d, "hashes.json"))
with open(os.path.join(d, "manifest.json"), "w") as f:
    json.dump({"commit": commit, "built": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "nvcc": f"nvcc {nvcc}", "sources_sha256": hashes}, f, indent=2)
PY

# Open MPI for one node under $dest/mpi, laid out as its install tree below the prefix: Open MPI
# puts OPAL_PREFIX (set by mpi/env.sh) for ${prefix} in its configured directories. The
# libraries (libmpi, libopen-rte, libpmix, ...) go to $dest/lib with the programs' own.
bundle_mpi() {
  local mpirun version bindir prefix pkglibdir pkgdatadir m plugins p
  mpirun=$(command -v mpirun) || { echo "gpu-bundle: no mpirun here: no MPI runtime in the bundle"; return 0; }
  bindir=$(dirname "$(readlink -f "$mpirun")")
  # (Strings, not pipes into grep -q: with pipefail, a writer cut short by SIGPIPE fails.)
  version=$("$mpirun" --version 2>&1 || true) version=${version%%$'\n'*}
  if [[ "$version" != *"Open MPI"* ]] || [ ! -x "$bindir/ompi_info" ]; then
    echo "gpu-bundle: $mpirun is not Open MPI: no MPI runtime in the bundle"; return 0
  fi
  opath() { "$bindir/ompi_info" --parsable --path "$1" | sed -n "s|^path:$1:||p"; }
  prefix=$(opath prefix) pkglibdir=$(opath pkglibdir) pkgdatadir=$(opath pkgdatadir)
  for p in "$bindir" "$pkglibdir" "$pkgdatadir"; do
    case "$p" in "$prefix"/*) ;; *)
      echo "gpu-bundle: Open MPI's $p is outside its prefix $prefix: no MPI runtime in the bundle"; return 0 ;;
    esac
  done
  m=$dest.tmp/mpi plugins=$dest.tmp/mpi/${pkglibdir#"$prefix"/}
  mkdir -p "$m/bin" "$plugins" "$m/${pkgdatadir#"$prefix"/}" "$m/etc"
  # Real files, not links (mpirun and mpiexec link to orterun). orted is for other nodes, kept
  # because it is small; ompi_info for a look at what loads there.
  for p in mpirun mpiexec orterun orted ompi_info; do
    if [ -x "$bindir/$p" ]; then cp -L "$bindir/$p" "$m/bin/"; fi
  done
  # Plugins, less those for fabrics one node does not use, whose libraries (UCX, libfabric,
  # verbs, PSM, netlink) are large or absent there, OpenSHMEM's, and any that does not load
  # here: Open MPI only tries the plugins it finds.
  local heavy='/lib(uc[mpst]|fabric|ibverbs|rdmacm|efa|psm2?|psm_infinipath|infinipath|nl(-route)?-3|numa|oshmem|mca_common_(ucx|ofi|verbs))\.so'
  local left_out=()
  local libs
  for p in "$pkglibdir"/mca_*.so; do
    libs=$(ldd "$p")
    if [[ "$libs" == *"not found"* ]] || grep -Eq "$heavy" <<<"$libs"; then
      left_out+=("$(basename "$p" .so)")
    else
      cp "$p" "$plugins/"
    fi
  done
  echo "gpu-bundle: Open MPI plugins left out: ${left_out[*]:-none}"
  # Help files: without them an error says only that its help file is missing.
  cp -r "$pkgdatadir"/help-*.txt "$m/${pkgdatadir#"$prefix"/}/"
  if [ -d "$pkgdatadir/amca-param-sets" ]; then cp -r "$pkgdatadir/amca-param-sets" "$m/${pkgdatadir#"$prefix"/}/"; fi
  # An external PMIx (Open MPI 4's pmix ext*x plugin links libpmix): its plugins and help files
  # in mpi/lib/pmix and mpi/share/pmix. Debian configured its directories as absolute paths
  # (so PMIX_PREFIX alone moves nothing): env.sh names each one to PMIx 4's pinstalldirs.
  local libpmix pmixdir
  libpmix=$(ldd "$plugins"/mca_pmix_*.so 2>/dev/null | awk '$1 ~ /^libpmix\.so/ {print $3; exit}')
  if [ -n "$libpmix" ]; then
    pmixdir=$(dirname "$(readlink -f "$libpmix")")
    mkdir -p "$m/lib/pmix" "$m/share/pmix"
    if compgen -G "$pmixdir/pmix/*.so" >/dev/null; then cp "$pmixdir"/pmix/*.so "$m/lib/pmix/"; fi
    if compgen -G "$pmixdir/../share/pmix/help-*.txt" >/dev/null; then cp "$pmixdir"/../share/pmix/help-*.txt "$m/share/pmix/"; fi
  fi
  local pmix_plugins
  mapfile -t pmix_plugins < <(find "$m/lib/pmix" -name '*.so' 2>/dev/null)
  copy_deps "$m"/bin/* "$plugins"/*.so "${pmix_plugins[@]}"
  {
    echo "# Source this (bash) to run the bundled Open MPI ${version##* } wherever the bundle lies: one"
    echo "# node, shared memory, as root. Written by launch/gpu-bundle.sh from the Open MPI in $prefix"
    echo "# and the PMIx in ${pmixdir:-(none)}."
    cat <<'EOF'
_b=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The install directories. sysconfdir (Debian: /etc/openmpi) lies outside the prefix: an empty
# mpi/etc, so a GPU machine's own Open MPI or PMIx configuration is not read either.
export OPAL_PREFIX=$_b/mpi OPAL_SYSCONFDIR=$_b/mpi/etc
export PMIX_PREFIX=$_b/mpi PMIX_LIBDIR=$_b/mpi/lib PMIX_DATADIR=$_b/mpi/share PMIX_SYSCONFDIR=$_b/mpi/etc
export PMIX_MCA_mca_base_component_path=$_b/mpi/lib/pmix
export PATH=$_b/mpi/bin:$PATH
export LD_LIBRARY_PATH=$_b/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# hwloc's plugins (PCI, OpenCL, ...) are not bundled, and another hwloc's must not load.
export HWLOC_PLUGINS_PATH=$_b/mpi/lib/hwloc
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Shared memory only; no single copy (CMA is refused in containers without CAP_SYS_PTRACE); no
# core binding; the isolated launcher (one node: no ssh needed); no word on missing plugins.
export OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1 OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_hwloc_base_binding_policy=none OMPI_MCA_plm=isolated
export OMPI_MCA_mca_base_component_show_load_errors=0 OMPI_MCA_btl_base_warn_component_unused=0
unset _b
EOF
  } >"$m/env.sh"
  echo "gpu-bundle: $dest/mpi: Open MPI runtime, $(du -sh "$m" | cut -f1) (libraries in $dest/lib)"
}
bundle_mpi
rm -rf "$dest" && mv "$dest.tmp" "$dest"
tar -C "$(dirname "$dest")" -cf - "$(basename "$dest")" | xz -T0 -6 >"$dest.tar.xz.tmp" && mv "$dest.tar.xz.tmp" "$dest.tar.xz"
echo "gpu-bundle: $dest: $(ls "$dest/bin" | wc -l) programs, $(ls "$dest/lib" | wc -l) libraries, $(du -sh "$dest" | cut -f1);" \
  "$dest.tar.xz: $(du -sh "$dest.tar.xz" | cut -f1)"
