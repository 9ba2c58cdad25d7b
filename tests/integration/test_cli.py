"""The command line a newcomer meets: `cubetorchfs --help` names every command the binary
accepts, and a mount started from a terminal leaves that terminal alone once it returns.

Needs the daemon binary and, for the mount, /dev/fuse (skips with one line otherwise)."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import select
import stat
import subprocess
import termios
import time
from pathlib import Path

import pytest

from cubefs_harness import BINARY, REPO_ROOT, CubeFactory, environment_problem, run_command

pytestmark = pytest.mark.skipif(not BINARY.exists(), reason=f"no daemon binary at {BINARY}")


def help_commands() -> list[str]:
    """The commands `cubetorchfs --help` lists under "commands"."""
    text = run_command([str(BINARY), "--help"]).stdout
    section = text.split("\ncommands", 1)
    assert len(section) == 2, f"--help has no commands section:\n{text}"
    body = section[1].split("\n\n", 1)[0]
    return re.findall(r"^  ([a-z][a-z-]*) ", body, flags=re.M)


def test_help_names_every_command_and_each_has_its_own_help() -> None:
    commands = help_commands()
    assert {"warmup", "status", "upgrade"} <= set(commands), commands
    usage = run_command([str(BINARY), "--help"]).stdout
    for name in commands:
        assert f"cubetorchfs {name} " in usage  # its synopsis in the usage lines
        got = run_command([str(BINARY), name, "--help"])
        assert got.returncode == 0, (name, got.stderr)
        assert got.stdout.startswith(f"usage: cubetorchfs {name}"), (name, got.stdout)


def test_every_command_the_binary_dispatches_is_in_the_help() -> None:
    """main.cc dispatches a first argument only through the table --help is made from (and
    the supervisor's internal --supports probe): a command added beside it fails here."""
    main = (REPO_ROOT / "daemon" / "main.cc").read_text()
    compared = set(re.findall(r'argv\[1\]\)?\s*==\s*"([^"]+)"', main))
    assert compared <= {"--supports"}, f"commands dispatched outside Commands(): {compared}"
    table = (REPO_ROOT / "daemon" / "command_line.cc").read_text()
    names = re.findall(r'^\s*\{"([a-z-]+)",', table, flags=re.M)
    handled = set(re.findall(r'if \(name == "([a-z-]+)"\) return Run', main))
    assert names and set(names) == handled, (names, handled)
    assert sorted(names) == sorted(help_commands())


def _drain(master: int, seconds: float) -> bytes:
    """What the terminal receives within `seconds` (until EOF or EIO: no writer left)."""
    out = b""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([master], [], [], left)
        if not ready:
            continue
        try:
            chunk = os.read(master, 4096)
        except OSError as e:
            if e.errno == errno.EIO:
                break
            raise
        if not chunk:
            break
        out += chunk
    return out


def test_a_mount_without_log_dir_leaves_its_terminal_alone(cube: CubeFactory,
                                                           tmp_path: Path) -> None:
    """Mounted from a terminal (a pty, its controlling terminal) with no logDir: the command
    prints one line saying where the daemon logs and returns; nothing reaches the terminal
    afterwards, while the mount serves, a missing file is asked for, and it unmounts. The
    log file is the daemon's own (mode 0600) and holds what used to reach the terminal."""
    problem = environment_problem()
    if problem:
        pytest.skip(problem)
    if os.geteuid() != 0:
        pytest.skip("the default log directory of this test is root's (/var/log/cubetorchfs)")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"hello\n")
    instance = cube.prepare(src, {"logDir": None})
    log = Path("/var/log/cubetorchfs") / f"{instance.vol_name}.log"
    master, slave = os.openpty()
    try:
        def controlling_tty() -> None:  # runs after setsid (start_new_session)
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        proc = subprocess.Popen(
            [str(BINARY), "-c", str(instance.config_path), str(instance.mountpoint)],
            stdin=slave, stdout=slave, stderr=slave, env=instance.env(),
            start_new_session=True, preexec_fn=controlling_tty)
        printed = b""
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            printed += _drain(master, 0.1)
        assert proc.poll() == 0, f"exit {proc.poll()}; terminal: {printed!r}"
        printed += _drain(master, 0.3)
        assert instance.wait_ready()
        instance.learn_pid()
        lines = printed.decode(errors="replace").splitlines()
        assert lines == [f"cubetorchfs: {instance.mountpoint} mounted (volume "
                         f"{instance.vol_name}); log: {log}"], lines

        # Serving, an error answered, and the unmount: all logged, none on the terminal.
        assert (instance.mountpoint / "a.txt").read_bytes() == b"hello\n"
        assert not (instance.mountpoint / "missing").exists()
        instance.fusermount()
        assert instance.wait_gone()
        after = _drain(master, 1.5)
        assert after == b"", f"written to the terminal after the command returned: {after!r}"

        text = log.read_text()
        assert "mounted" in text and "exiting" in text, text
        st = log.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
        assert stat.S_IMODE(log.parent.stat().st_mode) == 0o700
    finally:
        os.close(master)
        os.close(slave)
        log.unlink(missing_ok=True)
