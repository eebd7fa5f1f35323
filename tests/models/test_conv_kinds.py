"""``nn.Conv1d`` and ``nn.Conv3d`` are preconditioned exactly: a convolution is a Linear
layer on its input's patches, so a model with ungrouped Conv1d / Conv3d layers follows
the trajectory of its twin whose convolutions are replaced by a Linear on explicitly
sliced patches (the dense float64 reference's), for every optimizer, fused diagonal
paths included (float64). Grouped layers are pinned by the dense reference
(tests/optim/test_dense_reference.py) and the sums-of-squares test
(tests/optim/test_layer_rules.py); here they also accumulate micro-batches exactly and
train under bf16 autocast as in float32."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from singd_cuda import SINGD
from tests.optim.test_dense_reference import conv_patches

from .test_layer_kinds import OPTIMIZERS as KIND_OPTIMIZERS

OPTIMIZERS = {  # SINGD at a smaller lr than there: no trajectory here diverges
    **{
        name: (cls, {**kwargs, "lr": 0.01} if cls is SINGD else kwargs)
        for name, (cls, kwargs) in KIND_OPTIMIZERS.items()
    },
    "ikfac": (SINGD, dict(lr=0.01, lr_cov=0.05, T=1, structures="dense", kfac_like=True)),
}
PADDINGS = ["zeros", "reflect", "replicate", "circular", "same"]
SHAPES = {1: (3, 9), 3: (2, 4, 5, 3)}  # a sample's (channels, *spatial)


class Unfolded(nn.Module):
    """The function of an ungrouped ``conv`` as a Linear on its patches: the Linear sees
    the rows a of the conv's patches and the rows g of its output gradient."""

    def __init__(self, conv: nn.Module) -> None:
        super().__init__()
        self.geometry = SimpleNamespace(
            **{
                key: getattr(conv, key)
                for key in ("kernel_size", "stride", "dilation", "groups", "padding_mode")
            },
            _reversed_padding_repeated_twice=conv._reversed_padding_repeated_twice,
        )
        self.linear = nn.Linear(
            conv.weight[0].numel(), conv.out_channels, bias=conv.bias is not None
        ).to(conv.weight.dtype)
        with torch.no_grad():
            self.linear.weight.copy_(conv.weight.flatten(1))
            if conv.bias is not None:
                self.linear.bias.copy_(conv.bias)

    def forward(self, x):
        batch = x.shape[0]
        patches = conv_patches(x, self.geometry).reshape(batch, -1, self.linear.in_features)
        out_size = self.output_size(x.shape[2:])
        y = self.linear(patches)  # (B, positions, C_out): B samples, rows (sample, position)
        return y.reshape(batch, *out_size, -1).movedim(-1, 1)

    def output_size(self, size):
        g = self.geometry
        padded = [
            n
            + g._reversed_padding_repeated_twice[-2 * i - 1]
            + g._reversed_padding_repeated_twice[-2 * i - 2]
            for i, n in enumerate(size)
        ]
        geometry = zip(padded, g.kernel_size, g.stride, g.dilation, strict=True)
        return [(n - d * (k - 1) - 1) // s + 1 for n, k, s, d in geometry]


def conv_model(dims: int, padding: str, bias: bool, groups: int = 1) -> nn.Sequential:
    """A strided, dilated conv with ``padding`` (a mode, or 'same'), a pointwise conv
    (kernel size 1), pooling, a linear head; float64."""
    torch.manual_seed(0)
    conv = (nn.Conv1d, nn.Conv3d)[dims == 3]
    channels, *size = SHAPES[dims]
    if padding == "same":  # asymmetric for Conv1d's even kernel
        first = dict(kernel_size=(2, 3)[dims == 3], padding="same", dilation=1)
    else:
        first = dict(kernel_size=3, stride=2, padding=1, padding_mode=padding, dilation=1)
        if dims == 1:
            first.update(dilation=2, padding=2)
    layers = [
        conv(channels, 4, bias=bias, **first),
        nn.Tanh(),
        conv(4, 4, 1, bias=bias, groups=groups),
        nn.Tanh(),
        (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool3d)[dims == 3](2),
        nn.Flatten(),
    ]
    with torch.no_grad():
        out = nn.Sequential(*layers)(torch.zeros(1, channels, *size)).shape[1]
    return nn.Sequential(*layers, nn.Linear(out, 3, bias=bias)).double()


def unfolded_twin(model: nn.Sequential) -> nn.Sequential:
    convs = (nn.Conv1d, nn.Conv3d)
    layers = (Unfolded(m) if isinstance(m, convs) else copy.deepcopy(m) for m in model)
    return nn.Sequential(*layers).double()


def batches(dims: int, steps: int, batch: int = 6):
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(batch, *SHAPES[dims], dtype=torch.float64, generator=gen),
            torch.randn(batch, 3, dtype=torch.float64, generator=gen),
        )
        for _ in range(steps)
    ]


