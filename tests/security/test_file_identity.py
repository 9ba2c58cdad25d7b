"""A file is its identity, not its name, size and mtime: an unprivileged user who copies another
user's file's size and mtime onto a file of their own (os.utime) and swaps directories gets
neither the other user's bytes nor a way to feed them bytes of their own.

The setting: a shared directory `team/` (0777, no sticky bit) holding the victim's directory
`team/v/` (0755) with 0600 files. The attacker (NOBODY) and the victim (OTHER) are
unprivileged; the daemon runs as root with allow_other. Each swap is tried through the mount
(the daemon sees the renames) and in the store itself (a user who may also write the store,
as beside a CubeFS or NFS mount)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from cubefs_harness import CubeFactory, environment_problem
from seclib import NOBODY, OTHER, open_cube, script_result, start_script_as  # noqa: F401

pytestmark = [
    pytest.mark.skipif(environment_problem() is not None, reason=environment_problem() or ""),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, setpriv, allow_other)"),
]

PROFILES = {"default": {}, "ai_prefetch": {"profile": "ai_prefetch"}}


def victim_bytes(n: int) -> bytes:
    return (b"VICTIM-SECRET-" * (n // 14 + 1))[:n]


def evil_bytes(n: int) -> bytes:
    return (b"EVIL ATTACKER BYTES " * (n // 20 + 1))[:n]


def make_team(base: Path, files: dict[str, int]) -> Path:
    """src/team (0777, not sticky) with the victim's team/v/ holding 0600 `files` of the given
    sizes, all owned by OTHER."""
    src = base / "src"
    team = src / "team"
    v = team / "v"
    v.mkdir(parents=True)
    os.chmod(src, 0o755)
    os.chmod(team, 0o777)
    os.chmod(v, 0o755)
    os.chown(v, OTHER, OTHER)
    for name, size in files.items():
        p = v / name
        p.write_bytes(victim_bytes(size))
        os.chmod(p, 0o600)
        os.chown(p, OTHER, OTHER)
    return src


# Run as the attacker: the open-descriptor swap. `where` is the mount (the renames go through
# it) or the store (they go around it); reads always go through the mount.
_OPEN_SWAP = r'''
import errno, json, os, sys
spec = json.loads(sys.stdin.read())
m, where, name = spec["mount"], spec["where"], spec["name"]
st = os.stat(f"{m}/team/v/{name}")                     # 1. the victim's size and mtime
os.makedirs(f"{where}/team/x", exist_ok=True)
mine = f"{where}/team/x/{name}"
with open(mine, "wb") as f:                             # 2. a file of the same size and mtime
    f.write(b"A" * st.st_size)
os.utime(mine, ns=(st.st_atime_ns, st.st_mtime_ns))
fd = os.open(f"{m}/team/x/{name}", os.O_RDONLY)         # opened, nothing read yet
os.rename(f"{where}/team/x", f"{where}/team/x_old")     # 3. swap the directories
os.rename(f"{where}/team/v", f"{where}/team/x")
out = {}
try:                                                    # 4. read the open descriptor
    got = b""
    for off in range(0, st.st_size, 1 << 20):
        got += os.pread(fd, 1 << 20, off)
    out["read"] = got[:64].decode(errors="replace")
    out["victim"] = b"VICTIM-SECRET" in got
except OSError as e:
    out["errno"] = e.errno
os.close(fd)
print(json.dumps(out))
'''


@pytest.mark.parametrize("size", [1 << 20, 40 << 20], ids=["1MiB-cached", "40MiB-streamed"])
@pytest.mark.parametrize("via", ["mount", "store"])
@pytest.mark.parametrize("profile", list(PROFILES))
def test_an_open_descriptor_never_reads_another_users_file_swapped_under_it(
        open_cube: CubeFactory, profile: str, via: str, size: int) -> None:
    base = open_cube.base.parent
    src = make_team(base, {"secret.bin": size})
    mount = open_cube.mount(src, PROFILES[profile])
    m = str(mount.mountpoint)
    spec: dict[str, Any] = {"mount": m, "where": m if via == "mount" else str(src),
                            "name": "secret.bin"}
    out = script_result(start_script_as(_OPEN_SWAP, spec, NOBODY), timeout=120)
    # Either the attacker's own bytes (the handle follows the file it opened) or ESTALE; never
    # the victim's.
    assert not out.get("victim", False), out
    if "errno" not in out:
        assert out["read"] == "A" * 64, out
    else:
        assert out["errno"] in (116, 5), out  # ESTALE (EIO where the kernel maps it)


# Run as the attacker: moves the victim's directory team/v aside, makes its own team/v/<name>
# with the victim's size and mtime and reads it through the mount. "probe": the victim's file
# was cached; prints whether the read gave the victim's bytes or its own. "poison": its own
# bytes are evil, then the victim's directory is put back; prints whether they were read (and
# so cached under the victim's path).
_FORGE = r'''
import json, os, sys, time
spec = json.loads(sys.stdin.read())
m, where, name, mode = spec["mount"], spec["where"], spec["name"], spec["mode"]
st = os.stat(f"{m}/team/v/{name}")
os.rename(f"{where}/team/v", f"{where}/team/v_real")
os.mkdir(f"{where}/team/v")
mine = f"{where}/team/v/{name}"
fill = b"A" if mode == "probe" else b"EVIL ATTACKER BYTES "
own = (fill * (st.st_size // len(fill) + 1))[:st.st_size]
with open(mine, "wb") as f:
    f.write(own)
os.utime(mine, ns=(st.st_atime_ns, st.st_mtime_ns))
time.sleep(spec["settle"])                              # the kernel's view of the swap expires
try:
    with open(f"{m}/team/v/{name}", "rb") as f:
        got = f.read()
except OSError:                                         # the kernel still holds the victim's
    got = b""                                           # mode: refused
if mode == "poison":
    os.rename(f"{where}/team/v", f"{where}/team/v_evil")
    os.rename(f"{where}/team/v_real", f"{where}/team/v")
print(json.dumps({"victim": b"VICTIM-SECRET" in got, "own": got == own}))
'''

_READ = r'''
import json, sys
spec = json.loads(sys.stdin.read())
with open(spec["path"], "rb") as f:
    got = f.read()
print(json.dumps({"evil": b"EVIL ATTACKER" in got, "victim": got.startswith(b"VICTIM-SECRET")}))
'''


@pytest.mark.parametrize("via", ["mount", "store"])
@pytest.mark.parametrize("profile", list(PROFILES))
def test_a_forged_size_and_mtime_neither_reads_nor_poisons_the_cache(
        open_cube: CubeFactory, profile: str, via: str) -> None:
    base = open_cube.base.parent
    src = make_team(base, {"secret2.bin": 300_000, "model.bin": 200_000})
    mount = open_cube.mount(src, PROFILES[profile])
    m = str(mount.mountpoint)
    where = m if via == "mount" else str(src)
    # The victim reads its files: both are in the RAM cache now.
    for name in ("secret2.bin", "model.bin"):
        got = script_result(start_script_as(_READ, {"path": f"{m}/team/v/{name}"}, OTHER))
        assert got["victim"], got
    # The attacker's own file at the victim's path, with the victim's size and mtime.
    # Through the mount the daemon sees every rename; in the store it learns of them once the
    # attributes it and the kernel hold expire (1 s under the default profile; under
    # ai_prefetch the kernel refuses the attacker by the victim's mode meanwhile).
    settle = 1.5 if via == "store" else 0
    spec = {"mount": m, "where": where, "settle": settle, "name": "secret2.bin", "mode": "probe"}
    out = script_result(start_script_as(_FORGE, spec, NOBODY))
    assert not out["victim"], out
    if via == "mount":
        assert out["own"], out
    # Put things back as they were, as root, for the second attack.
    os.rename(Path(where) / "team" / "v", Path(where) / "team" / "v_probe")
    os.rename(Path(where) / "team" / "v_real", Path(where) / "team" / "v")
    # The attacker's bytes cached under the victim's path; the victim's next read.
    spec.update(name="model.bin", mode="poison")
    poisoned = script_result(start_script_as(_FORGE, spec, NOBODY))
    if via == "mount":
        assert poisoned["own"], poisoned
    time.sleep(settle)
    got = script_result(start_script_as(_READ, {"path": f"{m}/team/v/model.bin"}, OTHER))
    assert not got["evil"] and got["victim"], got
