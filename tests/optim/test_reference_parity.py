"""Parity with the published reference implementation, PyPI ``singd`` 0.0.5.

Same model (deep copies), data and hyperparameters, 20 steps in float32. The
reference's defaults that matter are kept: ``kfac_approx="expand"`` (ours:
patches / leading dims flattened into rows), ``init_grad_scale=1.0`` (no
GradScaler here), ``preconditioner_dtype=(None, None)`` (the weight dtype),
``loss_average="batch"``. Block-diagonal is not compared (the reference
applies K where Kᵀ is needed, docs/departures.md); instead the structures
that reduce to dense for large enough parameters must equal dense SINGD.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from singd_cuda import SINGD

from .conftest import NUM_CLASSES, loss_fn

Reference = pytest.importorskip("singd.optim.optimizer").SINGD

STEPS = 20
RTOL, ATOL = 1e-5, 1e-6  # float32 parameters; atol for entries near zero
# ours also takes warm_start=False (the reference starts at K = C = I)
HYPER = dict(lr=0.02, momentum=0.9, damping=1e-3, alpha1=0.5, weight_decay=1e-2, lr_cov=0.05)

# ours -> the reference's name
STRUCTURES = {
    "dense": "dense",
    "diagonal": "diagonal",
    "hierarchical:15,15": "hierarchical15_15",
    "tril_toeplitz": "triltoeplitz",
    "triu_toeplitz": "triutoeplitz",
}


def parity_mlp() -> nn.Module:
    """Wide enough (d > 30) that hierarchical 15,15 is really structured."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(40, 36), nn.Tanh(), nn.Linear(36, 34), nn.ReLU(), nn.Linear(34, NUM_CLASSES)
    )


def parity_cnn() -> nn.Module:
    """Strided conv, grouped conv (zeros padding: the reference supports no other), head."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.Conv2d(8, 16, 3, padding=1, groups=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, NUM_CLASSES),
    )


def parity_batches(kind: str, dtype=torch.float32):
    gen = torch.Generator().manual_seed(5)
    shape = (40,) if kind == "mlp" else (3, 8, 8)
    return [
        (
            torch.randn(32, *shape, generator=gen, dtype=dtype),
            torch.randint(0, NUM_CLASSES, (32,), generator=gen),
        )
        for _ in range(STEPS)
    ]


def train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()


@pytest.mark.filterwarnings("ignore:Calling naive implementation")  # the reference's own
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("structure", list(STRUCTURES))
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_parity_with_singd_0_0_5(kind, structure, T):
    model = parity_mlp() if kind == "mlp" else parity_cnn()
    ref_model = copy.deepcopy(model)
    batches = parity_batches(kind)
    name = STRUCTURES[structure]
    ref = Reference(ref_model, structures=(name, name), T=T, kfac_approx="expand", **HYPER)
    train(ref_model, ref, batches)
    opt = SINGD(model, structures=structure, T=T, warm_start=False, **HYPER)
    train(model, opt, batches)
    for (label, ours), theirs in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(
            ours, theirs, rtol=RTOL, atol=ATOL, msg=lambda m, n=label: f"{n}: {m}"
        )
    if T == 3 and structure in ("dense", "hierarchical:15,15"):
        # these sizes take the cached K Kᵀ / C Cᵀ at T = 3 (and two products at T = 1)
        cached = [v for values in opt.rule_for(opt.param_groups[0])._outer.values() for v in values]
        assert any(v is not None for v in cached)


def test_parity_ikfac_dense():
    model = parity_mlp()
    ref_model = copy.deepcopy(model)
    batches = parity_batches("mlp")
    hp = dict(HYPER, alpha1=0.0)  # the reference warns and zeroes alpha1 itself
    ref = Reference(ref_model, structures=("dense", "dense"), T=2, kfac_like=True, **hp)
    train(ref_model, ref, batches)
    opt = SINGD(model, structures="dense", T=2, kfac_like=True, warm_start=False, **hp)
    train(model, opt, batches)
    for ours, theirs in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)


@pytest.mark.filterwarnings("ignore:Calling naive implementation")
@pytest.mark.parametrize("kfac_like", [False, True], ids=["singd", "ikfac"])
@pytest.mark.parametrize("structure", ["dense", "hierarchical:15,15", "tril_toeplitz"])
def test_parity_normalize_lr_cov(structure, kfac_like):
    """normalize_lr_cov: β₁ / max(1, max|m|), and m̂ scaled by (1 − α₁) as the reference does."""
    model = parity_mlp()
    ref_model = copy.deepcopy(model)
    batches = parity_batches("mlp")
    hp = dict(HYPER, lr_cov=0.2, alpha1=0.0 if kfac_like else 0.5)
    name = STRUCTURES[structure]
    common = dict(T=1, normalize_lr_cov=True, kfac_like=kfac_like, **hp)
    train(ref_model, Reference(ref_model, structures=(name, name), **common), batches)
    train(model, SINGD(model, structures=structure, warm_start=False, **common), batches)
    for ours, theirs in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)


# ------------------------------------------------ structures that reduce to dense
@pytest.mark.parametrize("structure", ["block_diagonal:300", "hierarchical:300,4", "low_rank:300"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_large_parameters_equal_dense(kind, structure):
    """block >= d, k1 >= d and rank >= d are the dense family: same 20 steps as dense."""
    model = (parity_mlp() if kind == "mlp" else parity_cnn()).double()
    dense_model = copy.deepcopy(model)
    batches = parity_batches(kind, dtype=torch.float64)
    hp = dict(HYPER, lr=2e-3, damping=1e-2)  # warm-started factors (HYPER diverges)
    train(dense_model, SINGD(dense_model, structures="dense", T=1, **hp), batches)
    train(model, SINGD(model, structures=structure, T=1, **hp), batches)
    for ours, dense in zip(model.parameters(), dense_model.parameters(), strict=True):
        torch.testing.assert_close(ours, dense, rtol=1e-10, atol=1e-13)


# ------------------------------------------------ Toeplitz beyond the dense cut-off
@pytest.mark.filterwarnings("ignore:Calling naive implementation")
@pytest.mark.parametrize("structure", ["tril_toeplitz", "triu_toeplitz"])
def test_parity_toeplitz_fft_products(structure):
    """d = 201 and 150 > 128: FFT products (wrapped outputs computed directly), with the
    K Kᵀ / C Cᵀ operators cached at T = 3, against the reference's dense products."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(200, 150), nn.Tanh(), nn.Linear(150, NUM_CLASSES))
    ref_model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    batches = [
        (torch.randn(32, 200, generator=gen), torch.randint(0, NUM_CLASSES, (32,), generator=gen))
        for _ in range(STEPS)
    ]
    name = STRUCTURES[structure]
    train(ref_model, Reference(ref_model, structures=(name, name), T=3, **HYPER), batches)
    opt = SINGD(model, structures=structure, T=3, warm_start=False, **HYPER)
    train(model, opt, batches)
    for ours, theirs in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
    cached = opt.rule_for(opt.param_groups[0])._outer.values()
    assert any(type(v).__name__ == "_ToeplitzGram" for values in cached for v in values)


