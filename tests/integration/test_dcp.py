"""torch.distributed.checkpoint (DCP) through a real mount: `dcp.save` with `FileSystemWriter`
(`sync_files=True`, `thread_count` 1 and 4) and `dcp.load` with `FileSystemReader`, from 4
processes (torch.multiprocessing, gloo on the CPU) holding a sharded state dict: DTensors
sharded along dim 0 or 1 in float32/bfloat16/float16/float64/int64/uint8, a replicated tensor,
a scalar and a non-tensor object, of random bits (float exponents kept finite).

- Round trip: every tensor loads byte for byte in a fresh process group (new processes), from
  the mount and, over posix, straight from the store; 1 GiB over the posix backend.
- kill -9 of one writer in the middle of a save (it stops with half of its tensors written to
  its shard files, some still open, and is killed): the previous checkpoint, in another
  directory, still loads byte for byte; the new one has no `.metadata` and DCP refuses it on
  every rank; the daemon lives on and the mount keeps working. Over posix also the coordinator
  killed right after its rename of `.metadata.tmp` to `.metadata`: then the new checkpoint is
  whole and loads byte for byte.
- The same round trip and kill over the s3 backend (moto).
- The same over CubeFS's C SDK: tests/cubefs/test_dcp_cubefs.py runs the helpers here.

DCP itself rewrites the shard files of a directory in place (`open(..., "wb")`) before it
replaces `.metadata`, so a save killed in the directory of the previous checkpoint can leave its
old `.metadata` describing new bytes: every save here goes to a directory of its own, as
docs/writing.md says to.

The training processes run with the project venv's python (torch 2.x); this process needs no
torch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest

from cubefs_harness import (CubeFactory, CubeMount, bounded, environment_problem, pid_alive,
                            project_venv_problem, project_venv_python, wait_until)

_PROBLEM = environment_problem() or project_venv_problem("torch.distributed.checkpoint")
pytestmark = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")

MIB = 1 << 20
WORLD = 4
SPAWN_TIMEOUT_S = 120  # one run of the worker: 4 processes start, then their steps
MARKER_TIMEOUT_S = 90  # until the rank to kill has stopped in the middle of its save

# The training side: `python dcp_worker.py SPEC.json` (the project venv's python).
DCP_WORKER = r'''
"""Runs the spec's steps, in order, in one process group of WORLD processes (gloo, CPU).

  {"op": "save", "dir": D, "seed": S, "thread_count": T[, "kill": K]}
  {"op": "load", "dir": D, "seed": S}: result "equal" (every tensor byte for byte the state
      saved with seed S), "refused: <why>" (DCP raised) or "mismatch: <names>".
