"""Helpers for integration tests that really mount cubetorchfs (fixtures: conftest.py).

Every daemon a test starts is registered here and is always stopped in a finalizer:
`fusermount3 -u -z`, then the daemon's pid (from its control file, or found by its unique
config path) is waited for and killed if it lingers, then `umount -l` as a last resort.
Every subprocess runs under a timeout, and a per-test watchdog kills the daemons of a test
that hangs, so a hung FUSE request turns into a failed test instead of a stuck suite.

Environment:
  CUBETORCHFS_BIN   the daemon binary (default: <repo>/build/bin/cubetorchfs)
"""

from __future__ import annotations

import copy
import ctypes
import http.client
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BINARY = Path(os.environ.get("CUBETORCHFS_BIN", REPO_ROOT / "build" / "bin" / "cubetorchfs"))

START_TIMEOUT_S = 30.0  # the daemon must be mounted and daemonized within this
STOP_TIMEOUT_S = 15.0  # ... and gone within this after an unmount or a signal
COMMAND_TIMEOUT_S = 15.0  # fusermount3, umount, --help and friends
TEST_WATCHDOG_S = 150.0  # a test running longer than this gets its daemons killed

T = TypeVar("T")


# --------------------------------------------------------------------------- environment


def environment_problems() -> list[str]:
    """Every reason these tests cannot run here (empty when they can). Under CI, a test
    skipped for one of these fails instead (tests/ci_skips.py)."""
    problems = []
    if not os.path.exists("/dev/fuse"):
        problems.append("/dev/fuse does not exist (no FUSE in this machine or container)")
    elif not os.access("/dev/fuse", os.R_OK | os.W_OK):
        problems.append("/dev/fuse is not readable and writable by this user")
    if shutil.which("fusermount3") is None:
        problems.append("fusermount3 is not installed (Debian package fuse3)")
    if not (BINARY.is_file() and os.access(BINARY, os.X_OK)):
        problems.append(f"{BINARY} is not built (build the project or set CUBETORCHFS_BIN)")
    return problems


def ci_skip_problems() -> list[str]:
    """The texts of skip reasons that fail under CI (tests/ci_skips.py): this machine's
    environment problems, and a missing project venv (tests that need none run without it)."""
    return environment_problems() + [VENV_PROBLEM]


def environment_problem() -> Optional[str]:
    """Why these tests cannot run here, or None when they can."""
    problems = environment_problems()
    return problems[0] if problems else None


# --------------------------------------------------------------------------- the project venv

# torch 2.x and the peers the tests run beside cubetorchfs (moto, torchdata...), made by
# scripts/install_deps.sh outside the clone; scripts/venv.sh names its path.
VENV_SCRIPT = REPO_ROOT / "scripts" / "venv.sh"
_venv_cache: list[Path] = []


def project_venv() -> Path:
    if not _venv_cache:
        out = subprocess.run([str(VENV_SCRIPT)], capture_output=True, text=True, timeout=15,
                             check=True)
        _venv_cache.append(Path(out.stdout.strip()))
    return _venv_cache[0]


def project_venv_python() -> Path:
    return project_venv() / "bin" / "python"


def project_venv_problem(*modules: str) -> Optional[str]:
    """Why the project venv cannot run `modules` here, or None when it can. A problem of the
    environment: under CI such a skip fails (tests/ci_skips.py)."""
    venv = project_venv()
    if not (venv / ".complete").is_file():
        return f"{VENV_PROBLEM}: {venv} is not made (scripts/install_deps.sh makes it)"
    if modules:
        code = "import " + ", ".join(modules)
        try:
            subprocess.run([str(project_venv_python()), "-c", code], check=True, timeout=120,
                           capture_output=True)
        except (subprocess.SubprocessError, OSError):
            return f"{VENV_PROBLEM}: {venv} cannot `{code}` (scripts/install_deps.sh remakes it)"
    return None


VENV_PROBLEM = "the project venv is missing"


# --------------------------------------------------------------------------- small helpers


