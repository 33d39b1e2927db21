"""gradsync.profile in a world of one: the JSON format, the backward timeline, codec cost fits,
the collectives of a world of one, and a whole profile run."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gradsync import profile
from gradsync.comm import LocalComm, completed
from gradsync.compress.base import count_for
from gradsync.compress.topk import TopK
from gradsync.cost import LinearFit, fit_linear
from gradsync.profile import Profile, TensorTiming, host

# Small enough to keep the file fast, a factor of 256 wide so that size dominates the cost.
SIZES = (1 << 12, 1 << 16, 1 << 20)
IN_FEATURES = 16


def awkward_fit(scale: float) -> LinearFit:
    return LinearFit(
        fixed_s=(0.1 + 0.2) * scale, per_unit_s=1e-300, rel_error=1 / 3, max_rel_error=0.7, points=5
    )


def awkward_profile() -> Profile:
    """Floats whose shortest repr is long or extreme, to catch any rounding on the way through JSON."""
    return Profile(
        world_size=3,
        backend="gloo",
        device="cpu",
        threads=2,
        forward_s=0.1 + 0.2,
        backward_s=1e-300,
        optimizer_s=5e-324,
        tensors=(TensorTiming(1, "0.bias", 7, 2 / 3), TensorTiming(0, "0.weight", 70, math.pi)),
        compression={"topk:ratio=0.01": {"compress": awkward_fit(1.0), "decompress": awkward_fit(7.0)}},
        collectives={name: awkward_fit(i + 1e-17) for i, name in enumerate(profile.COLLECTIVES)},
        meta={"model": "tiny", "sizes": [1, 2], "nested": {"x": 0.1}},
        hook={"qsgd": {"before": awkward_fit(3.0), "after": awkward_fit(1 / 3)}},
        contention={"allreduce:float16": {"compute": 0.1 + 0.2, "transfer": 1e-300}},
    )


def mlp(layers: int = 4, width: int = 24) -> nn.Sequential:
    """Linear layers with Tanh between them, seeded without touching the caller's global RNG."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        blocks: list[nn.Module] = []
        for i in range(layers):
            blocks.append(nn.Linear(IN_FEATURES if i == 0 else width, width))
            blocks.append(nn.Tanh())
        return nn.Sequential(*blocks[:-1])


def step_fn(model: nn.Module) -> Callable[[int], torch.Tensor]:
    def step(i: int) -> torch.Tensor:
        x = torch.randn(8, IN_FEATURES, generator=torch.Generator().manual_seed(i))
        return model(x).square().mean()

    return step


# -- JSON ------------------------------------------------------------------------------------------


def test_json_round_trip_is_exact() -> None:
    original = awkward_profile()
    text = original.to_json()
    restored = Profile.from_json(text)
    assert restored == original
    assert restored.to_json() == text
    assert restored.forward_s == 0.1 + 0.2 and restored.optimizer_s == 5e-324
    assert restored.compression["topk:ratio=0.01"]["decompress"] == awkward_fit(7.0)
    assert restored.hook["qsgd"]["after"] == awkward_fit(1 / 3)
    assert restored.contention["allreduce:float16"]["compute"] == 0.1 + 0.2


def test_json_is_indented_with_sorted_keys_and_a_version() -> None:
    text = awkward_profile().to_json()
    data = json.loads(text)
    assert data["version"] == profile.VERSION == 1
    assert text == json.dumps(data, indent=1, sort_keys=True)


def test_save_then_load_gives_the_same_profile(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    awkward_profile().save(path)
    assert Profile.load(path) == awkward_profile()


def test_another_version_is_refused_with_the_version_named(tmp_path: Path) -> None:
    data = json.loads(awkward_profile().to_json())
    data["version"] = 2
    path = tmp_path / "future.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"version 2 is not supported.*reads version 1") as error:
        Profile.load(path)
    assert str(path) in str(error.value)
    del data["version"]
    with pytest.raises(ValueError, match="version None"):
        Profile.from_json(json.dumps(data))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("backward_s"), r"version 1\) lacks field 'backward_s'"),
        (lambda d: d.update(extra=1), r"version 1\) has unknown field 'extra'"),
        (lambda d: d["tensors"][1].pop("numel"), r"tensors\[1\] lacks field 'numel'"),
        (lambda d: d["compression"]["topk:ratio=0.01"].pop("decompress"), "lacks field 'decompress'"),
    ],
)
def test_a_missing_or_unknown_field_is_named(edit, message: str) -> None:
    data = json.loads(awkward_profile().to_json())
    edit(data)
    with pytest.raises(ValueError, match=message):
        Profile.from_json(json.dumps(data))


