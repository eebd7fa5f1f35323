"""Single runs: determinism, early stop on non-finite values, time to a target, data."""

from __future__ import annotations

import math

import pytest
import torch

from singd_cuda import SINGD
from singd_cuda.harness.data import (
    TASKS,
    VOCAB,
    corpus_text,
    encode,
    lm_task,
    mnist1d_mlp_task,
    patchify,
)
from singd_cuda.harness.models import MNIST1DCNN, MNIST1DMLP, PatchViT
from singd_cuda.harness.optimizers import OptimizerChoice
from singd_cuda.harness.runner import EVALUATIONS, RunSpec, train

CPU = torch.device("cpu")


def spec(optimizer, precision="fp32", factor="fp32", steps=4, **hparams) -> RunSpec:
    hp = tuple(sorted((hparams or {"lr": 0.05}).items()))
    return RunSpec("mnist1d_mlp", optimizer, precision, factor, 0, steps, hp)


def test_mnist1d_is_generated_locally_with_the_paper_sizes():
    task = mnist1d_mlp_task()
    assert task.train_x.shape == (4000, 40) and task.eval_x.shape == (1000, 40)
    assert set(task.train_y.unique().tolist()) == set(range(10))
    assert task.batch_size == 100


def test_mnist1d_models_have_the_paper_parameter_counts():
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(MNIST1DCNN()) == 5210  # ConvBase: 25 channels, linear 125 -> 10
    assert count(MNIST1DMLP()) == 15210  # MLPBase: hidden 100
    assert MNIST1DCNN()(torch.randn(3, 40)).shape == (3, 10)


@pytest.mark.parametrize("patch", [2, 4])
def test_patchify_cuts_row_major_patches_and_loses_no_pixel(patch):
    images = torch.arange(2 * 64, dtype=torch.float32).view(2, 1, 8, 8)
    tokens = patchify(images, patch)
    side = 8 // patch
    assert tokens.shape == (2, side**2, patch * patch)
    first = [8 * r + c for r in range(patch) for c in range(patch)]  # pixel indices, row-major
    assert tokens[0, 0].tolist() == first
    assert tokens[0, 1].tolist() == [v + patch for v in first]  # the patch to its right
    assert tokens[0, side].tolist() == [v + 8 * patch for v in first]  # the patch below
    assert tokens[1, 0].tolist() == [v + 64 for v in first]  # the second image
    assert torch.equal(tokens.flatten().sort().values, images.flatten())
    two_channels = torch.stack([images[:, 0], -images[:, 0]], dim=1)  # channel-major patches
    assert patchify(two_channels, patch)[0, 0].tolist() == first + [-v for v in first]


def test_digits_vit_is_the_digits_split_as_patches_through_a_vit():
    pytest.importorskip("sklearn")
    digits, vit = TASKS["digits"](), TASKS["digits_vit"]()
    assert vit.train_x.shape == (1437, 16, 4) and vit.eval_x.shape == (360, 16, 4)
    assert torch.equal(vit.train_x, patchify(digits.train_x, 2))
    assert torch.equal(vit.eval_x, patchify(digits.eval_x, 2))
    assert torch.equal(vit.train_y, digits.train_y) and torch.equal(vit.eval_y, digits.eval_y)
    model = vit.make_model()
    assert model(vit.eval_x[:3]).shape == (3, 10)
    blocks = [
        f"blocks.{i}.{n}" for i in (0, 1) for n in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")
    ]
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears == {"embed", "head", *blocks}
    assert set(SINGD(model).preconditioned()) == linears  # q/k/v, out, MLP, embedding, head
    s = RunSpec(
        "digits_vit", OptimizerChoice("singd", "diagonal"), "fp32", "fp32", 0, 3, (("lr", 1e-3),)
    )
    result = train(vit, s, CPU)
    assert result.stable and result.eval_loss[-1] < result.eval_loss[0]


def test_patch_vit_pools_over_patches_and_depends_on_their_positions():
    torch.manual_seed(0)
    model = PatchViT(patches=4, patch_dim=3, dim=8, depth=1, heads=2)
    x = torch.randn(2, 4, 3)
    assert model(x).shape == (2, 10)
    assert not torch.allclose(model(x), model(x.flip(1)))  # learned positions break symmetry
    model.positions.data.zero_()
    torch.testing.assert_close(model(x), model(x.flip(1)))  # otherwise permutation-invariant


