"""open() with no terminal check for files of a cubetorchfs mount.

Before Python 3.14, `open()` with the default buffering asks the new file whether it is a
terminal (`isatty()`: a TCGETS ioctl), to choose line buffering. On a FUSE mount that ioctl is a
round trip to the daemon: about half of what a warm open-read-close of a small file costs, and
the only request left on that path once the kernel holds the file's pages. A file of a
cubetorchfs mount is never a terminal, and line buffering only changes writes, so a call that
opens such a file for reading with the default buffering gets the buffer size `open()` would
have chosen (the st_blksize the daemon reports) passed in: the same file object, no ioctl.
Every other call reaches the original `open()` unchanged.

`builtins.open` and `io.open` (one function, as before) are replaced at `import cube_torch`,
and in every process that imports it (spawned DataLoader workers do); CUBE_TORCH_PATCH_OPEN=0
leaves them alone, unless the batch mode (_batch.py) is chosen: its files are served from
memory through the same replacement. The mounts are read from /proc/self/mountinfo at most once a second. A
relative path counts as on a mount if the working directory was on one at that reading.
"""

from __future__ import annotations

import builtins
import functools
import io
import os
import sys
import threading
import time
from typing import Any, Callable, Optional, Tuple

from . import _client, _paths

MOUNT_TYPE = "fuse.cubetorchfs"
# st_blksize of every file of a cubetorchfs mount (fuse/fuse_ops.cc): what open() picks.
MOUNT_BLKSIZE = 4096
REFRESH_S = 1.0
# Modes that only read: the terminal check decides nothing for them.
READ_MODES = frozenset({"r", "rb", "br", "rt", "tr"})

_mountinfo = "/proc/self/mountinfo"
_original: Optional[Callable[..., Any]] = None
_serve: Optional[Callable[..., Any]] = None  # the batch mode's files (install's `serve`)
_lock = threading.Lock()
# (monotonic time of the next reading, mount points as prefixes, cwd on a mount)
_state: Tuple[float, Tuple[str, ...], bool] = (0.0, (), False)
skipped_checks = 0  # opens given the buffer size, in this process (for tests and benches)


def _read_mounts(now: float) -> Tuple[float, Tuple[str, ...], bool]:
    global _state
    with _lock:
        if now < _state[0]:
            return _state
        table = _client.mount_table(_mountinfo) or []
        points = [p for p, kind in table if kind == MOUNT_TYPE]
        prefixes = tuple(p if p.endswith("/") else p + "/" for p in points)
        try:
            cwd = os.getcwd()
        except OSError:
            cwd = ""
        cwd_on = bool(cwd) and any(_client.is_under(cwd, p) for p in points)
        _state = (now + REFRESH_S, prefixes, cwd_on)
        return _state


def on_mount(path: str) -> bool:
    """Whether `path` names a file of a cubetorchfs mount (as of the last reading)."""
    state = _state
    now = time.monotonic()
    if now >= state[0]:
        state = _read_mounts(now)
    if path.startswith("/"):
        return path.startswith(state[1])
    return state[2]


def installed() -> bool:
    return _original is not None and builtins.open is not _original


def install(serve: Optional[Callable[..., Any]] = None) -> bool:
    """Replaces builtins.open and io.open; False where nothing is to gain (Python 3.14 and later
    skip the check for regular files, or CUBE_TORCH_PATCH_OPEN=0) and no `serve` is given.
    `serve(path, mode, encoding, errors, newline)`: the batch mode's files (_batch.serve_open),
    a file object or None; asked first for each open of a str path for reading."""
    global _original, _serve
    check = sys.version_info < (3, 14) and os.environ.get("CUBE_TORCH_PATCH_OPEN", "1").strip() \
        .lower() not in ("0", "false", "no", "off")
    if not check and serve is None:
        return False
    if serve is not None:
        _serve = serve
    if installed():
        return True
    original = builtins.open
    _original = original

    @functools.wraps(original)
    def open(file: Any, mode: str = "r", buffering: int = -1, encoding: Optional[str] = None,
             errors: Optional[str] = None, newline: Optional[str] = None, closefd: bool = True,
             opener: Optional[Callable[..., int]] = None) -> Any:
        global skipped_checks
        serve = _serve
        if type(mode) is str and mode in READ_MODES and (
                serve is not None or (check and buffering == -1)):
            path = file if type(file) is str else _paths.as_path(file)
            if path is not None:
                if serve is not None and opener is None:
                    served = serve(path, mode, encoding, errors, newline)
                    if served is not None:
                        return served
                if check and buffering == -1 and on_mount(path):
                    buffering = MOUNT_BLKSIZE
                    skipped_checks += 1
        return original(file, mode, buffering, encoding, errors, newline, closefd, opener)

    builtins.open = open
    io.open = open
    return True


def uninstall() -> None:
    global _original, _serve
    _serve = None
    if _original is not None:
        builtins.open = _original
        io.open = _original
        _original = None
