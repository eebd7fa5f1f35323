"""Layers of equal shapes, structures and dtypes are updated and preconditioned as one
stack (singd_cuda/optim/grouped.py): the result equals the per-layer path in float64, the
checkpoint layout stays per parameter, and a non-finite stacked factor update restores
every factor."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import singd_cuda.ops as ops
import singd_cuda.optim.grouped as grouped
import singd_cuda.optim.singd as singd_module
from singd_cuda import SINGD
from singd_cuda.curvature.discovery import find_layers
from singd_cuda.curvature.layers import gradient_matrix, split_matrix
from singd_cuda.optim.grouped import StackedProduct

T = 3
CASES = {
    "dense": dict(structures="dense"),
    "block_diagonal": dict(structures="block_diagonal:5"),
    "block_diagonal-bias-in-a-full-block": dict(structures="block_diagonal:13"),
    "hierarchical": dict(structures="hierarchical:3,2"),
    "diagonal": dict(structures="diagonal"),
    "mixed-sides": dict(structures=("hierarchical:2,3", "block_diagonal:4")),
    "kfac_like-dense": dict(structures="dense", kfac_like=True),
    "kfac_like-block_diagonal": dict(structures="block_diagonal:5", kfac_like=True),
}


class Stack(nn.Module):
    """Mixed shapes: three 12 → 12 layers with bias, two without, a 3 x 3 conv pair and
    layers of their own shape (the first and the head), as in a repeated-block model."""

    def __init__(self, dtype=torch.float64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 4, 3, padding=1), nn.Tanh()
        )
        self.first = nn.Linear(4 * 3 * 3, 12)
        self.body = nn.Sequential(
            *(m for _ in range(3) for m in (nn.Linear(12, 12), nn.Tanh())),
            *(m for _ in range(2) for m in (nn.Linear(12, 12, bias=False), nn.Tanh())),
        )
        self.head = nn.Linear(12, 5)
        self.to(dtype)

    def forward(self, x):
        return self.head(self.body(self.first(self.conv(x).flatten(1))))


def batches(n: int, dtype=torch.float64, scale: float = 1.0):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 2, 3, 3, generator=g, dtype=dtype) * scale, torch.randn(8, 5, generator=g))
        for _ in range(n)
    ]


def train(model, opt, data) -> None:
    for x, y in data:
        opt.zero_grad()
        ((model(x) - y.to(x.dtype)) ** 2).mean().backward()
        opt.step()


def per_layer(opt: SINGD) -> SINGD:
    """The reference: no two layers share a group key, and no layer is preconditioned
    through stacked products, so each runs the per-layer path (the structures' own
    products)."""
    rule = opt._rules["singd"]
    rule.group_key = lambda *args: None
    rule._stacked_outer = lambda *args: (None, None)
    return opt


def make(model, **hyper) -> SINGD:
    return SINGD(model, lr=0.01, T=T, lr_cov=0.1, **hyper)


@pytest.fixture
def stacked_calls(monkeypatch) -> dict[str, int]:
    """Counts the stacked factor updates, stacked products and multi-layer diagonal
    factor updates, so that a test sees the stacked path run."""
    calls = {"update": 0, "matmul": 0, "diagonal": 0}
    update, matmul = singd_module._stacked_factor_update, StackedProduct.matmul_
    diagonal = ops.diag_factor_update_

    def count_update(*args, **kwargs):
        calls["update"] += 1
        return update(*args, **kwargs)

    def count_matmul(self, X):
        calls["matmul"] += 1
        return matmul(self, X)

    def count_diagonal(k, *args, **kwargs):
        # more than one layer's two sides: as rows of lists, or as stacked (2-D) entries
        calls["diagonal"] += len(k) > 2 or any(t.dim() == 2 for t in k)
        return diagonal(k, *args, **kwargs)

    monkeypatch.setattr(singd_module, "_stacked_factor_update", count_update)
    monkeypatch.setattr(StackedProduct, "matmul_", count_matmul)
    monkeypatch.setattr(singd_module.ops, "diag_factor_update_", count_diagonal)
    return calls


@pytest.fixture(params=["one product", "chunked"])
def product_path(request, monkeypatch):
    """Small stacks take one batched product; larger ones go through temporaries of a
    few rows (here forced with a tiny chunk)."""
    if request.param == "chunked":
        monkeypatch.setattr(grouped, "_CHUNK_ELEMENTS", 8)
    return request.param


@pytest.mark.parametrize("case", list(CASES))
def test_stacked_equals_per_layer_in_float64(case, stacked_calls, product_path):
    data = batches(2 * T + 2)
    models = [Stack(), Stack()]
    opts = [make(models[0], **CASES[case]), per_layer(make(models[1], **CASES[case]))]
    train(models[0], opts[0], data)
    counted = dict(stacked_calls)
    train(models[1], opts[1], data)
    assert stacked_calls == counted  # the reference stacked nothing
    if case == "diagonal":
        assert counted["diagonal"] > 0
    else:
        assert counted["update"] > 0 and counted["matmul"] > 0
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    states = [opt.state_dict()["state"] for opt in opts]
    assert states[0].keys() == states[1].keys()
    for index in states[0]:
        for key, value in states[0][index].items():
            if isinstance(value, dict):
                for name, part in value.items():
                    other = states[1][index][key][name]
                    torch.testing.assert_close(part, other, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "case", ["dense", "block_diagonal", "block_diagonal-bias-in-a-full-block", "hierarchical"]
)
def test_stacked_with_frozen_parameters_equals_per_layer(case, stacked_calls, product_path):
    """A frozen bias, and a frozen weight beside a trained bias, inside stacked groups."""
    data = batches(2 * T + 2)
    models = [Stack(), Stack()]
    for model in models:
        model.body[0].bias.requires_grad_(False)
        model.body[2].weight.requires_grad_(False)
    opts = [make(models[0], **CASES[case]), per_layer(make(models[1], **CASES[case]))]
    train(models[0], opts[0], data)
    train(models[1], opts[1], data)
    assert stacked_calls["matmul"] > 0
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["dense", "block_diagonal", "hierarchical"])
def test_stacked_with_a_loss_scale_equals_unscaled(case, stacked_calls):
    """GradScaler's constant power-of-two scale is exact: the stacked products, which
    unscale the gradients through the cached K Kᵀ, give the unscaled run's weights."""
    data = batches(2 * T + 2)
    models = [Stack(), Stack()]
    opts = [make(model, **CASES[case]) for model in models]
    train(models[0], opts[0], data)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6)
    for x, y in data:
        opts[1].zero_grad()
        scaler.scale(((models[1](x) - y.to(x.dtype)) ** 2).mean()).backward()
        scaler.step(opts[1])
        scaler.update()
    assert stacked_calls["matmul"] > 0
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("case", ["dense", "hierarchical", "diagonal"])
def test_checkpoint_round_trip_keeps_the_per_parameter_layout(case):
    data = batches(3 * T, torch.float32)
    model = Stack(torch.float32)
    opt = make(model, **CASES[case])
    train(model, opt, data[: T + 1])
    saved = copy.deepcopy(opt.state_dict())
    weight = dict(model.named_parameters())["body.0.weight"]
    index = next(
        i for i, p in enumerate(p for g in opt.param_groups for p in g["params"]) if p is weight
    )
    assert set(saved["state"][index]) >= {"K", "m_K", "C", "m_C", "momentum_buffer"}
    assert saved["state"][index]["momentum_buffer"].shape == weight.shape

    resumed_model = Stack(torch.float32)
    resumed_model.load_state_dict(model.state_dict())
    resumed = make(resumed_model, **CASES[case])
    resumed.load_state_dict(saved)
    train(model, opt, data[T + 1 :])
    train(resumed_model, resumed, data[T + 1 :])
    for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("structures", "path"), [("dense", "update"), ("diagonal", "diagonal")])
