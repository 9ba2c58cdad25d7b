"""Ranks started by torch.multiprocessing.spawn get the hook when the parent imported
cube_torch, even when that import sits under `if __name__ == "__main__":`, which the ranks
never run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

SCRIPT = r'''
import json, sys
import torch.multiprocessing as mp

def rank(i, out):
    from torch.utils.data import dataloader
    state = {"imported": "cube_torch" in sys.modules,
             "patched": "_cube_torch_originals" in dataloader._BaseDataLoaderIter.__dict__}
    with open(f"{out}/rank{i}", "w") as f:
        json.dump(state, f)

if __name__ == "__main__":
    if sys.argv[2] == "hook":
        import cube_torch
    mp.spawn(rank, args=(sys.argv[1],), nprocs=2)
'''

REPO = Path(__file__).resolve().parents[2]


def _ranks(tmp_path: Path, mode: str) -> list:
    out = tmp_path / mode
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO / "hooks"))
    env.pop("CUBE_TORCH_DISABLE", None)
    subprocess.run(["/usr/bin/python3", str(script), str(out), mode], check=True, env=env,
                   timeout=300, cwd=str(tmp_path))
    return [json.loads((out / f"rank{i}").read_text()) for i in range(2)]


def test_spawned_ranks_get_the_hook_the_parent_imported(tmp_path: Path) -> None:
    assert _ranks(tmp_path, "hook") == [{"imported": True, "patched": True}] * 2
    # Without the parent's import nothing is hooked: the ranks' own state is what is seen.
    assert _ranks(tmp_path, "plain") == [{"imported": False, "patched": False}] * 2
