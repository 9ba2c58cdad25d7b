"""Control files and sockets the hook must not trust: another user's, a symlink, one writable
by group or others. Each is ignored after one warning naming the path and the owner, and the
training loop runs unchanged; the legitimate case (root's file read by another user) works.

These tests create files owned by uid 65534 (nobody), so they need root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import List

import pytest
from torch.utils.data import DataLoader

from cube_torch import _client, _publisher
from fake_control_server import FakeDaemon
from hook_testlib import FileList, cube_warnings, flush, indices, make_files

NOBODY = 65534
HOOKS = Path(__file__).resolve().parents[2] / "hooks"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown to uid 65534)")


def scan(vol: str = "") -> tuple:
    """live_daemons() and the cube_torch warnings it gave."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        daemons = _client.live_daemons(vol_name=vol or None)
    return daemons, cube_warnings(record)


def epoch_with_warnings(files: List[str]) -> tuple:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = indices(DataLoader(FileList(files), batch_size=2))
        again = indices(DataLoader(FileList(files), batch_size=2))
        flush()
    assert got == again == list(range(len(files)))  # training is unaffected
    return cube_warnings(record)


def test_a_control_file_of_another_user_is_ignored_with_one_warning(
        mount: Path, config_dir: Path, daemon: FakeDaemon) -> None:
    path = config_dir / f"cube_torch.config.{daemon.vol_name}"
    os.chown(path, NOBODY, NOBODY)
    daemons, warned = scan()
    assert daemons == []
    assert len(warned) == 1
    assert str(path) in warned[0] and f"uid {NOBODY}" in warned[0]
    # Through a DataLoader: nothing reaches the (attacker's) socket, one warning in all.
    _publisher.reset()
    warned = epoch_with_warnings(make_files(mount, 6))
    assert daemon.requests == []
    assert len(warned) == 1 and str(path) in warned[0] and f"uid {NOBODY}" in warned[0]


def test_a_symlinked_control_file_is_ignored(mount: Path, config_dir: Path,
                                             daemon: FakeDaemon, tmp_path: Path) -> None:
    real = config_dir / f"cube_torch.config.{daemon.vol_name}"
    elsewhere = tmp_path / "elsewhere.json"
    os.rename(real, elsewhere)  # a trusted file (root's, 0644) reached only through a link
    os.symlink(elsewhere, real)
    daemons, warned = scan()
    assert daemons == []
    assert len(warned) == 1 and str(real) in warned[0] and "symlink" in warned[0]
    _publisher.reset()
    epoch_with_warnings(make_files(mount, 4))
    assert daemon.requests == []


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666])
def test_a_control_file_writable_by_group_or_others_is_ignored(
        mode: int, config_dir: Path, daemon: FakeDaemon) -> None:
    path = config_dir / f"cube_torch.config.{daemon.vol_name}"
    os.chmod(path, mode)
    daemons, warned = scan()
    assert daemons == []
    assert len(warned) == 1 and str(path) in warned[0] and "uid 0" in warned[0]


def test_a_hard_link_to_a_root_file_is_ignored(config_dir: Path, daemon: FakeDaemon,
                                               tmp_path: Path) -> None:
    path = config_dir / f"cube_torch.config.{daemon.vol_name}"
    os.link(path, tmp_path / "second-name")
    daemons, warned = scan()
    assert daemons == [] and len(warned) == 1 and str(path) in warned[0]


def test_a_socket_of_another_user_is_ignored(config_dir: Path, daemon: FakeDaemon) -> None:
    os.chown(daemon.socket_path, NOBODY, NOBODY)
    daemons, warned = scan()
    assert daemons == []
    assert len(warned) == 1 and daemon.socket_path in warned[0] and f"uid {NOBODY}" in warned[0]
    # A client given the path directly refuses it too (the socket may change after discovery).
    client = _client.ControlClient(daemon.socket_path, timeout=0.5)
    with pytest.raises(_client.ControlError):
        client.stats()
    assert daemon.requests == []


def test_a_socket_in_a_directory_others_can_write_is_ignored(config_dir: Path,
                                                            daemon: FakeDaemon) -> None:
    os.chmod(os.path.dirname(daemon.socket_path), 0o777)  # not sticky: anyone may swap it
    daemons, warned = scan()
    assert daemons == [] and len(warned) == 1 and daemon.socket_path in warned[0]
    os.chmod(os.path.dirname(daemon.socket_path), 0o1777)  # sticky, like /tmp: fine
    daemons, _ = scan()
    assert [d.vol_name for d in daemons] == [daemon.vol_name]


def test_a_symlinked_socket_is_ignored(config_dir: Path, daemon: FakeDaemon,
                                       tmp_path: Path) -> None:
    link = tmp_path / "link.sock"
    os.symlink(daemon.socket_path, link)
    daemon.socket_path, real = str(link), daemon.socket_path
    try:
        daemon.write_control_file(str(config_dir))
    finally:
        daemon.socket_path = real
    daemons, warned = scan()
    assert daemons == [] and len(warned) == 1 and str(link) in warned[0]


def test_vol_name_with_an_untrusted_file_goes_quiet(monkeypatch: pytest.MonkeyPatch,
                                                    mount: Path, config_dir: Path,
                                                    daemon: FakeDaemon) -> None:
    os.chown(config_dir / f"cube_torch.config.{daemon.vol_name}", NOBODY, NOBODY)
    monkeypatch.setenv("VOL_NAME", daemon.vol_name)
    warned = epoch_with_warnings(make_files(mount, 4))
    assert daemon.requests == [] and len(warned) == 1 and f"uid {NOBODY}" in warned[0]


def test_root_control_file_is_trusted_by_another_user(daemon: FakeDaemon) -> None:
    """The usual deployment: the root daemon's 0644 file (and root's socket in a root-owned
    directory) read by an ordinary user's training process, uid 65534 here."""
    shared = Path(tempfile.mkdtemp(prefix="ctfs-trust-"))
    try:
        os.chmod(shared, 0o755)
        os.chmod(os.path.dirname(daemon.socket_path), 0o755)
        os.chmod(daemon.socket_path, 0o666)
        daemon.write_control_file(str(shared))
        os.chmod(shared / f"cube_torch.config.{daemon.vol_name}", 0o644)
        code = ("import json, warnings; warnings.simplefilter('error');"
                "from cube_torch import _client;"
                "d = _client.live_daemons();"
                "print(json.dumps([x.vol_name for x in d]));"
                "print(_client.ControlClient(d[0].control_socket).stats()['global'] is not None)")
        env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(shared), PYTHONPATH=str(HOOKS),
                   PYTHONDONTWRITEBYTECODE="1", HOME="/")
        out = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                              "--clear-groups", sys.executable, "-c", code],
                             capture_output=True, text=True, env=env, timeout=120, cwd="/")
        assert out.returncode == 0, out.stderr
        lines = out.stdout.split()
        assert json.loads(lines[0]) == [daemon.vol_name] and lines[1] == "True"
    finally:
        for p in shared.iterdir():
            p.unlink()
        shared.rmdir()
