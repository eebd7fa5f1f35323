"""Curvature capture: forward hooks that hand (layer, input, grad_output) to a callback.

A forward hook on each layer records the input and registers a tensor hook on
the output, so the statistics are taken on the backward pass (this works with
in-place activations after the layer, unlike full backward hooks). Capture
happens only when the owner asks for it, grad is enabled and the module trains,
so eval / no_grad forwards between steps change nothing. With reentrant
activation checkpointing the first forward runs without grad and only the
recomputation is captured; with non-reentrant checkpointing the recomputed
output is never backpropagated, so its hook never fires: no double counting.

Micro-batches (gradient accumulation) are counted the same way: a model
forward counts once the backward reaches its output, so a recomputed forward
(checkpointing the whole model) or a forward that is never backpropagated
does not count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import torch
from torch import Tensor, nn

from .layers import Layer

StatisticsCallback = Callable[[Layer, Tensor, Tensor], None]


class CurvatureCapture:
    """Installs the hooks; ``micro_batches`` counts the model's backpropagated forwards
    on steps that take statistics."""

    def __init__(
        self,
        model: nn.Module,
        layers: list[Layer],
        wants_statistics: Callable[[Layer], bool],
        on_statistics: StatisticsCallback,
        wants_any_statistics: Callable[[], bool],
    ) -> None:
        """``wants_any_statistics()`` is ``any(wants_statistics(l) for l in layers)``,
        computed cheaply by the owner (it runs on every model forward)."""
        self._wants_statistics = wants_statistics
        self._on_statistics = on_statistics
        self._wants_any_statistics = wants_any_statistics
        self.micro_batches = 0
        self._handles = [
            layer.module.register_forward_hook(partial(self._forward_hook, layer))
            for layer in layers
        ]
        self._handles.append(model.register_forward_hook(self._count_on_backward))

    def _count_on_backward(self, module: nn.Module, inputs, output) -> None:
        """Count this forward as a micro-batch once a gradient reaches its output (only
        on steps that take statistics: the count normalises them and nothing else)."""
        if not (torch.is_grad_enabled() and module.training):
            return
        if not self._wants_any_statistics():
            return
        outputs = [t for t in _tensors(output) if t.requires_grad]
        reached = False

        def on_grad(grad: Tensor) -> None:
            nonlocal reached
            if not reached:  # once per forward, however many outputs it has
                reached = True
                self.micro_batches += 1

        for tensor in outputs:
            tensor.register_hook(on_grad)

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
        """Forget the counted micro-batches (called after each optimizer step)."""
        self.micro_batches = 0

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _tensors(output) -> list[Tensor]:
    """The tensors in a module output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, list | tuple):
        return [t for item in output for t in _tensors(item)]
    return []
