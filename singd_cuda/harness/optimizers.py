"""The optimizer table of the harness: how each optimizer is built and tuned.

Every entry builds a ``torch.optim.Optimizer`` for the whole model from
``(model, structure, hparams, factor_dtype=, stochastic_rounding=, grad_scaler=,
loss_average=)``. ``hparams`` holds the tuned values (``lr``); everything else is the
library default except the few settings in :data:`FIXED_SETTINGS`, which the report
lists. Weight decay is 0 everywhere so the runs compare preconditioners only.
``singd`` expands into one run per structure; ``ikfac`` is SINGD with
``kfac_like=True`` and dense factors.

The peers a practitioner would pick instead (:mod:`.peers`): ``sgd``
(``torch.optim.SGD``, momentum 0.9) and heavyball's ``soap``, ``psgd_kron`` and
``muon`` (the optional ``peers`` extra), tuned on the same number of trials.

``hparams`` may also carry ``fallback_lr`` (the learning rate of the AdamW that trains
what the preconditioner does not: embeddings and norms of ours, every parameter but the
hidden matrices of Muon) and, for our optimizers, any library keyword (``T``,
``damping``, ``loss_average``, ...): the ablations of ``--set``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .. import KFAC, SINGD, AdaFisher
from . import peers

#: Learning rate of the built-in AdamW fallback of KFAC, AdaFisher and SINGD (the
#: parameters of embeddings, LayerNorm and BatchNorm).
FALLBACK_LR = 3e-3
#: K-FAC's damping: its default 1e-3 (√λ ≈ 0.03 added to each factor) diverges on the
#: digits task in fp32 at any learning rate that trains.
KFAC_DAMPING = 1e-2

#: Settings the harness passes that differ from the library defaults (listed in the report).
FIXED_SETTINGS: dict[str, dict] = {
    "adamw": {"weight_decay": 0.0},
    "kfac": {"damping": KFAC_DAMPING},
    "adafisher": {},
    "singd": {},
    "ikfac": {"structures": "dense", "kfac_like": True},
    "sgd": {"momentum": peers.SGD_MOMENTUM, "weight_decay": 0.0},
    "soap": {"weight_decay": 0.0},
    "psgd_kron": {"weight_decay": 0.0},
    "muon": {
        "weight_decay": 0.0,
        "rest": "AdamW (heavyball) at the fallback lr for all but hidden matrices",
    },
}


@dataclass(frozen=True)
class OptimizerEntry:
    """How to build one optimizer, which hyperparameters are tuned and on what grid
    (every optimizer gets the same number of trials), and whether it takes a structure."""

    build: Callable[..., torch.optim.Optimizer]
    description: str
    tune_grid: tuple[dict[str, float], ...]
    structured: bool = False
    has_factors: bool = True


def _ours(name: str, common: dict, hparams: dict) -> dict:
    """Keywords of our optimizers: the run's factor dtype, stochastic rounding,
    GradScaler and loss averaging, a fixed lr for the AdamW fallback (norms,
    embeddings), raising on a non-finite gradient (so the harness sees it instead of a
    warning and a skipped step), the fixed settings, then ``hparams`` over all of them."""
    fixed = FIXED_SETTINGS[name]
    return {**common, "fallback_lr": FALLBACK_LR, "nonfinite": "raise", **fixed, **hparams}


def _adamw(model: nn.Module, structure, hparams: dict, **common) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), **{**FIXED_SETTINGS["adamw"], **hparams})


def _kfac(model: nn.Module, structure, hparams: dict, **common) -> torch.optim.Optimizer:
    return KFAC(model, **_ours("kfac", common, hparams))


def _adafisher(model: nn.Module, structure, hparams: dict, **common) -> torch.optim.Optimizer:
    return AdaFisher(model, **_ours("adafisher", common, hparams))


def _singd(model: nn.Module, structure: str, hparams: dict, **common) -> torch.optim.Optimizer:
    return SINGD(model, structures=structure, **_ours("singd", common, hparams))


def _ikfac(model: nn.Module, structure, hparams: dict, **common) -> torch.optim.Optimizer:
    return SINGD(model, **_ours("ikfac", common, hparams))


def _peer(build: Callable[..., torch.optim.Optimizer]) -> Callable[..., torch.optim.Optimizer]:
    """A peer's entry: its builder with the fallback lr defaulting to :data:`FALLBACK_LR`."""

    def make(model: nn.Module, structure, hparams: dict, **common) -> torch.optim.Optimizer:
        return build(model, **{"fallback_lr": FALLBACK_LR, **hparams})

    return make


def _lr_grid(*lrs: float) -> tuple[dict[str, float], ...]:
    return tuple({"lr": lr} for lr in lrs)


