"""SINGD's diagonal statistics are the sums of each call's products k² ⊙ diag(aᵀa) and
c² ⊙ diag(gᵀg), bit for bit, whether the capture multiplies k² and c² in at the call or
the step multiplies them into the gathered stacks (a pass's first call of a layer keeps
its sums unscaled, :class:`~singd_cuda.optim.statistics.UnscaledDiagonal`).

The reference is the same optimizer with every call multiplied at the call (the rule's
generic ``accumulate_diagonal_sums``: the reductions, then ``accumulate_diagonal``). The
patterns: one call per pass, a module called twice in a pass, micro-batches committed
onto each other, a thrown-away batch, a skipped step, layers of several shapes (the
factors as lists, not stacks), a group of another structure beside a diagonal one, and
half and float64 factors (a factor dtype other than the statistics')."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from singd_cuda import SINGD
from singd_cuda.optim.rule import LayerRule
from singd_cuda.optim.singd import SingdRule
from singd_cuda.optim.statistics import UnscaledDiagonal
from singd_cuda.structures.diagonal import Diagonal

from .conftest import assert_models_equal, assert_states_equal

STEPS = 5


class Shared(nn.Module):
    """``shared`` is called twice in one forward."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inp, self.shared = nn.Linear(6, width), nn.Linear(width, width)
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        z = self.shared(torch.tanh(self.shared(torch.tanh(self.inp(x)))))
        return self.out(torch.tanh(z))


def stack_of_equal(dtype=torch.float32) -> nn.Module:
    """Four 8 x 8 layers: their factors are the rows of kept stacks."""
    layers = [m for _ in range(4) for m in (nn.Linear(8, 8), nn.Tanh())]
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), *layers, nn.Linear(8, 3)).to(dtype)


def mixed_shapes() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 7, bias=False), nn.Tanh(), nn.Linear(7, 3)
    )


MODELS = {"shared": Shared, "stacked": stack_of_equal, "mixed": mixed_shapes}


def one_step(model, opt, batches, pattern: str) -> None:
    """Backward passes of ``pattern`` then a step."""
    x, y = batches
    loss = nn.functional.cross_entropy
    opt.zero_grad()
    if pattern == "micro-batches":  # three passes committed onto each other
        for part in range(3):
            rows = slice(4 * part, 4 * part + 4)
            (loss(model(x[rows]), y[rows]) / 3).backward()
    elif pattern == "thrown-away":  # a pass whose gradients are reset before the kept one
        loss(model(x[:5]), y[:5]).backward()
        opt.zero_grad()
        loss(model(x), y).backward()
    else:
        loss(model(x), y).backward()
        if pattern == "skipped" and opt.param_groups[0]["step"] == 2:
            next(model.parameters()).grad[0, 0] = float("inf")
    opt.step()


def run(model_name: str, pattern: str, scale_at_call: bool, monkeypatch, **settings):
    torch.manual_seed(0)
    model = MODELS[model_name]()
    if scale_at_call:
        monkeypatch.setattr(
            SingdRule, "accumulate_diagonal_sums", LayerRule.accumulate_diagonal_sums
        )
    params = settings.pop("params", None)
    opt = SINGD(model, params(model) if params else None, **settings)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        batches = torch.randn(12, 6, generator=gen), torch.randint(0, 3, (12,), generator=gen)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the skipped step's warning
            one_step(model, opt, batches, pattern)
    monkeypatch.undo()
    return model, opt


def two_groups(model):
    """The first layer dense, the others diagonal (the defaults)."""
    first = list(model.inp.parameters())
    rest = [p for name, p in model.named_parameters() if not name.startswith("inp.")]
    return [dict(params=first, structures="dense"), dict(params=rest)]


