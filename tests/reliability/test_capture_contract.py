"""The capture contract (README, "What counts as curvature"): a backward pass's statistics
count exactly when, and as, that pass accumulates into the ``.grad`` of the layer weight.

Each test compares two ways of training that the contract says are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from singd_cuda import KFAC, SINGD

from .conftest import (
    NAMES,
    assert_close_params,
    batches,
    loss_sum,
    make_optimizer,
    mlp,
    plain_step,
    run,
)


@pytest.mark.parametrize("name", NAMES)
def test_autograd_grad_leaves_nothing(name):
    """An input gradient (adversarial examples, gradient penalties) between steps goes
    through every layer's backward but into no .grad: it counts for nothing."""

    def with_input_gradient(model, opt, x, y):
        x_adv = x.clone().requires_grad_(True)
        (grad_x,) = torch.autograd.grad(loss_sum(model(x_adv), y), x_adv)
        opt.zero_grad()
        x = x + 0.0 * grad_x  # the same batch, after the extra pass
        (loss_sum(model(x), y) / len(y)).backward()
        opt.step()

    assert_close_params(run(name, mlp(), with_input_gradient), run(name, mlp(), plain_step))


@pytest.mark.parametrize("reset", ["opt.zero_grad", "model.zero_grad", "grad=None", "keep-zeros"])
@pytest.mark.parametrize("name", NAMES)
def test_thrown_away_batch_equals_never_seen(name, reset):
    """A batch whose gradient is reset after its backward leaves no statistics."""
    noise = batches(4, seed=7)

    def with_thrown_away_batch(model, opt, x, y):
        x_bad, y_bad = noise.pop()
        (loss_sum(model(x_bad), y_bad) / len(y_bad)).backward()
        if reset == "opt.zero_grad":
            opt.zero_grad()
        elif reset == "model.zero_grad":
            model.zero_grad()
        elif reset == "grad=None":
            for p in model.parameters():
                p.grad = None
        else:
            opt.zero_grad(set_to_none=False)
        (loss_sum(model(x), y) / len(y)).backward()
        opt.step()

    def plain(model, opt, x, y):
        opt.zero_grad(set_to_none=reset != "keep-zeros")
        (loss_sum(model(x), y) / len(y)).backward()
        opt.step()

    assert_close_params(run(name, mlp(), with_thrown_away_batch), run(name, mlp(), plain))


@pytest.mark.parametrize("split", [(3, 7), (1, 4, 5), (10,)])
@pytest.mark.parametrize("name", NAMES)
def test_uneven_micro_batches_equal_the_whole_batch(name, split):
    """Micro-batches of any sizes, each loss weighted by its share, equal one batch."""

    def accumulated(model, opt, x, y):
        opt.zero_grad()
        for xs, ys in zip(x.split(split), y.split(split), strict=True):
            (loss_sum(model(xs), ys) / len(y)).backward()
        opt.step()

    assert_close_params(run(name, mlp(), accumulated), run(name, mlp(), plain_step))


@pytest.mark.parametrize("name", NAMES)
def test_several_forwards_into_one_loss_equal_one_forward(name):
    def two_forwards(model, opt, x, y):
        opt.zero_grad()
        loss = loss_sum(model(x[:4]), y[:4]) + loss_sum(model(x[4:]), y[4:])
        (loss / len(y)).backward()
        opt.step()

    assert_close_params(run(name, mlp(), two_forwards), run(name, mlp(), plain_step))


@dataclass
class Output:
    logits: torch.Tensor


