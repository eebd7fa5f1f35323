"""FactorUndo keeps where the saved entries lie between steps: it must follow the states
when their objects change (a checkpoint load, a layer's first factors, a new flag)."""

from __future__ import annotations

import pytest
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


def test_save_buffers_go_with_the_states_they_saved():
    """Loads bring new tensors every time: the buffers saved for the old ones are let go,
    so that they do not pile up over many loads, and a save after a load restores the new
    values."""
    undo = FactorUndo()
    given = states()
    undo.save(given)
    held = len(undo._vectors)
    for load in range(5):  # each a load_state_dict: new tensors under the same keys
        for state in given:
            state["h"] = torch.full_like(state["h"], float(load))
        undo.save(given)
        assert len(undo._vectors) == held
        scribble(given)
        undo.restore()
        assert all(torch.equal(s["h"], torch.full_like(s["h"], float(load))) for s in given)


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


def stacked_states(pad: int) -> tuple[list[dict], torch.Tensor, torch.Tensor]:
    """Three states whose "h" (length 5) and "K" (2 x 2) are the rows of stacks, with
    ``pad`` elements between rows (as ResidentStacks aligns them), and a loose vector."""
    h_buffer = torch.arange(3 * (5 + pad), dtype=torch.float32).reshape(3, 5 + pad)
    K_buffer = torch.randn(3, 4 + pad, generator=torch.Generator().manual_seed(0))
    H, K = h_buffer[:, :5], K_buffer[:, :4].unflatten(1, (2, 2))
    given = [
        {"h": h, "K": {"mat": k}, "s": torch.full((2,), float(i)), "step": i}
        for i, (h, k) in enumerate(zip(H.unbind(0), K.unbind(0), strict=True))
    ]
    return given, h_buffer, K_buffer


@pytest.mark.parametrize("pad", [0, 3])
def test_rows_of_a_stack_are_saved_and_checked_as_the_stack(pad):
    """Entries that are every row of one stack are saved and checked as one tensor; the
    padding between rows is neither checked (it may hold anything) nor written; restore
    and restore_where bring every row back, also after an update replaced an entry."""
    given, h_buffer, K_buffer = stacked_states(pad)
    if pad:
        h_buffer[:, 5:] = float("nan")  # uninitialised padding: never checked
        K_buffer[:, 4:] = float("inf")
    undo = FactorUndo()
    expected_h = h_buffer[:, :5].clone()
    expected_K = K_buffer[:, :4].clone()
    for restore in ("restore", "restore_where"):
        undo.save(given)
        checked = undo.updated()
        assert len(checked) == 2 + 3  # the h stack, the K stack, three loose vectors
        assert all(torch.isfinite(t).all() for t in checked)
        h_buffer[:, :5] = -1.0
        K_buffer[:, :4] = -2.0
        if restore == "restore":
            undo.restore()
        else:
            undo.restore_where(torch.ones(1))
        assert torch.equal(h_buffer[:, :5], expected_h)
        assert torch.equal(K_buffer[:, :4], expected_K)
        if pad:
            assert h_buffer[:, 5:].isnan().all() and K_buffer[:, 4:].isinf().all()
    undo.save(given)
    given[1]["h"] = torch.full((5,), 9.0)  # an update put a new tensor in a state
    assert len(undo.updated()) == 3 + 3 + 3  # entry by entry now
    undo.restore()
    assert torch.equal(given[1]["h"], expected_h[1])
    assert torch.equal(h_buffer[:, :5], expected_h)


