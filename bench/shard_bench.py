#!/usr/bin/python3
"""Loose files with the hook against the usual workaround, webdataset tar shards.

The same ImageFolder of ~110 KB JPEGs (bench/benchlib.py) is kept twice in one posix store
directory: as it is (`loose/class_NNN/img_*.jpg`, hard links) and repacked into webdataset
shards of --shard-mib MiB (`shards/shard-NNNNNN.tar`, written with webdataset's ShardWriter;
the repack is timed). A cubetorchfs mount fronts that store with --latency-ms added to every
store request (backend.inject: the latency exists on our side only, so both systems pay it and
no figure here compares with a store outside). Systems, each on a fresh mount after dropping
the page cache, --epochs epochs in one training process (2 workers, batch 64):

  webdataset  wds.WebDataset(the shards through the mount, shardshuffle=number of shards)
              .shuffle(--buffer): each worker reads its shards front to back, and samples are
              shuffled only within a buffer of --buffer samples (and by shard order)
  hook        torchvision ImageFolder over loose/ through the mount, DataLoader(shuffle=True),
              `import cube_torch` (profile ai_prefetch): a true shuffle of the whole epoch
  nohook      the same without the hook (not run by default: 10 ms per file, unprefetched)

Variants: `raw` (the bytes) and `decode` (PIL decode + RandomResizedCrop(112) + ToTensor).
Every epoch must deliver every sample once (raw: every byte), or the run fails.

Prints a table (median and min-max samples/s per system, variant and epoch) and the ratio
hook / webdataset per epoch (target >= 0.9, docs/benchmarks.md). Runs under the project venv's
python (webdataset, torch 2.x), starting itself again there if needed.
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
import time
import urllib.request
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from benchlib import drop_caches, free_port, generate_jpegs, rerun_under_venv, vm_hwm_mib  # noqa: E402

SYSTEMS = ("webdataset", "hook", "nohook")
MOUNT_TIMEOUT_S = 60


def log(msg: str) -> None:
    print(f"[shard_bench] {msg}", file=sys.stderr, flush=True)


def data_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.jpg") if p.is_file())


def build_store(data: Path, store: Path, shard_bytes: int) -> dict:
    """loose/ as hard links of the data set, shards/ repacked from it; returns the repack's
    figures. Kept between runs (a marker names the data set and the shard size)."""
    marker = store / f".complete-{len(data_files(data))}-{shard_bytes}"
    info = store / "repack.json"
    if marker.exists() and info.exists():
        return json.loads(info.read_text())
    shutil.rmtree(store, ignore_errors=True)
    files = data_files(data)
    for f in files:
        dst = store / "loose" / f.relative_to(data)
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(f, dst)
        except OSError:  # --data on another file system
            shutil.copy2(f, dst)
    import webdataset as wds
    (store / "shards").mkdir(parents=True)
    drop_caches(log)
    t0 = time.monotonic()
    with wds.ShardWriter(str(store / "shards" / "shard-%06d.tar"), maxsize=shard_bytes,
                         maxcount=10**9, verbose=0) as sink:
        for i, f in enumerate(files):
            rel = f.relative_to(data)
            label = int(rel.parts[0].rsplit("_", 1)[1])
            sink.write({"__key__": f"{rel.parts[0]}/{f.stem}", "jpg": f.read_bytes(),
                        "cls": str(label).encode()})
            if (i + 1) % 2000 == 0 or i + 1 == len(files):
                print(f"\r[shard_bench] repacking: {i + 1}/{len(files)}", end="", file=sys.stderr,
                      flush=True)
    os.sync()
    seconds = time.monotonic() - t0
    print(file=sys.stderr)
    shards = sorted((store / "shards").glob("*.tar"))
    result = {"seconds": seconds, "shards": len(shards),
              "bytes": sum(s.stat().st_size for s in shards), "files": len(files)}
    info.write_text(json.dumps(result))
    marker.touch()
    return result


class Mount:
    """A cubetorchfs mount of the store with injected latency; close() always unmounts."""

    def __init__(self, binary: str, store: Path, work: Path, latency_ms: float, memory: str) -> None:
        self.mnt = work / "mnt"
        self.mnt.mkdir(parents=True)
        self.port = free_port()
        self.vol = f"shardbench{os.getpid()}"
        self.env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(work), VOL_NAME=self.vol)
        config = {
            "volName": self.vol, "mountPoint": str(self.mnt), "logDir": str(work / "log"),
            "exporterPort": self.port, "profile": "ai_prefetch",
            "backend": {"type": "posix", "root": str(store),
                        "inject": {"latency_us": int(latency_ms * 1000)}},
            "cache": {"memory_bytes": memory},
            "prefetch": {"control_socket": f"/run/cubetorchfs/{self.vol}.sock"},
        }
        (work / "config.json").write_text(json.dumps(config))
        subprocess.run([binary, "-c", str(work / "config.json")], check=True, env=self.env,
                       timeout=MOUNT_TIMEOUT_S)
        try:
            self.pid = json.loads((work / f"cube_torch.config.{self.vol}").read_text())["pid"]
        except (OSError, ValueError, KeyError):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], check=False, timeout=30)
            raise

    def reads(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
        return {m.group(1): float(m.group(2))
                for m in re.finditer(r'^cubetorchfs_reads_total\{result="(\w+)"\} (\S+)$', text, re.M)}

    def close(self) -> None:
        subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], check=False, timeout=30,
                       stderr=subprocess.DEVNULL)
        for _ in range(200):
            if not Path(f"/proc/{self.pid}").exists():
                return
            time.sleep(0.05)
        log(f"cubetorchfs pid {self.pid} still alive after unmount; killing it")
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass


# --------------------------------------------------------------------------- the training side


class _Sample:
    """(jpg bytes, cls bytes) -> (sample, label); picklable for the workers."""

    def __init__(self, variant: str) -> None:
        self.variant, self.tf = variant, None

    def __call__(self, jpg: bytes, cls: bytes = b"0"):
        if self.variant != "decode":
            return jpg, int(cls)
        import io
        from PIL import Image
        from torchvision import transforms
        if self.tf is None:
            self.tf = transforms.Compose([transforms.RandomResizedCrop(112), transforms.ToTensor()])
        return self.tf(Image.open(io.BytesIO(jpg)).convert("RGB")), int(cls)


def child(args: argparse.Namespace) -> None:
    if args.system == "hook":
        import cube_torch  # noqa: F401  (patches DataLoader iteration)
    import torch
    import torchvision

    torch.manual_seed(0)
    root = Path(args.child)
    sample = _Sample(args.variant)
    t0 = time.monotonic()
    if args.system == "webdataset":
        import webdataset as wds
        urls = [str(p) for p in sorted((root / "shards").glob("*.tar"))]
        ds = (wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
              .shuffle(args.buffer).to_tuple("jpg", "cls").map(lambda t: sample(*t)))
        shuffle = False
    else:
        ds = torchvision.datasets.ImageFolder(str(root / "loose"),
                                              loader=lambda p: open(p, "rb").read())
        ds.transform = lambda data: sample(data)[0]
        shuffle = True
    scan = time.monotonic() - t0
    loader = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=shuffle, num_workers=2,
                                         collate_fn=list if args.variant == "raw" else None)
    for _ in range(args.epochs):
        start = time.monotonic()
        n = nbytes = 0
        for batch in loader:
            if args.variant == "raw":
                n += len(batch)
                nbytes += sum(len(data) for data, _ in batch)
            else:
                n += len(batch[0])
        print(json.dumps({"samples": n, "bytes": nbytes, "seconds": time.monotonic() - start,
                          "scan_seconds": scan}), flush=True)
        scan = 0.0


def run_child(mount: Mount, store_in_mount: Path, system: str, variant: str, epochs: int,
              buffer: int, timeout: float) -> list[dict]:
    cmd = [sys.executable, __file__, "--child", str(store_in_mount), "--system", system,
           "--variant", variant, "--epochs", str(epochs), "--buffer", str(buffer)]
    env = dict(mount.env)
    if system == "hook":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "hooks"), env.get("PYTHONPATH")]))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{system} exited with {out.returncode}: "
                           + " | ".join(out.stderr.strip().splitlines()[-3:]))
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if len(rows) != epochs:
        raise RuntimeError(f"{system} printed {len(rows)} epochs, not {epochs}")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=20000)
    p.add_argument("--classes", type=int, default=30)
    p.add_argument("--shard-mib", type=int, default=100, help="shard size (default 100 MiB)")
    p.add_argument("--buffer", type=int, default=1000, help="webdataset shuffle buffer (samples)")
    p.add_argument("--latency-ms", type=float, default=10.0, help="added to every store request")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=["raw", "decode"], choices=["raw", "decode"])
    p.add_argument("--systems", nargs="+", default=["webdataset", "hook"], choices=SYSTEMS)
    p.add_argument("--memory-bytes", default="4GiB", help="cubetorchfs cache.memory_bytes")
    p.add_argument("--epoch-timeout", type=float, default=900.0)
    p.add_argument("--workdir", default="/tmp/cubetorchfs-shard-bench")
    p.add_argument("--data", default="/tmp/cubetorchfs-s3-bench/data",
                   help="the JPEG data set (made if absent; shared with s3_bench)")
    p.add_argument("--bin", default=os.environ.get("CUBETORCHFS_BIN", str(REPO / "build/bin/cubetorchfs")))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="raw", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    missing = rerun_under_venv(("webdataset", "torchvision"), __file__)
    if missing:
        p.error(f"{', '.join(missing)} not importable: make the project venv (scripts/install_deps.sh)")
    if not Path(args.bin).exists():
        p.error(f"no cubetorchfs binary at {args.bin} (build it, or --bin)")

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    data = Path(args.data)
    generate_jpegs(data, args.files, args.classes, "shard_bench")
    files = data_files(data)
    total = sum(f.stat().st_size for f in files)
    repack = build_store(data, work / "store", args.shard_mib << 20)
    log(f"{len(files)} files ({total / 1e6:.0f} MB); repacked into {repack['shards']} shards in "
        f"{repack['seconds']:.1f} s (from the local disk, page cache dropped first)")

    results: dict[tuple[str, str], list[list[dict]]] = {}
    failures: list[str] = []
    for variant in args.variants:
        for r in range(args.rounds):
            for system in args.systems:
                run = work / f"run-{system}"
                shutil.rmtree(run, ignore_errors=True)
                run.mkdir()
                mount: Optional[Mount] = None
                try:
                    mount = Mount(args.bin, work / "store", run, args.latency_ms, args.memory_bytes)
                    drop_caches(log)
                    rows = run_child(mount, mount.mnt, system, variant, args.epochs, args.buffer,
                                     args.epoch_timeout * args.epochs)
                    for k, row in enumerate(rows, 1):
                        if row["samples"] != len(files):
                            raise RuntimeError(f"epoch {k}: {row['samples']} samples, not {len(files)}")
                        if variant == "raw" and row["bytes"] != total:
                            raise RuntimeError(f"epoch {k}: {row['bytes']} bytes, not {total}")
                        row["rate"] = row["samples"] / (row["seconds"] + row["scan_seconds"])
                    reads = mount.reads()
                    n = sum(reads.get(k, 0) for k in ("hit", "late", "miss"))
                    rows[0]["hit_ratio"] = reads.get("hit", 0) / n if n else float("nan")
                    rows[0]["vmhwm"] = vm_hwm_mib(mount.pid)
                    results.setdefault((variant, system), []).append(rows)
                    log(f"{variant} round {r + 1}: {system:10} "
                        + ", ".join(f"epoch {k + 1} {row['rate']:.0f} samples/s" for k, row in enumerate(rows))
                        + f"; reads hit {rows[0]['hit_ratio']:.3f}; VmHWM {rows[0]['vmhwm']:.0f} MiB")
                except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as e:
                    failures.append(f"{variant} {system} round {r + 1}: {type(e).__name__}: {e}")
                    log(f"FAILED: {failures[-1]}")
                finally:
                    if mount is not None:
                        mount.close()
                    shutil.rmtree(run, ignore_errors=True)

    print(f"shard_bench - nproc {os.cpu_count()}, {len(files)} JPEGs ({total / 1e6:.0f} MB), "
          f"{repack['shards']} shards of {args.shard_mib} MiB, +{args.latency_ms:g} ms per store "
          f"request (cubetorchfs inject, posix store), 2 workers, batch 64, shuffle buffer "
          f"{args.buffer}, {args.rounds} rounds, median (min-max) samples/s; epoch 1 cold, "
          f"includes the scan")
    print(f"repack: {repack['seconds']:.1f} s for {repack['files']} files into {repack['shards']} "
          f"shards ({repack['bytes'] / 1e6:.0f} MB), from the local disk")
    for variant in args.variants:
        for system in args.systems:
            rounds = results.get((variant, system), [])
            if not rounds:
                print(f"{variant:7} {system:11} failed")
                continue
            cells = []
            for k in range(args.epochs):
                rates = [rows[k]["rate"] for rows in rounds]
                cells.append(f"epoch {k + 1} {statistics.median(rates):6.0f} "
                             f"({min(rates):.0f}-{max(rates):.0f})")
            print(f"{variant:7} {system:11} " + "  ".join(cells)
                  + f"  hit {statistics.median(rows[0]['hit_ratio'] for rows in rounds):.3f}")
        a, b = results.get((variant, "hook"), []), results.get((variant, "webdataset"), [])
        if a and b:
            print(f"{variant}: hook / webdataset = " + ", ".join(
                f"epoch {k + 1} {statistics.median(r[k]['rate'] for r in a) / statistics.median(r[k]['rate'] for r in b):.2f}"
                for k in range(args.epochs)) + " (target >= 0.9)")
    for f in failures:
        print(f"FAILED {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
