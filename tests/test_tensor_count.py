"""benchmarks/tensor_count.py: the table runs end to end and times what it says (the lists
hold one tensor per parameter and list, the stack the same elements). Mechanics only: no
assertion reads a number derived from a timing."""

from __future__ import annotations

import pytest
import torch

import singd_cuda.ops as ops

from .host_cost_script import loaded


@pytest.fixture(scope="module")
def tensor_count():
    with loaded("tensor_count") as module:
        yield module


def test_the_stack_holds_the_lists_elements(tensor_count):
    lists = tensor_count.diagonal_lists(3, 4)
    stack = tensor_count.one_stack(3, 4)
    assert list(map(len, lists)) == [6] * 5 and list(map(len, stack)) == [1] * 5
    for side in range(3):  # parameters, gradients, buffers: the same number of elements
        assert sum(t.numel() for t in lists[side]) == stack[side][0].numel()
    assert [tuple(t.shape) for t in lists[0]] == [(4, 4)] * 3 + [(4, 1)] * 3


@pytest.mark.skipif(not ops.fused_available("cpu"), reason="fused ops not built")
def test_table_has_a_row_per_layer_count(tensor_count, tmp_path):
    out = tmp_path / "count.md"
    assert (
        tensor_count.main(["--layers", "1,2", "--width", "4", "--calls", "2", "--out", str(out)])
        == 0
    )
    text = out.read_text()
    assert "| 1 x Linear(4, 4) | 10 |" in text and "| 2 x Linear(4, 4) | 20 |" in text
    lists = tensor_count.diagonal_lists(2, 4)
    before = [p.clone() for p in lists[0]]
    tensor_count.diagonal_step(lists)()  # the timed call updates every parameter
    assert not any(torch.equal(a, b) for a, b in zip(lists[0], before, strict=True))
