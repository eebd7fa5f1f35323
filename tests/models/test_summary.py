"""``opt.preconditioned()`` and ``opt.summary()`` say which layers get curvature, with
which structures and how much state, for every optimizer."""

from __future__ import annotations

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
    text = SINGD(net).summary()
    out_proj = next(line for line in text.splitlines() if line.startswith("1.out_proj"))
    assert "AdamW fallback" in out_proj
    assert text.splitlines()[-1].startswith("1 preconditioned layers")


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(2048) == "2.0 KiB"
    assert format_bytes(3 * 2**20) == "3.0 MiB"
