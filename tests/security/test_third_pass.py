"""The third security pass's findings, each tried as an unprivileged user against a real daemon
(docs/security.md): a listing made ahead of a private directory, the mount helper's options,
the daemon's descriptors, open directories' memory, idle connections to the metrics port,
one user's reads moving another's stream, the supervisor's restarts and the listeners across
a restart."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from cubefs_harness import (BINARY, REPO_ROOT, CubeFactory, environment_problem, free_tcp_port,
                            mount_entry, wait_until)
from seclib import (NOBODY, OTHER, as_user, daemon_peak_rss_bytes, daemon_rss_bytes,  # noqa: F401
                    open_cube, script_result, shell_as, start_script_as)

pytestmark = [
    pytest.mark.skipif(environment_problem() is not None, reason=environment_problem() or ""),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, setpriv, allow_other)"),
]


def public_store(base: Path, files: dict[str, bytes] | None = None) -> Path:
    """base/src, traversable by every user, holding world-readable `files`."""
    src = base / "src"
    src.mkdir(exist_ok=True)
    os.chmod(src, 0o755)
    for name, data in (files or {}).items():
        (src / name).write_bytes(data)
        os.chmod(src / name, 0o644)
    return src


def public_subdir(base: Path, name: str) -> tuple[Path, Path]:
    """base/src and base/src/`name`, both traversable by every user."""
    src = public_store(base)
    sub = src / name
    sub.mkdir()
    os.chmod(sub, 0o755)
    return src, sub


def flag_dir(base: Path) -> Path:
    """A directory every user may write, for a script and the test to signal each other."""
    flags = base / "flags"
    flags.mkdir()
    os.chmod(flags, 0o777)
    return flags


def wait_for_flag(flag: Path, p: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.time() + timeout
    while not flag.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.1)
    assert flag.exists(), f"{flag.name} never came"



def test_a_listing_made_ahead_is_not_handed_to_a_directory_swapped_in_the_store(
        open_cube: CubeFactory) -> None:
    base = open_cube.base.parent
    src = base / "src"
    team = src / "team"
    for d in ("a", "b", "private"):
        (team / d).mkdir(parents=True)
    os.chmod(src, 0o755)
    os.chmod(team, 0o777)
    for d in ("a", "b"):
        os.chmod(team / d, 0o755)
    os.chmod(team / "private", 0o700)
    os.chown(team / "private", OTHER, OTHER)
    names = [f"payroll-{i:03d}.csv" for i in range(20)]
    for n in names:
        (team / "private" / n).write_bytes(b"salary")
        os.chown(team / "private" / n, OTHER, OTHER)
    mount = open_cube.mount(src, {"profile": "ai_prefetch"})
    m = mount.mountpoint
    # The victim's scan lists team/ with plain readdir: the daemon lists its subdirectories
    # ahead, the private one included (as root).
    assert shell_as(["ls", "-f", f"{m}/team"], OTHER)[0] == 0
    time.sleep(1)
    # The kernel forgets the names it holds under memory pressure, which the attacker may wait
    # for; dropping them here makes that moment now.
    Path("/proc/sys/vm/drop_caches").write_text("2")
    # The attacker swaps, in the store, the private directory for an empty one of its own.
    code, out = shell_as(["sh", "-c", f"mv {team}/private {team}/p.old && mkdir {team}/private"],
                         NOBODY)
    assert code == 0, out
    code, out = shell_as(["ls", "-f", f"{m}/team/private"], NOBODY)
    assert not any(n.encode() in out for n in names), out


def test_the_mount_helper_never_expands_globs_in_options() -> None:
    tmp_path = Path(tempfile.mkdtemp(prefix="ctfs-helper-"))
    helper = tmp_path / "mount.cubetorchfs"
    shutil.copy(REPO_ROOT / "packaging" / "mount.cubetorchfs", helper)
    fake = tmp_path / "fake-daemon"
    fake.write_text("#!/bin/sh\nfor a in \"$@\"; do echo \"[$a]\"; done\n")
    fake.chmod(0o755)
    work = tmp_path / "cwd"
    work.mkdir()
    for n in ("secret-file-name", "other"):
        (work / n).write_text("")
    os.chmod(tmp_path, 0o755)
    os.chmod(work, 0o777)
    try:
        code, out = shell_as(["sh", "-c", f"cd {work} && CUBETORCHFS_BIN={fake} sh {helper} "
                              f"/etc/vol.json /mnt -o 'allow_other,*,?ther'"], NOBODY)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert code == 0, out
    assert b"secret-file-name" not in out and b"[other]" not in out, out
    assert b"[allow_other,*,?ther]" in out, out


# Run as the attacker: `n` handles of one readable large file, each reading one page at its own
# offset (no readahead), so that each is a first touch the daemon streams from a store
# descriptor of its own. Holds them until the file `done` appears (60 s at most).
_HOLD_HANDLES = r'''
import json, os, resource, sys, time
spec = json.loads(sys.stdin.read())
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
fds, errors = [], 0
for i in range(spec["n"]):
    try:
        fd = os.open(spec["path"], os.O_RDONLY)
    except OSError:
        errors += 1
        continue
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    try:
        os.pread(fd, 4096, i * 36864)
    except OSError:
        errors += 1
    fds.append(fd)
open(spec["ready"], "w").write(json.dumps({"open": len(fds), "errors": errors}))
deadline = time.time() + 60
while not os.path.exists(spec["done"]) and time.time() < deadline:
    time.sleep(0.1)
print(json.dumps({"open": len(fds), "errors": errors}))
'''


def test_one_users_open_handles_do_not_exhaust_the_daemons_descriptors(
        open_cube: CubeFactory) -> None:
    base = open_cube.base.parent
    src = base / "src"
    (src / "pub").mkdir(parents=True)
    os.chmod(src, 0o755)
    os.chmod(src / "pub", 0o755)
    big = src / "pub" / "big.bin"
    with open(big, "wb") as f:
        f.truncate(40 << 20)
    os.chmod(big, 0o644)
    (src / "pub" / "other.txt").write_bytes(b"another user's read")
    os.chmod(src / "pub" / "other.txt", 0o644)
    # Started as a mount by hand or from fstab would be: under a soft limit of 1,024.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        mount = open_cube.mount(src)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    m = mount.mountpoint
    pid = mount.pid or mount.learn_pid()
    assert pid
    flags = flag_dir(base)
    spec: dict[str, Any] = {"path": f"{m}/pub/big.bin", "n": 1100,
                            "ready": str(flags / "ready"), "done": str(flags / "done")}
    p = start_script_as(_HOLD_HANDLES, spec, NOBODY)
    try:
        wait_for_flag(flags / "ready", p, 90)
        held = len(os.listdir(f"/proc/{pid}/fd"))
        # Another user still reads and lists.
        assert shell_as(["cat", f"{m}/pub/other.txt"], OTHER) == (0, b"another user's read")
        code, out = shell_as(["ls", f"{m}/pub"], OTHER)
        assert code == 0 and b"other.txt" in out, out
        # The daemon holds a bounded number of descriptors for that user's handles.
        assert held < 600, held
    finally:
        (flags / "done").write_text("")
        script_result(p, timeout=90)


# Run as the attacker: tries to bind the mount's ports (and to listen at the socket's name)
# again and again until the file `done` appears; prints how often it got one.
_SQUAT = r'''
import json, os, socket, sys, time
spec = json.loads(sys.stdin.read())
got, tries = [], 0
deadline = time.time() + 60
while not os.path.exists(spec["done"]) and time.time() < deadline:
    for port in spec["ports"]:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tries += 1
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            got.append(port)
            time.sleep(0.5)  # hold it while the daemon would bind
        except OSError:
            pass
        s.close()
print(json.dumps({"got": got, "tries": tries}))
'''


def _healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def test_a_restart_or_an_upgrade_keeps_its_listeners_from_a_squatter(
        open_cube: CubeFactory) -> None:
    base = open_cube.base.parent
    src = public_store(base, {"f": b"still served"})
    prof = free_tcp_port()
    mount = open_cube.mount(src, {"profPort": prof})
    flags = flag_dir(base)
    spec = {"ports": [prof, mount.metrics_port], "done": str(flags / "done")}
    squatter = start_script_as(_SQUAT, spec, NOBODY)
    try:
        time.sleep(0.5)
        # Crashes (within the supervisor's restart budget: 5 a minute), then an upgrade.
        for _ in range(4):
            pid = mount.read_control()["pid"]
            os.kill(pid, signal.SIGKILL)
            assert wait_until(lambda: mount.read_control().get("pid") not in (None, pid), 30), \
                "no new daemon after kill -9"
            time.sleep(0.3)
        pid = mount.read_control()["pid"]
        up = subprocess.run([str(BINARY), "upgrade", str(mount.mountpoint)],
                            capture_output=True, text=True, timeout=60, env=mount.env())
        assert up.returncode == 0, up.stderr
        assert wait_until(lambda: mount.read_control().get("pid") not in (None, pid), 30)
    finally:
        (flags / "done").write_text("")
        out = script_result(squatter, timeout=90)
    assert out["got"] == [], out
    assert mount.is_mounted()
    assert (mount.mountpoint / "f").read_bytes() == b"still served"
    assert _healthz(mount.metrics_port) == 200


def test_idle_connections_to_the_metrics_port_do_not_starve_healthz(
        open_cube: CubeFactory) -> None:
    src = public_store(open_cube.base.parent)
    mount = open_cube.mount(src)
    port = mount.metrics_port
    idle = []
    try:
        for i in range(8):  # idle, and half-sent requests
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if i % 2:
                s.sendall(b"GET /metr")
            idle.append(s)
        time.sleep(0.3)
        ok = 0
        for _ in range(13):
            start = time.monotonic()
            if _healthz(port) == 200 and time.monotonic() - start < 3:
                ok += 1
        assert ok == 13, ok
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert b"cubetorchfs_" in r.read()
    finally:
        for s in idle:
            s.close()


@pytest.mark.parametrize("what", ["profPort", "exporterPort", "disk_dir", "remote_cache"])
def test_a_bad_listener_or_tier_directory_is_one_line_and_nothing_mounted(
        open_cube: CubeFactory, what: str) -> None:
    base = open_cube.base.parent
    src = base / "src"
    src.mkdir()
    port = free_tcp_port()
    taken = socket.socket()
    taken.bind(("127.0.0.1", port))
    taken.listen()
    overrides: dict[str, Any] = {}
    if what == "profPort":
        overrides["profPort"] = port
    elif what == "disk_dir":
        tier = base / "usertier"
        tier.mkdir()
        os.chown(tier, NOBODY, NOBODY)  # another user could swap what the daemon writes there
        overrides["cache"] = {"disk_dir": str(tier), "disk_bytes": "64MiB"}
    elif what == "remote_cache":
        overrides["backend"] = {"cubefs": {"remote_cache": True}}
    try:
        instance = open_cube.prepare(src, overrides)
        if what == "exporterPort":
            instance.metrics_port = port
            cfg = dict(instance.config or {})
            cfg["exporterPort"] = port
            instance.config_path.write_text(json.dumps(cfg))
        result = open_cube.launch(instance)
    finally:
        taken.close()
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    if what == "remote_cache":  # accepted, with a word
        assert result.returncode == 0, result
        assert any("remote_cache" in ln and "ignored" in ln for ln in lines), result.stderr
        return
    assert result.returncode == 2, result
    key = "cache.disk_dir" if what == "disk_dir" else what
    assert len(lines) == 1 and key in lines[0], result.stderr
    assert mount_entry(instance.mountpoint) is None


def _start_from(open_cube: CubeFactory, exe: Path, src: Path) -> Any:
    """A mount started by the binary at `exe` (a copy the test may remove or replace)."""
    shutil.copy(BINARY, exe)
    instance = open_cube.prepare(src)
    p = subprocess.run([str(exe), "-c", str(instance.config_path), str(instance.mountpoint)],
                       capture_output=True, text=True, timeout=60, env=instance.env())
    assert p.returncode == 0, p.stderr
    assert instance.wait_ready()
    instance.learn_pid()
    return instance


def test_a_removed_binary_does_not_turn_a_crash_into_an_unmount(open_cube: CubeFactory) -> None:
    base = open_cube.base.parent
    src = public_store(base, {"f": b"served"})
    exe = base / "cubetorchfs-copy"
    mount = _start_from(open_cube, exe, src)
    exe.unlink()  # a package removed, or replaced and not yet upgraded to
    for _ in range(2):
        pid = mount.read_control()["pid"]
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: mount.read_control().get("pid") not in (None, pid), 30), \
            "no new worker after kill -9 with the binary gone"
    assert (mount.mountpoint / "f").read_bytes() == b"served"


def test_an_upgrade_to_a_binary_that_cannot_start_keeps_the_running_version(
        open_cube: CubeFactory) -> None:
    base = open_cube.base.parent
    src = public_store(base, {"f": b"served"})
    exe = base / "cubetorchfs-copy"
    mount = _start_from(open_cube, exe, src)
    held = open(mount.mountpoint / "f", "rb")  # an open file, read across the upgrade
    try:
        exe.unlink()
        exe.write_text("#!/bin/sh\nexit 127\n")  # as a binary missing a library exits
        exe.chmod(0o755)
        pid = mount.read_control()["pid"]
        subprocess.run([str(BINARY), "upgrade", str(mount.mountpoint), "--timeout", "30"],
                       capture_output=True, text=True, timeout=60, env=mount.env())
        assert wait_until(lambda: mount.read_control().get("pid") not in (None, pid), 30)
        assert mount.is_mounted()
        assert held.read() == b"served"
        assert (mount.mountpoint / "f").read_bytes() == b"served"
    finally:
        held.close()


_OPEN_DIRS = r'''
import json, os, sys, time
spec = json.loads(sys.stdin.read())
fds, errors = [], 0
for _ in range(spec["n"]):
    try:
        fds.append(os.open(spec["path"], os.O_RDONLY | os.O_DIRECTORY))
    except OSError:
        errors += 1
open(spec["ready"], "w").write("")
deadline = time.time() + 60
while not os.path.exists(spec["done"]) and time.time() < deadline:
    time.sleep(0.1)
for fd in fds:
    os.close(fd)
print(json.dumps({"open": len(fds), "errors": errors}))
'''


def test_open_directories_stay_within_their_memory_bound(open_cube: CubeFactory) -> None:
    base = open_cube.base.parent
    src, big = public_subdir(base, "big")
    for i in range(50_000):
        (big / f"sample-{i:08d}-with-a-name-of-some-length.jpg").touch()
    mount = open_cube.mount(src, {"fuse": {"dir_memory_bytes": "64MiB"}})
    m = mount.mountpoint
    pid = mount.pid or mount.learn_pid()
    assert pid
    start = daemon_rss_bytes(pid)
    flags = flag_dir(base)
    spec = {"path": f"{m}/big", "n": 60, "ready": str(flags / "ready"),
            "done": str(flags / "done")}
    p = start_script_as(_OPEN_DIRS, spec, NOBODY)
    try:
        wait_for_flag(flags / "ready", p, 120)
        # Another user still lists it.
        code, out = shell_as(["sh", "-c", f"ls {m}/big | wc -l"], OTHER)
        assert code == 0 and out.strip() == b"50000", out
        grown = daemon_peak_rss_bytes(pid) - start
        # 60 snapshots of 50,000 entries would be about 900 MiB; the bound is 64 MiB (half for
        # one user), plus what one listing being made and the kernel's replies take. Under
        # AddressSanitizer the refused listings stay in its quarantine of freed memory (256 MiB).
        asan = "libasan" in Path(f"/proc/{pid}/maps").read_text()
        assert grown < (160 << 20) + (256 << 20 if asan else 0), grown
    finally:
        (flags / "done").write_text("")
        out = script_result(p, timeout=90)
    assert out["errors"] > 0, out  # some opens were refused (ENOMEM)


@pytest.mark.parametrize("how", ["batchdownload", "cat"])
def test_one_users_read_does_not_move_another_users_stream(open_cube: CubeFactory,
                                                           how: str) -> None:
    src, shared = public_subdir(open_cube.base.parent, "shared")
    for i in range(400):
        (shared / f"s{i:04d}").write_bytes(bytes([i % 256]) * 2000)
    mount = open_cube.mount(src, {"profile": "ai_prefetch",
                                  "prefetch": {"window_files": 64}})
    m = str(mount.mountpoint)
    sock = mount.read_control()["control_socket"]
    # The victim's stream: 400 shared files in order; none read yet.
    out = as_user({"kind": "unix", "socket": sock, "target": "/v1/streams",
                   "body": {"name": "victim", "pid": 1}}, uid=OTHER)
    assert out["status"] == 201, out
    sid = json.loads(out["body"])["id"]
    paths = [f"{m}/shared/s{i:04d}" for i in range(400)]
    out = as_user({"kind": "unix", "socket": sock, "target": f"/v1/streams/{sid}/paths",
                   "body": {"paths": paths}}, uid=OTHER)
    assert out["status"] == 202, out

    def victim_stream() -> dict[str, Any]:
        st = as_user({"kind": "unix", "socket": sock, "method": "GET", "target": "/v1/stats"},
                     uid=OTHER)
        return json.loads(st["body"])["streams"][0]

    assert wait_until(lambda: victim_stream()["fetched"] >= 60, 30), victim_stream()
    before = victim_stream()
    # The attacker reads one shared file far ahead in the victim's stream, and one fetched.
    for far in ("s0300", "s0005"):
        if how == "batchdownload":
            out = as_user({"kind": "unix", "socket": sock, "target": "/batchdownload/path",
                           "body": [[f"{m}/shared/{far}"]]}, uid=NOBODY)
            assert out["status"] == 200, out
        else:
            assert shell_as(["cat", f"{m}/shared/{far}"], NOBODY)[0] == 0
    after = victim_stream()
    assert after["skipped"] == before["skipped"] == 0, (before, after)
    assert after["evicted_unread"] == before["evicted_unread"], (before, after)
    # The victim's own reads are hits.
    code, _ = shell_as(["sh", "-c", f"cat {m}/shared/s000[0-9] >/dev/null"], OTHER)
    assert code == 0
    assert victim_stream()["reads"]["hit"] >= 9, victim_stream()
