#!/usr/bin/env bash
# POSIX conformance of a mount: builds pjdfstest, mounts cubetorchfs over a fresh store, runs
# the whole suite as root from inside the mount, prints passed/failed per test file and in
# total, and compares the failures with tests/posix/expected_failures.txt.
#
#   scripts/posix_conformance.sh [--profile default|ai_prefetch] [--backend posix|s3]
#                                [--transport dev_fuse|io_uring]
#                                [--pjdfstest DIR] [--keep-log FILE] [--only GLOB]
#
# Exit 0: every failure is listed for this backend and profile, and every listed test still
# fails (the list only shrinks); 1 otherwise; 2 on a usage or set-up error. Needs root, fuse3,
# autoconf, automake and a C compiler (pjdfstest); --only runs the test files matching a glob;
# --backend s3 runs moto's S3 server from the project venv (scripts/install_deps.sh makes it).
# --transport io_uring mounts with fuse.io_uring on, turning the kernel's enable_uring on for
# the run (and back off after); exit 3 (skipped) where the kernel has no FUSE over io_uring.
# About 3 minutes on 2 cores. Two runs may go side by side (the build is locked).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

PROFILE=default BACKEND=posix SRC="" KEEP_LOG="" ONLY="" TRANSPORT=dev_fuse
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) PROFILE="${2:-}"; shift 2 ;;
    --backend) BACKEND="${2:-}"; shift 2 ;;
    --transport) TRANSPORT="${2:-}"; shift 2 ;;
    --pjdfstest) SRC="${2:-}"; shift 2 ;;
    --keep-log) KEEP_LOG="${2:-}"; shift 2 ;;
    --only) ONLY="${2:-}"; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "posix_conformance: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$PROFILE" in default|ai_prefetch) ;; *) echo "posix_conformance: --profile is default or ai_prefetch" >&2; exit 2 ;; esac
case "$BACKEND" in posix|s3) ;; *) echo "posix_conformance: --backend is posix or s3" >&2; exit 2 ;; esac
case "$TRANSPORT" in dev_fuse|io_uring) ;; *) echo "posix_conformance: --transport is dev_fuse or io_uring" >&2; exit 2 ;; esac
URING_PARAM=/sys/module/fuse/parameters/enable_uring
if [ "$TRANSPORT" = io_uring ] && [ ! -f "$URING_PARAM" ]; then
  echo "SKIP: this kernel has no FUSE over io_uring (Linux 6.14+ with CONFIG_FUSE_IO_URING)"
  exit 3
fi
[ "$(id -u)" = 0 ] || { echo "posix_conformance: needs root (pjdfstest changes owners)" >&2; exit 2; }
SRC="${SRC:-$REPO/../shared/tools/pjdfstest}"
[ -f "$SRC/pjdfstest.c" ] || { echo "posix_conformance: no pjdfstest source at $SRC (give --pjdfstest DIR)" >&2; exit 2; }
BIN="${CUBETORCHFS_BIN:-$REPO/build/bin/cubetorchfs}"
[ -x "$BIN" ] || { echo "posix_conformance: $BIN missing: run scripts/build.sh" >&2; exit 2; }
for tool in autoreconf fusermount3 curl; do
  command -v "$tool" >/dev/null || { echo "posix_conformance: $tool not found (scripts/install_deps.sh)" >&2; exit 2; }
done

# pjdfstest, built once into build-pjdfstest/ (rebuilt when the source changes).
PJD="$REPO/build-pjdfstest"
stamp="$(cat "$SRC/SOURCE_COMMIT" 2>/dev/null || stat -c %Y "$SRC/pjdfstest.c")"
exec 9>"$REPO/.pjdfstest.lock"
flock 9
if [ ! -x "$PJD/pjdfstest" ] || [ "$(cat "$PJD/.source" 2>/dev/null)" != "$stamp" ]; then
  echo "== building pjdfstest ($SRC)"
  rm -rf "$PJD" && cp -r "$SRC" "$PJD"
  (cd "$PJD" && autoreconf -ifs && ./configure && make pjdfstest) >"$PJD.build.log" 2>&1 ||
    { echo "posix_conformance: building pjdfstest failed (see $PJD.build.log)" >&2; exit 2; }
  echo "$stamp" >"$PJD/.source"
fi
flock -u 9

WORK="$(mktemp -d /tmp/cubetorchfs-posix.XXXXXX)"
MNT="$WORK/mnt" LOG="$WORK/prove.log" S3PID="" URING_WAS=""
mkdir -p "$MNT" "$WORK/store" "$WORK/log"
cleanup() {
  cd /
  mountpoint -q "$MNT" && { fusermount3 -u "$MNT" 2>/dev/null || fusermount3 -u -z "$MNT"; }
  [ -n "$S3PID" ] && kill "$S3PID" 2>/dev/null
  [ "$URING_WAS" = N ] && echo N >"$URING_PARAM"
  [ -n "$KEEP_LOG" ] && [ -f "$LOG" ] && cp "$LOG" "$KEEP_LOG"
  rm -rf "$WORK"
}
trap cleanup EXIT

if [ "$BACKEND" = posix ]; then
  backend="{\"type\": \"posix\", \"root\": \"$WORK/store\"}"
else
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  VENV="$(scripts/venv.sh)"
  [ -f "$VENV/.complete" ] || { echo "posix_conformance: no project venv at $VENV (scripts/install_deps.sh makes it)" >&2; exit 2; }
  "$VENV/bin/python" -m moto.server -H 127.0.0.1 -p "$port" >"$WORK/moto.log" 2>&1 &
  S3PID=$!
  for _ in $(seq 1 300); do curl -s -o /dev/null "http://127.0.0.1:$port/moto-api/" && break; sleep 0.1; done
  curl -sf -X PUT --aws-sigv4 "aws:amz:us-east-1:s3" --user posix:posix-secret \
    "http://127.0.0.1:$port/posix" >/dev/null ||
    { echo "posix_conformance: moto's S3 server did not start (see $WORK/moto.log)" >&2; exit 2; }
  backend="{\"type\": \"s3\", \"endpoint\": \"http://127.0.0.1:$port\", \"bucket\": \"posix\",
            \"access_key\": \"posix\", \"secret_key\": \"posix-secret\", \"staging_dir\": \"$WORK/staging\"}"
fi
profile=""; [ "$PROFILE" = ai_prefetch ] && profile='"profile": "ai_prefetch",'
uring=off
if [ "$TRANSPORT" = io_uring ]; then
  uring=on
  URING_WAS="$(cat "$URING_PARAM")"
  [ "$URING_WAS" = N ] && echo Y >"$URING_PARAM"
fi
cat >"$WORK/config.json" <<JSON
{"volName": "posix-$$", "mountPoint": "$MNT", "logDir": "$WORK/log", $profile
 "backend": $backend, "cache": {"memory_bytes": "256MiB"}, "fuse": {"io_uring": "$uring"},
 "prefetch": {"control_socket": "$WORK/ctl.sock"}}
JSON
"$BIN" -c "$WORK/config.json" "$MNT" -o allow_other ||
  { echo "posix_conformance: the mount failed" >&2; exit 2; }

echo "== pjdfstest: backend $BACKEND, profile $PROFILE, transport $TRANSPORT (about 3 minutes)"
python3 "$REPO/tests/posix/pjdfstest.py" "$MNT" "$PJD/tests" \
  "$REPO/tests/posix/expected_failures.txt" "$BACKEND" "$PROFILE" --log "$LOG" ${ONLY:+--only "$ONLY"}
