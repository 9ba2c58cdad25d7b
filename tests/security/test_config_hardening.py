"""A hostile or broken config makes the root daemon exit 2 with one line, never hang or mount.

Runs the real binary against configs that used to read forever (/dev/zero), block (a FIFO),
abort with an uncaught exception (a long volName or control socket path), inject mount options
(volName "a,ro,allow_other") or pass silently (duplicate keys). Each must exit 2 within the
timeout, print exactly one line on stderr naming the problem, and leave nothing mounted.
Config errors come before any mount, so /dev/fuse is not needed.

The daemon is run through the integration harness (CUBETORCHFS_BIN names the binary), whose
launch fails the test if the command does not return in time.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cubefs_harness import BINARY, CubeFactory, CubeMount, LaunchResult

pytestmark = pytest.mark.skipif(
    not (BINARY.is_file() and os.access(BINARY, os.X_OK)),
    reason=f"{BINARY} is not built (build the project or set CUBETORCHFS_BIN)")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    (r / "file.txt").write_text("data\n")
    return r


def config(instance: CubeMount, root: Path, **overrides: Any) -> dict[str, Any]:
    """A valid config for `instance` with top-level keys replaced."""
    c: dict[str, Any] = {
        "volName": instance.vol_name,
        "mountPoint": str(instance.mountpoint),
        "backend": {"type": "posix", "root": str(root)},
        "cache": {"memory_bytes": "64MiB", "chunk_bytes": "4MiB"},
    }
    c.update(overrides)
    return c


def launch(cube: CubeFactory, root: Path, text: Any = None, path: Any = None) -> tuple:
    """Runs `cubetorchfs -c CONFIG MNT` (the daemonizing form) with the config text `text` (a
    function of the instance) or the file `path`; the harness fails the test on a hang."""
    instance = cube.prepare(root, raw_text=text if text is not None else "{}")
    args = ["-c", str(path if path is not None else instance.config_path), str(instance.mountpoint)]
    return instance, cube.launch(instance, args)


def assert_refused(instance: CubeMount, run: LaunchResult, *must_name: str) -> None:
    assert run.returncode == 2, (
        f"exit status {run.returncode}, expected 2; stderr: {run.stderr[:2000]!r}")
    assert len(run.stderr_lines) == 1, f"expected one stderr line, got {run.stderr[:2000]!r}"
    line = run.stderr_lines[0]
    assert line.startswith("cubetorchfs: "), line
    assert len(line) < 2048, f"an error line of {len(line)} bytes"
    for name in must_name:
        assert name in line, f"stderr does not name {name!r}: {line!r}"
    assert not instance.is_mounted(), "a refused config must not mount"
    assert not list(instance.config_dir.iterdir()), "a refused config must write no control file"


def test_the_good_config_is_not_refused_for_its_shape(cube: CubeFactory, root: Path) -> None:
    """The base config passes config checks (so each refusal below is about its one change);
    it is run with a missing mount point so nothing is mounted."""
    instance = cube.prepare(root, raw_text=lambda i: json.dumps(
        config(i, root, mountPoint=str(i.workdir / "absent"))))
    proc = subprocess.run([str(BINARY), "-c", str(instance.config_path)], capture_output=True,
                          text=True, timeout=30, env=instance.env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert "mountPoint" in proc.stderr, proc.stderr


def test_dev_zero_is_refused_at_once(cube: CubeFactory, root: Path) -> None:
    instance, run = launch(cube, root, path="/dev/zero")
    assert_refused(instance, run, "/dev/zero", "not a regular file")
    assert run.seconds < 5, f"took {run.seconds:.1f}s"


def test_a_fifo_is_refused_without_blocking(cube: CubeFactory, root: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    instance, run = launch(cube, root, path=fifo)
    assert_refused(instance, run, "config.fifo", "not a regular file")
    assert run.seconds < 5, f"took {run.seconds:.1f}s on a FIFO"


def test_a_directory_is_refused(cube: CubeFactory, root: Path, tmp_path: Path) -> None:
    assert_refused(*launch(cube, root, path=tmp_path), "not a regular file")


def test_a_config_above_one_mebibyte_is_refused(cube: CubeFactory, root: Path) -> None:
    def text(i: CubeMount) -> str:
        t = json.dumps(config(i, root))
        return t + " " * (2 * 1024 * 1024 - len(t))  # valid JSON, 2 MiB
    assert_refused(*launch(cube, root, text), "larger than 1 MiB")


@pytest.mark.parametrize("fmt", ["json", "yaml-block", "yaml-flow"])
def test_duplicate_keys_are_refused(cube: CubeFactory, root: Path, fmt: str) -> None:
    def text(i: CubeMount) -> str:
        if fmt == "json":
            return json.dumps(config(i, root))[:-1] + ', "volName": "other"}'
        head = f"volName: {i.vol_name}\nmountPoint: {i.mountpoint}\n"
        if fmt == "yaml-block":
            return (head + f"backend:\n  type: posix\n  root: {root}\n"
                    "cache:\n  memory_bytes: 64MiB\n  memory_bytes: 128MiB\n")
        return head + f"backend: {{type: posix, root: {root}, root: /}}\n"
    key = {"json": "volName", "yaml-block": "cache.memory_bytes", "yaml-flow": "backend.root"}[fmt]
    assert_refused(*launch(cube, root, text), f"{key}: duplicate key")


def test_volname_cannot_inject_mount_options(cube: CubeFactory, root: Path) -> None:
    run = launch(cube, root, lambda i: json.dumps(config(i, root, volName="a,ro,allow_other")))
    assert_refused(*run, "volName", "A-Z a-z 0-9 . _ -")


def test_a_long_volname_is_refused_not_aborted(cube: CubeFactory, root: Path) -> None:
    # The default socket path is derived from volName too.
    run = launch(cube, root, lambda i: json.dumps(config(i, root, volName="v" * 200)))
    assert_refused(*run, "volName", "200 bytes")


def test_a_volname_with_a_newline_is_one_line(cube: CubeFactory, root: Path) -> None:
    run = launch(cube, root, lambda i: json.dumps(config(i, root, volName="a\nforged line")))
    assert_refused(*run, "volName")


def test_a_long_control_socket_path_is_refused_not_aborted(cube: CubeFactory, root: Path) -> None:
    sock = "/tmp/" + "s" * 195  # 200 bytes: sockaddr_un.sun_path holds 107
    run = launch(cube, root,
                 lambda i: json.dumps(config(i, root, prefetch={"control_socket": sock})))
    assert_refused(*run, "prefetch.control_socket", "107")
