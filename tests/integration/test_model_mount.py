"""Model files through a real mount: cube_torch.load_file under a cubetorchfs mount gets a
descriptor of the resident file from the daemon (SCM_RIGHTS over the control socket) and
loads exactly what a direct load gives; without it, it reads through FUSE, where the first
read of a *.safetensors file starts parallel chunk fetches. The /v1/files/open errors are
checked over the real socket."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cubefs_harness import (REPO_ROOT, CubeFactory, CubeMount, UnixHTTPConnection, call,
                             environment_problem, wait_until)

pytestmark = pytest.mark.skipif(environment_problem() is not None,
                                reason=environment_problem() or "")

KEY_B64 = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="  # 32 bytes: AES-256

# Runs in a child process, as a training script would: save, or load and digest.
CHILD = r"""
import hashlib, json, sys, torch, cube_torch
op, path = sys.argv[1], sys.argv[2]
if op == "save":
    g = torch.Generator().manual_seed(int(sys.argv[4]) if len(sys.argv) > 4 else 5)
    t = {f"layer{i}.weight": torch.randn(256, 1024, generator=g) for i in range(12)}
    t["odd"] = torch.randint(0, 2, (7,), dtype=torch.bool)
    t["bf"] = torch.randn(33, generator=g).bfloat16()
    cube_torch.save_file(t, path, metadata={"m": "1"}, use_cipher=sys.argv[3] == "1")
else:
    out = cube_torch.load_file(path)
    h = hashlib.sha256()
    for k in sorted(out):
        h.update(k.encode()); h.update(str(out[k].dtype).encode())
        h.update(out[k].contiguous().view(torch.uint8).numpy().tobytes())
    print(json.dumps({"digest": h.hexdigest(), "stats": cube_torch.stats().get("global", {})}))
