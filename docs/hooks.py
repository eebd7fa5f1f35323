"""MkDocs hooks: pages generated from the recorded results at build time.

- ``records/<name>.md``: each benchmark record in ``benchmarks/results/`` (its command
  included), as recorded, so the performance pages link to the numbers themselves.
- ``test_run_sentence()``: the size (and, when recorded, the duration) of the default test
  run from ``benchmarks/results/test_run.json``, which the README and Getting started
  carry (``tests/docs`` checks their copies).
- ``evidence.md``: the marker ``<!-- harness-tables -->`` is replaced by tables rendered
  from every recorded harness run's ``results.json`` (``benchmarks/results/harness*/``),
  and ``<!-- harness-headline -->`` by :func:`headline_table`, which the README carries
  too (``tests/docs`` checks that the README's copy equals the rendering).

The rendering functions need only the standard library; MkDocs is imported inside the
hooks that need it, so the tests can import this file without the docs extra.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
HARNESS = RESULTS / "harness"

TEST_RUN = RESULTS / "test_run.json"


def test_run_sentence(path: Path = TEST_RUN) -> str:
    """The recorded size of the default test run (and its duration, when one was timed)."""
    record = json.loads(path.read_text())
    sentence = (
        f"The default test run has {record['selected']:,} tests ({record['deselected']:,} slow "
        f"or GPU tests deselected; `-m slow` / `-m gpu` select them; counted {record['date']})"
    )
    duration = record.get("duration")
    if duration:
        minutes = duration["seconds"] / 60
        sentence += f" and took {minutes:.0f} minutes on {duration['machine']} ({duration['date']})"
    return sentence + "."


# Benchmark records published as pages: (record file, page name).
RECORDS = {
    "vs_peers.md": "vs_peers.md",
    "structures.md": "structures.md",
    "depth.md": "depth.md",
    "compile.md": "compile.md",
    "host_cost.md": "host_cost.md",
    "host_cost_2026-12-02.md": "host_cost_2026-12-02.md",
    "host_cost_3ce7984.md": "host_cost_3ce7984.md",
    "host_cost_182f0cd.md": "host_cost_182f0cd.md",
    "host_cost_3e85ed8.md": "host_cost_3e85ed8.md",
    "host_cost_1a617ab.md": "host_cost_1a617ab.md",
    "host_cost_a42e13e.md": "host_cost_a42e13e.md",
    "host_cost_726c568.md": "host_cost_726c568.md",
    "host_cost_9b05ab1.md": "host_cost_9b05ab1.md",
    "host_cost_263dd9a.md": "host_cost_263dd9a.md",
    "host_cost_d4f0379.md": "host_cost_d4f0379.md",
    "host_cost_b5201e6.md": "host_cost_b5201e6.md",
    "host_cost_e978fbf.md": "host_cost_e978fbf.md",
    "host_cost_e948122.md": "host_cost_e948122.md",
    "host_cost_9c2aba8.md": "host_cost_9c2aba8.md",
    "host_cost_a60f0d5.md": "host_cost_a60f0d5.md",
    "host_cost_f2f0c12.md": "host_cost_f2f0c12.md",
    "host_cost_cfaa65b.md": "host_cost_cfaa65b.md",
    "host_cost_24873f3.md": "host_cost_24873f3.md",
    "host_cost_1ccc87e.md": "host_cost_1ccc87e.md",
    "host_cost_b9eb351_run2.md": "host_cost_b9eb351_run2.md",
    "host_cost_b9eb351_run3.md": "host_cost_b9eb351_run3.md",
    "host_cost_eac60a5.md": "host_cost_eac60a5.md",
    "host_cost_36577b8.md": "host_cost_36577b8.md",
    "host_cost_cc0def1_run2.md": "host_cost_cc0def1_run2.md",
    "host_cost_cc0def1_run3.md": "host_cost_cc0def1_run3.md",
    "host_cost_cc0def1.md": "host_cost_cc0def1.md",
    "host_cost_2560488_run2.md": "host_cost_2560488_run2.md",
    "host_cost_2560488_run3.md": "host_cost_2560488_run3.md",
    "host_cost_2560488.md": "host_cost_2560488.md",
    "host_cost_8ee25c1.md": "host_cost_8ee25c1.md",
    "host_cost_b141036_run2.md": "host_cost_b141036_run2.md",
    "host_cost_b141036_run3.md": "host_cost_b141036_run3.md",
    "host_cost_b141036.md": "host_cost_b141036.md",
    "host_cost_dd19647.md": "host_cost_dd19647.md",
    "host_cost_52210fb_run2.md": "host_cost_52210fb_run2.md",
    "host_cost_52210fb_run3.md": "host_cost_52210fb_run3.md",
    "host_cost_52210fb.md": "host_cost_52210fb.md",
    "host_cost_52210fb_second.md": "host_cost_52210fb_second.md",
    "host_cost_0d718b9_run2.md": "host_cost_0d718b9_run2.md",
    "host_cost_0d718b9_run3.md": "host_cost_0d718b9_run3.md",
    "host_cost_0d718b9.md": "host_cost_0d718b9.md",
    "host_cost_815d5a3.md": "host_cost_815d5a3.md",
    "host_cost_73de52c_run2.md": "host_cost_73de52c_run2.md",
    "host_cost_73de52c_run3.md": "host_cost_73de52c_run3.md",
    "host_cost_blocks.md": "host_cost_blocks.md",
    "host_cost_blocks_b5201e6.md": "host_cost_blocks_b5201e6.md",
    "host_cost_blocks_e978fbf.md": "host_cost_blocks_e978fbf.md",
    "host_cost_blocks_e948122.md": "host_cost_blocks_e948122.md",
    "host_cost_blocks_9c2aba8.md": "host_cost_blocks_9c2aba8.md",
    "host_cost_blocks_a60f0d5.md": "host_cost_blocks_a60f0d5.md",
    "host_cost_blocks_f2f0c12.md": "host_cost_blocks_f2f0c12.md",
    "host_cost_blocks_cfaa65b.md": "host_cost_blocks_cfaa65b.md",
    "host_cost_blocks_24873f3.md": "host_cost_blocks_24873f3.md",
    "host_cost_blocks_1ccc87e.md": "host_cost_blocks_1ccc87e.md",
    "host_cost_blocks_b9eb351_run2.md": "host_cost_blocks_b9eb351_run2.md",
    "host_cost_blocks_b9eb351_run3.md": "host_cost_blocks_b9eb351_run3.md",
    "host_cost_blocks_eac60a5.md": "host_cost_blocks_eac60a5.md",
    "host_cost_blocks_36577b8.md": "host_cost_blocks_36577b8.md",
    "host_cost_blocks_cc0def1_run2.md": "host_cost_blocks_cc0def1_run2.md",
    "host_cost_blocks_cc0def1_run3.md": "host_cost_blocks_cc0def1_run3.md",
    "host_cost_blocks_cc0def1.md": "host_cost_blocks_cc0def1.md",
    "host_cost_blocks_2560488_run2.md": "host_cost_blocks_2560488_run2.md",
    "host_cost_blocks_2560488_run3.md": "host_cost_blocks_2560488_run3.md",
    "host_cost_blocks_2560488.md": "host_cost_blocks_2560488.md",
    "host_cost_blocks_8ee25c1.md": "host_cost_blocks_8ee25c1.md",
    "host_cost_blocks_b141036_run2.md": "host_cost_blocks_b141036_run2.md",
    "host_cost_blocks_b141036_run3.md": "host_cost_blocks_b141036_run3.md",
    "host_cost_blocks_b141036.md": "host_cost_blocks_b141036.md",
    "host_cost_blocks_dd19647.md": "host_cost_blocks_dd19647.md",
    "host_cost_blocks_52210fb_run2.md": "host_cost_blocks_52210fb_run2.md",
    "host_cost_blocks_52210fb_run3.md": "host_cost_blocks_52210fb_run3.md",
    "host_cost_blocks_52210fb.md": "host_cost_blocks_52210fb.md",
    "host_cost_blocks_52210fb_second.md": "host_cost_blocks_52210fb_second.md",
    "host_cost_blocks_0d718b9_run2.md": "host_cost_blocks_0d718b9_run2.md",
    "host_cost_blocks_0d718b9_run3.md": "host_cost_blocks_0d718b9_run3.md",
    "host_cost_blocks_0d718b9.md": "host_cost_blocks_0d718b9.md",
    "host_cost_blocks_815d5a3.md": "host_cost_blocks_815d5a3.md",
    "host_cost_blocks_73de52c_run2.md": "host_cost_blocks_73de52c_run2.md",
    "host_cost_blocks_73de52c_run3.md": "host_cost_blocks_73de52c_run3.md",
    "capture_cost.md": "capture_cost.md",
    "tensor_count.md": "tensor_count.md",
    "capture_cost_1a617ab.md": "capture_cost_1a617ab.md",
    "models_iteration.md": "models_iteration.md",
    "models_iteration_3ce7984.md": "models_iteration_3ce7984.md",
    "models_iteration_2a4bdc1.md": "models_iteration_2a4bdc1.md",
    "models_iteration_1a617ab.md": "models_iteration_1a617ab.md",
    "models_iteration_a42e13e.md": "models_iteration_a42e13e.md",
    "models_iteration_726c568.md": "models_iteration_726c568.md",
    "models_iteration_9b05ab1.md": "models_iteration_9b05ab1.md",
    "models_iteration_263dd9a.md": "models_iteration_263dd9a.md",
    "models_iteration_d4f0379.md": "models_iteration_d4f0379.md",
    "models_iteration_b5201e6.md": "models_iteration_b5201e6.md",
    "models_iteration_e978fbf.md": "models_iteration_e978fbf.md",
    "models_iteration_e948122.md": "models_iteration_e948122.md",
    "models_iteration_9c2aba8.md": "models_iteration_9c2aba8.md",
    "models_iteration_a60f0d5.md": "models_iteration_a60f0d5.md",
    "models_iteration_f2f0c12.md": "models_iteration_f2f0c12.md",
    "models_iteration_cfaa65b.md": "models_iteration_cfaa65b.md",
    "models_iteration_24873f3.md": "models_iteration_24873f3.md",
    "models_iteration_1ccc87e.md": "models_iteration_1ccc87e.md",
    "models_iteration_fdc4ba8.md": "models_iteration_fdc4ba8.md",
    "models_iteration_36577b8.md": "models_iteration_36577b8.md",
    "models_iteration_cc0def1.md": "models_iteration_cc0def1.md",
    "models_iteration_2560488.md": "models_iteration_2560488.md",
    "models_iteration_8ee25c1.md": "models_iteration_8ee25c1.md",
    "models_iteration_b141036.md": "models_iteration_b141036.md",
    "models_iteration_dd19647.md": "models_iteration_dd19647.md",
    "models_iteration_52210fb.md": "models_iteration_52210fb.md",
    "models_iteration_52210fb_second.md": "models_iteration_52210fb_second.md",
    "models_iteration_0d718b9.md": "models_iteration_0d718b9.md",
    "models_iteration_815d5a3.md": "models_iteration_815d5a3.md",
    "defaults.md": "defaults.md",
    "defaults_models.md": "defaults_models.md",
    "fsdp.md": "fsdp.md",
    "fsdp_example.md": "fsdp_example.md",
    "gpu/README.md": "gpu_first_run.md",
    "gpu/gpu_report.md": "gpu_report.md",
    "harness_memory/README.md": "harness_memory.md",
    "harness/README.md": "harness_commands.md",
}

# The headline: fp32 model and fp32 factors on the three tasks, one row per optimizer.
HEADLINE_TASKS = (
    ("mnist1d_cnn", "MNIST-1D CNN"),
    ("mnist1d_mlp", "MNIST-1D MLP"),
    ("lm", "char LM"),
)
HEADLINE_OPTIMIZERS = (
    ("adamw", "AdamW"),
    ("kfac", "K-FAC"),
    ("singd:block_diagonal:32", "SINGD (default)"),
    ("singd:diagonal", "SINGD diagonal"),
    ("adafisher", "AdaFisher"),
    ("ikfac", "IKFAC"),
)
IKFAC_FOLDERS = {"mnist1d_cnn": "mnist1d_cnn_ikfac", "mnist1d_mlp": "mnist1d_mlp_ikfac"}


def load(folder: Path) -> dict:
    """The recorded ``results.json`` of one harness run folder."""
    return json.loads((folder / "results.json").read_text())


def run_folders(root: Path = RESULTS) -> list[Path]:
    """Every recorded harness run (a folder with a results.json), in name order."""
    return sorted(p.parent for p in root.glob("harness*/*/results.json"))


def _mean_std(mean, std, scale: float = 1.0, digits: int = 3) -> str:
    if mean is None or not math.isfinite(mean):
        return "—"
    spread = "" if std is None or not math.isfinite(std) else f" ± {std * scale:.{digits}f}"
    return f"{mean * scale:.{digits}f}{spread}"


def _steps(cell: dict) -> str:
    steps = cell["steps_to_target"]
    if steps is None:
        return "not reached"
    reached, seeds = cell["seeds_reaching_target"], cell["seeds"]
    return f"{steps}" + (f" ({reached}/{seeds} seeds)" if reached < seeds else "")


def _ratio(value) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.2f}x"


def _spread(values, unit: str = "") -> str:
    """A timed [median, min, max] as "0.53x (0.50–0.56)", or "—"."""
    if values is None:
        return "—"
    mid, low, high = (f"{v:.2f}{unit}" for v in values)
    return f"{mid} ({low}–{high})"


def is_timed(record: dict) -> bool:
    """Whether a record's times come from a timing pass (``singd-harness timing``)."""
    return bool(record.get("timing"))


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _reference_cell(cells: list[dict], label: str, precision: str = "fp32") -> dict | None:
    """The cell of ``label`` in model ``precision`` with fp32 factors (or none)."""
    for cell in cells:
        if (
            cell["label"] == label
            and cell["precision"] == precision
            and cell["factor"] in ("-", "fp32")
        ):
            return cell
    return None


