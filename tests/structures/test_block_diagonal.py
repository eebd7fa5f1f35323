"""block_diagonal's Gram matrices without a trailing block share one (0, 0) part."""

import torch

from singd_cuda.structures import block_diagonal, get


def test_grams_without_a_trailing_block_share_one_empty_part(monkeypatch):
    """Every statistic of a factor whose block size divides d has the same (0, 0)
    ``last`` (no allocation per layer call), of the statistic's dtype and device; made
    first inside inference mode, it still takes in-place ops outside it (the
    normaliser's multiply, a second pass's add)."""
    monkeypatch.setattr(block_diagonal, "_EMPTY_LAST", {})
    S = get("block_diagonal:4")
    K = S.eye(8, dtype=torch.float32)
    with torch.inference_mode():
        first = K.gram_of_product(torch.randn(3, 8))
    second = K.gram_of_product(torch.randn(5, 8))
    assert first.parts["last"] is second.parts["last"]
    assert first.parts["last"].shape == (0, 0) and first.parts["last"].dtype == torch.float32
    second.mul_(2.0).add_(second)
    assert first.parts["last"].shape == (0, 0)
    double = S.eye(8, dtype=torch.float64).gram_of_product(torch.randn(2, 8, dtype=torch.float64))
    assert double.parts["last"].dtype == torch.float64
    assert double.parts["last"] is not second.parts["last"]
    # a trailing block: its own Gram matrix
    trailing = get("block_diagonal:3").eye(8).gram_of_product(torch.randn(4, 8))
    assert trailing.parts["last"].shape == (2, 2)


def test_a_traced_gram_keeps_no_fake_tensor(monkeypatch):
    """Under a fake-tensor trace the part is the trace's own (never cached)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(block_diagonal, "_EMPTY_LAST", {})
    with FakeTensorMode() as mode:
        K = get("block_diagonal:4").eye(8)
        H = K.gram_of_product(mode.from_tensor(torch.randn(3, 8)))
    assert type(H.parts["last"]) is not torch.Tensor and H.parts["last"].shape == (0, 0)
    assert block_diagonal._EMPTY_LAST == {}
