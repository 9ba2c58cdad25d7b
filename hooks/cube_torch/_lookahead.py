"""An iterator that runs a fixed number of items ahead of its consumer.

`LookaheadIterator(source, ahead, on_pull)` yields exactly the items of `source`, the same
objects in the same order, but keeps up to `ahead` items pulled from `source` beyond the one it
returns; `on_pull(item)` sees every item at the moment it is pulled, in order. Nothing is
pulled before the first `next()`, so creating one has no effect on the source (a sampler's
random draws happen when they would have happened anyway).

An exception from `source` (other than StopIteration) is held back and raised when the
consumer reaches its position, as it would have been without the lookahead; after it the
iterator is exhausted, as a generator is. KeyboardInterrupt and other BaseExceptions are not
held back. `on_pull` must not raise; if it does the error is dropped.
Thread safety: none needed; a DataLoader iterator is used from one thread.

`StatefulLookaheadIterator` is the same over a source that reports its position through
`state_dict()` / `load_state_dict()` (torchdata's `Stateful` protocol, through which
StatefulDataLoader checkpoints its sampler): its own `state_dict()` is the source's state at
the consumer's position, not at the lookahead's. `stateful(source)` tells which one to use.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, Iterator, Optional


class LookaheadIterator:
    __slots__ = ("_source", "_ahead", "_buffer", "_exhausted", "_error", "_on_pull", "context",
                 "__weakref__")

    def __init__(self, source: Iterator[Any], ahead: int,
                 on_pull: Callable[[Any], None], context: Any = None) -> None:
        self._source = source
        self._ahead = max(0, int(ahead))
        self._buffer: Deque[Any] = deque()
        self._exhausted = False
        self._error: Optional[Exception] = None
        self._on_pull = on_pull
        self.context = context  # whatever the owner wants to keep with it (its stream)

    @property
    def source(self) -> Iterator[Any]:
        return self._source

    @property
    def exhausted(self) -> bool:
        """True once the source has ended and every item pulled has been returned."""
        return self._exhausted and not self._buffer

    def __iter__(self) -> "LookaheadIterator":
        return self

    def __next__(self) -> Any:
        buffer = self._buffer
        if not self._exhausted:
            want = self._ahead + 1
            while len(buffer) < want:
                try:
                    item = self._pull()
                except StopIteration:
                    self._exhausted = True
                    break
                except Exception as e:  # raised when the consumer gets to it
                    self._exhausted = True
                    self._error = e
                    break
                buffer.append(item)
                try:
                    self._on_pull(item)
                except Exception:
                    pass
        if buffer:
            return buffer.popleft()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        raise StopIteration

    def _pull(self) -> Any:
        return next(self._source)


def stateful(source: Any) -> bool:
    """Whether `source` has the methods of torchdata's `Stateful` protocol (which torchdata
    checks the same way, by their presence)."""
    return (callable(getattr(source, "state_dict", None))
            and callable(getattr(source, "load_state_dict", None)))


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class StatefulLookaheadIterator(LookaheadIterator):
    """A LookaheadIterator whose `state_dict()` is the source's state as the consumer left it:
    the source's `state_dict()` is taken before each pull and kept with the item until the
    consumer has it, so a checkpoint taken after k items resumes after exactly k items. (The
    states are kept as returned, not copied: a source must return a new object each time,
    as torchdata's own iterators do and as torchdata itself assumes when it keeps them.)
    A `state_dict()` of the source that raises is raised again when asked for at that position.
    Having the protocol's two methods, it is `Stateful` to torchdata exactly when its source is
    (so make one only for a `stateful` source)."""

    __slots__ = ("_states",)

    def __init__(self, source: Iterator[Any], ahead: int,
                 on_pull: Callable[[Any], None], context: Any = None) -> None:
        super().__init__(source, ahead, on_pull, context)
        self._states: Deque[Any] = deque()  # the source's state before each buffered item

    def _pull(self) -> Any:
        try:
            state = self._source.state_dict()  # type: ignore[attr-defined]
        except Exception as e:
            state = _Failed(e)
        item = next(self._source)
        self._states.append(state)
        return item

    def __next__(self) -> Any:
        item = super().__next__()
        self._states.popleft()
        return item

    def state_dict(self) -> Any:
        if not self._buffer:  # the consumer has had every item pulled: it is where the source is
            return self._source.state_dict()  # type: ignore[attr-defined]
        state = self._states[0]
        if isinstance(state, _Failed):
            raise state.error
        return state

    def load_state_dict(self, state_dict: Any) -> None:
        """Moves the source; the items pulled ahead are dropped (torchdata does not call it:
        it restores a fresh iterator of the sampler, which the hook wraps at its first pull)."""
        self._buffer.clear()
        self._states.clear()
        self._exhausted = False
        self._error = None
        self._source.load_state_dict(state_dict)  # type: ignore[attr-defined]
