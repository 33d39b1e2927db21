"""Published tables: every measured table in the docs is rendered from the JSON its benchmark wrote.

A table in a Markdown page sits between two markers naming the benchmark that renders it and the
results file it renders:

    <!-- table script docs/bench-runtime/1gbit/results.json -->
    | way | median step (s) | ... |
    <!-- /table -->

`refresh` rewrites every such table from its JSON (`gradsync bench tables`); `stale` lists those
that differ, which the test suite fails on. So a number in the docs is always the one the command
measured, at the commit its JSON records.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from . import fidelity, kernels, planning, report, script, seeds, simulator, sparse

ROOT = Path(__file__).resolve().parents[2]

# Benchmark -> the function rendering its results document as Markdown.
RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "script": script.table,
    "train": report.table,
    "seeds": seeds.table,
    "sparse": sparse.table,
    "sim": simulator.table,
    "fidelity": fidelity.table,
    "plan": planning.table,
    "kernels": kernels.table,
}
_TABLE = re.compile(r"(<!-- table (\S+) (\S+) -->\n)(.*?)(<!-- /table -->)", re.S)


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def tables(page: Path) -> Iterator[tuple[str, Path, str]]:
    """(renderer, results file, the table as the page has it) for each marked table of `page`."""
    for match in _TABLE.finditer(page.read_text()):
        yield match.group(2), ROOT / match.group(3), match.group(4)


def render(renderer: str, results: Path) -> str:
    """The table `renderer` makes of `results`, as it sits between the markers."""
    if renderer not in RENDERERS:
        raise ValueError(f"unknown table renderer {renderer!r}; choose one of {', '.join(RENDERERS)}")
    return RENDERERS[renderer](json.loads(results.read_text())).rstrip("\n") + "\n"


def stale(page: Path) -> list[str]:
    """What differs in `page` from what its results files render, one line each."""
    found = []
    for renderer, results, shown in tables(page):
        if not results.is_file():
            found.append(f"{page.name}: {results.relative_to(ROOT)} does not exist")
        elif render(renderer, results) != shown:
            found.append(f"{page.name}: the table from {results.relative_to(ROOT)} is not what it renders")
    return found


def refresh(page: Path) -> bool:
    """Rewrite every marked table of `page` from its results file; whether anything changed."""
    text = page.read_text()

    def fill(match: re.Match[str]) -> str:
        return match.group(1) + render(match.group(2), ROOT / match.group(3)) + match.group(5)

    new = _TABLE.sub(fill, text)
    if new != text:
        page.write_text(new)
    return new != text
