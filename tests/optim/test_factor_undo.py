"""FactorUndo keeps where the saved entries lie between steps: it must follow the states
when their objects change (a checkpoint load, a layer's first factors, a new flag)."""

from __future__ import annotations

import torch

from singd_cuda.optim.finite import FactorUndo


def states() -> list[dict]:
    return [
        {
            "h": torch.arange(3.0),
            "K": {"mat": torch.ones(2, 2)},
            "step": 1,
            "exp_avg": torch.ones(3),
        },
        {
            "h": torch.arange(4.0),
            "K": {"mat": torch.eye(2, dtype=torch.float64)},  # another dtype: its own copy
            "T": torch.arange(6.0).reshape(2, 3).t(),  # strided: cloned
            "step": 5,
        },
    ]


def scribble(states: list[dict]) -> None:
    for state in states:
        state["h"].fill_(float("nan"))
        state["K"]["mat"].fill_(float("inf"))
        if "T" in state:
            state["T"].fill_(-1.0)
        state["step"] += 1


def test_restore_after_the_objects_of_a_state_changed():
    undo = FactorUndo()
    given = states()
    for _ in range(2):  # the second save keeps the layout of the first
        expected = [
            {"h": s["h"].clone(), "K": s["K"]["mat"].clone(), "step": s["step"]} for s in given
        ]
        undo.save(given)
        scribble(given)
        assert len(undo.updated()) == 5
        undo.restore()
        for state, saved in zip(given, expected, strict=True):
            assert torch.equal(state["h"], saved["h"])
            assert torch.equal(state["K"]["mat"], saved["K"])
            assert state["step"] == saved["step"]
        assert torch.equal(given[1]["T"], torch.arange(6.0).reshape(2, 3).t())
    # a load_state_dict replaces the tensors, a nested dict, and adds an entry
    given[0]["h"] = torch.full((3,), 7.0)
    given[1]["K"] = {"mat": torch.full((2, 2), 3.0)}
    given[1]["warm_started"] = True
    undo.save(given)
    scribble(given)
    given[1]["warm_started"] = False
    assert undo.sets_flags()
    undo.restore()
    assert torch.equal(given[0]["h"], torch.full((3,), 7.0))
    assert torch.equal(given[1]["K"]["mat"], torch.full((2, 2), 3.0))
    assert given[1]["warm_started"] is True


def test_restore_where_selects_on_the_device_and_keeps_host_values():
    undo = FactorUndo()
    given = states()
    before = given[0]["h"].clone()
    undo.save(given)
    scribble(given)
    undo.restore_where(torch.ones(1))
    assert torch.equal(given[0]["h"], before)
    assert given[0]["step"] == 2  # the update's host value stays
    undo.save(given)
    given[0]["h"].add_(1.0)
    undo.restore_where(torch.zeros(1))
    assert torch.equal(given[0]["h"], before + 1.0)
