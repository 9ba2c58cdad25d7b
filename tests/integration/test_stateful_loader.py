"""torchdata's StatefulDataLoader with `import cube_torch`, against a real daemon and a real
mount whose store adds 10 ms to every request: training runs in child processes of the project
venv's python (torch 2.x, torchdata), as users run them.

- An epoch, shuffled, 2 workers, with the hook: the same samples in the same order as without
  it, and (after a warm-up) at least 99% of the reads are hits.
- A checkpoint, with 2 workers and with none: `state_dict()` after K batches in one process,
  `load_state_dict()` in a new one (seeded otherwise, on a fresh mount): the new process reads
  exactly the rest of the epoch, in order, and its reads are hits too: the hook publishes the
  resumed position's files, never the epoch's start (the daemon fetches none of the K
  batches' files).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any, Callable

import pytest

from cubefs_harness import (CubeFactory, CubeMount, environment_problem, project_venv_problem,
                            project_venv_python)

_PROBLEM = environment_problem() or project_venv_problem("torchdata.stateful_dataloader",
                                                         "torchvision")
pytestmark = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")

REPO = Path(__file__).resolve().parents[2]
SCRIPT_TIMEOUT_S = 120
N_FILES = 640
BATCH = 16
K = 10  # batches read before the checkpoint
LOOKAHEAD = 4  # CUBE_TORCH_LOOKAHEAD_BATCHES
WARMUP = LOOKAHEAD + 4  # batches before the hit ratio is measured (as test_hook_e2e.py does)
IN_FLIGHT = 2 * 2  # batches the 2 workers load ahead of the loop (prefetch_factor 2)
LATENCY_US = 10_000


@pytest.fixture(scope="module")
def jpeg_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("stateful") / "train"
    rng = np.random.default_rng(5)
    for i in range(N_FILES):
        d = root / f"class_{i % 8}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
            d / f"img_{i:04d}.jpg", quality=85)
    return root


def mount_with_latency(cube: CubeFactory, root: Path) -> CubeMount:
    return cube.mount(root.parent, {"profile": "ai_prefetch",
                                    "backend": {"inject": {"latency_us": LATENCY_US}}})


# One script, four modes: "plain" (no hook, the whole epoch), "full" (hook, the whole epoch),
# "part" (hook, K batches, then the checkpoint to a file), "resume" (hook, from the file).
TRAIN = """
import json, os, sys
mode, root, ckpt, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if mode != "plain":
    import cube_torch
import torch, torchvision
from torchvision import transforms
from torchdata.stateful_dataloader import StatefulDataLoader

class Indexed(torchvision.datasets.ImageFolder):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x, y, i

torch.manual_seed(99 if mode == "resume" else 1234)  # only the checkpoint can restore order
ds = Indexed(root, transform=transforms.ToTensor())
loader = StatefulDataLoader(ds, batch_size=%(batch)d, shuffle=True, num_workers=workers)
if mode == "resume":
    loader.load_state_dict(torch.load(ckpt, weights_only=False))
order, snapshot, streams, published = [], None, None, None
for i, (x, y, idx) in enumerate(loader):
    order += idx.tolist()
    if mode in ("full", "resume") and i + 1 == %(warmup)d:
        snapshot = cube_torch.stats()
        streams = [s for s in snapshot["streams"] if s["pid"] == os.getpid()]
    if mode == "part" and i + 1 == %(k)d:
        torch.save(loader.state_dict(), ckpt)
        published = cube_torch.stats()["client"]["published"]
        break
final = cube_torch.stats() if mode in ("full", "resume") else None
print(json.dumps({"order": order, "snapshot": snapshot, "final": final, "streams": streams,
                  "published": published}))
