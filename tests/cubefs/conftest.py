"""Fixtures of the live-cluster tests: one CubeFS cluster for the session (started with
cluster.sh, always stopped), the daemon factory of the integration tests, and the volume
through CubeFS's own FUSE client. Without a CubeFS to test against every test skips with one
line; under CI a broken environment (no FUSE, no daemon binary) fails as in tests/integration.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

HERE = Path(__file__).resolve().parent
for extra in (HERE.parent / "integration", HERE.parent):
    if str(extra) not in sys.path:
        sys.path.append(str(extra))

from cluster import Cluster, cubefs_problem  # noqa: E402
from cubefs_harness import ci_skip_problems  # noqa: E402


def _load_ci_skips() -> Any:
    import ci_skips
    return ci_skips


_load_ci_skips().install(globals(), ci_skip_problems)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    problem = cubefs_problem()
    if problem:
        pytest.skip(problem)
    c = Cluster(flash=True)  # the distributed cache too (test_multinode)
    try:
        c.start()
    except Exception as e:  # noqa: BLE001: the cluster's own words say more than a trace
        pytest.fail(f"the CubeFS cluster did not start: {e}")
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def cfs_mount(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The volume through cfs-client, CubeFS's own FUSE client (unmounted by cluster.stop)."""
    return cluster.mount_cfs_client(tmp_path_factory.mktemp("cfs") / "mnt")


from daemon_fixtures import _watchdog, cube, module_cube  # noqa: E402,F401
