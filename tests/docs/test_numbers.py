"""Numbers that drift are quoted from records: the README's and Getting started's size of
the test run is the rendering of ``benchmarks/results/test_run.json``."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from .blocks import ROOT


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_test_run_size_is_the_record(page):
    sentence = _hooks().test_run_sentence()
    assert _flat(sentence) in _flat((ROOT / page).read_text()), (
        f"{page} quotes another test run than benchmarks/results/test_run.json: paste\n" + sentence
    )


def test_a_timed_run_is_quoted_with_its_machine_and_date(tmp_path):
    record = json.loads((ROOT / "benchmarks" / "results" / "test_run.json").read_text())
    record["duration"] = {"seconds": 400, "date": "2026-01-02", "machine": "x86_64, 2 cores"}
    path = tmp_path / "test_run.json"
    path.write_text(json.dumps(record))
    sentence = _hooks().test_run_sentence(path)
    assert sentence.endswith("and took 7 minutes on x86_64, 2 cores (2026-01-02).")


@pytest.mark.slow
def test_the_record_counts_about_the_tests_selected_now():
    """Within 5 % of what the default run collects today (re-record when it drifts)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    now = int(re.search(r"(\d+)(?:/\d+)? tests? collected", done.stdout).group(1))
    recorded = json.loads((ROOT / "benchmarks" / "results" / "test_run.json").read_text())
    assert abs(recorded["selected"] - now) <= 0.05 * now, (
        f"{now} tests now, {recorded['selected']} recorded: run python benchmarks/test_run.py"
        " --record"
    )


NUMBER = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)\s?(?:µs|ms|MiB|MB|%|x|×)(?!\w)")


def _quoted_numbers_missing_from_their_records(text: str) -> list[tuple[str, str]]:
    """(number, paragraph start) of each time, size, share or ratio in a paragraph that
    links records (``records/NAME.md``) that none of those records contains."""
    hooks = _hooks()
    pages = {page: source for source, page in hooks.RECORDS.items()}
    missing = []
    for paragraph in re.split(r"\n\s*\n", text):
        linked = re.findall(r"\]\(records/([\w.]+\.md)\)", paragraph)
        if not linked:
            continue
        records = "".join((hooks.RESULTS / pages[page]).read_text() for page in linked)
        missing += [
            (number, paragraph[:60])
            for number in NUMBER.findall(paragraph)
            if number not in records
        ]
    return missing


def test_the_performance_page_quotes_its_records():
    """Every time, size, share or ratio next to a record link is in that record."""
    text = (ROOT / "docs" / "performance.md").read_text()
    assert "](records/" in text
    assert not _quoted_numbers_missing_from_their_records(text)


def test_a_number_the_linked_record_lacks_is_found():
    text = "Step 12.5 ms ([`structures.md`](records/structures.md)); 4.16 ms dense."
    assert _quoted_numbers_missing_from_their_records(text) == [("12.5", text[:60])]
