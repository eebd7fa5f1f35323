"""torch.compile of a preconditioned model (README, "torch.compile").

The capture hooks put opaque ops into the graph (``singd_cuda.curvature.capture_ops``),
so a hooked model compiles into as many graphs as the plain model, with no break, on
steps that take statistics and on steps that do not; and training compiled equals
training eager. The ``aot_eager`` backend runs the traced graphs with eager kernels, so
its trajectories are bit for bit those of eager; Inductor's generated kernels round
differently (slow tests, to a tolerance).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from singd_cuda import KFAC, SINGD, AdaFisher

OPTIMIZERS = {
    "singd-diagonal": lambda m: SINGD(m, lr=0.05, lr_cov=0.1, T=2, structures="diagonal"),
    "singd-dense": lambda m: SINGD(
        m, lr=0.05, lr_cov=0.1, T=1, structures=("dense", "diagonal"), weight_decay=1e-2
    ),
    "adafisher": lambda m: AdaFisher(m, lr=0.01, T=1),
    "kfac": lambda m: KFAC(m, lr=0.05, T=2, stat_decay=0.9, damping=1e-2),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


class Block(nn.Module):
    """A pre-norm transformer block: attention (one qkv Linear) and an MLP."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, 3)

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(batch, tokens, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)
        x = x + self.proj(attended)
        x = x + self.mlp(self.norm2(x))
        return self.head(x.mean(1))


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 3),
    )


def cnn1d() -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(3, 4, 3, padding=1, padding_mode="circular"),
        nn.ReLU(),
        nn.Conv1d(4, 4, 1, groups=2),  # pointwise
        nn.Flatten(),
        nn.Linear(4 * 8, 3),
    )


def cnn3d() -> nn.Module:
    return nn.Sequential(
        nn.Conv3d(2, 4, 2, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 2 * 2 * 2, 3)
    )


MODELS = {
    "mlp": (mlp, (10, 6)),
    "cnn": (cnn, (10, 3, 8, 8)),
    "cnn1d": (cnn1d, (10, 3, 8)),
    "cnn3d": (cnn3d, (10, 2, 4, 4, 4)),
    "transformer": (Block, (10, 5, 8)),
}


def make(model_name: str, seed: int = 0, dtype=torch.float64) -> tuple[nn.Module, list]:
    factory, shape = MODELS[model_name]
    torch.manual_seed(seed)
    model = factory().to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    data = [
        (
            torch.randn(shape, generator=gen, dtype=dtype),
            torch.randint(0, 3, (shape[0],), generator=gen),
        )
        for _ in range(4)
    ]
    return model, data


def graphs_and_breaks(model: nn.Module, x: Tensor, y: Tensor) -> tuple[int, int]:
    """(graphs, graph breaks) of torch.compile(model) over one forward and backward."""
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    F.cross_entropy(torch.compile(model, backend=backend)(x), y).backward()
    return backend.frame_count, sum(counters["graph_break"].values())


@pytest.mark.parametrize("model_name", list(MODELS))
def test_hooked_model_traces_like_the_plain_model(model_name):
    """No break, with and without statistics; as many graphs as the plain model, plus
    one for the model's pre-hook when the model's class is not torch.nn's (torch.compile
    runs such a module's hooks outside its forward's frame: the pre-hook is a frame, and a
    graph, of its own)."""
    model, data = make(model_name, dtype=torch.float32)
    x, y = data[0]
    plain = graphs_and_breaks(model, x, y)
    assert plain == (1, 0)
    opt = SINGD(model, lr=0.05, T=2, structures="diagonal")
    extra = 0 if isinstance(model, nn.Sequential) else 1
    for step in range(2):  # statistics, then none
        assert opt._wants_statistics(opt.layers[0]) == (step == 0)
        opt.zero_grad()
        assert graphs_and_breaks(model, x, y) == (plain[0] + extra, 0)
        opt.step()
    assert opt._capture.committed == {}  # the step used them


def train(
    model_name: str, name: str, compiled: str | None, steps: int = 4, **group
) -> list[Tensor]:
    model, data = make(model_name)
    opt = OPTIMIZERS[name](model)
    opt.param_groups[0].update(group)
    run = model if compiled is None else torch.compile(model, backend=compiled, fullgraph=True)
    for x, y in data[:steps]:
        opt.zero_grad()
        for xs, ys in zip(x.split((6, 4)), y.split((6, 4)), strict=True):  # uneven micro-batches
            (F.cross_entropy(run(xs), ys, reduction="sum") / len(y)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_compiled_training_equals_eager_bit_for_bit(name):
    """fullgraph=True, float64, uneven micro-batches, steps with and without statistics:
    the same parameters as eager, bit for bit."""
    eager = train("mlp", name, None)
    compiled = train("mlp", name, "aot_eager")
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["singd-diagonal", "kfac"])
@pytest.mark.parametrize("model_name", ["cnn1d", "cnn3d"])
def test_compiled_conv1d_and_conv3d_training_equals_eager_bit_for_bit(model_name, name):
    """As above for Conv1d and Conv3d layers (diagonal and dense statistics)."""
    eager = train(model_name, name, None)
    compiled = train(model_name, name, "aot_eager")
    model = make(model_name)[0]
    assert len(OPTIMIZERS[name](model).layers) == sum(hasattr(m, "weight") for m in model)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_compiled_kfac_reduce_equals_eager_bit_for_bit(name):
    """kfac_approx="reduce" on the transformer block (a row per sample of its tokens)."""
    eager = train("transformer", name, None, kfac_approx="reduce")
    compiled = train("transformer", name, "aot_eager", kfac_approx="reduce")
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
    expand = train("transformer", name, None)
    assert any(not torch.equal(a, b) for a, b in zip(eager, expand, strict=True))


