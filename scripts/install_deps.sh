#!/usr/bin/env bash
# Installs the Debian packages cubetorchfs needs to build, test and run its demo.
# Idempotent and quiet when everything is present. Needs root (or sudo) to install.
set -euo pipefail

PACKAGES=(
  # build
  cmake g++ make pkg-config
  fuse3 libfuse3-dev libboost-dev librocksdb-dev libcurl4-openssl-dev libyaml-cpp-dev
  prometheus-cpp-dev libssl-dev libgtest-dev libgmock-dev nlohmann-json3-dev
  # tests, demo and benchmarks
  python3 python3-torch python3-torchvision python3-pytest python3-numpy python3-pil
  bindfs curl prometheus
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install_deps: run as root to install: ${missing[*]}" >&2; exit 1; }
  SUDO="sudo"
fi
echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
