"""Samples are counted where a layer sees them (README, "What counts as curvature").

Every call of a layer that a backward pass reaching its ``.grad`` passes through counts
its samples (the size of its output's batch dimension); the layer's statistics are those
of one call on the joined inputs of its calls. So the layout of the data (batch-first or
sequence-first), the number of calls a batch is split into, and where the model is
called do not matter. Each test compares two ways of training that this says are the
same, in float64, on SINGD (dense, block-diagonal, diagonal), IKFAC, AdaFisher and K-FAC.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from singd_cuda.optim.finite import tensors_of

from .conftest import (
    CLASSES,
    FEATURES,
    HIDDEN,
    NAMES,
    assert_close_params,
    loss_sum,
    make_optimizer,
    mlp,
    params_of,
    plain_step,
    run,
)

POSITIONS = 4  # sequence length of the sequence models (the batch is 10: never equal)


def sequences(steps: int = 4, size: int = 10, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    """Batch-first (B, T, F) float64 inputs and (B,) class targets."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(size, POSITIONS, FEATURES, generator=gen, dtype=torch.float64),
            torch.randint(0, CLASSES, (size,), generator=gen),
        )
        for _ in range(steps)
    ]


def train(name: str, model: nn.Module, data, steps: int = 4, **extra) -> list[Tensor]:
    """Plain steps on ``data`` (inputs as the model takes them); the final parameters."""
    opt = make_optimizer(name, model, **extra)
    for x, y in data[:steps]:
        plain_step(model, opt, x, y)
    return params_of(model)


def copy_weights(target: nn.Module, source: nn.Module) -> nn.Module:
    target.load_state_dict(source.state_dict())
    return target


# ----------------------------------------------------------- sequence-first layouts
class LinearSequence(nn.Module):
    """Linear layers over every position, mean over positions, a head. The data comes in
    batch-first (B, T, F); ``layout="sequence"`` runs the layers on (T, B, C), as
    fairseq-style code does."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layout = layout
        self.inp, self.mid = nn.Linear(FEATURES, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        position = 0 if self.layout == "sequence" else 1
        if self.layout == "sequence":
            x = x.transpose(0, 1)
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return self.head(h.mean(position))


class Recurrent(nn.Module):
    """An LSTM (trained by the fallback) and a Linear on its (T, B, H) or (B, T, H) output."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_first = batch_first
        self.rnn = nn.LSTM(FEATURES, HIDDEN, batch_first=batch_first)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.double()

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, F)
        if not self.batch_first:
            x = x.transpose(0, 1)
        h = torch.tanh(self.mid(self.rnn(x)[0]))
        return self.head(h.mean(1 if self.batch_first else 0))


