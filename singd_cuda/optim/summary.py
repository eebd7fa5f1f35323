"""What an optimizer preconditions: per-layer structures, state sizes and a printable table.

:func:`preconditioned` maps each preconditioned module's qualified name to its (K side,
C side) structures; :func:`summary` lays out one row per preconditioned layer (module,
kind, weight shape, structures, factor-state bytes), one row per module whose parameters
the AdamW fallback trains, with the reason (:func:`fallback_modules`: a norm, an
embedding, a module without a layer kind, a frozen one, an ``nn.MultiheadAttention``
output projection...), and a last line with the fraction of trainable parameters that
get curvature and the state bytes. :func:`warn_unpreconditioned` is the optimizers'
construction warning for weight matrices without a layer kind.

Factor-state bytes are the layer's curvature state (SINGD: K, m_K, C, m_C; K-FAC: A, G
and their inverses; AdaFisher: h, s), not the per-parameter momentum buffers; before the
first step they are what the first step will allocate.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ..curvature.layers import Layer, bypassed_modules, is_supported, own_parameter
from ..curvature.norm_layers import NORM_LAYERS

NORMS = (*NORM_LAYERS, nn.RMSNorm, nn.LocalResponseNorm)  # and classes named "...Norm..."

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


def fallback_modules(opt: Optimizer) -> list[tuple[str, str, str, str]]:
    """(name, class name, parameters, reason) of every module holding parameters that the
    AdamW fallback trains, in model order; ``parameters`` is the weight's shape, or the
    first parameter's name and shape. Reasons: "frozen" (all of them frozen now),
    "norm" (without ``norm_fisher``), "embedding", "unsupported kind" (a ``weight``-like
    parameter but no layer kind: register one), "free parameters" (no layer kind, no
    weight: class tokens, scales), and for a module of a supported kind the reason it is
    not preconditioned (:func:`_supported_reason`)."""
    rows = []
    for name, module, held in _fallback_holders(opt):
        if "weight" in held:
            shown = _shape(held["weight"].shape)
        else:
            shown = _named(*next(iter(held.items())))
            shown += f" (+{len(held) - 1})" if len(held) > 1 else ""
        rows.append((name, type(module).__name__, shown, _reason(opt, module, held)))
    return rows


def unpreconditioned_matrices(opt: Optimizer) -> list[str]:
    """'name' (Class: parameter shape) of each module with a trainable ``weight``-like
    parameter of 2 or more dims whose class has no layer kind (what the construction
    warning lists): embeddings and norms are left out, on the fallback by design."""
    found = []
    for name, module, held in _fallback_holders(opt):
        if _reason(opt, module, held) != "unsupported kind":
            continue
        matrices = [
            _named(key, p)
            for key, p in held.items()
            if p.requires_grad and p.dim() >= 2 and "weight" in key
        ]
        if matrices:
            found.append(f"'{name}' ({type(module).__name__}: {', '.join(matrices)})")
    return found


def _fallback_holders(opt: Optimizer):
    """(name, module, {parameter name: parameter}) of the modules that hold fallback
    parameters directly (a parameter held twice counts for its first holder)."""
    fallback = {id(p) for p in opt._fallback_params}
    seen: set[int] = set()
    for name, module in opt.model.named_modules():
        held = {
            key: p
            for key, p in module._parameters.items()
            if p is not None and id(p) in fallback and id(p) not in seen
        }
        if held:
            seen.update(id(p) for p in held.values())
            yield name or type(module).__name__, module, held


def warn_unpreconditioned(opt: Optimizer) -> None:
    """One UserWarning naming the modules of :func:`unpreconditioned_matrices`, if any."""
    found = unpreconditioned_matrices(opt)
    if found:
        warnings.warn(
            f"{type(opt).__name__}: {len(found)} module(s) with a weight matrix have no "
            f"layer kind and train with the AdamW fallback, without curvature: "
            f"{'; '.join(found)}. Register a LayerKind for their class "
            "(singd_cuda.register_layer_kind) to precondition them; opt.summary() lists "
            "every module on the fallback and why",
            UserWarning,
            stacklevel=4,
        )


def _reason(opt: Optimizer, module: nn.Module, held: dict[str, Tensor]) -> str:
    if not any(p.requires_grad for p in held.values()):
        return "frozen"
    if is_supported(module):
        return _supported_reason(opt, module)
    if isinstance(module, NORMS) or "Norm" in type(module).__name__:
        return "norm"
    if isinstance(module, nn.Embedding | nn.EmbeddingBag):
        return "embedding"
    return "unsupported kind" if any("weight" in key for key in held) else "free parameters"


def _supported_reason(opt: Optimizer, module: nn.Module) -> str:
    """Why a module of a supported kind is left to the fallback (see find_layers)."""
    weight = own_parameter(module, "weight")  # reading a parametrized one would run it
    if weight is None:
        return "weight parametrized"
    if id(weight) not in opt._param_group:
        return "weight not in params"
    if any(layer.weight is weight for layer in opt.layers):
        return "bias not shared by the weight's modules"  # a frozen bias reads "frozen"
    if id(module) in bypassed_modules(opt.model):
        return "forward bypassed (MultiheadAttention)"
    if weight.numel() == 0:
        return "no inputs or outputs"
    return "weight shared with another kind of module"


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
    for name, kind, shown, reason in fallback_modules(opt):
        rows.append((name, kind, shown, f"AdamW fallback: {reason}", "", "-"))
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


def _named(key: str, param: Tensor) -> str:
    return f"{key} {_shape(param.shape)}"


def _line(cells, widths) -> str:
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
