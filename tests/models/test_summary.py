"""``opt.preconditioned()`` and ``opt.summary()`` say which layers get curvature, with
which structures and how much state, for every optimizer."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from singd_cuda import KFAC, SINGD, AdaFisher
from singd_cuda.optim.summary import format_bytes


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.Flatten(),
        nn.LayerNorm(64),
        nn.Linear(64, 10, bias=False),
    )


def train_one_step(net: nn.Module, opt) -> None:
    opt.zero_grad()
    net(torch.randn(2, 3, 4, 4)).square().mean().backward()
    opt.step()


def test_preconditioned_names_each_layer_with_its_structures():
    net = model()
    assert SINGD(net, structures=("diagonal", "block_diagonal:4")).preconditioned() == {
        "0": ("diagonal", "block_diagonal:4"),
        "3": ("diagonal", "block_diagonal:4"),
    }
    assert KFAC(net).preconditioned() == {"0": ("dense", "dense"), "3": ("dense", "dense")}
    adafisher = ("adafisher", "adafisher")
    assert AdaFisher(net).preconditioned() == {"0": adafisher, "3": adafisher}


def test_summary_rows_and_totals():
    net = model()
    opt = SINGD(net, structures="dense", factor_dtype=torch.bfloat16)
    # K: 27 + 1 inputs, C: 4 outputs; K, m_K, C, m_C in bfloat16 (2 bytes)
    conv_bytes = 2 * 2 * (28**2 + 4**2)
    linear_bytes = 2 * 2 * (64**2 + 10**2)
    before = opt.summary()
    train_one_step(net, opt)
    after = opt.summary()
    for text in (before, after):
        lines = text.splitlines()
        assert lines[0].split() == [
            "module",
            "kind",
            "weight",
            "K",
            "side",
            "C",
            "side",
            "factor",
            "state",
        ]
        conv_row = ["0", "Conv2d", *["4", "x", "3", "x", "3", "x", "3"], "dense", "dense"]
        assert lines[2].split() == [*conv_row, *format_bytes(conv_bytes).split()]
        assert lines[3].split()[:2] == ["3", "Linear"]
        assert format_bytes(linear_bytes) in lines[3]
        curvature = 4 * 27 + 4 + 640
        total = curvature + 2 * 64
        assert f"{curvature:,} of {total:,} trainable parameters" in lines[-1]
        assert f"factor state {format_bytes(conv_bytes + linear_bytes)}" in lines[-1]
    assert "optimizer state now 0 B" in before
    assert "optimizer state now 0 B" not in after


def test_summary_lists_supported_modules_left_to_the_fallback():
    net = nn.Sequential(nn.Linear(4, 4), nn.MultiheadAttention(4, 2, batch_first=True))
    with pytest.warns(UserWarning, match="in_proj_weight"):
        text = SINGD(net).summary()
    out_proj = next(line for line in text.splitlines() if line.startswith("1.out_proj"))
    assert "AdamW fallback: forward bypassed" in out_proj
    assert text.splitlines()[-1].startswith("1 preconditioned layers")


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(2048) == "2.0 KiB"
    assert format_bytes(3 * 2**20) == "3.0 MiB"


class FreeParameters(nn.Module):
    """Parameters outside any layer (a scale, a class token)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.token = nn.Parameter(torch.zeros(1, 1, 4))


def mixed_model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv1d(3, 4, 1),
        nn.ConvTranspose2d(4, 3, 3),
        nn.LayerNorm(4),
        nn.Embedding(5, 4),
        nn.MultiheadAttention(4, 2, batch_first=True),
        nn.BatchNorm1d(4),
        FreeParameters(),
        nn.LSTM(4, 4),
        nn.Conv3d(4, 4, 2, bias=False),
        nn.Conv3d(4, 4, 2),
        nn.Linear(4, 4),
    )
    net[5].requires_grad_(False)  # frozen BatchNorm
    net[9].weight.requires_grad_(False)  # a frozen weight stays a layer: its bias too
    return net


