"""Fixtures for the integration tests; the harness itself is in cubefs_harness.py.

Every daemon a test starts through `cube` or `module_cube` is stopped after it, pass or fail,
and a per-test watchdog kills the daemons of a test that hangs. Under CI, a test skipped for
want of FUSE or the daemon binary fails instead (tests/ci_skips.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from cubefs_harness import ci_skip_problems, proc_mounts, run_command


def _load_ci_skips() -> Any:
    # tests/ goes last on the path, so it can shadow nothing: only ci_skips is taken from it.
    tests_dir = str(Path(__file__).resolve().parents[1])
    if tests_dir not in sys.path:
        sys.path.append(tests_dir)
    import ci_skips
    return ci_skips


# pytest_runtest_makereport, pytest_make_collect_report: environment skips fail under CI.
_load_ci_skips().install(globals(), ci_skip_problems)


# The daemon factories and the per-test watchdog, shared with tests/cubefs.
from daemon_fixtures import _watchdog, cube, module_cube  # noqa: E402,F401


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
