"""Checkpoints: torch.save(opt.state_dict()) at step 7, torch.load(weights_only=True)
into a fresh model and optimizer, continue to step 15: bitwise equal to a run that
was never interrupted; every state tensor keeps its dtype."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from .conftest import (
    IN_FEATURES,
    NUM_CLASSES,
    assert_models_equal,
    assert_states_equal,
    flat_state,
    make_optimizer,
    random_batches,
    train,
)

SAVE_AT, TOTAL = 7, 15


def model_with_fallback(dtype=torch.float32) -> nn.Module:
    """Linear layers plus a LayerNorm, so the AdamW fallback state is checkpointed too."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, 16),
        nn.LayerNorm(16),
        nn.Tanh(),
        nn.Linear(16, NUM_CLASSES),
    ).to(dtype)


CASES = {
    "singd-dense": dict(name="singd-dense", T=3),
    "singd-block_diagonal": dict(name="singd-block_diagonal", T=3),
    "singd-hierarchical": dict(name="singd-hierarchical", T=2),
    "ikfac": dict(name="ikfac", T=3),
    "adafisher": dict(name="adafisher", T=2),
    "singd-bf16-factors": dict(name="singd-dense", T=3, factor_dtype=torch.bfloat16),
    "adafisher-bf16-factors": dict(name="adafisher", factor_dtype=torch.bfloat16),
    "singd-pure-bf16-sr": dict(
        name="singd-tril_toeplitz",
        factor_dtype=torch.bfloat16,
        stochastic_rounding=True,
        model_dtype=torch.bfloat16,
    ),
    "adafisher-pure-bf16-sr": dict(
        name="adafisher",
        factor_dtype=torch.bfloat16,
        stochastic_rounding=True,
        model_dtype=torch.bfloat16,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_save_load_continue_is_bitwise_equal(case, tmp_path):
    settings = dict(CASES[case])
    name, model_dtype = settings.pop("name"), settings.pop("model_dtype", torch.float32)
    batches = random_batches("mlp", TOTAL, dtype=model_dtype)

    straight = model_with_fallback(model_dtype)
    straight_opt = make_optimizer(name, straight, **settings)
    train(straight, straight_opt, batches)

    first = model_with_fallback(model_dtype)
    first_opt = make_optimizer(name, first, **settings)
    train(first, first_opt, batches[:SAVE_AT])
    torch.save(first_opt.state_dict(), tmp_path / "opt.pt")
    torch.save(first.state_dict(), tmp_path / "model.pt")
    saved = flat_state(first_opt.state_dict())

    resumed = model_with_fallback(model_dtype)
    resumed.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    resumed_opt = make_optimizer(name, resumed, **settings)
    resumed_opt.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    loaded = flat_state(resumed_opt.state_dict())
    for key, value in saved.items():  # every state tensor keeps its own dtype
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype, key
    train(resumed, resumed_opt, batches[SAVE_AT:])

    assert_models_equal(resumed, straight)
    assert_states_equal(resumed_opt.state_dict(), straight_opt.state_dict())


def test_bf16_factor_dtypes_survive_load(tmp_path):
    """factor_dtype=bfloat16 on a float32 model: factors bf16, momentum buffers float32."""
    model = model_with_fallback()
    opt = make_optimizer("singd-block_diagonal", model, factor_dtype=torch.bfloat16, T=1)
    train(model, opt, random_batches("mlp", 1))
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    fresh = make_optimizer("singd-block_diagonal", model, factor_dtype=torch.bfloat16, T=1)
    fresh.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    state = fresh.state[model[0].weight]
    for side in ("K", "C", "m_K", "m_C"):
        assert all(t.dtype == torch.bfloat16 for t in state[side].values()), side
    assert state["momentum_buffer"].dtype == torch.float32
    assert fresh.state[model[1].weight]["exp_avg"].dtype == torch.float32
