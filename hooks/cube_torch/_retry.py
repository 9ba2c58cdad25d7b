"""A sample whose read failed because the daemon of its cubetorchfs mount went away is read
again once the mount answers, in the process that loads it (a DataLoader worker, or the loop
itself with num_workers=0).

When the daemon is killed or crashes, its supervisor starts the next one on the same mount
within a second or two (an upgrade hands over without this). The requests the dead process had
taken fail as the kernel decides (ENOTCONN, ECONNABORTED; ECANCELED for those given to the
dying process's queues on FUSE over io_uring), and a file opened through it or a name the
kernel still held from it that the new process could not adopt answers ESTALE until the
kernel looks the name up again. An unmodified training loop would die of that one sample. So torch's
fetch of a map-style dataset's samples (`_MapDatasetFetcher.fetch`) is wrapped: when it raises
an OSError of one of those errnos (anywhere in the exception's chain) for a file of a
cubetorchfs mount (or with no file named, the mounts of the samples' files, else every such
mount), the fetch waits until the mount answers a stat of its root, pauses (0.25 s, doubling
up to 2 s) and fetches the same indices again, at most 5 times. Every other error, and every
error of a file elsewhere, reaches the loop unchanged. An iterable dataset's fetch is not
retried (its iterator has moved on).

A retried fetch reads its samples again from the start: a dataset whose __getitem__ draws
random augmentations draws them again.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from typing import Any, Callable, List, Optional

from . import _client, _common, _open, _paths

RETRY_ERRNOS = frozenset({errno.ESTALE, errno.ENOTCONN, errno.ECONNABORTED, errno.ECANCELED})
MAX_RETRIES = 5
WAIT_S = 60.0  # how long a fetch waits for its mount to answer before the error goes through
POLL_S = 0.2
# After the mount answers, a pause before the next try (doubling from 0.25 s, at most 2 s):
# the new daemon makes the kernel drop the names it held from the old one beside serving.
BACKOFF_S = 0.25

_lock = threading.Lock()
retried = 0  # fetches read again, in this process (for tests and stats)
_original: Optional[Callable[..., Any]] = None


def daemon_error(e: BaseException) -> Optional[OSError]:
    """The OSError of a dead daemon in `e`'s chain (its cause and context), if any."""
    seen = 0
    cur: Optional[BaseException] = e
    while cur is not None and seen < 16:
        if isinstance(cur, OSError) and cur.errno in RETRY_ERRNOS:
            return cur
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return None


def _mounts() -> list:
    table = _client.mount_table(_open._mountinfo) or []
    return [p for p, kind in table if kind == _open.MOUNT_TYPE]


def mounts_of(e: OSError, dataset: Any, index: Any) -> List[str]:
    """The cubetorchfs mounts to wait for: the one holding e.filename; with no file named (a
    read of a file opened before), those holding the files of the samples fetched, else every
    cubetorchfs mount. Empty: the file is not on one (the error is not ours to retry)."""
    points = _mounts()
    if not points:
        return []
    name = e.filename
    if isinstance(name, bytes):
        name = os.fsdecode(name)
    if isinstance(name, str) and name:
        path = os.path.abspath(name)
        holding = [p for p in points if _client.is_under(path, p)]
        return [max(holding, key=len)] if holding else []
    found = set()
    try:
        mapper = _paths.mapper_for(dataset)
        indices = index if isinstance(index, (list, tuple)) else [index]
        for i in indices if mapper is not None else ():
            for p in mapper(i):
                holding = [m for m in points if _client.is_under(os.path.abspath(p), m)]
                if holding:
                    found.add(max(holding, key=len))
    except Exception:
        found.clear()
    return sorted(found) or points


def _answers(mount: str, deadline: float) -> bool:
    from ._publisher import probe_mount  # the publisher's probe: a stat on a thread of its own
    while True:
        state, _ = probe_mount(mount)
        if state == "answers":
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def _patched_fetch(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def fetch(self: Any, possibly_batched_index: Any) -> Any:
        global retried
        for attempt in range(MAX_RETRIES + 1):
            try:
                return original(self, possibly_batched_index)
            except Exception as e:
                err = daemon_error(e)
                if err is None or attempt == MAX_RETRIES or _common.disabled():
                    raise
                mounts = mounts_of(err, getattr(self, "dataset", None), possibly_batched_index)
                deadline = time.monotonic() + WAIT_S
                if not mounts or not all(_answers(m, deadline) for m in mounts):
                    raise
                time.sleep(min(2.0, BACKOFF_S * 2 ** attempt))
                with _lock:
                    retried += 1
                if _common.verbose():
                    _common.warn_once(
                        "retry", f"a sample's read failed with {errno.errorcode.get(err.errno)} "
                        f"(the daemon of {', '.join(mounts)} went away); read again once the "
                        "mount answered")
        raise AssertionError("unreachable: the last attempt returns or raises")
    fetch._cube_torch_original = original  # type: ignore[attr-defined]
    return fetch


def install() -> bool:
    """Wraps torch's map-style fetcher; True if wrapped (now or before)."""
    global _original
    try:
        from torch.utils.data._utils import fetch as fetch_module
    except Exception:
        return False
    cls = getattr(fetch_module, "_MapDatasetFetcher", None)
    method = getattr(cls, "fetch", None) if cls is not None else None
    if method is None:
        return False
    if getattr(method, "_cube_torch_original", None) is not None:
        return True
    _original = method
    cls.fetch = _patched_fetch(method)
    return True
