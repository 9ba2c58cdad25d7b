#!/usr/bin/env bash
# Fuzz the safetensors header parser (loader/safetensors.cc) with libFuzzer for a bounded time,
# then the loader's file-opening code (loader/fuzz_model_file.cc: encrypted header, integrity
# field, ModelFile::Open + ReadData) for as long again.
#
#   bench/fuzz_safetensors.sh [SECONDS]      (default 60 per target)
#
# Builds loader/fuzz_safetensors.cc with clang (-fsanitize=fuzzer,address,undefined) in its own
# build directory (build-fuzz, or $FUZZ_BUILD_DIR), seeds a corpus with a few valid files, runs
# the fuzzer and prints executions per second and whether a crash was found. Exit status: 0 no
# crash, 1 a crash (the reproducer is in the artifacts directory printed), 2 setup failed.
set -euo pipefail

SECONDS_TO_RUN="${1:-60}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD="${FUZZ_BUILD_DIR:-$ROOT/build-fuzz}"
WORK="$BUILD/fuzz-work"
JOBS="${FUZZ_BUILD_JOBS:-1}"

# A clang++ with libFuzzer: the default one, else clang++-14.
CXX_BIN=""
for c in clang++ clang++-14; do
  if command -v "$c" >/dev/null 2>&1; then CXX_BIN="$(command -v "$c")"; break; fi
done
if [[ -z "$CXX_BIN" ]]; then
  echo "fuzz_safetensors: no clang++ found (apt-get install clang)" >&2
  exit 2
fi
CC_BIN="${CXX_BIN/clang++/clang}"

mkdir -p "$BUILD"
if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
  CC="$CC_BIN" CXX="$CXX_BIN" cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCUBETORCH_CUDA=OFF -DBUILD_TESTING=OFF >"$BUILD/fuzz-configure.log" 2>&1 || {
    echo "fuzz_safetensors: cmake configure failed, see $BUILD/fuzz-configure.log" >&2
    exit 2
  }
fi
cmake -S "$ROOT" -B "$BUILD" >>"$BUILD/fuzz-configure.log" 2>&1  # picks up new targets
cmake --build "$BUILD" -j"$JOBS" --target fuzz_safetensors fuzz_model_file >"$BUILD/fuzz-build.log" 2>&1 || {
  echo "fuzz_safetensors: build failed, see $BUILD/fuzz-build.log" >&2
  exit 2
}
FUZZER="$BUILD/bin/fuzz_safetensors"

# Seed corpus: a few valid files written by hand (independent of the parser).
mkdir -p "$WORK/corpus" "$WORK/artifacts"
python3 - "$WORK/corpus" <<'PY'
import json, struct, sys, os
out = sys.argv[1]
def write(name, tensors, metadata=None, pad=0):
    header, data, off = {}, b"", 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for tname, dtype, shape, nbytes in tensors:
        header[tname] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nbytes]}
        data += bytes((i * 7) & 0xff for i in range(nbytes))
        off += nbytes
    h = json.dumps(header, separators=(",", ":")).encode() + b" " * pad
    with open(os.path.join(out, name), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
write("seed_empty", [])
write("seed_one", [("w", "F32", [2, 2], 16)])
write("seed_meta", [("a", "I64", [1], 8), ("b", "BF16", [3], 6)], {"format": "pt"}, pad=5)
write("seed_scalar_empty", [("s", "F64", [], 8), ("e", "U8", [0], 0), ("f4", "F4", [4], 2)])
write("seed_many", [("layer.%d" % i, "F16", [i + 1], 2 * (i + 1)) for i in range(20)])
write("seed_subbyte", [("x", "F6_E2M3", [4], 3), ("y", "F8_E4M3", [2], 2), ("z", "C64", [1], 8)])
PY

# run_fuzzer NAME BINARY WORKDIR [libFuzzer flags...]: runs for SECONDS_TO_RUN, prints a summary
# line, and exits 1 if it found a crash.
run_fuzzer() {
  local name="$1" binary="$2" work="$3"
  shift 3
  echo "$name: running $binary for ${SECONDS_TO_RUN}s"
  set +e
  "$binary" "$work/corpus" -max_total_time="$SECONDS_TO_RUN" -print_final_stats=1 \
    -max_len=4096 -rss_limit_mb=2048 -artifact_prefix="$work/artifacts/" "$@" \
    >"$work/fuzz.log" 2>&1
  local rc=$?
  set -e
  local execs rate cov crashes
  execs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$work/fuzz.log" | grep -o '[0-9]*$' || true)"
  rate="$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$work/fuzz.log" | grep -o '[0-9]*$' || true)"
  cov="$(grep -E '^#[0-9]+' "$work/fuzz.log" | tail -1 | grep -o 'cov: [0-9]*' || true)"
  crashes="$(ls "$work/artifacts" 2>/dev/null | grep -E '^(crash|leak|oom|timeout)-' || true)"
  echo "$name: executions=${execs:-?} exec/s=${rate:-?} ${cov} corpus=$(ls "$work/corpus" | wc -l)"
  if [[ $rc -ne 0 || -n "$crashes" ]]; then
    echo "$name: CRASH FOUND (exit $rc); reproducers in $work/artifacts:"
    echo "$crashes"
    grep -E 'ERROR|SUMMARY|runtime error' "$work/fuzz.log" | head -20
    exit 1
  fi
  echo "$name: no crash found in ${SECONDS_TO_RUN}s"
}

run_fuzzer fuzz_safetensors "$FUZZER" "$WORK" -dict="$ROOT/loader/fuzz_safetensors.dict"

# The second target, seeded with the same files plus an encrypted-header input ('E', header
# JSON, 0xFF, payload) that carries an integrity field.
MODEL_WORK="$BUILD/fuzz-model-work"
mkdir -p "$MODEL_WORK/corpus" "$MODEL_WORK/artifacts"
cp "$WORK"/corpus/seed_* "$MODEL_WORK/corpus/" 2>/dev/null || true
printf 'E{"mode":"CTR-128","iv":"AAAAAAAAAAAAAAAAAAAAAA==","file_timestamp":1,"cubetorchfs_integrity":{"alg":"GMAC-AES256-chunked-v2","chunk_size":64,"tag":"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="}}\xff\x10\x00\x00\x00\x00\x00\x00\x00{}              ' \
  >"$MODEL_WORK/corpus/seed_encrypted"
run_fuzzer fuzz_model_file "$BUILD/bin/fuzz_model_file" "$MODEL_WORK"
