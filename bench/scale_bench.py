#!/usr/bin/python3
"""ImageNet scale: a shuffled ImageFolder DataLoader over an ImageNet-shaped tree, three ways.

  local   the tree read straight from the local disk, after dropping the page cache (the
          reference: epoch 1 cold, later epochs from the page cache)
  hook    a cubetorchfs mount of the tree (posix backend + --latency-us per store request,
          profile ai_prefetch, cache.memory_bytes --memory-bytes) with `import cube_torch`
  hook-ro the hook row with the mount read-only (`fuse.read_only`): a dataset mount. The kernel
          then sends no FLUSH at close and keeps attributes across reads (a read-write mount
          drops a file's atime after each read that reached the daemon)
  hook-ram the hook-ro row with the kernel keeping no page of the files between opens
          (`fuse.keep_cache: false`) and the RAM cache keeping every file read
          (`prefetch.evict_after_read: false`): every read reaches the daemon, and after the first
          epoch is served from its RAM. Its epochs 2-3 measure the daemon's CPU per small file
          served from RAM, all hits; run it with --workers 1 and 2 to see it grow with readers
  hook-ram-heap the hook-ram row with the RAM cache in the heap (`cache.durable: false`), not
          in the memfd arena that outlives a crash: what the arena costs, in the same run
  batch   the hook-ro row in the hook's batch mode (USE_BATCH_DOWNLOAD=1): each DataLoader
          worker takes its batch's files from the daemon in one request and reads them from
          memory, with no FUSE request per file
  batch-rw the batch row on the read-write mount (the default mount)
  nohook  the same mount without the hook, over the first --nohook-classes classes only (at
          1 ms a request a full cold epoch without prefetching takes hours)

The tree (--classes directories of --per-class files, sizes --size, random bytes) is made once
under --workdir and reused while its shape is unchanged. With --synthetic the mount serves the
synthetic store instead (backend.type synthetic: no disk; --synthetic-dirs x --per-class files
of which the first --classes directories are read), and there is no local row: it measures the
daemon alone at namespace sizes no disk here holds (100 M files: --synthetic-dirs 100000
--per-class 1000).

Each round runs each system in one fresh training process: the scan (ImageFolder's listing of
every class directory), then --epochs epochs of a DataLoader (batch --batch, --workers workers,
shuffle, persistent workers, raw bytes). Per epoch it reports the time and its ratio to the
local row's same epoch, the FUSE reads' hit/late/miss, the store requests and FUSE requests by
op, the daemon's CPU per file served (/proc/PID/stat), the training process's own CPU per sample
(the hook's publisher thread apart), the DataLoader workers' CPU per sample and their largest
VmHWM, and the daemon's VmHWM against cache.memory_bytes. Medians over --rounds rounds; the last lines give the ratios the targets of
docs/benchmarks.md are about.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from benchlib import cpu_seconds, drop_caches, free_port, vm_hwm_mib  # noqa: E402


def log(msg: str) -> None:
    print(f"[scale_bench] {msg}", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)(i?B)?", text.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1K, 110K, 2M)")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]


def parse_size_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    a = parse_size(lo)
    b = parse_size(hi) if hi else a
    if a > b:
        raise argparse.ArgumentTypeError(f"--size {text}: the first size exceeds the second")
    return a, b


def class_name(c: int) -> str:
    return f"n{c:08d}"


def make_tree(root: Path, classes: int, per_class: int, size: tuple[int, int]) -> None:
    """The ImageNet-shaped tree, made once: reused while its marker says the same shape."""
    shape = {"classes": classes, "per_class": per_class, "size": list(size), "version": 1}
    marker = root / ".scale_bench_tree.json"
    if marker.exists() and json.loads(marker.read_text()) == shape:
        log(f"reusing the tree at {root}")
        return
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = random.Random(1281)
    total = classes * per_class
    start = time.monotonic()
    done = 0
    for c in range(classes):
        d = root / class_name(c)
        d.mkdir()
        for i in range(per_class):
            n = rng.randint(*size)
            fd = os.open(d / f"{class_name(c)}_{i}.JPEG", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, rng.randbytes(n))
            finally:
                os.close(fd)
        done += per_class
        if (c + 1) % max(1, classes // 20) == 0 or c + 1 == classes:
            rate = done / max(time.monotonic() - start, 1e-9)
            log(f"tree: {done:,} of {total:,} files ({100 * done / total:.0f} %, "
                f"{rate:,.0f} files/s, {(total - done) / rate:.0f} s left)")
    subprocess.run(["sync"], check=False)
    marker.write_text(json.dumps(shape))


# --------------------------------------------------------------------------- the training child


def metrics(port: str) -> dict[str, float]:
    """The daemon's counters this bench reports, flattened to 'name{labels}' -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    wanted = ("cubetorchfs_reads_total", "cubetorchfs_backend_requests_total",
              "cubetorchfs_fuse_ops_total", "cubetorchfs_prefetch_files_total")
    for line in text.splitlines():
        if line.startswith(wanted):
            key, _, value = line.rpartition(" ")
            out[key] = out.get(key, 0.0) + float(value)
    return out


