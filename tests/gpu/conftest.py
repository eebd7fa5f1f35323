"""Tests of the CUDA kernels on a GPU (marked ``gpu``: the default run deselects them, and
``pytest -m gpu`` skips them cleanly without a CUDA device)."""

from __future__ import annotations

import pytest
import torch

from singd_cuda.ops import _build


@pytest.fixture(scope="session")
def cuda_ops():
    """The CPU and CUDA op libraries (built once, strictly: a failed build fails the test)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert _build.load("cpu", strict=True)
    assert _build.load("cuda", strict=True)
    return torch.ops.singd_cuda


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def randn(shape, dtype, gen, offset: int = 0, low: float | None = None) -> torch.Tensor:
    """CPU tensor of ``shape``: normal, or uniform in [low, 1); ``offset`` > 0 makes it a view
    at that storage offset (elements), so its pointer is not vector-aligned."""
    numel = 1
    for size in shape:
        numel *= size
    if low is None:
        values = torch.randn(numel + offset, generator=gen, dtype=torch.float64)
    else:
        values = low + (1 - low) * torch.rand(numel + offset, generator=gen, dtype=torch.float64)
    return values.to(dtype)[offset:].view(shape)


def on(device, tensors):
    """Copies of ``tensors`` on ``device`` keeping their storage offsets (so alignment)."""
    out = []
    for t in tensors:
        base = torch.empty(t.storage_offset() + t.numel(), dtype=t.dtype, device=device)
        view = base[t.storage_offset() :].view(t.shape)
        view.copy_(t)
        out.append(view)
    return out


_SAME_SIZE_INT = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def assert_bitwise(actual, expected, what: str = "") -> None:
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a.dtype == e.dtype and a.shape == e.shape, what
        a, e = a.cpu().contiguous(), e.cpu().contiguous()
        bits = _SAME_SIZE_INT[a.dtype]
        same = a.view(bits) == e.view(bits)
        assert bool(same.all()), (
            f"{what}[{i}]: {int((~same).sum())} of {a.numel()} elements differ, first at "
            f"{int((~same).flatten().nonzero()[0])}"
        )
