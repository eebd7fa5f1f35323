"""Layer kinds: how a supported module's input, output gradient and parameter gradient
become the matrices a (N x d_K), g (N x d_C) and G (d_C x d_K).

Built-in kinds: ``nn.Linear`` (any leading dims, flattened into N), ``nn.Conv1d``,
``nn.Conv2d`` and ``nn.Conv3d`` (groups, stride, dilation, every padding and padding mode;
the input is unfolded into patches, averaged over channel groups) and Hugging Face
``transformers.pytorch_utils.Conv1D`` (a Linear whose weight is stored transposed,
d_in x d_out; recognised by its class path, so ``transformers`` is never imported here).
With a bias, a column of ones is appended to a and the bias gradient to G.

Other Linear-like modules plug in through :func:`register_layer_kind`: a
:class:`LayerKind` says how the module's weight is a (d_C, d_K') matrix and which rows
of its input and output gradient pair with it; the module needs ``weight`` and ``bias``
(None allowed) attributes and must return its output as a tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .. import ops
from ..structures.base import ACCUMULATES_IN

SUPPORTED_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)  # built-in; see is_supported
"""The torch.nn classes preconditioned without registration (subclasses included); Hugging
Face ``Conv1D`` and registered kinds are supported too: :func:`is_supported` says."""
LOSS_AVERAGES = ("batch", "batch+sequence", None)
KFAC_APPROXIMATIONS = ("expand", "reduce")  # rows of a and g: per position, or per sample


class LayerKind:
    """How one type of module becomes a Kronecker-factored layer; subclass it and pass an
    instance to :func:`register_layer_kind`.

    The module computes y = W a for every row a of :meth:`inputs` (plus its bias), W the
    (d_C, d_K') matrix :meth:`weight_matrix` of its weight; d_K' excludes the bias column.
    The defaults describe ``nn.Linear``: the weight is (d_out, ...) and inputs and output
    gradients have their features last. A new kind overrides what differs; the sums of
    squares have defaults built on :meth:`inputs` and :meth:`output_gradients` and are
    overridden only to avoid materialising them.
    """

    def out_features(self, weight: Tensor) -> int:
        """d_C, the rows of :meth:`weight_matrix`, from the weight's shape."""
        return weight.shape[0]

    def weight_matrix(self, weight: Tensor) -> Tensor:
        """The weight (or a tensor shaped like it: its gradient, a buffer) as the
        (d_C, d_K') matrix W, a view where the layout allows."""
        return weight.reshape(weight.shape[0], -1)

    def weight_from_matrix(self, matrix: Tensor, weight: Tensor) -> Tensor:
        """Inverse of :meth:`weight_matrix`: a (d_C, d_K') matrix shaped like ``weight``."""
        return matrix.reshape(weight.shape)

    def inputs(self, module: nn.Module, x: Tensor) -> Tensor:
        """a: (N, d_K'), the rows of the layer input ``x`` that W multiplies (x's dtype)."""
        return x.reshape(-1, x.shape[-1])

    def output_gradients(self, module: nn.Module, grad: Tensor) -> Tensor:
        """g: (N, d_C), the output gradient rows, paired with the rows of :meth:`inputs`."""
        return grad.reshape(-1, grad.shape[-1])

    features_last = True  # outputs are (leading dims..., d_C): ``batch_dim`` applies

    def output_terms(self, module: nn.Module, grad: Tensor) -> tuple[int, int]:
        """(batch size, N) of an output gradient: samples, and rows of g (samples times
        positions, e.g. tokens); from the shape only."""
        leading = grad.shape[:-1]
        return (leading[0] if len(leading) else 1), leading.numel()

    def input_sum_squares(self, module: nn.Module, x: Tensor) -> tuple[Tensor, int]:
        """(diag(aᵀa) (d_K'), N) for a = :meth:`inputs`: float32 (float64 for float64)."""
        a = self.inputs(module, x)
        return ops.col_sum_squares(a, -1), a.shape[0]

    def output_sum_squares(self, module: nn.Module, grad: Tensor) -> Tensor:
        """diag(gᵀg) (d_C) for g = :meth:`output_gradients`, dtype as above."""
        return ops.col_sum_squares(self.output_gradients(module, grad), -1)


class LinearKind(LayerKind):
    """``nn.Linear``: statistics straight from the input and output gradient."""

    def input_sum_squares(self, module: nn.Module, x: Tensor) -> tuple[Tensor, int]:
        return ops.col_sum_squares(x, -1), x.numel() // max(x.shape[-1], 1)

    def output_sum_squares(self, module: nn.Module, grad: Tensor) -> Tensor:
        return ops.col_sum_squares(grad, -1)


class TransposedLinearKind(LinearKind):
    """A Linear whose weight is stored (d_in, d_out), y = x W + b (Hugging Face
    ``Conv1D``): W is the transposed view of the weight."""

    def out_features(self, weight: Tensor) -> int:
        return weight.shape[-1]

    def weight_matrix(self, weight: Tensor) -> Tensor:
        return weight.reshape(-1, weight.shape[-1]).T

    def weight_from_matrix(self, matrix: Tensor, weight: Tensor) -> Tensor:
        return matrix.T.reshape(weight.shape)


class ConvKind(LayerKind):
    """``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d`` (``spatial`` = 1, 2, 3): unfolded
    patches of the group-averaged input, one row per (sample, output position)."""

    features_last = False  # (N, C, *spatial): the batch is dimension 0

    def __init__(self, spatial: int) -> None:
        self.spatial = spatial

    def inputs(self, module: nn.Module, x: Tensor) -> Tensor:
        x, padding = _padded(module, self._batched(x))
        if module.groups > 1:
            batch, channels = x.shape[:2]
            x = x.reshape(batch, module.groups, channels // module.groups, *x.shape[2:]).mean(1)
        if self.spatial == 2:
            patches = F.unfold(
                x,
                module.kernel_size,
                dilation=module.dilation,
                padding=padding,
                stride=module.stride,
            )
            return patches.transpose(1, 2).flatten(0, 1)
        patches = _windows(F.pad(x, _pad_arg(padding)), module)  # (B, C, *out, *kernel)
        n = self.spatial  # to (B, *out, C, *kernel): rows (sample, position), (c, offset) columns
        patches = patches.permute(0, *range(2, 2 + n), 1, *range(2 + n, 2 + 2 * n))
        return patches.flatten(0, n).flatten(1)

    def output_gradients(self, module: nn.Module, grad: Tensor) -> Tensor:
        grad = self._batched(grad)
        return grad.movedim(1, -1).reshape(-1, grad.shape[1])

    def output_terms(self, module: nn.Module, grad: Tensor) -> tuple[int, int]:
        grad = self._batched(grad)
        return grad.shape[0], grad.shape[0] * grad.shape[2:].numel()

    def input_sum_squares(self, module: nn.Module, x: Tensor) -> tuple[Tensor, int]:
        """Without unfolding the patches: :func:`singd_cuda.ops.conv2d_patch_sum_squares`
        (Conv1d as a Conv2d of height 1); Conv3d sums the squared input over the batch
        and then over the windows of each kernel offset."""
        x, padding = _padded(module, self._batched(x))
        rows = x.shape[0] * _conv_positions(module, x.shape[2:], padding)
        if self.spatial == 3:
            return _patch_sum_squares_3d(x, module, padding), rows
        if self.spatial == 1:  # (B, C, L) as (B, C, 1, L)
            (k,), (s,), (p,), (d,) = module.kernel_size, module.stride, padding, module.dilation
            h = ops.conv2d_patch_sum_squares(
                x.unsqueeze(2), (1, k), (1, s), (0, p), (1, d), module.groups
            )
            return h, rows
        geometry = (module.kernel_size, module.stride, padding, module.dilation, module.groups)
        return ops.conv2d_patch_sum_squares(x, *geometry), rows

    def output_sum_squares(self, module: nn.Module, grad: Tensor) -> Tensor:
        return ops.col_sum_squares(self._batched(grad), 1)

    def _batched(self, x: Tensor) -> Tensor:
        """A conv input or output gradient with its batch dimension (unbatched: batch 1)."""
        return x if x.dim() == self.spatial + 2 else x.unsqueeze(0)


def _padded(module: nn.Module, x: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """(x, padding left to unfold): padded as the layer's own forward pads it where that
    is not plain symmetric zero padding ('same' may be asymmetric)."""
    padding = module.padding
    if module.padding_mode != "zeros" or isinstance(padding, str):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
        return x, (0,) * len(module.kernel_size)
    return x, padding


def _conv_positions(module: nn.Module, size, padding) -> int:
    out = 1
    dims = zip(size, module.kernel_size, module.stride, padding, module.dilation, strict=True)
    for n, k, s, p, d in dims:
        out *= max((n + 2 * p - d * (k - 1) - 1) // s + 1, 0)
    return out


def _pad_arg(padding: tuple[int, ...]) -> list[int]:
    """F.pad's argument for symmetric ``padding`` of the trailing dimensions."""
    return [p for p in reversed(padding) for _ in range(2)]


def _windows(x: Tensor, module: nn.Module) -> Tensor:
    """(B, C, *out, *kernel): a view of the (padded) x, the input of every kernel offset
    at every output position (F.unfold for any number of spatial dimensions)."""
    geometry = zip(module.kernel_size, module.stride, module.dilation, strict=True)
    for dim, (k, s, d) in enumerate(geometry):
        x = x.unfold(2 + dim, d * (k - 1) + 1, s)[..., ::d]
    return x


def _patch_sum_squares_3d(x: Tensor, module: nn.Module, padding) -> Tensor:
    """diag(aᵀa) of Conv3d patches: each entry (c, kernel offset) is the sum of the
    squared, group-averaged input over its window positions, summed over the batch first."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.to(acc)
    if module.groups > 1:
        x = x.reshape(x.shape[0], module.groups, -1, *x.shape[2:]).mean(1)
    squares = F.pad(x.square().sum(0, keepdim=True), _pad_arg(padding))
    return _windows(squares, module).sum((0, 2, 3, 4)).flatten()


_KINDS: dict[type, LayerKind] = {
    nn.Linear: LinearKind(),
    nn.Conv1d: ConvKind(1),
    nn.Conv2d: ConvKind(2),
    nn.Conv3d: ConvKind(3),
}
# kinds of classes from optional packages, by "module.qualname": matched without importing
_KINDS_BY_PATH: dict[str, LayerKind] = {
    "transformers.pytorch_utils.Conv1D": TransposedLinearKind(),
}
_resolved: dict[type, LayerKind | None] = {}  # lookups by class, cleared on registration


def register_layer_kind(module_class: type[nn.Module], kind: LayerKind) -> None:
    """Precondition every module of ``module_class`` (and its subclasses) as ``kind``.

    Call it before creating the optimizer. A registration for a class overrides the
    kind of its base classes (and a built-in one for the class itself).
    """
    if not (isinstance(module_class, type) and issubclass(module_class, nn.Module)):
        raise TypeError(f"module_class must be an nn.Module subclass, got {module_class!r}")
    if not isinstance(kind, LayerKind):
        raise TypeError(f"kind must be a LayerKind instance, got {kind!r}")
    _KINDS[module_class] = kind
    _resolved.clear()


def layer_kind(module: nn.Module) -> LayerKind | None:
    """The kind of ``module`` (the registration nearest in its class's MRO), or None."""
    cls = type(module)
    if cls not in _resolved:
        _resolved[cls] = next(
            (kind for base in cls.__mro__ if (kind := _registered(base)) is not None), None
        )
    return _resolved[cls]


def _registered(cls: type) -> LayerKind | None:
    kind = _KINDS.get(cls)
    if kind is None:
        kind = _KINDS_BY_PATH.get(f"{cls.__module__}.{cls.__qualname__}")
    return kind


def is_supported(module: nn.Module) -> bool:
    """Whether ``module`` is a layer kind the optimizers precondition."""
    return layer_kind(module) is not None


@dataclass(eq=False)
class Layer:
    """One preconditioned layer: its module, its trained parameters and factor sizes.

    ``modules`` are all the modules that hold ``weight`` (one, unless the weight is
    shared; ``module`` is the first): their calls all add to the layer's statistics.
    """

    name: str
    module: nn.Module
    weight: nn.Parameter
    bias: nn.Parameter | None  # None when absent or not trained by the optimizer
    modules: tuple[nn.Module, ...] = ()
    # derived from the fields once, in __post_init__ (read per layer on every step: plain
    # attributes, not properties, cost no Python call)
    kind: LayerKind | None = field(init=False, repr=False)
    """How the module's weight, inputs and output gradients map to W, a and g (None for
    the norm layers, which have no Kronecker factors)."""
    dim_out: int = field(init=False, repr=False)
    """d_C: output features / channels (rows of the weight matrix)."""
    dim_in: int = field(init=False, repr=False)
    """d_K: weight-matrix columns, plus one for a trained bias."""
    params: list[nn.Parameter] = field(init=False, repr=False)
    """``[weight]`` or ``[weight, bias]``: the parameters the layer's factors precondition."""

    def __post_init__(self) -> None:
        if not self.modules:
            self.modules = (self.module,)
        self.kind = layer_kind(self.module)
        if self.kind is not None:
            self.dim_out = self.kind.out_features(self.weight)
            self.dim_in = self.weight.numel() // max(self.dim_out, 1) + (self.bias is not None)
        self.params = [self.weight] if self.bias is None else [self.weight, self.bias]

    def __repr__(self) -> str:  # names and shapes, never tensor contents
        bias = ", bias" if self.bias is not None else ""
        weight = tuple(self.weight.shape)
        return f"Layer('{self.name}', {type(self.module).__name__}, weight {weight}{bias})"


def own_parameter(module: nn.Module, name: str) -> Tensor | None:
    """``module.<name>`` without computing it: None for a parametrized tensor
    (``torch.nn.utils.parametrizations.spectral_norm``, ``weight_norm``), whose every read
    runs the parametrization (a spectral norm's power iteration advances its buffers), and
    which is no parameter the optimizer could precondition anyway."""
    if parametrize.is_parametrized(module, name):
        return None
    return getattr(module, name, None)


def sequence_first_modules(model: nn.Module) -> set[int]:
    """ids of the modules inside PyTorch's sequence-first transformer layers
    (``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` with
    ``batch_first=False``, as ``nn.Transformer`` builds them by default): their Linear
    layers see (positions, batch, features), so their batch is dimension 1."""
    found = set()
    for module in model.modules():
        layer_classes = nn.TransformerEncoderLayer | nn.TransformerDecoderLayer
        if isinstance(module, layer_classes) and not module.self_attn.batch_first:
            found.update(id(m) for m in module.modules())
    return found


BATCH_TELLING = (nn.RNNBase, nn.MultiheadAttention)
"""Modules that know where their input's batch is (``batch_first``): ``nn.RNN``,
``nn.LSTM``, ``nn.GRU`` and ``nn.MultiheadAttention``; each call says the model's batch
(:func:`call_batch`)."""


def call_batch(module: nn.Module, args: tuple, kwargs: dict) -> int | None:
    """The samples of one call of a :data:`BATCH_TELLING` module: dimension 0 (with
    ``batch_first=True``) or 1 of its batched input (an RNN's input, attention's query),
    ``batch_sizes[0]`` of a packed sequence; None for an unbatched input."""
    x = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(x, nn.utils.rnn.PackedSequence):
        return int(x.batch_sizes[0])
    if not isinstance(x, Tensor) or x.dim() != 3:
        return None
    return x.shape[0 if module.batch_first else 1]


def bypassed_modules(model: nn.Module) -> set[int]:
    """ids of supported modules whose own forward never runs, so no statistics reach
    them: ``nn.MultiheadAttention`` uses ``out_proj.weight`` directly. Their
    parameters train with the fallback instead."""
    return {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}


def input_matrix(layer: Layer, x: Tensor, dtype: torch.dtype, weight: float = 1.0) -> Tensor:
    """a: (N, d_K) in ``dtype``, a new tensor: the layer input with ones for the bias,
    scaled by 1/√N, then by √weight (:meth:`RowMatrices.inputs`)."""
    return RowMatrices(layer).inputs(x, dtype, weight)


def _scaled_rows(rows: Tensor, bias: bool) -> Tensor:
    """[rows, 1] / √N for rows (N, d), the ones column for a bias (left out without
    one), in a new tensor: the column by one pad (not ones and a cat), then divided in
    place."""
    root = math.sqrt(max(rows.shape[0], 1))
    if not bias:
        return rows / root
    return torch.constant_pad_nd(rows, (0, 1), 1.0).div_(root)


def samples(layer: Layer, output: Tensor, batch_dim: int) -> int:
    """The samples one call's output (or output gradient) holds, from its shape: for
    features-last kinds (Linear-like) the size of leading dimension ``batch_dim``, or of
    the first when there is no such leading dimension (a (B, C) head after pooling in a
    sequence-first model); for other kinds (convolutions: N of (N, C, ...)) the kind's own
    batch size. An unbatched output is one sample."""
    kind = layer.kind
    if batch_dim == 0 or not kind.features_last or output.dim() - 1 <= batch_dim:
        return kind.output_terms(layer.module, output)[0]
    return output.shape[batch_dim]


def loss_terms(layer: Layer, output: Tensor, loss_average: str | None, batch_dim: int = 0) -> int:
    """L: the loss terms one call's output (or output gradient) covers: its samples
    (:func:`samples`), or samples times positions (every row of g) for
    "batch+sequence"; from the shape only."""
    if loss_average == "batch+sequence":
        return layer.kind.output_terms(layer.module, output)[1]
    return samples(layer, output, batch_dim)


def misplaced_batch(layer: Layer, output: Tensor, batch_dim: int, model_batch: int) -> bool:
    """Whether a call counted along ``batch_dim`` looks sequence-first or transposed: its
    count differs from ``model_batch`` (the model input's batch) while another leading
    dimension of its (features-last) output has exactly that size."""
    if not layer.kind.features_last or output.dim() < 3:
        return False
    leading = output.shape[:-1]
    counted = samples(layer, output, batch_dim)
    return counted != model_batch and any(
        size == model_batch for dim, size in enumerate(leading) if dim != batch_dim
    )


def grad_output_matrix(layer: Layer, grad: Tensor, dtype) -> Tensor:
    """g: (N, d_C) in ``dtype``, the raw output gradient (:meth:`RowMatrices.outputs`)."""
    return RowMatrices(layer).outputs(grad, dtype)


def reduced_input_matrix(
    layer: Layer, x: Tensor, grad: Tensor, dtype: torch.dtype, batch_dim: int
) -> Tensor:
    """K-FAC-reduce's a: (B, d_K) in ``dtype``, one row per sample of the call (B =
    :func:`samples` of its output gradient ``grad`` along ``batch_dim``): the mean of
    the sample's rows of :meth:`LayerKind.inputs` (its positions: tokens, patches),
    ones for the bias, scaled by 1/√B."""
    rows = layer.kind.inputs(layer.module, x.detach().to(dtype))
    return _scaled_rows(
        _per_sample(layer, rows, grad, batch_dim, torch.mean), layer.bias is not None
    )


def reduced_grad_output_matrix(
    layer: Layer, grad: Tensor, dtype: torch.dtype, batch_dim: int
) -> Tensor:
    """K-FAC-reduce's g: (B, d_C) in ``dtype``, per sample the sum of its rows of
    :func:`grad_output_matrix` (raw, as there)."""
    rows = layer.kind.output_gradients(layer.module, grad.detach().to(dtype))
    return _per_sample(layer, rows, grad, batch_dim, torch.sum)


def _per_sample(layer: Layer, rows: Tensor, grad: Tensor, batch_dim: int, reduce) -> Tensor:
    """``reduce`` (mean or sum) of ``rows`` (N, d) over each sample's rows: (B, d).

    Features-last kinds order their rows as the output's leading dimensions, the batch
    at ``batch_dim`` (as :func:`samples` counts it); other kinds (Conv2d) sample-major."""
    batch = samples(layer, grad, batch_dim)
    if rows.shape[0] == 0 or batch == 0:  # no rows (an empty batch or sequence)
        return rows.new_zeros(0, rows.shape[-1])
    lead = grad.shape[:-1]
    if layer.kind.features_last and len(lead) > batch_dim > 0:
        rows = rows.reshape(*lead, rows.shape[-1]).movedim(batch_dim, 0)
    return reduce(rows.reshape(batch, -1, rows.shape[-1]), 1)


class RowMatrices:
    """The rows one layer call contributes, a of :func:`input_matrix` and g of
    :func:`grad_output_matrix`, with what depends on the layer alone decided once: its
    kind's row maps and its bias. For the Linear kinds a 2-D input or gradient is its own
    rows (``reshape`` would return a view of the same values), so a call makes no Python
    call beyond these two methods and the ops themselves.
    """

    __slots__ = ("_bias", "_inputs", "_linear", "_module", "_outputs")

    def __init__(self, layer: Layer) -> None:
        kind = layer.kind
        self._module, self._bias = layer.module, layer.bias is not None
        self._inputs, self._outputs = kind.inputs, kind.output_gradients
        cls = type(kind)
        self._linear = (
            cls.inputs is LayerKind.inputs and cls.output_gradients is LayerKind.output_gradients
        )

    def inputs(self, x: Tensor, dtype: torch.dtype, weight: float = 1.0) -> Tensor:
        """a: (N, d_K) in ``dtype``, a new tensor: the rows of ``x`` with ones for the
        bias, scaled by 1/√N, then by √weight (a multiply by 1 changes nothing, so it is
        left out)."""
        if x.requires_grad:  # a statistic, outside the graph (detach only what is in one)
            x = x.detach()
        if x.dtype is not dtype:
            x = x.to(dtype)
        rows = x if self._linear and x.dim() == 2 else self._rows(x)
        # _scaled_rows, inline (a Python call less per layer call)
        n = rows.shape[0]
        root = math.sqrt(n) if n > 1 else 1.0
        a = torch.constant_pad_nd(rows, (0, 1), 1.0).div_(root) if self._bias else rows / root
        return a if weight == 1.0 else a.mul_(math.sqrt(weight))

    def _rows(self, x: Tensor) -> Tensor:
        """The kind's rows of an input (Linear kinds: the input flattened to (N, d))."""
        if self._linear:
            return x.reshape(-1, x.shape[-1])
        return self._inputs(self._module, x)

    def outputs(self, grad: Tensor, dtype: torch.dtype) -> Tensor:
        """g: (N, d_C) in ``dtype``, the raw output gradient (the optimizer scales the
        summed statistics by the loss terms of their forwards); a view of ``grad`` where it
        can be."""
        if grad.requires_grad:  # (a backward with create_graph=True)
            grad = grad.detach()
        if grad.dtype is not dtype:
            grad = grad.to(dtype)
        if not self._linear:
            return self._outputs(self._module, grad)
        return grad if grad.dim() == 2 else grad.reshape(-1, grad.shape[-1])


class SquareSums:
    """The diagonal statistics of one layer's calls, diag(aᵀa) of :func:`input_matrix`
    and diag(gᵀg) of :func:`grad_output_matrix`, in one pass over the input and the
    output gradient (conv patches are not unfolded), float32 (float64 for float64).

    What depends on the layer alone is decided once: its kind, and for the Linear kinds
    the reductions themselves (:func:`singd_cuda.ops.input_sum_squares_for` and
    :func:`~singd_cuda.ops.col_sum_squares_for`, the fused ops or the references as
    ``SINGD_CUDA_FUSED`` says when a device type is first seen), so a call reads no
    environment and makes one op call per side.
    """

    __slots__ = (
        "_bias",
        "_bias_entries",
        "_device_type",
        "_inputs",
        "_kind",
        "_linear",
        "_module",
        "_reduce",
    )

    def __init__(self, layer: Layer) -> None:
        kind = layer.kind
        self._kind, self._module, self._bias = kind, layer.module, layer.bias is not None
        cls = type(kind)
        self._linear = (
            cls.input_sum_squares is LinearKind.input_sum_squares
            and cls.output_sum_squares is LinearKind.output_sum_squares
        )
        self._device_type: str | None = None
        self._reduce = self._inputs = None
        self._bias_entries: dict[tuple, Tensor] = {}

    def _resolve(self, x: Tensor) -> None:
        self._device_type = x.device.type
        self._reduce = _entry(ops.col_sum_squares_for(self._device_type))
        self._inputs = _entry(ops.input_sum_squares_for(self._device_type))

    def inputs(
        self, x: Tensor, dtype: torch.dtype, weight: float = 1.0, scale: Tensor | None = None
    ) -> Tensor:
        """diag(aᵀa) (d_K, the bias entry included) in ``dtype``, a carrying 1/√N, times
        ``weight`` and then, when given, elementwise times ``scale`` (d_K, ``dtype``): for
        the Linear kinds one op (:func:`singd_cuda.ops.input_sum_squares`) when ``dtype``
        is the one it sums in."""
        if x.requires_grad:  # a statistic, outside the graph (detach only what is in one)
            x = x.detach()
        if self._linear:
            if x.device.type != self._device_type:
                self._resolve(x)
            if dtype is ACCUMULATES_IN.get(x.dtype, x.dtype):  # the dtype the op sums in
                return self._inputs(x, weight, self._bias, scale)
            h, rows = self._reduce(x, -1), x.numel() // max(x.shape[-1], 1)
        else:
            h, rows = self._kind.input_sum_squares(self._module, x)
        inv_rows = 1.0 / max(rows, 1)
        # a no-op .to and a product by exactly 1 still cost a dispatch each: left out
        h = (h if h.dtype == dtype else h.to(dtype)).mul_(inv_rows)
        if weight != 1.0:
            h.mul_(weight)
        if self._bias:
            # the bias entry, N, through the same two multiplies (so rounded alike), made
            # once per (N, weight, dtype, device): one op less a call than new_full
            key = (rows, weight, h.dtype, h.device)
            entry = self._bias_entries.get(key)
            if entry is None:
                if len(self._bias_entries) > 64:  # many batch sizes: start over
                    self._bias_entries.clear()
                entry = h.new_full((1,), float(rows)).mul_(inv_rows).mul_(weight)
                self._bias_entries[key] = entry
            h = torch.cat([h, entry])
        return h if scale is None else h.mul_(scale)

    def outputs(self, grad: Tensor, dtype: torch.dtype, scale: Tensor | None = None) -> Tensor:
        """diag(gᵀg) (d_C) of the raw output gradient, in ``dtype``, elementwise times
        ``scale`` (d_C, ``dtype``) when given."""
        if grad.requires_grad:  # backward(create_graph=True)
            grad = grad.detach()
        if self._linear:
            if grad.device.type != self._device_type:
                self._resolve(grad)
            if dtype is ACCUMULATES_IN.get(grad.dtype, grad.dtype):  # the dtype the op sums in
                return self._reduce(grad, -1, scale)
            s = self._reduce(grad, -1)
        else:
            s = self._kind.output_sum_squares(self._module, grad)
        s = s if s.dtype == dtype else s.to(dtype)
        return s if scale is None else s.mul_(scale)


def _entry(op: Callable) -> Callable:
    """A fused op's C++ entry, which its ``OpOverload.__call__`` (a Python call) forwards
    to: the same kernel (unless a Python dispatcher serves the op); other callables as
    they are."""
    if isinstance(op, torch._ops.OpOverload) and getattr(op, "_pyobj_dispatcher", None) is None:
        return op._op
    return op


def input_sum_squares(layer: Layer, x: Tensor, dtype: torch.dtype) -> Tensor:
    """diag(aᵀa) of :func:`input_matrix` (column sums of squares, bias entry included)
    without materialising a (:meth:`SquareSums.inputs`)."""
    return SquareSums(layer).inputs(x, dtype)


def grad_output_sum_squares(layer: Layer, grad: Tensor, dtype: torch.dtype) -> Tensor:
    """diag(gᵀg) of :func:`grad_output_matrix` (:meth:`SquareSums.outputs`)."""
    return SquareSums(layer).outputs(grad, dtype)


def gradient_matrix(layer: Layer, dtype: torch.dtype) -> Tensor:
    """G: (d_C, d_K) in ``dtype``, the weight gradient with the bias gradient appended
    (zeros for a parameter without a gradient, e.g. a frozen weight)."""
    weight_grad = layer.weight.grad
    if weight_grad is None:
        weight_grad = torch.zeros_like(layer.weight)
    G = layer.kind.weight_matrix(weight_grad.detach()).to(dtype)
    if layer.bias is None:
        return G
    bias_grad = layer.bias.grad
    if bias_grad is None:
        bias_grad = torch.zeros_like(layer.bias)
    return torch.cat([G, bias_grad.detach().reshape(-1, 1).to(dtype)], dim=1)


def split_matrix(layer: Layer, M: Tensor) -> list[Tensor]:
    """Inverse of :func:`gradient_matrix`: M (d_C, d_K) into tensors shaped like the params."""
    weight_part = M if layer.bias is None else M[:, :-1]
    weight = layer.kind.weight_from_matrix(weight_part, layer.weight)
    if layer.bias is None:
        return [weight]
    return [weight, M[:, -1].reshape(layer.bias.shape)]
