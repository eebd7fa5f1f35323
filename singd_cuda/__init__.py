"""singd_cuda: low-precision structured second-order optimizers for PyTorch."""

from . import structures
from .optim import KFAC, SINGD, AdaFisher

__version__ = "0.1.0"

__all__ = ["KFAC", "SINGD", "AdaFisher", "structures"]
