"""The analytic optimizer-state formula equals the measured bytes, per structure."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from singd_cuda.harness.cli import main
from singd_cuda.harness.memory import (
    MEMORY_MODELS,
    formula_bytes,
    measure,
    state_bytes,
    structure_entries,
)
from singd_cuda.harness.optimizers import STRUCTURES, OptimizerChoice

CHOICES = [
    OptimizerChoice("adamw"),
    OptimizerChoice("kfac"),
    OptimizerChoice("adafisher"),
    OptimizerChoice("ikfac"),
    *(OptimizerChoice("singd", s) for s in STRUCTURES),
    OptimizerChoice("singd", "block_diagonal:5"),
    OptimizerChoice("singd", "low_rank:3"),
    OptimizerChoice("singd", "hierarchical:4,3"),
]


class Mixed(nn.Module):
    """Conv with and without bias (one grouped), Linear, LayerNorm, Embedding, a free
    parameter: every kind of parameter the formula distinguishes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.conv1 = nn.Conv2d(6, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 37)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, idx):
        x = self.embed(idx).permute(0, 3, 1, 2)
        x = self.conv2(torch.relu(self.conv1(x))).mean((2, 3))
        return self.fc(self.norm(x)) * self.scale


@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: c.label)
def test_formula_equals_measured_state(choice, factor_dtype):
    torch.manual_seed(0)
    model = Mixed()
    optimizer = choice.build(model, {"lr": 1e-3}, factor_dtype)
    idx = torch.randint(11, (4, 5, 5))
    F.cross_entropy(model(idx), torch.randint(37, (4,))).backward()
    optimizer.step()
    assert state_bytes(optimizer) == formula_bytes(model, choice, factor_dtype)


@pytest.mark.parametrize("graft", ["adam", "rms"])
@pytest.mark.parametrize(
    "choice",
    [
        OptimizerChoice("singd", "block_diagonal:5"),
        OptimizerChoice("ikfac"),
        OptimizerChoice("kfac"),
        OptimizerChoice("adafisher"),
    ],
    ids=lambda c: c.label,
)
def test_formula_with_graft_equals_measured_state(choice, graft):
    """graft="adam": a second moment per weight and bias; "rms": nothing."""
    torch.manual_seed(0)
    model = Mixed()
    optimizer = choice.build(model, {"lr": 1e-3, "graft": graft}, torch.float32)
    idx = torch.randint(11, (4, 5, 5))
    F.cross_entropy(model(idx), torch.randint(37, (4,))).backward()
    optimizer.step()
    measured = state_bytes(optimizer)
    assert measured == formula_bytes(model, choice, torch.float32, graft=graft)
    if graft == "adam":
        assert measured > formula_bytes(model, choice, torch.float32)


@pytest.mark.parametrize("spec", [*STRUCTURES, "block_diagonal:5", "hierarchical:4,3"])
@pytest.mark.parametrize("d", [1, 2, 7, 31, 64])
def test_structure_entries_match_storage(spec, d):
    from singd_cuda import structures

    assert structures.get(spec).eye(d).nbytes == 4 * structure_entries(spec, d)


def test_memory_command_with_graft(tmp_path):
    """``memory --graft adam``: the preconditioned optimizers' rows measure and count the
    second moments (one buffer per weight and bias); AdamW's row is as it was."""
    argv = ["memory", "--models", "gpt_tiny", "--optimizers", "adamw", "adafisher", "kfac"]
    argv += ["--graft", "adam", "--out", str(tmp_path), "--device", "cpu"]
    assert main(argv) == 0
    payload = json.loads((tmp_path / "memory.json").read_text())
    assert payload["graft"] == "adam"
    rows = payload["rows"]
    assert [(r["label"], r["graft"]) for r in rows] == [
        ("adamw", None),
        ("adafisher graft=adam", "adam"),
        ("kfac graft=adam", "adam"),
    ]
    assert all(r["measured_bytes"] == r["formula_bytes"] for r in rows)
    for row, name in zip(rows[1:], ("adafisher", "kfac"), strict=True):
        plain = measure("gpt_tiny", OptimizerChoice(name), torch.float32, torch.device("cpu"))
        model = MEMORY_MODELS["gpt_tiny"][0]()
        weights = sum(
            p.numel() * p.element_size()
            for m in model.modules()
            if isinstance(m, nn.Linear | nn.Conv2d)
            for p in m.parameters(recurse=False)
        )
        assert row["measured_bytes"] - plain.measured_bytes == weights
