"""The harness command end to end on a tiny grid (in-process and in worker processes),
the tune command's output format, and its errors for bad options."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from singd_cuda.harness import tune as tuning
from singd_cuda.harness.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_KEYS = {
    "task": str,
    "optimizer": str,
    "label": str,
    "precision": str,
    "factor": str,
    "seed": int,
    "hparams": dict,
    "steps": int,
    "steps_run": int,
    "status": str,
    "state_bytes": int,
    "median_step_ms": float,
    "train_loss": list,
    "eval_steps": list,
    "eval_loss": list,
    "eval_accuracy": list,
    "eval_seconds": list,
}
CELL_KEYS = (
    "loss_mean",
    "loss_std",
    "accuracy_mean",
    "failed_seeds",
    "verdict",
    "steps_to_target",
    "seconds_to_target",
    "time_vs_adamw",
    "state_mib",
)


@pytest.fixture(scope="module")
def tiny_grid(tmp_path_factory):
    """A first- and a second-order optimizer, two model precisions, both factor
    precisions, two seeds, two steps; runs in this process (--workers 1)."""
    out = tmp_path_factory.mktemp("grid")
    argv = ["--tasks", "mnist1d_mlp", "--optimizers", "adamw", "singd"]
    argv += ["--structures", "diagonal", "--precisions", "fp32", "bf16-pure-sr"]
    argv += ["--steps", "2", "--seeds", "0", "1", "--workers", "1"]
    argv += ["--timing-rounds", "2", "--timing-block", "2"]
    argv += ["--device", "cpu", "--out", str(out)]
    return out, argv


def test_tiny_grid_report_json_and_plots(tiny_grid, capsys):
    out, argv = tiny_grid
    assert main(argv) == 0
    text = capsys.readouterr().out
    for needle in ("mnist1d_mlp:", "held-out loss", "ETA", "singd:diagonal", "bf16-pure-sr"):
        assert needle in text, needle
    assert text.rstrip().splitlines()[-1].endswith("memory.png)")
    assert str(out / "report.md") in text.rstrip().splitlines()[-1]

    report = (out / "report.md").read_text()
    for needle in ("## Verdict rule", "standard errors", "## Time to target", "paper: MLP", "68"):
        assert needle in report, needle
    assert "2 rounds of 2 steps" in report and "| s to target (timed) |" in report
    assert "parallel grid" not in report.split("## Settings")[1]  # no untimed time column
    timing = json.loads((out / "timing.json").read_text())
    assert timing["threads"] == 1 and timing["clock"] == "cpu"
    assert [len(c["cpu_ms"]) for c in timing["cells"]] == [2] * 5  # one per cell, 2 rounds

    payload = json.loads((out / "results.json").read_text())
    assert payload["schema"] == "singd_cuda.harness/2"
    assert payload["timing"]["rounds"] == 2 and "cells" not in payload["timing"]
    assert payload["config"]["steps"] == {"mnist1d_mlp": 2}
    # adamw fp32 (no stochastic rounding for AdamW), singd in 2 precisions x 2 factor
    # dtypes; 2 seeds each
    assert len(payload["runs"]) == (1 + 4) * 2
    for run in payload["runs"]:
        for key, kind in RUN_KEYS.items():
            assert isinstance(run[key], kind), (key, run[key])
        assert run["factor"] == ("-" if run["optimizer"] == "adamw" else run["factor"])
        assert run["eval_steps"] == [0, 1, 2] or run["status"] != "stable"
    assert len(payload["cells"]) == 1 + 4
    for cell in payload["cells"]:
        assert all(key in cell for key in CELL_KEYS)
        assert cell["seeds"] == 2
        assert cell["timed_step_ms"] is not None or cell["timing_error"]
    lines = (out / "runs.jsonl").read_text().splitlines()
    assert len(lines) == len(payload["runs"])  # written as the runs finished

    for name in ("curves_mnist1d_mlp.png", "time_to_target.png", "memory.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC


def test_report_is_rebuilt_from_a_partial_grid(tiny_grid, tmp_path, capsys):
    out, _ = tiny_grid
    lines = (out / "runs.jsonl").read_text().splitlines()[:5]  # as if interrupted
    (tmp_path / "runs.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["report", str(tmp_path)]) == 0
    assert "interrupted" in (tmp_path / "report.md").read_text()
    partial = json.loads((tmp_path / "results.json").read_text())
    assert len(partial["runs"]) == 5
    assert partial["config"]["tasks"] == ["mnist1d_mlp"]  # the docs render it per task
    assert main(["report", str(out)]) == 0  # and from a finished grid's results.json
    assert str(out / "report.md") in capsys.readouterr().out


def test_resume_runs_only_what_is_missing(tmp_path, capsys):
    """--resume on a folder with part of the grid's runs, a run of another learning rate
    and a line torn by a kill: the missing runs (the other learning rate's too) run, seed
    by seed; the report holds all of the grid's runs, equal to those of an uninterrupted
    grid, and the records of other runs move out of runs.jsonl."""
    grid = ["--tasks", "mnist1d_mlp", "--optimizers", "adamw", "singd", "--structures"]
    grid += ["diagonal", "--precisions", "fp32", "--factors", "fp32", "--steps", "2"]
    grid += ["--seeds", "0", "1", "--workers", "1", "--device", "cpu", "--no-timing"]
    whole = tmp_path / "whole"
    assert main([*grid, "--out", str(whole)]) == 0
    reference = json.loads((whole / "results.json").read_text())["runs"]
    key = ("label", "seed")
    assert [tuple(r[k] for k in key) for r in reference] == [
        ("adamw", 0),
        ("adamw", 1),
        ("singd:diagonal", 0),
        ("singd:diagonal", 1),
    ]
    first, *_, last = (whole / "runs.jsonl").read_text().splitlines()
    other_lr = json.loads(last)  # singd seed 1 at another learning rate: not this grid's
    other_lr["hparams"]["lr"] *= 3
    other_lr["final_loss"] = 123.0
    part = tmp_path / "part"
    part.mkdir()
    (part / "runs.jsonl").write_text(f"{first}\n{json.dumps(other_lr)}\n{last[:40]}")
    capsys.readouterr()

    assert main([*grid, "--out", str(part), "--resume"]) == 0
    text = capsys.readouterr().out
    assert "1 of the 4 runs already in" in text and "2 other record(s) moved" in text
    ran = [line.split(": ")[0].split("] ")[1] for line in text.splitlines() if "/3]" in line]
    assert ran == [  # seed by seed; adamw seed 0 is not run again
        "mnist1d_mlp singd:diagonal fp32/fp32 seed 0",
        "mnist1d_mlp adamw fp32/- seed 1",
        "mnist1d_mlp singd:diagonal fp32/fp32 seed 1",
    ]
    payload = json.loads((part / "results.json").read_text())
    runs = payload["runs"]
    assert [tuple(r[k] for k in key) for r in runs] == [tuple(r[k] for k in key) for r in reference]
    for run, expected in zip(runs, reference, strict=True):
        assert run["hparams"] == expected["hparams"]
        assert run["final_loss"] == pytest.approx(expected["final_loss"], rel=1e-6)
    assert payload["resumed"] == 1 and payload["run_count"] == 4
    assert "1 of them loaded from runs.jsonl with --resume" in (part / "report.md").read_text()
    assert len(payload["cells"]) == 2 and all(c["seeds"] == 2 for c in payload["cells"])
    # runs.jsonl holds exactly the grid's runs; the others are kept aside
    assert len((part / "runs.jsonl").read_text().splitlines()) == 4
    aside = (part / "runs_superseded.jsonl").read_text().splitlines()
    assert json.loads(aside[0])["final_loss"] == 123.0 and aside[1] == last[:40]

    # everything recorded: nothing runs, the report is rebuilt with all four
    assert main([*grid, "--out", str(part), "--resume"]) == 0
    text = capsys.readouterr().out
    assert "4 of the 4 runs already in" in text and "/4]" not in text
    assert len(json.loads((part / "results.json").read_text())["runs"]) == 4


def test_without_timing_the_times_say_parallel_grid_and_timing_retimes(tmp_path, capsys):
    """--no-timing: the time columns are labelled "parallel grid"; ``timing FOLDER`` then
    times the recorded cells and rebuilds the report with "timed" columns."""
    argv = ["--tasks", "mnist1d_mlp", "--optimizers", "adamw", "kfac", "--precisions"]
    argv += ["fp32", "--factors", "bf16", "--steps", "2", "--seeds", "0", "1", "--workers"]
    argv += ["1", "--device", "cpu", "--no-timing", "--out", str(tmp_path)]
    assert main(argv) == 0
    report = (tmp_path / "report.md").read_text()
    assert "| s to target (parallel grid) |" in report and "(timed)" not in report
    assert not (tmp_path / "timing.json").exists()
    assert main(["timing", str(tmp_path), "--timing-rounds", "2", "--timing-block", "2"]) == 0
    assert "timing pass: 2 cells x 2 rounds" in capsys.readouterr().out
    report = (tmp_path / "report.md").read_text()
    assert "| s to target (timed) |" in report and "(parallel grid)" not in report
    cells = json.loads((tmp_path / "results.json").read_text())["cells"]
    assert all(len(c["timed_step_ms"]) == 3 for c in cells)


def test_default_grid_is_the_mission():
    """The default run: the CNN and the character LM; K-FAC, SINGD, AdaFisher and AdamW;
    fp32, bf16 autocast, fp16 autocast + GradScaler and pure bf16; fp32 and bf16
    factors; 3 seeds."""
    from singd_cuda.harness.cli import (
        argv_is_default,
        build_specs,
        expand,
        grid_values,
        steps_for,
        train_parser,
    )

    args = train_parser().parse_args([])
    assert argv_is_default(args) and not argv_is_default(train_parser().parse_args(["--full"]))
    tasks = grid_values(args, "tasks")
    choices = expand(grid_values(args, "optimizers"), grid_values(args, "structures"))
    specs, _ = build_specs(args, tasks, choices, steps_for(args, tasks, quick=True))
    cells = {s.cell for s in specs}
    assert {c[0] for c in cells} == {"mnist1d_cnn", "lm"}
    assert {c[1] for c in cells} == {"adamw", "kfac", "adafisher", "singd:block_diagonal:32"}
    precisions = {"fp32", "bf16-amp", "fp16-amp", "bf16-pure"}
    for task in ("mnist1d_cnn", "lm"):
        for precision in precisions:
            assert (task, "adamw", precision, "-") in cells
            for factor in ("fp32", "bf16"):
                assert (task, "kfac", precision, factor) in cells
    assert {c[2] for c in cells} == precisions
    assert len(specs) == 3 * len(cells)


def test_resume_needs_out(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--tasks", "mnist1d_mlp", "--resume"])
    assert exit_info.value.code == 2
    assert "--resume needs --out" in capsys.readouterr().err


def test_grid_in_worker_processes(tmp_path, capsys):
    """Two worker processes; the character LM as the second task."""
    argv = ["--tasks", "mnist1d_mlp", "lm", "--optimizers", "adamw", "singd", "--structures"]
    argv += ["diagonal", "--precisions", "fp32", "--factors", "fp32", "--steps", "2"]
    argv += ["--seeds", "0", "--workers", "2", "--device", "cpu", "--out", str(tmp_path)]
    argv += ["--no-timing"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "with 2 worker(s)" in text and "[4/4]" in text and "lm:" in text
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert sorted((r["task"], r["label"]) for r in runs) == [
        ("lm", "adamw"),
        ("lm", "singd:diagonal"),
        ("mnist1d_mlp", "adamw"),
        ("mnist1d_mlp", "singd:diagonal"),
    ]


def test_tune_writes_chosen_values_and_the_sweep(tmp_path, capsys):
    argv = ["--tasks", "mnist1d_mlp", "--optimizers", "adamw", "singd", "--structures"]
    argv += ["diagonal", "--steps", "2", "--workers", "1", "--device", "cpu"]
    argv += ["--out", str(tmp_path)]
    assert main(["tune", *argv]) == 0
    payload = json.loads((tmp_path / "tuned.json").read_text())
    chosen = payload["chosen"]["mnist1d_mlp"]
    assert set(chosen) == {"adamw", "singd:diagonal"}
    assert set(chosen["adamw"]) == {"lr"} and set(chosen["singd:diagonal"]) == {"lr"}
    trials = [row["label"] for row in payload["sweep"]]
    assert trials.count("adamw") == trials.count("singd:diagonal") == 6  # same budget
    assert payload["command"].startswith("python -m singd_cuda.harness tune")
    sweep = (tmp_path / "sweep.md").read_text()
    assert sweep.count("**chosen**") == 2 and "| lr |" in sweep

    module = tmp_path / "tuned_copy.py"
    tuning.record(payload["chosen"], payload, module)
    spec = importlib.util.spec_from_file_location("tuned_copy", module)
    recorded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recorded)
    # merged over what was recorded: the earlier commands and other tasks' step counts stay
    assert f"{tuning.tuned.COMMAND} && {payload['command']}" == recorded.COMMAND
    assert recorded.STEPS == {**tuning.tuned.STEPS, "mnist1d_mlp": 2}
    assert recorded.TUNED["mnist1d_mlp"]["adamw"] == chosen["adamw"]


def test_record_writes_the_module_as_ruff_formats_it(tmp_path):
    """Re-recording the recorded values reproduces the committed (ruff-formatted) module
    byte for byte, long dicts split one item per line."""
    from singd_cuda.harness import tuned

    module = tmp_path / "tuned_copy.py"
    meta = {"command": tuned.COMMAND, "created": tuned.CREATED, "steps": tuned.STEPS}
    tuning.record({}, meta, module)
    assert module.read_text() == Path(tuned.__file__).read_text()


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
        (["--tasks", "mnist"], ["mnist1d_mlp", "mnist1d_cnn", "lm"]),
        (["--optimizers", "lion"], ["adamw", "kfac", "adafisher", "singd", "ikfac", "sgd"]),
        (["--optimizers", "lion"], ["soap", "psgd_kron", "muon"]),
        (["--precisions", "fp8"], ["fp32", "bf16-amp", "fp16-amp", "bf16-pure", "bf16-pure-sr"]),
        (["--factors", "fp8"], ["fp32", "bf16"]),
        (["--structures", "banded"], ["dense", "block_diagonal", "hierarchical"]),
        (["--structures", "low_rank:x"], ["low_rank"]),
        (["--lr", "lion=0.1"], ["adamw", "singd", "ikfac", "muon"]),
        (["--lr", "fast"], ["adamw", "singd"]),
        (["--steps", "0"], ["positive integer"]),
        (["--workers", "0"], ["positive integer"]),
        (["--device", "tpu"], ["auto", "cpu", "cuda"]),
        (["tune", "--optimizers", "lion"], ["adamw", "singd", "soap"]),
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