K = {"rank": R, "at": "shard" | "after_rename", "marker": PATH}: rank R stops in the middle of
the save (the thread about to write the rank's (half + 1)-th tensor item; or right after the
coordinator renamed .metadata.tmp to .metadata), writes its pid to PATH and waits for SIGKILL.
Rank 0 writes every rank's results to spec["result"] at the end.
"""
import hashlib, json, os, socket, sys, threading, time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

WORLD = 4
MIB = 1 << 20
COLS = 512
# name, dtype, share of a rank's bytes, the dimension it is sharded along
LAYOUT = [("layers.0.attn.weight", torch.float32, 0.25, 0),
          ("layers.0.mlp.weight", torch.bfloat16, 0.20, 0),
          ("layers.1.attn.weight", torch.float32, 0.15, 1),
          ("layers.1.mlp.weight", torch.float64, 0.12, 0),
          ("embed.ids", torch.int64, 0.10, 0),
          ("embed.weight", torch.float16, 0.08, 0),
          ("quant.codes", torch.uint8, 0.06, 1),
          ("norm.weight", torch.float32, 0.04, 0)]
# Random bits with the top exponent bit cleared: no NaN or infinity (their bits may change).
FINITE = {torch.float32: 0xBFFFFFFFBFFFFFFF, torch.bfloat16: 0xBFFFBFFFBFFFBFFF,
          torch.float16: 0xBBFFBBFFBBFFBBFF, torch.float64: 0xBFFFFFFFFFFFFFFF}


def random_bits(seed, name, rank, dtype, shape):
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    key = hashlib.sha256(repr((seed, name, rank)).encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key[:7], "little"))
    words = torch.empty((nbytes + 7) // 8, dtype=torch.int64).random_(generator=g)
    if dtype in FINITE:
        words.bitwise_and_(FINITE[dtype] - (1 << 64))
    return words.view(torch.uint8)[:nbytes].view(dtype).reshape(shape)


def state(mib, seed, rank, mesh, fill):
    per_rank = mib * MIB // WORLD
    model = {}
    for name, dtype, share, dim in LAYOUT:
        rows = max(1, int(per_rank * share) // (COLS * torch.empty((), dtype=dtype).element_size()))
        shape = (rows, COLS) if dim == 0 else (COLS, rows)
        local = (random_bits(seed, name, rank, dtype, shape) if fill
                 else torch.zeros(shape, dtype=dtype))
        model[name] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
    # Replicated on every rank (DCP writes one copy), a scalar and a non-tensor object.
    model["bias"] = (random_bits(seed, "bias", -1, torch.float32, (4096,)) if fill
                     else torch.zeros(4096))
    return {"model": model, "step": torch.tensor(seed * 1000 if fill else -1),
            "extra": {"seed": seed if fill else -1, "note": "via cubetorchfs" if fill else ""}}


def mismatches(mib, seed, rank, mesh, got):
    want = state(mib, seed, rank, mesh, True)
    bad = []
    for name, w in want["model"].items():
        g = got["model"][name]
        a = w.to_local() if isinstance(w, DTensor) else w
        b = g.to_local() if isinstance(g, DTensor) else g
        if (a.shape != b.shape or a.dtype != b.dtype or not torch.equal(
                a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))):
            bad.append(name)
    if not torch.equal(got["step"], want["step"]):
        bad.append("step")
    if got["extra"] != want["extra"]:
        bad.append("extra")
    return bad


def halt(kill, what):
    with open(kill["marker"] + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "at": what}, f)
    os.rename(kill["marker"] + ".tmp", kill["marker"])
    time.sleep(600)  # the test kills us long before
    os._exit(3)


def save(step, rank, sd):
    kill = step.get("kill")
    kill = kill if kill and kill["rank"] == rank else None
    write_item, rename = dcp_fs._write_item, dcp_fs.FileSystem.rename
    if kill and kill["at"] == "shard":
        lock, count, half = threading.Lock(), [0], len(LAYOUT) // 2

        def stopping_write_item(*args, **kwargs):
            with lock:
                count[0] += 1
                n = count[0]
            if n == half + 1:  # only this thread stops: the others go on writing
                halt(kill, f"shard, {half} items written")
            return write_item(*args, **kwargs)
        dcp_fs._write_item = stopping_write_item
    elif kill and kill["at"] == "after_rename":
        def stopping_rename(self, path, new_path):
            rename(self, path, new_path)
            halt(kill, "after the rename of .metadata")
        dcp_fs.FileSystem.rename = stopping_rename
    try:
        writer = dcp.FileSystemWriter(step["dir"], thread_count=step["thread_count"],
                                      sync_files=True)
        dcp.save(sd, storage_writer=writer)
    finally:
        dcp_fs._write_item, dcp_fs.FileSystem.rename = write_item, rename


def run_rank(rank, spec):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (WORLD,))
    results = []
    for step in spec["steps"]:
        start = time.monotonic()
        if step["op"] == "save":
            save(step, rank, state(spec["mib"], step["seed"], rank, mesh, True))
            result = "saved"
        else:
            got = state(spec["mib"], step["seed"], rank, mesh, False)
            try:
                dcp.load(got, storage_reader=dcp.FileSystemReader(step["dir"]))
            except (Exception, CheckpointException) as e:
                result = "refused: " + " ".join(str(e).split())[-240:]
            else:
                bad = mismatches(spec["mib"], step["seed"], rank, mesh, got)
                result = "mismatch: " + ", ".join(bad) if bad else "equal"
        dist.barrier()
        results.append({"op": step["op"], "dir": step["dir"], "result": result,
                        "seconds": round(time.monotonic() - start, 2)})
    every = [None] * WORLD
    dist.all_gather_object(every, results)
    if rank == 0:
        with open(spec["result"] + ".tmp", "w") as f:
            json.dump(every, f)
        os.rename(spec["result"] + ".tmp", spec["result"])
    dist.barrier()
    # Not destroy_process_group() and a normal exit: at exit gloo's threads sometimes abort the
    # process ("terminate called without an active exception") after all was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        spec["port"] = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(run_rank, args=(spec,), nprocs=WORLD, join=True)
'''


# --------------------------------------------------------------------------- the harness side


def save_step(directory: Path, seed: int, thread_count: int,
              kill: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    step: dict[str, Any] = {"op": "save", "dir": str(directory), "seed": seed,
                            "thread_count": thread_count}
    if kill:
        step["kill"] = kill
    return step


def load_step(directory: Path, seed: int) -> dict[str, Any]:
    return {"op": "load", "dir": str(directory), "seed": seed}


class Run:
    """One run of the worker (4 fresh processes, one process group): its per-rank results, or
    the pid and kill point of the rank that was killed -9 in the middle of a save."""

    def __init__(self, results: Optional[list[list[dict[str, Any]]]],
                 killed: Optional[dict[str, Any]], returncode: int, log: str) -> None:
        self.results, self.killed, self.returncode, self.log = results, killed, returncode, log

    def outcome(self, index: int) -> set[str]:
        """What the ranks got at step `index`: one entry when they agree."""
        assert self.results is not None
        return {ranks[index]["result"].split(":")[0] for ranks in self.results}

    def detail(self, index: int) -> list[str]:
        assert self.results is not None
        return [ranks[index]["result"] for ranks in self.results]


def run_dcp(work: Path, mib: int, steps: list[dict[str, Any]], name: str,
            timeout: float = SPAWN_TIMEOUT_S) -> Run:
    """Runs the steps in 4 new processes. When a save step has a kill point, waits (bounded)
    until that rank stops there, kills it with SIGKILL, and waits for the others to go (the
    launcher, torch.multiprocessing.spawn, ends them when one dies). Every process of the run
    is killed at the end whatever happened (they share the launcher's process group)."""
    work.mkdir(parents=True, exist_ok=True)
    script = work / "dcp_worker.py"
    if not script.exists():
        script.write_text(DCP_WORKER)
    result = work / f"{name}.result.json"
    spec = {"mib": mib, "steps": steps, "result": str(result)}
    (work / f"{name}.spec.json").write_text(json.dumps(spec))
    kills = [s["kill"] for s in steps if s.get("kill")]
    assert len(kills) <= 1, "one kill per run: the process group dies with it"
    marker = Path(kills[0]["marker"]) if kills else None
    log_path = work / f"{name}.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    killed = None
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(project_venv_python()), str(script),
                                 str(work / f"{name}.spec.json")], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, env=env, start_new_session=True)
    try:
        if marker is not None:
            def stopped() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"the run ended ({proc.returncode}) before the kill "
                                         f"point: {tail(log_path)}")
                return marker.exists()
            assert wait_until(stopped, MARKER_TIMEOUT_S, interval=0.02), \
                f"no rank reached the kill point in {MARKER_TIMEOUT_S} s: {tail(log_path)}"
            killed = json.loads(marker.read_text())
            assert pid_alive(killed["pid"])
            os.kill(killed["pid"], signal.SIGKILL)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"run {name} did not end in {timeout:.0f} s: {tail(log_path)}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group: every rank of this run
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    log_text = log_path.read_text(errors="replace")
    results = json.loads(result.read_text()) if result.exists() else None
    if killed is None:
        assert proc.returncode == 0 and results is not None, \
            f"run {name} failed ({proc.returncode}): {tail(log_path)}"
    else:
        assert results is None and proc.returncode != 0, \
            f"run {name} went on after its rank was killed: {tail(log_path)}"
        assert not pid_alive(killed["pid"])
    return Run(results, killed, proc.returncode, log_text)


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def assert_equal_loads(run: Run, indices: list[int]) -> None:
    for i in indices:
        assert run.outcome(i) == {"equal"}, (run.results[0][i]["dir"],  # type: ignore[index]
                                             run.detail(i))


