"""Bad input gets a clear error that names the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from singd_cuda import SINGD, AdaFisher

from .conftest import loss_fn, make_mlp, random_batches

VALID_NAMES = ("dense", "diagonal", "block_diagonal", "low_rank", "toeplitz", "hierarchical")


@pytest.mark.parametrize(
    "structures", ["bogus", ("dense", "bogus"), "block_diagonal:0", "low_rank:x", 3]
)
def test_unknown_structure_lists_the_valid_names(structures):
    with pytest.raises(ValueError, match="valid names") as error:
        SINGD(make_mlp(), structures=structures)
    for name in VALID_NAMES:
        assert name in str(error.value)


def test_unknown_structure_in_a_param_group():
    model = make_mlp()
    with pytest.raises(ValueError, match=r"unknown structure 'bogus'.*valid names"):
        SINGD(model, [dict(params=model.parameters(), structures="bogus")])


@pytest.mark.parametrize(
    ("structures", "match"),
    [
        (("dense", "dense", "dense"), "one name or a \\(K side, C side\\) pair"),
        (("adafisher", "dense"), "pass structures='adafisher'"),
    ],
)
def test_malformed_structure_pairs(structures, match):
    with pytest.raises(ValueError, match=match):
        SINGD(make_mlp(), structures=structures)


def test_parameters_not_in_the_model():
    with pytest.raises(ValueError, match=r"not a parameter of the model.*model.parameters"):
        SINGD(make_mlp(), make_mlp(seed=1).parameters())


def test_parameters_passed_instead_of_the_model():
    with pytest.raises(TypeError, match=r"first argument must be the model.*SINGD\(model"):
        SINGD(make_mlp().parameters())


@pytest.mark.parametrize("cls", [SINGD, AdaFisher])
def test_model_without_supported_layer(cls):
    with pytest.raises(ValueError, match=r"no supported layer.*Linear.*Conv2d.*AdamW"):
        cls(nn.Sequential(nn.Embedding(4, 3), nn.LayerNorm(3)))


def test_params_without_a_supported_layer_weight():
    model = make_mlp()
    with pytest.raises(ValueError, match="no supported layer"):
        SINGD(model, params=[model[0].bias, model[2].bias])


BAD_HYPERPARAMETERS = [
    (dict(lr=-1.0), "lr must be a number >= 0"),
    (dict(lr=float("nan")), "lr must be a number >= 0"),
    (dict(momentum=1.0), "momentum must be in \\[0, 1\\)"),
    (dict(momentum=-0.1), "momentum must be in \\[0, 1\\)"),
    (dict(alpha1=1.5), "alpha1 must be in \\[0, 1\\)"),
    (dict(damping=-1e-3), "damping must be a number >= 0"),
    (dict(lr_cov=-0.1), "lr_cov must be a number >= 0"),
    (dict(weight_decay=-1.0), "weight_decay must be a number >= 0"),
    (dict(T=0), "T must be an integer >= 1"),
    (dict(T=2.5), "T must be an integer >= 1"),
    (dict(loss_average="mean"), "loss_average must be one of .*'batch'.*'batch\\+sequence'"),
    (dict(factor_dtype=torch.int32), "factor_dtype must be None or one of .*bfloat16"),
    (dict(factor_dtype="bf16"), "factor_dtype must be None or one of .*bfloat16"),
    (dict(fallback_lr=-1.0), "fallback_lr must be >= 0"),
    (dict(fallback_betas=(1.5, 0.9)), "fallback_betas must be a pair of numbers in \\[0, 1\\)"),
    (dict(nonfinite="ignore"), "nonfinite must be 'warn', 'raise' or 'device'"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_HYPERPARAMETERS)
def test_invalid_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SINGD(make_mlp(), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(lr=-1.0), "lr must be a number >= 0"),
        (dict(momentum=1.0), "momentum must be in \\[0, 1\\)"),
        (dict(ema_decay=1.5), "ema_decay must be in \\[0, 1\\)"),
        (dict(T=0), "T must be an integer >= 1"),
        (dict(loss_average="tokens"), "loss_average must be one of"),
        (dict(factor_dtype=torch.int8), "factor_dtype must be None or one of"),
    ],
)
def test_invalid_adafisher_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaFisher(make_mlp(), **kwargs)


def test_invalid_hyperparameter_in_a_param_group():
    model = make_mlp()
    with pytest.raises(ValueError, match="momentum must be in"):
        SINGD(model, [dict(params=model[0].parameters(), momentum=2.0)])


def test_scheduled_T_returning_zero_fails_at_the_step():
    model = make_mlp()
    opt = SINGD(model, T=lambda step: 0)
    x, y = random_batches("mlp", 1)[0]
    with pytest.raises(ValueError, match="T must be >= 1"):
        loss_fn(model(x), y).backward()
        opt.step()


def test_weight_and_bias_in_different_groups():
    model = make_mlp()
    rest = [p for name, p in model.named_parameters() if not name.startswith("0.")]
    groups = [dict(params=[model[0].weight]), dict(params=[model[0].bias, *rest])]
    with pytest.raises(ValueError, match=r"weight and bias of layer '0'.*put both in one group"):
        SINGD(model, groups)


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (SINGD, dict(betas=(0.9, 0.99)), "'betas'.*did you mean 'fallback_betas'"),
        (SINGD, dict(foo=1), "'foo'.*fallback_lr"),
        (SINGD, dict(fallback_foo=1), "'fallback_foo'"),
        (AdaFisher, dict(structures="dense"), "'structures'"),
    ],
)
def test_unexpected_keyword(cls, kwargs, match):
    with pytest.raises(TypeError, match=f"unexpected keyword argument.*{match}"):
        cls(make_mlp(), **kwargs)
