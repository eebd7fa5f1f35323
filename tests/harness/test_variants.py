"""Optimizer variants (``--optimizers singd+graft=adam``) and the tune's equal-budget
options (``--grid``, ``--precision``, ``--prune``, ``--resume``)."""

from __future__ import annotations

import json

import pytest
import torch

from singd_cuda.harness.cli import main
from singd_cuda.harness.data import mnist1d_mlp_task
from singd_cuda.harness.optimizers import OptimizerChoice, expand, label_name, parse_variant
from singd_cuda.harness.runner import RunSpec, train

CPU = torch.device("cpu")


def test_a_variant_parses_labels_and_builds_with_its_options():
    assert parse_variant("singd+graft=adam+T=5") == ("singd", (("graft", "adam"), ("T", 5)))
    assert parse_variant("ikfac+normalize_lr_cov=True+warm_start=False") == (
        "ikfac",
        (("normalize_lr_cov", True), ("warm_start", False)),
    )
    (flagged,) = expand(["ikfac+normalize_lr_cov=True"], ["dense"])
    assert flagged.label == "ikfac+normalize_lr_cov=True"
    flagged_group = flagged.build(torch.nn.Sequential(torch.nn.Linear(4, 3)), {"lr": 1e-3})
    assert flagged_group.param_groups[0]["normalize_lr_cov"] is True
    (choice,) = expand(["singd+graft=adam+T=5"], ["diagonal"])
    assert choice.label == "singd:diagonal+graft=adam+T=5"
    assert choice.variant == "singd+graft=adam+T=5"
    assert label_name(choice.label) == "singd" and label_name("kfac+graft=rms") == "kfac"
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    optimizer = choice.build(model, {"lr": 1e-3})
    group = optimizer.param_groups[0]
    assert group["graft"] == "adam" and group["T"] == 5 and group["lr"] == 1e-3
    assert (
        OptimizerChoice("singd", "diagonal").build(model, {"lr": 1e-3}).param_groups[0]["graft"]
        is None
    )
    with pytest.raises(ValueError, match="unknown optimizer 'sing'"):
        parse_variant("sing+graft=adam")
    with pytest.raises(ValueError, match="not KEY=VALUE"):
        parse_variant("singd+graft")


def test_a_variant_is_a_cell_of_its_own_with_its_own_learning_rate(tmp_path, capsys):
    argv = ["--tasks", "mnist1d_mlp", "--optimizers", "kfac", "kfac+graft=rms"]
    argv += ["--precisions", "fp32", "--factors", "fp32", "--steps", "2", "--seeds", "0"]
    argv += ["--lr", "kfac=1e-3", "kfac+graft=rms=3e-4", "--workers", "1", "--device", "cpu"]
    argv += ["--no-timing", "--out", str(tmp_path)]
    assert main(argv) == 0
    runs = {r["label"]: r for r in json.loads((tmp_path / "results.json").read_text())["runs"]}
    assert set(runs) == {"kfac", "kfac+graft=rms"}
    assert runs["kfac"]["hparams"] == {"lr": 1e-3}
    assert runs["kfac+graft=rms"]["hparams"] == {"lr": 3e-4}
    assert runs["kfac+graft=rms"]["options"] == [["graft", "rms"]]
    assert runs["kfac"]["final_loss"] != runs["kfac+graft=rms"]["final_loss"]
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0  # the records load back as the same runs
    assert "2 of the 2 runs already in" in capsys.readouterr().out


def test_prune_stops_a_hopeless_run_and_it_scores_as_failed():
    adamw = ("mnist1d_mlp", OptimizerChoice("adamw"), "fp32", "-", 0, 20, (("lr", 1e-6),))
    pruned = RunSpec(*adamw, (1.0, 0.5))  # lr 1e-6 learns nothing in 20 steps
    result = train(mnist1d_mlp_task(), pruned, CPU)
    assert result.pruned_at == 10 and result.status == "pruned@10"
    assert not result.stable and result.final_loss is None
    assert len(result.step_ms) == 10 and result.eval_steps[-1] == 10
    assert train(mnist1d_mlp_task(), RunSpec(*adamw, (9.0, 0.5)), CPU).status == "stable"


def test_tune_grid_precision_prune_and_resume(tmp_path, capsys):
    argv = ["tune", "--tasks", "mnist1d_mlp", "--optimizers", "adamw", "singd+graft=adam"]
    argv += ["--structures", "diagonal", "--steps", "4", "--precision", "bf16-amp"]
    argv += ["--grid", "adamw=1e-3,1e-2", "singd+graft=adam=1e-4,1e-3", "--prune", "0.5@0.5"]
    argv += ["--workers", "1", "--device", "cpu", "--out", str(tmp_path)]
    assert main([*argv, "--resume"]) == 0
    records = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [(r["label"], r["hparams"]["lr"]) for r in records] == [
        ("adamw", 1e-3),
        ("adamw", 1e-2),
        ("singd:diagonal+graft=adam", 1e-4),
        ("singd:diagonal+graft=adam", 1e-3),
    ]
    assert {r["precision"] for r in records} == {"bf16-amp"}
    assert all(r["status"] == "pruned@2" for r in records)  # nothing reaches 0.5 in 4 steps
    assert "pruned@2" in (tmp_path / "sweep.md").read_text()
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    assert "4 of the 4 runs already in" in capsys.readouterr().out


def test_tune_refuses_unequal_budgets(capsys):
    argv = ["tune", "--optimizers", "adamw", "singd", "--grid", "adamw=1e-3,1e-2"]
    with pytest.raises(SystemExit):
        main(argv)
    assert "give every one the same number" in capsys.readouterr().err
