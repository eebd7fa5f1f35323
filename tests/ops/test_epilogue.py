"""sgd_epilogue_ and adam_epilogue_ against the reference, on every dtype and layout."""

from __future__ import annotations

import pytest
import torch

from singd_cuda.ops import reference

from .conftest import DTYPES, LAYOUTS, SHAPES, assert_bitwise, clones, make

# (momentum or beta, weight_decay, decoupled, inverse loss scale, state in float32, rounding)
CONFIGS = {
    "plain": (0.0, 0.0, False, None, False, False),
    "momentum+l2+unscale": (0.9, 0.01, False, 0.25, False, False),
    "decoupled+fp32-state": (0.9, 0.1, True, 0.5, True, False),
    "stochastic-rounding": (0.9, 0.01, True, None, True, True),
}


def _lists(dtype, layout, device, gen, fp32_state):
    params = [make(s, dtype, device, gen, layout) for s in SHAPES]
    updates = [make(s, dtype, device, gen, layout) for s in SHAPES]
    state_dtype = torch.float32 if fp32_state else dtype
    state = [make(s, state_dtype, device, gen, layout) for s in SHAPES]
    return params, updates, state


def _scalars(inv, device):
    return (None if inv is None else torch.tensor([inv], device=device)), torch.zeros(
        1, device=device
    )


def _assert_sgd_matches_reference(params, updates, bufs, hyper, scalars, sr, seed):
    """sgd_epilogue_ on (params, updates, bufs) writes what the reference writes on
    copies, bit for bit; ``scalars`` is (inv_scale, found_inf)."""
    ref_params, ref_bufs = clones(params), clones(bufs)
    inv_scale, found_inf = scalars
    torch.ops.singd_cuda.sgd_epilogue_(
        params, updates, bufs, *hyper.values(), inv_scale, found_inf, sr, seed
    )
    reference.sgd_epilogue_(
        ref_params,
        updates,
        ref_bufs,
        **hyper,
        inv_scale=inv_scale,
        found_inf=found_inf,
        stochastic_rounding=sr,
        seed=seed,
    )
    assert_bitwise(params, ref_params)
    assert_bitwise(bufs, ref_bufs)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sgd_epilogue(device, gen, dtype, layout, config):
    momentum, wd, decoupled, inv, fp32_state, sr = CONFIGS[config]
    params, updates, bufs = _lists(dtype, layout, device, gen, fp32_state)
    hyper = dict(lr=0.1, momentum=momentum, weight_decay=wd, decoupled=decoupled)
    _assert_sgd_matches_reference(params, updates, bufs, hyper, _scalars(inv, device), sr, 1234)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_adam_epilogue(device, gen, dtype, layout, config):
    beta, wd, decoupled, inv, fp32_state, sr = CONFIGS[config]
    params, updates, exp_avgs = _lists(dtype, layout, device, gen, fp32_state)
    ref_params, ref_avgs = clones(params), clones(exp_avgs)
    inv_scale, found_inf = _scalars(inv, device)
    hyper = dict(lr=0.01, beta=beta, step=3, weight_decay=wd, decoupled=decoupled)
    torch.ops.singd_cuda.adam_epilogue_(
        params, updates, exp_avgs, *hyper.values(), inv_scale, found_inf, sr, 99
    )
    reference.adam_epilogue_(
        ref_params,
        updates,
        ref_avgs,
        **hyper,
        inv_scale=inv_scale,
        found_inf=found_inf,
        stochastic_rounding=sr,
        seed=99,
    )
    assert_bitwise(params, ref_params)
    assert_bitwise(exp_avgs, ref_avgs)


@pytest.mark.parametrize("sr", [False, True])
def test_a_conv_shaped_view_of_a_matrix_is_read_where_it_lies(device, gen, sr):
    """The preconditioned weight of a conv with a bias: M[:, :-1] of M (d_C, d_K) reshaped
    to the weight's 4-D shape (rows contiguous, a row stride of d_K)."""
    M = make((4, 2 * 3 * 3 + 1), torch.float32, device, gen)
    update = M[:, :-1].reshape(4, 2, 3, 3)
    params = [make((4, 2, 3, 3), torch.bfloat16, device, gen)]
    bufs = [make((4, 2, 3, 3), torch.float32, device, gen)]
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=0.01, decoupled=False)
    _assert_sgd_matches_reference(params, [update], bufs, hyper, _scalars(0.5, device), sr, 7)


@pytest.mark.parametrize("sr", [False, True])
def test_a_bias_column_of_a_matrix_is_read_where_it_lies(device, gen, sr):
    """The preconditioned bias of a layer: M[:, -1] of M (d_C, d_K), a vector of stride
    d_K (rows of one element), next to its weight M[:, :-1]."""
    M = make((33, 17), torch.float32, device, gen)
    params = [make((33, 16), torch.bfloat16, device, gen), make((33,), torch.float32, device, gen)]
    bufs = [make((33, 16), torch.float32, device, gen), make((33,), torch.float32, device, gen)]
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=0.01, decoupled=False)
    updates = [M[:, :-1], M[:, -1]]
    _assert_sgd_matches_reference(params, updates, bufs, hyper, _scalars(0.5, device), sr, 7)


