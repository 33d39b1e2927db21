"""Every measured table in README.md and docs/ is what its results file renders, and every results
file a table comes from records the commit and the machine it was measured on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsync.bench import tables

PAGES = tables.pages()
MARKED = [(page, renderer, results) for page in PAGES for renderer, results, _ in tables.tables(page)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(tables.ROOT)))
def test_every_table_in_the_docs_is_what_its_results_render(page: Path) -> None:
    assert tables.stale(page) == [], "run `gradsync bench tables` after measuring, and commit both"


@pytest.mark.parametrize(("page", "renderer", "results"), MARKED, ids=lambda v: getattr(v, "name", str(v)))
def test_every_published_result_records_its_commit_and_machine(
    page: Path, renderer: str, results: Path
) -> None:
    meta = json.loads(results.read_text())["meta"]
    assert len(meta["commit"]) == 40, f"{results}: no commit recorded; measure it again"
    assert not meta.get("dirty"), f"{results}: measured with uncommitted changes; measure it again"
    assert meta["machine"]["cores"] > 0 and meta["machine"]["torch"], f"{results}: no machine recorded"


def test_a_table_that_differs_from_its_results_is_reported_and_refresh_rewrites_it(
    tmp_path, monkeypatch
) -> None:
    results = tmp_path / "docs" / "results.json"
    results.parent.mkdir()
    results.write_text(json.dumps({"rows": [1, 2]}))
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    monkeypatch.setitem(
        tables.RENDERERS, "rows", lambda doc: "| n |\n" + "".join(f"| {r} |\n" for r in doc["rows"])
    )
    page = tmp_path / "docs" / "page.md"
    page.write_text("before\n<!-- table rows docs/results.json -->\n| n |\n| 1 |\n<!-- /table -->\nafter\n")
    assert tables.stale(page) == ["page.md: the table from docs/results.json is not what it renders"]
    assert tables.refresh(page)
    assert (
        page.read_text()
        == "before\n<!-- table rows docs/results.json -->\n| n |\n| 1 |\n| 2 |\n<!-- /table -->\nafter\n"
    )
    assert tables.stale(page) == [] and not tables.refresh(page)
    results.unlink()
    assert tables.stale(page) == ["page.md: docs/results.json does not exist"]


@pytest.mark.parametrize(
    "page", sorted((tables.ROOT / "docs").rglob("results.md")), ids=lambda p: str(p.relative_to(tables.ROOT))
)
def test_every_results_page_is_what_its_results_file_renders(page: Path) -> None:
    # A benchmark writes results.md beside results.json from the same document; a renderer
    # changed since must not leave the page showing what it no longer writes.
    document = json.loads((page.parent / "results.json").read_text())
    rendered = []
    for render in tables.RENDERERS.values():
        try:
            rendered.append(render(document) + "\n")
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):
            continue  # another benchmark's renderer: not this document's
    assert page.read_text() in rendered, "rewrite it from results.json with its benchmark's renderer"