def child(args: argparse.Namespace) -> None:
    """The scan and --epochs epochs in one process, as training runs; a JSON line each."""
    if args.hook:
        sys.path.insert(0, str(REPO / "hooks"))
        import cube_torch  # noqa: F401  (patches DataLoader iteration)
    import torch
    import torchvision

    def raw(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    torch.manual_seed(0)
    start = time.monotonic()
    root = Path(args.child)
    names = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if args.subset_classes < len(names):
        # ImageFolder's own scan, over the first classes only (a 100 M-file namespace, or the
        # no-hook subset).
        class Subset(torchvision.datasets.DatasetFolder):
            def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
                keep = names[:args.subset_classes]
                return keep, {c: i for i, c in enumerate(keep)}

        ds: Any = Subset(str(root), loader=raw, extensions=(".jpeg",))
    else:
        ds = torchvision.datasets.ImageFolder(str(root), loader=raw)
    scan = time.monotonic() - start
    print(json.dumps({"scan": scan, "files": len(ds)}), flush=True)
    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch, shuffle=True,
                                         num_workers=args.workers, persistent_workers=True,
                                         collate_fn=list)
    port, pid = os.environ.get("SCALE_BENCH_PORT"), int(os.environ.get("SCALE_BENCH_PID", "0"))

    def hook_cpu() -> float:  # the hook's publisher thread, so far
        return float(cube_torch.stats()["client"].get("cpu_s", 0.0)) if args.hook else 0.0

    def workers() -> list[int]:  # the DataLoader's worker processes (persistent)
        it = getattr(loader, "_iterator", None)
        return [w.pid for w in getattr(it, "_workers", []) if w.pid]

    def peak_mib(worker: int) -> float:
        for line in Path(f"/proc/{worker}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return 0.0

    for _ in range(args.epochs):
        before = metrics(port) if port else {}
        cpu0 = cpu_seconds(pid) if pid else 0.0
        hook0, own0 = hook_cpu(), cpu_seconds(os.getpid())
        # The workers' CPU so far (none before the first epoch: they start with it).
        workers0 = sum(cpu_seconds(w) for w in workers())
        start = time.monotonic()
        n = 0
        for batch in loader:
            n += len(batch)
        elapsed = time.monotonic() - start
        # The training process itself (its loop, the DataLoader's main side and, with the
        # hook, the lookahead and the publisher thread); the workers are processes of their own.
        row: dict[str, Any] = {"samples": n, "seconds": elapsed,
                               "train_cpu": cpu_seconds(os.getpid()) - own0,
                               "hook_cpu": hook_cpu() - hook0,
                               "workers_cpu": sum(cpu_seconds(w) for w in workers()) - workers0,
                               "worker_hwm_mib": max((peak_mib(w) for w in workers()),
                                                     default=0.0)}
        if port:
            after = metrics(port)
            row["counters"] = {k: after[k] - before.get(k, 0.0) for k in after
                               if after[k] - before.get(k, 0.0)}
            row["daemon_cpu"] = cpu_seconds(pid) - cpu0
        print(json.dumps(row), flush=True)


# --------------------------------------------------------------------------- the parent


class Mount:
    def __init__(self, args: argparse.Namespace, data: Path, work: Path,
                 read_only: bool = False, page_cache: bool = True, durable: bool = True) -> None:
        self.work, self.mnt = work, work / "mnt"
        self.mnt.mkdir(parents=True)
        self.port = free_port()
        self.vol = f"scalebench{os.getpid()}"
        if args.synthetic:
            backend: dict[str, Any] = {"type": "synthetic", "synthetic": {
                "dirs": args.synthetic_dirs, "files_per_dir": args.per_class,
                "min_bytes": args.size[0], "max_bytes": args.size[1]}}
        else:
            backend = {"type": "posix", "root": str(data)}
        backend["inject"] = {"latency_us": args.latency_us}
        config = {"volName": self.vol, "mountPoint": str(self.mnt), "logDir": str(work / "log"),
                  "exporterPort": self.port, "profile": "ai_prefetch", "backend": backend,
                  "cache": {"memory_bytes": args.memory_bytes, "durable": durable},
                  "prefetch": {"control_socket": str(work / "ctl.sock")}}
        if read_only:
            config["fuse"] = {"read_only": True}
        if args.timeouts_s is not None:  # what docs/prefetch.md advises for a fixed dataset
            config["fuse"] = {**config.get("fuse", {}), "entry_timeout_s": args.timeouts_s,
                              "attr_timeout_s": args.timeouts_s}
        if not page_cache:
            config["fuse"] = {**config.get("fuse", {}), "keep_cache": False}
            config["prefetch"]["evict_after_read"] = False
        (work / "config.json").write_text(json.dumps(config))
        self.env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(work), VOL_NAME=self.vol,
                        SCALE_BENCH_PORT=str(self.port))
        subprocess.run([args.bin, "-c", str(work / "config.json")], check=True, env=self.env,
                       timeout=120)
        self.pid = 0
        try:
            self.pid = json.loads((work / f"cube_torch.config.{self.vol}").read_text())["pid"]
            self.env["SCALE_BENCH_PID"] = str(self.pid)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        subprocess.run(["fusermount3", "-u", str(self.mnt)], check=False, timeout=60)
        for _ in range(200):
            if not self.pid or not Path(f"/proc/{self.pid}").exists():
                break
            time.sleep(0.05)


