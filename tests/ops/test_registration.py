"""Op registration: opcheck (schema, fake tensors, functionalization), torch.compile, and the
public wrappers' choice between the fused ops and the reference."""

from __future__ import annotations

import pytest
import torch

from singd_cuda import ops
from singd_cuda.ops import reference


def _list_op_args(n: int = 3):
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 5), (4, 1), (7, 3)][:n]
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    bufs = [torch.randn(s, generator=g) for s in shapes]
    rows = [torch.rand(s[0], generator=g) for s in shapes]
    cols = [torch.rand(s[1], generator=g) for s in shapes]
    return params, grads, bufs, rows, cols


def _opcheck_cases():
    params, grads, bufs, rows, cols = _list_op_args()
    scalar = torch.tensor([0.5])
    flag = torch.zeros(1)
    return {
        "sgd_epilogue_": (params, grads, bufs, 0.1, 0.9, 0.01, False, scalar, flag, False, 0),
        "adam_epilogue_": (params, grads, bufs, 0.1, 0.9, 2, 0.01, True, None, flag, False, 0),
        "diag_precond_step_": (
            params,
            grads,
            bufs,
            rows,
            cols,
            "adafisher",
            0.1,
            0.9,
            1e-3,
            0.0,
            False,
            2,
            scalar,
            flag,
            False,
            0,
        ),
        "diag_factor_update_": (
            [r.clone() for r in rows],
            [torch.zeros_like(r) for r in rows],
            rows,
            [torch.tensor(1.5)] * 3,
            [torch.tensor(0.5)] * 3,
            0.5,
            0.01,
            1e-3,
        ),
        "min_max_normalise_rows_": (torch.empty(3, 5), torch.randn(3, 5)),
        "col_sum_squares": (torch.randn(6, 5), -1),
        "input_sum_squares": (torch.randn(2, 3, 5), 4.0, True),
        "conv2d_patch_sum_squares": (torch.randn(2, 4, 6, 6), (3, 3), (1, 1), (1, 1), (1, 1), 2),
    }


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck(cpu_ops, name):
    torch.library.opcheck(getattr(cpu_ops, name).default, _opcheck_cases()[name])


def _diagonal_step(params, grads, bufs, rows, cols, k, m, x):
    """A diagonal-path step as the optimizer runs it: statistics, factors, update."""
    h = ops.col_sum_squares(x)
    ops.diag_factor_update_(k, m, [h], alpha1=0.5, beta1=0.01, damping=1e-3)
    ops.diag_precond_step_(params, grads, bufs, rows, cols, mode="singd", lr=0.1, momentum=0.9)
    ops.sgd_epilogue_(params, grads, bufs, lr=0.1, momentum=0.9, found_inf=torch.zeros(1))
    ops.adam_epilogue_(params, grads, bufs, lr=0.1, beta=0.9, step=1)
    return h + ops.conv2d_patch_sum_squares(x.view(1, 1, 6, 5), 3, padding=1).sum()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compile_fullgraph_matches_eager(cpu_ops, backend):
    eager = [*_list_op_args(), [torch.ones(5)], [torch.zeros(5)], torch.randn(6, 5)]
    compiled = [[t.clone() for t in a] if isinstance(a, list) else a.clone() for a in eager]
    torch._dynamo.reset()
    out = torch.compile(_diagonal_step, fullgraph=True, backend=backend)(*compiled)
    expected = _diagonal_step(*eager)
    torch.testing.assert_close(out, expected)
    for got, want in zip(compiled[:-1], eager[:-1], strict=True):
        torch.testing.assert_close(got, want)


def test_wrappers_take_the_fused_path(cpu_ops, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("reference path taken")

    monkeypatch.setattr(reference, "sgd_epilogue_", fail)
    monkeypatch.setattr(reference, "col_sum_squares", fail)
    monkeypatch.setattr(reference, "input_sum_squares", fail)
    monkeypatch.setattr(reference, "min_max_normalise_rows_", fail)
    params, grads, bufs, _, _ = _list_op_args()
    ops.sgd_epilogue_(params, grads, bufs, lr=0.1, momentum=0.9)
    ops.min_max_normalise_rows_(bufs[0], params[0])
    ops.col_sum_squares(params[0])
    ops.input_sum_squares(params[0], 2.0, True)
    assert ops.input_sum_squares_for("cpu") is cpu_ops.input_sum_squares.default
    assert ops.fused_available("cpu")
    assert not ops.fused_available("meta")


def test_env_switch_forces_the_reference(cpu_ops, monkeypatch):
    calls = []
    monkeypatch.setenv("SINGD_CUDA_FUSED", "0")
    monkeypatch.setattr(reference, "col_sum_squares", lambda x, dim, scale: calls.append(dim))
    ops.col_sum_squares(torch.ones(3, 2), dim=0)
    assert calls == [0]
    assert not ops.fused_available("cpu")
    assert ops.input_sum_squares_for("cpu") is reference.input_sum_squares
    assert ops.min_max_normalise_rows_for("cpu") is reference.min_max_normalise_rows_


def test_wrappers_accept_empty_lists(cpu_ops):
    ops.sgd_epilogue_([], [], [], lr=0.1)
    ops.diag_factor_update_([], [], [], alpha1=0.5, beta1=0.1, damping=0.0)


def _in_place_calls(params, grads, bufs, rows, cols):
    """Every in-place wrapper, each with the tensors it writes."""
    return {
        "sgd_epilogue_": lambda: ops.sgd_epilogue_(params, grads, bufs, lr=0.1, momentum=0.9),
        "adam_epilogue_": lambda: ops.adam_epilogue_(params, grads, bufs, lr=0.1, beta=0.9, step=1),
        "diag_precond_step_": lambda: ops.diag_precond_step_(
            params, grads, bufs, rows, cols, mode="singd", lr=0.1, momentum=0.9
        ),
    }


@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused", "reference"])
@pytest.mark.parametrize("name", ["sgd_epilogue_", "adam_epilogue_", "diag_precond_step_"])
def test_in_place_ops_bump_version_counters(cpu_ops, monkeypatch, fused, name):
    """As for aten's in-place ops: backward through a value saved before the update raises."""
    monkeypatch.setenv("SINGD_CUDA_FUSED", fused)
    params, grads, bufs, rows, cols = _list_op_args()
    leaf = params[0].requires_grad_()
    loss = (leaf * leaf).sum()  # saves leaf for backward
    before = [t._version for t in params + bufs]
    with torch.no_grad():
        _in_place_calls(params, grads, bufs, rows, cols)[name]()
    assert all(t._version > v for t, v in zip(params + bufs, before, strict=True))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused", "reference"])
def test_factor_update_bumps_version_counters(cpu_ops, monkeypatch, fused):
    monkeypatch.setenv("SINGD_CUDA_FUSED", fused)
    params, _, bufs, rows, _ = _list_op_args()
    k, m = [t[:, 0] for t in params], [t[:, 0] for t in bufs]
    before = [t._version for t in k + m]
    ops.diag_factor_update_(k, m, [r.clone() for r in rows], alpha1=0.5, beta1=0.1, damping=1e-3)
    assert all(t._version > v for t, v in zip(k + m, before, strict=True))
