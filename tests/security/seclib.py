"""Helpers for the security tests: run a small client as an unprivileged user (setpriv), and a
world-traversable place to mount, so that user can reach the mount at all."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from cubefs_harness import CubeFactory

NOBODY = 65534
OTHER = 65533  # a second unprivileged user (no passwd entry needed)
THIRD = 65532  # a third one

# For the scripts run as another user (inline, so that user needs to read nothing of the
# repository): one POST over the unix socket `sock` whose reply may carry descriptors
# (SCM_RIGHTS: /v1/files/open, /v1/files/batch); the raw reply and the descriptors received.
POST_WITH_FDS = r'''
import socket, struct
def post_with_fds(sock, target, body, ctype=b"application/octet-stream"):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(sock)
    s.sendall(b"POST " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: "
              + ctype + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    data, fds = b"", []
    while True:
        msg, anc, _, _ = s.recvmsg(1 << 16, socket.CMSG_SPACE(4 * 4))
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += list(struct.unpack("%di" % (len(payload) // 4), payload))
        if not msg:
            break
        data += msg
    s.close()
    return data, fds
'''

# The client run as the other user: one request, the reply as JSON on stdout.
_CLIENT = POST_WITH_FDS + r'''
import base64, http.client, json, os, socket, struct, sys
spec = json.loads(sys.stdin.read())

class Unix(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=spec.get("timeout", 10))
        self._path = path
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)

def request(conn):
    body = spec.get("body")
    if body is not None and not isinstance(body, str):
        body = json.dumps(body)
    if "body_b64" in spec:  # a binary body
        body = base64.b64decode(spec["body_b64"])
    try:
        conn.request(spec.get("method", "POST"), spec["target"], body=body,
                     headers=spec.get("headers", {}))
        r = conn.getresponse()
        data = r.read()
        return {"status": r.status, "body": base64.b64encode(data).decode()}
    except Exception as e:
        return {"status": 0, "error": repr(e)}

def files_open():
    body = json.dumps({"path": spec["path"]}).encode()
    data, fds = post_with_fds(spec["socket"], b"/v1/files/open", body, b"application/json")
    head = data.split(b"\r\n", 1)[0].decode()
    first = b""
    for fd in fds:
        first = os.pread(fd, 64, 0)
        os.close(fd)
    return {"status": int(head.split()[1]), "fds": len(fds), "first": base64.b64encode(first).decode(),
            "body": base64.b64encode(data.split(b"\r\n\r\n", 1)[-1]).decode()}

kind = spec["kind"]
if kind == "unix":
    out = request(Unix(spec["socket"]))
elif kind == "tcp":
    out = request(http.client.HTTPConnection("127.0.0.1", spec["port"], timeout=spec.get("timeout", 10)))
elif kind == "open":
    out = files_open()
elif kind == "shell":
    p = __import__("subprocess").run(spec["argv"], capture_output=True, timeout=30)
    out = {"status": p.returncode, "body": base64.b64encode(p.stdout + p.stderr).decode()}
print(json.dumps(out))
'''


def as_user(spec: dict[str, Any], uid: int = NOBODY, timeout: float = 60) -> dict[str, Any]:
    """Runs one client request as `uid` (gid the same, no supplementary groups)."""
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "/usr/bin/python3", "-c", _CLIENT]
    p = subprocess.run(argv, input=json.dumps(spec).encode(), capture_output=True,
                       timeout=timeout, cwd="/")
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    out = json.loads(p.stdout)
    import base64
    if "body" in out:
        out["body"] = base64.b64decode(out["body"])
    if "first" in out:
        out["first"] = base64.b64decode(out["first"])
    return out


def start_script_as(code: str, spec: dict[str, Any], uid: int) -> subprocess.Popen[bytes]:
    """Starts `python3 -c code` as `uid` (gid the same, no supplementary groups) with `spec`
    as JSON on its stdin; script_result() collects what it prints."""
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "/usr/bin/python3", "-c", code]
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd="/")
    assert p.stdin is not None
    p.stdin.write(json.dumps(spec).encode())
    p.stdin.close()
    p.stdin = None  # communicate() must not touch it again
    return p


def script_result(p: subprocess.Popen[bytes], timeout: float = 60) -> Any:
    """The JSON a script started with start_script_as printed; it is killed after `timeout`."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"script ran past {timeout} s: {err.decode(errors='replace')}")
    assert p.returncode == 0, err.decode(errors="replace")
    return json.loads(out)


def shell_as(argv: list[str], uid: int = NOBODY) -> tuple[int, bytes]:
    out = as_user({"kind": "shell", "argv": argv}, uid)
    return out["status"], out["body"]


def parse_batch(body: bytes) -> list[tuple[str, bytes]]:
    """The framed /batchdownload reply: [(path, data), ...]."""
    import struct
    version, count = struct.unpack(">QQ", body[:16])
    assert version == 0
    off, out = 16, []
    for _ in range(count):
        (plen,) = struct.unpack(">Q", body[off:off + 8]); off += 8
        path = body[off:off + plen].decode(); off += plen
        (dlen,) = struct.unpack(">Q", body[off:off + 8]); off += 8
        out.append((path, body[off:off + dlen])); off += dlen
    assert off == len(body), (off, len(body))
    return out


@pytest.fixture
def open_cube() -> Iterator[CubeFactory]:
    """A CubeFactory under a directory every user may traverse (pytest's are root-only), whose
    daemons mount with allow_other, so unprivileged users can reach its mounts and their
    control API; everything is removed after the test."""
    base = Path(tempfile.mkdtemp(prefix="ctfs-sec-"))
    os.chmod(base, 0o755)
    factory = CubeFactory(base / "cube", ["-o", "allow_other"])
    (base / "cube").mkdir()
    os.chmod(base / "cube", 0o755)
    try:
        yield factory
    finally:
        try:
            factory.cleanup_all()
        finally:
            shutil.rmtree(base, ignore_errors=True)


def open_up(path: Path) -> None:
    """Makes `path` and its parents up to /tmp traversable by everyone."""
    for p in [path, *path.parents]:
        if str(p) in ("/", "/tmp"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o755)


def daemon_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def daemon_peak_rss_bytes(pid: int) -> int:
    """The daemon's peak RSS since it started (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def find_pid(mount: Any) -> int:
    pid: Optional[int] = mount.pid or mount.learn_pid()
    assert pid, "daemon pid unknown"
    return pid
