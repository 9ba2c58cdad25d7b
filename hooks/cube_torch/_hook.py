"""The DataLoader patch: a lookahead around the iterator's index sampler.

torch's DataLoader iterators (`_BaseDataLoaderIter` and subclasses) draw every index or index
batch from `self._sampler_iter`. We replace that attribute with a `LookaheadIterator` that
pulls CUBE_TORCH_LOOKAHEAD_BATCHES items ahead and hands each to a publishing `Stream` as it
is pulled; the DataLoader still gets the same items in the same order.

Where the attribute is (re)set, in torch 1.13 and 2.x:
- `_BaseDataLoaderIter.__init__` sets it: the single-process iterator's only place;
- `_BaseDataLoaderIter._reset` sets it again: the multi-process iterator calls it from its
  `__init__` and for each epoch of persistent workers, then at once pulls
  prefetch_factor * num_workers indices (already through our wrapper);
- `__next__` is patched to close the stream when the iterator ends (only then have the
  workers read every file; deleting the stream when the sampler ends would drop files still
  being read), and as the fallback for a torch whose `_reset` is missing or renamed: an
  unwrapped `_sampler_iter` is wrapped at the next `__next__`, from wherever it stands;
- `_next_index` (the one place torch, and torchdata's StatefulDataLoader iterators, pull from
  `_sampler_iter`) does the same before it pulls: StatefulDataLoader's `load_state_dict`
  replaces `_sampler_iter` with a fresh iterator of the sampler restored to the checkpoint,
  and its multi-process iterator pulls prefetch_factor * num_workers indices from it before
  any `__next__`; wrapped there, the stream starts at the resumed position.
Each method is patched only if the class defines it; every patched method calls the original
first and swallows its own errors, so a torch we do not know runs unchanged.

A `_sampler_iter` with `state_dict()` / `load_state_dict()` (torchdata's Stateful protocol:
StatefulDataLoader's sampler iterators) gets a `StatefulLookaheadIterator`, whose state is the
one at the loop's position, not the lookahead's, so checkpoints resume where the loop was.
torchdata is never imported here: its samplers are recognized only if the user imported it.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import _batch, _client, _common, _paths, _publisher
from ._lookahead import LookaheadIterator, StatefulLookaheadIterator, stateful

_ATTR = "_sampler_iter"
_SEEN = "_cube_torch_seen"  # the raw index iterator we decided not to wrap
_ORIGINALS = "_cube_torch_originals"
ALL_METHODS = ("__init__", "_reset", "__next__", "_next_index")
_TORCHDATA_SAMPLERS = "torchdata.stateful_dataloader.sampler"


def _base_class() -> Optional[type]:
    try:
        from torch.utils.data import dataloader
    except Exception:
        return None
    base = getattr(dataloader, "_BaseDataLoaderIter", None)
    return base if isinstance(base, type) else None


def install(methods: Sequence[str] = ALL_METHODS, base: Optional[type] = None) -> bool:
    """Patches the DataLoader iterator class; True if patched (now or before)."""
    base = base or _base_class()
    if base is None:
        _common.warn_once("torch", "this torch has no DataLoader iterator class we know; "
                          "cube_torch is inactive")
        return False
    if _ORIGINALS in base.__dict__:
        return True
    makers: Dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
        "__init__": _patched_init, "_reset": _patched_reset, "__next__": _patched_next,
        "_next_index": _patched_next_index}
    originals = {}
    for name in methods:
        original = base.__dict__.get(name)
        if callable(original):
            originals[name] = original
            setattr(base, name, functools.wraps(original)(makers[name](original)))
    setattr(base, _ORIGINALS, originals)
    return True


class SpawnEntry:
    """A rank's function wrapped so that the rank imports cube_torch before it runs. Ranks of
    torch.multiprocessing.spawn start a fresh interpreter that runs no `if __name__ ==
    "__main__":` block, where `import cube_torch` often sits; unpickling this object there
    imports the package (and so hooks DataLoader) first."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _patched_start_processes(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def start_processes(fn: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(fn, SpawnEntry) and not _common.disabled():
            fn = SpawnEntry(fn)
        return original(fn, *args, **kwargs)
    start_processes._cube_torch_original = original  # type: ignore[attr-defined]
    return start_processes


