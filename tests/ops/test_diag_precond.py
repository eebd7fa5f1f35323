"""diag_precond_step_ (SINGD diagonal and AdaFisher modes) against the reference."""

from __future__ import annotations

import pytest
import torch

from singd_cuda.ops import reference

from .conftest import DTYPES, LAYOUTS, assert_bitwise, clones, make

# Weight-like (rows, cols) shapes, a bias as (rows, 1), empty, and one larger than a span.
SHAPES_2D = [(1, 1), (3, 7), (5, 1), (0, 4), (9, 17), (260, 129)]
# (mode, momentum or beta, weight_decay, decoupled, inverse loss scale, rounding,
#  float32 gradients and state)
CONFIGS = {
    "singd-plain": ("singd", 0.0, 0.0, False, None, False, False),
    "singd-momentum+l2+unscale": ("singd", 0.9, 0.01, False, 0.25, False, True),
    "singd-decoupled+sr": ("singd", 0.9, 0.1, True, 0.5, True, False),
    "adafisher+l2": ("adafisher", 0.9, 0.01, False, None, False, True),
    "adafisher-decoupled+unscale+sr": ("adafisher", 0.8, 0.1, True, 0.125, True, False),
}


def _case(dtype, layout, device, gen, fp32_companions):
    companion = torch.float32 if fp32_companions else dtype
    scale_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    params = [make(s, dtype, device, gen, layout) for s in SHAPES_2D]
    grads = [make(s, companion, device, gen, layout) for s in SHAPES_2D]
    bufs = [make(s, companion, device, gen, layout) for s in SHAPES_2D]
    rows = [make((s[0],), scale_dtype, device, gen, low=0.0) for s in SHAPES_2D]
    cols = [make((s[1],), scale_dtype, device, gen, low=0.0) for s in SHAPES_2D]
    return params, grads, bufs, rows, cols


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_diag_precond_step(device, gen, dtype, layout, config):
    mode, momentum, wd, decoupled, inv, sr, fp32_companions = CONFIGS[config]
    params, grads, bufs, rows, cols = _case(dtype, layout, device, gen, fp32_companions)
    ref_params, ref_bufs = clones(params), clones(bufs)
    inv_scale = None if inv is None else torch.tensor([inv], device=device)
    torch.ops.singd_cuda.diag_precond_step_(
        params,
        grads,
        bufs,
        rows,
        cols,
        mode,
        0.01,
        momentum,
        1e-3,
        wd,
        decoupled,
        4,
        inv_scale,
        None,
        sr,
        5,
    )
    reference.diag_precond_step_(
        ref_params,
        grads,
        ref_bufs,
        rows,
        cols,
        mode=mode,
        lr=0.01,
        momentum=momentum,
        damping=1e-3,
        weight_decay=wd,
        decoupled=decoupled,
        step=4,
        inv_scale=inv_scale,
        stochastic_rounding=sr,
        seed=5,
    )
    assert_bitwise(params, ref_params)
    assert_bitwise(bufs, ref_bufs)


def test_scales_in_other_dtypes_are_converted(device, gen):
    params, grads, bufs, rows, cols = _case(torch.float32, "contiguous", device, gen, False)
    rows16 = [r.to(torch.bfloat16) for r in rows]
    ref_params, ref_bufs = clones(params), clones(bufs)
    torch.ops.singd_cuda.diag_precond_step_(
        params,
        grads,
        bufs,
        rows16,
        cols,
        "adafisher",
        0.01,
        0.9,
        1e-3,
        0.0,
        False,
        1,
        None,
        None,
        False,
        0,
    )
    reference.diag_precond_step_(
        ref_params,
        grads,
        ref_bufs,
        rows16,
        cols,
        mode="adafisher",
        lr=0.01,
        momentum=0.9,
        damping=1e-3,
    )
    assert_bitwise(params, ref_params)


@pytest.mark.parametrize("mode", ["singd", "adafisher"])
def test_found_inf_changes_nothing(device, gen, mode):
    params, grads, bufs, rows, cols = _case(torch.bfloat16, "strided", device, gen, True)
    before_p, before_b = clones(params), clones(bufs)
    found_inf = torch.tensor([float("inf")], device=device)
    torch.ops.singd_cuda.diag_precond_step_(
        params,
        grads,
        bufs,
        rows,
        cols,
        mode,
        0.01,
        0.9,
        1e-3,
        0.1,
        True,
        1,
        None,
        found_inf,
        True,
        0,
    )
    reference.diag_precond_step_(
        params,
        grads,
        bufs,
        rows,
        cols,
        mode=mode,
        lr=0.01,
        momentum=0.9,
        damping=1e-3,
        weight_decay=0.1,
        decoupled=True,
        found_inf=found_inf,
        stochastic_rounding=True,
    )
    assert_bitwise(params, before_p)
    assert_bitwise(bufs, before_b)


