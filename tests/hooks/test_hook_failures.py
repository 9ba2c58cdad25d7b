"""Nothing the daemon (or its absence) does can break or slow a training loop."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, List, Optional

import pytest
import torch
from torch.utils.data import DataLoader

from cube_torch import _client, _mounts, _publisher
from cube_torch._common import CubeTorchWarning
from fake_control_server import FakeDaemon
from hook_testlib import (Counting, FileList, Unmappable, counters, cube_warnings, flush,
                          indices, make_files)


def run_epoch(dataset: FileList, seed: int = 11, **kwargs: object) -> List[int]:
    torch.manual_seed(seed)
    return indices(DataLoader(dataset, batch_size=2, shuffle=True, **kwargs))


def test_no_control_file_one_warning(mount: Path) -> None:
    dataset = FileList(make_files(mount, 20))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = run_epoch(dataset)
        second = run_epoch(dataset, num_workers=2)
        flush()
    assert sorted(first) == sorted(second) == list(range(20))
    assert len(cube_warnings(record)) == 1
    assert "no cubetorchfs control file" in cube_warnings(record)[0]
    assert _publisher.current_publisher() is None  # no thread was started


def test_warnings_as_errors_do_not_reach_the_loop(mount: Path) -> None:
    dataset = FileList(make_files(mount, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sorted(run_epoch(dataset)) == list(range(6))


def test_dead_daemon_control_file_is_ignored(mount: Path, config_dir: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    fake = FakeDaemon(str(mount)).start()
    try:
        fake.write_control_file(str(config_dir), pid=proc.pid)  # a pid that is gone
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert sorted(run_epoch(FileList(make_files(mount, 8)))) == list(range(8))
            flush()
        assert fake.requests == []
        assert len(cube_warnings(record)) == 1
    finally:
        fake.stop()


def test_daemon_stopped_mid_epoch(monkeypatch: pytest.MonkeyPatch, mount: Path,
                                  daemon: FakeDaemon) -> None:
    monkeypatch.setenv("CUBE_TORCH_LOOKAHEAD_BATCHES", "1")
    dataset = FileList(make_files(mount, 60))
    seen: List[int] = []
    torch.manual_seed(12)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for j, batch in enumerate(DataLoader(dataset, batch_size=2, shuffle=True, num_workers=2)):
            seen.extend(batch.tolist())
            if j == 3:
                flush()
                daemon.stop()  # socket removed, connections cut
        flush()
    assert sorted(seen) == list(range(60))
    assert 0 < len(daemon.published()) < 60
    assert len(cube_warnings(record)) == 1
    assert counters()["errors"] >= 1


def epoch_with_an_outage(daemon: FakeDaemon, files: List[str], seed: int, down_at: int,
                         back_at: int) -> List[int]:
    """One shuffled epoch (batches of 2, a short step each) during which the daemon goes down
    after batch `down_at` and comes back on the same socket after batch `back_at`; returns
    the indices in the order read."""
    seen: List[int] = []
    torch.manual_seed(seed)
    for j, batch in enumerate(DataLoader(FileList(files), batch_size=2, shuffle=True)):
        seen.extend(batch.tolist())
        if j == down_at:
            flush()
            daemon.go_down()
        if j == back_at:
            flush()  # the batches since were refused (no socket) and held
            assert counters()["errors"] >= 1
            daemon.come_back()
            time.sleep(_publisher.GONE_COOLDOWN_S + 0.05)
        time.sleep(0.01)
    flush()
    assert sorted(seen) == list(range(len(files)))
    return seen


def test_paths_of_a_restarting_daemon_are_held_and_sent_when_it_is_back(
        monkeypatch: pytest.MonkeyPatch, mount: Path, daemon: FakeDaemon) -> None:
    """A daemon killed and restarted by its supervisor (or upgraded) mid-epoch: the next
    process first gets again the window the first one lost with its stream (the items sent to
    it that the loop may not have read), then the batches the loop went through meanwhile,
    none dropped, so the window it prefetches is whole."""
    monkeypatch.setenv("CUBE_TORCH_LOOKAHEAD_BATCHES", "8")
    files = make_files(mount, 60)
    seen = epoch_with_an_outage(daemon, files, seed=13, down_at=3, back_at=6)
    c = counters()
    assert c["dropped"] == 0, c
    first, second = daemon.all_streams()
    resent = c["resent"]  # one file an index here
    assert resent >= 2, c
    # The window sent again is the tail of what the first process had, in the same order.
    assert second.paths[:resent] == first.paths[-resent:], (first.paths, second.paths)
    # Every file reaches a daemon, in the order read: those published before the crash the
    # first process, the rest (held while it was down) the second, after the window.
    assert first.paths + second.paths[resent:] == [files[i] for i in seen], \
        (first.paths, second.paths)


def test_paths_held_for_a_daemon_that_stays_down_are_bounded_oldest_dropped_first(
        monkeypatch: pytest.MonkeyPatch, mount: Path, daemon: FakeDaemon) -> None:
    monkeypatch.setenv("CUBE_TORCH_LOOKAHEAD_BATCHES", "1")
    monkeypatch.setattr(_publisher, "MAX_HELD_PATHS", 6)
    files = make_files(mount, 60)
    order = [files[i] for i in epoch_with_an_outage(daemon, files, seed=14, down_at=3,
                                                    back_at=20)]
    first, second = daemon.all_streams()
    dropped = counters()["dropped"]
    # Nothing published twice or out of order; what was dropped is the oldest of what was held
    # (the files read meanwhile): the second process gets the newest 6 and everything after.
    assert first.paths == order[:len(first.paths)]
    assert second.paths == order[len(order) - len(second.paths):]
    assert dropped > 0 and len(first.paths) + dropped + len(second.paths) == 60, (
        len(first.paths), dropped, len(second.paths))


@pytest.mark.parametrize("mode", ["error", "garbage"])
def test_daemon_error_replies(mode: str, mount: Path, daemon_factory) -> None:
    fake = daemon_factory(mode)
    dataset = FileList(make_files(mount, 20))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert sorted(run_epoch(dataset)) == list(range(20))
        assert sorted(run_epoch(dataset, num_workers=2)) == list(range(20))
        flush()
    assert len(cube_warnings(record)) == 1
    c = counters()
    assert c["errors"] >= 2 and c["published"] == 0
    assert len(fake.requests) >= 2  # each epoch tried its own stream


def test_slow_daemon_does_not_slow_training(mount: Path, daemon_factory) -> None:
    fake = daemon_factory("slow")
    dataset = FileList(make_files(mount, 24))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        start = time.monotonic()
        for _ in range(3):
            assert sorted(run_epoch(dataset)) == list(range(24))
        elapsed = time.monotonic() - start
        flush()  # the publisher gives up on each request after 2 s
    assert elapsed < 1.5
    assert len(cube_warnings(record)) == 1
    c = counters()
    # One 2 s timeout, then the daemon is left alone for a while: the paths of all three
    # epochs are held for it, and dropped as each epoch's stream closes before it answers.
    assert c["errors"] == 1
    assert c["dropped"] == 3 * 24
    assert len(fake.requests) == 1


def test_full_queue_drops_and_counts(monkeypatch: pytest.MonkeyPatch, mount: Path,
                                     daemon_factory) -> None:
    daemon_factory("slow")
    monkeypatch.setattr(_publisher, "MAX_QUEUED_BATCHES", 2)
    dataset = FileList(make_files(mount, 40))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert sorted(run_epoch(dataset)) == list(range(40))
        assert counters()["dropped"] > 0
        flush()


def test_daemon_over_its_queue_limits_refuses_a_batch_and_publishing_resumes(
        monkeypatch: pytest.MonkeyPatch, mount: Path, daemon_factory) -> None:
    fake = daemon_factory("full")
    fake.refuse = 1  # the first publish gets 429
    monkeypatch.setattr(_publisher, "FULL_COOLDOWN_S", 0.0)
    monkeypatch.setenv("CUBE_TORCH_LOOKAHEAD_BATCHES", "0")  # a batch is sent as it is taken
    files = make_files(mount, 40)
    seen = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.manual_seed(3)
        for batch in DataLoader(FileList(files), batch_size=2, shuffle=True):
            seen.extend(batch.tolist())
            flush()  # each batch its own POST
    assert sorted(seen) == list(range(40))
    warned = cube_warnings(record)
    assert len(warned) == 1 and "prefetch.max_queued_paths_per_uid" in warned[0]
    c = counters()
    assert (c["rejected"], c["published"], c["errors"]) == (2, 38, 0)
    [stream] = fake.all_streams()
    assert len(stream.paths) == 38 and stream.paths == [files[i] for i in seen[2:]]


def test_iterable_dataset_runs_unchanged_with_one_warning(daemon: FakeDaemon) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert indices(DataLoader(Counting(), batch_size=3)) == list(range(10))
        assert indices(DataLoader(Counting(), batch_size=None, num_workers=2)) == \
            sorted(list(range(10)) * 2)  # each worker replica yields everything
        flush()
    messages = cube_warnings(record)
    assert len(messages) == 1 and "IterableDataset" in messages[0]
    assert daemon.requests == []


def test_unmappable_dataset_runs_unchanged_with_one_warning(daemon: FakeDaemon) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            torch.manual_seed(0)
            assert sorted(indices(DataLoader(Unmappable(), batch_size=3, shuffle=True))) == \
                list(range(8))
    messages = cube_warnings(record)
    assert len(messages) == 1 and "Unmappable" in messages[0]
    assert daemon.requests == []


def test_stream_forgotten_by_the_daemon_is_recreated(monkeypatch: pytest.MonkeyPatch,
                                                     mount: Path, daemon: FakeDaemon) -> None:
    monkeypatch.setenv("CUBE_TORCH_LOOKAHEAD_BATCHES", "0")
    files = make_files(mount, 10)
    seen: List[int] = []
    for j, batch in enumerate(DataLoader(FileList(files), batch_size=2)):
        seen.extend(batch.tolist())
        if j == 1:
            flush()
            with daemon.lock:  # the daemon expires the idle stream
                daemon.streams["1"].deleted = True
    flush()
    first, second = daemon.all_streams()
    assert first.paths + second.paths == [files[i] for i in seen]
    assert counters()["errors"] == 0


def test_publisher_thread_warnings_name_the_users_loop(mount: Path, daemon_factory) -> None:
    """A warning raised on the publisher thread points at the line of the training loop that
    iterated the DataLoader, never at threading.py or cube_torch."""
    daemon_factory("error")
    dataset = FileList(make_files(mount, 12))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loop_line = sys._getframe().f_lineno + 1
        for _ in DataLoader(dataset, batch_size=2, shuffle=True, num_workers=0):
            pass
        flush()
    ours = [w for w in record if issubclass(w.category, CubeTorchWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert (ours[0].filename, ours[0].lineno) == (__file__, loop_line), (ours[0].filename,
                                                                          ours[0].lineno)


# --- what the warnings say -------------------------------------------------------------------


def test_mountinfo_gives_the_mount_holding_a_path(tmp_path: Path) -> None:
    table = tmp_path / "mountinfo"
    table.write_text(
        "22 1 0:21 / / rw - ext4 /dev/sda1 rw\n"
        "30 22 0:40 / /data rw - xfs /dev/sdb1 rw\n"
        "31 30 0:41 / /data/train\\040set rw,nosuid - fuse.cubetorchfs cubetorchfs:vol rw\n"
        "32 30 0:42 / /data/train\\040set rw - tmpfs tmpfs rw\n"  # mounted over the one above
        "33 22 0:43 / /data2 rw - fuse.cubetorchfs cubetorchfs:other rw\n")
    assert _client.mount_of("/data/train set/a/b.jpg", str(table)) == ("/data/train set", "tmpfs")
    assert _client.mount_of("/data/trainX/b.jpg", str(table)) == ("/data", "xfs")
    assert _client.mount_of("/data2/x", str(table)) == ("/data2", "fuse.cubetorchfs")
    assert _client.mount_of("/etc/hosts", str(table)) == ("/", "ext4")
    assert _client.mount_of("/x", str(tmp_path / "absent")) is None


def _one_epoch_warnings(files: List[str]) -> List[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert sorted(run_epoch(FileList(files))) == list(range(len(files)))
        flush()
    return cube_warnings(record)


def test_a_dataset_under_no_announced_mount_names_its_own_mount_and_the_announced_ones(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mount: Path, config_dir: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    fake = FakeDaemon(str(other)).start()  # a daemon of another mount announces itself
    try:
        fake.write_control_file(str(config_dir))
        files = make_files(mount, 8)
        # The dataset is on a cubetorchfs mount whose daemon writes its control file elsewhere.
        with monkeypatch.context() as m:
            m.setattr(_client, "mount_of", lambda path, *a: (str(mount), "fuse.cubetorchfs"))
            [warned] = _one_epoch_warnings(files)
        assert f"is on the cubetorchfs mount {mount}, but the control file in {config_dir} " \
               f"announces only {other}" in warned, warned
        assert "CUBE_TORCH_CONFIG_DIR" in warned
        # On a mount of another kind: that mount and its type, and the announced one.
        _publisher.reset()
        holder = _client.mount_of(files[0])
        assert holder is not None and holder[1] != "fuse.cubetorchfs"
        [warned] = _one_epoch_warnings(files)
        assert f"is on {holder[0]} ({holder[1]}), not on the cubetorchfs mount that the " \
               f"control file in {config_dir} announces ({other})" in warned, warned
        assert fake.requests == []
    finally:
        fake.stop()


def test_probe_mount_tells_a_mount_that_answers_fails_is_gone_or_hangs(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert _publisher.probe_mount("/") == ("answers", None)
    state, error = _publisher.probe_mount(str(tmp_path / "absent"))
    assert state == "failed" and isinstance(error, FileNotFoundError)
    assert _publisher.probe_mount(str(tmp_path)) == ("unmounted", None)  # a plain directory
    release = threading.Event()
    real_stat = os.stat

    def hanging_stat(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) == str(tmp_path):
            release.wait(10)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", hanging_stat)
    try:
        start = time.monotonic()
        assert _publisher.probe_mount(str(tmp_path), timeout=0.2) == ("hung", None)
        assert time.monotonic() - start < 2
    finally:
        release.set()


def test_a_silent_daemon_warning_says_what_reads_through_the_mount_do(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def said(state: str, error: Optional[OSError] = None) -> str:
        monkeypatch.setattr(_mounts, "probe_mount", lambda mount: (state, error))
        return _mounts._daemon_silent_message("/cfs/mnt", "FileList:1")

    answers = said("answers")
    assert "the mount itself still answers, so training goes on" in answers
    for text in (said("failed", OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN))),
                 said("unmounted"), said("hung")):
        assert "training goes on" not in text, text
        assert "prefetching is off" in text and "/cfs/mnt" in text, text
    assert "every read through /cfs/mnt fails until the mount is back" in said(
        "failed", OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN)))
    assert os.strerror(errno.ENOTCONN) in said(
        "failed", OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN)))
    assert "no longer mounted" in said("unmounted")


def test_a_daemon_gone_mid_epoch_warns_once_without_claiming_reads_work(
        monkeypatch: pytest.MonkeyPatch, mount: Path, daemon: FakeDaemon) -> None:
    """The fake's mount is a plain directory, no mount point: as after the supervisor has
    unmounted. The warning must not say training goes on; it comes once, as before."""
    monkeypatch.setenv("CUBE_TORCH_LOOKAHEAD_BATCHES", "1")
    probes: List[str] = []
    real_probe = _publisher.probe_mount

    def counting_probe(mount_point: str, *args: Any) -> Any:
        probes.append(mount_point)
        return real_probe(mount_point, *args)

    monkeypatch.setattr(_publisher, "probe_mount", counting_probe)
    dataset = FileList(make_files(mount, 60))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for j, _ in enumerate(DataLoader(dataset, batch_size=2, shuffle=True)):
            if j == 3:
                flush()
                daemon.stop()
            if j == 10:
                flush()
                time.sleep(_publisher.GONE_COOLDOWN_S + 0.05)  # past the cooldown: asked again
        flush()
    [warned] = cube_warnings(record)
    assert f"the daemon of {mount} is gone and {mount} is no longer mounted" in warned, warned
    assert "prefetching is off" in warned and "training goes on" not in warned
    assert probes == [str(mount)]  # probed for the one message shown, not at each retry


def test_a_routine_restart_prints_nothing_and_a_lasting_one_warns_once(
        monkeypatch: pytest.MonkeyPatch, mount: Path, daemon: FakeDaemon) -> None:
    """An upgrade or a restart by the supervisor (no socket for a moment while the mount
    still answers) is routine: no warning, nothing dropped. A daemon that stays away longer
    than SILENT_GRACE_S is warned about once."""
    monkeypatch.setenv("CUBE_TORCH_LOOKAHEAD_BATCHES", "1")
    monkeypatch.setattr(_publisher, "probe_mount", lambda mount_point, *a: ("answers", None))
    files = make_files(mount, 60)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        epoch_with_an_outage(daemon, files, seed=21, down_at=3, back_at=9)
    assert cube_warnings(record) == []
    assert counters()["dropped"] == 0

    monkeypatch.setattr(_publisher, "SILENT_GRACE_S", 0.3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for j, _ in enumerate(DataLoader(FileList(files), batch_size=2, shuffle=True)):
            if j == 3:
                flush()
                daemon.go_down()
            if j in (6, 12):
                flush()
                time.sleep(0.35)  # past the grace (and the cooldown): asked again
        flush()
    [warned] = cube_warnings(record)
    assert "the mount itself still answers, so training goes on" in warned, warned
