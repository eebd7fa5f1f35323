"""Which modules of a model are preconditioned layers."""

from __future__ import annotations

from torch import nn

from .layers import SUPPORTED_LAYERS, Layer, bypassed_modules, is_supported, own_parameter


def find_layers(model: nn.Module, group_of_param: dict[int, int], owner: str) -> list[Layer]:
    """One layer per trained weight of supported modules, in model order.

    ``group_of_param`` maps ``id`` of every trained parameter to its parameter group;
    ``owner`` names the optimizer in errors. Several modules sharing a weight make one
    layer; an output head tied to an ``nn.Embedding`` is one layer of the head's calls.
    Weights that other modules hold too, or that a module uses without its forward,
    train with the fallback instead (and so does a layer until its first statistics).
    Raises ValueError when no layer is found or a layer's weight and bias are in
    different groups.
    """
    skipped = bypassed_modules(model)
    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), []).append((name, module))
    layers, seen, zero_size = [], set(), []
    for name, module in model.named_modules():
        weight = own_parameter(module, "weight")
        if not is_supported(module) or id(weight) not in group_of_param:
            continue
        if weight.numel() == 0:  # no inputs or no outputs: nothing to precondition
            zero_size.append(f"'{name or type(module).__name__}' {tuple(weight.shape)}")
            continue
        if id(weight) in seen or id(module) in skipped or id(weight) in skipped:
            continue
        seen.add(id(weight))
        sharing = holders[id(weight)]
        if any(type(m) is not type(module) and not _tied_embedding(m) for _, m in sharing):
            continue  # tied to another kind of module: the fallback trains it
        modules = tuple(m for _, m in sharing if type(m) is type(module))
        biases = {id(b) if (b := own_parameter(m, "bias")) is not None else None for m in modules}
        bias = own_parameter(module, "bias")
        bias = bias if len(biases) == 1 and id(bias) in group_of_param else None
        if bias is not None and not bias.requires_grad:
            bias = None  # frozen now: outside the factor, the fallback if unfrozen
        layer = Layer(name or type(module).__name__, module, weight, bias, modules)
        if bias is not None and group_of_param[id(bias)] != group_of_param[id(weight)]:
            raise ValueError(
                f"the weight and bias of layer '{layer.name}' are in different parameter "
                "groups; a layer is preconditioned as one block, so put both in one group"
            )
        layers.append(layer)
    if not layers:
        supported = ", ".join(c.__name__ for c in SUPPORTED_LAYERS)
        empty = (
            f" (zero-size, with no inputs or no outputs: {', '.join(zero_size)})"
            if zero_size
            else ""
        )
        raise ValueError(
            f"the model has no supported layer ({supported}, Hugging Face Conv1D, or a "
            "class given to singd_cuda.register_layer_kind) "
            f"whose weight is trained by this optimizer and not empty{empty}; {owner} "
            "needs at least one (for a model without any, use torch.optim.AdamW)"
        )
    return layers


def _tied_embedding(module: nn.Module) -> bool:
    """An ``nn.Embedding`` whose weight a matmul layer may share (an input embedding tied
    to the output head): its dense row gradients add to the head's, and the head's calls
    give the statistics. Sparse gradients and ``max_norm`` (which rewrites the weight in
    the forward) keep the weight with the fallback."""
    return isinstance(module, nn.Embedding) and not module.sparse and module.max_norm is None
