#!/usr/bin/env bash
# Builds the control plane's libFuzzer targets (tests/fuzz/) with clang into build-fuzz/
# (-DCUBETORCHFS_FUZZ=ON: every library with coverage, ASan and UBSan) and runs each, from its
# seed corpus (tests/fuzz/corpus/<target>/) plus what earlier runs kept in
# build-fuzz/fuzz-corpus/<target>/, printing executions, executions a second, coverage (cov:
# edges, ft: features) and any crash.
#
#   bench/fuzz_bench.sh                   # each target for 1,000,000 executions
#   bench/fuzz_bench.sh --runs N          # each for N executions
#   bench/fuzz_bench.sh --time S          # each for S seconds (scripts/test.sh: 20)
#   bench/fuzz_bench.sh --only fuzz_json_shape [--only ...]
#
# Limits: -rss_limit_mb=2048 (the process), -malloc_limit_mb=256 (one allocation),
# -timeout=10 (one input), -max_len=4096 (8192 for the routes). Exit status: 0 no crash; 1 a
# crash, a leak, a broken invariant, an allocation over the limits or a slow input (the
# reproducer is in build-fuzz/fuzz-artifacts/<target>/, named in the output); 2 setup failed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD="${FUZZ_BUILD_DIR:-$ROOT/build-fuzz}"
JOBS="${FUZZ_BUILD_JOBS:-2}"
TARGETS=(fuzz_http_request fuzz_json_shape fuzz_control_routes)

RUNS=1000000
TIME=""
ONLY=()
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) RUNS="${2:?--runs needs a number}"; shift 2 ;;
    --time) TIME="${2:?--time needs seconds}"; shift 2 ;;
    --only) ONLY+=("${2:?--only needs a target}"); shift 2 ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "fuzz_bench: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[ ${#ONLY[@]} -gt 0 ] && TARGETS=("${ONLY[@]}")

# A clang++ with libFuzzer (libclang-rt-14-dev: scripts/install_deps.sh).
CXX_BIN=""
for c in clang++ clang++-14; do
  if command -v "$c" >/dev/null 2>&1; then CXX_BIN="$(command -v "$c")"; break; fi
done
[ -n "$CXX_BIN" ] || { echo "fuzz_bench: no clang++ (scripts/install_deps.sh)" >&2; exit 2; }
CC_BIN="${CXX_BIN/clang++/clang}"
if [ ! -f "$("$CXX_BIN" -print-resource-dir)/lib/linux/libclang_rt.fuzzer-$(uname -m).a" ]; then
  echo "fuzz_bench: clang has no libFuzzer runtime (apt-get install libclang-rt-14-dev)" >&2
  exit 2
fi

mkdir -p "$BUILD"
LOG="$BUILD/fuzz-bench-build.log"
start=$(date +%s)
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  CC="$CC_BIN" CXX="$CXX_BIN" cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCUBETORCH_CUDA=OFF -DBUILD_TESTING=OFF -DCUBETORCHFS_FUZZ=ON >"$LOG" 2>&1 ||
    { echo "fuzz_bench: cmake configure failed, see $LOG" >&2; exit 2; }
fi
# An existing build-fuzz/ (bench/fuzz_safetensors.sh's) gets the option; new targets are seen.
cmake -S "$ROOT" -B "$BUILD" -DCUBETORCHFS_FUZZ=ON >>"$LOG" 2>&1 ||
  { echo "fuzz_bench: cmake configure failed, see $LOG" >&2; exit 2; }
cmake --build "$BUILD" -j"$JOBS" --target "${TARGETS[@]}" >>"$LOG" 2>&1 ||
  { echo "fuzz_bench: build failed, see $LOG" >&2; tail -30 "$LOG" >&2; exit 2; }
echo "fuzz_bench: built ${TARGETS[*]} in $(($(date +%s) - start)) s ($BUILD, -j$JOBS)"

status=0
for t in "${TARGETS[@]}"; do
  bin="$BUILD/bin/$t"
  seeds="$ROOT/tests/fuzz/corpus/$t"
  corpus="$BUILD/fuzz-corpus/$t"      # what the runs found; the seeds stay as committed
  artifacts="$BUILD/fuzz-artifacts/$t"
  log="$BUILD/fuzz-$t.log"
  mkdir -p "$corpus" "$artifacts"
  # Routes: long enough for a path over the 4096 bytes a request may name.
  max_len=4096
  [ "$t" = fuzz_control_routes ] && max_len=8192
  args=(-rss_limit_mb=2048 -malloc_limit_mb=256 -timeout=10 -max_len="$max_len"
        -print_final_stats=1 -artifact_prefix="$artifacts/")
  [ -f "$ROOT/tests/fuzz/$t.dict" ] && args+=(-dict="$ROOT/tests/fuzz/$t.dict")
  if [ -n "$TIME" ]; then args+=(-max_total_time="$TIME"); else args+=(-runs="$RUNS"); fi
  set +e
  "$bin" "$corpus" "$seeds" "${args[@]}" >"$log" 2>&1
  rc=$?
  set -e
  execs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || true)"
  rate="$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' || true)"
  rss="$(grep -o 'stat::peak_rss_mb: *[0-9]*' "$log" | grep -o '[0-9]*$' || true)"
  last="$(grep -E '^#[0-9]+' "$log" | tail -1 || true)"
  cov="$(grep -o 'cov: [0-9]*' <<<"$last" || true)"
  ft="$(grep -o 'ft: [0-9]*' <<<"$last" || true)"
  secs="$(grep -o 'Done [0-9]* runs in [0-9]* second' "$log" | grep -o 'in [0-9]*' | grep -o '[0-9]*' || true)"
  echo "$t: executions=${execs:-?} exec/s=${rate:-?} ${cov:-cov: ?} ${ft:-ft: ?}" \
    "corpus=$(find "$corpus" -type f | wc -l) peak_rss_mb=${rss:-?} seconds=${secs:-?}"
  found="$(sed -n 's/.*Test unit written to //p' "$log" | tr '\n' ' ')"
  if [ $rc -ne 0 ] || [ -n "$found" ]; then
    echo "$t: CRASH (exit $rc); reproducer(s): ${found:-see $log}"
    grep -E 'ERROR|SUMMARY|runtime error|invariant broken|==[0-9]+==' "$log" | head -20
    status=1
  else
    echo "$t: no crash"
  fi
done
exit $status
