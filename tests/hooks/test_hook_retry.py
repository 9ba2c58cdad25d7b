"""A sample whose read failed because the daemon of its cubetorchfs mount went away is read
again once the mount answers: in the loop itself and in DataLoader workers, with the error
found in the exception's chain; any other error, or one of a file elsewhere, reaches the loop
unchanged."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Iterator

import pytest
from torch.utils.data import DataLoader, Dataset

from cube_torch import _open, _publisher, _retry


@pytest.fixture
def mnt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory listed as a fuse.cubetorchfs mount in a mount table of this test's, whose
    root answers."""
    m = tmp_path / "mnt"
    m.mkdir()
    table = tmp_path / "mountinfo"
    table.write_text("22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
                     f"97 22 0:51 / {m} rw,nosuid,nodev shared:60 - fuse.cubetorchfs "
                     "cubetorchfs:v rw,user_id=0,group_id=0\n")
    monkeypatch.setattr(_open, "_mountinfo", str(table))
    monkeypatch.setattr(_publisher, "probe_mount", lambda mount_point, *a: ("answers", None))
    monkeypatch.setattr(_retry, "POLL_S", 0.01)
    monkeypatch.setattr(_retry, "BACKOFF_S", 0.01)
    assert _retry.install()
    yield m


class Flaky(Dataset):
    """Sample i reads file i; the first read of each sample in `fail` fails with `err`."""

    def __init__(self, root: Path, n: int, fail: set, err: int, wrap: bool = False,
                 marks: Path | None = None) -> None:
        self.root, self.n, self.fail, self.err, self.wrap = root, n, fail, err, wrap
        self.marks = marks  # failures already made (a file: workers are processes)
        for i in range(n):
            (root / f"{i}.bin").write_bytes(bytes([i]) * 10)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> bytes:
        path = self.root / f"{i}.bin"
        mark = self.marks / str(i) if self.marks is not None else None
        if i in self.fail and mark is not None and not mark.exists():
            mark.write_text("")
            e = OSError(self.err, os.strerror(self.err), str(path))
            if self.wrap:
                raise RuntimeError(f"could not decode {path}") from e
            raise e
        return path.read_bytes()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("err", [errno.ESTALE, errno.ENOTCONN, errno.ECONNABORTED,
                                 errno.ECANCELED])
def test_a_sample_of_a_dead_daemon_is_read_again(mnt: Path, tmp_path: Path, workers: int,
                                                 err: int) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    ds = Flaky(mnt, 12, {3, 7}, err, wrap=err == errno.ECONNABORTED, marks=marks)
    got = [b for batch in DataLoader(ds, batch_size=4, num_workers=workers,
                                     collate_fn=lambda b: b) for b in batch]
    assert got == [bytes([i]) * 10 for i in range(12)]
    assert sorted(os.listdir(marks)) == ["3", "7"]  # each failed once, then read


def test_other_errors_and_other_files_reach_the_loop(mnt: Path, tmp_path: Path) -> None:
    for err, root in ((errno.EIO, mnt), (errno.ESTALE, tmp_path / "elsewhere")):
        root.mkdir(exist_ok=True)
        marks = tmp_path / f"marks-{err}-{root.name}"
        marks.mkdir()
        ds = Flaky(root, 4, {1}, err, marks=marks)
        with pytest.raises(OSError) as raised:
            list(DataLoader(ds, batch_size=2, collate_fn=lambda b: b))
        assert raised.value.errno == err


def test_a_mount_that_does_not_come_back_lets_the_error_through(
        mnt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_publisher, "probe_mount", lambda mount_point, *a: ("failed", None))
    monkeypatch.setattr(_retry, "WAIT_S", 0.05)
    marks = tmp_path / "marks"
    marks.mkdir()
    ds: Any = Flaky(mnt, 4, {2}, errno.ENOTCONN, marks=marks)
    with pytest.raises(OSError) as raised:
        list(DataLoader(ds, batch_size=2, collate_fn=lambda b: b))
    assert raised.value.errno == errno.ENOTCONN


class FailsOnRead(Flaky):
    """As Flaky, but the error names no file (a read of a file opened before the crash)."""

    def __getitem__(self, i: int) -> bytes:
        try:
            return super().__getitem__(i)
        except OSError as e:
            raise OSError(e.errno, e.strerror) from None


def test_an_error_naming_no_file_waits_for_the_mount_of_the_samples(
        mnt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several cubetorchfs mounts: the one waited for is the one holding the samples' files
    (the dataset names them), not the others."""
    other = tmp_path / "other"
    other.mkdir()
    table = Path(_open._mountinfo)
    table.write_text(table.read_text() + f"98 22 0:52 / {other} rw - fuse.cubetorchfs x rw\n")
    probed: list = []
    monkeypatch.setattr(_publisher, "probe_mount",
                        lambda m, *a: (probed.append(m), ("answers", None))[1])
    marks = tmp_path / "marks"
    marks.mkdir()

    class Named(FailsOnRead):
        def train_data_list(self) -> list:
            return [str(self.root / f"{i}.bin") for i in range(self.n)]

    ds = Named(mnt, 6, {4}, errno.ESTALE, marks=marks)
    got = [b for batch in DataLoader(ds, batch_size=3, collate_fn=lambda b: b) for b in batch]
    assert got == [bytes([i]) * 10 for i in range(6)]
    assert probed == [str(mnt)]