def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Polls predicate until it is true or timeout seconds have passed; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def bounded(fn: Callable[..., T], *args: Any, timeout: float = 30.0, what: str = "") -> T:
    """Runs fn(*args) in a daemon thread and returns its result or re-raises its exception.

    Raises TimeoutError when it does not finish in time, so a FUSE request that hangs fails
    the test; the thread is left behind and unblocks when the daemon is killed in cleanup.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name=f"bounded:{what}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{what or getattr(fn, '__name__', 'call')} did not finish in "
                           f"{timeout:.0f}s (is the daemon hung?)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_command(args: list[str], timeout: float = COMMAND_TIMEOUT_S,
                env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess[str]:
    """subprocess.run with captured text output and a timeout; never raises on exit status."""
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL, check=False)


def read_file_bytes(path: os.PathLike[str] | str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def errno_of(fn: Callable[[], Any]) -> Optional[int]:
    """Runs fn and returns the errno of the OSError it raised, or None if it succeeded."""
    try:
        fn()
    except OSError as exc:
        return exc.errno
    return None


# --------------------------------------------------------------------------- /proc helpers


@dataclass(frozen=True)
class MountEntry:
    source: str
    target: str
    fstype: str
    options: str


def _unescape_mount_field(value: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as \ooo octal escapes.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), value)


def proc_mounts() -> list[MountEntry]:
    entries = []
    with open("/proc/mounts", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 4:
                entries.append(MountEntry(*(_unescape_mount_field(x) for x in fields[:4])))
    return entries


def mount_entry(mountpoint: os.PathLike[str] | str) -> Optional[MountEntry]:
    """The last (topmost) /proc/mounts entry whose target is mountpoint, if any."""
    # Not realpath() of the mount point itself: its lstat asks the file system mounted there,
    # which may be the hung one.
    target = os.path.join(os.path.realpath(os.path.dirname(os.fspath(mountpoint))),
                          os.path.basename(os.fspath(mountpoint)))
    found = None
    for entry in proc_mounts():
        if entry.target == target:
            found = entry
    return found


def fuse_connection(mountpoint: os.PathLike[str] | str) -> Optional[str]:
    """The fusectl connection id (the device minor) of a FUSE mount at mountpoint, from
    /proc/self/mountinfo: asks nothing of the mount."""
    entry = mount_entry(mountpoint)
    if entry is None:
        return None
    found = None
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[4] == entry.target and " - fuse" in line:
                found = fields[2].split(":")[1]
    return found


def abort_fuse_connection(connection: str) -> bool:
    """Aborts a FUSE connection whose daemon is gone for good (a thread of it held in the
    kernel): every request waiting on it fails, so no test process stays blocked on it."""
    base = Path("/sys/fs/fuse/connections")
    if not (base / connection).exists():
        subprocess.run(["mount", "-t", "fusectl", "none", str(base)], capture_output=True,
                       timeout=10, check=False)
    try:
        (base / connection / "abort").write_text("1")
        return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """True if pid exists and is not a zombie (our PID 1 may never reap a daemon)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state not in ("Z", "X")


def pid_cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [part.decode(errors="surrogateescape") for part in raw.split(b"\0") if part]