def test_sgd_without_momentum_leaves_buffers_and_accepts_none(device, gen):
    params = [make((5, 3), torch.float32, device, gen)]
    updates = [make((5, 3), torch.float32, device, gen)]
    bufs = [make((5, 3), torch.float32, device, gen)]
    before = clones(bufs)
    expected = [params[0] - 0.5 * updates[0]]
    torch.ops.singd_cuda.sgd_epilogue_(
        params, updates, bufs, 0.5, 0.0, 0.0, False, None, None, False, 0
    )
    torch.ops.singd_cuda.sgd_epilogue_(
        params, updates, [], 0.0, 0.0, 0.0, False, None, None, False, 0
    )
    assert_bitwise(bufs, before)
    assert_bitwise(params, expected)


@pytest.mark.parametrize("op", ["sgd", "adam"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_found_inf_changes_nothing(device, gen, dtype, op):
    params, updates, state = _lists(dtype, "strided", device, gen, False)
    before_p, before_s = clones(params), clones(state)
    found_inf = torch.ones(1, device=device)
    inv_scale = torch.tensor([0.5], device=device)
    for impl in ("fused", "reference"):
        if op == "sgd" and impl == "fused":
            torch.ops.singd_cuda.sgd_epilogue_(
                params, updates, state, 0.1, 0.9, 0.1, True, inv_scale, found_inf, True, 1
            )
        elif op == "sgd":
            reference.sgd_epilogue_(
                params,
                updates,
                state,
                lr=0.1,
                momentum=0.9,
                weight_decay=0.1,
                decoupled=True,
                inv_scale=inv_scale,
                found_inf=found_inf,
                stochastic_rounding=True,
            )
        elif impl == "fused":
            torch.ops.singd_cuda.adam_epilogue_(
                params, updates, state, 0.1, 0.9, 1, 0.1, False, inv_scale, found_inf, True, 1
            )
        else:
            reference.adam_epilogue_(
                params,
                updates,
                state,
                lr=0.1,
                beta=0.9,
                step=1,
                weight_decay=0.1,
                inv_scale=inv_scale,
                found_inf=found_inf,
                stochastic_rounding=True,
            )
        assert_bitwise(params, before_p)
        assert_bitwise(state, before_s)


def test_mixed_dtypes_in_one_list(device, gen):
    """One call may mix parameter dtypes and float32 / same-dtype companions."""
    specs = [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ] * 20
    params = [make((33,), p, device, gen) for p, _ in specs]
    updates = [make((33,), s, device, gen) for _, s in specs]
    bufs = [make((33,), s, device, gen) for _, s in specs]
    ref_params, ref_bufs = clones(params), clones(bufs)
    torch.ops.singd_cuda.sgd_epilogue_(
        params, updates, bufs, 0.1, 0.9, 0.0, False, None, None, True, 7
    )
    reference.sgd_epilogue_(
        ref_params, updates, ref_bufs, lr=0.1, momentum=0.9, stochastic_rounding=True, seed=7
    )
    assert_bitwise(params, ref_params)
    assert_bitwise(bufs, ref_bufs)


def test_invalid_arguments_raise(cpu_ops, gen):
    p = [make((4,), torch.float32, "cpu", gen)]
    with pytest.raises(RuntimeError, match="sgd_epilogue_: updates has 0 tensors"):
        cpu_ops.sgd_epilogue_(p, [], [], 0.1, 0.0, 0.0, False, None, None, False, 0)
    with pytest.raises(RuntimeError, match="momentum_bufs has 0 tensors, expected 1"):
        cpu_ops.sgd_epilogue_(p, p, [], 0.1, 0.9, 0.0, False, None, None, False, 0)
    with pytest.raises(RuntimeError, match="has shape"):
        cpu_ops.sgd_epilogue_(p, [torch.zeros(5)], [], 0.1, 0.0, 0.0, False, None, None, False, 0)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_ops.sgd_epilogue_(
            p, [torch.zeros(4, dtype=torch.float16)], [], 0.1, 0.0, 0.0, False, None, None, False, 0
        )
    with pytest.raises(RuntimeError, match="step must be >= 1"):
        cpu_ops.adam_epilogue_(p, p, p, 0.1, 0.9, 0, 0.0, False, None, None, False, 0)
    with pytest.raises(RuntimeError, match="found_inf must have one element"):
        cpu_ops.sgd_epilogue_(p, p, [], 0.1, 0.0, 0.0, False, None, torch.zeros(2), False, 0)