def run_child(args: argparse.Namespace, root: Path, hook: bool, subset: int,
              env: dict[str, str]) -> list[dict[str, Any]]:
    cmd = [args.python, __file__, "--child", str(root), "--epochs", str(args.epochs),
           "--batch", str(args.batch), "--workers", str(args.workers),
           "--subset-classes", str(subset)]
    if hook:
        cmd.append("--hook")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or len(rows) != args.epochs + 1:
        raise RuntimeError(f"training process failed ({out.returncode}):\n{out.stdout[-2000:]}\n"
                           f"{out.stderr[-4000:]}")
    return rows


def by_label(counters: dict[str, float], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in counters.items():
        if key.startswith(name + "{"):
            m = re.search(label + r'="([^"]*)"', key)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def describe(row: dict[str, Any]) -> dict[str, Any]:
    c = row.get("counters", {})
    reads = by_label(c, "cubetorchfs_reads_total", "result")
    total_reads = sum(reads.values())
    return {
        "mounted": "daemon_cpu" in row,
        "seconds": row["seconds"],
        "samples": row["samples"],
        "hit": reads.get("hit", 0.0) / total_reads if total_reads else None,
        "reads": reads,
        "store": by_label(c, "cubetorchfs_backend_requests_total", "op"),
        "fuse": by_label(c, "cubetorchfs_fuse_ops_total", "op"),
        "prefetch": by_label(c, "cubetorchfs_prefetch_files_total", "outcome"),
        "cpu_us_per_file": 1e6 * row["daemon_cpu"] / row["samples"] if "daemon_cpu" in row else None,
        "train_us": 1e6 * row.get("train_cpu", 0.0) / max(1, row["samples"]),
        "hook_us": 1e6 * row.get("hook_cpu", 0.0) / max(1, row["samples"]),
        "workers_us": 1e6 * row.get("workers_cpu", 0.0) / max(1, row["samples"]),
        "worker_hwm_mib": row.get("worker_hwm_mib", 0.0),
    }


def fmt_ops(ops: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:,.0f}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])) or "none"


