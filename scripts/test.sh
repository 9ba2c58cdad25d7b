#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test: the gtest units (ctest) and the
# integration tests that really mount (pytest). Exits non-zero if anything fails.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh

echo "== unit tests (ctest)"
(cd build && ctest --output-on-failure --timeout 300 -j2)

echo "== integration tests (pytest)"
export CUBETORCHFS_BIN="$PWD/build/bin/cubetorchfs"
export PYTHONPATH="$PWD/hooks${PYTHONPATH:+:$PYTHONPATH}"
# Separate runs: the hook tests patch DataLoader in their own process.
timeout 600 /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/hooks
timeout 1200 /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/integration
echo "== security tests (pytest: attacks by an unprivileged user against a real daemon)"
timeout 900 /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/security
