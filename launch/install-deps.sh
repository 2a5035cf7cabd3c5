#!/usr/bin/env bash
# Installs the Debian packages retain builds against, and only those that are missing
# (safe to run again). CUDA, cuDNN, NCCL and NVTX come from /usr/local/cuda, not apt.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config
  ccache                              # compiler cache: build-emu/ reuses build/'s objects
  libopenmpi-dev openmpi-bin          # MPI: multi-rank training and tests
  libhdf5-dev                         # packed datasets
  libboost-program-options-dev        # command lines
  libboost-context-dev                # fibers: the CUDA emulator's threads (kernels/cuda/emu)
  libgtest-dev                        # tests
  nlohmann-json3-dev                  # config.json, safetensors headers
  libopenblas-dev                     # CPU GEMM
  libpcre2-dev                        # tokenizer pre-split regex
  libutf8proc-dev                     # tokenizer NFC normalization
  zlib1g-dev                          # gzip-compressed corpora
  libssl-dev                          # SHA-256 of tokenizer.json (libcrypto)
  libzip-dev                          # torch.save archives (trimkv_weights.pth)
  libtomlplusplus-dev                 # retain-train --config run.toml
  libspdlog-dev libfmt-dev            # logging, formatting
  libplplot-dev plplot-driver-cairo   # PNG figures (retain-eval --plot, retain-plot)
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
