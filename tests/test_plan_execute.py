"""A Plan executed by the hook, in one process: SyncConfig(plan=...), register()'s checks, and each
group synced by its own strategy (a world of one, where the average is the rank's own gradient, so
each group's result is exactly what its codec makes of that gradient)."""

from __future__ import annotations

import copy
import json
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradsync
from gradsync import SyncConfig, SyncState, autoplan, checkpoint, compress, exchange, tuner
from gradsync.api import read_plan
from gradsync.comm import LocalComm
from gradsync.exchange import Route
from gradsync.plan import GroupPlan, Plan, signature
from gradsync.regroup import Regroup
from gradsync.tuner import AutoState
from gradsync.wire import index_nbytes

WARMUP = 2
VOCAB, DIM, CONTEXT, WIDTH, CLASSES = 40, 8, 2, 16, 4
# Net's parameters: 0 embed.weight (320), 1 hidden.weight (256), 2 hidden.bias (16),
# 3 out.weight (64), 4 out.bias (4).
GROUPS = [((4, 3), "none"), ((2, 1), "fp16:collective=allgather"), ((0,), "topk:ratio=0.1:scheme=auto")]


class Net(nn.Module):
    def __init__(self, width: int = WIDTH, sparse_embedding: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM, sparse=sparse_embedding)
        self.hidden = nn.Linear(CONTEXT * DIM, width)
        self.out = nn.Linear(width, CLASSES)

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(words).flatten(1))))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    words = torch.randint(VOCAB, (6, CONTEXT), generator=generator)
    return words, torch.randint(CLASSES, (6,), generator=generator)


def make_plan(model: nn.Module, groups: Sequence[tuple[Sequence[int], str]], world_size: int = 1) -> Plan:
    params = list(model.parameters())
    return Plan(
        signature(model),
        world_size,
        tuple(GroupPlan(tuple(ps), sum(params[p].numel() for p in ps), text) for ps, text in groups),
    )


def config(**fields: Any) -> SyncConfig:
    return SyncConfig(**{"warmup_steps": WARMUP, **fields})


# -- SyncConfig(plan=...) ---------------------------------------------------------------------------


def test_a_plan_file_reads_back_as_the_plan_it_holds(tmp_path: Path) -> None:
    plan = make_plan(Net(), GROUPS)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert read_plan(str(path)) == read_plan(path) == read_plan(plan.to_dict()) == plan
    from_file, from_object = config(plan=read_plan(path)), config(plan=plan)
    assert from_file == from_object
    assert from_file.fingerprint() == from_object.fingerprint()
    assert from_file.to_dict()["plan"] == plan.to_dict()
    assert SyncConfig(**from_file.to_dict()).fingerprint() == from_file.fingerprint()  # plain data
    assert config(plan=str(path)).to_dict()["plan"] == str(path)  # read by register(), not here


def test_configs_with_different_plans_or_none_differ_and_fingerprint_differently() -> None:
    plan = make_plan(Net(), GROUPS)
    other = make_plan(Net(), [((4, 3), "none"), ((2, 1), "fp16"), ((0,), "topk:ratio=0.1:scheme=auto")])
    configs = [config(), config(plan=plan), config(plan=other)]
    assert len({c.fingerprint() for c in configs}) == 3
    assert configs[1] != configs[2] and configs[0] != configs[1]


def test_an_unknown_codec_in_a_plan_file_fails_when_it_is_read(tmp_path: Path) -> None:
    data = make_plan(Net(), GROUPS).to_dict()
    data["groups"][1]["strategy"] = "zstd:level=3"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as excinfo:
        read_plan(str(path))
    message = str(excinfo.value)
    assert str(path) in message and "group 1" in message and "unknown codec 'zstd'" in message
    assert "topk" in message  # the codecs to choose from


def test_a_plan_file_that_is_not_json_fails_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text("{groups: ")
    with pytest.raises(ValueError, match=r"plan\.json.*must be JSON"):
        read_plan(str(path))


def test_a_plan_strategy_that_sets_a_seed_is_refused_naming_the_fix() -> None:
    plan = make_plan(Net(), [((4, 3, 2, 1, 0), "qsgd:seed=3")])
    with pytest.raises(ValueError, match=r"group 0.*'qsgd:seed=3'.*SyncConfig\(seed=\.\.\.\)"):
        read_plan(plan)


