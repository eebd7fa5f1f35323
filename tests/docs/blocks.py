"""The fenced Python blocks of the README and the docs pages, with their markers.

A block runs in the page's namespace after the page's earlier blocks, unless the HTML
comments directly above its opening fence (no blank line between) say otherwise:

- ``<!-- not run: REASON -->``: never run; the reason is required.
- ``<!-- requires: module, module -->``: skipped when a module is not installed.
- ``<!-- slow -->``: marked ``slow`` (excluded from the default run).

Such a block must not define what a later block of its page needs.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(\s*)```python\s*$")
MARKER = re.compile(r"^\s*<!--\s*(not run|requires|slow)\b\s*(?::(.*?))?\s*-->\s*$")
ANY_MARKER = re.compile(r"<!--\s*(not run|requires|slow)\b")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its code and its markers."""

    page: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    code: str
    not_run: str | None  # the reason, "" when the marker has none
    requires: tuple[str, ...]
    slow: bool

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def markers_above(lines: list[str], index: int) -> list[tuple[str, str | None]]:
    """The (kind, argument) markers on the comment lines directly above ``lines[index]``."""
    found = []
    i = index - 1
    while i >= 0 and (match := MARKER.match(lines[i])):
        found.append((match.group(1), match.group(2)))
        i -= 1
    return found


def blocks(page: Path) -> list[Block]:
    """The page's Python blocks in order."""
    lines = page.read_text().split("\n")
    found = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent = match.group(1)
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{page}:{i + 1}: a ```python fence is never closed")
        code = (
            textwrap.dedent("\n".join(lines[i + 1 : end]))
            if indent
            else "\n".join(lines[i + 1 : end])
        )
        marks = markers_above(lines, i)
        not_run = next(((arg or "").strip() for kind, arg in marks if kind == "not run"), None)
        requires = tuple(
            name.strip()
            for kind, arg in marks
            if kind == "requires"
            for name in (arg or "").split(",")
            if name.strip()
        )
        found.append(
            Block(
                page=page.relative_to(ROOT).as_posix(),
                line=i + 1,
                code=code + "\n",
                not_run=not_run,
                requires=requires,
                slow=any(kind == "slow" for kind, _ in marks),
            )
        )
        i = end + 1
    return found


def dangling_markers(page: Path) -> list[str]:
    """Marker comments that do not sit directly above a Python block (or are malformed)."""
    lines = page.read_text().split("\n")
    problems = []
    for i, line in enumerate(lines):
        if not ANY_MARKER.search(line):
            continue
        if not MARKER.match(line):
            problems.append(f"{page.name}:{i + 1}: malformed marker {line.strip()!r}")
            continue
        j = i + 1
        while j < len(lines) and MARKER.match(lines[j]):
            j += 1
        if j == len(lines) or not FENCE.match(lines[j]):
            problems.append(f"{page.name}:{i + 1}: marker not directly above a ```python block")
    return problems
