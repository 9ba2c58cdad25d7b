#!/usr/bin/python3
"""S3 epoch benchmark: epochs over a loopback S3 server, through FUSE mounts and AWS's connector.

  cubetorchfs  the s3 backend, profile ai_prefetch, with `import cube_torch` in the training
               process (PYTHONPATH=hooks; VOL_NAME and CUBE_TORCH_CONFIG_DIR find the daemon)
  cubetorchfs-nohook  the same mount without `import cube_torch`: what the daemon does alone,
               so the ratio of the two is the share due to prefetching
  s3fs         Debian's s3fs-fuse, with its local cache (-o use_cache=DIR)
  rclone       Debian's rclone, `rclone mount --vfs-cache-mode full`, an s3 remote (provider
               Other) configured through RCLONE_CONFIG_* environment variables
  s3torchconnector  AWS's PyTorch connector (PyPI s3torchconnector, the project venv), no mount:
               S3MapDataset.from_prefix over the bucket, shuffled by the DataLoader like the
               others; labels from the key's class directory, decode as ImageFolder's loader
  s3torchconnector-iter  S3IterableDataset.from_prefix(enable_sharding=True): the workers
               stream the bucket in listing order. It cannot shuffle an epoch (no random
               access), so it is shown, never used for a ratio

--epochs N runs N epochs in the same process (DataLoader workers restarted each epoch, as
usual), on the same mount: epoch 1 is cold, the next ones show what each system keeps.
Epoch 1's time includes the scan (ImageFolder's, or the connector's listing).

The data set (ImageFolder JPEGs of ~110 KB) is generated once and uploaded once, with SigV4
PUTs, into a bucket of moto's S3 server (from the project venv that scripts/install_deps.sh
makes) on 127.0.0.1; moto keeps objects in memory, so each run uploads them again. All three
systems talk to the server through a
small TCP proxy that delays every byte from client to server by --latency-ms (default 5 ms),
so each request costs the same extra round trip whichever system sends it.

Each measurement is one epoch (ImageFolder DataLoader, 2 workers, batch 64, shuffle) in a
fresh process, on a fresh mount with fresh, empty cache directories, after dropping the
kernel's page cache. Rounds alternate cubetorchfs, cubetorchfs-nohook, s3fs, rclone. Variants:
`raw` (the file bytes only; the default) and `decode` (PIL decode + RandomResizedCrop(112) +
ToTensor).

An epoch's time includes the ImageFolder scan (s3fs does a HEAD per file there): the user waits
for it too. Rates and ratios are given with the scan (the headline) and, labelled scan-free,
for the DataLoader loop alone.

--store-concurrency / --store-bandwidth add cubetorchfs-capped and cubetorchfs-nohook-capped:
the same mounts with the daemon's store requests capped (backend.inject.max_concurrency and
bandwidth_bytes_s). Only cubetorchfs is capped (s3fs and rclone are not), so a capped row
against a peer is a lower bound.

Prints a table (median and min-max samples/s per system) and a last line with the ratio of
cubetorchfs to the best peer, the target in docs/benchmarks.md ("S3 rows": >= 3).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from benchlib import (cpu_seconds, drop_caches, free_port, generate_jpegs, median_range,  # noqa: E402
                      mounted, parse_rate, port_answers, stop_process, unmount, venv_python,
                      vm_hwm_mib, wait_for, wait_for_ci)
SYSTEMS = ("cubetorchfs", "cubetorchfs-nohook", "s3fs", "rclone")
CONNECTORS = ("s3torchconnector", "s3torchconnector-iter")  # no mount; the project venv's python
CAPPED = ("cubetorchfs-capped", "cubetorchfs-nohook-capped")
PEERS = ("s3fs", "rclone")
MOUNT_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


def log(msg: str) -> None:
    print(f"[s3_bench] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- data


def generate(root: Path, files: int, classes: int) -> None:
    generate_jpegs(root, files, classes, "s3_bench")


def data_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.jpg") if p.is_file())


# --------------------------------------------------------------------------- uploads
# The S3 server and signed client of the integration tests (SigV4 by hand: moto does not check
# it, but the bench keeps its requests honest all the same).
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO / "tests" / "cubefs"))
from cluster import Cluster, cubefs_problem  # noqa: E402
from s3_testlib import ACCESS_KEY, SECRET_KEY, S3Client, S3Server, uri_encode  # noqa: E402

# The bucket and its keys: moto's by default; --store cubefs replaces them with the CubeFS
# cluster's (the epoch processes get them through CUBE_S3_BENCH_STORE).
STORE = json.loads(os.environ.get("CUBE_S3_BENCH_STORE", "null")) or {
    "name": "moto", "bucket": "bench", "access_key": ACCESS_KEY, "secret_key": SECRET_KEY,
    "region": "us-east-1", "create_bucket": True}


def client(port: int) -> S3Client:
    return S3Client(port, STORE["access_key"], STORE["secret_key"], STORE["region"])


def upload(port: int, data: Path, threads: int = 4) -> int:
    if STORE["create_bucket"]:
        c = client(port)
        try:
            status, body = c.request("PUT", f"/{STORE['bucket']}")
            if status != 200:
                raise RuntimeError(f"create bucket: HTTP {status} {body[:200]!r}")
        finally:
            c.close()
    files = data_files(data)
    done = [0]

    def put_share(share: list[Path]) -> None:
        c = client(port)
        try:
            for path in share:
                key = path.relative_to(data).as_posix()
                status, body = c.request("PUT", f"/{STORE['bucket']}/{key}", path.read_bytes())
                if status != 200:
                    raise RuntimeError(f"PUT {key}: HTTP {status} {body[:200]!r}")
                done[0] += 1
                if done[0] % 500 == 0:
                    print(f"\r[s3_bench] uploading: {done[0]}/{len(files)}", end="", file=sys.stderr, flush=True)
        finally:
            c.close()

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(put_share, files[i::threads]) for i in range(threads)]:
            f.result()
    print(file=sys.stderr)
    return len(files)


def count_objects(port: int) -> int:
    """Keys in the bucket, through signed ListObjectsV2 requests."""
    count, token = 0, ""
    conn = client(port)
    while True:
        query = "list-type=2&max-keys=1000" + (f"&continuation-token={uri_encode(token, False)}" if token else "")
        status, body = conn.request("GET", f"/{STORE['bucket']}", query=query)
        if status != 200:
            conn.close()
            raise RuntimeError(f"ListObjectsV2: HTTP {status} {body[:200]!r}")
        text = body.decode()
        count += len(re.findall(r"<Key>", text))
        m = re.search(r"<NextContinuationToken>([^<]+)</NextContinuationToken>", text)
        if not m or "<IsTruncated>true</IsTruncated>" not in text:
            conn.close()
            return count
        token = m.group(1)


def get_latency_ms(port: int, keys: list[str], n: int = 40) -> float:
    """Median wall time of one signed GET of a whole object on a kept-alive connection."""
    conn = client(port)
    times = []
    try:
        for key in keys[:n]:
            t = time.perf_counter()
            status, _ = conn.request("GET", f"/{STORE['bucket']}/{key}")
            times.append((time.perf_counter() - t) * 1000)
            if status != 200:
                raise RuntimeError(f"GET {key}: HTTP {status}")
    finally:
        conn.close()
    return statistics.median(times)


# --------------------------------------------------------------------------- processes


class LatencyProxy:
    """This script in --proxy mode, as a separate process (its own GIL and CPU accounting)."""

    def __init__(self, upstream_port: int, latency_ms: float) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--proxy", f"{self.port}:{upstream_port}:{latency_ms}"],
            stdin=subprocess.DEVNULL, start_new_session=True)
        if not wait_for(lambda: self.proc.poll() is not None or port_answers(self.port), 20):
            self.stop()
            raise RuntimeError("the latency proxy did not listen within 20 s")
        if self.proc.poll() is not None:
            raise RuntimeError(f"the latency proxy exited with {self.proc.returncode}")

    def stop(self) -> None:
        stop_process(self.proc, "latency proxy", log, STOP_TIMEOUT_S)


def run_proxy(spec: str) -> None:
    """Forwards 127.0.0.1:LISTEN to 127.0.0.1:UPSTREAM; bytes from client to server are held
    for DELAY_MS each (a pipe, not a queue: chunks in flight overlap), replies pass at once."""
    listen, upstream, delay_ms = spec.split(":")
    delay = float(delay_ms) / 1000

    async def delayed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            try:
                while True:
                    data = await reader.read(1 << 18)
                    queue.put_nowait((loop.time() + delay, data))
                    if not data:
                        return
            except (ConnectionError, OSError):
                queue.put_nowait((0.0, b""))

        task = loop.create_task(pump())
        try:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    break
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            task.cancel()
            writer.close()

    async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 18):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle(creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            ureader, uwriter = await asyncio.open_connection("127.0.0.1", int(upstream))
        except OSError:
            cwriter.close()
            return
        for w in (cwriter, uwriter):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(delayed(creader, uwriter), plain(ureader, cwriter), return_exceptions=True)

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", int(listen), backlog=1024, reuse_address=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with server:
            await stop.wait()

    asyncio.run(main())


# --------------------------------------------------------------------------- the mounts


class Mount:
    """A fresh mount of the bucket at work/mnt with fresh cache directories under work/."""

    name = ""

    def __init__(self, work: Path, endpoint: str, args: argparse.Namespace) -> None:
        self.work = work
        self.endpoint = endpoint
        self.args = args
        self.mnt = work / "mnt"
        self.mnt.mkdir(parents=True)
        self.env = dict(os.environ)
        self.proc: Optional[subprocess.Popen] = None
        self.pid: Optional[int] = None
        self.hook = False

    def _start(self, cmd: list[str], env: dict[str, str]) -> None:
        with open(self.work / f"{self.name}.log", "ab") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                         start_new_session=True)
        self.pid = self.proc.pid
        if not wait_for(lambda: self.proc.poll() is not None or mounted(self.mnt), MOUNT_TIMEOUT_S, 0.1):
            raise RuntimeError(f"{self.name} did not mount within {MOUNT_TIMEOUT_S:.0f} s: {self.log_tail()}")
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log_tail()}")

    def log_tail(self) -> str:
        try:
            lines = (self.work / f"{self.name}.log").read_text(errors="replace").strip().splitlines()
            return " | ".join(lines[-3:]) or "(no output)"
        except OSError:
            return "(no log)"

    def extra(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        unmount(self.mnt, log)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                stop_process(self.proc, self.name, log, STOP_TIMEOUT_S)
        elif self.pid is not None:
            wait_for(lambda: not Path(f"/proc/{self.pid}").exists(), STOP_TIMEOUT_S)
            if Path(f"/proc/{self.pid}").exists():
                log(f"{self.name} pid {self.pid} still alive after unmount; killing it")
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


class CubeMount(Mount):
    name = "cubetorchfs"

    def __init__(self, work: Path, endpoint: str, args: argparse.Namespace, hook: bool = True,
                 capped: bool = False) -> None:
        super().__init__(work, endpoint, args)
        self.hook = hook
        self.port = free_port()
        self.vol = f"s3bench{os.getpid()}"
        self.env.update(CUBE_TORCH_CONFIG_DIR=str(work), VOL_NAME=self.vol)
        config = {
            "volName": self.vol, "mountPoint": str(self.mnt), "logDir": str(work / "log"),
            "exporterPort": self.port, "profile": "ai_prefetch",
            "backend": {"type": "s3", "endpoint": endpoint, "bucket": STORE["bucket"],
                        "access_key": STORE["access_key"], "secret_key": STORE["secret_key"]},
            "cache": {"memory_bytes": args.memory_bytes},
            "prefetch": {"control_socket": f"/run/cubetorchfs/{self.vol}.sock"},
        }
        if capped:
            inject = {}
            if args.store_concurrency:
                inject["max_concurrency"] = args.store_concurrency
            if args.store_bandwidth:
                inject["bandwidth_bytes_s"] = args.store_bandwidth
            config["backend"]["inject"] = inject
        (work / "config.json").write_text(json.dumps(config))
        out = subprocess.run([args.bin, "-c", str(work / "config.json")], env=self.env,
                             capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S)
        if out.returncode != 0:
            raise RuntimeError(f"cubetorchfs exited with {out.returncode}: {(out.stderr or out.stdout).strip()}")
        self.pid = json.loads((work / f"cube_torch.config.{self.vol}").read_text())["pid"]
        if not mounted(self.mnt):
            raise RuntimeError("cubetorchfs returned 0 but nothing is mounted")

    def extra(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
        reads = {m.group(1): float(m.group(2))
                 for m in re.finditer(r'^cubetorchfs_reads_total\{result="(\w+)"\} (\S+)$', text, re.M)}
        missing = [k for k in ("hit", "late", "miss") if k not in reads]
        if missing:
            raise RuntimeError(f"no cubetorchfs_reads_total sample for {', '.join(missing)} in /metrics: "
                               "cannot compute the hit ratio")
        total = sum(reads[k] for k in ("hit", "late", "miss"))
        if total == 0:
            raise RuntimeError("cubetorchfs_reads_total is 0 after an epoch: no read reached the daemon")
        frac = {k: reads[k] / total for k in ("hit", "late", "miss")}
        return {"hit_ratio": frac["hit"], "late_ratio": frac["late"], "miss_ratio": frac["miss"],
                "rss_mib": vm_hwm_mib(self.pid)}


class S3fsMount(Mount):
    name = "s3fs"

    def __init__(self, work: Path, endpoint: str, args: argparse.Namespace) -> None:
        super().__init__(work, endpoint, args)
        if shutil.which("s3fs") is None:
            raise RuntimeError("s3fs is not installed (Debian package s3fs; scripts/install_deps.sh)")
        cache = work / "cache"
        cache.mkdir()
        passwd = work / "passwd-s3fs"
        passwd.write_text(f"{STORE['access_key']}:{STORE['secret_key']}\n")
        passwd.chmod(0o600)
        opts = [f"use_cache={cache}", f"url={endpoint}", "use_path_request_style",
                f"passwd_file={passwd}", "ro", "endpoint=" + STORE["region"]]
        self._start(["s3fs", STORE["bucket"], str(self.mnt), "-f", "-o", ",".join(opts)], self.env)


class RcloneMount(Mount):
    name = "rclone"

    def __init__(self, work: Path, endpoint: str, args: argparse.Namespace) -> None:
        super().__init__(work, endpoint, args)
        if shutil.which("rclone") is None:
            raise RuntimeError("rclone is not installed (Debian package rclone; scripts/install_deps.sh)")
        # rclone's AWS SDK fails on AWS_CA_BUNDLE ("unable to load custom CA bundle, HTTPClient's
        # transport unsupported type"); the endpoint is plain http, so it is not needed.
        env = {k: v for k, v in self.env.items() if k != "AWS_CA_BUNDLE"}
        env.update(RCLONE_CONFIG_S3BENCH_TYPE="s3", RCLONE_CONFIG_S3BENCH_PROVIDER="Other",
                   RCLONE_CONFIG_S3BENCH_ENDPOINT=endpoint, RCLONE_CONFIG_S3BENCH_REGION=STORE["region"],
                   RCLONE_CONFIG_S3BENCH_ACCESS_KEY_ID=STORE["access_key"],
                   RCLONE_CONFIG_S3BENCH_SECRET_ACCESS_KEY=STORE["secret_key"],
                   RCLONE_CONFIG_S3BENCH_FORCE_PATH_STYLE="true")
        self._start(["rclone", "mount", f"s3bench:{STORE['bucket']}", str(self.mnt), "--vfs-cache-mode", "full",
                     "--cache-dir", str(work / "cache"), "--read-only",
                     "--config", str(work / "rclone.conf")],  # absent: only the environment counts
                    env)


class NoMount(Mount):
    """The connector rows: nothing is mounted; the epoch reads the bucket itself."""

    def __init__(self, work: Path, endpoint: str, args: argparse.Namespace, name: str) -> None:
        super().__init__(work, endpoint, args)
        self.name = name
        self.pid = None

    def close(self) -> None:
        pass


def make_mount(system: str, work: Path, endpoint: str, args: argparse.Namespace) -> Mount:
    if system in CONNECTORS:
        return NoMount(work, endpoint, args, system)
    if system.startswith("cubetorchfs"):
        return CubeMount(work, endpoint, args, hook="-nohook" not in system,
                         capped=system.endswith("-capped"))
    if system == "s3fs":
        return S3fsMount(work, endpoint, args)
    if system == "rclone":
        return RcloneMount(work, endpoint, args)
    raise ValueError(system)


# --------------------------------------------------------------------------- one epoch


class _Decode:
    """S3 object -> (sample, label), as ImageFolder would give for the same file; picklable
    for the DataLoader's workers."""

    def __init__(self, variant: str) -> None:
        self.variant = variant
        self.tf = None

    def __call__(self, obj):
        label = int(obj.key.split("/")[0].rsplit("_", 1)[1])  # class_NNN/img_*.jpg
        data = obj.read()
        if self.variant != "decode":
            return data, label
        import io
        from PIL import Image
        from torchvision import transforms
        if self.tf is None:
            self.tf = transforms.Compose([transforms.RandomResizedCrop(112), transforms.ToTensor()])
        return self.tf(Image.open(io.BytesIO(data)).convert("RGB")), label


