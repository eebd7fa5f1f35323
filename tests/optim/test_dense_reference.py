"""Dense SINGD equals an independent float64 implementation of the paper's update.

The reference below uses plain tensors only (no singd_cuda code): it runs the
model functionally on its own copy of the parameters, builds a and g from the
layer inputs and output gradients (patches extracted by explicit slicing,
channel groups averaged, a column of ones for the bias, 1/√N and √L), and
applies the factor update and the preconditioned momentum step.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from singd_cuda import SINGD

from .conftest import MODELS, NUM_CLASSES, loss_fn, random_batches

STEPS = 20
RTOL, ATOL = 1e-10, 1e-13  # float64; atol only guards entries that cross zero
CONVS = nn.Conv1d | nn.Conv2d | nn.Conv3d


# ----------------------------------------------------------------- a, g and G
def conv_patches(x: Tensor, conv: nn.Module) -> Tensor:
    """(B·O1·…, C_in/groups·k1·…) patches of the padded, group-averaged input of a
    Conv1d, Conv2d or Conv3d: one window per output position, sliced out explicitly."""
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    x = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)  # 'same' included
    batch, channels, *size = x.shape
    x = x.reshape(batch, conv.groups, channels // conv.groups, *size).mean(1)
    geometry = list(zip(size, conv.kernel_size, conv.stride, conv.dilation, strict=True))
    out = [(n - d * (k - 1) - 1) // s + 1 for n, k, s, d in geometry]
    rows = []
    for position in itertools.product(*map(range, out)):
        window = x[
            (
                slice(None),
                slice(None),
                *(
                    slice(i * s, i * s + d * (k - 1) + 1, d)
                    for i, (_, k, s, d) in zip(position, geometry, strict=True)
                ),
            )
        ]
        rows.append(window.reshape(batch, -1))  # (c, k1, …) order, like weight.flatten(1)
    return torch.stack(rows, dim=1).reshape(batch * math.prod(out), -1)


def input_rows(module: nn.Module, x: Tensor, bias: bool) -> Tensor:
    """a: the layer input as N x d_K (patches for conv), ones for the bias, / √N."""
    a = conv_patches(x, module) if isinstance(module, CONVS) else x.reshape(-1, x.shape[-1])
    if bias:
        a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], dim=1)
    return a / math.sqrt(a.shape[0])


def grad_output_rows(module: nn.Module, grad: Tensor, num_loss_terms: int) -> Tensor:
    """g: the output gradient as N x d_C, times √L."""
    if isinstance(module, CONVS):
        grad = grad.movedim(1, -1)
    return grad.reshape(-1, grad.shape[-1]) * math.sqrt(num_loss_terms)


def functional_forward(model: nn.Sequential, weights: dict, x: Tensor):
    """Run ``model`` with the reference's own parameters; return output, layer inputs/outputs."""
    inputs, outputs = {}, {}
    for index, module in enumerate(model):
        if isinstance(module, nn.Linear | CONVS):
            W, b = weights[index]
            inputs[index] = x
            if isinstance(module, nn.Linear):
                x = x @ W.T + (b if b is not None else 0.0)
            else:
                padding = module._reversed_padding_repeated_twice
                mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
                conv = (F.conv1d, F.conv2d, F.conv3d)[len(module.kernel_size) - 1]
                x = conv(
                    F.pad(x, padding, mode=mode),
                    W,
                    b,
                    stride=module.stride,
                    dilation=module.dilation,
                    groups=module.groups,
                )
            outputs[index] = x
        else:
            x = module(x)
    return x, inputs, outputs


# ------------------------------------------------------------- the SINGD update
def avg_trace(M: Tensor) -> Tensor:
    return M.diagonal().sum() / M.shape[0]


def factor_update(K, C, m_K, m_C, aTa, gTg, *, damping, alpha1, lr_cov, kfac_like):
    """One dense SINGD factor update (the paper's); returns K, C, m_K, m_C."""
    H_K, H_C = K.T @ aTa @ K, C.T @ gTg @ C
    KtK, CtC = K.T @ K, C.T @ C
    I_K, I_C = torch.eye(K.shape[0], dtype=K.dtype), torch.eye(C.shape[0], dtype=C.dtype)
    if kfac_like:
        alpha1 = 0.0
        mhat_K = 0.5 * (H_K + damping * KtK - I_K)
        mhat_C = 0.5 * (H_C + damping * CtC - I_C)
    else:
        mhat_K = 0.5 * (avg_trace(H_C) * H_K + damping * avg_trace(CtC) * KtK - I_K)
        mhat_C = 0.5 * (avg_trace(H_K) * H_C + damping * avg_trace(KtK) * CtC - I_C)
    m_K = alpha1 * m_K + mhat_K
    m_C = alpha1 * m_C + mhat_C
    return K @ (I_K - lr_cov * m_K), C @ (I_C - lr_cov * m_C), m_K, m_C


