"""Attacks on the daemon, each tried against a real daemon by a hostile local user, and shown to
fail: store symlinks that lead out of the root (through every API and through the mount),
root-only files asked for over TCP and the unix socket, other users' streams, a directory
swapped for a symlink under an allow_other mount, memory attacks, a flooding user, forged log
lines and idle connections."""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cubefs_harness import (CubeFactory, CubeMount, UnixHTTPConnection, call,
                             environment_problem, free_tcp_port, wait_until)
from seclib import (NOBODY, OTHER, THIRD, as_user, daemon_peak_rss_bytes,  # noqa: F401
                    daemon_rss_bytes, find_pid, open_cube, parse_batch, script_result, shell_as,
                    start_script_as)

pytestmark = [
    pytest.mark.skipif(environment_problem() is not None, reason=environment_problem() or ""),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, setpriv, allow_other)"),
]

SECRET = b"TOPSECRET-outside-the-store"
ROOT_ONLY = b"ROOT-ONLY-inside-the-store"


def make_store(base: Path) -> Path:
    """A store with symlinks out of it, a root-only file and directory, and public files."""
    outside = base / "outside"
    outside.mkdir(mode=0o700)
    (outside / "shadow").write_bytes(SECRET)
    os.chmod(outside / "shadow", 0o600)
    src = base / "src"
    src.mkdir(mode=0o755)
    os.chmod(src, 0o755)
    pub = src / "pub"
    (pub / "d").mkdir(parents=True)
    for d in (pub, pub / "d"):
        os.chmod(d, 0o755)
    for i in range(40):
        (pub / f"f{i:03d}").write_bytes(bytes([i]) * 20_000)
        os.chmod(pub / f"f{i:03d}", 0o644)
    (pub / "d" / "x").write_bytes(b"inside-x")
    os.chmod(pub / "d" / "x", 0o644)
    (src / "private.bin").write_bytes(ROOT_ONLY)
    os.chmod(src / "private.bin", 0o600)
    (src / "closed").mkdir(mode=0o700)
    os.chmod(src / "closed", 0o700)
    (src / "closed" / "f").write_bytes(ROOT_ONLY)
    os.chmod(src / "closed" / "f", 0o644)
    own = src / "nobody"
    own.mkdir()
    (own / "mine.bin").write_bytes(b"nobody's own bytes")
    os.chmod(own / "mine.bin", 0o600)
    os.chown(own, NOBODY, NOBODY)
    os.chown(own / "mine.bin", NOBODY, NOBODY)
    os.symlink(str(outside), src / "etcdir")         # absolute, out of the store
    os.symlink("../outside", src / "up")             # relative, climbs out
    os.symlink("pub/d", src / "classes")             # relative, stays inside: allowed
    os.symlink(str(outside / "shadow"), src / "shadowlink")
    return src


def start(cube: CubeFactory, src: Path, **extra: Any) -> tuple[CubeMount, str, int]:
    prof = free_tcp_port()
    overrides: dict[str, Any] = {"profile": "ai_prefetch", "profPort": prof,
                                 "prefetch": {"max_inflight": 4}}
    for k, v in extra.items():
        overrides[k] = v
    mount = cube.mount(src, overrides)
    sock = mount.read_control()["control_socket"]
    return mount, sock, prof


def stats(sock: str) -> dict[str, Any]:
    status, body = call(UnixHTTPConnection(sock), "GET", "/v1/stats")
    assert status == 200, body
    return json.loads(body)


def no_secret_anywhere(where: Path) -> None:
    for dirpath, _, files in os.walk(where):
        for name in files:
            p = Path(dirpath) / name
            try:
                assert SECRET not in p.read_bytes(), p
            except (PermissionError, FileNotFoundError, IsADirectoryError):
                pass