""" % {"batch": BATCH, "warmup": WARMUP, "k": K}


def run(mode: str, root: Path, ckpt: Path, env: dict[str, str], workers: int = 2) -> Any:
    env = dict(env, PYTHONPATH=str(REPO / "hooks"), CUBE_TORCH_LOOKAHEAD_BATCHES=str(LOOKAHEAD))
    proc = subprocess.run([str(project_venv_python()), "-c", textwrap.dedent(TRAIN), mode,
                           str(root), str(ckpt), str(workers)],
                          env=env, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
    assert proc.returncode == 0, f"{mode} failed:\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "CubeTorchWarning" not in proc.stderr, proc.stderr  # read ahead, nothing refused
    return json.loads(proc.stdout.strip().splitlines()[-1])


def hit_ratio_after(out: Any) -> tuple[float, int]:
    a, b = out["snapshot"]["global"]["reads"], out["final"]["global"]["reads"]
    delta = {k: b[k] - a[k] for k in ("hit", "late", "miss")}
    total = sum(delta.values())
    return (delta["hit"] / total if total else 0.0), total


def hooked_env(mount: CubeMount) -> dict[str, str]:
    return dict(mount.env(), VOL_NAME=mount.vol_name)


@pytest.fixture(scope="module")
def reference(jpeg_tree: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Callable[[int], list[int]]:
    """The epoch's samples, in order, read from the store itself without the hook, for a
    number of workers (torchdata's multi-process iterator draws one more permutation before
    its first epoch than the single-process one: the orders differ)."""
    orders: dict[int, list[int]] = {}

    def order(workers: int) -> list[int]:
        if workers not in orders:
            ckpt = tmp_path_factory.mktemp("plain") / "unused.pt"
            orders[workers] = run("plain", jpeg_tree, ckpt, dict(os.environ), workers)["order"]
            assert sorted(orders[workers]) == list(range(N_FILES))
        return orders[workers]
    return order


def test_epoch_prefetches_in_order(cube: CubeFactory, jpeg_tree: Path,
                                   reference: Callable[[int], list[int]], tmp_path: Path) -> None:
    mount = mount_with_latency(cube, jpeg_tree)  # a fresh, empty cache
    full = run("full", mount.path("train"), tmp_path / "unused.pt", hooked_env(mount))
    assert full["order"] == reference(2)  # same seed, same order: the hook changes nothing
    ratio, reads = hit_ratio_after(full)
    print(f"uninterrupted epoch: hit ratio {ratio:.4f} over {reads} reads; whole run: "
          f"{full['final']['global']['reads']}")
    assert reads >= N_FILES - (WARMUP + IN_FLIGHT) * BATCH, full["final"]
    assert ratio >= 0.99, (ratio, full["snapshot"]["global"], full["final"]["global"])
    (stream,) = full["streams"]
    assert stream["published"] >= (WARMUP + LOOKAHEAD) * BATCH, stream
    assert full["final"]["client"]["published"] == N_FILES, full["final"]["client"]


@pytest.mark.parametrize("workers", [2, 0])
def test_checkpoint_resumes_in_a_new_process(cube: CubeFactory, jpeg_tree: Path,
                                             reference: Callable[[int], list[int]],
                                             tmp_path: Path,
                                             workers: int) -> None:
    ckpt = tmp_path / "loader_state.pt"
    # K batches, then the checkpoint, taken while the hook had pulled batches further.
    first = mount_with_latency(cube, jpeg_tree)
    part = run("part", first.path("train"), ckpt, hooked_env(first), workers)
    assert part["order"] == reference(workers)[:K * BATCH]
    assert part["published"] >= (K + LOOKAHEAD) * BATCH, part
    assert ckpt.is_file()

    # A new process, seeded otherwise, on a fresh mount (an empty cache) resumes from it.
    second = mount_with_latency(cube, jpeg_tree)
    resumed = run("resume", second.path("train"), ckpt, hooked_env(second), workers)
    rest = N_FILES - K * BATCH
    assert resumed["order"] == reference(workers)[K * BATCH:]
    ratio, reads = hit_ratio_after(resumed)
    whole = resumed["final"]["global"]["reads"]  # the new mount's reads: this run's only
    print(f"resumed epoch ({workers} workers): hit ratio {ratio:.4f} over {reads} reads; "
          f"whole run: {whole}")
    assert reads >= rest - (WARMUP + IN_FLIGHT) * BATCH, resumed["final"]
    assert ratio >= 0.99, (ratio, resumed["snapshot"]["global"], resumed["final"]["global"])
    # Its stream starts at the resumed position: the hook published each remaining file once,
    # from the first batch after the checkpoint on (the workers' first batches included), the
    # readers read it in turn (from the daemon, or from the page cache it was put in: no
    # position passed over unread), and the daemon fetched the rest of the epoch, none of the
    # K batches' files.
    assert resumed["final"]["client"]["published"] == rest, resumed["final"]["client"]
    assert whole["late"] + whole["miss"] <= 2 * BATCH, whole  # not even the first batches miss
    (stream,) = resumed["streams"]
    assert stream["skipped"] == 0, stream
    # Reads from the page cache are known from the hook's word, which allows for the batches
    # the workers may still hold: by the snapshot the daemon knows of all but those.
    assert stream["read"] + stream["page_cache"] >= (WARMUP - IN_FLIGHT) * BATCH, stream
    m = second.metrics()
    fetched = m.value("cubetorchfs_prefetch_files_total", outcome="fetched")
    assert rest - 8 <= fetched <= rest, m.text
    assert m.value("cubetorchfs_backend_requests_total", op="read", status="ok") <= rest + 8