#: Six trials per optimizer: six learning rates a half decade apart, everything else at
#: the library defaults (SINGD's warm start puts its factors at the curvature's scale from
#: the first step, so its learning rates sit where K-FAC's do and its default ``lr_cov``
#: needs no tuning: ``benchmarks/results/defaults.md``).
OPTIMIZERS: dict[str, OptimizerEntry] = {
    "adamw": OptimizerEntry(
        _adamw,
        "torch.optim.AdamW",
        _lr_grid(3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
        has_factors=False,
    ),
    "kfac": OptimizerEntry(
        _kfac,
        "K-FAC with explicit inverses, damping 1e-2",
        _lr_grid(3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
    ),
    "adafisher": OptimizerEntry(
        _adafisher,
        "AdaFisher (diagonal Kronecker factors)",
        _lr_grid(3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
    ),
    "sgd": OptimizerEntry(
        _peer(peers.sgd),
        "torch.optim.SGD, momentum 0.9",
        _lr_grid(3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0),
        has_factors=False,
    ),
    "singd": OptimizerEntry(
        _singd,
        "SINGD, one run per structure",
        _lr_grid(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2),
        structured=True,
    ),
    "ikfac": OptimizerEntry(
        _ikfac,
        "IKFAC: SINGD kfac_like=True, dense factors",
        _lr_grid(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2),
    ),
    "soap": OptimizerEntry(
        _peer(peers.soap),
        "heavyball SOAP (Adam in Shampoo's eigenbasis; 1-D parameters: Adam)",
        _lr_grid(3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
        has_factors=False,
    ),
    "psgd_kron": OptimizerEntry(
        _peer(peers.psgd_kron),
        "heavyball PSGDKron (Kronecker PSGD; 1-D parameters: diagonal)",
        _lr_grid(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2),
        has_factors=False,
    ),
    "muon": OptimizerEntry(
        _peer(peers.muon),
        "heavyball Muon on hidden matrices, AdamW on the rest",
        _lr_grid(1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1),
        has_factors=False,
    ),
}
#: The entries that need the optional ``peers`` extra (heavyball).
HEAVYBALL_OPTIMIZERS = ("soap", "psgd_kron", "muon")

#: The structures SINGD runs with in ``--full`` (the default grid uses the first two).
STRUCTURES = (
    "block_diagonal:32",
    "diagonal",
    "dense",
    "low_rank:8",
    "tril_toeplitz",
    "triu_toeplitz",
    "hierarchical:15,15",
)


@dataclass(frozen=True)
class OptimizerChoice:
    """One optimizer of the grid: a table entry name plus, for SINGD, a structure, plus
    fixed library keywords that make a variant (``options``, e.g. ``(("graft", "adam"),)``),
    which the label carries so that a variant is a cell of its own."""

    name: str
    structure: str | None = None
    options: tuple[tuple[str, object], ...] = ()

    @property
    def label(self) -> str:
        """``"adamw"``, ``"singd:dense"``, ``"singd:block_diagonal:32+graft=adam"``, ..."""
        base = self.name if self.structure is None else f"{self.name}:{self.structure}"
        return base + self._suffix

    @property
    def variant(self) -> str:
        """The label without the structure, as ``--optimizers`` names it:
        ``"singd+graft=adam"``."""
        return self.name + self._suffix

    @property
    def _suffix(self) -> str:
        return "".join(f"+{key}={value}" for key, value in self.options)

    @property
    def has_factors(self) -> bool:
        return OPTIMIZERS[self.name].has_factors

    def build(
        self,
        model: nn.Module,
        hparams: dict,
        factor_dtype: torch.dtype | None = None,
        stochastic_rounding: bool = False,
        grad_scaler: torch.amp.GradScaler | None = None,
        loss_average: str = "batch",
    ) -> torch.optim.Optimizer:
        """The optimizer for ``model`` with the variant's options and the tuned
        ``hparams`` (e.g. ``{"lr": 1e-3}``) over them; ``loss_average`` says over what the
        loss is a mean ("batch" or "batch+sequence"), which sets the scale of the
        curvature statistics."""
        common = {}
        if self.has_factors:
            common = dict(
                factor_dtype=factor_dtype,
                stochastic_rounding=stochastic_rounding,
                grad_scaler=grad_scaler,
                loss_average=loss_average,
            )
        hparams = {**dict(self.options), **hparams}
        return OPTIMIZERS[self.name].build(model, self.structure, hparams, **common)


def parse_variant(text: str) -> tuple[str, tuple[tuple[str, object], ...]]:
    """``"singd+graft=adam+kfac_approx=reduce"`` -> ``("singd", (("graft", "adam"),
    ("kfac_approx", "reduce")))``; numbers become int or float. Raises ValueError naming
    the fix on an unknown optimizer or a malformed option."""
    name, *parts = text.split("+")
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer '{name}' in '{text}'; valid: {', '.join(OPTIMIZERS)}")
    options = []
    for part in parts:
        key, _, value = part.partition("=")
        if not key or not value:
            raise ValueError(f"'{part}' in '{text}' is not KEY=VALUE (e.g. singd+graft=adam)")
        options.append((key, parse_value(value)))
    return name, tuple(options)


def parse_value(text: str) -> object:
    """A command-line value: True or False, else an int, else a float, else the string
    itself."""
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def label_name(label: str) -> str:
    """The table entry of a label: ``"singd:dense+graft=adam"`` -> ``"singd"``."""
    return label.split("+", 1)[0].split(":", 1)[0]


def expand(variants: list[str], structures: list[str]) -> list[OptimizerChoice]:
    """The grid's optimizers (``"adamw"``, ``"singd+graft=adam"``, ...): structured
    entries once per structure, in order."""
    choices = []
    for text in variants:
        name, options = parse_variant(text)
        for structure in structures if OPTIMIZERS[name].structured else [None]:
            choices.append(OptimizerChoice(name, structure, options))
    return choices
