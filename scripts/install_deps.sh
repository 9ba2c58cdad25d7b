#!/usr/bin/env bash
# Installs what cubetorchfs needs to build, test, benchmark and run its demo, from Debian's
# packages and PyPI only. Idempotent: quiet when everything is present; otherwise it says what
# it installs. Needs root (or sudo) for the Debian packages.
#
#   scripts/install_deps.sh            # Debian packages + the project venv
#   scripts/install_deps.sh --debian   # the Debian packages only (build and the 1.13 tests)
#   scripts/install_deps.sh --demo     # what scripts/demo.sh needs: the build, Debian's torch
#
# The project venv holds current PyTorch (torch 2.x, torchvision, torchdata) and the peers the
# tests and benchmarks run beside cubetorchfs (moto's S3 server, safetensors, fastsafetensors,
# s3torchconnector, webdataset), pinned in scripts/requirements-venv.txt (every
# dependency's version in scripts/constraints-venv.txt). It lives outside the
# clone, keyed by that file's hash ($CUBETORCHFS_VENV_ROOT, default ~/.cache/cubetorchfs), so
# every clone with the same pins shares it; `scripts/venv.sh` prints its path.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBIAN_ONLY=0
DEMO_ONLY=0
case "${1:-}" in
  "") ;;
  --debian) DEBIAN_ONLY=1 ;;
  --demo) DEBIAN_ONLY=1; DEMO_ONLY=1 ;;
  -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "install_deps: unknown argument '$1' (see --help)" >&2; exit 2 ;;
esac

# What scripts/demo.sh needs: the build, and the demo's training under Debian's torch 1.13.
DEMO_PACKAGES=(
  cmake g++ make pkg-config ccache
  fuse3 libfuse3-dev liburing-dev libboost-dev librocksdb-dev libcurl4-openssl-dev libyaml-cpp-dev
  prometheus-cpp-dev libcivetweb-dev libssl-dev libgtest-dev libgmock-dev nlohmann-json3-dev
  python3 python3-torch python3-torchvision python3-numpy python3-pil
)
PACKAGES=(
  "${DEMO_PACKAGES[@]}"
  # the Debian package (scripts/package.sh) and its checks
  dpkg-dev lintian
  # checks of scripts/test.sh: the format check, the lock annotations (-Wthread-safety)
  clang-format clang
  # fuzzing: libFuzzer's runtime for clang (bench/fuzz_bench.sh, the short run of scripts/test.sh;
  # only recommended by clang, so --no-install-recommends leaves it out)
  libclang-rt-14-dev
  # scripts/posix_conformance.sh builds pjdfstest
  autoconf automake
  # tests and benchmarks under Debian's python3 (torch 1.13), and the venv's making
  python3-pytest python3-venv python3-pip
  # cv2.imread in the hook's batch mode (tests/integration/test_batch_mode.py)
  python3-opencv
  bindfs curl prometheus s3fs rclone
)

[ "$DEMO_ONLY" -eq 1 ] && PACKAGES=("${DEMO_PACKAGES[@]}")
missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "install_deps: run as root to install: ${missing[*]}" >&2; exit 1; }
    SUDO="sudo"
  fi
  echo "install_deps: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ "$DEBIAN_ONLY" -eq 1 ] && exit 0

# The project venv. A venv is not relocatable, so it is made at its final path and marked
# complete only after every pin installed; a half-made one (an interrupted run) is made again.
REQ="scripts/requirements-venv.txt"
CONSTRAINTS="scripts/constraints-venv.txt"
VENV="$(scripts/venv.sh)"
if [ ! -f "$VENV/.complete" ] || ! cat "$REQ" "$CONSTRAINTS" | cmp -s - "$VENV/.complete"; then
  echo "install_deps: making the project venv $VENV from $REQ (torch 2.x and peers from PyPI;"
  echo "install_deps: about 6 GB of disk, several minutes on a first run)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  /usr/bin/python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --progress-bar off --disable-pip-version-check \
    --no-input -r "$REQ" -c "$CONSTRAINTS"
  "$VENV/bin/python" -c "import torch, torchvision, torchdata, moto, safetensors" \
    || { echo "install_deps: the venv $VENV does not import what it installed" >&2; exit 1; }
  cat "$REQ" "$CONSTRAINTS" > "$VENV/.complete"
  echo "install_deps: venv ready: $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)')"
fi
