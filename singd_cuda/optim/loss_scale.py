"""The GradScaler that is stepping an optimizer, for the loss scale its statistics carry.

torch's AMP recipe ``scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt)``
unscales the gradients before the step, so ``scaler.step`` hands the optimizer
``grad_scale = None``: the gradients need nothing more. The curvature statistics
captured in the backward pass still carry the loss scale, and torch passes no way to
reach it: the scaler records the unscale in ``scaler._per_optimizer_states[id(opt)]``,
and an optimizer holds no reference to its scaler. Alternatives that do not work:
GradScaler's older contract of passing ``grad_scaler=self`` to a ``step`` that accepts
it warns (FutureWarning) at every step and then leaves the inf check to the optimizer;
and the captured statistics cannot tell the scale they were scaled by. What does work:
the scaler is the ``self`` of the :meth:`torch.amp.GradScaler.step` frame that calls
the optimizer's ``step``, a few frames up the stack; its scale tensor at that point is
the scale of the backward passes since the last ``update()``, which produced the
statistics. Reading it stays on the device (no host read).
"""

from __future__ import annotations

import sys

import torch
from torch.amp.grad_scaler import OptState

_SCALER_STEP = torch.amp.GradScaler.step.__code__
_MAX_DEPTH = 32  # frames between GradScaler.step and the optimizer's own code


def stepping_scaler(optimizer: torch.optim.Optimizer) -> torch.amp.GradScaler | None:
    """The GradScaler whose ``step`` is calling ``optimizer.step`` after it unscaled
    ``optimizer``'s gradients (every subclass of torch.amp.GradScaler inherits that
    ``step``), or None when no such call is on the stack."""
    frame = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        if frame.f_code is _SCALER_STEP:
            scaler = frame.f_locals.get("self")
            states = getattr(scaler, "_per_optimizer_states", {})
            if id(optimizer) in states and states[id(optimizer)]["stage"] is OptState.UNSCALED:
                return scaler
            return None
        frame = frame.f_back
    return None
