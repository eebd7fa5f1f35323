"""Curvature capture: module hooks and per-layer-kind rules producing a, g and G."""

from .capture import CurvatureCapture
from .layers import (
    SUPPORTED_LAYERS,
    Layer,
    LayerKind,
    LinearKind,
    TransposedLinearKind,
    is_supported,
    layer_kind,
    register_layer_kind,
)

__all__ = [
    "SUPPORTED_LAYERS",
    "CurvatureCapture",
    "Layer",
    "LayerKind",
    "LinearKind",
    "TransposedLinearKind",
    "is_supported",
    "layer_kind",
    "register_layer_kind",
]