def assert_whole_or_refused(run: Run, index: int, has_metadata: bool) -> None:
    """The new checkpoint is whole (loads byte for byte) when its .metadata exists, and is
    refused by DCP on every rank when it does not; never loaded with other bytes."""
    want = {"equal"} if has_metadata else {"refused"}
    assert run.outcome(index) == want, (has_metadata, run.detail(index))
    if not has_metadata:
        assert all(".metadata" in r for r in run.detail(index)), run.detail(index)


def checkpoint_files(listing: dict[str, int]) -> set[str]:
    return {n for n in listing if n.endswith(".distcp")}


def assert_complete(listing: dict[str, int], thread_count: int) -> None:
    """A finished save: .metadata, no .metadata.tmp, thread_count shard files per rank."""
    assert ".metadata" in listing and ".metadata.tmp" not in listing, sorted(listing)
    assert checkpoint_files(listing) == {f"__{r}_{t}.distcp" for r in range(WORLD)
                                         for t in range(thread_count)}, sorted(listing)


def listing(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in directory.iterdir()}


def assert_daemon_alive_and_serving(mount: CubeMount, probe: str) -> None:
    """The daemon survived the killed writer: same process, still mounted, reads and writes."""
    pid = mount.learn_pid()
    assert pid is not None and pid_alive(pid), "the daemon died"
    assert mount.is_mounted()
    data = os.urandom(MIB + 17)
    bounded(mount.path(probe).write_bytes, data, what="write after the kill")
    assert bounded(mount.path(probe).read_bytes, what="read after the kill") == data
    os.unlink(mount.path(probe))
    m = mount.metrics()
    assert m.value("cubetorchfs_backend_requests_total", status="error") == 0, \
        [s for s in m.samples if s[1].get("status") == "error" and s[2]]