class Transformer(nn.Module):
    """A projection, a PyTorch transformer encoder layer and a pooled head.

    ``layout``: "batch" (all batch-first), "inner" (batch-first data, the transformer
    layer sequence-first, as CLIP-style code transposes around it), or "sequence" (the
    model takes sequence-first (T, B, F) data)."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layout = layout
        self.proj = nn.Linear(FEATURES, HIDDEN)
        self.block = nn.TransformerEncoderLayer(
            HIDDEN, 2, dim_feedforward=12, dropout=0.0, batch_first=layout == "batch"
        )
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)
        if self.layout == "inner":
            h = self.block(h.transpose(0, 1)).transpose(0, 1)
        else:
            h = self.block(h)
        return self.head(h.mean(0 if self.layout == "sequence" else 1))


def sequence_first(data):
    return [(x.transpose(0, 1).contiguous(), y) for x, y in data]


@pytest.mark.parametrize("loss_average", ["batch", "batch+sequence"])
@pytest.mark.parametrize("name", NAMES)
def test_sequence_first_linear_layers_with_batch_dim_equal_batch_first(name, loss_average):
    data = sequences()
    first = train(name, LinearSequence("batch"), data, loss_average=loss_average)
    seq = train(name, LinearSequence("sequence"), data, loss_average=loss_average, batch_dim=1)
    assert_close_params(seq, first)


@pytest.mark.parametrize("name", NAMES)
def test_sequence_first_micro_batches_equal_the_batch_first_whole_batch(name):
    """Uneven micro-batches of a sequence-first model (losses weighted by size)."""

    def accumulated(model, opt, x, y):
        opt.zero_grad()
        for xs, ys in zip(x.split((3, 7)), y.split((3, 7)), strict=True):
            (loss_sum(model(xs), ys) / len(y)).backward()
        opt.step()

    data = sequences()
    model = LinearSequence("sequence")
    opt = make_optimizer(name, model, batch_dim=1)
    for x, y in data:
        accumulated(model, opt, x, y)
    assert_close_params(params_of(model), train(name, LinearSequence("batch"), data))


@pytest.mark.parametrize("name", NAMES)
def test_sequence_first_recurrent_model_equals_batch_first(name):
    data = sequences()
    first = Recurrent(batch_first=True)
    second = copy_weights(Recurrent(batch_first=False), first)
    expected = train(name, first, data)
    assert_close_params(train(name, second, data, batch_dim=1), expected)


@pytest.mark.parametrize("name", NAMES)
def test_transformer_layers_count_their_batch_without_being_told(name):
    """Linear layers inside nn.TransformerEncoderLayer(batch_first=False) count
    dimension 1 by themselves (CLIP-style code transposes around them): no setting, no
    warning."""
    data = sequences()
    first = Transformer("batch")
    inner = copy_weights(Transformer("inner"), first)
    expected = train(name, first, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the attention's in_proj_weight has no layer kind: the construction warns
        warnings.filterwarnings("ignore", ".*have no layer kind", UserWarning)
        # attention in another layout rounds differently: 1e-10 absolute
        assert_close_params(train(name, inner, data), expected, atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_sequence_first_model_with_batch_dim_equals_batch_first(name):
    data = sequences()
    first = Transformer("batch")
    seq = copy_weights(Transformer("sequence"), first)
    expected = train(name, first, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the attention's in_proj_weight has no layer kind: the construction warns
        warnings.filterwarnings("ignore", ".*have no layer kind", UserWarning)
        trained = train(name, seq, sequence_first(data), batch_dim=1)
        assert_close_params(trained, expected, atol=1e-10)


def test_a_sequence_first_model_without_batch_dim_is_warned_about():
    """Sequence-first data without ``batch_dim``: the layers outside the transformer
    layer count positions as samples; a warning says so (once) and names the fix."""
    model = Transformer("sequence")
    opt = make_optimizer("kfac", model)
    with pytest.warns(RuntimeWarning, match="batch_dim=1") as caught:
        for x, y in sequence_first(sequences(2)):
            plain_step(model, opt, x, y)
    assert len([w for w in caught if "batch_dim" in str(w.message)]) == 1


@pytest.mark.parametrize("name", NAMES)
def test_linear_layers_on_transposed_data_count_the_models_batch(name):
    """Batch-first data transposed inside the model: the layers on (T, B, C) count the
    model's batch B (their dimension 1) without being told, and warn about nothing."""
    data = sequences()
    first = LinearSequence("batch")
    seq = copy_weights(LinearSequence("sequence"), first)
    expected = train(name, first, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_close_params(train(name, seq, data), expected)


def test_an_explicit_batch_dim_is_validated():
    with pytest.raises(ValueError, match="batch_dim must be None or an integer >= 0"):
        make_optimizer("kfac", mlp(), batch_dim=-1)


# ------------------------------------------------------- several calls of a layer
class Siamese(nn.Module):
    """An encoder applied to two inputs (or once to both, joined), a head on the pair."""

    def __init__(self, joined: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.joined = joined
        self.encoder = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN)
        )
        self.head = nn.Linear(2 * HIDDEN, CLASSES)
        self.double()

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        if self.joined:
            z1, z2 = self.encoder(torch.cat([x1, x2])).split([len(x1), len(x2)])
        else:
            z1, z2 = self.encoder(x1), self.encoder(x2)
        return self.pair(z1, z2)

    def pair(self, z1: Tensor, z2: Tensor) -> Tensor:
        return self.head(torch.tanh(torch.cat([z1, z2], -1)))


def siamese_step(how: str):
    def step(model, opt, x, y):
        opt.zero_grad()
        x1, x2, y = x[:5], x[5:], y[:5]
        if how == "submodules":  # the model itself is never called
            out = model.pair(model.encoder(x1), model.encoder(x2))
        else:
            out = model(x1, x2)
        (loss_sum(out, y) / len(y)).backward()
        opt.step()

    return step


@pytest.mark.parametrize("how", ["model", "submodules"])
@pytest.mark.parametrize("name", NAMES)
def test_submodule_called_twice_equals_one_call_on_the_joined_batch(name, how):
    joined = run(name, Siamese(joined=True), siamese_step("model"))
    assert_close_params(run(name, Siamese(joined=False), siamese_step(how)), joined)


class Wrapper(nn.Module):
    """Calls the model it wraps once per part of the batch (``parts``) or on the whole."""

    def __init__(self, parts: tuple[int, ...]) -> None:
        super().__init__()
        self.model, self.parts = mlp(), parts

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.model(xs) for xs in x.split(self.parts)])


