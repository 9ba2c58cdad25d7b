"""cube_torch's open(): a file of a cubetorchfs mount opened for reading gets the buffer size
open() would have chosen passed in (no terminal check, no ioctl); every other call is the
original open() unchanged. The mount table is a file written here in /proc/self/mountinfo's
format; tests/integration/test_hook_e2e.py counts the ioctls a real mount receives."""

from __future__ import annotations

import builtins
import io
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

from cube_torch import _open

pytestmark = pytest.mark.skipif(sys.version_info >= (3, 14),
                                reason="Python 3.14 checks no regular file for a terminal")


@pytest.fixture
def patched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A "mount" directory listed as fuse.cubetorchfs in a mount table of this test's."""
    mnt = tmp_path / "mnt with space"
    mnt.mkdir()
    (mnt / "a.bin").write_bytes(b"x" * 10_000)
    table = tmp_path / "mountinfo"
    escaped = str(mnt).replace(" ", "\\040")
    table.write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        f"97 22 0:51 / {escaped} rw,nosuid,nodev shared:60 - fuse.cubetorchfs cubetorchfs:v "
        "rw,user_id=0,group_id=0\n")
    monkeypatch.setattr(_open, "_mountinfo", str(table))
    monkeypatch.setattr(_open, "_state", (0.0, (), False))
    was = _open.installed()
    _open.uninstall()
    monkeypatch.delenv("CUBE_TORCH_PATCH_OPEN", raising=False)
    assert _open.install()
    yield mnt
    _open.uninstall()
    if was:
        _open.install()


def given(fn) -> int:  # type: ignore[no-untyped-def]
    before = _open.skipped_checks
    fn()
    return _open.skipped_checks - before


def test_a_mount_file_opened_to_read_gets_open_s_own_buffer_size(patched: Path) -> None:
    path = patched / "a.bin"
    assert open is io.open  # one function, as before
    for arg in (str(path), path, os.fsencode(path)):
        n = 0
        for mode in ("rb", "r"):
            before = _open.skipped_checks
            with open(arg, mode) as f:
                assert f.read(3) in (b"xxx", "xxx")
                # The same object the original would give: type and buffer size.
                with _open._original(arg, mode) as g:  # type: ignore[misc]
                    assert type(f) is type(g)
                    assert sys.getsizeof(f) == sys.getsizeof(g)
                    assert f.mode == g.mode and f.name == g.name
            n += _open.skipped_checks - before
        assert n == 2, arg
    assert os.stat(path).st_blksize > 1
    with io.open(path, "rb") as f:
        assert f.read() == b"x" * 10_000


def test_everything_else_reaches_open_unchanged(patched: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "b.bin"
    elsewhere.write_bytes(b"y")
    assert given(lambda: open(elsewhere, "rb").close()) == 0
    # Writing, appending, updating, explicit buffering, a descriptor: untouched.
    assert given(lambda: open(patched / "new.bin", "wb").close()) == 0
    assert given(lambda: open(patched / "a.bin", "ab").close()) == 0
    assert given(lambda: open(patched / "a.bin", "r+b").close()) == 0
    assert given(lambda: open(patched / "a.bin", "rb", buffering=0).close()) == 0
    fd = os.open(patched / "a.bin", os.O_RDONLY)
    assert given(lambda: open(fd, "rb").close()) == 0
    # A sibling whose name starts like the mount is not in it.
    sibling = Path(str(patched) + "2")
    sibling.mkdir()
    (sibling / "c").write_bytes(b"z")
    assert given(lambda: open(sibling / "c", "rb").close()) == 0
    # Errors are the original's.
    with pytest.raises(FileNotFoundError):
        open(patched / "missing", "rb")
    with pytest.raises(ValueError):
        open(patched / "a.bin", "rq")


def test_a_relative_path_counts_while_the_working_directory_is_on_the_mount(
        patched: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(patched)
    monkeypatch.setattr(_open, "_state", (0.0, (), False))  # read the table again
    assert given(lambda: open("a.bin", "rb").close()) == 1


def test_no_patch_when_asked_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    was = _open.installed()
    _open.uninstall()
    try:
        monkeypatch.setenv("CUBE_TORCH_PATCH_OPEN", "0")
        assert not _open.install()
        assert builtins.open is io.open and not _open.installed()
    finally:
        monkeypatch.delenv("CUBE_TORCH_PATCH_OPEN")
        if was:
            _open.install()


def test_the_import_patches_open() -> None:
    import cube_torch  # noqa: F401

    assert _open.installed()
    assert builtins.open.__name__ == "open" and builtins.open.__wrapped__ is _open._original
