"""The optimizer's hooks over the model's life: one optimizer at a time, nothing left
behind by a collected one, copies and pickles of the model that work, no stale loss scale
after an exception inside ``scaler.step``."""

from __future__ import annotations

import copy
import gc
import io

import pytest
import torch
from torch.optim.swa_utils import AveragedModel

from .conftest import NAMES, assert_close_params, batches, loss_sum, make_optimizer, mlp


def hook_count(model) -> int:
    forward = sum(len(m._forward_hooks) for m in model.modules())
    params = model.parameters()
    grad = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in params)
    return forward + grad + len(model._forward_pre_hooks)


@pytest.mark.parametrize("name", NAMES)
def test_a_collected_optimizer_leaves_no_hook(name):
    model = mlp()
    assert hook_count(model) == 0
    opt = make_optimizer(name, model)
    assert hook_count(model) > 0
    del opt
    gc.collect()
    assert hook_count(model) == 0


@pytest.mark.parametrize("name", NAMES)
def test_a_second_optimizer_replaces_the_first(name):
    model = mlp()
    first = make_optimizer(name, model)
    one = hook_count(model)
    second = make_optimizer(name, model)
    assert hook_count(model) == one
    x, y = batches(1)[0]
    (loss_sum(model(x), y) / len(y)).backward()
    assert not first._capture.committed
    assert second._capture.committed
    second.step()
    with pytest.raises(RuntimeError, match="took over"):
        first.step()


def test_recreating_an_optimizer_keeps_one_set_of_hooks():
    model = mlp()
    opt = make_optimizer("singd-dense", model)
    single = hook_count(model)
    for _ in range(3):
        opt = make_optimizer("singd-dense", model)
    assert hook_count(model) == single
    x, y = batches(1)[0]
    (loss_sum(model(x), y) / len(y)).backward()
    opt.step()


@pytest.mark.parametrize("name", NAMES)
def test_copies_of_the_model_work_and_do_not_feed_the_optimizer(name):
    """deepcopy (EMA models), AveragedModel (SWA) and torch.save of a hooked model; their
    forwards and backwards do not reach the optimizer's statistics."""
    model, twin = mlp(), mlp()
    opt, twin_opt = make_optimizer(name, model), make_optimizer(name, twin)
    ema = copy.deepcopy(model)
    swa = AveragedModel(model)
    torch.save(model, io.BytesIO())
    for x, y in batches(3):
        for m, o in ((model, opt), (twin, twin_opt)):
            o.zero_grad()
            (loss_sum(m(x), y) / len(y)).backward()
        (loss_sum(ema(x), y) / len(y)).backward()  # in train mode, with grad
        swa(x)
        opt.step()
        twin_opt.step()
        swa.update_parameters(model)
    assert_close_params(list(model.parameters()), list(twin.parameters()), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["singd-dense", "adafisher"])
def test_an_exception_inside_scaler_step_leaves_no_stale_scale(name):
    model = mlp().float()
    opt = make_optimizer(name, model)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = batches(1)[0]
    opt.zero_grad()
    scaler.scale(loss_sum(model(x.float()), y) / len(y)).backward()
    seed = opt._seed  # called as the layers are written, after the factor updates
    opt._seed = lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        scaler.step(opt)
    opt._seed = seed
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    assert not opt._capture.committed
