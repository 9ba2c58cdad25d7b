#!/usr/bin/env bash
# The two-minute tour: installs what is missing, builds, generates a small ImageNet-style
# dataset, mounts it through cubetorchfs (posix backend with 0.3 ms of emulated store
# latency), trains a tiny model on it with a PyTorch DataLoader for two epochs, prints
# samples/s and the cache hit rate per epoch, and unmounts.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh >/dev/null

work="${CUBETORCHFS_DEMO_DIR:-/tmp/cubetorchfs-demo}"
mkdir -p "$work/data" "$work/mnt" "$work/log"
port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat > "$work/config.json" <<JSON
{
  "volName": "demo",
  "mountPoint": "$work/mnt",
  "logDir": "$work/log",
  "exporterPort": $port,
  "profile": "ai_prefetch",
  "backend": {"type": "posix", "root": "$work/data", "inject": {"latency_us": 300}},
  "cache": {"memory_bytes": "1GiB"}
}
JSON

cleanup() { fusermount3 -u "$work/mnt" 2>/dev/null || true; }
trap cleanup EXIT

export CUBE_TORCH_CONFIG_DIR="$work"
/usr/bin/python3 scripts/demo_train.py --generate "$work/data"
fusermount3 -u "$work/mnt" 2>/dev/null || true
build/bin/cubetorchfs -c "$work/config.json"
echo "mounted $work/data at $work/mnt (0.3 ms emulated store latency); metrics on 127.0.0.1:$port"
/usr/bin/python3 scripts/demo_train.py --train "$work/mnt" --metrics "http://127.0.0.1:$port/metrics"
