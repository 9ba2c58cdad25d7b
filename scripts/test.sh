#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test: the gtest units (ctest), a short
# libFuzzer run of the control plane (bench/fuzz_bench.sh), the contract tests (the docs'
# claims read against the sources) and the integration tests that really mount (pytest).
# Exits non-zero if anything fails.
#
#   scripts/test.sh                      # everything, Release build, warnings as errors
#   scripts/test.sh --sanitize address   # units + integration, daemon under ASan + UBSan
#   scripts/test.sh --sanitize thread    # the unit tests under TSan
#
# A sanitizer run builds into build-asan/ or build-tsan/ and fails on any report, whether
# it made a test fail or not (reports are collected from every process, the daemons included).
set -euo pipefail
cd "$(dirname "$0")/.."

SANITIZE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --sanitize) SANITIZE="${2:-}"; shift 2 || { echo "test.sh: --sanitize needs address or thread" >&2; exit 2; } ;;
    --sanitize=*) SANITIZE="${1#*=}"; shift ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "test.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$SANITIZE" in
  ""|address|thread) ;;
  *) echo "test.sh: --sanitize takes address or thread, not '$SANITIZE'" >&2; exit 2 ;;
esac

# Each phase's time, printed at the end whatever the outcome (docs/testing.md keeps a record).
PHASES=()
PHASE=""
PHASE_START=$SECONDS
REPORTS=""
phase() {  # ends the running phase and starts the next, which it announces
  [ -n "$PHASE" ] && PHASES+=("$(printf '%6d s  %s' $((SECONDS - PHASE_START)) "$PHASE")")
  PHASE="$1"
  PHASE_START=$SECONDS
  echo "== $1"
}
finish() {
  local rc=$?
  [ -n "$REPORTS" ] && rm -rf "$REPORTS"
  if [ -n "${VENV_JOB:-}" ]; then kill "$VENV_JOB" 2>/dev/null; wait "$VENV_JOB" 2>/dev/null; fi
  if [ -n "${CHECKS_JOB:-}" ]; then kill "$CHECKS_JOB" 2>/dev/null; wait "$CHECKS_JOB" 2>/dev/null; fi
  [ -n "${VENV_LOG:-}" ] && rm -f "$VENV_LOG"
  [ -n "${CHECKS_LOG:-}" ] && rm -f "$CHECKS_LOG"
  phase "(end)" >/dev/null
  echo "== time per phase (scripts/test.sh${SANITIZE:+ --sanitize $SANITIZE}; exit $rc)"
  printf '%s\n' "${PHASES[@]}"
  printf '%6d s  total\n' "$SECONDS"
}
trap finish EXIT

phase "dependencies (Debian packages: scripts/install_deps.sh --debian)"
scripts/install_deps.sh --debian
# The project venv (torch 2.x and the PyPI peers: minutes on a fresh machine, mostly download)
# is made in the background while the trees build and the first suites run; the integration
# tests, the first to need it (moto), wait for it (venv_ready).
VENV_LOG="$(mktemp /tmp/cubetorchfs-venv.XXXXXX)"
VENV_JOB=""
if [ "$SANITIZE" != thread ]; then
  scripts/install_deps.sh >"$VENV_LOG" 2>&1 &
  VENV_JOB=$!
fi
# Waits, in a phase of its own, for the background job whose pid is in the variable named $1,
# prints its log $2, and fails the run if it failed ($3 names it).
wait_background() {
  local job="${!1}"
  [ -z "$job" ] && return 0
  phase "$3 (run in the background)"
  local rc=0
  wait "$job" || rc=$?
  printf -v "$1" '%s' ""
  cat "$2"
  [ "$rc" -eq 0 ] || { echo "test.sh: $3 failed (exit $rc)" >&2; exit 1; }
}
venv_ready() { wait_background VENV_JOB "$VENV_LOG" "the project venv (scripts/install_deps.sh)"; }
phase "build (build/, Release, warnings as errors)"
scripts/build.sh -DCUBETORCHFS_WERROR=ON

