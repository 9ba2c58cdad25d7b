"""The control API through a real daemon: /v1 on the unix socket, the legacy cube_torch
endpoints on 127.0.0.1:profPort, prefetching seen through /v1/stats and /metrics, and a
fuzz-style barrage of bad requests that must leave the daemon serving."""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import socket
import struct
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from cubefs_harness import (CubeFactory, CubeMount, UnixHTTPConnection, call,
                             environment_problem, free_tcp_port, wait_until)

pytestmark = pytest.mark.skipif(environment_problem() is not None,
                                reason=environment_problem() or "")

HTTP_TIMEOUT_S = 5.0


def make_tree(root: Path, count: int, size: int = 20_000) -> list[Path]:
    rng = random.Random(7)
    files = []
    for i in range(count):
        d = root / f"class_{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"img_{i:05d}.bin"
        p.write_bytes(rng.randbytes(size))
        files.append(p)
    return files


def start(cube: CubeFactory, root: Path, latency_us: int = 0, prof: bool = False,
          **prefetch: Any) -> tuple[CubeMount, str, int]:
    prof_port = free_tcp_port() if prof else 0
    overrides: dict[str, Any] = {"profile": "ai_prefetch", "profPort": prof_port,
                                 "prefetch": {"max_inflight": 8, **prefetch}}
    if latency_us:
        overrides["backend"] = {"inject": {"latency_us": latency_us}}
    mount = cube.mount(root, overrides)
    sock = mount.read_control()["control_socket"]
    assert sock and os.path.exists(sock), mount.read_control()
    return mount, sock, prof_port


def stats(sock: str) -> dict[str, Any]:
    status, body = call(UnixHTTPConnection(sock), "GET", "/v1/stats")
    assert status == 200, body
    return json.loads(body)


def publish(sock: str, paths: list[str], name: str = "test") -> str:
    conn = UnixHTTPConnection(sock)
    status, body = call(conn, "POST", "/v1/streams", {"name": name, "pid": os.getpid()})
    assert status == 201, body
    sid = json.loads(body)["id"]
    status, body = call(conn, "POST", f"/v1/streams/{sid}/paths", {"paths": paths})
    assert status == 202, body
    assert json.loads(body) == {"accepted": len(paths), "rejected": 0}
    return sid


