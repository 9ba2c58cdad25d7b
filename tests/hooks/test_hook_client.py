"""Finding the daemon from control files, the /v1 client, and the report line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from cube_torch import _client, _report
from fake_control_server import FakeDaemon
from hook_testlib import FileList, cube_warnings, flush, indices, make_files


def write_control(config_dir: Path, vol: str, mount: str, sock: str = "/nonexistent.sock",
                  pid: int = 0) -> Path:
    path = config_dir / f"cube_torch.config.{vol}"
    path.write_text(json.dumps({"vol_name": vol, "mount_point": mount, "prof": 17410,
                                "local_ip": "127.0.0.1", "control_socket": sock,
                                "metrics_port": 9500, "pid": pid or os.getpid(),
                                "version": "0.1.0"}))
    return path


def test_is_under_is_component_wise() -> None:
    assert _client.is_under("/mnt/a/x.jpg", "/mnt/a")
    assert _client.is_under("/mnt/a", "/mnt/a")
    assert not _client.is_under("/mnt/ab/x.jpg", "/mnt/a")
    assert _client.is_under("/x", "/")


def test_deepest_mount_wins(config_dir: Path) -> None:
    write_control(config_dir, "outer", "/data")
    write_control(config_dir, "inner", "/data/train/")
    daemons = _client.live_daemons()
    assert _client.daemon_for("/data/train/a/b.jpg", daemons).vol_name == "inner"
    assert _client.daemon_for("/data/val/b.jpg", daemons).vol_name == "outer"
    assert _client.daemon_for("/elsewhere/b.jpg", daemons) is None


def test_vol_name_picks_its_control_file(monkeypatch: pytest.MonkeyPatch, config_dir: Path) -> None:
    write_control(config_dir, "a", "/data")
    write_control(config_dir, "b", "/data")
    monkeypatch.setenv("VOL_NAME", "b")
    assert [d.vol_name for d in _client.live_daemons()] == ["b"]
    monkeypatch.setenv("VOL_NAME", "missing")
    assert _client.live_daemons() == []


def test_bad_and_dead_control_files_are_ignored(config_dir: Path) -> None:
    (config_dir / "cube_torch.config.broken").write_text("{not json")
    (config_dir / "cube_torch.config.partial").write_text('{"vol_name": "p"}')
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    write_control(config_dir, "dead", "/data", pid=proc.pid)
    write_control(config_dir, "live", "/data")
    assert [d.vol_name for d in _client.live_daemons()] == ["live"]


def test_vol_name_routes_to_that_daemon_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                             config_dir: Path) -> None:
    mount_a, mount_b = tmp_path / "a", tmp_path / "b"
    fake_a = FakeDaemon(str(mount_a), vol_name="va").start()
    fake_b = FakeDaemon(str(mount_b), vol_name="vb").start()
    try:
        fake_a.write_control_file(str(config_dir))
        fake_b.write_control_file(str(config_dir))
        files_b = make_files(mount_b, 4)
        indices(DataLoader(FileList(files_b), batch_size=2))  # matched by mount point
        flush()
        assert fake_b.published() == files_b and fake_a.requests == []
        monkeypatch.setenv("VOL_NAME", "va")  # files of b are outside a's mount
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            indices(DataLoader(FileList(files_b), batch_size=2))
            flush()
        assert fake_a.requests == [] and len(fake_b.all_streams()) == 1
        assert len(cube_warnings(record)) == 1
    finally:
        fake_a.stop()
        fake_b.stop()


def test_client_round_trip(mount: Path, daemon: FakeDaemon) -> None:
    client = _client.ControlClient(daemon.socket_path)
    try:
        sid = client.create_stream("X:1", 42)
        inside = str(mount / "a.jpg")
        assert client.publish(sid, [inside, "/outside/b.jpg"]) == {"accepted": 1, "rejected": 1}
        assert client.stats()["streams"][0]["pid"] == 42
        client.delete_stream(sid)
        with pytest.raises(_client.ControlError) as err:
            client.publish(sid, [inside])
        assert err.value.status == 404 and "unknown stream" in str(err.value)
        assert (err.value.code, err.value.errno) == ("not_found", 2)
    finally:
        client.close()
    assert [r[0] for r in daemon.requests] == ["POST", "POST", "GET", "DELETE", "POST"]


def test_client_reconnects_after_the_daemon_closed_the_connection(daemon: FakeDaemon) -> None:
    client = _client.ControlClient(daemon.socket_path)
    try:
        client.stats()
        with daemon.lock:
            conns = list(daemon.connections)
        for c in conns:  # an idle timeout on the daemon's side
            c.shutdown(2)
        assert "global" in client.stats()
    finally:
        client.close()


def test_client_without_a_socket(tmp_path: Path) -> None:
    client = _client.ControlClient(str(tmp_path / "none.sock"), timeout=0.5)
    with pytest.raises(_client.ControlError) as err:
        client.stats()
    assert (err.value.status, err.value.code, err.value.errno) == (0, "", 0)


def test_report_line() -> None:
    assert _report.global_counts({"global": {"reads": {"hit": 990, "late": 5, "miss": 5}}}) == \
        (1000, 990)
    assert _report.global_counts({}) is None
    r = _report.Reporter()
    assert r.line((1000, 995)) == (
        "cube_torch: last cycle: request_count=1000 hit_count=995 miss_count=5 hit_rate=0.995; "
        "total: request_count=1000 hit_count=995 miss_count=5 hit_rate=0.995")
    assert r.line((1100, 1094)) == (
        "cube_torch: last cycle: request_count=100 hit_count=99 miss_count=1 hit_rate=0.990; "
        "total: request_count=1100 hit_count=1094 miss_count=6 hit_rate=0.995")
    assert r.line((1100, 1094)).startswith(
        "cube_torch: last cycle: request_count=0 hit_count=0 miss_count=0 hit_rate=0.000;")


def test_big_publishes_are_split() -> None:
    from cube_torch._publisher import _chunks
    paths = [f"/m/{i:06d}" for i in range(1000)]  # 13 bytes each with overhead
    chunks = list(_chunks(paths, 1300))
    assert [p for c in chunks for p in c] == paths
    assert all(len(c) == 100 for c in chunks)
    assert list(_chunks(["/m/" + "x" * 5000], 100)) == [["/m/" + "x" * 5000]]
    assert list(_chunks([], 100)) == []


def test_client_says_why_no_reply_came(tmp_path: Path) -> None:
    """A daemon being restarted has no socket, or refuses: the publisher asks it again soon."""
    import errno as errno_mod
    import socket as socket_mod

    client = _client.ControlClient(str(tmp_path / "none.sock"), timeout=0.5)
    with pytest.raises(_client.ControlError) as err:
        client.stats()
    assert err.value.os_errno == errno_mod.ENOENT and err.value.errno == 0
    path = tmp_path / "dead.sock"
    s = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # a socket file nobody listens on
    client = _client.ControlClient(str(path), timeout=0.5)
    with pytest.raises(_client.ControlError) as err:
        client.stats()
    assert err.value.os_errno == errno_mod.ECONNREFUSED and err.value.status == 0
