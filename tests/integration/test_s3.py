"""The s3 backend against a real S3 server on loopback (moto, started per module on a free
port and always stopped): a mounted bucket reads like the tree that was uploaded, listings
past 1000 keys, nested prefixes, ranged reads of a large object, a server that stops mid-read
(EIO within the timeout, then recovery), bad endpoints and buckets at start-up, correct SigV4
signatures, prefetch through `import cube_torch`, and the write path (staging files uploaded on
fsync/close, multipart, copy+delete rename, a failed upload kept for retry)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from cubefs_harness import (CubeFactory, CubeMount, bounded, check_paged_listing,
                            environment_problem, errno_of, free_tcp_port, wait_until)
from s3_testlib import (ACCESS_KEY, SECRET_KEY, S3Server, SigV4CheckingProxy,
                        aws_example_signature, s3_server_problem, wait_port_free)

_problem = environment_problem() or s3_server_problem()
pytestmark = pytest.mark.skipif(_problem is not None, reason=_problem or "")

REPO = Path(__file__).resolve().parents[2]
BUCKET = "data"
MANY = 1234  # keys in one directory: two ListObjectsV2 pages
BIG = 40 << 20


def s3_backend(endpoint: str, bucket: str = BUCKET, **extra: Any) -> dict[str, Any]:
    backend = {"type": "s3", "root": None, "endpoint": endpoint, "bucket": bucket,
               "access_key": ACCESS_KEY, "secret_key": SECRET_KEY}
    backend.update(extra)
    return backend


def mount_s3(cube: CubeFactory, tmp_path: Path, endpoint: str, bucket: str = BUCKET,
             overrides: Optional[dict[str, Any]] = None, **extra: Any) -> CubeMount:
    return cube.mount(tmp_path, {"backend": s3_backend(endpoint, bucket, **extra),
                                 **(overrides or {})})


def make_tree(root: Path) -> None:
    """Nested directories, names with spaces and non-ASCII letters, an empty file, and files
    from a few bytes to just over a cache chunk. Each directory holds a file of its own."""
    rng = random.Random(7)
    files = {
        "top.txt": b"top\n",
        "with space.txt": b"spaces in the key\n",
        "\u00fcn\u00efc\u00f8de \u20ac.txt": "n\u00e4me\n".encode(),
        "plus+and=eq&amp.txt": b"punctuation\n",
        "empty.txt": b"",
        "nested/readme.txt": b"nested\n",
        "nested/a/b/b.txt": b"b\n",
        "nested/a/b/c/deep.txt": b"deep\n",
        "nested/a/x.bin": rng.randbytes(200 << 10),
        "nested/sib/one.txt": b"1\n",
        "nested/sib/chunk_plus_one.bin": rng.randbytes((4 << 20) + 1),
    }
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def dataset(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Bucket `data`: tree/ (the local tree), many/ (MANY keys), big/blob.bin (40 MiB of random
    bytes). No "dir/" marker objects (the unit tests cover how markers are listed)."""
    local = tmp_path_factory.mktemp("local") / "tree"
    make_tree(local)
    big = random.Random(11).randbytes(BIG)
    client = s3.client()
    try:
        client.create_bucket(BUCKET)
        client.put_tree(BUCKET, local, "tree/")
        for i in range(MANY):
            client.put(BUCKET, f"many/f{i:04d}.txt", f"{i}\n".encode())
        client.put(BUCKET, "big/blob.bin", big)
    finally:
        client.close()
    return {"local": local, "big": big}