def test_published_files_are_prefetched_and_read_as_hits(cube: CubeFactory, tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = make_tree(src, 40)
    mount, sock, _ = start(cube, src, latency_us=2000)
    paths = [str(mount.path(str(f.relative_to(src)))) for f in files]
    sid = publish(sock, paths)
    assert wait_until(lambda: stats(sock)["global"]["prefetch"]["fetched"] == 40, timeout=30)
    for f, p in zip(files, paths):
        assert Path(p).read_bytes() == f.read_bytes()
    s = stats(sock)
    reads = s["global"]["reads"]
    assert reads["miss"] == 0 and reads["hit"] >= 40, s
    stream = [x for x in s["streams"] if x["id"] == sid][0]
    assert stream["read"] == 40 and stream["reads"]["hit"] == 40 and stream["hit_ratio"] == 1.0
    # Every file read whole left the window (for the LRU): it is empty, nothing fetched twice.
    assert s["global"]["prefetch"]["window_files"] == 0
    m = mount.metrics()
    assert m.value("cubetorchfs_prefetch_files_total", outcome="fetched") == 40
    assert m.value("cubetorchfs_backend_requests_total", op="read", status="ok") == 40
    assert m.value("cubetorchfs_reads_total", result="miss") == 0


def test_the_page_probe_passes_over_files_the_kernel_holds_and_fetches_those_it_dropped(
        cube: CubeFactory, tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = make_tree(src, 40, size=50_000)
    # POSIX_FADV_DONTNEED drops pages without the kernel counting a reclaim: every mark is
    # probed here, not trusted (prefetch.trust_page_cache).
    mount, sock, _ = start(cube, src, latency_us=1000, evict_after_read=False,
                           trust_page_cache=False)
    paths = [str(mount.path(str(f.relative_to(src)))) for f in files]
    for p in paths:  # read whole: the kernel keeps the pages, the daemon marks the files
        Path(p).read_bytes()
    for p in paths[::2]:  # half of them lose their pages, as under memory pressure
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    m = mount.metrics()
    reads_before = m.value("cubetorchfs_backend_requests_total", op="read", status="ok")
    fuse_reads_before = sum(m.value("cubetorchfs_reads_total", result=r)
                            for r in ("hit", "late", "miss"))
    misses_before = m.value("cubetorchfs_reads_total", result="miss")
    publish(sock, paths)

    def probed() -> dict[str, Any]:
        return stats(sock)["global"]["prefetch"]
    assert wait_until(lambda: probed()["page_resident"] + probed()["probed_absent"] == 40
                      and probed()["inflight"] == 0, 10), probed()
    pf = probed()
    # The dropped half is probed absent and fetched (from the LRU, which kept every file read:
    # evict_after_read is off); the kernel may drop a few more pages on its own.
    assert pf["probed_absent"] >= 20 and pf["page_resident"] >= 10, pf
    for f, p in zip(files, paths):
        assert Path(p).read_bytes() == f.read_bytes()
    m = mount.metrics()
    fuse_reads = sum(m.value("cubetorchfs_reads_total", result=r)
                     for r in ("hit", "late", "miss")) - fuse_reads_before
    # Every file the kernel lacked was fetched and put back into its page cache
    # (FUSE_NOTIFY_STORE): no read reaches the daemon, and none is a miss. The kernel may drop
    # pages on its own between the store and the read: such a read is a page drop (served
    # from the LRU, which kept every file).
    drops = probed()["page_drops"]
    assert pf["stored"] >= pf["probed_absent"], pf
    assert fuse_reads == drops, (fuse_reads, probed())
    assert m.value("cubetorchfs_reads_total", result="miss") == misses_before
    # Files the LRU still held cost no store read.
    assert m.value("cubetorchfs_backend_requests_total", op="read", status="ok") - reads_before \
        <= pf["probed_absent"] - pf["cached"]


def test_a_read_of_a_file_being_prefetched_waits_instead_of_fetching_again(
        cube: CubeFactory, tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = make_tree(src, 1, size=50_000)
    mount, sock, _ = start(cube, src, latency_us=300_000)
    path = str(mount.path(str(files[0].relative_to(src))))
    publish(sock, [path])
    assert Path(path).read_bytes() == files[0].read_bytes()
    reads = stats(sock)["global"]["reads"]
    # Published just before the read: the read joins the prefetch (late) or finds it done.
    assert reads["miss"] == 0, reads
    assert mount.metrics().value("cubetorchfs_backend_requests_total", op="read", status="ok") == 1


def test_window_bounds_and_stream_delete(cube: CubeFactory, tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = make_tree(src, 30)
    mount, sock, _ = start(cube, src, window_files=5)
    sid = publish(sock, [str(f.relative_to(src)) for f in files])  # relative paths work too
    assert wait_until(lambda: stats(sock)["global"]["prefetch"]["fetched"] == 5, timeout=20)
    time.sleep(0.3)  # nothing more may arrive while nothing is read
    g = stats(sock)["global"]["prefetch"]
    assert g["fetched"] == 5 and g["window_files"] == 5, g
    status, _ = call(UnixHTTPConnection(sock), "DELETE", f"/v1/streams/{sid}")
    assert status == 204
    g = stats(sock)["global"]["prefetch"]
    assert g["window_files"] == 0 and g["evicted_unread"] == 5, g


def test_control_api_errors(cube: CubeFactory, tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_tree(src, 2)
    mount, sock, _ = start(cube, src)
    conn = UnixHTTPConnection(sock)
    assert call(conn, "POST", "/v1/streams", "{not json")[0] == 400
    assert call(conn, "POST", "/v1/streams", {"name": 5})[0] == 400
    assert call(conn, "POST", "/v1/streams/nope/paths", {"paths": ["a"]})[0] == 404
    status, body = call(conn, "DELETE", "/v1/streams/nope")
    assert status == 404 and json.loads(body)["code"] == "not_found", body
    # A route the daemon lacks is not a missing file: a client may fall back.
    status, body = call(conn, "GET", "/v1/nothing")
    assert status == 404 and json.loads(body)["code"] == "not_supported", body
    status, body = call(conn, "GET", "/v1/streams")
    assert status == 405 and json.loads(body)["code"] == "not_supported", body
    status, body = call(conn, "POST", "/v1/streams", {"name": "x", "pid": 1})
    sid = json.loads(body)["id"]
    assert call(conn, "POST", f"/v1/streams/{sid}/paths", {"paths": "a"})[0] == 400
    assert call(conn, "POST", f"/v1/streams/{sid}/paths", {"paths": [1, 2]})[0] == 400
    status, body = call(conn, "POST", f"/v1/streams/{sid}/paths", {"paths": ["/etc/passwd"]})
    assert status == 422 and "outside" in json.loads(body)["error"]
    status, body = call(conn, "POST", f"/v1/streams/{sid}/paths",
                        {"paths": ["/etc/passwd", str(mount.path("class_0/img_00000.bin"))]})
    assert status == 202 and json.loads(body) == {"accepted": 1, "rejected": 1}
    one = str(mount.path("class_0/img_00000.bin"))
    for bad in (-1, 1.5, "3", True, None, [1]):
        status, body = call(conn, "POST", f"/v1/streams/{sid}/paths",
                            {"paths": [one], "unread": bad})
        assert status == 400 and "unread" in json.loads(body)["error"], (bad, body)
    status, body = call(conn, "POST", f"/v1/streams/{sid}/paths", {"paths": [one], "unread": 0})
    assert status == 202 and json.loads(body) == {"accepted": 1, "rejected": 0}
    # A body over 16 MiB is refused from its Content-Length, before it is sent.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(HTTP_TIMEOUT_S)
        s.connect(sock)
        s.sendall(f"POST /v1/streams/{sid}/paths HTTP/1.1\r\nHost: x\r\n"
                  f"Content-Length: {17 << 20}\r\n\r\n".encode())
        assert s.recv(4096).startswith(b"HTTP/1.1 413")
    # Errors are JSON with an "error" key.
    status, body = call(UnixHTTPConnection(sock), "POST", "/v1/streams", "[]")
    assert status == 400 and "error" in json.loads(body)
    assert stats(sock)["streams"]


def test_legacy_cube_torch_endpoints(cube: CubeFactory, tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = make_tree(src, 6)
    mount, sock, prof = start(cube, src, prof=True)
    assert mount.read_control()["prof"] == prof
    conn = http.client.HTTPConnection("127.0.0.1", prof, timeout=HTTP_TIMEOUT_S)
    assert call(conn, "POST", "/register/pid", [os.getpid()])[0] == 200
    abs_paths = [str(mount.path(str(f.relative_to(src)))) for f in files]
    status, body = call(conn, "POST", "/prefetch/read/path", [abs_paths[:3], abs_paths[3:]])
    assert (status, body) == (200, b"prefetching.\n")
    assert wait_until(lambda: stats(sock)["global"]["prefetch"]["fetched"] == 6, timeout=20)
    status, body = call(conn, "POST", "/batchdownload/path", [abs_paths[:4]])
    assert status == 200
    assert len(body) >= 16, body
    version, count = struct.unpack(">QQ", body[:16])
    assert (version, count) == (0, 4)
    # Exactly `count` entries, in the order asked, and the body ends right after the last.
    off = 16

    def take(n: int, what: str) -> bytes:
        nonlocal off
        assert off + n <= len(body), (
            f"body ends at {len(body)} inside {what} ({n} bytes from {off})")
        off += n
        return body[off - n:off]

    for i, (f, p) in enumerate(zip(files[:count], abs_paths[:count])):
        (plen,) = struct.unpack(">Q", take(8, f"entry {i} path length"))
        assert take(plen, f"entry {i} path").decode() == p
        (dlen,) = struct.unpack(">Q", take(8, f"entry {i} data length"))
        assert take(dlen, f"entry {i} data") == f.read_bytes(), p
    assert off == len(body), f"{len(body) - off} bytes after the {count} entries"
    assert call(conn, "POST", "/unregister/pid", [os.getpid()])[0] == 200
    assert call(conn, "POST", "/register/pid", {"pid": 1})[0] == 400
    assert call(conn, "POST", "/prefetch/read/path", "garbage")[0] == 400


def _send_raw(addr: Any, family: int, payload: bytes, read: bool = True) -> None:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        s.connect(addr)
        try:
            s.sendall(payload)
            if read:
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):
                    pass
        except (socket.timeout, ConnectionError, OSError):
            pass


def test_fuzzed_requests_never_take_the_daemon_down(cube: CubeFactory, tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = make_tree(src, 3)
    mount, sock, prof = start(cube, src, prof=True)
    rng = random.Random(1234)
    valid = (b"POST /v1/streams HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: 25\r\n\r\n{\"name\": \"f\", \"pid\": 1}")
    legacy = (b"POST /prefetch/read/path HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\n\r\n"
              b"[[\"/a/b\"]]  ")
    cases = [
        b"", b"\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"POST /v1/streams HTTP/1.1\r\n",
        b"GET /v1/stats HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        b"POST /v1/streams HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET /v1/stats HTTP/1.1\r\n" + b"X: " + b"y" * 100_000 + b"\r\n\r\n",
        b"POST /v1/streams HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n{",
    ]
    for _ in range(120):
        kind = rng.randrange(3)
        if kind == 0:
            cases.append(rng.randbytes(rng.randrange(1, 2048)))
        elif kind == 1:
            base = rng.choice([valid, legacy])
            cases.append(base[:rng.randrange(len(base))])  # truncated
        else:
            base = bytearray(rng.choice([valid, legacy]))
            for _ in range(rng.randrange(1, 6)):
                base[rng.randrange(len(base))] = rng.randrange(256)
            cases.append(bytes(base))
    deadline = time.monotonic() + 60
    for i, payload in enumerate(cases):
        assert time.monotonic() < deadline, "fuzzing took too long: a listener stalls"
        if i % 2:
            _send_raw(sock, socket.AF_UNIX, payload, read=i % 4 != 1)
        else:
            _send_raw(("127.0.0.1", prof), socket.AF_INET, payload, read=i % 4 != 0)
    # Still serving: both listeners and the mount.
    assert stats(sock)["global"] is not None
    conn = http.client.HTTPConnection("127.0.0.1", prof, timeout=HTTP_TIMEOUT_S)
    assert call(conn, "POST", "/register/pid", [1])[0] == 200
    assert mount.path(str(files[0].relative_to(src))).read_bytes() == files[0].read_bytes()


def _exchange(addr: Any, family: int, payload: bytes) -> bytes:
    """Sends payload and reads until the server closes (or 5 s pass): every reply it gave."""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(HTTP_TIMEOUT_S)
        s.connect(addr)
        s.sendall(payload)
        got = b""
        deadline = time.monotonic() + HTTP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                piece = s.recv(65536)
            except socket.timeout:
                break
            if not piece:
                break
            got += piece
        return got


def test_requests_framed_ambiguously_are_refused_and_the_connection_closed(
        cube: CubeFactory, tmp_path: Path) -> None:
    """RFC 9112: a body whose framing the daemon could read differently from a proxy or client
    (a transfer coding it does not decode, Content-Length beside Transfer-Encoding, two
    Content-Lengths, HTTP/1.1 without Host) is refused and the connection closed, so nothing
    in that body is ever read as a second request."""
    src = tmp_path / "src"
    make_tree(src, 1)
    mount, sock, prof = start(cube, src, prof=True)
    inner = b"POST /v1/streams HTTP/1.1\r\nHost: x\r\nContent-Length: 23\r\n\r\n{\"name\":\"s\",\"pid\":1}"
    cases = [
        (b"POST /v1/streams HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n" + inner,
         501, "Transfer-Encoding"),
        (b"POST /v1/streams HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
         b"0\r\n\r\n" + inner, 501, "Transfer-Encoding"),
        (b"POST /v1/streams HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
         b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + inner, 400, "Transfer-Encoding"),
        (b"POST /v1/streams HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nContent-Length: 0\r\n\r\n"
         + inner, 400, "Content-Length"),
        (b"GET /v1/stats HTTP/1.1\r\n\r\n" + inner, 400, "Host"),
        # Trailer fields would join the header after it was checked (a second Host here).
        (b"POST /v1/streams HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
         b"14\r\n{\"name\":\"s\",\"pid\":1}\r\n0\r\nHost: y\r\n\r\n" + inner, 400, "trailer"),
    ]
    before = mount.metrics().value("cubetorchfs_control_refused_total", reason="bad_framing")
    sent = 0
    for addr, family in ((sock, socket.AF_UNIX), (("127.0.0.1", prof), socket.AF_INET)):
        for payload, status, word in cases:
            reply = _exchange(addr, family, payload)
            sent += 1
            assert reply.startswith(f"HTTP/1.1 {status} ".encode()), (payload[:80], reply[:200])
            assert word in reply.decode(errors="replace"), reply[:300]
            replies = re.findall(rb"(?:^|\n)HTTP/1\.[01] \d{3} ", reply)
            assert len(replies) == 1, f"a second request was answered: {reply!r}"
    # Nothing smuggled made a stream; HTTP/1.0 needs no Host; chunked alone is fine.
    assert stats(sock)["streams"] == []
    assert _exchange(sock, socket.AF_UNIX, b"GET /v1/stats HTTP/1.0\r\n\r\n").startswith(
        b"HTTP/1.0 200 ")
    chunked = (b"POST /v1/streams HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
               b"Connection: close\r\n\r\n14\r\n{\"name\":\"s\",\"pid\":1}\r\n0\r\n\r\n")
    assert _exchange(sock, socket.AF_UNIX, chunked).startswith(b"HTTP/1.1 201 ")
    after = mount.metrics().value("cubetorchfs_control_refused_total", reason="bad_framing")
    assert after - before == sent


def test_socket_is_removed_on_exit(cube: CubeFactory, tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_tree(src, 1)
    mount, sock, _ = start(cube, src)
    assert os.path.exists(sock)
    assert mount.fusermount().returncode == 0
    assert mount.wait_gone()
    assert not os.path.exists(sock)


def test_a_second_daemon_cannot_take_a_live_socket(cube: CubeFactory, tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_tree(src, 1)
    mount, sock, _ = start(cube, src)
    second = cube.prepare(src, {"prefetch": {"control_socket": sock}})
    result = cube.launch(second)
    assert result.returncode == 2, result.stderr
    assert "in use" in result.stderr and "control_socket" in result.stderr
    assert not second.is_mounted()
    assert stats(sock)["global"] is not None  # the first daemon still owns it
