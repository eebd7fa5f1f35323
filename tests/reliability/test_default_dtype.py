"""torch.set_default_dtype(torch.float64) changes nothing: a float64 model trains exactly as
it does under the float32 default; K-FAC's GGN capture computes in the model's dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from singd_cuda import KFAC

from .validation_cases import CASES, make_model, make_optimizer, parameters, train


@pytest.fixture
def float64_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def trained(name: str, init: dict) -> list[torch.Tensor]:
    model = make_model(torch.float64)
    model.load_state_dict(init)
    train(model, make_optimizer(name, model), 3)
    return parameters(model)


@pytest.mark.parametrize("name", list(CASES))
def test_a_float64_default_trains_as_an_explicit_float64_model(name, float64_default):
    init = make_model(torch.float64).state_dict()
    under_default = trained(name, init)
    torch.set_default_dtype(torch.float32)
    explicit = trained(name, init)
    for a, b in zip(under_default, explicit, strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["singd-diagonal", "adafisher", "kfac"])
def test_a_nonfinite_gradient_is_skipped_under_a_float64_default(name, float64_default):
    model = make_model()
    opt = make_optimizer(name, model)
    train(model, opt, 1)
    before = parameters(model)
    opt.zero_grad()
    model(torch.full((2, 6), float("inf"))).sum().backward()
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        opt.step()
    for a, b in zip(parameters(model), before, strict=True):
        assert torch.equal(a, b)


def test_capture_ggn_cross_entropy_is_float64_for_a_float64_model():
    """Output layer: G = mean over samples of diag(p) − p pᵀ (the softmax Hessian), exact
    to float64 rounding (a float32 softmax is off by ~1e-8)."""
    model = make_model(torch.float64)
    opt = KFAC(model, T=1, fisher="ggn", loss_average="batch")
    x = torch.randn(16, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = model(x)
    opt.capture_ggn(out, "cross_entropy")
    F.cross_entropy(out, torch.zeros(16, dtype=torch.long)).backward()
    opt.step()
    p = torch.softmax(out.detach(), dim=-1)
    expected = (torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)).mean(0)
    G = opt.state[model[3].weight]["G"]
    assert G.dtype == torch.float64
    torch.testing.assert_close(G, expected, rtol=1e-12, atol=1e-15)
