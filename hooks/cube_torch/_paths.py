"""Dataset index -> the files that `dataset[index]` reads, in the order it reads them.

`mapper_for(dataset)` picks a strategy once per dataset object and caches it:

- `train_data_list()` (a user's explicit list): one list of paths, or a list/tuple of parallel
  lists (image + caption files): index i maps to the i-th element of each. Any sequence with
  a length is used as it is (a lazy sequence of 100 M names, a numpy array), never copied;
- torch's `Subset` (through `indices`) and `ConcatDataset` (through `cumulative_sizes`);
- torchvision's `DatasetFolder` / `ImageFolder` and look-alikes: `samples[i][0]`, or every
  path of `samples[i]` when its rows hold more than one (an image and its label file);
- torchvision's VOC datasets: `images[i]`, then `annotations[i]` or `targets[i]`;
- torchvision's `CocoDetection` / `CocoCaptions`: `root` joined with the file of `ids[i]`.

A mapper holds the lists it needs, never the dataset, so caching it does not keep a dataset
alive. Mappers may raise for a bad index; callers treat that as "no files".
Thread safety: `mapper_for` may be called from any thread; mappers are read-only.
"""

from __future__ import annotations

import bisect
import operator
import os
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

Paths = Tuple[str, ...]
PathMapper = Callable[[Any], Paths]

_MAX_DEPTH = 16  # nesting of Subset / ConcatDataset followed


