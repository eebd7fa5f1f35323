"""Curvature capture: forward hooks that hand (layer, input, grad_output) to a callback.

A forward hook on each layer records the input and registers a tensor hook on
the output, so the statistics are taken on the backward pass (this works with
in-place activations after the layer, unlike full backward hooks). Capture
happens only when the owner asks for it, grad is enabled and the module trains,
so eval / no_grad forwards between steps change nothing. With reentrant
activation checkpointing the first forward runs without grad and only the
recomputation is captured; with non-reentrant checkpointing the recomputed
output is never backpropagated, so its hook never fires: no double counting.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from .layers import Layer

StatisticsCallback = Callable[[Layer, Tensor, Tensor], None]


class CurvatureCapture:
    """Installs the hooks; ``forward_passes`` counts the model's training forwards."""

    def __init__(
        self,
        model: nn.Module,
        layers: list[Layer],
        wants_statistics: Callable[[Layer], bool],
        on_statistics: StatisticsCallback,
    ) -> None:
        self._wants_statistics = wants_statistics
        self._on_statistics = on_statistics
        self.forward_passes = 0
        self._handles = [
            layer.module.register_forward_hook(partial(self._forward_hook, layer))
            for layer in layers
        ]
        self._handles.append(model.register_forward_pre_hook(self._count_forward))

    def _count_forward(self, module: nn.Module, inputs) -> None:
        if torch.is_grad_enabled() and module.training:
            self.forward_passes += 1

    def _forward_hook(self, layer: Layer, module: nn.Module, inputs, output) -> None:
        if not (torch.is_grad_enabled() and module.training and isinstance(output, Tensor)):
            return
        if not output.requires_grad or not self._wants_statistics(layer):
            return
        layer_input = inputs[0].detach()

        def on_grad(grad_output: Tensor) -> None:
            with torch.autocast(grad_output.device.type, enabled=False):
                self._on_statistics(layer, layer_input, grad_output)

        output.register_hook(on_grad)

    def reset(self) -> None:
        """Forget the counted forwards (called after each optimizer step)."""
        self.forward_passes = 0

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
