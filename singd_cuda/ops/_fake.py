"""Fake (meta) implementations of the ``singd_cuda`` ops, for FakeTensor tracing.

The C++ library names this module (``set_python_module``), so PyTorch imports it whenever
it needs a fake implementation; ``_build`` imports it right after loading the library.
The in-place ops return nothing, the reductions an empty tensor of the output's shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("singd_cuda::sgd_epilogue_")
def _sgd_epilogue(
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
) -> None:
    return None


@torch.library.register_fake("singd_cuda::adam_epilogue_")
def _adam_epilogue(
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
) -> None:
    return None


@torch.library.register_fake("singd_cuda::diag_precond_step_")
def _diag_precond_step(
    params,
    grads,
    bufs,
    row_scales,
    col_scales,
    variant,
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
) -> None:
    return None


@torch.library.register_fake("singd_cuda::diag_factor_update_")
def _diag_factor_update(k, m, h, a, b, alpha1, beta1, damping) -> None:
    return None


@torch.library.register_fake("singd_cuda::col_sum_squares")
def _col_sum_squares(x: Tensor, dim: int = -1, scale: Tensor | None = None) -> Tensor:
    return x.new_empty((x.shape[dim],), dtype=_opmath(x.dtype))


@torch.library.register_fake("singd_cuda::input_sum_squares")
def _input_sum_squares(x: Tensor, weight: float, bias: bool, scale: Tensor | None = None) -> Tensor:
    return x.new_empty((x.shape[-1] + bias,), dtype=_opmath(x.dtype))


@torch.library.register_fake("singd_cuda::conv2d_patch_sum_squares")
def _conv2d_patch_sum_squares(
    x: Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> Tensor:
    size = x.shape[1] // groups * kernel_size[0] * kernel_size[1]
    return x.new_empty((size,), dtype=_opmath(x.dtype))


@torch.library.register_fake("singd_cuda::min_max_normalise_rows_")
def _min_max_normalise_rows(out, v) -> None:
    return None
