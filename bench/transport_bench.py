#!/usr/bin/python3
"""Transport benchmark: every read reaching the daemon, /dev/fuse against FUSE over io_uring.

Three systems serve the same directory, none keeping the kernel page cache across opens, so
every open and read is a request to the FUSE process:
  bindfs          `bindfs -o ro,attr_timeout=300,entry_timeout=300` (a plain pass-through)
  cube-devfuse    cubetorchfs, posix backend, profile ai_prefetch with fuse.keep_cache false,
                  fuse.io_uring off (requests read from /dev/fuse)
  cube-io_uring   the same with fuse.io_uring on (skipped, with a line, where the kernel has no
                  FUSE over io_uring; as root the benchmark turns enable_uring on for the run
                  and back off after)
Small: N files of ~110 KB, open/read/close each, split across R reader processes, for each R
of --readers. Large: one file read in 1 MiB reads by one process. Everything is read once
through each system before measuring (the daemon answers from its RAM cache). Reported: the
median of --rounds, files/s and GB/s, the ratio to bindfs, and the FUSE process's CPU per file
and per request (utime+stime of the process over the run; requests from
cubetorchfs_fuse_ops_total).

Usage: bench/transport_bench.py [--small-files N] [--large-gib G] [--readers 1,2,4,8]
                                [--rounds R] [--workdir DIR] [--bin PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import cpu_seconds, free_port, mounted, unmount, vm_hwm_mib, wait_for  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
REPO = Path(__file__).resolve().parents[1]
URING_PARAM = Path("/sys/module/fuse/parameters/enable_uring")


def log(message: str) -> None:
    print(f"[transport_bench] {message}", file=sys.stderr, flush=True)


def run(args: list[str], timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL, check=False)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {r.returncode}: {r.stderr.strip()}")
    return r


def generate(data: Path, files: int, mean: int, large: int) -> None:
    manifest = data / "manifest.json"
    spec = {"files": files, "mean": mean, "large": large}
    if manifest.exists() and json.loads(manifest.read_text()) == spec:
        return
    shutil.rmtree(data, ignore_errors=True)
    log(f"generating {files} files of ~{mean // 1000} KB and a {large / GIB:.2f} GiB file")
    import random
    rng = random.Random(7)
    for i in range(files):
        size = int(min(4 * mean, max(4096, rng.gauss(mean, mean / 3))))
        p = data / "small" / f"d{i // 100:04d}" / f"f{i:06d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(size))
    (data / "large").mkdir(parents=True, exist_ok=True)
    with open(data / "large" / "large.bin", "wb") as f:
        left = large
        while left > 0:
            n = min(64 * MIB, left)
            f.write(os.urandom(n))
            left -= n
    manifest.write_text(json.dumps(spec))


def read_paths(paths: list[str]) -> int:
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(MIB):
                total += len(chunk)
    return total


def fuse_requests(port: int) -> float:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return float("nan")
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("cubetorchfs_fuse_ops_total{"))


class System:
    def __init__(self, name: str, root: Path, pid: int, port: int | None):
        self.name, self.root, self.pid, self.port = name, root, pid, port


def mount_all(workdir: Path, data: Path, binary: str, uring: bool) -> tuple[list[System], list]:
    systems, mounts = [], []
    mnt = workdir / "mnt-bindfs"
    unmount(mnt, log, settle=5)  # workdir is resolved: mounted() needs the real path
    mnt.mkdir(parents=True, exist_ok=True)
    run(["bindfs", "-o", "ro,attr_timeout=300,entry_timeout=300", str(data), str(mnt)])
    mounts.append(mnt)
    if not wait_for(lambda: mounted(mnt), 10):
        raise RuntimeError("bindfs did not mount")
    bindfs_pid = int(run(["pgrep", "-n", "-f", f"^bindfs .* {mnt}$"]).stdout.split()[0])
    systems.append(System("bindfs", mnt, bindfs_pid, None))
    for name, mode in (("cube-devfuse", "off"), ("cube-io_uring", "on")):
        if mode == "on" and not uring:
            continue
        mnt = workdir / f"mnt-{name}"
        unmount(mnt, log, settle=5)
        mnt.mkdir(parents=True, exist_ok=True)
        port, vol = free_port(), f"tb{name.replace('-', '').replace('_', '')}"
        ctl = workdir / "ctl"
        ctl.mkdir(exist_ok=True)
        (workdir / "log" / name).mkdir(parents=True, exist_ok=True)
        config = {"volName": vol, "mountPoint": str(mnt), "logDir": str(workdir / "log" / name),
                  "logLevel": "warn", "exporterPort": port, "profPort": "",
                  "profile": "ai_prefetch", "backend": {"type": "posix", "root": str(data)},
                  "cache": {"memory_bytes": "4GiB"},
                  "fuse": {"keep_cache": False, "io_uring": mode}}
        path = workdir / f"{name}.json"
        path.write_text(json.dumps(config))
        env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(ctl))
        subprocess.run([binary, "-c", str(path), str(mnt)], env=env, check=True, timeout=60,
                       capture_output=True)
        mounts.append(mnt)
        control = ctl / f"cube_torch.config.{vol}"
        if not wait_for(lambda: mounted(mnt) and control.exists(), 10):
            raise RuntimeError(f"{name} did not mount")
        systems.append(System(name, mnt, int(json.loads(control.read_text())["pid"]), port))
    return systems, mounts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/cubetorchfs-transport-bench"))
    ap.add_argument("--small-files", type=int, default=5000)
    ap.add_argument("--mean-kb", type=int, default=110)
    ap.add_argument("--large-gib", type=float, default=0.5)
    ap.add_argument("--readers", default="1,2,4,8", help="reader processes, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bin", default=os.environ.get("CUBETORCHFS_BIN",
                                                    str(REPO / "build" / "bin" / "cubetorchfs")))
    args = ap.parse_args()
    readers = [int(r) for r in args.readers.split(",")]
    for tool in ("bindfs", "fusermount3"):
        if shutil.which(tool) is None:
            sys.exit(f"transport_bench: {tool} is not installed (apt-get install bindfs fuse3)")
    workdir = args.workdir.resolve()
    data = workdir / "data"
    generate(data, args.small_files, args.mean_kb * 1000, int(args.large_gib * GIB))
    small = sorted(str(p.relative_to(data)) for p in (data / "small").rglob("*.bin"))
    small_bytes = sum((data / p).stat().st_size for p in small)
    large = "large/large.bin"
    large_bytes = (data / large).stat().st_size

    uring_before = URING_PARAM.read_text().strip() if URING_PARAM.exists() else None
    uring = uring_before == "Y"
    if uring_before == "N":
        try:
            URING_PARAM.write_text("Y\n")
            uring = True
            log("enable_uring turned on for the run (turned off after)")
        except OSError as e:
            log(f"cannot turn FUSE over io_uring on ({e}): the io_uring row is skipped")
    elif uring_before is None:
        log("this kernel has no FUSE over io_uring (Linux 6.14+): the io_uring row is skipped")

    rates: dict = {}
    cpu: dict = {}
    systems, mounts = [], []
    try:
        systems, mounts = mount_all(workdir, data, args.bin, uring)
        for s in systems:  # warm: the daemon's RAM cache holds everything
            read_paths([str(s.root / p) for p in small] + [str(s.root / large)])
        for r in range(args.rounds):
            for n in readers:
                slices = [small[i::n] for i in range(n)]
                with multiprocessing.Pool(n) as pool:
                    for s in systems:
                        paths = [[str(s.root / p) for p in part] for part in slices]
                        c0, q0 = cpu_seconds(s.pid), fuse_requests(s.port) if s.port else 0
                        t0 = time.perf_counter()
                        total = sum(pool.map(read_paths, paths))
                        dt = time.perf_counter() - t0
                        c1, q1 = cpu_seconds(s.pid), fuse_requests(s.port) if s.port else 0
                        rates.setdefault(("small", n, s.name), []).append(len(small) / dt)
                        cpu.setdefault(("small", n, s.name), []).append(
                            ((c1 - c0) / len(small), (c1 - c0) / (q1 - q0) if s.port else None))
                        assert total == small_bytes, f"{s.name}: read {total} of {small_bytes}"
            for s in systems:
                c0 = cpu_seconds(s.pid)
                t0 = time.perf_counter()
                total = read_paths([str(s.root / large)])
                dt = time.perf_counter() - t0
                assert total == large_bytes, f"{s.name}: read {total} of {large_bytes}"
                rates.setdefault(("large", 1, s.name), []).append(total / dt)
                cpu.setdefault(("large", 1, s.name), []).append(
                    ((cpu_seconds(s.pid) - c0) / (total / GIB), None))
            log(f"round {r + 1}/{args.rounds} done")
        hwm = {s.name: vm_hwm_mib(s.pid) for s in systems}
    finally:
        for m in mounts:
            unmount(m, log, settle=5)
        if uring_before == "N":
            URING_PARAM.write_text("N\n")

    names = [s.name for s in systems]
    print(f"transport_bench — nproc {os.cpu_count()}, kernel {os.uname().release}; "
          f"{len(small)} files of ~{args.mean_kb} KB, {args.large_gib} GiB large, "
          f"{args.rounds} rounds (median)")
    print(f"{'bench':<6} {'readers':>7} {'system':<14} {'rate':>14} {'/bindfs':>8} "
          f"{'CPU/file':>10} {'CPU/request':>12}")
    for bench, ns in (("small", readers), ("large", [1])):
        for n in ns:
            base = statistics.median(rates[(bench, n, "bindfs")])
            for name in names:
                med = statistics.median(rates[(bench, n, name)])
                per = statistics.median(c[0] for c in cpu[(bench, n, name)]) * 1e6
                req = [c[1] for c in cpu[(bench, n, name)] if c[1] is not None]
                rate = f"{med:.0f} file/s" if bench == "small" else f"{med / 1e9:.2f} GB/s"
                unit = "µs" if bench == "small" else "ms/GiB"
                per_text = f"{per:.1f} {unit}" if bench == "small" else f"{per / 1e3:.0f} {unit}"
                req_text = f"{statistics.median(req) * 1e6:.1f} µs" if req else ""
                print(f"{bench:<6} {n:>7} {name:<14} {rate:>14} {med / base:>8.2f} "
                      f"{per_text:>10} {req_text:>12}")
    print("peak RSS: " + ", ".join(f"{k} {v:.0f} MiB" for k, v in hwm.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
