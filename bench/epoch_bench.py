#!/usr/bin/python3
"""Epoch benchmark: a shuffled ImageFolder DataLoader over real JPEGs read three ways.

  local   the files read straight from the local disk (the reference)
  nohook  through a cubetorchfs mount whose posix backend adds --latency-us per request
  hook    the same mount, with `import cube_torch` in the training process (the prefetch mode)
  batch   the hook row in the hook's batch mode (USE_BATCH_DOWNLOAD=1): each DataLoader worker
          takes its batch's files from the daemon in one request, with no FUSE read per file
          (--systems; not measured by default)

Each measurement is --epochs epochs (default 1) in one fresh training process, on a fresh
mount (empty cache) after dropping the kernel's page cache: a cold first epoch, the case
prefetching is for, then warm ones; with a mount each epoch also reports the store requests
and data reads the daemon made meanwhile and its hit ratio. Rounds alternate
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
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from benchlib import drop_caches, free_port, generate_jpegs, parse_rate  # noqa: E402


def log(msg: str) -> None:
    print(f"[epoch_bench] {msg}", file=sys.stderr, flush=True)


def generate(root: Path, files: int, classes: int) -> None:
    generate_jpegs(root, files, classes, "epoch_bench")


def store_counters(port: str) -> dict[str, float]:
    """The daemon's store requests (all, and data reads) and FUSE read outcomes so far."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {"requests": 0.0, "data_reads": 0.0, "hit": 0.0, "late": 0.0, "miss": 0.0}
    for m in re.finditer(r'^cubetorchfs_backend_requests_total\{([^}]*)\} (\S+)$', text, re.M):
        out["requests"] += float(m.group(2))
        if 'op="read"' in m.group(1) or 'op="open_read"' in m.group(1):
            out["data_reads"] += float(m.group(2))
    for m in re.finditer(r'^cubetorchfs_reads_total\{result="(\w+)"\} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    for m in re.finditer(r'^cubetorchfs_prefetch_files_total\{outcome="(\w+)"\} (\S+)$', text, re.M):
        out["pf_" + m.group(1)] = float(m.group(2))
    return out


def child(args: argparse.Namespace) -> None:
    """--epochs epochs, in one process (as training runs); prints a JSON line per epoch."""
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
                                         persistent_workers=args.persistent == "on",
                                         collate_fn=None if args.variant == "decode" else list)
    port = os.environ.get("EPOCH_BENCH_METRICS_PORT")
    for e in range(args.epochs):
        before = store_counters(port) if port else None
        start = time.monotonic()
        n = 0
        for batch in loader:
            n += len(batch[0]) if args.variant == "decode" else len(batch)
        elapsed = time.monotonic() - start
        out = {"samples": n, "seconds": elapsed, "scan_seconds": scan if e == 0 else 0.0}
        if port:
            after = store_counters(port)
            out.update({k: after[k] - before[k] for k in after})
        print(json.dumps(out), flush=True)


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
                 cap: StoreCap, nvme: bool = False) -> None:
        self.work = work
        self.mnt = work / "mnt"
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.vol = f"epochbench{os.getpid()}"
        self.env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(work), VOL_NAME=self.vol,
                        EPOCH_BENCH_METRICS_PORT=str(self.port))
        cache: dict[str, object] = {"memory_bytes": memory}
        if nvme:  # an NVMe tier large enough for the dataset
            cache.update({"disk_dir": str(work / "tier"), "disk_bytes": "64GiB"})
        config = {
            "volName": self.vol, "mountPoint": str(self.mnt), "logDir": str(work / "log"),
            "exporterPort": self.port, "profile": "ai_prefetch",
            "backend": {"type": "posix", "root": str(data),
                        "inject": {"latency_us": latency_us, **cap.inject()}},
            "cache": cache,
            "prefetch": {"control_socket": f"/run/cubetorchfs/{self.vol}.sock"},
        }
        (work / "config.json").write_text(json.dumps(config))
        subprocess.run([binary, "-c", str(work / "config.json")], check=True, env=self.env, timeout=60)
        self.pid = 0
        try:
            self.pid = json.loads((work / f"cube_torch.config.{self.vol}").read_text())["pid"]
            self.idle_rss = self.status_mib("VmRSS")  # mounted, nothing read yet
        except BaseException:
            self.close()  # mounted: never leave it behind
            raise

    def status_mib(self, key: str) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def peak_rss_mib(self) -> float:
        return self.status_mib("VmHWM")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        subprocess.run(["fusermount3", "-u", str(self.mnt)], check=False, timeout=30)
        for _ in range(100):
            if not Path(f"/proc/{self.pid}").exists():
                break
            time.sleep(0.05)


