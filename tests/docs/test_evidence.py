"""The README's headline evidence table is the rendering of the recorded harness runs."""

from __future__ import annotations

import importlib.util

from .blocks import ROOT


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_headline_equals_the_records():
    table = _hooks().headline_table()
    assert table in (ROOT / "README.md").read_text(), (
        "README.md's evidence table differs from benchmarks/results/harness: paste\n" + table
    )


def test_readme_peers_table_equals_the_records():
    table = _hooks().peers_table()
    assert table in (ROOT / "README.md").read_text(), (
        "README.md's peers table differs from benchmarks/results/harness: paste\n" + table
    )


def test_every_record_is_rendered():
    hooks = _hooks()
    folders = hooks.run_folders()
    assert len(folders) >= 6
    text = hooks.harness_tables()
    for folder in folders:
        record = hooks.load(folder)
        assert record["command"] in text
        assert text.count("| " + record["cells"][0]["label"] + " |") >= 1


def test_evidence_page_has_the_markers():
    page = (ROOT / "docs" / "evidence.md").read_text()
    assert "<!-- harness-headline -->" in page
    assert "<!-- harness-tables -->" in page
    assert "<!-- harness-peers -->" in page


def test_record_time_columns_say_where_their_times_come_from():
    """A record re-timed by a timing pass shows "(timed)" time columns; any other
    "(parallel grid)", never an unlabelled time column."""
    hooks = _hooks()
    for folder in hooks.run_folders():
        record = hooks.load(folder)
        section = hooks.run_section(folder)
        timed = "timing" in record and record["timing"]
        assert ("| time vs AdamW (timed) |" in section) == bool(timed), folder
        assert ("| time vs AdamW (parallel grid) |" in section) != bool(timed), folder
        assert "| time vs AdamW |" not in section and "| step ms |" not in section