def headline_table(root: Path = HARNESS) -> str:
    """Held-out loss (test accuracy %) and steps to AdamW's final loss per task, fp32.

    Mean ± sample std over the recorded seeds; a row per optimizer, a column pair per task.
    """
    headers = ["optimizer (fp32)"]
    for _, title in HEADLINE_TASKS:
        headers += [f"{title}: loss (acc %)", "steps to AdamW's loss"]
    records = {task: load(root / task)["cells"] for task, _ in HEADLINE_TASKS}
    for task, folder in IKFAC_FOLDERS.items():
        records[task] = records[task] + load(root / folder)["cells"]
    rows = []
    for label, name in HEADLINE_OPTIMIZERS:
        row = [name]
        for task, _ in HEADLINE_TASKS:
            cell = _reference_cell(records[task], label)
            if cell is None:
                row += ["not run", "—"]
                continue
            loss = _mean_std(cell["loss_mean"], cell["loss_std"])
            accuracy = _mean_std(cell["accuracy_mean"], None, 100.0, 1)
            row += [f"{loss} ({accuracy})", _steps(cell)]
        rows.append(row)
    return _table(headers, rows)


# Against the optimizers users pick instead: runs with the peers, each with its own AdamW.
PEER_TASKS = (  # (folder, title, model precision)
    ("mnist1d_cnn_peers", "MNIST-1D CNN", "fp32"),
    ("lm_peers", "char LM", "fp32"),
    ("llama_lm_full", "LLaMA (bf16 autocast)", "bf16-amp"),
)
PEER_NAMES = {
    "adamw": "AdamW",
    "sgd": "momentum SGD",
    "kfac": "K-FAC",
    "adafisher": "AdaFisher",
    "singd:block_diagonal:32": "SINGD (default)",
    "soap": "SOAP",
    "psgd_kron": "PSGD-Kron",
    "muon": "Muon",
}


