"""Shared models, data and comparison helpers for the optimizer tests.

The models are small on purpose (the whole of tests/optim must run in a few
minutes on two CPU cores) but exercise every layer rule: Linear with and
without bias, Conv2d with stride, padding, dilation, groups and a non-zero
padding mode.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import singd_cuda.ops as ops
from singd_cuda import SINGD, AdaFisher

IN_FEATURES, NUM_CLASSES, IMAGE = 12, 5, (3, 8, 8)


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """The tensors here are tiny: intra-op threads only add overhead, and on a shared
    two-core machine oversubscription makes them 10x slower. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_mlp(bias: bool = True, dtype=torch.float32, seed: int = 0, inplace: bool = False):
    """12 → 16 → 16 → 5 with Tanh and ReLU (``inplace`` for the ReLU)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, 16, bias=bias),
        nn.Tanh(),
        nn.Linear(16, 16, bias=bias),
        nn.ReLU(inplace=inplace),
        nn.Linear(16, NUM_CLASSES, bias=bias),
    ).to(dtype)


def make_cnn(bias: bool = True, dtype=torch.float32, seed: int = 0, padding_mode: str = "circular"):
    """3x8x8 images: strided conv, grouped dilated conv with ``padding_mode``, linear head."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, stride=2, padding=1, bias=bias),  # 8x8 -> 4x4
        nn.Tanh(),
        nn.Conv2d(6, 8, 3, padding=2, dilation=2, groups=2, bias=bias, padding_mode=padding_mode),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, NUM_CLASSES, bias=bias),
    ).to(dtype)


MODELS = {"mlp": make_mlp, "cnn": make_cnn}

# Optimizer cases shared by the behaviour tests: (class, keyword arguments). The learning
# rates suit the warm-started factors (IKFAC's per-side damping preconditions hardest).
OPTIMIZERS = {
    "singd-dense": (SINGD, dict(structures="dense", lr=0.01, lr_cov=0.05, T=2, weight_decay=1e-2)),
    "singd-block_diagonal": (SINGD, dict(lr=0.01, lr_cov=0.05, T=2, structures="block_diagonal:5")),
    "singd-tril_toeplitz": (SINGD, dict(lr=0.01, lr_cov=0.05, T=1, structures="tril_toeplitz")),
    "singd-hierarchical": (SINGD, dict(lr=0.01, T=1, structures="hierarchical:4,4")),
    "ikfac": (SINGD, dict(structures="dense", lr=0.003, lr_cov=0.05, T=2, kfac_like=True)),
    "adafisher": (AdaFisher, dict(lr=0.01, T=1, weight_decay=1e-2)),
}


def make_optimizer(name: str, model: nn.Module, **extra) -> torch.optim.Optimizer:
    cls, kwargs = OPTIMIZERS[name]
    return cls(model, **{**kwargs, **extra})


def input_shape(kind: str) -> tuple[int, ...]:
    return (IN_FEATURES,) if kind == "mlp" else IMAGE


def random_batches(
    kind: str, steps: int, batch_size: int = 16, dtype=torch.float32, seed: int = 1
) -> list[tuple[Tensor, Tensor]]:
    """``steps`` batches of random inputs and random class labels."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch_size, *input_shape(kind), generator=gen, dtype=dtype),
            torch.randint(0, NUM_CLASSES, (batch_size,), generator=gen),
        )
        for _ in range(steps)
    ]


def teacher_dataset(kind: str, size: int = 512, seed: int = 2, label_noise: float = 0.1):
    """A learnable classification set: labels of a fixed random teacher, a few flipped.

    The flipped labels keep the loss floor away from zero, so a relative
    comparison of final losses is meaningful.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, *input_shape(kind), generator=gen)
    teacher = MODELS[kind](seed=seed + 100)
    with torch.no_grad():
        y = teacher(x).argmax(1)
    flip = torch.rand(size, generator=gen) < label_noise
    y[flip] = torch.randint(0, NUM_CLASSES, (int(flip.sum()),), generator=gen)
    return x, y


def cycle_batches(x: Tensor, y: Tensor, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Consecutive slices, wrapping around forever (deterministic)."""
    start = 0
    while True:
        idx = torch.arange(start, start + batch_size) % x.shape[0]
        yield x[idx], y[idx]
        start += batch_size


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output.float(), target)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches,
    steps: int | None = None,
    autocast_dtype: torch.dtype | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> list[float]:
    """zero_grad, forward (under autocast if asked), backward, step; returns the losses."""
    losses = []
    for t, (x, y) in enumerate(batches):
        if steps is not None and t >= steps:
            break
        opt.zero_grad()
        with torch.autocast(
            "cpu", dtype=autocast_dtype or torch.bfloat16, enabled=bool(autocast_dtype)
        ):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def flat_state(state_dict: dict) -> dict[str, object]:
    """Every leaf of an optimizer state_dict under a path name (tensors and numbers)."""
    out: dict[str, object] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, list | tuple) and prefix.endswith("params"):
            out[prefix] = list(value)
        else:
            out[prefix] = value

    walk("state", state_dict["state"])
    for index, group in enumerate(state_dict["param_groups"]):
        walk(f"group{index}", group)
    return out


def assert_bitwise_equal(a: Tensor, b: Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    assert torch.equal(a, b), f"{what}: max diff {(a.double() - b.double()).abs().max()}"


def assert_states_equal(first: dict, second: dict) -> None:
    """Two optimizer state_dicts hold the same leaves, tensors bitwise equal."""
    a, b = flat_state(first), flat_state(second)
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    for key in a:
        if isinstance(a[key], Tensor):
            assert_bitwise_equal(a[key], b[key], key)
        else:
            assert a[key] == b[key], (key, a[key], b[key])


def assert_models_equal(first: nn.Module, second: nn.Module) -> None:
    for (name, p), q in zip(first.named_parameters(), second.parameters(), strict=True):
        assert_bitwise_equal(p.detach(), q.detach(), name)


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[list[Tensor], dict]:
    """Copies of the parameters and of the full optimizer state."""
    params = [p.detach().clone() for p in model.parameters()]
    return params, copy.deepcopy(opt.state_dict())


def count_diagonal_steps(monkeypatch) -> list[int]:
    """The number of parameters of every diagonal step op call from here on, through
    ``ops.diag_precond_step_`` or the op a kept batch resolves once
    (``ops.diag_precond_step_for``)."""
    calls: list[int] = []

    def counting(step_op):
        def count(params, *args, **kwargs):
            calls.append(len(params))
            return step_op(params, *args, **kwargs)

        return count

    resolve = ops.diag_precond_step_for
    monkeypatch.setattr(ops, "diag_precond_step_", counting(ops.diag_precond_step_))
    monkeypatch.setattr(ops, "diag_precond_step_for", lambda device: counting(resolve(device)))
    return calls
