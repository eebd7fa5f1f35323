"""singd_cuda: low-precision structured second-order optimizers for PyTorch."""

# distributed: importing it plugs torch.distributed into the optimizers (optim.scale_out)
from . import distributed, structures
from .curvature import LayerKind, is_supported, register_layer_kind
from .optim import KFAC, SINGD, AdaFisher

__version__ = "0.1.0"

__all__ = [
    "KFAC",
    "SINGD",
    "AdaFisher",
    "LayerKind",
    "distributed",
    "is_supported",
    "register_layer_kind",
    "structures",
]
