"""`import cube_torch` against a real daemon and a real mount: training scripts run in their own
process (as users run them), over a generated ImageFolder of real JPEGs on a mount whose
backend adds latency to every request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from cubefs_harness import CubeFactory, CubeMount, environment_problem

pytestmark = pytest.mark.skipif(environment_problem() is not None,
                                reason=environment_problem() or "")

REPO = Path(__file__).resolve().parents[2]
SCRIPT_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def jpeg_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("jpegs") / "train"
    rng = np.random.default_rng(3)
    for i in range(480):
        d = root / f"class_{i % 6}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)).save(
            d / f"img_{i:04d}.jpg", quality=85)
        (d / f"img_{i:04d}.txt").write_text(f"caption {i}\n")
    return root


def mount_with_latency(cube: CubeFactory, root: Path, latency_us: int = 2000) -> CubeMount:
    return cube.mount(root.parent, {"profile": "ai_prefetch",
                                    "backend": {"inject": {"latency_us": latency_us}}})


def run_script(body: str, env: dict[str, str], *args: str) -> dict[str, Any]:
    """Runs a training script in a fresh interpreter; it prints one JSON line last."""
    script = textwrap.dedent(body)
    env = dict(env, PYTHONPATH=str(REPO / "hooks"))
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                          text=True, timeout=SCRIPT_TIMEOUT_S)
    assert proc.returncode == 0, f"script failed:\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


EPOCH = """
import json, os, sys, time
hook = sys.argv[2] == "hook"
if hook:
    import cube_torch
import torch, torchvision
from torchvision import transforms
root, workers = sys.argv[1], int(sys.argv[3])
torch.manual_seed(1234)
ds = torchvision.datasets.ImageFolder(root, transform=transforms.ToTensor())
loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, num_workers=workers)
order, snapshot = [], None
lookahead = int(os.environ.get("CUBE_TORCH_LOOKAHEAD_BATCHES", "16"))
for i, (x, y) in enumerate(loader):
    order += y.tolist()
    if hook and i == lookahead + 4:
        snapshot = cube_torch.stats()
final = cube_torch.stats() if hook else None
print(json.dumps({"labels": order, "snapshot": snapshot, "final": final}))
"""


def hit_ratio_after(snapshot: dict[str, Any], final: dict[str, Any]) -> tuple[float, int]:
    a, b = snapshot["global"]["reads"], final["global"]["reads"]
    delta = {k: b[k] - a[k] for k in ("hit", "late", "miss")}
    total = sum(delta.values())
    return (delta["hit"] / total if total else 1.0), total


@pytest.mark.parametrize("workers", [0, 2])
def test_hook_prefetches_and_keeps_the_sample_order(cube: CubeFactory, jpeg_tree: Path,
                                                    workers: int) -> None:
    plain = mount_with_latency(cube, jpeg_tree)
    root = str(plain.path("train"))
    without = run_script(EPOCH, plain.env(), root, "plain", str(workers))
    hooked = mount_with_latency(cube, jpeg_tree)  # a fresh, empty cache
    env = dict(hooked.env(), VOL_NAME=hooked.vol_name, CUBE_TORCH_LOOKAHEAD_BATCHES="4")
    with_hook = run_script(EPOCH, env, str(hooked.path("train")), "hook", str(workers))
    # Same seed, same order: the hook changes nothing the training loop sees.
    assert with_hook["labels"] == without["labels"]
    assert len(with_hook["labels"]) == 480
    ratio, reads = hit_ratio_after(with_hook["snapshot"], with_hook["final"])
    assert reads >= 240, with_hook["final"]  # at least half the epoch came after the snapshot
    assert ratio >= 0.99, (ratio, with_hook["snapshot"], with_hook["final"])
    streams = with_hook["snapshot"]["streams"]
    assert len(streams) == 1 and streams[0]["published"] >= 16 * 4, streams
    # Each file's path went to the daemon once, in the dataset's file list; the epoch's order
    # went as positions in it.
    client = with_hook["final"]["client"]
    assert client["registered"] == 480 and client["published"] == 480, client
    assert with_hook["final"]["global"]["lists"]["entries"] == 480, with_hook["final"]["global"]
    m = hooked.metrics()
    assert m.value("cubetorchfs_prefetch_files_total", outcome="fetched") >= 470


def test_open_of_a_mount_file_asks_the_daemon_no_terminal_question(cube: CubeFactory,
                                                                  jpeg_tree: Path) -> None:
    """Python before 3.14 asks every file open() opens whether it is a terminal: a FUSE ioctl,
    a round trip to the daemon per sample. With the hook, ImageFolder's loader (PIL, through
    open()) in two DataLoader workers sends none; with CUBE_TORCH_PATCH_OPEN=0, one a file."""
    mount = mount_with_latency(cube, jpeg_tree, latency_us=0)
    env = dict(mount.env(), VOL_NAME=mount.vol_name, CUBE_TORCH_LOOKAHEAD_BATCHES="4")
    root = str(mount.path("train"))

    def ioctls() -> float:
        return mount.metrics().value("cubetorchfs_fuse_ops_total", op="ioctl")

    before = ioctls()
    assert len(run_script(EPOCH, env, root, "hook", "2")["labels"]) == 480
    if sys.version_info < (3, 14):
        assert ioctls() == before
        unpatched = run_script(EPOCH, dict(env, CUBE_TORCH_PATCH_OPEN="0"), root, "hook", "2")
        assert len(unpatched["labels"]) == 480
        assert ioctls() - before >= 480


TRAIN_DATA_LIST = """
import json, sys
import cube_torch
import torch

