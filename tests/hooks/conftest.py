"""Fixtures for the cube_torch hook tests: a clean hook per test, a temp control-file
directory, a "mount" directory and a fake daemon serving the /v1 control API. Under CI, a test
skipped because libcubetorch_io cannot be loaded fails instead (tests/ci_skips.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator, List

import pytest

_HOOKS = str(Path(__file__).resolve().parents[2] / "hooks")
if _HOOKS not in sys.path:
    sys.path.insert(0, _HOOKS)

from cube_torch import _hook, _paths, _publisher  # noqa: E402  (the import patches DataLoader)

from fake_control_server import FakeDaemon  # noqa: E402


def _load_ci_skips() -> Any:
    # tests/ goes last on the path, so it can shadow nothing: only ci_skips is taken from it.
    tests_dir = str(Path(__file__).resolve().parents[1])
    if tests_dir not in sys.path:
        sys.path.append(tests_dir)
    import ci_skips
    return ci_skips


_ci_skips = _load_ci_skips()


def _environment_problems() -> List[str]:
    """Why libcubetorch_io cannot be loaded here (test_loader.py skips then), if it cannot;
    and not being root (test_hook_trust.py skips then)."""
    from cube_torch import _io
    try:
        _io.lib()
    except OSError as e:
        return [str(e)] + _ci_skips.not_root()
    return _ci_skips.not_root()


# pytest_runtest_makereport, pytest_make_collect_report: environment skips fail under CI.
_ci_skips.install(globals(), _environment_problems)

_ENV = ("VOL_NAME", "CUBE_TORCH_DISABLE", "CUBE_TORCH_VERBOSE", "CUBE_TORCH_LOOKAHEAD_BATCHES",
        "CUBE_TORCH_REPORT_S")


@pytest.fixture(autouse=True)
def config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Each test: a fully installed hook, no publisher yet, an empty control-file directory."""
    for var in _ENV:
        monkeypatch.delenv(var, raising=False)
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    monkeypatch.setenv("CUBE_TORCH_CONFIG_DIR", str(cfg))
    _hook.uninstall()
    _hook.install()
    _publisher.reset()
    _paths.clear_cache()
    yield cfg
    _publisher.reset()
    _hook.uninstall()
    _hook.install()


@pytest.fixture
def mount(tmp_path: Path) -> Path:
    m = tmp_path / "mnt"
    m.mkdir()
    return m


def _start(mount: Path, config_dir: Path, mode: str) -> FakeDaemon:
    fake = FakeDaemon(str(mount), mode=mode).start()
    fake.write_control_file(str(config_dir))
    return fake


@pytest.fixture
def daemon(mount: Path, config_dir: Path) -> Iterator[FakeDaemon]:
    fake = _start(mount, config_dir, "ok")
    yield fake
    fake.stop()


@pytest.fixture
def daemon_factory(mount: Path, config_dir: Path) -> Iterator:
    started = []

    def make(mode: str = "ok") -> FakeDaemon:
        fake = _start(mount, config_dir, mode)
        started.append(fake)
        return fake

    yield make
    for fake in started:
        fake.stop()