class MemoryCgroup:
    """A memory cgroup (v2, else v1) limiting what the training processes may hold, page cache
    included: a node whose page cache cannot keep the dataset. None if cgroups are not writable."""

    def __init__(self, limit: int) -> None:
        self.path = None
        tag = f"cubetorchfs-epoch-bench-{os.getpid()}"
        mine = Path("/proc/self/cgroup").read_text().splitlines()
        candidates = []
        for line in mine:
            _, controllers, where = line.split(":", 2)
            if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
                candidates.append((Path("/sys/fs/cgroup") / where.lstrip("/") / tag, "memory.max"))
            if "memory" in controllers.split(","):
                candidates.append((Path("/sys/fs/cgroup/memory") / where.lstrip("/") / tag,
                                   "memory.limit_in_bytes"))
        for path, knob in candidates:
            try:
                path.mkdir(exist_ok=True)
                (path / knob).write_text(str(limit))
                self.path = path
                return
            except OSError as e:
                log(f"cgroup {path}: {e}")
                try:
                    path.rmdir()
                except OSError:
                    pass

    def preexec(self) -> None:  # runs in the child before exec
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def close(self) -> None:
        if self.path is not None:
            for _ in range(50):
                try:
                    self.path.rmdir()
                    return
                except OSError:
                    time.sleep(0.1)


def run_epochs(root: Path, variant: str, hook: bool, env: dict[str, str], epochs: int,
               persistent: str, cgroup: MemoryCgroup | None) -> list[dict[str, float]]:
    """`epochs` epochs in one fresh training process: per epoch, samples/s with the scan
    (`rate`; the scan is epoch 1's) and without (`loop_rate`), and the store counters."""
    cmd = [sys.executable, __file__, "--child", str(root), "--variant", variant,
           "--epochs", str(epochs), "--persistent", persistent]
    if hook:
        cmd.append("--hook")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=3600,
                         preexec_fn=cgroup.preexec if cgroup else None)
    rows = [json.loads(line) for line in out.stdout.strip().splitlines() if line.startswith("{")]
    if len(rows) != epochs:
        raise RuntimeError(f"child printed {len(rows)} epochs, not {epochs}:\n{out.stdout}\n{out.stderr}")
    for r in rows:
        r["rate"] = r["samples"] / (r["scan_seconds"] + r["seconds"])
        r["loop_rate"] = r["samples"] / r["seconds"]
        r["scan"] = r["scan_seconds"]
        reads = r.get("hit", 0) + r.get("late", 0) + r.get("miss", 0)
        if reads:
            r["hit_ratio"] = r["hit"] / reads
    return rows


