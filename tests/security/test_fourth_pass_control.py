"""The fourth security pass's findings on the control API, each tried as an unprivileged user
against a real daemon (docs/security.md, "Bounded resources"): memory files of
/v1/files/batch kept mapped after their descriptors are closed, positions naming a long path
decoded before the queued-path limits applied, and file lists that left a newcomer nothing."""

from __future__ import annotations

import base64
import json
import os
import random
import struct
from pathlib import Path
from typing import Any

import pytest

from cubefs_harness import CubeFactory, environment_problem
from seclib import (NOBODY, OTHER, POST_WITH_FDS, THIRD, as_user, daemon_peak_rss_bytes, find_pid,  # noqa: F401
                    open_cube, script_result, start_script_as)

pytestmark = [
    pytest.mark.skipif(environment_problem() is not None, reason=environment_problem() or ""),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, setpriv, allow_other)"),
]


def public_store(base: Path) -> Path:
    """base/src and base/src/pub, traversable by every user."""
    src = base / "src"
    (src / "pub").mkdir(parents=True)
    for d in (src, src / "pub"):
        os.chmod(d, 0o755)
    return src


def control_socket(mount: Any) -> str:
    return mount.read_control()["control_socket"]


# As the attacker: asks for `count` batches of `path`, maps each memory file and closes its
# descriptor (the mapping keeps the pages), then, with `release`, unmaps them all and asks
# once more. Prints the statuses, the first refusal's error and the bytes kept mapped.
_BATCHES = POST_WITH_FDS + r'''
import json, mmap, os, sys
spec = json.loads(sys.stdin.read())

def batch(path):
    data, fds = post_with_fds(spec["socket"], b"/v1/files/batch", path.encode() + b"\0")
    status = int(data.split(b"\r\n", 1)[0].split()[1])
    return status, data.split(b"\r\n\r\n", 1)[-1], fds

out = {"statuses": [], "error": None, "mapped": 0}
maps = []
for _ in range(spec["count"]):
    status, body, fds = batch(spec["path"])
    out["statuses"].append(status)
    if status != 200 and out["error"] is None:
        out["error"] = json.loads(body).get("error")
    for fd in fds:
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        m[size - 1]  # touched: the pages are there
        maps.append(m)
        out["mapped"] += size
        os.close(fd)  # the mapping outlives it
if spec.get("release"):
    for m in maps:
        m.close()
    status, body, fds = batch(spec["path"])
    out["after_release"] = status
    for fd in fds:
        os.close(fd)
print(json.dumps(out))
'''


def test_batch_memory_files_kept_mapped_are_bounded_per_user(open_cube: CubeFactory) -> None:
    """Finding 4: 1,024 batches of 4 MiB, each mapped and its descriptor closed, held 4 GiB of
    the daemon's memory. Here with a bound of 8 MiB a user: the ninth batch of 1 MB is
    refused naming the key while the first eight stay mapped, another user is not refused,
    and unmapping them gives the room back."""
    src = public_store(open_cube.base.parent)
    (src / "pub" / "big.bin").write_bytes(os.urandom(1_000_000))
    os.chmod(src / "pub" / "big.bin", 0o644)
    mount = open_cube.mount(src, {"control": {"batch_max_bytes": "1MiB",
                                              "batch_memory_bytes_per_uid": "8MiB"}})
    sock = control_socket(mount)
    path = f"{mount.mountpoint}/pub/big.bin"
    attacker = start_script_as(_BATCHES, {"socket": sock, "path": path, "count": 24}, NOBODY)
    got = script_result(attacker, timeout=60)
    # 8 MiB hold eight batches of 1 MB (each charged in whole pages).
    assert got["statuses"][:8] == [200] * 8, got
    assert set(got["statuses"][8:]) == {429}, got
    assert "control.batch_memory_bytes_per_uid" in got["error"], got
    assert got["mapped"] == 8 * 1_000_000, got
    # The bound is the user's own: another user's batch is served meanwhile.
    other = start_script_as(_BATCHES, {"socket": sock, "path": path, "count": 1}, OTHER)
    assert script_result(other, timeout=30)["statuses"] == [200]
    # Unmapped, the pages are gone and so is the charge.
    again = start_script_as(_BATCHES, {"socket": sock, "path": path, "count": 8,
                                       "release": True}, NOBODY)
    got = script_result(again, timeout=60)
    assert got["statuses"] == [200] * 8 and got["after_release"] == 200, got


