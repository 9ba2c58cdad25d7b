"""The Debian package (scripts/package.sh) as an operator uses it: lintian, an install into a
fresh root with dpkg --root, and a real `dpkg -i` with `mount -t cubetorchfs`, an fstab line
and `dpkg -r`."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from cubefs_harness import environment_problem, mount_entry, run_command, wait_until

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("CUBETORCHFS_BIN", REPO / "build" / "bin" / "cubetorchfs")).parents[1]

def _sanitized() -> bool:
    cache = BUILD / "CMakeCache.txt"
    return cache.exists() and any(
        line.startswith("CUBETORCHFS_SANITIZE:") and line.strip().split("=", 1)[1]
        for line in cache.read_text(errors="replace").splitlines())


pytestmark = [
    pytest.mark.skipif(environment_problem() is not None or shutil.which("dpkg-deb") is None
                       or shutil.which("cpack") is None,
                       reason=environment_problem() or "dpkg-deb and cpack build the package"),
    pytest.mark.skipif(_sanitized(), reason="a sanitizer build is not packaged (the plain run "
                       "of scripts/test.sh tests the package)"),
]


@pytest.fixture(scope="module")
def deb() -> Path:
    result = run_command([str(REPO / "scripts" / "package.sh")], timeout=900,
                         env=dict(os.environ, BUILD_DIR=str(BUILD)))
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip().splitlines()[-1])
    assert path.is_file(), result.stdout
    return path


def package_files(deb: Path) -> list[str]:
    listing = run_command(["dpkg-deb", "-c", str(deb)]).stdout.splitlines()
    return [line.split()[-1].lstrip(".") for line in listing if not line.startswith("d")]


def test_package_holds_what_an_operator_needs(deb: Path) -> None:
    files = package_files(deb)
    for want in ("/usr/bin/cubetorchfs", "/sbin/mount.cubetorchfs",
                 "/lib/systemd/system/cubetorchfs@.service",
                 "/usr/lib/python3/dist-packages/cube_torch/__init__.py",
                 "/usr/lib/python3/dist-packages/cube_torch/libcubetorch_io.so",
                 "/usr/share/cubetorchfs/grafana/cubetorchfs-dashboard.json",
                 "/usr/share/cubetorchfs/prometheus/cubetorchfs.rules.yml",
                 "/usr/share/doc/cubetorchfs/copyright", "/usr/share/man/man1/cubetorchfs.1.gz",
                 "/usr/share/doc/cubetorchfs/operations.md"):
        assert want in files, f"{want} not in the package"
    depends = run_command(["dpkg-deb", "-f", str(deb), "Depends"]).stdout
    for dep in ("fuse3", "python3", "libfuse3-3", "librocksdb", "libcurl4"):
        assert dep in depends, depends


@pytest.mark.skipif(shutil.which("lintian") is None, reason="lintian is not installed")
def test_lintian_is_clean(deb: Path) -> None:
    result = run_command(["lintian", "--pedantic", "--fail-on", "error,warning,info,pedantic",
                          str(deb)], timeout=300)
    tags = [line for line in result.stdout.splitlines() if line[:2] in ("E:", "W:", "I:", "P:")]
    assert result.returncode == 0 and not tags, result.stdout + result.stderr


def write_config(where: Path, store: Path, mountpoint: Path) -> tuple[Path, str]:
    vol = f"pkg-{secrets.token_hex(4)}"
    config = where / f"{vol}.json"
    config.write_text(json.dumps({"mountPoint": str(mountpoint), "volName": vol,
                                  "logDir": str(where / "log"),
                                  "backend": {"type": "posix", "root": str(store)}}))
    return config, vol


@pytest.fixture
def store(tmp_path: Path) -> Iterator[dict[str, Path]]:
    root = tmp_path / "store"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f.bin").write_bytes(b"cubetorchfs package\n" * 1000)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    yield {"root": root, "mnt": mnt}
    if mount_entry(mnt) is not None:
        run_command(["umount", "-l", str(mnt)])


def test_installs_into_a_fresh_root_serves_a_mount_and_removes_cleanly(
        deb: Path, tmp_path: Path, store: dict[str, Path]) -> None:
    root = tmp_path / "root"
    for d in ("var/lib/dpkg/info", "var/lib/dpkg/updates", "var/lib/dpkg/triggers", "var/log"):
        (root / d).mkdir(parents=True)
    for f in ("var/lib/dpkg/status", "var/lib/dpkg/available"):
        (root / f).touch()
    dpkg = ["dpkg", f"--root={root}", "--force-depends", "--force-bad-path",
            "--log=/dev/null"]
    result = run_command(dpkg + ["-i", str(deb)], timeout=120)
    assert result.returncode == 0, result.stderr
    files = package_files(deb)
    assert all((root / f.lstrip("/")).exists() for f in files)

    daemon = root / "usr/bin/cubetorchfs"
    assert run_command([str(daemon), "--version"]).stdout.strip() == "cubetorchfs 0.1.0"
    config, vol = write_config(tmp_path, store["root"], store["mnt"])
    env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(tmp_path))
    result = run_command([str(daemon), "-c", str(config)], timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    try:
        assert (store["mnt"] / "d" / "f.bin").read_bytes() == (store["root"] / "d/f.bin").read_bytes()
        # The hook and its loader library, from the installed tree, under Debian's python3.
        probe = ("import cube_torch, cube_torch._io as io, json, sys; "
                 "print(json.dumps([cube_torch.__file__, io.lib()._name]))")
        site = root / "usr/lib/python3/dist-packages"
        result = run_command(["/usr/bin/python3", "-c", probe], timeout=60,
                             env=dict(env, PYTHONPATH=str(site), VOL_NAME=vol))
        assert result.returncode == 0, result.stderr
        module, lib = json.loads(result.stdout)
        assert module.startswith(str(site)) and lib.startswith(str(site)), (module, lib)
    finally:
        run_command(["fusermount3", "-u", str(store["mnt"])])
    assert wait_until(lambda: mount_entry(store["mnt"]) is None, 15)

    result = run_command(dpkg + ["-r", "cubetorchfs"], timeout=120)
    assert result.returncode == 0, result.stderr
    left = [f for f in files if (root / f.lstrip("/")).exists()]
    assert not left, f"left after dpkg -r: {left}"


def installed(package: str) -> bool:
    out = run_command(["dpkg-query", "-W", "-f=${Status}", package]).stdout
    return "install ok installed" in out


@pytest.mark.skipif(os.geteuid() != 0, reason="dpkg -i and mount -t need root")
def test_dpkg_i_then_mount_t_and_fstab_then_dpkg_r(deb: Path, tmp_path: Path,
                                                   store: dict[str, Path]) -> None:
    if installed("cubetorchfs"):
        pytest.skip("a cubetorchfs package is installed on this machine: not replacing it")
    result = run_command(["dpkg", "-i", str(deb)], timeout=300)
    try:
        assert result.returncode == 0, result.stdout + result.stderr
        config, vol = write_config(tmp_path, store["root"], store["mnt"])
        want = (store["root"] / "d/f.bin").read_bytes()

        # mount -t, as an operator types it.
        result = run_command(["mount", "-t", "cubetorchfs", str(config), str(store["mnt"]),
                              "-o", "allow_other"], timeout=60)
        assert result.returncode == 0, result.stderr
        entry = mount_entry(store["mnt"])
        assert entry is not None and entry.fstype == "fuse.cubetorchfs", entry
        assert (store["mnt"] / "d/f.bin").read_bytes() == want
        status = run_command(["cubetorchfs", "status", str(store["mnt"])], timeout=30)
        assert status.returncode == 0 and "healthy" in status.stdout, status
        assert run_command(["umount", str(store["mnt"])], timeout=30).returncode == 0
        assert wait_until(lambda: mount_entry(store["mnt"]) is None, 15)

        # An fstab line with _netdev (mount -T reads another fstab: /etc/fstab is untouched).
        fstab = tmp_path / "fstab"
        fstab.write_text(f"{config} {store['mnt']} cubetorchfs _netdev,allow_other,noauto 0 0\n")
        result = run_command(["mount", "-T", str(fstab), str(store["mnt"])], timeout=60)
        assert result.returncode == 0, result.stderr
        assert (store["mnt"] / "d/f.bin").read_bytes() == want
        assert run_command(["umount", str(store["mnt"])], timeout=30).returncode == 0
        assert wait_until(lambda: mount_entry(store["mnt"]) is None, 15)

        # Debian's python3 imports the hook with no PYTHONPATH.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        result = run_command(["/usr/bin/python3", "-c",
                              "import cube_torch; print(cube_torch.__file__)"], env=env)
        assert result.stdout.startswith("/usr/lib/python3/dist-packages/cube_torch/"), result
        if shutil.which("systemd-analyze"):
            check = run_command(["systemd-analyze", "verify",
                                 "/lib/systemd/system/cubetorchfs@.service"], timeout=60)
            assert "cubetorchfs@" not in check.stderr or check.returncode == 0, check.stderr
    finally:
        if mount_entry(store["mnt"]) is not None:
            run_command(["umount", "-l", str(store["mnt"])])
        removed = run_command(["dpkg", "-r", "cubetorchfs"], timeout=300)
    assert removed.returncode == 0, removed.stderr
    for path in ("/usr/bin/cubetorchfs", "/sbin/mount.cubetorchfs",
                 "/lib/systemd/system/cubetorchfs@.service",
                 "/usr/lib/python3/dist-packages/cube_torch"):
        assert not os.path.exists(path), f"{path} left after dpkg -r"