def med(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=20000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=1,
                   help="epochs per training process (a cold start, then warm epochs)")
    p.add_argument("--persistent", nargs="+", default=["off"], choices=["on", "off"],
                   help="DataLoader persistent_workers settings to measure")
    p.add_argument("--latency-us", type=int, nargs="+", default=[300, 10000])
    p.add_argument("--variants", nargs="+", default=["decode", "raw"], choices=["decode", "raw"])
    p.add_argument("--store-concurrency", type=int, default=0, metavar="N",
                   help="cap: requests the emulated store serves at once (e.g. 64; 0: no cap)")
    p.add_argument("--store-bandwidth", type=parse_rate, default=0, metavar="BYTES/S",
                   help="cap: bytes/s the emulated store moves, all requests together "
                        "(e.g. 1e9 or 1GB/s; 0: no cap)")
    p.add_argument("--capped-only", action="store_true",
                   help="with a cap, measure only the capped mounts (default: uncapped and capped)")
    p.add_argument("--systems", nargs="+", default=["nohook", "hook"],
                   choices=["nohook", "hook", "batch"],
                   help="what is measured against the local disk (always measured)")
    p.add_argument("--memory-bytes", default="4GiB", help="the daemon's cache.memory_bytes")
    p.add_argument("--nvme", action="store_true",
                   help="mount with an NVMe tier (cache.disk_dir) large enough for the dataset")
    p.add_argument("--train-memory-limit", type=parse_rate, default=0, metavar="BYTES",
                   help="run the training processes in a memory cgroup of this size (page cache "
                        "included): a node whose page cache cannot hold the dataset")
    p.add_argument("--workdir", default="/tmp/cubetorchfs-epoch-bench")
    p.add_argument("--bin", default=os.environ.get("CUBETORCHFS_BIN", str(REPO / "build/bin/cubetorchfs")))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="decode", help=argparse.SUPPRESS)
    p.add_argument("--hook", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.persistent = args.persistent[0]
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
    systems = [("local", None)] + [(s, cap) for cap in caps for s in args.systems]
    cgroup = None
    if args.train_memory_limit:
        cgroup = MemoryCgroup(args.train_memory_limit)
        if cgroup.path is None:
            sys.exit("epoch_bench: --train-memory-limit: no writable memory cgroup here")

    data = Path(args.workdir) / "data"
    generate(data, args.files, args.classes)
    # (variant, latency, persistent, store, system) -> rounds -> epochs
    results: dict[tuple[str, int, str, str, str], list[list[dict[str, float]]]] = {}
    rss: list[float] = []
    idle_rss: list[float] = []
    try:
        for variant in args.variants:
            for latency in args.latency_us:
                for persistent in args.persistent:
                    for r in range(args.rounds):
                        for system, cap in systems:
                            drop_caches(log)
                            extra = ""
                            if system == "local":
                                rows = run_epochs(data, variant, False, dict(os.environ), args.epochs,
                                                  persistent, cgroup)
                            else:
                                work = Path(tempfile.mkdtemp(prefix="epoch-", dir=args.workdir))
                                m = Mount(args.bin, data, work, latency, args.memory_bytes, cap, args.nvme)
                                try:
                                    env = dict(m.env, USE_BATCH_DOWNLOAD="1") \
                                        if system == "batch" else m.env
                                    rows = run_epochs(m.mnt, variant, system != "nohook", env,
                                                      args.epochs, persistent, cgroup)
                                    extra = f", daemon CPU {m.cpu_seconds():.2f} s"
                                    rss.append(m.peak_rss_mib())
                                    idle_rss.append(m.idle_rss)
                                finally:
                                    m.close()
                                    shutil.rmtree(work, ignore_errors=True)
                            store = "" if cap is None else str(cap)
                            results.setdefault((variant, latency, persistent, store, system), []).append(rows)
                            per_epoch = "; ".join(
                                f"e{i + 1} {x['rate']:.0f}/s" + (f" req {x['requests']:.0f} data {x['data_reads']:.0f}"
                                                                 if "requests" in x else "")
                                + (f" hit {x['hit_ratio']:.3f}" if "hit_ratio" in x else "")
                                + (f" (reads hit/late/miss {x['hit']:.0f}/{x['late']:.0f}/{x['miss']:.0f};"
                                   f" prefetch fetched {x.get('pf_fetched', 0):.0f}"
                                   f" page-resident {x.get('pf_page_resident', 0):.0f}"
                                   f" cached {x.get('pf_cached', 0):.0f}"
                                   f" lru-filled {x.get('pf_lru_filled', 0):.0f}"
                                   f" evicted unread {x.get('pf_evicted_unread', 0):.0f})"
                                   if "hit_ratio" in x else "")
                                for i, x in enumerate(rows))
                            log(f"{variant} {latency} us persistent={persistent} round {r + 1}: {system} "
                                f"{store} {per_epoch} (scan {rows[0]['scan']:.2f} s){extra}")
    finally:
        if cgroup:
            cgroup.close()

    print(f"epoch_bench - nproc {os.cpu_count()}, {args.files} JPEGs, 2 workers, batch 64, "
          f"{args.epochs} epoch(s) per cold-started process, {args.rounds} rounds, median (min-max); "
          f"cache.memory_bytes {args.memory_bytes}" + (", NVMe tier" if args.nvme else "")
          + (f", training memory limit {args.train_memory_limit / 2**20:.0f} MiB" if cgroup else "")
          + "; epoch 1's samples/s include the ImageFolder scan, scan-free is the loop alone")
    print(f"{'variant':8} {'latency':>9} {'pers':4} {'system':7} {'store':22} {'epoch':>5} {'samples/s':>10} "
          f"{'min-max':>15} {'scan-free':>10} {'store req':>9} {'data rd':>8} {'hit':>6}")
    for (variant, latency, persistent, store, system), rounds in results.items():
        for e in range(args.epochs):
            rows = [rs[e] for rs in rounds]
            rates = [x["rate"] for x in rows]
            req = f"{med(rows, 'requests'):>9.0f} {med(rows, 'data_reads'):>8.0f}" if "requests" in rows[0] else f"{'-':>9} {'-':>8}"
            hit = f"{min(x['hit_ratio'] for x in rows):>6.3f}" if all("hit_ratio" in x for x in rows) else f"{'-':>6}"
            print(f"{variant:8} {latency:>7}us {persistent:4} {system:7} {store or '-':22} {e + 1:>5} "
                  f"{statistics.median(rates):>10.0f} {min(rates):>7.0f}-{max(rates):<7.0f} "
                  f"{med(rows, 'loop_rate'):>10.0f} {req} {hit}")
    summary = []
    for variant in args.variants:
        for latency in args.latency_us:
            for persistent in args.persistent:
                for cap in caps:
                    for e in range(args.epochs):
                        measured = ["local"] + args.systems
                        rate = {s: statistics.median(rs[e]["rate"] for rs in results[(variant, latency, persistent, str(cap) if s != "local" else "", s)])
                                for s in measured}
                        free = {s: statistics.median(rs[e]["loop_rate"] for rs in results[(variant, latency, persistent, str(cap) if s != "local" else "", s)])
                                for s in measured}
                        where = (f"{variant}@{latency}us" + (f" pers={persistent}" if len(args.persistent) > 1 or args.epochs > 1 else "")
                                 + ("" if len(caps) == 1 and not cap.inject() else f" {cap}")
                                 + (f" epoch {e + 1}" if args.epochs > 1 else ""))
                        for s in args.systems:
                            if s == "nohook":
                                continue
                            line = f"{where} {s}/local={rate[s] / rate['local']:.2f} "
                            bracket = f"[scan-free: {s}/local={free[s] / free['local']:.2f}"
                            if "nohook" in rate:
                                line += f"{s}/nohook={rate[s] / rate['nohook']:.2f} "
                                bracket += f" {s}/nohook={free[s] / free['nohook']:.2f}"
                            summary.append(line + bracket + "]")
    hits = [x["hit_ratio"] for k, rounds in results.items() if k[4] in ("hook", "batch") for rs in rounds for x in rs
            if "hit_ratio" in x]
    print(f"hook hit ratio per epoch: min {min(hits):.3f} median {statistics.median(hits):.3f}" if hits else
          "hook hit ratio: no FUSE reads reached the daemon", end="")
    print(f"; daemon VmHWM max {max(rss):.0f} MiB (cache.memory_bytes {args.memory_bytes}; "
          f"RSS of an idle mount {max(idle_rss):.0f} MiB)")
    print("ratios (epoch 1 includes the scan; scan-free in brackets):\n  " + "\n  ".join(summary))
    print("targets: epoch 1 hook/local >= 0.95, hook/nohook >= 5 at 10 ms; epochs 2+ hook/nohook >= 1.0, "
          "hook/local >= 0.95, 0 store requests when the dataset fits")


if __name__ == "__main__":
    main()
