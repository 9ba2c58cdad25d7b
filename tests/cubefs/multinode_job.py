"""A data-parallel training job on several "nodes" of one machine: one rank per node, started
with torch.multiprocessing and joined with gloo on the CPU, each rank reading its share of an
ImageFolder through its own node's mount with DistributedSampler and set_epoch, with or
without `import cube_torch`. Used by tests/cubefs/test_multinode.py and
bench/multinode_bench.py.

    python3 multinode_job.py SPEC.json

SPEC: {"nodes": [{"root": DATASET_DIR, "config_dir": CONTROL_FILE_DIR, "vol_name": VOL,
                  "metrics_port": PORT or 0}, ...],
       "hook": bool, "epochs": int, "batch": int, "pause": seconds per batch (the model's step),
       "workers": int, "seed": int, "out": DIR,
       "servers": {"data": [PID, ...], "flash": [PID, ...]} (optional)}
Each rank writes DIR/rank<R>.json: per epoch the SHA-256 of every sample in the order the
loader gave them, the sampler's indices, its seconds (from the barrier before it to the
barrier after it, so the same for every rank), with the hook the daemon's stats before and
after it, and the node daemon's counters (`metrics`: after minus before) when it has a
metrics port. Rank 0 also records what the servers wrote meanwhile (`servers`: wchar of
/proc/PID/io, summed per kind).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def collate(batch: list[Any]) -> list[Any]:
    return batch


COUNTERS = {  # name in the record: (metric, label filter)
    "store_reads": ("cubetorchfs_backend_requests_total", 'op="read"'),
    "store_bytes": ("cubetorchfs_backend_read_bytes_total", ""),
    "ram_bytes": ("cubetorchfs_read_bytes_total", 'source="ram"'),
    "nvme_bytes": ("cubetorchfs_read_bytes_total", 'source="disk"'),
    "miss_bytes": ("cubetorchfs_read_bytes_total", 'source="backend"'),
}


def node_counters(port: int) -> dict[str, float]:
    import urllib.request
    if not port:
        return {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for key, (metric, label) in COUNTERS.items():
            if line.startswith(metric) and line[len(metric)] in "{ " and label in line:
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def server_bytes(servers: dict[str, list[int]]) -> dict[str, int]:
    out = {}
    for kind, pids in servers.items():
        total = 0
        for pid in pids:
            with open(f"/proc/{pid}/io") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
        out[kind] = total
    return out


def minus(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def rank_main(rank: int, spec: dict[str, Any]) -> None:
    node = spec["nodes"][rank]
    # The hook finds its node's daemon by these (read when used, not at import).
    os.environ["CUBE_TORCH_CONFIG_DIR"] = node["config_dir"]
    os.environ["VOL_NAME"] = node["vol_name"]
    if spec["hook"]:
        import cube_torch  # noqa: F401  (the one line a user adds)
    import torch.distributed as dist
    import torchvision
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    world = len(spec["nodes"])
    dist.init_process_group("gloo", init_method="file://" + os.path.join(spec["out"], "rdv"),
                            rank=rank, world_size=world)
    ds = torchvision.datasets.ImageFolder(node["root"], loader=digest,
                                          is_valid_file=lambda p: True)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True,
                                 seed=spec["seed"])
    loader = DataLoader(ds, batch_size=spec["batch"], sampler=sampler,
                        num_workers=spec["workers"], collate_fn=collate)
    epochs = []
    for epoch in range(spec["epochs"]):
        sampler.set_epoch(epoch)
        servers = spec.get("servers") if rank == 0 else None
        dist.barrier()
        counters = node_counters(node.get("metrics_port", 0))
        served = server_bytes(servers) if servers else {}
        before = cube_torch.stats() if spec["hook"] else None
        start = time.monotonic()
        shas = []
        for batch in loader:
            shas += [sha for sha, _ in batch]
            time.sleep(spec["pause"])
        after = cube_torch.stats() if spec["hook"] else None
        dist.barrier()
        seconds = time.monotonic() - start
        counters = minus(node_counters(node.get("metrics_port", 0)), counters)
        served = minus(server_bytes(servers), served) if servers else {}
        epochs.append({"seconds": seconds, "samples": shas, "indices": list(iter(sampler)),
                       "before": before, "after": after, "metrics": counters,
                       "servers": served})
    dist.destroy_process_group()
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "files": [os.path.relpath(p, node["root"]) for p, _ in ds.samples],
                   "epochs": epochs}, f)


# --- for the test and the bench that run this job

def run_job(mounts: list[Any], rel: str, out: str, hook: bool, timeout: float,
            servers: dict[str, list[int]] | None = None, **params: Any) -> list[dict[str, Any]]:
    """Runs the job, one rank per mount (a CubeMount of the test harness), each reading `rel`
    under its mount; `params` set epochs, batch, pause, workers, seed (defaults below).
    Returns each rank's record; raises with the job's stderr if it fails."""
    import subprocess
    spec: dict[str, Any] = {"epochs": 3, "batch": 16, "pause": 0.0, "workers": 2, "seed": 7}
    spec.update(params)
    spec.update(hook=hook, out=out, nodes=[
        {"root": str(m.path(rel)), "config_dir": str(m.config_dir), "vol_name": m.vol_name,
         "metrics_port": m.metrics_port} for m in mounts])
    if servers:
        spec["servers"] = servers
    os.makedirs(out)
    with open(os.path.join(out, "spec.json"), "w") as f:
        json.dump(spec, f)
    hooks = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "hooks")
    env = dict(os.environ, PYTHONPATH=os.path.normpath(hooks))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__),
                           os.path.join(out, "spec.json")],
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the job failed ({proc.returncode}): {proc.stderr[-4000:]}")
    ranks = []
    for r in range(len(mounts)):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def served(servers: dict[str, int], fetched: float) -> dict[str, float]:
    """What the flashnodes and the datanodes served the nodes in an epoch, and what the
    flashnodes cached, from what they wrote (`servers`: wchar) and what the nodes fetched.
    Datanodes write what they serve, to the nodes and to flashnodes filling blocks;
    flashnodes write what they serve and what they cache: fills = (datanodes + flash -
    fetched) / 2. What the nodes fetched is then split in that proportion."""
    if servers.get("flash"):
        fills = max(0.0, (servers["data"] + servers["flash"] - fetched) / 2)
        flash = max(0.0, servers["flash"] - fills)
        data = max(0.0, servers["data"] - fills)
    else:  # no flashnodes: every byte fetched came from the datanodes
        fills, flash, data = 0.0, 0.0, float(servers.get("data", 0))
    share = flash / (flash + data) if flash + data > 0 else 0.0
    return {"flash": fetched * share, "datanodes": fetched * (1 - share), "fills": fills}


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    import torch.multiprocessing as mp
    mp.spawn(rank_main, args=(spec,), nprocs=len(spec["nodes"]), join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
