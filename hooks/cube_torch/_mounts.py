"""Which mount a path is on, and what to tell a user whose daemon does not answer.

`_MountFilter` finds the mount point a path lies under (a publish names only files inside the
daemon's mount); `probe_mount` tells a mount that answers from one that failed, is gone or
hangs; the two messages say what that means for training.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, List, Optional, Tuple

from . import _client

class _MountFilter:
    """Maps dataset paths to absolute paths inside one mount; None for paths outside it.
    A path that is outside as written is retried with its directory's symlinks resolved.
    Both are memoized per directory: a dataset's files share a few thousand directories, so a
    path costs a split and a dict lookup, not a normpath and an abspath."""

    _MAX_DIRS = 1 << 16

    def __init__(self) -> None:
        self._dirs: Dict[str, str] = {}  # directory -> the same with its symlinks resolved
        # (absolute directory as written, mount point) -> its normalized form inside the
        # mount, or "" when it is outside (as written and resolved)
        self._inside: Dict[Tuple[str, str], str] = {}

    def inside(self, path: str, mount_point: str) -> Optional[str]:
        head, sep, tail = path.rpartition("/")
        if sep and head.startswith("/") and tail not in ("", ".", ".."):
            key = (head, mount_point)
            d = self._inside.get(key)
            if d is None:
                if len(self._inside) >= self._MAX_DIRS:
                    self._inside.clear()
                q = self._slow(path, mount_point)
                d = "" if q is None else q[:len(q) - len(tail) - 1]
                if q is not None and not _client.is_under(d, mount_point):
                    return q  # the mount point itself: its directory is outside
                self._inside[key] = d
            return d + "/" + tail if d else None
        return self._slow(path, mount_point)

    def _slow(self, path: str, mount_point: str) -> Optional[str]:
        p = os.path.normpath(os.path.abspath(path))
        if _client.is_under(p, mount_point):
            return p
        head, tail = os.path.split(p)
        real = self._dirs.get(head)
        if real is None:
            if len(self._dirs) >= self._MAX_DIRS:
                self._dirs.clear()
            try:
                real = os.path.realpath(head)
            except OSError:
                real = head
            self._dirs[head] = real
        q = os.path.join(real, tail)
        return q if _client.is_under(q, mount_point) else None


def _elsewhere_message(sample_path: str, daemons: List[_client.Daemon], where: str,
                       vol: str) -> str:
    """The warning for a dataset under none of the mounts the control files in `where`
    announce: which mount it is really on, and which ones those files announce."""
    announced = ", ".join(sorted(d.mount_point for d in daemons))
    files = f"the control file{'s' if len(daemons) > 1 else ''} in {where}" + (
        f" for VOL_NAME={vol}" if vol else "")
    holder = _client.mount_of(sample_path)
    if holder is None:
        return (f"{sample_path} is under none of the mounts that {files} announce"
                f"{'s' if len(daemons) == 1 else ''} ({announced}); its DataLoader's files "
                "are not published")
    point, fstype = holder
    if fstype == CUBETORCHFS_FSTYPE:
        return (f"{sample_path} is on the cubetorchfs mount {point}, but {files} announce"
                f"{'s' if len(daemons) == 1 else ''} only {announced}: {point}'s daemon "
                "writes its control file elsewhere (set CUBE_TORCH_CONFIG_DIR to that "
                "directory" + (", or VOL_NAME to its volume" if vol else "") + "); its "
                "DataLoader's files are not published")
    return (f"{sample_path} is on {point} ({fstype}), not on the cubetorchfs mount"
            f"{'s' if len(daemons) > 1 else ''} that {files} announce"
            f"{'s' if len(daemons) == 1 else ''} ({announced}); its DataLoader's files are not "
            "published")


CUBETORCHFS_FSTYPE = "fuse.cubetorchfs"
MOUNT_PROBE_S = 1.0  # how long the stat of a mount root may take before it counts as hung


def probe_mount(mount_point: str, timeout: float = MOUNT_PROBE_S) -> Tuple[str, Optional[OSError]]:
    """Whether `mount_point` still answers, as a stat of its root tells within `timeout`
    seconds (on a thread of its own, left behind if it hangs): ("answers", None), ("failed",
    the error), ("unmounted", None) when the directory is no longer a mount point (the
    supervisor unmounted), or ("hung", None)."""
    result: List[Any] = []

    def stat() -> None:
        try:
            os.stat(mount_point)
            mounted = os.path.ismount(os.path.realpath(mount_point))
            result.append("answers" if mounted else "unmounted")
        except OSError as e:
            result.append(e)

    thread = threading.Thread(target=stat, name="cube_torch-mount-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if not result:
        return "hung", None
    if isinstance(result[0], OSError):
        return "failed", result[0]
    return result[0], None


def _daemon_silent_message(mount: str, stream_name: str,
                           probed: Optional[Tuple[str, Optional[OSError]]] = None) -> str:
    """What a daemon that does not answer (no socket, refused, timed out) means for the
    training loop: that depends on whether its mount still answers (`probed`: probe_mount's
    answer already had)."""
    state, error = probed if probed is not None else probe_mount(mount)
    again = "asking the daemon again shortly"
    if state == "answers":
        # A supervisor keeps the mount while it starts a new daemon, or the daemon is slow.
        return (f"the files of {stream_name} are not prefetched while the daemon of {mount} "
                f"does not answer; the mount itself still answers, so training goes on, "
                f"reading through it; {again}")
    if state == "failed":
        assert error is not None
        why = error.strerror or repr(error)
        return (f"the daemon of {mount} does not answer and the mount fails ({why}): "
                f"prefetching is off, and every read through {mount} fails until the mount is "
                f"back (mount it again, or restart the daemon); {again}")
    if state == "unmounted":
        return (f"the daemon of {mount} is gone and {mount} is no longer mounted: prefetching "
                f"is off, and reads of the files of {stream_name} under {mount} fail until it "
                f"is mounted again; {again}")
    return (f"neither the daemon of {mount} nor the mount answers (a stat of {mount} took "
            f"over {MOUNT_PROBE_S:g} s): prefetching is off, and reads through {mount} wait or "
            f"fail until the daemon is back; {again}")
