"""The NVMe tier through real mounts: a restarted daemon serves what it cached with no backend
data request, a corrupted chunk file is caught and refetched, and a changed file is read fresh."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from cubefs_harness import (CubeFactory, CubeMount, UnixHTTPConnection, call,
                             environment_problem, wait_until)

pytestmark = pytest.mark.skipif(environment_problem() is not None,
                                reason=environment_problem() or "")


def make_files(root: Path, count: int, size: int) -> dict[str, bytes]:
    rng = random.Random(11)
    out = {}
    for i in range(count):
        rel = f"d{i % 5}/f{i:04d}.bin"
        data = rng.randbytes(size + rng.randrange(size // 2))
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        out[rel] = data
    return out


def nvme_overrides(disk: Path, memory: str = "8MiB") -> dict[str, Any]:
    return {"profile": "ai_prefetch",
            "cache": {"memory_bytes": memory, "chunk_bytes": "1MiB",
                      "disk_dir": str(disk), "disk_bytes": "256MiB"}}


def backend_reads(mount: CubeMount) -> float:
    return mount.metrics().value("cubetorchfs_backend_requests_total", op="read", status="ok")


def read_all(mount: CubeMount, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        assert mount.path(rel).read_bytes() == data, rel


def chunk_files(disk: Path) -> list[Path]:
    return sorted((disk / "data").iterdir())


def test_restart_serves_from_nvme_with_no_backend_reads(cube: CubeFactory, tmp_path: Path) -> None:
    src, disk = tmp_path / "src", tmp_path / "nvme"
    files = make_files(src, 60, 200_000)  # ~18 MB: more than the 8 MiB of RAM
    first = cube.mount(src, nvme_overrides(disk))
    read_all(first, files)
    assert backend_reads(first) == len(files)
    assert first.metrics().value("cubetorchfs_cache_bytes", tier="disk") > 0
    assert first.fusermount().returncode == 0 and first.wait_gone()
    assert len(chunk_files(disk)) == len(files)

    second = cube.mount(src, nvme_overrides(disk))  # a restarted daemon, same disk_dir
    read_all(second, files)
    m = second.metrics()
    assert backend_reads(second) == 0
    # Each chunk comes from NVMe once, then from RAM for the rest of its reads.
    assert m.value("cubetorchfs_read_bytes_total", source="backend") == 0
    assert m.value("cubetorchfs_read_bytes_total", source="disk") > 0
    assert m.value("cubetorchfs_reads_total", result="miss") == 0


def test_corrupted_chunk_is_refetched_and_counted(cube: CubeFactory, tmp_path: Path) -> None:
    src, disk = tmp_path / "src", tmp_path / "nvme"
    files = make_files(src, 6, 100_000)
    first = cube.mount(src, nvme_overrides(disk))
    read_all(first, files)
    assert first.fusermount().returncode == 0 and first.wait_gone()
    victims = chunk_files(disk)[:3]
    for path in victims:  # flip one byte in the middle of each
        with open(path, "r+b") as f:
            f.seek(5000)
            b = f.read(1)
            f.seek(5000)
            f.write(bytes([b[0] ^ 0xFF]))

    second = cube.mount(src, nvme_overrides(disk))
    read_all(second, files)  # correct bytes all the same
    m = second.metrics()
    assert m.value("cubetorchfs_cache_corruptions_total") == len(victims)
    assert backend_reads(second) == len(victims)


def test_changed_file_is_never_served_stale_from_nvme(cube: CubeFactory, tmp_path: Path) -> None:
    src, disk = tmp_path / "src", tmp_path / "nvme"
    files = make_files(src, 3, 50_000)
    first = cube.mount(src, nvme_overrides(disk))
    read_all(first, files)
    assert first.fusermount().returncode == 0 and first.wait_gone()
    rel = next(iter(files))
    new = os.urandom(len(files[rel]))  # same size: only the mtime tells
    (src / rel).write_bytes(new)
    os.utime(src / rel, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    files[rel] = new
    second = cube.mount(src, nvme_overrides(disk))
    read_all(second, files)
    assert backend_reads(second) == 1


def test_prefetch_uses_the_nvme_tier_after_restart(cube: CubeFactory, tmp_path: Path) -> None:
    """A published stream whose files are on the NVMe tier costs only metadata requests."""
    src, disk = tmp_path / "src", tmp_path / "nvme"
    files = make_files(src, 20, 50_000)
    first = cube.mount(src, nvme_overrides(disk))
    read_all(first, files)
    assert first.fusermount().returncode == 0 and first.wait_gone()

    second = cube.mount(src, nvme_overrides(disk))
    sock = second.read_control()["control_socket"]

    def control(method: str, target: str, body: Any = None) -> Any:
        status, data = call(UnixHTTPConnection(sock), method, target, body)
        assert status < 300, (status, data)
        return json.loads(data) if data else None

    sid = control("POST", "/v1/streams", {"name": "t", "pid": 1})["id"]
    control("POST", f"/v1/streams/{sid}/paths", {"paths": list(files)})
    assert wait_until(lambda: control("GET", "/v1/stats")["global"]["prefetch"]["fetched"] == 20,
                      timeout=20)
    read_all(second, files)
    assert backend_reads(second) == 0
    assert second.metrics().value("cubetorchfs_reads_total", result="hit") >= 20


def test_disk_dir_without_disk_bytes_is_a_config_error(cube: CubeFactory, tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_files(src, 1, 10)
    instance = cube.prepare(src, {"cache": {"disk_dir": str(tmp_path / "nvme")}})
    result = cube.launch(instance)
    assert result.returncode == 2
    assert "cache.disk_bytes" in result.stderr


def run_warmup(instance: CubeMount, *args: str) -> "subprocess.CompletedProcess[str]":
    import subprocess

    from cubefs_harness import BINARY
    return subprocess.run([str(BINARY), "warmup", "-c", str(instance.config_path), *args],
                          env=instance.env(), capture_output=True, text=True, timeout=120)


def test_warmup_fills_the_tier_and_resumes(cube: CubeFactory, tmp_path: Path) -> None:
    src, disk = tmp_path / "src", tmp_path / "nvme"
    files = make_files(src, 30, 60_000)
    instance = cube.prepare(src, nvme_overrides(disk))
    r = run_warmup(instance, "/")  # no daemon: this process fills the tier itself
    assert r.returncode == 0, r.stderr
    assert "30 fetched" in r.stderr and "0 failed" in r.stderr
    assert len(chunk_files(disk)) == 30
    again = run_warmup(instance, "/")
    assert again.returncode == 0 and "30 already cached" in again.stderr, again.stderr
    result = cube.launch(instance)
    assert result.returncode == 0 and instance.wait_ready()
    instance.learn_pid()
    read_all(instance, files)
    assert backend_reads(instance) == 0


def test_warmup_through_a_running_daemon(cube: CubeFactory, tmp_path: Path) -> None:
    src, disk = tmp_path / "src", tmp_path / "nvme"
    files = make_files(src, 20, 60_000)
    mount = cube.mount(src, nvme_overrides(disk))
    listing = tmp_path / "list.txt"
    some = sorted(files)[:10]
    listing.write_text("".join(str(mount.path(rel)) + "\n" for rel in some))
    r = run_warmup(mount, "--list", str(listing))
    assert r.returncode == 0, r.stderr
    assert "through the running daemon" in r.stderr and "10 fetched" in r.stderr
    r = run_warmup(mount, str(mount.path("d1")))  # a directory under the mount
    assert r.returncode == 0 and "0 failed" in r.stderr, r.stderr
    for rel in some:
        assert mount.path(rel).read_bytes() == files[rel]
    assert backend_reads(mount) == 10 + 4 - len([rel for rel in some if rel.startswith("d1/")])


def test_warmup_without_a_tier_says_so(cube: CubeFactory, tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_files(src, 1, 10)
    instance = cube.prepare(src)
    r = run_warmup(instance, "/")
    assert r.returncode == 2 and "no NVMe tier" in r.stderr
