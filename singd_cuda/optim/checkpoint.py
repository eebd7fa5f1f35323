"""Does a checkpoint fit this optimizer? One clear ValueError naming the mismatch.

:func:`check_fits` runs before anything is loaded. It compares the checkpoint with the
optimizer: the optimizer kind (``state_dict()["optimizer"]``, when present), the number
of parameter groups and of parameters per group, the hyperparameter names each group
needs and their values (validated as at construction), the structures of each group,
and the state of every parameter: its keys, and the shapes of its tensors (factors
against the shapes this optimizer would create for the layer, buffers against the
parameter). A checkpoint from another model, structure or
optimizer is rejected here rather than failing later inside ``step()``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from .fallback import in_fallback
from .hyperparameters import factor_keys, validate

KIND_KEY = "optimizer"  # state_dict()[KIND_KEY]: the optimizer class name

# state of a parameter besides a layer's factors: key -> shaped like the parameter?
# ("warm_started": SINGD's warm-start flag, absent when off and in older checkpoints)
LAYER_BUFFERS = {
    "momentum_buffer": True,
    "exp_avg": True,
    "warm_started": False,
    "graft_sq": True,  # graft="adam": the second moment and its count
    "graft_step": False,
}
# hyperparameters added since the first checkpoints: key -> the value such a checkpoint
# behaves as (SINGD's warm start: an old run's factors have started already; batch_dim:
# automatic, as every run was before it existed; kfac_approx, graft: what was built then;
# maximize: every run minimised)
ADDED_HYPERPARAMETERS = {
    "warm_start": True,
    "batch_dim": None,
    "kfac_approx": "expand",
    "graft": None,
    "maximize": False,
}
# keys torch.optim.Optimizer adds to ``defaults`` itself (its __setstate__, on every
# load_state_dict): not hyperparameters a checkpoint must hold
TORCH_DEFAULTS = frozenset({"differentiable"})
NORM_STATE = {"momentum_buffer": True, "fisher_diag": True}
FALLBACK_STATE = {"step": False, "exp_avg": True, "exp_avg_sq": True}


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit this optimizer (a ValueError)."""


def check_fits(
    optimizer: Optimizer, state_dict: dict[str, Any], buffers_only: set[int] = frozenset()
) -> None:
    """Raise :class:`CheckpointMismatchError` (a ValueError) unless ``state_dict`` fits.

    ``buffers_only``: ids of parameters whose state may hold their buffers without the
    layer's factors (FSDP2 with ``distribute_factors``: another rank owns the layer).
    """
    name = type(optimizer).__name__
    fix = f"load a checkpoint saved by the same {name} configuration and model"
    kind = state_dict.get(KIND_KEY)
    if kind is not None and kind != name:
        raise CheckpointMismatchError(f"the checkpoint was saved by {kind}, this is {name}; {fix}")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointMismatchError(
            f"the checkpoint has {len(saved_groups)} parameter group(s), this {name} has "
            f"{len(optimizer.param_groups)}; {fix}"
        )
    for index, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups, strict=True)):
        _check_group(index, saved, group, optimizer, fix)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = {id(p): n for n, p in optimizer.model.named_parameters()}
    expected = _expected_states(optimizer)
    layer_params = {id(p) for layer in optimizer.layers for p in layer.params}
    for index, state in state_dict["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise CheckpointMismatchError(
                f"the checkpoint has state for parameter {index!r}, this {name} has "
                f"{len(params)} parameters; {fix}"
            )
        param = params[index]
        where = f"parameter {index} ('{names.get(id(param), '?')}', shape {tuple(param.shape)})"
        required, optional = expected[id(param)]
        if isinstance(state, dict) and in_fallback(state) and id(param) in layer_params:
            required, optional = {}, FALLBACK_STATE  # waiting for its first statistics
        elif id(param) in buffers_only and isinstance(state, dict) and set(state) <= set(optional):
            required = {}
        _check_state(where, state, param, required, optional, fix)


