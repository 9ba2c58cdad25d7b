"""The fourth security pass's findings 5, 6 and 9 (issue 59), each tried as an unprivileged user
would, against a real daemon: a file held through passthrough across a kill -9 of the worker,
a reader of another user's large file against its owner's writes and replacements, and the
default log directory below a group-writable /var/log (Debian, Ubuntu). Tests that need
passthrough skip with one line where the kernel or the daemon lacks it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from cubefs_harness import (BINARY, CubeFactory, CubeMount, environment_problem, run_command,
                            wait_until)
from seclib import (NOBODY, OTHER, THIRD, open_cube, script_result,  # noqa: F401
                    start_script_as)

pytestmark = [
    pytest.mark.skipif(environment_problem() is not None, reason=environment_problem() or ""),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, setpriv, allow_other)"),
]


BIG = 40 << 20  # over cache.stream_min_bytes (32 MiB): passed through


def public_store(base: Path) -> Path:
    src = base / "src"
    src.mkdir(exist_ok=True)
    os.chmod(src, 0o755)
    return src


def big_file(path: Path, seed: int, owner: int = 0) -> bytes:
    data = hashlib.sha256(str(seed).encode()).digest() * (BIG // 32)
    path.write_bytes(data)
    os.chmod(path, 0o644)
    os.chown(path, owner, owner)
    return data


def passthrough_mount(cube: CubeFactory, src: Path, overrides: dict[str, Any] | None = None
                      ) -> CubeMount:
    """A mount whose large files are passed through; the test skips, with one line, where the
    kernel (Linux 6.9+) or the daemon (CAP_SYS_ADMIN, an unstacked store) lacks it."""
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    if (major, minor) < (6, 9):
        pytest.skip("FUSE passthrough needs Linux 6.9+")
    mount = cube.mount(src, overrides)
    r = run_command([str(BINARY), "status", str(mount.mountpoint), "--json"], env=mount.env())
    if r.returncode != 0 or not json.loads(r.stdout).get("passthrough"):
        pytest.skip("FUSE passthrough unavailable to this daemon (CAP_SYS_ADMIN, an unstacked "
                    "store, a kernel with CONFIG_FUSE_PASSTHROUGH)")
    return mount


def backing_files(mount: CubeMount) -> float:
    return mount.metrics().value("cubetorchfs_passthrough_backing_files")


def flags_dir(base: Path) -> Path:
    flags = base / "flags"
    flags.mkdir(exist_ok=True)
    os.chmod(flags, 0o777)
    return flags


# Holds `path` open (read through passthrough) until `go` exists (60 s at most), then reads the
# rest: prints how many bytes it read and their sha256.
HOLD = r"""
import hashlib, json, os, sys, time
spec = json.loads(sys.stdin.read())
with open(spec["path"], "rb") as f:
    data = f.read(1 << 20)
    open(spec["held"], "w").close()
    deadline = time.time() + 60
    while not os.path.exists(spec["go"]) and time.time() < deadline:
        time.sleep(0.05)
    data += f.read()
print(json.dumps({"bytes": len(data), "sha": hashlib.sha256(data).hexdigest()}))
"""

# Each of spec["tries"]: opens `path` with os.open flags `flags` (names), reads 8 bytes or
# writes `data` at 0: the hex read, "ok" written, or the errno's name.
TRY_OPEN = r"""
import errno, json, os, sys
spec = json.loads(sys.stdin.read())
out = []
for flags in spec["tries"]:
    try:
        fd = os.open(spec["path"], sum(getattr(os, f) for f in flags))
        try:
            if "O_RDONLY" in flags:
                out.append(os.pread(fd, 8, 0).hex())
            else:
                os.pwrite(fd, spec.get("data", "w").encode(), 0)
                os.fsync(fd)
                out.append("ok")
        finally:
            os.close(fd)
    except OSError as e:
        out.append(errno.errorcode.get(e.errno, str(e.errno)))
