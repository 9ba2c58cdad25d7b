"""Index -> file mapping for the dataset kinds the hook knows, end to end where cheap."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List

import pytest
import torch
from PIL import Image
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset
from torchvision import datasets

from cube_torch import _paths
from fake_control_server import FakeDaemon
from hook_testlib import FileList, Unmappable, flush, indices, make_files


class PositionConcat(ConcatDataset):
    """A ConcatDataset whose item i is i (so the loop's order is visible), still reading it."""

    def __getitem__(self, i: int) -> int:
        super().__getitem__(i)
        return i


def make_image_folder(root: Path, classes: int = 3, per_class: int = 4) -> None:
    for c in range(classes):
        d = root / f"class{c}"
        d.mkdir(parents=True)
        for k in range(per_class):
            Image.new("RGB", (4, 4), (c * 60, k * 40, 0)).save(d / f"img{k}.jpg")


def test_image_folder_published_in_read_order(mount: Path, daemon: FakeDaemon) -> None:
    make_image_folder(mount / "train")
    read: List[str] = []

    def loader(path: str) -> Any:
        read.append(path)
        return datasets.folder.pil_loader(path)

    folder = datasets.ImageFolder(str(mount / "train"), loader=loader)
    torch.manual_seed(0)
    for _ in DataLoader(folder, batch_size=5, shuffle=True, collate_fn=lambda b: len(b)):
        pass
    flush()
    assert len(read) == 12
    assert daemon.published() == read


@pytest.mark.parametrize("workers", [0, 2])
def test_subset_and_concat(workers: int, mount: Path, daemon: FakeDaemon) -> None:
    a = make_files(mount / "a", 10)
    b = make_files(mount / "b", 6)
    both = PositionConcat([Subset(FileList(a), [9, 7, 5, 3, 1]), FileList(b)])
    expected_files = [a[i] for i in (9, 7, 5, 3, 1)] + b
    torch.manual_seed(1)
    seen = indices(DataLoader(both, batch_size=3, shuffle=True, num_workers=workers))
    flush()
    assert sorted(seen) == list(range(11))
    assert daemon.published() == [expected_files[i] for i in seen]

    mapper = _paths.mapper_for(both)
    assert [mapper(i) for i in range(11)] == [(p,) for p in expected_files]
    assert mapper(-1) == (b[-1],)
    with pytest.raises(IndexError):
        mapper(11)


def test_train_data_list_with_two_parallel_lists(mount: Path, daemon: FakeDaemon) -> None:
    images = make_files(mount / "img", 9, suffix=".jpg")
    captions = make_files(mount / "txt", 9, suffix=".txt")
    read: List[str] = []
    dataset = FileList(images, captions, record=read)
    torch.manual_seed(3)
    seen = indices(DataLoader(dataset, batch_size=2, shuffle=True))
    flush()
    expected = [p for i in seen for p in (images[i], captions[i])]
    assert daemon.published() == expected == read


def test_paths_outside_the_mount_are_not_published(tmp_path: Path, mount: Path,
                                                   daemon: FakeDaemon) -> None:
    inside = make_files(mount / "in", 6)
    outside = make_files(tmp_path / "elsewhere", 6)
    dataset = FileList([p for pair in zip(inside, outside) for p in pair])
    torch.manual_seed(4)
    seen = indices(DataLoader(dataset, batch_size=4, shuffle=True))
    flush()
    files = dataset.columns[0]
    assert daemon.published() == [files[i] for i in seen if files[i] in inside]
    assert all(p.startswith(str(mount) + os.sep) for p in daemon.published())


def test_symlink_into_the_mount_is_published_as_the_mount_path(tmp_path: Path, mount: Path,
                                                               daemon: FakeDaemon) -> None:
    make_files(mount / "data", 4, dirs=1)
    link = tmp_path / "link"
    link.symlink_to(mount / "data")
    dataset = FileList(sorted(str(p) for p in (link / "d0").iterdir()))
    indices(DataLoader(dataset, batch_size=2))
    flush()
    assert daemon.published() == [str(mount / "data" / "d0" / f"f{i:04d}.bin") for i in range(4)]


def test_relative_paths_are_made_absolute(monkeypatch: pytest.MonkeyPatch, mount: Path,
                                          daemon: FakeDaemon) -> None:
    files = make_files(mount, 4, dirs=1)
    monkeypatch.chdir(mount)
    dataset = FileList([os.path.relpath(p) for p in files])
    indices(DataLoader(dataset, batch_size=2))
    flush()
    assert daemon.published() == files


# --- mapping strategies, without a DataLoader ---

def test_voc_detection_maps_image_then_annotation() -> None:
    voc = datasets.VOCDetection.__new__(datasets.VOCDetection)
    voc.images = ["/m/JPEGImages/a.jpg", "/m/JPEGImages/b.jpg"]
    voc.targets = ["/m/Annotations/a.xml", "/m/Annotations/b.xml"]
    mapper = _paths.mapper_for(voc)
    assert mapper(1) == ("/m/JPEGImages/b.jpg", "/m/Annotations/b.xml")


def test_voc_like_dataset_with_annotations_attribute() -> None:
    class OldVoc(Dataset):
        images = ["/m/a.jpg"]
        annotations = ["/m/a.xml"]

    assert _paths.mapper_for(OldVoc())(0) == ("/m/a.jpg", "/m/a.xml")


def test_coco_detection_maps_the_file_of_the_id() -> None:
    class FakeCoco:
        imgs = {7: {"file_name": "000007.jpg"}, 3: {"file_name": "sub/000003.jpg"}}

        def loadImgs(self, ids: Any) -> List[dict]:
            return [self.imgs[ids]]

    coco = datasets.CocoDetection.__new__(datasets.CocoDetection)
    coco.root = "/m/coco/train2017"
    coco.coco = FakeCoco()
    coco.ids = [3, 7]
    mapper = _paths.mapper_for(coco)
    assert mapper(0) == ("/m/coco/train2017/sub/000003.jpg",)
    assert mapper(1) == ("/m/coco/train2017/000007.jpg",)


def test_dataset_folder_samples(tmp_path: Path) -> None:
    make_image_folder(tmp_path / "f", classes=2, per_class=2)
    folder = datasets.DatasetFolder(str(tmp_path / "f"), loader=lambda p: p, extensions=(".jpg",))
    mapper = _paths.mapper_for(folder)
    assert [mapper(i)[0] for i in range(len(folder))] == [s[0] for s in folder.samples]


def test_samples_holding_several_paths_publish_them_all(mount: Path, daemon: FakeDaemon) -> None:
    """An ImageFolder look-alike whose rows are (image, label file): both files of a sample
    are published, in the order the sample reads them; a row of (path, class name) is not
    taken for two paths."""
    images = make_files(mount / "img", 6, suffix=".jpg")
    labels = make_files(mount / "json", 6, suffix=".json")
    read: List[str] = []

    class Pairs(Dataset):
        def __init__(self) -> None:
            self.samples = list(zip(images, labels))

        def __len__(self) -> int:
            return len(self.samples)

        def __getitem__(self, i: int) -> int:
            for p in self.samples[i]:
                read.append(p)
                Path(p).read_bytes()
            return i

    torch.manual_seed(5)
    seen = indices(DataLoader(Pairs(), batch_size=2, shuffle=True))
    flush()
    assert daemon.published() == read == [p for i in seen for p in (images[i], labels[i])]

    class Named(Dataset):
        samples = [("/m/a.jpg", "cat"), ("/m/b.jpg", "dog")]

    assert _paths.mapper_for(Named())(1) == ("/m/b.jpg",)


def test_train_data_list_forms() -> None:
    class One(Dataset):
        def train_data_list(self) -> List[str]:
            return ["/m/a", "/m/b"]

    class Columns(Dataset):
        def __len__(self) -> int:
            return 3

        def train_data_list(self) -> tuple:
            return (["/m/1.jpg", "/m/2.jpg", "/m/3.jpg"], ["/m/1.txt", "/m/2.txt", "/m/3.txt"])

    class Rows(Dataset):
        def __len__(self) -> int:
            return 3

        def train_data_list(self) -> List[tuple]:
            return [("/m/1.jpg", "/m/1.txt"), ("/m/2.jpg", "/m/2.txt"), ("/m/3.jpg", "/m/3.txt")]

    assert _paths.mapper_for(One())(1) == ("/m/b",)
    assert _paths.mapper_for(Columns())(2) == ("/m/3.jpg", "/m/3.txt")
    assert _paths.mapper_for(Rows())(1) == ("/m/2.jpg", "/m/2.txt")


def test_a_lazy_train_data_list_is_used_as_it_is() -> None:
    """180 M samples: train_data_list() returns a sequence that makes each name when asked
    (or a numpy array): the hook indexes it, never lists it."""
    class Names:
        def __len__(self) -> int:
            return 180_000_000

        def __getitem__(self, i: int) -> str:
            if not 0 <= i < len(self):
                raise IndexError(i)
            return f"/m/n{i // 1000:08d}/{i}.jpg"

        def __iter__(self) -> Any:
            raise AssertionError("the whole list was walked")

    class Huge(Dataset):
        def train_data_list(self) -> Names:
            return Names()

    mapper = _paths.mapper_for(Huge())
    assert mapper(179_999_999) == ("/m/n00179999/179999999.jpg",)
    assert mapper.singles([5, 7]) == ["/m/n00000000/5.jpg", "/m/n00000000/7.jpg"]


def test_strategy_is_cached_per_dataset_object() -> None:
    calls = []

    class Counted(Dataset):
        def train_data_list(self) -> List[str]:
            calls.append(1)
            return ["/m/a"]

    ds = Counted()
    assert _paths.mapper_for(ds) is _paths.mapper_for(ds)
    assert len(calls) == 1
    other = Counted()
    _paths.mapper_for(other)
    assert len(calls) == 2


def test_unmappable_dataset() -> None:
    assert _paths.mapper_for(Unmappable()) is None
    assert _paths.mapper_for(Subset(Unmappable(), [1, 2])) is None
