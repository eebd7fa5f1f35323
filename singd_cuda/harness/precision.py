"""The two precision axes of the grid, kept apart.

Model precision (how weights and activations are stored and computed):

============== ============================ ============ ========== ===================
mode           forward/backward             weights      GradScaler stochastic rounding
============== ============================ ============ ========== ===================
fp32           float32                      float32      no         no
bf16-amp       ``torch.autocast`` bfloat16  float32      no         no
fp16-amp       ``torch.autocast`` float16   float32      yes        no
bf16-pure      bfloat16 (``model.to``)      bfloat16     no         no
bf16-pure-sr   bfloat16 (``model.to``)      bfloat16     no         yes (our optimizers)
fp16-pure      float16 (``model.to``)       float16      yes        no
============== ============================ ============ ========== ===================

``fp16-pure`` scales the loss with a GradScaler that also unscales float16 gradients
(:class:`PureFP16GradScaler`; ``torch.amp.GradScaler`` refuses them, as AMP keeps fp32
weights): pure fp16 training with dynamic loss scaling, whose gradients, weights and
optimizer states all live in fp16's range.

Factor precision (the dtype of the Kronecker factors of K-FAC, SINGD, IKFAC and
AdaFisher): ``fp32``, ``bf16`` or ``fp16`` (fp16's range is 65504: factors that grow past
it overflow, which is what ``fp16`` tests), chosen independently of the model precision, so that
"factors stay stable in bf16" is tested on its own. AdamW has no factors (``-``), and
it has no stochastic rounding, so it does not run in ``bf16-pure-sr``; the same holds
for the peers (momentum SGD, SOAP, PSGD-Kron, Muon). The loss is
always computed from float32 logits.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn


class PureFP16GradScaler(torch.amp.GradScaler):
    """A GradScaler for float16 weights: unscales float16 gradients in place (in fp16)
    where ``torch.amp.GradScaler.unscale_`` raises "Attempting to unscale FP16
    gradients"; otherwise the same dynamic loss scaling."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


@dataclass(frozen=True)
class Precision:
    """One model-precision mode (see the module docstring for the table)."""

    name: str
    description: str
    autocast_dtype: torch.dtype | None
    weight_dtype: torch.dtype
    uses_scaler: bool
    stochastic_rounding: bool = False

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model with its parameters and buffers in the mode's weight dtype."""
        return model.to(self.weight_dtype)

    def cast_input(self, x: Tensor) -> Tensor:
        """Floating-point inputs in the weight dtype; integer inputs unchanged."""
        return x.to(self.weight_dtype) if x.is_floating_point() else x

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The autocast context of the forward pass (a no-op without autocast)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def make_scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        """A fresh GradScaler for fp16 autocast (``torch.amp.GradScaler``) and pure fp16
        (:class:`PureFP16GradScaler`), else None."""
        if not self.uses_scaler:
            return None
        if self.weight_dtype == torch.float16:
            return PureFP16GradScaler(device.type)
        return torch.amp.GradScaler(device.type)


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", "float32", None, torch.float32, False),
        Precision("bf16-amp", "bfloat16 autocast", torch.bfloat16, torch.float32, False),
        Precision("fp16-amp", "float16 autocast + GradScaler", torch.float16, torch.float32, True),
        Precision("bf16-pure", "bfloat16 weights", None, torch.bfloat16, False),
        Precision(
            "bf16-pure-sr",
            "bfloat16 weights, stochastic rounding",
            None,
            torch.bfloat16,
            False,
            stochastic_rounding=True,
        ),
        Precision("fp16-pure", "float16 weights + GradScaler", None, torch.float16, True),
    )
}

#: Factor precision name -> dtype of the Kronecker factors. "-" marks an optimizer
#: without factors (AdamW).
FACTOR_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
NO_FACTORS = "-"
