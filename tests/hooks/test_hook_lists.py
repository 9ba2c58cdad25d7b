"""File lists: each file's path goes to the daemon once per dataset, each epoch's order as
positions in its list; a daemon without lists, or one that lost the list, still gets every
file in order."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import List

import pytest
import torch
from torch.utils.data import DataLoader

from cube_torch import _lists
from fake_control_server import FakeDaemon
from hook_testlib import FileList, counters, cube_warnings, flush, indices, make_files


def epochs(dataset: FileList, n: int, batch_size: int = 4) -> List[List[int]]:
    out = []
    for e in range(n):
        torch.manual_seed(100 + e)
        out.append(indices(DataLoader(dataset, batch_size=batch_size, shuffle=True)))
    flush()
    return out


def requests_to(daemon: FakeDaemon, what: str) -> int:
    with daemon.lock:
        return sum(1 for _, path, _ in daemon.requests if what in path)


def test_each_path_is_registered_once_and_epochs_go_as_positions(
        monkeypatch: pytest.MonkeyPatch, mount: Path, daemon: FakeDaemon) -> None:
    monkeypatch.setenv("CUBE_TORCH_LOOKAHEAD_BATCHES", "2")
    files = make_files(mount, 40)
    orders = epochs(FileList(files), 3)
    # Every epoch's files reach the daemon in the order read.
    assert daemon.published() == [files[i] for order in orders for i in order]
    c = counters()
    assert c["registered"] == 40 and c["published"] == 120, c
    with daemon.lock:
        assert len(daemon.lists) == 1 and len(next(iter(daemon.lists.values()))) == 40
        posted = [body for method, path, body in daemon.requests if path.endswith("/positions")]
    assert requests_to(daemon, "/paths") == 0
    # Epochs 2 and 3 sent no path at all: 8 bytes of `unread` and 4 bytes a file a request.
    # One registration: the first epoch met every index within its first publish cycles.
    assert 1 <= requests_to(daemon, "/v1/lists") <= 10
    assert sum(len(b) - 8 for b in posted) == 4 * 120
    # The positions carry `unread` as paths did.
    assert all(u is not None for s in daemon.all_streams() for _, _, u in s.unread)


def test_indices_with_several_files_each(mount: Path, daemon: FakeDaemon) -> None:
    images = make_files(mount, 12, ".jpg")
    captions = make_files(mount, 12, ".txt")
    orders = epochs(FileList(images, captions), 2, batch_size=3)
    assert daemon.published() == [p for order in orders for i in order
                                  for p in (images[i], captions[i])]
    assert counters()["registered"] == 24


def test_a_daemon_without_lists_gets_paths(mount: Path, daemon_factory) -> None:
    old = daemon_factory("nolists")
    files = make_files(mount, 20)
    orders = epochs(FileList(files), 2)
    assert old.published() == [files[i] for order in orders for i in order]
    # It is asked once whether it has lists, not once a batch.
    assert requests_to(old, "/v1/lists") == 1
    assert counters()["registered"] == 0 and counters()["errors"] == 0


def test_positions_off_sends_paths(monkeypatch: pytest.MonkeyPatch, mount: Path,
                                   daemon: FakeDaemon) -> None:
    monkeypatch.setattr(_lists, "POSITIONS", False)
    files = make_files(mount, 20)
    orders = epochs(FileList(files), 2)
    assert daemon.published() == [files[i] for order in orders for i in order]
    assert requests_to(daemon, "/v1/lists") == 0 and requests_to(daemon, "/positions") == 0


def test_a_list_the_daemon_lost_is_registered_again(mount: Path, daemon: FakeDaemon) -> None:
    files = make_files(mount, 24)
    dataset = FileList(files)
    first = epochs(dataset, 1)
    with daemon.lock:  # expired (idle), or dropped at the user's limits
        daemon.lists.clear()
    second = epochs(dataset, 1)
    assert daemon.published() == [files[i] for order in first + second for i in order]
    c = counters()
    assert c["registered"] == 48 and c["errors"] == 0, c


def test_files_outside_the_mount_are_not_registered(tmp_path: Path, mount: Path,
                                                    daemon: FakeDaemon) -> None:
    inside = make_files(mount, 8)
    outside = make_files(tmp_path / "elsewhere", 8)
    files = [p for pair in zip(inside, outside) for p in pair]
    dataset = FileList(files)
    for _ in range(2):  # in order: the first file, which finds the daemon, is in the mount
        assert indices(DataLoader(dataset, batch_size=4)) == list(range(16))
    flush()
    assert daemon.published() == 2 * inside
    c = counters()
    assert c["registered"] == 8 and c["skipped"] == 8, c


def test_a_daemon_whose_lists_are_full_gets_paths(mount: Path, daemon_factory) -> None:
    full = daemon_factory("listsfull")
    files = make_files(mount, 20)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        orders = epochs(FileList(files), 2)
    assert full.published() == [files[i] for order in orders for i in order]
    assert requests_to(full, "/v1/lists") == 1  # refused once: paths from then on
    assert len(cube_warnings(record)) == 1


def test_registrations_stay_within_the_daemons_paths_a_request(
        monkeypatch: pytest.MonkeyPatch, mount: Path, daemon: FakeDaemon) -> None:
    monkeypatch.setattr(_lists, "MAX_POSITIONS_PER_POST", 5)
    monkeypatch.setenv("CUBE_TORCH_LOOKAHEAD_BATCHES", "8")
    images = make_files(mount, 24, ".jpg")
    captions = make_files(mount, 24, ".txt")
    orders = epochs(FileList(images, captions), 1, batch_size=8)
    assert daemon.published() == [p for order in orders for i in order
                                  for p in (images[i], captions[i])]
    with daemon.lock:
        sizes = [body.count(b"\0") for _, path, body in daemon.requests
                 if path.startswith("/v1/lists")]
        posted = [(len(body) - 8) // 4 for _, path, body in daemon.requests
                  if path.endswith("/positions")]
    assert sum(sizes) == 48 and max(sizes) <= 5 and all(n % 2 == 0 for n in sizes), sizes
    assert max(posted) <= 5, posted


def test_indices_past_the_registry_bound_go_as_paths(monkeypatch: pytest.MonkeyPatch,
                                                     mount: Path, daemon: FakeDaemon) -> None:
    """A dataset of more indices than the registry keeps (4 bytes each, up to the largest met)
    is published as paths for the batches that name them: every file still arrives, in order."""
    monkeypatch.setattr(_lists, "MAX_REGISTERED_INDEX", 10)
    files = make_files(mount, 20)
    dataset = FileList(files)
    assert indices(DataLoader(dataset, batch_size=5)) == list(range(20))
    flush()
    assert daemon.published() == files
    assert counters()["registered"] <= 10  # none past the bound (batches may coalesce)
    assert requests_to(daemon, "/paths") >= 1


class Samples(torch.utils.data.Dataset):
    """An ImageFolder look-alike: `samples[i]` is (path, class); item i is i."""

    def __init__(self, samples: list) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> int:
        with open(self.samples[i][0], "rb") as f:
            f.read()
        return i


@pytest.mark.parametrize("shape", ["tuples", "one_list_row"])
def test_one_file_an_index_registers_in_bounded_requests(
        monkeypatch: pytest.MonkeyPatch, mount: Path, daemon: FakeDaemon, shape: str) -> None:
    """Rows of one path each are mapped and encoded in bulk; a row of another shape maps them
    one by one. Either way each request keeps the daemon's bounds, paths and bytes."""
    monkeypatch.setattr(_lists, "MAX_POSITIONS_PER_POST", 5)
    files = make_files(mount, 30)
    monkeypatch.setattr(_lists, "MAX_POST_BYTES", 3 * (len(files[0]) + 1))
    monkeypatch.setenv("CUBE_TORCH_LOOKAHEAD_BATCHES", "8")
    samples: list = [(f, 0) for f in files]
    if shape == "one_list_row":
        samples[7] = [files[7], 0]
    orders = epochs(Samples(samples), 2, batch_size=6)
    assert daemon.published() == [files[i] for order in orders for i in order]
    with daemon.lock:
        bodies = [body for _, path, body in daemon.requests if path.startswith("/v1/lists")]
    sizes = [b.count(b"\0") for b in bodies]
    assert sum(sizes) == 30 and max(sizes) <= 3, sizes
    assert max(len(b) for b in bodies) <= 3 * (len(files[0]) + 1)
    assert counters()["registered"] == 30
