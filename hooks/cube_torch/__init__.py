"""cube_torch: tells a cubetorchfs daemon which files a PyTorch DataLoader will read next.

`import cube_torch` patches DataLoader iteration and does nothing else: no thread starts and
no socket opens until a DataLoader iterates over a dataset whose files are on a cubetorchfs
mount. The training loop sees exactly the indices, in the order, it would without the hook.

Environment (read when used):
  CUBE_TORCH_DISABLE=1           import does nothing at all
  VOL_NAME                       use this volume's daemon (else: the one whose mount holds
                                 the dataset's files)
  CUBE_TORCH_CONFIG_DIR          where the daemons' control files are (default /tmp)
  CUBE_TORCH_LOOKAHEAD_BATCHES   batches published ahead of the one being loaded (default 16)
  CUBE_TORCH_VERBOSE=1           print a hit-rate line every CUBE_TORCH_REPORT_S seconds
                                 (default 10)
"""

from __future__ import annotations

from typing import Any, Dict

from . import _common

__version__ = "0.1.0"
__all__ = ["stats", "CubeTorchWarning", "__version__"]

CubeTorchWarning = _common.CubeTorchWarning


def stats() -> Dict[str, Any]:
    """The daemon's /v1/stats reply ({} if no daemon is reachable), plus this process's hook
    counters under "client": published, rejected, dropped, errors, skipped, unmapped, streams.
    Never raises."""
    from . import _publisher
    return _publisher.stats()


if not _common.disabled():
    from . import _hook

    _hook.install()
