#!/usr/bin/python3
"""Epoch benchmark: a shuffled ImageFolder DataLoader over real JPEGs read three ways.

  local   the files read straight from the local disk (the reference)
  nohook  through a cubetorchfs mount whose posix backend adds --latency-us per request
  hook    the same mount, with `import cube_torch` in the training process

Each measurement is one epoch in a fresh process, on a fresh mount (empty cache) after
dropping the kernel's page cache: a cold epoch, the case prefetching is for. Rounds alternate
local, nohook, hook; the table shows the median and min-max of the rounds. Variants: `decode`
(PIL decode + RandomResizedCrop + ToTensor) and `raw` (the file bytes only).

The last line gives the ratios the targets in BENCHMARKS.md are about.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from benchlib import generate_jpegs  # noqa: E402


def log(msg: str) -> None:
    print(f"[epoch_bench] {msg}", file=sys.stderr, flush=True)


def generate(root: Path, files: int, classes: int) -> None:
    generate_jpegs(root, files, classes, "epoch_bench")


def child(args: argparse.Namespace) -> None:
    """One epoch, in its own process; prints a JSON line."""
    if args.hook:
        sys.path.insert(0, str(REPO / "hooks"))
        import cube_torch  # noqa: F401  (the hook patches DataLoader iteration)
    import torch
    import torchvision
    from torchvision import transforms

    torch.manual_seed(0)
    if args.variant == "decode":
        ds = torchvision.datasets.ImageFolder(args.child, transform=transforms.Compose(
            [transforms.RandomResizedCrop(112), transforms.ToTensor()]))
    else:
        ds = torchvision.datasets.ImageFolder(args.child, loader=lambda p: open(p, "rb").read())
    loader = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True, num_workers=2,
                                         collate_fn=None if args.variant == "decode" else list)
    start = time.monotonic()
    n = 0
    for batch in loader:
        n += len(batch[0]) if args.variant == "decode" else len(batch)
    elapsed = time.monotonic() - start
    print(json.dumps({"samples": n, "seconds": elapsed}))


def drop_caches() -> None:
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        log(f"cannot drop the page cache ({e}): runs are not cold")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Mount:
    def __init__(self, binary: str, data: Path, work: Path, latency_us: int, memory: str) -> None:
        self.work = work
        self.mnt = work / "mnt"
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.vol = f"epochbench{os.getpid()}"
        self.env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(work), VOL_NAME=self.vol)
        config = {
            "volName": self.vol, "mountPoint": str(self.mnt), "logDir": str(work / "log"),
            "exporterPort": self.port, "profile": "ai_prefetch",
            "backend": {"type": "posix", "root": str(data), "inject": {"latency_us": latency_us}},
            "cache": {"memory_bytes": memory},
            "prefetch": {"control_socket": f"/run/cubetorchfs/{self.vol}.sock"},
        }
        (work / "config.json").write_text(json.dumps(config))
        subprocess.run([binary, "-c", str(work / "config.json")], check=True, env=self.env, timeout=60)
        self.pid = json.loads((work / f"cube_torch.config.{self.vol}").read_text())["pid"]

    def counters(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
        out = {}
        for m in re.finditer(r'^cubetorchfs_reads_total\{result="(\w+)"\} (\S+)$', text, re.M):
            out[m.group(1)] = float(m.group(2))
        return out

    def peak_rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        subprocess.run(["fusermount3", "-u", str(self.mnt)], check=False, timeout=30)
        for _ in range(100):
            if not Path(f"/proc/{self.pid}").exists():
                break
            time.sleep(0.05)


def epoch(root: Path, variant: str, hook: bool, env: dict[str, str]) -> float:
    cmd = [sys.executable, __file__, "--child", str(root), "--variant", variant]
    if hook:
        cmd.append("--hook")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=1800)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["samples"] / result["seconds"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=20000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--latency-us", type=int, nargs="+", default=[300, 10000])
    p.add_argument("--variants", nargs="+", default=["decode", "raw"], choices=["decode", "raw"])
    p.add_argument("--memory-bytes", default="4GiB")
    p.add_argument("--workdir", default="/tmp/cubetorchfs-epoch-bench")
    p.add_argument("--bin", default=os.environ.get("CUBETORCHFS_BIN", str(REPO / "build/bin/cubetorchfs")))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="decode", help=argparse.SUPPRESS)
    p.add_argument("--hook", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return

    data = Path(args.workdir) / "data"
    generate(data, args.files, args.classes)
    results: dict[tuple[str, int, str], list[float]] = {}
    hit_ratios: list[float] = []
    rss: list[float] = []
    for variant in args.variants:
        for latency in args.latency_us:
            for r in range(args.rounds):
                for system in ("local", "nohook", "hook"):
                    drop_caches()
                    if system == "local":
                        rate = epoch(data, variant, False, dict(os.environ))
                    else:
                        work = Path(tempfile.mkdtemp(prefix="epoch-", dir=args.workdir))
                        m = Mount(args.bin, data, work, latency, args.memory_bytes)
                        try:
                            rate = epoch(m.mnt, variant, system == "hook", m.env)
                            cpu = m.cpu_seconds()
                            if system == "hook":
                                c = m.counters()
                                total = sum(c.values())
                                hit_ratios.append(c.get("hit", 0) / total if total else 1.0)
                            rss.append(m.peak_rss_mib())
                        finally:
                            m.close()
                            shutil.rmtree(work, ignore_errors=True)
                    results.setdefault((variant, latency, system), []).append(rate)
                    log(f"{variant} {latency} us round {r + 1}: {system} {rate:.0f} samples/s"
                        + ("" if system == "local" else f", daemon CPU {cpu:.2f} s"))

    print(f"epoch_bench (cold) - nproc {os.cpu_count()}, {args.files} JPEGs, 2 workers, batch 64, "
          f"{args.rounds} rounds, median (min-max)")
    print(f"{'variant':8} {'latency':>9} {'system':8} {'samples/s':>10} {'min-max':>15}")
    summary = []
    for (variant, latency, system), rates in results.items():
        print(f"{variant:8} {latency:>7}us {system:8} {statistics.median(rates):>10.0f} "
              f"{min(rates):>7.0f}-{max(rates):<7.0f}")
    for variant in args.variants:
        for latency in args.latency_us:
            med = {s: statistics.median(results[(variant, latency, s)]) for s in ("local", "nohook", "hook")}
            summary.append(f"{variant}@{latency}us hook/local={med['hook'] / med['local']:.2f} "
                           f"hook/nohook={med['hook'] / med['nohook']:.2f}")
    print(f"hook hit ratio: min {min(hit_ratios):.3f} median {statistics.median(hit_ratios):.3f}; "
          f"daemon VmHWM max {max(rss):.0f} MiB (budget {args.memory_bytes} + 64 MiB)")
    print("ratios: " + " | ".join(summary) + " (targets: hook/local >= 0.95, hook/nohook >= 5 at 10 ms)")


if __name__ == "__main__":
    main()
