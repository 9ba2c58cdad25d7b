"""Finding a cubetorchfs daemon, and talking to it over its control socket.

A daemon announces itself with a control file, `<dir>/cube_torch.config.<vol_name>` (dir:
CUBE_TORCH_CONFIG_DIR, default /tmp), holding JSON
`{"vol_name", "mount_point", "prof", "local_ip", "control_socket", "metrics_port", "pid",
"version"}`. With VOL_NAME set, that volume's file is the only one considered; otherwise the
daemon whose mount point holds the dataset's files is chosen (the deepest mount wins).

The directory is usually /tmp, where any local user can put a file of that name, so a control
file is trusted only as a daemon leaves it: not a symlink (opened with O_NOFOLLOW), a regular
file with one link, owned by root or by this user (real or effective uid), not writable by
group or others. Its socket likewise: a socket, not a symlink, owned by root or this user, in
a directory owned by root or this user that others cannot write to unless sticky. Anything
else is ignored after one warning naming the path and its owner (docs/permissions.md).

`ControlClient` speaks the /v1 API (HTTP/1.1 + JSON over the unix socket). Every call is
bounded by a socket timeout (`TIMEOUT_S`) and returns a `Reply` or raises `ControlError`;
nothing else escapes. A client is meant for one thread at a time.
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import re
import socket
import struct
import stat
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from . import _common

TIMEOUT_S = 2.0
MAX_REPLY_BYTES = 16 << 20


@dataclass(frozen=True)
class Daemon:
    """What a control file says about one running daemon."""

    vol_name: str
    mount_point: str  # absolute and normalized, without a trailing slash (except "/")
    control_socket: str
    pid: int = 0
    prof: Any = None
    metrics_port: Any = None
    local_ip: str = ""
    version: str = ""
    control_file: str = ""


def _trusted_uid(uid: int) -> bool:
    return uid == 0 or uid == os.getuid() or uid == os.geteuid()


def _owner(uid: int) -> str:
    try:
        import pwd
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError, OSError):
        return f"uid {uid}"


# Paths found untrusted since the latest live_daemons() scan (their warning is given already):
# a set, so reconnects to one untrusted socket do not grow it; the publisher thread and the
# caller's thread both touch it.
_last_untrusted: Set[str] = set()
_untrusted_lock = threading.Lock()


def last_untrusted() -> List[str]:
    with _untrusted_lock:
        return sorted(_last_untrusted)


def _untrusted(path: str, why: str) -> None:
    with _untrusted_lock:
        _last_untrusted.add(path)
    _common.warn_once("untrusted:" + path, f"ignoring {why}: a cubetorchfs daemon (root's or "
                      "your own) never leaves it so; nothing is published through it")


def read_trusted_control_file(path: str) -> Optional[bytes]:
    """The bytes of the control file at `path` if it may be trusted (see the top of this
    module), else None; a file present but untrusted gets one warning."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            try:
                owner = _owner(os.lstat(path).st_uid)
            except OSError:
                owner = "unknown"
            _untrusted(path, f"control file {path}: a symlink (owned by {owner})")
        return None
    try:
        st = os.fstat(fd)
        owner = _owner(st.st_uid)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            _untrusted(path, f"control file {path}: not a plain file (owned by {owner})")
            return None
        if not _trusted_uid(st.st_uid):
            _untrusted(path, f"control file {path}: owned by {owner}, neither root nor you")
            return None
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            _untrusted(path, f"control file {path}: writable by group or others "
                             f"(mode {stat.S_IMODE(st.st_mode):04o}, owned by {owner})")
            return None
        chunks = []
        left = 1 << 20
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def control_socket_trusted(sock: str) -> bool:
    """False, after one warning, if `sock` exists but is not a socket of root or this user
    (or is a symlink), or sits in a directory others may write to (unless sticky). An absent
    socket is not judged here: connecting to it fails as for a daemon gone."""
    try:
        st = os.lstat(sock)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    # The owner's name only for a warning: looking it up reads the user database.
    if stat.S_ISLNK(st.st_mode):
        _untrusted(sock, f"control socket {sock}: a symlink (owned by {_owner(st.st_uid)})")
        return False
    if not stat.S_ISSOCK(st.st_mode):
        _untrusted(sock, f"control socket {sock}: not a socket (owned by {_owner(st.st_uid)})")
        return False
    if not _trusted_uid(st.st_uid):
        _untrusted(sock, f"control socket {sock}: owned by {_owner(st.st_uid)}, neither root "
                         "nor you")
        return False
    parent = os.path.dirname(sock) or "."
    try:
        d = os.stat(parent)
    except OSError:
        return False
    if not _trusted_uid(d.st_uid) or (
            d.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not d.st_mode & stat.S_ISVTX):
        _untrusted(sock, f"control socket {sock}: its directory {parent} (owned by "
                         f"{_owner(d.st_uid)}) lets other users replace it")
        return False
    return True