if [ -n "$SANITIZE" ]; then
  dir="build-${SANITIZE:0:1}san"   # build-asan, build-tsan
  phase "$SANITIZE sanitizer build ($dir)"
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCUBETORCHFS_SANITIZE="$SANITIZE" \
    -DCUBETORCHFS_WERROR=ON -DCUBETORCH_CUDA=OFF >/dev/null
  if [ "$SANITIZE" = address ]; then
    cmake --build "$dir" -j"$(nproc)"
  else
    cmake --build "$dir" -j"$(nproc)" --target unit_tests
  fi
  reports="$(mktemp -d /tmp/cubetorchfs-sanitize.XXXXXX)"
  REPORTS="$reports"
  export ASAN_OPTIONS="log_path=$reports/asan:detect_leaks=1:halt_on_error=1"
  export UBSAN_OPTIONS="log_path=$reports/ubsan:print_stacktrace=1:halt_on_error=1"
  export TSAN_OPTIONS="log_path=$reports/tsan:halt_on_error=0:second_deadlock_stack=1"
  status=0
  if [ "$SANITIZE" = address ]; then
    phase "unit tests under ASan + UBSan"
    (cd "$dir" && ctest --output-on-failure --timeout 600 -j2) || status=1
    venv_ready
    phase "integration tests, the daemon under ASan + UBSan"
    # The Python side loads build/'s uninstrumented loader library; only the daemon swaps.
    CUBETORCHFS_BIN="$PWD/$dir/bin/cubetorchfs" PYTHONPATH="$PWD/hooks" \
      timeout 1500 /usr/bin/python3 -m pytest -q -rs -p no:cacheprovider tests/integration || status=1
  else
    phase "unit tests under TSan"
    # All of them (10 s): the prefetcher, the caches, the file system and write path, the
    # model fetcher and the loader's threads among them.
    "$dir/bin/unit_tests" --gtest_brief=1 || status=1
  fi
  if compgen -G "$reports/*" >/dev/null; then
    echo "== sanitizer reports:"
    for f in "$reports"/*; do echo "--- $f"; head -60 "$f"; done
    status=1
  fi
  [ "$status" -eq 0 ] && echo "== no sanitizer reports"
  exit "$status"
fi

phase "format check (clang-format)"
scripts/format.sh --check

phase "unit tests (ctest)"
(cd build && ctest --output-on-failure --timeout 300 -j2)

# The lock annotations and the fuzzing need no mount: they run in the background at the lowest
# CPU priority (nice 19), on the CPU the suites below leave idle (about half of it: they wait
# on stores with added latency, timeouts, clusters), and are waited for at the end.
#  - lock annotations: clang -Wthread-safety over every file using the annotated locks;
#  - fuzzing the control plane: the request reader, the JSON body limits and the routes, 20 s a
#    target, built with clang into build-fuzz/ (a first build there takes minutes on 2 cores,
#    later ones seconds). A crash, a leak, an allocation over 256 MiB or a broken invariant
#    fails the run; its reproducer is in build-fuzz/fuzz-artifacts/.
CHECKS_LOG="$(mktemp /tmp/cubetorchfs-checks.XXXXXX)"
(
  echo "-- lock annotations (clang -Wthread-safety)"
  nice -n 19 scripts/thread_safety.sh build
  echo "-- fuzzing the control plane (libFuzzer, 20 s a target; bench/fuzz_bench.sh)"
  nice -n 19 bench/fuzz_bench.sh --time 20
) >"$CHECKS_LOG" 2>&1 &
CHECKS_JOB=$!

phase "contract tests (pytest: the docs' metrics, routes, thread rules and pjdfstest counts against the sources; no build needed)"
timeout 120 /usr/bin/python3 -m pytest -q -rs -p no:cacheprovider tests/contracts

phase "hook and loader tests (pytest) under Debian's python3 and torch $(/usr/bin/python3 -c 'import torch; print(torch.__version__)')"
export CUBETORCHFS_BIN="$PWD/build/bin/cubetorchfs"
export PYTHONPATH="$PWD/hooks${PYTHONPATH:+:$PYTHONPATH}"
# Separate runs: the hook tests patch DataLoader in their own process. -rs prints every skip's
# reason. With CI set, a skip for want of FUSE, the daemon binary or libcubetorch_io is a
# failure (tests/ci_skips.py); other skips (no GPU...) stay skips.
timeout 600 /usr/bin/python3 -m pytest -q -rs -p no:cacheprovider tests/hooks
venv_ready
phase "integration tests (pytest, real mounts) under Debian's python3"
timeout 1200 /usr/bin/python3 -m pytest -q -rs -p no:cacheprovider tests/integration
# The same hook and loader suite, and the integration tests that train or load, under the
# project venv's current torch 2.x (scripts/requirements-venv.txt): their children run with
# the interpreter of the pytest process. The tests that need the venv whatever the pytest
# interpreter (moto, torchdata, DCP) ran above.
VENV_PY="$(scripts/venv.sh)/bin/python"
phase "hook and loader tests under $("$VENV_PY" -c 'import torch; print("torch", torch.__version__)') (project venv)"
timeout 600 "$VENV_PY" -m pytest -q -rs -p no:cacheprovider tests/hooks
timeout 900 "$VENV_PY" -m pytest -q -rs -p no:cacheprovider tests/integration/test_hook_e2e.py \
  tests/integration/test_batch_mode.py \
  tests/integration/test_epochs.py tests/integration/test_model_mount.py \
  tests/integration/test_s3.py::test_prefetch_through_cube_torch_on_an_s3_mount \
  tests/integration/test_s3.py::test_model_load_from_an_s3_mount \
  tests/integration/test_fleet.py::test_an_unmodified_loop_survives_three_kill_9s_and_three_upgrades
phase "security tests (pytest: attacks by an unprivileged user against a real daemon)"
timeout 900 /usr/bin/python3 -m pytest -q -rs -p no:cacheprovider tests/security
phase "CubeFS tests (a live loopback cluster; each test skips without ../shared/cubefs)"
timeout 1200 /usr/bin/python3 -m pytest -q -rs -p no:cacheprovider tests/cubefs
phase "POSIX conformance (pjdfstest over a default-profile mount of a posix store, on each transport side by side)"
if [ -f ../shared/tools/pjdfstest/pjdfstest.c ]; then
  # The io_uring run skips (exit 3, one line) where the kernel has no FUSE over io_uring.
  uring_log="$(mktemp /tmp/cubetorchfs-pjdfstest-io_uring.XXXXXX)"
  timeout 900 scripts/posix_conformance.sh --profile default --backend posix \
    --transport io_uring >"$uring_log" 2>&1 &
  uring_run=$!
  timeout 900 scripts/posix_conformance.sh --profile default --backend posix --transport dev_fuse
  uring_rc=0; wait "$uring_run" || uring_rc=$?
  echo "-- pjdfstest on FUSE over io_uring:"; tail -n 3 "$uring_log"
  [ "$uring_rc" = 0 ] || [ "$uring_rc" = 3 ] || { cat "$uring_log"; rm -f "$uring_log"; exit 1; }
  rm -f "$uring_log"
else
  echo "SKIP: no pjdfstest source at ../shared/tools/pjdfstest (scripts/posix_conformance.sh --pjdfstest DIR runs it by hand)"
fi

wait_background CHECKS_JOB "$CHECKS_LOG" "the lock annotations and the fuzzing"