def reference_singd(model, batches, hp, loss=loss_fn, loss_terms=None):
    """Train a copy of ``model``'s parameters with dense SINGD; returns (weights, factors).

    ``loss(output, y)`` is the training loss; ``loss_terms(x)`` is L for a batch
    (default: the batch size).
    """
    weights, layers = {}, {}
    for index, module in enumerate(model):
        if isinstance(module, nn.Linear | CONVS):
            b = None if module.bias is None else module.bias.detach().clone()
            weights[index] = [module.weight.detach().clone(), b]
            d_C = module.weight.shape[0]
            d_K = module.weight[0].numel() + (b is not None)
            layers[index] = {
                "K": torch.eye(d_K, dtype=torch.float64),
                "C": torch.eye(d_C, dtype=torch.float64),
                "m_K": torch.zeros(d_K, d_K, dtype=torch.float64),
                "m_C": torch.zeros(d_C, d_C, dtype=torch.float64),
                "buf": torch.zeros(d_C, d_K, dtype=torch.float64),
            }
    for t, (x, y) in enumerate(batches):
        leaves = []
        for W, b in weights.values():
            leaves += [W.requires_grad_()] + ([b.requires_grad_()] if b is not None else [])
        out, inputs, outputs = functional_forward(model, weights, x)
        index_list = list(weights)
        grads = torch.autograd.grad(loss(out, y), leaves + [outputs[i] for i in index_list])
        param_grads, out_grads = (
            grads[: len(leaves)],
            dict(zip(index_list, grads[len(leaves) :], strict=True)),
        )
        L = x.shape[0] if loss_terms is None else loss_terms(x)
        cursor = 0
        for index, (W, b) in weights.items():
            module, s = model[index], layers[index]
            G = param_grads[cursor].reshape(W.shape[0], -1)
            cursor += 1
            if b is not None:
                G = torch.cat([G, param_grads[cursor].reshape(-1, 1)], dim=1)
                cursor += 1
            if t % hp["T"] == 0:
                a = input_rows(module, inputs[index].detach(), b is not None)
                g = grad_output_rows(module, out_grads[index], L)
                s["K"], s["C"], s["m_K"], s["m_C"] = factor_update(
                    s["K"], s["C"], s["m_K"], s["m_C"], a.T @ a, g.T @ g,
                    damping=hp["damping"], alpha1=hp["alpha1"], lr_cov=hp["lr_cov"],
                    kfac_like=hp["kfac_like"],
                )  # fmt: skip
            K, C = s["K"], s["C"]
            Wb = W.detach().reshape(W.shape[0], -1)
            if b is not None:
                Wb = torch.cat([Wb, b.detach()[:, None]], dim=1)
            delta = (C @ C.T) @ G @ (K @ K.T) + hp["weight_decay"] * Wb
            s["buf"] = hp["momentum"] * s["buf"] + delta
            Wb = Wb - hp["lr"] * s["buf"]
            new_W = Wb[:, : W[0].numel()].reshape(W.shape)
            weights[index] = [new_W, None if b is None else Wb[:, -1].clone()]
    return weights, layers


# the float64 reference starts at K = C = I: ours without the warm start
HYPER = dict(
    lr=0.05,
    momentum=0.9,
    damping=1e-3,
    alpha1=0.5,
    weight_decay=1e-2,
    lr_cov=0.05,
    warm_start=False,
)


def run_ours(model, batches, hp, **extra):
    opt = SINGD(model, structures="dense", **hp, **extra)
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return opt


def assert_matches_reference(model, opt, weights, layers):
    for index, (W, b) in weights.items():
        module = model[index]
        torch.testing.assert_close(module.weight.detach(), W.detach(), rtol=RTOL, atol=ATOL)
        if b is not None:
            torch.testing.assert_close(module.bias.detach(), b.detach(), rtol=RTOL, atol=ATOL)
        state = opt.state[module.weight]
        for side in ("K", "C", "m_K", "m_C"):
            torch.testing.assert_close(
                state[side]["mat"], layers[index][side], rtol=RTOL, atol=ATOL, msg=side
            )


