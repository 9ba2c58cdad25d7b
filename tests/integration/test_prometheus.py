"""The Prometheus side of the metrics: conf/prometheus/ (scrape example, recording rules) and
conf/grafana/ (dashboard), checked with promtool and with a real Prometheus server scraping a
real mount.

The server is Debian's `prometheus` (PROMETHEUS_BIN, default /usr/bin/prometheus; promtool next
to it); the tests that need it are skipped when it is missing. It listens on a free loopback
port with its own temporary TSDB, and is always stopped after the test (terminate, wait, kill).
Run: /usr/bin/python3 -m pytest -q tests/integration/test_prometheus.py
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from cubefs_harness import (REPO_ROOT, CubeFactory, CubeMount, bounded, environment_problem,
                            free_tcp_port, run_command)

PROMETHEUS = Path(os.environ.get("PROMETHEUS_BIN", "/usr/bin/prometheus"))
PROMTOOL = PROMETHEUS.with_name("promtool")
CONF = REPO_ROOT / "conf"
RULES = CONF / "prometheus" / "cubetorchfs.rules.yml"
RULES_TEST = CONF / "prometheus" / "cubetorchfs.rules.test.yml"
SCRAPE_EXAMPLE = CONF / "prometheus" / "prometheus.yml"
DASHBOARD = CONF / "grafana" / "cubetorchfs-dashboard.json"

HTTP_TIMEOUT_S = 5.0  # every request to Prometheus
PROM_START_TIMEOUT_S = 30.0  # /-/ready within this
PROM_STOP_TIMEOUT_S = 10.0  # gone within this after SIGTERM, else SIGKILL
RULE_TIMEOUT_S = 60.0  # the hit-ratio rule must yield a value within this
KIB = 1 << 10

RECORDED = ["cubetorchfs:hit_ratio:rate1m", "cubetorchfs:late_ratio:rate1m",
            "cubetorchfs:read_bytes:rate1m", "cubetorchfs:backend_request_seconds:p50",
            "cubetorchfs:backend_request_seconds:p90", "cubetorchfs:backend_request_seconds:p99",
            "cubetorchfs:fuse_op_seconds:p99"]


def _need(binary: Path) -> None:
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        pytest.skip(f"{binary} is not installed (Debian package prometheus)")


def _need_mount() -> None:
    problem = environment_problem()
    if problem is not None:
        pytest.skip(f"needs a real cubetorchfs mount: {problem}")


# --------------------------------------------------------------------------- Prometheus server


class PromServer:
    """One Prometheus process on 127.0.0.1:port with its own TSDB under workdir."""

    def __init__(self, workdir: Path, scrape_port: int) -> None:
        self.workdir = workdir
        self.port = free_tcp_port()
        self.config = workdir / "prometheus.yml"
        self.log = workdir / "prometheus.log"
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self._log_file: Any = None
        # Rules are loaded from the repository; paths in rule_files may be absolute.
        self.config.write_text(
            "global:\n"
            "  scrape_interval: 1s\n"
            "  scrape_timeout: 1s\n"
            "  evaluation_interval: 1s\n"
            "rule_files:\n"
            f"  - {json.dumps(str(RULES))}\n"
            "scrape_configs:\n"
            "  - job_name: cubetorchfs\n"
            "    static_configs:\n"
            f"      - targets: [\"127.0.0.1:{scrape_port}\"]\n")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [str(PROMETHEUS), f"--config.file={self.config}",
                f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h"]
        setpriv = shutil.which("setpriv")
        if setpriv is not None:  # dies with us even if pytest itself is killed
            args = [setpriv, "--pdeathsig", "TERM", "--"] + args
        self._log_file = open(self.log, "wb")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + PROM_START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited {self.proc.returncode} at start:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=HTTP_TIMEOUT_S) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() >= deadline:
                pytest.fail(f"prometheus not ready in {PROM_START_TIMEOUT_S:.0f}s:\n"
                            f"{self.log_tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Always safe to call; leaves no process behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=PROM_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; returns `data` of a successful reply, fails the test otherwise."""
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as reply:
                body = json.loads(reply.read())
        except urllib.error.HTTPError as exc:  # 400/422 carry the PromQL error in the body
            body = json.loads(exc.read() or b"{}")
        assert body.get("status") == "success", f"{url}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Any]:
    """Factory: prometheus(scrape_port) starts a server scraping 127.0.0.1:scrape_port; every
    server it started is stopped after the test, pass or fail."""
    _need(PROMETHEUS)
    servers: list[PromServer] = []

    def start(scrape_port: int) -> PromServer:
        workdir = tmp_path / f"prometheus{len(servers)}"
        workdir.mkdir()
        server = PromServer(workdir, scrape_port)
        servers.append(server)
        server.start()
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


