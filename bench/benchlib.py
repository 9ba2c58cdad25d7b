"""Helpers shared by the benchmarks in bench/ (not a test module)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def generate_jpegs(root: Path, files: int, classes: int, tag: str) -> None:
    """An ImageFolder of ~110 KB JPEGs (noisy 384x384 images at quality 90, like ImageNet's),
    generated once per (files, classes); `tag` prefixes the progress line."""
    import numpy as np
    from PIL import Image

    marker = root / f".complete-v2-{files}-{classes}"
    if marker.exists():
        return
    if root.exists():
        shutil.rmtree(root)
    rng = np.random.default_rng(0)
    for i in range(files):
        d = root / f"class_{i % classes:03d}"
        d.mkdir(parents=True, exist_ok=True)
        small = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
        img = Image.fromarray(small).resize((384, 384), Image.BILINEAR)
        arr = np.asarray(img).astype(np.int16) + rng.integers(-60, 60, (384, 384, 3))
        Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(d / f"img_{i:06d}.jpg", quality=90)
        if (i + 1) % 500 == 0 or i + 1 == files:
            print(f"\r[{tag}] generating JPEGs: {i + 1}/{files}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    marker.touch()


def parse_rate(text: str) -> int:
    """Bytes per second: a number (1e9), or with k/M/G (decimal) or KiB/MiB/GiB, and /s."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmg]i?b?|b)?(?:/s)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (bytes/s: 1e9, 1GB/s, 512MiB)")
    unit = (m.group(2) or "").lower().rstrip("b")
    factor = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}[unit]
    return int(float(m.group(1)) * factor)


def drop_caches(log=print, *, level: int = 3, sync_timeout: float | None = None) -> None:
    """sync (waiting at most `sync_timeout` s; None: as long as it takes), then drop the kernel's
    caches (root): `level` 3 the page cache, dentries and inodes, 1 the page cache only. When
    they cannot be dropped, says so through `log`, or raises the OSError when `log` is None."""
    subprocess.run(["sync"], check=False, timeout=sync_timeout)
    try:
        Path("/proc/sys/vm/drop_caches").write_text(f"{level}\n")
    except OSError as e:
        if log is None:
            raise
        log(f"cannot drop the page cache ({e}): runs are not cold")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_answers(port: int) -> bool:
    """Whether something accepts a TCP connection on 127.0.0.1:`port` (within 1 s)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Calls `predicate` every `interval` s until it is true or `timeout` s have passed, then
    once more; returns whether it became true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def stop_process(proc: subprocess.Popen | None, name: str, log=print, timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL after `timeout` s; only this process, which we started. Says
    through `log` when it ignored SIGTERM or did not die. None or already exited: nothing."""
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.terminate()
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log(f"{name} (pid {proc.pid}) ignored SIGTERM; killing it")
        proc.kill()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log(f"{name} (pid {proc.pid}) did not die")


def cpu_seconds(pid: int | None, children: bool = False, missing: float | None = None) -> float:
    """User + system CPU seconds of process `pid` so far; with `children`, plus those of its
    children it has waited for. When /proc/PID/stat cannot be read (the process is gone, or
    pid is None): `missing` if given (e.g. nan), else the error is raised."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15 if children else 13]) / os.sysconf("SC_CLK_TCK")
    except (OSError, TypeError, IndexError, ValueError):
        if missing is None:
            raise
        return missing


def mounted(mnt: Path) -> bool:
    """Whether something is mounted at `mnt` (as given: no symlink resolving), from
    /proc/self/mountinfo."""
    target = str(mnt)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[4].replace("\\040", " ") == target:
                return True
    return False


def unmount(mnt: Path, log=print, timeout: float = 30.0, settle: float = 0.0) -> None:
    """Unmounts `mnt` if mounted: `fusermount3 -u`, then `fusermount3 -u -z`, then `umount -l`,
    each given `timeout` s to run and then up to `settle` s to take effect, until it is gone.
    Says through `log` when a command timed out or all of them failed."""
    if not mounted(mnt):
        return
    for cmd in (["fusermount3", "-u", str(mnt)], ["fusermount3", "-u", "-z", str(mnt)], ["umount", "-l", str(mnt)]):
        try:
            subprocess.run(cmd, check=False, timeout=timeout,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            log(f"{' '.join(cmd)} timed out")
        if wait_for(lambda: not mounted(mnt), settle):
            return
    log(f"could not unmount {mnt}")


def median_range(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of `values`."""
    return statistics.median(values), min(values), max(values)


def wait_for_ci(path: Path, limit_s: float, log=print) -> None:
    """Another run (CI) may be using the CPU: wait until its log `path`, if it exists, has its
    `rc=` line, for at most `limit_s` s; says so through `log`."""
    if not path.exists():
        return
    deadline = time.monotonic() + limit_s
    announced = False
    while time.monotonic() < deadline:
        if any(line.startswith("rc=") for line in path.read_text(errors="replace").splitlines()):
            return
        if not announced:
            log(f"{path} has no rc= line yet: waiting for that run to finish (at most {limit_s:.0f} s)")
            announced = True
        time.sleep(5)
    log(f"still no rc= line in {path}: measuring anyway")


def proc_status_mib(pid: int, field: str) -> float:
    """A memory field of /proc/PID/status (VmHWM, VmRSS, ...) in MiB; nan when unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def vm_hwm_mib(pid: int) -> float:
    """Peak resident memory (VmHWM) of process `pid` in MiB; nan when it cannot be read."""
    return proc_status_mib(pid, "VmHWM")


def venv_python() -> str | None:
    """The project venv's python (torch 2.x and the PyPI peers; scripts/venv.sh), if made."""
    repo = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run([str(repo / "scripts/venv.sh")], capture_output=True, text=True,
                             timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    py = Path(out) / "bin" / "python"
    # Made whole only: install_deps marks it complete after every pin installed.
    return str(py) if py.exists() and (Path(out) / ".complete").exists() else None


def missing_modules(names) -> list[str]:
    missing = []
    for name in names:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    return missing


def make_venv() -> None:
    """Makes the project venv (scripts/install_deps.sh), saying so: it is built when a
    benchmark first needs a peer, not by the demo."""
    repo = Path(__file__).resolve().parents[1]
    print("# making the project venv for the peers (scripts/install_deps.sh: torch 2.x, moto, "
          "safetensors, ...; about 6 GB and several minutes, once)", flush=True)
    subprocess.run([str(repo / "scripts/install_deps.sh")], check=False)


def rerun_under_venv(modules, script: str) -> list[str]:
    """When this interpreter lacks any of `modules`, starts `script` again under the project
    venv's python (once; says so), making that venv first if it is not made yet. Returns what
    is still missing."""
    missing = missing_modules(modules)
    if missing and not os.environ.get("CUBE_BENCH_REEXEC"):
        py = venv_python()
        if py is None:
            make_venv()
            py = venv_python()
        if py and Path(py).parent.parent.resolve() != Path(sys.prefix).resolve():
            print(f"# {', '.join(missing)} not importable by {sys.executable}: running under the "
                  f"project venv's {py}", flush=True)
            os.environ["CUBE_BENCH_REEXEC"] = "1"
            os.execv(py, [py, str(Path(script).resolve()), *sys.argv[1:]])
    return missing
