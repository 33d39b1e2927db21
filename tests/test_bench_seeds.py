"""`gradsync bench seeds`: bench train's runs under several seeds, each strategy against DDP's of
its own seed."""

from __future__ import annotations

import copy
import json
import statistics
from typing import Any

import pytest

from gradsync.bench import seeds, tables

OPTIONS = {
    "workload": "gpt-tiny",
    "workload_options": {},
    "world_size": 4,
    "steps": 200,
    "eval_every": 25,
    "tolerance": 0.02,
    "threads": 1,
    "until_flat": None,
}


def run(strategy: str, versus: float | None, speedup: float | None) -> dict[str, Any]:
    return {
        "strategy": strategy,
        "label": f"label of {strategy}",
        "final_loss": 2.8 * (1 + (versus or 0.0)),
        "final_vs_reference": versus,
        "final_vs_reference_se": None if versus is None else 0.001,
        "time_to_target_speedup": speedup,
        "step_median_s": 1.0,
    }


def document(seed: int, runs: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
    return {
        "meta": {
            "workload": "gpt-tiny",
            "options": {**OPTIONS, "seed": seed, "strategies": [r["strategy"] for r in runs], **options},
            "network": {"kind": "testbed", "description": "4 hosts, 1 Gbit/s per link"},
            "reference": "ddp",
            "schedule_steps": 200,
            "commit": f"{seed:040d}",
            "dirty": False,
            "date": "2026-11-27 12:00:00",
            "command": f"gradsync bench train --seed {seed}",
            "target_loss": 2.86,
        },
        "runs": runs,
    }


def three_seeds() -> list[dict[str, Any]]:
    return [
        document(0, [run("ddp", None, 1.0), run("int8", 0.001, 1.7), run("powersgd:rank=4", 0.011, 1.8)]),
        document(1, [run("ddp", None, 1.0), run("powersgd:rank=4", 0.023, None), run("int8", -0.002, 1.6)]),
        document(2, [run("ddp", None, 1.0), run("int8", 0.004, 1.7), run("powersgd:rank=4", 0.008, 1.9)]),
    ]


def test_each_strategy_keeps_its_loss_against_ddp_of_the_same_seed_in_seed_order() -> None:
    gathered = seeds.gather(three_seeds())
    assert gathered["meta"]["seeds"] == [0, 1, 2]
    by_strategy = {r["strategy"]: r for r in gathered["runs"]}
    assert list(by_strategy) == ["ddp", "int8", "powersgd:rank=4"]  # the first run's order
    assert by_strategy["powersgd:rank=4"]["final_vs_reference"] == [0.011, 0.023, 0.008]
    assert by_strategy["powersgd:rank=4"]["time_to_target_speedup"] == [1.8, None, 1.9]
    assert by_strategy["int8"]["final_vs_reference"] == [0.001, -0.002, 0.004]
    assert [s["commit"] for s in gathered["meta"]["sources"]] == [f"{s:040d}" for s in (0, 1, 2)]


def test_the_table_gives_the_mean_and_range_over_seeds_and_how_many_reached_ddps_loss() -> None:
    text = seeds.table(seeds.gather(three_seeds()))
    row = next(line for line in text.splitlines() if line.startswith("| label of powersgd"))
    mean = statistics.fmean([0.011, 0.023, 0.008])
    assert row == (
        "| label of powersgd:rank=4 | +1.1% ± 0.10, +2.3% ± 0.10, +0.8% ± 0.10 | "
        f"{100 * mean:+.1f}% | +0.8% to +2.3% | 2 of 3 | 1.80x, not reached, 1.90x |"
    )
    assert "| label of ddp | (the reference) |" in text
    assert "seed 1: commit 0000000000000000000000000000000000000001" not in text  # shortened
    assert "seed 1: commit 000000000000," in text
    assert "different commits" in text


def test_a_seed_without_a_paired_loss_keeps_its_place_and_stays_out_of_the_mean() -> None:
    documents = three_seeds()
    diverged = next(r for r in documents[1]["runs"] if r["strategy"] == "int8")
    diverged.update(final_vs_reference=None, final_vs_reference_se=None, time_to_target_speedup=None)
    text = seeds.table(seeds.gather(documents))
    row = next(line for line in text.splitlines() if line.startswith("| label of int8"))
    assert row == (
        "| label of int8 | +0.1% ± 0.10, n/a, +0.4% ± 0.10 | +0.2% | +0.1% to +0.4% | 2 of 3 | "
        "1.70x, not reached, 1.70x |"
    )


def test_the_reference_row_is_found_by_name_not_by_missing_values() -> None:
    documents = three_seeds()
    for document in documents:  # a strategy with no paired values in any seed is not DDP
        for r in document["runs"]:
            if r["strategy"] == "int8":
                r.update(final_vs_reference=None, final_vs_reference_se=None)
    text = seeds.table(seeds.gather(documents))
    assert "| label of int8 | n/a, n/a, n/a | n/a | n/a | 3 of 3 | 1.70x, 1.60x, 1.70x |" in text
    assert text.count("(the reference)") == 1


def test_a_strategy_missing_from_one_seed_is_left_out() -> None:
    documents = three_seeds()
    documents[2]["runs"] = [r for r in documents[2]["runs"] if r["strategy"] != "int8"]
    assert [r["strategy"] for r in seeds.gather(documents)["runs"]] == ["ddp", "powersgd:rank=4"]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"steps": 400}, ["seed 1", "steps=400", "200", "only in --seed"]),
        ({"world_size": 8}, ["world_size=8"]),
        ({"workload_options": {"d_model": 256}}, ["workload_options", "d_model"]),
        ({"seed": 0}, ["seeds [0, 0, 2] repeat"]),
        ({"until_flat": 0.02}, ["until_flat=0.02", "None"]),
    ],
)
def test_runs_that_differ_in_more_than_the_seed_are_refused_naming_the_difference(
    change: dict[str, Any], words: list[str]
) -> None:
    documents = three_seeds()
    documents[1]["meta"]["options"].update(change)
    with pytest.raises(ValueError) as error:
        seeds.gather(documents)
    for word in words:
        assert word in str(error.value)


