"""The optimizers a practitioner would pick instead of ours, built for the harness.

* :func:`sgd` - ``torch.optim.SGD`` with momentum 0.9 on every parameter.
* :func:`soap`, :func:`psgd_kron`, :func:`muon` - heavyball's SOAP, PSGDKron and Muon
  (PyPI ``heavyball``, the optional ``peers`` extra), run eagerly
  (``heavyball.utils.compile_mode = None``) as our optimizers are.

Parameters that are not matrices are handled as heavyball documents for each: SOAP and
PSGDKron take every parameter (SOAP runs Adam on 1-D parameters, ``precondition_1d``
off; PSGDKron gives them a diagonal preconditioner); Muon takes only the hidden
matrices - the weights (2-D and more) of ``nn.Linear`` and ``nn.Conv2d`` layers except
the output layer (the last such layer) - and heavyball's ``SplitOpt`` trains the rest
(embeddings, the output layer, biases, norms) with heavyball's AdamW at
``fallback_lr``, as our optimizers train their fallback parameters. Weight decay is 0
everywhere; the other settings are heavyball's defaults.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch
from torch import nn

SGD_MOMENTUM = 0.9
INSTALL_HINT = "install the optional peers extra: pip install -e '.[peers]' (heavyball==3.2.1)"


def heavyball_available() -> bool:
    """Whether heavyball can be imported (without importing it)."""
    return importlib.util.find_spec("heavyball") is not None


def _heavyball() -> ModuleType:
    """heavyball, set to run eagerly; a clear error naming the extra when it is missing."""
    try:
        import heavyball
    except ImportError as exc:
        raise ImportError(f"SOAP, PSGD-Kron and Muon need heavyball: {INSTALL_HINT}") from exc
    heavyball.utils.compile_mode = None
    return heavyball


def sgd(model: nn.Module, lr: float, fallback_lr: float) -> torch.optim.Optimizer:
    """Momentum SGD (0.9) on every parameter; ``fallback_lr`` is unused (no fallback)."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=SGD_MOMENTUM, weight_decay=0.0)


def soap(model: nn.Module, lr: float, fallback_lr: float, **options) -> torch.optim.Optimizer:
    """heavyball SOAP on every parameter, ``options`` over its defaults; ``fallback_lr``
    is unused."""
    return _heavyball().SOAP(model.parameters(), lr=lr, **{"weight_decay": 0.0, **options})


def psgd_kron(model: nn.Module, lr: float, fallback_lr: float, **options) -> torch.optim.Optimizer:
    """heavyball PSGDKron on every parameter, ``options`` over its defaults; ``fallback_lr``
    is unused."""
    return _heavyball().PSGDKron(model.parameters(), lr=lr, **{"weight_decay": 0.0, **options})


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The weights Muon trains: of every ``nn.Linear``/``nn.Conv2d`` but the last (the
    output layer), excluding any weight shared with an embedding (tied heads)."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear | nn.Conv2d)]
    embedded = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    return [m.weight for m in layers[:-1] if id(m.weight) not in embedded]


def muon(model: nn.Module, lr: float, fallback_lr: float, **options) -> torch.optim.Optimizer:
    """heavyball Muon (at ``lr``, ``options`` over its defaults) on
    :func:`hidden_matrices`, heavyball AdamW (at ``fallback_lr``) on every other
    parameter, in one ``SplitOpt``."""
    hb = _heavyball()
    hidden = hidden_matrices(model)
    chosen = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in chosen]
    return hb.SplitOpt(
        [
            {"params": hidden, "optimizer": hb.Muon, "lr": lr, "weight_decay": 0.0, **options},
            {"params": rest, "optimizer": hb.AdamW, "lr": fallback_lr, "weight_decay": 0.0},
        ]
    )
