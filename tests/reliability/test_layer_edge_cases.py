"""Sparse gradients and layers with no inputs or no outputs: a clear error or correct
training, never a failure from inside (README, "What counts as curvature")."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from .conftest import NAMES, make_optimizer, params_of, run


class SparseEmbedding(nn.Module):
    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 6, sparse=sparse)
        self.head = nn.Linear(6, 3)
        self.double()

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(torch.tanh(self.embed(tokens))).mean(1)


@pytest.mark.parametrize("name", NAMES)
def test_a_sparse_embedding_trains_beside_with_sparse_adam(name):
    """The advice of the error: the embedding with torch.optim.SparseAdam, the rest here."""
    model = SparseEmbedding()
    rest = [p for n, p in model.named_parameters() if not n.startswith("embed")]
    opt = make_optimizer(name, model, params=rest)
    sparse = torch.optim.SparseAdam(model.embed.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    before = params_of(model)
    for _ in range(3):
        opt.zero_grad()
        sparse.zero_grad()
        model(torch.randint(0, 11, (5, 4), generator=gen)).square().sum().backward()
        opt.step()
        sparse.step()
    assert all(not torch.equal(p, q) for p, q in zip(params_of(model), before, strict=True))


class ZeroSized(nn.Module):
    """A layer with no outputs (its output joins the hidden features) and one with no
    inputs (its output is its bias), around two ordinary layers; or, ``twin=True``, the
    same model without them and with the bias as a free parameter."""

    def __init__(self, twin: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.twin = twin
        self.body, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        if twin:
            self.bias = nn.Parameter(torch.linspace(-1, 1, 8))
        else:
            self.no_outputs, self.no_inputs = nn.Linear(8, 0), nn.Linear(0, 8)
            with torch.no_grad():
                self.no_inputs.bias.copy_(torch.linspace(-1, 1, 8))
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        hidden = torch.tanh(self.body(x))
        if self.twin:
            return self.head(hidden + self.bias)
        hidden = torch.cat([hidden, self.no_outputs(hidden)], -1)
        return self.head(hidden + self.no_inputs(x[:, :0]))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("name", NAMES)
def test_layers_with_no_inputs_or_no_outputs_train_with_the_fallback(name):
    """nn.Linear(8, 0) and nn.Linear(0, 8) have no weight to precondition: what they hold
    (the bias of the second) trains with the fallback, exactly as a free parameter."""
    model = ZeroSized()
    assert [layer.name for layer in make_optimizer(name, model).layers] == ["body", "head"]

    def step(model, opt, x, y):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    trained = dict(zip(dict(model.named_parameters()), run(name, model, step), strict=True))
    twin = ZeroSized(twin=True)
    expected = dict(zip(dict(twin.named_parameters()), run(name, twin, step), strict=True))
    for key in ("body.weight", "body.bias", "head.weight", "head.bias"):
        torch.testing.assert_close(trained[key], expected[key], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(trained["no_inputs.bias"], expected["bias"], rtol=1e-10, atol=1e-12)
