"""torchdata's StatefulDataLoader with the hook: read ahead like DataLoader, and a checkpoint
(`state_dict()` after k batches) resumes after exactly those k batches, its stream starting at
the resumed position. The StatefulLookaheadIterator tests need no torchdata (nor does the
hook: it must not import it); the loader tests skip where torchdata is not installed
(Debian's torch 1.13)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

from cube_torch import _hook
from cube_torch._lookahead import LookaheadIterator, StatefulLookaheadIterator, stateful
from fake_control_server import FakeDaemon
from hook_testlib import FileList, cube_warnings, flush, make_files

HOOKS = str(Path(__file__).resolve().parents[2] / "hooks")

KINDS: Dict[str, Dict[str, Any]] = {"single": {"num_workers": 0}, "workers": {"num_workers": 2},
                               "persistent": {"num_workers": 2, "persistent_workers": True}}


# --------------------------------------------------------------------------- the lookahead


class Counter:
    """A Stateful-style source: yields 0..n-1; its state is how many it has yielded."""

    def __init__(self, n: int, bad_state_at: Optional[int] = None) -> None:
        self.n, self.pos, self.bad_state_at = n, 0, bad_state_at

    def __iter__(self) -> "Counter":
        return self

    def __next__(self) -> int:
        if self.pos >= self.n:
            raise StopIteration
        self.pos += 1
        return self.pos - 1

    def state_dict(self) -> Dict[str, int]:
        if self.pos == self.bad_state_at:
            raise ValueError("no state here")
        return {"pos": self.pos}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.pos = state["pos"]


def test_stateful_lookahead_reports_the_consumers_position() -> None:
    pulled: List[int] = []
    it = StatefulLookaheadIterator(Counter(10), 3, pulled.append)
    assert it.state_dict() == {"pos": 0}
    for k in range(10):
        assert next(it) == k
        assert it.state_dict() == {"pos": k + 1}, k  # the source itself is up to 3 further
        assert pulled == list(range(min(k + 4, 10)))
    with pytest.raises(StopIteration):
        next(it)
    assert it.state_dict() == {"pos": 10}


def test_stateful_lookahead_state_error_comes_at_its_position() -> None:
    it = StatefulLookaheadIterator(Counter(6, bad_state_at=2), 3, lambda item: None)
    assert [next(it), next(it)] == [0, 1]  # the source's state at 2 was taken (and failed)
    with pytest.raises(ValueError):
        it.state_dict()
    assert next(it) == 2
    assert it.state_dict() == {"pos": 3}
    assert list(it) == [3, 4, 5]


def test_stateful_lookahead_load_state_dict_drops_what_was_pulled() -> None:
    it = StatefulLookaheadIterator(Counter(10), 3, lambda item: None)
    assert next(it) == 0
    it.load_state_dict({"pos": 7})
    assert it.state_dict() == {"pos": 7}
    assert list(it) == [7, 8, 9]


def test_only_a_stateful_source_makes_a_stateful_wrapper() -> None:
    # torchdata decides by the presence of state_dict and load_state_dict.
    assert stateful(Counter(1)) and not stateful(iter(range(3)))
    assert not hasattr(LookaheadIterator(iter(range(3)), 2, lambda item: None), "state_dict")


def test_the_hook_never_imports_torchdata(config_dir: Path) -> None:
    script = textwrap.dedent("""
        import sys
        import cube_torch
        import torch
        loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, shuffle=True)
        assert [x for b in loader for x in b.tolist()]
        print("torchdata" in " ".join(sys.modules))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": HOOKS, "PATH": "/usr/bin:/bin",
                                                "CUBE_TORCH_CONFIG_DIR": str(config_dir)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False"


# --------------------------------------------------------------------------- StatefulDataLoader


def torchdata_loader() -> Any:
    return pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


