"""A fake cubetorchfs control server: the /v1 API over a unix socket, recording what it gets.

`FakeDaemon(mount_point, mode=...)` serves on a fresh socket under /tmp (unix socket paths are
limited to 108 bytes, pytest's tmp_path can be longer) until `stop()`; `write_control_file`
announces it. File lists and positions are served as the daemon serves them (`published()`
gives the paths positions name). Modes: "ok"; "nolists" (a daemon from before file lists:
404 for them); "listsfull" (429 for every registration); "error" (every request gets 500 with a JSON error); "garbage" (2xx
replies whose body is not JSON); "slow" (each reply waits up to 5 s, or until stop()).
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import socketserver
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass
class FakeStream:
    id: str
    name: str
    pid: int
    paths: List[str] = field(default_factory=list)
    posts: int = 0
    deleted: bool = False
    # Per POST: (time.monotonic() when it came, positions after it, its "unread" or None).
    unread: List[Tuple[float, int, Optional[int]]] = field(default_factory=list)


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    block_on_close = False
    fake: "FakeDaemon"

    def handle_error(self, request: Any, client_address: Any) -> None:  # cut connections: quiet
        pass


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        with self.server.fake.lock:
            self.server.fake.connections.append(self.connection)

    def address_string(self) -> str:
        return "unix"

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if self.headers.get("Content-Type") == "application/octet-stream":
            return raw
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return raw

    def _reply(self, status: int, body: Any = None, raw: Optional[bytes] = None) -> None:
        data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _serve(self, method: str) -> None:
        fake = self.server.fake
        body = self._body() if method != "GET" else None
        with fake.lock:
            fake.requests.append((method, self.path, body))
        if fake.mode == "slow":
            fake.release.wait(5.0)
        if fake.mode == "error":
            return self._reply(500, {"error": "injected failure"})
        if fake.mode == "nolists" and (self.path.startswith("/v1/lists")
                                       or self.path.endswith("/positions")):
            return self._reply(404, {"error": "no route " + self.path, "code": "not_supported",
                                     "errno": 95})
        if fake.mode == "listsfull" and self.path.startswith("/v1/lists"):
            return self._reply(429, {"error": "the file lists of all users would take more "
                                     "than prefetch.max_list_bytes", "code": "io_error",
                                     "errno": 5})
        if fake.mode == "full" and method == "POST" and (self.path.endswith("/paths")
                                                         or self.path.endswith("/positions")):
            with fake.lock:
                refuse = fake.refuse > 0
                fake.refuse -= refuse
            if refuse:
                return self._reply(429, {"error": "publishing 8 paths would pass "
                                         "prefetch.max_queued_paths_per_uid (131072)",
                                         "code": "resource_exhausted", "errno": 105})
        status, reply = fake.route(method, self.path, body)
        if fake.mode == "garbage":
            return self._reply(status if status != 204 else 200, raw=b"<html>not json")
        self._reply(status, reply)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_DELETE(self) -> None:
        self._serve("DELETE")


class FakeDaemon:
    def __init__(self, mount_point: str, mode: str = "ok", vol_name: str = "testvol") -> None:
        self.mount_point = mount_point
        self.mode = mode
        self.refuse = 2  # mode "full": POSTs of paths refused with 429 before they are taken
        self.vol_name = vol_name
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.requests: List[Tuple[str, str, Any]] = []
        self.streams: Dict[str, FakeStream] = {}
        self.lists: Dict[str, List[Optional[str]]] = {}  # None: an entry refused
        self.stream_lists: Dict[str, str] = {}
        self.reads = {"hit": 0, "late": 0, "miss": 0}
        self.connections: List[socket.socket] = []
        self._dir = tempfile.mkdtemp(prefix="ctfake")
        self.socket_path = os.path.join(self._dir, "ctl.sock")
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None

    # --- lifecycle ---

    def start(self) -> "FakeDaemon":
        server = _Server(self.socket_path, _Handler)
        server.fake = self
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving, cuts the open connections and removes the socket: a daemon gone."""
        self.release.set()
        self._halt()
        shutil.rmtree(self._dir, ignore_errors=True)

    def go_down(self) -> None:
        """As stop(), but keeps what it saw: a daemon killed, restarted by come_back()."""
        self._halt()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    def come_back(self) -> None:
        """Serves again on the same socket, as the next process would: it knows no stream or
        file list."""
        with self.lock:
            for s in self.streams.values():
                s.deleted = True
            self.lists.clear()
        self.start()

    def _halt(self) -> None:
        """Stops serving and cuts the open connections."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self.lock:
            connections, self.connections = self.connections, []
        for c in connections:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(5)

    def write_control_file(self, config_dir: str, pid: Optional[int] = None,
                           mount_point: Optional[str] = None) -> str:
        path = os.path.join(config_dir, "cube_torch.config." + self.vol_name)
        data = {"vol_name": self.vol_name, "mount_point": mount_point or self.mount_point,
                "prof": 0, "local_ip": "127.0.0.1", "control_socket": self.socket_path,
                "metrics_port": 0, "pid": os.getpid() if pid is None else pid, "version": "0.1.0"}
        with open(path, "w") as f:
            json.dump(data, f)
        return path

    # --- the API ---

    def route(self, method: str, path: str, body: Any) -> Tuple[int, Any]:
        parts = [p for p in path.split("/") if p]
        with self.lock:
            if method == "POST" and parts == ["v1", "streams"]:
                if not isinstance(body, dict) or not isinstance(body.get("name"), str) \
                        or not isinstance(body.get("pid"), int):
                    return 400, {"error": "malformed"}
                list_id = body.get("list")
                if list_id is not None and list_id not in self.lists:
                    return 410, {"error": "file list gone", "code": "stale", "errno": 116}
                sid = str(len(self.streams) + 1)
                self.streams[sid] = FakeStream(sid, body["name"], body["pid"])
                if list_id is not None:
                    self.stream_lists[sid] = list_id
                return 201, {"id": sid}
            if method == "POST" and parts[:2] == ["v1", "lists"] and len(parts) <= 3:
                if not isinstance(body, bytes) or (body and not body.endswith(b"\0")):
                    return 400, {"error": "malformed"}
                names = [os.fsdecode(p) for p in body.split(b"\0")[:-1]] if body else []
                if len(parts) == 2:
                    lid = "l" + str(len(self.lists) + 1 + len(self.requests))
                    self.lists[lid] = []
                else:
                    lid = parts[2]
                    if lid not in self.lists:
                        return 410, {"error": "file list gone", "code": "stale", "errno": 116}
                entries = self.lists[lid]
                first = len(entries)
                inside = [p if p.startswith(self.mount_point + "/") else None for p in names]
                entries.extend(inside)
                return (201 if len(parts) == 2 else 200), {
                    "id": lid, "first": first, "size": len(entries),
                    "rejected": sum(1 for p in inside if p is None)}
            if method == "DELETE" and parts[:2] == ["v1", "lists"] and len(parts) == 3:
                if self.lists.pop(parts[2], None) is None:
                    return 404, {"error": "unknown file list", "code": "not_found", "errno": 2}
                return 204, None
            if len(parts) == 4 and parts[:2] == ["v1", "streams"] and parts[3] == "positions" \
                    and method == "POST":
                s = self.streams.get(parts[2])
                if s is None or s.deleted:
                    return 404, {"error": "unknown stream", "code": "not_found", "errno": 2}
                lid = self.stream_lists.get(s.id)
                if lid is None:
                    return 400, {"error": "stream without a list"}
                if lid not in self.lists:
                    return 410, {"error": "file list gone", "code": "stale", "errno": 116}
                if not isinstance(body, bytes) or len(body) < 8 or (len(body) - 8) % 4:
                    return 400, {"error": "malformed"}
                entries = self.lists[lid]
                u = int.from_bytes(body[:8], "little")
                positions = [int.from_bytes(body[i:i + 4], "little")
                             for i in range(8, len(body), 4)]
                if any(p >= len(entries) for p in positions):
                    return 400, {"error": "position past the end"}
                good = [entries[p] for p in positions if entries[p] is not None]
                s.paths.extend(good)
                s.posts += 1
                s.unread.append((time.monotonic(), len(s.paths), None if u == (1 << 64) - 1 else u))
                return 202, {"accepted": len(good), "rejected": len(positions) - len(good)}
            if len(parts) == 4 and parts[:2] == ["v1", "streams"] and parts[3] == "paths" \
                    and method == "POST":
                s = self.streams.get(parts[2])
                if s is None or s.deleted:
                    return 404, {"error": "unknown stream", "code": "not_found", "errno": 2}
                if not isinstance(body, dict) or not isinstance(body.get("paths"), list):
                    return 400, {"error": "malformed"}
                good = [p for p in body["paths"]
                        if isinstance(p, str) and (p == self.mount_point
                                                   or p.startswith(self.mount_point + "/"))]
                s.paths.extend(good)
                s.posts += 1
                u = body.get("unread")
                if u is not None and (not isinstance(u, int) or isinstance(u, bool) or u < 0):
                    return 400, {"error": "unread must be a non-negative integer"}
                s.unread.append((time.monotonic(), len(s.paths), u))
                return 202, {"accepted": len(good), "rejected": len(body["paths"]) - len(good)}
            if len(parts) == 3 and parts[:2] == ["v1", "streams"] and method == "DELETE":
                s = self.streams.get(parts[2])
                if s is None or s.deleted:
                    return 404, {"error": "unknown stream", "code": "not_found", "errno": 2}
                s.deleted = True
                return 204, None
            if parts == ["v1", "stats"] and method == "GET":
                total = sum(self.reads.values())
                return 200, {
                    "global": {"reads": dict(self.reads),
                               "hit_ratio": self.reads["hit"] / total if total else 0.0,
                               "prefetch": {"fetched": 0, "failed": 0, "evicted_unread": 0,
                                            "inflight": 0},
                               "cache": {"ram_bytes": 0}},
                    "streams": [{"id": s.id, "name": s.name, "pid": s.pid,
                                 "published": len(s.paths), "rejected": 0,
                                 "reads": {"hit": 0, "late": 0, "miss": 0}}
                                for s in self.streams.values() if not s.deleted],
                }
            return 404, {"error": "no such route"}

    # --- what it saw ---

    def all_streams(self) -> List[FakeStream]:
        with self.lock:
            return list(self.streams.values())

    def published(self) -> List[str]:
        """Every path published, stream after stream, each in order."""
        with self.lock:
            return [p for s in self.streams.values() for p in s.paths]
