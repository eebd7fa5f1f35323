"""Fused ops of the optimizers: C++/CUDA kernels (``csrc/``) with a pure-PyTorch reference.

Every function here runs the fused kernel of the ``singd_cuda`` op library when it is
available for the tensors' device (CPU always after the first, cached, JIT build; CUDA when
the CUDA library builds) and otherwise the reference in :mod:`singd_cuda.ops.reference`,
which computes the same values. ``SINGD_CUDA_FUSED=0`` forces the reference path (read at
every call, except by the ``*_for`` functions, which resolve once); a failed
build warns once and falls back to it. ``python -m singd_cuda.ops build [--cuda]`` prebuilds.
The ops are registered as ``torch.ops.singd_cuda.*`` with fake implementations, so code
calling them traces under ``torch.compile(fullgraph=True)``.

Common conventions of the in-place list ops:

- A list op updates every tensor of its lists in one call (one kernel launch per dtype
  combination on CUDA, for up to a few dozen tensors per launch).
- Tensors may have any shape and strides (non-contiguous ones are updated through a
  contiguous copy). Parameters are float32, bfloat16, float16 or float64; gradients and
  state buffers hold the parameter's dtype or float32. Math runs in float32 (float64 for
  float64 parameters) and every result is rounded once into its tensor's dtype.
- ``inv_scale``: optional one-element tensor on the parameters' device (the inverse loss
  scale); the gradient is multiplied by it. None means 1.
- ``found_inf``: optional one-element tensor, read on the device without a host sync; when
  nonzero the call changes nothing (bitwise).
- ``weight_decay`` is coupled (L2, ``u += weight_decay * p``) or, with ``decoupled=True``,
  applied as ``p *= 1 - lr * weight_decay`` before the step.
- ``stochastic_rounding`` (bfloat16 parameters only; ignored for other dtypes) rounds the
  parameter write stochastically with random bits that are a pure function of ``seed``,
  the tensor's position in the list and the element's row-major index, identical on CPU,
  CUDA and the reference. Pass a different ``seed`` every step (e.g. the step count).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain

import torch
from torch import Tensor
from torch.nn.modules.utils import _pair

from . import _build, reference

__all__ = [
    "adam_epilogue_",
    "col_sum_squares",
    "col_sum_squares_for",
    "conv2d_patch_sum_squares",
    "diag_factor_update_",
    "diag_precond_step_",
    "diag_precond_step_for",
    "fused_available",
    "input_sum_squares",
    "input_sum_squares_for",
    "min_max_normalise_rows_",
    "min_max_normalise_rows_for",
    "sgd_epilogue_",
]


@torch.compiler.assume_constant_result
def _fused_for(device_type: str) -> bool:
    if not _build.fused_enabled():
        return False
    if device_type in ("cpu", "cuda"):
        return _build.load(device_type)
    return False


def fused_available(device: torch.device | str = "cpu") -> bool:
    """True when the fused kernels serve tensors on ``device`` (building them if needed)."""
    return _fused_for(torch.device(device).type)


def _use_fused(tensors: Sequence[Tensor]) -> bool:
    return len(tensors) > 0 and _fused_for(tensors[0].device.type)


def _bump_versions(*tensor_lists: Sequence[Tensor]) -> None:
    """The kernels write through data pointers, unseen by autograd: bump the version
    counters as an in-place aten op would, so that backward through a tensor saved before
    the update raises instead of silently using the new values."""
    torch.autograd.graph.increment_version(list(chain.from_iterable(tensor_lists)))


def sgd_epilogue_(
    params: Sequence[Tensor],
    updates: Sequence[Tensor],
    momentum_bufs: Sequence[Tensor],
    *,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    decoupled: bool = False,
    inv_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> None:
    """SGD-momentum update epilogue of every parameter, in place.

    Per tensor i, elementwise: ``u = updates[i] * inv_scale`` (``+ weight_decay * p`` when
    coupled); with momentum ``buf = momentum * buf + u`` and the step is ``buf`` (with
    ``momentum == 0`` the step is ``u`` and ``momentum_bufs`` may be empty); decoupled:
    ``p *= 1 - lr * weight_decay``; ``p -= lr * step``.

    Args:
        params: parameters of any shapes, updated in place.
        updates: the update directions (e.g. preconditioned gradients), shapes of params.
        momentum_bufs: momentum buffers, shapes of params, updated in place.
        lr: the learning rate (a Python float).
        momentum: the heavy-ball momentum (a Python float; 0 for none).
        weight_decay: the weight decay (a Python float; default 0).
        decoupled: True for decoupled (AdamW-style) weight decay, False (default) to add it
            to the update.
        inv_scale: see the module docstring.
        found_inf: see the module docstring.
        stochastic_rounding: see the module docstring.
        seed: see the module docstring.
    """
    if _use_fused(params):
        torch.ops.singd_cuda.sgd_epilogue_(
            params,
            updates,
            momentum_bufs,
            lr,
            momentum,
            weight_decay,
            decoupled,
            inv_scale,
            found_inf,
            stochastic_rounding,
            seed,
        )
        _bump_versions(params, momentum_bufs)
    else:
        reference.sgd_epilogue_(
            params,
            updates,
            momentum_bufs,
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            decoupled=decoupled,
            inv_scale=inv_scale,
            found_inf=found_inf,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
        )


def adam_epilogue_(
    params: Sequence[Tensor],
    updates: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    *,
    lr: float,
    beta: float,
    step: int,
    weight_decay: float = 0.0,
    decoupled: bool = False,
    inv_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> None:
    """Adam-style momentum epilogue (bias correction, no square root), in place.

    Per tensor i, elementwise: ``u`` as in :func:`sgd_epilogue_`;
    ``m = beta * m + (1 - beta) * u``; decoupled: ``p *= 1 - lr * weight_decay``;
    ``p -= (lr / (1 - beta**step)) * m``.

    Args:
        params: parameters of any shapes, updated in place.
        updates: the update directions, shapes of params.
        exp_avgs: first-moment buffers m, shapes of params, updated in place.
        lr: the learning rate (a Python float).
        beta: the first-moment decay, ``0 <= beta < 1``.
        step: the 1-based step count of the bias correction (a Python int, >= 1).
        weight_decay: the weight decay (a Python float; default 0).
        decoupled: True for decoupled weight decay, False (default) to add it to the update.
        inv_scale: see the module docstring.
        found_inf: see the module docstring.
        stochastic_rounding: see the module docstring.
        seed: see the module docstring.
    """
    if _use_fused(params):
        torch.ops.singd_cuda.adam_epilogue_(
            params,
            updates,
            exp_avgs,
            lr,
            beta,
            step,
            weight_decay,
            decoupled,
            inv_scale,
            found_inf,
            stochastic_rounding,
            seed,
        )
        _bump_versions(params, exp_avgs)
    else:
        reference.adam_epilogue_(
            params,
            updates,
            exp_avgs,
            lr=lr,
            beta=beta,
            step=step,
            weight_decay=weight_decay,
            decoupled=decoupled,
            inv_scale=inv_scale,
            found_inf=found_inf,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
        )


def diag_precond_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    bufs: Sequence[Tensor],
    row_scales: Sequence[Tensor],
    col_scales: Sequence[Tensor],
    *,
    mode: str,
    lr: float,
    momentum: float,
    damping: float = 0.0,
    weight_decay: float = 0.0,
    decoupled: bool = False,
    step: int = 1,
    inv_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> None:
    """One pass over W, G and state for the diagonal structures, preconditioning included.

    ``params[i]`` is a 2-D (d_C, n) view of a weight (conv weights flattened to
    (d_C, C_in/groups * kh * kw)) or a bias as a (d_C, 1) view; ``grads[i]`` its gradient
    (for a (d_C, 1) or (1, n) matrix also as the vector itself: a bias's own gradient),
    ``row_scales[i]`` has d_C entries and ``col_scales[i]`` n entries (1 for a bias: the
    bias column's entry of the K side). Scales are used in float32 (float64 for float64
    parameters); pass them in that dtype to avoid a conversion.

    ``mode`` is the op schema's ``variant`` argument (the name ``mode`` collides with
    PyTorch's functionalization internals):

    - ``mode="singd"``: row_scale = c², col_scale = k² (diagonals of C Cᵀ and K Kᵀ); the
      direction ``row_i * col_j * g_ij`` goes through the SGD-momentum epilogue of
      :func:`sgd_epilogue_` (``momentum`` is α₂; ``damping`` and ``step`` are unused).
    - ``mode="adafisher"``: row_scale = s', col_scale = h' (min–max normalised EMAs);
      ``F_ij = row_i * col_j + damping`` is formed on the fly (no d_C × n temporary) and
      ``m = momentum * m + (1 - momentum) * u``, ``p -= (lr / (1 - momentum**step)) * m / F``
      with ``u = g * inv_scale`` (+ coupled weight decay).

    Args:
        bufs: momentum buffers (singd; may be empty when momentum == 0) or the Adam first
            moments (adafisher), shapes of params, updated in place.
        step: 1-based step count of AdaFisher's bias correction.

    The other arguments are as in :func:`sgd_epilogue_` and the module docstring.
    """
    step_op = _fused_diag_precond_step_ if _use_fused(params) else reference.diag_precond_step_
    step_op(
        params,
        grads,
        bufs,
        row_scales,
        col_scales,
        mode=mode,
        lr=lr,
        momentum=momentum,
        damping=damping,
        weight_decay=weight_decay,
        decoupled=decoupled,
        step=step,
        inv_scale=inv_scale,
        found_inf=found_inf,
        stochastic_rounding=stochastic_rounding,
        seed=seed,
    )


def diag_precond_step_for(device_type: str) -> Callable[..., None]:
    """:func:`diag_precond_step_` (the same arguments) for tensors on ``device_type``,
    resolved once: the fused op or the reference, as ``SINGD_CUDA_FUSED`` says now. For
    callers that step every layer at every step, which then read no environment per
    call."""
    if _fused_for(device_type):
        return _fused_diag_precond_step_
    return reference.diag_precond_step_


def _fused_diag_precond_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    bufs: Sequence[Tensor],
    row_scales: Sequence[Tensor],
    col_scales: Sequence[Tensor],
    *,
    mode: str,
    lr: float,
    momentum: float,
    damping: float = 0.0,
    weight_decay: float = 0.0,
    decoupled: bool = False,
    step: int = 1,
    inv_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> None:
    torch.ops.singd_cuda.diag_precond_step_(
        params,
        grads,
        bufs,
        row_scales,
        col_scales,
        mode,
        lr,
        momentum,
        damping,
        weight_decay,
        decoupled,
        step,
        inv_scale,
        found_inf,
        stochastic_rounding,
        seed,
    )
    _bump_versions(params, bufs)


def diag_factor_update_(
    k: Sequence[Tensor],
    m: Sequence[Tensor],
    h: Sequence[Tensor],
    a: Sequence[Tensor] = (),
    b: Sequence[Tensor] = (),
    *,
    alpha1: float,
    beta1: float,
    damping: float,
) -> None:
    """Diagonal SINGD factor update of one side of every layer, in one pass, in place.

    Per factor i, elementwise:
    ``m_hat = 0.5 * (a_i * h + (damping * b_i) * k**2 - 1)``, ``m = alpha1 * m + m_hat``,
    ``k = k * (1 - beta1 * m)``.

    On the CPU a 2-D ``k[i]`` (n, d) whose ``a[i]`` and ``b[i]`` (those given) hold n > 1
    values is n factors, its rows (each contiguous, any row stride; ``m[i]`` and ``h[i]``
    alike), with the values of row r at ``a[i][r]`` and ``b[i][r]``: a stack of factors in
    one entry, bitwise as its rows one by one. (The CUDA op takes one factor per entry.)

    Args:
        k: diagonal factors (d,), any floating dtype, updated in place.
        m: their momenta, shapes of k, k's dtype or float32, updated in place.
        h: diag(H) of the factor's side, e.g. H_K = k² ⊙ diag(aᵀa) with diag(aᵀa) from
            :func:`col_sum_squares` or :func:`conv2d_patch_sum_squares`; shapes of k, k's
            dtype or float32.
        a: one-element tensors tr̄(H) of the other side, one per factor, read on the device;
            empty means 1 (IKFAC).
        b: one-element tensors tr̄(Π̂(otherᵀ other)), one per factor; empty means 1.
        alpha1: α₁, the Riemannian momentum (0 for IKFAC).
        beta1: β₁, the factor step size (``lr_cov``).
        damping: λ.
    """
    if _use_fused(k):
        torch.ops.singd_cuda.diag_factor_update_(k, m, h, a, b, alpha1, beta1, damping)
        _bump_versions(k, m)
    else:
        reference.diag_factor_update_(k, m, h, a, b, alpha1=alpha1, beta1=beta1, damping=damping)


def min_max_normalise_rows_(out: Tensor, v: Tensor) -> None:
    """Every row of ``v`` scaled to [0, 1] into ``out``, in one op (AdaFisher's s′, h′).

    Row by row: ``(v - min + c) / max(max - min + c, tiny)`` with c = 1 for a constant row
    (which maps to ones: no direction is preferred) and 0 otherwise, min and max of the
    row, tiny the smallest normal number of out's dtype. v: (rows, d) or (d,) (one row),
    d ≥ 1, any floating dtype, each row contiguous (rows may lie apart: the padded rows of
    a resident stack); out: v's shape on v's device, float32 or float64, rows contiguous.
    The arithmetic is in out's dtype, each operation rounded once as the reference's
    separate ``aminmax``, ``sub``, ``sign``, ``add``, ``clamp_min`` and ``div`` round it;
    a row holding a NaN comes out NaN. Allocates nothing.
    """
    min_max_normalise_rows_for(out.device.type)(out, v)


def min_max_normalise_rows_for(device_type: str) -> Callable[[Tensor, Tensor], None]:
    """:func:`min_max_normalise_rows_` for tensors on ``device_type``, resolved once: the
    fused op or the reference, as ``SINGD_CUDA_FUSED`` says now. For callers that
    normalise at every step, which then read no environment per call."""
    if _fused_for(device_type):
        return _fused_min_max_normalise_rows_
    return reference.min_max_normalise_rows_


def _fused_min_max_normalise_rows_(out: Tensor, v: Tensor) -> None:
    torch.ops.singd_cuda.min_max_normalise_rows_(out, v)
    torch.autograd.graph.increment_version(out)  # (see _bump_versions)


def col_sum_squares(x: Tensor, dim: int = -1, scale: Tensor | None = None) -> Tensor:
    """Sum of x² over every dimension except ``dim``, in one pass.

    For x of shape (N, d) and ``dim=-1`` this is diag(xᵀx), the column sums of squares;
    for a conv output gradient (B, C, H, W) and ``dim=1`` the per-channel sums. Any
    floating input dtype; the result has shape (x.shape[dim],) and dtype float32 (float64
    for float64 input), accumulated in that dtype. ``scale``: a vector of the result's
    shape, dtype and device multiplied into it, each product rounded once as a separate
    ``mul_`` rounds (SINGD's diagonal statistics c² ⊙ diag(gᵀg) in the same op). A
    statistic: not differentiable.
    """
    if _fused_for(x.device.type):
        return torch.ops.singd_cuda.col_sum_squares(x, dim, scale)
    return reference.col_sum_squares(x, dim, scale)


def col_sum_squares_for(device_type: str) -> Callable[..., Tensor]:
    """:func:`col_sum_squares` for tensors on ``device_type``, resolved once: the fused
    op or the reference, as ``SINGD_CUDA_FUSED`` says now. For callers that reduce on
    every layer call (the curvature capture), which then read no environment per call."""
    if _fused_for(device_type):
        return torch.ops.singd_cuda.col_sum_squares.default
    return reference.col_sum_squares


def input_sum_squares(
    x: Tensor, weight: float = 1.0, bias: bool = False, scale: Tensor | None = None
) -> Tensor:
    """diag(aᵀa)·w of a Linear layer's input rows a = [x, 1] / √N, in one op.

    x (..., d), any floating dtype, taken as N = numel / d rows of d. The result is
    (d,) (d + 1 with ``bias``: the bias column's entry last), float32 (float64 for float64
    input): ``col_sum_squares(x, -1)`` multiplied by 1/N (1 when N = 0) and then by
    ``weight``, each product rounded once as a separate multiply by that scalar rounds,
    and the bias entry N, multiplied alike; then, when given, by ``scale`` (a vector of
    the result's shape, dtype and device) as a separate ``mul_`` would. A statistic: not
    differentiable.
    """
    if _fused_for(x.device.type):
        return torch.ops.singd_cuda.input_sum_squares(x, weight, bias, scale)
    return reference.input_sum_squares(x, weight, bias, scale)


def input_sum_squares_for(device_type: str) -> Callable[..., Tensor]:
    """:func:`input_sum_squares` for tensors on ``device_type``, resolved once (as
    :func:`col_sum_squares_for`)."""
    if _fused_for(device_type):
        return torch.ops.singd_cuda.input_sum_squares.default
    return reference.input_sum_squares


def conv2d_patch_sum_squares(
    x: Tensor,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
) -> Tensor:
    """diag(aᵀa) of the unfolded conv2d input, without unfolding it.

    ``a`` is ``F.unfold`` of x after averaging corresponding channels over the ``groups``
    channel groups (x.view(B, groups, C/groups, H, W).mean(1)), with zero padding: one row
    per (sample, output position). x is (B, C, H, W) of any floating dtype; the result has
    shape (C/groups * kh * kw,), ordered like unfold's rows, float32 (float64 for float64
    input). Other padding modes or asymmetric padding: pad x first and pass padding=0.
    A statistic: not differentiable.
    """
    args = (_pair(kernel_size), _pair(stride), _pair(padding), _pair(dilation), groups)
    if _fused_for(x.device.type):
        return torch.ops.singd_cuda.conv2d_patch_sum_squares(x, *args)
    return reference.conv2d_patch_sum_squares(x, *args)
