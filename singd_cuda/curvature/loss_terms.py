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
        self._sequence_first: set[Layer] = set()
        self._norm_layers: set[Layer] = set()
        self._checked: set[int] = set()  # weights whose batch dimension was checked
        # (layer, output shape, loss_average, batch_dim, model batch) -> (count, whether
        # the call counts the model input's dimension 0 of a >= 3-D output): the count
        # depends on these alone once the layer's first call was checked
        self._counts: dict[tuple, tuple[int, bool]] = {}

    @property
    def sequence_first(self) -> set[Layer]:
        """The layers and norm layers of sequence-first transformer modules."""
        return self._sequence_first

    @sequence_first.setter
    def sequence_first(self, layers: set[Layer]) -> None:
        self._sequence_first = layers
        self._counts.clear()

    @property
    def norm_layers(self) -> set[Layer]:
        """The norm layers (their count is :func:`.norm_layers.num_terms`)."""
        return self._norm_layers

    @norm_layers.setter
    def norm_layers(self, layers: set[Layer]) -> None:
        self._norm_layers = layers
        self._counts.clear()

    def count(
        self, layer: Layer, output: Tensor, loss_average: str | None, batch_dim: int | None, capture
    ) -> tuple[int, bool | None]:
        """(the loss terms ``output`` covers, whether a call of the same key counts the
        model input's dimension 0); may set ``capture.model_batch``. The key is the layer,
        the output's shape, ``loss_average``, ``batch_dim`` and ``capture.model_batch``
        before the call: a call of the same key counts the same (and, when the second
        field is True and ``capture.batch_from_input``, sets ``capture.counted_on_input``),
        except where the second field is None (a layer of a sequence-first transformer
        module without ``batch_dim``: it says the model's batch, counted anew at every
        call)."""
        key = (layer, output.shape, loss_average, batch_dim, capture.model_batch)
        known = self._counts.get(key)
        if known is None:
            terms, on_input = self._count(layer, output, loss_average, batch_dim, capture)
            if layer in self._sequence_first and batch_dim is None:
                return terms, None
            if len(self._counts) > 4096:  # many shapes (e.g. every sequence length)
                self._counts.clear()
            known = self._counts[key] = (terms, on_input)
        if known[1] and capture.batch_from_input:
            capture.counted_on_input = True
        return known

    def _count(
        self, layer: Layer, output: Tensor, loss_average: str | None, batch_dim: int | None, capture
    ) -> tuple[int, bool]:
        """(the loss terms, whether the count is of the model input's dimension 0 of a
        >= 3-D output): the counting rule of the module docstring."""
        if layer in self._norm_layers:
            terms = norm_layers.num_terms(
                layer.module, output, loss_average, self.norm_batch_dim(layer, batch_dim)
            )
            return terms, False
        if batch_dim is not None:
            return loss_terms(layer, output, loss_average, batch_dim), False
        if layer in self._sequence_first:
            self.told(capture, samples(layer, output, 1))
            return loss_terms(layer, output, loss_average, 1), False
        batch = capture.model_batch
        if batch is None:
            return loss_terms(layer, output, loss_average, 0), False
        if self._sequence_first_output(layer, output, batch):
            return loss_terms(layer, output, loss_average, 1), False
        if id(layer.weight) not in self._checked:
            self._checked.add(id(layer.weight))  # the first call says it
            if misplaced_batch(layer, output, 0, batch):
                self._warn_misplaced_batch(layer, output, batch)
        return loss_terms(layer, output, loss_average, 0), output.dim() >= 3

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
        return 1 if layer in self._sequence_first else 0

    def _warn_misplaced_batch(self, layer: Layer, output: Tensor, batch: int) -> None:
        warnings.warn(
            f"{self.owner}: layer '{layer.name}' counts its samples along dimension "
            f"0 of its output {tuple(output.shape)}, but the model's batch is {batch}, the "
            "size of another dimension: if the layer's data is sequence-first (positions, "
            "batch, features), pass batch_dim=1 (for the optimizer, or in a parameter group "
            "of those layers); batch_dim=0 keeps dimension 0 without this check (README, "
            "'What counts as curvature')",
            RuntimeWarning,
            stacklevel=4,
        )
