"""Fixtures for the security tests: the integration tests' harness and fixtures (`cube`, the
per-test watchdog, the check for leftover mounts) and their CI rule for skips, reused from
tests/integration."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_INTEGRATION = Path(__file__).resolve().parents[1] / "integration"
if str(_INTEGRATION) not in sys.path:
    sys.path.insert(0, str(_INTEGRATION))

# Loaded under its own name: "conftest" is this file's module name.
_spec = importlib.util.spec_from_file_location("integration_conftest", _INTEGRATION / "conftest.py")
assert _spec is not None and _spec.loader is not None
_integration = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_integration)

cube = _integration.cube
module_cube = _integration.module_cube
_watchdog = _integration._watchdog
_no_leftover_mounts = _integration._no_leftover_mounts
# Under CI, a test skipped for want of FUSE, the daemon binary, the venv or root fails
# (tests/ci_skips.py): these tests exist to try attacks as root.
_ci_skips = _integration._load_ci_skips()
_ci_skips.install(globals(), lambda: _integration.ci_skip_problems() + _ci_skips.not_root())