class Captions(torch.utils.data.Dataset):
    def __init__(self, root):
        import glob
        self.images = sorted(glob.glob(root + "/*/*.jpg"))
        self.captions = [p[:-4] + ".txt" for p in self.images]
    def train_data_list(self):
        return [self.images, self.captions]
    def __len__(self):
        return len(self.images)
    def __getitem__(self, i):
        with open(self.images[i], "rb") as f, open(self.captions[i]) as g:
            return len(f.read()), g.read()

torch.manual_seed(5)
loader = torch.utils.data.DataLoader(Captions(sys.argv[1]), batch_size=8, shuffle=True,
                                     num_workers=2)
captions = [c for _, batch in loader for c in batch]
print(json.dumps({"n": len(captions), "stats": cube_torch.stats()}))
"""


def test_train_data_list_with_two_parallel_lists(cube: CubeFactory, jpeg_tree: Path) -> None:
    mount = mount_with_latency(cube, jpeg_tree)
    env = dict(mount.env(), VOL_NAME=mount.vol_name, CUBE_TORCH_LOOKAHEAD_BATCHES="4")
    out = run_script(TRAIN_DATA_LIST, env, str(mount.path("train")))
    assert out["n"] == 480
    # An image and a caption per sample were published, fetched ahead and read.
    g = out["stats"]["global"]
    assert g["prefetch"]["fetched"] >= 940, g
    assert g["reads"]["hit"] + g["reads"]["late"] >= 940, g


DISTRIBUTED = """
import json, os, sys
import cube_torch
import torch, torchvision
root, rank = sys.argv[1], int(sys.argv[2])
ds = torchvision.datasets.ImageFolder(root)
sampler = torch.utils.data.distributed.DistributedSampler(ds, num_replicas=2, rank=rank,
                                                          shuffle=True, seed=3)
loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler, num_workers=1,
                                     collate_fn=lambda b: [t for _, t in b])
n, stream = 0, None
for i, batch in enumerate(loader):
    n += len(batch)
    if i == 10:  # mid-epoch: this rank's stream, as the daemon sees it
        mine = [s for s in cube_torch.stats()["streams"] if s["pid"] == os.getpid()]
        stream = mine[0] if mine else None
