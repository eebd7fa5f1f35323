"""``graft`` and a rule's own per-layer ``apply``: applied where the rule grafts, refused
with a clear error where it does not (never silently ignored)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from singd_cuda import KFAC
from singd_cuda.curvature.layers import split_matrix
from singd_cuda.optim import KroneckerOptimizer
from singd_cuda.optim.graft import graft_
from singd_cuda.optim.kfac import KfacRule
from singd_cuda.optim.rule import LayerRule
from singd_cuda.optim.write import sgd_update_

LR = 0.05


class DiagonalKronecker(LayerRule):
    """The rule of docs/concepts/architecture.md: momentum SGD on G / (s ⊗ h + λ)."""

    def init_state(self, layer, group, state):
        state["h"] = torch.zeros(layer.dim_in, dtype=layer.weight.dtype)
        state["s"] = torch.zeros(layer.dim_out, dtype=layer.weight.dtype)

    def accumulate(self, layer, group, state, pending, a, g):
        h, s = a.square().sum(0), g.square().sum(0)
        pending["in"] = pending["in"] + h if "in" in pending else h
        pending["out"] = pending["out"] + s if "out" in pending else s

    def update_factors(self, layer, group, state, pending, step):
        state["h"].lerp_(pending["in"], 0.1)
        state["s"].lerp_(pending["out"], 0.1)

    def natural(self, states, G):
        F_ = torch.outer(states[0]["s"], states[0]["h"]) + 0.1
        return G / F_.to(G.dtype)

    def apply(self, layer, group, states, G, step, seed, found_inf=None):
        directions = split_matrix(layer, self.natural(states, G))
        sgd_update_(layer.params, directions, states, group, seed, found_inf)


class GraftingDiagonalKronecker(DiagonalKronecker):
    """The same rule, grafting its directions in apply as ``LayerRule.grafts`` says."""

    def grafts(self, group):
        return True

    def apply(self, layer, group, states, G, step, seed, found_inf=None):
        directions = split_matrix(layer, self.natural(states, G))
        grads = split_matrix(layer, G)
        graft_(layer.params, directions, states, group, found_inf=found_inf, grads=grads)
        sgd_update_(layer.params, directions, states, group, seed, found_inf)


class Custom(KroneckerOptimizer):
    def __init__(self, model, rule, **kwargs):
        defaults = dict(lr=LR, T=1, momentum=0.0, weight_decay=0.0, **kwargs)
        self._rule = rule
        super().__init__(model, None, defaults)

    def rule_for(self, group):
        return self._rule


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def batches(n=4):
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(10, 6, generator=gen, dtype=torch.float64), torch.randint(3, (10,)))
        for _ in range(n)
    ]


def test_a_rule_that_writes_in_apply_refuses_graft():
    with pytest.raises(ValueError, match=r"DiagonalKronecker writes the parameters in apply\(\)"):
        Custom(model(), DiagonalKronecker(), graft="rms")


def test_a_graft_set_after_construction_is_refused_before_any_change():
    net = model()
    opt = Custom(net, DiagonalKronecker())
    x, y = batches(1)[0]
    F.cross_entropy(net(x), y).backward()
    opt.param_groups[0]["graft"] = "adam"
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match="return True from its grafts"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), before, strict=True))
    assert not opt.state


def test_a_rule_that_grafts_in_apply_sets_the_rms():
    net = model()
    opt = Custom(net, GraftingDiagonalKronecker(), graft="rms")
    for x, y in batches():
        before = [p.detach().clone() for p in net.parameters()]
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        for p, w in zip(net.parameters(), before, strict=True):
            rms = (w - p.detach()).square().mean().sqrt() / LR
            torch.testing.assert_close(rms, torch.tensor(0.2, dtype=rms.dtype), rtol=1e-12, atol=0)


def test_a_grafting_apply_takes_the_unscaled_gradients():
    """graft="adam" under a GradScaler: the second moments and the trajectory of the
    unscaled run (the gradients ``.grad`` still carry the scale in apply)."""
    plain, scaled = model(), model()
    opt = Custom(plain, GraftingDiagonalKronecker(), graft="adam")
    opt_scaled = Custom(scaled, GraftingDiagonalKronecker(), graft="adam")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6)
    for x, y in batches():
        opt.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        opt.step()
        opt_scaled.zero_grad()
        scaler.scale(F.cross_entropy(scaled(x), y)).backward()
        scaler.step(opt_scaled)
        scaler.update()
    for a, b in zip(plain.parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(opt.state[a]["graft_sq"], opt_scaled.state[b]["graft_sq"])


class PerLayerKfacRule(KfacRule):
    """K-FAC's rule through its per-layer apply instead of the fused group update."""

    def fuses_apply(self, group):
        return False


@pytest.mark.parametrize("graft", ["adam", "rms"])
def test_kfac_per_layer_apply_grafts_like_the_group_update(graft):
    fused, per_layer = model(), model()
    opts = [KFAC(net, lr=LR, T=1, graft=graft) for net in (fused, per_layer)]
    opts[1]._rule = PerLayerKfacRule()
    for x, y in batches():
        for net, opt in zip((fused, per_layer), opts, strict=True):
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    for a, b in zip(fused.parameters(), per_layer.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
