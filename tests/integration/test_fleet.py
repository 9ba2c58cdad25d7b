"""Operating a mount as a fleet would: upgrades and crashes of the daemon under a training loop
(a real DataLoader with `import cube_torch`, in its own process), `cubetorchfs status` and
/healthz. The store is a posix directory with latency added to every request."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from cubefs_harness import (BINARY, CubeFactory, CubeMount, environment_problem, pid_alive,
                            run_command, wait_until)

pytestmark = pytest.mark.skipif(environment_problem() is not None,
                                reason=environment_problem() or "")

REPO = Path(__file__).resolve().parents[2]
FILES = 480
BATCH = 8
SCRIPT_TIMEOUT_S = 240

TRAIN = """
import hashlib, json, os, sys, time
import cube_torch
import torch, torchvision

root, progress, epochs, pause = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])

def digest(path):
    # A loop that skips a failed sample: the error is recorded, training goes on. With
    # FLEET_UNMODIFIED=1 the loop has no such care: an error reaches it and ends it.
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        if os.environ.get("FLEET_UNMODIFIED") == "1":
            raise
        return "error:" + os.strerror(e.errno)

ds = torchvision.datasets.ImageFolder(root, loader=digest, is_valid_file=lambda p: True)
loader = torch.utils.data.DataLoader(ds, batch_size=%d, shuffle=True, num_workers=2,
                                     collate_fn=lambda b: b)
out, batches = [], 0
for epoch in range(epochs):
    before = cube_torch.stats()
    for batch in loader:
        for (sha, label) in batch:
            out.append([epoch, sha])
        batches += 1
        with open(progress, "w") as f:
            f.write(str(batches))
        time.sleep(pause)
    after = cube_torch.stats()
    out.append([epoch, {"before": before, "after": after}])
paths = [p for p, _ in ds.samples]
print(json.dumps({"samples": out, "paths": paths}))
""" % BATCH


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fleet") / "store"
    digests = {}
    for i in range(FILES):
        d = root / "train" / f"class_{i % 5}"
        d.mkdir(parents=True, exist_ok=True)
        data = os.urandom(20_000 + i)
        (d / f"s{i:04d}.bin").write_bytes(data)
        digests[hashlib.sha256(data).hexdigest()] = i
    return {"root": root, "digests": digests}


def start_training(mount: CubeMount, workdir: Path, epochs: int, pause: float,
                   **extra_env: str) -> tuple[subprocess.Popen[str], Path]:
    progress = workdir / f"progress.{time.monotonic_ns()}"
    progress.write_text("0")
    env = dict(mount.env(), VOL_NAME=mount.vol_name, PYTHONPATH=str(REPO / "hooks"),
               CUBE_TORCH_LOOKAHEAD_BATCHES="4", **extra_env)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(TRAIN),
                             str(mount.path("train")), str(progress), str(epochs), str(pause)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, progress


@contextlib.contextmanager
def training(mount: CubeMount, workdir: Path, epochs: int, pause: float,
             **extra_env: str) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """start_training, with the training killed at the end if it still runs."""
    proc, progress = start_training(mount, workdir, epochs, pause, **extra_env)
    try:
        yield proc, progress
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_for_batches(proc: subprocess.Popen[str], progress: Path, at: int, what: str) -> None:
    """Waits until the training has done `at` batches, and is still running."""
    assert wait_until(lambda: batches_done(progress) >= at or proc.poll() is not None, 120), \
        "training made no progress"
    assert proc.poll() is None, f"training ended before {what}: " + proc.stderr.read()


def kill_daemon(mount: CubeMount) -> None:
    """kill -9 of the daemon serving `mount`; returns once the supervisor started another."""
    pid = mount.read_control()["pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: mount.read_control().get("pid") != pid, 30), \
        "no new daemon after kill -9"


def batches_done(progress: Path) -> int:
    try:
        return int(progress.read_text() or 0)
    except (OSError, ValueError):
        return 0


def finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"training did not finish in {SCRIPT_TIMEOUT_S} s; stderr:\n{err}")
    assert proc.returncode == 0, f"training failed:\nstdout:\n{out}\nstderr:\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def check_samples(result: dict[str, Any], digests: dict[str, int], epochs: int) -> list[int]:
    """Every sample of every epoch is byte-identical to the store's file, or a recorded error;
    returns the errors per epoch."""
    errors = [0] * epochs
    kinds: dict[str, int] = {}
    seen: list[set[int]] = [set() for _ in range(epochs)]
    for epoch, sha in result["samples"]:
        if isinstance(sha, dict):
            continue
        if sha.startswith("error:"):
            errors[epoch] += 1
            kinds[sha] = kinds.get(sha, 0) + 1
            continue
        assert sha in digests, f"epoch {epoch}: a sample matches no file of the store"
        seen[epoch].add(digests[sha])
    for epoch in range(epochs):
        assert len(seen[epoch]) + errors[epoch] == FILES, (epoch, len(seen[epoch]), errors)
    if kinds:
        print("errors by kind:", kinds)
    return errors


def epoch_stats(result: dict[str, Any], epoch: int) -> dict[str, Any]:
    return next(s for e, s in result["samples"] if e == epoch and isinstance(s, dict))


def mount_profile(cube: CubeFactory, store: dict[str, Any], profile: str) -> CubeMount:
    """The store behind 3 ms per request, under `profile` ("default" or a config profile)."""
    overrides: dict[str, Any] = {"backend": {"inject": {"latency_us": 3000}}}
    if profile != "default":
        overrides["profile"] = profile
    return cube.mount(store["root"], overrides)


def assert_second_epoch_published(result: dict[str, Any]) -> dict[str, Any]:
    """The hook published the whole second epoch (but its first lookahead) to the daemon
    serving then; returns that epoch's stats."""
    second = epoch_stats(result, 1)
    published = second["after"]["client"]["published"] - second["before"]["client"]["published"]
    assert published >= FILES - 4 * BATCH, second
    return second