def test_with_until_flat_the_steps_may_differ_but_not_the_schedule() -> None:
    documents = three_seeds()
    for document, steps in zip(documents, (150, 175, 200), strict=True):
        document["meta"]["options"].update(until_flat=0.02, steps=steps)
    gathered = seeds.gather(documents)
    assert [s["steps"] for s in gathered["meta"]["sources"]] == [150, 175, 200]
    assert "150 or 175 or 200 steps" in seeds.table(gathered)
    documents[2]["meta"]["schedule_steps"] = 400
    with pytest.raises(ValueError, match="schedule_steps=400"):
        seeds.gather(documents)


def test_runs_without_a_reference_or_missing_what_bench_train_writes_are_refused() -> None:
    documents = three_seeds()
    documents[0]["meta"]["reference"] = None
    with pytest.raises(ValueError, match="add ddp to --strategies"):
        seeds.gather(documents)
    documents = three_seeds()
    del documents[1]["meta"]["options"]["threads"]
    with pytest.raises(ValueError, match=r"no meta\.options\.threads"):
        seeds.gather(documents)


def test_runs_on_other_networks_or_one_run_alone_are_refused() -> None:
    documents = three_seeds()
    documents[2]["meta"]["network"] = {"kind": "loopback", "description": "loopback (127.0.0.1)"}
    with pytest.raises(ValueError, match="loopback"):
        seeds.gather(documents)
    with pytest.raises(ValueError, match="at least 2"):
        seeds.gather(three_seeds()[:1])


def test_the_docs_render_a_seeds_table_from_its_results_file(tmp_path) -> None:
    gathered = seeds.gather(three_seeds())
    path = tmp_path / "results.json"
    path.write_text(json.dumps(gathered))
    assert tables.render("seeds", path) == seeds.table(gathered).rstrip("\n") + "\n"


def test_the_command_writes_the_gathered_runs_with_its_own_commit(tmp_path, capsys) -> None:
    from gradsync.cli import main

    paths = []
    for doc in three_seeds():
        paths.append(tmp_path / f"seed-{doc['meta']['options']['seed']}.json")
        paths[-1].write_text(json.dumps(doc))
    assert main(["bench", "seeds", *map(str, paths), "--out", str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert written["runs"] == seeds.gather(three_seeds())["runs"]
    assert written["meta"]["command"].startswith("gradsync") and len(written["meta"]["commit"]) >= 7
    assert (tmp_path / "out" / "results.md").read_text() == seeds.table(written) + "\n"
    assert "+1.1% ± 0.10, +2.3% ± 0.10, +0.8% ± 0.10" in capsys.readouterr().out


def test_the_command_refuses_a_file_that_is_not_a_bench_train_result(tmp_path, capsys) -> None:
    from gradsync.cli import main

    other = tmp_path / "other.json"
    other.write_text(json.dumps({"runs": []}))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(copy.deepcopy(three_seeds()[0])))
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "seeds", str(good), str(other), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert (
        f"{other}: not the results.json of a `gradsync bench train` run (no meta)" in capsys.readouterr().err
    )
    assert not (tmp_path / "out").exists()


def test_each_seeds_source_says_the_state_of_its_tree() -> None:
    documents = three_seeds()
    documents[1]["meta"]["dirty"] = None  # a copy told its commit
    documents[2]["meta"]["dirty"] = True
    text = seeds.table(seeds.gather(documents))
    assert "seed 0: commit 000000000000, 2026" in text
    assert "seed 1: commit 000000000000 (a copy of the tree: uncommitted changes not checked), 2026" in text
    assert "seed 2: commit 000000000000 (with uncommitted changes), 2026" in text
