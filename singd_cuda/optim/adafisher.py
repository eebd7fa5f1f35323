"""AdaFisher (Gomes et al., ICLR 2025) as a structure: diagonal Kronecker factors.

DESIGN.md section 4. Per layer: h (d_K) and s (d_C), exponential moving averages
(h ← γh + (1−γ)h_new, γ = ``ema_decay``) of the mean squared layer input and
the mean squared (loss-scaled) output gradient, refreshed every T steps. The
preconditioner F̃ = s′ ⊗ h′ + λ uses the min–max normalised EMAs, as in the
paper. The update is Adam-style momentum with bias correction and no square
root: m ← βm + (1−β)g; θ ← θ − lr · (m / (1−βᵗ)) / F̃.

Departures from the official code, on purpose: its EMA (0.1γ·H + 0.01γ·H_new)
makes F̃ ≈ λ everywhere, so the paper's EMA is used; and parameters are paired
with their modules by identity, not by index.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..curvature.layers import Layer, split_matrix
from ..distributed.synchronizer import DEFAULT_BUCKET_CAP_MB
from .base import KroneckerOptimizer, LayerRule, checked_fallback, scheduled, validate_common
from .epilogue import adam_style_update_

ADAFISHER = "adafisher"


def min_max_normalise(v: Tensor) -> Tensor:
    """v scaled to [0, 1]; a constant vector maps to ones (no direction is preferred)."""
    low, high = v.min(), v.max()
    span = high - low
    return torch.where(span > 0, (v - low) / span.clamp_min(torch.finfo(v.dtype).tiny), 1.0)


class AdaFisherRule(LayerRule):
    """AdaFisher's diagonal statistics, EMA and Adam-style preconditioned update."""

    def init_state(self, layer: Layer, group: dict, state: dict) -> None:
        dtype = group["factor_dtype"] or layer.weight.dtype
        device = layer.weight.device
        state["h"] = torch.zeros(layer.dim_in, dtype=dtype, device=device)
        state["s"] = torch.zeros(layer.dim_out, dtype=dtype, device=device)

    def accumulate(self, layer, group, state, pending, a: Tensor, g: Tensor) -> None:
        """Column sums of a² and g² (a carries 1/√N, so these are means)."""
        h_new, s_new = a.square().sum(0), g.square().sum(0)
        if "in" in pending:
            pending["in"].add_(h_new)
            pending["out"].add_(s_new)
        else:
            pending["in"], pending["out"] = h_new, s_new

    def factor_structures(self, group: dict) -> tuple[str, str]:
        return (ADAFISHER, ADAFISHER)

    def update_factors(self, layer, group, state, pending, step: int) -> None:
        decay = group["ema_decay"]
        for key, new in (("h", pending["in"]), ("s", pending["out"])):
            ema = state[key].to(new.dtype).mul_(decay).add_(new, alpha=1.0 - decay)
            state[key].copy_(ema)

    def apply(self, layer, group, states, G: Tensor, step: int, generator) -> None:
        h = min_max_normalise(states[0]["h"].to(G.dtype))
        s = min_max_normalise(states[0]["s"].to(G.dtype))
        fisher = torch.outer(s, h).add_(scheduled(group["damping"], step))
        for param, state, direction, denominator in zip(
            layer.params, states, split_matrix(layer, G), split_matrix(layer, fisher), strict=True
        ):
            if param.grad is None:
                continue  # e.g. a bias frozen after construction: leave it alone
            adam_style_update_(
                param,
                direction,
                denominator,
                state,
                lr=group["lr"],
                beta=group["momentum"],
                step=step + 1,
                weight_decay=group["weight_decay"],
                decoupled=group["decoupled_weight_decay"],
                generator=generator,
            )


class AdaFisher(KroneckerOptimizer):
    """AdaFisher: ``AdaFisher(model, lr=1e-3, momentum=0.9, damping=1e-3, ema_decay=0.8,
    T=1, weight_decay=0.0, decoupled_weight_decay=False, ...)``.

    ``momentum`` is the Adam-style β. Equivalent to ``SINGD(model, structures="adafisher")``
    with these defaults. Parameters of other modules train with AdamW (``fallback_*``).
    """

    def __init__(
        self,
        model: nn.Module,
        params=None,
        lr: float = 1e-3,
        momentum: float = 0.9,
        damping: float = 1e-3,
        ema_decay: float = 0.8,
        T: int = 1,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        loss_average: str | None = "batch",
        factor_dtype: torch.dtype | None = None,
        stochastic_rounding: bool = False,
        grad_scaler: torch.amp.GradScaler | None = None,
        nonfinite: str = "warn",
        process_group=None,
        distribute_factors: bool = False,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        **fallback: Any,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            damping=damping,
            ema_decay=ema_decay,
            T=T,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            loss_average=loss_average,
            factor_dtype=factor_dtype,
            stochastic_rounding=stochastic_rounding,
        )
        defaults.update(checked_fallback(fallback))
        self._rule = AdaFisherRule()
        super().__init__(
            model,
            params,
            defaults,
            grad_scaler=grad_scaler,
            nonfinite=nonfinite,
            process_group=process_group,
            distribute_factors=distribute_factors,
            bucket_cap_mb=bucket_cap_mb,
        )

    def validate_group(self, group: dict) -> None:
        super().validate_group(group)
        validate_common(group, "momentum", "ema_decay")

    def rule_for(self, group: dict) -> LayerRule:
        return self._rule
