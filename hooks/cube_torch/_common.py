"""Environment settings and once-per-process warnings shared by the hook's modules.

Every setting is read when it is used, never at import time, so a test (or a program) may
change the environment after `import cube_torch`.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Any, Optional, Set, Tuple

DEFAULT_LOOKAHEAD_BATCHES = 16
DEFAULT_REPORT_S = 10.0
DEFAULT_CONFIG_DIR = "/tmp"
CONTROL_FILE_PREFIX = "cube_torch.config."


class CubeTorchWarning(RuntimeWarning):
    """Every warning the hook emits: prefetching is off for something. The hook itself never
    stops the training loop; each message says what happens to reads meanwhile."""


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def disabled() -> bool:
    """CUBE_TORCH_DISABLE=1: the hook does nothing at all."""
    return _flag("CUBE_TORCH_DISABLE")


def verbose() -> bool:
    return _flag("CUBE_TORCH_VERBOSE")


def lookahead_batches() -> int:
    """CUBE_TORCH_LOOKAHEAD_BATCHES (default 16; 0 publishes each batch as it is taken)."""
    try:
        return max(0, int(os.environ.get("CUBE_TORCH_LOOKAHEAD_BATCHES", "")))
    except ValueError:
        return DEFAULT_LOOKAHEAD_BATCHES


def report_s() -> float:
    """CUBE_TORCH_REPORT_S: seconds between verbose hit-rate lines (default 10, at least 0.1)."""
    try:
        return max(0.1, float(os.environ.get("CUBE_TORCH_REPORT_S", "")))
    except ValueError:
        return DEFAULT_REPORT_S


def config_dir() -> str:
    return os.environ.get("CUBE_TORCH_CONFIG_DIR") or DEFAULT_CONFIG_DIR


def vol_name() -> str:
    return os.environ.get("VOL_NAME", "")


_warned: Set[str] = set()
_warned_lock = threading.Lock()


# The user's line that last started iterating a DataLoader: where warnings raised on the
# publisher thread (whose own stack is threading.py's and ours) point instead.
_user_site: Optional[Tuple[str, int, dict]] = None


def remember_user_site() -> None:
    """Records the calling user's line (the first frame outside cube_torch and torch)."""
    global _user_site
    frame = _user_frame(sys._getframe(1))
    if frame is not None:
        _user_site = (frame.f_code.co_filename, frame.f_lineno, frame.f_globals)


def warn_once(key: str, message: str) -> None:
    """Emits `message` once per process per `key`, attributed to the user's line: the caller's
    own, or on a thread of ours the line that last started iterating a DataLoader. Never
    raises, even under `-W error`."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    text = "cube_torch: " + message
    try:
        frame = _user_frame(sys._getframe(1))
        site = (frame.f_code.co_filename, frame.f_lineno, frame.f_globals) if frame else _user_site
        if site is None:
            warnings.warn(text, CubeTorchWarning, stacklevel=2)
            return
        filename, lineno, module_globals = site
        warnings.warn_explicit(text, CubeTorchWarning, filename, lineno,
                               module=module_globals.get("__name__", "__main__"),
                               registry=module_globals.setdefault("__warningregistry__", {}),
                               module_globals=module_globals)
    except Exception:  # a filter turned warnings into errors: stay quiet rather than raise
        pass


def has_warned(key: str) -> bool:
    """Whether warn_once(key, ...) has spoken in this process: a caller may skip the work of
    composing a message that would not be shown."""
    with _warned_lock:
        return key in _warned


def _internal_dirs() -> tuple:
    dirs = [os.path.dirname(os.path.abspath(__file__))]
    data = sys.modules.get("torch.utils.data")
    if data is not None and getattr(data, "__file__", None):
        dirs.append(os.path.dirname(os.path.abspath(data.__file__)))
    return tuple(d + os.sep for d in dirs)


def _user_frame(frame: Any) -> Any:
    """The first frame from `frame` outwards outside cube_torch, torch.utils.data and the
    threading module; None when there is none (a thread of ours)."""
    skip = _internal_dirs()
    threading_file = os.path.abspath(threading.__file__)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(skip) and os.path.abspath(name) != threading_file:
            return frame
        frame = frame.f_back
    return None


def reset_warnings() -> None:
    """Forgets which warnings were given (after fork, and for tests)."""
    global _warned_lock, _user_site
    _warned.clear()
    _user_site = None
    _warned_lock = threading.Lock()