def peers_table(root: Path = HARNESS) -> str:
    """Held-out loss (accuracy %), steps to that run's AdamW loss, time to it relative to
    AdamW's from the record's timing pass (``timed_time_vs_adamw``: median (min–max)
    over its rounds; "—" for a record without one) and optimizer state per optimizer of
    the peer runs (each task's model precision, fp32 factors; mean ± std over the
    recorded seeds)."""
    headers = ["optimizer"]
    for _, title, _ in PEER_TASKS:
        headers += [f"{title}: loss (acc %)", "steps to AdamW's loss", "time (timed)", "state MiB"]
    records = {folder: load(root / folder)["cells"] for folder, _, _ in PEER_TASKS}
    rows = []
    for label, name in PEER_NAMES.items():
        row = [name]
        for folder, _, precision in PEER_TASKS:
            cell = _reference_cell(records[folder], label, precision)
            if cell is None:
                row += ["not run", "—", "—", "—"]
                continue
            loss = _mean_std(cell["loss_mean"], cell["loss_std"])
            accuracy = _mean_std(cell["accuracy_mean"], None, 100.0, 1)
            time_to_target = _spread(cell.get("timed_time_vs_adamw"), "x")
            row += [
                f"{loss} ({accuracy})",
                _steps(cell),
                time_to_target,
                f"{cell['state_mib']:.3f}",
            ]
        rows.append(row)
    return _table(headers, rows)