def child(args: argparse.Namespace) -> None:
    """--epochs epochs, in their own process; prints a JSON line."""
    if args.hook:
        import cube_torch  # noqa: F401  (PYTHONPATH=hooks; patches DataLoader iteration)
    import torch
    import torchvision
    from torchvision import transforms

    torch.manual_seed(0)
    scan_start = time.monotonic()
    shuffle = True
    if args.connector:
        os.environ.update(AWS_ACCESS_KEY_ID=STORE["access_key"], AWS_SECRET_ACCESS_KEY=STORE["secret_key"])
        from s3torchconnector import S3ClientConfig, S3IterableDataset, S3MapDataset
        kind = S3MapDataset if args.connector == "s3torchconnector" else S3IterableDataset
        extra = {} if kind is S3MapDataset else {"enable_sharding": True}
        ds = kind.from_prefix(f"s3://{STORE['bucket']}/", region=STORE["region"], endpoint=args.child,
                              transform=_Decode(args.variant),
                              s3client_config=S3ClientConfig(force_path_style=True), **extra)
        if kind is S3MapDataset:
            len(ds)  # lists the bucket: its scan
        else:
            shuffle = False
    elif args.variant == "decode":
        ds = torchvision.datasets.ImageFolder(args.child, transform=transforms.Compose(
            [transforms.RandomResizedCrop(112), transforms.ToTensor()]))
    else:
        ds = torchvision.datasets.ImageFolder(args.child, loader=lambda p: open(p, "rb").read())
    scan = time.monotonic() - scan_start
    loader = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=shuffle, num_workers=2,
                                         collate_fn=None if args.variant == "decode" else list)
    epochs = []
    for _ in range(args.epochs):
        start = time.monotonic()
        n = nbytes = 0
        for batch in loader:
            if args.variant == "decode":
                n += len(batch[0])
            else:
                n += len(batch)
                nbytes += sum(len(data) for data, _ in batch)
        epochs.append({"samples": n, "bytes": nbytes, "seconds": time.monotonic() - start})
    first = epochs[0]
    print(json.dumps({"samples": first["samples"], "bytes": first["bytes"],
                      "seconds": first["seconds"], "scan_seconds": scan, "epochs": epochs}))