print(json.dumps(out))
"""


def try_open(path: Path, uid: int, tries: list[list[str]], data: str = "w") -> list[str]:
    spec = {"path": str(path), "tries": tries, "data": data}
    return script_result(start_script_as(TRY_OPEN, spec, uid), timeout=60)


def hold(path: Path, uid: int, flags: Path) -> subprocess.Popen[bytes]:
    """A reader, as `uid`, holding `path` open once it has read its first MiB."""
    p = start_script_as(HOLD, {"path": str(path), "held": str(flags / "held"),
                               "go": str(flags / "go")}, uid)
    assert wait_until(lambda: (flags / "held").exists() or p.poll() is not None, 30)
    assert (flags / "held").exists(), p.communicate()[1]
    return p


def kill_worker(mount: CubeMount) -> None:
    pid = mount.read_control()["pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: mount.read_control().get("pid") not in (None, pid), 30), \
        "no new daemon after kill -9"


READ3 = [["O_RDONLY"]] * 3


# --------------------------------------------------------------------------- finding 5


def test_a_file_held_through_passthrough_opens_for_others_after_a_kill_9(
        open_cube: CubeFactory) -> None:
    """atk1 held a shard through passthrough and the worker was killed (kill -9, or the OOM
    killer): every open by another user failed with EIO until atk1 closed it, because the next
    worker registered another backing file for an inode the kernel still had in passthrough
    mode. The next worker now adopts the passthrough table from the memfd the supervisor
    holds, and joins the kernel's registration."""
    base = open_cube.base.parent
    src = public_store(base)
    data = big_file(src / "shard.bin", 1)
    flags = flags_dir(base)
    mount = passthrough_mount(open_cube, src)
    holder = hold(mount.path("shard.bin"), NOBODY, flags)
    try:
        assert backing_files(mount) == 1, "the holder's open was not passed through"
        kill_worker(mount)
        assert try_open(mount.path("shard.bin"), OTHER, READ3) == [data[:8].hex()] * 3
        assert try_open(mount.path("shard.bin"), NOBODY, READ3) == [data[:8].hex()] * 3
        # A second crash, of the worker that adopted the table.
        kill_worker(mount)
        assert try_open(mount.path("shard.bin"), THIRD, READ3) == [data[:8].hex()] * 3
    finally:
        (flags / "go").touch()
        out = script_result(holder, timeout=60)
    assert out == {"bytes": BIG, "sha": hashlib.sha256(data).hexdigest()}
    # The holder's close, the last, gives the registration back.
    assert wait_until(lambda: backing_files(mount) == 0, 10), backing_files(mount)
    assert "after the crash, kept the opens of 1 inodes" in "".join(
        p.read_text(errors="replace") for p in mount.workdir.rglob("*.log"))


# --------------------------------------------------------------------------- finding 6


def test_a_reader_through_passthrough_does_not_lock_the_owner_out(open_cube: CubeFactory
                                                                  ) -> None:
    """While atk1 held atk2's 0644 file through passthrough, atk2's opens for writing got
    ETXTBSY (also with O_TRUNC), and once atk2 replaced the file in the store every user's
    open got EBUSY until atk1 closed it. Now the owner's writer joins the readers' passthrough
    with direct I/O (its writes go through the daemon's write path), and the replaced file is
    opened under a new inode number."""
    base = open_cube.base.parent
    src = public_store(base)
    people = src / "people"
    people.mkdir()
    os.chown(people, OTHER, OTHER)
    os.chmod(people, 0o755)
    old = big_file(people / "ckpt.bin", 2, owner=OTHER)
    flags = flags_dir(base)
    # Attributes expire at once, names not: an open after the replacement meets the held
    # inode (the path the kernel takes within an entry timeout).
    mount = passthrough_mount(open_cube, src, {"fuse": {"attr_timeout_s": 0,
                                                        "entry_timeout_s": 60}})
    path = mount.path("people/ckpt.bin")
    holder = hold(path, NOBODY, flags)
    try:
        assert backing_files(mount) == 1, "the reader's open was not passed through"
        # The owner writes it, in place and with O_TRUNC: served, through the write path.
        assert try_open(path, OTHER, [["O_RDWR"], ["O_WRONLY"]], data="B") == ["ok", "ok"]
        assert (people / "ckpt.bin").read_bytes()[:1] == b"B"
        assert try_open(path, OTHER, [["O_WRONLY", "O_TRUNC"]], data="T") == ["ok"]
        assert (people / "ckpt.bin").stat().st_size == 1
        # The owner replaces it in the store (write aside, rename over).
        new = hashlib.sha256(b"new").digest() * 4
        code = ("import os; p = %r; open(p + '.tmp', 'wb').write(%r); "
                "os.rename(p + '.tmp', p)" % (str(people / "ckpt.bin"), new))
        p = start_script_as(code, {}, OTHER)
        assert p.wait(timeout=30) == 0, p.communicate()[1]
        for uid in (OTHER, THIRD, NOBODY):
            assert try_open(path, uid, READ3) == [new[:8].hex()] * 3, uid
        assert try_open(path, OTHER, [["O_WRONLY", "O_TRUNC"]], data="N") == ["ok"]
    finally:
        (flags / "go").touch()
        out = script_result(holder, timeout=60)
    # The reader read what the file held while it read (truncated under it, as a local one).
    assert out["bytes"] >= 1 << 20
    assert wait_until(lambda: backing_files(mount) == 0, 10), backing_files(mount)


