"""How many loss terms one call of a layer covers: the capture's counting rule.

A call's output covers its samples along the batch dimension (or samples x positions for
``loss_average="batch+sequence"``). With ``batch_dim=None`` the count follows the model's
batch B: dimension 0 of the model's first tensor input, or, once a module that knows its
batch dimension is called in the forward (an RNN or attention, :data:`.layers.BATCH_TELLING`,
and the Linear layers of sequence-first transformer modules), the batch it holds. The
layers of sequence-first transformer modules count dimension 1; any other layer counts
dimension 0, or dimension 1 where dimension 0 is not B and dimension 1 is (its output is
sequence-first: (positions, batch, ...)). So a sequence-first model counts as its
batch-first twin. What cannot be told from shapes warns, once: layers that counted the
input's dimension 0 before a module said another batch (the model's data may be
sequence-first), and a layer whose count differs from B while a later dimension of its
output has that size.
"""

from __future__ import annotations

import warnings

from torch import Tensor

from . import norm_layers
from .layers import Layer, loss_terms, misplaced_batch, samples

_SEQUENCE_FIRST_WARNED = -1  # the key of the once-per-counter warning in ``checked``


class LossTermCounter:
    """The loss terms of each call, and the warnings about a misplaced batch dimension.

    ``owner`` names the optimizer in warnings; :attr:`sequence_first` (the layers and
    norm layers of sequence-first transformer modules) and :attr:`norm_layers` are set
    by the owner whenever it finds its layers.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.sequence_first: set[Layer] = set()
        self.norm_layers: set[Layer] = set()
        self._checked: set[int] = set()  # weights whose batch dimension was checked

    def count(
        self, layer: Layer, output: Tensor, loss_average: str | None, batch_dim: int | None, capture
    ) -> int:
        """The loss terms ``output`` covers; may set ``capture.model_batch``."""
        if layer in self.norm_layers:
            return norm_layers.num_terms(
                layer.module, output, loss_average, self.norm_batch_dim(layer, batch_dim)
            )
        if batch_dim is not None:
            return loss_terms(layer, output, loss_average, batch_dim)
        if layer in self.sequence_first:
            self.told(capture, samples(layer, output, 1))
            return loss_terms(layer, output, loss_average, 1)
        batch = capture.model_batch
        if batch is None:
            return loss_terms(layer, output, loss_average, 0)
        if self._sequence_first_output(layer, output, batch):
            return loss_terms(layer, output, loss_average, 1)
        if capture.batch_from_input and output.dim() >= 3:
            capture.counted_on_input = True
        if id(layer.weight) not in self._checked:
            self._checked.add(id(layer.weight))  # the first call says it
            if misplaced_batch(layer, output, 0, batch):
                self._warn_misplaced_batch(layer, output, batch)
        return loss_terms(layer, output, loss_average, 0)

    @staticmethod
    def _sequence_first_output(layer: Layer, output: Tensor, batch: int) -> bool:
        """Whether a features-last output is (positions, batch, ...): dimension 0 is not
        the model's batch, dimension 1 is."""
        return (
            layer.kind.features_last
            and output.dim() >= 3
            and output.shape[0] != batch
            and output.shape[1] == batch
        )

    def told(self, capture, batch: int) -> None:
        """A module that knows its batch dimension holds ``batch`` samples: the model's
        batch from now on in this forward. Warns (once) when it is not the model input's
        dimension 0 and layers counted that dimension before."""
        if (
            capture.counted_on_input
            and capture.model_batch != batch
            and _SEQUENCE_FIRST_WARNED not in self._checked
        ):
            self._checked.add(_SEQUENCE_FIRST_WARNED)
            warnings.warn(
                f"{self.owner}: the model input's dimension 0 ({capture.model_batch}) is not "
                f"the batch ({batch}) its sequence-first modules (RNNs, attention, transformer "
                "layers) see, and layers called before them counted dimension 0. If the "
                "model's data is sequence-first, pass batch_dim=1 (README, 'What counts as "
                "curvature')",
                RuntimeWarning,
                stacklevel=3,
            )
        capture.model_batch = batch
        capture.batch_from_input = capture.counted_on_input = False

    def norm_batch_dim(self, layer: Layer, batch_dim: int | None) -> int:
        """The batch dimension of a norm layer: ``batch_dim`` when given, else 1 inside a
        sequence-first transformer layer and 0 elsewhere (its statistic is not checked
        against the model's batch)."""
        if batch_dim is not None:
            return batch_dim
        return 1 if layer in self.sequence_first else 0

    def _warn_misplaced_batch(self, layer: Layer, output: Tensor, batch: int) -> None:
        warnings.warn(
            f"{self.owner}: layer '{layer.name}' counts its samples along dimension "
            f"0 of its output {tuple(output.shape)}, but the model's batch is {batch}, the "
            "size of another dimension: if the layer's data is sequence-first (positions, "
            "batch, features), pass batch_dim=1 (for the optimizer, or in a parameter group "
            "of those layers); batch_dim=0 keeps dimension 0 without this check (README, "
            "'What counts as curvature')",
            RuntimeWarning,
            stacklevel=3,
        )
