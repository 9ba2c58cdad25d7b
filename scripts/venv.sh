#!/usr/bin/env bash
# Prints the path of the project venv (torch 2.x and the test and benchmark peers), which
# scripts/install_deps.sh makes: $CUBETORCHFS_VENV when set, else
# ${CUBETORCHFS_VENV_ROOT:-~/.cache/cubetorchfs}/venv-<first 12 hex of the sha256 of
# scripts/requirements-venv.txt followed by scripts/constraints-venv.txt>.
# tests/venv_path.py computes the same path for the Python side.
set -euo pipefail
if [ -n "${CUBETORCHFS_VENV:-}" ]; then echo "$CUBETORCHFS_VENV"; exit 0; fi
here="$(cd "$(dirname "$0")" && pwd)"
root="${CUBETORCHFS_VENV_ROOT:-${HOME:-/root}/.cache/cubetorchfs}"
echo "$root/venv-$(cat "$here/requirements-venv.txt" "$here/constraints-venv.txt" | sha256sum | cut -c1-12)"