def twin_cases():
    """Every padding (bias alternating) with dense SINGD; every optimizer with and
    without bias: the patches do not depend on the optimizer, nor its paths on them."""
    for padding in PADDINGS:
        yield "singd-dense", padding, padding != "reflect"
    for name in OPTIMIZERS:
        if name != "singd-dense":
            yield name, "zeros", True
            yield name, "reflect", False


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize(("name", "padding", "bias"), twin_cases())
@pytest.mark.parametrize("dims", [1, 3], ids=["conv1d", "conv3d"])
def test_conv_follows_its_unfolded_linear_twin(dims, name, padding, bias):
    conv = conv_model(dims, padding, bias)
    twin = unfolded_twin(conv)
    cls, kwargs = OPTIMIZERS[name]
    opts = [cls(conv, **kwargs), cls(twin, **kwargs)]
    assert [type(layer.module) for layer in opts[0].layers] == [
        type(conv[0]),
        type(conv[0]),
        nn.Linear,
    ]
    initial = conv[0].weight.detach().clone()
    for x, y in batches(dims, 5):
        for model, opt in zip((conv, twin), opts, strict=True):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    for index in (0, 2):
        torch.testing.assert_close(
            conv[index].weight.flatten(1), twin[index].linear.weight, rtol=1e-10, atol=1e-12
        )
        if bias:
            torch.testing.assert_close(
                conv[index].bias, twin[index].linear.bias, rtol=1e-10, atol=1e-12
            )
    torch.testing.assert_close(conv[-1].weight, twin[-1].weight, rtol=1e-10, atol=1e-12)
    assert 1e-3 < (conv[0].weight - initial).abs().max() < 100, "unmoved, or diverged"


@pytest.mark.parametrize("name", ["singd-dense", "singd-diagonal", "adafisher", "kfac"])
@pytest.mark.parametrize("dims", [1, 3], ids=["conv1d", "conv3d"])
def test_uneven_micro_batches_equal_the_whole_batch(dims, name):
    """The capture contract: micro-batches of 2 and 4 samples, losses weighted by size,
    give the statistics and the step of the batch of 6 (grouped pointwise conv)."""
    model = conv_model(dims, "circular", bias=True, groups=2)
    split = copy.deepcopy(model)
    cls, kwargs = OPTIMIZERS[name]
    opt, opt_split = cls(model, **kwargs), cls(split, **kwargs)
    assert [layer.name for layer in opt.layers] == ["0", "2", "6"]  # both convs and the head
    for x, y in batches(dims, 4):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt_split.zero_grad()
        for xs, ys in zip(x.split((2, 4)), y.split((2, 4)), strict=True):
            (F.mse_loss(split(xs), ys) * len(xs) / len(x)).backward()
        opt_split.step()
    for p, q in zip(model.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name", ["kfac", "adafisher", "singd-diagonal"])
@pytest.mark.parametrize("dims", [1, 3], ids=["conv1d", "conv3d"])
def test_bf16_autocast_statistics_match_float32(dims, name):
    """Under bf16 autocast the grouped pointwise conv sees bfloat16 inputs and output
    gradients; after one step its factors are within bf16 rounding (2e-2 relative) of
    the float32 step's, dense (K-FAC's A and G) and diagonal paths alike."""
    x, y = batches(dims, 1, batch=32)[0]
    states = []
    for autocast in (False, True):
        model = conv_model(dims, "circular", bias=True, groups=2).float()
        cls, kwargs = OPTIMIZERS[name]
        opt = cls(model, **kwargs)
        seen = []
        model[2].register_forward_hook(lambda m, args, out, seen=seen: seen.append(args[0].dtype))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            F.mse_loss(model(x.float()).float(), y.float()).backward()
        opt.step()
        assert seen == [torch.bfloat16 if autocast else torch.float32]
        states.append(opt.state[model[2].weight])
    factors = {"kfac": ("A", "G"), "adafisher": ("h", "s"), "singd-diagonal": ("K", "C")}[name]
    for key in factors:
        expected, got = (s[key] if name != "singd-diagonal" else s[key]["diag"] for s in states)
        assert torch.isfinite(got).all()
        assert (got - expected).norm() <= 2e-2 * expected.norm(), key
