"""Seed statistics and the verdict rule of the harness.

A low-precision cell is compared with the same optimizer's fp32 cell (fp32 model, fp32
factors) on the final held-out loss, over the seeds that stayed finite; in a grid without
the fp32 model, with its cell at the grid's first model precision and fp32 factors (e.g.
bf16 autocast for a language model):

* ``failed``: at least one seed went non-finite, raised, or diverged;
* ``degraded``: mean(low) − mean(fp32) > ``REL_THRESHOLD`` · mean(fp32) **and**
  > 2 · SE, with SE = √(s²_low/n_low + s²_fp32/n_fp32) the standard error of the
  difference of the means (s the sample standard deviations over seeds);
* ``better``: the same with the sign reversed;
* ``same within noise``: otherwise.

With one seed per cell the standard error is unknown (taken as 0), so only the relative
threshold applies; the report says so.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

#: The relative threshold of the verdict rule (fraction of the fp32 mean).
REL_THRESHOLD = 0.10
#: How many standard errors of the difference a change must exceed.
NOISE_SE = 2.0

RULE = (
    f"A cell is compared with the same optimizer's fp32 cell (fp32 model, fp32 factors) "
    f"on the final held-out loss, mean over the seeds that stayed finite. "
    f"'failed': at least one seed went non-finite, raised an error or diverged (held-out "
    f"loss ended above its initial value). 'degraded': the mean is worse than fp32's by "
    f"more than {REL_THRESHOLD:.0%} of fp32's mean AND by more than {NOISE_SE:g} standard "
    f"errors of the difference, SE = sqrt(s_low^2/n_low + s_fp32^2/n_fp32) (s: sample "
    f"standard deviation over seeds). 'better': the same in the other direction. "
    f"Otherwise 'same within noise'. With one seed the SE is unknown and only the "
    f"relative threshold applies. In a grid without the fp32 model, 'fp32' reads: the "
    f"grid's first model precision with fp32 factors."
)


@dataclass(frozen=True)
class Summary:
    """Mean, sample standard deviation (0 for one value) and count of some values."""

    mean: float
    std: float
    n: int

    @property
    def se(self) -> float:
        """Standard error of the mean."""
        return self.std / math.sqrt(self.n)


def summarize(values: list[float]) -> Summary | None:
    """The :class:`Summary` of ``values``, or None when there are none."""
    if not values:
        return None
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return Summary(statistics.fmean(values), std, len(values))


def compare(low: Summary | None, ref: Summary | None) -> str:
    """The verdict of a cell whose seeds all stayed finite (``low``) against its fp32
    reference (``ref``): "degraded", "better" or "same within noise" (also when either
    side has no finite seed to compare)."""
    if low is None or ref is None:
        return "same within noise"
    diff = low.mean - ref.mean
    noise = NOISE_SE * math.sqrt(low.se**2 + ref.se**2)
    threshold = REL_THRESHOLD * abs(ref.mean)
    if diff > threshold and diff > noise:
        return "degraded"
    if -diff > threshold and -diff > noise:
        return "better"
    return "same within noise"


def verdict(low: Summary | None, ref: Summary | None, failed_seeds: int) -> str:
    """``compare`` for a cell with no failed seed, else "failed"."""
    return "failed" if failed_seeds else compare(low, ref)


def median_or_none(values: list[float | None]) -> float | None:
    """The median where ``None`` counts as +inf ("not reached"); None when the median
    itself is not reached."""
    if not values:
        return None
    ranked = sorted(math.inf if v is None else v for v in values)
    m = statistics.median(ranked)
    return None if math.isinf(m) else m
