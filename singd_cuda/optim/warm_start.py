"""SINGD's warm start: the factors begin at the scale of the first statistics.

With K = C = I the preconditioner (K Kᵀ) ⊗ (C Cᵀ) is the identity, and with the
default lr_cov the factors need hundreds of steps to reach the scale of the curvature:
until then SINGD is momentum SGD at ``lr``. The warm start sets K = k·I and C = c·I
(in the layer's structures) at the layer's first statistics step, before its first
factor update, with k and c at the fixed point of that update on the trace.

SINGD's factor update, with U = Π̂(aᵀa), G = Π̂(gᵀg), ū = tr̄(U), ḡ = tr̄(G): for
K = k·I and C = c·I, H_K = k²U and H_C = c²G, so

    tr̄(m̂_K) = tr̄(m̂_C) = ½[k²c²(ū ḡ + λ) − 1],

zero when k²c² = 1/(ū ḡ + λ). Only the product is determined (m̂ depends on k and c
through k²c² alone, and K ← K(I − β₁m) is multiplicative), so the split only decides
how the two factors share the scale in their storage dtype. It follows K-FAC's damped
factors, k²/c² = (ḡ + √λ)/(ū + √λ), which balances tr̄(H_K) with tr̄(H_C) and stays
bounded when one side is tiny:

    k² = √(p (ḡ + √λ)/(ū + √λ)),   c² = √(p (ū + √λ)/(ḡ + √λ)),   p = 1/(ū ḡ + λ).

IKFAC (``kfac_like``: m̂_K = ½[H_K + λ KᵀK − I]) has one fixed point per side:
k² = 1/(ū + λ), c² = 1/(ḡ + λ).

The statistics must be those of K = C = I, which is what the factors are until the
warm start; a layer whose first statistics are zero on a side (a layer after a
zero-initialised one, a LoRA A) keeps K = C = I and skips its factor update until a
statistics step that can start it. Statistics that would put k or c outside the factor
dtype (float16 factors of a layer with large inputs) skip the whole step, with a
warning and no state changed, as a factor update that overflows does: K = C = I would
leave the layer unpreconditioned.
"""

from __future__ import annotations

import math

import torch

from ..structures.base import StructuredMatrix

#: ``state[KEY]`` of a SINGD layer: False while the warm start is to happen (at the next
#: statistics step that can start it), True once it has. Without the key (``warm_start``
#: off when the factors were created, or a checkpoint saved before the warm start
#: existed, whose factors have moved already) the layer never warm starts.
KEY = "warm_started"


def init_state(group: dict, state: dict) -> None:
    """Mark a layer whose factors are created now (K = C = I) for the warm start."""
    if group["warm_start"]:
        state[KEY] = False


def scales(u: float, g: float, damping: float, kfac_like: bool) -> tuple[float, float] | None:
    """(k², c²) of the warm start from ū = tr̄(U) and ḡ = tr̄(G) (see the module
    docstring); None when the statistics cannot set a scale (a side is zero or not
    finite)."""
    if not (u > 0.0 and g > 0.0 and math.isfinite(u) and math.isfinite(g)):
        return None
    if kfac_like:
        return 1.0 / (u + damping), 1.0 / (g + damping)
    product = 1.0 / (u * g + damping)
    root = math.sqrt(damping)
    ratio = (g + root) / (u + root)
    return math.sqrt(product * ratio), math.sqrt(product / ratio)


def _fits(square: float, dtype: torch.dtype) -> bool:
    """Whether a factor entry k with k² = ``square`` and k² itself are normal numbers of
    ``dtype`` (the diagonal path stores k² in the factor dtype)."""
    info = torch.finfo(dtype)
    return math.isfinite(square) and info.tiny <= square <= info.max


def start_(
    factors: dict[str, StructuredMatrix],
    pending: dict,
    damping: float,
    kfac_like: bool,
) -> bool | None:
    """Warm-start the layer: K ← k·I, C ← c·I in place (they are I, their momenta 0), and
    the pending statistics H_K = Π̂(aᵀa), H_C = Π̂(gᵀg) (taken with K = C = I) rescaled to
    those of the new factors, k²·H_K and c²·H_C, with k and c as stored (rounded to the
    factor dtype). True: started. With nothing changed: False when the statistics cannot
    set a scale (the layer waits), None when the scale is outside the factor dtype (the
    step is to be skipped).

    ``factors``: "K", "C" as structured matrices over the layer state's tensors.
    """
    K, C = factors["K"], factors["C"]
    u = float(pending["in"].average_trace())
    g = float(pending["out"].average_trace())
    found = scales(u, g, damping, kfac_like)
    if found is None:
        return False
    if not all(_fits(s, F.dtype) for s, F in zip(found, (K, C), strict=True)):
        return None
    for factor, square, side in ((K, found[0], "in"), (C, found[1], "out")):
        factor.mul_(math.sqrt(square))
        stored = float(factor.average_trace())  # k as rounded to the factor dtype
        pending[side].mul_(stored * stored)
    return True
