"""What an optimizer preconditions: per-layer structures, state sizes and a printable table.

:func:`preconditioned` maps each preconditioned module's qualified name to its (K side,
C side) structures; :func:`summary` lays out one row per preconditioned layer (module,
kind, weight shape, structures, factor-state bytes), one row per module of a supported
kind whose weight the AdamW fallback trains instead (e.g. an ``nn.MultiheadAttention``
output projection), and a last line with the fraction of trainable parameters that get curvature
and the state bytes.

Factor-state bytes are the layer's curvature state (SINGD: K, m_K, C, m_C; K-FAC: A, G
and their inverses; AdaFisher: h, s), not the per-parameter momentum buffers; before the
first step they are what the first step will allocate.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..curvature.layers import Layer, is_supported

# per-parameter buffers in a weight's state: not curvature
_PARAMETER_BUFFERS = ("momentum_buffer", "exp_avg")


def preconditioned(opt: Optimizer) -> dict[str, tuple[str, str]]:
    """{qualified module name: (K side structure, C side structure)}, in model order."""
    return {layer.name: structures(opt, layer) for layer in opt.layers}


def structures(opt: Optimizer, layer: Layer) -> tuple[str, str]:
    group = opt.group_of(layer)
    return tuple(opt.rule_for(group).factor_structures(group))


def factor_state_bytes(opt: Optimizer, layer: Layer) -> int:
    """Bytes of the layer's curvature state (as the first step creates it, if not yet)."""
    state = opt.state.get(layer.weight)
    if not state:
        state = {}
        meta = Layer(
            layer.name,
            layer.module,
            torch.empty_like(layer.weight, device="meta"),
            None if layer.bias is None else torch.empty_like(layer.bias, device="meta"),
        )
        group = opt.group_of(layer)
        opt.rule_for(group).init_state(meta, group, state)
    return sum(tensor_bytes(value) for key, value in state.items() if key not in _PARAMETER_BUFFERS)


def tensor_bytes(value) -> int:
    """Bytes of the tensors in a state value (a tensor, or dicts/lists of them)."""
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


def fallback_modules(opt: Optimizer) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, class name, weight shape) of the modules of a supported kind whose trained
    weight gets the AdamW fallback instead of curvature (e.g. a weight a module of another
    kind holds too, or an ``nn.MultiheadAttention.out_proj``)."""
    fallback = {id(p) for p in opt._fallback_params}
    seen: set[int] = set()
    rows = []
    for name, module in opt.model.named_modules():
        weight = getattr(module, "weight", None)
        if not is_supported(module) or weight is None or id(weight) not in fallback:
            continue
        if id(module) in seen:
            continue
        seen.add(id(module))
        rows.append((name or type(module).__name__, type(module).__name__, tuple(weight.shape)))
    return rows


def summary(opt: Optimizer) -> str:
    """A printable table of what ``opt`` preconditions (see the module docstring)."""
    header = ("module", "kind", "weight", "K side", "C side", "factor state")
    rows = []
    factor_total = 0
    for layer in opt.layers:
        k_side, c_side = structures(opt, layer)
        nbytes = factor_state_bytes(opt, layer)
        factor_total += nbytes
        rows.append(
            (
                layer.name,
                type(layer.module).__name__,
                _shape(layer.weight.shape),
                k_side,
                c_side,
                format_bytes(nbytes),
            )
        )
    for name, kind, shape in fallback_modules(opt):
        rows.append((name, kind, _shape(shape), "AdamW fallback", "", "-"))
    trainable = {id(p): p.numel() for g in opt.param_groups for p in g["params"]}
    curvature = sum(trainable.get(id(p), 0) for layer in opt.layers for p in layer.params)
    total = sum(trainable.values())
    all_state = sum(tensor_bytes(s) for s in opt.state.values())
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = [_line(header, widths), _line(tuple("-" * w for w in widths), widths)]
    lines += [_line(row, widths) for row in rows]
    lines.append(
        f"{len(opt.layers)} preconditioned layers: {curvature:,} of {total:,} trainable "
        f"parameters ({curvature / max(total, 1):.1%}) get curvature; factor state "
        f"{format_bytes(factor_total)}, optimizer state now {format_bytes(all_state)}"
    )
    return "\n".join(lines)


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _shape(shape) -> str:
    return " x ".join(str(s) for s in shape)


def _line(cells, widths) -> str:
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