def test_summary_names_every_module_on_the_fallback_and_why():
    net = mixed_model()
    with pytest.warns(UserWarning, match="no layer kind"):
        opt = SINGD(net, params=[p for p in net.parameters() if p is not net[10].weight])
    rows = {line.split()[0]: line for line in opt.summary().splitlines()[2:-1]}
    assert [layer.name for layer in opt.layers] == ["0", "8", "9"]
    assert "Conv1d" in rows["0"] and "Conv3d" in rows["8"] and "AdamW" not in rows["8"]
    reasons = {
        "1": "unsupported kind",  # ConvTranspose2d
        "2": "norm",
        "3": "embedding",
        "4": "unsupported kind",  # in_proj_weight
        "4.out_proj": "forward bypassed (MultiheadAttention)",
        "5": "frozen",
        "6": "free parameters",
        "7": "unsupported kind",  # LSTM
        "10": "weight not in params",  # its bias alone is trained
    }
    for name, reason in reasons.items():
        assert rows[name].split("AdamW fallback: ")[1].split("  ")[0] == reason, rows[name]
    assert set(rows) == {*reasons, "0", "8", "9"}
    assert "scale 4 (+1)" in rows["6"] and "weight_ih_l0 16 x 4 (+3)" in rows["7"]


def test_construction_warns_once_naming_weight_matrices_without_a_layer_kind():
    for cls in (SINGD, KFAC, AdaFisher):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls(mixed_model())
        (warning,) = [w for w in caught if "no layer kind" in str(w.message)]
        assert warning.category is UserWarning and warning.filename == __file__
        message = str(warning.message)
        assert message.startswith(f"{cls.__name__}: 3 module(s) with a weight matrix")
        for named in (
            "'1' (ConvTranspose2d: weight 4 x 3 x 3 x 3)",
            "'4' (MultiheadAttention: in_proj_weight 12 x 4)",
            "'7' (LSTM: weight_ih_l0 16 x 4, weight_hh_l0 16 x 4)",
        ):
            assert named in message
        assert "register_layer_kind" in message


def test_no_construction_warning_when_every_weight_matrix_has_a_layer_kind():
    """Embeddings, norms, free parameters and frozen modules are on the fallback by design
    (summary() names them); Conv1d and Conv3d have layer kinds."""
    net = mixed_model()
    del net[7], net[4], net[1]  # LSTM, attention, transposed conv
    frozen = nn.Sequential(net, nn.ConvTranspose1d(4, 4, 3).requires_grad_(False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = SINGD(frozen)
    assert [type(layer.module) for layer in opt.layers] == [
        nn.Conv1d, nn.Conv3d, nn.Conv3d, nn.Linear
    ]  # fmt: skip
    assert "frozen" in opt.summary().splitlines()[-2]


def test_registering_a_kind_silences_the_warning():
    from singd_cuda.curvature import LayerKind, layers, register_layer_kind

    class Outer(nn.Module):  # y = W x, W stored like a Linear's
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 4))
            self.bias = None

        def forward(self, x):
            return x @ self.weight.T

    net = nn.Sequential(nn.Linear(4, 4), Outer())
    with pytest.warns(UserWarning, match=r"'1' \(Outer: weight 3 x 4\)"):
        SINGD(net)
    register_layer_kind(Outer, LayerKind())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(SINGD(net).layers) == 2
    finally:
        layers._KINDS.pop(Outer)
        layers._resolved.clear()


class SharedWeights(nn.Module):
    """Two Linear layers sharing a weight but not a bias, a Linear whose weight a Conv1d
    holds too (as a 1-wide kernel's), and a Linear without outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.second.weight = self.first.weight
        self.linear, self.conv = nn.Linear(4, 4), nn.Conv1d(4, 4, 1)
        self.conv.weight = self.linear.weight
        self.empty = nn.Linear(4, 0)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # torch's own
def test_summary_says_why_a_supported_module_is_left_to_the_fallback():
    net = SharedWeights()
    lines = SINGD(net).summary().splitlines()[2:-1]
    assert lines[0].split()[:3] == ["first", "Linear", "4"]  # one layer of first and second
    fallback = [line.split("AdamW fallback: ") for line in lines[1:]]
    assert [(row.split()[0], reason.split("  ")[0]) for row, reason in fallback] == [
        ("first", "bias not shared by the weight's modules"),  # the biases differ
        ("second", "bias not shared by the weight's modules"),
        ("linear", "weight shared with another kind of module"),
        ("conv", "weight shared with another kind of module"),  # (its bias)
        ("empty", "no inputs or outputs"),
    ]
