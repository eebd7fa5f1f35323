"""K-FAC-reduce (``kfac_approx="reduce"``) under the capture contract.

A layer that shares its weight over positions (tokens) takes one row of a and g per
sample: the mean of the sample's inputs and the sum of its output gradients. Samples are
where the batch dimension says (``batch_dim``, sequence-first layers), so the layouts,
micro-batches and calls on parts of the batch that the contract makes equal stay equal;
the statistics themselves are checked against their formula.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from singd_cuda import KFAC, SINGD

from .conftest import (
    NAMES,
    assert_close_params,
    loss_sum,
    make_optimizer,
    mlp,
    params_of,
    plain_step,
    run,
)
from .test_capture_samples import (
    LinearSequence,
    Transformer,
    copy_weights,
    sequence_first,
    sequences,
    train,
)

REDUCE = {"kfac_approx": "reduce"}


@pytest.mark.parametrize("loss_average", ["batch", "batch+sequence"])
def test_reduce_statistics_are_per_sample_input_means_and_output_gradient_sums(loss_average):
    """K-FAC's first statistics of a Linear over (B, T, F): A = Σ_b ā_b ā_bᵀ / B with
    ā_b the mean of sample b's inputs (and 1 for the bias), G = L Σ_b ĝ_b ĝ_bᵀ with ĝ_b
    the sum of its output gradients, L the loss terms."""
    model = LinearSequence("batch")
    x, y = sequences(steps=1)[0]
    opt = KFAC(model, T=1, loss_average=loss_average, kfac_approx="reduce")
    seen = {}
    update_factors = opt._update_factors

    def recording(layers):
        for layer, pending in opt._pending.items():
            seen[layer.name] = {k: v.clone() for k, v in pending.items()}
        return update_factors(layers)

    opt._update_factors = recording
    inputs, output_grads = [], []

    def keep(module, args, output):
        inputs.append(args[0])
        output.register_hook(output_grads.append)

    model.mid.register_forward_hook(keep)
    opt.zero_grad()
    (loss_sum(model(x), y) / len(y)).backward()
    opt.step()
    batch, positions = x.shape[:2]
    terms = batch if loss_average == "batch" else batch * positions
    a = torch.cat([inputs[0].mean(1), torch.ones(batch, 1, dtype=x.dtype)], 1)
    g = output_grads[0].sum(1)
    torch.testing.assert_close(seen["mid"]["in"], a.T @ a / batch, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(seen["mid"]["out"], terms * g.T @ g, rtol=1e-12, atol=1e-14)
    expand = torch.cat([inputs[0].flatten(0, 1), torch.ones(batch * positions, 1)], 1)
    assert not torch.allclose(seen["mid"]["in"], expand.T @ expand / (batch * positions))


@pytest.mark.parametrize("name", NAMES)
def test_reduce_without_positions_equals_expand(name):
    """(B, F) inputs: one row per sample either way."""
    expand = run(name, mlp(), plain_step)
    assert_close_params(run(name, mlp(), plain_step, **REDUCE), expand, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("name", NAMES)
def test_reduce_differs_from_expand_on_sequences(name):
    data = sequences()
    expand = train(name, LinearSequence("batch"), data)
    reduce = train(name, LinearSequence("batch"), data, **REDUCE)
    assert any(
        not torch.allclose(r, e, rtol=1e-6, atol=0) for r, e in zip(reduce, expand, strict=True)
    )


@pytest.mark.parametrize("loss_average", ["batch", "batch+sequence"])
@pytest.mark.parametrize("name", NAMES)
def test_reduce_sequence_first_with_batch_dim_equals_batch_first(name, loss_average):
    data = sequences()
    hp = dict(loss_average=loss_average, **REDUCE)
    first = train(name, LinearSequence("batch"), data, **hp)
    seq = train(name, LinearSequence("sequence"), data, batch_dim=1, **hp)
    assert_close_params(seq, first)


@pytest.mark.parametrize("name", NAMES)
def test_reduce_sequence_first_micro_batches_equal_the_batch_first_whole_batch(name):
    data = sequences()
    model = LinearSequence("sequence")
    opt = make_optimizer(name, model, batch_dim=1, **REDUCE)
    for x, y in data:
        opt.zero_grad()
        for xs, ys in zip(x.split((3, 7)), y.split((3, 7)), strict=True):
            (loss_sum(model(xs), ys) / len(y)).backward()
        opt.step()
    assert_close_params(params_of(model), train(name, LinearSequence("batch"), data, **REDUCE))


class Halves(nn.Module):
    """LinearSequence's layers, each called on two parts of the batch in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = LinearSequence("batch")

    def forward(self, x):
        net = self.net
        h = torch.cat([torch.tanh(net.inp(xs)) for xs in x.split((4, 6))])
        h = torch.cat([torch.tanh(net.mid(hs)) for hs in h.split((7, 3))])
        return net.head(h.mean(1))


@pytest.mark.parametrize("name", NAMES)
def test_reduce_calls_on_parts_of_the_batch_equal_one_call(name):
    data = sequences()
    whole = train(name, LinearSequence("batch"), data, **REDUCE)
    assert_close_params(train(name, Halves(), data, **REDUCE), whole)


@pytest.mark.parametrize("name", NAMES)
def test_reduce_in_sequence_first_transformer_layers_counts_their_batch(name):
    """nn.TransformerEncoderLayer(batch_first=False) inside a batch-first model: its
    Linear layers reduce over dimension 0 (positions) by themselves; a sequence-first
    model with batch_dim=1 likewise."""
    data = sequences()
    first = Transformer("batch")
    inner = copy_weights(Transformer("inner"), first)
    seq = copy_weights(Transformer("sequence"), first)
    expected = train(name, first, data, **REDUCE)
    assert_close_params(train(name, inner, data, **REDUCE), expected, atol=1e-10)
    trained = train(name, seq, sequence_first(data), batch_dim=1, **REDUCE)
    assert_close_params(trained, expected, atol=1e-10)


def test_kfac_approx_is_validated_per_group():
    with pytest.raises(ValueError, match="kfac_approx must be one of"):
        SINGD(mlp(), kfac_approx="mean")
    model = mlp()
    groups = [
        {"params": model[0].parameters(), "kfac_approx": "reduce"},
        {"params": model[2].parameters()},
    ]
    opt = SINGD(model, params=groups)
    assert [g["kfac_approx"] for g in opt.param_groups] == ["reduce", "expand"]
    opt.param_groups[1]["kfac_approx"] = "sum"
    with pytest.raises(ValueError, match=r"param_groups\[1\]: kfac_approx must be one of"):
        opt.step()
