"""The capture's hook on a layer output's gradient (``capture._hook_gradient``, which skips
``Tensor.register_hook``'s handle): the user's own hooks on the same output keep working
and stay separate from it, and a torch function mode takes the ordinary path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from singd_cuda import SINGD, AdaFisher


class _Passthrough(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.hooks = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.hooks += func is torch.Tensor.register_hook
        return func(*args, **(kwargs or {}))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def _train(make_opt, steps: int = 3, user_hooks: bool = False, mode=None) -> list[torch.Tensor]:
    model = _model()
    opt = make_opt(model)
    seen = []
    if user_hooks:
        # the user's own gradient hooks on the same outputs, registered after the capture's;
        # each is removed after its first call
        def forward_hook(module, args, output):
            handle = None

            def hook(grad):
                seen.append(grad.shape)
                handle.remove()

            handle = output.register_hook(hook)

        for layer in (model[0], model[2]):
            layer.register_forward_hook(forward_hook)
    x, y = torch.randn(8, 5, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 3
    for _ in range(steps):
        opt.zero_grad()
        if mode is None:
            F.cross_entropy(model(x), y).backward()
        else:
            with mode:
                F.cross_entropy(model(x), y).backward()
        opt.step()
    if user_hooks:
        assert seen == [(8, 3), (8, 6)] * steps
    return [p.detach().clone() for p in model.parameters()]


def _optimizers():
    return [
        lambda m: AdaFisher(m, lr=0.1),
        lambda m: SINGD(m, lr=0.1, structures="diagonal", T=1),
        lambda m: SINGD(m, lr=0.1, T=1),
    ]


def test_user_hooks_on_the_same_output_leave_the_capture_alone():
    for make_opt in _optimizers():
        plain = _train(make_opt)
        hooked = _train(make_opt, user_hooks=True)
        for a, b in zip(plain, hooked, strict=True):
            assert torch.equal(a, b)


def test_a_torch_function_mode_takes_register_hook():
    for make_opt in _optimizers():
        plain = _train(make_opt)
        mode = _Passthrough()
        moded = _train(make_opt, mode=mode)
        assert mode.hooks == 2 * 3  # two layers, three steps: the ordinary path
        for a, b in zip(plain, moded, strict=True):
            assert torch.equal(a, b)


def test_statistics_need_the_gradient_hook(monkeypatch):
    """Without the capture's gradient hook there are no statistics (the AdamW fallback
    trains every layer), so the tests above can fail."""
    import singd_cuda.curvature.capture as capture

    plain = _train(_optimizers()[0])
    monkeypatch.setattr(capture, "_hook_gradient", lambda output, hook: None)
    with pytest.warns(RuntimeWarning, match="no curvature statistics"):
        unhooked = _train(_optimizers()[0])
    assert not all(torch.equal(a, b) for a, b in zip(plain, unhooked, strict=True))