def test_compute_s_is_forward_plus_backward_plus_optimizer() -> None:
    p = awkward_profile()
    assert p.compute_s == p.forward_s + p.backward_s + p.optimizer_s


# -- backward timeline -----------------------------------------------------------------------------


def test_time_backward_gives_gradients_in_backprop_order_within_the_backward_pass() -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rng_before = torch.random.get_rng_state()
    forward_s, backward_s, optimizer_s, tensors = profile.time_backward(
        model, step_fn(model), optimizer, steps=3, warmup=1
    )
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert min(forward_s, backward_s, optimizer_s) > 0
    # Every parameter once, with its name, index and size.
    named = list(model.named_parameters())
    assert sorted(t.index for t in tensors) == list(range(len(named)))
    for t in tensors:
        assert (t.name, t.numel) == (named[t.index][0], named[t.index][1].numel())
    # The last layer's gradients are ready first; layers come in reverse forward order.
    layers = [int(t.name.split(".")[0]) for t in tensors]
    assert layers == sorted(layers, reverse=True)
    assert {t.name for t in tensors[:2]} == {"6.weight", "6.bias"}
    readies = [t.ready_s for t in tensors]
    assert readies == sorted(readies)
    assert readies[0] >= 0 and readies[-1] <= backward_s
    assert all(p.grad is None for p in model.parameters())


def test_time_backward_removes_its_hooks_and_keeps_the_callers() -> None:
    model = mlp(layers=2)
    calls = []
    first = next(model.parameters())
    first.register_post_accumulate_grad_hook(lambda p: calls.append(p))
    profile.time_backward(
        model, step_fn(model), torch.optim.SGD(model.parameters(), lr=0.01), steps=2, warmup=0
    )
    assert len(calls) == 2
    assert [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()] == [1, 0, 0, 0]
    step_fn(model)(0).backward()
    assert len(calls) == 3


def test_time_backward_skips_frozen_and_unused_parameters() -> None:
    net = mlp(layers=3)
    net[0].bias.requires_grad_(False)
    model = nn.ModuleDict({"net": net, "unused": nn.Linear(2, 2)})
    _, _, _, tensors = profile.time_backward(
        model, step_fn(net), torch.optim.SGD(model.parameters(), lr=0.01), steps=1, warmup=0
    )
    assert {t.name for t in tensors} == {
        "net.0.weight",
        "net.2.weight",
        "net.2.bias",
        "net.4.weight",
        "net.4.bias",
    }
    assert {t.index for t in tensors} == {0, 2, 3, 4, 5}


def test_time_backward_rejects_no_steps() -> None:
    model = mlp(layers=1)
    with pytest.raises(ValueError, match="steps=0 must be >= 1"):
        profile.time_backward(model, step_fn(model), torch.optim.SGD(model.parameters(), lr=0.01), steps=0)


# -- codec costs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["fp16", "topk:ratio=0.01"])
def test_each_measured_point_is_within_the_fits_max_relative_error(spec: str) -> None:
    measured = profile.measure_compression(spec, SIZES, repeats=3, seed=1)
    for phase in profile.CODEC_PHASES:
        seconds = measured[phase]
        assert len(seconds) == len(SIZES) and min(seconds) > 0
        fit = fit_linear(SIZES, seconds)
        for numel, s in zip(SIZES, seconds, strict=True):
            assert abs(fit(numel) - s) / s <= fit.max_rel_error * (1 + 1e-9) + 1e-12


