"""A hostile or broken config makes the root daemon exit 2 with one line, never hang or mount.

Runs the real binary against configs that used to read forever (/dev/zero), block (a FIFO),
abort with an uncaught exception (a long volName or control socket path), inject mount options
(volName "a,ro,allow_other") or pass silently (duplicate keys). Each must exit 2 within the
timeout, print exactly one line on stderr naming the problem, and leave nothing mounted.
Config errors come before any mount, so /dev/fuse is not needed.

Environment:
  CUBETORCHFS_BIN   the daemon binary (default: <repo>/build/bin/cubetorchfs)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BINARY = Path(os.environ.get("CUBETORCHFS_BIN", REPO_ROOT / "build" / "bin" / "cubetorchfs"))
TIMEOUT_S = 20.0  # a refused config must be refused well within this

pytestmark = pytest.mark.skipif(
    not (BINARY.is_file() and os.access(BINARY, os.X_OK)),
    reason=f"{BINARY} is not built (build the project or set CUBETORCHFS_BIN)")


@dataclass
class Run:
    returncode: Optional[int]  # None: it did not exit in time (and was killed)
    stderr: str
    seconds: float

    @property
    def stderr_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


@dataclass
class Setup:
    tmp: Path
    mountpoint: Path
    root: Path
    control_dir: Path

    def config(self, **overrides: Any) -> dict[str, Any]:
        """A valid config for this setup with top-level keys replaced."""
        config: dict[str, Any] = {
            "volName": f"sec{os.getpid()}",
            "mountPoint": str(self.mountpoint),
            "logLevel": "info",
            "profPort": "",
            "backend": {"type": "posix", "root": str(self.root)},
            "cache": {"memory_bytes": "64MiB", "chunk_bytes": "4MiB"},
            "prefetch": {"control_socket": str(self.tmp / "ctl.sock")},
        }
        config.update(overrides)
        return config

    def write(self, text: str, name: str = "config.json") -> Path:
        path = self.tmp / name
        path.write_text(text)
        return path


def is_mounted(path: Path) -> bool:
    target = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        # Mount points are octal-escaped there; ours has no special characters.
        return any(line.split()[1] == target for line in f if len(line.split()) > 1)


def unmount(path: Path) -> None:
    for cmd in (["fusermount3", "-u", "-z", str(path)], ["umount", "-l", str(path)]):
        if shutil.which(cmd[0]):
            subprocess.run(cmd, capture_output=True, timeout=15, check=False)
        if not is_mounted(path):
            return


def launch(setup: Setup, config_path: Path | str) -> Run:
    """Runs `cubetorchfs -c CONFIG MNT` (the daemonizing form) and waits for it to return.

    Output goes to files, not pipes, so a daemon that keeps a descriptor open cannot hang us.
    """
    err_path = setup.tmp / "launch.err"
    env = dict(os.environ)
    env["CUBE_TORCH_CONFIG_DIR"] = str(setup.control_dir)
    start = time.monotonic()
    with open(setup.tmp / "launch.out", "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen([str(BINARY), "-c", str(config_path), str(setup.mountpoint)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env)
        try:
            returncode: Optional[int] = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
            returncode = None
    return Run(returncode, err_path.read_text(errors="replace"), time.monotonic() - start)


def assert_refused(setup: Setup, run: Run, *must_name: str) -> None:
    assert run.returncode is not None, (
        f"did not exit within {TIMEOUT_S:.0f}s; stderr: {run.stderr[:2000]!r}")
    assert run.returncode == 2, (
        f"exit status {run.returncode}, expected 2; stderr: {run.stderr[:2000]!r}")
    assert len(run.stderr_lines) == 1, f"expected one stderr line, got {run.stderr[:2000]!r}"
    line = run.stderr_lines[0]
    assert line.startswith("cubetorchfs: "), line
    assert len(line) < 2048, f"an error line of {len(line)} bytes"
    for name in must_name:
        assert name in line, f"stderr does not name {name!r}: {line!r}"
    assert not is_mounted(setup.mountpoint), "a refused config must not mount"
    assert not list(setup.control_dir.iterdir()), "a refused config must write no control file"


@pytest.fixture
def setup(tmp_path: Path):
    s = Setup(tmp=tmp_path, mountpoint=tmp_path / "mnt", root=tmp_path / "root",
              control_dir=tmp_path / "ctl")
    for d in (s.mountpoint, s.root, s.control_dir):
        d.mkdir()
    (s.root / "file.txt").write_text("data\n")
    try:
        yield s
    finally:
        if is_mounted(s.mountpoint):  # only if the daemon wrongly accepted the config
            unmount(s.mountpoint)


def test_the_good_config_is_not_refused_for_its_shape(setup: Setup) -> None:
    """The base config passes config checks (so each refusal below is about its one change);
    it is run with a missing mount point so nothing is mounted."""
    path = setup.write(json.dumps(setup.config(mountPoint=str(setup.tmp / "absent"))))
    env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(setup.control_dir))
    proc = subprocess.run([str(BINARY), "-c", str(path)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env, stdin=subprocess.DEVNULL, check=False)
    assert proc.returncode == 2
    assert "mountPoint" in proc.stderr, proc.stderr


def test_dev_zero_is_refused_at_once(setup: Setup) -> None:
    run = launch(setup, "/dev/zero")
    assert_refused(setup, run, "/dev/zero", "not a regular file")
    assert run.seconds < 5, f"took {run.seconds:.1f}s"


def test_a_fifo_is_refused_without_blocking(setup: Setup) -> None:
    fifo = setup.tmp / "config.fifo"
    os.mkfifo(fifo)
    run = launch(setup, fifo)
    assert_refused(setup, run, "config.fifo", "not a regular file")
    assert run.seconds < 5, f"took {run.seconds:.1f}s on a FIFO"


def test_a_directory_is_refused(setup: Setup) -> None:
    assert_refused(setup, launch(setup, setup.tmp), "not a regular file")


def test_a_config_above_one_mebibyte_is_refused(setup: Setup) -> None:
    text = json.dumps(setup.config())
    text += " " * (2 * 1024 * 1024 - len(text))  # valid JSON, 2 MiB
    run = launch(setup, setup.write(text))
    assert_refused(setup, run, "larger than 1 MiB")


@pytest.mark.parametrize("fmt", ["json", "yaml-block", "yaml-flow"])
def test_duplicate_keys_are_refused(setup: Setup, fmt: str) -> None:
    base = setup.config()
    if fmt == "json":
        text = json.dumps(base)[:-1] + ', "volName": "other"}'
        key = "volName"
    elif fmt == "yaml-block":
        text = (f"volName: {base['volName']}\n"
                f"mountPoint: {base['mountPoint']}\n"
                f"backend:\n  type: posix\n  root: {base['backend']['root']}\n"
                f"cache:\n  memory_bytes: 64MiB\n  memory_bytes: 128MiB\n")
        key = "cache.memory_bytes"
    else:
        text = (f"volName: {base['volName']}\n"
                f"mountPoint: {base['mountPoint']}\n"
                f"backend: {{type: posix, root: {base['backend']['root']}, root: /}}\n")
        key = "backend.root"
    run = launch(setup, setup.write(text, "config.json" if fmt == "json" else "config.yaml"))
    assert_refused(setup, run, f"{key}: duplicate key")


def test_volname_cannot_inject_mount_options(setup: Setup) -> None:
    run = launch(setup, setup.write(json.dumps(setup.config(volName="a,ro,allow_other"))))
    assert_refused(setup, run, "volName", "A-Z a-z 0-9 . _ -")


def test_a_long_volname_is_refused_not_aborted(setup: Setup) -> None:
    config = setup.config(volName="v" * 200)
    del config["prefetch"]  # the default socket path is derived from volName
    run = launch(setup, setup.write(json.dumps(config)))
    assert_refused(setup, run, "volName", "200 bytes")


def test_a_volname_with_a_newline_is_one_line(setup: Setup) -> None:
    run = launch(setup, setup.write(json.dumps(setup.config(volName="a\nforged line"))))
    assert_refused(setup, run, "volName")


def test_a_long_control_socket_path_is_refused_not_aborted(setup: Setup) -> None:
    sock = "/tmp/" + "s" * 195  # 200 bytes: sockaddr_un.sun_path holds 107
    run = launch(setup, setup.write(json.dumps(setup.config(prefetch={"control_socket": sock}))))
    assert_refused(setup, run, "prefetch.control_socket", "107")
