"""Fixtures for the integration tests; the harness itself is in cubefs_harness.py.

Every daemon a test starts through `cube` or `module_cube` is stopped after it, pass or fail,
and a per-test watchdog kills the daemons of a test that hangs. Under CI, a test skipped for
want of FUSE or the daemon binary fails instead (tests/ci_skips.py).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from cubefs_harness import (TEST_WATCHDOG_S, CubeFactory, abort_live, environment_problems,
                            proc_mounts, run_command)


def _load_ci_skips() -> Any:
    # tests/ goes last on the path, so it can shadow nothing: only ci_skips is taken from it.
    tests_dir = str(Path(__file__).resolve().parents[1])
    if tests_dir not in sys.path:
        sys.path.append(tests_dir)
    import ci_skips
    return ci_skips


# pytest_runtest_makereport, pytest_make_collect_report: environment skips fail under CI.
_load_ci_skips().install(globals(), environment_problems)


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


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """After the session, reports (and removes) any cubetorchfs mount left under this
    session's temporary directory. Mounts elsewhere are not ours and are left alone."""
    base = str(tmp_path_factory.getbasetemp().resolve()) + "/"
    yield
    leftovers = [e for e in proc_mounts()
                 if e.fstype == "fuse.cubetorchfs" and e.target.startswith(base)]
    for entry in leftovers:
        try:
            run_command(["fusermount3", "-u", "-z", entry.target])
        except subprocess.TimeoutExpired:
            pass
    assert not leftovers, f"mounts left behind: {[e.target for e in leftovers]}"
