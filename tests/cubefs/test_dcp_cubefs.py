"""torch.distributed.checkpoint through cubetorchfs over a real CubeFS volume, natively
(backend.type cubefs, CubeFS's C SDK): the scenario of tests/integration/test_dcp.py at 128 MiB.
4 processes (gloo, CPU) save a sharded state dict at thread_count 1 and 4, then a third save
whose rank 2 is killed -9 with half of its tensors written; a fresh process group loads the
first two byte for byte, through the mount and through cfs-client (the volume's other
interface), and DCP refuses the third. The daemon lives on. Skips without a CubeFS to test
against (see conftest.py) or without the project venv."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cluster import Cluster
from cubefs_harness import CubeFactory, environment_problem, project_venv_problem

_PROBLEM = environment_problem() or project_venv_problem("torch.distributed.checkpoint")
pytestmark = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")


def test_dcp_round_trip_and_kill_9_native(cube: CubeFactory, cluster: Cluster, cfs_mount: Path,
                                          tmp_path: Path) -> None:
    from test_dcp import listing, round_trip_and_kill

    mount = cube.mount(tmp_path, {**cluster.native_config(), "profile": "ai_prefetch"})
    base = f"dcp-{os.getpid()}"
    round_trip_and_kill(mount, tmp_path / "work", base, 128,
                        lambda rel: listing(cfs_mount / rel), store_root=cfs_mount)