def cell_headers(timed: bool) -> list[str]:
    """The columns of a record's table; the time columns say where their times come from:
    the record's timing pass, or its grid's runs side by side (rough)."""
    how = "timed" if timed else "parallel grid"
    return [
        "optimizer",
        "precision",
        "factors",
        "held-out loss",
        "test acc %",
        "failed seeds",
        "vs fp32",
        "steps to target",
        f"time vs AdamW ({how})",
        "state MiB",
        f"step ms ({how})",
    ]


def cell_row(cell: dict, timed: bool = False) -> list[str]:
    """One row of :func:`cell_headers` from a recorded cell."""
    if timed:
        times = [_spread(cell["timed_time_vs_adamw"], "x"), _spread(cell["timed_step_ms"])]
    else:
        step = cell["median_step_ms"]
        times = [_ratio(cell["time_vs_adamw"]), "—" if step is None else f"{step:.2f}"]
    return [
        cell["label"],
        cell["precision"],
        cell["factor"],
        _mean_std(cell["loss_mean"], cell["loss_std"], digits=4),
        _mean_std(cell["accuracy_mean"], cell["accuracy_std"], 100.0, 1),
        cell["failures"] or f"{cell['failed_seeds']}/{cell['seeds']}",
        cell["verdict"],
        _steps(cell),
        times[0],
        f"{cell['state_mib']:.3f}",
        times[1],
    ]