"""


def child(mount: CubeMount | None, *args: str, **env_extra: str) -> dict[str, Any]:
    env = mount.env() if mount is not None else dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT / "hooks")
    env["VETURBOIO_KEY"] = KEY_B64
    env.update(env_extra)
    r = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout) if r.stdout.strip() else {}


@pytest.fixture()
def models(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "models").mkdir(parents=True)
    child(None, "save", str(src / "models" / "plain.safetensors"), "0")
    child(None, "save", str(src / "models" / "enc.safetensors"), "1")
    return src


def files_open(stats: dict[str, Any]) -> dict[str, int]:
    return stats.get("files_open", {})


@pytest.mark.parametrize("kind", ["store", "memory"])
@pytest.mark.parametrize("name", ["plain.safetensors", "enc.safetensors"])
def test_load_through_mount_uses_daemon_fd_and_equals_direct(cube: CubeFactory, models: Path,
                                                             name: str, kind: str) -> None:
    # A posix store hands over its own file; with fault injection on, the daemon makes a
    # memory copy with parallel ranged reads instead.
    backend = {"inject": {"latency_us": 100}} if kind == "memory" else {}
    mount = cube.mount(models, {"cache": {"chunk_bytes": "1MiB"}, "backend": backend})
    direct = child(None, "load", str(models / "models" / name))
    through = child(mount, "load", str(mount.path(f"models/{name}")))
    assert through["digest"] == direct["digest"]
    opened = files_open(through["stats"])
    assert opened.get("opened") == 1 and opened.get("failed") == 0, opened
    assert opened.get("bytes") == (models / "models" / name).stat().st_size
    assert opened.get("store_files") == (1 if kind == "store" else 0), opened
    reads = mount.metrics().value("cubetorchfs_backend_requests_total", op="read", status="ok")
    size = (models / "models" / name).stat().st_size
    assert reads == (0 if kind == "store" else -(-size // (1 << 20))), reads


def test_second_load_comes_from_the_nvme_tier(cube: CubeFactory, models: Path,
                                             tmp_path: Path) -> None:
    # With an NVMe tier the daemon makes memory copies and keeps the chunks on the tier: a
    # second load on this node reads nothing from the store.
    mount = cube.mount(models, {"cache": {"chunk_bytes": "1MiB", "disk_dir": str(tmp_path / "nvme"),
                                          "disk_bytes": "256MiB"}})
    path = mount.path("models/plain.safetensors")
    size = (models / "models" / "plain.safetensors").stat().st_size

    def backend_reads() -> float:
        return mount.metrics().value("cubetorchfs_backend_requests_total", op="read", status="ok")

    first = child(mount, "load", str(path))
    assert backend_reads() == -(-size // (1 << 20))
    assert wait_until(lambda: mount.metrics().value("cubetorchfs_cache_bytes", tier="disk") >= size,
                      timeout=20)
    reads_after_first = backend_reads()
    second = child(mount, "load", str(path))
    assert second["digest"] == first["digest"]
    assert backend_reads() == reads_after_first
    opened = files_open(second["stats"])
    assert opened.get("opened") == 2 and opened.get("store_files") == 0, opened


def test_without_daemon_fd_reads_through_fuse_with_parallel_chunks(cube: CubeFactory,
                                                                   models: Path) -> None:
    # RAM for the whole file in every shard of the cache: no chunk is evicted and refetched.
    mount = cube.mount(models, {"cache": {"chunk_bytes": "1MiB", "memory_bytes": "512MiB"}})
    direct = child(None, "load", str(models / "models" / "plain.safetensors"))
    through = child(mount, "load", str(mount.path("models/plain.safetensors")),
                    CUBE_TORCH_NO_DAEMON_FD="1")
    assert through["digest"] == direct["digest"]
    assert files_open(through["stats"]).get("opened", 0) == 0
    m = mount.metrics()
    chunks = -(-(models / "models" / "plain.safetensors").stat().st_size // (1 << 20))
    # Every chunk was fetched once, by the parallel model fetch or a demand read.
    assert m.value("cubetorchfs_backend_requests_total", op="read", status="ok") == chunks
    # The parallel fetch ran ahead of the readers: not every read had to fetch for itself.
    assert m.value("cubetorchfs_reads_total", result="miss") < chunks


def test_changed_file_is_served_fresh(cube: CubeFactory, models: Path) -> None:
    mount = cube.mount(models)
    path = mount.path("models/plain.safetensors")
    first = child(mount, "load", str(path))
    child(None, "save", str(models / "models" / "plain.safetensors"), "1", "6")  # other tensors
    second = child(mount, "load", str(path))
    assert second["digest"] == child(None, "load", str(models / "models" / "plain.safetensors"))["digest"]
    assert second["digest"] != first["digest"]
    assert files_open(second["stats"]).get("opened") == 2


def test_files_open_errors(cube: CubeFactory, models: Path) -> None:
    mount = cube.mount(models)
    sock = mount.read_control()["control_socket"]
    # Each error names its failure for programs: a code and its errno (docs/errors.md).
    cases = [
        ({"path": str(mount.path("models/none.safetensors"))}, 404, "no such file", "not_found",
         errno.ENOENT),
        ({"path": "/etc/passwd"}, 422, "outside", "invalid_argument", errno.EINVAL),
        ({"path": str(mount.path("models"))}, 400, "not a regular file", "is_directory",
         errno.EISDIR),
        ({"nope": 1}, 400, "path", "invalid_argument", errno.EINVAL),
        ("{not json", 400, "", "invalid_argument", errno.EINVAL),
    ]
    for body, status, text, name, err in cases:
        conn = UnixHTTPConnection(sock)
        try:
            code, reply = call(conn, "POST", "/v1/files/open", body)
        finally:
            conn.close()
        assert code == status, (body, code, reply)
        parsed = json.loads(reply)
        assert text in parsed["error"], reply
        assert (parsed["code"], parsed["errno"]) == (name, err), reply
    conn = UnixHTTPConnection(sock)
    try:
        assert call(conn, "GET", "/v1/files/open")[0] == 405
    finally:
        conn.close()
    # The daemon is still serving.
    assert (mount.path("models/plain.safetensors")).stat().st_size > 0
