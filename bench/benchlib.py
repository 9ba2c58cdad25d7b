"""Helpers shared by the benchmarks in bench/ (not a test module)."""

from __future__ import annotations

import argparse
import re
import shutil
import socket
import subprocess
import sys
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


def drop_caches(log=print) -> None:
    """sync, then drop the kernel's page cache (root); says so through `log` when it cannot."""
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        log(f"cannot drop the page cache ({e}): runs are not cold")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_hwm_mib(pid: int) -> float:
    """Peak resident memory (VmHWM) of process `pid` in MiB; nan when it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def venv_python() -> str | None:
    """The project venv's python (torch 2.x and the PyPI peers; scripts/venv.sh), if made."""
    repo = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run([str(repo / "scripts/venv.sh")], capture_output=True, text=True,
                             timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    py = Path(out) / "bin" / "python"
    return str(py) if py.exists() else None


def missing_modules(names) -> list[str]:
    missing = []
    for name in names:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    return missing


def rerun_under_venv(modules, script: str) -> list[str]:
    """When this interpreter lacks any of `modules`, starts `script` again under the project
    venv's python (once; says so) if that venv exists. Returns what is still missing."""
    import os
    missing = missing_modules(modules)
    if missing and not os.environ.get("CUBE_BENCH_REEXEC"):
        py = venv_python()
        if py and Path(py).parent.parent.resolve() != Path(sys.prefix).resolve():
            print(f"# {', '.join(missing)} not importable by {sys.executable}: running under the "
                  f"project venv's {py}", flush=True)
            os.environ["CUBE_BENCH_REEXEC"] = "1"
            os.execv(py, [py, str(Path(script).resolve()), *sys.argv[1:]])
    return missing
