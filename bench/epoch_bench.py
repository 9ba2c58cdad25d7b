#!/usr/bin/python3
"""Epoch benchmark: a shuffled ImageFolder DataLoader over real JPEGs read three ways.

  local   the files read straight from the local disk (the reference)
  nohook  through a cubetorchfs mount whose posix backend adds --latency-us per request
  hook    the same mount, with `import cube_torch` in the training process

Each measurement is one epoch in a fresh process, on a fresh mount (empty cache) after
dropping the kernel's page cache: a cold epoch, the case prefetching is for. Rounds alternate
local, nohook, hook; the table shows the median and min-max of the rounds. Variants: `decode`
(PIL decode + RandomResizedCrop + ToTensor) and `raw` (the file bytes only).

An epoch's time includes the ImageFolder scan (listing every class directory): the user waits
for it too, and only the mount rows pay the store's latency there. The rate with the scan is
the headline; the rate of the DataLoader loop alone is printed beside it, labelled scan-free.

--store-concurrency / --store-bandwidth cap the emulated store (backend.inject.max_concurrency
and bandwidth_bytes_s: requests served at once, bytes per second shared by all requests); the
mount rows are then measured both uncapped and capped in the same rounds (--capped-only: capped
only), against the same local rows.

The last line gives the ratios the targets in docs/benchmarks.md are about.
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
from benchlib import generate_jpegs, parse_rate  # noqa: E402


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
    scan_start = time.monotonic()
    if args.variant == "decode":
        ds = torchvision.datasets.ImageFolder(args.child, transform=transforms.Compose(
            [transforms.RandomResizedCrop(112), transforms.ToTensor()]))
    else:
        ds = torchvision.datasets.ImageFolder(args.child, loader=lambda p: open(p, "rb").read())
    scan = time.monotonic() - scan_start
    loader = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True, num_workers=2,
                                         collate_fn=None if args.variant == "decode" else list)
    start = time.monotonic()
    n = 0
    for batch in loader:
        n += len(batch[0]) if args.variant == "decode" else len(batch)
    elapsed = time.monotonic() - start
    print(json.dumps({"samples": n, "seconds": elapsed, "scan_seconds": scan}))


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


class StoreCap:
    """Limits of the emulated store: requests at once (0: unlimited) and bytes/s (0: unlimited)."""

    def __init__(self, concurrency: int = 0, bandwidth: int = 0) -> None:
        self.concurrency, self.bandwidth = concurrency, bandwidth

    def inject(self) -> dict[str, int]:
        keys = {}
        if self.concurrency:
            keys["max_concurrency"] = self.concurrency
        if self.bandwidth:
            keys["bandwidth_bytes_s"] = self.bandwidth
        return keys

    def __str__(self) -> str:
        if not self.concurrency and not self.bandwidth:
            return "uncapped"
        return (f"cap {self.concurrency or 'inf'} req, "
                + (f"{self.bandwidth / 1e9:g} GB/s" if self.bandwidth else "inf GB/s"))


class Mount:
    def __init__(self, binary: str, data: Path, work: Path, latency_us: int, memory: str,
                 cap: StoreCap) -> None:
        self.work = work
        self.mnt = work / "mnt"
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.vol = f"epochbench{os.getpid()}"
        self.env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(work), VOL_NAME=self.vol)
        config = {
            "volName": self.vol, "mountPoint": str(self.mnt), "logDir": str(work / "log"),
            "exporterPort": self.port, "profile": "ai_prefetch",
            "backend": {"type": "posix", "root": str(data),
                        "inject": {"latency_us": latency_us, **cap.inject()}},
            "cache": {"memory_bytes": memory},
            "prefetch": {"control_socket": f"/run/cubetorchfs/{self.vol}.sock"},
        }
        (work / "config.json").write_text(json.dumps(config))
        subprocess.run([binary, "-c", str(work / "config.json")], check=True, env=self.env, timeout=60)
        self.pid = json.loads((work / f"cube_torch.config.{self.vol}").read_text())["pid"]

    def hit_ratio(self) -> float:
        """hit / (hit + late + miss) of cubetorchfs_reads_total; raises when they are missing."""
        url = f"http://127.0.0.1:{self.port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        out = {}
        for m in re.finditer(r'^cubetorchfs_reads_total\{result="(\w+)"\} (\S+)$', text, re.M):
            out[m.group(1)] = float(m.group(2))
        missing = [k for k in ("hit", "late", "miss") if k not in out]
        if missing:
            raise RuntimeError(f"{url}: no cubetorchfs_reads_total{{result=...}} sample for "
                               f"{', '.join(missing)}: cannot compute the hit ratio")
        total = sum(out[k] for k in ("hit", "late", "miss"))
        if total == 0:
            raise RuntimeError(f"{url}: cubetorchfs_reads_total is 0 for hit, late and miss after "
                               "an epoch: no read reached the daemon, so there is no hit ratio")
        return out["hit"] / total

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


def epoch(root: Path, variant: str, hook: bool, env: dict[str, str]) -> dict[str, float]:
    """One epoch in a fresh process: samples/s with the scan (`rate`) and without (`loop_rate`),
    and the scan's seconds."""
    cmd = [sys.executable, __file__, "--child", str(root), "--variant", variant]
    if hook:
        cmd.append("--hook")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=1800)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"rate": result["samples"] / (result["scan_seconds"] + result["seconds"]),
            "loop_rate": result["samples"] / result["seconds"], "scan": result["scan_seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=20000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--latency-us", type=int, nargs="+", default=[300, 10000])
    p.add_argument("--variants", nargs="+", default=["decode", "raw"], choices=["decode", "raw"])
    p.add_argument("--store-concurrency", type=int, default=0, metavar="N",
                   help="cap: requests the emulated store serves at once (e.g. 64; 0: no cap)")
    p.add_argument("--store-bandwidth", type=parse_rate, default=0, metavar="BYTES/S",
                   help="cap: bytes/s the emulated store moves, all requests together "
                        "(e.g. 1e9 or 1GB/s; 0: no cap)")
    p.add_argument("--capped-only", action="store_true",
                   help="with a cap, measure only the capped mounts (default: uncapped and capped)")
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

    capped = StoreCap(args.store_concurrency, args.store_bandwidth)
    if capped.inject():
        caps = [capped] if args.capped_only else [StoreCap(), capped]
    else:
        if args.capped_only:
            p.error("--capped-only needs --store-concurrency or --store-bandwidth")
        caps = [StoreCap()]
    # One local row per round, then nohook and hook under each store setting.
    systems = [("local", None)] + [(s, cap) for cap in caps for s in ("nohook", "hook")]

    data = Path(args.workdir) / "data"
    generate(data, args.files, args.classes)
    results: dict[tuple[str, int, str, str], list[dict[str, float]]] = {}
    hit_ratios: dict[str, list[float]] = {}  # by store setting
    rss: list[float] = []
    for variant in args.variants:
        for latency in args.latency_us:
            for r in range(args.rounds):
                for system, cap in systems:
                    drop_caches()
                    extra = ""
                    if system == "local":
                        res = epoch(data, variant, False, dict(os.environ))
                    else:
                        work = Path(tempfile.mkdtemp(prefix="epoch-", dir=args.workdir))
                        m = Mount(args.bin, data, work, latency, args.memory_bytes, cap)
                        try:
                            res = epoch(m.mnt, variant, system == "hook", m.env)
                            extra = f", daemon CPU {m.cpu_seconds():.2f} s"
                            if system == "hook":
                                hit = m.hit_ratio()
                                hit_ratios.setdefault(str(cap), []).append(hit)
                                extra += f", hit ratio {hit:.3f}"
                            rss.append(m.peak_rss_mib())
                        finally:
                            m.close()
                            shutil.rmtree(work, ignore_errors=True)
                    store = "" if cap is None else str(cap)
                    results.setdefault((variant, latency, store, system), []).append(res)
                    log(f"{variant} {latency} us round {r + 1}: {system} {store} {res['rate']:.0f} "
                        f"samples/s (scan {res['scan']:.2f} s; scan-free {res['loop_rate']:.0f})" + extra)

    print(f"epoch_bench (cold) - nproc {os.cpu_count()}, {args.files} JPEGs, 2 workers, batch 64, "
          f"{args.rounds} rounds, median (min-max); samples/s include the ImageFolder scan, "
          f"scan-free is the DataLoader loop alone")
    print(f"{'variant':8} {'latency':>9} {'system':8} {'store':22} {'samples/s':>10} {'min-max':>15} "
          f"{'scan s':>7} {'scan-free':>10}")
    for (variant, latency, store, system), rs in results.items():
        rates = [x["rate"] for x in rs]
        print(f"{variant:8} {latency:>7}us {system:8} {store or '-':22} {statistics.median(rates):>10.0f} "
              f"{min(rates):>7.0f}-{max(rates):<7.0f} {statistics.median(x['scan'] for x in rs):>7.2f} "
              f"{statistics.median(x['loop_rate'] for x in rs):>10.0f}")
    summary = []
    for variant in args.variants:
        for latency in args.latency_us:
            local = results[(variant, latency, "", "local")]
            for cap in caps:
                med = {s: statistics.median(x["rate"] for x in results[(variant, latency, str(cap), s)])
                       for s in ("nohook", "hook")}
                free = {s: statistics.median(x["loop_rate"] for x in results[(variant, latency, str(cap), s)])
                        for s in ("nohook", "hook")}
                med["local"] = statistics.median(x["rate"] for x in local)
                free["local"] = statistics.median(x["loop_rate"] for x in local)
                where = f"{variant}@{latency}us" + ("" if len(caps) == 1 and not cap.inject() else f" {cap}")
                summary.append(f"{where} hook/local={med['hook'] / med['local']:.2f} "
                               f"hook/nohook={med['hook'] / med['nohook']:.2f} "
                               f"[scan-free: hook/local={free['hook'] / free['local']:.2f} "
                               f"hook/nohook={free['hook'] / free['nohook']:.2f}]")
    print("hook hit ratio: " + "; ".join(
        f"{store}: min {min(h):.3f} median {statistics.median(h):.3f}" for store, h in hit_ratios.items())
          + f"; daemon VmHWM max {max(rss):.0f} MiB (budget {args.memory_bytes} + 64 MiB)")
    print("ratios (scan included; scan-free in brackets): " + " | ".join(summary)
          + " (targets: hook/local >= 0.95, hook/nohook >= 5 at 10 ms)")

if __name__ == "__main__":
    main()
