"""Real models (Hugging Face GPT-2, LLaMA, BERT, a timm ViT, torchvision ResNet-18 in
channels_last), tiny configurations on the CPU in bf16 autocast: every matmul layer is
preconditioned (:func:`conftest.expected_split`), the loss stays finite and decreases over
a few steps on a fixed batch, and a checkpoint round-trips through
``torch.load(weights_only=True)``, continuing exactly as the uninterrupted run.

The default run covers the whole matrix except ResNet-18's heavier cases
(:func:`in_default_run`), which are marked slow."""

from __future__ import annotations

import io

import pytest
import torch

from singd_cuda import KFAC, SINGD, AdaFisher
from singd_cuda.optim.factor_memory import LargeFactorWarning

from .conftest import MODELS, RealModel, build, expected_split

OPTIMIZERS = {
    "singd-block_diagonal": lambda m: SINGD(
        m, lr=5e-3, lr_cov=0.05, T=2, structures="block_diagonal:16", factor_dtype=torch.bfloat16
    ),
    "singd-diagonal": lambda m: SINGD(
        m, lr=5e-3, lr_cov=0.05, T=2, structures="diagonal", factor_dtype=torch.bfloat16
    ),
    "singd-hierarchical": lambda m: SINGD(
        m, lr=5e-3, lr_cov=0.05, T=2, structures="hierarchical:4,4", factor_dtype=torch.bfloat16
    ),
    "adafisher": lambda m: AdaFisher(m, lr=3e-3, T=1),
    "kfac": lambda m: KFAC(m, lr=3e-3, T=2, damping=1e-2),
}
STEPS = 4


def in_default_run(model: str, opt: str) -> bool:
    """About a second per case on a quiet CPU; ResNet-18's larger factors (K-FAC inverts a
    4609 x 4609 one) make its other cases slow, so its default case is diagonal SINGD."""
    return model != "resnet18" or opt == "singd-diagonal"


CASES = [
    pytest.param(model, name, marks=() if in_default_run(model, name) else pytest.mark.slow)
    for model in MODELS
    for name in OPTIMIZERS
]


def make_optimizer(model_name: str, opt_name: str, model):
    """The optimizer; K-FAC on ResNet-18 warns of its dense factors (4608 wide, 81 MiB), as
    it should."""
    if (model_name, opt_name) == ("resnet18", "kfac"):
        with pytest.warns(LargeFactorWarning, match="K-FAC's factors are dense"):
            return OPTIMIZERS[opt_name](model)
    return OPTIMIZERS[opt_name](model)


def step(real: RealModel, opt) -> float:
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = real.loss(real.model, real.batch)
    loss.backward()
    opt.step()
    return loss.item()


@pytest.mark.parametrize(("model_name", "opt_name"), CASES)
def test_real_model_trains_preconditioned_and_checkpoints(model_name, opt_name):
    real = build(model_name)
    opt = make_optimizer(model_name, opt_name, real.model)

    preconditioned, fallback = expected_split(real.model)
    assert set(opt.preconditioned()) == preconditioned
    rows = {line.split()[0]: line for line in opt.summary().splitlines()[2:-1]}
    fallback_rows = {name: row for name, row in rows.items() if "AdamW fallback" in row}
    reasons = {
        name: row.split("fallback: ")[1].split("  ")[0] for name, row in fallback_rows.items()
    }
    by_design = ("norm", "embedding", "free parameters")  # no module without a layer kind
    assert {name for name, reason in reasons.items() if reason not in by_design} == fallback

    losses = [step(real, opt) for _ in range(STEPS)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses

    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    resumed = build(model_name, seed=1)  # (a deepcopy would copy the optimizer's hooks)
    resumed.model.load_state_dict(real.model.state_dict())
    resumed_opt = make_optimizer(model_name, opt_name, resumed.model)
    resumed_opt.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    for _ in range(2):  # an update step (T = 2) and a plain one
        assert step(resumed, resumed_opt) == step(real, opt)
    for (name, p), q in zip(real.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), name
