"""The dense K-FAC baseline: exact on deep linear networks, inversion variants, low precision."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from singd_cuda import KFAC


def deep_linear(bias: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 5, bias=bias), nn.Linear(5, 3, bias=bias), nn.Linear(3, 2, bias=bias)
    ).double()


def exact_ggn_blocks(net: nn.Module, X: torch.Tensor) -> list[torch.Tensor]:
    """Per-layer GGN blocks of the mean of ½‖f − y‖² from explicit Jacobians.

    Ordered as vec of [W | b] row by row, the ordering of kron(G, A).
    """
    names = [n for n, _ in net.named_parameters()]

    def f(params, x):
        return functional_call(net, dict(zip(names, params, strict=True)), (x,))

    jacobians = jacrev(f)(tuple(net.parameters()), X)
    by_name = dict(zip(names, jacobians, strict=True))
    blocks = []
    for index, layer in enumerate(net):
        J = by_name[f"{index}.weight"].reshape(X.shape[0], -1, *layer.weight.shape)
        if layer.bias is not None:
            J = torch.cat([J, by_name[f"{index}.bias"].reshape(*J.shape[:3], 1)], dim=3)
        J = J.flatten(2)
        blocks.append(torch.einsum("nci,ncj->ij", J, J) / X.shape[0])
    return blocks


@pytest.mark.parametrize("bias", [False, True])
def test_factors_equal_exact_ggn_of_deep_linear_network(bias):
    net = deep_linear(bias)
    opt = KFAC(net, T=1, fisher="ggn", lr=0.0, momentum=0.0)
    X = torch.randn(7, 4, dtype=torch.float64)
    Y = torch.randn(7, 2, dtype=torch.float64)
    out = net(X)
    opt.capture_ggn(out, "mse")
    (0.5 * (out - Y).square().sum(1).mean()).backward()
    opt.step()
    for layer, ggn in zip(opt.layers, exact_ggn_blocks(net, X), strict=True):
        state = opt.state[layer.weight]
        torch.testing.assert_close(torch.kron(state["G"], state["A"]), ggn, rtol=1e-10, atol=1e-14)


def test_empirical_fisher_factors_are_the_gradient_outer_products():
    """One sample, one layer: A ⊗ G is exactly vec(∇W) vec(∇W)ᵀ."""
    torch.manual_seed(1)
    layer = nn.Linear(3, 2).double()
    opt = KFAC(layer, T=1, lr=0.0, momentum=0.0)
    x, y = torch.randn(1, 3, dtype=torch.float64), torch.randn(1, 2, dtype=torch.float64)
    (0.5 * (layer(x) - y).square().sum()).backward()
    grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1).flatten()
    opt.step()
    state = opt.state[layer.weight]
    torch.testing.assert_close(torch.kron(state["G"], state["A"]), torch.outer(grad, grad))


def test_inverse_and_eigen_agree_and_precondition_the_gradient():
    torch.manual_seed(2)
    results = []
    for method in ("inverse", "eigen"):
        net = deep_linear(True)
        opt = KFAC(net, T=1, inverse=method, lr=0.1, momentum=0.0, damping=1e-2)
        X = torch.randn(16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        before = [p.clone() for p in net.parameters()]
        net(X).square().mean().backward()
        grads = [p.grad.clone() for p in net.parameters()]
        opt.step()
        layer = opt.layers[0]
        state = opt.state[layer.weight]
        eye = torch.eye
        A = state["A"] + 0.1 * eye(5, dtype=torch.float64)
        G = state["G"] + 0.1 * eye(5, dtype=torch.float64)
        G_full = torch.cat([grads[0], grads[1][:, None]], 1)
        expected = torch.linalg.solve(G, G_full) @ torch.linalg.inv(A)
        step = torch.cat([before[0] - net[0].weight, (before[1] - net[0].bias)[:, None]], 1)
        torch.testing.assert_close(step, 0.1 * expected, rtol=1e-9, atol=1e-12)
        results.append([p.detach().clone() for p in net.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_inverses_refresh_only_every_T_inv_steps():
    torch.manual_seed(4)
    net = deep_linear(True)
    opt = KFAC(net, T=1, T_inv=3, lr=1e-2)
    seen = []
    for _ in range(6):
        opt.zero_grad()
        net(torch.randn(8, 4, dtype=torch.float64)).square().mean().backward()
        opt.step()
        seen.append(opt.state[opt.layers[0].weight]["A_inv"].clone())
    changed = [not torch.equal(seen[i], seen[i - 1]) for i in range(1, 6)]
    assert changed == [False, False, True, False, False]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_factors_are_stored_in_their_dtype(dtype):
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = KFAC(net, T=1, factor_dtype=dtype, lr=1e-2)
    X = torch.randn(32, 6)
    for _ in range(3):
        opt.zero_grad()
        net(X).square().mean().backward()
        opt.step()
    state = opt.state[net[0].weight]
    assert {state[k].dtype for k in ("A", "G", "A_inv", "G_inv")} == {dtype}
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_cross_entropy_ggn_capture_leaves_grad_untouched():
    torch.manual_seed(6)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 4))
    opt = KFAC(net, T=1, fisher="ggn")
    out = net(torch.randn(9, 5))
    opt.capture_ggn(out, "cross_entropy")
    assert all(p.grad is None for p in net.parameters())
    torch.nn.functional.cross_entropy(out, torch.randint(0, 4, (9,))).backward()
    opt.step()
    G = opt.state[net[2].weight]["G"]
    # the softmax Hessian has the all-ones vector in its kernel, so does G
    torch.testing.assert_close(G @ torch.ones(4), torch.zeros(4), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"inverse": "cholesky"}, "inverse must be one of"),
        ({"fisher": "mc"}, "fisher must be one of"),
        ({"T_inv": 0}, "T_inv must be None or an integer"),
        ({"stat_decay": 1.0}, r"stat_decay must be in \[0, 1\)"),
        ({"damping": -1.0}, "damping must be a number"),
    ],
)
def test_bad_hyperparameters_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KFAC(nn.Linear(2, 2), **kwargs)


def test_capture_ggn_rejects_unknown_loss():
    net = nn.Linear(2, 2)
    opt = KFAC(net, fisher="ggn")
    with pytest.raises(ValueError, match="loss must be one of"):
        opt.capture_ggn(net(torch.randn(3, 2)), "hinge")


class _Repeated(nn.Module):
    """Three 6 → 6 layers (one stack), a 6 → 6 layer without bias and a head: mixed shapes."""

    def __init__(self, dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(*(m for _ in range(3) for m in (nn.Linear(6, 6), nn.Tanh())))
        self.plain = nn.Linear(6, 6, bias=False)
        self.head = nn.Linear(6, 3)
        self.to(dtype)
        self.idle = ()  # indices of body modules the forward skips

    def forward(self, x):
        for index, module in enumerate(self.body):
            if index not in self.idle:
                x = module(x)
        return self.head(torch.tanh(self.plain(x)))


def _train_kfac(dtype, stacked: bool, late_layer: bool, **hyper) -> tuple[nn.Module, KFAC]:
    model = _Repeated(dtype)
    if late_layer:  # one layer of the stack is idle for two steps: its factors start late
        model.idle = (2, 3)
    opt = KFAC(model, lr=0.05, **hyper)
    if not stacked:
        opt._rule._ema_stacked = lambda *args: False
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        if step == 2:
            model.idle = ()
        x = torch.randn(8, 6, generator=g).to(dtype)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(
    "hyper",
    [dict(T=1), dict(T=2, T_inv=3, stat_decay=0.7), dict(T=1, inverse="eigen")],
    ids=["T1", "T2-Tinv3", "eigen"],
)
@pytest.mark.parametrize("late_layer", [False, True], ids=["together", "late-layer"])
def test_factor_ema_on_stacks_equals_one_tensor_at_a_time(dtype, hyper, late_layer):
    """Layers of equal shapes update their factor EMA on the stack of their factors (the
    factors are its aligned rows, kept between steps): bitwise what the EMA one tensor at
    a time gives, a layer that starts late (another decay) included."""
    model, opt = _train_kfac(dtype, True, late_layer, **hyper)
    reference, _ = _train_kfac(dtype, False, late_layer, **hyper)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    factors = [opt.state[model.body[i].weight]["A"] for i in (0, 2, 4)]
    assert len({f.untyped_storage().data_ptr() for f in factors}) == 1
    assert all(f.data_ptr() % 64 == 0 for f in factors)


def test_stacked_directions_go_into_a_buffer_kept_between_inversions():
    """Layers of equal shapes are preconditioned by batched products into a buffer kept
    with their stacked inverses: each step it holds G_inv ∇W A_inv of that step's
    gradients (the directions the write took are its views), with the inverses of the
    last inversion; the same buffers across inversions, new ones after a load."""
    from singd_cuda.optim.grouped import stacked_gradients

    model = _Repeated(torch.float64)
    opt = KFAC(model, lr=0.05, T=1, T_inv=3)
    body = [next(la for la in opt._layers if la.weight is model.body[i].weight) for i in (0, 2, 4)]
    g = torch.Generator().manual_seed(1)
    pointers = []
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(8, 6, generator=g, dtype=torch.float64)).square().mean().backward()
        opt.step()
        (G_inv, A_inv, naturals, views), *_ = opt._rule._stacked.values()
        states = [opt.state[layer.weight] for layer in body]
        assert torch.equal(G_inv, torch.stack([s["G_inv"] for s in states]))
        assert torch.equal(A_inv, torch.stack([s["A_inv"] for s in states]))
        expected = torch.bmm(torch.bmm(G_inv, stacked_gradients(body, torch.float64)), A_inv)
        assert torch.equal(naturals, expected)
        assert all(view._base is naturals for view in views) and len(views) == 6
        pointers.append(naturals.data_ptr())
        if len(pointers) == 3:
            opt.load_state_dict(opt.state_dict())  # new tensors: new buffers
    assert pointers[0] == pointers[1] == pointers[2] != pointers[3] == pointers[4]


@pytest.mark.parametrize("T_inv", [None, 3])
def test_weights_cast_between_steps_get_stacks_in_their_dtype(T_inv):
    """A model cast to float64 between steps (at an inversion, or between inversions):
    the stacked inverses and the preconditioning buffer are made again in the new dtype,
    not reused."""
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(3) for m in (nn.Linear(6, 6), nn.Tanh())))
    opt = KFAC(model, lr=0.01, T=1, T_inv=T_inv)
    for dtype in (torch.float32, torch.float64, torch.float64, torch.float64):
        model.to(dtype)
        opt.zero_grad()
        model(torch.randn(8, 6, dtype=dtype)).square().mean().backward()
        opt.step()
        (G_inv, _, naturals, _), *_ = opt._rule._stacked.values()
        assert G_inv.dtype == naturals.dtype == dtype
        assert all(torch.isfinite(p).all() for p in model.parameters())