def install_spawn() -> bool:
    """Makes ranks started by torch.multiprocessing.spawn / start_processes import cube_torch
    (and so get the hook) whatever their script does. True if patched (now or before)."""
    try:
        import torch.multiprocessing as mp
        module = sys.modules.get("torch.multiprocessing.spawn")
    except Exception:
        return False
    if module is None or not callable(getattr(module, "start_processes", None)):
        return False
    if hasattr(module.start_processes, "_cube_torch_original"):
        return True
    patched = _patched_start_processes(module.start_processes)
    module.start_processes = patched  # what spawn() calls
    if getattr(mp, "start_processes", None) is patched._cube_torch_original:  # type: ignore
        mp.start_processes = patched
    return True


def uninstall(base: Optional[type] = None) -> None:
    """Restores the original methods (for tests)."""
    base = base or _base_class()
    if base is None or _ORIGINALS not in base.__dict__:
        return
    for name, original in base.__dict__[_ORIGINALS].items():
        setattr(base, name, original)
    delattr(base, _ORIGINALS)


def installed(base: Optional[type] = None) -> bool:
    base = base or _base_class()
    return base is not None and _ORIGINALS in base.__dict__


class WorkerEntry:
    """A DataLoader's worker_init_fn wrapped so that its workers import cube_torch before they
    run, in the batch mode. Workers started with `spawn` or `forkserver` run a fresh
    interpreter that imports only what the dataset needs; unpickling this object there imports
    the package, which installs the batch mode (the environment that chose it is inherited)."""

    def __init__(self, fn: Optional[Callable[[int], Any]]) -> None:
        self.fn = fn

    def __call__(self, worker_id: int) -> Any:
        return self.fn(worker_id) if self.fn is not None else None


def _module_of(filename: str) -> Optional[Any]:
    """The loaded module whose source is `filename`, if any."""
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) == filename:
            return module
    return None


def _with_torch_warnings_attributed(call: Callable[[], Any], caller: Any) -> Any:
    """Runs `call`; the warnings it raises are shown as if no wrapper of ours stood between
    torch and its caller. torch warns with stacklevel=2 from the iterator's __init__, which
    names the frame above it: with this module's wrapper there, the warning (its place, the
    filters that match its module, its once-per-place registry) would be ours. Each warning is
    collected (an "always" filter put first for the call, not through catch_warnings, which
    would reset every module's once-per-place registry) and warned again at its place:
    `caller` (the frame that called the wrapper) for one that named this module, its own
    place otherwise, where the user's filters and registries decide as they would have."""
    caught: List[Any] = []

    def collect(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                line: Any = None) -> None:
        caught.append((message, category, filename, lineno))

    always = ("always", None, Warning, None, 0)
    shown = warnings.showwarning
    warnings.filters.insert(0, always)
    warnings.showwarning = collect
    try:
        result = call()
    finally:
        warnings.showwarning = shown
        for k, f in enumerate(warnings.filters):
            if f is always:
                del warnings.filters[k]
                break
    for message, category, filename, lineno in caught:
        if filename == __file__:
            g = caller.f_globals
            filename, lineno = caller.f_code.co_filename, caller.f_lineno
        else:
            module = _module_of(filename)
            g = vars(module) if module is not None else {"__name__": filename}
        warnings.warn_explicit(message, category, filename, lineno, module=g.get("__name__"),
                               registry=g.setdefault("__warningregistry__", {}),
                               module_globals=g if "__loader__" in g else None)
    return result


def _patched_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        loader = args[0] if args else kwargs.get("loader")
        if (_batch.installed() and getattr(loader, "num_workers", 0) > 0
                and not isinstance(getattr(loader, "worker_init_fn", None), WorkerEntry)):
            try:
                loader.worker_init_fn = WorkerEntry(loader.worker_init_fn)
            except Exception:  # a loader that refuses it: its workers go without the batch mode
                pass
        _with_torch_warnings_attributed(lambda: original(self, *args, **kwargs),
                                        sys._getframe(1))
        _attach(self)
    return __init__


def _patched_reset(original: Callable[..., Any]) -> Callable[..., Any]:
    def _reset(self: Any, *args: Any, **kwargs: Any) -> Any:
        previous = self.__dict__.get(_ATTR)
        result = original(self, *args, **kwargs)
        if isinstance(previous, LookaheadIterator) and self.__dict__.get(_ATTR) is not previous:
            _publisher.close_stream(previous.context)  # an epoch left early
        _attach(self)
        return result
    return _reset


