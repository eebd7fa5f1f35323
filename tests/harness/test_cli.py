"""The harness command end to end on a tiny grid, and its errors for bad options."""

from __future__ import annotations

import json

import pytest

from singd_cuda.harness.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_KEYS = {
    "task": str,
    "optimizer": str,
    "label": str,
    "precision": str,
    "seed": int,
    "lr": float,
    "steps": int,
    "steps_run": int,
    "status": str,
    "state_bytes": int,
    "state_mib": float,
    "median_step_ms": float,
    "train_loss": list,
    "eval_steps": list,
    "eval_loss": list,
}


@pytest.fixture(scope="module")
def tiny_grid(tmp_path_factory):
    """One tiny grid over both tasks, a first- and two second-order optimizers, three modes."""
    out = tmp_path_factory.mktemp("grid")
    argv = ["--optimizers", "adamw", "kfac", "singd", "--structures", "diagonal", "dense"]
    argv += ["--precisions", "fp32", "fp16-amp", "bf16-pure", "--steps", "3", "--seeds", "0"]
    argv += ["--device", "cpu", "--out", str(out)]
    return out, argv


def test_tiny_grid_table_json_and_plots(tiny_grid, capsys):
    out, argv = tiny_grid
    assert main(argv) == 0
    text = capsys.readouterr().out
    for needle in (
        "digits: sklearn digits",
        "lm: char LM",
        "final loss",
        "best loss",
        "stability",
        "vs fp32",
        "state MiB",
        "step ms",
        "singd:diagonal",
        "kfac",
        "fp16-amp",
        "stable",
        "Verdicts",
        str(out),
    ):
        assert needle in text, needle
    assert (out / "report.txt").read_text().count("final loss") == 2

    payload = json.loads((out / "results.json").read_text())
    assert payload["schema"] == "singd_cuda.harness/1"
    assert payload["config"]["steps"] == {"digits": 3, "lm": 3}
    assert len(payload["runs"]) == 2 * 4 * 3  # tasks x (adamw, kfac, 2 structures) x modes
    for run in payload["runs"]:
        for key, kind in RUN_KEYS.items():
            assert isinstance(run[key], kind), (key, run[key])
        assert run["status"] == "stable"
        assert len(run["train_loss"]) == run["steps_run"] == 3
        assert run["eval_steps"] == [0, 1, 2, 3]
        assert run["final_loss"] == run["eval_loss"][-1]
        assert run["rel_fp32"] == pytest.approx(1.0) if run["precision"] == "fp32" else True
        assert run["state_bytes"] > 0
    assert set(payload["verdicts"]) == {"adamw", "kfac", "singd:diagonal", "singd:dense"}

    for name in ("loss_digits.png", "loss_lm.png", "memory.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC


def test_memory_command(tmp_path, capsys):
    argv = ["memory", "--models", "gpt_tiny", "--optimizers", "adamw", "singd"]
    argv += ["--structures", "diagonal", "--factor-dtype", "bfloat16", "--out", str(tmp_path)]
    argv += ["--device", "cpu"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "gpt_tiny" in text and "= formula" in text and "estimate" in text
    rows = json.loads((tmp_path / "memory.json").read_text())["rows"]
    assert [r["label"] for r in rows] == ["adamw", "singd:diagonal"]
    assert all(r["measured_bytes"] == r["formula_bytes"] for r in rows)
    assert (tmp_path / "memory.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    ("argv", "valid"),
    [
        (["--tasks", "mnist"], ["digits", "lm"]),
        (["--optimizers", "sgd"], ["adamw", "kfac", "adafisher", "singd", "ikfac"]),
        (["--precisions", "fp8"], ["fp32", "bf16-amp", "fp16-amp", "bf16-pure"]),
        (["--structures", "banded"], ["dense", "block_diagonal", "hierarchical"]),
        (["--structures", "low_rank:x"], ["low_rank"]),
        (["--lr", "sgd=0.1"], ["adamw", "singd", "ikfac"]),
        (["--lr", "fast"], ["adamw", "singd"]),
        (["--steps", "0"], ["positive integer"]),
        (["--device", "tpu"], ["auto", "cpu", "cuda"]),
        (["memory", "--models", "resnet50"], ["resnet18", "vit_tiny", "gpt_tiny"]),
        (["memory", "--factor-dtype", "fp8"], ["float32", "bfloat16", "float16"]),
    ],
)
def test_bad_option_lists_valid_values(argv, valid, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    for value in valid:
        assert value in error, (value, error)
