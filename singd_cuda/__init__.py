"""singd_cuda: low-precision structured second-order optimizers for PyTorch."""

from . import structures
from .curvature import LayerKind, is_supported, register_layer_kind
from .optim import KFAC, SINGD, AdaFisher

__version__ = "0.1.0"

__all__ = [
    "KFAC",
    "SINGD",
    "AdaFisher",
    "LayerKind",
    "is_supported",
    "register_layer_kind",
    "structures",
]