def _check_group(index: int, saved: dict, group: dict, optimizer, fix: str) -> None:
    where = f"param_groups[{index}]"
    if len(saved["params"]) != len(group["params"]):
        raise CheckpointMismatchError(
            f"{where} has {len(saved['params'])} parameters in the checkpoint and "
            f"{len(group['params'])} here; {fix}"
        )
    needed = set(optimizer.defaults) - TORCH_DEFAULTS - set(ADDED_HYPERPARAMETERS)
    missing = sorted(needed - set(saved))
    if missing:
        raise CheckpointMismatchError(
            f"{where} of the checkpoint lacks {missing}: it was saved by another optimizer "
            f"than {type(optimizer).__name__}; {fix}"
        )
    trial = {**with_added_hyperparameters(saved, group), "params": group["params"]}
    try:
        validate(trial, optimizer.hyperparameter_checks(trial))
    except ValueError as error:
        raise CheckpointMismatchError(f"{where} of the checkpoint: {error}") from None
    if "structures" in group and tuple(trial["structures"]) != tuple(group["structures"]):
        raise CheckpointMismatchError(
            f"{where} uses structures {tuple(trial['structures'])} in the checkpoint and "
            f"{tuple(group['structures'])} here; construct the optimizer with "
            f"structures={tuple(trial['structures'])} to load it"
        )


