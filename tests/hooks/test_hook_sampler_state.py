"""A sampler that resumes where it stopped keeps exactly its samples with the hook: the
lookahead never pulls batches from a sampler that may carry state across passes, so a
`break` loses nothing. torch's own samplers, and samplers that declare
`cube_torch_restartable`, are read ahead as before."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Iterator, List

import torch
from torch.utils.data import DataLoader, Sampler

from cube_torch import _hook
from fake_control_server import FakeDaemon
from hook_testlib import FileList, cube_warnings, flush, make_files


class Resuming(Sampler):
    """Yields 0..n-1 once across all passes: a pass resumes where the last one stopped."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0

    def __iter__(self) -> Iterator[int]:
        while self.pos < self.n:
            i = self.pos
            self.pos += 1
            yield i

    def __len__(self) -> int:
        return self.n


class Restartable(Resuming):
    cube_torch_restartable = True

    def __iter__(self) -> Iterator[int]:
        self.pos = 0
        return super().__iter__()


def passes(dataset: FileList, sampler: Sampler) -> List[List[int]]:
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=0)
    first: List[int] = []
    for j, batch in enumerate(loader):
        first.extend(batch.tolist())
        if j == 9:  # stop mid-pass: the sampler must resume right after batch 10
            break
    second = [i for batch in loader for i in batch.tolist()]
    return [first, second]


def test_a_resuming_sampler_loses_nothing_after_a_break(mount: Path, daemon: FakeDaemon) -> None:
    dataset = FileList(make_files(mount, 2000, dirs=8))
    _hook.uninstall()
    plain = passes(dataset, Resuming(2000))
    _hook.install()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        hooked = passes(dataset, Resuming(2000))
    assert len(plain[0]) == 320 and len(plain[1]) == 1680
    assert hooked == plain
    [warned] = [w for w in cube_warnings(record) if "may carry state" in w]
    # The user's sampler is named, not the BatchSampler torch wrapped it in.
    assert "test_hook_sampler_state.Resuming (inside the DataLoader's " \
           "BatchSampler) may carry state" in warned, warned
    assert "`cube_torch_restartable = True` on Resuming" in warned, warned
    flush()
    assert daemon.published() == []  # nothing read ahead, nothing published


class ResumingBatches(torch.utils.data.BatchSampler):
    """A BatchSampler of its own whose passes resume: it is the one named."""

    def __iter__(self) -> Iterator[List[int]]:
        return super().__iter__()


def test_the_warning_names_the_users_own_sampler_class(mount: Path, daemon: FakeDaemon) -> None:
    dataset = FileList(make_files(mount, 64, dirs=2))
    cases = [
        # sampler= without batching: the index sampler is the user's own.
        (dict(batch_size=None, sampler=Resuming(64)), "test_hook_sampler_state.Resuming may"),
        # batch_sampler= of the user's class: that class, even over a stock sampler.
        (dict(batch_sampler=ResumingBatches(torch.utils.data.SequentialSampler(range(64)), 8,
                                            False)),
         "test_hook_sampler_state.ResumingBatches may"),
        # A stock BatchSampler over the user's sampler: the user's sampler.
        (dict(batch_sampler=torch.utils.data.BatchSampler(Resuming(64), 8, False)),
         "test_hook_sampler_state.Resuming (inside the DataLoader's BatchSampler)"),
    ]
    for kwargs, want in cases:
        _hook.uninstall()
        _hook.install()
        from cube_torch import _common
        _common.reset_warnings()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for _ in DataLoader(dataset, num_workers=0, **kwargs):
                pass
        warned = [w for w in cube_warnings(record) if "may carry state" in w]
        assert len(warned) == 1 and want in warned[0], (want, warned)
        assert "torch.utils.data.sampler.BatchSampler may" not in warned[0]
    flush()
    assert daemon.published() == []


def test_a_declared_restartable_sampler_is_read_ahead(mount: Path, daemon: FakeDaemon) -> None:
    files = make_files(mount, 200, dirs=4)
    dataset = FileList(files)
    _hook.uninstall()
    plain = passes(dataset, Restartable(200))
    _hook.install()
    hooked = passes(dataset, Restartable(200))
    assert hooked == plain
    flush()
    assert len(daemon.published()) > 0
