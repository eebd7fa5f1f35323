"""Counter-based random bits and bfloat16 stochastic rounding, bit-identical to csrc/singd_math.h.

The random bits of element ``i`` (row-major position) of tensor ``t`` of a list are a pure
function of ``(seed, t, i)``: ``random_bits(stream_key(seed, t), numel)``. The 32-bit hash
uses multipliers below 2**31, so int64 tensor arithmetic evaluates it exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

MASK32 = 0xFFFFFFFF
_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97


def hash32(x: Tensor) -> Tensor:
    """The 32-bit finaliser on an int64 tensor holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & MASK32
    return x ^ (x >> 15)


def _hash32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * _MUL1) & MASK32
    x ^= x >> 15
    x = (x * _MUL2) & MASK32
    return x ^ (x >> 15)


def stream_key(seed: int, stream: int) -> int:
    """Key of tensor ``stream`` (its position in the list) for the step seeded by ``seed``."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    k = _hash32_int(s >> 32)
    k = _hash32_int(k ^ (s & MASK32))
    return _hash32_int(k ^ (stream & MASK32))


def random_bits(key: int, numel: int, device: torch.device | str | None = None) -> Tensor:
    """(numel,) int64 tensor of 32 random bits per element index 0..numel-1."""
    index = torch.arange(numel, dtype=torch.int64, device=device)
    return hash32(hash32(key ^ (index >> 32)) ^ (index & MASK32))


def bf16_stochastic(x: Tensor, bits: Tensor) -> Tensor:
    """float32 ``x`` rounded stochastically to bfloat16 with ``bits`` (int64, x's numel).

    Adds the top 16 random bits below the kept mantissa and truncates; infinities stay
    infinite and NaNs become the canonical quiet NaN (0x7fc0). Returns a bfloat16 tensor
    of x's shape.
    """
    x = x.contiguous()
    b = x.view(torch.int32).to(torch.int64) & MASK32
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    rounded = torch.where(nan, 0x7FC00000, b + (bits.view(x.shape) >> 16)) >> 16
    rounded = torch.where(rounded >= 0x8000, rounded - 0x10000, rounded)
    return rounded.to(torch.int16).view(torch.bfloat16)