class KeywordModel(nn.Module):
    """Returns a dataclass, calls its layers with keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        hidden = torch.tanh(self.net[0](input=x))
        return {"out": Output(logits=self.net[2](input=hidden))}


@pytest.mark.parametrize("name", NAMES)
def test_keyword_calls_and_structured_outputs_change_nothing(name):
    def step(model, opt, x, y):
        opt.zero_grad()
        for xs, ys in zip(x.split((6, 4)), y.split((6, 4)), strict=True):
            (loss_sum(model(xs)["out"].logits, ys) / len(y)).backward()
        opt.step()

    model = KeywordModel()
    assert_close_params(run(name, model, step), run(name, mlp(), plain_step))


@pytest.mark.parametrize("name", NAMES)
def test_empty_batch_counts_for_nothing(name):
    """A micro-batch of 0 samples (a summed loss: zero gradient) changes nothing."""

    def with_empty(model, opt, x, y):
        opt.zero_grad()
        (loss_sum(model(x[:0]), y[:0]) / len(y)).backward()
        (loss_sum(model(x), y) / len(y)).backward()
        opt.step()

    assert_close_params(run(name, mlp(), with_empty), run(name, mlp(), plain_step))


@pytest.mark.parametrize("name", NAMES)
def test_eval_mode_keeps_curvature(name):
    """model.eval() (frozen BatchNorm, no dropout) trains exactly as train() here."""
    evaluated = mlp().eval()
    assert_close_params(run(name, evaluated, plain_step), run(name, mlp(), plain_step))


class Twice(nn.Module):
    """One Linear called twice, or two Linears sharing weight and bias."""

    def __init__(self, shared_modules: bool) -> None:
        super().__init__()
        self.first = mlp()[0]
        torch.manual_seed(3)
        self.mid = nn.Linear(8, 8).double()
        self.mid_again = nn.Linear(8, 8).double() if shared_modules else self.mid
        if shared_modules:
            self.mid_again.weight, self.mid_again.bias = self.mid.weight, self.mid.bias
        self.head = mlp()[2]

    def forward(self, x):
        h = torch.tanh(self.mid(torch.tanh(self.first(x))))
        return self.head(torch.tanh(self.mid_again(h)))


@pytest.mark.parametrize("name", NAMES)
def test_shared_weight_equals_module_called_twice(name):
    """Two modules sharing one weight: one layer, one update per step, the statistics of
    both uses: exactly one module called twice."""
    shared = Twice(shared_modules=True)
    opt = make_optimizer(name, shared)
    assert len(opt.layers) == 3
    opt.remove_hooks()
    assert_close_params(run(name, shared, plain_step), run(name, Twice(False), plain_step))


@pytest.mark.parametrize("name", NAMES)
def test_frozen_weight_takes_no_statistics_and_trains_once_unfrozen(name):
    model = mlp()
    model[0].weight.requires_grad_(False)
    opt = make_optimizer(name, model)
    frozen = model[0].weight.detach().clone()
    for step, (x, y) in enumerate(batches(4)):
        if step == 2:
            model[0].weight.requires_grad_(True)
        opt.zero_grad()
        (loss_sum(model(x), y) / len(y)).backward()
        if step < 2:
            assert opt.layers[0] not in opt._capture.committed
        opt.step()
        if step < 2:
            assert torch.equal(model[0].weight, frozen)
    assert not torch.equal(model[0].weight, frozen)
    assert opt.state[model[0].weight]


class TiedLM(nn.Module):
    """Token embedding tied to the output layer, as in GPT-style language models."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


@pytest.mark.parametrize("name", NAMES)
def test_tied_embedding_is_one_layer_of_the_head(name):
    """A head tied to an input embedding is preconditioned as one layer of the head's
    calls (its gradient: the head's plus the embedding rows'); training is finite and
    makes progress."""
    model = TiedLM()
    opt = make_optimizer(name, model)
    assert [layer.name for layer in opt.layers] == ["mix", "head"]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 11, (16, 6), generator=gen)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 11), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_a_tied_head_steps_once_with_the_heads_statistics():
    """The tied weight's factors are those of an untied twin's head (statistics of the
    head's calls only), and it moves once, by the preconditioned total gradient:
    W - lr (C Cᵀ) G (K Kᵀ) with G = the head's gradient + the embedding rows'."""
    tied = TiedLM().double()
    untied = TiedLM().double()
    untied.head.weight = nn.Parameter(untied.embed.weight.detach().clone())
    hyper = dict(structures="dense", lr=0.1, T=1, momentum=0.0, warm_start=False)
    opts = [SINGD(model, **hyper) for model in (tied, untied)]
    tokens = torch.randint(0, 11, (16, 6), generator=torch.Generator().manual_seed(0))
    before = tied.head.weight.detach().clone()
    for model, opt in zip((tied, untied), opts, strict=True):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, 11), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
    state, twin = opts[0].state[tied.head.weight], opts[1].state[untied.head.weight]
    for side in ("K", "C"):
        torch.testing.assert_close(state[side]["mat"], twin[side]["mat"], rtol=1e-12, atol=0)
    K, C = state["K"]["mat"], state["C"]["mat"]
    G = tied.head.weight.grad
    expected = before - 0.1 * (C @ C.T) @ G @ (K @ K.T)
    torch.testing.assert_close(tied.head.weight.detach(), expected, rtol=1e-12, atol=1e-14)


