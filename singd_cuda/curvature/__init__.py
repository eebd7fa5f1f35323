"""Curvature capture: module hooks and per-layer-type rules producing a, g and G."""

from .capture import CurvatureCapture
from .layers import SUPPORTED_LAYERS, Layer

__all__ = ["SUPPORTED_LAYERS", "CurvatureCapture", "Layer"]
