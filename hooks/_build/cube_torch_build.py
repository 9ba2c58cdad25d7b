"""The build backend of the cube_torch package (PEP 517), in the tree and stdlib only.

`pip install hooks/` then needs no index and no build dependency: pip's isolated build
environment is empty (`requires = []`), and this module builds the wheel with zipfile alone.
It writes only into the directory pip gives it, never into the source tree. The package is
pure Python: one wheel, tagged py3-none-any.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import sys
import tarfile
import zipfile
from pathlib import Path

# Python cached this module's bytecode in the source tree before running it: remove that, and
# write no more, so that a build leaves nothing in the tree.
sys.dont_write_bytecode = True
try:
    if __cached__:
        os.remove(__cached__)
        os.rmdir(os.path.dirname(__cached__))
except OSError:
    pass

NAME = "cube_torch"
VERSION = "0.1.0"
SUMMARY = ("cubetorchfs hook: publishes a PyTorch DataLoader's upcoming files to the "
           "cubetorchfs daemon, and loads model files through it")
ROOT = Path(__file__).resolve().parent.parent  # hooks/
DIST_INFO = f"{NAME}-{VERSION}.dist-info"


def _package_files() -> list[Path]:
    pkg = ROOT / NAME
    return sorted(p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts)


def _metadata() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\nSummary: {SUMMARY}\n"
            "Requires-Python: >=3.8\nRequires-Dist: torch\n"
            f"Description-Content-Type: text/markdown\n\n{readme}")


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def get_requires_for_build_wheel(config_settings=None):  # noqa: D103 (PEP 517 hook)
    return []


def get_requires_for_build_sdist(config_settings=None):  # noqa: D103
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):  # noqa: D103
    target = Path(metadata_directory) / DIST_INFO
    target.mkdir(parents=True, exist_ok=True)
    (target / "METADATA").write_text(_metadata(), encoding="utf-8")
    return DIST_INFO


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):  # noqa: D103
    wheel_name = f"{NAME}-{VERSION}-py3-none-any.whl"
    entries: list[tuple[str, bytes]] = []
    for path in _package_files():
        entries.append((path.relative_to(ROOT).as_posix(), path.read_bytes()))
    entries.append((f"{DIST_INFO}/METADATA", _metadata().encode()))
    entries.append((f"{DIST_INFO}/WHEEL", b"Wheel-Version: 1.0\nGenerator: cube_torch_build\n"
                    b"Root-Is-Purelib: true\nTag: py3-none-any\n"))
    record = [_record_line(name, data) for name, data in entries] + [f"{DIST_INFO}/RECORD,,"]
    entries.append((f"{DIST_INFO}/RECORD", ("\n".join(record) + "\n").encode()))
    out = Path(wheel_directory) / wheel_name
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as whl:
        for name, data in entries:
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            whl.writestr(info, data)
    return wheel_name


def build_sdist(sdist_directory, config_settings=None):  # noqa: D103
    base = f"{NAME}-{VERSION}"
    out = Path(sdist_directory) / f"{base}.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        for rel in ["pyproject.toml", "README.md", "_build/cube_torch_build.py",
                    *[p.relative_to(ROOT).as_posix() for p in _package_files()]]:
            tar.add(ROOT / rel, arcname=f"{base}/{rel}")
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        data = _metadata().encode()
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return out.name

