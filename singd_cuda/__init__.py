"""singd_cuda: low-precision structured second-order optimizers for PyTorch."""

from . import structures

__version__ = "0.1.0"

__all__ = ["structures"]