def test_nonfinite_stacked_factor_update_restores_every_factor(stacked_calls, structures, path):
    """float16 factors, IKFAC (no trace normalisation), T = 1: inputs scaled by 1e3 give
    finite statistics whose factor momentum overflows float16 in the stacked update; the
    factors are rows of stacks, restored as such."""
    model = Stack(torch.float32)
    opt = SINGD(
        model, lr=0.05, T=1, structures=structures, kfac_like=True, factor_dtype=torch.float16
    )
    (x, y), (x2, y2) = batches(2, torch.float32)
    train(model, opt, [(x, y), (x, y)])
    assert len({f.untyped_storage().data_ptr() for f in _body_factors(model, opt)}) == 1
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    updates = stacked_calls[path]
    with pytest.warns(RuntimeWarning, match="non-finite"):
        train(model, opt, [(x2 * 1e3, y2)])
    assert stacked_calls[path] > updates
    for before, after in zip(params, model.parameters(), strict=True):
        assert torch.equal(before, after)
    after = opt.state_dict()
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if isinstance(value, dict):
                for name, part in value.items():
                    assert torch.equal(part, after["state"][index][key][name])


def _layers(*modules: nn.Module) -> list:
    """The layers of ``modules`` as an optimizer finds them."""
    model = nn.ModuleList(modules)
    return find_layers(model, {id(p): 0 for p in model.parameters()}, "test")


