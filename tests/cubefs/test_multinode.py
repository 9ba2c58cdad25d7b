"""Several training nodes on one machine, each with its own cubetorchfs over the same CubeFS
volume, sharing CubeFS's distributed cache: 3 daemons (own mount, RAM and NVMe caches,
control socket and control-file directory), natively through libcfs with
`backend.cubefs.remote_cache`, and 3 ranks of a gloo job (multinode_job.py) reading their
DistributedSampler shares with set_epoch and `import cube_torch`, for 3 epochs."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from cluster import Cluster
from cubefs_harness import CubeFactory, CubeMount, deep_merge
from multinode_job import run_job, served

NODES = 3
EPOCHS = 3
FILES = 960  # 320 a rank an epoch
JOB_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def dataset(cfs_mount: Path) -> dict[str, Any]:
    """FILES files of 16-48 KB in 6 classes, written through cfs-client."""
    root = cfs_mount / "multinode" / "train"
    digests: dict[str, str] = {}
    for i in range(FILES):
        d = root / f"class_{i % 6}"
        d.mkdir(parents=True, exist_ok=True)
        data = os.urandom(16_384 + (i * 7919) % 32_768)
        (d / f"s{i:04d}.bin").write_bytes(data)
        digests[hashlib.sha256(data).hexdigest()] = f"class_{i % 6}/s{i:04d}.bin"
    return {"rel": "multinode/train", "digests": digests}


def start_nodes(cube: CubeFactory, cluster: Cluster, tmp_path: Path) -> list[CubeMount]:
    cluster.wait_flash_view()
    nodes = []
    for i in range(NODES):
        nvme = tmp_path / f"nvme{i}"
        nvme.mkdir()
        overrides: dict[str, Any] = dict(cluster.native_config(remote_cache=True))
        overrides["cache"] = {"memory_bytes": "96MiB", "disk_dir": str(nvme),
                              "disk_bytes": "256MiB"}
        nodes.append(cube.mount(tmp_path / f"node{i}", overrides))
    return nodes


def test_three_nodes_share_the_flash_cache_and_read_what_they_would_without_the_hook(
        cube: CubeFactory, cluster: Cluster, tmp_path: Path, dataset: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBE_TORCH_LOOKAHEAD_BATCHES", "8")  # the job's ranks inherit it
    nodes = start_nodes(cube, cluster, tmp_path)
    job = dict(epochs=EPOCHS, batch=16, pause=0.12, timeout=JOB_TIMEOUT_S)
    servers = {"data": cluster.server_pids("data"), "flash": cluster.server_pids("flash")}
    ranks = run_job(nodes, dataset["rel"], str(tmp_path / "hook"), True, servers=servers, **job)
    # The same job without the hook: the reference. Through the same mounts (cfs-client, read
    # by three ranks at once, has been seen to list some entries twice).
    plain = run_job(nodes, dataset["rel"], str(tmp_path / "plain"), False, **job)
    for r in range(NODES):
        files = ranks[r]["files"]
        held: set[int] = set()
        for e in range(EPOCHS):
            got, want = ranks[r]["epochs"][e], plain[r]["epochs"][e]
            # Each rank reads exactly the samples of a run without the hook, in its order,
            # every one byte-identical to the file written.
            assert got["indices"] == want["indices"], (r, e)
            assert got["samples"] == want["samples"], (r, e)
            assert [dataset["digests"][s] for s in got["samples"]] == \
                [files[i] for i in got["indices"]], (r, e)
            # Every read the node's daemon served was prefetched.
            before, after = got["before"]["global"]["reads"], got["after"]["global"]["reads"]
            delta = {k: after[k] - before[k] for k in ("hit", "late", "miss")}
            total = sum(delta.values())
            assert total >= len(got["indices"]), (r, e, delta)
            assert delta["hit"] / total >= 0.99, (r, e, delta)
            # Node-local first: a file the node holds (read in an earlier epoch, kept by its RAM
            # cache or NVMe tier) is not fetched again; each file it lacks is fetched once.
            new = set(got["indices"]) - held
            m = got["metrics"]
            assert m["store_reads"] == len(new), (r, e, m, len(new))
            held |= set(got["indices"])
    # The volume's blocks read in epoch 1 were cached by the flashnodes: from epoch 2 on, what
    # the nodes fetch comes from them, not from the datanodes (wchar: what each kind served).
    shares = []
    for e in range(EPOCHS):
        fetched = sum(ranks[r]["epochs"][e]["metrics"]["store_bytes"] for r in range(NODES))
        came = served(ranks[0]["epochs"][e]["servers"], fetched)
        print(f"epoch {e + 1}: nodes fetched {fetched / 1e6:.1f} MB, from datanodes "
              f"{came['datanodes'] / 1e6:.1f} MB, from flash {came['flash'] / 1e6:.1f} MB, "
              f"flash fills {came['fills'] / 1e6:.1f} MB")
        total_bytes = sum(ranks[r]["epochs"][e]["metrics"][k] for r in range(NODES)
                          for k in ("ram_bytes", "nvme_bytes", "miss_bytes"))
        shares.append((e, came["datanodes"], total_bytes, ranks[0]["epochs"][e]["servers"],
                       fetched))
    # Target: from epoch 2 on, at least 90 % of the bytes the ranks read come from their
    # node's caches or the flash cache, at most 10 % from the datanodes.
    for e, from_datanodes, total_bytes, s, fetched in shares[1:]:
        assert from_datanodes <= 0.1 * total_bytes, (e, s, fetched, total_bytes)


def test_the_stock_sdk_with_remote_cache_stops_the_start_naming_the_key(
        cube: CubeFactory, cluster: Cluster, tmp_path: Path) -> None:
    """The stock libcfs.so refuses enableRemoteCache: the daemon must not read around the
    cache the config asks for, but stop at once with exit 2 and one line saying why."""
    overrides = deep_merge(cluster.native_config(),
                           {"backend": {"cubefs": {"remote_cache": True}}})
    mount = cube.prepare(tmp_path / "root", overrides)
    result = cube.launch(mount)
    assert result.returncode == 2, result
    [line] = result.stderr_lines
    assert "backend.cubefs.remote_cache" in line and "enableRemoteCache" in line, line
    assert str(cluster.script.parent / "bin" / "libcfs.so") in line, line
    assert not mount.is_mounted()
