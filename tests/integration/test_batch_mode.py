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


LOADERS = """
import hashlib, json, os, sys
mode, root = sys.argv[1], sys.argv[2]
if mode != "plain":
    import cube_torch
import cv2, numpy, torch

class Pairs(torch.utils.data.Dataset):
    # An image read with cv2.imread and its label tensor with torch.load, named by
    # train_data_list (two columns); cv2 imported before the workers start, as a user would.
    def __init__(self, root):
        names = sorted(n[:-4] for n in os.listdir(root) if n.endswith(".jpg"))
        self.images = [os.path.join(root, n + ".jpg") for n in names]
        self.labels = [os.path.join(root, n + ".pt") for n in names]
    def train_data_list(self):
        return [self.images, self.labels]
    def __len__(self):
        return len(self.images)
    def __getitem__(self, i):
        image = cv2.imread(self.images[i], cv2.IMREAD_GRAYSCALE)
        label = torch.load(self.labels[i])
        return hashlib.sha1(image.tobytes()).hexdigest(), int(label)

torch.manual_seed(5)
loader = torch.utils.data.DataLoader(Pairs(root), batch_size=8, shuffle=True, num_workers=2)
digests, labels = [], []
for d, y in loader:
    digests += list(d)
    labels += y.tolist()
stats = cube_torch.stats() if mode != "plain" else None
print(json.dumps({"digests": digests, "labels": labels, "stats": stats}))
"""


