"""load_state_dict checks that a checkpoint fits this optimizer (optimizer kind, groups,
structures, per-parameter state keys and shapes) and raises one ValueError naming the
mismatch before anything is loaded; a checkpoint that fits loads as before."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from singd_cuda import KFAC, SINGD, AdaFisher

from .validation_cases import (
    assert_same,
    batch,
    make_model,
    make_optimizer,
    parameters,
    state_tensors,
    train,
)

NAMES = ["singd-dense", "singd-block_diagonal", "singd-diagonal", "ikfac", "adafisher", "kfac"]


def saved(name: str, model: nn.Module | None = None, **extra) -> dict:
    """A checkpoint after 2 steps, through torch.save / torch.load(weights_only=True)."""
    model = model or make_model()
    opt = make_optimizer(name, model, **extra)
    train(model, opt, 2)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_rejected(opt: torch.optim.Optimizer, checkpoint: dict, match: str) -> None:
    """ValueError matching ``match``; the optimizer's state and groups are unchanged."""
    before, groups = state_tensors(opt), [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(checkpoint)
    assert_same(state_tensors(opt), before)
    assert [dict(g) for g in opt.param_groups] == groups


@pytest.mark.parametrize("name", NAMES)
def test_the_state_dict_names_its_optimizer_and_round_trips(name):
    checkpoint = saved(name)
    assert checkpoint["optimizer"] == type(make_optimizer(name, make_model())).__name__
    model = make_model()
    opt = make_optimizer(name, model)
    opt.load_state_dict(checkpoint)
    train(model, opt, 1, first_seed=2)


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("singd-dense", "adafisher"),
        ("singd-dense", "kfac"),
        ("adafisher", "singd-diagonal"),
        ("kfac", "singd-dense"),
        ("kfac", "adafisher"),
    ],
)
def test_a_checkpoint_of_another_optimizer_is_rejected(source, target):
    checkpoint = saved(source)
    opt = make_optimizer(target, make_model())
    train(opt.model, opt, 1)
    assert_rejected(opt, checkpoint, r"saved by (SINGD|AdaFisher|KFAC), this is")


@pytest.mark.parametrize(("source", "target"), [("singd-dense", "kfac"), ("adafisher", "kfac")])
def test_another_optimizer_is_rejected_without_the_kind_key(source, target):
    """Older or hand-assembled checkpoints lack "optimizer": the groups and states tell."""
    checkpoint = saved(source)
    del checkpoint["optimizer"]
    opt = make_optimizer(target, make_model())
    assert_rejected(opt, checkpoint, r"lacks|state of parameter")


def test_singd_with_adafisher_structure_is_not_the_adafisher_class():
    checkpoint = saved("adafisher")
    opt = SINGD(make_model(), structures="adafisher")
    assert_rejected(opt, checkpoint, "saved by AdaFisher, this is SINGD")


@pytest.mark.parametrize(
    ("saved_structure", "structure"),
    [("dense", "diagonal"), ("block_diagonal:3", "block_diagonal:4"), ("dense", "low_rank:2")],
)
def test_a_checkpoint_of_another_structure_is_rejected(saved_structure, structure):
    checkpoint = saved("singd-dense", structures=saved_structure)
    opt = make_optimizer("singd-dense", make_model(), structures=structure)
    assert_rejected(opt, checkpoint, r"param_groups\[0\] uses structures .* to load it")


@pytest.mark.parametrize("name", NAMES)
def test_a_checkpoint_of_another_model_is_rejected(name):
    """Same number of parameters, one layer wider: the shapes tell."""
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(6, 9), nn.LayerNorm(9), nn.Tanh(), nn.Linear(9, 4))
    checkpoint = saved(name, other)
    opt = make_optimizer(name, make_model())
    assert_rejected(opt, checkpoint, r"parameter \d+ \('\d\.(weight|bias)'.*shape")


@pytest.mark.parametrize("name", ["singd-dense", "adafisher", "kfac"])
def test_parameters_in_another_order_are_rejected(name):
    """The LayerNorm first: its AdamW state lands on a Linear weight."""
    checkpoint = saved(name)
    model = make_model()
    groups = [{"params": [model[1].weight, model[1].bias, model[0].weight, model[0].bias]}]
    groups[0]["params"] += [model[3].weight, model[3].bias]
    opt = make_optimizer(name, model)
    reordered = make_optimizer(name, model, params=groups[0]["params"])
    assert_rejected(reordered, checkpoint, r"state of parameter 0 .* has the keys")
    opt.load_state_dict(checkpoint)  # the same model in its own order loads


