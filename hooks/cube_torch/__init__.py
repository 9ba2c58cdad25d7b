"""cube_torch: tells a cubetorchfs daemon which files a PyTorch DataLoader will read next.

`import cube_torch` patches DataLoader iteration, and `open()` so that opening a file of a
cubetorchfs mount for reading skips Python's terminal check (an ioctl round trip to the daemon
before Python 3.14; see _open.py). No thread starts and no socket opens until a DataLoader
iterates over a dataset whose files are on a cubetorchfs mount. The training loop sees exactly
the indices, in the order, it would without the hook.

Environment (read when used):
  CUBE_TORCH_DISABLE=1           import does nothing at all
  VOL_NAME                       use this volume's daemon (else: the one whose mount holds
                                 the dataset's files)
  CUBE_TORCH_CONFIG_DIR          where the daemons' control files are (default /tmp)
  CUBE_TORCH_LOOKAHEAD_BATCHES   batches published ahead of the one being loaded (default 16)
  CUBE_TORCH_PATCH_OPEN=0        leave open() as it is (each open of a mount's file then asks
                                 the daemon whether it is a terminal)
  USE_BATCH_DOWNLOAD=1, or       the batch mode: DataLoader workers take each batch's files
  CUBE_TORCH_MODE=batch          from the daemon in one request and serve the dataset's opens
                                 of them from memory (see _batch.py)
  CUBE_TORCH_VERBOSE=1           print a hit-rate line every CUBE_TORCH_REPORT_S seconds
                                 (default 10)

A sample whose read fails because the daemon of its mount went away (ESTALE, ENOTCONN,
ECONNABORTED) is read again once the mount answers (see _retry.py).
"""

from __future__ import annotations

from typing import Any, Dict

from . import _common

__version__ = "0.1.0"
__all__ = ["stats", "CubeTorchWarning", "__version__", "load_file", "load", "save_file",
           "init_io_helper", "read_info", "LoadError"]

CubeTorchWarning = _common.CubeTorchWarning

from ._io import LoadError  # noqa: E402  (ctypes only; the library loads on first use)


def load_file(path, device="cpu", use_pinmem=False, use_cipher=None, num_threads=None,
              helper=None, direct_io=False, require_integrity=None, map_file=True):
    """Loads a safetensors file (plain or veTurboIO-encrypted) into a dict of tensors on
    `device`, reading it with many threads into one buffer; see _loader.load_file."""
    from . import _loader
    return _loader.load_file(path, device=device, use_pinmem=use_pinmem, use_cipher=use_cipher,
                             num_threads=num_threads, helper=helper, direct_io=direct_io,
                             require_integrity=require_integrity, map_file=map_file)


def load(file, map_location="cpu", use_pinmem=False, use_cipher=None, helper=None):
    """veTurboIO-style load: safetensors through load_file, anything else through torch.load."""
    from . import _loader
    return _loader.load(file, map_location=map_location, use_pinmem=use_pinmem,
                        use_cipher=use_cipher, helper=helper)


def save_file(tensors, path, metadata=None, use_cipher=False):
    """Writes a safetensors file atomically; use_cipher=True writes the veTurboIO encrypted
    format with a fresh IV and an integrity tag."""
    from . import _loader
    return _loader.save_file(tensors, path, metadata=metadata, use_cipher=use_cipher)


def init_io_helper(slot_bytes=16 << 20, slots=8):
    """Reusable pinned staging buffers for loads to CUDA."""
    from . import _loader
    return _loader.init_io_helper(slot_bytes, slots)


def read_info(path, use_cipher=None):
    """The validated header of a model file (tensors, metadata, sizes), without the data."""
    from . import _loader
    return _loader.read_info(path, use_cipher=use_cipher)


def stats() -> Dict[str, Any]:
    """The daemon's /v1/stats reply ({} if no daemon is reachable), plus this process's hook
    counters under "client": published, rejected, dropped, errors, skipped, unmapped, streams.
    Never raises."""
    from . import _publisher
    return _publisher.stats()


if not _common.disabled():
    from . import _batch, _hook, _open, _retry

    _hook.install()
    _hook.install_spawn()
    _retry.install()
    _open.install(_batch.serve_open if _batch.install() else None)