def test_store_symlinks_never_lead_out_of_the_root(open_cube: CubeFactory) -> None:
    base = open_cube.base.parent
    src = make_store(base)
    disk = base / "tier"
    mount, sock, prof = start(open_cube, src,
                              cache={"memory_bytes": "64MiB", "chunk_bytes": "4MiB",
                                     "disk_dir": str(disk), "disk_bytes": "64MiB"})
    m = str(mount.mountpoint)
    escapes = [f"{m}/etcdir/shadow", f"{m}/up/shadow", f"{m}/shadowlink",
               f"{m}/pub/../etcdir/shadow", "etcdir/shadow"]
    inside = f"{m}/classes/x"
    # /batchdownload/path over both listeners: no byte of the outside file, the inside link works.
    for conn in (UnixHTTPConnection(sock), __import__("http.client").client.HTTPConnection(
            "127.0.0.1", prof, timeout=10)):
        status, body = call(conn, "POST", "/batchdownload/path", [escapes + [inside]])
        assert status == 200, body
        got = dict(parse_batch(body))
        assert all(got[p] == b"" for p in escapes), got
        assert got[inside] == b"inside-x"
    # /v1/files/open: never a descriptor of the outside file.
    for p in escapes[:3]:
        out = as_user({"kind": "open", "socket": sock, "path": p}, uid=0)
        assert out["status"] != 200 and out["fds"] == 0, out
    # Stream publish, the legacy prefetch and warmup: refused, never fetched.
    conn = UnixHTTPConnection(sock)
    status, body = call(conn, "POST", "/v1/streams", {"name": "evil", "pid": 1})
    sid = json.loads(body)["id"]
    status, body = call(conn, "POST", f"/v1/streams/{sid}/paths", {"paths": escapes[:2] + [inside]})
    assert status == 202 and json.loads(body) == {"accepted": 1, "rejected": 2}, body
    status, body = call(conn, "POST", "/prefetch/read/path", [escapes])
    assert status == 200
    status, body = call(conn, "POST", "/v1/warmup", {"paths": escapes + [inside]})
    assert status == 200, body
    warm = json.loads(body)
    assert warm["fetched"] + warm["skipped"] == 1 and warm["failed"] == len(escapes), warm
    time.sleep(1.0)
    g = stats(sock)["global"]
    assert g["control"]["rejected_paths"]["symlink"] >= 8, g["control"]
    # Nothing of the secret reached the tier, and the mount shows the links as links.
    no_secret_anywhere(disk)
    assert os.path.islink(mount.path("etcdir"))
    assert mount.metrics().value("cubetorchfs_control_rejected_paths_total", reason="symlink") >= 8


def test_rights_changed_after_a_list_is_registered_are_checked_before_each_fetch(
        open_cube: CubeFactory) -> None:
    """A registered file list resolves each path (and checks its directories) once; a file
    whose mode changed since, or that the user never could read, is still refused before its
    bytes are fetched, whenever its position is published."""
    import base64
    import struct
    base = open_cube.base.parent
    src = make_store(base)
    mount, sock, _ = start(open_cube, src)
    m = str(mount.mountpoint)
    names = [f"{m}/pub/f010", f"{m}/pub/f011", f"{m}/private.bin", f"{m}/closed/f"]
    body = b"".join(os.fsencode(p) + b"\0" for p in names)
    out = as_user({"kind": "unix", "socket": sock, "target": "/v1/lists",
                   "body_b64": base64.b64encode(body).decode()})
    assert out["status"] == 201, out
    reg = json.loads(out["body"])
    assert (reg["size"], reg["rejected"]) == (4, 1), reg  # closed/: no search permission
    os.chmod(src / "pub" / "f011", 0o600)  # after registration: now root's alone
    out = as_user({"kind": "unix", "socket": sock, "target": "/v1/streams",
                   "body": {"name": "n", "list": reg["id"]}})
    assert out["status"] == 201, out
    sid = json.loads(out["body"])["id"]
    positions = struct.pack("<Q4I", 4, 0, 1, 2, 3)
    out = as_user({"kind": "unix", "socket": sock, "target": f"/v1/streams/{sid}/positions",
                   "body_b64": base64.b64encode(positions).decode()})
    assert json.loads(out["body"]) == {"accepted": 3, "rejected": 1}, out
    assert wait_until(lambda: (stats(sock)["global"]["prefetch"]["fetched"]
                               + stats(sock)["global"]["prefetch"]["denied"]) >= 3, timeout=10)
    p = stats(sock)["global"]["prefetch"]
    assert (p["fetched"], p["denied"]) == (1, 2), p  # f010 only
    # Another user may not use the list, nor see it in its stats.
    out = as_user({"kind": "unix", "socket": sock, "target": "/v1/streams",
                   "body": {"name": "n", "list": reg["id"]}}, uid=OTHER)
    assert out["status"] == 403, out