def test_code_compiled_before_the_hooks_does_not_run_on():
    """Dynamo does not guard on module hooks: code compiled for an unhooked model would
    run on a hooked model of the same structure (no statistics) unless the optimizer
    resets Dynamo's caches, as it does."""
    twin, data = make("mlp")
    x, y = data[0]
    F.cross_entropy(torch.compile(twin, backend="aot_eager", fullgraph=True)(x), y).backward()
    model, _ = make("mlp")
    opt = OPTIMIZERS["singd-dense"](model)
    F.cross_entropy(torch.compile(model, backend="aot_eager", fullgraph=True)(x), y).backward()
    assert len(opt._capture.committed) == len(opt.layers) == 3


def test_compiled_contract_autograd_grad_and_thrown_away_batch_leave_nothing():
    """The capture contract under compile: an input gradient and a batch thrown away by
    zero_grad change nothing."""
    model, data = make("mlp")
    opt = OPTIMIZERS["singd-dense"](model)
    run = torch.compile(model, backend="aot_eager", fullgraph=True)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(run(x), y).backward()  # thrown away
        opt.zero_grad()
        xr = x.clone().requires_grad_(True)
        torch.autograd.grad(F.cross_entropy(run(xr), y), xr)
        F.cross_entropy(run(x), y).backward()
        opt.step()
    expected = train_plain(data)
    for a, b in zip(expected, model.parameters(), strict=True):
        assert torch.equal(a, b)


def train_counting(backend: str | None) -> list[Tensor]:
    """A submodule called twice into two backward passes of one forward (K-FAC), and
    sequence-first layers with ``batch_dim=1`` (SINGD); the final parameters."""
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8)).double()
    sequence = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    opts = [
        KFAC(encoder, lr=0.05, T=1, damping=1e-2),
        SINGD(sequence, lr=0.05, T=1, structures="dense", batch_dim=1),
    ]
    run_encoder, run_sequence = (
        (encoder, sequence)
        if backend is None
        else (torch.compile(m, backend=backend, fullgraph=True) for m in (encoder, sequence))
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(10, 6, generator=gen, dtype=torch.float64)
        tokens = torch.randn(4, 10, 6, generator=gen, dtype=torch.float64)  # (T, B, F)
        for opt in opts:
            opt.zero_grad()
        z1, z2 = run_encoder(x[:5]), run_encoder(x[5:])
        (z1 * z2).sum().backward(retain_graph=True)
        z1.square().mean().backward()
        run_sequence(tokens).mean(0).square().mean().backward()
        for opt in opts:
            opt.step()
    return [p.detach().clone() for m in (encoder, sequence) for p in m.parameters()]


def test_compiled_counting_of_calls_passes_and_batch_dimension_equals_eager():
    """Samples counted where layers see them (README, "What counts as curvature") hold
    compiled, bit for bit."""
    eager, compiled = train_counting(None), train_counting("aot_eager")
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


def train_plain(data) -> list[Tensor]:
    model, _ = make("mlp")
    opt = OPTIMIZERS["singd-dense"](model)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_compiled_step_runs_eagerly_and_says_so():
    """torch.compile(opt.step) steps exactly as opt.step (it runs eagerly: no graph), and
    Dynamo's graph-break log names the reason."""
    eager = train("mlp", "singd-diagonal", None)
    model, data = make("mlp")
    opt = OPTIMIZERS["singd-diagonal"](model)
    backend = CompileCounterWithBackend("aot_eager")
    step = torch.compile(opt.step, backend=backend)
    counters.clear()
    for x, y in data:
        opt.zero_grad()
        for xs, ys in zip(x.split((6, 4)), y.split((6, 4)), strict=True):
            (F.cross_entropy(model(xs), ys, reduction="sum") / len(y)).backward()
        step()
    for a, b in zip(eager, model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert backend.frame_count == 0
    assert any("compile the model, not optimizer.step" in r for r in counters["graph_break"])


@pytest.mark.slow
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_inductor_training_equals_eager(model_name, name):
    """Inductor (its own kernels: rounding differs) on every model, to 1e-9."""
    eager = train(model_name, name, None)
    compiled = train(model_name, name, "inductor")
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


class Attending(nn.Module):
    """nn.MultiheadAttention and a Linear on its (T, B, C) output (or (B, T, C) with
    ``batch_first=True``), mean over positions."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_first = batch_first
        self.attention = nn.MultiheadAttention(6, 2, batch_first=batch_first)
        self.head = nn.Linear(6, 3)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        h = self.attention(x, x, x, need_weights=False)[0]
        return self.head(h).mean(1 if self.batch_first else 0)


def train_attending(batch_first: bool, backend: str | None) -> list[Tensor]:
    model = Attending(batch_first)
    opt = SINGD(model, lr=0.05, T=1, structures="dense")
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(10, 4, 6, generator=gen, dtype=torch.float64)  # (B, T, C)
        opt.zero_grad()
        run(x if batch_first else x.transpose(0, 1)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_compiled_attention_says_the_batch_as_eager():
    """A sequence-first nn.MultiheadAttention says the model's batch inside a compiled
    graph (the ``tell`` op): the Linear on its (T, B, C) output counts B, as eager and as
    the batch-first twin."""
    compiled = train_attending(False, "aot_eager")
    for a, b in zip(train_attending(False, None), compiled, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(train_attending(True, None), compiled, strict=True):
        # attention in another layout rounds differently: 1e-10 absolute
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
