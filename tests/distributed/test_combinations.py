"""DDP and FSDP2 with a tied head, DDP + torch.compile, and FSDP2 with AMP, on 2 gloo ranks, each
against its single-process counterpart (combo_scenarios.py); one launch for all."""

from __future__ import annotations

import pytest

from . import combo_scenarios as cs
from .launch import launch

JOBS = {
    "ddp-tied-head": ("tied", {}),
    "ddp-tied-head-compiled": ("tied", {"compile": True}),
    "ddp-tied-head-kfac": ("tied", {"optimizer": "kfac"}),
    "ddp-tied-head-adafisher": ("tied", {"optimizer": "adafisher"}),
    "fsdp-tied-head": ("tied", {"fsdp": True}),
    "fsdp-tied-head-kfac": ("tied", {"fsdp": True, "optimizer": "kfac"}),
    "fsdp-tied-head-adafisher": ("tied", {"fsdp": True, "optimizer": "adafisher"}),
    "fsdp-untied-head-in-root-kfac": ("tied", {"fsdp": True, "untied": True, "optimizer": "kfac"}),
    "fsdp-bf16-dense": ("fsdp-amp", {"amp": "bf16", "structures": "dense"}),
    "fsdp-bf16-diagonal": ("fsdp-amp", {"amp": "bf16", "structures": "diagonal"}),
    "fsdp-fp16-scaler-dense": ("fsdp-amp", {"amp": "fp16", "structures": "dense"}),
}


@pytest.fixture(scope="module")
def combos() -> dict[str, list[dict]]:
    per_rank = launch(2, cs.run_many, list(JOBS.values()), timeout=300)
    return {key: [r[i] for r in per_rank] for i, key in enumerate(JOBS)}


def single(key: str) -> dict:
    return cs.run_many(0, 1, [JOBS[key]])[0]


def max_diff(first, second) -> float:
    return max((a - b).abs().max().item() for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("key", [k for k in JOBS if "tied" in k])
def test_tied_head_matches_one_process(combos, key):
    """The head tied to the embedding is one preconditioned layer, as in one process,
    for every optimizer, under DDP and FSDP2 (the tied weight in the root's unit: its
    statistics commit in FSDP2's final backward callback), and so is an untied head in
    the root's unit."""
    ranks, ref = combos[key], single(key)
    assert ranks[0]["layers"] == ref["layers"] == ["head", "mix"]
    assert max_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0
    assert max_diff(ref["params"], ranks[0]["params"]) <= 1e-10


@pytest.mark.parametrize("key", [k for k in JOBS if k.startswith("fsdp") and "tied" not in k])
def test_fsdp_amp_matches_one_process_to_its_precision(combos, key):
    """The sharded and the single-process autocast runs agree to a small fraction of how
    far training moved the parameters. Half-precision rounding, amplified by the
    preconditioner, differs with the batch split and the thread count (about 1-4 % of
    the movement here, and as much between autocast and float32); a loss scale left on
    the gradients or statistics, or a factor-of-two scaling slip, moves them by about
    the whole movement. Every step is taken."""
    ref = single(key)
    moved = max_diff(cs.full_params(cs.make_model()), ref["params"])
    diff = max_diff(ref["params"], combos[key][0]["params"])
    assert diff <= 0.1 * moved, f"{key}: sharded differs by {diff:.3g}, moved {moved:.3g}"
    assert combos[key][0]["steps"] == ref["steps"] == cs.STEPS