def _unseen(d: Dict[str, Any]) -> bool:
    """Whether the iterator (its __dict__) holds a `_sampler_iter` not yet wrapped or judged."""
    source = d.get(_ATTR)
    return (source is not None and not isinstance(source, LookaheadIterator)
            and d.get(_SEEN) is not source)


def _patched_next(original: Callable[..., Any]) -> Callable[..., Any]:
    def __next__(self: Any) -> Any:
        d = self.__dict__
        if _unseen(d):
            _attach(self)
        try:
            return original(self)
        except StopIteration:
            wrapper = d.get(_ATTR)
            if isinstance(wrapper, LookaheadIterator):
                try:
                    _publisher.close_stream(wrapper.context, finished=wrapper.exhausted)
                except Exception:
                    pass
            raise
    return __next__


def _patched_next_index(original: Callable[..., Any]) -> Callable[..., Any]:
    def _next_index(self: Any) -> Any:
        if _unseen(self.__dict__):
            _attach(self)
        return original(self)
    return _next_index


def _attach(it: Any) -> None:
    """Wraps `it._sampler_iter` unless it is wrapped already or must run unchanged."""
    try:
        d = it.__dict__
        if _ATTR not in d:
            _common.warn_once("torch", f"{type(it).__name__} has no {_ATTR}; this torch is not "
                              "supported, DataLoaders run without cube_torch")
            return
        source = d[_ATTR]
        if source is None or isinstance(source, LookaheadIterator) or d.get(_SEEN) is source:
            return
        d[_SEEN] = source
        _common.remember_user_site()  # where the publisher thread's warnings will point
        wrapper = _wrap(it, source)
        if wrapper is not None:
            it._sampler_iter = wrapper
    except Exception as e:
        _common.warn_once("internal", f"could not hook a DataLoader ({e!r}); it runs unchanged")


def _wrap(it: Any, source: Any) -> Optional[LookaheadIterator]:
    if _common.disabled():
        return None
    dataset = it.__dict__.get("_dataset")
    if dataset is None:
        return None
    from torch.utils.data import IterableDataset, dataloader
    iterable_kind = getattr(getattr(dataloader, "_DatasetKind", None), "Iterable", None)
    kind = it.__dict__.get("_dataset_kind")
    if isinstance(dataset, IterableDataset) or (kind is not None and kind == iterable_kind):
        _common.warn_once(f"iterable:{_qualname(dataset)}",
                          f"{_qualname(dataset)} is an IterableDataset: its files cannot be "
                          "known ahead; it runs unchanged, without prefetching")
        return None
    sampler = it.__dict__.get("_index_sampler")
    if sampler is not None and not _restarts(sampler):
        culprit = _stateful_part(sampler)
        name = _qualname(culprit)
        where = ""
        if culprit is not sampler:  # the user's sampler, inside the BatchSampler torch made
            where = f" (inside the DataLoader's {type(sampler).__name__})"
        _common.warn_once(f"sampler:{name}",
                          f"{name}{where} may carry state from one pass to the next; so that "
                          "the loop sees exactly its samples, cube_torch does not read ahead of "
                          "it and publishes nothing (set `cube_torch_restartable = True` on "
                          f"{type(culprit).__name__} if each iter() of it starts afresh)")
        return None
    try:
        mapper = _paths.mapper_for(dataset)
    except Exception:
        mapper = None
    if mapper is None:
        _common.warn_once(f"unmappable:{_qualname(dataset)}",
                          f"cannot tell which files {_qualname(dataset)} reads; it runs unchanged, "
                          "without prefetching (define train_data_list() to fix)")
        return None
    if not _client.control_files():
        vol = _common.vol_name()
        _common.warn_once("daemon", "no cubetorchfs control file in " + _common.config_dir()
                          + (f" for VOL_NAME={vol}" if vol else "") + "; not publishing")
        return None
    auto = it.__dict__.get("_auto_collation")
    ahead = _common.lookahead_batches()
    stream = _publisher.Stream(type(dataset).__name__, mapper,
                               None if auto is None else bool(auto), _unread_items(it, ahead))
    kind_of = StatefulLookaheadIterator if stateful(source) else LookaheadIterator
    wrapper = kind_of(source, ahead, stream.submit, stream)
    weakref.finalize(wrapper, _publisher.close_stream, stream).atexit = False
    return wrapper


