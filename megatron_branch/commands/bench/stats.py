"""Summaries of repeated timings: the median with its range (noisy machines, paired runs)."""

from __future__ import annotations

import statistics
from typing import Dict, List


def spread(values: List[float]) -> Dict[str, float]:
    """``{"median", "min", "max"}`` of a list of repeats."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