def test_cv2_imread_and_torch_load_are_served_from_the_batch(cube: CubeFactory,
                                                             tmp_path: Path) -> None:
    cv2 = pytest.importorskip("cv2", reason="no cv2 in this Python (python3-opencv)")
    import numpy as np
    import torch

    root = tmp_path / "store" / "pairs"
    root.mkdir(parents=True)
    rng = np.random.default_rng(9)
    for i in range(96):
        cv2.imwrite(str(root / f"s{i:03d}.jpg"), rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
        torch.save(torch.tensor(i % 7), str(root / f"s{i:03d}.pt"))
    plain_mount = mount_with_latency(cube, root, latency_us=0)
    plain = run_script(LOADERS, plain_mount.env(), "plain", str(plain_mount.path("pairs")))
    mount = mount_with_latency(cube, root, latency_us=500)
    env = dict(mount.env(), VOL_NAME=mount.vol_name, USE_BATCH_DOWNLOAD="1")
    before = fuse_reads(mount)
    batch = run_script(LOADERS, env, "batch", str(mount.path("pairs")))
    assert batch["digests"] == plain["digests"] and batch["labels"] == plain["labels"]
    assert len(batch["labels"]) == 96
    files = batch["stats"]["global"]["files_batch"]
    assert files["files"] == 192, files  # every image and every label, from the batches
    assert fuse_reads(mount) - before == 0, fuse_reads(mount) - before


# The hook's loader patterns, each run three ways on the same mount: without the hook, in the
# prefetch mode, in the batch mode. The samples (each image's decoded bytes) and their order
# are those of the run without the hook. The dataset lives in a module of its own so that
# workers started with spawn or forkserver, which run none of the script, can unpickle it; the
# script imports cube_torch in the main process only.
PATTERN_DATASETS = '''
import hashlib
import torch, torchvision
from torchvision import transforms

def served():
    batch = __import__("sys").modules.get("cube_torch._batch")
    return batch.counters["served"] if batch else 0

class Images(torchvision.datasets.ImageFolder):
    # Each sample: its image's decoded bytes, its label, and whether the batch mode served it.
    def __getitem__(self, i):
        path, target = self.samples[i]
        before = served()
        image = transforms.functional.pil_to_tensor(self.loader(path))
        return hashlib.sha1(image.numpy().tobytes()).hexdigest(), target, served() - before
'''

PATTERN = """
import json, os, sys
pattern, mode, root = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, sys.argv[4])  # patterns_ds (spawned workers get this path too)
if mode != "plain":
    import cube_torch
import torch
from torch.utils.data import ConcatDataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
import patterns_ds

def main():
    torch.manual_seed(7)
    ds = patterns_ds.Images(root)
    kw = dict(batch_size=8, num_workers=2)
    if pattern == "subset":
        ds = Subset(ds, list(range(0, len(ds), 3)))
    if pattern == "concat":
        ds = ConcatDataset([Subset(ds, range(0, 200)), Subset(ds, range(300, 480))])
    if pattern == "distributed":
        kw["sampler"] = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)
    else:
        kw["shuffle"] = True
    if pattern in ("spawn", "forkserver"):
        kw["multiprocessing_context"] = pattern
    if pattern == "unordered":
        kw["in_order"] = False
    if pattern == "stateful":  # 3 batches, the state saved, a new loader resumed from it
        from torchdata.stateful_dataloader import StatefulDataLoader
        first = StatefulDataLoader(ds, **kw)
        it = iter(first)
        head = [next(it) for _ in range(3)]
        state = first.state_dict()
        del it
        loader = StatefulDataLoader(ds, **kw)
        loader.load_state_dict(state)
        digests = [x for d, _, _ in head for x in d]
        labels = [x for _, y, _ in head for x in y.tolist()]
        count = sum(int(s.sum()) for _, _, s in head)
        for d, y, s in loader:
            digests += list(d)
            labels += y.tolist()
            count += int(s.sum())
        print(json.dumps({"digests": digests, "labels": labels, "served": count}))
        return
    loader = DataLoader(ds, **kw)
    digests, labels, count = [], [], 0
    if pattern == "break":  # a few batches, then a whole new epoch from the start
        for n, (d, y, s) in enumerate(loader):
            if n == 3:
                break
        digests.append("|")
    for d, y, s in loader:
        digests += list(d)
        labels += y.tolist()
        count += int(s.sum())
    if pattern == "unordered":  # the order is the workers' own: compare the samples alone
        digests.sort()
        labels.sort()
    print(json.dumps({"digests": digests, "labels": labels, "served": count}))

if __name__ == "__main__":
    main()
"""

PATTERNS = ("imagefolder", "subset", "concat", "distributed", "break", "spawn", "forkserver",
            "unordered", "stateful")


@pytest.fixture
def pattern_mount(cube: CubeFactory, jpeg_tree: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Any:
    module_dir = tmp_path_factory.mktemp("patterns")
    (module_dir / "patterns_ds.py").write_text(PATTERN_DATASETS)
    mount = mount_with_latency(cube, jpeg_tree, latency_us=200)
    return mount, str(module_dir)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_loader_patterns_give_the_same_samples_in_both_modes(pattern_mount: Any,
                                                             pattern: str) -> None:
    import torch
    if pattern == "unordered" and "in_order" not in torch.utils.data.DataLoader.__init__.__code__ \
            .co_varnames:
        pytest.skip(f"DataLoader(in_order=...) is newer than torch {torch.__version__}")
    if pattern == "stateful":
        pytest.importorskip("torchdata.stateful_dataloader", reason="no torchdata here")
    mount, module_dir = pattern_mount
    root = str(mount.path("train"))
    env = dict(mount.env(), VOL_NAME=mount.vol_name)

    def run(mode: str, **extra: str) -> dict:
        return run_script(PATTERN, dict(env, **extra), pattern, mode, root, module_dir)

    plain = run("plain")
    assert len(plain["digests"]) > 100
    prefetch = run("prefetch")
    batch = run("batch", USE_BATCH_DOWNLOAD="1")
    for got in (prefetch, batch):
        assert got["digests"] == plain["digests"] and got["labels"] == plain["labels"]
    # Every image of the batch mode's epoch came from its batches (spawned workers included),
    # none in the other modes.
    assert prefetch["served"] == 0
    assert batch["served"] == len(plain["labels"]), (batch["served"], len(plain["labels"]))
