"""Shared fixtures of the fused-op tests: the op libraries (built once per session), devices,
dtypes, tensor layouts and the comparison against the reference."""

from __future__ import annotations

import pytest
import torch

from singd_cuda.ops import _build

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# contiguous; strided (every other column of a wider tensor); offset (storage offset of one
# element, so the CUDA kernels peel an unaligned head before their vector path).
# "row-strided": each row contiguous, rows apart by more than their length (M[:, :-1] of
# a matrix with a bias column)
LAYOUTS = ["contiguous", "strided", "offset", "row-strided"]
# Sizes around the vector widths (2, 4, 8 elements), one larger than a CPU span, and empty.
SHAPES = [(1,), (7,), (3, 5), (0,), (2, 0), (9, 17), (40_000,)]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="session")
def cpu_ops():
    """The CPU op library, built (or loaded from the cache) once per test session."""
    assert _build.load("cpu", strict=True)
    return torch.ops.singd_cuda


@pytest.fixture(scope="session")
def cuda_ops(cpu_ops):
    """The CUDA op library; skips without a GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert _build.load("cuda", strict=True)
    return cpu_ops


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """A device whose op library is loaded."""
    request.getfixturevalue("cuda_ops" if request.param == "cuda" else "cpu_ops")
    return torch.device(request.param)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def make(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
    gen: torch.Generator,
    layout: str = "contiguous",
    low: float | None = None,
) -> torch.Tensor:
    """Random tensor of ``shape`` in ``layout``; normal, or uniform in [low, 1) when ``low``."""
    numel = 1
    for size in shape:
        numel *= size
    if layout == "strided":
        full = (*shape[:-1], 2 * shape[-1])
        return make(full, dtype, device, gen, low=low)[..., ::2]
    if layout == "row-strided":
        full = (*shape[:-1], shape[-1] + 3)
        return make(full, dtype, device, gen, low=low)[..., : shape[-1]]
    extra = 1 if layout == "offset" else 0
    values = torch.randn(numel + extra, generator=gen, dtype=torch.float64)
    if low is not None:
        values = low + (1 - low) * torch.rand(numel + extra, generator=gen, dtype=torch.float64)
    return values.to(dtype).to(device)[extra:].view(shape)


def clones(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


_SAME_SIZE_INT = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def assert_bitwise(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Fused vs reference: equal bit for bit on every device (no FMA contraction in the
    kernels, so every multiply and add rounds as the reference's tensor ops do)."""
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        bits = _SAME_SIZE_INT[a.dtype]
        assert torch.equal(a.cpu().view(bits), e.cpu().view(bits))
