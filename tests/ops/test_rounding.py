"""Stochastic rounding of bfloat16 parameter writes: unbiased, deterministic, seeded."""

from __future__ import annotations

import torch

from singd_cuda.ops import reference
from singd_cuda.ops.rounding import bf16_stochastic, hash32, random_bits, stream_key

ULP = 2.0**-7  # bfloat16 spacing in [1, 2)


def _step_to(target: float, n: int, device, seed: int, fused: bool) -> torch.Tensor:
    """bf16 ones moved by one SGD step to ``target`` (float32), stochastically rounded."""
    p = torch.ones(n, dtype=torch.bfloat16, device=device)
    u = torch.full((n,), 1.0 - target, dtype=torch.float32, device=device)
    if fused:
        torch.ops.singd_cuda.sgd_epilogue_(
            [p], [u], [], 1.0, 0.0, 0.0, False, None, None, True, seed
        )
    else:
        reference.sgd_epilogue_([p], [u], [], lr=1.0, stochastic_rounding=True, seed=seed)
    return p


def test_rounding_is_unbiased_between_the_two_neighbours(device):
    target = 1.0 + 0.3 * ULP
    p = _step_to(target, 200_000, device, seed=3, fused=True).float()
    assert set(p.unique().tolist()) == {1.0, 1.0 + ULP}
    assert abs(p.mean().item() - target) < 0.01 * ULP


def test_bits_depend_only_on_seed_stream_and_index(device):
    a = _step_to(1.0 + 0.5 * ULP, 4096, device, seed=11, fused=True)
    b = _step_to(1.0 + 0.5 * ULP, 4096, device, seed=11, fused=True)
    c = _step_to(1.0 + 0.5 * ULP, 4096, device, seed=12, fused=True)
    ref = _step_to(1.0 + 0.5 * ULP, 4096, device, seed=11, fused=False)
    assert torch.equal(a, b) and torch.equal(a, ref)
    assert not torch.equal(a, c)


def test_special_values():
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 3.0e38])
    out = bf16_stochastic(x, torch.full((6,), 0xFFFFFFFF, dtype=torch.int64))
    assert out[0] == float("inf") and out[1] == -float("inf") and out[2].isnan()
    assert out[2].view(torch.int16).item() == 0x7FC0
    assert out[3].view(torch.int16).item() == 0 and out[4].view(torch.int16).item() == -0x8000
    assert out[5].float() > x[5]  # rounded up to the next bfloat16


def test_hash_is_a_32_bit_permutation_sample():
    x = torch.arange(1 << 16, dtype=torch.int64)
    h = hash32(x)
    assert h.min() >= 0 and h.max() < 2**32
    assert h.unique().numel() == x.numel()
    assert stream_key(0, 0) != stream_key(0, 1) != stream_key(1, 0)
    assert random_bits(stream_key(-5, 2), 8).unique().numel() == 8
