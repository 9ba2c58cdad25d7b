"""Directories listed a page at a time (fuse.list_page_entries), through a real mount, on each
backend: every name once, a readdir resumed at the kernel's offset (a small getdents buffer
makes the kernel drop the rest of each reply) returns every entry exactly once while nothing
changes, a rewind lists again from the start, and only a window of the listing is held.
S3 is in test_s3.py (its server), CubeFS in tests/cubefs/test_cubefs.py (its cluster)."""
from __future__ import annotations

from pathlib import Path

from cubefs_harness import CubeFactory, check_paged_listing

PAGE = 100  # fuse.list_page_entries here


def test_a_posix_directory_is_listed_in_pages(cube: CubeFactory, tmp_path: Path) -> None:
    store = tmp_path / "store"
    (store / "flat").mkdir(parents=True)
    names = {f"img_{i:06d}.jpg" for i in range(2500)}
    for n in names:
        (store / "flat" / n).write_bytes(b"")
    mount = cube.mount(store, {"fuse": {"list_page_entries": PAGE}})
    check_paged_listing(mount, "flat", names, PAGE)


def test_a_synthetic_directory_is_listed_in_pages(cube: CubeFactory, tmp_path: Path) -> None:
    mount = cube.mount(tmp_path, {
        "backend": {"type": "synthetic", "root": None,
                    "synthetic": {"dirs": 3, "files_per_dir": 3000,
                                  "min_bytes": 1, "max_bytes": 8}},
        "fuse": {"list_page_entries": PAGE},
    })
    want = {f"n00000001_{i}.JPEG" for i in range(3000)}
    check_paged_listing(mount, "n00000001", want, PAGE)
