"""What the daemon keeps on disk of the files it serves is private to it.

A 0600 root file read through a real mount lands in the NVMe tier (cache.disk_dir); a file
written through an S3 mount sits in a staging file (backend.staging_dir). Both directories are
made 0700 (an existing one narrowed), every file in them 0600 (RocksDB's index files too), even
when the daemon starts under umask 0; an unprivileged user (uid 65534) cannot read them although
every directory above is open to them. A tier or staging directory that is a symlink or belongs
to another user is refused at start with a clear error.

Runs as root (the daemon mounts; setpriv drops to uid 65534)."""

from __future__ import annotations

import os
import random
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator, List

import pytest

from cubefs_harness import CubeFactory, environment_problem, wait_until
from s3_testlib import ACCESS_KEY, SECRET_KEY, S3Server, s3_server_problem

NOBODY = 65534

pytestmark = [
    pytest.mark.skipif(environment_problem() is not None, reason=environment_problem() or ""),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts, setpriv to uid 65534)"),
]


@pytest.fixture
def open_base() -> Iterator[Path]:
    """A directory every user can traverse (pytest's tmp_path is 0700, which would hide the
    tier's files from uid 65534 whatever their modes)."""
    base = Path(tempfile.mkdtemp(prefix="ctfs-sec-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def as_nobody(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           *args], capture_output=True, timeout=30, cwd="/")


def launch_under_umask_zero(cube: CubeFactory, root: Path, overrides: dict[str, Any]):
    instance = cube.prepare(root, overrides)  # its own directories under the usual umask
    old = os.umask(0)  # the daemon inherits it: nothing it creates may be wider for that
    try:
        result = cube.launch(instance)
    finally:
        os.umask(old)
    assert result.returncode == 0, result.stderr
    assert instance.wait_ready(), f"not ready; stderr: {result.stderr!r}"
    instance.learn_pid()
    return instance


def check_private_tree(top: Path) -> List[Path]:
    """Asserts top and every directory below are 0700 and every file 0600, all root's;
    returns the files."""
    files = []
    for dirpath, dirnames, filenames in os.walk(top):
        st = os.lstat(dirpath)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700, \
            f"{dirpath}: mode {stat.S_IMODE(st.st_mode):04o}"
        assert st.st_uid == 0, dirpath
        for name in filenames:
            path = Path(dirpath) / name
            st = os.lstat(path)
            assert stat.S_ISREG(st.st_mode), path
            assert stat.S_IMODE(st.st_mode) == 0o600, f"{path}: mode {stat.S_IMODE(st.st_mode):04o}"
            assert st.st_uid == 0, path
            files.append(path)
    return files


def log_text(mount) -> str:
    """What the daemon logged: its stderr before detaching, then its log file."""
    launched = mount.launch_result.stderr if mount.launch_result is not None else ""
    return launched + "".join(p.read_text(errors="replace")
                              for p in (mount.workdir / "log").glob("*"))


# --------------------------------------------------------------------------- NVMe tier


def nvme_overrides(disk: Path) -> dict[str, Any]:
    return {"profile": "ai_prefetch",
            "cache": {"memory_bytes": "8MiB", "chunk_bytes": "1MiB",
                      "disk_dir": str(disk), "disk_bytes": "64MiB"}}


def test_nvme_tier_of_a_0600_file_is_private(cube: CubeFactory, open_base: Path) -> None:
    src, disk = open_base / "src", open_base / "nvme"
    src.mkdir(mode=0o755)
    secret = random.Random(5).randbytes(300_000)
    (src / "secret.bin").write_bytes(secret)
    os.chmod(src / "secret.bin", 0o600)
    disk.mkdir(mode=0o755)  # an existing tier directory open to all: narrowed at start
    os.chmod(disk, 0o755)

    mount = launch_under_umask_zero(cube, src, nvme_overrides(disk))
    assert mount.path("secret.bin").read_bytes() == secret
    assert wait_until(lambda: any((disk / "data").iterdir()), 15), "nothing reached the tier"
    # The writer thread may still be renaming the last chunk in: wait for a quiet tmp/.
    assert wait_until(lambda: not any((disk / "tmp").iterdir()), 15)

    files = check_private_tree(disk)
    chunks = sorted((disk / "data").iterdir())
    assert chunks and any(f.parent.name == "index" for f in files)
    assert b"".join(p.read_bytes() for p in chunks) == secret  # one file, its chunks in order
    for path in [chunks[0], *[f for f in files if f.parent.name == "index"][:3]]:
        out = as_nobody("cat", str(path))
        assert out.returncode != 0 and out.stdout == b"", f"uid {NOBODY} read {path}"
    # The source file itself stays as private as it was.
    assert as_nobody("cat", str(src / "secret.bin")).returncode != 0
    assert "made 0700" in log_text(mount)


def test_a_symlinked_or_foreign_tier_is_refused(cube: CubeFactory, open_base: Path) -> None:
    src = open_base / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x")
    theirs = open_base / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    link = open_base / "link"
    real = open_base / "real"
    real.mkdir()
    link.symlink_to(real)
    for disk, words in ((theirs, f"uid {NOBODY}"), (link, "symlink")):
        instance = cube.prepare(src, nvme_overrides(disk))
        result = cube.launch(instance)
        assert result.returncode != 0, f"started with disk_dir {disk}"
        text = log_text(instance)
        assert str(disk) in text and words in text, text
        assert not instance.is_mounted()
    assert list(theirs.iterdir()) == [] and list(real.iterdir()) == []


# --------------------------------------------------------------------------- S3 staging


_s3_problem = s3_server_problem()


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[S3Server]:
    if _s3_problem is not None:
        pytest.skip(_s3_problem)
    server = S3Server(tmp_path / "s3").start()
    try:
        client = server.client()
        client.create_bucket("sec")
        client.close()
        yield server
    finally:
        server.stop()


def s3_overrides(server: S3Server, staging: Path) -> dict[str, Any]:
    return {"backend": {"type": "s3", "root": None, "endpoint": server.endpoint,
                        "bucket": "sec", "access_key": ACCESS_KEY, "secret_key": SECRET_KEY,
                        "staging_dir": str(staging)}}


def test_s3_staging_files_are_private(cube: CubeFactory, open_base: Path, tmp_path: Path,
                                      s3: S3Server) -> None:
    staging = open_base / "staging"
    staging.mkdir()
    os.chmod(staging, 0o755)  # as an older daemon (or an admin) left it: narrowed at start
    mount = launch_under_umask_zero(cube, tmp_path, s3_overrides(s3, staging))
    assert stat.S_IMODE(os.lstat(staging).st_mode) == 0o700
    secret = random.Random(9).randbytes(100_000)
    fd = os.open(mount.path("ckpt.bin"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.write(fd, secret)
        files = check_private_tree(staging)  # the file being written has its staging file
        assert len(files) == 1 and files[0].read_bytes() == secret
        out = as_nobody("cat", str(files[0]))
        assert out.returncode != 0 and out.stdout == b""
        os.fsync(fd)
    finally:
        os.close(fd)
    assert "made 0700" in log_text(mount)


def test_a_symlinked_or_foreign_staging_dir_is_refused(cube: CubeFactory, open_base: Path,
                                                      tmp_path: Path, s3: S3Server) -> None:
    theirs = open_base / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    real = open_base / "real"
    real.mkdir()
    link = open_base / "link"
    link.symlink_to(real)
    for staging, words in ((theirs, f"uid {NOBODY}"), (link, "symlink")):
        instance = cube.prepare(tmp_path, s3_overrides(s3, staging))
        result = cube.launch(instance)
        assert result.returncode != 0, f"started with staging_dir {staging}"
        assert "backend.staging_dir" in result.stderr and str(staging) in result.stderr \
            and words in result.stderr, result.stderr
        assert not instance.is_mounted()


# --------------------------------------------------------------------------- daemon directories


def test_daemon_directories_reached_through_a_link_or_held_by_another_user_are_refused(
        cube: CubeFactory, open_base: Path) -> None:
    """logDir, the control socket's directory and the NVMe tier are written as root: a link at
    their name or anywhere above it (planted by another user), or a directory another user owns
    or may write in, is refused at start with one clear error, and nothing is written there."""
    src = open_base / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x")
    root_only = open_base / "root-only"  # what the links point at: only root may write there
    root_only.mkdir(mode=0o755)
    public = open_base / "public"  # as /tmp: anyone may add names, sticky
    public.mkdir()
    os.chmod(public, 0o1777)
    planted = public / "planted"
    as_nobody("ln", "-s", str(root_only), str(planted))  # /tmp/x -> a root directory
    assert planted.is_symlink() and planted.lstat().st_uid == NOBODY
    theirs = open_base / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    world = open_base / "world"
    world.mkdir()
    os.chmod(world, 0o777)  # writable by all, not sticky
    sock = "prefetch.control_socket"
    cases = [
        ("logDir", {"logDir": str(planted)}, str(planted), "symlink"),
        ("logDir", {"logDir": str(planted / "sub")}, str(planted), "symlink"),
        ("logDir", {"logDir": str(theirs)}, f"uid {NOBODY}", "another user"),
        ("logDir", {"logDir": str(world)}, str(world), "other users"),
        (sock, {"prefetch": {"control_socket": str(planted / "vol.sock")}}, str(planted),
         "symlink"),
        (sock, {"prefetch": {"control_socket": str(world / "vol.sock")}}, str(world),
         "other users"),
        ("cache.disk_dir", nvme_overrides(planted / "nvme"), str(planted), "symlink"),
    ]
    for key, overrides, names, words in cases:
        instance = cube.prepare(src, overrides)
        result = cube.launch(instance)
        assert result.returncode == 2, (overrides, result.returncode, result.stderr)
        assert not instance.is_mounted()
        first = result.stderr.strip().splitlines()[0] if result.stderr.strip() else ""
        assert first.startswith(f"cubetorchfs: {key}: ") and names in first and words in first, \
            (overrides, result.stderr)
    assert list(root_only.iterdir()) == [], "the daemon wrote through a planted link"
    assert list(theirs.iterdir()) == [] and list(world.iterdir()) == []
    # The same directories, real and root's, are fine: the log lands in logDir.
    good = open_base / "logs"
    mount = launch_under_umask_zero(cube, src, {"logDir": str(good)})
    assert mount.path("f").read_bytes() == b"x"
    assert (good / "cubetorchfs.log").is_file()
    assert stat.S_IMODE(os.lstat(good / "cubetorchfs.log").st_mode) == 0o600
