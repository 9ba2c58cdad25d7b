"""Under CI, a test skipped because the test environment is broken fails instead.

A developer's machine may lack FUSE, the daemon binary or libcubetorch_io, and the tests that
need them skip, with the reason printed (scripts/test.sh runs pytest with -rs). In CI the same
skips would turn a broken environment into a green run with hundreds of tests skipped, so when
the CI environment variable is set (to anything but "", "0", "false" or "no") such a skip is
reported as a failure (an error in setup, or a collection error for a module skipped as a
whole), naming the reason.

Only skips caused by an environment problem of this machine become failures: each conftest
passes `install` a function listing those problems as the exact texts the tests put in their
skip reasons (cubefs_harness.environment_problems(), the error loading libcubetorch_io, and
for the security and trust tests `NOT_ROOT`: a CI run that is not root would otherwise pass
with every attack untried). Every other skip stays a skip under CI: no GPU, no CUDA, a
Prometheus or node binary missing, a test that skips itself for its own reasons.

The conftests import it with tests/ appended to sys.path (last, so it shadows nothing).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Generator, List, Optional

import pytest


# The skip reason of tests that need root starts with this; a problem under CI (see above).
NOT_ROOT = "needs root"


def not_root() -> List[str]:
    """[NOT_ROOT] when this process is not root, else []."""
    return [NOT_ROOT] if os.geteuid() != 0 else []


def ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_reason(report: Any) -> str:
    """The reason of a skipped test or collection report ("Skipped: " stripped)."""
    longrepr = report.longrepr
    text = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


def environment_caused(reason: str, problems: List[str]) -> Optional[str]:
    """The environment problem that `reason` reports, or None if it reports none of them."""
    return next((p for p in problems if p and p in reason), None)


def _harden(report: Any, problems: Callable[[], List[str]]) -> None:
    if not report.skipped or hasattr(report, "wasxfail") or not ci():
        return
    reason = skip_reason(report)
    problem = environment_caused(reason, problems())
    if problem is None:
        return
    report.outcome = "failed"
    report.longrepr = (f"CI is set, so this skip is a failure: the test environment is broken "
                       f"({problem}). Skip reason: {reason}")


def install(namespace: Dict[str, Any], problems: Callable[[], List[str]]) -> None:
    """Defines the report hooks in a conftest's namespace (pass its globals())."""
    cache: List[List[str]] = []

    def cached() -> List[str]:  # computed once, at the first skip under CI
        if not cache:
            cache.append([p for p in problems() if p])
        return cache[0]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item: Any, call: Any) -> Generator[None, Any, None]:
        outcome = yield
        _harden(outcome.get_result(), cached)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_make_collect_report(collector: Any) -> Generator[None, Any, None]:
        outcome = yield
        _harden(outcome.get_result(), cached)

    namespace["pytest_runtest_makereport"] = pytest_runtest_makereport
    namespace["pytest_make_collect_report"] = pytest_make_collect_report

