"""`pip install hooks/` on a machine with no package index: into a venv that sees Debian's
torch (--system-site-packages), with pip's build isolation, leaving nothing in the source
tree; the installed package then hooks a real DataLoader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3"

TRAIN = r"""
import os, sys, torch
import cube_torch
assert "site-packages" in cube_torch.__file__, cube_torch.__file__
class Files(torch.utils.data.Dataset):
    def __init__(self, root):
        self.paths = sorted(os.path.join(root, n) for n in os.listdir(root))
    def train_data_list(self):
        return self.paths
    def __len__(self):
        return len(self.paths)
    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            return len(f.read())
loader = torch.utils.data.DataLoader(Files(sys.argv[1]), batch_size=4, shuffle=True, num_workers=2)
total = sum(int(b.sum()) for b in loader)
assert type(loader).__module__.startswith("torch"), type(loader)
# The installed package patched DataLoader iteration (with no mount here, nothing is published).
assert "_cube_torch_originals" in torch.utils.data.dataloader._BaseDataLoaderIter.__dict__
assert cube_torch.__file__.startswith(sys.prefix), cube_torch.__file__  # the venv's copy
print(total)
"""


def _tree_state() -> str:
    return subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--ignored", "hooks"],
                          capture_output=True, text=True, timeout=30).stdout


def test_offline_pip_install_into_a_venv_then_trains(tmp_path: Path) -> None:
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import venv, ensurepip"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("python3-venv is not installed (scripts/install_deps.sh installs it)")
    before = _tree_state()
    venv = tmp_path / "venv"
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, timeout=120)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "--no-index",
                          str(REPO / "hooks")], capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                              "PIP_NO_INDEX": "1"})
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert _tree_state() == before, "the build left files in the source tree"
    data = tmp_path / "data"
    data.mkdir()
    for i in range(12):
        (data / f"f{i:02d}").write_bytes(b"x" * (i + 1))
    run = subprocess.run([str(venv / "bin" / "python"), "-c", TRAIN, str(data)],
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                              "CUBE_TORCH_CONFIG_DIR": str(tmp_path)})
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split()[0] == str(sum(range(1, 13)))