# ------------------------------------------------ K-FAC-reduce over sequences
def sequence_model() -> nn.Module:
    """Linear layers over (B, T, d) inputs, weights shared over the T positions."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(10, 12), nn.Tanh(), nn.Linear(12, 9, bias=False), nn.ReLU(), nn.Linear(9, 6)
    ).double()


def sequence_batches(steps: int = STEPS):
    gen = torch.Generator().manual_seed(5)
    return [
        (
            torch.randn(8, 7, 10, generator=gen, dtype=torch.float64),
            torch.randint(0, 6, (8, 7), generator=gen),
        )
        for _ in range(steps)
    ]


def sequence_loss(output, target, loss_average: str) -> torch.Tensor:
    """Cross-entropy summed over positions, a mean over the batch ("batch") or over
    batch x positions ("batch+sequence")."""
    total = nn.functional.cross_entropy(output.flatten(0, 1), target.flatten(), reduction="sum")
    return total / (target.shape[0] if loss_average == "batch" else target.numel())


def train_sequences(model, opt, batches, loss_average: str) -> None:
    for x, y in batches:
        opt.zero_grad()
        sequence_loss(model(x), y, loss_average).backward()
        opt.step()


@pytest.mark.filterwarnings("ignore:Calling naive implementation")
@pytest.mark.parametrize("loss_average", ["batch", "batch+sequence"])
@pytest.mark.parametrize(
    ("structure", "kfac_like"),
    [("dense", False), ("diagonal", False), ("dense", True)],
    ids=["dense", "diagonal", "ikfac"],
)
def test_parity_kfac_reduce(structure, kfac_like, loss_average):
    """kfac_approx="reduce" (a mean of the inputs and a sum of the output gradients over
    each sequence, one row per sample) equals the reference's in float64 (its other
    structures take no float64)."""
    model = sequence_model()
    ref_model = copy.deepcopy(model)
    batches = sequence_batches()
    hp = dict(HYPER, alpha1=0.0 if kfac_like else 0.5, kfac_like=kfac_like)
    hp.update(T=2, loss_average=loss_average, kfac_approx="reduce")
    name = STRUCTURES[structure]
    ref = Reference(ref_model, structures=(name, name), **hp)
    train_sequences(ref_model, ref, batches, loss_average)
    opt = SINGD(model, structures=structure, warm_start=False, **hp)
    train_sequences(model, opt, batches, loss_average)
    expanded = copy.deepcopy(sequence_model())
    hp["kfac_approx"] = "expand"
    opt = SINGD(expanded, structures=structure, warm_start=False, **hp)
    train_sequences(expanded, opt, batches, loss_average)
    for ours, theirs, other in zip(
        model.parameters(), ref_model.parameters(), expanded.parameters(), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
        assert not torch.allclose(ours, other, rtol=1e-6, atol=0)  # reduce is not expand


@pytest.mark.filterwarnings("ignore:Calling naive implementation")
@pytest.mark.parametrize("structure", ["dense", "diagonal"])
def test_parity_kfac_reduce_conv(structure):
    """Conv2d with kfac_approx="reduce": per image the mean of its patches (grouped
    channels averaged) and the sum of its output gradients over positions, in float64."""
    model = parity_cnn().double()
    ref_model = copy.deepcopy(model)
    batches = parity_batches("cnn", dtype=torch.float64)
    hp = dict(HYPER, T=2, kfac_approx="reduce")
    train(ref_model, Reference(ref_model, structures=(structure, structure), **hp), batches)
    train(model, SINGD(model, structures=structure, warm_start=False, **hp), batches)
    for ours, theirs in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