@pytest.mark.parametrize(
    "modules, start",
    [
        (lambda: [nn.Linear(6, 4) for _ in range(3)], 0),  # one layout: the stacked path
        (lambda: [nn.Linear(6, 4) for _ in range(3)], 2),
        (lambda: [nn.Linear(6, 4, bias=False) for _ in range(3)], 1),
        (lambda: [nn.Conv2d(2, 4, 3) for _ in range(2)], 0),
        # equal d_C and d_K, other layouts: the per-layer path
        (lambda: [nn.Linear(6, 4), nn.Linear(7, 4, bias=False), nn.Conv2d(2, 4, (1, 3))], 0),
    ],
)
@pytest.mark.parametrize("grad_dtype", [torch.float64, torch.bfloat16])
def test_stacked_gradients_and_split_equal_the_per_layer_matrices(modules, start, grad_dtype):
    """stacked_gradients == the stack of gradient_matrix, and split_matrices of a stack ==
    split_matrix of each layer, bitwise, whichever path the layers take."""
    torch.manual_seed(0)
    layers = _layers(*(module.to(grad_dtype) for module in modules()))
    for layer in layers:
        for p in layer.params:
            p.grad = torch.randn(p.shape, dtype=torch.float64).to(grad_dtype)
    dtype = torch.float64
    expected = torch.stack([gradient_matrix(layer, dtype)[:, start:] for layer in layers])
    got = grouped.stacked_gradients(layers, dtype, start=start)
    assert torch.equal(got, expected)
    scale = torch.tensor(0.5, dtype=torch.float64)
    assert torch.equal(
        grouped.stacked_gradients(layers, dtype, inv_scale=scale)[:, :, start:], expected * 0.5
    )
    M = torch.randn(len(layers), layers[0].dim_out, layers[0].dim_in, dtype=dtype)
    split = grouped.split_matrices(layers, M)
    reference = [
        part for layer, m in zip(layers, M, strict=True) for part in split_matrix(layer, m)
    ]
    assert len(split) == len(reference)
    for a, b in zip(split, reference, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_stacked_gradients_of_a_layer_without_gradient_are_zeros():
    """A parameter without a gradient (frozen, or unused this step) gives zero columns; the
    others' stay (the per-layer path, whatever the layout)."""
    layers = _layers(nn.Linear(3, 2), nn.Linear(3, 2))
    layers[0].weight.grad = torch.ones(2, 3)
    layers[1].weight.grad, layers[1].bias.grad = torch.full((2, 3), 2.0), torch.full((2,), 3.0)
    G = grouped.stacked_gradients(layers, torch.float32)
    assert torch.equal(G[0], torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 0]]))
    assert torch.equal(G[1], torch.tensor([[2.0, 2, 2, 3], [2, 2, 2, 3]]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "chunk", [8, 64, 2**16], ids=["a block at a time", "two blocks", "all layers at once"]
)
def test_block_diagonal_rows_in_any_chunks_are_the_dense_product_bitwise(dtype, chunk, monkeypatch):
    """C Cᵀ X through temporaries of a few blocks' rows: every block's product is the same
    batched matmul whatever the temporaries hold, so any chunking gives the same values
    bit for bit, and they equal the dense block-diagonal matrix's product."""
    monkeypatch.setattr(grouped, "_CHUNK_ELEMENTS", chunk)
    gen = torch.Generator().manual_seed(0)
    L, n, b, r, m = 3, 5, 4, 2, 7
    blocks = torch.randn(L, n, b, b, generator=gen).to(dtype)
    last = torch.randn(L, r, r, generator=gen).to(dtype)
    X = torch.randn(L, n * b + r, m, generator=gen).to(dtype)
    whole = grouped._block_diagonal_matmul_(blocks, last, X.clone())
    monkeypatch.setattr(grouped, "_CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(grouped, "_BLOCK_ROWS_FRACTION", 0.0)  # one block at a time
    assert torch.equal(grouped._block_diagonal_matmul_(blocks, last, X.clone()), whole)
    for layer in range(L):
        dense = torch.block_diag(*blocks[layer].double(), last[layer].double())
        expected = (dense @ X[layer].double()).to(dtype)
        tolerance = 1e-12 if dtype is torch.float64 else 2e-2
        torch.testing.assert_close(whole[layer], expected, rtol=tolerance, atol=tolerance)


def _body_factors(model, opt) -> list[torch.Tensor]:
    """The K (its one part) of the three 12 → 12 layers with bias (one group)."""
    return [next(iter(opt.state[model.body[i].weight]["K"].values())) for i in (0, 2, 4)]


@pytest.mark.parametrize("case", ["dense", "kfac_like-dense", "diagonal"])
def test_factors_live_as_aligned_rows_of_one_stack_kept_between_steps(case):
    """A group's factors are rows of one stack (ResidentStacks), each row starting where
    a tensor of its own would (64 bytes); steps reuse the stack; a load puts new tensors
    in the state, which the next factor update stacks again, and training goes on exactly
    as without the load."""
    data = batches(4 * T, torch.float32)
    model, twin = Stack(torch.float32), Stack(torch.float32)
    opt, twin_opt = make(model, **CASES[case]), make(twin, **CASES[case])
    train(model, opt, data[: T + 1])
    rows = _body_factors(model, opt)
    storage = rows[0].untyped_storage().data_ptr()
    assert all(row.untyped_storage().data_ptr() == storage for row in rows)
    assert all(row.data_ptr() % 64 == 0 for row in rows)
    assert len({row.data_ptr() for row in rows}) == 3
    train(model, opt, data[T + 1 : 2 * T + 1])
    assert all(a is b for a, b in zip(_body_factors(model, opt), rows, strict=True))

    train(twin, twin_opt, data[: 2 * T + 1])
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    loaded = _body_factors(model, opt)
    assert len({row.untyped_storage().data_ptr() for row in loaded}) == 3  # tensors of their own
    train(model, opt, data[2 * T + 1 :])
    train(twin, twin_opt, data[2 * T + 1 :])
    restacked = _body_factors(model, opt)
    assert len({row.untyped_storage().data_ptr() for row in restacked}) == 1
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


_GARBAGE_SCRIPT = """
import gc, sys, torch
from torch import nn
from singd_cuda import SINGD

configs = {
    "block_diagonal": dict(T=1),  # block_diagonal:32, the default
    "dense": dict(T=1, structures="dense"),
    "diagonal": dict(T=1, structures="diagonal"),
    "kfac_like-T2": dict(T=2, structures="block_diagonal:5", kfac_like=True),
}


def ours(obj):  # torch's and the library's objects and functions (not, e.g., importlib's)
    module = getattr(obj, "__module__", None) if callable(obj) else type(obj).__module__
    return isinstance(module, str) and module.startswith(("torch", "singd_cuda"))


torch.manual_seed(0)
data = [torch.randn(8, 12) for _ in range(10)]
for name, hyper in configs.items():
    model = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(12, 12), nn.Tanh())))
    opt = SINGD(model, lr=0.01, **hyper)

    def train(batches):
        for x in batches:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

    train(data[:4])
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    gc.garbage.clear()
    train(data[4:])
    gc.collect()
    print(name, sum(map(ours, gc.garbage)))
    gc.set_debug(0)
    gc.garbage.clear()
"""


def test_a_steady_step_leaves_no_cyclic_garbage():
    """Steady-state iterations leave nothing for the garbage collector: a stacked factor
    update makes no reference cycles (``torch.func.vmap`` makes some per call, so the
    ``batched`` structures update without it). In a fresh interpreter, so that no other
    test's leftovers are counted, and only torch's and the library's objects (lazy imports
    leave some of their own): block-diagonal (the default), dense, diagonal, IKFAC."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _GARBAGE_SCRIPT], capture_output=True, text=True, check=True
    )
    counts = dict(line.split() for line in done.stdout.splitlines())
    assert counts == {
        "block_diagonal": "0",
        "dense": "0",
        "diagonal": "0",
        "kfac_like-T2": "0",
    }, done.stdout


@pytest.mark.parametrize("optimizer", ["singd", "kfac", "adafisher"])
def test_loads_leave_no_stack_behind(optimizer):
    """After a load the next factor update stacks the loaded factors anew; the stacks they
    replaced are let go (a loop that reloads checkpoints keeps one set of factors)."""
    import gc
    import weakref

    from singd_cuda import KFAC, AdaFisher

    model = Stack(torch.float32)
    if optimizer == "singd":
        opt = SINGD(model, lr=0.01, T=1, structures="dense")
        factor = lambda: opt.state[model.body[0].weight]["K"]["mat"]  # noqa: E731
    elif optimizer == "adafisher":
        opt = AdaFisher(model, lr=0.01, T=1)
        factor = lambda: opt.state[model.body[0].weight]["h"]  # noqa: E731
    else:
        opt = KFAC(model, lr=0.01, T=1)
        factor = lambda: opt.state[model.body[0].weight]["A"]  # noqa: E731
    data = batches(8, torch.float32)
    train(model, opt, data[:2])
    replaced = []
    for start in range(2, 8, 2):
        replaced.append(weakref.ref(factor()._base))
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        train(model, opt, data[start : start + 2])
    gc.collect()
    assert [ref() for ref in replaced] == [None] * len(replaced)
    assert factor()._base is not None  # the loaded factors were stacked again


def _emas(model, opt) -> list[torch.Tensor]:
    """AdaFisher's h and s of the three 12 → 12 layers with bias (one stack each)."""
    return [opt.state[model.body[i].weight][key] for key in ("h", "s") for i in (0, 2, 4)]


@pytest.mark.parametrize("factor_dtype", [None, torch.bfloat16], ids=["weights'", "bfloat16"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_adafisher_on_stacks_equals_one_layer_at_a_time(dtype, factor_dtype):
    """AdaFisher's EMAs of layers of equal shapes and dtypes are the rows of one aligned
    stack, lerped and min-max normalised per stack, with the undo saving each stack as one
    tensor; training equals the path with every layer alone bit for bit, through a frozen
    layer, an idle one that joins late and a checkpoint load."""
    from singd_cuda import AdaFisher

    data = batches(4 * T, dtype)
    runs = {}
    for stacked in (True, False):
        model = Stack(dtype)
        opt = AdaFisher(model, lr=0.01, T=2, factor_dtype=factor_dtype)
        if not stacked:  # every layer a key of its own: no stacks
            opt._rule._parts = lambda layers, states: [[i] for i in range(len(layers))]
        model.body[8].weight.requires_grad_(False)  # frozen: its bias trains alone
        idle = model.body[6]
        idle_params = [p.detach().clone() for p in idle.parameters()]
        forward = idle.forward
        idle.forward = lambda x: x  # idle for the first two steps, then joins
        train(model, opt, data[:2])
        assert all(torch.equal(a, b) for a, b in zip(idle.parameters(), idle_params, strict=True))
        idle.forward = forward
        train(model, opt, data[2 : 2 * T])
        if stacked:
            rows = _emas(model, opt)
            assert len({row.untyped_storage().data_ptr() for row in rows}) == 2
            assert all(row.data_ptr() % 64 == 0 for row in rows)
            assert opt._undo._layout.stacked.count(True) >= 2
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        train(model, opt, data[2 * T :])
        if stacked:
            assert len({row.untyped_storage().data_ptr() for row in _emas(model, opt)}) == 2
        runs[stacked] = model, opt
    (model, opt), (reference, reference_opt) = runs[True], runs[False]
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(_emas(model, opt), _emas(reference, reference_opt), strict=True):
        assert torch.equal(a, b)


def test_adafisher_overflow_in_stacked_emas_restores_them():
    """float16 EMAs whose update overflows (inputs scaled by 1e3): the step is skipped and
    every EMA, a row of a stack, is restored."""
    from singd_cuda import AdaFisher

    model = Stack(torch.float32)
    opt = AdaFisher(model, lr=0.01, T=1, factor_dtype=torch.float16)
    (x, y), (x2, y2) = batches(2, torch.float32)
    train(model, opt, [(x, y), (x, y)])
    assert len({row.untyped_storage().data_ptr() for row in _emas(model, opt)}) == 2
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    with pytest.warns(RuntimeWarning, match="non-finite"):
        train(model, opt, [(x2 * 1e3, y2)])
    for before, after in zip(params, model.parameters(), strict=True):
        assert torch.equal(before, after)
    after = opt.state_dict()
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, after["state"][index][key]), key


@pytest.mark.parametrize("factor_dtype", [None, torch.bfloat16], ids=["weights'", "bfloat16"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("kfac_like", [False, True], ids=["singd", "ikfac"])
def test_diagonal_squares_of_stacks_equal_one_layer_at_a_time(dtype, factor_dtype, kfac_like):
    """SINGD's diagonal path derives c², k² and their traces for the layers whose factors
    are rows of kept stacks as rows of stacked buffers, filled a few calls for all, and
    updates them from lists of rows kept with the stacks; the same training as deriving
    and updating them layer by layer, bit for bit (T = 1 and 2)."""
    data = batches(4 * T, dtype)
    for period in (1, 2):
        runs = []
        for stacked in (True, False):
            model = Stack(dtype)
            opt = SINGD(
                model,
                lr=1e-3,
                T=period,
                lr_cov=0.05,
                structures="diagonal",
                kfac_like=kfac_like,
                factor_dtype=factor_dtype,
            )
            rule = opt._rules["singd"]
            if not stacked:  # no kept stacks: every layer's squares and update alone
                rule._resident.kept = lambda layers, states: None
                rule._update_stacked_diagonal = lambda *args: False
            train(model, opt, data)
            runs.append((model, opt))
            if stacked:  # the group of three 12 -> 12 layers took the stacked path
                assert len(rule._stacked_squares.values()) >= 1
                kept = [entry[0] for entry in rule._stack_rows.values()]
                assert kept and all(map(rule._resident.holds, kept))
        (model, opt), (reference, reference_opt) = runs
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(a, b)
        state, expected = opt.state_dict()["state"], reference_opt.state_dict()["state"]
        for index, entry in expected.items():
            for key, value in entry.items():
                if isinstance(value, dict):
                    for name, part in value.items():
                        assert torch.equal(state[index][key][name], part), (key, name)


@pytest.mark.parametrize("case", ["dense", "diagonal", "block_diagonal"])
def test_group_keys_of_kept_stacks_are_each_layers_key(case):
    """SINGD answers the group keys of layers whose factors are rows of kept stacks from
    the first layer alone; the keys equal each layer's own, for the group, for all layers
    (several shapes), and after a load (new tensors: keys computed one by one)."""
    model = Stack(torch.float32)
    opt = make(model, **CASES[case])
    train(model, opt, batches(T + 1, torch.float32))
    rule, group = opt._rules["singd"], opt.param_groups[0]
    everyone = list(opt._layers)
    body = [next(la for la in everyone if la.weight is model.body[i].weight) for i in (0, 2, 4)]
    for layers in (body, everyone):
        states = [opt.state[layer.weight] for layer in layers]
        pairs = zip(layers, states, strict=True)
        expected = [rule.group_key(layer, group, state) for layer, state in pairs]
        assert rule.group_keys(layers, group, states) == expected
    assert rule._resident.kept(body, [opt.state[layer.weight] for layer in body]) is not None
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    states = [opt.state[layer.weight] for layer in body]
    assert rule._resident.kept(body, states) is None
    assert rule.group_keys(body, group, states) == [
        rule.group_key(layer, group, state) for layer, state in zip(body, states, strict=True)
    ]


@pytest.mark.parametrize("named", [False, True])
def test_resident_stacks_are_kept_while_the_states_hold_their_rows(named):
    """kept() answers the stacks while the states hold the rows of(): not after a row
    was replaced, (named) a part added or taken away, nor for other or fewer layers."""
    layers = [object(), object(), object()]

    def fresh() -> list[dict]:
        if named:
            return [{"K": {"diag": torch.randn(4)}, "C": {"diag": torch.randn(3)}} for _ in layers]
        return [{"K": torch.randn(4), "C": torch.randn(3)} for _ in layers]

    def entry(state, key):
        return state[key]["diag"] if named else state[key]

    resident = grouped.ResidentStacks(("K", "C"), named=named)
    states = fresh()
    values = [entry(s, "K").clone() for s in states]
    stacks = resident.of(layers, states)
    K = stacks["K"]["diag"] if named else stacks["K"]
    assert torch.equal(K, torch.stack(values))
    assert all(entry(s, "K")._base is K._base for s in states)
    assert resident.kept(layers, states) is stacks
    assert resident.of(layers, states) is stacks
    assert resident.kept(layers[:2], states[:2]) is None
    assert resident.kept(layers[::-1], states[::-1]) is None
    replaced = [dict(s) if not named else {k: dict(v) for k, v in s.items()} for s in states]
    if named:
        replaced[2]["C"]["diag"] = torch.randn(3)
    else:
        replaced[2]["C"] = torch.randn(3)
    assert resident.kept(layers, replaced) is None
    if named:
        for change in ("add", "remove"):
            edited = [{k: dict(v) for k, v in s.items()} for s in states]
            if change == "add":
                edited[1]["K"]["extra"] = torch.randn(4)
            else:
                del edited[1]["K"]["diag"]
            assert resident.kept(layers, edited) is None
    assert resident.kept(layers, states) is stacks


def test_gathered_answers_the_stack_the_tensors_are_rows_of():
    """gathered() hands back the stack that holds the tensors as its rows (no copy; the
    same values), and otherwise their copy in a buffer kept with the target stack: for
    a row order that is not the stack's, or a single tensor."""
    layers = [object(), object(), object()]
    states = [{"K": torch.randn(4), "C": torch.randn(3)} for _ in layers]
    resident = grouped.ResidentStacks(("K", "C"), named=False)
    K = resident.of(layers, states)["K"]
    padded = torch.randn(3, 6)
    statistics = list(padded[:, :4].unbind())  # rows of one stack, padded apart
    got = resident.gathered(K, statistics)
    assert got._base is padded and torch.equal(got, padded[:, :4])
    reversed_rows = statistics[::-1]
    copied = resident.gathered(K, reversed_rows)
    assert copied._base is not padded and torch.equal(copied, torch.stack(reversed_rows))
    assert resident.gathered(K, reversed_rows) is copied  # the kept buffer, refilled
    assert torch.equal(resident.gathered(K[:1], statistics[:1]), statistics[0][None])


def test_resident_stacks_trust_a_layout_found_whole_until_the_step_closes():
    """Within a step a layout kept() found whole is answered for the same layers and
    state dicts without walking their entries again (of() too); not for other state
    dicts, not once of() restacked some of its layers, and never outside a step (nor in
    the next step before a walk)."""
    layers = [object(), object(), object()]
    states = [{"K": torch.randn(4), "C": torch.randn(3)} for _ in layers]
    resident = grouped.ResidentStacks(("K", "C"), named=False)
    stacks = resident.of(layers, states)
    states[1]["C"] = torch.randn(3)  # outside a step: every call walks the entries
    assert resident.kept(layers, states) is None
    stacks = resident.of(layers, states)

    resident.open_step()
    assert resident.kept(layers, states) is stacks  # walked, found whole: trusted
    states[1]["C"] = torch.randn(3)  # (what no code of a step does)
    assert resident.kept(layers, states) is stacks  # answered without the walk
    assert resident.kept(layers, [dict(s) for s in states]) is None  # other dicts: walked
    assert resident.of(layers, states) is stacks  # of() trusts it too
    resident.of(layers[:2], states[:2])  # restacks two of the layers: the three let go
    assert resident.kept(layers, states) is None
    stacks = resident.of(layers, states)
    assert resident.kept(layers, states) is stacks
    resident.close_step()
    states[1]["C"] = torch.randn(3)
    assert resident.kept(layers, states) is None
    resident.open_step()  # a new step trusts nothing found in the last
    assert resident.kept(layers, states) is None
    resident.close_step()


@pytest.mark.parametrize("case", ["dense", "diagonal"])
def test_a_step_closes_the_rules_trust_also_when_it_raises(case, monkeypatch):
    """step() opens every rule's step and closes it when the step returns and when it
    raises, so that a layout trusted in a step is walked again after it."""
    model = Stack(torch.float32)
    opt = make(model, **CASES[case])
    data = batches(2, torch.float32)
    train(model, opt, data[:1])
    rule = opt.rule_for(opt.param_groups[0])
    assert rule._resident._trusted is None
    seen = []

    def failing(self, *args, **kwargs):
        seen.append(self._resident._trusted is not None)
        raise RuntimeError("injected")

    monkeypatch.setattr(type(rule), "apply_many", failing)
    with pytest.raises(RuntimeError, match="injected"):
        train(model, opt, data[1:])
    assert seen == [True] and rule._resident._trusted is None


@pytest.mark.parametrize("factor_dtype", [None, torch.bfloat16])
def test_kfac_group_keys_are_each_layers_key(factor_dtype):
    """K-FAC answers the keys of all layers at once: each layer's own key, ("kfac",
    dtype) for factors in the statistics' dtype, None (alone) for low-precision ones."""
    from singd_cuda import KFAC

    model = Stack(torch.float32)
    opt = KFAC(model, lr=0.01, T=1, factor_dtype=factor_dtype)
    train(model, opt, batches(2, torch.float32))
    rule, group = opt.rule_for(opt.param_groups[0]), opt.param_groups[0]
    layers = list(opt._layers)
    states = [opt.state[layer.weight] for layer in layers]
    keys = rule.group_keys(layers, group, states)
    pairs = zip(layers, states, strict=True)
    assert keys == [rule.group_key(layer, group, state) for layer, state in pairs]
    assert keys == [None if factor_dtype else ("kfac", torch.float32)] * len(layers)


def test_positions_by_splits_by_value_in_order_of_first_appearance():
    assert grouped.positions_by([]) == []
    assert grouped.positions_by(["a", "a", "a"]) == [[0, 1, 2]]
    assert grouped.positions_by(["a", "b", "a", "c", "b"]) == [[0, 2], [1, 4], [3]]
    assert grouped.stack_parts(["x", "y", "z"], [1, None, 1]) == [[0, 2], [1]]


def test_singd_started_holds_once_every_warm_start_is_done():
    """SINGD.started: False while a layer's warm start waits (start_factors has work),
    True once every layer is started and for layers without a warm start."""
    model = Stack(torch.float32)
    opt = make(model, warm_start=True)
    rule, group = opt.rule_for(opt.param_groups[0]), opt.param_groups[0]
    states = [{} for _ in opt._layers]
    for layer, state in zip(opt._layers, states, strict=True):
        rule.init_state(layer, group, state)
    assert not rule.started(group, states)
    assert rule.started(group, [{} for _ in states])  # no warm start asked for
    train(model, opt, batches(1, torch.float32))
    assert rule.started(group, [opt.state[layer.weight] for layer in opt._layers])


def test_diagonal_update_lists_go_with_their_stacks():
    """The lists of rows the diagonal factor update keeps belong to kept stacks only: a
    load (new tensors, new stacks at the next update) lets the old ones go."""
    model = Stack(torch.float32)
    opt = make(model, structures="diagonal")
    train(model, opt, batches(T + 1, torch.float32))
    rule = opt._rules["singd"]
    first = [entry[0] for entry in rule._stack_rows.values()]
    assert first and all(map(rule._resident.holds, first))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(model, opt, batches(T + 1, torch.float32))
    stacks = [entry[0] for entry in rule._stack_rows.values()]
    assert len(stacks) == len(first) and all(map(rule._resident.holds, stacks))
    assert not any(map(rule._resident.holds, first))
    assert not {id(s) for s in stacks} & {id(s) for s in first}


def test_count_up_adds_one_to_every_state_and_returns_the_counts_before():
    from singd_cuda.optim.grouped import count_up

    states = [{"n": 0}, {"n": 4, "other": 1}]
    assert count_up(states, "n") == [0, 4]
    assert states == [{"n": 1}, {"n": 5, "other": 1}]
