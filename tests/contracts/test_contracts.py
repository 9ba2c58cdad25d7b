"""Contract tests: claims the docs make about the code, checked by reading both.

Pure scans of the sources and the docs (no build, no daemon; well under a second):

- metrics: every metric the C++ sources register is a row of docs/metrics.md and every row is
  registered, with the label values the sources give literally; every metric name any doc,
  dashboard, rule, script or test mentions is registered;
- threads: every thread the C++ sources start is one of the forms docs/architecture.md
  ("Threads and locks") allows: a service loop that is a member started and joined by its
  owner, or a helper of common/parallel.h;
- routes: the routes docs/control-api.md's table lists are the routes the control server
  serves (control/routes.h, or before it the target comparisons of ServerImpl::Handle), and
  every route a doc mentions or a client calls is served;
- pjdfstest: the S3 pass/fail counts README.md and docs/testing.md state agree with each
  other and with tests/posix/expected_failures.txt, read as tests/posix/pjdfstest.py reads it.
- layering: every include of another source folder points down the floors of
  docs/architecture.md ("Dependencies point one way"), and control/ includes nothing of
  cache/, fs/ or fuse/.

Run: python3 -m pytest -q -p no:cacheprovider tests/contracts
"""

from __future__ import annotations

import collections
import importlib.util
import re
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]

# Threads started another way than docs/architecture.md allows, still in the code: each entry
# (file, form) is one occurrence, with why it is there. The list only shrinks: a new
# occurrence fails test_threads_start_only_through_the_named_helpers, and an entry whose
# occurrence is gone fails test_known_thread_violations_are_still_there (remove it then).
KNOWN_VIOLATIONS: List[Tuple[str, str]] = []

# Metric names the sources compose at run time (a `.Name(...)` whose argument is not a string
# literal), as (file, the argument's text) -> the names it produces. None today: every
# `.Name(` argument is a literal, and a composed one fails test_metric_names_are_known until
# it is listed here with the names it can take.
COMPOSED_METRIC_NAMES: Dict[Tuple[str, str], List[str]] = {}

# Tokens that look like metric names in the docs but are not metrics.
NOT_METRICS = {
    "cubetorchfs_integrity",  # docs/models.md: the encrypted header's extra field
}

# HTTP routes the docs mention that are not the control API's: the metrics port's.
EXPORTER_ROUTES = {("GET", "/healthz"), ("GET", "/metrics")}

SOURCE_EXTS = (".cc", ".h", ".cpp", ".hpp", ".cu", ".cuh", ".c")
NOT_SOURCES = {"tests", "bench", "hooks", "docs", "scripts", "packaging", ".git", ".ci"}


def rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


def cxx_sources() -> List[Path]:
    """The daemon's and libraries' C++ files: every top-level directory but the tests, the
    benchmarks, the Python package and the build trees."""
    out = []
    for top in sorted(REPO.iterdir()):
        if not top.is_dir() or top.name in NOT_SOURCES or top.name.startswith(("build", ".")):
            continue
        out.extend(p for p in sorted(top.rglob("*")) if p.suffix in SOURCE_EXTS and p.is_file())
    return out


def strip_cxx(text: str, keep_strings: bool) -> str:
    """`text` without comments (and without the contents of string and character literals
    unless `keep_strings`), newlines kept so that offsets map to the same lines."""
    out: List[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum()
                                                                        or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]{0,16})\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i + m.end())
            end = n if end < 0 else end + len(m.group(1)) + 2
            body = text[i:end]
            out.append(body if keep_strings else '""' + re.sub(r"[^\n]", " ", body[2:]))
            i = end
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(text[i:j] if keep_strings else c + " " * (j - i - 2) + c)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def c_string(literals: str) -> str:
    """The value of adjacent C string literals (simple escapes only)."""
    parts = re.findall(r'"((?:[^"\\]|\\.)*)"', literals)
    return "".join(bytes(p, "utf-8").decode("unicode_escape") for p in parts)


def markdown_table_rows(text: str) -> Iterator[List[str]]:
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"^\|\s*-", line):
            yield [cell.strip() for cell in line.strip().strip("|").split("|")]


# ------------------------------------------------------------------------------- metrics

BUILD_RE = re.compile(r"\bBuild(Counter|Gauge|Histogram|Summary|Info)\s*\(\s*\)")
NAME_ARG_RE = re.compile(r"\.\s*Name\s*\(")
LABEL_PAIR_RE = re.compile(r'\{\s*"([^"]*)"\s*,\s*"([^"]*)"\s*\}')


def _call_args(text: str, open_paren: int) -> str:
    """The text between the parenthesis at `open_paren` and its match."""
    depth = 0
    for j in range(open_paren, len(text)):
        if text[j] == "(":
            depth += 1
        elif text[j] == ")":
            depth -= 1
            if depth == 0:
                return text[open_paren + 1:j]
    raise ValueError("unbalanced parentheses")