def snapshot(root: Path) -> dict[str, Any]:
    """Every path under root: None for a directory, the bytes of a file (diff -r, in data)."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        for d in dirnames:
            out[(rel / d).as_posix()] = None
        for f in filenames:
            out[(rel / f).as_posix()] = (Path(dirpath) / f).read_bytes()
    return out


def test_the_signature_helper_matches_the_aws_documentation() -> None:
    # The example of "Signature Calculations for the Authorization Header" (GET with Range).
    assert aws_example_signature() == \
        "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"


def test_a_mounted_bucket_reads_like_the_uploaded_tree(cube: CubeFactory, tmp_path: Path,
                                                        s3: S3Server, dataset: dict[str, Any]
                                                        ) -> None:
    mount = mount_s3(cube, tmp_path, s3.endpoint, prefix="tree/")
    got = bounded(snapshot, mount.path(), what="walk the mount")
    want = snapshot(dataset["local"])
    assert sorted(got) == sorted(want)
    for rel, data in want.items():
        assert got[rel] == data, rel
        if data is not None:
            st = os.stat(mount.path(rel))
            assert st.st_size == len(data)
            assert abs(st.st_mtime - time.time()) < 600  # Last-Modified of the upload
            assert oct(st.st_mode & 0o777) == "0o644"
    assert errno_of(lambda: os.stat(mount.path("no such file"))) == errno.ENOENT
    assert errno_of(lambda: os.listdir(mount.path("nested/nope"))) == errno.ENOENT
    assert os.statvfs(mount.path()).f_blocks > 0


def test_a_prefix_is_listed_in_pages_and_resumes(cube: CubeFactory, tmp_path: Path,
                                                 s3: S3Server, dataset: dict[str, Any]) -> None:
    # Pages of 100 entries: LIST requests of max-keys 100, resumed by continuation token.
    mount = mount_s3(cube, tmp_path, s3.endpoint, overrides={"fuse": {"list_page_entries": 100}})
    check_paged_listing(mount, "many", {f"f{i:04d}.txt" for i in range(MANY)}, 100)


def test_listing_more_than_1000_keys(cube: CubeFactory, tmp_path: Path, s3: S3Server,
                                     dataset: dict[str, Any]) -> None:
    mount = mount_s3(cube, tmp_path, s3.endpoint)
    names = bounded(os.listdir, mount.path("many"), what="list many/")
    assert sorted(names) == [f"f{i:04d}.txt" for i in range(MANY)]
    assert sorted(os.listdir(mount.path())) == ["big", "many", "tree"]
    for i in (0, 999, 1000, MANY - 1):
        assert mount.path(f"many/f{i:04d}.txt").read_bytes() == f"{i}\n".encode()
    m = mount.metrics()
    assert m.value("cubetorchfs_backend_requests_total", op="list", status="ok") >= 2


def test_nested_prefixes(cube: CubeFactory, tmp_path: Path, s3: S3Server,
                         dataset: dict[str, Any]) -> None:
    whole = mount_s3(cube, tmp_path, s3.endpoint)
    assert whole.path("tree/nested/a/b/c/deep.txt").read_bytes() == b"deep\n"
    assert sorted(os.listdir(whole.path("tree/nested"))) == ["a", "readme.txt", "sib"]
    assert sorted(os.listdir(whole.path("tree/nested/a"))) == ["b", "x.bin"]
    assert sorted(os.listdir(whole.path("tree/nested/a/b"))) == ["b.txt", "c"]
    for d in ("tree", "tree/nested", "tree/nested/a/b/c"):
        assert os.path.isdir(whole.path(d)), d
    assert os.path.isfile(whole.path("tree/nested/a/x.bin"))
    # A key prefix deep in the bucket serves as the root of the mount.
    deep = mount_s3(cube, tmp_path, s3.endpoint, prefix="tree/nested/a")
    assert sorted(os.listdir(deep.path())) == ["b", "x.bin"]
    assert deep.path("b/c/deep.txt").read_bytes() == b"deep\n"
    assert deep.path("x.bin").read_bytes() == (dataset["local"] / "nested/a/x.bin").read_bytes()


def test_virtual_hosted_style_urls(cube: CubeFactory, tmp_path: Path, s3: S3Server,
                                   dataset: dict[str, Any]) -> None:
    mount = mount_s3(cube, tmp_path, s3.vhost_endpoint, path_style=False, prefix="tree")
    assert sorted(os.listdir(mount.path("nested/a"))) == ["b", "x.bin"]
    rel = "\u00fcn\u00efc\u00f8de \u20ac.txt"
    assert mount.path(rel).read_bytes() == (dataset["local"] / rel).read_bytes()
    whole = mount_s3(cube, tmp_path, s3.vhost_endpoint, path_style=False)
    assert len(bounded(os.listdir, whole.path("many"), what="list many/")) == MANY


def test_ranged_reads_of_a_large_object(cube: CubeFactory, tmp_path: Path, s3: S3Server,
                                        dataset: dict[str, Any]) -> None:
    big: bytes = dataset["big"]
    mount = mount_s3(cube, tmp_path, s3.endpoint)
    path = mount.path("big/blob.bin")
    assert os.stat(path).st_size == BIG
    digest = bounded(lambda: hashlib.sha256(path.read_bytes()).hexdigest(), what="read 40 MiB")
    assert digest == hashlib.sha256(big).hexdigest()
    # A second mount starts cold: random ranges, across chunk boundaries and past the end.
    cold = mount_s3(cube, tmp_path, s3.endpoint)
    rng = random.Random(5)
    chunk = 4 << 20
    ranges = [(chunk - 10, 20), (BIG - 100, 1000), (BIG, 10), (0, 1), (3 * chunk, chunk + 7)]
    ranges += [(rng.randrange(BIG), rng.randrange(1, 300_000)) for _ in range(60)]

    def read_ranges() -> None:
        fd = os.open(cold.path("big/blob.bin"), os.O_RDONLY)
        try:
            for off, n in ranges:
                assert os.pread(fd, n, off) == big[off:off + n], (off, n)
        finally:
            os.close(fd)

    bounded(read_ranges, timeout=60, what="random ranged reads")


def test_a_server_that_stops_mid_read_gives_eio_then_recovers(cube: CubeFactory, tmp_path: Path
                                                              ) -> None:
    server = S3Server(tmp_path / "flaky-s3").start()
    size = 32 << 20
    data = random.Random(3).randbytes(size)

    def fill() -> None:  # moto keeps objects in memory: a restarted server starts empty
        client = server.client()
        try:
            client.create_bucket("flaky")
            client.put("flaky", "blob", data)
        finally:
            client.close()

    try:
        fill()
        timeout_ms, retries = 1000, 1
        mount = mount_s3(cube, tmp_path, server.endpoint, "flaky", timeout_ms=timeout_ms,
                         retries=retries)
        path = mount.path("blob")
        progress = {"bytes": 0, "error": None, "failed_at": None}

        def reader() -> None:
            try:
                with open(path, "rb", buffering=0) as f:
                    while True:
                        piece = f.read(1 << 20)
                        if not piece:
                            return
                        progress["bytes"] += len(piece)
                        time.sleep(0.05)  # slow enough to be caught mid-read
            except OSError as exc:
                progress["error"] = exc.errno
                progress["failed_at"] = time.monotonic()

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        assert wait_until(lambda: progress["bytes"] >= 4 << 20, 20)
        server.pause()  # connections stay open; no answer ever comes
        paused_at = time.monotonic()
        thread.join(30)
        assert not thread.is_alive(), "the read hung on a stopped server"
        assert progress["error"] == errno.EIO, progress
        assert progress["bytes"] < size
        # Two attempts of 1 s each plus the backoff, for each of the few chunks in flight.
        assert progress["failed_at"] - paused_at < 15, progress["failed_at"] - paused_at
        # Gone entirely (connection refused): still EIO, quickly.
        server.stop()
        start = time.monotonic()
        assert errno_of(lambda: bounded(lambda: _pread(path, 1 << 20, size - (1 << 20)),
                                        timeout=20)) == errno.EIO
        assert time.monotonic() - start < 10
        # Back on the same port with the same object: the same mount reads all of it again.
        assert wait_port_free(server.port)
        server.start()
        fill()
        got = bounded(path.read_bytes, timeout=30, what="read after the restart")
        assert got == data
    finally:
        server.stop()


def _pread(path: Path, n: int, off: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, off)
    finally:
        os.close(fd)


def test_bad_endpoint_or_bucket_exits_2_naming_the_key(cube: CubeFactory, tmp_path: Path,
                                                        s3: S3Server, dataset: dict[str, Any]
                                                        ) -> None:
    cases = [
        (s3_backend(f"http://127.0.0.1:{free_tcp_port()}"), "backend.endpoint"),
        (s3_backend(s3.endpoint, "no-such-bucket"), "backend.bucket"),
        (s3_backend("127.0.0.1:9000"), "backend.endpoint"),
        (s3_backend(s3.endpoint, prefix="/abs"), "backend.prefix"),
        ({"type": "s3", "endpoint": s3.endpoint}, "backend.root"),  # root is for posix only
    ]
    for backend, key in cases:
        instance = cube.prepare(tmp_path, {"backend": backend})
        result = cube.launch(instance, timeout=30)
        assert result.returncode == 2, (backend, result.stderr)
        assert len(result.stderr_lines) == 1, result.stderr
        assert result.stderr_lines[0].startswith(f"cubetorchfs: {key}: "), result.stderr
        assert result.seconds < 15, result.seconds
        assert not instance.is_mounted()
        assert SECRET_KEY not in result.stderr


def test_requests_are_signed_as_s3_checks_them(cube: CubeFactory, tmp_path: Path, s3: S3Server,
                                                dataset: dict[str, Any]) -> None:
    proxy = SigV4CheckingProxy(s3.port)
    try:
        mount = mount_s3(cube, tmp_path, proxy.endpoint)
        assert len(bounded(os.listdir, mount.path("many"), what="list")) == MANY
        local = dataset["local"]
        for rel in ("with space.txt", "\u00fcn\u00efc\u00f8de \u20ac.txt",
                    "plus+and=eq&amp.txt", "nested/a/x.bin"):
            assert mount.path("tree/" + rel).read_bytes() == (local / rel).read_bytes(), rel
        assert sorted(os.listdir(mount.path("tree/nested/a/b"))) == ["b.txt", "c"]
        assert proxy.checked >= 8
        assert proxy.mismatches == []
        # A wrong secret is refused at start-up, naming the key.
        instance = cube.prepare(tmp_path, {"backend": s3_backend(proxy.endpoint,
                                                                 secret_key="wrong")})
        result = cube.launch(instance, timeout=30)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("cubetorchfs: backend.secret_key: "), result.stderr
        assert "wrong" not in result.stderr
    finally:
        proxy.close()


IMAGES = 360
EPOCH = """
import json, os, sys
import cube_torch
import torch, torchvision
from torchvision import transforms
root = sys.argv[1]
torch.manual_seed(1234)
ds = torchvision.datasets.ImageFolder(root, transform=transforms.ToTensor())
loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, num_workers=2)
labels, snapshot = [], None
for i, (x, y) in enumerate(loader):
    labels += y.tolist()
    if i == 3:
        snapshot = cube_torch.stats()
