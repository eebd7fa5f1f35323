"""The optimizer table of the harness: one entry per optimizer, with its learning rate.

Every entry builds a ``torch.optim.Optimizer`` for the whole model from
``(model, lr, structure, factor_dtype=, grad_scaler=, loss_average=)``. Weight decay
is 0 everywhere so the runs compare preconditioners only. ``singd`` expands into one
run per structure; ``ikfac`` is SINGD with ``kfac_like=True`` and dense factors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .. import KFAC, SINGD, AdaFisher

#: Learning rate of the built-in AdamW fallback of KFAC, AdaFisher and SINGD (the
#: parameters of embeddings, LayerNorm and BatchNorm), the same as AdamW's own.
FALLBACK_LR = 3e-3
#: K-FAC's damping: its default 1e-3 (√λ ≈ 0.03 added to each factor) diverges on the
#: digits task in fp32 at any learning rate that trains.
KFAC_DAMPING = 1e-2
#: SINGD settings for runs of a few hundred steps. With the library defaults (T=10,
#: lr_cov=1e-2) the factors move from the identity by a nearly uniform scale in that
#: time, so every structure acts like SGD with momentum; updating them every step with a
#: larger, normalised lr_cov lets them take shape within the run.
SINGD_SETTINGS = dict(T=1, lr_cov=0.1, normalize_lr_cov=True)
#: IKFAC has no trace scaling in its factor update and goes non-finite in fp32 on the
#: digits task with lr_cov=0.05 already, so it gets a smaller one.
IKFAC_LR_COV = 0.02


@dataclass(frozen=True)
class OptimizerEntry:
    """How to build one optimizer, its default learning rate, and whether it takes a
    structure."""

    lr: float
    build: Callable[..., torch.optim.Optimizer]
    description: str
    structured: bool = False


def _adamw(model: nn.Module, lr: float, structure: None, **common) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)


def _ours(common: dict) -> dict:
    """Keywords of our optimizers: the run's factor dtype, GradScaler and loss averaging,
    a fixed lr for the AdamW fallback (norms, embeddings), and raising on a non-finite
    gradient (so the harness sees it instead of a warning and a skipped step)."""
    return dict(common, fallback_lr=FALLBACK_LR, nonfinite="raise")


def _kfac(model: nn.Module, lr: float, structure: None, **common) -> torch.optim.Optimizer:
    return KFAC(model, lr=lr, damping=KFAC_DAMPING, **_ours(common))


def _adafisher(model: nn.Module, lr: float, structure: None, **common) -> torch.optim.Optimizer:
    return AdaFisher(model, lr=lr, **_ours(common))


def _singd(model: nn.Module, lr: float, structure: str, **common) -> torch.optim.Optimizer:
    return SINGD(model, lr=lr, structures=structure, **SINGD_SETTINGS, **_ours(common))


def _ikfac(model: nn.Module, lr: float, structure: None, **common) -> torch.optim.Optimizer:
    settings = dict(SINGD_SETTINGS, lr_cov=IKFAC_LR_COV)
    return SINGD(model, lr=lr, structures="dense", kfac_like=True, **settings, **_ours(common))


#: Optimizer name -> entry. The learning rates are chosen to train in the default steps.
OPTIMIZERS: dict[str, OptimizerEntry] = {
    "adamw": OptimizerEntry(FALLBACK_LR, _adamw, "torch.optim.AdamW"),
    "kfac": OptimizerEntry(3e-3, _kfac, "K-FAC with explicit inverses, damping 1e-2"),
    "adafisher": OptimizerEntry(1e-3, _adafisher, "AdaFisher (diagonal Kronecker factors)"),
    "singd": OptimizerEntry(2e-3, _singd, "SINGD, one run per structure", structured=True),
    "ikfac": OptimizerEntry(2e-3, _ikfac, "IKFAC: SINGD kfac_like=True, dense factors"),
}

#: The structures SINGD runs with by default.
STRUCTURES = (
    "dense",
    "diagonal",
    "block_diagonal",
    "low_rank",
    "tril_toeplitz",
    "triu_toeplitz",
    "hierarchical",
)


@dataclass(frozen=True)
class OptimizerChoice:
    """One optimizer of the grid: a table entry name plus, for SINGD, a structure."""

    name: str
    structure: str | None = None

    @property
    def label(self) -> str:
        """``"adamw"``, ``"singd:dense"``, ``"singd:block_diagonal:16"``, ..."""
        return self.name if self.structure is None else f"{self.name}:{self.structure}"

    def build(
        self,
        model: nn.Module,
        lr: float,
        factor_dtype: torch.dtype,
        grad_scaler: torch.amp.GradScaler | None = None,
        loss_average: str = "batch",
    ) -> torch.optim.Optimizer:
        """The optimizer for ``model``; ``loss_average`` says over what the loss is a mean
        ("batch" or "batch+sequence"), which sets the scale of the curvature statistics."""
        return OPTIMIZERS[self.name].build(
            model,
            lr,
            self.structure,
            factor_dtype=factor_dtype,
            grad_scaler=grad_scaler,
            loss_average=loss_average,
        )


def expand(names: list[str], structures: list[str]) -> list[OptimizerChoice]:
    """The grid's optimizers: structured entries once per structure, in order."""
    return [
        OptimizerChoice(name, structure)
        for name in names
        for structure in (structures if OPTIMIZERS[name].structured else [None])
    ]