class Metric:
    def __init__(self, name: str, kind: str) -> None:
        self.name = name
        self.kinds: Set[str] = {kind}
        self.sites: List[str] = []
        # label -> literal values given it; labels given a non-literal value somewhere.
        self.values: Dict[str, Set[str]] = collections.defaultdict(set)
        self.open_labels: Set[str] = set()


def _add_labels(metric: Metric, args: str) -> None:
    literal = {k for k, _ in LABEL_PAIR_RE.findall(args)}
    for k, v in LABEL_PAIR_RE.findall(args):
        metric.values[k].add(v)
    for k in re.findall(r'\{\s*"([^"]*)"\s*,\s*[^"\s]', args):
        if k not in literal:
            metric.open_labels.add(k)


def registered_metrics() -> Tuple[Dict[str, Metric], List[str]]:
    """The metrics the sources register, and the problems found reading them."""
    metrics: Dict[str, Metric] = {}
    problems: List[str] = []
    for path in cxx_sources():
        text = strip_cxx(path.read_text(errors="replace"), keep_strings=True)
        for m in BUILD_RE.finditer(text):
            where = f"{rel(path)}:{line_of(text, m.start())}"
            register = text.find(".Register(", m.end())
            if register < 0:
                register = re.search(r"\.\s*Register\s*\(", text[m.end():])
                register = -1 if register is None else m.end() + register.start()
            if register < 0:
                problems.append(f"{where}: Build{m.group(1)}() without .Register(")
                continue
            chain = text[m.end():register]
            names = list(NAME_ARG_RE.finditer(chain))
            if len(names) != 1:
                problems.append(f"{where}: Build{m.group(1)}() with {len(names)} .Name( calls")
                continue
            arg = _call_args(chain, m.end() + names[0].end() - 1 - m.end()).strip()
            if re.fullmatch(r'(?:"(?:[^"\\]|\\.)*"\s*)+', arg):
                produced = [c_string(arg)]
            else:
                key = (rel(path), re.sub(r"\s+", " ", arg))
                if key not in COMPOSED_METRIC_NAMES:
                    problems.append(f"{where}: a metric name composed at run time, {arg!r}: "
                                    "list it in COMPOSED_METRIC_NAMES with the names it makes")
                    continue
                produced = COMPOSED_METRIC_NAMES[key]
            for name in produced:
                metric = metrics.get(name)
                if metric is None:
                    metric = metrics[name] = Metric(name, m.group(1))
                metric.kinds.add(m.group(1))
                metric.sites.append(where)
                # Labels: `.Register(...).Add({...})` chained, or `auto& family = Build...`
                # and `family.Add({...})` later in the file.
                reg_args = _call_args(text, text.index("(", register))
                after = register + len(".Register(") + len(reg_args) + 1
                chained = re.match(r"\s*\.\s*Add\s*\(", text[after:])
                if chained:
                    _add_labels(metric, _call_args(text, after + chained.end() - 1))
                var = re.search(r"(?:auto|prometheus::Family<\s*prometheus::\w+\s*>)\s*&\s*(\w+)"
                                r"\s*=\s*(?:&\s*)?(?:prometheus::)?$", text[:m.start()])
                if var:
                    for add in re.finditer(r"\b" + re.escape(var.group(1))
                                           + r"\s*\.\s*Add\s*\(", text[after:]):
                        _add_labels(metric, _call_args(text, after + add.end() - 1))
    return metrics, problems


def documented_metrics() -> Dict[str, str]:
    """docs/metrics.md's table: metric name -> its labels cell."""
    out = {}
    for cells in markdown_table_rows((REPO / "docs/metrics.md").read_text()):
        m = re.fullmatch(r"`(cubetorchfs_[a-z0-9_]+)`", cells[0])
        if m and len(cells) >= 2:
            out[m.group(1)] = cells[1]
    return out


def test_metric_names_are_known() -> None:
    metrics, problems = registered_metrics()
    assert not problems, "\n".join(problems)
    assert len(metrics) >= 10, f"the scan found only {sorted(metrics)}: is BUILD_RE stale?"
    bad = [f"{n} ({', '.join(m.sites)})" for n, m in metrics.items()
           if not re.fullmatch(r"cubetorchfs_[a-z][a-z0-9_]*", n)]
    assert not bad, f"metric names must be cubetorchfs_snake_case: {bad}"
    unused = [k for k in COMPOSED_METRIC_NAMES
              if k[1] not in re.sub(r"\s+", " ", (REPO / k[0]).read_text(errors="replace"))]
    assert not unused, f"COMPOSED_METRIC_NAMES entries no longer in the sources: {unused}"


def test_every_registered_metric_is_documented_and_every_documented_one_registered() -> None:
    metrics, _ = registered_metrics()
    documented = documented_metrics()
    missing = sorted(set(metrics) - set(documented))
    stale = sorted(set(documented) - set(metrics))
    assert not missing and not stale, (
        f"docs/metrics.md documents {len(documented)} metrics, the sources register "
        f"{len(metrics)}.\nRegistered, not documented: "
        + ", ".join(f"{n} ({metrics[n].sites[0]})" for n in missing)
        + f"\nDocumented, not registered: {stale}")


