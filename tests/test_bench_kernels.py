"""`gradsync bench kernels`: what it measures, reports and writes (never how fast anything is).

The variants are generated from the registry, so these checks cover a newly registered codec at
once. Runs use a 4096-element tensor and one or two repeats to stay fast.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from gradsync import cli, compress
from gradsync.bench import kernels

NUMEL = 4096


@pytest.fixture(scope="module")
def results() -> list[kernels.KernelResult]:
    return kernels.run(numel=NUMEL, repeats=2)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Intra-op threads set to 2 (not the benchmark's 1), restored after the test."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_results_cover_every_registered_compressor_plus_torch_topk(results):
    assert [r.label for r in results] == kernels.variant_labels()
    assert {r.label for r in results} == {*compress.names(), "topk-torch"}
    assert {r.compressor for r in results} == set(compress.names())
    reference = next(r for r in results if r.label == "topk-torch")
    assert (reference.compressor, reference.args) == ("topk", {"mode": "exact"})


def test_bits_per_element_match_each_codecs_payload_bytes(results):
    # A data-dependent payload (fixed_size False, e.g. a threshold codec) has no exact size to match.
    for r in (r for r in results if compress.lookup(r.compressor).fixed_size):
        codec = compress.warmed_up(compress.build(r.compressor, **r.args))  # as timed
        expected = 8 * codec.payload_bytes(NUMEL) / NUMEL
        assert r.bits_per_element == pytest.approx(expected, rel=1e-12), r.label
    by_label = {r.label: r for r in results}
    assert by_label["none"].bits_per_element == 32
    assert by_label["fp16"].bits_per_element == 16


def test_ratio_is_seconds_over_the_clone_seconds_timed_beside_it(results):
    for r in results:
        assert r.clone_seconds > 0
        assert r.numel == NUMEL
        assert r.seconds > 0
        assert r.ratio == pytest.approx(r.seconds / r.clone_seconds, rel=1e-12), r.label


def test_encode_ratio_is_the_encode_over_a_copy_timed_beside_it(results):
    for r in results:
        assert r.encode_seconds > 0 and r.copy_seconds > 0, r.label
        assert r.encode_ratio == pytest.approx(r.encode_seconds / r.copy_seconds, rel=1e-12), r.label


def test_int4_is_timed_encoding_with_one_error_memory_as_the_hook_does(monkeypatch):
    # int4 needs feedback and fuses it: the hook's encode writes the residual as it goes, into
    # memory made once. int8 fuses it but runs without feedback by default; fp16 has none.
    seen: list[tuple[str, int, int]] = []
    for name in ("int4", "int8", "fp16"):
        kind = compress.lookup(name)

        def corrected(self, g, base, alpha, out, _original=kind.compress_corrected, _name=name):
            seen.append((_name, base.data_ptr(), out.data_ptr()))
            return _original(self, g, base, alpha, out)

        monkeypatch.setattr(kind, "compress_corrected", corrected)
    kernels.run(numel=NUMEL, repeats=2, labels=["int4", "int8", "fp16"])
    assert [name for name, _, _ in seen] == ["int4"] * 3  # one untimed call, two timed
    assert len({(base, out) for _, base, out in seen}) == 1  # the same memory and spare each time


def test_targets_are_set_exactly_for_labels_with_one_and_judged_by_the_ratio(results):
    for r in results:
        assert r.target == kernels.TARGETS.get(r.label), r.label
        if r.target is None:
            assert r.meets_target is None, r.label
        else:
            assert r.meets_target == (r.ratio <= r.target), r.label
    by_label = {r.label: r for r in results}
    assert all(by_label[label].target is None for label in ("none", "topk-torch", "powersgd"))
    assert (by_label["fp16"].target, by_label["topk"].target, by_label["qsgd"].target) == (2, 4, 6)


def test_runs_on_the_requested_threads_and_restores_the_previous_count(two_threads):
    seen: list[int] = []
    kernels.run(
        numel=NUMEL,
        repeats=1,
        labels=["fp16"],
        threads=1,
        progress=lambda _: seen.append(torch.get_num_threads()),
    )
    assert seen == [1]
    assert torch.get_num_threads() == 2


def test_thread_count_is_restored_when_the_run_fails(two_threads):
    def fail(line: str) -> None:
        raise RuntimeError(f"stop at {line}")

    with pytest.raises(RuntimeError, match=r"stop at \[1/1\] fp16"):
        kernels.run(numel=NUMEL, repeats=1, labels=["fp16"], threads=1, progress=fail)
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError, match="nope"):
        kernels.run(numel=NUMEL, repeats=1, labels=["nope"], threads=1)
    assert torch.get_num_threads() == 2


def test_labels_select_variants_in_benchmark_order():
    results = kernels.run(numel=NUMEL, repeats=1, labels=["topk", "none"])
    assert [r.label for r in results] == ["none", "topk"]


def test_unknown_label_names_it_and_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown label\(s\) \['nope'\]; valid labels: none, fp16"):
        kernels.run(numel=NUMEL, repeats=1, labels=["fp16", "nope"])


@pytest.mark.parametrize(
    ("params", "message"),
    [({"numel": 0}, r"numel=0 must be >= 1"), ({"repeats": 0}, r"repeats=0 must be >= 1")],
)
def test_bad_sizes_name_the_value_and_constraint(params, message):
    with pytest.raises(ValueError, match=message):
        kernels.run(**{"numel": NUMEL, "repeats": 1, **params})


def test_table_lists_each_label_and_the_missed_targets(results):
    table = kernels.format_table(results, threads=1)
    for r in results:
        assert f"| {r.label} |" in table
    missed = [r.label for r in results if r.meets_target is False]
    last = table.splitlines()[-1]
    if missed:
        assert last.startswith("Missed: ") and all(f"{label} (" in last for label in missed)
    else:
        assert last == "All targets met."


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GRADSYNC_COMMIT", raising=False)  # a lent GPU machine's copy is told its commit
    path = tmp_path / "nested" / "kernels.json"
    argv = ["bench", "kernels", "--numel", str(NUMEL), "--repeats", "1", "--only", "fp16,topk"]
    assert cli.main([*argv, "--json", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "| fp16 |" in out and "| topk |" in out
    assert "[1/2] fp16 ..." in err and "[2/2] topk ..." in err
    data = json.loads(path.read_text())
    assert data["meta"]["numel"] == NUMEL and data["meta"]["threads"] == 1
    assert data["meta"]["machine"]["torch"] == torch.__version__
    assert len(data["meta"]["commit"]) == 40 and isinstance(data["meta"]["dirty"], bool)
    assert [r["label"] for r in data["results"]] == ["fp16", "topk"]
    assert data["results"][0]["bits_per_element"] == 16
    # What is printed is the table published from the JSON alone, caption and all: one rule
    # (kernels.table's) says what the run was timed on.
    assert kernels.table(data) in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--numel", "0"], "--numel=0 must be >= 1"),
        (["--repeats", "-1"], "--repeats=-1 must be >= 1"),
        (["--threads", "0"], "--threads=0 must be >= 1"),
        (["--only", "fp16,nope"], "unknown label(s) ['nope']"),
        (["--device", "gpu"], "--device: device='gpu': the benchmark times on 'cpu' or 'cuda'"),
        (["--device", "cuda:99"], "torch sees"),
        (["--device", "meta"], "--device: device='meta': the benchmark times on 'cpu' or 'cuda'"),
        *(
            []
            if torch.cuda.is_available()
            else [(["--device", "cuda"], "device='cuda': torch sees no CUDA GPU here; pass device='cpu'")]
        ),
    ],
)
def test_cli_rejects_bad_arguments_naming_the_value(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "kernels", *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_table_names_the_gpu_a_run_timed_on(tmp_path):
    path = tmp_path / "kernels.json"
    assert (
        cli.main(
            [
                "bench",
                "kernels",
                "--numel",
                str(NUMEL),
                "--repeats",
                "1",
                "--only",
                "fp16",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    document = json.loads(path.read_text())
    assert "gpu" not in document["meta"] and " cores (" in kernels.table(document).splitlines()[-1]
    assert ", threads=1, " in kernels.table(document).splitlines()[0]
    document["meta"]["gpu"] = "NVIDIA H200"
    document["meta"]["dirty"] = None  # a copy of the tree, told its commit
    document["results"][0].update(seconds=0.000314, clone_seconds=0.0123, encode_seconds=0.00123)
    rendered = kernels.table(document)
    assert "on one NVIDIA H200, torch" in rendered.splitlines()[-1]
    assert "threads=" not in rendered.splitlines()[0]  # CPU threads time nothing of a GPU's run
    assert "uncommitted changes not checked" in rendered.splitlines()[-1]
    # Three significant figures from a thousandth of a ms up, a tenth from 10 ms on.
    assert "| fp16 | - | 0.314 | 12.3 |" in rendered and "| 1.23 |" in rendered


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_timing_waits_for_the_kernels_not_their_launch():
    device = torch.device("cuda", torch.cuda.current_device())
    assert kernels._seconds(lambda: torch.cuda._sleep(int(1e8)), device) > 0.01  # launched in microseconds


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_run_times_the_same_payloads_on_the_gpu(monkeypatch):
    on_cpu = kernels.run(numel=NUMEL, repeats=1, labels=["fp16", "int4", "topk"])
    on_gpu = kernels.run(numel=NUMEL, repeats=1, labels=["fp16", "int4", "topk"], device="cuda")
    assert [r.bits_per_element for r in on_gpu] == [r.bits_per_element for r in on_cpu]
    timed_on = []
    time_variant = kernels._time_variant
    monkeypatch.setattr(
        kernels, "_time_variant", lambda v, x, *a: timed_on.append(x.device.type) or time_variant(v, x, *a)
    )
    kernels.run(numel=NUMEL, repeats=1, labels=["fp16"], device="cuda")
    assert timed_on == ["cuda"]  # the tensor itself went to the GPU, not just the caption
    assert all(r.seconds > 0 and r.clone_seconds > 0 for r in on_gpu)
    assert kernels.metadata(NUMEL, 1, 1, "cuda")["gpu"] == torch.cuda.get_device_name()


def test_a_caption_says_each_state_of_the_tree_and_times_keep_their_figures_at_the_bounds():
    from gradsync.bench import report

    assert report.tree_note(False) == ""
    assert report.tree_note(True) == " (with uncommitted changes)"
    assert report.tree_note(None) == " (a copy of the tree: uncommitted changes not checked)"
    assert (kernels._ms(0.010), kernels._ms(0.001), kernels._ms(0.0009994)) == ("10.0", "1.00", "0.999")
