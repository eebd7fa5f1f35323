"""Optimizer-state memory: measured bytes, the analytic formula, and peak step memory.

Measured state = the bytes of every tensor in ``optimizer.state_dict()["state"]``.
The formula counts, from the module shapes alone, what each optimizer stores for a
model whose ``nn.Linear``/``nn.Conv2d`` layers are preconditioned (d_K = inputs per
output, +1 with a bias; d_C = outputs) and whose other parameters train with AdamW:

* structure storage S(d) (entries of one d x d factor): dense d²; diagonal d;
  block_diagonal:b  n·b² + r² (n = d // b full blocks, r = d − n·b);
  low_rank:k  k² + (d−k)k + (d−k); tril/triu_toeplitz d;
  hierarchical:k1,k2  k1² + k1(d−k1) + m + k2·m + k2² with m = d − k1 − k2
  (k = min(k, d), k2 = min(k2, d − k1));
* SINGD/IKFAC per layer: 2·(S_K(d_K) + S_C(d_C)) factor entries (K, m_K, C, m_C) in
  the factor dtype, plus a momentum buffer per weight and bias in the parameter dtype;
* K-FAC per layer: 2·(d_K² + d_C²) (A, A⁻¹, G, G⁻¹) in the factor dtype + momentum;
* AdaFisher per layer: d_K + d_C (the diagonals h, s) in the factor dtype + exp_avg;
* ``graft="adam"`` (SINGD, IKFAC, K-FAC, AdaFisher): one more buffer per weight and
  bias, the second moment, in the parameter dtype (float32 for float16 parameters), and
  its count (a Python int, no tensor); ``graft="rms"`` stores nothing;
* AdamW (and every fallback parameter): exp_avg + exp_avg_sq in the parameter dtype
  (the fallback's in float32 for float16 parameters) and a 4-byte float32 step.

Peak step memory (forward, backward and optimizer step of the first step): on CUDA
``torch.cuda.max_memory_allocated``; on the CPU an estimate, the sum of parameters,
gradients, optimizer state and the activations autograd saved for the backward
(``torch.autograd.graph.saved_tensors_hooks``), which leaves out short-lived
temporaries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import structures as structure_registry
from ..optim.fallback import moment_dtype
from .models import gpt_tiny, resnet18, vit_tiny
from .optimizers import OptimizerChoice

ADAMW_STEP_BYTES = 4
#: The optimizers :func:`formula_bytes` has a formula for.
FORMULA_OPTIMIZERS = ("adamw", "kfac", "adafisher", "singd", "ikfac")
#: The optimizers that take ``graft`` (the preconditioned layers').
GRAFTED_OPTIMIZERS = ("kfac", "adafisher", "singd", "ikfac")


def tensor_bytes(obj) -> int:
    """Bytes of every tensor inside nested dicts, lists and tuples."""
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of all tensors in ``optimizer.state_dict()["state"]`` (of each inner
    optimizer of a heavyball ``SplitOpt``, whose state dict lists them)."""
    state = optimizer.state_dict()
    if "state" not in state and "optimizers" in state:
        return sum(tensor_bytes(inner["state"]) for inner in state["optimizers"])
    return tensor_bytes(state["state"])


def structure_entries(spec: str, d: int) -> int:
    """S(d): entries one d x d factor of structure ``spec`` stores (module docstring)."""
    cls = structure_registry.get(spec)
    params = cls.bound_values() or ()
    if cls.name == "dense":
        return d * d
    if cls.name in ("diagonal", "tril_toeplitz", "triu_toeplitz"):
        return d
    if cls.name == "block_diagonal":
        b = min(params[0], d)
        n, r = d // b, d - (d // b) * b
        return n * b * b + r * r
    if cls.name == "low_rank":
        k = min(params[0], d)
        return k * k + (d - k) * k + (d - k)
    if cls.name == "hierarchical":
        k1 = min(params[0], d)
        k2 = min(params[1], d - k1)
        m = d - k1 - k2
        return k1 * k1 + k1 * (d - k1) + m + k2 * m + k2 * k2
    raise ValueError(f"no storage formula for structure '{spec}'")


def layer_dims(module: nn.Linear | nn.Conv2d) -> tuple[int, int]:
    """(d_K, d_C) of a preconditioned layer."""
    bias = module.bias is not None
    if isinstance(module, nn.Linear):
        return module.in_features + bias, module.out_features
    k = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
    return k + bias, module.out_channels


