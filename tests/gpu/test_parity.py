"""Fused CUDA, fused CPU and the reference (on either device) round alike, bit for bit.

The kernels are built without FMA contraction (``--fmad=false``, ``-ffp-contract=off``), so
every multiply and add of the element math rounds once, like the reference's separate
tensor ops; stochastic rounding draws the same bits everywhere. Shapes cross the CUDA
launch chunk (8192 elements) and storage offsets make the pointers unaligned, so the
scalar head, the vector body and the scalar tail of every kernel are all compared.
"""

from __future__ import annotations

import pytest
import torch

from singd_cuda import ops
from singd_cuda.ops import reference

from .conftest import assert_bitwise, on, randn

pytestmark = pytest.mark.gpu

SHAPES = [(1, 1), (3, 5), (9, 17), (40, 1000), (2, 8192 + 13)]
PATHS = ["fused-cuda", "fused-cpu", "reference-cuda"]  # each against the reference on the CPU
# (parameter dtype, companion dtype, stochastic rounding)
DTYPES = {
    "float32": (torch.float32, torch.float32, False),
    "bfloat16-sr": (torch.bfloat16, torch.float32, True),
    "bfloat16-sr-same": (torch.bfloat16, torch.bfloat16, True),
    "float16": (torch.float16, torch.float32, False),
    "float64": (torch.float64, torch.float64, False),
}


def _inputs(gen, param_dtype, other_dtype, offset):
    """params, grads, bufs, row and column scales over SHAPES; offsets vary per tensor."""
    acc = torch.float64 if param_dtype == torch.float64 else torch.float32
    params = [randn(s, param_dtype, gen, offset=(offset + i) % 5) for i, s in enumerate(SHAPES)]
    grads = [randn(s, other_dtype, gen, offset=(offset + i) % 5) for i, s in enumerate(SHAPES)]
    bufs = [randn(s, other_dtype, gen, offset=(offset + i) % 5) for i, s in enumerate(SHAPES)]
    rows = [randn((s[0],), acc, gen, low=0.5) for s in SHAPES]
    cols = [randn((s[1],), acc, gen, low=0.5) for s in SHAPES]
    return params, grads, bufs, rows, cols


def _run(path: str, name: str, inputs, scalars, kwargs):
    """Copies of ``inputs`` on the path's device, updated by op ``name``; returns them."""
    device = "cpu" if path.endswith("cpu") else "cuda"
    params, grads, bufs, rows, cols = (on(device, tensors) for tensors in inputs)
    inv_scale, found_inf = (t.to(device) for t in scalars)
    module = reference
    if path.startswith("fused"):
        assert ops.fused_available(device)
        module = ops
    scales = (rows, cols) if name == "diag_precond_step_" else ()
    getattr(module, name)(
        params, grads, bufs, *scales, inv_scale=inv_scale, found_inf=found_inf, **kwargs
    )
    if device == "cuda":
        torch.cuda.synchronize()
    return params + bufs


OPS = {
    "sgd-momentum-wd": ("sgd_epilogue_", dict(lr=0.1, momentum=0.9, weight_decay=1e-2)),
    "sgd-decoupled": (
        "sgd_epilogue_",
        dict(lr=0.1, momentum=0.9, weight_decay=1e-2, decoupled=True),
    ),
    "adam-wd": ("adam_epilogue_", dict(lr=0.1, beta=0.9, step=3, weight_decay=1e-2)),
    "diag-singd-momentum-wd": (
        "diag_precond_step_",
        dict(mode="singd", lr=0.1, momentum=0.9, damping=0.0, weight_decay=1e-2, step=1),
    ),
    "diag-adafisher-wd": (
        "diag_precond_step_",
        dict(
            mode="adafisher",
            lr=0.01,
            momentum=0.9,
            damping=1e-3,
            weight_decay=1e-2,
            step=4,
            decoupled=True,
        ),
    ),
}


@pytest.mark.parametrize("offset", [0, 1, 3], ids=lambda o: f"offset{o}")
@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("case", list(OPS))
def test_list_ops_round_alike_on_every_path(cuda_ops, gen, case, dtypes, offset):
    name, hyper = OPS[case]
    param_dtype, other_dtype, stochastic = DTYPES[dtypes]
    kwargs = {"decoupled": False, "stochastic_rounding": stochastic, "seed": 12345, **hyper}
    inputs = _inputs(gen, param_dtype, other_dtype, offset)
    scalars = (torch.tensor([0.5]), torch.zeros(1))
    expected = _run("reference-cpu", name, inputs, scalars, kwargs)
    for path in PATHS:
        assert_bitwise(_run(path, name, inputs, scalars, kwargs), expected, f"{case} {path}")


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_factor_update_rounds_alike_on_every_path(cuda_ops, gen, dtype, offset):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    sizes = [1, 7, 9000, 20_001]
    k = [randn((n,), dtype, gen, offset=offset, low=0.5) for n in sizes]
    m = [randn((n,), acc, gen, offset=offset) for n in sizes]
    h = [randn((n,), acc, gen, low=0.0) for n in sizes]
    a = [torch.tensor(1.5, dtype=acc), torch.tensor(0.7), torch.tensor(2.0), torch.tensor(1.0)]
    b = [torch.tensor(0.5, dtype=acc)] * len(sizes)
    hyper = dict(alpha1=0.5, beta1=0.01, damping=1e-3)

    def run(path):
        device = "cpu" if path.endswith("cpu") else "cuda"
        kd, md, hd, ad, bd = (on(device, t) for t in (k, m, h, a, b))
        module = ops if path.startswith("fused") else reference
        module.diag_factor_update_(kd, md, hd, ad, bd, **hyper)
        return kd + md

    expected = run("reference-cpu")
    for path in PATHS:
        assert_bitwise(run(path), expected, f"factor update {path}")


def test_found_inf_leaves_every_tensor_unchanged(cuda_ops, gen):
    name, hyper = OPS["diag-adafisher-wd"]
    kwargs = {"decoupled": False, "stochastic_rounding": True, "seed": 1, **hyper}
    inputs = _inputs(gen, torch.bfloat16, torch.float32, 1)
    scalars = (torch.tensor([0.5]), torch.ones(1))
    got = _run("fused-cuda", name, inputs, scalars, kwargs)
    assert_bitwise(got, inputs[0] + inputs[2], "found_inf set")
