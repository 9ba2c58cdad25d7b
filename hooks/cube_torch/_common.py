"""Environment settings and once-per-process warnings shared by the hook's modules.

Every setting is read when it is used, never at import time, so a test (or a program) may
change the environment after `import cube_torch`.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Set

DEFAULT_LOOKAHEAD_BATCHES = 16
DEFAULT_REPORT_S = 10.0
DEFAULT_CONFIG_DIR = "/tmp"
CONTROL_FILE_PREFIX = "cube_torch.config."


class CubeTorchWarning(RuntimeWarning):
    """Every warning the hook emits: the cache is off for something, training goes on."""


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


def warn_once(key: str, message: str) -> None:
    """Emits `message` once per process per `key`. Never raises, even under `-W error`."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    try:
        warnings.warn("cube_torch: " + message, CubeTorchWarning, stacklevel=_user_stacklevel())
    except Exception:  # a filter turned warnings into errors: stay quiet rather than raise
        pass


def _internal_dirs() -> tuple:
    dirs = [os.path.dirname(os.path.abspath(__file__))]
    data = sys.modules.get("torch.utils.data")
    if data is not None and getattr(data, "__file__", None):
        dirs.append(os.path.dirname(os.path.abspath(data.__file__)))
    return tuple(d + os.sep for d in dirs)


def _user_stacklevel() -> int:
    """The stacklevel (for a warn() in warn_once) of the first frame outside cube_torch and
    torch.utils.data: the user's line that iterated the DataLoader, where there is one."""
    skip = _internal_dirs()
    level = 2  # warn_once's caller
    frame = sys._getframe(2)
    while frame is not None and frame.f_back is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
        level += 1
    return level


def reset_warnings() -> None:
    """Forgets which warnings were given (after fork, and for tests)."""
    global _warned_lock
    _warned.clear()
    _warned_lock = threading.Lock()