def formula_bytes(
    model: nn.Module, choice: OptimizerChoice, factor_dtype: torch.dtype, graft: str | None = None
) -> int | None:
    """The analytic optimizer-state bytes of ``choice`` on ``model`` (module docstring)
    with the preconditioned layers' ``graft``; None for the peers (SGD, SOAP,
    PSGD-Kron, Muon), whose state is only measured."""
    if choice.name not in FORMULA_OPTIMIZERS:
        return None
    factor = torch.empty((), dtype=factor_dtype).element_size()

    def adamw(p: Tensor, moments: torch.dtype) -> int:
        return ADAMW_STEP_BYTES + 2 * p.numel() * torch.empty((), dtype=moments).element_size()

    if choice.name == "adamw":
        return sum(adamw(p, p.dtype) for p in model.parameters())
    layers = [m for m in model.modules() if isinstance(m, nn.Linear | nn.Conv2d)]
    in_layers = {id(p) for m in layers for p in m.parameters(recurse=False)}
    total = sum(  # the fallback keeps float16 parameters' moments in float32
        adamw(p, moment_dtype(p)) for p in model.parameters() if id(p) not in in_layers
    )
    for module in layers:
        d_K, d_C = layer_dims(module)
        if choice.name == "kfac":
            entries = 2 * (d_K * d_K + d_C * d_C)
        elif choice.name == "adafisher":
            entries = d_K + d_C
        else:  # singd / ikfac
            structure = choice.structure or "dense"
            entries = 2 * (structure_entries(structure, d_K) + structure_entries(structure, d_C))
        params = list(module.parameters(recurse=False))
        total += entries * factor + tensor_bytes(params)
        if graft == "adam":
            total += sum(
                p.numel() * torch.empty((), dtype=moment_dtype(p)).element_size() for p in params
            )
    return total


def _images(gen: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.randn(2, 3, 32, 32, generator=gen), torch.randint(10, (2,), generator=gen)


def _tokens(gen: torch.Generator) -> tuple[Tensor, Tensor]:
    ids = torch.randint(256, (2, 129), generator=gen)
    return ids[:, :-1], ids[:, 1:]


#: Model name -> (constructor, a tiny batch (inputs, targets) from a generator).
MEMORY_MODELS: dict[str, tuple[Callable[[], nn.Module], Callable]] = {
    "resnet18": (resnet18, _images),
    "vit_tiny": (vit_tiny, _images),
    "gpt_tiny": (gpt_tiny, _tokens),
}


@dataclass(frozen=True)
class MemoryRow:
    """One (model, optimizer) measurement."""

    model: str
    label: str
    graft: str | None
    parameters: int
    measured_bytes: int
    formula_bytes: int | None
    peak_bytes: int
    peak_method: str


def _saved_activation_bytes(run: Callable[[], None]) -> int:
    """Bytes of the distinct tensors autograd saves for the backward while ``run`` runs."""
    seen: dict[tuple[int, int], int] = {}

    def pack(t: Tensor) -> Tensor:
        if t.device.type != "meta" and t.numel():
            key = (t.untyped_storage().data_ptr(), t.dtype.itemsize)
            seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def measure(
    model_name: str,
    choice: OptimizerChoice,
    factor_dtype: torch.dtype,
    device: torch.device,
    graft: str | None = None,
) -> MemoryRow:
    """One training step of ``choice`` on a fresh ``model_name`` with a batch of 2; the
    preconditioned layers with ``graft`` (:data:`GRAFTED_OPTIMIZERS`; the others as
    they are, the row's graft None)."""
    build, batch = MEMORY_MODELS[model_name]
    torch.manual_seed(0)
    model = build().to(device)
    x, y = (t.to(device) for t in batch(torch.Generator().manual_seed(0)))
    graft = graft if choice.name in GRAFTED_OPTIMIZERS else None
    hparams = {"lr": 1e-3} if graft is None else {"lr": 1e-3, "graft": graft}
    optimizer = choice.build(model, hparams, factor_dtype)
    holder: dict[str, Tensor] = {}

    def forward() -> None:
        holder["loss"] = F.cross_entropy(model(x).flatten(0, -2), y.flatten())

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        forward()
    else:
        saved = _saved_activation_bytes(forward)
    holder["loss"].backward()
    optimizer.step()
    measured = state_bytes(optimizer)
    params = list(model.parameters())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak, method = torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
    else:
        peak = 2 * tensor_bytes(params) + measured + saved
        method = "estimate: params + grads + state + saved activations"
    return MemoryRow(
        model=model_name,
        label=choice.label if graft is None else f"{choice.label} graft={graft}",
        graft=graft,
        parameters=sum(p.numel() for p in params),
        measured_bytes=measured,
        formula_bytes=formula_bytes(model, choice, factor_dtype, graft),
        peak_bytes=peak,
        peak_method=method,
    )