class Chunked(nn.Module):
    """The model's own forward runs its layers over chunks of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: Tensor) -> Tensor:
        hidden = torch.cat([torch.tanh(self.net[0](xs)) for xs in x.split(3)])
        return torch.cat([self.net[2](hs) for hs in hidden.split((1, 9))])


@pytest.mark.parametrize("model", [lambda: Wrapper((4, 6)), lambda: Wrapper((3, 3, 4)), Chunked])
@pytest.mark.parametrize("name", NAMES)
def test_calls_on_parts_of_the_batch_equal_one_call(name, model):
    """A wrapper calling the model on parts of the batch, a layer called on slices or
    chunks of it inside one forward: the statistics of one call on the whole batch."""
    assert_close_params(run(name, model(), plain_step), run(name, mlp(), plain_step))


# ---------------------------------------------------- several backward passes
class TwoTasks(nn.Module):
    """A shared trunk, a classification head and a regression head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(FEATURES, HIDDEN)
        self.classify, self.regress = nn.Linear(HIDDEN, CLASSES), nn.Linear(HIDDEN, 2)
        self.double()

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.classify(h), self.regress(h)


def task_losses(outputs, y) -> list[Tensor]:
    classes, values = outputs
    target = torch.stack([y.double(), -y.double()], 1)
    return [loss_sum(classes, y) / len(y), F.mse_loss(values, target)]


def first_step_statistics(name: str, tasks: list[int]) -> tuple[dict, list[Tensor]]:
    """The normalised statistics of the first step, {layer: {side: tensors}}, when one
    forward's task losses ``tasks`` are backpropagated one pass each; and the gradients."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(10, FEATURES, generator=gen, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (10,), generator=gen)
    model = TwoTasks()
    opt = make_optimizer(name, model)
    seen: dict = {}
    update_factors = opt._update_factors

    def recording(layers):
        for layer, pending in opt._pending.items():
            seen[layer.name] = {k: [t.clone() for t in tensors_of(v)] for k, v in pending.items()}
        return update_factors(layers)

    opt._update_factors = recording
    losses = task_losses(model(x), y)
    for i, task in enumerate(tasks):
        losses[task].backward(retain_graph=i < len(tasks) - 1)
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    opt.step()
    return seen, grads


def assert_close_all(first: list[Tensor], second: list[Tensor]) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name", NAMES)
def test_backward_passes_of_one_forward_add_their_output_sides(name):
    """loss1.backward(retain_graph=True); loss2.backward(): each pass is a loss over the
    same samples. A layer both passes reach counts its samples and input side once and
    adds the output sides of both; the gradient is the sum."""
    both, grads = first_step_statistics(name, [0, 1])
    first, grads_first = first_step_statistics(name, [0])
    second, grads_second = first_step_statistics(name, [1])
    assert_close_all(grads, [a + b for a, b in zip(grads_first, grads_second, strict=True)])
    assert set(both) == {"trunk", "classify", "regress"}
    assert_close_all(both["classify"]["in"] + both["classify"]["out"], [
        *first["classify"]["in"], *first["classify"]["out"]
    ])  # fmt: skip
    assert_close_all(both["regress"]["in"] + both["regress"]["out"], [
        *second["regress"]["in"], *second["regress"]["out"]
    ])  # fmt: skip
    assert_close_all(both["trunk"]["in"], first["trunk"]["in"])
    assert_close_all(both["trunk"]["in"], second["trunk"]["in"])
    summed = [a + b for a, b in zip(first["trunk"]["out"], second["trunk"]["out"], strict=True)]
    assert_close_all(both["trunk"]["out"], summed)


@pytest.mark.parametrize("name", NAMES)
def test_one_loss_in_two_passes_counts_its_samples_once(name):
    """The same loss backpropagated twice: twice the gradient, twice the output side, the
    input side and the samples once."""
    twice, grads = first_step_statistics(name, [0, 0])
    once, grads_once = first_step_statistics(name, [0])
    assert_close_all(grads[:4], [2 * g for g in grads_once[:4]])
    for layer in ("trunk", "classify"):
        assert_close_all(twice[layer]["in"], once[layer]["in"])
        assert_close_all(twice[layer]["out"], [2 * t for t in once[layer]["out"]])


@pytest.mark.parametrize("layout, told", [("inner", {}), ("sequence", {"batch_dim": 1})])
@pytest.mark.parametrize("name", [n for n in NAMES if n != "adafisher"])  # no norm_fisher
def test_norm_fisher_counts_the_batch_of_sequence_first_layer_norms(name, layout, told):
    """The LayerNorms of a sequence-first transformer layer (``norm_fisher=True``) count
    its batch as its Linear layers do: by themselves inside nn.TransformerEncoderLayer,
    or as ``batch_dim`` says."""
    data = sequences()
    first = Transformer("batch")
    other = copy_weights(Transformer(layout), first)
    expected = train(name, first, data, norm_fisher=True)
    inputs = sequence_first(data) if layout == "sequence" else data
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the attention's in_proj_weight has no layer kind: the construction warns
        warnings.filterwarnings("ignore", ".*have no layer kind", UserWarning)
        trained = train(name, other, inputs, norm_fisher=True, **told)
    assert_close_params(trained, expected, atol=1e-10)