def child_python() -> str:
    """The project venv's python (torch 2.x, s3torchconnector) when it exists: every system's
    epoch runs under the same interpreter."""
    return venv_python() or sys.executable


def epoch(m: Mount, variant: str, timeout: float, epochs: int = 1) -> dict:
    target = m.endpoint if isinstance(m, NoMount) else str(m.mnt)
    cmd = [child_python(), __file__, "--child", target, "--variant", variant,
           "--epochs", str(epochs)]
    if isinstance(m, NoMount):
        cmd += ["--connector", m.name]
    env = dict(m.env)
    if m.hook:
        cmd.append("--hook")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "hooks"), env.get("PYTHONPATH")]))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode != 0:
        tail = " | ".join(out.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"epoch exited with {out.returncode}: {tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- main


class _Cluster:
    """The CubeFS cluster where s3_bench expects an S3Server: port, proc (for CPU: the
    ObjectNode's is not ours to count, so none) and stop()."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.port = cluster.s3_port
        self.proc = None

    def stop(self) -> None:
        self.cluster.stop()


def cpu_now(m: Mount, server, proxy: Optional[LatencyProxy]) -> tuple[float, float, float]:
    """CPU seconds so far of the mount's process, the S3 server's and the proxy's (each with its
    waited-for children; nan when gone or not ours, 0 without a proxy)."""
    def cpu(pid: Optional[int]) -> float:
        return cpu_seconds(pid, children=True, missing=float("nan"))
    return cpu(m.pid), cpu(server.proc.pid if server.proc else None), cpu(proxy.proc.pid) if proxy else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=3000)
    p.add_argument("--classes", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--latency-ms", type=float, default=5.0,
                   help="added to every request by a proxy in front of the S3 server (0: no proxy)")
    p.add_argument("--variants", nargs="+", default=["raw"], choices=["raw", "decode"])
    p.add_argument("--decode", action="store_true", help="also run the decode variant")
    p.add_argument("--store", choices=["moto", "cubefs"], default="moto",
                   help="the S3 server: moto's (default), or the ObjectNode of a loopback CubeFS "
                        "cluster (../shared/cubefs/cluster.sh; the bucket is its volume)")
    p.add_argument("--epochs", type=int, default=1, help="epochs per measurement, in one process "
                   "on one mount (default 1; 2 shows what each system keeps)")
    p.add_argument("--systems", nargs="+", default=None,
                   choices=list(SYSTEMS) + list(CAPPED) + list(CONNECTORS),
                   help="default: all of " + ", ".join(SYSTEMS) + ", and the capped ones with a cap")
    p.add_argument("--store-concurrency", type=int, default=0, metavar="N",
                   help="cap of the -capped cubetorchfs rows: store requests at once (e.g. 64)")
    p.add_argument("--store-bandwidth", type=parse_rate, default=0, metavar="BYTES/S",
                   help="cap of the -capped cubetorchfs rows: bytes/s from the store, all requests "
                        "together (e.g. 1e9 or 1GB/s)")
    p.add_argument("--memory-bytes", default="4GiB", help="cubetorchfs cache.memory_bytes")
    p.add_argument("--epoch-timeout", type=float, default=600.0, help="seconds one epoch may take")
    p.add_argument("--workdir", default="/tmp/cubetorchfs-s3-bench")
    p.add_argument("--wait-for-log", default="/tmp/ci.log",
                   help="if this file exists, wait (up to 20 min) for a line starting with rc= first")
    p.add_argument("--bin", default=os.environ.get("CUBETORCHFS_BIN", str(REPO / "build/bin/cubetorchfs")))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="raw", help=argparse.SUPPRESS)
    p.add_argument("--hook", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--proxy", help=argparse.SUPPRESS)
    p.add_argument("--connector", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.proxy:
        run_proxy(args.proxy)
        return
    if args.child:
        child(args)
        return
    variants = list(dict.fromkeys(args.variants + (["decode"] if args.decode else [])))
    has_cap = bool(args.store_concurrency or args.store_bandwidth)
    if args.systems is None:
        args.systems = list(SYSTEMS) + (list(CAPPED) if has_cap else [])
    if any(s in CAPPED for s in args.systems) and not has_cap:
        p.error("the -capped systems need --store-concurrency or --store-bandwidth")
    cap_text = (f"{args.store_concurrency or 'unlimited'} requests at once, "
                + (f"{args.store_bandwidth / 1e9:g} GB/s" if args.store_bandwidth else "unlimited bytes/s"))

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / "data"
    generate(data, args.files, args.classes)
    files = data_files(data)
    total_bytes = sum(f.stat().st_size for f in files)

    server: Optional[S3Server] = None
    proxy: Optional[LatencyProxy] = None
    latency: dict[str, float] = {}
    results: dict[tuple[str, str], list[dict]] = {}
    failures: dict[tuple[str, str], list[str]] = {}
    try:
        if args.store == "cubefs":
            problem = cubefs_problem()
            if problem:
                raise SystemExit(f"s3_bench --store cubefs: {problem}")
            cluster = Cluster().start()
            STORE.update(name="CubeFS ObjectNode", bucket=cluster.bucket,
                         access_key=cluster.env["CUBEFS_ACCESS_KEY"],
                         secret_key=cluster.env["CUBEFS_SECRET_KEY"], region="cfs_dev",
                         create_bucket=False)
            os.environ["CUBE_S3_BENCH_STORE"] = json.dumps(STORE)
            server = _Cluster(cluster)
        else:
            server = S3Server(workdir / "s3").start()
        t = time.monotonic()
        n = upload(server.port, data)
        log(f"uploaded {n} objects ({total_bytes / 1e6:.0f} MB) in {time.monotonic() - t:.0f} s")
        keys = count_objects(server.port)
        if keys != len(files):
            raise RuntimeError(f"the bucket holds {keys} keys, not {len(files)}")
        endpoint = f"http://127.0.0.1:{server.port}"
        sample = [f.relative_to(data).as_posix() for f in files[:: max(1, len(files) // 40)]]
        latency = {"direct": get_latency_ms(server.port, sample)}
        if args.latency_ms > 0:
            proxy = LatencyProxy(server.port, args.latency_ms)
            endpoint = f"http://127.0.0.1:{proxy.port}"
            latency["proxy"] = get_latency_ms(proxy.port, sample)
        log("store latency, median of 40 sequential GETs of a whole object: " +
            ", ".join(f"{k} {v:.1f} ms" for k, v in latency.items()))
        wait_for_ci(Path(args.wait_for_log), 1200, log)

        for variant in variants:
            for r in range(args.rounds):
                for system in args.systems:
                    work = Path(tempfile.mkdtemp(prefix=f"{system}-", dir=workdir))
                    m: Optional[Mount] = None
                    try:
                        m = make_mount(system, work, endpoint, args)
                        drop_caches(log, sync_timeout=120)
                        cpu0 = cpu_now(m, server, proxy)
                        res = epoch(m, variant, args.epoch_timeout * args.epochs, args.epochs)
                        cpu1 = cpu_now(m, server, proxy)
                        for k, ep in enumerate(res["epochs"], 1):
                            if ep["samples"] != len(files):
                                raise RuntimeError(f"epoch {k} read {ep['samples']} samples, not {len(files)}")
                            if variant == "raw" and ep["bytes"] != total_bytes:
                                raise RuntimeError(f"epoch {k} read {ep['bytes']} bytes, not {total_bytes}")
                        res["epoch_rates"] = [len(files) / (ep["seconds"] + (res["scan_seconds"] if k == 0 else 0))
                                              for k, ep in enumerate(res["epochs"])]
                        res.update(rate=res["samples"] / (res["scan_seconds"] + res["seconds"]),
                                   loop_rate=res["samples"] / res["seconds"], mount_cpu=cpu1[0] - cpu0[0],
                                   server_cpu=cpu1[1] - cpu0[1], proxy_cpu=cpu1[2] - cpu0[2], **m.extra())
                        results.setdefault((variant, system), []).append(res)
                        log(f"{variant} round {r + 1}: {system:12} {res['rate']:7.0f} samples/s "
                            f"(scan-free {res['loop_rate']:.0f}; loop {res['seconds']:.1f} s; "
                            f"scan {res['scan_seconds']:.1f} s; CPU: mount "
                            f"{res['mount_cpu']:.1f} s, S3 server {res['server_cpu']:.1f} s, proxy {res['proxy_cpu']:.1f} s)"
                            + (f"; epochs 2+: {', '.join(f'{r:.0f}' for r in res['epoch_rates'][1:])} samples/s"
                               if args.epochs > 1 else "")
                            + (f"; reads: hit {res['hit_ratio']:.3f}, late {res['late_ratio']:.3f}, "
                               f"miss {res['miss_ratio']:.3f}" if "hit_ratio" in res else ""))
                    except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as e:
                        reason = f"{type(e).__name__}: {e}"
                        if m is not None and not isinstance(e, subprocess.TimeoutExpired):
                            reason += f" [log: {m.log_tail()}]"
                        failures.setdefault((variant, system), []).append(reason)
                        log(f"{variant} round {r + 1}: {system} FAILED: {reason}")
                    finally:
                        if m is not None:
                            m.close()
                        elif mounted(work / "mnt"):
                            unmount(work / "mnt", log)
                        if not mounted(work / "mnt"):
                            shutil.rmtree(work, ignore_errors=True)
    finally:
        if proxy is not None:
            proxy.stop()
        if server is not None:
            server.stop()

    lat = f"+{args.latency_ms:g} ms per request" if args.latency_ms > 0 else "no added latency"
    lat += "; a GET of a whole object took " + ", ".join(
        f"{v:.1f} ms {'through the proxy' if k == 'proxy' else 'direct'}" for k, v in latency.items())
    print(f"s3_bench (cold; loopback {STORE['name']}, {lat}) - nproc {os.cpu_count()}, {len(files)} JPEGs "
          f"({total_bytes / 1e6:.0f} MB), 2 workers, batch 64, {args.rounds} rounds, median (min-max); "
          f"samples/s include the ImageFolder scan, scan-free is the DataLoader loop alone")
    if has_cap:
        print(f"-capped rows: cubetorchfs's store requests capped at {cap_text} (peers uncapped)")
    print(f"{'variant':8} {'system':26} {'samples/s':>10} {'min-max':>15} {'scan s':>7} {'scan-free':>10} "
          f"{'mount CPU s':>12} {'server CPU s':>13}")
    for variant in variants:
        for system in args.systems:
            rs = results.get((variant, system), [])
            fails = failures.get((variant, system), [])
            if rs:
                med, lo, hi = median_range([x["rate"] for x in rs])
                print(f"{variant:8} {system:26} {med:>10.0f} {lo:>7.0f}-{hi:<7.0f} "
                      f"{statistics.median(x['scan_seconds'] for x in rs):>7.2f} "
                      f"{statistics.median(x['loop_rate'] for x in rs):>10.0f} "
                      f"{statistics.median(x['mount_cpu'] for x in rs):>12.1f} "
                      f"{statistics.median(x['server_cpu'] for x in rs):>13.1f}"
                      + "".join(f"  epoch {k + 1}: {statistics.median(x['epoch_rates'][k] for x in rs):.0f}"
                                f" ({min(x['epoch_rates'][k] for x in rs):.0f}-"
                                f"{max(x['epoch_rates'][k] for x in rs):.0f})"
                                for k in range(1, args.epochs))
                      + (f"  ({len(fails)} failed)" if fails else ""))
            else:
                print(f"{variant:8} {system:26} {'failed':>10}  {fails[0] if fails else 'not run'}")
    for name in ("cubetorchfs", "cubetorchfs-capped"):
        cube = [x for v in variants for x in results.get((v, name), []) if "hit_ratio" in x]
        if cube:
            print(f"{name}: hit ratio min {min(x['hit_ratio'] for x in cube):.3f} "
                  f"median {statistics.median(x['hit_ratio'] for x in cube):.3f}; daemon VmHWM max "
                  f"{max(x['rss_mib'] for x in cube):.0f} MiB (budget {args.memory_bytes} + 64 MiB)")

    def med(variant: str, system: str, key: str) -> Optional[float]:
        rs = results.get((variant, system), [])
        return statistics.median(x[key] for x in rs) if rs and system in args.systems else None

    def best_peer(variant: str, key: str) -> tuple[Optional[str], Optional[float]]:
        peers = {s: med(variant, s, key) for s in PEERS}
        peers = {s: v for s, v in peers.items() if v is not None}
        if not peers:
            return None, None
        best = max(peers, key=peers.get)
        return best, peers[best]

    def ratio_text(a: Optional[float], b: Optional[float]) -> str:
        return f"{a / b:.2f}" if a is not None and b else "n/a"

    headline = None
    for variant in variants:
        for cube, nohook in (("cubetorchfs", "cubetorchfs-nohook"),
                             ("cubetorchfs-capped", "cubetorchfs-nohook-capped")):
            if cube not in args.systems and nohook not in args.systems:
                continue
            peer, peer_rate = best_peer(variant, "rate")
            peer_free, peer_free_rate = best_peer(variant, "loop_rate")
            vs_peer = ratio_text(med(variant, cube, "rate"), peer_rate)
            vs_peer_free = ratio_text(med(variant, cube, "loop_rate"), peer_free_rate)
            print(f"{variant}: {cube} / best peer ({peer or 'none'}) = {vs_peer} "
                  f"[scan-free: {vs_peer_free}, best peer {peer_free or 'none'}]; "
                  f"{cube} / {nohook} (the share due to prefetching) = "
                  f"{ratio_text(med(variant, cube, 'rate'), med(variant, nohook, 'rate'))} "
                  f"[scan-free: {ratio_text(med(variant, cube, 'loop_rate'), med(variant, nohook, 'loop_rate'))}]")
            if headline is None and cube == "cubetorchfs":
                headline = (vs_peer, vs_peer_free, peer, ratio_text(
                    med(variant, cube, "rate"), med(variant, nohook, "rate")))
    if headline is None:
        headline = ("n/a", "n/a", None, "n/a")
    if "s3torchconnector" in args.systems and "cubetorchfs" in args.systems:
        for variant in variants:
            cube = results.get((variant, "cubetorchfs"), [])
            conn = results.get((variant, "s3torchconnector"), [])
            if cube and conn:
                parts = []
                for k in range(args.epochs):
                    a = statistics.median(x["epoch_rates"][k] for x in cube)
                    b = statistics.median(x["epoch_rates"][k] for x in conn)
                    parts.append(f"epoch {k + 1} {a / b:.2f} ({a:.0f} vs {b:.0f} samples/s)")
                print(f"{variant}: cubetorchfs / s3torchconnector: {'; '.join(parts)} "
                      "(targets: epoch 1 >= 2, epoch 2 >= 5)")
    print(f"ratio: cubetorchfs / best peer = {headline[0]} with the scan (scan-free {headline[1]}; "
          f"best peer {headline[2] or 'none'}) (target >= 3); hook / no hook = {headline[3]}")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