def parse_control_file(path: str) -> Optional[Daemon]:
    """The daemon a control file describes, or None if untrusted, unreadable or incomplete."""
    try:
        raw = read_trusted_control_file(path)
        if raw is None:
            return None
        data = json.loads(raw)
        mount = data["mount_point"]
        sock = data["control_socket"]
        if not isinstance(mount, str) or not mount or not isinstance(sock, str) or not sock:
            return None
        if not control_socket_trusted(sock):
            return None
        pid = int(data.get("pid") or 0)
        return Daemon(
            vol_name=str(data.get("vol_name", "")),
            mount_point=os.path.normpath(os.path.abspath(mount)),
            control_socket=sock,
            pid=pid,
            prof=data.get("prof"),
            metrics_port=data.get("metrics_port"),
            local_ip=str(data.get("local_ip", "")),
            version=str(data.get("version", "")),
            control_file=path,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def pid_alive(pid: int) -> bool:
    """False only when `pid` certainly names no process (0 or absent counts as alive)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    except OSError:
        return True
    return True


def control_files(config_dir: Optional[str] = None, vol_name: Optional[str] = None) -> List[str]:
    """Paths of the control files present (cheap: one directory listing, nothing parsed)."""
    config_dir = config_dir if config_dir is not None else _common.config_dir()
    vol_name = vol_name if vol_name is not None else _common.vol_name()
    prefix = _common.CONTROL_FILE_PREFIX
    # Symlinks are listed (is_file follows them) so that parse_control_file warns about them.
    if vol_name:
        path = os.path.join(config_dir, prefix + vol_name)
        return [path] if os.path.isfile(path) else []
    try:
        with os.scandir(config_dir) as entries:
            return sorted(e.path for e in entries if e.name.startswith(prefix) and e.is_file())
    except OSError:
        return []


def live_daemons(config_dir: Optional[str] = None, vol_name: Optional[str] = None) -> List[Daemon]:
    """The daemons of the control files present whose process is alive."""
    out = []
    with _untrusted_lock:
        _last_untrusted.clear()
    for path in control_files(config_dir, vol_name):
        d = parse_control_file(path)
        if d is not None and pid_alive(d.pid):
            out.append(d)
    return out


def is_under(path: str, mount_point: str) -> bool:
    """Whether normalized absolute `path` lies in `mount_point`, component-wise."""
    if mount_point == "/":
        return path.startswith("/")
    return path == mount_point or path.startswith(mount_point + "/")


def daemon_for(path: str, daemons: Sequence[Daemon]) -> Optional[Daemon]:
    """The daemon whose mount holds `path` (tried as given, then with symlinks resolved)."""
    candidates = [os.path.normpath(os.path.abspath(path))]
    try:
        real = os.path.realpath(path)
        if real != candidates[0]:
            candidates.append(real)
    except OSError:
        pass
    for p in candidates:
        best = None
        for d in daemons:
            if is_under(p, d.mount_point) and (best is None or len(d.mount_point) > len(best.mount_point)):
                best = d
        if best is not None:
            return best
    return None


def _unescape_mountinfo(field: str) -> str:
    # The kernel writes space, tab, newline and backslash in a mount point as \ooo.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_table(mountinfo: str = "/proc/self/mountinfo") -> Optional[List[Tuple[str, str]]]:
    """(mount point, file system type) of every mount in `mountinfo` (the format of
    /proc/self/mountinfo), in its order; a cubetorchfs mount's type is "fuse.cubetorchfs".
    None if the table cannot be read."""
    # os.read, not open(): cube_torch's open() asks this table (see _open.py).
    try:
        fd = os.open(mountinfo, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        parts = []
        while True:
            part = os.read(fd, 1 << 16)
            if not part:
                break
            parts.append(part)
    except OSError:
        return None
    finally:
        os.close(fd)
    text = b"".join(parts).decode("utf-8", errors="replace")
    table: List[Tuple[str, str]] = []
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        fields = head.split()
        if not sep or len(fields) < 5 or not tail.split():
            continue
        table.append((os.path.normpath(_unescape_mountinfo(fields[4])), tail.split()[0]))
    return table


def mount_of(path: str, mountinfo: str = "/proc/self/mountinfo") -> Optional[Tuple[str, str]]:
    """(mount point, file system type) of the mount holding `path` (symlinks resolved), from
    `mountinfo` (see mount_table). None if the table cannot be read. Touches nothing under
    `path`'s mount but the symlinks on the way to it."""
    table = mount_table(mountinfo)
    if table is None:
        return None
    try:
        target = os.path.realpath(path)
    except (OSError, ValueError):
        target = os.path.normpath(os.path.abspath(path))
    best: Optional[Tuple[str, str]] = None
    for point, fstype in table:
        # Later lines are mounted over earlier ones at the same point: the last one counts.
        if is_under(target, point) and (best is None or len(point) >= len(best[0])):
            best = (point, fstype)
    return best


def _quote(stream_id: str) -> str:
    return urllib.parse.quote(stream_id, safe="")


class ControlError(Exception):
    """A control request that failed: no socket, a timeout, an error status, a bad reply.

    ``status`` is the HTTP status (0 if none came); ``code`` the daemon's error code
    ("not_found", "permission_denied", ...; "" if none came) and ``errno`` its errno (0 if
    none); ``os_errno`` the local error when no reply came (ENOENT: no socket, ECONNREFUSED,
    ...; 0 otherwise)."""

    def __init__(self, message: str, status: int = 0, code: str = "", err: int = 0,
                 os_errno: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.errno = err
        self.os_errno = os_errno


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over an AF_UNIX stream socket."""

    def __init__(self, socket_path: str, timeout: float = TIMEOUT_S) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        if not control_socket_trusted(self.socket_path):  # checked again: it may have changed
            raise PermissionError(errno.EPERM, "untrusted control socket", self.socket_path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


@dataclass
class Reply:
    status: int
    body: Any  # parsed JSON, or None for an empty body


# Failures of a kept-alive connection the daemon may have closed in between; worth one retry
# on a fresh connection when the request went out on a reused one.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError,
          http.client.CannotSendRequest)


class ControlClient:
    """The /v1 API of one daemon, on one kept-alive connection."""

    def __init__(self, socket_path: str, timeout: float = TIMEOUT_S) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._conn: Optional[UnixHTTPConnection] = None

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass
            self._conn = None

    def request(self, method: str, url: str, body: Any = None, raw: Optional[bytes] = None) -> Reply:
        """One request; raises ControlError for anything but a 2xx reply with valid JSON.
        `raw`: a binary body (application/octet-stream) instead of JSON `body`."""
        payload = raw if raw is not None else (
            None if body is None else json.dumps(body, separators=(",", ":")).encode())
        kind = "application/octet-stream" if raw is not None else "application/json"
        for attempt in (0, 1):
            reused = self._conn is not None
            if self._conn is None:
                self._conn = UnixHTTPConnection(self.socket_path, self.timeout)
            try:
                headers = {"Content-Type": kind} if payload is not None else {}
                self._conn.request(method, url, body=payload, headers=headers)
                resp = self._conn.getresponse()
                data = resp.read(MAX_REPLY_BYTES + 1)
                status = resp.status
                if resp.will_close:
                    self.close()
            except _STALE as e:
                self.close()
                if reused and attempt == 0:
                    continue
                raise ControlError(f"{method} {url}: {e!r}") from None
            except (OSError, http.client.HTTPException, ValueError) as e:
                self.close()
                if isinstance(e, FileNotFoundError) or getattr(e, "errno", None) == errno.ENOENT:
                    raise ControlError(f"no control socket at {self.socket_path}",
                                       os_errno=errno.ENOENT) from None
                raise ControlError(f"{method} {url}: {e!r}",
                                   os_errno=getattr(e, "errno", 0) or 0) from None
            return self._parse(method, url, status, data)
        raise ControlError(f"{method} {url}: connection lost")  # not reached

    @staticmethod
    def _parse(method: str, url: str, status: int, data: bytes) -> Reply:
        if len(data) > MAX_REPLY_BYTES:
            raise ControlError(f"{method} {url}: reply over {MAX_REPLY_BYTES} bytes", status)
        parsed: Any = None
        bad_json = False
        if data.strip():
            try:
                parsed = json.loads(data)
            except ValueError:
                bad_json = True
        if not 200 <= status < 300:
            fields = parsed if isinstance(parsed, dict) else {}
            detail = fields.get("error")
            code = fields.get("code") if isinstance(fields.get("code"), str) else ""
            err = fields.get("errno") if isinstance(fields.get("errno"), int) else 0
            raise ControlError(f"{method} {url}: HTTP {status}" + (f" ({detail})" if detail else ""),
                               status, code, err)
        if bad_json:
            raise ControlError(f"{method} {url}: reply is not JSON", status)
        return Reply(status, parsed)

    # --- the /v1 API ---

    def create_stream(self, name: str, pid: int, list_id: Optional[str] = None,
                      mode: Optional[str] = None) -> str:
        """A new stream; `list_id`: the registered file list its positions name; `mode`:
        "batch" when the workers take the files through /v1/files/batch (the daemon then
        puts nothing into the page cache for it)."""
        body: Dict[str, Any] = {"name": name, "pid": pid}
        if list_id is not None:
            body["list"] = list_id
        if mode is not None:
            body["mode"] = mode
        reply = self.request("POST", "/v1/streams", body)
        sid = reply.body.get("id") if isinstance(reply.body, dict) else None
        if not isinstance(sid, (str, int)) or isinstance(sid, bool) or str(sid) == "":
            raise ControlError("POST /v1/streams: reply without an id", reply.status)
        return str(sid)

    def publish(self, stream_id: str, paths: Sequence[str],
                unread: Optional[int] = None) -> Dict[str, int]:
        """Returns {"accepted": n, "rejected": m}. `unread`: at most this many of the stream's
        latest positions, these paths included, are still to be read."""
        body: Dict[str, Any] = {"paths": list(paths)}
        if unread is not None:
            body["unread"] = int(unread)
        reply = self.request("POST", f"/v1/streams/{_quote(stream_id)}/paths", body)
        if reply.body is not None and not isinstance(reply.body, dict):
            raise ControlError("POST paths: reply is not a JSON object", reply.status)
        body = reply.body or {}
        try:
            accepted = int(body.get("accepted", len(paths)))
            rejected = int(body.get("rejected", 0))
        except (TypeError, ValueError):
            raise ControlError("POST paths: bad counts in reply", reply.status) from None
        return {"accepted": accepted, "rejected": rejected}

    def register_list(self, paths: Sequence[str], list_id: Optional[str] = None) -> Dict[str, Any]:
        """Registers `paths` as a new file list, or appends them to list `list_id`. Returns
        {"id", "first", "size", "rejected"}: the list, the number of the first path sent, the
        list's length after, and how many of these the daemon refused (they keep their
        numbers; positions naming them are ignored)."""
        return self.register_list_raw(b"".join(os.fsencode(p) + b"\0" for p in paths),
                                      len(paths), list_id)

    def register_list_raw(self, raw: bytes, count: int,
                          list_id: Optional[str] = None) -> Dict[str, Any]:
        """register_list() of `count` paths already encoded, each followed by a NUL."""
        url = "/v1/lists" if list_id is None else f"/v1/lists/{_quote(list_id)}"
        reply = self.request("POST", url, raw=raw)
        body = reply.body if isinstance(reply.body, dict) else {}
        try:
            out = {"id": str(body["id"]), "first": int(body["first"]), "size": int(body["size"]),
                   "rejected": int(body.get("rejected", 0))}
        except (KeyError, TypeError, ValueError):
            raise ControlError(f"POST {url}: reply without id, first and size",
                               reply.status) from None
        if out["size"] != out["first"] + count:
            raise ControlError(f"POST {url}: the list has {out['size']} entries, expected "
                               f"{out['first'] + count}", reply.status)
        return out

    def delete_list(self, list_id: str) -> None:
        self.request("DELETE", f"/v1/lists/{_quote(list_id)}")

    def publish_positions(self, stream_id: str, positions: bytes,
                          unread: Optional[int] = None) -> Dict[str, int]:
        """Publishes `positions` (little-endian 32-bit numbers in the stream's file list, as
        array('I').tobytes() makes them on a little-endian machine) to a stream created with a
        list. Returns {"accepted": n, "rejected": m}."""
        head = struct.pack("<Q", (1 << 64) - 1 if unread is None else int(unread))
        url = f"/v1/streams/{_quote(stream_id)}/positions"
        reply = self.request("POST", url, raw=head + positions)
        body = reply.body if isinstance(reply.body, dict) else {}
        try:
            return {"accepted": int(body.get("accepted", len(positions) // 4)),
                    "rejected": int(body.get("rejected", 0))}
        except (TypeError, ValueError):
            raise ControlError("POST positions: bad counts in reply", reply.status) from None

    def delete_stream(self, stream_id: str) -> None:
        self.request("DELETE", f"/v1/streams/{_quote(stream_id)}")

    def stats(self) -> Dict[str, Any]:
        reply = self.request("GET", "/v1/stats")
        if not isinstance(reply.body, dict):
            raise ControlError("GET /v1/stats: reply is not a JSON object", reply.status)
        return reply.body
