#!/bin/bash
# The CUDA paths on a GPU machine, from the repository root of a built tree (scripts/build.sh
# with nvcc present, then `cmake --build build --target gpu_tests gpu_bench`):
#   1. build/bin/gpu_tests: the AES-CTR kernel against OpenSSL (1 byte to 4 GiB, every
#      alignment, both key sizes, counter carries) and the loader's pipeline with pinned slots;
#   2. the CUDA tests of tests/hooks/test_loader.py (every dtype, plain and encrypted, equal to
#      a CPU load; clear errors for a bad device index and out of memory);
#   3. bench/gpu_bench.py with the arguments given (e.g. --sizes 1,4 --rounds 5).
# Usage: scripts/gpu_check.sh [--log-dir DIR] [gpu_bench.py arguments...]
# Exits non-zero if a test fails; the benchmark's figures go to DIR/gpu_bench.json.
set -uo pipefail
cd "$(dirname "$0")/.."
log_dir=.
if [ "${1:-}" = --log-dir ]; then log_dir="$2"; shift 2; fi
mkdir -p "$log_dir"
PY="${PYTHON:-python3}"
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
  --format=csv 2>&1 | tee "$log_dir/device.txt"
echo "== gpu_tests"
build/bin/gpu_tests --gtest_brief=1 2>&1 | tee "$log_dir/gpu_tests.log" || status=1
echo "== loader CUDA tests ($PY: torch $("$PY" -c 'import torch; print(torch.__version__)'))"
PYTHONPATH="$PWD/hooks" timeout 300 "$PY" -m pytest -q -rs -p no:cacheprovider \
  tests/hooks/test_loader.py -k cuda 2>&1 | tee "$log_dir/pytest_cuda.log" || status=1
echo "== gpu_bench"
PYTHONUNBUFFERED=1 "$PY" bench/gpu_bench.py --out "$log_dir/gpu_bench.json" "$@" 2>&1 \
  | tee "$log_dir/gpu_bench.log" || status=1
exit $status