def test_more_groups_or_parameters_are_rejected():
    checkpoint = saved("singd-dense")
    model = make_model()
    two = make_optimizer(
        "singd-dense", model, params=[{"params": model[0].parameters()}, {"params": []}]
    )
    assert_rejected(two, checkpoint, r"1 parameter group\(s\), this SINGD has 2")
    fewer = make_optimizer("singd-dense", model, params=[*model[0].parameters(), model[3].weight])
    assert_rejected(fewer, checkpoint, r"param_groups\[0\] has 6 parameters in the checkpoint")


def test_a_state_key_of_another_rule_is_rejected():
    checkpoint = saved("singd-dense")
    first = next(iter(checkpoint["state"].values()))
    first["A"] = first.pop("K")
    assert_rejected(make_optimizer("singd-dense", make_model()), checkpoint, r"unexpected: \['A'\]")


@pytest.mark.parametrize(("key", "value"), [("lr", -1.0), ("T", 0), ("loss_average", "mean")])
def test_an_invalid_hyperparameter_in_the_checkpoint_is_rejected(key, value):
    checkpoint = saved("singd-dense")
    checkpoint["param_groups"][0][key] = value
    opt = make_optimizer("singd-dense", make_model())
    assert_rejected(opt, checkpoint, rf"param_groups\[0\] of the checkpoint: {key} must be")


def test_a_failed_load_leaves_training_as_it_was():
    model = make_model()
    opt = make_optimizer("singd-dense", model)
    twin = make_model()
    twin_opt = make_optimizer("singd-dense", twin)
    for o, m in ((opt, model), (twin_opt, twin)):
        train(m, o, 2)
    with pytest.raises(ValueError):
        opt.load_state_dict(saved("singd-diagonal"))
    train(model, opt, 2, first_seed=2)
    train(twin, twin_opt, 2, first_seed=2)
    assert_same(parameters(model), parameters(twin))


@pytest.mark.parametrize("cls", [SINGD, AdaFisher, KFAC])
def test_error_is_a_value_error_naming_the_fix(cls):
    checkpoint = saved("singd-diagonal")
    name = {SINGD: "singd-dense", AdaFisher: "adafisher", KFAC: "kfac"}[cls]
    opt = make_optimizer(name, make_model())
    with pytest.raises(ValueError, match=r"load a checkpoint saved by the same|structures="):
        opt.load_state_dict(checkpoint)


# ------------------------------------------------------------------ values that do not fit
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_factor_is_rejected(name, value):
    checkpoint = saved(name)
    state = checkpoint["state"][0]  # the first Linear's weight
    key = next(k for k, v in sorted(state.items()) if isinstance(v, torch.Tensor))
    state[key] = state[key].clone()
    state[key].view(-1)[0] = value
    model = make_model()
    opt = make_optimizer(name, model)
    train(model, opt, 1)
    assert_rejected(opt, checkpoint, rf"non-finite values .*'{key}' of parameter 0 \('0.weight'\)")


@pytest.mark.parametrize(("parameter", "key"), [(0, "momentum_buffer"), (2, "exp_avg_sq")])
def test_a_non_finite_buffer_is_rejected(parameter, key):
    """A layer's momentum, the AdamW fallback's moment of the LayerNorm weight."""
    checkpoint = saved("singd-dense")
    checkpoint["state"][parameter][key][0] = float("nan")
    assert_rejected(make_optimizer("singd-dense", make_model()), checkpoint, "non-finite")


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64, torch.bool])
def test_a_state_tensor_of_a_non_float_dtype_is_rejected(dtype):
    checkpoint = saved("adafisher")
    state = checkpoint["state"][0]
    state["h"] = state["h"].to(dtype)
    opt = make_optimizer("adafisher", make_model())
    assert_rejected(opt, checkpoint, rf"holds 'h' of dtype {dtype}")


@pytest.mark.parametrize("step", [-1, 2.5, "2", None, True])
def test_an_invalid_group_step_is_rejected(step):
    checkpoint = saved("kfac")
    checkpoint["param_groups"][0]["step"] = step
    assert_rejected(make_optimizer("kfac", make_model()), checkpoint, r"has step .* integer >= 0")


@pytest.mark.parametrize(
    "mangle",
    [
        lambda c: c.pop("state"),
        lambda c: c.pop("param_groups"),
        lambda c: c["param_groups"][0].pop("params"),
        lambda c: c.__setitem__("state", [c["state"]]),
    ],
)
def test_a_malformed_state_dict_is_rejected(mangle):
    checkpoint = saved("singd-dense")
    mangle(checkpoint)
    opt = make_optimizer("singd-dense", make_model())
    assert_rejected(opt, checkpoint, r"not (an optimizer state_dict|a dict with a 'params')")