def round_trip_and_kill(mount: CubeMount, work: Path, base: str, mib: int,
                        store_listing: Callable[[str], dict[str, int]],
                        store_root: Optional[Path] = None) -> None:
    """The whole scenario at `mib` MiB in one process group and then another: saves at
    thread_count 1 and 4 (the previous checkpoints), then a save into a third directory whose
    rank 2 is killed -9 with half of its tensors written; a fresh process group loads the first
    two byte for byte and is refused the third. `store_listing(rel)` lists a checkpoint
    directory in the store itself (not through the mount); with `store_root` (a store with a
    file interface), the thread_count 4 checkpoint is also loaded from there directly."""
    d1, d4 = mount.path(f"{base}/step1"), mount.path(f"{base}/step4")
    new = mount.path(f"{base}/step5")
    marker = work / "kill-shard.json"
    save_run = run_dcp(work, mib, [
        save_step(d1, 1, 1), save_step(d4, 4, 4),
        save_step(new, 5, 4, kill={"rank": 2, "at": "shard", "marker": str(marker)})], "save")
    assert save_run.killed is not None and save_run.killed["at"].startswith("shard")
    assert_daemon_alive_and_serving(mount, f"{base}/probe.bin")
    for rel, tc in ((f"{base}/step1", 1), (f"{base}/step4", 4)):
        assert_complete(listing(mount.path(rel)), tc)
        assert store_listing(rel) == listing(mount.path(rel)), rel
    stopped = listing(new)
    assert ".metadata" not in stopped and ".metadata" not in store_listing(f"{base}/step5")
    assert any(n.startswith("__2_") for n in stopped), sorted(stopped)  # rank 2 had begun

    loads = [load_step(d1, 1), load_step(d4, 4), load_step(new, 5)]
    if store_root is not None:
        loads.append(load_step(store_root / f"{base}/step4", 4))
    load_run = run_dcp(work, mib, loads, "load")
    assert_equal_loads(load_run, [0, 1] + ([3] if store_root is not None else []))
    assert_whole_or_refused(load_run, 2, has_metadata=False)
    assert_daemon_alive_and_serving(mount, f"{base}/probe2.bin")


# --------------------------------------------------------------------------- posix


def test_dcp_round_trip_1gib_posix(cube: CubeFactory, tmp_path: Path) -> None:
    """1 GiB in all, saved at thread_count 1 and at 4 (default profile), loaded by a fresh
    process group through the mount and straight from the store."""
    store = tmp_path / "store"
    store.mkdir()
    mount = cube.mount(store)
    work = tmp_path / "work"
    mib = 1024
    save_run = run_dcp(work, mib, [save_step(mount.path("ckpt/tc1"), 11, 1),
                                   save_step(mount.path("ckpt/tc4"), 14, 4)], "save")
    for tc in (1, 4):
        got = listing(mount.path(f"ckpt/tc{tc}"))
        assert_complete(got, tc)
        assert listing(store / f"ckpt/tc{tc}") == got
        assert sum(got.values()) > mib * MIB
    load_run = run_dcp(work, mib, [load_step(mount.path("ckpt/tc1"), 11),
                                   load_step(mount.path("ckpt/tc4"), 14),
                                   load_step(store / "ckpt/tc4", 14)], "load")
    assert_equal_loads(load_run, [0, 1, 2])
    steps = save_run.results[0] + load_run.results[0]  # type: ignore[index, operator]
    seconds = {s["dir"]: s["seconds"] for s in steps}
    print(f"1 GiB DCP through the mount, seconds per step (rank 0): {seconds}")


