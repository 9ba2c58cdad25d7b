"""The benchmarks that measure cubetorchfs against the PyPI peers (safetensors, fastsafetensors,
s3torchconnector, webdataset) run end to end at a tiny size, so that they keep working from a
fresh clone: every row runs, every sample is checked, every mount is gone afterwards. They
measure nothing here; bench/README.md has the figures."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cubefs_harness import project_venv_problem, project_venv_python

REPO = Path(__file__).resolve().parents[2]
BENCH_S = 420

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the benches drop the page cache and mount (root)"),
]


def run_bench(args: list[str], tmp_path: Path) -> str:
    env = dict(os.environ, CUBETORCHFS_BIN=os.environ.get(
        "CUBETORCHFS_BIN", str(REPO / "build/bin/cubetorchfs")))
    try:
        out = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                             timeout=BENCH_S, cwd=REPO)
    finally:
        with open("/proc/self/mountinfo") as fh:  # nothing of this test may stay mounted
            left = [line.split()[4] for line in fh if str(tmp_path) in line or "bench-mnt" in line]
        for mnt in left:
            subprocess.run(["fusermount3", "-u", "-z", mnt], check=False, timeout=30)
        assert not left, f"the bench left mounts behind: {left}"
    assert out.returncode == 0, f"{args[0]} exited with {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def need_venv(*modules: str) -> None:
    problem = project_venv_problem(*modules)
    if problem:
        pytest.skip(problem)


def test_load_bench_against_safetensors_and_fastsafetensors(tmp_path: Path) -> None:
    need_venv("safetensors", "fastsafetensors")
    out = run_bench(["bench/load_bench.py", "--sizes", "0.02", "--layouts", "many", "--rounds", "1",
                     "--mount", "--workdir", str(tmp_path / "w")], tmp_path)
    for row in ("load_file", "load_file-read", "safetensors", "fastsafetensors", "torch.load", "dd",
                "limit", "load_file-enc", "mount", "mount-fuse", "mount-enc"):
        assert re.search(rf"^0.02GiB-many\s+{re.escape(row)}\s+\d", out, re.M), f"no {row} row:\n{out}"
    assert re.search(r"load_file/safetensors = \d", out) and re.search(r"load_file/fastsafetensors = \d", out)


def test_s3_bench_against_s3torchconnector(tmp_path: Path) -> None:
    need_venv("s3torchconnector", "moto", "torchvision")
    out = run_bench(["bench/s3_bench.py", "--files", "150", "--classes", "3", "--rounds", "1",
                     "--epochs", "2", "--latency-ms", "1", "--workdir", str(tmp_path / "w"),
                     "--wait-for-log", str(tmp_path / "none"), "--systems", "cubetorchfs",
                     "s3torchconnector", "s3torchconnector-iter"], tmp_path)
    for system in ("cubetorchfs", "s3torchconnector", "s3torchconnector-iter"):
        assert re.search(rf"^raw\s+{re.escape(system)}\s+\d+ .*epoch 2: \d", out, re.M), f"no {system} row:\n{out}"
    assert re.search(r"cubetorchfs / s3torchconnector: epoch 1 \d.*epoch 2 \d", out)


def test_shard_bench_against_webdataset(tmp_path: Path) -> None:
    need_venv("webdataset", "torchvision")
    out = run_bench(["bench/shard_bench.py", "--files", "150", "--classes", "3", "--shard-mib", "2",
                     "--rounds", "1", "--epochs", "2", "--variants", "raw", "--latency-ms", "1",
                     "--workdir", str(tmp_path / "w"), "--data", str(tmp_path / "data")], tmp_path)
    assert re.search(r"^repack: [\d.]+ s for 150 files into \d+ shards", out, re.M), out
    for system in ("webdataset", "hook"):
        assert re.search(rf"^raw\s+{system}\s+epoch 1\s+\d+ .*epoch 2\s+\d+", out, re.M), f"no {system} row:\n{out}"
    assert "hook / webdataset = epoch 1" in out