# ----------------------------------------------------------- failed calls change nothing
def test_a_failing_load_state_dict_post_hook_leaves_the_optimizer_as_it_was():
    model = make_model()
    opt = make_optimizer("singd-dense", model)
    train(model, opt, 3)
    checkpoint = saved("singd-dense")  # fits, after 2 steps

    def refuse(optimizer):
        raise RuntimeError("post-hook refuses")

    opt.register_load_state_dict_post_hook(refuse)
    assert_rejected_by(opt, checkpoint, RuntimeError, "post-hook refuses")


def assert_rejected_by(opt, checkpoint, error, match) -> None:
    before, groups = state_tensors(opt), [dict(g) for g in opt.param_groups]
    with pytest.raises(error, match=match):
        opt.load_state_dict(checkpoint)
    assert_same(state_tensors(opt), before)
    assert [dict(g) for g in opt.param_groups] == groups


def backward_on(model, opt, seed: int) -> None:
    opt.zero_grad()
    x, y = batch(seed)
    F.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize("name", ["singd-dense", "adafisher", "kfac"])
def test_a_step_refused_for_a_hyperparameter_keeps_the_statistics(name):
    """lr edited to -1 between backward and step: the step raises, changes nothing and
    keeps the statistics of the backward, so the step after the fix is the step that
    would have been."""
    model, reference = make_model(), make_model()
    opt, ref = make_optimizer(name, model), make_optimizer(name, reference)
    train(model, opt, 1)
    train(reference, ref, 2)
    backward_on(model, opt, 1)
    lr = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"param_groups\[0\]: lr must be"):
        opt.step()
    opt.param_groups[0]["lr"] = lr
    opt.step()
    assert_same(parameters(model), parameters(reference))
    assert_same(state_tensors(opt), state_tensors(ref))


@pytest.mark.parametrize("name", ["singd-dense", "adafisher", "kfac"])
def test_a_failed_add_param_group_keeps_the_statistics(name):
    model, reference = make_model(), make_model()
    opt = make_optimizer(name, model, params=model[0].parameters())
    ref = make_optimizer(name, reference, params=reference[0].parameters())
    train(model, opt, 1)
    train(reference, ref, 2)
    backward_on(model, opt, 1)
    with pytest.raises(ValueError, match="lr must be"):
        opt.add_param_group({"params": list(model[3].parameters()), "lr": -1.0})
    assert len(opt.param_groups) == 1
    opt.step()
    assert_same(parameters(model), parameters(reference))
    assert_same(state_tensors(opt), state_tensors(ref))


def test_add_param_group_names_the_stale_parameter_not_the_new_one():
    """A weight replaced in the model after construction: the error names the group
    entry the optimizer already had, and the optimizer stays as it was."""
    model = make_model()
    opt = make_optimizer("singd-dense", model, params=model[0].parameters())
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] .* no longer"):
        opt.add_param_group({"params": list(model[3].parameters())})
    assert len(opt.param_groups) == 1


def test_load_state_dict_pre_hooks_run_before_the_check():
    """torch.optim's pre-hooks may adapt a checkpoint: one that renames a key back makes
    it fit; one that writes a NaN into it gets it refused."""
    checkpoint = saved("singd-dense")
    renamed = {**checkpoint, "state": {i: dict(s) for i, s in checkpoint["state"].items()}}
    renamed["state"][0]["A"] = renamed["state"][0].pop("K")

    def rename_back(optimizer, state_dict):
        state_dict["state"][0]["K"] = state_dict["state"][0].pop("A")

    opt = make_optimizer("singd-dense", make_model())
    handle = opt.register_load_state_dict_pre_hook(rename_back)
    opt.load_state_dict(renamed)
    assert_same(state_tensors(opt), state_tensors(loaded("singd-dense", checkpoint)))
    handle.remove()

    def poison(optimizer, state_dict):
        state = {i: dict(s) for i, s in state_dict["state"].items()}
        state[0]["momentum_buffer"] = torch.full_like(state[0]["momentum_buffer"], torch.nan)
        return {**state_dict, "state": state}

    opt.register_load_state_dict_pre_hook(poison)
    assert_rejected(opt, checkpoint, r"non-finite values .*'momentum_buffer' of parameter 0")


def loaded(name: str, checkpoint: dict):
    opt = make_optimizer(name, make_model())
    opt.load_state_dict(checkpoint)
    return opt
