"""The batch mode: each DataLoader worker takes a batch's files from the daemon in one request
and serves the dataset's opens of those paths from memory, with no FUSE request per file.

Chosen with USE_BATCH_DOWNLOAD=1 (the original cube_torch's variable) or
CUBE_TORCH_MODE=batch. In a DataLoader worker, before the dataset's __getitem__ runs for a
batch, the worker maps the batch's indices to paths (as the publisher does), and asks the
daemon of each cubetorchfs mount holding some of them for those files (POST /v1/files/batch on
its unix socket). The daemon checks each file for this process's user as the mount would, and
answers with one sealed memory file holding their bytes. While the batch is fetched, an
`open()` for reading (builtins.open and io.open: PIL, torch.load, plain open) or a
`cv2.imread` of one of those paths gets its bytes from that memory; each path once. Anything
else (another path, a write, a file the daemon did not give, a second open of the same path)
goes to the file system unchanged. When the batch is fetched the memory is dropped.

Nothing of this runs outside DataLoader workers (the main process publishes, as in the
prefetch mode, so the daemon has the files in RAM when the workers ask), for datasets without
a path mapping, or for files outside cubetorchfs mounts. A daemon that does not answer costs
the batch nothing but the request: its files are read through the mount.
"""

from __future__ import annotations

import io
import os
import socket
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from . import _client, _common, _paths

MODE_VARS = ("USE_BATCH_DOWNLOAD", "CUBE_TORCH_MODE")
MAX_FILES = 4096  # a request's files: the daemon's bound
TIMEOUT_S = 10.0  # a batch request; past it the batch is read through the mount
RETRY_AFTER_S = 5.0  # after a daemon failed to answer, its batches go through the mount
MAX_REPLY_BYTES = 4 << 20

# Counters of this process (for tests and stats): batches asked, files served from memory,
# files asked for and not given (read through the mount), requests that failed.
counters: Dict[str, int] = {"batches": 0, "served": 0, "missed": 0, "failed": 0}

_lock = threading.Lock()
# path as the dataset will open it -> (the batch's bytes, offset, size): the current batch's
# files. The memory file is read in one call (a mapping cost a page fault per page, and its
# unmapping as much again).
_files: Dict[str, Tuple[bytes, int, int]] = {}
_down_until: Dict[str, float] = {}  # control socket -> no request before this time
_daemons: Optional[List[_client.Daemon]] = None


def enabled() -> bool:
    """Whether the batch mode was chosen (read each time: tests set it)."""
    v = os.environ.get("USE_BATCH_DOWNLOAD", "").strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    return os.environ.get("CUBE_TORCH_MODE", "").strip().lower() == "batch"


class BatchFile(io.BytesIO):
    """A file served from a batch: io.BytesIO with the `name` and `mode` of the file asked."""

    def __init__(self, data: bytes, name: str, mode: str) -> None:
        super().__init__(data)
        self.name = name
        self.mode = mode


def take(path: str) -> Optional[bytes]:
    """The bytes of `path` if the current batch holds it, once; None otherwise."""
    if not _files:
        return None
    with _lock:
        got = _files.pop(path, None)
    if got is None:
        return None
    data, offset, size = got
    counters["served"] += 1
    return data[offset:offset + size]


def serve_open(path: str, mode: str, encoding: Optional[str], errors: Optional[str],
               newline: Optional[str]) -> Optional[Any]:
    """open() of `path` for reading from the current batch, or None (open it for real)."""
    data = take(path)
    if data is None:
        return None
    binary = "b" in mode
    f = BatchFile(data, path, "rb" if binary else "r")
    if binary:
        return f
    return io.TextIOWrapper(f, encoding=encoding, errors=errors, newline=newline)


_cv2_original: Optional[Any] = None