def hooked(system: str) -> bool:
    """Whether `system`'s training process imports cube_torch."""
    return system.startswith("hook") or system.startswith("batch")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", type=int, default=1000, help="class directories read (1000)")
    p.add_argument("--per-class", type=int, default=1281, help="files per class (1281)")
    p.add_argument("--size", type=parse_size_range, default=(1024, 3072),
                   help="file size or range, e.g. 1K-3K (default) or 110K")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--latency-us", type=int, default=1000, help="added to every store request")
    p.add_argument("--memory-bytes", default="4GiB", help="the daemon's cache.memory_bytes")
    p.add_argument("--systems", nargs="+", default=["local", "hook", "nohook"],
                   choices=["local", "hook", "hook-ro", "hook-ram", "hook-ram-heap", "batch",
                            "batch-rw", "nohook"])
    p.add_argument("--nohook-classes", type=int, default=50,
                   help="classes the no-hook mount reads (its epochs are store-bound)")
    p.add_argument("--synthetic", action="store_true",
                   help="mount the synthetic store (no disk); no local row")
    p.add_argument("--synthetic-dirs", type=int, default=1000,
                   help="with --synthetic: directories in the namespace (--classes are read)")
    p.add_argument("--python", default=sys.executable,
                   help="interpreter of the training processes (torch, torchvision)")
    p.add_argument("--timeouts-s", type=float, default=None,
                   help="fuse.entry_timeout_s and fuse.attr_timeout_s of the mounts (default: "
                        "ai_prefetch's 300; docs/prefetch.md advises hours for a fixed dataset)")
    p.add_argument("--timeout", type=int, default=7200, help="seconds per training process")
    p.add_argument("--workdir", default="/tmp/cubetorchfs-scale-bench")
    p.add_argument("--bin", default=os.environ.get("CUBETORCHFS_BIN",
                                                   str(REPO / "build/bin/cubetorchfs")))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--hook", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--subset-classes", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if args.synthetic:
        args.systems = [s for s in args.systems if s != "local"]
        if args.classes > args.synthetic_dirs:
            p.error("--classes exceeds --synthetic-dirs")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "tree"
    if not args.synthetic:
        make_tree(data, args.classes, args.per_class, args.size)
    files = args.classes * args.per_class
    results: dict[str, list[list[dict[str, Any]]]] = {}
    scans: dict[str, list[float]] = {}
    hwm: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for system in args.systems:
            subset = args.nohook_classes if system == "nohook" else args.classes
            drop_caches(log)
            if system == "local":
                rows = run_child(args, data, False, subset, dict(os.environ))
            else:
                mwork = Path(tempfile.mkdtemp(prefix="mount-", dir=work))
                m = Mount(args, data, mwork,
                          read_only=system in ("hook-ro", "hook-ram", "hook-ram-heap", "batch"),
                          page_cache=system not in ("hook-ram", "hook-ram-heap"),
                          durable=system != "hook-ram-heap")
                if system in ("batch", "batch-rw"):
                    m.env["USE_BATCH_DOWNLOAD"] = "1"
                try:
                    rows = run_child(args, m.mnt, hooked(system), subset, m.env)
                    hwm.setdefault(system, []).append(vm_hwm_mib(m.pid))
                finally:
                    m.close()
                    shutil.rmtree(mwork, ignore_errors=True)
            scans.setdefault(system, []).append(rows[0]["scan"])
            epochs = [describe(x) for x in rows[1:]]
            results.setdefault(system, []).append(epochs)
            log(f"round {r + 1} {system}: scan {rows[0]['scan']:.1f} s ({rows[0]['files']:,} files); "
                + "; ".join(f"epoch {i + 1} {e['seconds']:.1f} s"
                            + (f" hit {e['hit']:.5f}" if e["hit"] is not None else "")
                            + (f", daemon {e['cpu_us_per_file']:.0f} us/file"
                               if e["cpu_us_per_file"] is not None else "")
                            for i, e in enumerate(epochs)))

    med = statistics.median
    print(f"scale_bench - nproc {os.cpu_count()}, "
          + (f"synthetic store of {args.synthetic_dirs * args.per_class:,} files, "
             if args.synthetic else "")
          + f"{files:,} files read ({args.classes} classes x {args.per_class}, "
          f"{args.size[0]}-{args.size[1]} bytes), store latency {args.latency_us} us, "
          f"batch {args.batch}, {args.workers} workers, {args.rounds} rounds (medians), "
          f"cache.memory_bytes {args.memory_bytes}; no-hook rows read {args.nohook_classes} classes")
    local = results.get("local")
    for system, rounds in results.items():
        line = f"{system:7} scan {med(scans[system]):7.2f} s"
        if local and hooked(system):
            line += f" (local/{system} {med(scans['local']) / med(scans[system]):.2f})"
        if system in hwm:
            line += f"; VmHWM {max(hwm[system]):,.0f} MiB against cache.memory_bytes {args.memory_bytes}"
        print(line)
        for e in range(args.epochs):
            rows = [rs[e] for rs in rounds]
            secs = med(x["seconds"] for x in rows)
            rate = rows[0]["samples"] / secs
            text = f"  epoch {e + 1}: {secs:8.2f} s ({rate:,.0f} files/s)"
            text += f", training process {med(x['train_us'] for x in rows):.1f} us/sample"
            if hooked(system):
                text += f" (publisher thread {med(x['hook_us'] for x in rows):.2f})"
            text += (f", workers {med(x['workers_us'] for x in rows):.1f} us/sample "
                     f"(VmHWM {max(x['worker_hwm_mib'] for x in rows):,.0f} MiB each at most)")
            if local and hooked(system):
                text += f", local/{system} {med(x['seconds'] for x in [rs[e] for rs in local]) / secs:.2f}"
            if rows[0]["mounted"]:
                hits = [x["hit"] for x in rows if x["hit"] is not None]
                text += (f", hit {min(hits):.5f}" if hits else ", no read reached the daemon")
                text += f", daemon CPU {med(x['cpu_us_per_file'] for x in rows):.0f} us/file"
                mid = sorted(rows, key=lambda x: x["seconds"])[len(rows) // 2]
                text += (f"\n    reads {fmt_ops(mid['reads'])}\n    store {fmt_ops(mid['store'])}"
                         f"\n    FUSE {fmt_ops(mid['fuse'])}\n    prefetch {fmt_ops(mid['prefetch'])}")
            print(text)
    for name in ("hook", "hook-ro", "hook-ram", "hook-ram-heap", "batch", "batch-rw"):
        if not local or name not in results:
            continue
        ratios = [f"scan {med(scans['local']) / med(scans[name]):.2f}"]
        for e in range(args.epochs):
            ratios.append(f"epoch {e + 1} "
                          f"{med(rs[e]['seconds'] for rs in local) / med(rs[e]['seconds'] for rs in results[name]):.2f}")
        print(f"ratio (speed, {name} / local): " + ", ".join(ratios)
              + " (targets: scan >= 0.77, i.e. <= 1.3x the time; epochs >= 0.9)")


if __name__ == "__main__":
    main()
