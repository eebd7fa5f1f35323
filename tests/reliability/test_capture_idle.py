"""Weights idle on a statistics step (README, "What counts as curvature").

A layer with a gradient but no statistics on a statistics step (its module not called
while its weight is in an L2 term: alternating task heads, LayerDrop, an expert that got
no tokens) keeps its preconditioner and skips that factor update; a layer that never had
statistics is trained by the AdamW fallback until its first statistics, and that is part
of the optimizer state (a resume continues exactly). Float64, every optimizer.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

from .conftest import (
    CLASSES,
    FEATURES,
    HIDDEN,
    NAMES,
    assert_close_params,
    batches,
    loss_sum,
    make_optimizer,
    params_of,
)
from .test_capture_contract import OutsideUse

L2 = 1e-2


class Heads(nn.Module):
    """A body and two heads; ``forward(x, heads)`` sums the outputs of ``heads``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(FEATURES, HIDDEN)
        self.heads = nn.ModuleList([nn.Linear(HIDDEN, CLASSES) for _ in range(2)])
        self.double()

    def forward(self, x: Tensor, heads: tuple[int, ...]) -> Tensor:
        hidden = torch.tanh(self.body(x))
        return sum(self.heads[i](hidden) for i in heads)


def train_heads(name: str, schedule: list, idle_head_T=1) -> tuple[list[Tensor], object]:
    """Step t runs the heads ``schedule[t]`` on the batch; the loss has an explicit L2 term on
    every parameter, so an idle head's parameters get a gradient too. Head 1 is in a group of
    its own with ``T=idle_head_T``."""
    model = Heads()
    head = list(model.heads[1].parameters())
    others = [p for p in model.parameters() if all(p is not q for q in head)]
    opt = make_optimizer(name, model, params=[{"params": others}, {"params": head}])
    opt.param_groups[1]["T"] = idle_head_T
    for t, (x, y) in enumerate(batches(len(schedule))):
        opt.zero_grad()
        penalty = sum(p.square().sum() for p in model.parameters())
        (loss_sum(model(x, schedule[t]), y) / len(y) + L2 * penalty).backward()
        opt.step()
    return params_of(model), opt


@pytest.mark.parametrize("name", NAMES)
def test_idle_on_a_statistics_step_equals_a_step_without_statistics(name):
    """Head 1 idle on step 2 (its weight's gradient: the L2 term only): preconditioned by
    its factors as they are, without a factor update, exactly as when step 2 is not a
    statistics step of its group; no warning, no move to the fallback."""
    schedule = [(0, 1), (0, 1), (0,), (0, 1), (0, 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        idle, opt = train_heads(name, schedule)
    skipped, _ = train_heads(name, schedule, idle_head_T=lambda step: 3 if step == 2 else 1)
    assert_close_params(idle, skipped)
    assert "exp_avg_sq" not in opt.state[opt.model.heads[1].weight]


@pytest.mark.parametrize("name", NAMES)
def test_a_head_first_used_later_trains_with_the_fallback_until_its_statistics(name):
    """Head 1 idle on steps 0-1 with an L2 gradient: AdamW moves it; from its first call
    (step 2) on it is preconditioned, its fallback state replaced by factors."""
    with pytest.warns(RuntimeWarning, match="never had any"):
        _, before = train_heads(name, [(0,), (0,)])
    weight = before.model.heads[1].weight
    assert "exp_avg_sq" in before.state[weight]
    assert "exp_avg_sq" in before.state[before.model.heads[1].bias]
    with pytest.warns(RuntimeWarning, match="never had any"):
        _, after = train_heads(name, [(0,), (0,), (0, 1)])
    state = after.state[after.model.heads[1].weight]
    assert state and "exp_avg_sq" not in state
    assert "exp_avg_sq" not in after.state[after.model.heads[1].bias]


def outside_use_run(name: str, steps: int, resume_at: int | None = None) -> list[Tensor]:
    model = OutsideUse()
    opt = make_optimizer(name, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for t, (x, y) in enumerate(batches(steps)):
            if t == resume_at:
                saved = torch.load(_saved(opt), weights_only=True)
                opt = make_optimizer(name, model)  # a fresh optimizer on the same model
                opt.load_state_dict(saved)
            opt.zero_grad()
            (loss_sum(model(x), y) / len(y)).backward()
            opt.step()
    return params_of(model)


def _saved(opt):
    import io

    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("name", NAMES)
def test_resume_after_the_fallback_took_a_weight_equals_uninterrupted(name):
    assert_close_params(outside_use_run(name, 4, resume_at=2), outside_use_run(name, 4))