def test_batches_depend_only_on_the_seed():
    task = mnist1d_mlp_task()
    assert torch.equal(task.batch_indices(30, 1), task.batch_indices(30, 1))
    assert not torch.equal(task.batch_indices(30, 1), task.batch_indices(30, 2))
    epoch = task.batch_indices(task.train_x.shape[0] // task.batch_size, 0).flatten()
    assert epoch.unique().numel() == epoch.numel()  # no repeats within an epoch


def test_lm_corpus_ships_with_python():
    text = corpus_text()
    assert len(text) > 100_000 and "def " in text
    ids = encode("ab\n\t")
    assert ids.tolist() == [VOCAB.index("a"), VOCAB.index("b"), 0, len(VOCAB)]
    task = lm_task()
    assert torch.equal(task.train_x[:, 1:], task.train_y[:, :-1])
    assert {"mnist1d_mlp", "mnist1d_cnn", "lm"} <= set(TASKS)


def test_runs_are_deterministic_and_record_accuracy_and_time():
    task = mnist1d_mlp_task()
    s = spec(OptimizerChoice("singd", "diagonal"), lr=1e-3)
    first, second = train(task, s, CPU), train(task, s, CPU)
    assert first.stable and first.train_loss == second.train_loss
    assert first.eval_loss == second.eval_loss
    assert first.eval_steps == [0, 1, 2, 3, 4]
    assert all(0.0 <= a <= 1.0 for a in first.eval_accuracy)
    assert first.eval_seconds[0] == 0.0 and first.eval_seconds == sorted(first.eval_seconds)


def test_evaluations_are_spaced_over_the_run():
    r = train(mnist1d_mlp_task(), spec(OptimizerChoice("adamw"), "fp32", "-", 40, lr=1e-3), CPU)
    assert len(r.eval_steps) == EVALUATIONS + 1 and r.eval_steps[-1] == 40


def test_reach_returns_the_first_evaluation_at_or_below_the_target():
    r = train(mnist1d_mlp_task(), spec(OptimizerChoice("adamw"), "fp32", "-", 6, lr=1e-2), CPU)
    start = r.eval_loss[0]
    assert r.reach(start) == (0, 0.0)
    assert r.reach(-1.0) is None
    best = min(r.eval_loss)
    step, seconds = r.reach(best)
    assert r.eval_loss[r.eval_steps.index(step)] == best and seconds > 0


def test_divergent_run_stops_early_and_reports():
    s = spec(OptimizerChoice("adamw"), "bf16-pure", "-", 50, lr=1e30)
    result = train(mnist1d_mlp_task(), s, CPU)
    assert not result.stable and result.status.startswith(("nan@", "error@"))
    assert result.first_nonfinite_step < 50
    assert len(result.step_ms) <= result.first_nonfinite_step
    assert result.final_loss is None and result.final_accuracy is None
    assert result.best_loss is not None and math.isfinite(result.best_loss)


def test_factor_dtype_and_stochastic_rounding_reach_the_optimizer():
    task = mnist1d_mlp_task()
    s = spec(OptimizerChoice("singd", "diagonal"), "bf16-pure-sr", "fp32", 2, lr=0.01, lr_cov=0.1)
    r = train(task, s, CPU)
    assert r.stable
    choice = OptimizerChoice("singd", "diagonal")
    bf16 = train(task, spec(choice, "fp32", "bf16", 2, lr=0.01, lr_cov=0.1), CPU)
    fp32 = train(task, spec(choice, "fp32", "fp32", 2, lr=0.01, lr_cov=0.1), CPU)
    assert bf16.stable and bf16.state_bytes < fp32.state_bytes


def test_llama_lm_is_byte_level_stdlib_source_and_trains_in_bf16_autocast():
    pytest.importorskip("transformers")
    from singd_cuda.harness.data import stdlib_bytes, stdlib_sources

    sources = stdlib_sources()
    assert any(path.name == "os.py" for path in sources)
    ids = stdlib_bytes()
    assert ids.dtype == torch.long and ids.min() >= 0 and ids.max() < 256
    assert ids.numel() == sum(path.stat().st_size for path in sources)
    task = TASKS["llama_lm"]()
    assert task.train_x.shape[1] == 128 and torch.equal(task.train_x[:, 1:], task.train_y[:, :-1])
    s = RunSpec("llama_lm", OptimizerChoice("adamw"), "bf16-amp", "-", 0, 2, (("lr", 1e-2),))
    result = train(task, s, CPU)
    assert result.stable and result.eval_loss[-1] < result.eval_loss[0]