def same(a: Any, b: Any) -> bool:
    """Deep equality of state dicts (tensors compared by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def run(dataset: Any, seed: int, epochs: int, stop_after: Optional[int] = None,
        state: Optional[Dict[str, Any]] = None, **kwargs: Any
        ) -> Tuple[List[List[int]], Optional[Dict[str, Any]]]:
    """Epochs of a StatefulDataLoader (restored from `state` if given); with `stop_after`,
    the last epoch stops after that many batches and its state_dict() is returned."""
    StatefulDataLoader = torchdata_loader()
    torch.manual_seed(seed)
    loader = StatefulDataLoader(dataset, **kwargs)
    if state is not None:
        loader.load_state_dict(state)
    out: List[List[int]] = []
    for e in range(epochs):
        out.append([])
        for j, batch in enumerate(loader):
            out[-1].extend(torch.as_tensor(batch).reshape(-1).tolist())
            if stop_after is not None and e == epochs - 1 and j + 1 == stop_after:
                return out, loader.state_dict()
    return out, None


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_stateful_loader_is_read_ahead_in_order(kind: str, mount: Path,
                                               daemon: FakeDaemon) -> None:
    files = make_files(mount, 40)
    dataset = FileList(files)
    opts = dict(batch_size=4, shuffle=True, **KINDS[kind])
    _hook.uninstall()
    plain, _ = run(dataset, 1234, 2, **opts)
    _hook.install()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        hooked, _ = run(dataset, 1234, 2, **opts)
    assert cube_warnings(record) == []
    assert hooked == plain and plain[0] != plain[1]
    flush()
    streams = daemon.all_streams()
    assert [s.paths for s in streams] == [[files[i] for i in epoch] for epoch in hooked]
    assert all(s.deleted for s in streams)


@pytest.mark.parametrize("epoch", [0, 1])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_checkpoint_resumes_where_the_loop_was(kind: str, epoch: int, mount: Path,
                                               daemon: FakeDaemon) -> None:
    files = make_files(mount, 64)
    dataset = FileList(files)
    opts = dict(batch_size=4, shuffle=True, **KINDS[kind])
    k = 5
    _hook.uninstall()
    reference, _ = run(dataset, 7, epoch + 1, **opts)
    _, plain_state = run(dataset, 7, epoch + 1, stop_after=k, **opts)
    _hook.install()
    first, state = run(dataset, 7, epoch + 1, stop_after=k, **opts)
    assert first[-1] == reference[-1][:4 * k]
    # The hook pulled 16 batches further, yet the checkpoint is the one the loop's position
    # gives without it.
    assert state is not None and plain_state is not None and same(state, plain_state)
    flush()
    before = len(daemon.all_streams())
    # A new loader, seeded otherwise: only the checkpoint can put it where the loop was.
    rest, _ = run(dataset, 99, 1, state=state, **opts)
    assert first[-1] + rest[0] == reference[-1]
    flush()
    resumed = daemon.all_streams()[before:]
    # One stream, the resumed position's files: none of the k batches read before.
    assert [s.paths for s in resumed] == [[files[i] for i in rest[0]]]


def test_stateful_distributed_sampler_resumes(mount: Path, daemon: FakeDaemon) -> None:
    sampler_cls = pytest.importorskip("torchdata.stateful_dataloader.sampler")
    files = make_files(mount, 64)
    dataset = FileList(files)

    def opts() -> Dict[str, Any]:
        sampler = sampler_cls.StatefulDistributedSampler(dataset, num_replicas=2, rank=1,
                                                         shuffle=True, seed=3)
        return dict(batch_size=4, sampler=sampler, num_workers=0)

    _hook.uninstall()
    reference, _ = run(dataset, 7, 1, **opts())
    _hook.install()
    first, state = run(dataset, 7, 1, stop_after=3, **opts())
    rest, _ = run(dataset, 7, 1, state=state, **opts())
    assert first[0] + rest[0] == reference[0] and len(reference[0]) == 32
    flush()
    streams = daemon.all_streams()
    assert [s.paths for s in streams] == [[files[i] for i in reference[0]],
                                          [files[i] for i in rest[0]]]


def test_a_sampler_reporting_its_own_state_is_not_read_ahead(mount: Path,
                                                             daemon: FakeDaemon) -> None:
    """Unbatched, StatefulDistributedSampler is the index sampler, whose state_dict() torchdata
    reads directly, at the sampler's position: read ahead, it would be ahead of the loop."""
    sampler_cls = pytest.importorskip("torchdata.stateful_dataloader.sampler")
    dataset = FileList(make_files(mount, 32))

    def opts() -> Dict[str, Any]:
        sampler = sampler_cls.StatefulDistributedSampler(dataset, num_replicas=1, rank=0,
                                                         shuffle=True, seed=3)
        return dict(batch_size=None, sampler=sampler, num_workers=0)

    _hook.uninstall()
    reference, _ = run(dataset, 7, 1, **opts())
    _hook.install()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first, state = run(dataset, 7, 1, stop_after=5, **opts())
    assert any("may carry state" in w for w in cube_warnings(record))
    rest, _ = run(dataset, 7, 1, state=state, **opts())
    assert first[0] + rest[0] == reference[0]
    flush()
    assert daemon.published() == []
