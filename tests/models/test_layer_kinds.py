"""Layer kinds: a Linear stored transposed (Hugging Face ``Conv1D``, or any class
registered with :func:`singd_cuda.register_layer_kind`) follows the trajectory of the
equivalent ``nn.Linear`` exactly (float64, 1e-12), for every rule, fused diagonal paths
included; the registry finds kinds through the class hierarchy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from singd_cuda import KFAC, SINGD, AdaFisher, is_supported, register_layer_kind
from singd_cuda.curvature import LayerKind, LinearKind, TransposedLinearKind, layer_kind

OPTIMIZERS = {
    "singd-dense": (SINGD, dict(lr=0.05, lr_cov=0.05, T=1, weight_decay=1e-2)),
    "singd-diagonal": (SINGD, dict(lr=0.05, lr_cov=0.05, T=2, structures="diagonal")),
    "singd-block_diagonal": (
        SINGD,
        dict(lr=0.05, lr_cov=0.05, T=1, structures="block_diagonal:4", weight_decay=1e-2),
    ),
    "singd-hierarchical": (SINGD, dict(lr=0.05, lr_cov=0.05, T=1, structures="hierarchical:2,3")),
    "adafisher": (AdaFisher, dict(lr=0.01, T=1, damping=0.1, weight_decay=1e-2)),
    "kfac": (KFAC, dict(lr=0.05, T=1, damping=1e-2)),
}


class TransposedLinear(nn.Module):
    """y = x W + b with W stored (d_in, d_out), as Hugging Face's Conv1D."""

    def __init__(self, d_in: int, d_out: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out) / d_in**0.5)
        self.bias = nn.Parameter(torch.randn(d_out) * 0.1) if bias else None

    def forward(self, x):
        y = x @ self.weight
        return y if self.bias is None else y + self.bias


def hf_conv1d(d_in: int, d_out: int, bias: bool = True) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    assert bias, "Conv1D always has a bias"
    return transformers.pytorch_utils.Conv1D(d_out, d_in)


@pytest.fixture
def registered():
    """TransposedLinear registered for the test only."""
    register_layer_kind(TransposedLinear, TransposedLinearKind())
    yield TransposedLinear
    from singd_cuda.curvature import layers

    layers._KINDS.pop(TransposedLinear)
    layers._resolved.clear()


def model_pair(make, bias: bool):
    """(model with transposed layers, the same model with nn.Linear), float64."""
    torch.manual_seed(0)
    transposed = nn.Sequential(make(6, 10, bias), nn.Tanh(), make(10, 4, bias)).double()
    linear = nn.Sequential(nn.Linear(6, 10, bias=bias), nn.Tanh(), nn.Linear(10, 4, bias=bias))
    linear = linear.double()
    with torch.no_grad():
        for t, lin in ((transposed[0], linear[0]), (transposed[2], linear[2])):
            t.weight.normal_(0, 0.4)
            lin.weight.copy_(t.weight.T)
            if bias:
                t.bias.normal_(0, 0.1)
                lin.bias.copy_(t.bias)
    return transposed, linear


def trajectories_match(transposed: nn.Module, linear: nn.Module, name: str, steps: int = 5):
    initial = linear[0].weight.detach().clone()
    cls, kwargs = OPTIMIZERS[name]
    opts = [cls(transposed, **kwargs), cls(linear, **kwargs)]
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 3, 6, dtype=torch.float64, generator=generator)  # leading dims
        y = torch.randn(8, 3, 4, dtype=torch.float64, generator=generator)
        for model, opt in zip((transposed, linear), opts, strict=True):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    for t, lin in ((transposed[0], linear[0]), (transposed[2], linear[2])):
        torch.testing.assert_close(t.weight.T, lin.weight, rtol=0, atol=1e-12)
        if t.bias is not None:
            torch.testing.assert_close(t.bias, lin.bias, rtol=0, atol=1e-12)
    assert (linear[0].weight - initial).abs().max() > 1e-3, "the weights did not move"


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_hf_conv1d_matches_linear(name):
    transposed, linear = model_pair(lambda i, o, b: hf_conv1d(i, o, b), bias=True)
    trajectories_match(transposed, linear, name)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_registered_kind_matches_linear(registered, name, bias):
    transposed, linear = model_pair(registered, bias=bias)
    trajectories_match(transposed, linear, name)


def test_unregistered_module_is_not_preconditioned():
    assert not is_supported(TransposedLinear(3, 2))
    with pytest.raises(ValueError, match="no supported layer"):
        SINGD(nn.Sequential(TransposedLinear(3, 2)))


def test_kind_lookup_follows_the_class_hierarchy(registered):
    class Sub(registered):
        pass

    class Special(LinearKind):
        pass

    assert isinstance(layer_kind(Sub(3, 2)), TransposedLinearKind)
    assert isinstance(layer_kind(nn.Linear(3, 2)), LinearKind)
    assert layer_kind(nn.LayerNorm(3)) is None
    special = Special()
    register_layer_kind(Sub, special)
    try:
        assert layer_kind(Sub(3, 2)) is special
        assert isinstance(layer_kind(registered(3, 2)), TransposedLinearKind)
    finally:
        from singd_cuda.curvature import layers

        layers._KINDS.pop(Sub)
        layers._resolved.clear()


def test_register_layer_kind_checks_its_arguments():
    with pytest.raises(TypeError, match=r"nn\.Module subclass"):
        register_layer_kind(int, LinearKind())
    with pytest.raises(TypeError, match="LayerKind instance"):
        register_layer_kind(TransposedLinear, LinearKind)
    assert issubclass(TransposedLinearKind, LayerKind)


def test_hf_conv1d_recognised_without_registration():
    transformers = pytest.importorskip("transformers")
    assert isinstance(layer_kind(transformers.pytorch_utils.Conv1D(4, 3)), TransposedLinearKind)


class ScaledLinear(nn.Module):
    """The README's example of a registered kind: y = x Wᵀ · 0.5."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)
        self.bias = None

    def forward(self, x):
        return 0.5 * (x @ self.weight.T)


class ScaledLinearKind(LayerKind):
    def inputs(self, module, x):
        return 0.5 * x.reshape(-1, x.shape[-1])


def test_readme_kind_reproduces_the_weight_gradient():
    """G = gᵀa with the kind's a and g (loss_average=None: no scalings but 1/√N)."""
    from singd_cuda.curvature.layers import Layer, grad_output_matrix, input_matrix

    register_layer_kind(ScaledLinear, ScaledLinearKind())
    try:
        module = ScaledLinear(5, 3).double()
        x = torch.randn(4, 2, 5, dtype=torch.float64)
        out = module(x)
        out.retain_grad()
        (out * torch.randn_like(out)).sum().backward()
        layer = Layer("scaled", module, module.weight, None)
        a = input_matrix(layer, x, torch.float64) * (x.numel() // 5) ** 0.5
        g = grad_output_matrix(layer, out.grad, torch.float64)
        torch.testing.assert_close(g.T @ a, module.weight.grad, rtol=1e-12, atol=1e-12)
        opt = SINGD(nn.Sequential(module), lr=0.1, T=1, structures="dense")
        assert opt.preconditioned() == {"0": ("dense", "dense")}
    finally:
        from singd_cuda.curvature import layers

        layers._KINDS.pop(ScaledLinear)
        layers._resolved.clear()