def poll(fn: Any, timeout: float, interval: float = 0.25) -> Any:
    """Calls fn until it returns something truthy or timeout seconds pass; returns the last."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


# --------------------------------------------------------------------------- static checks


def test_promtool_accepts_config_and_rules() -> None:
    _need(PROMTOOL)
    for args in (["check", "config", str(SCRAPE_EXAMPLE)], ["check", "rules", str(RULES)],
                 ["test", "rules", str(RULES_TEST)]):
        result = run_command([str(PROMTOOL), *args], timeout=60)
        assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"
    text = RULES.read_text()
    for name in RECORDED:
        assert f"record: {name}\n" in text, name


def _dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"]
            for target in panel.get("targets", [])]


def _concrete(expr: str) -> str:
    """A dashboard expression with its Grafana variables replaced, as Grafana would send it."""
    return (expr.replace("$__rate_interval", "1m").replace("$job", "cubetorchfs")
            .replace("$instance", ".*"))


def test_grafana_dashboard_is_importable_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"
    assert 36 <= dashboard["schemaVersion"] <= 39
    assert dashboard["id"] is None and dashboard["uid"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    rules = set(re.findall(r"record: (\S+)", RULES.read_text()))
    used_metrics: set[str] = set()
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
            for name in re.findall(r"cubetorchfs[a-z_:0-9]*", target["expr"]):
                used_metrics.add(name)
                if ":" in name:
                    assert name in rules, f"{panel['title']}: {name} is not a recording rule"
    for metric in ("cubetorchfs:hit_ratio:rate1m", "cubetorchfs_reads_total",
                   "cubetorchfs:read_bytes:rate1m", "cubetorchfs_cache_bytes",
                   "cubetorchfs_cache_evictions_total", "cubetorchfs_prefetch_inflight",
                   "cubetorchfs_prefetch_files_total", "cubetorchfs:backend_request_seconds:p50",
                   "cubetorchfs:backend_request_seconds:p90",
                   "cubetorchfs:backend_request_seconds:p99", "cubetorchfs_fuse_ops_total"):
        assert metric in used_metrics, f"no panel shows {metric}"
    stat_exprs = [t["expr"] for p in dashboard["panels"] if p["type"] == "stat"
                  for t in p["targets"]]
    assert any("cubetorchfs:hit_ratio:rate1m" in e for e in stat_exprs)


# --------------------------------------------------------------------------- live server


def _read_uncached(path: Path) -> bytes:
    """Reads path past the kernel page cache (the mount has keep_cache off, and the fadvise
    drops what is cached anyway), so the read reaches the daemon."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _reads(metrics: Any) -> dict[str, float]:
    return {r: metrics.value("cubetorchfs_reads_total", result=r) for r in ("hit", "late", "miss")}


def _buckets(metrics: Any, name: str, **labels: str) -> dict[float, float]:
    """The cumulative bucket counts of histogram `name` (upper bound -> count), summed over
    the series whose labels include `labels`."""
    out: dict[float, float] = {}
    for sample, sample_labels, value in metrics.samples:
        if sample == name + "_bucket" and all(sample_labels.get(k) == v
                                                for k, v in labels.items()):
            le = float(sample_labels["le"])
            out[le] = out.get(le, 0.0) + value
    return out


def _bucket_quantile(q: float, buckets: dict[float, float]) -> float:
    """histogram_quantile(q, ...) as Prometheus computes it (promql/quantile.go) over
    cumulative bucket counts: linear interpolation inside the bucket holding rank q*count."""
    ordered = sorted(buckets.items())
    assert ordered and math.isinf(ordered[-1][0]), ordered
    observations = ordered[-1][1]
    if observations == 0:
        return math.nan
    rank = q * observations
    b = next((i for i in range(len(ordered) - 1) if ordered[i][1] >= rank), len(ordered) - 1)
    if b == len(ordered) - 1:
        return ordered[-2][0]
    if b == 0 and ordered[0][0] <= 0:
        return ordered[0][0]
    start, end, count = 0.0, ordered[b][0], ordered[b][1]
    if b > 0:
        start = ordered[b - 1][0]
        count -= ordered[b - 1][1]
        rank -= ordered[b - 1][1]
    return start + (end - start) * (rank / count)