def test_fit_compression_costs_grow_with_size() -> None:
    rng_before = torch.random.get_rng_state()
    fits = profile.fit_compression(["fp16", "topk:ratio=0.01"], SIZES, repeats=3)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert sorted(fits) == ["fp16", "topk:ratio=0.01"]
    for spec, phases in fits.items():
        assert sorted(phases) == ["compress", "decompress"]
        assert phases["compress"].per_unit_s > 0, spec
        assert phases["compress"].points == len(SIZES)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("nosuch", "unknown compressor 'nosuch'"),
        ("topk:ratio=2", "out of range"),
        ("topk:bogus=1", "unknown parameter"),
        ("topk:ratio", "is not key=value"),
    ],
)
def test_a_bad_codec_spec_is_named(spec: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason) as error:
        profile.fit_compression([spec], SIZES[:1], repeats=1)
    assert repr(spec) in str(error.value)


def test_parse_spec_reads_literals_and_keeps_words() -> None:
    assert profile.parse_spec("topk:ratio=0.01:mode=sampled") == ("topk", {"ratio": 0.01, "mode": "sampled"})
    assert profile.parse_spec("fp16") == ("fp16", {})


# -- collectives and the whole run -----------------------------------------------------------------


def test_a_world_of_one_has_free_collectives() -> None:
    fits = profile.probe_collectives(LocalComm())
    assert sorted(fits) == sorted(profile.COLLECTIVES)
    for fit in fits.values():
        assert (fit.fixed_s, fit.per_unit_s, fit.rel_error, fit.max_rel_error) == (0, 0, 0, 0)
        assert fit(4 << 20) == 0


def test_run_profiles_every_parameter_of_a_world_of_one() -> None:
    model = mlp(layers=3)
    found = profile.run(
        model,
        step_fn(model),
        torch.optim.Adam(model.parameters(), lr=1e-3),
        compressors=["fp16", "qsgd"],
        steps=2,
        warmup=1,
        codec_sizes=SIZES[:2],
        repeats=2,
        meta={"model": "mlp3", "batch_size": 8},
    )
    assert (found.world_size, found.backend, found.device) == (1, "local", "cpu")
    assert found.threads == torch.get_num_threads()
    expected = [(i, name, p.numel()) for i, (name, p) in enumerate(model.named_parameters())]
    assert sorted((t.index, t.name, t.numel) for t in found.tensors) == expected
    assert sorted(found.compression) == ["fp16", "qsgd"]
    assert all(fit.per_unit_s == 0 for fit in found.collectives.values())
    # gradsync's hook path around each codec, timed where the hook compresses; no contention alone.
    assert sorted(found.hook) == ["fp16", "qsgd"]
    assert all(fit.points == 2 and fit(1 << 20) > 0 for fits in found.hook.values() for fit in fits.values())
    assert found.contention == {}
    assert found.meta["model"] == "mlp3" and found.meta["batch_size"] == 8
    assert found.compute_s > 0
    assert Profile.from_json(found.to_json()) == found


def test_the_hook_path_is_timed_before_and_after_its_collective() -> None:
    config = profile.hook_config("qsgd")
    sizes = (1 << 14, 1 << 20)
    measured = profile.measure_hook(config, sizes, repeats=2)
    assert sorted(measured) == ["after", "before"]
    for phase, seconds in measured.items():
        assert len(seconds) == len(sizes) and all(t > 0 for t in seconds), phase
    # 64 times the elements: the hook's compress and decode take longer.
    assert measured["before"][1] > measured["before"][0]
    assert measured["after"][1] > measured["after"][0]


def test_timing_the_hook_does_not_log_that_the_run_compresses(caplog: pytest.LogCaptureFixture) -> None:
    # plan="auto" times each codec while the run itself still sends fp32: "compressing from step"
    # is the run's own line, and a timing state must not say it.
    with caplog.at_level(logging.INFO, logger="gradsync"):
        profile.measure_hook(profile.hook_config("int4"), (1 << 14,), repeats=1)
    assert not [r for r in caplog.records if "compressing from step" in r.getMessage()]


