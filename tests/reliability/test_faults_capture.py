"""Faults around the capture: a call that fails changes nothing (the statistics captured
since the last step included) and its error names what is wrong; construction changes
no tensor of the model; a thrown-away batch counts for nothing; a sequence-first model
counts as its batch-first twin (docs/checkpoints-errors.md, "What counts as curvature")."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

from .conftest import (
    CLASSES,
    FEATURES,
    HIDDEN,
    NAMES,
    assert_close_params,
    batches,
    loss_sum,
    make_optimizer,
    mlp,
    params_of,
    plain_step,
)
from .test_capture_samples import copy_weights, sequences, train


# ------------------------------------------------------------------ sparse gradients
class Embedded(nn.Module):
    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, FEATURES, sparse=sparse)
        self.body = mlp()
        self.double()

    def forward(self, tokens: Tensor) -> Tensor:
        return self.body(self.embed(tokens).mean(1))


def tokens(seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (10, 4), generator=gen), torch.randint(
        0, CLASSES, (10,), generator=gen
    )


@pytest.mark.parametrize("kind", ["Embedding", "EmbeddingBag"])
@pytest.mark.parametrize("name", NAMES)
def test_a_trained_sparse_embedding_is_refused_at_construction(name, kind):
    model = nn.Sequential(getattr(nn, kind)(11, FEATURES, sparse=True), mlp()).double()
    with pytest.raises(ValueError, match=r"sparse gradients.*'0' \(" + kind + r".*SparseAdam"):
        make_optimizer(name, model)
    make_optimizer(name, model, params=list(model[1].parameters()))  # the advice works
    model[0].weight.requires_grad_(False)  # as in torch.optim: frozen, it gets no gradient
    opt = make_optimizer(name, model)
    model(tokens(0)[0]).square().sum().backward()
    opt.step()
    tied = nn.Sequential(
        getattr(nn, kind)(11, FEATURES, sparse=True),
        nn.Linear(FEATURES, FEATURES),
        nn.Linear(FEATURES, 11),
    )
    tied[2].weight = tied[0].weight  # the head's gradient and its own add up to a dense one
    make_optimizer(name, tied)


@pytest.mark.parametrize("name", NAMES)
def test_a_sparse_gradient_later_is_refused_before_anything_changes(name):
    """An embedding switched to sparse after construction: step refuses and keeps the
    statistics, so that the step after the fix is the step of the same batch."""
    model, twin = Embedded(), Embedded()
    opt, twin_opt = make_optimizer(name, model), make_optimizer(name, twin)
    plain_step(twin, twin_opt, *tokens(0))
    plain_step(model, opt, *tokens(0))
    model.embed.sparse = True
    x, y = tokens(1)
    opt.zero_grad()
    (loss_sum(model(x), y) / len(y)).backward()
    before = params_of(model)
    with pytest.raises(RuntimeError, match=r"sparse gradients.*\(11, 6\).*SparseAdam"):
        opt.step()
    assert_close_params(params_of(model), before, rtol=0, atol=0)
    model.embed.weight.grad = model.embed.weight.grad.to_dense()  # the fix
    opt.step()
    plain_step(twin, twin_opt, x, y)
    assert_close_params(params_of(model), params_of(twin))


# --------------------------------------------------------------- zero-size layers
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_a_model_of_zero_size_layers_names_them():
    with pytest.raises(ValueError, match=r"zero-size.*'Linear' \(3, 0\)"):
        make_optimizer("singd-dense", nn.Linear(0, 3))
    model = nn.Sequential(nn.Linear(4, 0), nn.Linear(0, 2))
    with pytest.raises(ValueError, match=r"'0' \(0, 4\), '1' \(2, 0\)"):
        make_optimizer("kfac", model)


# ------------------------------------------------------- construction changes nothing
class CountsForwards(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return x


def model_with_state() -> nn.Module:
    """Spectral norms of both APIs (the parametrization runs its power iteration at each
    read of the weight in training), BatchNorm in training, a module counting its calls."""
    torch.manual_seed(0)
    parametrized = nn.utils.parametrizations.spectral_norm
    return nn.Sequential(
        nn.utils.spectral_norm(nn.Linear(6, 8)),
        parametrized(nn.Linear(8, 8)),
        parametrized(nn.LayerNorm(8)),
        nn.BatchNorm1d(8),
        CountsForwards(),
        nn.Linear(8, 3),
    ).train()


@pytest.mark.parametrize("norm_fisher", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_construction_changes_no_tensor_of_the_model(name, norm_fisher):
    if norm_fisher and name == "adafisher":
        pytest.skip("AdaFisher has no norm_fisher option")
    model = model_with_state()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    make_optimizer(name, model, **({"norm_fisher": True} if norm_fisher else {}))
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


# ----------------------------------------------------------- a thrown-away batch
# (model.zero_grad(), opt.zero_grad(...) and p.grad = None: test_capture_contract.py)
RESETS = {
    "model.zero_grad(set_to_none=False)": lambda model, opt: model.zero_grad(set_to_none=False),
    "p.grad.zero_()": lambda model, opt: [p.grad.zero_() for p in model.parameters()],
    "p.grad = zeros": lambda model, opt: [
        setattr(p, "grad", torch.zeros_like(p)) for p in model.parameters()
    ],
}


@pytest.mark.parametrize("reset", list(RESETS))
@pytest.mark.parametrize("name", NAMES)
def test_a_batch_thrown_away_by_any_reset_equals_never_seen(name, reset):
    """Gradients reset after a batch's backward, in place or not: the next step is that
    of the next batch alone. That batch accumulates over two micro-batches and a pass
    that reaches the head's weight without calling the head (an L2 term): each pass
    keeps the statistics of the ones before it."""
    noise = batches(4, seed=7)

    def l2(model) -> Tensor:
        return 1e-2 * model[2].weight.square().sum()

    def thrown_away(model, opt, x, y):
        opt.zero_grad()
        x_bad, y_bad = noise.pop()
        (loss_sum(model(x_bad), y_bad) / len(y_bad)).backward()
        RESETS[reset](model, opt)
        (loss_sum(model(x[:3]), y[:3]) / len(y)).backward()
        l2(model).backward()
        (loss_sum(model(x[3:]), y[3:]) / len(y)).backward()
        opt.step()

    def whole(model, opt, x, y):
        opt.zero_grad()
        (loss_sum(model(x), y) / len(y) + l2(model)).backward()
        opt.step()

    trained, expected = mlp(), mlp()
    opt, expected_opt = make_optimizer(name, trained), make_optimizer(name, expected)
    for x, y in batches(4):
        thrown_away(trained, opt, x, y)
        whole(expected, expected_opt, x, y)
    assert_close_params(params_of(trained), params_of(expected))


# ------------------------------------------------- sequence-first recurrent models
class Recurrent(nn.Module):
    """An RNN (trained by the fallback), a Linear on every position and a pooled head;
    the model takes (B, T, F) or, with ``batch_first=False``, (T, B, F) data."""

    def __init__(self, cell: type[nn.RNNBase], batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_first = batch_first
        self.rnn = cell(FEATURES, HIDDEN, batch_first=batch_first)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.mid(self.rnn(x)[0]))
        return self.head(h.mean(1 if self.batch_first else 0))


def transposed(data):
    return [(x.transpose(0, 1).contiguous(), y) for x, y in data]


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("name", [n for n in NAMES if n != "adafisher"])
def test_a_sequence_first_recurrent_model_equals_its_batch_first_twin(name, cell):
    """Without batch_dim: the RNN says the batch, the Linear on its (T, B, H) output
    counts B. (AdaFisher's min-max normalised statistics do not depend on the count.)"""
    data = sequences()
    first = Recurrent(cell, batch_first=True)
    second = copy_weights(Recurrent(cell, batch_first=False), first)
    expected = train(name, first, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the RNN's own weights have no layer kind: the construction says so, rightly
        warnings.filterwarnings("ignore", ".*have no layer kind", UserWarning)
        assert_close_params(train(name, second, transposed(data)), expected)


class Packed(nn.Module):
    """An LSTM on a packed sequence, a Linear on the padded (T, B, H) output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.LSTM(FEATURES, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.double()

    def forward(self, x: Tensor) -> Tensor:  # (T, B, F), every sequence of full length
        packed = nn.utils.rnn.pack_padded_sequence(x, [x.shape[0]] * x.shape[1])
        h, _ = nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0])
        return self.head(torch.tanh(h)).mean(0)


@pytest.mark.parametrize("name", ["singd-dense", "kfac"])
def test_a_packed_sequence_says_its_batch(name):
    data = transposed(sequences())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the RNN's own weights have no layer kind: the construction says so, rightly
        warnings.filterwarnings("ignore", ".*have no layer kind", UserWarning)
        trained = train(name, Packed(), data)
    assert_close_params(trained, train(name, Packed(), data, batch_dim=1))


class ProjectedRecurrent(Recurrent):
    """A Linear before the RNN: on (T, B, F) input, it runs before anything says the batch."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__(nn.LSTM, batch_first)
        self.proj = nn.Linear(FEATURES, FEATURES).double()

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(self.proj(x))


def test_layers_counted_before_the_batch_was_said_are_warned_about():
    model = ProjectedRecurrent(batch_first=False)
    opt = make_optimizer("singd-dense", model)
    with pytest.warns(RuntimeWarning, match=r"dimension 0 \(4\) is not the batch \(10\)") as seen:
        for x, y in transposed(sequences(2)):
            plain_step(model, opt, x, y)
    assert len([w for w in seen if "batch_dim=1" in str(w.message)]) == 1
    first = ProjectedRecurrent(batch_first=True)
    second = copy_weights(ProjectedRecurrent(batch_first=False), first)
    expected = train("singd-dense", first, sequences())
    assert_close_params(
        train("singd-dense", second, transposed(sequences()), batch_dim=1), expected
    )


# ------------------------------------------------------------ scaler.step hooks
class HookError(Exception):
    pass


def boom(*args) -> None:
    raise HookError


@pytest.mark.parametrize("hook", ["pre", "post"])
@pytest.mark.parametrize("name", NAMES)
def test_a_raising_step_hook_leaves_no_loss_scale_behind(name, hook):
    """A hook that raises inside scaler.step(opt) (before or after the step's body): the
    next plain step is as if the scaler's call had not raised (pre: nothing happened;
    post: the step happened)."""
    (x, y), (x2, y2) = batches(2)

    def run(raising: bool) -> list[Tensor]:
        model = mlp()
        opt = make_optimizer(name, model)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        if raising or hook == "post":
            handle = getattr(opt, f"register_step_{hook}_hook")(boom if raising else _none)
            scaler.scale(loss_sum(model(x), y) / len(y)).backward()
            if raising:
                with pytest.raises(HookError):
                    scaler.step(opt)
            else:
                scaler.step(opt)
            handle.remove()
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        plain_step(model, opt, x2, y2)
        return params_of(model)

    assert_close_params(run(raising=True), run(raising=False))


def _none(*args) -> None:
    return None


# ------------------------------------------------------- a capture raising mid-backward
class Twice(nn.Module):
    """A Linear called twice, then a head: in the backward both calls of the Linear stage
    their statistics before its weight commits them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(FEATURES, FEATURES)
        self.head = nn.Linear(FEATURES, CLASSES)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


@pytest.mark.parametrize("name", NAMES)
def test_a_capture_raising_mid_backward_leaves_nothing_staged(name):
    """The capture raises at the second call of a layer, whose first staged already: the
    pass counts for nothing (nothing of it waits for a later commit), and later passes
    still drop what they stage without committing (a ``torch.autograd.grad``). After
    zero_grad the next step is that of the next batch alone."""
    (x_bad, y_bad), (x, y) = batches(2)

    def run(failing: bool) -> list[Tensor]:
        model = Twice()
        opt = make_optimizer(name, model)
        if failing:
            accumulate, calls = opt._accumulate_statistics, []

            def raises_at_the_second_call(layer, *args):
                calls.append(layer.module)
                if calls.count(model.inner) == 2:
                    raise HookError
                return accumulate(layer, *args)

            opt._accumulate_statistics = raises_at_the_second_call
            with pytest.raises(HookError):
                (loss_sum(model(x_bad), y_bad) / len(y_bad)).backward()
            del opt._accumulate_statistics
        loss = loss_sum(model(x_bad), y_bad) / len(y_bad)
        torch.autograd.grad(loss, [model.inner.weight, model.head.weight])
        plain_step(model, opt, x, y)
        return params_of(model)

    assert_close_params(run(failing=True), run(failing=False), rtol=0, atol=0)