def test_invalid_arguments_raise(cpu_ops, gen):
    p = [make((3, 4), torch.float32, "cpu", gen)]
    rows, cols = [torch.ones(3)], [torch.ones(4)]
    with pytest.raises(RuntimeError, match="mode must be 'singd' or 'adafisher'"):
        cpu_ops.diag_precond_step_(
            p, p, p, rows, cols, "adam", 0.1, 0.9, 0.0, 0.0, False, 1, None, None, False, 0
        )
    with pytest.raises(RuntimeError, match=r"col_scales\[0\] has 3 entries, expected 4"):
        cpu_ops.diag_precond_step_(
            p, p, p, rows, rows, "singd", 0.1, 0.9, 0.0, 0.0, False, 1, None, None, False, 0
        )
    with pytest.raises(RuntimeError, match="must be 2-D"):
        flat = [torch.zeros(12)]
        cpu_ops.diag_precond_step_(
            flat,
            flat,
            flat,
            rows,
            cols,
            "singd",
            0.1,
            0.9,
            0.0,
            0.0,
            False,
            1,
            None,
            None,
            False,
            0,
        )
    with pytest.raises(ValueError, match="mode must be"):
        reference.diag_precond_step_(p, p, p, rows, cols, mode="adam", lr=0.1, momentum=0.9)


@pytest.mark.parametrize("mode", ["singd", "adafisher"])
@pytest.mark.parametrize("shape", [(5, 1), (1, 6)], ids=["column", "row"])
def test_a_vector_gradient_of_a_one_column_matrix(device, gen, mode, shape):
    """A bias's (d,) gradient for its (d, 1) matrix (or a vector for a one-row matrix) is
    taken as it is: the same result, bit for bit, as its matrix view, fused and reference;
    the state must still have the matrix's shape."""
    params = [make(shape, torch.float32, device, gen)]
    grads = [make((shape[0] * shape[1],), torch.float32, device, gen)]
    bufs = [make(shape, torch.float32, device, gen)]
    rows = [make((shape[0],), torch.float32, device, gen, low=0.0)]
    cols = [make((shape[1],), torch.float32, device, gen, low=0.0)]
    hyper = (mode, 0.01, 0.9, 1e-3, 0.01, False, 3, None, None, False, 5)
    expected_params, expected_bufs = clones(params), clones(bufs)
    viewed = [grads[0].view(shape)]
    torch.ops.singd_cuda.diag_precond_step_(
        expected_params, viewed, expected_bufs, rows, cols, *hyper
    )
    torch.ops.singd_cuda.diag_precond_step_(params, grads, bufs, rows, cols, *hyper)
    assert_bitwise(params, expected_params)
    assert_bitwise(bufs, expected_bufs)
    ref_params, ref_bufs = clones(expected_params), clones(expected_bufs)
    kwargs = dict(mode=mode, lr=0.01, momentum=0.9, damping=1e-3, weight_decay=0.01, step=3)
    reference.diag_precond_step_(ref_params, grads, ref_bufs, rows, cols, **kwargs)
    reference.diag_precond_step_(expected_params, viewed, expected_bufs, rows, cols, **kwargs)
    assert_bitwise(ref_params, expected_params)
    with pytest.raises(RuntimeError, match=r"bufs\[0\] has shape"):
        torch.ops.singd_cuda.diag_precond_step_(params, grads, grads, rows, cols, *hyper)


def test_a_vector_gradient_of_a_wider_matrix_raises(cpu_ops, gen):
    p = [make((3, 2), torch.float32, "cpu", gen)]
    with pytest.raises(RuntimeError, match=r"grads\[0\] has shape \[6\], expected \[3, 2\]"):
        cpu_ops.diag_precond_step_(
            p, [torch.zeros(6)], p, [torch.ones(3)], [torch.ones(2)],
            "singd", 0.1, 0.9, 0.0, 0.0, False, 1, None, None, False, 0,
        )  # fmt: skip
