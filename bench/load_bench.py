#!/usr/bin/python3
"""Model loading: cube_torch.load_file vs safetensors, fastsafetensors, torch.load and the limit.

For each size (GiB) and layout (one tensor; ~500 tensors of mixed sizes) the script writes the
same random weights (never zeros) as safetensors, as veTurboIO-encrypted safetensors
(save_file(use_cipher=True), a random key) and as a torch.save .pt, then measures in
alternating rounds, in this order each round:

  load_file        cube_torch.load_file(plain)               (CPU, default threads; a plain
                   file is mapped and its pages made present: docs/models.md)
  load_file-read   cube_torch.load_file(plain, map_file=False): read into private memory
  safetensors      safetensors.torch.load_file(plain)        (HF safetensors, the project venv)
  fastsafetensors  fastsafetensors' SafeTensorsFileLoader(device="cpu", nogds=True,
                   max_threads=--fst-threads, bbuf_size_kb=--fst-bbuf-kb), what fastsafe_open
                   builds, with its thread options exposed (the project venv)
  torch.load       torch.load(.pt, map_location="cpu")
  dd               `dd if=FILE of=/dev/null bs=16M`: one sequential pass, no new memory
  limit            os.preadv of the whole safetensors file with --threads Python threads
                   (they release the GIL) into a fresh page-aligned buffer, 8 MiB per read —
                   the same work as load_file minus parsing: new memory + every byte read once
  limit-prefault   the same into a buffer allocated and touched before the clock starts (what
                   the read alone costs; shown, not used for the ratio)
  load_file-enc    cube_torch.load_file(encrypted): read + AES-CTR + integrity check
  mount, mount-enc, mount-fuse   with --mount: the same files through a cubetorchfs mount this
                   script starts over the work directory (posix backend): load_file through the
                   daemon's descriptor (mount, mount-enc) and through FUSE reads
                   (mount-fuse: CUBE_TORCH_NO_DAEMON_FD=1)

Every time includes reading one byte of every 4 KiB page of every tensor the system returned
(`touch_pages`): safetensors maps the file and reads nothing until the tensors are used, so
without this it would be timed for its header parse alone; safetensors-lazy is that figure,
shown, never used for a ratio. cube_torch.load_file maps plain files too (docs/models.md) but
makes every page present before it returns.

Hot page cache by default (one unmeasured warm-up round reads everything first); --cold drops
the page cache (`sync; echo 3 > /proc/sys/vm/drop_caches`, root) before every measurement.
Prints one table (median and min–max seconds and GB/s per system) and a last line with the
ratios: load_file/safetensors (target >= 1.5 hot), load_file/fastsafetensors (target >= 1.0 hot
and cold), load_file/torch.load, load_file/limit (target >= 0.83, within 1.2x of the limit),
encrypted/plain (target >= 0.7), medians over all sizes and layouts.

safetensors and fastsafetensors come from the project venv (scripts/install_deps.sh): run under
any other python, the script starts itself again under the venv's (scripts/venv.sh) when the
venv exists, and otherwise leaves those two rows out with one line saying so.

Files go under --workdir (default: a fresh directory in /var/tmp) and are deleted at exit.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import gc
import json
import mmap
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hooks"))
os.environ.setdefault("CUBE_TORCH_DISABLE", "1")  # no DataLoader hook needed here
import cube_torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import drop_caches, rerun_under_venv  # noqa: E402

GIB = 1 << 30
READ_CHUNK = 8 << 20
MANY = 500
FST_THREADS = 4
FST_BBUF_KB = 64 * 1024


def default_threads() -> int:
    from cube_torch import _loader
    return _loader._io_threads(None)  # the library's default


# ---- data --------------------------------------------------------------------------------------

def make_weights(nbytes: int, layout: str, seed: int) -> Dict[str, torch.Tensor]:
    """Random bits (as float32/bf16/int8 tensors; NaN bit patterns included) with separate
    storages, as a real state dict has. "one": one float32 tensor; "many": MANY tensors of
    log-normally distributed sizes (a few big matrices, many small ones)."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "one":
        return {"weight": torch.empty(nbytes // 4, dtype=torch.int32).random_(generator=gen)
                .view(torch.float32)}
    sizes = torch.empty(MANY).log_normal_(0.0, 2.0, generator=gen)
    sizes = (sizes / sizes.sum() * nbytes).long().clamp_(min=64)
    sizes = (sizes // 64) * 64
    sizes[0] += nbytes - int(sizes.sum())  # exact total
    out: Dict[str, torch.Tensor] = {}
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.int8]
    for i, s in enumerate(sizes.tolist()):
        dtype = dtypes[i % len(dtypes)]
        elem = torch.empty((), dtype=dtype).element_size()
        raw = torch.empty(s // 4, dtype=torch.int32).random_(generator=gen)
        out[f"layers.{i // 4}.t{i % 4}.weight"] = raw.view(torch.uint8)[: s // elem * elem].view(dtype)
    return out


def same_bytes(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a)


# ---- the systems -------------------------------------------------------------------------------

def fresh_buffer(n: int) -> mmap.mmap:
    """New memory allocated the way load_file allocates its buffer (private, huge pages), so
    the limit pays the same allocation cost."""
    m = mmap.mmap(-1, max(n, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return m


def parallel_read(path: str, buf: mmap.mmap, threads: int) -> int:
    size = os.path.getsize(path)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        def read(off: int) -> int:
            end = min(size, off + READ_CHUNK)
            done = off
            while done < end:
                n = os.preadv(fd, [view[done:end]], done)
                if n <= 0:
                    raise OSError(f"{path}: short read at {done}")
                done += n
            return end - off

        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(read, range(0, size, READ_CHUNK)))
    finally:
        os.close(fd)
        view.release()
    assert total == size
    return total


def fastsafetensors_load(path: Path, threads: int, bbuf_kb: int) -> Dict[str, torch.Tensor]:
    """What fastsafe_open(filenames=[path], nogds=True, device="cpu") does, with its loader's
    thread count and bounce-buffer size set. The tensors own their memory after close()."""
    from fastsafetensors import SafeTensorsFileLoader
    loader = SafeTensorsFileLoader(None, "cpu", nogds=True, max_threads=threads,
                                   bbuf_size_kb=bbuf_kb)
    try:
        loader.add_filenames({0: [str(path)]})
        fb = loader.copy_files_to_device()
        try:
            return {k: fb.get_tensor(k) for k in fb.key_to_rank_lidx}
        finally:
            fb.close()
    finally:
        loader.close()


def peer_versions() -> str:
    from importlib import metadata
    out = []
    for dist in ("safetensors", "fastsafetensors"):
        try:
            out.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            out.append(f"{dist} absent")
    return ", ".join(out)


def dd_read(path: Path) -> int:
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "status=none"], check=True,
                   timeout=600)
    return os.path.getsize(path)


def touch_pages(result: object) -> None:
    """Reads one byte of every 4 KiB of every tensor: a loader that maps the file lazily
    (safetensors does) pays here for what it left to first use."""
    if isinstance(result, dict):
        for t in result.values():
            flat = t.reshape(-1).view(torch.uint8)
            if flat.numel():
                int(flat[::4096].sum())


def measure(fn: Callable[[], object], cold: bool, setup: Optional[Callable[[], object]] = None,
            touch: bool = True) -> float:
    arg = setup() if setup else None
    if cold:
        drop_caches(log=None, sync_timeout=120)  # raises where it cannot
    gc.collect()
    t0 = time.perf_counter()
    result = fn() if arg is None else fn(arg)  # type: ignore[call-arg]
    if touch:
        touch_pages(result)
    dt = time.perf_counter() - t0
    del result, arg
    gc.collect()
    return dt


# ---- main --------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1", help="comma-separated GiB sizes (default 1; e.g. 1,2,4)")
    ap.add_argument("--layouts", default="one,many", help="one,many (default both)")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5, at least 5 "
                    "for a recorded figure)")
    ap.add_argument("--threads", type=int, default=default_threads(),
                    help="threads of the plain-read limit (default: the library's default, "
                         f"{default_threads()} here)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every "
                    "measurement (root)")
    ap.add_argument("--mount", action="store_true", help="also load through a cubetorchfs mount "
                    "of the work directory (build/bin/cubetorchfs or $CUBETORCHFS_BIN)")
    ap.add_argument("--workdir", help="where the files go (default: a new directory in /var/tmp); "
                    "removed at exit")
    ap.add_argument("--no-encrypted", action="store_true", help="skip the encrypted rows")
    ap.add_argument("--fst-threads", type=int, default=FST_THREADS,
                    help=f"fastsafetensors max_threads (default {FST_THREADS}: the best of 1, 2, 4, "
                         "8, 16 on the recorded machine; bench/README.md)")
    ap.add_argument("--fst-bbuf-kb", type=int, default=FST_BBUF_KB,
                    help=f"fastsafetensors bbuf_size_kb (default {FST_BBUF_KB})")
    ap.add_argument("--no-torch-load", action="store_true", help="skip torch.load (and writing "
                    "the .pt file)")
    args = ap.parse_args()
    missing = rerun_under_venv(("safetensors", "fastsafetensors"), __file__)
    if missing:
        print(f"# {', '.join(missing)} not importable (make the project venv: "
              f"scripts/install_deps.sh): those rows are left out", flush=True)
    sizes = [float(s) for s in args.sizes.split(",") if s]
    layouts = [s for s in args.layouts.split(",") if s]
    if args.cold and os.geteuid() != 0:
        ap.error("--cold needs root (drop_caches)")
    if any(l not in ("one", "many") for l in layouts):
        ap.error("--layouts: one, many")

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="cube-load-bench-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    cleanup_paths = [p for p in (work if not args.workdir else None,) if p]
    made: List[Path] = []
    daemon = Daemon(work) if args.mount else None
    mount_dir = daemon.mountpoint if daemon else None

    def cleanup() -> None:
        if daemon:
            daemon.stop()
        for p in made:
            try:
                p.unlink()
            except OSError:
                pass
        for d in cleanup_paths:
            shutil.rmtree(d, ignore_errors=True)

    atexit.register(cleanup)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ["VETURBOIO_KEY"] = base64.b64encode(os.urandom(32)).decode()  # this run only
    if daemon:
        daemon.start()

    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    print(f"# load_bench: sizes {sizes} GiB, layouts {layouts}, {args.rounds} rounds, "
          f"{'cold' if args.cold else 'hot'} page cache, limit threads {args.threads}, "
          f"load_file threads default; {os.cpu_count()} cores, {mem_gib:.0f} GiB, kernel "
          f"{platform.release()}, torch {torch.__version__}, {peer_versions()}; fastsafetensors "
          f"max_threads {args.fst_threads}, bbuf_size_kb {args.fst_bbuf_kb}; files in {work}",
          flush=True)

    results: Dict[tuple, List[float]] = {}
    file_bytes: Dict[tuple, int] = {}
    began = time.monotonic()
    for size in sizes:
        nbytes = int(size * GIB)
        for layout in layouts:
            tag = f"{size:g}GiB-{layout}"
            t0 = time.monotonic()
            weights = make_weights(nbytes, layout, seed=int(size * 1000) + len(layout))
            st, enc, pt = work / f"{tag}.safetensors", work / f"{tag}.enc.safetensors", work / f"{tag}.pt"
            made.extend([st, enc, pt])
            cube_torch.save_file(weights, st)
            if not args.no_encrypted:
                cube_torch.save_file(weights, enc, use_cipher=True)
            if not args.no_torch_load:
                torch.save(weights, pt)
            systems: Dict[str, tuple] = {
                "load_file": (lambda p=st: cube_torch.load_file(p), None, st),
                "load_file-read": (lambda p=st: cube_torch.load_file(p, map_file=False), None, st),
            }
            if "safetensors" not in missing:
                import safetensors.torch
                systems["safetensors"] = (lambda p=st: safetensors.torch.load_file(p), None, st)
                systems["safetensors-lazy"] = (lambda p=st: safetensors.torch.load_file(p), None, st)
            if "fastsafetensors" not in missing:
                systems["fastsafetensors"] = (lambda p=st: fastsafetensors_load(
                    p, args.fst_threads, args.fst_bbuf_kb), None, st)
            if not args.no_torch_load:
                systems["torch.load"] = (lambda p=pt: torch.load(p, map_location="cpu"), None, pt)
            systems |= {
                "dd": (lambda p=st: dd_read(p), None, st),
                "limit": (lambda b, p=st: parallel_read(str(p), b, args.threads),
                          lambda p=st: fresh_buffer(os.path.getsize(p)), st),
                "limit-prefault": (lambda b, p=st: parallel_read(str(p), b, args.threads),
                                   lambda p=st: _touched(fresh_buffer(os.path.getsize(p))), st),
            }
            if not args.no_encrypted:
                systems["load_file-enc"] = (lambda p=enc: cube_torch.load_file(p), None, enc)
            if mount_dir:
                mst, menc = mount_dir / st.name, mount_dir / enc.name
                systems["mount"] = (lambda p=mst: cube_torch.load_file(p), None, st)
                systems["mount-fuse"] = (lambda p=mst: load_via_fuse(p), None, st)
                if not args.no_encrypted:
                    systems["mount-enc"] = (lambda p=menc: cube_torch.load_file(p), None, enc)
            # Correctness once, and the warm-up round for the hot case.
            for name in ("load_file", "load_file-enc", "mount", "mount-enc", "mount-fuse",
                         "safetensors", "fastsafetensors"):
                if name in systems and not same_bytes(systems[name][0](), weights):
                    print(f"ERROR: {name} of {tag} loaded different bytes", file=sys.stderr)
                    return 1
            if not args.no_torch_load and not same_bytes(torch.load(pt, map_location="cpu"), weights):
                print(f"ERROR: torch.load of {tag} differs", file=sys.stderr)
                return 1
            del weights
            gc.collect()
            for name, (_, _, path) in systems.items():
                file_bytes[(tag, name)] = os.path.getsize(path)
            print(f"# {tag}: files written and checked in {time.monotonic() - t0:.1f} s",
                  flush=True)
            for _ in range(args.rounds):
                for name, (fn, setup, _) in systems.items():
                    results.setdefault((tag, name), []).append(
                        measure(fn, args.cold, setup, touch=not name.endswith("-lazy")))
            for p in (st, enc, pt):  # free the disk and page cache before the next size
                if p.exists():
                    p.unlink()

    # ---- report ----
    print(f"\n{'file':<14} {'system':<15} {'median s':>9} {'min–max s':>15} {'GB/s':>7} {'min–max GB/s':>15}")
    medians: Dict[tuple, float] = {}
    for (tag, name), ts in results.items():
        med = statistics.median(ts)
        medians[(tag, name)] = med
        gb = file_bytes[(tag, name)] / 1e9
        print(f"{tag:<14} {name:<15} {med:>9.3f} {min(ts):>7.3f}–{max(ts):<7.3f} {gb / med:>7.2f} "
              f"{gb / max(ts):>7.2f}–{gb / min(ts):<7.2f}")
    tags = sorted({t for t, _ in results})

    def ratio(num: str, den: str) -> str:
        # speed ratio of system `num` to `den` (> 1: num is faster), per file, then the median.
        rs = [medians[(t, den)] / medians[(t, num)] for t in tags if (t, num) in medians and (t, den) in medians]
        if not rs:
            return "n/a"
        each = ", ".join(f"{t} {medians[(t, den)] / medians[(t, num)]:.2f}" for t in tags if (t, num) in medians)
        return f"{statistics.median(rs):.2f} ({each})"

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
    print(f"# peak RSS of this process {rss:.2f} GiB; whole run {time.monotonic() - began:.0f} s")
    line = (f"ratios ({'cold' if args.cold else 'hot'}): load_file/safetensors = "
            f"{ratio('load_file', 'safetensors')} (target >= 1.5 hot); load_file/fastsafetensors = "
            f"{ratio('load_file', 'fastsafetensors')} (target >= 1.0); load_file/torch.load = "
            f"{ratio('load_file', 'torch.load')}; load_file/limit = {ratio('load_file', 'limit')} "
            f"(target >= 0.83: within 1.2x; vs prefaulted buffer "
            f"{ratio('load_file', 'limit-prefault')}, vs dd {ratio('load_file', 'dd')})")
    if not args.no_encrypted:
        line += f"; encrypted/plain = {ratio('load_file-enc', 'load_file')} (target >= 0.7)"
    if daemon:
        opened = daemon.stats().get("files_open", {})
        print(f"# daemon: files_open {opened}; VmHWM {daemon.vmhwm() / (1 << 20):.0f} MiB "
              f"(cache.memory_bytes {daemon.MEMORY})")
        line += (f"; mount/direct = {ratio('mount', 'load_file')}, mount-enc/direct-enc = "
                 f"{ratio('mount-enc', 'load_file-enc')}, mount-fuse/direct = "
                 f"{ratio('mount-fuse', 'load_file')}")
    print(line)
    return 0


def load_via_fuse(path: Path):
    """load_file reading through FUSE instead of asking the daemon for a descriptor."""
    os.environ["CUBE_TORCH_NO_DAEMON_FD"] = "1"
    try:
        return cube_torch.load_file(path)
    finally:
        del os.environ["CUBE_TORCH_NO_DAEMON_FD"]


class Daemon:
    """A cubetorchfs mount of `root` for the --mount rows, always unmounted at exit."""

    MEMORY = "2GiB"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.base = Path(tempfile.mkdtemp(prefix="cube-load-bench-mnt-", dir="/tmp"))
        self.mountpoint = self.base / "mnt"
        self.vol = f"loadbench{os.getpid()}"
        self.pid: Optional[int] = None

    def start(self) -> None:
        binary = os.environ.get("CUBETORCHFS_BIN",
                                str(Path(__file__).resolve().parents[1] / "build/bin/cubetorchfs"))
        self.mountpoint.mkdir()
        cfg = {"volName": self.vol, "mountPoint": str(self.mountpoint), "logDir": str(self.base),
               "exporterPort": 0, "profPort": "",
               "backend": {"type": "posix", "root": str(self.root)},
               "cache": {"memory_bytes": self.MEMORY, "chunk_bytes": "4MiB"},
               "prefetch": {"control_socket": str(self.base / "ctl.sock")}}
        (self.base / "config.json").write_text(json.dumps(cfg))
        os.environ["CUBE_TORCH_CONFIG_DIR"] = str(self.base)
        subprocess.run([binary, "-c", str(self.base / "config.json")], check=True, timeout=60,
                       env=dict(os.environ))
        self.pid = json.loads((self.base / f"cube_torch.config.{self.vol}").read_text())["pid"]

    def stats(self) -> dict:
        return cube_torch.stats().get("global", {})

    def vmhwm(self) -> int:
        with open(f"/proc/{self.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        if self.pid is not None:
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], timeout=30,
                           stderr=subprocess.DEVNULL)
            for _ in range(100):
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
            else:
                os.kill(self.pid, signal.SIGKILL)
            self.pid = None
        shutil.rmtree(self.base, ignore_errors=True)


def _touched(buf: mmap.mmap) -> mmap.mmap:
    page = mmap.PAGESIZE
    view = memoryview(buf)
    for off in range(0, len(buf), page):
        view[off] = 1
    view.release()
    return buf


if __name__ == "__main__":
    sys.exit(main())