def _patch_cv2() -> None:
    """Serves cv2.imread of the batch's files from memory (cv2.imdecode of the bytes), once
    cv2 is imported; a no-op after the first time. Called in workers before each batch."""
    global _cv2_original
    cv2 = sys.modules.get("cv2")
    if cv2 is None or _cv2_original is not None:
        return
    original = getattr(cv2, "imread", None)
    decode = getattr(cv2, "imdecode", None)
    if original is None or decode is None or getattr(original, "_cube_torch_batch", False):
        return
    import numpy
    color = getattr(cv2, "IMREAD_COLOR", 1)

    def imread(filename: Any, *args: Any, **kwargs: Any) -> Any:
        # imread(filename[, flags]) alone: other forms (an output array) go to OpenCV as asked.
        if len(args) + len(kwargs) <= 1 and (not kwargs or "flags" in kwargs) and (
                not args or isinstance(args[0], int)):
            path = filename if type(filename) is str else _paths.as_path(filename)
            data = take(path) if path is not None else None
            if data is not None:
                flags = args[0] if args else kwargs.get("flags", color)
                # An image OpenCV cannot decode gives None, as imread does.
                return decode(numpy.frombuffer(data, dtype=numpy.uint8), flags)
        return original(filename, *args, **kwargs)

    imread._cube_torch_batch = True  # type: ignore[attr-defined]
    imread.__wrapped__ = original  # type: ignore[attr-defined]
    cv2.imread = imread
    _cv2_original = original


# directory -> the daemon whose mount holds it (None: none), memoized: a dataset's files share
# a few thousand directories, and daemon_for resolves symlinks (syscalls) on each call.
_dir_daemon: Dict[str, Optional[_client.Daemon]] = {}
_MAX_DIRS = 1 << 16


def _daemon_for(path: str) -> Optional[_client.Daemon]:
    global _daemons
    if _daemons is None:
        _daemons = _client.live_daemons(_common.config_dir(), _common.vol_name() or None)
    head = path.rpartition("/")[0]
    if head in _dir_daemon:
        return _dir_daemon[head]
    if len(_dir_daemon) >= _MAX_DIRS:
        _dir_daemon.clear()
    d = _dir_daemon[head] = _client.daemon_for(path, _daemons)
    return d


