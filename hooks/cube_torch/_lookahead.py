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
                    item = next(self._source)
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
