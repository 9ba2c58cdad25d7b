#!/usr/bin/python3
"""Model loading onto a GPU: cube_torch.load_file(device="cuda") against what a user would pick
instead, on the same files, in the same run; and the loader's CUDA paths against plain CUDA.

Rows, for each size (GiB, --sizes) and page-cache state (hot: read once before; cold: `sync;
echo 3 > /proc/sys/vm/drop_caches` before every measurement, root):

  torch.load          torch.load(.pt, map_location="cuda:0", weights_only=True)
  safetensors         safetensors.torch.load_file(path, device="cuda:0")
  fastsafetensors     SafeTensorsFileLoader(device="cuda:0", nogds=True, max_threads=16,
                      bbuf_size_kb=16384), copy_files_to_device, get_tensor of every key
  fastsafetensors-gds the same with nogds=False (GPU Direct Storage through cuFile; a row says
                      why where cuFile cannot open the file)
  cube_torch          cube_torch.load_file(path, device="cuda:0") (reading threads into pinned
                      staging slots, pipelined host-to-device copies)
  cube_torch-enc      the same file veTurboIO-encrypted (AES-256-CTR, decrypted on the GPU)
  cube_torch-direct   cube_torch.load_file(..., direct_io=True): O_DIRECT reads past the page
                      cache (for the cold case)

Each round measures every row once, in that order; --rounds rounds; the table gives the median
and min-max seconds and GB/s. Every row's first result is checked byte for byte against the
weights. Then build/bin/gpu_bench (bench/gpu_bench.cc) measures, at the largest size: a plain
cudaMemcpy from pinned memory (the reference for the host-to-device path), the loader's copier
through its staging slots, a device-to-device copy (the device's memory bandwidth) and the
AES-CTR kernel. The last lines are the ratios the targets name.

With --slots 8,16,32 the rows cube_torch-slotsN load through init_io_helper(16 MiB, N): at most
N - 1 reading threads fill the staging slots.

Usage: bench/gpu_bench.py [--sizes 1,4] [--rounds 5] [--no-cold] [--time-limit S] [--out F]
Files go under --workdir (default: a fresh directory in /var/tmp) and are deleted at exit.
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "hooks"))
sys.path.insert(0, str(HERE))
os.environ.setdefault("CUBE_TORCH_DISABLE", "1")  # no DataLoader hook needed here
import cube_torch  # noqa: E402
from benchlib import drop_caches  # noqa: E402
from load_bench import GIB, make_weights  # noqa: E402

DEV = "cuda:0"
FST_THREADS = 16
FST_BBUF_KB = 16 * 1024


def fastsafetensors_load(path: str, nogds: bool) -> Dict[str, torch.Tensor]:
    from fastsafetensors import SafeTensorsFileLoader
    loader = SafeTensorsFileLoader(None, DEV, nogds=nogds, max_threads=FST_THREADS,
                                   bbuf_size_kb=FST_BBUF_KB)
    loader.add_filenames({0: [path]})
    fb = loader.copy_files_to_device()
    out = {k: fb.get_tensor(k) for k in fb.key_to_rank_lidx}
    torch.cuda.synchronize()
    # As fastsafe_open's exit does: the tensors keep their buffer alive (fastsafetensors 0.5),
    # and without fb.close() the loader keeps every device buffer it ever made.
    fb.close()
    loader.close()
    return out


def rows(files: Dict[str, str], slots: List[int]) -> Dict[str, Callable[[], Dict[str, torch.Tensor]]]:
    import safetensors.torch
    helpers = {n: cube_torch.init_io_helper(slot_bytes=16 << 20, slots=n) for n in slots}
    extra = {f"cube_torch-slots{n}": (lambda h=h: cube_torch.load_file(files["plain"], device=DEV,
                                                                         helper=h))
             for n, h in helpers.items()}
    return extra | {
        "torch.load": lambda: torch.load(files["pt"], map_location=DEV, weights_only=True),
        "safetensors": lambda: safetensors.torch.load_file(files["plain"], device=DEV),
        "fastsafetensors": lambda: fastsafetensors_load(files["plain"], nogds=True),
        "fastsafetensors-gds": lambda: fastsafetensors_load(files["plain"], nogds=False),
        "cube_torch": lambda: cube_torch.load_file(files["plain"], device=DEV),
        "cube_torch-enc": lambda: cube_torch.load_file(files["enc"], device=DEV),
        "cube_torch-direct": lambda: cube_torch.load_file(files["plain"], device=DEV,
                                                           direct_io=True),
    }


def same(got: Dict[str, torch.Tensor], want_gpu: Dict[str, torch.Tensor]) -> Optional[str]:
    if sorted(got) != sorted(want_gpu):
        return "different tensor names"
    for k, w in want_gpu.items():
        g = got[k]
        if g.device != w.device or g.dtype != w.dtype or g.shape != w.shape:
            return f"{k}: {g.device} {g.dtype} {tuple(g.shape)}"
        if not torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)):
            return f"{k}: different bytes"
    return None


def measure(fn: Callable[[], Dict[str, torch.Tensor]], cold: bool):
    gc.collect()
    torch.cuda.empty_cache()
    if cold:
        drop_caches()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def make_files(workdir: Path, gib: float, seed: int) -> Dict[str, Any]:
    nbytes = int(gib * GIB)
    w = make_weights(nbytes, "many", seed)
    files = {"plain": str(workdir / f"m{gib:g}.safetensors"),
             "enc": str(workdir / f"m{gib:g}.enc.safetensors"),
             "pt": str(workdir / f"m{gib:g}.pt")}
    t0 = time.perf_counter()
    cube_torch.save_file(w, files["plain"])
    cube_torch.save_file(w, files["enc"], use_cipher=True)
    torch.save(w, files["pt"])
    os.sync()
    print(f"# {gib:g} GiB: {len(w)} tensors, files written in {time.perf_counter() - t0:.1f} s",
          flush=True)
    return {"files": files, "weights": w, "bytes": sum(t.numel() * t.element_size()
                                                     for t in w.values())}


def summary(times: List[float], nbytes: int) -> Dict[str, float]:
    med = statistics.median(times)
    return {"median_s": med, "min_s": min(times), "max_s": max(times),
            "gb_per_s": nbytes / med / 1e9, "rounds": len(times)}


def run_cuda_bench(binary: Path, gib: float, rounds: int) -> Dict[str, Any]:
    if not binary.exists():
        return {"error": f"{binary} not built (cmake --build build --target gpu_bench)"}
    r = subprocess.run([str(binary), "--gib", f"{gib:g}", "--rounds", str(rounds)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return {"error": r.stderr.strip()[-500:]}
    out: Dict[str, Any] = {}
    for line in r.stdout.splitlines():
        d = json.loads(line)
        key = d["name"]
        if key == "decrypt":
            key = f"decrypt-aes{d['key_bits']}-offset{d['offset']}"
        out[key] = d
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,4", help="GiB, comma separated (default 1,4)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-cold", action="store_true", help="hot page cache only")
    ap.add_argument("--only", default="", help="comma-separated rows to run (default: all)")
    ap.add_argument("--slots", default="",
                    help="also cube_torch-slotsN rows: a helper of N staging slots of 16 MiB")
    ap.add_argument("--time-limit", type=float, default=0,
                    help="start no new round after this many seconds (0: no limit)")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--out", default="", help="write the results as JSON here too")
    ap.add_argument("--gpu-bench", default=str(HERE.parent / "build" / "bin" / "gpu_bench"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    began = time.monotonic()
    sizes = [float(s) for s in args.sizes.split(",") if s]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gpu_bench.", dir="/var/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ["VETURBOIO_KEY"] = base64.b64encode(os.urandom(32)).decode()
    props = torch.cuda.get_device_properties(0)
    results: Dict[str, Any] = {
        "device": props.name, "gpu_memory_bytes": props.total_memory,
        "cpus": os.cpu_count(), "torch": torch.__version__, "rounds": args.rounds,
        "fastsafetensors_options": {"max_threads": FST_THREADS, "bbuf_size_kb": FST_BBUF_KB},
        "loads": {}}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))

    only = {s for s in args.only.split(",") if s}
    try:
        states = ["hot"] + ([] if args.no_cold else ["cold"])
        for gib in sizes:
            made = make_files(workdir, gib, seed=int(gib * 10))
            want_gpu = {k: v.to(DEV) for k, v in made["weights"].items()}
            del made["weights"]
            slots = [int(n) for n in args.slots.split(",") if n]
            table = {n: f for n, f in rows(made["files"], slots).items()
                     if not only or n in only or n.startswith("cube_torch-slots")}
            for state in states:
                key = f"{gib:g}GiB-{state}"
                times: Dict[str, List[float]] = {n: [] for n in table}
                errors: Dict[str, str] = {}
                if state == "hot":  # the page cache holds every file
                    for path in made["files"].values():
                        with open(path, "rb") as fh:
                            while fh.read(64 << 20):
                                pass
                for rnd in range(args.rounds):
                    if args.time_limit and time.monotonic() - began > args.time_limit and rnd:
                        print(f"# {key}: time limit reached after {rnd} rounds", flush=True)
                        break
                    for name, fn in table.items():
                        if name in errors:
                            continue
                        try:
                            dt, out = measure(fn, cold=state == "cold")
                        except Exception as e:  # a row that cannot run here says why
                            errors[name] = f"{type(e).__name__}: {e}"[:400]
                            continue
                        if rnd == 0:
                            bad = same(out, want_gpu)
                            if bad:
                                errors[name] = f"wrong result: {bad}"
                        del out
                        times[name].append(dt)
                results["loads"][key] = {
                    "bytes": made["bytes"],
                    "rows": {n: summary(t, made["bytes"]) for n, t in times.items()
                             if t and n not in errors},
                    "errors": errors}
                print_table(key, results["loads"][key])
                save()
            del want_gpu
            for path in made["files"].values():
                os.unlink(path)
        results["cuda"] = run_cuda_bench(Path(args.gpu_bench), max(sizes), args.rounds)
        save()
        print_ratios(results)
        save()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def print_table(key: str, r: Dict[str, Any]) -> None:
    print(f"\n{key} ({r['bytes'] / 1e9:.2f} GB)")
    print(f"{'row':22} {'median s':>9} {'min-max s':>15} {'GB/s':>7}")
    for name, s in r["rows"].items():
        print(f"{name:22} {s['median_s']:9.3f} {s['min_s']:7.3f}-{s['max_s']:<7.3f} "
              f"{s['gb_per_s']:7.2f}")
    for name, e in r["errors"].items():
        print(f"{name:22} not measured: {e}")
    sys.stdout.flush()


def print_ratios(results: Dict[str, Any]) -> None:
    print("\nratios (cube_torch speed over the other's; medians):")
    for key, r in results["loads"].items():
        rows_ = r["rows"]
        cube = rows_.get("cube_torch")
        if not cube:
            continue
        parts = []
        for other in ("torch.load", "safetensors", "fastsafetensors", "fastsafetensors-gds"):
            if other in rows_:
                parts.append(f"vs {other} {rows_[other]['median_s'] / cube['median_s']:.2f}")
        if "cube_torch-enc" in rows_:
            parts.append(f"encrypted/plain {cube['median_s'] / rows_['cube_torch-enc']['median_s']:.2f}")
        print(f"  {key}: " + ", ".join(parts))
    cuda = results.get("cuda", {})
    if "error" in cuda:
        print(f"  gpu_bench: {cuda['error']}")
        return
    ref = cuda.get("memcpy_pinned")
    if ref:
        print(f"  cudaMemcpy from pinned memory: {ref['gb_per_s']:.1f} GB/s; the loader's copier "
              f"{cuda['copier']['gb_per_s']:.1f} GB/s ({cuda['copier']['gb_per_s'] / ref['gb_per_s']:.2f}x)")
        for key, r in results["loads"].items():
            if key.endswith("hot") and "cube_torch" in r["rows"]:
                g = r["rows"]["cube_torch"]["gb_per_s"]
                print(f"  {key}: load_file(cuda) end to end {g:.1f} GB/s = "
                      f"{g / ref['gb_per_s']:.2f}x the pinned cudaMemcpy")
    if "d2d" in cuda:
        print(f"  device memory: a device-to-device copy moves {cuda['d2d']['gb_per_s']:.0f} GB/s "
              f"(read + written)")
    for key, d in cuda.items():
        if key.startswith("decrypt"):
            print(f"  {key}: {d['gb_per_s']:.1f} GB/s")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
