#!/usr/bin/python3
"""The original cube_torch package against cubetorchfs's legacy routes, as a user runs it.

The package is not part of this project: get its last version (the `aimagic/cube_torch`
directory of CubeFS at commit a402c9f6a, for example
`git -C cubefs archive a402c9f6a aimagic/cube_torch | tar -x -C /tmp/orig`) and pass the
directory that holds its `cube_torch/` with --package. It needs `requests` and `cv2`
(Debian: python3-requests, python3-opencv) and runs under Debian's torch 1.13.

One cold epoch of a torchvision ImageFolder (--classes x --per-class JPEGs of 96x96, ToTensor,
2 workers, batch 32, shuffle) through a fresh mount whose posix store adds --latency-us a
request, in a fresh process, each of:

  plain     no cube_torch
  prefetch  `import cube_torch` (the original): POST /prefetch/read/path, reads through FUSE
  batch     the same with USE_BATCH_DOWNLOAD=1: POST /batchdownload/path per batch, the
            workers' opens served from the reply

Every sample is checked against the local copy (each image's tensor sum). Per mode: the epoch,
the samples delivered, the FUSE reads and flushes, the daemon's hit/late/miss, its store
requests, and the package's own hit/miss counters. Medians over --rounds; the last line gives
batch / prefetch and prefetch / plain.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from benchlib import free_port, mounted  # noqa: E402
# Set by main() from the command line.
BENCH = Path("/tmp/cubetorchfs-legacy-bench")
DATA = BENCH / "data"  # backend.root; the ImageFolder is <mnt>/train
PACKAGE = Path()  # holds the original cube_torch/ package
BINARY = REPO / "build/bin/cubetorchfs"
CLASSES, PER_CLASS, SIDE = 15, 100, 96

# ----------------------------------------------------------------------------- dataset


def make_dataset() -> None:
    train = DATA / "train"
    done = DATA / ".complete"
    if done.exists():
        return
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(7)
    for c in range(CLASSES):
        d = train / f"class_{c:02d}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(PER_CLASS):
            arr = rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
            Image.fromarray(arr).save(d / f"img_{c:02d}_{i:04d}.jpg", quality=90)
    done.write_text("ok\n")


def reference_sums() -> list[float]:
    """Per-sample tensor sums, decoded from the local copy, in ImageFolder order."""
    cache = DATA / "reference_sums.json"
    if cache.exists():
        return json.loads(cache.read_text())
    import torchvision
    from torchvision import transforms
    ds = torchvision.datasets.ImageFolder(str(DATA / "train"), transform=transforms.ToTensor())
    sums = [float(ds[i][0].sum()) for i in range(len(ds))]
    cache.write_text(json.dumps(sums))
    return sums


# ----------------------------------------------------------------------------- the daemon


def pids_with_arg(arg: str) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                cmd = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if arg.encode() in cmd:
                out.append(int(p))
    return out


class Mount:
    def __init__(self, mode: str, latency_us: int) -> None:
        self.work = BENCH / "work" / f"{mode}-{int(time.time())}-{secrets.token_hex(2)}"
        self.mnt = self.work / "mnt"
        (self.work / "log").mkdir(parents=True)
        self.mnt.mkdir()
        self.mnt = Path(os.path.realpath(self.mnt))
        self.vol = f"legacy-{mode}-{secrets.token_hex(3)}"
        self.metrics_port = free_port()
        self.prof_port = free_port()
        while self.prof_port == self.metrics_port:
            self.prof_port = free_port()
        self.cfg = self.work / "config.json"
        self.control_file = Path(f"/tmp/cube_torch.config.{self.vol}")
        cfg = {
            "volName": self.vol,
            "mountPoint": str(self.mnt),
            "logDir": str(self.work / "log"),
            "logLevel": "info",
            "exporterPort": self.metrics_port,
            "profPort": str(self.prof_port),  # a string, as in the CubeFS client config
            "profile": "ai_prefetch",
            "backend": {"type": "posix", "root": str(DATA),
                        "inject": {"latency_us": latency_us}},
            "cache": {"memory_bytes": "256MiB"},
            "prefetch": {"control_socket": str(self.work / "ctl.sock")},
        }
        self.cfg.write_text(json.dumps(cfg, indent=2) + "\n")

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "CUBE_TORCH_CONFIG_DIR"}
        with open(self.work / "launch.out", "wb") as o, open(self.work / "launch.err", "wb") as e:
            rc = subprocess.run([str(BINARY), "-c", str(self.cfg), str(self.mnt)],
                                stdin=subprocess.DEVNULL, stdout=o, stderr=e, env=env,
                                timeout=60).returncode
        if rc != 0:
            raise RuntimeError(f"cubetorchfs exited {rc}: "
                               f"{(self.work / 'launch.err').read_text(errors='replace')}")
        deadline = time.monotonic() + 30
        while not (mounted(self.mnt) and self.control_file.exists()):
            if time.monotonic() > deadline:
                raise RuntimeError("mount/control file not ready in 30 s")
            time.sleep(0.05)

    def control(self) -> dict:
        return json.loads(self.control_file.read_text())

    def stop(self) -> None:
        pids = set(pids_with_arg(str(self.cfg)))
        if mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", str(self.mnt)], timeout=30,
                           capture_output=True)
        if mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], timeout=30,
                           capture_output=True)
        deadline = time.monotonic() + 15
        while [p for p in pids if Path(f"/proc/{p}").exists()] and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in pids:  # only the daemons started with this config path
            if Path(f"/proc/{p}").exists():
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if mounted(self.mnt):
            subprocess.run(["umount", "-l", str(self.mnt)], timeout=30, capture_output=True)


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def scrape(port: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in http_get(f"http://127.0.0.1:{port}/metrics").splitlines():
        if line.startswith("cubetorchfs_") and "_bucket" not in line:
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def metric_sum(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(prefix))


# ----------------------------------------------------------------------------- the epoch

CHILD = r"""
import json, os, sys, time
mode, root, result_file = sys.argv[1], sys.argv[2], sys.argv[3]
t_import = time.perf_counter()
if mode != "plain":
    import cube_torch                      # the original: patches DataLoader.__new__