def as_path(value: Any) -> Optional[str]:
    """A str for str / bytes / os.PathLike values, None for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, os.PathLike)):
        try:
            return os.fsdecode(os.fspath(value))
        except (TypeError, ValueError):
            return None
    return None


class _ListMapper:
    """Index i -> element i of each of several parallel lists (one list is the common case)."""

    def __init__(self, columns: Sequence[Sequence[Any]]) -> None:
        self._columns = tuple(columns)

    def singles(self, indices: List[int]) -> Optional[List[str]]:
        """The one path of each of `indices` (non-negative ints), with one list of str paths;
        None when that does not hold for all of them: map them one by one then."""
        if len(self._columns) != 1:
            return None
        column = self._columns[0]
        try:
            out = [column[i] for i in indices]
        except (IndexError, KeyError, TypeError):
            return None
        return out if not out or set(map(type, out)) == {str} else None

    def __call__(self, index: Any) -> Paths:
        i = operator.index(index)
        out = []
        for column in self._columns:
            p = as_path(column[i])
            if p is not None:
                out.append(p)
        return tuple(out)


class _RowMapper:
    """Index i -> the path-like fields of row i (`samples[i]` style)."""

    def __init__(self, rows: Sequence[Any], first_only: bool) -> None:
        self._rows = rows
        self._first_only = first_only

    def singles(self, indices: List[int]) -> Optional[List[str]]:
        """The first field of each of `indices`' rows (non-negative ints) where every row is a
        tuple starting with a str path (ImageFolder's samples), in a few passes with no call a
        row; None otherwise: map them one by one then."""
        if not self._first_only:
            return None
        rows = self._rows
        try:
            picked = [rows[i] for i in indices]
            if picked and set(map(type, picked)) != {tuple}:
                return None
            out = [r[0] for r in picked]
        except (IndexError, KeyError, TypeError):
            return None
        return out if not out or set(map(type, out)) == {str} else None

    def __call__(self, index: Any) -> Paths:
        row = self._rows[operator.index(index)]
        if not isinstance(row, (tuple, list)):
            p = as_path(row)
            return () if p is None else (p,)
        if self._first_only:  # the common case (ImageFolder), without a generator
            p = as_path(row[0]) if row else None
            return () if p is None else (p,)
        return tuple(p for p in map(as_path, row) if p is not None)


class _SubsetMapper:
    def __init__(self, indices: Sequence[Any], inner: PathMapper) -> None:
        self._indices = indices
        self._inner = inner

    def __call__(self, index: Any) -> Paths:
        return self._inner(self._indices[operator.index(index)])


class _ConcatMapper:
    def __init__(self, cumulative_sizes: Sequence[int], inner: List[Optional[PathMapper]]) -> None:
        self._cumulative = list(cumulative_sizes)
        self._inner = inner

    def __call__(self, index: Any) -> Paths:
        i = operator.index(index)
        if i < 0:
            i += self._cumulative[-1] if self._cumulative else 0
        k = bisect.bisect_right(self._cumulative, i)
        if k >= len(self._inner):
            raise IndexError(index)
        inner = self._inner[k]
        if inner is None:
            return ()
        return inner(i - self._cumulative[k - 1] if k > 0 else i)


class _CocoMapper:
    def __init__(self, root: Any, coco: Any, ids: Sequence[Any]) -> None:
        self._root = as_path(root) or ""
        self._coco = coco
        self._ids = ids

    def __call__(self, index: Any) -> Paths:
        info = self._coco.loadImgs(self._ids[operator.index(index)])[0]
        name = as_path(info["file_name"])
        return () if name is None else (os.path.join(self._root, name),)


def _is_sequence(value: Any) -> bool:
    """A list, a tuple, or any other object indexed by position with a length (a lazy
    sequence, a numpy array of names): used as it is, never copied."""
    if isinstance(value, (list, tuple)):
        return True
    if isinstance(value, (str, bytes, bytearray, dict)) or isinstance(value, os.PathLike):
        return False
    return hasattr(value, "__len__") and hasattr(value, "__getitem__")


def _is_path_list(value: Any) -> bool:
    if not _is_sequence(value):
        return False
    try:
        return len(value) == 0 or as_path(value[0]) is not None
    except Exception:
        return False


def _from_train_data_list(dataset: Any) -> Optional[PathMapper]:
    result = dataset.train_data_list()
    if result is None:
        return None
    if not _is_sequence(result):
        result = list(result)  # an iterator or a generator: its paths once, as a list
    if _is_path_list(result):
        return _ListMapper([result])  # the user's own sequence: 100 M paths are not copied
    if not isinstance(result, (list, tuple)):
        return None
    if all(_is_sequence(c) for c in result):
        # Several parallel lists (columns). A list with one row per sample is told apart by
        # its length: as many rows as samples, and rows shorter than that.
        try:
            n = len(dataset)
        except Exception:
            n = -1
        if len(result) == n and n > 0 and all(len(r) != n for r in result):
            return _RowMapper(result, first_only=False)
        return _ListMapper(result)
    return None


def _tv_class(name: str) -> Optional[type]:
    """A torchvision.datasets class if torchvision is already imported (never imports it)."""
    module = sys.modules.get("torchvision.datasets")
    cls = getattr(module, name, None) if module is not None else None
    return cls if isinstance(cls, type) else None


def _build(dataset: Any, depth: int) -> Optional[PathMapper]:
    if depth > _MAX_DEPTH:
        return None
    if callable(getattr(type(dataset), "train_data_list", None)):
        return _from_train_data_list(dataset)

    from torch.utils.data import ConcatDataset, Subset  # torch is loaded by the time we map

    if isinstance(dataset, Subset):
        inner = mapper_for(dataset.dataset, depth + 1)
        return None if inner is None else _SubsetMapper(dataset.indices, inner)
    if isinstance(dataset, ConcatDataset):
        inners = [mapper_for(d, depth + 1) for d in dataset.datasets]
        if all(m is None for m in inners):
            return None
        return _ConcatMapper(dataset.cumulative_sizes, inners)

    coco = _tv_class("CocoDetection")
    if (coco is not None and isinstance(dataset, coco)) or (
        callable(getattr(getattr(dataset, "coco", None), "loadImgs", None))
        and hasattr(dataset, "ids")
        and hasattr(dataset, "root")
    ):
        return _CocoMapper(dataset.root, dataset.coco, dataset.ids)

    images = getattr(dataset, "images", None)
    second = getattr(dataset, "annotations", None)
    if second is None:
        second = getattr(dataset, "targets", None)
    if _is_path_list(images) and _is_path_list(second):  # VOCDetection / VOCSegmentation
        return _ListMapper([images, second])

    samples = getattr(dataset, "samples", None)  # DatasetFolder / ImageFolder and look-alikes
    folder = _tv_class("DatasetFolder")
    if isinstance(samples, (list, tuple)) and (
        (folder is not None and isinstance(dataset, folder))
        or not samples
        or (isinstance(samples[0], (tuple, list)) and samples[0] and as_path(samples[0][0]))
        or as_path(samples[0]) is not None
    ):
        rows = samples[0] if samples and isinstance(samples[0], (tuple, list)) else ()
        return _RowMapper(samples, first_only=not any(_looks_like_path(f) for f in rows[1:]))
    return None


def _looks_like_path(value: Any) -> bool:
    """A field of a sample that names a file: a path object, or a str with a directory in it
    (ImageFolder's second field is a class index; a look-alike's may be a label name)."""
    if isinstance(value, os.PathLike):
        return True
    p = as_path(value)
    return p is not None and os.sep in p


# id(dataset) -> (weak reference to it, its mapper or None). The weak reference's callback
# drops the entry when the dataset goes away, before its id can be reused.
_cache: Dict[int, Tuple["weakref.ref[Any]", Optional[PathMapper]]] = {}


def mapper_for(dataset: Any, depth: int = 0) -> Optional[PathMapper]:
    """The strategy for `dataset`, or None when its files cannot be named."""
    key = id(dataset)
    hit = _cache.get(key)
    if hit is not None and hit[0]() is dataset:
        return hit[1]
    mapper = _build(dataset, depth)
    try:
        ref = weakref.ref(dataset, lambda _r, k=key: _cache.pop(k, None))
    except TypeError:  # not weak-referenceable: no caching
        return mapper
    _cache[key] = (ref, mapper)
    return mapper


def clear_cache() -> None:
    _cache.clear()
