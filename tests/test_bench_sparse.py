"""The sparse exchange benchmark: its inputs, sparsity measures, traffic model, report and command
line, and one short real run with 2 gloo ranks on loopback."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from gradsync.bench import sparse as sb
from gradsync.bench import train
from gradsync.bench.sparse_worker import Reference, SumMismatch
from gradsync.comm import LocalComm
from gradsync.sparse import HashPartition, RangePartition, SparseResult, SparseRows, Summed, cost
from gradsync.sparse.hashing import pull_index_nbytes

# A small embed-lm (2,048 x 16 table, a corpus of 400k characters) whose ranks start in seconds.
_SMALL_EMBED = "embed-lm:corpus_chars=400000:vocab_size=2048:output_vocab=512:hidden=64:dim=16:batch_size=8"
_SMALL_ZIPF = "zipf:rows=4096:width=4:density=0.02"


def _t(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# -- inputs ------------------------------------------------------------------------------------------


def test_zipf_rows_are_deterministic_per_seed_and_rank_and_leave_the_global_rng_alone():
    state = torch.get_rng_state()
    a = sb.zipf_indices(65536, 1000, 1.1, seed=0, rank=3)
    assert torch.equal(a, sb.zipf_indices(65536, 1000, 1.1, seed=0, rank=3))
    assert not torch.equal(a, sb.zipf_indices(65536, 1000, 1.1, seed=0, rank=4))
    assert not torch.equal(a, sb.zipf_indices(65536, 1000, 1.1, seed=1, rank=3))
    assert torch.equal(torch.get_rng_state(), state)
    source = sb.Source(sb.parse_input(_SMALL_ZIPF), seed=0)
    first, again = source.rows(1, 4), source.rows(1, 4)
    assert torch.equal(first.indices, again.indices) and torch.equal(first.values, again.values)


def test_zipf_rows_are_distinct_ascending_in_range_at_the_target_density():
    source = sb.Source(sb.parse_input("zipf:rows=65536:width=8:density=0.015"), seed=0)
    for rank in range(4):
        rows = source.rows(rank, 4)
        assert rows.nnz == round(0.015 * 65536) == source.count
        assert bool((rows.indices[1:] > rows.indices[:-1]).all())  # ascending, hence distinct
        assert int(rows.indices.min()) >= 0 and int(rows.indices.max()) < 65536
        assert rows.values.shape == (rows.nnz, 8) and rows.values.dtype == torch.float32


def test_zipf_rows_crowd_the_lowest_indices():
    indices = sb.zipf_indices(2**20, round(0.015 * 2**20), 1.1, seed=0, rank=0)
    eighth = 2**20 // 8
    assert float((indices < eighth).float().mean()) > 0.5  # uniform rows would put 1/8 there
    assert float((indices < 1024).float().mean()) > 0.05  # and 0.1% of the index space holds 5%+
    assert int((indices < 64).sum()) == 64  # the hottest rows are drawn by every rank


def test_default_zipf_input_skews_a_range_partition_but_not_the_hash():
    source = sb.Source(sb.parse_input("zipf"), seed=0)
    assert source.num_rows * source.width * 4 / 1e6 > 20  # a dense exchange of tens of MB
    sets = [source.indices(rank, 8) for rank in range(8)]
    report = sb.measure(sets, source.num_rows, source.width, 4)
    assert 0.01 <= report["density_mean"] <= 0.02
    assert min(report["range"].values()) >= 3
    assert max(report["hash"].values()) <= 1.1


def test_embed_lm_rows_are_the_batch_words_with_a_real_gradient():
    source = sb.Source(sb.parse_input(_SMALL_EMBED), seed=0)
    rows = source.rows(1, 2)
    assert torch.equal(rows.indices, source.indices(1, 2))
    assert rows.width == 16 and rows.num_rows == 2048
    assert bool(rows.values.abs().sum(1).gt(0).all())  # every touched word got a gradient


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("nope", ["unknown input 'nope'", "embed-lm or zipf"]),
        ("zipf:rows", ["'rows' is not key=value"]),
        ("zipf:colour=3", ["unknown option 'colour'", "density"]),
        ("zipf:density=0", ["density=0", "(0, 1]"]),
        ("zipf:rows=100:density=0.001", ["no row"]),
        ("zipf:s=-1", ["s=-1"]),
        ("zipf:rows=99999999", ["rows=99999999", "multinomial"]),
        ("embed-lm:batch_size=0", ["batch_size=0"]),
        ("embed-lm:sparse=False", ["unknown option 'sparse'"]),
    ],
)
def test_bad_inputs_are_refused_with_the_reason(text, words):
    with pytest.raises(ValueError) as err:
        sb.parse_input(text)
    for word in words:
        assert word in str(err.value)


def test_input_options_override_the_defaults():
    spec = sb.parse_input("zipf:width=4:s=1.2")
    assert spec.options == {**sb.ZIPF_DEFAULTS, "width": 4, "s": 1.2} and spec.text == "zipf:width=4:s=1.2"
    assert sb.parse_input("embed-lm").options == sb.EMBED_LM_DEFAULTS


# -- measured sparsity ---------------------------------------------------------------------------------


def test_overlap_is_the_mean_over_pairs_of_the_shared_fraction_of_the_smaller_set():
    a, b, c = _t(0, 1, 2, 3), _t(2, 3, 4, 5), _t(10)
    assert sb.overlap([a, b]) == 0.5
    assert sb.overlap([a, b, c]) == pytest.approx((0.5 + 0 + 0) / 3)
    assert sb.overlap([a, _t(1, 2)]) == 1.0  # the smaller set lies inside the larger
    assert sb.overlap([a]) == 1.0
    assert sb.overlap([a, _t()]) == 0.0  # no pair to count


def test_union_density_is_the_mean_over_whole_groups_of_consecutive_ranks():
    sets = [_t(0, 1), _t(1, 2), _t(5, 6), _t(7, 8), _t(0, 9)]
    assert sb.group_union_sizes(sets, 10, 2) == [3, 4]  # the fifth rank is in no whole group
    assert sb.union_density(sets, 10, 1) == pytest.approx(0.2)
    assert sb.union_density(sets, 10, 2) == pytest.approx(0.35)
    assert sb.union_density(sets, 10, 4) == pytest.approx(0.7)
    assert sb.union_density(sets, 10, 5) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="m=6"):
        sb.union_density(sets, 10, 6)


def test_densification_is_one_for_equal_sets_and_m_for_disjoint_ones():
    same = [_t(3, 4, 5)] * 8
    assert sb.densification(same, 100, [1, 2, 4, 8]) == {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
    disjoint = [torch.arange(3 * r, 3 * r + 3) for r in range(8)]
    assert sb.densification(disjoint, 100, [1, 2, 4, 8]) == pytest.approx({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0})


def test_group_sizes_are_powers_of_two_and_n():
    assert sb.group_sizes(8) == [1, 2, 4, 8]
    assert sb.group_sizes(6) == [1, 2, 4, 6]
    assert sb.group_sizes(2) == [1, 2]


def test_partition_imbalance_counts_pushed_rows_and_pull_bytes_per_owner():
    # 8 rows, 2 owners by range (0-3, 4-7); every row in the lower half.
    sets = [_t(0, 1, 2), _t(1, 2, 3)]
    partition = RangePartition(8, 2)
    assert sb.owner_loads(sets, partition) == ([6, 0], [4, 0])
    push, pull = sb.partition_imbalance(sets, partition, row_nbytes=16)
    assert push == 2.0  # all on one of two owners
    loads = [pull_index_nbytes(4, 4) + 4 * 16, pull_index_nbytes(4, 0)]
    assert pull == pytest.approx(max(loads) * 2 / sum(loads))


def test_hash_partition_balances_what_a_range_partition_piles_on_owner_zero():
    sets = [sb.zipf_indices(65536, 2000, 1.1, seed=0, rank=r) for r in range(8)]
    hashed = sb.partition_imbalance(sets, HashPartition(65536, 8, seed=0), 64)
    ranged = sb.partition_imbalance(sets, RangePartition(65536, 8), 64)
    assert max(hashed) < 1.15 and min(ranged) > 3


def test_sparsity_feeds_the_cost_model_with_the_measured_unions():
    sets = [_t(0, 1), _t(1, 2, 3), _t(4), _t(4, 5)]
    s = sb.sparsity(sets, 10, 4, 4)
    assert isinstance(s, cost.Sparsity)
    assert dict(s.union_density) == pytest.approx({1: 0.2, 2: 0.3, 4: 0.6})
    assert s.max_density == pytest.approx(0.3) and s.width == 4 and s.value_nbytes == 4


# -- the traffic model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zipf_sets() -> list[torch.Tensor]:
    return [sb.zipf_indices(16384, 250, 1.1, seed=0, rank=r) for r in range(32)]


def test_model_points_span_two_to_the_largest_and_include_the_hosts():
    assert sb.model_points(128, 8) == [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]
    assert sb.model_points(10, 5) == [2, 3, 4, 5, 6, 8, 10]


def test_model_is_cost_traffic_on_the_first_n_ranks(zipf_sets):
    network = cost.Network()
    points = sb.model(zipf_sets, 16384, 8, 4, [2, 4, 8, 32], network)
    for point in points:
        n = point["workers"]
        expected = cost.traffic(sb.sparsity(zipf_sets[:n], 16384, 8, 4), n)
        assert {k: point["bytes"][k] for k in expected} == pytest.approx(expected)
        assert point["least_bytes"] == min(sb.MODELLED, key=point["bytes"].__getitem__)
        assert point["fastest"] == cost.fastest(sb.sparsity(zipf_sets[:n], 16384, 8, 4), n, network)
    with pytest.raises(ValueError, match="64 workers"):
        sb.model(zipf_sets, 16384, 8, 4, [64], network)


def test_model_curves_have_the_expected_shapes(zipf_sets):
    points = sb.model(zipf_sets, 16384, 8, 4, [2, 4, 8, 16, 32], cost.Network())
    dense = [p["bytes"]["dense"] for p in points]
    table = 16384 * 8 * 4
    assert all(table <= d <= 2 * table + 8 for d in dense)  # flat per worker: 2 (n - 1) / n of it
    assert dense == sorted(dense)
    agsparse = [p["bytes"]["agsparse"] for p in points]
    assert agsparse[-1] / agsparse[0] == pytest.approx(31, rel=0.1)  # (n - 1) copies of a rank's rows
    balanced = [p["bytes"]["balanced"] for p in points]
    assert balanced[-1] < agsparse[-1] / 2  # the union grows slower than n copies
    ranged = [p["bytes"]["range"] for p in points]
    assert all(r > b for r, b in zip(ranged, balanced, strict=True))  # skew costs the range partition


def test_winner_ranges_group_consecutive_worker_counts():
    points = [{"workers": n, "least_bytes": w} for n, w in [(2, "a"), (4, "a"), (8, "b"), (16, "a")]]
    assert sb.winner_ranges(points) == [(2, 4, "a"), (8, 8, "b"), (16, 16, "a")]


# -- summary and report --------------------------------------------------------------------------------


def _raw(seconds: dict[str, list[float]]) -> dict:
    schemes = []
    for name, times in seconds.items():
        schemes.append(
            {
                "scheme": name,
                "seconds": times,
                "cpu_seconds": [0.01] * len(times),
                "cpu_user_seconds": [0.006] * len(times),
                "cpu_system_seconds": [0.004] * len(times),
                "sent_nbytes": [1000, 1200],
                "wire_bytes": None,
                "push_imbalance": 1.05 if name in ("balanced", "range") else None,
                "pull_imbalance": 1.08 if name == "balanced" else (4.0 if name == "range" else None),
                "checks": len(times) + 1,
                "max_error": 0.0,
            }
        )
    return {
        "input": "zipf:rows=64",
        "num_rows": 64,
        "width": 2,
        "value_nbytes": 4,
        "rank_rows": [{"rows": 3, "index_sum": 3}, {"rows": 2, "index_sum": 2}],
        "calibrated": {"alpha_s": 1e-3, "bytes_per_s": 1e8},
        "description": "hand-made",
        "schemes": schemes,
    }


@pytest.fixture
def document() -> dict:
    times = {
        "dense": [1.0, 1.2, 0.9, 1.1, 5.0],
        "agsparse": [0.3, 0.3, 0.3, 0.3, 0.3],
        "balanced": [0.1, 0.1, 0.2, 0.1, 0.1],
        "recursive-doubling": [0.2, 0.2, 0.2, 0.2, 0.2],
        "range": [0.4, 0.4, 0.4, 0.4, 0.4],
    }
    sets = [_t(0, 1, 2), _t(0, 1)]
    network = cost.Network(1e-3, 1e8, round_s={"all_to_all": 2e-3})
    at_hosts = {
        **sb.traffic_by_scheme(sets, 64, 2, 4, network),
        "network": {"alpha_s": 1e-3, "bytes_per_s": 1e8, "round_s": {"all_to_all": 2e-3}},
    }
    section = sb.summarize_input(
        _raw(times), sb.measure(sets, 64, 2, 4), at_hosts, sb.model(sets, 64, 2, 4, [2], cost.Network())
    )
    options = sb.SparseBenchOptions(hosts=2, inputs=("zipf:rows=64",), reps=5, model_workers=2)
    meta = {
        "options": {**vars(options), "inputs": list(options.inputs), "schemes": list(options.schemes)},
        "network": train.loopback().to_dict(),
        "model_network": {"alpha_s": 50e-6, "bytes_per_s": 1.25e8},
        "machine": {"cores": 2},
    }
    return {"meta": meta, "inputs": [section]}


def test_summary_takes_median_p90_and_balanced_speedups(document):
    section = document["inputs"][0]
    by_name = {s["scheme"]: s for s in section["schemes"]}
    assert by_name["dense"]["median_s"] == 1.1 and by_name["dense"]["p90_s"] == 5.0
    assert by_name["balanced"]["median_s"] == 0.1
    assert by_name["agsparse"]["balanced_speedup"] == pytest.approx(3.0)
    assert by_name["dense"]["balanced_speedup"] == pytest.approx(11.0)
    assert by_name["balanced"]["balanced_speedup"] == 1.0
    assert by_name["dense"]["bytes_sent_mean"] == 1100 and by_name["dense"]["bytes_sent_max"] == 1200
    assert by_name["dense"]["model_bytes"] == section["model_at_hosts"]["bytes"]["dense"]
    assert by_name["agsparse"]["predicted_s"] == section["model_at_hosts"]["seconds"]["agsparse"]


def test_targets_are_judged_against_the_issues_thresholds(document):
    t = document["inputs"][0]["targets"]
    assert t["vs_agsparse"] == {"value": pytest.approx(3.0), "at_least": 1.5, "met": True}
    assert t["vs_dense"]["met"] is True
    assert t["hash_imbalance"] == {"value": 1.08, "at_most": 1.1, "met": True}
    ranged = document["inputs"][0]["sparsity"]["range"]
    assert t["range_imbalance"]["value"] == max(ranged.values())


def test_a_missed_target_says_so(document):
    section = document["inputs"][0]
    raw = _raw({"agsparse": [0.12], "balanced": [0.1], "dense": [0.3]})
    missed = sb.summarize_input(raw, section["sparsity"], section["model_at_hosts"], section["model"])
    assert missed["targets"]["vs_agsparse"]["met"] is False and missed["targets"]["vs_dense"]["met"] is False
    document["inputs"] = [missed]
    assert "1.20x (MISSED)" in sb.table(document) and "3.00x (MISSED)" in sb.table(document)


def test_table_has_a_row_per_scheme_and_survives_a_json_round_trip(document):
    text = sb.table(document)
    for name in sb.SCHEMES:
        assert f"| zipf:rows=64 | {name} |" in text
    assert "| zipf:rows=64 | balanced | 0.1000 | 0.2000 | 1.00x |" in text
    assert "3.00x (met)" in text and "calibrated rounds (all_to_all 2.0 ms)" in text
    assert sb.table(json.loads(json.dumps(document))) == text


def test_write_produces_json_markdown_and_two_pngs(document, tmp_path: Path):
    paths = sb.write(document, tmp_path / "out")
    assert [p.name for p in paths] == ["results.json", "results.md", "sparse-times.png", "sparse-model.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    assert json.loads(paths[0].read_text())["inputs"][0]["input"] == "zipf:rows=64"


# -- the sum check of the worker ---------------------------------------------------------------------


def _result(rows: SparseRows) -> SparseResult:
    return SparseResult(Summed(rows.num_rows, parts=[rows]), "test", True, 0)


def test_the_sum_check_accepts_last_bit_differences_and_refuses_wrong_or_missing_rows():
    table = torch.zeros(6, 2)
    table[[1, 4]] = torch.tensor([[1.0, 2.0], [3.0, -4.0]])
    reference = Reference(table)
    exact = SparseRows(_t(1, 4), table[[1, 4]].clone(), 6)
    assert reference.check(_result(exact), "test", LocalComm()) == 0.0
    nudged = SparseRows(_t(1, 4), table[[1, 4]] * (1 + 1e-7), 6)
    assert reference.check(_result(nudged), "test", LocalComm()) < 1e-6
    dense = SparseResult(Summed(6, dense=table.clone()), "dense", True, 0)
    assert reference.check(dense, "dense", LocalComm()) == 0.0
    wrong = SparseRows(_t(1, 4), table[[1, 4]] + 0.01, 6)
    with pytest.raises(SumMismatch, match=r"'test'.*differs from dense's by up to 0\.01"):
        reference.check(_result(wrong), "test", LocalComm())
    with pytest.raises(SumMismatch, match="lacks 1"):
        reference.check(_result(SparseRows(_t(1), table[[1]].clone(), 6)), "test", LocalComm())
    flagged = SparseResult(Summed(6, parts=[exact]), "test", False, 0)
    with pytest.raises(SumMismatch, match="non-finite"):
        reference.check(flagged, "test", LocalComm())


# -- options and command line ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"hosts": 1}, ["hosts=1", "[2, 254]"]),
        ({"reps": 0}, ["reps=0"]),
        ({"warmup": -1}, ["warmup=-1"]),
        ({"inputs": ()}, ["no input"]),
        ({"inputs": ("zipf", "zipf")}, ["more than once"]),
        ({"schemes": ("dense", "fast")}, ["unknown scheme(s) ['fast']", "balanced"]),
        ({"model_workers": 1}, ["model_workers=1"]),
        ({"hosts": 8, "model_workers": 4}, ["model_workers=4 is below hosts=8"]),
        ({"timeout_s": 0}, ["timeout_s=0"]),
    ],
)
def test_bad_options_are_refused(kwargs, words):
    with pytest.raises(ValueError) as err:
        sb.SparseBenchOptions(**kwargs)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--hosts", "1"], ["hosts=1", "--hosts 8"]),
        (["--reps", "0"], ["reps=0"]),
        (["--inputs", "zipf,nope"], ["unknown input 'nope'"]),
        (["--inputs", "zipf:rows=0"], ["input 'zipf:rows=0'", "rows=0"]),
        (["--inputs", "embed-lm:vocab_size=1"], ["input 'embed-lm:vocab_size=1'", "vocab_size=1"]),
        (["--schemes", "dense,nope"], ["unknown scheme(s) ['nope']"]),
        (["--bandwidth", "fast"], ["bandwidth 'fast'", "1gbit"]),
        (["--latency", "5"], ["latency '5'"]),
        (["--testbed", "--loopback"], ["not allowed with"]),
    ],
)
def test_bench_sparse_refuses_bad_arguments_with_exit_code_2(argv, words, capsys, monkeypatch):
    from gradsync import cli

    monkeypatch.setattr(sb, "run", lambda *a, **k: pytest.fail("the benchmark started"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "sparse", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


def test_a_failed_run_ends_with_its_message_and_exit_code_1(monkeypatch, capsys):
    from gradsync.bench import train

    def fail(options, network, say=None):
        raise train.BenchError("input 'zipf': rank(s) [1] exited with code(s) [1]\nSumMismatch: boom")

    monkeypatch.setattr(sb, "run", fail)
    options = sb.SparseBenchOptions(hosts=2, inputs=("zipf",))
    start = lambda network: sb.run(options, network)  # noqa: E731
    assert train.run_and_report(start, 2, False, "1gbit", "0.2ms", False, sb.table, sb.write, "unused") == 1
    err = capsys.readouterr().err
    assert "gradsync: error: input 'zipf': rank(s) [1]" in err and "boom" in err


# -- a short real run ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    options = sb.SparseBenchOptions(
        hosts=2, inputs=(_SMALL_ZIPF, _SMALL_EMBED), reps=3, warmup=1, model_workers=6, timeout_s=120
    )
    said: list[str] = []
    document = sb.run(options, train.loopback(), said.append)
    document["said"] = said
    document["paths"] = [str(p) for p in sb.write(document, tmp_path_factory.mktemp("bench-sparse"))]
    return document


def test_a_real_run_times_and_checks_every_scheme_on_every_input(real_run):
    assert [s["input"] for s in real_run["inputs"]] == [_SMALL_ZIPF, _SMALL_EMBED]
    for section in real_run["inputs"]:
        by_name = {s["scheme"]: s for s in section["schemes"]}
        assert list(by_name) == list(sb.SCHEMES)
        for s in by_name.values():
            assert len(s["seconds"]) == 3 and all(t > 0 for t in s["seconds"])
            assert s["checks"] == 4 and s["max_error"] <= 1e-5 * max(1.0, s["max_error"])
            assert s["p90_s"] >= s["median_s"] > 0
        # The algorithm's byte counts are the cost model's on the same rows.
        for name in ("dense", "agsparse", "recursive-doubling"):
            assert by_name[name]["bytes_sent_mean"] == pytest.approx(by_name[name]["model_bytes"])
        assert by_name["balanced"]["push_imbalance"] == pytest.approx(
            section["sparsity"]["hash"]["push_imbalance"]
        )
        assert by_name["range"]["pull_imbalance"] == pytest.approx(
            section["sparsity"]["range"]["pull_imbalance"]
        )
        assert [p["workers"] for p in section["model"]] == [2, 3, 4, 6]
        rounds = section["model_at_hosts"]["network"]["round_s"]
        assert set(rounds) == {"allreduce", "allgather", "all_to_all", "sendrecv"}
        assert all(seconds > 0 for seconds in rounds.values())


def test_a_real_run_measures_the_rows_it_exchanged(real_run):
    zipf = real_run["inputs"][0]
    assert [r["rows"] for r in zipf["rank_rows"]] == [round(0.02 * 4096)] * 2
    assert zipf["sparsity"]["density"] == pytest.approx([0.02, 0.02], abs=1e-4)
    embed = real_run["inputs"][1]
    assert statistics.fmean(embed["sparsity"]["density"]) == pytest.approx(embed["sparsity"]["density_mean"])
    assert embed["sparsity"]["densification"][2] >= 1


def test_a_real_run_writes_its_report_and_says_what_it_does(real_run):
    assert [Path(p).name for p in real_run["paths"]] == [
        "results.json",
        "results.md",
        "sparse-times.png",
        "sparse-model.png",
    ]
    assert any("[1/2] zipf:rows=4096" in line for line in real_run["said"])
    assert "| zipf:rows=4096:width=4:density=0.02 | balanced |" in Path(real_run["paths"][1]).read_text()


def test_a_failing_rank_ends_the_input_with_its_log(tmp_path: Path):
    # An input the worker cannot parse: every rank exits with the ValueError in its log.
    options = sb.SparseBenchOptions(hosts=2, inputs=("zipf",), timeout_s=60)
    bad = sb.InputSpec("zipf:rows=oops", "zipf", {})
    with pytest.raises(train.BenchError) as err:
        sb._run_input(options, train.loopback(), bad, tmp_path, 0)
    assert "input 'zipf:rows=oops'" in str(err.value) and "rows='oops'" in str(err.value)