print(json.dumps({"labels": labels, "snapshot": snapshot, "final": cube_torch.stats()}))
"""


def test_prefetch_through_cube_torch_on_an_s3_mount(cube: CubeFactory, tmp_path: Path,
                                                    s3: S3Server) -> None:
    import numpy as np
    from PIL import Image

    client = s3.client()
    rng = np.random.default_rng(3)
    try:
        client.create_bucket("jpegs")
        for i in range(IMAGES):
            path = tmp_path / "img.jpg"
            Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)).save(
                path, quality=85)
            client.put("jpegs", f"train/class_{i % 6}/img_{i:04d}.jpg", path.read_bytes())
    finally:
        client.close()
    mount = mount_s3(cube, tmp_path, s3.endpoint, "jpegs", overrides={"profile": "ai_prefetch"})
    env = dict(mount.env(), VOL_NAME=mount.vol_name, CUBE_TORCH_LOOKAHEAD_BATCHES="4",
               PYTHONPATH=str(REPO / "hooks"))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(EPOCH), str(mount.path("train"))],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(out["labels"]) == sorted(i % 6 for i in range(IMAGES))
    before, after = out["snapshot"]["global"]["reads"], out["final"]["global"]["reads"]
    delta = {k: after[k] - before[k] for k in ("hit", "late", "miss")}
    total = sum(delta.values())
    assert total >= IMAGES // 2, out["final"]  # the workers read well past the snapshot
    assert (delta["hit"] + delta["late"]) / total >= 0.95, delta
    assert out["final"]["global"]["prefetch"]["fetched"] >= IMAGES - 10, out["final"]
    m = mount.metrics()
    assert m.value("cubetorchfs_prefetch_files_total", outcome="fetched") >= IMAGES - 10
    assert m.value("cubetorchfs_backend_requests_total", op="read", status="error") == 0


# --------------------------------------------------------------------------- writes

WRITE_BUCKET = "ckpt"


@pytest.fixture(scope="module")
def write_bucket(s3: S3Server) -> str:
    client = s3.client()
    try:
        client.create_bucket(WRITE_BUCKET)
        client.put(WRITE_BUCKET, "run/keep.txt", b"makes run/ a directory\n")
        client.put(WRITE_BUCKET, "old.bin", b"old object")
    finally:
        client.close()
    return WRITE_BUCKET


def s3_get(s3: S3Server, key: str) -> Optional[bytes]:
    client = s3.client()
    try:
        status, body = client.request("GET", f"/{WRITE_BUCKET}/{key}")
    finally:
        client.close()
    return body if status == 200 else None


@pytest.mark.parametrize("profile", ["", "ai_prefetch"])
def test_checkpoint_through_an_s3_mount(cube: CubeFactory, tmp_path: Path, s3: S3Server,
                                        write_bucket: str, profile: str) -> None:
    """Four writer threads, shards fsynced, .metadata.tmp renamed to .metadata (copy + delete);
    a shard over multipart_bytes goes up in parallel parts. Every request's signature is
    checked; the bytes are read back from the server, through the mount, and after a remount."""
    from test_write import write_checkpoint  # the same pattern as over posix

    proxy = SigV4CheckingProxy(s3.port)
    try:
        staging = tmp_path / "staging"
        mount = mount_s3(cube, tmp_path, proxy.endpoint, write_bucket,
                         {"profile": profile}, staging_dir=str(staging),
                         multipart_bytes="5MiB")
        step = f"run/step{profile or 'default'}"
        want = bounded(write_checkpoint, mount.path(step), 8, 3 << 20, 5, timeout=120,
                       what="checkpoint")
        big = random.Random(2).randbytes(12 << 20)  # 3 parts of 5 MiB at most
        with open(mount.path(f"{step}/big.bin"), "wb") as f:
            f.write(big)
            f.flush()
            os.fsync(f.fileno())
        want["big.bin"] = big
        for name, data in want.items():
            assert s3_get(s3, f"{step}/{name}") == data, name
            assert mount.path(f"{step}/{name}").read_bytes() == data, name
        assert s3_get(s3, f"{step}/.metadata.tmp") is None
        assert proxy.mismatches == [] and proxy.checked > 20
        assert wait_until(lambda: not any(staging.iterdir()), 10), \
            "staging files left after successful uploads"
        # Files made here had no ETag before their upload: that must not make the daemon
        # believe the store gives none (it would then tell versions by Last-Modified alone).
        log = (mount.workdir / "log" / "cubetorchfs.log").read_text(errors="replace")
        assert "without an ETag" not in log
        mount.cleanup()
        again = mount_s3(cube, tmp_path, proxy.endpoint, write_bucket, {"profile": profile})
        assert sorted(os.listdir(again.path(step))) == sorted(want)
        assert again.path(f"{step}/big.bin").read_bytes() == big
    finally:
        proxy.close()


def test_s3_overwrite_truncate_unlink_and_rename_rules(cube: CubeFactory, tmp_path: Path,
                                                       s3: S3Server, write_bucket: str) -> None:
    mount = mount_s3(cube, tmp_path, s3.endpoint, write_bucket)
    m = mount.mountpoint
    assert (m / "old.bin").read_bytes() == b"old object"
    with open(m / "old.bin", "r+b") as f:  # a partial overwrite: the object is fetched first
        f.write(b"OLD")
    assert s3_get(s3, "old.bin") == b"OLD object"
    assert (m / "old.bin").read_bytes() == b"OLD object"
    os.truncate(m / "old.bin", 3)
    assert s3_get(s3, "old.bin") == b"OLD"
    (m / "run/a.txt").write_bytes(b"a")
    (m / "run/b.txt").write_bytes(b"b")
    os.rename(m / "run/a.txt", m / "run/b.txt")  # over an existing object
    assert s3_get(s3, "run/b.txt") == b"a" and s3_get(s3, "run/a.txt") is None
    assert errno_of(lambda: os.rename(m / "run", m / "run2")) == errno.EXDEV
    assert errno_of(lambda: os.rmdir(m / "run")) == errno.ENOTEMPTY
    os.unlink(m / "run/b.txt")
    assert s3_get(s3, "run/b.txt") is None
    assert errno_of(lambda: os.unlink(m / "run/b.txt")) == errno.ENOENT
    assert errno_of(lambda: os.symlink("x", m / "link")) == errno.EPERM


@pytest.mark.parametrize("profile", ["", "ai_prefetch"])
def test_s3_files_not_yet_uploaded(cube: CubeFactory, tmp_path: Path, s3: S3Server,
                                   write_bucket: str, profile: str) -> None:
    """touch of a new file (its times set before the first upload); unlink and rename-over of
    a file still being written leave no staging file behind and upload nothing of it."""
    staging = tmp_path / "staging"
    mount = mount_s3(cube, tmp_path, s3.endpoint, write_bucket, {"profile": profile},
                     staging_dir=str(staging))
    m = mount.mountpoint
    name = f"touched{profile}"
    subprocess.run(["touch", str(m / name)], check=True, timeout=30)
    assert s3_get(s3, name) == b""
    fd = os.open(m / f"gone{profile}", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"never uploaded")
        os.unlink(m / f"gone{profile}")
        assert not any(staging.iterdir()), "staging file of an unlinked file kept"
        os.write(fd, b" still writable")
    finally:
        os.close(fd)
    assert s3_get(s3, f"gone{profile}") is None
    (m / f"src{profile}").write_bytes(b"src")
    fd = os.open(m / f"dst{profile}", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"unflushed destination")
        os.rename(m / f"src{profile}", m / f"dst{profile}")
    finally:
        os.close(fd)
    assert s3_get(s3, f"dst{profile}") == b"src"
    assert wait_until(lambda: not any(staging.iterdir()), 10), "staging files left behind"


def test_a_failed_upload_fails_fsync_and_is_kept_for_retry(cube: CubeFactory,
                                                          tmp_path: Path) -> None:
    server = S3Server(tmp_path / "down-s3").start()
    try:
        client = server.client()
        client.create_bucket("wbk")
        client.close()
        staging = tmp_path / "staging"
        mount = mount_s3(cube, tmp_path, server.endpoint, "wbk", timeout_ms=1000, retries=0,
                         staging_dir=str(staging))
        data = random.Random(4).randbytes(1 << 20)
        fd = os.open(mount.path("f.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            server.pause()
            err = errno_of(lambda: bounded(os.fsync, fd, timeout=30, what="fsync"))
            assert err == errno.EIO, err
            assert len(list(staging.iterdir())) == 1, "the staging file must be kept"
            server.stop()
            assert wait_port_free(server.port)
            server.start()
            client = server.client()  # moto restarts empty: the bucket is made again
            client.create_bucket("wbk")
            client.close()
            bounded(os.fsync, fd, timeout=30, what="fsync after the restart")
        finally:
            os.close(fd)
        client = server.client()
        try:
            status, body = client.request("GET", "/wbk/f.bin")
        finally:
            client.close()
        assert status == 200 and body == data
        # The kernel sends release after close returns: the staging file goes then.
        assert wait_until(lambda: not any(staging.iterdir()), 10), "staging file left behind"
    finally:
        server.stop()


def test_read_only_s3_mount_refuses_writes(cube: CubeFactory, tmp_path: Path, s3: S3Server,
                                          write_bucket: str) -> None:
    mount = mount_s3(cube, tmp_path, s3.endpoint, write_bucket,
                     {"profile": "ai_prefetch", "fuse": {"read_only": True}})
    assert errno_of(lambda: open(mount.path("new.txt"), "w")) == errno.EROFS
    assert s3_get(s3, "new.txt") is None


# --------------------------------------------------------------------------- model files


def test_model_load_from_an_s3_mount(cube: CubeFactory, tmp_path: Path, s3: S3Server) -> None:
    """cube_torch.load_file of a safetensors object under an S3 mount: the daemon makes it
    resident with parallel ranged GETs and hands over the descriptor; the tensors equal a
    load of the same file from local disk, plain and encrypted."""
    from test_model_mount import child, files_open

    local = tmp_path / "local"
    local.mkdir()
    client = s3.client()
    try:
        client.create_bucket("models")
        for name, cipher in (("plain.safetensors", "0"), ("enc.safetensors", "1")):
            child(None, "save", str(local / name), cipher)
            client.put("models", f"llm/{name}", (local / name).read_bytes())
    finally:
        client.close()
    mount = mount_s3(cube, tmp_path, s3.endpoint, "models",
                     overrides={"cache": {"chunk_bytes": "1MiB"}})
    for i, name in enumerate(("plain.safetensors", "enc.safetensors")):
        direct = child(None, "load", str(local / name))
        through = child(mount, "load", str(mount.path(f"llm/{name}")))
        assert through["digest"] == direct["digest"], name
        opened = files_open(through["stats"])
        assert opened.get("opened") == i + 1 and opened.get("failed") == 0, opened
    m = mount.metrics()
    assert m.value("cubetorchfs_backend_requests_total", op="read", status="error") == 0
