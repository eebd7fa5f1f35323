"""Pure-PyTorch reference of every fused op: the fallback path and the test oracle.

Each function mirrors, operation by operation, the element math of csrc/singd_math.h, in
float32 for float32/bfloat16/float16 tensors and float64 for float64 ones, and stores every
result rounded once into the tensor's own dtype. The signatures and semantics are those of
the public wrappers in ``singd_cuda.ops`` (documented there). ``found_inf`` is read on the
device: a set flag keeps every tensor bitwise unchanged without a host synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from einops import reduce
from torch import Tensor
from torch.nn.modules.utils import _pair

from .rounding import bf16_stochastic, random_bits, stream_key


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _skip_flag(found_inf: Tensor | None) -> Tensor | None:
    return None if found_inf is None else found_inf.reshape(()).ne(0)


def _store(dst: Tensor, value: Tensor, skip: Tensor | None) -> None:
    """dst <- value (rounded to dst's dtype), unless the skip flag is set."""
    dst.copy_(value if skip is None else torch.where(skip, dst, value))


def _store_param(
    p: Tensor, value: Tensor, skip: Tensor | None, stochastic: bool, seed: int, stream: int
) -> None:
    if stochastic and p.dtype == torch.bfloat16:
        bits = random_bits(stream_key(seed, stream), value.numel(), value.device)
        value = bf16_stochastic(value, bits)
    _store(p, value, skip)


def _direction(
    g: Tensor,
    p: Tensor,
    inv_scale: Tensor | None,
    weight_decay: float,
    decoupled: bool,
) -> Tensor:
    """u = g * inv_scale (+ weight_decay * p when coupled), in p's op-math dtype."""
    u = g.to(p.dtype)
    if inv_scale is not None:
        u = u * inv_scale.to(p.dtype).reshape(())
    if not decoupled and weight_decay != 0:
        u = u + weight_decay * p
    return u


def _decay(p: Tensor, lr: float, weight_decay: float, decoupled: bool) -> Tensor:
    return p * (1 - lr * weight_decay) if decoupled and weight_decay != 0 else p


def _sgd_update(
    p: Tensor,
    u: Tensor,
    buf: Tensor | None,
    lr: float,
    momentum: float,
    weight_decay: float,
    decoupled: bool,
    skip: Tensor | None,
) -> Tensor:
    """New p (op-math dtype) of SGD with momentum; writes buf when momentum != 0."""
    if momentum != 0:
        u = momentum * buf.to(p.dtype) + u
        _store(buf, u, skip)
    return _decay(p, lr, weight_decay, decoupled) - lr * u


def _adam_update(
    p: Tensor,
    u: Tensor,
    m: Tensor,
    denom: Tensor | None,
    lr: float,
    beta: float,
    step: int,
    weight_decay: float,
    decoupled: bool,
    skip: Tensor | None,
) -> Tensor:
    """New p (op-math dtype) of the Adam form without a square root; writes m."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    m_new = beta * m.to(p.dtype) + (1 - beta) * u
    _store(m, m_new, skip)
    step_size = lr / (1 - beta**step)
    if denom is None:
        return _decay(p, lr, weight_decay, decoupled) - step_size * m_new
    # AdaFisher: each element's step bounded by lr (as the fused op)
    return _decay(p, lr, weight_decay, decoupled) - (step_size * (m_new / denom)).clamp(-lr, lr)


def sgd_epilogue_(
    params: Sequence[Tensor],
    updates: Sequence[Tensor],
    momentum_bufs: Sequence[Tensor],
    *,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    decoupled: bool = False,
    inv_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> None:
    skip = _skip_flag(found_inf)
    for i, param in enumerate(params):
        p = param.to(_opmath(param.dtype))
        u = _direction(updates[i], p, inv_scale, weight_decay, decoupled)
        buf = momentum_bufs[i] if momentum != 0 else None
        new = _sgd_update(p, u, buf, lr, momentum, weight_decay, decoupled, skip)
        _store_param(param, new, skip, stochastic_rounding, seed, i)


def adam_epilogue_(
    params: Sequence[Tensor],
    updates: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    *,
    lr: float,
    beta: float,
    step: int,
    weight_decay: float = 0.0,
    decoupled: bool = False,
    inv_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> None:
    skip = _skip_flag(found_inf)
    for i, param in enumerate(params):
        p = param.to(_opmath(param.dtype))
        u = _direction(updates[i], p, inv_scale, weight_decay, decoupled)
        new = _adam_update(p, u, exp_avgs[i], None, lr, beta, step, weight_decay, decoupled, skip)
        _store_param(param, new, skip, stochastic_rounding, seed, i)


def diag_precond_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    bufs: Sequence[Tensor],
    row_scales: Sequence[Tensor],
    col_scales: Sequence[Tensor],
    *,
    mode: str,
    lr: float,
    momentum: float,
    damping: float = 0.0,
    weight_decay: float = 0.0,
    decoupled: bool = False,
    step: int = 1,
    inv_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> None:
    if mode not in ("singd", "adafisher"):
        raise ValueError(f"mode must be 'singd' or 'adafisher', got {mode!r}")
    skip = _skip_flag(found_inf)
    for i, param in enumerate(params):
        acc = _opmath(param.dtype)
        p = param.to(acc)
        scale = row_scales[i].to(acc).reshape(-1, 1) * col_scales[i].to(acc).reshape(1, -1)
        g = grads[i].to(acc).reshape(param.shape)  # (a bias's vector for its column)
        if mode == "singd":
            u = _direction(scale * g, p, inv_scale, weight_decay, decoupled)
            buf = bufs[i] if momentum != 0 else None
            new = _sgd_update(p, u, buf, lr, momentum, weight_decay, decoupled, skip)
        else:
            u = _direction(g, p, inv_scale, weight_decay, decoupled)
            new = _adam_update(
                p, u, bufs[i], scale + damping, lr, momentum, step, weight_decay, decoupled, skip
            )
        _store_param(param, new, skip, stochastic_rounding, seed, i)


def diag_factor_update_(
    k: Sequence[Tensor],
    m: Sequence[Tensor],
    h: Sequence[Tensor],
    a: Sequence[Tensor] = (),
    b: Sequence[Tensor] = (),
    *,
    alpha1: float,
    beta1: float,
    damping: float,
) -> None:
    for i, k_i in enumerate(k):
        acc = _opmath(k_i.dtype)
        kf = k_i.to(acc)
        # one value per factor: per row of a stacked (n, d) factor (n > 1 values given)
        rows = k_i.dim() == 2 and all(
            len(v) == 0 or v[i].numel() == k_i.shape[0] > 1 for v in (a, b)
        )
        shape = (k_i.shape[0], 1) if rows else ()
        a_i = a[i].to(acc).reshape(shape) if len(a) else 1.0
        lam_b = damping * b[i].to(acc).reshape(shape) if len(b) else damping
        m_hat = 0.5 * (a_i * h[i].to(acc) + lam_b * (kf * kf) - 1)
        m_new = alpha1 * m[i].to(acc) + m_hat
        m[i].copy_(m_new)
        k_i.copy_(kf * (1 - beta1 * m_new))


def min_max_normalise_rows_(out: Tensor, v: Tensor) -> None:
    rows = out if out.dim() == 2 else out.unsqueeze(0)
    out.copy_(v)
    low, span = torch.aminmax(rows, dim=1, keepdim=True)
    span.sub_(low)
    constant = torch.rsub(torch.sign(span), 1)  # 1 if span == 0, else 0
    span.add_(constant).clamp_min_(torch.finfo(out.dtype).tiny)
    rows.sub_(low).add_(constant).div_(span)


def col_sum_squares(x: Tensor, dim: int = -1, scale: Tensor | None = None) -> Tensor:
    xf = x.to(_opmath(x.dtype))
    dims = [d for d in range(x.dim()) if d != dim % x.dim()]
    out = xf.square().sum(dims) if dims else xf.square()
    return out if scale is None else out.mul_(scale)


def input_sum_squares(
    x: Tensor, weight: float = 1.0, bias: bool = False, scale: Tensor | None = None
) -> Tensor:
    rows = x.numel() // max(x.shape[-1], 1)
    inv_rows = 1.0 / max(rows, 1)
    h = col_sum_squares(x, -1).mul_(inv_rows).mul_(weight)
    if bias:
        h = torch.cat([h, h.new_full((1,), float(rows)).mul_(inv_rows).mul_(weight)])
    return h if scale is None else h.mul_(scale)


def conv2d_patch_sum_squares(
    x: Tensor,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
) -> Tensor:
    # a grouped layer's input side is the mean over its groups' channels
    per_group = reduce(x.to(_opmath(x.dtype)), "n (g c) h w -> n c h w", "mean", g=groups)
    patches = F.unfold(
        per_group,
        _pair(kernel_size),
        dilation=_pair(dilation),
        padding=_pair(padding),
        stride=_pair(stride),
    )
    return patches.square().sum((0, 2))