def test_documented_label_values_are_the_registered_ones() -> None:
    metrics, _ = registered_metrics()
    documented = documented_metrics()
    problems = []
    for name, metric in sorted(metrics.items()):
        cell = documented.get(name)
        if cell is None:
            continue  # reported by the test above
        for label, values in sorted(metric.values.items()):
            m = re.search(r"`" + re.escape(label) + r"`=((?:`[^`]*`,?)+)", cell)
            if m is None:
                problems.append(f"{name}: label {label} (values {sorted(values)}) not in the "
                                f"doc's labels cell {cell!r}")
                continue
            doc_values = set(re.findall(r"`([^`]*)`", m.group(1)))
            if values - doc_values:
                problems.append(f"{name}{{{label}}}: registered {sorted(values - doc_values)}, "
                                f"not documented (the doc says {sorted(doc_values)})")
            if label not in metric.open_labels and doc_values - values:
                problems.append(f"{name}{{{label}}}: documented {sorted(doc_values - values)}, "
                                f"never registered (the sources give {sorted(values)})")
    assert not problems, "\n".join(problems)


def test_every_metric_named_anywhere_is_registered() -> None:
    """Docs, the Prometheus rules and Grafana dashboard, and the Python that scrapes /metrics
    (tests, benchmarks, scripts) name only registered metrics (a histogram also as its
    _bucket/_sum/_count series)."""
    metrics, _ = registered_metrics()
    series = set(metrics)
    for name, metric in metrics.items():
        if metric.kinds & {"Histogram", "Summary"}:
            series |= {name + "_bucket", name + "_sum", name + "_count"}
    files = sorted(REPO.glob("docs/*.md")) + [REPO / "README.md"]
    files += sorted(REPO.glob("conf/prometheus/*")) + sorted(REPO.glob("conf/grafana/*"))
    for top in ("tests", "bench", "scripts", "hooks"):
        files += sorted(p for p in (REPO / top).rglob("*.py") if p != Path(__file__).resolve())
    unknown = collections.defaultdict(set)
    for path in files:
        if not path.is_file():
            continue
        for token in re.findall(r"\bcubetorchfs_[a-z][a-z0-9_]*", path.read_text(errors="replace")):
            if token not in series and token not in NOT_METRICS:
                unknown[token].add(rel(path))
    assert not unknown, "metrics named but never registered:\n" + "\n".join(
        f"{t}: {sorted(f)}" for t, f in sorted(unknown.items()))


# ------------------------------------------------------------------------------- threads

HELPERS_FILE = "common/parallel.h"

# Forms that always start a thread another way (or hide one from this scan).
FORBIDDEN = [
    (re.compile(r"\bstd::jthread\b"), "std::jthread"),
    (re.compile(r"\bstd::async\b"), "std::async"),
    (re.compile(r"\bpthread_create\s*\("), "pthread_create"),
    (re.compile(r"\bboost::thread(?:_group)?\b"), "boost::thread"),
    (re.compile(r"\busing\s+std::thread\b"), "using std::thread"),
    (re.compile(r"\busing\s+namespace\s+std\s*;"), "using namespace std"),
    (re.compile(r"\.\s*detach\s*\(\s*\)"), "detach()"),
]
THREAD_TYPE = (r"(?:std::vector\s*<\s*std::thread\s*>|std::array\s*<\s*std::thread\s*,[^>]*>"
               r"|std::thread|(?:boost::)?asio::thread_pool)")
MEMBER_DECL_RE = re.compile(THREAD_TYPE + r"\s+(\w+_)\s*(?:GUARDED_BY\s*\([^)]*\)\s*)?;")
VECTOR_DECL_RE = re.compile(r"std::vector\s*<\s*std::thread\s*>\s+(\w+)")
POOL_RE = re.compile(r"\b(?:boost::)?asio::thread_pool\b(\s*[({]|\s+(\w+)\s*[;({=])?")


def thread_starts(files: Dict[str, str]) -> List[Tuple[str, int, str]]:
    """(file, line, form) of every thread start in `files` (path -> source) that is not one
    of the allowed forms; the sources are read with comments and literals blanked."""
    stripped = {p: strip_cxx(t, keep_strings=False) for p, t in files.items()}
    members: Dict[str, Set[str]] = collections.defaultdict(set)  # directory -> member names
    for path, text in stripped.items():
        for m in MEMBER_DECL_RE.finditer(text):
            members[path.rsplit("/", 1)[0]].add(m.group(1))
    out: List[Tuple[str, int, str]] = []
    for path, text in stripped.items():
        if path == HELPERS_FILE:
            continue
        own = members[path.rsplit("/", 1)[0]]

        def bad(offset: int, form: str) -> None:
            out.append((path, line_of(text, offset), form))

        for regex, form in FORBIDDEN:
            for m in regex.finditer(text):
                bad(m.start(), form)
        # std::thread constructed with a function: allowed only when assigned to a member.
        for m in re.finditer(r"\bstd::thread\s*(?:(\w+)\s*)?[({]", text):
            if m.group(1):
                bad(m.start(), f"local std::thread {m.group(1)}")
                continue
            assigned = re.search(r"(\w+)\s*=\s*$", text[:m.start()])
            if assigned is None:
                bad(m.start(), "temporary std::thread")
            elif assigned.group(1) not in own:
                bad(m.start(), f"std::thread assigned to local {assigned.group(1)}")
        # Threads added to a vector of them: allowed for a member vector only.
        local_vectors = {m.group(1) for m in VECTOR_DECL_RE.finditer(text)} - own
        for name in local_vectors:
            for m in re.finditer(r"\b" + re.escape(name) + r"\s*\.\s*(?:emplace_back|push_back|"
                                 r"emplace)\s*\(", text):
                bad(m.start(), f"std::thread in local vector {name}")
        # Asio thread pools: members only.
        for m in POOL_RE.finditer(text):
            if m.group(2) and m.group(2) in own:
                continue
            if m.group(1) and m.group(1).strip().startswith(("(", "{")) or m.group(2):
                bad(m.start(), "asio::thread_pool not a member")
    return out


