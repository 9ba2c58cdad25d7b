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
# Separate runs: the hook tests patch DataLoader in their own process. -rs prints every skip's
# reason. With CI set, a skip for want of FUSE, the daemon binary or libcubetorch_io is a
# failure (tests/ci_skips.py); other skips (no GPU...) stay skips.
timeout 600 /usr/bin/python3 -m pytest -q -rs -p no:cacheprovider tests/hooks
timeout 1200 /usr/bin/python3 -m pytest -q -rs -p no:cacheprovider tests/integration
echo "== security tests (pytest: attacks by an unprivileged user against a real daemon)"
timeout 900 /usr/bin/python3 -m pytest -q -rs -p no:cacheprovider tests/security