import torch, torchvision
from torchvision import transforms
t_import = time.perf_counter() - t_import

class Indexed(torchvision.datasets.ImageFolder):
    # still a DatasetFolder (the original reads .samples); adds the index and the
    # worker's cube_torch hit/miss counters (batch mode) to each sample
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        h = m = -1
        mod = sys.modules.get("cube_torch.cube_file_open_interceptor")
        if mod is not None:
            c = mod.CubeFileOpenInterceptor
            h, m = c._last_cycle_hit_count + c.total_hit_count, c._last_cycle_miss_count + c.total_miss_count
        return x, y, i, os.getpid(), h, m   # the original's workers hide get_worker_info()

torch.manual_seed(1234)
t0 = time.perf_counter()
ds = Indexed(root, transform=transforms.ToTensor())
t_scan = time.perf_counter() - t0
t0 = time.perf_counter()
loader = torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True, num_workers=2)
t_ctor = time.perf_counter() - t0
sums, seen, worker_hm = {}, [], {}
t0 = time.perf_counter()
for x, y, idx, wid, h, m in loader:
    s = x.sum(dim=(1, 2, 3)).tolist()
    for k, i in enumerate(idx.tolist()):
        seen.append(i)
        sums[i] = s[k]
    for k, w in enumerate(wid.tolist()):
        old = worker_hm.get(w, (0, 0))
        worker_hm[w] = (max(old[0], int(h[k])), max(old[1], int(m[k])))
epoch = time.perf_counter() - t0
open(result_file, "w").write(json.dumps({"t_written": time.time(), "loader_class": type(loader).__module__ + "." + type(loader).__name__,
                  "import_s": t_import, "scan_s": t_scan, "ctor_s": t_ctor, "epoch_s": epoch,
                  "n": len(seen), "unique": len(set(seen)), "len": len(ds),
                  "sums": sums, "worker_hit_miss": worker_hm}))
