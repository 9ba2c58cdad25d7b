#!/usr/bin/python3
"""Runs pjdfstest's test files from inside a mount and compares the failures with the expected
list (scripts/posix_conformance.sh sets the mount up; this is not a pytest module).

  pjdfstest.py MOUNT TESTS_DIR EXPECTED BACKEND PROFILE [--log FILE] [--only GLOB]

Each TESTS_DIR/**/*.t runs with /bin/sh in MOUNT (as prove would; 300 s at most each) and its
TAP output is read: a test is failed if it says `not ok` or never reports (a plan of N with
fewer results). Prints passed/total per test file and in total, then every failure that is not
in EXPECTED for BACKEND and PROFILE and every listed test that passed. Exit 0 when there are
neither, 1 otherwise.

EXPECTED lines: `BACKEND PROFILE FILE TESTS -- REASON`; BACKEND and PROFILE may be `*`, FILE a
glob of the test file relative to TESTS_DIR (`mkfifo/*.t`), TESTS `*` or numbers and ranges
(`5,8-9`). A line with numbers must still fail each of them; a `*` line must still fail at least
one test of each file it names. `#` starts a comment line.
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Expected:
    backend: str
    profile: str
    pattern: str
    tests: set[int] | None  # None: every test of the file
    reason: str
    line: int
    matched: set[str] = field(default_factory=set)  # files it named that still fail


def parse_numbers(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            out.update(range(int(a), int(b) + 1))
        elif part:
            out.add(int(part))
    return out


def load_expected(path: Path, backend: str, profile: str) -> list[Expected]:
    out = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        head, sep, reason = line.partition(" -- ")
        fields = head.split()
        if not sep or len(fields) != 4 or not reason.strip():
            sys.exit(f"{path}:{n}: want `BACKEND PROFILE FILE TESTS -- REASON`: {raw!r}")
        b, p, pattern, tests = fields
        if b not in ("*", backend) or p not in ("*", profile):
            continue
        out.append(Expected(b, p, pattern, None if tests == "*" else parse_numbers(tests),
                            reason.strip(), n))
    return out


TAP_RESULT = re.compile(r"^(not )?ok (\d+)")
TAP_PLAN = re.compile(r"^1\.\.(\d+)")


def run_file(mount: Path, test: Path) -> tuple[int, set[int], str]:
    """(planned tests, failed test numbers, output) of one test file."""
    try:
        r = subprocess.run(["/bin/sh", str(test)], cwd=mount, capture_output=True, text=True,
                           timeout=300, errors="replace")
        output = r.stdout
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
            else (e.stdout or "")
    planned, passed, failed = 0, set(), set()
    for line in output.splitlines():
        if m := TAP_PLAN.match(line):
            planned = int(m.group(1))
        elif m := TAP_RESULT.match(line):
            # `not ok N # TODO`: a failure the test itself expects (TAP); prove passes it too.
            bad = m.group(1) and "# TODO" not in line
            (failed if bad else passed).add(int(m.group(2)))
    missing = set(range(1, planned + 1)) - passed - failed
    return planned, failed | missing, output


def ranges(numbers: set[int]) -> str:
    out, run = [], []
    for n in sorted(numbers):
        if run and n == run[-1] + 1:
            run.append(n)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [n]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mount", type=Path)
    ap.add_argument("tests_dir", type=Path)
    ap.add_argument("expected", type=Path)
    ap.add_argument("backend")
    ap.add_argument("profile")
    ap.add_argument("--log", type=Path)
    ap.add_argument("--only", default="*")
    args = ap.parse_args()
    expected = load_expected(args.expected, args.backend, args.profile)
    files = sorted(p for p in args.tests_dir.rglob("*.t")
                   if fnmatch.fnmatch(p.relative_to(args.tests_dir).as_posix(), args.only))
    total = total_failed = 0
    unexpected: list[str] = []
    now_passing: list[str] = []
    log = open(args.log, "w") if args.log else None
    for test in files:
        rel = test.relative_to(args.tests_dir).as_posix()
        planned, failed, output = run_file(args.mount, test)
        if log:
            log.write(f"### {rel}\n{output}\n")
        total += planned
        total_failed += len(failed)
        print(f"{rel:24} {planned - len(failed):5}/{planned:<5}"
              + (f" failed {ranges(failed)}" if failed else ""), flush=True)
        covered: set[int] = set()
        for e in expected:
            if not fnmatch.fnmatch(rel, e.pattern):
                continue
            if e.tests is None:
                covered |= failed
                if failed:
                    e.matched.add(rel)
                elif planned:
                    now_passing.append(f"{rel}: all pass, but line {e.line} expects failures")
            else:
                covered |= e.tests
                passing = e.tests - failed
                if passing:
                    now_passing.append(f"{rel} {ranges(passing)}: pass now (line {e.line})")
        if failed - covered:
            unexpected.append(f"{args.backend} {args.profile} {rel} {ranges(failed - covered)}")
    print(f"total: {total - total_failed}/{total} passed ({100 * (total - total_failed) / max(total, 1):.2f} %), "
          f"{total_failed} failed, in {len(files)} files")
    for u in unexpected:
        print(f"UNEXPECTED failure: {u}")
    for p in now_passing:
        print(f"LISTED but passing: {p}")
    return 1 if unexpected or now_passing else 0


if __name__ == "__main__":
    sys.exit(main())