def pids_with_argument(argument: str) -> list[int]:
    """Pids of live processes that were started with argument on their command line."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            if argument in pid_cmdline(int(name)) and pid_alive(int(name)):
                pids.append(int(name))
    return pids


# --------------------------------------------------------------------------- metrics


_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Metrics:
    """One scrape of the Prometheus text format, queried by name and label subset."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            match = _SAMPLE_RE.match(line)
            if not match:
                continue
            labels = dict(_LABEL_RE.findall(match.group(3) or ""))
            self.samples.append((match.group(1), labels, float(match.group(4))))

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples called name whose labels include labels (0 when none)."""
        return sum(v for n, l, v in self.samples
                   if n == name and all(l.get(k) == want for k, want in labels.items()))

    def has(self, name: str, **labels: str) -> bool:
        return any(n == name and all(l.get(k) == want for k, want in labels.items())
                   for n, l, _ in self.samples)

    def label_values(self, name: str, label: str) -> set[str]:
        return {l[label] for n, l, _ in self.samples if n == name and label in l}


def scrape(port: int, timeout: float = 5.0) -> Metrics:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as reply:
        assert reply.status == 200, f"/metrics answered {reply.status}"
        return Metrics(reply.read().decode("utf-8"))


# --------------------------------------------------------------------------- config


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of base with overrides merged in; a value of None deletes the key."""
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def to_yaml(value: Any, indent: int = 0) -> str:
    """Block-style YAML for nested dicts of scalars (strings are JSON-quoted, valid YAML)."""
    pad = "  " * indent
    lines = []
    for key, item in value.items():
        if isinstance(item, dict):
            lines.append(f"{pad}{key}:")
            lines.append(to_yaml(item, indent + 1))
        else:
            lines.append(f"{pad}{key}: {json.dumps(item)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the daemon


@dataclass
class LaunchResult:
    returncode: Optional[int]  # None for a foreground daemon that is still running
    stdout: str
    stderr: str
    seconds: float

    @property
    def stderr_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


@dataclass
class CubeMount:
    """One cubetorchfs instance: its files, its mount point and (once started) its process."""

    workdir: Path
    mountpoint: Path
    config_path: Path
    config_dir: Path  # CUBE_TORCH_CONFIG_DIR
    vol_name: str
    metrics_port: int
    config: Optional[dict[str, Any]] = None
    pid: Optional[int] = None
    proc: Optional[subprocess.Popen[bytes]] = None  # set for foreground (-f) runs
    launch_result: Optional[LaunchResult] = None
    _out_files: list[Any] = field(default_factory=list)

    # -- what a user sees

    @property
    def control_file(self) -> Path:
        return self.config_dir / f"cube_torch.config.{self.vol_name}"

    def read_control(self) -> dict[str, Any]:
        return json.loads(self.control_file.read_text())

    def is_mounted(self) -> bool:
        return mount_entry(self.mountpoint) is not None

    def metrics(self) -> Metrics:
        return scrape(self.metrics_port)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["CUBE_TORCH_CONFIG_DIR"] = str(self.config_dir)
        return env

    def path(self, relative: str = "") -> Path:
        return self.mountpoint / relative if relative else self.mountpoint

    # -- process bookkeeping

    def _owned(self, pid: int) -> bool:
        """True if pid is a live daemon started with this instance's config path."""
        return pid_alive(pid) and str(self.config_path) in pid_cmdline(pid)

    def daemon_pids(self) -> list[int]:
        pids = set(pids_with_argument(str(self.config_path)))
        if self.pid is not None and self._owned(self.pid):
            pids.add(self.pid)
        return sorted(pids)

    def learn_pid(self) -> Optional[int]:
        """The daemon's pid, from the control file or the process table."""
        if self.pid is None and self.control_file.exists():
            try:
                self.pid = int(self.read_control()["pid"])
            except (ValueError, KeyError, OSError, json.JSONDecodeError):
                pass
        if self.pid is None:
            # The process serving the mount, not its supervisor (daemon/supervisor.h).
            pids = self.daemon_pids()
            workers = [p for p in pids if "--takeover" in pid_cmdline(p)]
            self.pid = (workers or pids or [None])[0]
        return self.pid

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> bool:
        return wait_until(lambda: self.is_mounted() and self.control_file.exists(), timeout)

    def wait_gone(self, timeout: float = STOP_TIMEOUT_S) -> bool:
        """Waits until unmounted, control file removed and no daemon process left."""
        return wait_until(lambda: not self.is_mounted() and not self.control_file.exists()
                          and not self.daemon_pids(), timeout)

    # -- stopping

    def fusermount(self, lazy: bool = False) -> subprocess.CompletedProcess[str]:
        args = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [str(self.mountpoint)]
        return run_command(args)

    def signal(self, signum: int) -> None:
        pid = self.learn_pid()
        assert pid is not None, "daemon pid unknown"
        os.kill(pid, signum)

    def cleanup(self) -> None:
        """Leaves nothing behind: no mount, no daemon. Safe to call at any time, repeatedly."""
        try:
            self.learn_pid()
        except Exception:
            pass
        connection = fuse_connection(self.mountpoint) if os.geteuid() == 0 else None
        if self.is_mounted():
            try:
                self.fusermount(lazy=True)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self.daemon_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in self.daemon_pids():  # still alive after the unmount: a bug, but clean up
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_until(lambda: not self.daemon_pids(), 5.0)
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self.is_mounted() and os.geteuid() == 0:
            try:
                run_command(["umount", "-l", str(self.mountpoint)])
            except subprocess.TimeoutExpired:
                pass
        # A connection that outlives its mount with requests still waiting has no daemon
        # left to answer them (one died with a thread held in the kernel): abort it, so that
        # a failed test leaves no process blocked for good.
        waiting = Path(f"/sys/fs/fuse/connections/{connection}/waiting")
        try:
            stuck = connection is not None and int(waiting.read_text()) > 0 and \
                not self.is_mounted()
        except (OSError, ValueError):
            stuck = False
        if stuck:
            abort_fuse_connection(connection)
        for f in self._out_files:
            f.close()
        self._out_files.clear()

    def abort(self) -> None:
        """Watchdog path: kill the daemon first so hung requests fail, then clean up."""
        for pid in self.daemon_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.cleanup()


# Every prepared instance not yet cleaned up, so the watchdog reaches module-scoped ones too.
LIVE: list[CubeMount] = []
LIVE_LOCK = threading.Lock()


def abort_live() -> None:
    """Kills every live daemon (the watchdog's last resort)."""
    with LIVE_LOCK:
        live = list(LIVE)
    for instance in live:
        instance.abort()


class CubeFactory:
    """Creates, starts and always cleans up cubetorchfs instances under one directory."""

    def __init__(self, base: Path, options: Optional[list[str]] = None) -> None:
        self.base = base
        self.instances: list[CubeMount] = []
        self._count = 0
        self.options = options or []  # extra command-line arguments of every daemon (-o ...)

    def base_config(self, instance: CubeMount, root: os.PathLike[str] | str) -> dict[str, Any]:
        return {
            "volName": instance.vol_name,
            "mountPoint": str(instance.mountpoint),
            "logDir": str(instance.workdir / "log"),
            "logLevel": "info",
            "exporterPort": instance.metrics_port,
            "profPort": "",
            "backend": {"type": "posix", "root": str(root)},
            "cache": {"memory_bytes": "64MiB", "chunk_bytes": "4MiB"},
        }

    def prepare(self, root: os.PathLike[str] | str,
                overrides: Optional[dict[str, Any]] = None, fmt: str = "json",
                raw_text: Optional[str | Callable[[CubeMount], str]] = None) -> CubeMount:
        """Writes a config and returns an unstarted instance.

        The config is the default one with overrides deep-merged in (a None value removes a
        key), written as JSON or YAML (fmt); or raw_text verbatim, which may be a function of
        the instance (for its vol_name, mountpoint, metrics_port, workdir).
        """
        self._count += 1
        workdir = self.base / f"cube{self._count}"
        workdir.mkdir(parents=True)
        (workdir / "mnt").mkdir()
        (workdir / "log").mkdir()
        (workdir / "ctl").mkdir()
        instance = CubeMount(
            workdir=workdir,
            mountpoint=Path(os.path.realpath(workdir / "mnt")),
            config_path=workdir / f"config.{'yaml' if fmt == 'yaml' else 'json'}",
            config_dir=workdir / "ctl",
            vol_name=f"it{self._count}-{secrets.token_hex(4)}",
            metrics_port=free_tcp_port(),
        )
        if raw_text is not None:
            text = raw_text(instance) if callable(raw_text) else raw_text
            instance.config_path.write_text(text)
        else:
            config = deep_merge(self.base_config(instance, root), overrides or {})
            instance.config = config
            text = to_yaml(config) if fmt == "yaml" else json.dumps(config, indent=2)
            instance.config_path.write_text(text + "\n")
        self.instances.append(instance)
        with LIVE_LOCK:
            LIVE.append(instance)
        return instance

    def launch(self, instance: CubeMount, args: Optional[list[str]] = None,
               timeout: float = START_TIMEOUT_S) -> LaunchResult:
        """Runs the daemon (daemonizing form by default) and waits for the command to return.

        Output goes to files, not pipes: a daemon that keeps a pipe open must not hang us.
        """
        if args is None:
            args = ["-c", str(instance.config_path), str(instance.mountpoint), *self.options]
        out_path, err_path = instance.workdir / "launch.out", instance.workdir / "launch.err"
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen([str(BINARY), *args], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=err, env=instance.env())
            try:
                returncode: Optional[int] = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
                returncode = None
        result = LaunchResult(returncode, out_path.read_text(errors="replace"),
                              err_path.read_text(errors="replace"), time.monotonic() - start)
        instance.launch_result = result
        if returncode is None:
            pytest.fail(f"`cubetorchfs {' '.join(args)}` did not return in {timeout:.0f}s; "
                        f"stderr: {result.stderr!r}")
        return result

    def start_foreground(self, instance: CubeMount, extra: Optional[list[str]] = None,
                         ) -> subprocess.Popen[bytes]:
        """Starts `cubetorchfs -c CONFIG MNT -f` as our child and waits until it is mounted."""
        out = open(instance.workdir / "fg.out", "wb")
        err = open(instance.workdir / "fg.err", "wb")
        instance._out_files += [out, err]
        args = [str(BINARY), "-c", str(instance.config_path), str(instance.mountpoint), "-f",
                *self.options]
        instance.proc = subprocess.Popen(args + (extra or []), stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=err, env=instance.env())
        instance.pid = instance.proc.pid
        if not instance.wait_ready():
            pytest.fail("foreground daemon did not mount in time; stderr: "
                        f"{(instance.workdir / 'fg.err').read_text(errors='replace')!r}")
        return instance.proc

    def mount(self, root: os.PathLike[str] | str, overrides: Optional[dict[str, Any]] = None,
              fmt: str = "json") -> CubeMount:
        """Prepares and starts a daemon; fails the test unless it mounts and is ready."""
        instance = self.prepare(root, overrides, fmt)
        result = self.launch(instance)
        assert result.returncode == 0, (
            f"cubetorchfs exited {result.returncode}; stderr: {result.stderr!r}")
        assert instance.wait_ready(), (
            f"not mounted/no control file after start; stderr: {result.stderr!r}")
        instance.learn_pid()
        return instance

    def cleanup_all(self) -> None:
        for instance in reversed(self.instances):
            try:
                instance.cleanup()
            finally:
                with LIVE_LOCK:
                    if instance in LIVE:
                        LIVE.remove(instance)


# -- the control API over its unix socket


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 to the daemon's control socket."""

    def __init__(self, path: str, timeout: float = 5.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def call(conn: http.client.HTTPConnection, method: str, target: str,
         body: Optional[bytes | str | Any] = None) -> tuple[int, bytes]:
    """One request; a body that is not bytes or str is sent as JSON."""
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    conn.request(method, target, body=body,
                 headers={"Content-Type": "application/json"} if body is not None else {})
    resp = conn.getresponse()
    return resp.status, resp.read()


def list_in_small_reads(directory: os.PathLike[str] | str, buffer_bytes: int = 512,
                        rewind_after: int = 0) -> list[str]:
    """The names of `directory` (without . and ..) as getdents64(2) returns them into a buffer
    of `buffer_bytes`: a few entries a call, so the kernel drops the rest of each FUSE reply and
    asks again from the offset of the last entry it passed on (the daemon resumes inside its
    window of the listing). With `rewind_after` > 0 the directory is rewound (lseek 0) once
    that many names were read, and listed whole again from its start."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    sys_getdents64 = 217  # x86_64
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    names: list[str] = []
    rewound = False
    try:
        buf = ctypes.create_string_buffer(buffer_bytes)
        for _ in range(10_000_000):  # bounded: each call returns at least one entry or ends
            n = libc.syscall(sys_getdents64, fd, buf, buffer_bytes)
            if n < 0:
                raise OSError(ctypes.get_errno(), f"getdents64 {directory}")
            if n == 0:
                break
            raw = buf.raw[:n]
            pos = 0
            while pos < n:
                reclen = int.from_bytes(raw[pos + 16:pos + 18], "little")
                name = raw[pos + 19:pos + reclen].split(b"\0", 1)[0].decode("utf-8",
                                                                          "surrogateescape")
                if name not in (".", ".."):
                    names.append(name)
                pos += reclen
            if rewind_after and not rewound and len(names) >= rewind_after:
                rewound = True
                os.lseek(fd, 0, os.SEEK_SET)
                names.clear()
    finally:
        os.close(fd)
    return names


def check_paged_listing(mount: CubeMount, rel: str, want: set[str], page: int) -> None:
    """What every backend's mount with fuse.list_page_entries `page` must show of directory
    `rel` (holding the names `want`): each name once, read back in small getdents calls (the
    kernel resumes at its offsets), a page at a time, a rewind listing from the start."""
    directory = mount.path(rel)
    before = mount.metrics().value("cubetorchfs_backend_requests_total", op="list")
    resumed = bounded(list_in_small_reads, directory, what=f"getdents of {rel}")
    assert len(resumed) == len(want), f"{len(resumed)} names listed, {len(want)} there"
    assert set(resumed) == want
    pages = mount.metrics().value("cubetorchfs_backend_requests_total", op="list") - before
    # Listed a page at a time, each page once: resuming inside the window asks nothing again.
    assert len(want) / page <= pages <= len(want) / page + 2, pages
    # A rewind in the middle lists from the start again, every name once.
    again = bounded(list_in_small_reads, directory, 4096, len(want) // 2, what="rewind")
    assert sorted(again) == sorted(want)
    # Python's own listing (large reads) agrees.
    assert sorted(bounded(os.listdir, directory, what="listdir")) == sorted(want)
