"""`gradsync bench plan --quick`: its rows keep the invariants the full run reports on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsync import cli
from gradsync.bench import planning


def test_the_quick_bench_keeps_its_invariants_and_writes_its_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "plan", "--quick", "--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["quality"] and document["uniform"] and document["timing"]
    for row in document["quality"]:
        # Brute force is the optimum on the same timeline: nothing beats it, and the planner
        # stays within the 3%.
        assert row["brute_force_s"] <= row["decide_s"] * (1 + 1e-12)
        assert row["brute_force_all_groupings_s"] <= row["brute_force_s"] * (1 + 1e-12)
        assert -1e-12 <= row["decide_gap"] <= 0.03 and -1e-12 <= row["search_gap"] <= 0.03
    for row in document["uniform"]:
        assert row["planned_s"] <= row["best_uniform_s"] * (1 + 1e-12) <= row["fp32_ddp_s"] * (1 + 1e-12)
    assert all(row["decide_ms"] > 0 for row in document["timing"])
    readme = (tmp_path / "README.md").read_text()
    assert "python -m gradsync bench plan --quick" in readme and "## Decision time" in readme
    assert planning.table(document) in capsys.readouterr().out


def test_every_grouping_of_a_few_units_is_enumerated_once() -> None:
    found = planning.all_groupings(4)
    assert len(found) == 8 and len({tuple(map(tuple, g)) for g in found}) == 8
    assert all([i for g in grouping for i in g] == [0, 1, 2, 3] for grouping in found)