def unjoined_members(files: Dict[str, str]) -> List[str]:
    """Thread members (std::thread, vectors of them, Asio pools) no code of their directory
    joins: a service loop is joined by its owner."""
    stripped = {p: strip_cxx(t, keep_strings=False) for p, t in files.items()}
    by_dir: Dict[str, str] = collections.defaultdict(str)
    for path, text in stripped.items():
        by_dir[path.rsplit("/", 1)[0]] += text + "\n"
    out = []
    for path, text in stripped.items():
        for m in MEMBER_DECL_RE.finditer(text):
            name, code = m.group(1), by_dir[path.rsplit("/", 1)[0]]
            n = re.escape(name)
            joined = (re.search(r"\b" + n + r"\s*\.\s*join\s*\(", code)
                      or re.search(r":\s*" + n + r"\s*\)\s*(\w+)\s*\.\s*join\s*\(", code)
                      or re.search(r"std::move\s*\(\s*" + n + r"\s*\)", code))
            if not joined:
                out.append(f"{path}:{line_of(text, m.start())}: {name}")
    return out


def _source_map() -> Dict[str, str]:
    return {rel(p): p.read_text(errors="replace") for p in cxx_sources()}


def test_threads_start_only_through_the_named_helpers() -> None:
    found = collections.Counter((p, form) for p, _, form in thread_starts(_source_map()))
    known = collections.Counter(KNOWN_VIOLATIONS)
    new = found - known
    lines = [f"{p}:{line}: {form}" for p, line, form in thread_starts(_source_map())
             if (p, form) in new]
    assert not new, (
        "threads started another way than docs/architecture.md allows (a service loop that is "
        "a member started and joined by its owner, or RunOnThreads, RunOnThreadsWithTick, "
        f"RunDetached of {HELPERS_FILE}):\n" + "\n".join(lines))


def test_known_thread_violations_are_still_there() -> None:
    found = collections.Counter((p, form) for p, _, form in thread_starts(_source_map()))
    gone = collections.Counter(KNOWN_VIOLATIONS) - found
    assert not gone, f"fixed, so remove from KNOWN_VIOLATIONS: {sorted(gone.elements())}"


def test_thread_members_are_joined_by_their_owner() -> None:
    assert not unjoined_members(_source_map())


