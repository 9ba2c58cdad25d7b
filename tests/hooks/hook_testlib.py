"""Datasets and helpers shared by the hook tests."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Iterable, List, Optional, Sequence

import torch
from torch.utils.data import Dataset

from cube_torch import CubeTorchWarning, _publisher

FLUSH_S = 8.0  # bound on waiting for the publisher thread (a slow daemon costs 2 s a request)


def make_files(root: Path, n: int, suffix: str = ".bin", dirs: int = 4) -> List[str]:
    out = []
    for i in range(n):
        d = root / f"d{i % dirs}"
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"f{i:04d}{suffix}"
        p.write_bytes(b"x" * (i % 7 + 1))
        out.append(str(p))
    return out


class FileList(Dataset):
    """A custom dataset naming its files through train_data_list(); item i is i. Reads its
    file(s); with `record`, appends each path it reads (single-process only)."""

    def __init__(self, *columns: Sequence[str], record: Optional[list] = None) -> None:
        self.columns = [list(c) for c in columns]
        self.record = record

    def train_data_list(self) -> Any:
        return self.columns[0] if len(self.columns) == 1 else self.columns

    def __len__(self) -> int:
        return len(self.columns[0])

    def __getitem__(self, i: int) -> int:
        for column in self.columns:
            with open(column[i], "rb") as f:
                f.read()
            if self.record is not None:
                self.record.append(column[i])
        return i


class Unmappable(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return i


class Counting(torch.utils.data.IterableDataset):
    def __iter__(self) -> Iterable[int]:
        return iter(range(10))


def flush() -> None:
    publisher = _publisher.current_publisher()
    if publisher is not None:
        assert publisher.flush(FLUSH_S), "publisher thread did not catch up"


def indices(loader: Iterable[Any]) -> List[int]:
    """The sample indices one epoch yields, in order (items are index tensors or ints)."""
    out: List[int] = []
    for batch in loader:
        if isinstance(batch, torch.Tensor):
            out.extend(int(x) for x in batch.reshape(-1))
        else:
            out.append(int(batch))
    return out


def cube_warnings(record: List[warnings.WarningMessage]) -> List[str]:
    return [str(w.message) for w in record if issubclass(w.category, CubeTorchWarning)]


def counters() -> dict:
    publisher = _publisher.current_publisher()
    return publisher.counters() if publisher is not None else _publisher.zero_counters()


def real(paths: Iterable[str]) -> List[str]:
    return [os.path.normpath(os.path.abspath(p)) for p in paths]