def test_explicit_feedback_is_checked_against_every_compressed_group() -> None:
    plan = make_plan(Net(), [((4, 3, 2, 1), "fp16"), ((0,), "dgc:ratio=0.1:scheme=auto")])
    with pytest.raises(ValueError, match=r"'dgc' keeps its own error memory.*error_feedback='ef'"):
        config(plan=plan, error_feedback="ef")
    # The compressor field names no codec of the plan, so it has no say in feedback.
    assert config(plan=plan, compressor="dgc").feedback_for("fp16") == "none"
    uncompressed = make_plan(Net(), [((4, 3, 2, 1, 0), "none")])
    with pytest.warns(UserWarning, match="no effect: the plan compresses no group"):
        config(plan=uncompressed, error_feedback="ef")


def test_auto_feedback_resolves_for_each_groups_codec() -> None:
    cfg = config(plan=make_plan(Net(), GROUPS))
    assert [cfg.feedback_for(s.codec) for s in cfg.plan.strategies] == ["none", "none", "ef"]


def test_plan_auto_registers_a_planner_that_has_not_planned_yet(one_rank: None) -> None:
    cfg = config(plan="auto")
    assert cfg.plan == "auto" and cfg.to_dict()["plan"] == "auto"
    state = gradsync.register(DistributedDataParallel(Net()), cfg)
    assert isinstance(state, AutoState) and state.plan is None
    assert state.stats()["auto"]["adopted_at_step"] is None


@pytest.mark.parametrize("warmup_steps", [0, 1])
def test_register_refuses_a_warmup_ddp_cannot_take_with_the_reason(one_rank: None, warmup_steps: int) -> None:
    model = DistributedDataParallel(Net())
    with pytest.raises(ValueError) as excinfo:
        gradsync.register(model, SyncConfig(warmup_steps=warmup_steps))
    message = str(excinfo.value)
    assert f"warmup_steps={warmup_steps}" in message and "[2, inf]" in message
    assert "DDP rebuilds its buckets" in message  # the reason, not only the constraint


class WithUnused(Net):
    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(3, 3)  # never in the forward pass