def test_views_that_do_not_lie_as_rows_are_saved_one_by_one():
    """Rows out of order, columns, overlapping windows, rows of two bases: saved and
    restored one by one; two of three rows do lie as a stack (one tensor)."""
    base, other = torch.arange(12.0).reshape(3, 4), torch.arange(4.0)
    flat = base.flatten()
    cases = {
        "out of order": ([base[1], base[0], base[2]], 3),
        "columns": (list(base.t()), 4),
        "overlapping": ([flat[0:4], flat[2:6]], 2),
        "two bases": ([base[0], other[:4]], 2),
        "two of three rows": ([base[0], base[1]], 1),
    }
    for name, (vectors, saved) in cases.items():
        given = [{"h": v} for v in vectors]
        before = [v.clone() for v in vectors]
        undo = FactorUndo()
        undo.save(given)
        assert len(undo.updated()) == saved, name
        for v in vectors:
            v.fill_(0.0)
        undo.restore()
        assert all(torch.equal(v, b) for v, b in zip(vectors, before, strict=True)), name


@pytest.mark.parametrize("where", ["nested dict", "entry of a nested dict", "top entry"])
def test_updated_holds_what_an_update_put_in_the_states(where):
    """After an update replaced an entry (at any depth: a new nested dict, a new tensor in
    a kept one, a new top-level tensor), the tensors to check are the states' current
    ones, so a non-finite value in the new tensor is seen; nothing replaced: the saved
    layout's."""
    undo = FactorUndo()
    given = states()
    undo.save(given)
    kept = undo.updated()
    assert undo.updated() is kept
    new = torch.full((3,) if where == "top entry" else (2, 2), float("nan"))
    if where == "nested dict":
        given[0]["K"] = {"mat": new}
    elif where == "entry of a nested dict":
        given[0]["K"]["mat"] = new
    else:
        given[0]["h"] = new
    checked = undo.updated()
    assert any(t is new for t in checked)
    assert len(checked) == len(kept)
    undo.restore()
    assert torch.equal(given[0]["h"], torch.arange(3.0))
    assert torch.equal(given[0]["K"]["mat"], torch.ones(2, 2))


def test_untouched_entries_are_neither_saved_nor_checked():
    """``untouched`` keys (K-FAC's inverses between inversions) stay out of the save, the
    check and the restore; a save with other keys keeps its own layout, and new states
    let the old layouts go."""
    undo = FactorUndo()
    given = states()
    undo.save(given, ("K",))
    assert len(undo.updated()) == 3  # h, h and T: no K
    given[0]["K"]["mat"].fill_(5.0)  # what the update left: not restored
    given[0]["h"].fill_(float("nan"))
    undo.restore()
    assert torch.equal(given[0]["h"], torch.arange(3.0))
    assert torch.equal(given[0]["K"]["mat"], torch.full((2, 2), 5.0))
    narrow = undo._layouts[("K",)]
    undo.save(given)  # every entry: a layout of its own, the other kept
    assert len(undo.updated()) == 5 and undo._layouts[("K",)] is narrow
    undo.clear()
    undo.save(given, ("K",))
    assert undo._layout is narrow
    undo.clear()
    fresh = states()  # a load: other objects
    undo.save(fresh, ("K",))
    assert list(undo._layouts) == [("K",)] and undo._layout is not narrow
    undo.clear()


def test_kfac_saves_and_checks_its_inverses_only_when_it_inverts():
    from singd_cuda import KFAC

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    opt = KFAC(model, lr=0.1, T=1, T_inv=3)
    x = torch.randn(8, 4)
    checked = []
    for step in range(7):
        opt.zero_grad()
        model(x).square().mean().backward()
        keys = [(m.weight, key) for m in (model[0], model[2]) for key in ("A_inv", "G_inv")]
        inverses = [opt.state[p][key].clone() for p, key in keys]
        opt.step()
        checked.append(len(opt._undo._layout.checked))
        changed = [
            not torch.equal(opt.state[p][key], before)
            for (p, key), before in zip(keys, inverses, strict=True)
        ]
        assert any(changed) == (step % 3 == 0)
    # inverting steps 0, 3, 6 save (and check) the four inverses too
    assert [c > checked[1] for c in checked] == [True, False, False, True, False, False, True]
