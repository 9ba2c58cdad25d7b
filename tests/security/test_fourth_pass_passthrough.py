"""The fourth security pass's findings 5, 6 and 9 (issue 59), each tried as an unprivileged user
would, against a real daemon: a file held through passthrough across a kill -9 of the worker,
a reader of another user's large file against its owner's writes and replacements, and the
default log directory below a group-writable /var/log (Debian, Ubuntu). Tests that need
passthrough skip with one line where the kernel or the daemon lacks it."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cubefs_harness import BINARY, CubeFactory, CubeMount, environment_problem, wait_until
from seclib import NOBODY, OTHER, open_cube, script_result, start_script_as  # noqa: F401

pytestmark = [
    pytest.mark.skipif(environment_problem() is not None, reason=environment_problem() or ""),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, setpriv, allow_other)"),
]


def public_store(base: Path) -> Path:
    src = base / "src"
    src.mkdir(exist_ok=True)
    os.chmod(src, 0o755)
    return src


# --------------------------------------------------------------------------- finding 9


def run_in_own_mount_namespace(script: str, env: dict[str, str], timeout: float = 60
                               ) -> subprocess.CompletedProcess[str]:
    """`sh -c script` in a mount namespace of its own (unshare -m, private propagation): what it
    mounts, the daemon's FUSE mount included, is seen by nobody else and goes with it."""
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) (util-linux)")
def test_the_default_log_dir_below_a_group_writable_var_log_mounts(open_cube: CubeFactory
                                                                   ) -> None:
    """Debian and Ubuntu ship /var/log as root:syslog 0775. A root daemon with no logDir used
    to refuse to mount there (exit 2): the documented minimal config did not mount. It now
    logs to /var/log/cubetorchfs/<volName>.log, opened beneath a descriptor of that directory
    (a group member who renames names in /var/log cannot lead it elsewhere); a link planted at
    that name by the group is still refused, naming what to set."""
    base = open_cube.base.parent
    src = public_store(base)
    (src / "f").write_bytes(b"hello")
    var_log = base / "var-log"  # bound over /var/log in the test's own namespace
    var_log.mkdir()
    os.chown(var_log, 0, OTHER)
    os.chmod(var_log, 0o775)
    instance = open_cube.prepare(src, {"logDir": None})
    mnt = instance.mountpoint
    script = f"""
mount --bind {var_log} /var/log || exit 90
{BINARY} -c {instance.config_path} {mnt} -o allow_other
rc=$?
echo "rc=$rc"
if [ $rc = 0 ]; then cat {mnt}/f; echo; umount {mnt} || umount -l {mnt}; fi
"""
    r = run_in_own_mount_namespace(script, instance.env())
    assert "rc=0" in r.stdout, (r.stdout, r.stderr)
    assert "hello" in r.stdout, r.stdout
    log = var_log / "cubetorchfs" / f"{instance.vol_name}.log"
    assert log.is_file() and os.stat(log).st_mode & 0o777 == 0o600, list(var_log.rglob("*"))
    assert os.stat(var_log / "cubetorchfs").st_mode & 0o777 == 0o700
    assert f"log: /var/log/cubetorchfs/{instance.vol_name}.log" in r.stdout + r.stderr
    wait_until(lambda: not instance.daemon_pids(), 10)

    # A member of the group plants a link at the directory's name: refused, with what to set.
    target = base / "elsewhere"
    target.mkdir()
    shutil.rmtree(var_log / "cubetorchfs")
    os.symlink(target, var_log / "cubetorchfs")
    os.lchown(var_log / "cubetorchfs", OTHER, OTHER)
    instance = open_cube.prepare(src, {"logDir": None})
    r = run_in_own_mount_namespace(script.replace(str(mnt), str(instance.mountpoint))
                                   .replace(str(open_cube.instances[0].config_path),
                                            str(instance.config_path)), instance.env())
    assert "rc=2" in r.stdout, (r.stdout, r.stderr)
    line = r.stderr.strip().splitlines()[0]
    assert line.startswith("cubetorchfs: logDir: ") and "is a symlink" in line \
        and "set logDir" in line, r.stderr
    assert list(target.iterdir()) == []


def test_a_vol_name_that_reads_as_an_option_is_refused(open_cube: CubeFactory) -> None:
    """volName `-rf` was accepted; it names files an operator hands to commands."""
    base = open_cube.base.parent
    instance = open_cube.prepare(public_store(base), {"volName": "-rf"})
    result = open_cube.launch(instance)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stderr.startswith("cubetorchfs: volName: must not start with '-'"), \
        result.stderr
    assert not instance.is_mounted()