def test_non_root_user_gets_nothing_of_root_only_files(open_cube: CubeFactory) -> None:
    base = open_cube.base.parent
    src = make_store(base)
    mount, sock, prof = start(open_cube, src)
    m = str(mount.mountpoint)
    ask = [f"{m}/private.bin", f"{m}/closed/f", f"{m}/pub/f001", f"{m}/nobody/mine.bin"]
    for kind in ("tcp", "unix"):
        out = as_user({"kind": kind, "port": prof, "socket": sock, "target": "/batchdownload/path",
                       "body": [ask]})
        assert out["status"] == 200, out
        got = dict(parse_batch(out["body"]))
        assert got[ask[0]] == b"" and got[ask[1]] == b"", got
        assert got[ask[2]] == bytes([1]) * 20_000
        assert got[ask[3]] == b"nobody's own bytes"  # the user's own 0600 file
        # root, on the other hand, may read them all
        out = as_user({"kind": kind, "port": prof, "socket": sock, "target": "/batchdownload/path",
                       "body": [ask]}, uid=0)
        assert dict(parse_batch(out["body"]))[ask[0]] == ROOT_ONLY
    # No descriptor of a file the user may not read.
    for p in ask[:2]:
        out = as_user({"kind": "open", "socket": sock, "path": p})
        assert out["status"] == 403 and out["fds"] == 0, out
    # Published: the closed directory is refused at once; the 0600 file is never fetched.
    out = as_user({"kind": "unix", "socket": sock, "target": "/v1/streams", "body": {"name": "n"}})
    sid = json.loads(out["body"])["id"]
    out = as_user({"kind": "unix", "socket": sock, "target": f"/v1/streams/{sid}/paths",
                   "body": {"paths": ask}})
    assert json.loads(out["body"]) == {"accepted": 3, "rejected": 1}, out
    assert wait_until(lambda: stats(sock)["global"]["prefetch"]["fetched"] >= 2, timeout=10)
    g = stats(sock)["global"]
    assert g["prefetch"]["denied"] == 1, g["prefetch"]
    assert g["control"]["rejected_paths"]["permission"] >= 5, g["control"]
    # The legacy endpoint over TCP publishes into the user's own stream, same checks.
    out = as_user({"kind": "tcp", "port": prof, "target": "/prefetch/read/path", "body": [ask]})
    assert (out["status"], out["body"]) == (200, b"prefetching.\n")
    streams = stats(sock)["streams"]
    assert {s["uid"] for s in streams if s["name"] != "cube_torch legacy batch"} == {NOBODY}, \
        streams
    # /batchdownload/path fetched each asker's files through a batch stream of its own.
    assert {s["uid"] for s in streams if s["name"] == "cube_torch legacy batch"} == {0, NOBODY}, \
        streams


def test_streams_belong_to_their_creator(open_cube: CubeFactory) -> None:
    src = make_store(open_cube.base.parent)
    mount, sock, prof = start(open_cube, src)
    out = as_user({"kind": "unix", "socket": sock, "target": "/v1/streams", "body": {"name": "a"}})
    assert out["status"] == 201
    sid = json.loads(out["body"])["id"]
    for kind in ("unix", "tcp"):
        other = as_user({"kind": kind, "socket": sock, "port": prof, "method": "DELETE",
                         "target": f"/v1/streams/{sid}"}, uid=OTHER)
        assert other["status"] == 403, other
        other = as_user({"kind": kind, "socket": sock, "port": prof,
                         "target": f"/v1/streams/{sid}/paths",
                         "body": {"paths": [f"{mount.mountpoint}/pub/f000"]}}, uid=OTHER)
        assert other["status"] == 403, other
    seen = as_user({"kind": "unix", "socket": sock, "method": "GET", "target": "/v1/stats"},
                   uid=OTHER)
    assert json.loads(seen["body"])["streams"] == []
    mine = as_user({"kind": "unix", "socket": sock, "method": "GET", "target": "/v1/stats"})
    assert [s["id"] for s in json.loads(mine["body"])["streams"]] == [sid]
    assert [s["id"] for s in stats(sock)["streams"]] == [sid]  # root sees all
    assert as_user({"kind": "unix", "socket": sock, "method": "DELETE",
                    "target": f"/v1/streams/{sid}"})["status"] == 204


def test_mount_never_follows_a_directory_or_file_swapped_for_a_symlink(
        open_cube: CubeFactory) -> None:
    base = open_cube.base.parent
    src = make_store(base)
    victim = base / "victim"
    victim.write_bytes(b"root's file")
    os.chmod(victim, 0o600)
    g = src / "pub" / "g"
    g.write_bytes(b"user's file")
    os.chown(g, NOBODY, NOBODY)
    # Behind the 0700 directory, a 0644 file: a daemon that followed the swapped link would
    # hand it over, since the kernel checks only the attributes the daemon returns.
    (base / "outside" / "readable").write_bytes(SECRET)
    os.chmod(base / "outside" / "readable", 0o644)
    os.chown(src / "pub" / "d", NOBODY, NOBODY)  # the user may create in d as the kernel knows it
    mount = open_cube.prepare(src, {"profile": "ai_prefetch"})
    open_cube.start_foreground(mount)
    m = mount.mountpoint
    assert shell_as(["stat", f"{m}/pub/d", f"{m}/pub/g"])[0] == 0
    assert shell_as(["cat", f"{m}/pub/d/x"]) == (0, b"inside-x")
    # Swap, in the store, the directory for a link to a root-only one and the file for a link
    # to a root 0600 file. The kernel still holds the old attributes (ai_prefetch: 300 s).
    os.rename(src / "pub" / "d", src / "pub" / "d.old")
    os.symlink(str(base / "outside"), src / "pub" / "d")
    os.rename(g, src / "pub" / "g.old")
    os.symlink(str(victim), g)
    code, out = shell_as(["cat", f"{m}/pub/d/readable"])
    assert code != 0 and SECRET not in out, out
    code, out = shell_as(["touch", f"{m}/pub/d/planted"])
    assert code != 0 and not (base / "outside" / "planted").exists(), out
    shell_as(["chmod", "666", f"{m}/pub/g"])
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o600
    code, out = shell_as(["cat", f"{m}/pub/g"])
    assert b"root's file" not in out


