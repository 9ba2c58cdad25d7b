"""The root daemon writes its control file in a directory other users can write to
(/tmp by default). Symlinks planted at the names an attacker can predict — the old temp name
`<dir>/cube_torch.config.<vol>.tmp.<pid>` for the pids the daemon may get, and the final name —
must never make it write through them: the victim they point at is unchanged, and the control
file ends up a regular 0644 file owned by root. A directory others could swap files in (world-
or group-writable without the sticky bit) gets no control file at all, with a clear log line.

Runs as root (the daemon mounts)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from cubefs_harness import CubeFactory, CubeMount, environment_problem, wait_until

pytestmark = [
    pytest.mark.skipif(environment_problem() is not None, reason=environment_problem() or ""),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts as the root daemon does)"),
]

PLANTED_PIDS = 3000  # pids after the last one handed out: the daemon's is among them
VICTIM_TEXT = b"root:precious:do-not-overwrite\n"


def next_pids(count: int) -> list[int]:
    last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    out = []
    for i in range(1, count + 1):
        p = last + i
        if p >= pid_max:  # the kernel wraps around to 300
            p = 300 + (p - pid_max)
        out.append(p)
    return out


def control_is_regular(instance: CubeMount) -> bool:
    try:
        return stat.S_ISREG(os.lstat(instance.control_file).st_mode)
    except FileNotFoundError:
        return False


def log_text(instance: CubeMount) -> str:
    launched = instance.launch_result.stderr if instance.launch_result is not None else ""
    return launched + "".join(p.read_text(errors="replace")
                              for p in (instance.workdir / "log").glob("*"))


def test_planted_symlinks_are_never_written_through(cube: CubeFactory, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.txt").write_bytes(b"data\n")
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM_TEXT)
    os.chmod(victim, 0o600)

    instance = cube.prepare(src)
    ctl = instance.config_dir
    os.chmod(ctl, 0o1777)  # like /tmp: anyone may create names in it
    base = f"cube_torch.config.{instance.vol_name}"
    planted = [ctl / f"{base}.tmp.{pid}" for pid in next_pids(PLANTED_PIDS)]
    for link in planted:
        link.symlink_to(victim)
    instance.control_file.symlink_to(victim)

    result = cube.launch(instance)
    assert result.returncode == 0, result.stderr
    assert wait_until(lambda: instance.is_mounted() and control_is_regular(instance), 30), \
        f"no regular control file; log: {log_text(instance)!r}"
    instance.learn_pid()
    assert instance.pid is not None and any(
        link.name.endswith(f".tmp.{instance.pid}") for link in planted), \
        f"daemon pid {instance.pid} was not among the planted guesses"

    assert victim.read_bytes() == VICTIM_TEXT
    st = os.lstat(victim)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    st = os.lstat(instance.control_file)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == 0 and st.st_nlink == 1
    assert stat.S_IMODE(st.st_mode) == 0o644
    control = json.loads(instance.control_file.read_bytes())
    assert control["pid"] == instance.pid and control["vol_name"] == instance.vol_name
    # Every planted link is still a link to the victim (none was replaced or written).
    assert all(os.readlink(link) == str(victim) for link in planted)
    # Nothing else of ours is left beside them: no temp file.
    extra = {p.name for p in ctl.iterdir()} - {p.name for p in planted} - {base}
    assert extra == set(), extra

    # At unmount the daemon removes its own file, and only that.
    assert instance.fusermount().returncode == 0
    assert wait_until(lambda: not instance.daemon_pids(), 15)
    assert not os.path.lexists(instance.control_file)
    assert victim.read_bytes() == VICTIM_TEXT


def test_a_replaced_control_file_survives_unmount(cube: CubeFactory, tmp_path: Path) -> None:
    """Someone (another daemon of the same volume) replaced the file: it is not ours to delete."""
    src = tmp_path / "src"
    src.mkdir()
    mount = cube.mount(src)
    text = mount.control_file.read_bytes()
    other = mount.config_dir / "other"
    other.write_bytes(text)  # same bytes, same pid: only the inode tells
    os.rename(other, mount.control_file)
    assert mount.fusermount().returncode == 0
    assert wait_until(lambda: not mount.daemon_pids(), 15)
    assert mount.control_file.read_bytes() == text
    mount.control_file.unlink()


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_config_dir_others_can_write_gets_no_control_file(cube: CubeFactory, tmp_path: Path,
                                                            mode: int) -> None:
    src = tmp_path / "src"
    src.mkdir()
    instance = cube.prepare(src)
    os.chmod(instance.config_dir, mode)  # not sticky: another user could swap the file
    result = cube.launch(instance)
    assert result.returncode == 0, result.stderr  # the mount itself works
    assert wait_until(instance.is_mounted, 30)
    assert wait_until(lambda: "control file not written" in log_text(instance), 10), \
        log_text(instance)
    text = log_text(instance)
    assert str(instance.config_dir) in text and "sticky" in text
    assert list(instance.config_dir.iterdir()) == []
