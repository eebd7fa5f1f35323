"""GatheredRows: tensors copied into the rows of kept stacks, one per (shape, dtype,
device), a warm call reusing them; and the normaliser's statistics as those rows."""

from __future__ import annotations

import torch

from singd_cuda.curvature.capture import Committed
from singd_cuda.optim.grouped import GatheredRows
from singd_cuda.optim.statistics import StatisticsNormaliser
from singd_cuda.structures import get


def _rows_hold(sets, tensors):
    for positions, stack, rows in sets:
        assert [r.data_ptr() for r in rows] == [r.data_ptr() for r in stack.unbind()]
        for i, row in zip(positions, rows, strict=True):
            assert torch.equal(row, tensors[i]) and row.dtype == tensors[i].dtype


def test_sets_by_shape_and_dtype_in_order():
    tensors = [torch.randn(3), torch.randn(4), torch.randn(3).double(), torch.randn(3)]
    sets = GatheredRows()("x", tensors)
    assert [positions for positions, _, _ in sets] == [[0, 3], [1], [2]]
    _rows_hold(sets, tensors)


def test_a_warm_call_reuses_the_stacks_and_a_new_layout_makes_new_ones():
    gather = GatheredRows()
    first = gather("x", [torch.randn(5), torch.randn(5)])
    stack = first[0][1]
    again = [torch.randn(5), torch.randn(5)]
    second = gather("x", again)
    assert second[0][1] is stack
    _rows_hold(second, again)
    for changed in ([torch.randn(5).double(), torch.randn(5)], [torch.randn(6), torch.randn(5)]):
        sets = gather("x", changed)
        assert sets[0][1] is not stack
        _rows_hold(sets, changed)
    shaped = [torch.randn(2, 3), torch.randn(2, 3)]  # same sizes, another shape
    gather("y", [torch.randn(3, 2), torch.randn(3, 2)])
    sets = gather("y", shaped)
    assert sets[0][1].shape == (2, 2, 3)
    _rows_hold(sets, shaped)


def test_rows_given_back_are_not_copied_onto_themselves():
    gather = GatheredRows()
    tensors = [torch.randn(4), torch.randn(4)]
    sets = gather("x", tensors)
    rows = sets[0][2]
    values = [row.clone() for row in rows]
    gather("x", rows)
    assert all(torch.equal(row, value) for row, value in zip(rows, values, strict=True))


def _committed(make, n=3, terms=2.0):
    return {f"l{i}": Committed(statistics=make(i), terms=terms) for i in range(n)}


def test_normalised_statistics_are_the_rows_of_the_normalisers_stacks():
    """Plain statistics and diagonal ones: each side's tensors become rows of one stack
    per shape; ``stacks`` then holds every statistic (what the finite check reads)."""
    diagonal = get("diagonal")

    def plain(i):
        return {"in": torch.randn(4, 4), "out": torch.randn(3, 3)}

    def diag(i):
        return {"in": diagonal.eye(4).mul_(i + 1.0), "out": diagonal.eye(3).mul_(2.0)}

    for make in (plain, diag):
        committed = _committed(make)
        expected = {
            layer: {
                side: _values(s) * (0.5 if side == "in" else 2.0)
                for side, s in e.statistics.items()
            }
            for layer, e in committed.items()
        }
        normaliser = StatisticsNormaliser()
        pending = normaliser(committed, dict.fromkeys(committed, "mean"), None)
        assert normaliser.stacks is not None and len(normaliser.stacks) == 2
        held = {t.data_ptr() for stack in normaliser.stacks for t in stack.unbind()}
        for layer, statistics in pending.items():
            for side, statistic in statistics.items():
                assert torch.equal(_values(statistic), expected[layer][side])
                assert _values(statistic).data_ptr() in held


def test_no_stacks_for_statistics_it_does_not_gather():
    """Matrix-part structures (GEMM consumers) and mixed w keep their tensors."""
    blocks = get("block_diagonal:2")
    committed = _committed(lambda i: {"in": blocks.eye(4), "out": blocks.eye(4)})
    normaliser = StatisticsNormaliser()
    parts = [e.statistics["in"].parts["blocks"] for e in committed.values()]
    normaliser(committed, dict.fromkeys(committed, "mean"), None)
    assert normaliser.stacks is None
    assert [e.statistics["in"].parts["blocks"] for e in committed.values()] == parts
    mixed = _committed(lambda i: {"in": torch.ones(2), "out": torch.ones(2)})
    mixed["l0"].terms = 1.0
    normaliser(mixed, dict.fromkeys(mixed, "mean"), None)
    assert normaliser.stacks is None


def _values(statistic):
    return statistic if isinstance(statistic, torch.Tensor) else statistic.parts["diag"]


def test_gathered_rows_are_found_as_their_stack():
    """SINGD diagonal's update finds the statistics' stack from their rows
    (:func:`stack_of_rows`): the gathered stack itself (its storage, shape and strides),
    and None for rows out of order or tensors that are not views of one."""
    from singd_cuda.optim.grouped import stack_of_rows

    tensors = [torch.randn(5) for _ in range(4)]
    ((_, stack, rows),) = GatheredRows()("x", tensors)
    found = stack_of_rows(rows)
    assert found.data_ptr() == stack.data_ptr()
    assert found.shape == stack.shape and found.stride() == stack.stride()
    assert torch.equal(found, torch.stack(tensors))
    assert stack_of_rows(rows[::-1]) is None  # not in order
    assert stack_of_rows(tensors) is None  # not views


def test_known_stacks_answer_the_same_rows_by_identity():
    """:class:`KnownStacks` answers as :func:`stack_of_rows` does, a second call with the
    same row objects from what it kept, and other rows (or more of them) afresh."""
    from singd_cuda.optim.grouped import KnownStacks, stack_of_rows

    tensors = [torch.randn(5) for _ in range(4)]
    ((_, stack, rows),) = GatheredRows()("x", tensors)
    known = KnownStacks(size=2)
    first = known(rows)
    assert first.data_ptr() == stack.data_ptr() and torch.equal(first, stack)
    assert known(list(rows)) is first  # the same objects: the kept answer
    assert known(rows[:2]).shape == (2, 5)  # fewer rows: found afresh
    assert known(rows[::-1]) is None and stack_of_rows(rows[::-1]) is None
    other = [torch.randn(5) for _ in range(3)]
    assert known(other) is None  # not views (and the kept answers start over)
    again = known(rows)
    assert again is not first and torch.equal(again, stack)