print("epoch done", flush=True)
# a normal exit: the parent times it and kills what is left of this session afterwards
"""


def run_mode(mode: str, python: str, latency_us: int, ref: list[float]) -> dict:
    m = Mount(mode, latency_us)
    result: dict = {"mode": mode, "vol": m.vol, "work": str(m.work)}
    try:
        m.start()
        ctl = m.control()
        result["control_file"] = ctl
        before = scrape(m.metrics_port)
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "USE_PREFETCH", "USE_BATCH_DOWNLOAD",
                            "CUBE_TORCH_CONFIG_DIR")}
        if mode != "plain":
            env["PYTHONPATH"] = str(PACKAGE)  # the original cube_torch, only
            env["VOL_NAME"] = m.vol
            # check_evn() only requires DATASET_FILE to be an existing file; parse_dataset_file()
            # is never called. Give it the list of the dataset's paths anyway.
            listing = m.work / "dataset_file.txt"
            listing.write_text("".join(f"{m.mnt}/{p.relative_to(DATA)}\n"
                                       for p in sorted((DATA / "train").rglob("*.jpg"))))
            env["DATASET_FILE"] = str(listing)
            if mode == "batch":
                env["USE_BATCH_DOWNLOAD"] = "1"
            else:
                env["USE_PREFETCH"] = "1"  # the package sets it itself too
        t0 = time.perf_counter()
        rfile = m.work / "child.result.json"
        with open(m.work / "child.stdout", "w") as so, open(m.work / "child.stderr", "w") as se:
            proc = subprocess.Popen([python, "-c", CHILD, mode, str(m.mnt / "train"), str(rfile)],
                                    env=env, stdout=so, stderr=se, stdin=subprocess.DEVNULL,
                                    cwd=str(m.work), start_new_session=True)
            try:
                proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)   # the child's own session/group only
                proc.wait()
                result["error"] = "child timed out after 600 s"
        t_exit = time.time()
        result["child_wall_s"] = time.perf_counter() - t0
        result["child_rc"] = proc.returncode
        # processes the child left behind in its session (its own children), killed one by one
        left = []
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    if os.getsid(int(p)) == proc.pid:
                        left.append(int(p))
                except OSError:
                    pass
        result["leftover_pids"] = left
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if rfile.exists():
            r = json.loads(rfile.read_text())
            result["exit_after_epoch_s"] = t_exit - r.pop("t_written")
            sums = {int(k): v for k, v in r.pop("sums").items()}
            bad = [i for i, s in sums.items() if abs(s - ref[i]) > 1e-2 * max(1.0, abs(ref[i]))]
            r["content_mismatch"] = len(bad)
            result.update(r)
        else:
            result.setdefault("error", "no result file from child")
            result["stderr_tail"] = (m.work / "child.stderr").read_text(errors="replace")[-3000:]
        time.sleep(0.5)  # let the last async posts land before the scrape
        after = scrape(m.metrics_port)
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        result["metrics"] = {
            "fuse_read": d.get('cubetorchfs_fuse_ops_total{op="read"}', 0),
            "fuse_open": d.get('cubetorchfs_fuse_ops_total{op="open"}', 0),
            "fuse_lookup": d.get('cubetorchfs_fuse_ops_total{op="lookup"}', 0),
            "fuse_flush": d.get('cubetorchfs_fuse_ops_total{op="flush"}', 0),
            "reads_hit": d.get('cubetorchfs_reads_total{result="hit"}', 0),
            "reads_late": d.get('cubetorchfs_reads_total{result="late"}', 0),
            "reads_miss": d.get('cubetorchfs_reads_total{result="miss"}', 0),
            "prefetch_fetched": d.get('cubetorchfs_prefetch_files_total{outcome="fetched"}', 0),
            "prefetch_stored": d.get('cubetorchfs_prefetch_files_total{outcome="stored"}', 0),
            "backend_requests": metric_sum(d, "cubetorchfs_backend_requests_total"),
            "backend_read_req": metric_sum(d, 'cubetorchfs_backend_requests_total{op="read"'),
        }
        result["metrics_raw_delta"] = {k: v for k, v in d.items() if v}
        try:
            st = json.loads(http_get(f"http://127.0.0.1:{m.prof_port}/v1/stats"))
            g = st["global"]
            result["stats"] = {"reads": g.get("reads"), "files_batch": g.get("files_batch"),
                               "prefetch_fetched": g.get("prefetch", {}).get("fetched"),
                               "streams": [{k: s.get(k) for k in ("name", "published", "read",
                                                                   "page_cache", "skipped",
                                                                   "fetched", "reads")}
                                           for s in st.get("streams", [])]}
        except Exception as exc:  # noqa: BLE001
            result["stats_error"] = repr(exc)
        log = m.work / "log" / "cubetorchfs.log"
        if log.exists():
            result["log_warn_lines"] = [ln for ln in log.read_text(errors="replace").splitlines()
                                        if " warn" in ln.lower() or "error" in ln.lower()][-10:]
    finally:
        m.stop()
        result["clean_unmount"] = not mounted(m.mnt) and not pids_with_arg(str(m.cfg))
    return result


def main() -> int:
    global BENCH, DATA, PACKAGE, BINARY, CLASSES, PER_CLASS
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--package", required=True,
                    help="the directory holding the original package's cube_torch/")
    ap.add_argument("--modes", default="plain,prefetch,batch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--classes", type=int, default=15)
    ap.add_argument("--per-class", type=int, default=100)
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--latency-us", type=int, default=10000)
    ap.add_argument("--workdir", default="/tmp/cubetorchfs-legacy-bench")
    ap.add_argument("--bin", default=os.environ.get("CUBETORCHFS_BIN",
                                                   str(REPO / "build/bin/cubetorchfs")))
    a = ap.parse_args()
    PACKAGE = Path(a.package).resolve()
    if not (PACKAGE / "cube_torch" / "__init__.py").is_file():
        ap.error(f"--package {a.package}: no cube_torch/__init__.py there")
    BENCH, BINARY = Path(a.workdir), Path(a.bin)
    CLASSES, PER_CLASS = a.classes, a.per_class
    DATA = BENCH / f"data-{CLASSES}x{PER_CLASS}"
    BENCH.mkdir(parents=True, exist_ok=True)
    make_dataset()
    ref = reference_sums()
    results = []
    modes = a.modes.split(",")
    for rnd in range(a.rounds):
        for mode in modes:
            r = run_mode(mode, a.python, a.latency_us, ref)
            r["round"] = rnd + 1
            results.append(r)
            mt = r.get("metrics", {})
            print(f"round {rnd + 1} {mode:8s} epoch {r.get('epoch_s', float('nan')):6.2f} s, "
                  f"samples {r.get('n', '?')}/{r.get('len', '?')} "
                  f"(unique {r.get('unique', '?')}, wrong {r.get('content_mismatch', '?')}), "
                  f"FUSE reads {mt.get('fuse_read', 0):.0f} flushes {mt.get('fuse_flush', 0):.0f}, "
                  f"daemon hit/late/miss {mt.get('reads_hit', 0):.0f}/"
                  f"{mt.get('reads_late', 0):.0f}/{mt.get('reads_miss', 0):.0f}, "
                  f"store requests {mt.get('backend_requests', 0):.0f}, "
                  f"package hit/miss {r.get('worker_hit_miss')}"
                  + (f" ERROR {r['error']}" if "error" in r else ""), flush=True)
    out = BENCH / f"results-{int(time.time())}.json"
    out.write_text(json.dumps(results, indent=2))
    epochs = {m: statistics.median(r["epoch_s"] for r in results if r["mode"] == m
                                   and "epoch_s" in r) for m in modes
              if any(r["mode"] == m and "epoch_s" in r for r in results)}
    print(f"legacy_bench - {CLASSES * PER_CLASS} JPEGs, {a.latency_us} us a store request, "
          f"{a.rounds} rounds; median epoch: "
          + ", ".join(f"{m} {s:.2f} s" for m, s in epochs.items()))
    if "batch" in epochs and "prefetch" in epochs:
        print(f"speed batch / prefetch {epochs['prefetch'] / epochs['batch']:.2f} (target >= 1)"
              + (f", prefetch / plain {epochs['plain'] / epochs['prefetch']:.2f}"
                 if "plain" in epochs else ""))
    print(f"details: {out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