def test_positions_naming_a_long_path_are_refused_before_they_are_decoded(
        open_cube: CubeFactory) -> None:
    """Finding 7: a list of one 3,778-byte path, then requests of 131,072 positions naming it,
    took the daemon's peak memory from 90 to 569 MiB before each got 429. Now the request is
    refused once its paths pass what one user may queue (32 MiB by default)."""
    src = public_store(open_cube.base.parent)
    deep = src / "pub"
    for i in range(14):
        deep = deep / (chr(ord("a") + i) * 255)
    deep.mkdir(parents=True)
    d = deep
    while d != src:
        os.chmod(d, 0o755)
        d = d.parent
    mount = open_cube.mount(src, {})
    sock = control_socket(mount)
    m = str(mount.mountpoint)
    rel = f"{deep.relative_to(src)}/"
    name = "x" * (3778 - len(rel))
    assert len(rel + name) == 3778 and len(name) <= 255
    (deep / name).write_bytes(b"long")
    os.chmod(deep / name, 0o644)
    out = as_user({"kind": "unix", "socket": sock, "target": "/v1/lists",
                   "body_b64": base64.b64encode(os.fsencode(f"{m}/{rel}{name}") + b"\0").decode()})
    assert out["status"] == 201, out
    reg = json.loads(out["body"])
    assert reg["rejected"] == 0, reg
    out = as_user({"kind": "unix", "socket": sock, "target": "/v1/streams",
                   "body": {"name": "n", "list": reg["id"]}})
    assert out["status"] == 201, out
    sid = json.loads(out["body"])["id"]
    pid = find_pid(mount)
    before = daemon_peak_rss_bytes(pid)
    body = struct.pack("<Q", 0xFFFFFFFFFFFFFFFF) + bytes(4 * 131072)  # entry 0, 131,072 times
    for _ in range(3):
        out = as_user({"kind": "unix", "socket": sock, "target": f"/v1/streams/{sid}/positions",
                       "body_b64": base64.b64encode(body).decode()})
        assert out["status"] == 429, out
        error = json.loads(out["body"])["error"]
        assert "prefetch.max_queued_path_bytes" in error, error
    grown = daemon_peak_rss_bytes(pid) - before
    print(f"daemon peak RSS grew {grown >> 20} MiB over three requests of 131,072 positions")
    # What one user may queue (32 MiB of paths) and the request itself, not 131,072 paths.
    assert grown < 96 << 20, grown >> 20
    # Within the limits, positions of the same list are taken.
    small = struct.pack("<Q", 0xFFFFFFFFFFFFFFFF) + bytes(4 * 100)
    out = as_user({"kind": "unix", "socket": sock, "target": f"/v1/streams/{sid}/positions",
                   "body_b64": base64.b64encode(small).decode()})
    assert out["status"] == 202 and json.loads(out["body"])["accepted"] == 100, out


# As a user: registers lists of random 60-byte names (incompressible) in batches until the
# daemon refuses one; prints the entries held and the refusal.
_FILL_LISTS = r'''
import http.client, json, random, socket, sys
spec = json.loads(sys.stdin.read())

class Unix(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(spec["socket"])

rng = random.Random(spec["seed"])
out = {"entries": 0, "status": None, "error": None}
list_id = None
for _ in range(200):
    names = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(60))
             for _ in range(spec["batch"])]
    body = b"".join((spec["prefix"] + n).encode() + b"\0" for n in names)
    conn = Unix("localhost", timeout=30)
    conn.request("POST", "/v1/lists" + ("/" + list_id if list_id else ""), body=body)
    r = conn.getresponse()
    reply = json.loads(r.read())
    if r.status not in (200, 201):
        out["status"], out["error"] = r.status, reply.get("error")
        break
    list_id = reply["id"]
    out["entries"] = reply["size"]
print(json.dumps(out))
'''


def test_two_users_full_of_file_lists_leave_a_newcomer_its_share(open_cube: CubeFactory) -> None:
    """Finding 8: two users holding all their lists could take the whole list pool, and a third
    got 429 for a list it could register alone. Here with 1 MiB a user and 2 MiB in all: the
    first user alone gets its 1 MiB, the second a third of the pool, and the third still
    registers an ImageNet-like list of 20,000 paths (160 KiB)."""
    src = public_store(open_cube.base.parent)
    train = src / "train" / "n01440764"
    train.mkdir(parents=True)
    for d in (src / "train", train):
        os.chmod(d, 0o755)
    mount = open_cube.mount(src, {"prefetch": {"max_list_bytes_per_uid": "1MiB",
                                               "max_list_bytes": "2MiB"}})
    sock = control_socket(mount)
    m = str(mount.mountpoint)
    held = {}
    for uid, seed in ((NOBODY, 1), (OTHER, 2)):
        p = start_script_as(_FILL_LISTS, {"socket": sock, "prefix": f"{m}/pub/", "batch": 2000,
                                          "seed": seed}, uid)
        held[uid] = script_result(p, timeout=60)
        assert held[uid]["status"] == 429, held[uid]
    # The newcomer: 20,000 ImageNet-like names (random numbers, sorted as ImageFolder gives).
    rng = random.Random(3)
    numbers = sorted(rng.sample(range(1, 1_300_000), 20_000))
    body = b"".join(f"{m}/train/n01440764/n01440764_{n}.JPEG".encode() + b"\0"
                    for n in numbers)
    out = as_user({"kind": "unix", "socket": sock, "target": "/v1/lists",
                   "body_b64": base64.b64encode(body).decode()}, uid=THIRD)
    assert out["status"] == 201, out
    reg = json.loads(out["body"])
    assert (reg["size"], reg["rejected"]) == (20_000, 0), reg
    # Each of the first two was stopped by the limit it reached: its own, then its share.
    assert "prefetch.max_list_bytes_per_uid" in held[NOBODY]["error"], held
    assert "fair share" in held[OTHER]["error"], held