CASES = {
    "one call a pass": ("stacked", "plain", {}),
    "one call a pass, T=2": ("stacked", "plain", {"T": 2}),
    "a module called twice": ("shared", "plain", {}),
    "micro-batches": ("stacked", "micro-batches", {}),
    "micro-batches, shared": ("shared", "micro-batches", {}),
    "thrown-away batch": ("stacked", "thrown-away", {}),
    "skipped step": ("stacked", "skipped", {}),
    "several shapes": ("mixed", "plain", {}),
    "several shapes, micro-batches": ("mixed", "micro-batches", {}),
    "a dense group beside": ("shared", "plain", {"params": two_groups}),
    "bfloat16 factors": ("stacked", "plain", {"factor_dtype": torch.bfloat16}),
    "float64 factors": ("stacked", "micro-batches", {"factor_dtype": torch.float64}),
    "kfac_like": ("stacked", "plain", {"kfac_like": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_scaled_at_the_step_equals_scaled_at_the_call(case, monkeypatch):
    model_name, pattern, settings = CASES[case]
    settings = dict(structures="diagonal", lr=0.05, lr_cov=0.1, T=1) | settings
    deferred, deferred_opt = run(model_name, pattern, False, monkeypatch, **dict(settings))
    at_call, at_call_opt = run(model_name, pattern, True, monkeypatch, **dict(settings))
    assert_models_equal(deferred, at_call)
    assert_states_equal(deferred_opt.state_dict(), at_call_opt.state_dict())


def test_a_first_call_is_kept_unscaled_and_the_step_scales_it():
    """After one pass the committed statistics are unscaled sums; the step's normalised
    statistics are Diagonals holding k² ⊙ h / w (c² ⊙ s), bitwise."""
    torch.manual_seed(0)
    model = stack_of_equal()
    opt = SINGD(model, structures="diagonal", lr=0.05, T=1)
    x, y = torch.randn(12, 6), torch.randint(0, 3, (12,))
    loss = nn.functional.cross_entropy
    for _ in range(2):  # the first step's statistics take the unplanned path
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
    opt.zero_grad()
    loss(model(x), y).backward()
    committed = opt._capture.committed
    assert {type(c.statistics[side]) for c in committed.values() for side in ("in", "out")} == {
        UnscaledDiagonal
    }
    rule = opt.rule_for(opt.param_groups[0])
    expected = {}
    for layer, entry in committed.items():
        squares = rule.statistic_factors([layer], opt.group_of(layer), [opt.state[layer.weight]])
        h, s = (entry.statistics[side].parts["diag"].clone() for side in ("in", "out"))
        out_factor = 1.0 if opt.param_groups[0]["loss_average"] is None else entry.terms
        expected[layer] = (h * squares[0][0] * (1.0 / entry.terms), s * squares[1][0] * out_factor)
    seen = {}
    update_factors = opt._update_factors

    def recording(layers):  # the step's statistics, as normalised
        seen.update({layer: (p["in"], p["out"]) for layer, p in opt._pending.items()})
        return update_factors(layers)

    opt._update_factors = recording
    opt.step()
    assert seen.keys() == expected.keys()
    for layer, (H_K, H_C) in seen.items():
        assert type(H_K) is Diagonal and type(H_C) is Diagonal
        assert torch.equal(H_K.parts["diag"], expected[layer][0])
        assert torch.equal(H_C.parts["diag"], expected[layer][1])


def test_statistics_captured_before_a_load_get_the_loaded_factors():
    """A pass's first-call statistics meet k² and c² at the step, so a pass before a
    ``load_state_dict`` gives the step what the same pass after it gives (the docs'
    checkpoints page)."""
    x, y = torch.randn(12, 6), torch.randint(0, 3, (12,))
    loss = nn.functional.cross_entropy
    runs = []
    for load_first in (False, True):
        torch.manual_seed(0)
        model = stack_of_equal()
        opt = SINGD(model, structures="diagonal", lr=0.05, lr_cov=0.1, T=1)
        saved = None
        for step in range(4):
            if step == 2:
                saved = copy.deepcopy(opt.state_dict())
            opt.zero_grad()
            loss(model(x), y).backward()
            opt.step()
        opt.zero_grad()
        if load_first:
            opt.load_state_dict(saved)
        loss(model(x), y).backward()
        if not load_first:
            opt.load_state_dict(saved)
        opt.step()
        runs.append((model, opt))
    assert_models_equal(runs[0][0], runs[1][0])
    assert_states_equal(runs[0][1].state_dict(), runs[1][1].state_dict())
