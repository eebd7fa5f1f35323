"""The built-in AdamW fallback trains everything that is not a Linear/Conv2d
layer (embeddings, norms, free parameters) exactly as torch.optim.AdamW."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from singd_cuda import SINGD, AdaFisher

from .conftest import clone_model, loss_fn

VOCAB, WIDTH, CLASSES = 20, 8, 4
FALLBACK = dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
# float64; AdamW here computes sqrt(v / (1 - β₂ᵗ)) where torch divides sqrt(v) by
# sqrt(1 - β₂ᵗ): last-bit differences, visible in relative terms on entries near zero
TOL = dict(rtol=1e-10, atol=1e-10)


class TokenModel(nn.Module):
    """Embedding → LayerNorm → mean over tokens × a free scale → Linear head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.scale = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)).mean(1) * self.scale)


def batches(steps: int = 8):
    gen = torch.Generator().manual_seed(4)
    return [
        (
            torch.randint(0, VOCAB, (16, 5), generator=gen),
            torch.randint(0, CLASSES, (16,), generator=gen),
        )
        for _ in range(steps)
    ]


@pytest.mark.parametrize("cls", [SINGD, AdaFisher])
def test_fallback_equals_torch_adamw(cls):
    model = TokenModel().double()
    reference = clone_model(model)
    fallback = {f"fallback_{key}": value for key, value in FALLBACK.items()}
    opt = cls(model, lr=0.05, T=1, **fallback)
    assert [layer.module for layer in opt.layers] == [model.head]
    head_opt = cls(reference, reference.head.parameters(), lr=0.05, T=1)
    others = [p for name, p in reference.named_parameters() if not name.startswith("head")]
    adamw = torch.optim.AdamW(others, **FALLBACK)
    for ids, y in batches():
        opt.zero_grad()
        loss_fn(model(ids), y).backward()
        opt.step()
        head_opt.zero_grad()
        adamw.zero_grad()
        loss_fn(reference(ids), y).backward()
        head_opt.step()
        adamw.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert not torch.equal(p, TokenModel().double().get_parameter(name)), name  # it trained
        torch.testing.assert_close(p, q, **TOL, msg=name)


def test_fallback_lr_defaults_to_the_group_lr():
    """fallback_lr=None: the fallback uses the group's lr (and follows its scheduler)."""
    model = TokenModel().double()
    reference = clone_model(model)
    opt = SINGD(model, structures="dense", lr=0.01, T=1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    adamw = torch.optim.AdamW([reference.embed.weight], lr=0.01, weight_decay=0.0)
    adamw_scheduler = torch.optim.lr_scheduler.StepLR(adamw, step_size=1, gamma=0.5)
    for ids, y in batches(4):
        for o, m in ((opt, model), (adamw, reference)):
            o.zero_grad()
            loss_fn(m(ids), y).backward()
        # the reference's head/norm are not trained: give them the model's values
        opt.step()
        adamw.step()
        with torch.no_grad():
            for name, p in reference.named_parameters():
                if name != "embed.weight":
                    p.copy_(model.get_parameter(name))
        scheduler.step()
        adamw_scheduler.step()
    torch.testing.assert_close(model.embed.weight, reference.embed.weight, **TOL)


class Attention(nn.Module):
    """nn.MultiheadAttention never calls its out_proj Linear's forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attention = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        return self.head(self.attention(x, x, x, need_weights=False)[0].mean(1))


def test_attention_out_projection_trains_with_the_fallback():
    """out_proj gets no statistics, so it is not preconditioned (K = C = I would be
    plain SGD at SINGD's lr): it trains with AdamW like the rest of the attention."""
    model = Attention().double()
    reference = clone_model(model)
    opt = SINGD(model, structures="dense", lr=0.05, T=1, fallback_lr=0.01)
    assert [layer.module for layer in opt.layers] == [model.head]
    head_opt = SINGD(reference, reference.head.parameters(), structures="dense", lr=0.05, T=1)
    adamw = torch.optim.AdamW(reference.attention.parameters(), lr=0.01, weight_decay=0.0)
    gen = torch.Generator().manual_seed(6)
    for _ in range(5):
        x = torch.randn(8, 5, WIDTH, generator=gen, dtype=torch.float64)
        y = torch.randint(0, CLASSES, (8,), generator=gen)
        for o in (opt, head_opt, adamw):
            o.zero_grad()
        loss_fn(model(x), y).backward()
        loss_fn(reference(x), y).backward()
        for o in (opt, head_opt, adamw):
            o.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL)


def test_float16_parameters_keep_their_moments_in_float32():
    """(1 − β₂)·g² of a small float16 gradient underflows float16 (g = 1e-4: 1e-11), and
    with v̂ = 0 AdamW's step m̂/ε is 10⁴ times too large: the fallback keeps float16
    parameters' moments in float32, so their first step moves each entry by about lr,
    as in float32 (bfloat16 has float32's range and keeps the parameter's dtype)."""
    from singd_cuda.optim.fallback import adamw_update_

    lr = 1e-3
    steps = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        param = torch.ones(64, dtype=dtype)
        state: dict = {}
        grad = torch.full((64,), 1e-4)
        adamw_update_(
            [param], [grad], [state], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
        )
        steps[dtype] = (1.0 - param.float()).abs().max().item()
        moments = torch.float32 if dtype == torch.float16 else dtype
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == moments
    assert steps[torch.float32] == pytest.approx(lr, rel=1e-3)
    for dtype in (torch.float16, torch.bfloat16):  # lr within the parameter's rounding
        assert steps[dtype] == pytest.approx(lr, abs=torch.finfo(dtype).eps)
