"""SINGD's warm start (singd_cuda.optim.warm_start): the first statistics step sets
K = k·I, C = c·I at the trace fixed point of the factor update, then updates as usual.

The reference is a cold optimizer (warm_start=False) whose factors are set by hand to
k·I and c·I, with ū and ḡ computed here from the layer inputs and output gradients, in
float64."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from singd_cuda import SINGD
from singd_cuda.optim import warm_start

STRUCTURES = ["dense", "diagonal", "block_diagonal:4", "low_rank:2", "hierarchical:3,3"]


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 3)
    ).double()


def _batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(10, 6, generator=gen, dtype=torch.float64), torch.randint(
        0, 3, (10,), generator=gen
    )


def _traces(model: nn.Module, x, y) -> dict[nn.Module, tuple[float, float]]:
    """{layer: (ū, ḡ)}: tr̄ of aᵀa (a = [x, 1]/√N) and of gᵀg (g = √N · ∂loss/∂out)."""
    inputs, outputs = {}, {}

    def keep(module, args, output):
        inputs[module] = args[0].detach()
        output.retain_grad()
        outputs[module] = output

    hooks = [m.register_forward_hook(keep) for m in model if isinstance(m, nn.Linear)]
    F.cross_entropy(model(x), y).backward()
    for hook in hooks:
        hook.remove()
    model.zero_grad()
    n = len(x)
    traces = {}
    for module, a in inputs.items():
        if module.bias is not None:
            a = torch.cat([a, torch.ones(n, 1, dtype=a.dtype)], 1)
        grad = outputs[module].grad
        u = float((a * a).sum()) / n / a.shape[1]
        traces[module] = (u, float((grad * grad).sum()) * n / grad.shape[1])
    return traces


def _train(model, opt, steps: int, first: int = 0):
    for step in range(first, first + steps):
        x, y = _batch(step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize(
    "structure, kfac_like", [(s, False) for s in STRUCTURES] + [("dense", True)]
)
def test_first_step_equals_factors_set_by_hand(structure, kfac_like):
    settings = dict(lr=0.1, lr_cov=0.05, T=2, damping=1e-2, structures=structure)
    settings["kfac_like"] = kfac_like
    model = _mlp()
    reference = copy.deepcopy(model)
    opt = SINGD(model, **settings)
    cold = SINGD(reference, warm_start=False, **settings)
    traces = _traces(reference, *_batch(0))
    for layer in cold.layers:
        group = cold.param_groups[0]
        state = cold.state[layer.weight]
        rule = cold.rule_for(group)
        rule.init_state(layer, group, state)
        k2, c2 = warm_start.scales(*traces[layer.module], 1e-2, kfac_like)
        factors = rule._factors(layer, group, state)
        factors["K"].mul_(math.sqrt(k2))
        factors["C"].mul_(math.sqrt(c2))
    _train(model, opt, 4)
    _train(reference, cold, 4)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    for layer, ref_layer in zip(opt.layers, cold.layers, strict=True):
        state, ref_state = opt.state[layer.weight], cold.state[ref_layer.weight]
        assert state["warm_started"] is True and "warm_started" not in ref_state
        for key in ("K", "C", "m_K", "m_C"):
            for name, part in state[key].items():
                torch.testing.assert_close(part, ref_state[key][name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("u, g", [(1.0, 1e-6), (3.0, 0.2), (1e-4, 50.0)])
def test_scales_sit_at_the_trace_fixed_point(u, g):
    damping = 1e-3
    k2, c2 = warm_start.scales(u, g, damping, kfac_like=False)
    # tr̄(m̂_K) = ½[k²c²(ū ḡ + λ) − 1] = 0, and the damped K-FAC split of the product
    assert k2 * c2 * (u * g + damping) == pytest.approx(1.0, rel=1e-12)
    root = math.sqrt(damping)
    assert k2 / c2 == pytest.approx((g + root) / (u + root), rel=1e-12)
    k2, c2 = warm_start.scales(u, g, damping, kfac_like=True)
    assert k2 * (u + damping) == pytest.approx(1.0) and c2 * (g + damping) == pytest.approx(1.0)


@pytest.mark.parametrize("u, g", [(0.0, 1.0), (1.0, 0.0), (math.inf, 1.0), (math.nan, 1.0)])
def test_scales_refuse_statistics_without_a_scale(u, g):
    assert warm_start.scales(u, g, 1e-3, kfac_like=False) is None


def test_a_side_without_statistics_waits_with_identity_factors():
    """A layer whose output gradient is zero (the next layer is zero) keeps K = C = I and
    skips its factor updates until its statistics can start it."""
    model = _mlp()
    with torch.no_grad():
        model[4].weight.zero_()
    opt = SINGD(model, lr=0.1, T=1, structures="dense")
    _train(model, opt, 1)
    state = opt.state[model[2].weight]
    assert state["warm_started"] is False
    for key in ("K", "C"):
        (matrix,) = state[key].values()
        torch.testing.assert_close(matrix, torch.eye(8, dtype=torch.float64))
    assert opt.state[model[4].weight]["warm_started"] is True
    _train(model, opt, 2, first=1)  # the last layer has moved: gradients flow back now
    assert state["warm_started"] is True


def test_a_skipped_step_leaves_no_trace():
    model = _mlp()
    twin = copy.deepcopy(model)
    opt = SINGD(model, lr=0.1, T=1)
    fresh = SINGD(twin, lr=0.1, T=1)
    x, y = _batch(0)
    F.cross_entropy(model(x * math.inf), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()  # non-finite gradient: skipped
    opt.zero_grad()
    assert not opt.state
    _train(model, opt, 3)
    _train(twin, fresh, 3)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_checkpoint_says_it_happened_and_old_checkpoints_load():
    model = _mlp()
    opt = SINGD(model, lr=0.1, T=1)
    _train(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    assert {s["warm_started"] for s in saved["state"].values() if "K" in s} == {True}
    # as saved before the warm start existed: no flag in the states nor in the groups
    old = copy.deepcopy(saved)
    for state in old["state"].values():
        state.pop("warm_started", None)
    for group in old["param_groups"]:
        del group["warm_start"]
    twin = copy.deepcopy(model)
    resumed = SINGD(twin, lr=0.1, T=1)
    resumed.load_state_dict(old)
    assert resumed.param_groups[0]["warm_start"] is True
    restored = SINGD(copy.deepcopy(model), lr=0.1, T=1)
    restored.load_state_dict(saved)
    _train(twin, resumed, 2, first=2)  # the old run's factors are not restarted
    _train(model, opt, 2, first=2)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("structure", ["dense", "diagonal"])
def test_bfloat16_factors_hold_the_rounded_scale(structure):
    model = _mlp().float()
    opt = SINGD(model, lr=0.1, T=1, structures=structure, factor_dtype=torch.bfloat16)
    x, y = _batch(0)
    F.cross_entropy(model(x.float()), y).backward()
    opt.step()
    for layer in opt.layers:
        state = opt.state[layer.weight]
        assert state["warm_started"] is True
        for key in ("K", "C"):
            for part in state[key].values():
                assert part.dtype == torch.bfloat16 and torch.isfinite(part).all()


def _run(model, opt, batches, bad=None):
    """Train on ``batches``; at index ``bad`` an inf goes into the first gradient."""
    for index, (x, y) in enumerate(batches):
        F.cross_entropy(model(x), y).backward()
        if index == bad:
            model[0].weight.grad[0, 0] = math.inf
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("nonfinite", ["warn", "device"])
@pytest.mark.parametrize("structure", ["dense", "diagonal"])
def test_a_skip_on_the_warm_start_step_leaves_the_layer_to_start_later(structure, nonfinite):
    """The middle layer waits at step 0 (its output gradient is zero) and would warm-start
    at step 1, which is skipped: the step changes nothing, the flag included, so the run
    is the run without that batch (nonfinite='device' decides such a step on the host)."""
    model = _mlp()
    with torch.no_grad():
        model[4].weight.zero_()
    twin = copy.deepcopy(model)
    settings = dict(lr=0.1, T=1, structures=structure)
    opt = SINGD(model, nonfinite=nonfinite, **settings)
    reference = SINGD(twin, **settings)
    batches = [_batch(seed) for seed in range(4)]
    _run(model, opt, batches[:1])
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):  # at the step itself
        _run(model, opt, batches[1:2], bad=0)
    state = opt.state[model[2].weight]
    assert state["warm_started"] is False
    for key in ("K", "C"):
        for part in state[key].values():
            torch.testing.assert_close(
                part,
                torch.ones_like(part) if part.dim() == 1 else torch.eye(8, dtype=part.dtype),
                rtol=0,
                atol=0,
            )
    _run(model, opt, batches[2:])
    assert state["warm_started"] is True
    _run(twin, reference, batches[:1] + batches[2:])
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def _relu_mlp() -> nn.Module:
    """:func:`_mlp` in float32 with no saturating activation: large inputs keep their
    gradients."""
    model = _mlp().float()
    model[1], model[3] = nn.ReLU(), nn.Identity()
    return model


def _snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def _assert_unchanged(model, opt, before) -> None:
    params, saved = before
    for p, q in zip(model.parameters(), params, strict=True):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)
    now = opt.state_dict()
    assert now["state"].keys() == saved["state"].keys()
    for index, state in saved["state"].items():
        assert now["state"][index].keys() == state.keys()
        for key, value in state.items():
            if key != "step":  # SINGD's layer states keep no step; the fallback's counts
                torch.testing.assert_close(now["state"][index][key], value, rtol=0, atol=0)


@pytest.mark.parametrize(
    "structure, kfac_like",
    [("dense", False), ("diagonal", False), ("block_diagonal:4", False), ("dense", True)],
)
def test_a_first_warm_start_outside_float16_skips_the_step(structure, kfac_like):
    """Inputs of 1e6 ask for k² below 1e-5, below float16's normal range: the step is skipped
    with a warning and no state created (as for a factor update that overflows), not
    trained with K = C = I."""
    model = _relu_mlp()
    opt = SINGD(
        model, lr=0.1, T=1, structures=structure, kfac_like=kfac_like, factor_dtype=torch.float16
    )
    before = _snapshot(model, opt)
    x, y = _batch(0)
    F.cross_entropy(model(1e6 * x.float()), y).backward()
    with pytest.warns(RuntimeWarning, match="warm start a scale outside the factor dtype"):
        opt.step()
    _assert_unchanged(model, opt, before)
    assert not opt.state


@pytest.mark.parametrize("nonfinite", ["warn", "device"])
@pytest.mark.parametrize("structure", ["dense", "diagonal"])
def test_a_later_warm_start_outside_float16_skips_the_step(structure, nonfinite):
    """Inputs of 1e3 into a first layer scaled by 1e-3 (the other layers see the usual
    scales): it waits at step 0 (the zero middle layer stops its output gradient), and at
    step 1 its warm start asks for k² ~ 1e-6. The step changes no tensor and warns
    (nonfinite='device': decided on the device, warned at the next step, with the one
    message a non-finite factor update gives); the layer still waits, and no other
    layer's update overflows (a run of float32 factors skips nothing)."""
    model = _relu_mlp()
    with torch.no_grad():
        model[0].weight.mul_(1e-3)
        model[2].weight.zero_()
    twin = copy.deepcopy(model)
    settings = dict(lr=0.1, T=1, structures=structure, nonfinite=nonfinite)
    opt = SINGD(model, factor_dtype=torch.float16, **settings)
    batches = [(1e3 * x.float(), y) for x, y in map(_batch, range(3))]
    _run(model, opt, batches[:1])
    assert opt.state[model[0].weight]["warm_started"] is False
    before = _snapshot(model, opt)
    message = "warm start a scale outside the factor dtype"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(model, opt, batches[1:2])
    assert any(message in str(w.message) for w in caught) == (nonfinite == "warn")
    _assert_unchanged(model, opt, before)
    assert opt.state[model[0].weight]["warm_started"] is False
    if nonfinite == "device":
        with pytest.warns(RuntimeWarning, match=message + ".*an earlier step"):
            _run(model, opt, batches[2:])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(twin, SINGD(twin, factor_dtype=torch.float32, **settings), batches)
