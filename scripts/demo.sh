#!/usr/bin/env bash
# The two-minute tour: installs what is missing, builds, generates a small ImageNet-style
# dataset, and trains a tiny model on it for one epoch through cubetorchfs twice, each time on
# a fresh mount (empty cache) whose posix backend adds 5 ms to every request, like an object
# store: first plain, then with `import cube_torch`, which publishes the DataLoader's upcoming
# files so the daemon fetches them ahead. Prints samples/s and the hit rate of both, and
# unmounts.
#
# It needs only Debian's packages and the daemon (scripts/install_deps.sh --demo, the
# cubetorchfs target): the project venv and the tests are built when something needs them.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
scripts/install_deps.sh --demo
echo "demo: building the daemon (build/bin/cubetorchfs)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target cubetorchfs >/dev/null

work="${CUBETORCHFS_DEMO_DIR:-/tmp/cubetorchfs-demo}"
latency_us="${CUBETORCHFS_DEMO_LATENCY_US:-5000}"
mkdir -p "$work/data" "$work/mnt" "$work/log"
export CUBE_TORCH_CONFIG_DIR="$work"
export VOL_NAME=demo
export PYTHONPATH="$PWD/hooks${PYTHONPATH:+:$PYTHONPATH}"

cleanup() { fusermount3 -u "$work/mnt" 2>/dev/null || true; }
trap cleanup EXIT

/usr/bin/python3 scripts/demo_train.py --generate "$work/data"

mount_fresh() {
  cleanup
  local port
  port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  cat > "$work/config.json" <<JSON
{
  "volName": "demo",
  "mountPoint": "$work/mnt",
  "logDir": "$work/log",
  "exporterPort": $port,
  "profile": "ai_prefetch",
  "backend": {"type": "posix", "root": "$work/data", "inject": {"latency_us": $latency_us}},
  "cache": {"memory_bytes": "1GiB"},
  "prefetch": {"control_socket": "$work/control.sock"}
}
JSON
  build/bin/cubetorchfs -c "$work/config.json" >&2  # its one line goes with the log's
  echo "http://127.0.0.1:$port/metrics"
}

echo "store: $work/data, $((latency_us / 1000)) ms per backend request; mount: $work/mnt"
metrics=$(mount_fresh)
/usr/bin/python3 scripts/demo_train.py --train "$work/mnt" --metrics "$metrics" --label "without the hook  " \
  | tee "$work/nohook.txt"
metrics=$(mount_fresh)
/usr/bin/python3 scripts/demo_train.py --train "$work/mnt" --metrics "$metrics" --label "import cube_torch " --hook \
  | tee "$work/hook.txt"
/usr/bin/python3 - "$work" <<'PY'
import re, sys
rate = lambda f: float(re.search(r"= (\d+) samples/s", open(f"{sys.argv[1]}/{f}").read()).group(1))
print(f"speed-up from import cube_torch: {rate('hook.txt') / rate('nohook.txt'):.1f}x")
PY
echo "demo: done in $(( $(date +%s) - start )) s"