def test_a_tied_head_is_preconditioned_by_kfacs_head_factors():
    """K-FAC likewise: the tied weight's factors and damped inverses are those of an
    untied twin's head, and its step is lr · G⁻¹ (head + embedding rows' gradient) A⁻¹.
    (The embedding rows' part is preconditioned by factors that measure the head only:
    docs/concepts/curvature.md, "Tied weights".)"""
    tied = TiedLM().double()
    untied = TiedLM().double()
    untied.head.weight = nn.Parameter(untied.embed.weight.detach().clone())
    hyper = dict(lr=0.1, T=1, momentum=0.0, damping=1e-2)
    opts = [KFAC(model, **hyper) for model in (tied, untied)]
    tokens = torch.randint(0, 11, (16, 6), generator=torch.Generator().manual_seed(0))
    before = tied.head.weight.detach().clone()
    for model, opt in zip((tied, untied), opts, strict=True):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, 11), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
    state, twin = opts[0].state[tied.head.weight], opts[1].state[untied.head.weight]
    for key in ("A", "G", "A_inv", "G_inv"):
        torch.testing.assert_close(state[key], twin[key], rtol=1e-12, atol=1e-15)
    embedding_rows = untied.embed.weight.grad
    G = tied.head.weight.grad
    torch.testing.assert_close(G, untied.head.weight.grad + embedding_rows, rtol=1e-12, atol=0)
    assert embedding_rows.abs().max() > 0.1 * G.abs().max()  # the sum is not the head's alone
    expected = before - 0.1 * state["G_inv"] @ G @ state["A_inv"]
    torch.testing.assert_close(tied.head.weight.detach(), expected, rtol=1e-12, atol=1e-14)


class OutsideUse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        hidden = torch.tanh(F.linear(x, self.net[0].weight, self.net[0].bias))
        return self.net[2](hidden)


class FallbackTwin(nn.Module):
    """OutsideUse with the first layer in a module of no supported kind (the fallback
    trains it from the start)."""

    def __init__(self) -> None:
        super().__init__()
        net = mlp()
        self.first = nn.Module()
        self.first.weight, self.first.bias = net[0].weight, net[0].bias
        self.head = net[2]

    def forward(self, x):
        return self.head(torch.tanh(F.linear(x, self.first.weight, self.first.bias)))


@pytest.mark.parametrize("name", NAMES)
def test_weight_used_outside_its_module_trains_with_the_fallback(name):
    """A weight whose gradient never has statistics (used by F.linear outside its
    module's forward) trains with AdamW exactly as a weight of no supported module, and
    says so once."""
    model = OutsideUse()
    with pytest.warns(RuntimeWarning, match="never had any") as caught:
        trained = run(name, model, plain_step)
    assert len([w for w in caught if "never had any" in str(w.message)]) == 1
    assert_close_params(trained, run(name, FallbackTwin(), plain_step))


def test_grad_penalty_counts_the_pass_that_reaches_grad():
    """With create_graph=True the penalty's backward does reach .grad: a penalty weighted
    by 0 still leaves the statistics of the loss backward only (the penalty pass adds
    none, as nothing flows into the layer outputs from a zero-weighted term)."""

    def with_zero_penalty(model, opt, x, y):
        opt.zero_grad()
        x = x.clone().requires_grad_(True)
        loss = loss_sum(model(x), y) / len(y)
        (grad_x,) = torch.autograd.grad(loss, x, create_graph=True)
        (loss + 0.0 * grad_x.square().sum()).backward()
        opt.step()

    for name in ("singd-dense", "kfac"):
        assert_close_params(
            run(name, mlp(), with_zero_penalty), run(name, mlp(), plain_step), rtol=1e-9
        )


@pytest.mark.parametrize("name", ["singd-dense", "adafisher", "kfac"])
def test_torch_func_per_sample_gradients_leave_nothing(name):
    """Per-sample gradients with torch.func (vmap over grad of functional_call) between
    steps run the layers but accumulate no .grad: they count for nothing."""
    from torch.func import functional_call, grad, vmap

    def with_per_sample_grads(model, opt, x, y):
        params = {k: p.detach() for k, p in model.named_parameters()}

        def sample_loss(p, xs, ys):
            return loss_sum(functional_call(model, p, (xs[None],)), ys[None])

        vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
        plain_step(model, opt, x, y)

    assert_close_params(run(name, mlp(), with_per_sample_grads), run(name, mlp(), plain_step))


@pytest.mark.parametrize("name", NAMES)
def test_frozen_weights_with_trained_biases_train_the_biases(name):
    """BitFit: every weight frozen, the biases trained (with the current factors)."""
    model = mlp()
    for layer in (model[0], model[2]):
        layer.weight.requires_grad_(False)
    weights = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
    biases = [model[0].bias.detach().clone(), model[2].bias.detach().clone()]
    opt = make_optimizer(name, model)
    for x, y in batches(3):
        plain_step(model, opt, x, y)
    assert torch.equal(model[0].weight, weights[0]) and torch.equal(model[2].weight, weights[1])
    assert not torch.equal(model[0].bias, biases[0]) and not torch.equal(model[2].bias, biases[1])
