"""The hook leaves the training loop's order alone and publishes exactly that order."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from cube_torch import _hook, _publisher
from cube_torch._lookahead import LookaheadIterator
from fake_control_server import FakeDaemon
from hook_testlib import FileList, flush, indices, make_files, real

LOADER_KINDS: Dict[str, Dict[str, Any]] = {
    "single": {"num_workers": 0},
    "workers": {"num_workers": 2},
    "persistent": {"num_workers": 2, "persistent_workers": True},
}


def epochs(dataset: Any, n_epochs: int, seed: int = 1234, **kwargs: Any) -> List[List[int]]:
    torch.manual_seed(seed)
    loader = DataLoader(dataset, batch_size=4, shuffle=True, **kwargs)
    return [indices(loader) for _ in range(n_epochs)]


@pytest.mark.parametrize("kind", sorted(LOADER_KINDS))
def test_same_order_and_published_order(kind: str, mount: Path, daemon: FakeDaemon) -> None:
    files = make_files(mount, 40)
    dataset = FileList(files)
    _hook.uninstall()
    plain = epochs(dataset, 2, **LOADER_KINDS[kind])
    _hook.install()
    hooked = epochs(dataset, 2, **LOADER_KINDS[kind])
    assert hooked == plain
    assert plain[0] != plain[1]  # shuffled anew each epoch

    flush()
    streams = daemon.all_streams()
    assert [s.paths for s in streams] == [[files[i] for i in epoch] for epoch in hooked]
    assert all(s.deleted for s in streams)
    assert len({s.name for s in streams}) == 2 and all(s.name.startswith("FileList:") for s in streams)


def test_published_paths_are_the_files_read_in_order(monkeypatch: pytest.MonkeyPatch,
                                                     mount: Path, daemon: FakeDaemon) -> None:
    monkeypatch.setenv("CUBE_TORCH_LOOKAHEAD_BATCHES", "3")
    read: List[str] = []
    files = make_files(mount, 30)
    dataset = FileList(files, record=read)
    submitted: List[int] = []
    original = _publisher.Publisher.submit

    def spy(self: Any, stream: Any, batch: Any) -> None:
        submitted.append(len(batch))
        original(self, stream, batch)

    monkeypatch.setattr(_publisher.Publisher, "submit", spy)
    loader = DataLoader(dataset, batch_size=4, shuffle=True)
    n_batches = len(loader)
    for j, _ in enumerate(loader):
        # while batch j is used, batches j+1 .. j+3 have been pulled and handed over already
        assert len(submitted) == min(j + 1 + 3, n_batches)
    flush()
    assert daemon.published() == read
    assert sorted(read) == sorted(files)


class TimedReads(Dataset):
    """Reads its files, logging (index, time.monotonic() after the read) to `log`, from any
    process (one O_APPEND write per read)."""

    def __init__(self, files: List[str], log: str) -> None:
        self.files, self.log = files, log

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> int:
        with open(self.files[i], "rb") as f:
            f.read()
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{i} {time.monotonic()!r}\n".encode())
        finally:
            os.close(fd)
        if i % 7 == 0:
            time.sleep(0.002)  # workers finish out of order
        return i

    def train_data_list(self) -> List[str]:
        return self.files


@pytest.mark.parametrize("kind", sorted(LOADER_KINDS))
def test_what_the_hook_says_is_unread_is_never_read_already(kind: str, mount: Path, tmp_path: Path,
                                                            daemon: FakeDaemon,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # Each POST says how many of the stream's latest positions may not have been read yet:
    # the daemon then treats every earlier one as read. Check that claim against the reads.
    monkeypatch.setenv("CUBE_TORCH_LOOKAHEAD_BATCHES", "2")
    files = make_files(mount, 120)
    log = tmp_path / "reads.log"
    torch.manual_seed(7)
    loader = DataLoader(TimedReads(files, str(log)), batch_size=3, shuffle=True,
                        **LOADER_KINDS[kind])
    for _ in range(2):
        for _ in loader:
            time.sleep(0.001)  # the loop is slower than the publisher
    flush()
    read_at: Dict[str, List[float]] = {}
    for line in log.read_text().splitlines():
        i, t = line.split()
        read_at.setdefault(files[int(i)], []).append(float(t))
    streams = daemon.all_streams()
    assert len(streams) == 2
    bounds = 0
    for epoch, s in enumerate(streams):
        assert s.unread and all(u is not None for _, _, u in s.unread)
        assert sorted(s.paths) == sorted(files)
        # The same path is read once per epoch: the epoch's read is its epoch-th.
        for when, end, unread in s.unread:
            for pos in range(0, max(0, end - unread)):
                t = read_at[s.paths[pos]][epoch]
                assert t < when, (kind, epoch, pos, end, unread)
                bounds += 1
        # It says little more than it must: the lookahead (2 + 1 batches) and, with workers,
        # prefetch_factor (2) per worker (2): 7 batches of 3.
        limit = 3 * (3 + (4 if kind != "single" else 0))
        assert max(u for _, _, u in s.unread) <= limit
    assert bounds > 0


def test_lookahead_iterator_is_transparent() -> None:
    pulled: List[int] = []
    source = iter(range(10))
    it = LookaheadIterator(source, 4, pulled.append)
    assert pulled == []  # nothing pulled before the first next()
    assert next(it) == 0 and pulled == [0, 1, 2, 3, 4]
    assert list(it) == list(range(1, 10)) and pulled == list(range(10))
    assert it.exhausted
    with pytest.raises(StopIteration):
        next(it)


def test_lookahead_holds_back_a_sampler_error() -> None:
    def source():
        yield 1
        yield 2
        raise ValueError("sampler broke")

    it = LookaheadIterator(source(), 5, lambda item: None)
    assert next(it) == 1 and next(it) == 2
    with pytest.raises(ValueError):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_lookahead_survives_a_raising_callback() -> None:
    def boom(item: int) -> None:
        raise RuntimeError("publisher broke")

    assert list(LookaheadIterator(iter(range(5)), 2, boom)) == list(range(5))


def test_single_indices_without_batching(mount: Path, daemon: FakeDaemon) -> None:
    files = make_files(mount, 12)
    torch.manual_seed(7)
    loader = DataLoader(FileList(files), batch_size=None, shuffle=True)
    seen = indices(loader)
    flush()
    assert daemon.published() == [files[i] for i in seen]


def test_distributed_sampler_two_ranks(mount: Path, daemon: FakeDaemon) -> None:
    files = make_files(mount, 21)
    dataset = FileList(files)
    seen = {}
    for rank in (0, 1):
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=3)
        sampler.set_epoch(1)
        seen[rank] = indices(DataLoader(dataset, batch_size=3, sampler=sampler, num_workers=0))
    flush()
    streams = daemon.all_streams()
    assert len(streams) == 2
    for rank, stream in zip((0, 1), streams):
        assert stream.paths == [files[i] for i in seen[rank]]
    assert set(seen[0]) | set(seen[1]) == set(range(21))
    assert len(seen[0]) == len(seen[1]) == 11  # padded to an even share


def test_several_loaders_at_once_get_a_stream_each(mount: Path, daemon: FakeDaemon) -> None:
    a = make_files(mount / "a", 16)
    b = make_files(mount / "b", 24)
    torch.manual_seed(5)
    la = DataLoader(FileList(a), batch_size=2, shuffle=True)
    lb = DataLoader(FileList(b), batch_size=3, shuffle=True, num_workers=2)
    got_a: List[int] = []
    got_b: List[int] = []
    for xa, xb in zip(la, lb):
        got_a.extend(xa.tolist())
        got_b.extend(xb.tolist())
    flush()
    by_first = {s.paths[0]: s for s in daemon.all_streams()}
    assert len(by_first) == 2
    assert by_first[a[got_a[0]]].paths == [a[i] for i in got_a]
    assert by_first[b[got_b[0]]].paths == [b[i] for i in got_b]


def test_stream_deleted_when_an_epoch_is_left_early(mount: Path, daemon: FakeDaemon) -> None:
    files = make_files(mount, 40)
    loader = DataLoader(FileList(files), batch_size=2, shuffle=True)
    it = iter(loader)
    next(it)
    next(it)
    del it  # the iterator is dropped: its stream goes
    flush()
    (stream,) = daemon.all_streams()
    assert stream.deleted
    assert len(stream.paths) == 2 * (16 + 2)  # what was pulled: lookahead past the 2 batches


def test_persistent_workers_epoch_left_early(mount: Path, daemon: FakeDaemon) -> None:
    files = make_files(mount, 40)
    loader = DataLoader(FileList(files), batch_size=2, shuffle=True, num_workers=2,
                        persistent_workers=True)
    for i, _ in enumerate(loader):
        if i == 1:
            break
    full = indices(loader)  # the next epoch on the same workers
    flush()
    first, second = daemon.all_streams()
    assert first.deleted and second.deleted
    assert second.paths == [files[i] for i in full]


@pytest.mark.parametrize("methods", [("__init__", "__next__"), ("__next__",)])
@pytest.mark.parametrize("kind", sorted(LOADER_KINDS))
def test_fallback_patch_without_reset(methods: tuple, kind: str, mount: Path,
                                      daemon: FakeDaemon) -> None:
    """A torch where `_reset` is missing or unknown: wrapping happens at the next __next__."""
    files = make_files(mount, 40)
    dataset = FileList(files)
    _hook.uninstall()
    plain = epochs(dataset, 2, **LOADER_KINDS[kind])
    _hook.install(methods=methods)
    hooked = epochs(dataset, 2, **LOADER_KINDS[kind])
    assert hooked == plain
    flush()
    streams = daemon.all_streams()
    assert len(streams) == 2
    for stream, epoch in zip(streams, hooked):
        expected = [files[i] for i in epoch]
        # Worker iterators pulled their first prefetch_factor * num_workers batches before
        # the hook saw them; everything after is published, in order.
        assert stream.paths == expected[len(expected) - len(stream.paths):]
        assert len(stream.paths) >= len(expected) - 4 * 4
        if kind == "single":
            assert stream.paths == expected
    assert real(daemon.published()) == daemon.published()