@pytest.mark.parametrize("profile", ["", "ai_prefetch"])
def test_dcp_kill_9_mid_save_posix(cube: CubeFactory, tmp_path: Path, profile: str) -> None:
    store = tmp_path / "store"
    store.mkdir()
    mount = cube.mount(store, {"profile": profile})
    round_trip_and_kill(mount, tmp_path / "work", "run", 256,
                        lambda rel: listing(store / rel), store_root=store)


def test_dcp_coordinator_killed_after_the_rename_leaves_a_whole_checkpoint(
        cube: CubeFactory, tmp_path: Path) -> None:
    """Rank 0 is killed -9 right after it renamed .metadata.tmp to .metadata (dcp.save has not
    returned): the checkpoint is whole and loads byte for byte in a fresh process group."""
    store = tmp_path / "store"
    store.mkdir()
    mount = cube.mount(store, {"profile": "ai_prefetch"})
    work = tmp_path / "work"
    marker = work / "kill-rename.json"
    run = run_dcp(work, 128, [save_step(mount.path("c/step2"), 2, 1, kill={
        "rank": 0, "at": "after_rename", "marker": str(marker)})], "save")
    assert run.killed is not None and "rename" in run.killed["at"]
    assert_daemon_alive_and_serving(mount, "probe.bin")
    got = listing(mount.path("c/step2"))
    assert_complete(got, 1)
    assert listing(store / "c/step2") == got
    load = run_dcp(work, 128, [load_step(mount.path("c/step2"), 2)], "load")
    assert_whole_or_refused(load, 0, has_metadata=True)


# --------------------------------------------------------------------------- s3


def _s3_problem() -> Optional[str]:
    from s3_testlib import s3_server_problem
    return s3_server_problem()


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    problem = _s3_problem()
    if problem:
        pytest.skip(problem)
    from s3_testlib import S3Server
    server = S3Server(tmp_path_factory.mktemp("s3"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


def s3_listing(server: Any, bucket: str, prefix: str) -> dict[str, int]:
    """Object sizes under prefix/ in the bucket (ListObjectsV2), by name below it."""
    client = server.client()
    try:
        status, body = client.request("GET", f"/{bucket}", query=f"list-type=2&prefix={prefix}%2F")
    finally:
        client.close()
    assert status == 200, body[:500]
    ns = {"s3": "http://s3.amazonaws.com/doc/2006-03-01/"}
    root = ET.fromstring(body)
    assert root.findtext("s3:IsTruncated", namespaces=ns) != "true"
    out = {}
    for item in root.findall("s3:Contents", ns):
        key = item.findtext("s3:Key", namespaces=ns) or ""
        name = key[len(prefix) + 1:]
        if name and "/" not in name:
            out[name] = int(item.findtext("s3:Size", namespaces=ns) or 0)
    return out


def test_dcp_round_trip_and_kill_9_s3(cube: CubeFactory, tmp_path: Path, s3: Any) -> None:
    """Over the s3 backend (moto), 128 MiB: shard files over multipart_bytes go up in parts;
    .metadata is renamed by copy + delete. The killed writer's partial shard is uploaded when
    the kernel closes its descriptors, and no staging file is left behind."""
    from s3_testlib import ACCESS_KEY, SECRET_KEY

    bucket = "dcp"
    client = s3.client()
    try:
        client.create_bucket(bucket)
    finally:
        client.close()
    staging = tmp_path / "staging"
    mount = cube.mount(tmp_path, {"profile": "ai_prefetch", "backend": {
        "type": "s3", "root": None, "endpoint": s3.endpoint, "bucket": bucket,
        "access_key": ACCESS_KEY, "secret_key": SECRET_KEY, "staging_dir": str(staging),
        "multipart_bytes": "8MiB"}})
    round_trip_and_kill(mount, tmp_path / "work", "run", 128,
                        lambda rel: s3_listing(s3, bucket, rel))
    assert wait_until(lambda: not any(staging.iterdir()), 10), \
        f"staging files left: {sorted(p.name for p in staging.iterdir())}"
