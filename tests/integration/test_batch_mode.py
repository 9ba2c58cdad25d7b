"""The hook's batch mode against a real daemon and a real mount: DataLoader workers take each
batch's files in one request (POST /v1/files/batch, one sealed memory file) and the dataset's
opens of them are served from it, with the samples byte-identical and in the order of a run
without the hook."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from cubefs_harness import CubeFactory, environment_problem
from test_hook_e2e import jpeg_tree, mount_with_latency, run_script  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(environment_problem() is not None,
                                reason=environment_problem() or "")

EPOCH = """
import hashlib, json, os, sys
mode, root, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode != "plain":
    import cube_torch
import torch, torchvision
from torchvision import transforms

def served_so_far():
    batch = sys.modules.get("cube_torch._batch")
    return batch.counters["served"] if batch else 0

class Recording(torchvision.datasets.ImageFolder):
    # ImageFolder's own loader (PIL, through open()) decodes each image; the caption is read
    # as text; with TWICE, the image is opened once more, which goes to the file system.
    def __getitem__(self, i):
        path, target = self.samples[i]
        before = served_so_far()
        image = transforms.functional.pil_to_tensor(self.loader(path))
        with open(path[:-4] + ".txt") as g:
            caption = g.read()
        served = served_so_far() - before
        if os.environ.get("TWICE"):
            with open(path, "rb") as f:
                assert len(f.read()) > 0
        digest = hashlib.sha1(image.numpy().tobytes() + caption.encode()).hexdigest()
        return digest, target, served

torch.manual_seed(1234)
ds = Recording(root, is_valid_file=lambda p: p.endswith(".jpg"))
loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, num_workers=workers)
digests, labels, served = [], [], 0
for d, y, s in loader:
    digests += list(d)
    labels += y.tolist()
    served += int(s.sum())
stats = cube_torch.stats() if mode != "plain" else None
print(json.dumps({"digests": digests, "labels": labels, "served": served, "stats": stats}))
"""


def fuse_reads(mount: Any) -> float:
    return mount.metrics().value("cubetorchfs_fuse_ops_total", op="read")


def test_workers_take_each_batch_in_one_request(cube: CubeFactory, jpeg_tree: Path) -> None:
    plain = mount_with_latency(cube, jpeg_tree)
    root = str(plain.path("train"))
    without = run_script(EPOCH, plain.env(), "plain", root, "2")
    assert len(without["labels"]) == 480 and without["served"] == 0

    mount = mount_with_latency(cube, jpeg_tree)  # a fresh, empty cache
    env = dict(mount.env(), VOL_NAME=mount.vol_name, CUBE_TORCH_LOOKAHEAD_BATCHES="4",
               USE_BATCH_DOWNLOAD="1")
    before = fuse_reads(mount)
    batch = run_script(EPOCH, env, "batch", str(mount.path("train")), "2")
    # The samples, their bytes and their order are those of the run without the hook.
    for key in ("digests", "labels"):
        assert batch[key] == without[key], key
    # Every image came from a batch; the captions, which the dataset's path mapping does not
    # name, were read through the mount (one FUSE read each, at most).
    assert batch["served"] == 480, batch["served"]
    files = batch["stats"]["global"]["files_batch"]
    assert files["batches"] == 30 and files["files"] == 480, files
    # A batch-mode stream: nothing put into the page cache, which its workers never read.
    prefetch = batch["stats"]["global"]["prefetch"]
    assert prefetch["stored"] == 0 and prefetch["fetched"] >= 470, prefetch
    assert fuse_reads(mount) - before <= 480, fuse_reads(mount) - before


def test_a_second_open_of_a_path_goes_to_the_file_system(cube: CubeFactory,
                                                         jpeg_tree: Path) -> None:
    mount = mount_with_latency(cube, jpeg_tree, latency_us=0)
    env = dict(mount.env(), VOL_NAME=mount.vol_name, USE_BATCH_DOWNLOAD="1")
    plain = run_script(EPOCH, mount.env(), "plain", str(mount.path("train")), "2")
    twice = run_script(EPOCH, dict(env, TWICE="1"), "batch", str(mount.path("train")), "2")
    assert twice["digests"] == plain["digests"] and twice["served"] == 480


def test_without_a_daemon_to_ask_the_batch_mode_reads_through_the_mount(
        cube: CubeFactory, jpeg_tree: Path, tmp_path: Path) -> None:
    mount = mount_with_latency(cube, jpeg_tree, latency_us=0)
    root = str(mount.path("train"))
    plain = run_script(EPOCH, mount.env(), "plain", root, "2")
    # No control file where the hook looks: no daemon is found, nothing is asked.
    empty = tmp_path / "no-control-files"
    empty.mkdir()
    env = dict(mount.env(), USE_BATCH_DOWNLOAD="1", CUBE_TORCH_CONFIG_DIR=str(empty))
    alone = run_script(EPOCH, env, "batch", root, "2")
    assert alone["digests"] == plain["digests"] and alone["served"] == 0


def test_the_main_process_is_left_alone(cube: CubeFactory, jpeg_tree: Path) -> None:
    """num_workers=0: the batch mode runs in DataLoader workers only."""
    mount = mount_with_latency(cube, jpeg_tree, latency_us=0)
    env = dict(mount.env(), VOL_NAME=mount.vol_name, USE_BATCH_DOWNLOAD="1")
    out = run_script(EPOCH, env, "batch", str(mount.path("train")), "0")
    assert len(out["labels"]) == 480 and out["served"] == 0
    assert out["stats"]["global"]["files_batch"]["batches"] == 0