def test_plan_auto_plans_every_trainable_parameter_even_one_never_used(one_rank: None) -> None:
    model = DistributedDataParallel(WithUnused(), find_unused_parameters=True)
    state = gradsync.register(model, config(plan="auto", compressor="qsgd"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(tuner.warmup_steps(state.config) + 2):
        words, labels = batch(step)
        optimizer.zero_grad()
        loss_fn(model(words), labels).backward()
        optimizer.step()
    assert isinstance(state, AutoState) and state.done and state.plan is not None
    covered = sorted(p for group in state.plan.groups for p in group.params)
    assert covered == list(range(len(list(model.parameters()))))
    state.plan.check(model, 1)  # the plan it made fits the model
    assert all(g is not None for g in state.stats()["groups"])  # and every group ran


def test_plan_auto_measures_compression_errors_in_its_measuring_step_alone(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every one-off cost of measuring falls in the one step that probes the collectives and codecs
    # (already long), not in another: the errors are taken as that step's buckets go by, and the
    # candidates made at the next step's start keep to their budget.
    model = DistributedDataParallel(Net(), bucket_cap_mb=0.001)  # 1 KB: buckets of one or two
    state = gradsync.register(model, config(plan="auto", compressor="qsgd"))
    assert isinstance(state, AutoState)
    at: list[tuple[int, tuple[int, ...]]] = []  # (step, the parameters measured) per bucket
    error_levels = tuner.error_levels

    def noted(gradients: dict[int, torch.Tensor], config: SyncConfig) -> dict[int, dict[str, float]]:
        at.append((state.step, tuple(gradients)))
        return error_levels(gradients, config)

    monkeypatch.setattr(tuner, "error_levels", noted)
    _train(model, tuner.PLANNED)
    assert len(at) > 1 and {step for step, _ in at} == {tuner.MEASURING} and state.candidates == []
    assert sorted(p for _, params in at for p in params) == list(range(len(list(model.parameters()))))
    _train(model, 1, first=tuner.PLANNED)
    assert state.candidates and state.probe_from == max(tuner.PLANNED, state.config.warmup_steps)
    compressing = [p for p in state.candidates if any(s.compressed for s in p.strategies)]
    assert compressing and all(p.meta["error_budget"] > 0 for p in compressing)
    assert {step for step, _ in at} == {tuner.MEASURING}


@pytest.mark.parametrize("turns", [False, True], ids=["runoff-confirms", "runoff-turns"])
def test_plan_auto_runs_off_close_candidates_and_keeps_the_winner_running(
    one_rank: None, monkeypatch: pytest.MonkeyPatch, turns: bool
) -> None:
    # Measured times set by hand (real ones are noise at this size): after the first round the
    # top-k candidate leads another by under the margin; the runoff confirms it, or turns.
    # The leader, a top-k plan, comes before the runner-up in the first round, so it runs last in
    # the runoff: it goes on where it wins, and hands over where it loses.
    def lead_and_other(state: AutoState) -> tuple[int, int]:
        topk = [c for c, p in enumerate(state.candidates) if any(s.codec == "topk" for s in p.strategies)]
        lead = next(c for c in topk if c + 1 < len(state.candidates))
        return lead, lead + 1

    calls = []

    def measured_s(state: AutoState) -> list[float]:
        lead, other = lead_and_other(state)
        times = [2.0] * len(state.candidates)
        times[lead], times[other] = (1.1, 1.0) if calls and turns else (1.0, 1.0 + autoplan.RUNOFF_MARGIN / 2)
        calls.append(times)
        return times

    monkeypatch.setattr(AutoState, "_measured_s", measured_s)
    model = DistributedDataParallel(Net())
    state = gradsync.register(model, config(plan="auto", compressor="topk", compressor_args={"ratio": 0.1}))
    assert isinstance(state, AutoState)
    last_probe = tuner.warmup_steps(state.config) - 1
    _train(model, last_probe)
    assert not state.done and state.probe_from is not None
    points_before = dict(state.points)  # what runs in the runoff's last steps
    _train(model, 3, first=last_probe)
    assert state.done
    n = len(state.candidates)
    lead, other = lead_and_other(state)
    # The first round in the candidates' order, then the two again in reverse order.
    assert state.order == [*range(n), other, lead]
    assert state.adopted_at == state.probe_from + len(state.order) * tuner.STEPS_EACH
    assert all(len(state.probe_s[c]) == (tuner.STEPS_EACH - 1) * state.order.count(c) for c in range(n))
    best = other if turns else lead
    assert state.plan is not None and state.plan.meta["chosen"] == state.candidates[best].meta["chosen"]
    kept = [g for g, p in state.points.items() if points_before.get(g) is p]
    if not turns:
        # Adopted while running: the same codecs and memories go on, top-k's warm-up taken up
        # where training stands, as a codec made at adoption would.
        assert points_before and kept == list(points_before)
        for point in state.points.values():
            if type(point.codec).warms_up:
                assert point.codec.steps == state.step - state.config.warmup_steps
    else:
        assert kept == []  # made afresh, with what the last candidate's memories held carried


def test_plan_auto_takes_the_measured_steps_as_the_probe_of_the_plan_they_ran(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The steps that measured the timeline ran uncompressed on DDP's buckets; where that plan is a
    # candidate, their times are its measurement and it is not run again (sparse_scheme="dense":
    # no embedding rows routed apart, so those steps ran the plan's plain allreduces).
    model = DistributedDataParallel(Net(), bucket_cap_mb=0.001)  # several buckets
    state = gradsync.register(model, config(plan="auto", compressor="qsgd", sparse_scheme="dense"))
    assert isinstance(state, AutoState)
    made = tuner.candidates

    def fp32_first(measured: autoplan.Measured, cfg: SyncConfig, model_signature: str, buckets: Any) -> list:
        fp32 = make_plan(model, [(b, "none") for b in buckets])
        others = made(measured, cfg, model_signature, buckets)
        return [fp32, *[p for p in others if not state._ran_measuring(p, buckets)][: autoplan.CANDIDATES - 1]]

    monkeypatch.setattr(tuner, "candidates", fp32_first)
    _train(model, tuner.warmup_steps(state.config) + 1)
    assert state.done and len(state.candidates) > 1
    # One forward pass per step: the timer's index of a step is the step. Steps 2 .. MEASURED are
    # the counted ones of the timeline (the first two are DDP's one-off steps).
    timer = state.timer
    ran_s = [timer.synced[k] - timer.forward_start[k] for k in range(2, tuner.MEASURED + 1)]
    # Its measurement first; probe steps follow only where a runoff calls it.
    assert state.probe_s[0][: len(ran_s)] == ran_s
    assert state.stats()["auto"]["candidates"][0]["measured_s"] == state.probe_s[0]
    others = list(range(1, len(state.candidates)))
    assert state.order[: len(others)] == others  # the first round, without it
    probed = {c: (tuner.STEPS_EACH - 1) * state.order.count(c) for c in range(len(state.candidates))}
    assert all(len(state.probe_s[c]) == probed[c] for c in others)
    assert len(state.probe_s[0]) == len(ran_s) + probed[0]
    assert state.adopted_at == state.probe_from + len(state.order) * tuner.STEPS_EACH


def test_plan_auto_times_its_probe_steps_without_what_the_script_does_between_them(one_rank: None) -> None:
    # A script that evaluates between steps (here every other step: an evaluation's forward
    # passes and 0.3 s of other work) must not make the candidates it lands on look slower. The
    # time between a step's exchange and the next forward pass counts once, as its least.
    model = DistributedDataParallel(Net())
    state = gradsync.register(model, config(plan="auto", compressor="qsgd"))
    assert isinstance(state, AutoState)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    evaluation_s = 0.3
    for step in range(tuner.warmup_steps(state.config) + 1):
        words, labels = batch(step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(words), labels).backward()
        optimizer.step()
        if step % 2:
            with torch.no_grad():
                model(words)
            time.sleep(evaluation_s)
    assert state.done and state.probe_s
    counted = [t for times in state.probe_s.values() for t in times]
    assert len(counted) >= 2 * len(state.candidates)  # evaluations fell on counted steps
    assert max(counted) < evaluation_s  # a step that held the evaluation took longer
    assert 0 < state.between_s < evaluation_s  # the optimizer's step, at least
    assert state.stats()["auto"]["between_s"] == state.between_s
    chosen = state.plan.measured_step_s  # type: ignore[union-attr]
    assert chosen == pytest.approx(min(min(t) for t in state.probe_s.values()) + state.between_s)


def test_plan_auto_resumes_a_checkpoint_saved_before_runoffs_existed(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = DistributedDataParallel(Net())
    state = gradsync.register(model, config(plan="auto", compressor="qsgd"))
    assert isinstance(state, AutoState)
    probe_from = max(tuner.PLANNED, state.config.warmup_steps)
    _train(model, probe_from + tuner.STEPS_EACH + 1)
    own = AutoState._own_state

    def without_order(self: AutoState) -> dict[str, Any]:
        saved = own(self)
        del saved["auto"]["order"]  # what a version without runoffs saved
        return saved

    monkeypatch.setattr(AutoState, "_own_state", without_order)
    saved = state.state_dict()
    resumed = gradsync.register(DistributedDataParallel(Net()), config(plan="auto", compressor="qsgd"))
    assert isinstance(resumed, AutoState)
    resumed.load_state_dict(saved)
    # It had tried the candidates in their order.
    assert len(resumed.candidates) == len(state.candidates) and resumed.order == list(
        range(len(state.candidates))
    )


def test_plan_auto_refuses_sparse_gradients_before_training(one_rank: None) -> None:
    with pytest.raises(ValueError, match=r"plan='auto'\): parameters \[\d+\] have sparse \(COO\) gradients"):
        gradsync.register(DistributedDataParallel(Net(sparse_embedding=True)), config(plan="auto"))


# -- register() refuses what cannot run, before training ----------------------------------------------


def _other_width_plan() -> Plan:
    return make_plan(Net(width=WIDTH + 1), [((4, 3, 2, 1, 0), "none")])


BAD_PLANS = {
    "a parameter in no group": (
        lambda: make_plan(Net(), [((4, 3), "none"), ((2, 1), "fp16")]),
        r"trainable parameters \[0\] are in no group",
    ),
    "a parameter in two groups": (
        lambda: make_plan(Net(), [((4, 3, 2), "none"), ((2, 1, 0), "fp16")]),
        r"parameter 2 is in plan groups 0 and 1",
    ),
    "another model": (_other_width_plan, r"made for another model .* parameter names or shapes differ"),
    "another world size": (
        lambda: make_plan(Net(), GROUPS, world_size=4),
        r"made for 4 ranks but runs on 1.*--world 1",
    ),
    "hierarchical exchange": (
        lambda: make_plan(Net(), [((4, 3, 2, 1), "none"), ((0,), "qsgd:collective=two-level")]),
        r"plan group 1 \(strategy 'qsgd:collective=two-level'\).*does not build yet.*collective=allgather",
    ),
}


@pytest.mark.parametrize("case", BAD_PLANS, ids=list(BAD_PLANS))
def test_register_refuses_a_bad_plan_before_training(one_rank: None, case: str) -> None:
    make, expected = BAD_PLANS[case]
    model = DistributedDataParallel(Net())
    with pytest.raises(ValueError, match=expected):
        gradsync.register(model, config(plan=make()))


def test_register_refuses_a_plan_group_holding_a_sparse_gradient(one_rank: None) -> None:
    model = DistributedDataParallel(Net(sparse_embedding=True))
    plan = make_plan(model, [((4, 3, 2, 1), "none"), ((0,), "none:scheme=auto")])
    with pytest.raises(ValueError, match=r"plan group 1 .*parameters \[0\] have sparse \(COO\) gradients"):
        gradsync.register(model, config(plan=plan))


def test_on_cpu_runs_on_a_cpu_model_as_on_device(one_rank: None) -> None:
    model = DistributedDataParallel(Net())
    plan = make_plan(model, [((4, 3, 2, 1), "none"), ((0,), "topk:ratio=0.1:on=cpu")])
    state = gradsync.register(model, config(plan=plan))
    _train(model, WARMUP + 1)
    assert state.stats()["groups"][1]["codec"] == "topk"


# -- execution -------------------------------------------------------------------------------------


def _train(model: nn.Module, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        words, labels = batch(step)
        model.zero_grad()
        nn.functional.cross_entropy(model(words), labels).backward()


def _local_gradients(model: nn.Module, step: int) -> list[torch.Tensor]:
    words, labels = batch(step)
    return list(torch.autograd.grad(nn.functional.cross_entropy(model(words), labels), model.parameters()))


def test_each_group_is_synced_by_its_own_strategy(one_rank: None) -> None:
    net = Net()
    reference = copy.deepcopy(net)  # no optimizer: the parameters stay as they are
    model = DistributedDataParallel(net)
    plan = make_plan(model, GROUPS)
    state = gradsync.register(model, config(plan=plan))
    _train(model, WARMUP)
    assert state.stats()["groups"] == [None, None, None]  # warm-up: DDP's buckets, no group ran
    assert state.stats()["total"]["compressed_groups"] == 0

    _train(model, 1, first=WARMUP)  # the first compressed step: error memories are still empty
    local = _local_gradients(reference, WARMUP)
    grads = [p.grad for p in model.parameters()]
    for index in (4, 3):  # fp32: a world of one's average is the gradient itself
        assert torch.equal(grads[index], local[index])
    for index in (2, 1):  # fp16, decoded
        assert torch.equal(grads[index], local[index].half().float())
    topk = compress.build("topk", ratio=0.1)
    payload, ctx = topk.compress(local[0].reshape(-1))
    assert torch.equal(grads[0].reshape(-1), topk.decompress(payload, ctx))

    groups = state.stats()["groups"]
    assert [g["group"] for g in groups] == [0, 1, 2]
    assert [g["strategy"] for g in groups] == [text for _, text in GROUPS]
    assert [g["codec"] for g in groups] == ["none", "fp16", "topk"]
    assert [(g["collective"], g["scheme"]) for g in groups] == [
        ("allreduce", None),
        ("allgather", None),
        ("allgather", "agsparse"),  # the selector's decision step gathers the rows
    ]
    assert [g["feedback"] for g in groups] == ["none", "none", "ef"]
    assert [g["numel"] for g in groups] == [g.numel for g in plan.groups]
    assert [g["tensors"] for g in groups] == [2, 2, 1]
    assert all(g["step"] == WARMUP for g in groups)
    assert groups[1]["payload_nbytes"] == 2 * plan.groups[1].numel
    last = state.stats()["last_step"]
    assert (last["groups"], last["compressed_groups"]) == (3, 2)
    assert sorted(state.points) == [1, 2]  # compression points by group; fp32 has none


# strategy -> (collective, sparse scheme) it runs. PowerSGD's rounds and the sign vote are
# allreduces of their own.
RUNS = {
    "none": ("allreduce", None),
    "none:scheme=agsparse": ("allreduce", "agsparse"),  # the embedding's rows; the rest allreduced
    "fp16": ("allreduce", None),
    "fp16:collective=allgather": ("allgather", None),
    "topk:ratio=0.1": ("allgather", None),
    "topk:ratio=0.1:scheme=balanced": ("allgather", "balanced"),
    "qsgd": ("two-shot", None),
    "qsgd:collective=allgather": ("allgather", None),
    "powersgd:rank=1": ("allreduce", None),
    "signsgd": ("allreduce", None),
}


@pytest.mark.parametrize("text", RUNS)
def test_each_strategy_runs_the_exchange_it_names(text: str) -> None:
    net = Net()
    plan = make_plan(net, [((0, 1, 2, 3, 4), text)])
    state = SyncState(config(plan=plan), LocalComm(), net)
    generator = torch.Generator().manual_seed(0)
    for _ in range(WARMUP + 1):
        grads = torch.randn(plan.groups[0].numel, generator=generator)
        grads[: 10 * DIM] = 0  # embedding rows 0..9 untouched this step
        state.sync(grads, 0, is_last=True, params=plan.groups[0].params).wait()
    group = state.stats()["groups"][0]
    assert (group["collective"], group["scheme"]) == RUNS[text]
    assert group["codec"] == ("none" if text.startswith("none") else text.split(":")[0])


def test_min_compress_numel_does_not_apply_to_plan_groups(one_rank: None) -> None:
    model = DistributedDataParallel(Net())
    plan = make_plan(model, [((4,), "fp16"), ((3, 2, 1, 0), "none")])
    state = gradsync.register(model, config(plan=plan, min_compress_numel=1 << 20))
    _train(model, WARMUP + 1)
    assert state.stats()["groups"][0]["codec"] == "fp16"  # 4 elements, compressed as planned
    assert state.stats()["groups"][0]["collective"] == "allreduce"


def _group_gradients(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(group.numel, generator=generator) for group in _STATE_PLAN.groups]


_STATE_PLAN = make_plan(Net(), [((4, 3), "qsgd"), ((2, 1), "none"), ((0,), "topk:ratio=0.1:scheme=auto")])


def _sync_steps(state: SyncState, steps: range) -> list[torch.Tensor]:
    out = []
    for step in steps:
        grads = _group_gradients(step)
        for index, g in enumerate(grads):
            out.append(state.sync(g, index, is_last=index == len(grads) - 1).wait().clone())
    return out


def test_a_plan_state_resumes_bit_for_bit_from_its_state_dict() -> None:
    cfg = config(plan=_STATE_PLAN)
    continuous = SyncState(cfg, LocalComm())
    expected = _sync_steps(continuous, range(8))
    first = SyncState(cfg, LocalComm())
    _sync_steps(first, range(4))
    saved = first.state_dict()
    own, _ = checkpoint.own_part(saved, 0)
    assert own["layout"] == {i: list(g.params) for i, g in enumerate(_STATE_PLAN.groups)}
    assert sorted(own["points"]) == [0, 2]
    resumed = SyncState(cfg, LocalComm())
    resumed.load_state_dict(saved)
    got = _sync_steps(resumed, range(4, 8))
    later = expected[len(_STATE_PLAN.groups) * 4 :]
    assert all(torch.equal(a, b) for a, b in zip(got, later, strict=True))
    # Without the state (error memory, qsgd's stream), the same steps come out otherwise.
    fresh = SyncState(cfg, LocalComm())
    fresh.step = 4
    assert not all(torch.equal(a, b) for a, b in zip(_sync_steps(fresh, range(4, 8)), later, strict=True))


def test_a_plan_adopted_mid_run_takes_up_a_sparsifiers_warmup_where_training_stands() -> None:
    # Codecs are made afresh for a new plan (plan="auto" adopts one after its first steps); a
    # top-k made at step 7, after 2 fp32 steps and 5 compressed, sends what compressed step 5
    # of its warm-up sends (6.25 % of 320 entries), not what a fresh codec's first step would.
    warming = "topk:ratio=0.01:sparsity_warmup_steps=16"
    plan = make_plan(Net(), [((4, 3), "none"), ((2, 1), "none"), ((0,), warming)])
    state = SyncState(config(plan=plan), LocalComm())
    state.step = 7
    grads = _group_gradients(7)
    outs = [state.sync(g, index, is_last=index == 2).wait() for index, g in enumerate(grads)]
    assert int((outs[2] != 0).sum()) == 20
    assert state.points[2].codec.steps == 6
    # In planning, a codec is priced as it runs after its warm-up: 1 % of the entries.
    assert plan.strategies[2].payload_bytes(320) == index_nbytes(320, 3) + 4 * 3


def test_a_state_saved_with_another_plan_is_refused() -> None:
    saved = SyncState(config(plan=_STATE_PLAN), LocalComm()).state_dict()
    other = make_plan(Net(), [((4, 3), "fp16"), ((2, 1), "none"), ((0,), "topk:ratio=0.1:scheme=auto")])
    with pytest.raises(ValueError, match="resume with the same SyncConfig"):
        SyncState(config(plan=other), LocalComm()).load_state_dict(saved)


def test_regroup_refuses_a_step_that_leaves_a_group_without_gradients() -> None:
    regroup = Regroup({0: (0, 1), 1: (2,)})
    with pytest.raises(ValueError, match=r"group 1 needs the gradients of parameters \[2\]"):
        regroup.add(torch.ones(5), (0, 1), [2, 3], is_last=True)


# -- exchange.start(collective="allgather") ---------------------------------------------------------


def test_exchange_allgathers_a_summable_payload_when_asked() -> None:
    x = torch.randn(1000)
    summed = exchange.start(compress.build("fp16"), x, Route(LocalComm())).wait()
    gathered = exchange.start(compress.build("fp16"), x, Route(LocalComm()), collective="allgather").wait()
    assert (summed.collective, gathered.collective) == ("allreduce", "allgather")
    assert torch.equal(gathered.total, summed.total)
    assert gathered.payload_nbytes == 2 * x.numel()


@pytest.mark.parametrize("name", ["powersgd", "signsgd"])
def test_exchange_refuses_to_allgather_codecs_without_a_decode_per_payload(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        codec = compress.build(name)
    with pytest.raises(
        ValueError, match=rf"collective='allgather' for {type(codec).__name__}.*allreduces of its own"
    ):
        exchange.start(codec, torch.randn(64, 8), Route(LocalComm()), collective="allgather")


def test_a_failed_register_leaves_no_hooks_behind(one_rank: None) -> None:
    # DDP takes one comm hook per model: a second register() fails, naming why, before it puts
    # plan="auto"'s timers on the model, which would run on every step from then on.
    model = DistributedDataParallel(Net())
    gradsync.register(model, config())
    counts = (len(model._forward_pre_hooks), len(model._forward_hooks))
    grad_hooks = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
    with pytest.raises(ValueError, match=r"has a comm hook already \(hook: an earlier gradsync.register"):
        gradsync.register(model, config(plan="auto"))
    assert len(model._comm_hooks) == 1  # the first register's alone
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == counts
    assert [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()] == grad_hooks


def test_a_register_the_reducer_refuses_takes_back_everything_it_installed(one_rank: None) -> None:
    # A built-in hook is not in DDP's record of comm hooks: its reducer refuses gradsync's, after
    # the record took it and plan="auto" put its timers on the model.
    model = DistributedDataParallel(Net())
    model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    counts = (len(model._forward_pre_hooks), len(model._forward_hooks))
    grad_hooks = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
    with pytest.raises(ValueError, match=r"has a comm hook already \(a built-in one"):
        gradsync.register(model, config(plan="auto"))
    assert model._comm_hooks == []
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == counts
    assert [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()] == grad_hooks


def test_a_deepcopied_ddp_model_takes_gradsync_and_averages_with_it(one_rank: None) -> None:
    # A copy keeps DDP's record of the original's hook, but builds a fresh reducer with none:
    # register() on it must not be refused, and only its own hook stays in the record.
    original = DistributedDataParallel(Net())
    gradsync.register(original, config())
    copied = copy.deepcopy(original)
    state = gradsync.register(copied, config())
    assert [s for _, s in copied._comm_hooks] == [state]
    words, _ = batch(0)
    copied(words).sum().backward()
    assert state.step == 1


def test_ddps_mixed_precision_is_refused_by_name(one_rank: None) -> None:
    from torch.nn.parallel.distributed import _MixedPrecision

    model = DistributedDataParallel(Net(), mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"mixed_precision=\.\.\.\) averages gradients by a comm hook"):
        gradsync.register(model, config())