def _unread_items(it: Any, ahead: int) -> Optional[int]:
    """How many of the latest sampler items the loop may not have read yet: the lookahead's
    `ahead` items and the one it holds for its consumer, and the items the iterator has handed
    to its workers and not yet returned (at most prefetch_factor per worker). Every earlier
    item was read: an iterator returns its batches in order once read. None if the iterator's
    attributes are not those of torch's (or torchdata's) DataLoader iterators."""
    workers = it.__dict__.get("_num_workers")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        return None
    if workers == 0:
        return ahead + 1
    factor = it.__dict__.get("_prefetch_factor")
    if not isinstance(factor, int) or isinstance(factor, bool) or factor < 1:
        return None
    if it.__dict__.get("_in_order") is False:
        # Batches come back in the order they are read (torch >= 2.6, in_order=False): a
        # worker can hold an old one while later ones pass. Allow it four times the room.
        factor *= 4
    return ahead + 1 + workers * factor


def _restarts(sampler: Any, inner: bool = False) -> bool:
    """Whether each iter() of `sampler` starts afresh, so that the batches the lookahead
    pulled but the loop never used (after a `break`) change nothing later: torch's own
    samplers and BatchSampler over them, unless a subclass overrides __iter__, the same of
    torchdata's StatefulDataLoader (if the user imported it), or a sampler that says so with
    `cube_torch_restartable`. `inner`: `sampler` is a BatchSampler's."""
    declared = getattr(sampler, "cube_torch_restartable", None)
    if declared is not None:
        return bool(declared)
    try:
        from torch.utils.data import distributed, sampler as samplers
    except Exception:
        return False
    td = sys.modules.get(_TORCHDATA_SAMPLERS)  # never imported here

    def td_class(name: str) -> Any:
        return getattr(td, name, None) if td is not None else None

    # torchdata's BatchSampler derives from torch's: the most derived first.
    for batch in (td_class("BatchSampler"), samplers.BatchSampler):
        if isinstance(batch, type) and isinstance(sampler, batch):
            return (type(sampler).__iter__ is batch.__iter__
                    and _restarts(sampler.sampler, inner=True))
    known = [getattr(samplers, n, None) for n in ("SequentialSampler", "RandomSampler",
                                                   "SubsetRandomSampler", "WeightedRandomSampler")]
    known.append(getattr(distributed, "DistributedSampler", None))
    known.append(td_class("RandomSampler"))  # draws its permutation when iter() is called
    if inner:
        # Counts what it yields in its own state_dict(), which torchdata's BatchSampler
        # iterator reports per batch (so at the loop's position through the lookahead); on
        # its own, torchdata would read it directly, at the lookahead's position.
        known.append(td_class("StatefulDistributedSampler"))
    return any(isinstance(cls, type) and isinstance(sampler, cls)
               and type(sampler).__iter__ is cls.__iter__ for cls in known)


def _batch_sampler_classes() -> List[type]:
    """torch's BatchSampler and torchdata's (if the user imported it), the most derived first."""
    out: List[type] = []
    td = sys.modules.get(_TORCHDATA_SAMPLERS)
    cls = getattr(td, "BatchSampler", None) if td is not None else None
    if isinstance(cls, type):
        out.append(cls)
    try:
        from torch.utils.data import sampler as samplers
        out.append(samplers.BatchSampler)
    except Exception:
        pass
    return out


def _stateful_part(sampler: Any) -> Any:
    """The sampler that makes `sampler` (an index sampler _restarts() refused) unsafe to read
    ahead: for a stock BatchSampler around a sampler that may keep state, that inner sampler,
    the one the user gave the DataLoader; otherwise `sampler` itself."""
    if getattr(sampler, "cube_torch_restartable", None) is not None:
        return sampler  # it says so itself
    for batch in _batch_sampler_classes():
        if isinstance(sampler, batch):
            inner = getattr(sampler, "sampler", None)
            if (type(sampler).__iter__ is batch.__iter__ and inner is not None
                    and not _restarts(inner, inner=True)):
                return _stateful_part(inner)
            return sampler
    return sampler


def _qualname(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"