def run_section(folder: Path, root: Path = RESULTS) -> str:
    """A record's heading, provenance and one table per task."""
    record = load(folder)
    rel = folder.relative_to(root.parent.parent).as_posix()
    minutes = record["elapsed_s"] / 60
    parts = [
        f"### `{rel}/`",
        "",
        f"`{record['command']}`",
        "",
        f"{record['run_count']} runs in {minutes:.0f} min with {record['workers']} worker(s), "
        f"{record['created']} on {record['machine']}, torch {record['torch']}.",
    ]
    timing = record.get("timing")
    if timing:
        clock = "process CPU time" if timing["clock"] == "cpu" else "wall clock"
        parts += [
            "",
            f"Times: timing pass ({timing['created']}), one process, one thread, each "
            f"cell's first seed, {timing['rounds']} interleaved rounds of {timing['block']} "
            f"steps by the {clock}; median (min–max) over the rounds.",
        ]
    else:
        parts += ["", "Times: the grid's runs side by side with other jobs (parallel grid): rough."]
    verdicts: dict[str, int] = {}
    for cell in record["cells"]:
        if cell["verdict"] != "reference":
            verdicts[cell["verdict"]] = verdicts.get(cell["verdict"], 0) + 1
    if verdicts:
        summary = ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items()))
        parts += ["", f"Low-precision cells against their fp32 cell: {summary}."]
    timed = is_timed(record)
    for task in record["config"]["tasks"]:
        rows = [cell_row(c, timed) for c in record["cells"] if c["task"] == task]
        steps = record["config"]["steps"][task]
        rates = ", ".join(
            f"{key.split('/', 1)[1]} {hparams.get('lr', '—')}"
            for key, (hparams, _) in record["settings"].items()
            if key.startswith(f"{task}/")
        )
        parts += ["", f"**{task}**, {steps} steps, seeds {record['config']['seeds']}:", ""]
        parts += [f"Learning rates: {rates}.", ""] if rates else []
        parts.append(_table(cell_headers(timed), rows))
    return "\n".join(parts) + "\n"


def harness_tables(root: Path = RESULTS) -> str:
    """Every recorded harness run, rendered; the verdict rule stated once."""
    folders = run_folders(root)
    rule = load(folders[0])["rule"] if folders else ""
    parts = [f"**Verdict rule** (as recorded): {rule}", ""]
    parts += [run_section(folder, root) for folder in folders]
    return "\n".join(parts)


# ---------------------------------------------------------------- MkDocs hooks
def on_files(files, config):
    """Add the benchmark records as pages under ``records/``."""
    from mkdocs.structure.files import File

    for source, page in RECORDS.items():
        content = (RESULTS / source).read_text()
        files.append(File.generated(config, f"records/{page}", content=content))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Fill the evidence page's markers from the recorded JSON."""
    if page.file.src_uri == "evidence.md":
        markdown = markdown.replace("<!-- harness-headline -->", headline_table())
        markdown = markdown.replace("<!-- harness-peers -->", peers_table())
        markdown = markdown.replace("<!-- harness-tables -->", harness_tables())
    return markdown
