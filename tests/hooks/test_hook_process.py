"""Import-time behaviour, CUBE_TORCH_DISABLE, fork safety, stats() and the verbose line."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

import cube_torch
from cube_torch import _publisher
from fake_control_server import FakeDaemon
from hook_testlib import FileList, flush, indices, make_files

HOOKS = str(Path(__file__).resolve().parents[2] / "hooks")

_PROBE = """
import os, threading, torch.utils.data.dataloader as dl
import cube_torch
patched = "_cube_torch_originals" in dl._BaseDataLoaderIter.__dict__
def is_socket(fd):
    try:
        return os.readlink("/proc/self/fd/" + fd).startswith("socket:")
    except OSError:  # the listing's own descriptor
        return False
sockets = [f for f in os.listdir("/proc/self/fd") if is_socket(f)]
print(patched, threading.active_count(), len(sockets))
"""


def _probe(extra_env: dict) -> str:
    env = {**os.environ, "PYTHONPATH": HOOKS, **extra_env}
    result = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_import_only_patches(config_dir: Path) -> None:
    assert _probe({}) == "True 1 0"  # patched; no thread, no socket


def test_disable_leaves_dataloader_unpatched() -> None:
    assert _probe({"CUBE_TORCH_DISABLE": "1"}) == "False 1 0"


def test_disable_at_use_time(monkeypatch: pytest.MonkeyPatch, mount: Path,
                             daemon: FakeDaemon) -> None:
    monkeypatch.setenv("CUBE_TORCH_DISABLE", "1")
    assert sorted(indices(DataLoader(FileList(make_files(mount, 6)), batch_size=2))) == \
        list(range(6))
    assert _publisher.current_publisher() is None and daemon.requests == []


def _child_epoch(files: list, config_dir: str, queue: "multiprocessing.Queue") -> None:
    try:
        os.environ["CUBE_TORCH_CONFIG_DIR"] = config_dir
        assert _publisher.current_publisher() is None  # reset at fork
        seen = indices(DataLoader(FileList(files), batch_size=2, shuffle=True))
        flush()
        queue.put(("ok", os.getpid(), seen))
    except BaseException as e:  # report, never hang the parent
        queue.put(("error", os.getpid(), repr(e)))


def test_forked_child_publishes_its_own_stream(mount: Path, config_dir: Path,
                                               daemon: FakeDaemon) -> None:
    files = make_files(mount, 10)
    indices(DataLoader(FileList(files), batch_size=2))  # the parent's publisher is running
    flush()
    assert _publisher.current_publisher() is not None
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_epoch, args=(files, str(config_dir), queue))
    child.start()
    try:
        status, pid, seen = queue.get(timeout=30)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert status == "ok", seen
    streams = daemon.all_streams()
    assert [s.pid for s in streams] == [os.getpid(), pid]
    assert streams[1].paths == [files[i] for i in seen]
    # the parent still publishes after the fork
    indices(DataLoader(FileList(files), batch_size=5))
    flush()
    assert daemon.all_streams()[-1].pid == os.getpid()


def test_stats_sends_the_queued_paths_first_and_returns_the_daemon_reply(
        mount: Path, daemon: FakeDaemon) -> None:
    daemon.reads.update(hit=9, late=1, miss=2)
    files = make_files(mount, 8)
    order = indices(DataLoader(FileList(files), batch_size=2, shuffle=True))
    assert sorted(order) == list(range(8))
    s = cube_torch.stats()  # no flush(): stats() waits for what was queued
    # What the hook sent: one stream for this process, every file in the order the loop
    # read it, the stream deleted when the epoch ended, then (only then) one stats request.
    (stream,) = daemon.all_streams()
    assert stream.name.startswith("FileList:") and stream.pid == os.getpid()
    assert stream.paths == [files[i] for i in order]
    assert stream.deleted
    # The files go into the dataset's file list as their indices are first met, the order as
    # positions in it.
    sent = [(method, path) for method, path, _ in daemon.requests]
    (list_id,) = daemon.lists
    middle = sent[2:-2]
    posts = sum(1 for x in middle if x == ("POST", f"/v1/streams/{stream.id}/positions"))
    assert posts >= 1 and sent[:2] == [("POST", "/v1/lists"), ("POST", "/v1/streams")] \
        and set(middle) <= {("POST", f"/v1/streams/{stream.id}/positions"),
                            ("POST", f"/v1/lists/{list_id}")} \
        and sent[-2:] == [("DELETE", f"/v1/streams/{stream.id}"), ("GET", "/v1/stats")], sent
    # What stats() returns: the daemon's reply as served, plus the client's own counters,
    # which agree with what the daemon accepted.
    assert s["global"]["reads"] == {"hit": 9, "late": 1, "miss": 2}
    assert s["global"]["hit_ratio"] == 0.75
    assert s["streams"] == []  # the daemon lists live streams only
    assert s["client"]["cpu_s"] > 0
    del s["client"]["cpu_s"]
    assert s["client"] == {"published": 8, "rejected": 0, "dropped": 0, "errors": 0,
                           "skipped": 0, "unmapped": 0, "streams": 1, "registered": 8,
                           "resent": 0}


def test_stats_without_a_daemon() -> None:
    s = cube_torch.stats()
    assert set(s) == {"client"} and s["client"]["published"] == 0


def test_stats_before_any_stream_finds_the_only_daemon(daemon: FakeDaemon) -> None:
    assert "global" in cube_torch.stats()
    assert _publisher.current_publisher() is None


def test_verbose_hit_rate_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                               mount: Path, daemon: FakeDaemon) -> None:
    monkeypatch.setenv("CUBE_TORCH_VERBOSE", "1")
    monkeypatch.setenv("CUBE_TORCH_REPORT_S", "0.1")
    daemon.reads.update(hit=99, late=1, miss=0)
    indices(DataLoader(FileList(make_files(mount, 6)), batch_size=2))
    flush()

    def wait_for(text: str) -> str:
        out = ""
        deadline = time.monotonic() + 5
        while text not in out and time.monotonic() < deadline:
            time.sleep(0.05)
            out += capsys.readouterr().out
        assert text in out
        return out

    first = wait_for("\n")
    assert first.splitlines()[0] == (
        "cube_torch: last cycle: request_count=100 hit_count=99 miss_count=1 hit_rate=0.990; "
        "total: request_count=100 hit_count=99 miss_count=1 hit_rate=0.990")
    daemon.reads["hit"] += 100
    later = wait_for("total: request_count=200")
    line = [x for x in later.splitlines() if "total: request_count=200" in x][0]
    assert line == (
        "cube_torch: last cycle: request_count=100 hit_count=100 miss_count=0 hit_rate=1.000; "
        "total: request_count=200 hit_count=199 miss_count=1 hit_rate=0.995")


_EXIT_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import cube_torch
from torch.utils.data import DataLoader
from hook_testlib import FileList
it = iter(DataLoader(FileList({files!r}), batch_size=2))
next(it)  # left mid-epoch; the iterator is still alive at exit
"""


def test_open_stream_deleted_at_exit(mount: Path, config_dir: Path, daemon: FakeDaemon) -> None:
    files = make_files(mount, 10)
    script = _EXIT_SCRIPT.format(tests=str(Path(__file__).parent), files=files)
    env = {**os.environ, "PYTHONPATH": HOOKS, "CUBE_TORCH_CONFIG_DIR": str(config_dir)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (stream,) = daemon.all_streams()
    assert stream.paths == files and stream.deleted