def test_a_sparsifier_is_timed_past_its_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # plan="auto" prices each level by these timings: top-k's warm-up (25% of the entries at
    # first) would price every level as a quarter of the tensor.
    kept = []
    select = TopK.select

    def counting(self: TopK, flat: torch.Tensor) -> torch.Tensor:
        indices = select(self, flat)
        kept.append(indices.numel())
        return indices

    monkeypatch.setattr(TopK, "select", counting)
    profile.measure_hook(profile.hook_config("topk:ratio=0.01"), (1 << 15,), repeats=3)
    assert kept[0] == 1 << 13  # 25%: the untimed first compressed step, as the hook makes the codec
    assert kept[1:] == [count_for(1 << 15, 0.01)] * 3


def test_the_hook_is_timed_only_where_it_compresses() -> None:
    config = profile.hook_config("fp16")
    with pytest.raises(ValueError, match="below min_compress_numel=16384"):
        profile.measure_hook(config, (1 << 10, 1 << 20))


class SlowLink(LocalComm):
    """Two ranks, both this process, on a link of 100 MB/s with `latency_s` for each collective.
    An all_to_all sends half its bytes (the other half stays here), and the other rank's numbers
    (slowest_rank's float64 gathers) are `other` times this rank's."""

    world_size = 2

    def __init__(self, other: float = 1.0, latency_s: float = 2e-4) -> None:
        self.other, self.latency_s = other, latency_s

    def _transfer(self, nbytes: int) -> None:
        time.sleep(self.latency_s + nbytes / 1e8)

    def allreduce(self, tensor: torch.Tensor) -> Any:
        self._transfer(tensor.nbytes)
        return completed(tensor)

    def allgather(self, tensor: torch.Tensor) -> Any:
        self._transfer(tensor.nbytes)
        return completed([tensor, tensor * self.other if tensor.dtype == torch.float64 else tensor])

    def all_to_all(self, parts: list[torch.Tensor], recv_numels: list[int]) -> Any:
        self._transfer(sum(part.nbytes for part in parts) // 2)
        return completed(list(parts))


def test_probes_leave_out_the_sizes_a_bandwidth_bound_link_would_spend_longest_s_on() -> None:
    sizes = (1 << 22, 1 << 12, 1 << 20, 1 << 16, 1 << 18)  # any order: measured smallest first
    every = profile.measure_collectives(SlowLink(), sizes, repeats=1)
    assert all(nbytes == sorted(sizes) for nbytes, _ in every.values())

    def ran(other: float, longest_s: float) -> dict[str, int]:
        found = profile.measure_collectives(SlowLink(other), sizes, repeats=1, longest_s=longest_s)
        return {name: len(nbytes) for name, (nbytes, _) in found.items()}

    # 1 MiB takes about 11 ms, so the line through 256 KiB and 1 MiB puts 4 MiB at about 42 ms:
    # past 25 ms it is left out, where all_to_all's half (about 21 ms) is not.
    assert ran(1.0, 0.025) == {"allreduce": 4, "allgather": 4, "all_to_all": 5}
    # The slowest rank's times decide: a limit this rank's would stay under, the other's passes.
    assert ran(1.0, 0.08) == {"allreduce": 5, "allgather": 5, "all_to_all": 5}
    assert ran(3.0, 0.08) == {"allreduce": 4, "allgather": 4, "all_to_all": 5}
    # The three smallest always run.
    assert ran(1.0, 1e-6) == {"allreduce": 3, "allgather": 3, "all_to_all": 3}
    # Where the latency dominates (1 MiB takes under twice what 4 KiB does), the line's slope is
    # not measured yet: every size runs, however long.
    far = profile.measure_collectives(
        SlowLink(latency_s=0.02), sizes, 1, names=["allreduce"], longest_s=0.025
    )
    assert far["allreduce"][0] == sorted(sizes)
    # The fits from the sizes left still find the link's rate.
    fits = profile.probe_collectives(SlowLink(), sizes, repeats=1, longest_s=0.025)
    assert fits["allreduce"].points == 4 and fits["allreduce"].per_unit_s == pytest.approx(1e-8, rel=0.3)


def test_collectives_may_name_their_dtype() -> None:
    fits = profile.probe_collectives(LocalComm(), names=["allreduce", "allreduce:float16"])
    assert sorted(fits) == ["allreduce", "allreduce:float16"]
    for bad in ("allreduce:float17", "broadcast", "allgather:banana"):
        with pytest.raises(ValueError, match=f"collective {bad!r} is not one of"):
            profile.probe_collectives(LocalComm(), names=[bad])


def test_a_world_of_one_measures_no_contention() -> None:
    model = mlp(layers=2)
    assert profile.measure_contention(model, step_fn(model), LocalComm()) == {}


def test_matmul_speed_is_one_threads_and_leaves_the_thread_count_as_it_was():
    threads = torch.get_num_threads()
    gflops = profile.matmul_gflops(n=128, repeats=3)
    assert torch.get_num_threads() == threads
    # A 128 x 128 product is 4.2 MFLOP; any CPU that runs this suite does it in under a second
    # and no faster than a few TFLOP/s on one thread.
    assert 0.004 < gflops < 5000


def test_copy_speed_is_one_threads_and_counts_the_bytes_read_and_written(monkeypatch):
    threads = torch.get_num_threads()
    copied = []
    real = torch.Tensor.copy_

    def copy_(self, source):
        copied.append((torch.get_num_threads(), source.nbytes))
        return real(self, source)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    clock = iter(range(100))
    monkeypatch.setattr(host, "perf_counter", lambda: next(clock) * 0.01)
    torch.set_num_threads(2)  # not already one thread, so that the measurement has to set it
    try:
        gbytes = profile.one_thread_copy_gbytes_per_s(repeats=3)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert copied == [(1, 32 << 20)] * 3  # half of 64 MB, on one thread, per repeat
    assert gbytes == pytest.approx(2 * (32 << 20) / 0.01 / 1e9)  # read and written in 10 ms


def test_a_benchmarks_provenance_names_the_cpu_and_its_speeds():
    from gradsync.bench import report

    made = report.provenance()["machine"]
    assert made["cores"] == os.cpu_count() and made["matmul_gflops_1_thread"] > 0
    assert made["copy_gbytes_per_s_1_thread"] > 0
    assert "cpu_model" in made


def test_a_copy_told_its_commit_records_it_and_no_claim_of_a_clean_tree(monkeypatch, capsys):
    import subprocess

    from gradsync.bench import report

    monkeypatch.delenv("GRADSYNC_COMMIT", raising=False)
    head = report.provenance()["commit"]
    for told in (head, head[:7]):  # the commit git has, or its abbreviation: checked as ever
        monkeypatch.setenv("GRADSYNC_COMMIT", told)
        assert report.provenance()["commit"] == head and isinstance(report.provenance()["dirty"], bool)
    monkeypatch.setenv("GRADSYNC_COMMIT", "f" * 40)  # a copy whose .git is older than its files
    capsys.readouterr()
    made = report.provenance()
    assert made["commit"] == "f" * 40 and made["dirty"] is None
    assert f"recording commit {'f' * 40} (GRADSYNC_COMMIT), not git's {head}" in capsys.readouterr().err
    monkeypatch.setenv("GRADSYNC_COMMIT", head[:7])
    report.provenance()
    assert "GRADSYNC_COMMIT" not in capsys.readouterr().err  # HEAD abbreviated is no override
    monkeypatch.setenv("GRADSYNC_COMMIT", "f" * 40)

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert report.provenance()["commit"] == "f" * 40
    monkeypatch.delenv("GRADSYNC_COMMIT")
    assert report.provenance()["commit"] == "unknown" and report.provenance()["dirty"] is None


def test_transfers_are_timed_to_their_completion_not_to_the_end_of_the_compute_step_then_running() -> None:
    import threading

    from torch.futures import Future

    from gradsync.profile.collectives import _transfers_while

    class SlowLink:
        """Every allreduce completes 50 ms after it is issued, on another thread."""

        world_size = 2

        def allreduce(self, x: torch.Tensor) -> Future:
            future: Future = Future()
            threading.Timer(0.05, lambda: future.set_result(x)).start()
            return future

    def compute(i: int) -> float:
        time.sleep(0.3)  # one step outlasts every transfer
        return 0.3

    per_transfer, busy = _transfers_while(SlowLink(), "allreduce", [torch.ones(4)] * 2, 4, compute)
    assert 2 * per_transfer < 0.2  # the transfers' 50 ms, not the compute step's 300
    assert busy == 0.3  # the one step that began while they ran