def test_the_doc_names_every_thread_helper() -> None:
    text = (REPO / HELPERS_FILE).read_text()
    helpers = (re.findall(r"^inline\s+\w+\s+(\w+)\s*\(", text, re.M)
               + re.findall(r"^class\s+(\w+)", text, re.M))
    assert "RunOnThreads" in helpers, helpers
    doc = (REPO / "docs/architecture.md").read_text()
    section = doc[doc.index("## Threads and locks"):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    missing = [h for h in helpers if f"`{h}`" not in section]
    assert not missing, f"docs/architecture.md, Threads and locks, does not name {missing}"


@pytest.mark.parametrize("code, forms", [
    ("void F() { auto f = std::async(std::launch::async, G); }", ["std::async"]),
    ("void F() { pthread_t t; pthread_create(&t, nullptr, G, nullptr); }", ["pthread_create"]),
    ("void F() { std::jthread t([] {}); }", ["std::jthread"]),
    ("void F() { std::thread t([] {}); t.join(); }", ["local std::thread t"]),
    ("void F() { std::thread([] {}).detach(); }", ["temporary std::thread", "detach()"]),
    ("void F() { std::thread t; t = std::thread(G); t.join(); }",
     ["std::thread assigned to local t"]),
    ("void F() { std::vector<std::thread> v; v.emplace_back(G); for (auto& t : v) t.join(); }",
     ["std::thread in local vector v"]),
    ("void F() { asio::thread_pool pool(4); pool.join(); }", ["asio::thread_pool not a member"]),
    ("using std::thread;\nvoid F() { thread t(G); }", ["using std::thread"]),
    ("boost::thread t(G);", ["boost::thread"]),
])
def test_the_thread_scan_catches_each_other_form(code: str, forms: List[str]) -> None:
    found = [form for _, _, form in thread_starts({"x/new_file.cc": code})]
    assert sorted(found) == sorted(forms)


def test_the_thread_scan_passes_the_allowed_forms() -> None:
    header = ("class A {\n std::thread loop_;\n std::vector<std::thread> workers_;\n"
              " asio::thread_pool pool_;\n std::thread prober_ GUARDED_BY(mu_);\n};\n")
    code = ('// std::thread([] {}).detach(); in a comment\n'
            'const char* s = "std::async(pthread_create)";\n'
            "A::A() : pool_(4) { loop_ = std::thread([this] { Loop(); });\n"
            "  for (int i = 0; i < 4; ++i) workers_.emplace_back([this] { Work(); });\n"
            "  prober_ = std::thread([this] { Probe(); });\n"
            "  int n = std::thread::hardware_concurrency();\n"
            "  RunOnThreads(n, [] {}); RunDetached([] {}); }\n"
            "A::~A() { loop_.join(); for (auto& t : workers_) t.join(); pool_.join();\n"
            "  std::thread t = std::move(prober_); if (t.joinable()) t.join(); }\n")
    files = {"x/a.h": header, "x/a.cc": code}
    assert thread_starts(files) == []
    assert unjoined_members(files) == []
    assert unjoined_members({"x/a.h": header}) == [
        "x/a.h:2: loop_", "x/a.h:3: workers_", "x/a.h:4: pool_", "x/a.h:5: prober_"]


# -------------------------------------------------------------------------------- routes

ROUTE_ROW_RE = re.compile(r"^\| `(GET|POST|DELETE|PUT|PATCH|HEAD) (/[^` ]*)`", re.M)


def served_routes() -> Tuple[Set[Tuple[str, str]], str]:
    """(METHOD, pattern) of every route the control server serves, and where it was read."""
    table = REPO / "control/routes.h"
    if table.exists():
        text = strip_cxx(table.read_text(), keep_strings=True)
        routes = {(m.group(1).rstrip("_").upper(), m.group(2))
                  for m in re.finditer(r'\bverb::(\w+)\s*,\s*"(/[^"]*)"', text)}
        return routes, "control/routes.h"
    return handle_routes((REPO / "control/control_routes.cc").read_text()), \
        "ServerImpl::Handle in control/control_routes.cc"


def handle_routes(source: str) -> Set[Tuple[str, str]]:
    """The routes ServerImpl::Handle serves by comparing the target itself (the code before
    control/routes.h): `target == "/x"` conditions, each with the method its block requires
    (`method != http::verb::post`), and `target.rfind(prefix + "/", 0) == 0` blocks with a
    `suffix` variable, for the routes with a stream id ("{id}")."""
    text = strip_cxx(source, keep_strings=True)
    start = re.search(r"\bReply\s+ServerImpl::Handle\s*\(", text)
    assert start, "no ServerImpl::Handle in control/control_routes.cc"
    body_start = text.index("{", start.end())
    depth, end = 0, body_start
    for end in range(body_start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            break
    body = text[body_start:end + 1]
    constants = dict(re.findall(r'\bstd::string\s+(\w+)\s*=\s*"([^"]*)"', body))
    routes: Set[Tuple[str, str]] = set()

    def block_after(offset: int, within: str = body) -> str:
        """The braced block that starts at the first "{" from `offset`."""
        i = within.index("{", offset)
        d = 0
        for j in range(i, len(within)):
            d += {"{": 1, "}": -1}.get(within[j], 0)
            if d == 0:
                return within[i:j + 1]
        return within[i:]

    def method_in(block: str) -> str:
        m = re.search(r"method\s*!=\s*http::verb::(\w+)", block)
        assert m, f"no method check in {block[:80]!r}"
        return m.group(1).rstrip("_").upper()

    if_re = re.compile(r"\bif\s*\(((?:[^()]|\((?:[^()]|\([^()]*\))*\))*)\)\s*\{")  # 2 levels
    for m in if_re.finditer(body):
        cond = m.group(1)
        targets = re.findall(r'\btarget\s*==\s*"(/[^"]*)"', cond)
        targets += [constants[v] for v in re.findall(r"\btarget\s*==\s*(\w+)\b", cond)
                    if v in constants]
        if targets:
            method = method_in(block_after(m.start()))
            routes |= {(method, t) for t in targets}
            continue
        prefix = re.search(r'\btarget\.rfind\s*\(\s*(\w+)\s*\+\s*"/"\s*,\s*0\s*\)\s*==\s*0', cond)
        if prefix and prefix.group(1) in constants:
            block = block_after(m.start())
            base = constants[prefix.group(1)] + "/{id}"
            suffix = re.search(r'\bstd::string\s+suffix\s*=\s*"(/[^"]*)"', block)
            inner = list(if_re.finditer(block))
            for k in inner:
                sub = block_after(k.start(), block)
                if "suffix" in k.group(1) and suffix:
                    routes.add((method_in(sub), base + suffix.group(1)))
                elif "find('/')" in k.group(1).replace(" ", ""):
                    routes.add((method_in(sub), base))
    return routes


def documented_routes() -> List[Tuple[str, str]]:
    return ROUTE_ROW_RE.findall((REPO / "docs/control-api.md").read_text())


def test_documented_routes_are_the_served_routes() -> None:
    served, source = served_routes()
    assert len(served) >= 8, f"only {sorted(served)} read from {source}: is the scan stale?"
    rows = documented_routes()
    dupes = [r for r, n in collections.Counter(rows).items() if n > 1]
    assert not dupes, f"docs/control-api.md lists these routes twice: {dupes}"
    documented = set(rows)
    assert documented == served, (
        f"served ({source}), not in docs/control-api.md's table: {sorted(served - documented)}"
        f"\ndocumented, not served: {sorted(documented - served)}")


def test_the_route_table_is_what_handle_dispatches() -> None:
    """With control/routes.h, Handle matches through it and every RouteId has its case."""
    table = REPO / "control/routes.h"
    if not table.exists():
        pytest.skip("no control/routes.h: Handle compares targets itself (read above)")
    header = strip_cxx(table.read_text(), keep_strings=False)
    enum = re.search(r"enum\s+class\s+RouteId\s*\{([^}]*)\}", header)
    assert enum, "no RouteId in control/routes.h"
    ids = set(re.findall(r"\b(k\w+)\b", enum.group(1)))
    rows = set(re.findall(r"\{\s*RouteId::(k\w+)\s*,", header))
    assert ids == rows, f"RouteIds without a row in kRoutes: {sorted(ids - rows)}"
    handler = strip_cxx((REPO / "control/control_routes.cc").read_text(), keep_strings=False)
    assert re.search(r"\bMatchRoute\s*\(", handler), "Handle does not match through the table"
    cases = set(re.findall(r"\bcase\s+RouteId::(k\w+)\s*:", handler))
    assert ids <= cases, f"routes without a case in Handle: {sorted(ids - cases)}"


def _normalize(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{id}", path)


def test_routes_mentioned_or_called_are_served() -> None:
    """A `METHOD /path` in any doc, and every request the hook or the daemon's own commands
    make, names a served route (or the metrics port's)."""
    served, source = served_routes()
    allowed = served | EXPORTER_ROUTES
    problems = []
    for path in sorted(REPO.glob("docs/*.md")) + [REPO / "README.md"]:
        for m in re.finditer(r"\b(GET|POST|DELETE|PUT|PATCH) `?(/[A-Za-z0-9_/{}.-]*[A-Za-z0-9_}])",
                             path.read_text()):
            if (m.group(1), _normalize(m.group(2))) not in allowed:
                problems.append(f"{rel(path)}: {m.group(1)} {m.group(2)}")
    calls = [(p, r'\brequest\(\s*"(\w+)"\s*,\s*f?"(/[^"]*)"')
             for p in sorted((REPO / "hooks/cube_torch").glob("*.py"))]
    calls += [(p, r'\bCall\(\s*"(\w+)"\s*,\s*"(/[^"]*)"') for p in cxx_sources()]
    for path, regex in calls:
        for method, target in re.findall(regex, path.read_text(errors="replace")):
            if (method, _normalize(target)) not in allowed:
                problems.append(f"{rel(path)} calls {method} {target}")
    assert not problems, f"not served ({source}):\n" + "\n".join(problems)


def test_the_handle_scan_reads_target_comparisons() -> None:
    """The fallback for a tree without control/routes.h, on the shape Handle had then."""
    source = '''
Reply ServerImpl::Handle(Request& req, const Caller& caller, bool can_pass_fd, int sock) {
  const std::string streams = "/v1/streams";
  if (target == "/v1/files/open") {
    if (method != http::verb::post) return {Error(http::status::method_not_allowed, "", v)};
  }
  if (target == "/batchdownload/path" || target == "/v1/warmup") {
    if (method != http::verb::post) return {Error(http::status::method_not_allowed, "", v)};
    if (target == "/v1/warmup") return {Warmup(req, caller)};
  }
  if (target == "/v1/stats") {
    if (method != http::verb::get) return {Error(http::status::method_not_allowed, "", v)};
  }
  if (target == streams) {
    if (method != http::verb::post) return {Error(http::status::method_not_allowed, "", v)};
  }
  if (target.rfind(streams + "/", 0) == 0) {
    std::string rest = target.substr(streams.size() + 1);
    const std::string suffix = "/paths";
    if (rest.size() > suffix.size() &&
        rest.compare(rest.size() - suffix.size(), suffix.size(), suffix) == 0) {
      if (method != http::verb::post) return {Error(http::status::method_not_allowed, "", v)};
    }
    if (rest.find('/') == std::string::npos && !rest.empty()) {
      if (method != http::verb::delete_) return {Error(http::status::method_not_allowed, "", v)};
    }
  }
  return {ErrorFrom(http::status::not_found, Status::NotSupported("no route " + target), v)};
}
'''
    assert handle_routes(source) == {
        ("POST", "/v1/files/open"), ("POST", "/batchdownload/path"), ("POST", "/v1/warmup"),
        ("GET", "/v1/stats"), ("POST", "/v1/streams"), ("POST", "/v1/streams/{id}/paths"),
        ("DELETE", "/v1/streams/{id}")}


# ----------------------------------------------------------------------------- pjdfstest

EXPECTED_FAILURES = REPO / "tests/posix/expected_failures.txt"


def _load_pjdfstest_module():
    spec = importlib.util.spec_from_file_location("pjdfstest_runner",
                                                  REPO / "tests/posix/pjdfstest.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


NUM = r"(\d{1,3}(?:,\d{3})*|\d+)"  # 8798 or 8,798


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def expected_for(backend: str, profile: str) -> list:
    """The entries of the expected-failures file for a run, as the runner loads them."""
    return _load_pjdfstest_module().load_expected(EXPECTED_FAILURES, backend, profile)


def stated_in_file() -> Optional[Tuple[int, int]]:
    """(passed, total) the file's own s3 header says."""
    m = re.search(r"--backend s3[^\n]*\n#[^\n]*?" + NUM + " of " + NUM + " pass",
                  EXPECTED_FAILURES.read_text())
    return (_number(m.group(1)), _number(m.group(2))) if m else None


def pjdfstest_table_rows() -> Dict[str, Tuple[int, int, str, str]]:
    """docs/testing.md's pjdfstest table: 'backend, profile' -> (passed, total, percent
    text, expected failures cell)."""
    out = {}
    for cells in markdown_table_rows((REPO / "docs/testing.md").read_text()):
        if len(cells) != 3:
            continue
        m = re.fullmatch(NUM + " of " + NUM + r" \(([\d.]+) %\)", cells[1])
        if m:
            out[cells[0]] = (_number(m.group(1)), _number(m.group(2)), m.group(3), cells[2])
    return out


def test_s3_pjdfstest_counts_agree_with_the_expected_failures_file() -> None:
    rows = pjdfstest_table_rows()
    s3 = [k for k in rows if k.startswith("s3")]
    assert len(s3) == 1, f"docs/testing.md: want one s3 row in the pjdfstest table: {rows}"
    profile = s3[0].rsplit(",", 1)[1].strip()
    passed, total, percent, failures = rows[s3[0]]
    entries = expected_for("s3", profile)
    # Each entry names a test file (no globs: one file each); a `*` entry expects at least one
    # failure of its file, a numbered one each listed test. The doc counts files.
    globbed = [e.pattern for e in entries if any(ch in e.pattern for ch in "*?[")]
    assert not globbed, f"entries naming several files; count them by hand: {globbed}"
    files = {e.pattern for e in entries}
    m = re.fullmatch(NUM + " test files, each with its reason", failures)
    assert m, f"docs/testing.md s3 row: {failures!r}"
    assert _number(m.group(1)) == len(files), (
        f"docs/testing.md says {m.group(1)} test files fail on s3, "
        f"tests/posix/expected_failures.txt lists {len(files)}")
    assert all(e.reason for e in entries)
    assert f"{100 * passed / total:.1f}" == percent, (passed, total, percent)
    assert stated_in_file() == (passed, total), (
        f"tests/posix/expected_failures.txt says {stated_in_file()} (passed, total), "
        f"docs/testing.md {passed, total}")
    readme = re.search(r"s3 backend " + NUM + r"\s+of " + NUM, (REPO / "README.md").read_text())
    assert readme, "README.md no longer states the s3 pjdfstest count"
    assert (_number(readme.group(1)), _number(readme.group(2))) == (passed, total), (
        f"README.md says {readme.group(1)} of {readme.group(2)}, docs/testing.md "
        f"{passed:,} of {total:,}")


def test_posix_pjdfstest_rows_expect_no_failures() -> None:
    rows = pjdfstest_table_rows()
    posix = {k: v for k, v in rows.items() if k.startswith("posix")}
    assert posix, rows
    totals = {v[1] for v in rows.values()}
    assert len(totals) == 1, f"the rows disagree on the number of tests: {rows}"
    for key, (passed, total, percent, failures) in posix.items():
        profile = key.rsplit(",", 1)[1].strip()
        entries = expected_for("posix", profile)
        if failures == "none":
            assert passed == total and not entries, (key, [e.pattern for e in entries])
    readme = re.search(r"posix backend " + NUM + " of " + NUM, (REPO / "README.md").read_text())
    assert readme and {_number(readme.group(1)), _number(readme.group(2))} <= totals | {
        v[0] for v in posix.values()}, readme


# -------------------------------------------------------------------------------- packages

# What a fresh machine reaches is Debian's archive and PyPI; nothing may install or run a
# package from npm (docs/testing.md: "nothing from npm").
NPM_RE = re.compile(r"\b(?:npm|npx|yarn|pnpm|s3rver|nodejs)\b|\bnode\s+\S+\.js\b")


def test_nothing_comes_from_npm() -> None:
    """No script, test, benchmark, build or packaging file installs or runs anything from
    npm (history in Markdown may name s3rver; code may not)."""
    roots = ["scripts", "tests", "bench", ".ci", "packaging", "hooks"]
    offenders = []
    for root in roots:
        for p in sorted((REPO / root).rglob("*")):
            if not p.is_file() or p.suffix in {".md", ".pyc"} or "corpus" in p.parts:
                continue
            if p == Path(__file__).resolve():
                continue
            try:
                text = p.read_text(errors="strict")
            except (UnicodeDecodeError, OSError):
                continue  # binary
            for n, line in enumerate(text.splitlines(), 1):
                if NPM_RE.search(line):
                    offenders.append(f"{p.relative_to(REPO)}:{n}: {line.strip()[:100]}")
    for p in REPO.rglob("CMakeLists.txt"):
        if "build" not in p.relative_to(REPO).parts[0] and NPM_RE.search(p.read_text()):
            offenders.append(str(p.relative_to(REPO)))
    assert not offenders, "npm is not reachable here:\n" + "\n".join(offenders)


def test_the_npm_pattern_catches_its_forms() -> None:
    for line in ("npm install -g s3rver", "npx s3rver -d /tmp", "node server.js",
                 "subprocess.run(['s3rver', '--port', '4569'])"):
        assert NPM_RE.search(line), line
    for line in ("a node whose page cache", "node_count = 3", "Node n = Parse(path)"):
        assert not NPM_RE.search(line), line


# --- layering: the folders' includes point one way (docs/architecture.md, "Dependencies point
# one way"). Each folder's floor; a source may include a folder on a lower floor only. control/
# sits beside fs/ and reads files through the FileReader it is given, so it includes nothing of
# cache/ either (one read policy: fs/'s).
FLOORS = {"common": 0, "conf": 1, "crypto": 1, "cuda": 1, "cfs_client": 2, "loader": 2,
          "cache": 3, "prefetch": 4, "fs": 5, "control": 5, "fuse": 6, "daemon": 7}
NOT_INCLUDED_BY = {"control": {"cache", "fs", "fuse"}}


def folder_includes() -> Dict[str, Set[Tuple[str, str]]]:
    """For each source folder, the (file, folder) pairs of its includes of other folders."""
    out: Dict[str, Set[Tuple[str, str]]] = collections.defaultdict(set)
    for folder in FLOORS:
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix not in SOURCE_EXTS:
                continue
            for m in re.finditer(r'^\s*#\s*include\s+"([a-z_]+)/', path.read_text(errors="replace"),
                                 re.M):
                if m.group(1) != folder:
                    out[folder].add((rel(path), m.group(1)))
    return out


def test_every_source_folder_has_a_floor() -> None:
    folders = {p.parent.name for p in REPO.glob("*/CMakeLists.txt")}
    assert folders - NOT_SOURCES - set(FLOORS) == set(), "give each new folder a floor in FLOORS"


def test_includes_point_down_the_floors() -> None:
    up = [f"{f} includes {to}/ (floor {FLOORS.get(to)} >= {FLOORS[src]})"
          for src, pairs in folder_includes().items() for f, to in sorted(pairs)
          if to not in FLOORS or FLOORS[to] >= FLOORS[src]]
    assert up == [], "an include that climbs back or sideways:\n" + "\n".join(up)


def test_control_includes_nothing_of_the_cache_or_the_file_system() -> None:
    bad = [f"{f} includes {to}/" for src, banned in NOT_INCLUDED_BY.items()
           for f, to in sorted(folder_includes()[src]) if to in banned]
    assert bad == [], "\n".join(bad)
    doc = (REPO / "docs" / "architecture.md").read_text()
    assert "includes nothing of cache/" in doc


# --- the survival table: docs/architecture.md's "What survives a crash and an upgrade" names
# every message of the supervisor-worker channel (daemon/supervisor.h), and no other.
def channel_messages() -> Set[str]:
    text = (REPO / "daemon" / "supervisor.h").read_text()
    enum = re.search(r"enum ChannelMessage : char \{(.*?)\};", text, re.S)
    assert enum, "daemon/supervisor.h: enum ChannelMessage not found"
    return set(re.findall(r"\b(kMsg[A-Za-z]+)\s*=", enum.group(1)))


def survival_table() -> str:
    doc = (REPO / "docs" / "architecture.md").read_text()
    m = re.search(r"### What survives a crash and an upgrade\n(.*?)\n#", doc, re.S)
    assert m, "docs/architecture.md: no section 'What survives a crash and an upgrade'"
    rows = [line for line in m.group(1).splitlines() if line.startswith("|")]
    assert len(rows) > 2, "the survival table has no rows"
    return "\n".join(rows)


def test_the_survival_table_names_every_channel_message_and_no_other() -> None:
    table = survival_table()
    named = set(re.findall(r"`(kMsg[A-Za-z]+)`", table))
    messages = channel_messages()
    assert messages - named == set(), "messages the survival table leaves out"
    assert named - messages == set(), "messages the survival table names that do not exist"


def test_the_survival_table_has_a_crash_and_an_upgrade_column() -> None:
    header = survival_table().splitlines()[0]
    assert "after a crash" in header and "after an upgrade" in header, header
    for row in survival_table().splitlines()[2:]:
        assert row.count("|") == 5, f"a row of four cells: {row}"