def test_memory_attacks_stay_under_budget(open_cube: CubeFactory) -> None:
    base = open_cube.base.parent
    src = make_store(base)
    big = src / "pub" / "big.bin"
    with open(big, "wb") as f:
        f.write(os.urandom(1 << 20) * 48)  # 48 MiB
    os.chmod(big, 0o644)
    mount, sock, prof = start(open_cube, src)  # cache.memory_bytes: 64 MiB
    pid = find_pid(mount)
    base_rss = daemon_rss_bytes(pid)
    budget = 64 << 20
    overhead = 200 << 20  # the stated bound on what the daemon adds to its cache (docs/security.md)
    # Deeply nested and very wide JSON: refused before parsing, within the body limit.
    for body in (b"[" * (15 << 20), b"[" + b"0," * (7 << 20) + b"0]"):
        for conn in (UnixHTTPConnection(sock, timeout=30),
                     http.client.HTTPConnection("127.0.0.1", prof, timeout=30)):
            status, reply = call(conn, "POST", "/prefetch/read/path", body)
            assert status == 400, reply
            assert daemon_rss_bytes(pid) < budget + overhead
    # 16 readers of a 192 MiB /batchdownload reply that never read it.
    m = str(mount.mountpoint)
    socks = []
    peak = 0
    payload = json.dumps([[f"{m}/pub/big.bin"] * 4]).encode()
    for _ in range(16):
        s = socket.create_connection(("127.0.0.1", prof), timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"POST /batchdownload/path HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                  % len(payload) + payload)
        socks.append(s)
    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            peak = max(peak, daemon_rss_bytes(pid))
            time.sleep(0.1)
        print(f"daemon RSS: {base_rss >> 20} MiB at start, {peak >> 20} MiB peak under 16 "
              f"stalled 192 MiB replies (budget {budget >> 20} MiB + {overhead >> 20} MiB)")
        assert peak < budget + overhead, peak
        # the daemon still answers others meanwhile
        assert stats(sock)["global"] is not None
    finally:
        for s in socks:
            s.close()
    # A burst of large publishes (80,000 paths each, past the per-user queue limit) is
    # accepted as far as the limits go, and RSS stays within the stated bound.
    burst = [[f"{m}/pub/f{i:03d}" for i in range(40)] * 2000]
    for _ in range(4):
        status, body = call(UnixHTTPConnection(sock, timeout=60), "POST", "/prefetch/read/path",
                            burst)
        assert (status, body) == (200, b"prefetching.\n")
    assert daemon_rss_bytes(pid) < budget + overhead


# A hostile user's client, run as that user: opens `streams` streams, then publishes batches
# of paths round-robin over them, halving the batch at each 429 until a single path is
# refused, within `max_requests` requests and `seconds`. The paths are `prefix` plus a distinct
# name of `name_len` bytes, or, given `cycle`, those paths over and over. With `delete`, it
# deletes those streams instead. Prints what it got as JSON.
_FLOOD = r'''
import http.client, json, socket, sys, time
spec = json.loads(sys.stdin.read())

class Unix(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=30)
        self._path = path
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)

conn = Unix(spec["socket"])
def call(method, target, body=None):
    conn.request(method, target, body=None if body is None else json.dumps(body),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, r.read()

out = {"accepted": 0, "requests": 0, "errors": [], "statuses": {}}
if "delete" in spec:
    for sid in spec["delete"]:
        status = str(call("DELETE", "/v1/streams/" + sid)[0])
        out["statuses"][status] = out["statuses"].get(status, 0) + 1
    print(json.dumps(out))
    sys.exit(0)
ids = []
for _ in range(spec["streams"]):
    status, body = call("POST", "/v1/streams", {"name": "flood", "pid": 1})
    assert status == 201, (status, body)
    ids.append(json.loads(body)["id"])
out["ids"] = ids
batch, n = spec["batch"], 0
deadline = time.monotonic() + spec["seconds"]
while batch >= 1 and out["requests"] < spec["max_requests"] and time.monotonic() < deadline:
    paths = []
    for _ in range(batch):
        if "cycle" in spec:
            paths.append(spec["cycle"][n % len(spec["cycle"])])
        else:
            name = "%s%09d_" % (spec["tag"], n)
            paths.append(spec["prefix"] + name.ljust(spec["name_len"], "x"))
        n += 1
    sid = ids[out["requests"] % len(ids)]
    status, body = call("POST", "/v1/streams/%s/paths" % sid, {"paths": paths})
    out["requests"] += 1
    if status == 202:
        out["accepted"] += json.loads(body)["accepted"]
    elif status == 429:
        error = json.loads(body)["error"]
        if error not in out["errors"]:
            out["errors"].append(error)
        batch //= 2
    else:
        raise SystemExit("publish: %d %r" % (status, body[:300]))
out["last_batch"] = batch
print(json.dumps(out))
'''


def flood(pid: int, specs: dict[int, dict[str, Any]], base_rss: int, bound: int,
          seconds: float) -> tuple[dict[int, Any], int]:
    """Runs _FLOOD as each uid in `specs` at once, sampling the daemon's RSS meanwhile; stops
    them all once the daemon holds `bound` bytes over `base_rss` (the assertion after it then
    fails) or after `seconds`. Their results by uid, and the daemon's peak RSS."""
    procs = {uid: start_script_as(_FLOOD, dict(spec, seconds=seconds - 5), uid)
             for uid, spec in specs.items()}
    peak = 0
    deadline = time.monotonic() + seconds
    try:
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            peak = max(peak, daemon_rss_bytes(pid))
            if peak >= base_rss + bound:
                break
            time.sleep(0.02)
        peak = max(peak, daemon_peak_rss_bytes(pid))
        assert peak < base_rss + bound, (
            f"daemon RSS {peak >> 20} MiB, over {base_rss >> 20} MiB at start + {bound >> 20} MiB")
        assert all(p.poll() is not None for p in procs.values()), f"flood still on after {seconds} s"
        return {uid: script_result(p, timeout=5) for uid, p in procs.items()}, peak
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def delete_streams(sock: str, uid: int, ids: list[str]) -> None:
    out = script_result(start_script_as(_FLOOD, {"socket": sock, "delete": ids}, uid))
    assert out["statuses"] == {"204": len(ids)}, out


def publish_as(sock: str, uid: int, paths: list[str]) -> dict[str, Any]:
    """A new stream of `uid` and `paths` published into it: the reply's status and body."""
    out = as_user({"kind": "unix", "socket": sock, "target": "/v1/streams", "body": {"name": "t"}},
                  uid=uid)
    assert out["status"] == 201, out
    sid = json.loads(out["body"])["id"]
    out = as_user({"kind": "unix", "socket": sock, "target": f"/v1/streams/{sid}/paths",
                   "body": {"paths": paths}}, uid=uid)
    return {"status": out["status"], "body": json.loads(out["body"]) if out["body"] else None,
            "id": sid}


def test_two_users_flooding_long_paths_stay_within_the_memory_bound(
        open_cube: CubeFactory) -> None:
    """Two users, 64 streams each, publish paths of about 4,000 bytes until refused: the memory
    limits on queued paths hold the daemon within the bound docs/security.md states, the 429s
    name the limit hit, a third user still gets 5,000 paths in, and deleting the streams gives
    the memory back."""
    base = open_cube.base.parent
    src = make_store(base)
    # Directories with names of 250 bytes (NAME_MAX is 255): published paths of 4,000 bytes
    # below them pass every check (the files themselves are checked when fetched).
    deep = src
    for i in range(15):
        deep = deep / (chr(ord("a") + i) * 250)
    deep.mkdir(parents=True, mode=0o755)
    mount, sock, _ = start(open_cube, src)  # default limits on queued paths
    m = str(mount.mountpoint)
    prefix = f"{m}/{deep.relative_to(src)}/"
    name_len = 4000 - len(prefix)
    assert 16 <= name_len <= 255, name_len
    pid = find_pid(mount)
    base_rss = daemon_rss_bytes(pid)
    bound = 200 << 20  # docs/security.md: what the control server adds at most, default limits
    spec = {"socket": sock, "streams": 64, "prefix": prefix, "name_len": name_len,
            "batch": 512, "max_requests": 300}
    began = time.monotonic()
    results, peak = flood(pid, {uid: dict(spec, tag=f"u{uid}_") for uid in (NOBODY, OTHER)},
                          base_rss, bound, seconds=40)
    took = time.monotonic() - began
    g = stats(sock)["global"]["prefetch"]
    print(f"daemon RSS: {base_rss >> 20} MiB at start, {peak >> 20} MiB peak under two users' "
          f"4,000-byte paths ({sum(r['accepted'] for r in results.values())} queued, "
          f"{g['queued_bytes'] >> 20} MiB counted, {took:.1f} s)")
    for uid, r in results.items():
        # Each went on until a single path was refused, by a limit on memory: the count
        # limits are far (4,000 paths fill a user's 32 MiB).
        assert r["last_batch"] == 0 and r["accepted"] > 0, r
        assert r["errors"], r
        for error in r["errors"]:
            assert "prefetch.max_queued_path_bytes" in error, error
    assert g["queued_bytes"] <= 64 << 20 and g["queued_users"] == 2, g
    # A third user, with nothing queued, still gets 5,000 paths in.
    third = publish_as(sock, THIRD, [f"{m}/pub/f{i % 40:03d}" for i in range(5000)])
    assert third["status"] == 202 and third["body"] == {"accepted": 5000, "rejected": 0}, third
    # Their streams deleted, the memory goes back to the system.
    held = daemon_rss_bytes(pid)
    for uid, r in results.items():
        delete_streams(sock, uid, r["ids"])
    assert wait_until(lambda: daemon_rss_bytes(pid) < base_rss + (held - base_rss) // 2,
                      timeout=5), (base_rss >> 20, held >> 20, daemon_rss_bytes(pid) >> 20)
    print(f"daemon RSS: {held >> 20} MiB with the paths queued, "
          f"{daemon_rss_bytes(pid) >> 20} MiB once their streams were deleted")
    assert stats(sock)["global"]["prefetch"]["queued_users"] == 1


def test_two_users_filling_the_queue_leave_room_for_a_third(open_cube: CubeFactory) -> None:
    """The global count limit is shared fairly: two users publishing short paths until refused
    cannot take it all, and the 429 names the limit each hit."""
    src = make_store(open_cube.base.parent)
    mount, sock, _ = start(open_cube, src)  # 131,072 paths per user, 262,144 in all
    m = str(mount.mountpoint)
    pid = find_pid(mount)
    cycle = [f"{m}/pub/f{i:03d}" for i in range(40)]
    spec = {"socket": sock, "streams": 64, "cycle": cycle, "batch": 16384, "max_requests": 200}
    results, _ = flood(pid, {NOBODY: spec}, daemon_rss_bytes(pid), 200 << 20, seconds=40)
    first = results[NOBODY]
    # Alone, a user may have half the pool: here its own limit, named.
    assert first["accepted"] == 131072, first
    assert any("prefetch.max_queued_paths_per_uid" in e for e in first["errors"]), first
    results, _ = flood(pid, {OTHER: spec}, daemon_rss_bytes(pid), 200 << 20, seconds=40)
    second = results[OTHER]
    # The second gets a third of the pool: its fair share, named.
    assert second["accepted"] == 262144 // 3, second
    assert all("fair share" in e and "prefetch.max_queued_paths" in e
               for e in second["errors"]), second
    third = publish_as(sock, THIRD, [cycle[i % 40] for i in range(5000)])
    assert third["status"] == 202 and third["body"] == {"accepted": 5000, "rejected": 0}, third
    assert stats(sock)["global"]["prefetch"]["queued_paths"] == 131072 + 262144 // 3 + 5000


def test_over_long_paths_and_names_are_refused(open_cube: CubeFactory) -> None:
    """A path over PATH_MAX (4096 bytes) or with a name over NAME_MAX (255) is refused as it is
    parsed, path by path, as any other bad path: never queued."""
    src = make_store(open_cube.base.parent)
    mount, sock, prof = start(open_cube, src)
    m = str(mount.mountpoint)
    long_name = f"{m}/pub/{'n' * 256}"
    long_path = f"{m}/pub/" + "/".join(["d" * 200] * 21)
    assert len(long_path) > 4096
    ok = f"{m}/pub/f000"
    out = publish_as(sock, NOBODY, [long_name, long_path, ok])
    assert out["status"] == 202 and out["body"] == {"accepted": 1, "rejected": 2}, out
    for bad, limit in ((long_name, "NAME_MAX"), (long_path, "PATH_MAX")):
        out = publish_as(sock, NOBODY, [bad])
        assert out["status"] == 422, out
        assert limit in out["body"]["error"] and len(out["body"]["error"]) < 300, out
    # The legacy endpoint keeps only the good one.
    out = as_user({"kind": "tcp", "port": prof, "target": "/prefetch/read/path",
                   "body": [[long_name, long_path, ok]]}, uid=OTHER)
    assert (out["status"], out["body"]) == (200, b"prefetching.\n")
    g = stats(sock)
    assert g["global"]["control"]["rejected_paths"]["outside"] == 6, g["global"]["control"]
    queued = {s["uid"]: s["published"] for s in g["streams"] if s["published"]}
    assert queued == {NOBODY: 1, OTHER: 1}, g["streams"]
    # /v1/files/open and /batchdownload refuse it too.
    out = as_user({"kind": "open", "socket": sock, "path": long_name})
    assert out["status"] == 422 and out["fds"] == 0, out
    status, body = call(UnixHTTPConnection(sock), "POST", "/batchdownload/path", [[long_name, ok]])
    assert status == 200 and dict(parse_batch(body))[long_name] == b""


def test_one_users_flood_does_not_starve_another(open_cube: CubeFactory) -> None:
    src = make_store(open_cube.base.parent)
    mount, sock, _ = start(open_cube, src, prefetch={"max_inflight": 4, "window_files": 16})
    m = str(mount.mountpoint)
    flood = as_user({"kind": "unix", "socket": sock, "target": "/v1/streams", "body": {"name": "f"}})
    fid = json.loads(flood["body"])["id"]
    out = as_user({"kind": "unix", "socket": sock, "target": f"/v1/streams/{fid}/paths",
                   "body": {"paths": [f"{m}/pub/f{i % 30:03d}" for i in range(5000)]}})
    assert out["status"] == 202
    assert wait_until(lambda: stats(sock)["global"]["prefetch"]["window_files"] >= 16, timeout=10)
    fair = as_user({"kind": "unix", "socket": sock, "target": "/v1/streams", "body": {"name": "g"}},
                   uid=OTHER)
    gid = json.loads(fair["body"])["id"]
    out = as_user({"kind": "unix", "socket": sock, "target": f"/v1/streams/{gid}/paths",
                   "body": {"paths": [f"{m}/pub/f{i:03d}" for i in range(30, 40)]}}, uid=OTHER)
    assert out["status"] == 202, out

    def fair_fetched() -> int:
        return next(s["fetched"] for s in stats(sock)["streams"] if s["id"] == gid)
    assert wait_until(lambda: fair_fetched() >= 8, timeout=15), stats(sock)
    assert stats(sock)["global"]["prefetch"]["window_files"] <= 16


def test_forged_log_lines_are_escaped(open_cube: CubeFactory) -> None:
    src = make_store(open_cube.base.parent)
    mount, sock, prof = start(open_cube, src)
    forged = f"{mount.mountpoint}/nope\nE 2026-01-01 00:00:00.000000 1 forged.cc:1] FORGED"
    began = time.monotonic()
    for _ in range(30):  # 30 requests of 100 failures each
        conn = http.client.HTTPConnection("127.0.0.1", prof, timeout=10)
        assert call(conn, "POST", "/batchdownload/path", [[forged] * 100])[0] == 200
    log = (mount.workdir / "log" / "cubetorchfs.log").read_text(errors="replace")
    assert not any(line.startswith("E 2026-01-01") for line in log.splitlines())
    assert "\\nE 2026-01-01" in log
    # 3,000 failures: a burst of 10 lines, then about one a second.
    lines = sum("FORGED" in line for line in log.splitlines())
    assert 1 <= lines <= 10 + (time.monotonic() - began) + 2, lines


def test_idle_connections_do_not_starve_others(open_cube: CubeFactory) -> None:
    src = make_store(open_cube.base.parent)
    mount, sock, prof = start(open_cube, src, control={"idle_timeout_s": 2})
    held = []
    try:
        # One user's 150 idle TCP connections: 64 kept (the per-user cap), the rest refused.
        for _ in range(150):
            held.append(socket.create_connection(("127.0.0.1", prof), timeout=2))
        time.sleep(0.5)
        # Another user, on either listener, is still served.
        for kind in ("unix", "tcp"):
            out = as_user({"kind": kind, "socket": sock, "port": prof, "method": "GET",
                           "target": "/v1/stats"}, uid=OTHER)
            assert out["status"] == 200, out
        seen = as_user({"kind": "unix", "socket": sock, "method": "GET", "target": "/v1/stats"},
                       uid=OTHER)
        refused = json.loads(seen["body"])["global"]["control"]["refused"]
        assert refused["user_full"] == 150 - 64 and refused["listener_full"] == 0, refused
        # Idle ones are closed by the daemon after control.idle_timeout_s (2 s).
        kept = held[:64]
        deadline = time.monotonic() + 10
        closed = 0
        for s in kept:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                closed += s.recv(1) == b""
            except (socket.timeout, ConnectionError):
                pass
        assert closed == len(kept), f"{closed} of {len(kept)} idle connections closed"
    finally:
        for s in held:
            s.close()


def test_a_request_cannot_claim_another_uid(open_cube: CubeFactory) -> None:
    """The caller's uid comes from the kernel: nothing a client sends changes it."""
    src = make_store(open_cube.base.parent)
    mount, sock, prof = start(open_cube, src)
    p = f"{mount.mountpoint}/private.bin"
    for kind in ("tcp", "unix"):
        out = as_user({"kind": kind, "port": prof, "socket": sock, "target": "/batchdownload/path",
                       "headers": {"X-Uid": "0", "X-Forwarded-User": "root"}, "body": [[p]]})
        assert out["status"] == 200, out
        assert dict(parse_batch(out["body"]))[p] == b""


def test_without_allow_other_only_root_may_use_the_control_api(open_cube: CubeFactory) -> None:
    # The kernel lets no user but root into a mount without allow_other: the daemon's API,
    # which serves the same files, must not let them in either.
    open_cube.options = []
    src = make_store(open_cube.base.parent)
    mount, sock, prof = start(open_cube, src)
    for kind in ("unix", "tcp"):
        out = as_user({"kind": kind, "socket": sock, "port": prof, "method": "GET",
                       "target": "/v1/stats"})
        assert out["status"] == 0, out  # the connection is closed unanswered
        out = as_user({"kind": kind, "socket": sock, "port": prof,
                       "target": "/batchdownload/path",
                       "body": {"paths": [f"{mount.mountpoint}/pub/f000"]}})
        assert out["status"] == 0, out
    assert mount.metrics().value("cubetorchfs_control_refused_total",
                                 reason="not_allow_other") == 4
    assert stats(sock)["streams"] == []  # root is served


def test_busy_stream_and_listener_limits_answer_through_the_real_daemon(
        open_cube: CubeFactory) -> None:
    """The limits a flood meets, end to end: 503 busy when the request memory is reserved by
    bodies still being sent, 429 naming prefetch.max_streams_per_uid, and listener_full when a
    listener holds its most connections; each counted in /v1/stats, and the daemon serves
    again once the holders leave."""
    src = make_store(open_cube.base.parent)
    mount, sock, prof = start(open_cube, src,
                              control={"max_body_bytes": "1MiB", "body_memory_bytes": "1MiB",
                                       "max_connections_tcp": 4, "idle_timeout_s": 5},
                              prefetch={"max_inflight": 4, "max_streams_per_uid": 3})
    held: list[socket.socket] = []
    try:
        # A body of 900 KiB announced and not sent holds 900 KiB of the 1 MiB: the next is 503.
        first = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        first.settimeout(5)
        first.connect(sock)
        first.sendall(b"POST /v1/streams HTTP/1.1\r\nHost: x\r\nContent-Length: 921600\r\n\r\n{")
        held.append(first)
        reply = b""
        for _ in range(20):  # until the first body's reservation is made (at once, normally)
            second = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            second.settimeout(2)
            second.connect(sock)
            second.sendall(b"POST /v1/streams HTTP/1.1\r\nHost: x\r\n"
                           b"Content-Length: 921600\r\n\r\n{")
            try:
                reply = second.recv(4096)
            except socket.timeout:
                reply = b""
            second.close()
            if reply:
                break
            time.sleep(0.2)
        assert reply.startswith(b"HTTP/1.1 503 ") and b"busy" in reply, reply[:300]
        first.close()
        held.clear()
        # Streams: the fourth of one user is 429, naming the key and its value.
        statuses = []
        for i in range(4):
            out = as_user({"kind": "unix", "socket": sock, "method": "POST",
                           "target": "/v1/streams", "body": {"name": f"s{i}", "pid": 1}})
            statuses.append(out["status"])
            last = out
        assert statuses == [201, 201, 201, 429], statuses
        assert b"prefetch.max_streams_per_uid" in last["body"] and b"at most 3" in last["body"], last
        # The TCP listener holds 4 connections: a fifth is refused as listener_full.
        for _ in range(4):
            held.append(socket.create_connection(("127.0.0.1", prof), timeout=5))
        extra = socket.create_connection(("127.0.0.1", prof), timeout=5)
        extra.settimeout(5)
        try:
            gone = extra.recv(1) == b""
        except ConnectionError:
            gone = True
        extra.close()
        assert gone, "a connection past control.max_connections_tcp was kept"
        refused = stats_of(sock)["global"]["control"]["refused"]
        assert refused["busy"] >= 1 and refused["listener_full"] >= 1, refused
    finally:
        for s in held:
            s.close()
    # Served again once the holders are gone.
    assert wait_until(lambda: tcp_answers(prof), 10)


def stats_of(sock: str) -> dict[str, Any]:
    out = as_user({"kind": "unix", "socket": sock, "method": "GET", "target": "/v1/stats"})
    assert out["status"] == 200, out
    return json.loads(out["body"])


def tcp_answers(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
        conn.request("POST", "/register/pid", body=json.dumps([1]))
        return conn.getresponse().status == 200
    except OSError:
        return False
