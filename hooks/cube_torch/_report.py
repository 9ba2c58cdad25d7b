"""The hit-rate line CUBE_TORCH_VERBOSE=1 prints, in the original cube_torch's words.

A read counts as a hit only when it did not wait on the store; "late" reads (they waited on a
prefetch already in flight) count as misses here, so request_count = hit + late + miss and
hit_count + miss_count = request_count.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

Counts = Tuple[int, int]  # (request_count, hit_count)


def global_counts(stats: Mapping[str, Any]) -> Optional[Counts]:
    """(requests, hits) from a /v1/stats reply, or None if it has no global read counters."""
    try:
        reads = stats["global"]["reads"]
        hit, late, miss = (int(reads.get(k, 0)) for k in ("hit", "late", "miss"))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return hit + late + miss, hit


def _part(label: str, counts: Counts) -> str:
    requests, hits = counts
    rate = hits / requests if requests > 0 else 0.0
    return (f"{label}: request_count={requests} hit_count={hits} "
            f"miss_count={requests - hits} hit_rate={rate:.3f}")


def format_line(last: Counts, total: Counts) -> str:
    return "cube_torch: " + _part("last cycle", last) + "; " + _part("total", total)


class Reporter:
    """Turns successive cumulative counts into 'last cycle' + 'total' lines."""

    def __init__(self) -> None:
        self._previous: Optional[Counts] = None

    def line(self, total: Counts) -> str:
        prev = self._previous
        if prev is None or total[0] < prev[0] or total[1] < prev[1]:  # first, or daemon restarted
            prev = (0, 0)
        self._previous = total
        return format_line((total[0] - prev[0], total[1] - prev[1]), total)
