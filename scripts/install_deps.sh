#!/usr/bin/env bash
# Installs the Debian packages cubetorchfs needs to build, test and run its demo.
# Idempotent and quiet when everything is present. Needs root (or sudo) to install.
set -euo pipefail

PACKAGES=(
  # build
  cmake g++ make pkg-config
  fuse3 libfuse3-dev libboost-dev librocksdb-dev libcurl4-openssl-dev libyaml-cpp-dev
  prometheus-cpp-dev libssl-dev libgtest-dev libgmock-dev nlohmann-json3-dev
  # checks of scripts/test.sh: the format check, the lock annotations (-Wthread-safety)
  clang-format clang
  # scripts/posix_conformance.sh builds pjdfstest
  autoconf automake
  # tests, demo and benchmarks
  python3 python3-torch python3-torchvision python3-pytest python3-numpy python3-pil
  python3-venv python3-pip
  bindfs curl prometheus s3fs rclone
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
# Node.js and npm run s3rver, the S3 server of the s3 backend's tests; any install will do.
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)

if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "install_deps: run as root to install: ${missing[*]}" >&2; exit 1; }
    SUDO="sudo"
  fi
  echo "install_deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# s3rver (pinned in tools/package.json and tools/package-lock.json) into tools/node_modules.
TOOLS="$(cd "$(dirname "$0")/.." && pwd)/tools"
if [ ! -f "$TOOLS/node_modules/s3rver/package.json" ] ||
   ! grep -q '"version": "3.7.1"' "$TOOLS/node_modules/s3rver/package.json"; then
  echo "install_deps: installing s3rver 3.7.1 into tools/node_modules"
  npm ci --prefix "$TOOLS" --no-audit --no-fund --loglevel=error \
    >/dev/null
fi