def upgrade(mount: CubeMount) -> subprocess.CompletedProcess[str]:
    return run_command([str(BINARY), "upgrade", str(mount.mountpoint), "--timeout", "60"],
                       timeout=90, env=mount.env())


def status(mount: CubeMount, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_command([str(BINARY), "status", str(mount.mountpoint), *extra], env=mount.env())


@pytest.mark.parametrize("profile", ["default", "ai_prefetch"])
def test_training_runs_across_three_upgrades(cube: CubeFactory, store: dict[str, Any],
                                             tmp_path: Path, profile: str) -> None:
    mount = mount_profile(cube, store, profile)
    first = mount.read_control()
    proc, progress = start_training(mount, tmp_path, epochs=2, pause=0.03)
    try:
        per_epoch = FILES // BATCH
        for k, at in enumerate((10, 25, 40)):
            assert wait_until(lambda: batches_done(progress) >= at or proc.poll() is not None,
                              120), "training made no progress"
            assert proc.poll() is None, "training ended before the upgrades: " + proc.stderr.read()
            result = upgrade(mount)
            assert result.returncode == 0, result.stderr
            assert "upgraded" in result.stdout, result.stdout
            assert batches_done(progress) < per_epoch, "an upgrade came after the first epoch"
            info = mount.read_control()
            assert info["generation"] == k + 1 and info["supervisor_pid"] == first["supervisor_pid"]
            assert pid_alive(info["pid"]) and not pid_alive(first["pid"])
        result = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    errors = check_samples(result, store["digests"], 2)
    assert errors == [0, 0], errors
    # Prefetching goes on with the third daemon: the second epoch's files were published to
    # it and fetched ahead of the reads.
    second = assert_second_epoch_published(result)
    if profile == "default":  # every read reaches the daemon (no kernel page cache kept)
        before, after = second["before"]["global"]["reads"], second["after"]["global"]["reads"]
        hits = after["hit"] - before["hit"]
        total = sum(after[k] - before[k] for k in ("hit", "late", "miss"))
        assert total >= FILES // 2 and hits / total >= 0.9, (before, after)
    assert mount.read_control()["generation"] == 3


@pytest.mark.parametrize("profile", ["default", "ai_prefetch"])
def test_training_survives_kill_9_of_the_daemon(cube: CubeFactory, store: dict[str, Any],
                                                tmp_path: Path, profile: str) -> None:
    mount = mount_profile(cube, store, profile)
    first = mount.read_control()
    with training(mount, tmp_path, epochs=2, pause=0.03) as (proc, progress):
        for k, at in enumerate((12, 36)):
            wait_for_batches(proc, progress, at, "the crash")
            kill_daemon(mount)
            assert mount.read_control()["generation"] == k + 1
        result = finish(proc)
    errors = check_samples(result, store["digests"], 2)
    # Only the samples in flight at each crash may fail (the loop skips them): at most what the
    # 2 workers have asked for, prefetch_factor 2 batches each, per crash. Nothing else does.
    assert errors[0] <= 2 * (2 * 2 * BATCH) and errors[1] == 0, errors
    assert mount.is_mounted() and mount.read_control()["supervisor_pid"] == first["supervisor_pid"]
    second = assert_second_epoch_published(result)


@pytest.mark.parametrize("profile", ["default", "ai_prefetch"])
def test_an_unmodified_loop_survives_three_kill_9s_and_three_upgrades(
        cube: CubeFactory, store: dict[str, Any], tmp_path: Path, profile: str) -> None:
    """A loop whose dataset catches nothing: a kill -9 and an upgrade in the middle of each of
    three epochs, then a fourth with one daemon throughout. The reads the dead daemons failed
    are read again by the hook once the mount answers: no exception reaches the loop, every
    sample of the four epochs is byte-identical, and the fourth epoch is prefetched."""
    mount = mount_profile(cube, store, profile)
    per_epoch = FILES // BATCH
    events = []
    for epoch in range(3):
        events += [(epoch * per_epoch + 12, "kill"), (epoch * per_epoch + 36, "upgrade")]
    with training(mount, tmp_path, epochs=4, pause=0.03, FLEET_UNMODIFIED="1") as (proc,
                                                                                   progress):
        for at, event in events:
            wait_for_batches(proc, progress, at, f"the {event} at batch {at}")
            if event == "kill":
                kill_daemon(mount)
            else:
                upgraded = upgrade(mount)
                assert upgraded.returncode == 0 and "upgraded" in upgraded.stdout, upgraded
        assert batches_done(progress) < 3 * per_epoch, "the events came after the third epoch"
        result = finish(proc)
    assert check_samples(result, store["digests"], 4) == [0, 0, 0, 0]
    assert mount.read_control()["generation"] == 6
    fourth = epoch_stats(result, 3)
    published = fourth["after"]["client"]["published"] - fourth["before"]["client"]["published"]
    assert published >= FILES - 4 * BATCH, fourth
    if profile == "default":  # every read reaches the daemon (no kernel page cache kept)
        before, after = fourth["before"]["global"]["reads"], fourth["after"]["global"]["reads"]
        hits = after["hit"] - before["hit"]
        total = sum(after[k] - before[k] for k in ("hit", "late", "miss"))
        assert total >= FILES // 2 and hits / total >= 0.95, (before, after)


def test_the_batch_mode_trains_across_an_upgrade_and_a_kill_9(cube: CubeFactory,
                                                              store: dict[str, Any],
                                                              tmp_path: Path) -> None:
    """The hook's batch mode (each worker's batches from POST /v1/files/batch): an upgrade
    costs no sample; a crash costs at most the samples in flight, whose batch requests fail
    and are read through the mount (the daemon is asked again 5 s later)."""
    mount = mount_profile(cube, store, "ai_prefetch")
    with training(mount, tmp_path, epochs=2, pause=0.03, USE_BATCH_DOWNLOAD="1") as (proc,
                                                                                    progress):
        wait_for_batches(proc, progress, 10, "the upgrade")
        upgraded = upgrade(mount)
        assert upgraded.returncode == 0 and "upgraded" in upgraded.stdout, upgraded
        wait_for_batches(proc, progress, 30, "the crash")
        kill_daemon(mount)
        result = finish(proc)
    errors = check_samples(result, store["digests"], 2)
    assert errors[0] <= 2 * (2 * 2 * BATCH) and errors[1] == 0, errors
    assert mount.read_control()["generation"] == 2
    # The second epoch's batches came from the third daemon's batch requests.
    second = epoch_stats(result, 1)
    batches = second["after"]["global"]["files_batch"]["files"]
    assert batches >= FILES - 4 * BATCH, second


def test_upgrade_is_refused_while_a_file_is_open_for_writing(cube: CubeFactory,
                                                             tmp_path: Path) -> None:
    root = tmp_path / "rw"
    root.mkdir()
    mount = cube.mount(root)
    pid = mount.read_control()["pid"]
    with open(mount.path("ckpt.bin"), "wb") as f:
        f.write(b"x" * 4096)
        result = upgrade(mount)
        assert result.returncode == 1 and "open for writing" in result.stderr, result
        assert mount.read_control()["pid"] == pid
        f.write(b"y" * 4096)
    assert (root / "ckpt.bin").read_bytes() == b"x" * 4096 + b"y" * 4096
    result = upgrade(mount)
    assert result.returncode == 0, result.stderr
    assert mount.path("ckpt.bin").read_bytes() == b"x" * 4096 + b"y" * 4096


def test_upgrade_by_signal_and_stop_by_signal_to_the_supervisor(cube: CubeFactory,
                                                                store: dict[str, Any]) -> None:
    mount = cube.mount(store["root"])
    info = mount.read_control()
    sample = mount.path("train/class_0/s0000.bin")
    with open(sample, "rb") as held:  # opened before the upgrade, read after it
        head = held.read(100)
        os.kill(info["supervisor_pid"], signal.SIGUSR2)
        assert wait_until(lambda: mount.read_control().get("pid") != info["pid"], 30)
        rest = held.read()
    assert head + rest == (store["root"] / "train/class_0/s0000.bin").read_bytes()
    os.kill(info["supervisor_pid"], signal.SIGTERM)
    assert mount.wait_gone(), "mount or daemon still there after SIGTERM to the supervisor"


def test_status_and_healthz_report_the_mount(cube: CubeFactory, store: dict[str, Any]) -> None:
    mount = cube.mount(store["root"])
    (mount.path("train/class_1/s0001.bin")).read_bytes()
    result = status(mount)
    assert result.returncode == 0, result.stderr
    for word in ("healthy", "0.1.0", "store", "reachable", "cache: RAM", "hit ratio",
                 "last warning or error"):
        assert word in result.stdout, result.stdout
    report = json.loads(status(mount, "--json").stdout)
    assert report["healthy"] is True and report["store"]["reachable"] is True
    assert report["reads"]["miss"] >= 1 and report["pid"] == mount.read_control()["pid"]
    with urllib.request.urlopen(f"http://127.0.0.1:{mount.metrics_port}/healthz",
                                timeout=10) as r:
        assert r.status == 200 and json.load(r)["healthy"] is True
    with urllib.request.urlopen(f"http://127.0.0.1:{mount.metrics_port}/metrics",
                                timeout=10) as r:
        assert b"cubetorchfs_fuse_ops_total" in r.read()

    not_ours = run_command([str(BINARY), "status", str(store["root"])])
    assert not_ours.returncode == 2 and "not a mount point" in not_ours.stderr


def test_foreground_supervisor_tells_systemd_ready_reloading_stopping(
        cube: CubeFactory, store: dict[str, Any], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Type=notify in cubetorchfs@.service: the supervisor (the unit's main process) sends
    READY=1 once the mount is served, RELOADING=1 at an upgrade, STOPPING=1 at SIGTERM."""
    import socket

    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(30)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    try:
        mount = cube.prepare(store["root"])
        proc = cube.start_foreground(mount)
        ready = sock.recv(4096).decode()
        assert "READY=1" in ready and f"MAINPID={proc.pid}" in ready, ready
        old = mount.read_control()["pid"]
        os.kill(proc.pid, signal.SIGUSR2)
        assert "RELOADING=1" in sock.recv(4096).decode()
        assert "READY=1" in sock.recv(4096).decode()
        assert mount.read_control()["pid"] != old and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in sock.recv(4096).decode()
        assert proc.wait(timeout=30) == 0
        assert mount.wait_gone()
    finally:
        sock.close()
