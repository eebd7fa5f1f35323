"""The peers in the harness: momentum SGD always, heavyball's SOAP, PSGD-Kron and Muon
when the optional ``peers`` extra is installed (skipped otherwise); parameter routing of
Muon, the --set ablations, and the error that names the extra."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from singd_cuda.harness import cli, peers
from singd_cuda.harness.cli import main
from singd_cuda.harness.data import mnist1d_mlp_task
from singd_cuda.harness.memory import state_bytes, tensor_bytes
from singd_cuda.harness.models import GPT, GPTConfig
from singd_cuda.harness.optimizers import HEAVYBALL_OPTIMIZERS, OPTIMIZERS, OptimizerChoice
from singd_cuda.harness.runner import RunSpec, train

CPU = torch.device("cpu")
needs_heavyball = pytest.mark.skipif(
    not peers.heavyball_available(), reason="heavyball (the peers extra) is not installed"
)


def tiny_gpt() -> GPT:
    return GPT(GPTConfig(vocab=11, context=6, dim=8, depth=1, heads=2))


def test_every_optimizer_gets_the_same_number_of_trials():
    assert {len(entry.tune_grid) for entry in OPTIMIZERS.values()} == {6}


def test_momentum_sgd_trains_and_keeps_one_buffer_per_parameter():
    task = mnist1d_mlp_task()
    spec = RunSpec("mnist1d_mlp", OptimizerChoice("sgd"), "fp32", "-", 0, 3, (("lr", 0.05),))
    result = train(task, spec, CPU)
    assert result.stable and result.eval_loss[-1] < result.eval_loss[0]
    params = list(task.make_model().parameters())
    assert result.state_bytes == tensor_bytes(params)  # momentum_buffer, fp32


def test_muon_trains_hidden_matrices_only():
    model = tiny_gpt()
    hidden = {id(p) for p in peers.hidden_matrices(model)}
    names = {n for n, p in model.named_parameters() if id(p) in hidden}
    assert names == {"blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight"} | {
        "blocks.0.mlp.0.weight",
        "blocks.0.mlp.2.weight",
    }  # not the head, the embeddings, biases or norms


@needs_heavyball
@pytest.mark.parametrize("name", HEAVYBALL_OPTIMIZERS)
def test_heavyball_peer_covers_every_parameter_and_trains(name):
    torch.manual_seed(0)
    model = tiny_gpt()
    optimizer = OptimizerChoice(name).build(model, {"lr": 1e-3})
    idx = torch.randint(11, (4, 6))
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        optimizer.zero_grad()
        F.cross_entropy(model(idx).flatten(0, 1), idx.roll(1, 1).flatten()).backward()
        optimizer.step()
    after = list(model.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert state_bytes(optimizer) > 0


@needs_heavyball
@pytest.mark.parametrize("name", HEAVYBALL_OPTIMIZERS)
def test_heavyball_peer_runs_in_the_harness(name):
    spec = RunSpec("mnist1d_mlp", OptimizerChoice(name), "fp32", "-", 0, 2, (("lr", 1e-3),))
    result = train(mnist1d_mlp_task(), spec, CPU)
    assert result.stable, result.error
    assert result.state_bytes > 0 and len(result.step_ms) == 2


@needs_heavyball
def test_muon_fallback_lr_reaches_its_adamw_part():
    optimizer = OptimizerChoice("muon").build(tiny_gpt(), {"lr": 0.02, "fallback_lr": 0.007})
    muon, adamw = optimizer.optimizers
    assert muon.param_groups[0]["lr"] == 0.02 and adamw.param_groups[0]["lr"] == 0.007


def test_missing_heavyball_names_the_extra(monkeypatch, capsys):
    monkeypatch.setattr(cli, "heavyball_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--optimizers", "adamw", "soap", "--steps", "1"])
    assert exit_info.value.code == 2
    assert "[peers]" in capsys.readouterr().err


def test_set_ablations_reach_the_runs(tmp_path):
    argv = ["--tasks", "mnist1d_mlp", "--optimizers", "adamw", "singd", "--structures"]
    argv += ["diagonal", "--factors", "fp32", "--steps", "2", "--seeds", "0", "--workers"]
    argv += ["1", "--device", "cpu", "--lr", "adamw=0.004", "--out", str(tmp_path)]
    argv += ["--set", "singd.T=3", "singd.fallback_lr=adamw", "singd.loss_average=batch"]
    assert main(argv) == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    singd = next(r for r in payload["runs"] if r["optimizer"] == "singd")
    assert singd["status"] == "stable"
    assert singd["hparams"]["T"] == 3 and singd["hparams"]["fallback_lr"] == 0.004
    assert singd["hparams"]["loss_average"] == "batch"
    assert payload["settings"]["mnist1d_mlp/singd:diagonal"][1].endswith("--set")
    assert "T=3" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("text", ["singd", "lion.T=3", "singd.=3", "singd.T="])
def test_bad_set_names_the_form(text, capsys):
    with pytest.raises(SystemExit):
        main(["--set", text])
    assert "OPT.KEY=VALUE" in capsys.readouterr().err


def test_ablate_runs_one_change_at_a_time_against_adamw(tmp_path):
    argv = ["ablate", "--task", "mnist1d_mlp", "--structure", "diagonal", "--steps", "2"]
    argv += ["--seeds", "0", "--workers", "1", "--out", str(tmp_path), "--variants"]
    argv += ["base", "fallback lr tied to AdamW's", "T=1", "structure dense", "steps x4"]
    assert main(argv) == 0
    table = (tmp_path / "ablations.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "variant" not in line]
    assert len(rows) == 5
    assert "T=1" in rows[2] and "singd:dense" in rows[3] and rows[4].rstrip(" |").endswith("8")
    tied = json.loads((tmp_path / "fallback-lr-tied-to-adamw-s" / "results.json").read_text())
    adamw_lr = json.loads((tmp_path / "adamw-2" / "results.json").read_text())["runs"][0]
    assert tied["runs"][0]["hparams"]["fallback_lr"] == adamw_lr["hparams"]["lr"]
    assert (tmp_path / "adamw-8" / "report.md").exists()


def test_ablate_resumes_and_collects_earlier_variants(tmp_path, capsys):
    argv = ["ablate", "--task", "mnist1d_mlp", "--structure", "diagonal", "--steps", "1"]
    argv += ["--seeds", "0", "--workers", "1", "--out", str(tmp_path), "--variants"]
    assert main([*argv, "T=1"]) == 0
    assert main([*argv, "base", "T=1"]) == 0  # T=1 is not run again
    assert "T=1 already in" in capsys.readouterr().out
    table = (tmp_path / "ablations.md").read_text()
    assert "| base |" in table and "| T=1 |" in table
