"""min_max_normalise_rows_ against the reference, bit for bit: every source dtype into
float32 and float64, vectors and stacks of rows (rows lying apart, as a resident stack's
padded rows), and the rows whose arithmetic is special (constant, signed zeros, subnormal
spans, inf, NaN)."""

from __future__ import annotations

import pytest
import torch

from singd_cuda import ops
from singd_cuda.ops import reference

from .conftest import DTYPES, make

OUT_DTYPES = [torch.float32, torch.float64]
SHAPES = [(1,), (17,), (1, 5), (3, 16), (9, 17), (70, 513), (0, 4)]


def _special_rows(v: torch.Tensor) -> torch.Tensor:
    """v (rows, d) with its first rows replaced by the special cases."""
    specials = [
        lambda row: row.fill_(0.5),  # constant: ones
        lambda row: row.fill_(0.0).__setitem__(slice(None, None, 2), -0.0),  # signed zeros
        lambda row: row.fill_(1e-40).__setitem__(0, 3e-40),  # a subnormal span: tiny
        lambda row: row.__setitem__(-1, float("inf")),
        lambda row: row.__setitem__(0, float("-inf")),
        lambda row: row.fill_(float("inf")),
        lambda row: row.__setitem__(0, float("nan")),
    ]
    for row, special in zip(v, specials, strict=False):
        special(row)
    return v


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit for bit where finite or infinite; NaN where the expected is NaN (a NaN's
    payload is not part of the contract)."""
    assert torch.equal(actual.isnan(), expected.isnan())
    finite = ~expected.isnan()
    width = torch.int64 if expected.dtype == torch.float64 else torch.int32
    assert torch.equal(actual[finite].view(width), expected[finite].view(width))


@pytest.mark.parametrize("special", [False, True], ids=["random", "special"])
@pytest.mark.parametrize("layout", ["contiguous", "row-strided"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_the_reference_bitwise(device, gen, dtype, out_dtype, shape, layout, special):
    v = make(shape, dtype, "cpu", gen, layout) * 4
    if special and v.dim() == 2 and v.shape[1] > 1:
        v = _special_rows(v)
    v = v.to(device) if layout == "contiguous" else _on(device, v)
    out = torch.empty(v.shape, dtype=out_dtype, device=device)
    expected = torch.empty(v.shape, dtype=out_dtype, device=device)
    ops.min_max_normalise_rows_(out, v)
    reference.min_max_normalise_rows_(expected, v)
    assert_same_bits(out.cpu(), expected.cpu())


def _on(device: torch.device, v: torch.Tensor) -> torch.Tensor:
    """v on ``device`` keeping its rows apart (each row contiguous, rows 3 elements apart)."""
    wide = torch.zeros(*v.shape[:-1], v.shape[-1] + 3, dtype=v.dtype, device=device)
    wide[..., : v.shape[-1]] = v.to(device)
    return wide[..., : v.shape[-1]]


def test_normalises_each_row_to_the_unit_interval(cpu_ops):
    v = torch.tensor([[3.0, -1.0, 1.0, 7.0], [2.5, 2.5, 2.5, 2.5]])
    out = torch.empty(2, 4)
    ops.min_max_normalise_rows_(out, v)
    assert torch.equal(out[0], (v[0] + 1) / 8)
    assert torch.equal(out[1], torch.ones(4))  # a constant row prefers no direction


def test_writes_in_place_and_bumps_the_version(cpu_ops):
    v = torch.randn(3, 6, dtype=torch.bfloat16)
    out = torch.empty(3, 6)
    version = out._version
    ops.min_max_normalise_rows_(out, v)
    assert out._version > version
    same = v.float()  # in place: out is v
    expected = torch.empty(3, 6)
    reference.min_max_normalise_rows_(expected, same.clone())
    ops.min_max_normalise_rows_(same, same)
    assert torch.equal(same, expected)


@pytest.mark.parametrize(
    ("out", "v", "match"),
    [
        (torch.empty(3, dtype=torch.bfloat16), torch.randn(3), "float32 or float64"),
        (torch.empty(3, 4), torch.randn(4, 3), "shape"),
        (torch.empty(2, 3, 4), torch.randn(2, 3, 4), "vector or a matrix"),
        (torch.empty(3, 0), torch.randn(3, 0), "at least one element"),
        (torch.empty(3, 4), torch.randn(4, 3).t(), "v's rows must be contiguous"),
        (torch.empty(4, 3).t(), torch.randn(3, 4), "out's rows must be contiguous"),
        (torch.empty(3), torch.randint(0, 3, (3,)), "v must be floating"),
    ],
    ids=["out-dtype", "shapes", "3-d", "empty-rows", "v-columns", "out-columns", "v-int"],
)
def test_refuses_what_it_cannot_normalise(cpu_ops, out, v, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.singd_cuda.min_max_normalise_rows_(out, v)
