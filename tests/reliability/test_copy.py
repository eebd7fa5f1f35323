"""copy.deepcopy and pickle of an optimizer raise a TypeError naming state_dict; the
alternative they name (a new optimizer on a model copy, loading a copy of the state)
continues training exactly as the original."""

from __future__ import annotations

import copy
import pickle

import pytest

from .validation_cases import CASES, assert_same, make_model, make_optimizer, parameters, train


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize(
    "how", [copy.deepcopy, copy.copy, pickle.dumps], ids=["deepcopy", "copy", "pickle"]
)
def test_copying_an_optimizer_raises_naming_state_dict(name, how):
    model = make_model()
    opt = make_optimizer(name, model)
    train(model, opt, 1)
    with pytest.raises(TypeError, match=r"cannot be (deep-copied|pickled).*state_dict\(\)"):
        how(opt)


@pytest.mark.parametrize("name", list(CASES))
def test_the_named_alternative_continues_exactly(name):
    model = make_model()
    twin = copy.deepcopy(model)  # before the optimizer hooks the model
    opt = make_optimizer(name, model)
    train(model, opt, 2)
    twin.load_state_dict(model.state_dict())
    twin_opt = make_optimizer(name, twin)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(model, opt, 2, first_seed=2)
    train(twin, twin_opt, 2, first_seed=2)
    assert_same(parameters(model), parameters(twin))