def test_prometheus_scrapes_daemon_and_rules_yield_values(
        cube: CubeFactory, prometheus: Any, tmp_path: Path) -> None:
    _need_mount()
    rng = random.Random(31)
    src = tmp_path / "src"
    src.mkdir()
    files = {f"f{i:02d}.bin": rng.randbytes(rng.randint(40 * KIB, 160 * KIB)) for i in range(12)}
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    mount = cube.mount(src)  # no profile: keep_cache off, so each open re-reads from the daemon
    server: PromServer = prometheus(mount.metrics_port)

    # The target is up, and Prometheus holds a sample from before the reads (a baseline for
    # rate(); the counters are exported at 0 from the start).
    def target_up() -> Optional[dict[str, Any]]:
        active = server.api("targets", state="active")["activeTargets"]
        ours = [t for t in active if t["labels"].get("job") == "cubetorchfs"]
        return ours[0] if ours and ours[0]["health"] == "up" else None

    target = poll(target_up, 30)
    assert target, (f"target not up: {server.api('targets')}\n{server.log_tail()}")
    assert target["scrapeUrl"] == f"http://127.0.0.1:{mount.metrics_port}/metrics"
    assert target["labels"]["instance"] == f"127.0.0.1:{mount.metrics_port}"
    assert poll(lambda: server.query(
        'count_over_time(cubetorchfs_reads_total{result="hit"}[1m]) >= 3'), 15), \
        "Prometheus holds no samples of cubetorchfs_reads_total"

    # No reads yet (and the rules have been evaluated over several samples): the ratio gives
    # no value rather than NaN.
    time.sleep(1.5)
    assert server.query("cubetorchfs:hit_ratio:rate1m") == [], \
        server.query("cubetorchfs:hit_ratio:rate1m")

    scrape_before = mount.metrics()
    reads_started = time.monotonic()
    for rel, data in files.items():  # first reads: misses
        assert bounded(_read_uncached, mount.path(rel), timeout=30, what=rel) == data
    for rel in list(files)[: len(files) * 2 // 3]:  # again: hits from the RAM cache
        assert bounded(_read_uncached, mount.path(rel), timeout=30, what=rel) == files[rel]
    reads_took = time.monotonic() - reads_started
    scrape_after = mount.metrics()
    before, after = _reads(scrape_before), _reads(scrape_after)
    delta = {r: after[r] - before[r] for r in after}
    total = sum(delta.values())
    assert delta["miss"] > 0 and delta["hit"] > 0, f"daemon counted {delta}"
    expected = delta["hit"] / total
    expected_late = delta["late"] / total

    def moved(name: str, **labels: str) -> float:
        return scrape_after.value(name, **labels) - scrape_before.value(name, **labels)

    # The latency histograms moved by the requests made: one store read per file (the second
    # reads came from RAM), one observation per FUSE read, and no more time than the reads took.
    store_reads = moved("cubetorchfs_backend_requests_total", op="read")
    assert store_reads == len(files), f"{store_reads} store reads for {len(files)} files"
    assert moved("cubetorchfs_backend_request_seconds_count", op="read") == store_reads
    assert 0 < moved("cubetorchfs_backend_request_seconds_sum", op="read") <= reads_took
    fuse_reads = moved("cubetorchfs_fuse_ops_total", op="read")
    assert fuse_reads == total, f"{fuse_reads} FUSE reads, {delta} counted by outcome"
    assert moved("cubetorchfs_fuse_op_seconds_count", op="read") == fuse_reads
    assert 0 < moved("cubetorchfs_fuse_op_seconds_sum", op="read") <= reads_took
    # What the quantile rules must say about op="read", from the daemon's own buckets (there
    # were no reads before, so the rules' 5m windows hold exactly these).
    assert not _buckets(scrape_before, "cubetorchfs_backend_request_seconds", op="read").get(
        math.inf), "store reads before the test's reads"
    backend_buckets = _buckets(scrape_after, "cubetorchfs_backend_request_seconds", op="read")
    fuse_buckets = {le: count - _buckets(scrape_before, "cubetorchfs_fuse_op_seconds",
                                         op="read").get(le, 0.0)
                    for le, count in _buckets(scrape_after, "cubetorchfs_fuse_op_seconds",
                                              op="read").items()}
    expected_quantiles = {
        "cubetorchfs:backend_request_seconds:p50": _bucket_quantile(0.50, backend_buckets),
        "cubetorchfs:backend_request_seconds:p90": _bucket_quantile(0.90, backend_buckets),
        "cubetorchfs:backend_request_seconds:p99": _bucket_quantile(0.99, backend_buckets),
        "cubetorchfs:fuse_op_seconds:p99": _bucket_quantile(0.99, fuse_buckets),
    }

    # Poll the rule until it reflects all the reads (or the time runs out).
    last: list[dict[str, Any]] = []

    def rule_caught_up() -> bool:
        last[:] = server.query("cubetorchfs:hit_ratio:rate1m")
        return bool(last) and abs(float(last[0]["value"][1]) - expected) < 1e-3

    start = time.monotonic()
    poll(rule_caught_up, RULE_TIMEOUT_S)
    waited = time.monotonic() - start
    assert last, (f"cubetorchfs:hit_ratio:rate1m gave no value in {RULE_TIMEOUT_S:.0f}s; "
                  f"rules: {server.api('rules')}\n{server.log_tail()}")
    assert len(last) == 1, last
    assert last[0]["metric"] == {"__name__": "cubetorchfs:hit_ratio:rate1m",
                                 "job": "cubetorchfs",
                                 "instance": f"127.0.0.1:{mount.metrics_port}"}, last
    ratio = float(last[0]["value"][1])
    assert not math.isnan(ratio) and 0.0 <= ratio <= 1.0, ratio
    assert abs(ratio - expected) < 1e-3, (
        f"Prometheus says {ratio} after {waited:.1f}s, the daemon's counters {delta} say "
        f"{expected}")
    # The late ratio over the same reads: late / (hit + late + miss) from the same counters.
    late: list[dict[str, Any]] = []

    def late_caught_up() -> bool:
        late[:] = server.query("cubetorchfs:late_ratio:rate1m")
        return bool(late) and abs(float(late[0]["value"][1]) - expected_late) < 1e-3

    poll(late_caught_up, 10)
    assert len(late) == 1, late
    assert abs(float(late[0]["value"][1]) - expected_late) < 1e-3, (
        f"Prometheus says late ratio {late[0]['value'][1]}, the daemon's counters {delta} say "
        f"{expected_late}")

    # The other rules have values too, and every rule evaluates without error.
    sources = {s["metric"]["source"]: float(s["value"][1])
               for s in server.query("cubetorchfs:read_bytes:rate1m")}
    assert sources.get("backend", 0) > 0 and sources.get("ram", 0) > 0, sources
    for name in ("cubetorchfs:backend_request_seconds:p50",
                 "cubetorchfs:backend_request_seconds:p90",
                 "cubetorchfs:backend_request_seconds:p99", "cubetorchfs:fuse_op_seconds:p99"):
        samples = poll(lambda: server.query(name), 10)
        assert samples, f"{name} has no value"
        for sample in samples:
            value = float(sample["value"][1])
            assert not math.isnan(value) and value >= 0, sample
        want = expected_quantiles[name]
        assert not math.isnan(want) and want > 0, (name, want)
        read_value: list[float] = []

        def quantile_caught_up() -> bool:
            read_value[:] = [float(s["value"][1]) for s in server.query(name)
                             if s["metric"].get("op") == "read"]
            return bool(read_value) and math.isclose(read_value[0], want, rel_tol=1e-6)

        poll(quantile_caught_up, 10)
        assert read_value and math.isclose(read_value[0], want, rel_tol=1e-6), (
            f"{name}{{op=\"read\"}}: Prometheus says {read_value}, the daemon's buckets say "
            f"{want}")
    ops = {s["metric"]["op"] for s in server.query("cubetorchfs:fuse_op_seconds:p99")}
    assert "read" in ops, ops
    groups = server.api("rules", type="record")["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    assert sorted(rules) == sorted(RECORDED)
    for name, rule in rules.items():
        assert rule["health"] == "ok", (name, rule.get("lastError"))

    # Every dashboard query is valid PromQL for this Prometheus.
    for _title, expr in _dashboard_exprs():
        server.query(_concrete(expr))  # fails the test on a PromQL error
    assert server.query(_concrete(
        'sum by (result) (rate(cubetorchfs_reads_total{job=~"$job",instance=~"$instance"}'
        '[$__rate_interval]))'))