print(json.dumps({"n": n, "stream": stream}))
"""


def test_distributed_sampler_two_ranks_in_two_processes(cube: CubeFactory, jpeg_tree: Path) -> None:
    mount = mount_with_latency(cube, jpeg_tree)
    env = dict(mount.env(), VOL_NAME=mount.vol_name, CUBE_TORCH_LOOKAHEAD_BATCHES="4",
               PYTHONPATH=str(REPO / "hooks"))
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(DISTRIBUTED),
                               str(mount.path("train")), str(rank)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=SCRIPT_TIMEOUT_S)
        assert p.returncode == 0, stderr
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert [o["n"] for o in outs] == [240, 240]
    for o in outs:  # each rank publishes its own share ahead, in its own stream
        assert o["stream"] is not None and 11 * 8 <= o["stream"]["published"] <= 240, o
    # Together the ranks covered the whole dataset, each file fetched once.
    m = mount.metrics()
    assert m.value("cubetorchfs_prefetch_files_total", outcome="fetched") >= 470
    assert m.value("cubetorchfs_backend_requests_total", op="read", status="ok") <= 480 + 10


SOCKET_REMOVED = """
import json, os, sys
import cube_torch
import torch, torchvision
from torchvision import transforms
root, sock = sys.argv[1], sys.argv[2]
ds = torchvision.datasets.ImageFolder(root, transform=transforms.ToTensor())
loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, num_workers=2)
n = 0
for i, (x, y) in enumerate(loader):
    n += len(y)
    if i == 3:
        os.unlink(sock)   # the control socket disappears mid-epoch
print(json.dumps({"n": n}))
"""


def test_epoch_completes_when_the_socket_disappears(cube: CubeFactory, jpeg_tree: Path) -> None:
    mount = mount_with_latency(cube, jpeg_tree, latency_us=500)
    sock = mount.read_control()["control_socket"]
    env = dict(mount.env(), VOL_NAME=mount.vol_name, CUBE_TORCH_LOOKAHEAD_BATCHES="2")
    out = run_script(SOCKET_REMOVED, env, str(mount.path("train")), sock)
    assert out["n"] == 480


def test_no_daemon_means_training_as_usual(tmp_path: Path, jpeg_tree: Path) -> None:
    env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(tmp_path), VOL_NAME="nothing-here")
    out = run_script(EPOCH, env, str(jpeg_tree), "hook", "0")
    assert len(out["labels"]) == 480


RAW_EPOCH = """
import json, sys
import cube_torch
import torch, torchvision
root = sys.argv[1]
def raw(path):
    with open(path, "rb") as f:
        return f.read()
torch.manual_seed(int(sys.argv[2]))
ds = torchvision.datasets.ImageFolder(root, loader=raw)
loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, num_workers=2,
                                     collate_fn=list)
n = sum(len(b) for b in loader)
print(json.dumps({"samples": n, "client": cube_torch.stats()["client"]}))
"""


def test_a_warm_epoch_on_a_writable_mount_costs_no_getattr_or_read_per_file(
        cube: CubeFactory, jpeg_tree: Path) -> None:
    """The mount a user gets without reading docs/config.md: read-write, `ai_prefetch`. Its
    second epoch (another training process: the kernel keeps the pages) reaches the daemon
    with no GETATTR, LOOKUP or READ per file. The FLUSH at each close() is still sent: the
    kernel skips OPEN under keep_cache, so no open reply can say "no flush" (docs/prefetch.md);
    it is counted here, at most one per file."""
    mount = cube.mount(jpeg_tree.parent, {"profile": "ai_prefetch",
                                          "fuse": {"entry_timeout_s": 3600,
                                                   "attr_timeout_s": 3600}})
    env = dict(mount.env(), VOL_NAME=mount.vol_name)
    root = str(mount.path("train"))
    first = run_script(RAW_EPOCH, env, root, "1")
    assert first["samples"] == 480 and first["client"]["registered"] == 480, first
    before = mount.metrics()
    second = run_script(RAW_EPOCH, env, root, "2")
    after = mount.metrics()
    assert second["samples"] == 480

    def ops(op: str) -> float:
        return (after.value("cubetorchfs_fuse_ops_total", op=op)
                - before.value("cubetorchfs_fuse_ops_total", op=op))

    assert ops("getattr") < 48 and ops("lookup") < 48 and ops("read") < 48, (
        ops("getattr"), ops("lookup"), ops("read"))
    assert ops("flush") <= 480, ops("flush")
    assert (after.value("cubetorchfs_backend_requests_total", op="read")
            == before.value("cubetorchfs_backend_requests_total", op="read"))
