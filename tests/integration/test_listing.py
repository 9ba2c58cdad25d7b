"""Directories listed a page at a time (fuse.list_page_entries), through a real mount, on each
backend: every name once, a readdir resumed at the kernel's offset (a small getdents buffer
makes the kernel drop the rest of each reply) returns every entry exactly once while nothing
changes, a rewind lists again from the start, and only a window of the listing is held.
S3 is in test_s3.py (its server), CubeFS in tests/cubefs/test_cubefs.py (its cluster)."""
from __future__ import annotations

import os
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


def test_a_root_of_many_pages_still_plans_the_listing_of_its_subdirectories(
        cube: CubeFactory, tmp_path: Path) -> None:
    """ImageFolder's scan of a root of more class directories than a page: the plan of
    list-ahead is made when the root's last page is read, so the classes are listed ahead."""
    mount = cube.mount(tmp_path, {
        "profile": "ai_prefetch",
        "backend": {"type": "synthetic", "root": None,
                    "synthetic": {"dirs": 300, "files_per_dir": 20,
                                  "min_bytes": 1, "max_bytes": 8}},
        "fuse": {"list_page_entries": PAGE},
    })
    classes = sorted(os.listdir(mount.path()))
    assert len(classes) == 300
    for c in classes:
        assert len(os.listdir(mount.path(c))) == 20
    taken = mount.metrics().value("cubetorchfs_list_ahead_total", outcome="taken")
    assert taken >= 150, f"{taken} of 300 class directories listed ahead"