# --------------------------------------------------------------------------- finding 9


def run_in_own_mount_namespace(script: str, env: dict[str, str], timeout: float = 60
                               ) -> subprocess.CompletedProcess[str]:
    """`sh -c script` in a mount namespace of its own (unshare -m, private propagation): what it
    mounts, the daemon's FUSE mount included, is seen by nobody else and goes with it."""
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) (util-linux)")
def test_the_default_log_dir_below_a_group_writable_var_log_mounts(open_cube: CubeFactory
                                                                   ) -> None:
    """Debian and Ubuntu ship /var/log as root:syslog 0775. A root daemon with no logDir used
    to refuse to mount there (exit 2): the documented minimal config did not mount. It now
    logs to /var/log/cubetorchfs/<volName>.log, opened beneath a descriptor of that directory
    (a group member who renames names in /var/log cannot lead it elsewhere); a link planted at
    that name by the group is still refused, naming what to set."""
    base = open_cube.base.parent
    src = public_store(base)
    (src / "f").write_bytes(b"hello")
    var_log = base / "var-log"  # bound over /var/log in the test's own namespace
    var_log.mkdir()
    os.chown(var_log, 0, OTHER)
    os.chmod(var_log, 0o775)
    instance = open_cube.prepare(src, {"logDir": None})
    mnt = instance.mountpoint
    script = f"""
mount --bind {var_log} /var/log || exit 90
{BINARY} -c {instance.config_path} {mnt} -o allow_other
rc=$?
echo "rc=$rc"
if [ $rc = 0 ]; then cat {mnt}/f; echo; umount {mnt} || umount -l {mnt}; fi
"""
    r = run_in_own_mount_namespace(script, instance.env())
    assert "rc=0" in r.stdout, (r.stdout, r.stderr)
    assert "hello" in r.stdout, r.stdout
    log = var_log / "cubetorchfs" / f"{instance.vol_name}.log"
    assert log.is_file() and os.stat(log).st_mode & 0o777 == 0o600, list(var_log.rglob("*"))
    assert os.stat(var_log / "cubetorchfs").st_mode & 0o777 == 0o700
    assert f"log: /var/log/cubetorchfs/{instance.vol_name}.log" in r.stdout + r.stderr
    wait_until(lambda: not instance.daemon_pids(), 10)

    # A member of the group plants a link at the directory's name: refused, with what to set.
    target = base / "elsewhere"
    target.mkdir()
    shutil.rmtree(var_log / "cubetorchfs")
    os.symlink(target, var_log / "cubetorchfs")
    os.lchown(var_log / "cubetorchfs", OTHER, OTHER)
    instance = open_cube.prepare(src, {"logDir": None})
    r = run_in_own_mount_namespace(script.replace(str(mnt), str(instance.mountpoint))
                                   .replace(str(open_cube.instances[0].config_path),
                                            str(instance.config_path)), instance.env())
    assert "rc=2" in r.stdout, (r.stdout, r.stderr)
    line = r.stderr.strip().splitlines()[0]
    assert line.startswith("cubetorchfs: logDir: ") and "is a symlink" in line \
        and "set logDir" in line, r.stderr
    assert list(target.iterdir()) == []


def test_a_vol_name_that_reads_as_an_option_is_refused(open_cube: CubeFactory) -> None:
    """volName `-rf` was accepted; it names files an operator hands to commands."""
    base = open_cube.base.parent
    instance = open_cube.prepare(public_store(base), {"volName": "-rf"})
    result = open_cube.launch(instance)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stderr.startswith("cubetorchfs: volName: must not start with '-'"), \
        result.stderr
    assert not instance.is_mounted()