def make_cnn1d(bias: bool = True, dtype=torch.float32) -> nn.Sequential:
    """(3, 16) signals: strided conv, grouped dilated 'reflect' conv, pointwise conv, head."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv1d(3, 6, 3, stride=2, padding=1, bias=bias),  # 16 -> 8
        nn.Tanh(),
        nn.Conv1d(6, 6, 3, padding=2, dilation=2, groups=3, bias=bias, padding_mode="reflect"),
        nn.Tanh(),
        nn.Conv1d(6, 4, 1, bias=bias),
        nn.Flatten(),
        nn.Linear(4 * 8, NUM_CLASSES, bias=bias),
    ).to(dtype)


def make_cnn3d(bias: bool = True, dtype=torch.float32) -> nn.Sequential:
    """(2, 4, 5, 5) volumes: anisotropic strided conv, grouped dilated 'circular' conv."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(2, 4, (2, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1), bias=bias),  # 3x3x3
        nn.Tanh(),
        nn.Conv3d(4, 4, 3, padding=2, dilation=2, groups=2, bias=bias, padding_mode="circular"),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(4, NUM_CLASSES, bias=bias),
    ).to(dtype)


CONV_MODELS = {"cnn1d": (make_cnn1d, (3, 16)), "cnn3d": (make_cnn3d, (2, 4, 5, 5))}


def model_and_batches(kind: str, bias: bool, steps: int):
    """A float64 model of ``kind`` (conftest's, or a Conv1d / Conv3d one) and its batches."""
    if kind not in CONV_MODELS:
        return MODELS[kind](bias=bias, dtype=torch.float64), random_batches(
            kind, steps, dtype=torch.float64
        )
    make, shape = CONV_MODELS[kind]
    gen = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(16, *shape, generator=gen, dtype=torch.float64),
            torch.randint(0, NUM_CLASSES, (16,), generator=gen),
        )
        for _ in range(steps)
    ]
    return make(bias=bias, dtype=torch.float64), batches


@pytest.mark.parametrize("kfac_like", [False, True], ids=["singd", "ikfac"])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("kind", ["mlp", "cnn", "cnn1d", "cnn3d"])
def test_dense_singd_equals_float64_reference(kind, bias, T, kfac_like):
    # T = 3 preconditions these sizes with the cached K Kᵀ and C Cᵀ, T = 1 mostly with
    # two products per side (SingdRule._outer_products): both must match the reference
    model, batches = model_and_batches(kind, bias, STEPS)
    hp = dict(HYPER, T=T, kfac_like=kfac_like)
    weights, layers = reference_singd(model, batches, hp)
    opt = run_ours(model, batches, hp)
    assert_matches_reference(model, opt, weights, layers)
    # a K is not symmetric: a Kᵀ vs K mix-up would show at 10x the tolerance
    Ks = [opt.state[layer.weight]["K"]["mat"] for layer in opt.layers]
    assert max(((K - K.T).abs().max() / K.abs().max()).item() for K in Ks) > 10 * RTOL


@pytest.mark.parametrize("loss_average", ["batch", "batch+sequence", None])
def test_linear_with_leading_dims(loss_average):
    """Linear on (B, T, d): rows are B·T; L is B ('batch': a mean over sequences),
    B·T ('batch+sequence': a mean over tokens) or 1 (None: a sum)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    gen = torch.Generator().manual_seed(3)
    batches = [
        (
            torch.randn(4, 5, 6, generator=gen, dtype=torch.float64),
            torch.randn(4, 5, 3, generator=gen, dtype=torch.float64),
        )
        for _ in range(6)
    ]

    def seq_loss(out, target):
        err = (out - target).square().sum(-1)  # (B, T)
        if loss_average is None:
            return err.sum()
        return err.mean() if loss_average == "batch+sequence" else err.sum(1).mean()

    def loss_terms(x):
        return {"batch": x.shape[0], "batch+sequence": x.shape[0] * x.shape[1], None: 1}[
            loss_average
        ]

    hp = dict(HYPER, T=2, kfac_like=False)
    weights, layers = reference_singd(model, batches, hp, loss=seq_loss, loss_terms=loss_terms)
    opt = SINGD(model, structures="dense", loss_average=loss_average, **hp)
    for x, y in batches:
        opt.zero_grad()
        seq_loss(model(x), y).backward()
        opt.step()
    assert_matches_reference(model, opt, weights, layers)
