"""Fixtures shared by the suites that start daemons (tests/integration, tests/cubefs): the
daemon factories, each stopping every instance it made, and a per-test watchdog. A conftest
imports them into its own namespace."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator

import pytest

from cubefs_harness import TEST_WATCHDOG_S, CubeFactory, abort_live


@pytest.fixture
def cube(tmp_path: Path) -> Iterator[CubeFactory]:
    """Per-test factory; every instance it made is stopped after the test, pass or fail."""
    factory = CubeFactory(tmp_path / "cube")
    try:
        yield factory
    finally:
        factory.cleanup_all()


@pytest.fixture(scope="module")
def module_cube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CubeFactory]:
    """Like `cube`, but its instances live for the whole test module."""
    factory = CubeFactory(tmp_path_factory.mktemp("module_cube"))
    try:
        yield factory
    finally:
        factory.cleanup_all()


@pytest.fixture(autouse=True)
def _watchdog() -> Iterator[None]:
    """Kills every live daemon if a test runs past TEST_WATCHDOG_S (hung FUSE requests then
    fail with ENOTCONN instead of blocking the suite forever)."""

    timer = threading.Timer(TEST_WATCHDOG_S, abort_live)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
