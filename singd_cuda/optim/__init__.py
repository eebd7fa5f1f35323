"""The optimizers: SINGD (and IKFAC), AdaFisher, and the dense K-FAC baseline."""

from .adafisher import AdaFisher
from .base import KroneckerOptimizer
from .kfac import KFAC
from .singd import SINGD

__all__ = ["KFAC", "SINGD", "AdaFisher", "KroneckerOptimizer"]