def by_index(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` keyed by parameter index, as :meth:`Optimizer.state_dict` keys it.

    ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` hands over its
    state keyed by parameter names (the groups' ``params`` list the names in order);
    torch.optim maps them by position, and so does this.
    """
    groups = state_dict["param_groups"]
    saved = [key for group in groups for key in group["params"]]
    if all(isinstance(key, int) for key in saved):
        return state_dict
    index = {key: i for i, key in enumerate(saved)}
    unknown = sorted(str(k) for k in state_dict["state"] if k not in index)
    if unknown:
        raise CheckpointMismatchError(
            f"the checkpoint has state for {unknown[:3]}, which its param_groups do not list"
        )
    offsets = [0]
    for group in groups:
        offsets.append(offsets[-1] + len(group["params"]))
    return {
        **state_dict,
        "state": {index[key]: value for key, value in state_dict["state"].items()},
        "param_groups": [
            {**group, "params": list(range(start, start + len(group["params"])))}
            for group, start in zip(groups, offsets, strict=False)
        ],
    }


def with_added_hyperparameters(saved: dict, group: dict) -> dict:
    """A checkpoint's group with the :data:`ADDED_HYPERPARAMETERS` it lacks and this
    optimizer's ``group`` has, at the values such a checkpoint behaves as."""
    added = {k: v for k, v in ADDED_HYPERPARAMETERS.items() if k in group and k not in saved}
    return {**saved, **added}


def _expected_states(optimizer: Optimizer) -> dict[int, tuple[dict, dict]]:
    """id(param) -> (required entries: the factors; optional entries: key -> shaped like
    the parameter?), by the parameter's role."""
    expected: dict[int, tuple[dict, dict]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            expected[id(param)] = ({}, FALLBACK_STATE)
    for layer in optimizer.layers:
        group = optimizer.group_of(layer)
        factors = factor_keys(optimizer, layer, group)
        required = {key: value for key, value in factors.items() if key not in LAYER_BUFFERS}
        expected[id(layer.weight)] = (required, LAYER_BUFFERS)
        if layer.bias is not None:
            expected[id(layer.bias)] = ({}, LAYER_BUFFERS)
    for layer in optimizer._norm_layers:
        for param in layer.params:
            expected[id(param)] = ({}, NORM_STATE)
    return expected


def _check_state(where, state, param: nn.Parameter, required, optional, fix: str) -> None:
    if not isinstance(state, dict):
        raise CheckpointMismatchError(f"the state of {where} is not a dict; {fix}")
    if not state:
        return
    unknown = sorted(set(state) - set(required) - set(optional))
    missing = sorted(set(required) - set(state))
    if unknown or missing:
        raise CheckpointMismatchError(
            f"the state of {where} has the keys {sorted(state)}, this optimizer expects "
            f"{sorted(required) or ''}{' and ' if required else ''}any of {sorted(optional)}"
            f" (unexpected: {unknown}, missing: {missing}); {fix}"
        )
    for key, value in state.items():
        if key in required:
            _check_like(f"{where}, state '{key}'", value, required[key], fix)
        elif optional[key] and isinstance(value, Tensor) and value.shape != param.shape:
            raise CheckpointMismatchError(
                f"{where}: state '{key}' has shape {tuple(value.shape)} in the checkpoint, "
                f"the parameter {tuple(param.shape)}; {fix}"
            )


def _check_like(where: str, value: Any, expected: Any, fix: str) -> None:
    """``value`` has the layout of ``expected`` (a meta tensor, a dict of them, a number)."""
    if isinstance(expected, dict):
        if not isinstance(value, dict) or set(value) != set(expected):
            found = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise CheckpointMismatchError(
                f"{where} holds {found} in the checkpoint, this optimizer's structure "
                f"stores {sorted(expected)}; {fix}"
            )
        for key in expected:
            _check_like(f"{where}['{key}']", value[key], expected[key], fix)
    elif isinstance(expected, Tensor):
        if not isinstance(value, Tensor) or value.shape != expected.shape:
            found = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise CheckpointMismatchError(
                f"{where} has shape {found} in the checkpoint, {tuple(expected.shape)} here; {fix}"
            )
    elif isinstance(value, Tensor | dict):
        raise CheckpointMismatchError(
            f"{where} is a {type(value).__name__}, expected a number; {fix}"
        )


# ------------------------------------------------------------------------- loading
def prepared(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` as ``torch.optim.Optimizer.load_state_dict`` takes it (by index,
    with hyperparameters added since it was saved, without the optimizer kind), after
    checking that it fits; raises :class:`CheckpointMismatchError` before anything is
    loaded. ``optimizer``: a KroneckerOptimizer.

    Under torch.distributed the verdict is every rank's (one all-reduce of a flag): a
    rank checks only the part it holds (its shards under FSDP2, its layers' factors
    under ``distribute_factors``, its own copy otherwise), and when any rank refuses,
    every rank raises (the others name the number of ranks that refused)."""
    sync = optimizer._sync
    try:
        ready = _checked(optimizer, state_dict)
    except Exception:
        if sync is not None:
            sync.refusals(True)
        raise
    refused = 0 if sync is None else sync.refusals(False)
    if refused:
        raise CheckpointMismatchError(
            f"{refused} other rank(s) of the process group refused this checkpoint (their "
            "error says why): every rank refuses it, so that the ranks stay in step"
        )
    return ready


def _checked(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """:func:`prepared` on this rank's part alone."""
    _check_layout(state_dict)
    state_dict = by_index(state_dict)  # DCP's set_optimizer_state_dict: names
    foreign = set()
    if optimizer._shards() is not None:
        # FSDP2: a rank holds the rows of layers it does not own
        foreign = {id(p) for p in optimizer._sync.foreign_params()}
    check_fits(optimizer, state_dict, buffers_only=foreign)
    _check_norm_fisher_kept(optimizer, state_dict)
    _check_values(optimizer, state_dict)
    groups = [
        with_added_hyperparameters(saved, group)
        for saved, group in zip(state_dict["param_groups"], optimizer.param_groups, strict=True)
    ]
    return {
        **{k: v for k, v in state_dict.items() if k != KIND_KEY},
        "param_groups": groups,
    }


def _check_layout(state_dict: Any) -> None:
    """A dict with ``state`` (a dict) and ``param_groups`` (a list of dicts with
    ``params``), as torch.optim's ``state_dict()`` returns."""
    if not isinstance(state_dict, dict):
        raise CheckpointMismatchError(
            f"the checkpoint is a {type(state_dict).__name__}, not an optimizer state_dict"
        )
    groups = state_dict.get("param_groups")
    missing = [key for key in ("state", "param_groups") if key not in state_dict]
    if missing or not isinstance(state_dict["state"], dict) or not isinstance(groups, list):
        raise CheckpointMismatchError(
            f"the checkpoint is not an optimizer state_dict: it needs 'state' (a dict) and "
            f"'param_groups' (a list), it has {sorted(map(str, state_dict))}"
        )
    for index, group in enumerate(groups):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise CheckpointMismatchError(
                f"param_groups[{index}] of the checkpoint is not a dict with a 'params' list"
            )


def _check_values(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Every group's ``step`` is an integer >= 0, and every tensor of the state is real
    floating point and finite (a factor or buffer holding inf or NaN would carry it into
    every later step). One device read per device of the state."""
    for index, group in enumerate(state_dict["param_groups"]):
        step = group.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CheckpointMismatchError(
                f"param_groups[{index}] of the checkpoint has step {step!r}, expected an "
                "integer >= 0"
            )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    names = {id(p): n for n, p in optimizer.model.named_parameters()}
    by_device: dict[Any, list[tuple[str, Tensor]]] = {}
    for index, state in state_dict["state"].items():
        where = f"parameter {index} ('{names.get(id(params[index]), '?')}')"
        for key, tensor in _tensors(state):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # DTensor
            if not local.is_floating_point():
                raise CheckpointMismatchError(
                    f"the state of {where} holds '{key}' of dtype {local.dtype}; the state "
                    "holds real floating-point tensors only"
                )
            by_device.setdefault(local.device, []).append((f"'{key}' of {where}", local))
    for entries in by_device.values():
        finite = torch.stack([t.isfinite().all() for _, t in entries])
        if bool(finite.all()):
            continue
        bad = [where for (where, _), ok in zip(entries, finite.tolist(), strict=True) if not ok]
        raise CheckpointMismatchError(
            f"the checkpoint holds non-finite values (inf or NaN) in {', '.join(bad[:3])}"
            f"{' and more' if len(bad) > 3 else ''}: it was saved from a run that had "
            "diverged; load an earlier checkpoint"
        )


def _tensors(value: Any, key: str = "") -> list[tuple[str, Tensor]]:
    """(key path, tensor) of every tensor in a (nested) state dict."""
    if isinstance(value, Tensor):
        return [(key, value)]
    if isinstance(value, dict):
        return [
            pair for k, v in value.items() for pair in _tensors(v, f"{key}.{k}" if key else str(k))
        ]
    return []


def keep_saved_dtypes(optimizer: Optimizer, saved_state: dict[int, dict]) -> None:
    """After torch.optim's load (which casts floating state to each parameter's dtype),
    give every floating state tensor the dtype it was saved in (low-precision factors
    of a float32 model stay low-precision), on its parameter's device."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for index, param_state in saved_state.items():
        param = params[index]
        optimizer.state[param] = _keep_dtypes(param_state, optimizer.state[param], param.device)


def _keep_dtypes(saved_value: Any, loaded: Any, device) -> Any:
    if isinstance(saved_value, Tensor):
        return (
            saved_value.to(device=device, copy=True) if saved_value.is_floating_point() else loaded
        )
    if isinstance(saved_value, dict):
        return {k: _keep_dtypes(v, loaded[k], device) for k, v in saved_value.items()}
    return loaded


def _check_norm_fisher_kept(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """A checkpoint past its first step holds the norm Fisher of every norm layer
    that has state; DCP's sharded load fills only the entries a fresh optimizer's
    state_dict has, which lack it."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    states = state_dict["state"]
    for layer in optimizer._norm_layers:
        state = states.get(index[id(layer.weight)])
        if state and "fisher_diag" not in state and "momentum_buffer" in state:
            raise CheckpointMismatchError(
                f"the state of norm layer '{layer.name}' lacks its norm Fisher "
                "('fisher_diag'): torch.distributed.checkpoint's sharded load fills only "
                "the entries of a fresh optimizer; load norm_fisher=True optimizers from "
                "a full state (get_optimizer_state_dict(..., full_state_dict=True) or "
                "opt.full_state_dict())"
            )
