"""The training loop's tail that several tests share."""

from __future__ import annotations

import torch


def backward_and_step(
    loss: torch.Tensor, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
) -> None:
    """``loss.backward(); opt.step()``, through ``scaler`` (scale, step, update) when given."""
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