def _request(daemon: _client.Daemon, raw: bytes) -> Tuple[Dict[str, Any], Optional[int]]:
    """POST /v1/files/batch on `daemon`'s socket: the reply's JSON and its descriptor."""
    path = daemon.control_socket
    if not _client.control_socket_trusted(path):
        raise _client.ControlError(f"untrusted control socket {path}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: List[int] = []
    try:
        sock.settimeout(TIMEOUT_S)
        sock.connect(path)
        head = ("POST /v1/files/batch HTTP/1.1\r\nHost: cubetorchfs\r\n"
                "Content-Type: application/octet-stream\r\n"
                f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n").encode()
        sock.sendall(head + raw)
        data, fds, _, _ = socket.recv_fds(sock, 65536, 1)
        reply = bytearray(data)
        while data and len(reply) <= MAX_REPLY_BYTES:
            data = sock.recv(65536)
            reply += data
    except OSError as e:
        for fd in fds:
            os.close(fd)
        raise _client.ControlError(f"POST /v1/files/batch: {e!r}") from None
    finally:
        sock.close()
    head_end = reply.find(b"\r\n\r\n")
    status_line = bytes(reply[:reply.find(b"\r\n")]).split(b" ")
    body = bytes(reply[head_end + 4:]) if head_end >= 0 else b""
    status = int(status_line[1]) if len(status_line) > 1 and status_line[1].isdigit() else 0
    try:
        parsed = _client.ControlClient._parse("POST", "/v1/files/batch", status, body)
    except _client.ControlError:
        for fd in fds:
            os.close(fd)
        raise
    if not isinstance(parsed.body, dict) or not isinstance(parsed.body.get("files"), list):
        for fd in fds:
            os.close(fd)
        raise _client.ControlError("POST /v1/files/batch: reply without files", status)
    return parsed.body, (fds[0] if fds else None)


def begin(dataset: Any, indices: List[Any]) -> None:
    """Fetches the files of `indices` of `dataset` for the opens that follow (end() drops
    them). Never raises: a batch that cannot be fetched is read through the mount."""
    try:
        _begin(dataset, indices)
    except Exception as e:  # the training loop never fails for the batch mode
        counters["failed"] += 1
        _common.warn_once("batch-failed", f"the batch mode failed ({e!r}): batches are read "
                          "through the mount")


def _begin(dataset: Any, indices: List[Any]) -> None:
    mapper = _paths.mapper_for(dataset)
    if mapper is None:
        return
    singles = getattr(mapper, "singles", None)
    paths: Optional[List[str]] = None
    if singles is not None and all(type(i) is int and i >= 0 for i in indices):
        paths = singles(indices)  # one path an index, mapped in bulk (as the publisher does)
    if paths is None:
        paths = []
        for i in indices:
            try:
                paths.extend(mapper(i))
            except Exception:
                continue
    # Grouped by the daemon whose mount holds them; each path sent as the dataset names it,
    # made absolute (the daemon takes absolute paths under its mount point).
    by_daemon: Dict[str, Tuple[_client.Daemon, List[str], List[str]]] = {}
    for p in paths[:MAX_FILES]:
        absolute = p if p.startswith("/") else os.path.abspath(p)
        d = _daemon_for(absolute)
        if d is None:
            continue
        entry = by_daemon.setdefault(d.control_socket, (d, [], []))
        entry[1].append(p)
        entry[2].append(absolute)
    now = time.monotonic()
    for sock_path, (daemon, asked, absolute) in by_daemon.items():
        if now < _down_until.get(sock_path, 0.0):
            continue
        raw = b"".join(os.fsencode(a) + b"\0" for a in absolute)
        try:
            reply, fd = _request(daemon, raw)
        except _client.ControlError:
            counters["failed"] += 1
            _down_until[sock_path] = time.monotonic() + RETRY_AFTER_S
            continue
        counters["batches"] += 1
        files = reply["files"]
        data = b""
        try:
            size = int(reply.get("bytes", 0))
            if fd is not None and size > 0:
                data = _read_all(fd, min(size, os.fstat(fd).st_size))
        except (OSError, ValueError, TypeError):
            data = b""
        finally:
            if fd is not None:
                os.close(fd)
        with _lock:
            for name, entry in zip(asked, files):
                if (data and isinstance(entry, dict) and "offset" in entry
                        and 0 <= entry["offset"] <= entry["offset"] + entry["size"] <= len(data)):
                    _files[name] = (data, int(entry["offset"]), int(entry["size"]))
                else:
                    counters["missed"] += 1


def _read_all(fd: int, size: int) -> bytes:
    """The first `size` bytes of the memory file `fd` (sealed: it cannot change)."""
    data = os.pread(fd, size, 0)
    if len(data) == size:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        more = os.pread(fd, size - got, got)
        if not more:
            raise OSError(f"the batch's memory file ends at {got} of {size} bytes")
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def end() -> None:
    """Drops the current batch's files (those not opened go unused)."""
    with _lock:
        _files.clear()


def installed() -> bool:
    try:
        from torch.utils.data._utils import fetch as _fetch
    except ImportError:
        return False
    return getattr(_fetch._MapDatasetFetcher.fetch, "_cube_torch_batch", False)


def install() -> bool:
    """Wraps the map-style dataset fetcher of DataLoader workers when the batch mode is chosen;
    True if wrapped (now or before)."""
    if not enabled():
        return False
    try:
        from torch.utils.data._utils import fetch as _fetch
    except ImportError:
        return False
    cls = _fetch._MapDatasetFetcher
    original = cls.fetch
    if getattr(original, "_cube_torch_batch", False):
        return True

    def fetch(self: Any, possibly_batched_index: Any) -> Any:
        from torch.utils.data import get_worker_info
        if get_worker_info() is None:  # the main process (num_workers=0): nothing changes
            return original(self, possibly_batched_index)
        indices = list(possibly_batched_index) if self.auto_collation else [possibly_batched_index]
        if _cv2_original is None:
            _patch_cv2()
        begin(self.dataset, indices)
        try:
            return original(self, possibly_batched_index)
        finally:
            end()

    fetch._cube_torch_batch = True  # type: ignore[attr-defined]
    fetch.__wrapped__ = original  # type: ignore[attr-defined]
    cls.fetch = fetch
    return True
