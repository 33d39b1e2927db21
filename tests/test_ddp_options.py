"""gradsync under DDP's own options and PyTorch's training tools, each against a reference run:
static_graph and find_unused_parameters must not change a bit of what gradsync does; gradient
accumulation under no_sync, autocast and torch.compile must train as their reference does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradsync
from gradsync import SyncConfig, tuner
from gradsync.plan import GroupPlan, Plan, signature
from gradsync.tuner import AutoState

STEPS = 6
CONFIGS = {
    "int4": {},  # the default codec (two-shot), compressing every bucket
    "plan": {"compressor": "fp16", "plan": "auto"},
}


class Net(nn.Module):
    """Two layers and one parameter the forward pass never uses (DDP must be told)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(32, 256)
        self.spare = nn.Linear(3, 3)  # never used in the forward pass
        self.out = nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


class Used(Net):
    """Every parameter used."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0 * sum(p.sum() for p in self.spare.parameters())


def batch(step: int, part: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + part)
    return torch.randn(8, 32, generator=generator), torch.randint(8, (8,), generator=generator)


def train(
    config: dict[str, Any] | None,
    ddp_options: dict[str, Any] | None = None,
    step_fn: Callable[[nn.Module, int], None] | None = None,
    wrap: Callable[[nn.Module], nn.Module] = lambda m: m,
    net: Callable[[], nn.Module] = Net,
    steps: int = STEPS,
) -> list[torch.Tensor]:
    """STEPS steps of SGD on `net` under DDP with `ddp_options` (default: two buckets, unused
    parameters found), gradsync with `config` (None: plain DDP); the parameters after."""
    options = {"bucket_cap_mb": 0.01, "find_unused_parameters": True, **(ddp_options or {})}
    ddp = DistributedDataParallel(net(), **options)
    state = None
    if config is not None:
        state = gradsync.register(ddp, SyncConfig(warmup_steps=2, min_compress_numel=0, **config))
    model = wrap(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        if step_fn is None:
            x, y = batch(step)
            nn.functional.cross_entropy(model(x), y).backward()
        else:
            step_fn(model, step)
        optimizer.step()
    if isinstance(state, AutoState):
        assert state.plan is not None  # planned, and executed its plan since
    elif state is not None:
        assert state.stats()["total"]["compressed_groups"] > 0  # gradsync did compress
    return [p.detach().clone() for p in ddp.parameters()]


def test_static_graph_and_find_unused_parameters_change_nothing_an_elementwise_codec_does(
    one_rank: None,
) -> None:
    fp16 = {"compressor": "fp16"}
    reference = train(fp16)
    for options, net in (
        ({"static_graph": True, "find_unused_parameters": False}, Net),
        ({"find_unused_parameters": False}, Used),
    ):
        other = train(fp16, options, net=net)
        if net is Used:
            reference = train(fp16, net=Used)
        assert all(torch.equal(a, b) for a, b in zip(other, reference, strict=True)), options


@pytest.mark.parametrize("name", CONFIGS)
def test_static_graph_compresses_ddps_rebuilt_buckets_from_the_end_of_warm_up(
    one_rank: None, name: str
) -> None:
    # DDP rebuilds its buckets after the second iteration under static_graph, not the first: its
    # buckets differ from a dynamic graph's, so blockwise codecs round other blocks (close, not equal).
    steps = tuner.warmup_steps(SyncConfig(**CONFIGS[name])) + 3
    static = train(CONFIGS[name], {"static_graph": True, "find_unused_parameters": False}, steps=steps)
    dynamic = train(CONFIGS[name], steps=steps)
    for a, b in zip(static, dynamic, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)


def test_accumulating_under_no_sync_equals_one_backward_of_the_summed_loss(one_rank: None) -> None:
    def accumulated(model: nn.Module, step: int) -> None:
        with model.no_sync():
            x, y = batch(step, 0)
            nn.functional.cross_entropy(model(x), y).backward()
        x, y = batch(step, 1)
        nn.functional.cross_entropy(model(x), y).backward()  # this backward syncs

    def summed(model: nn.Module, step: int) -> None:
        loss = sum(nn.functional.cross_entropy(model(x), y) for x, y in (batch(step, 0), batch(step, 1)))
        loss.backward()

    fp16 = {"compressor": "fp16"}
    for a, b in zip(train(fp16, step_fn=accumulated), train(fp16, step_fn=summed), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_autocast_trains_as_plain_ddp_does_within_fp16_rounding(one_rank: None) -> None:
    def autocast(model: nn.Module, step: int) -> None:
        x, y = batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()

    with_gradsync = train({"compressor": "fp16"}, step_fn=autocast)
    plain = train(None, step_fn=autocast)
    for a, b in zip(with_gradsync, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3)
    assert not all(torch.equal(a, b) for a, b in zip(with_gradsync, plain, strict=True))  # fp16 did round


def test_torch_compile_trains_as_eager_does(one_rank: None) -> None:
    # One bucket: DDP's graph splitter under torch.compile wants its first bucket no larger.
    one_bucket = {"bucket_cap_mb": 25, "find_unused_parameters": False}
    fp16 = {"compressor": "fp16"}
    compiled = train(fp16, one_bucket, wrap=lambda m: torch.compile(m, backend="aot_eager"), net=Used)
    eager = train(fp16, one_bucket, net=Used)
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("plan", ["auto", "plan.json"])
def test_a_plan_on_a_state_made_without_the_model_is_refused_by_name(one_rank: None, plan: str) -> None:
    # Such a state sees DDP's buckets only: a plan's groups (sets of parameters) would be taken
    # by bucket index, or a plan file never read.
    ddp = DistributedDataParallel(Used(), bucket_cap_mb=0.01)
    ddp.register_comm_hook(gradsync.SyncState(SyncConfig(plan=plan)), gradsync.hook)
    x, y = batch(0)
    with pytest.raises(Exception, match=r"made without the model.*gradsync.register\(ddp_model"):
        nn.functional.cross_entropy(ddp(x), y).backward()


@pytest.mark.parametrize("warmup_steps", [0, 1])
def test_a_state_made_without_the_model_waits_for_static_graphs_rebuilt_buckets(
    one_rank: None, warmup_steps: int
) -> None:
    # register() refuses a warm-up shorter than DDP's initial iterations, but a state installed by
    # register_comm_hook (a framework's ddp_comm_state) cannot see static_graph=True, under which
    # DDP rebuilds its buckets after its second iteration: it must not compress on the first
    # layout and then meet the rebuilt one ("the layout changed").
    runs = []
    for static in (True, False):
        ddp = DistributedDataParallel(Used(), bucket_cap_mb=0.002, static_graph=static)
        state = gradsync.SyncState(SyncConfig(warmup_steps=warmup_steps, min_compress_numel=0))
        ddp.register_comm_hook(state, gradsync.hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(5):
            optimizer.zero_grad()
            x, y = batch(step)
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
        assert state.step == 5 and state.stats()["total"]["compressed_groups"] > 0
        runs.append([p.detach().clone() for p in ddp.parameters()])
    # Both compress DDP's rebuilt buckets from their third step on: the same bits.
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


class Tower(nn.Module):
    """A last layer larger than any bucket cap here (its own bucket), then three small ones:
    bucket_cap_mb 0.02 buckets them [(7, 6), (5, 4, 3, 2), (1, 0)], 0.04 [(7, 6), (5, 4, 3, 2, 1, 0)]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(16, 64),
            nn.Tanh(),
            nn.Linear(64, 64),
            nn.Tanh(),
            nn.Linear(64, 64),
            nn.Tanh(),
            nn.Linear(64, 256),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def steps_from(
    ddp: DistributedDataParallel,
    config: SyncConfig,
    steps: range,
    saved: dict | None = None,
    hooked: bool = False,
) -> tuple[DistributedDataParallel, Any]:
    """`steps` of plain SGD on `ddp` under gradsync with `config`, from `saved` (the module's and
    gradsync's state) where given: a run, or a run resumed in a fresh model. `hooked`: by a state
    made without the model (register_comm_hook, as a framework's ddp_comm_state), not register()."""
    if hooked:
        state = gradsync.SyncState(config)
        ddp.register_comm_hook(state, gradsync.hook)
    else:
        state = gradsync.register(ddp, config)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    if saved is not None:
        ddp.module.load_state_dict(saved["model"])
        state.load_state_dict(saved["gradsync"])
    for step in steps:
        optimizer.zero_grad()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        ddp(x).square().mean().backward()
        optimizer.step()
    return ddp, state


def tower_steps(
    cap_mb: float, steps: range, saved: dict | None = None
) -> tuple[DistributedDataParallel, Any]:
    ddp = DistributedDataParallel(Tower(), bucket_cap_mb=cap_mb)
    return steps_from(ddp, SyncConfig(warmup_steps=2, min_compress_numel=0), steps, saved)  # int4, ef


def test_a_state_resumed_under_another_bucket_cap_follows_its_saved_groups_exactly(one_rank: None) -> None:
    # The fresh model's first bucket is laid out as a saved group and is synced in place; its
    # second is not, and the other saved groups are cut out of it, step after step.
    continuous, state = tower_steps(0.02, range(6))
    assert list(state.layout.values()) == [(7, 6), (5, 4, 3, 2), (1, 0)]
    first, state = tower_steps(0.02, range(3))
    saved = {
        "model": {k: v.clone() for k, v in first.module.state_dict().items()},
        "gradsync": state.state_dict(),
    }
    resumed, state = tower_steps(0.04, range(3, 6), saved)
    assert list(state.layout.values()) == [(7, 6), (5, 4, 3, 2), (1, 0)]
    for a, b in zip(resumed.parameters(), continuous.parameters(), strict=True):
        assert torch.equal(a, b)


def test_parameters_ddp_ignores_are_left_out_of_plans(one_rank: None) -> None:
    # Frameworks tell DDP to ignore some parameters (expert-parallel ones): they never reach
    # the hook, so a plan must not hold them, and one that leaves them out must be accepted.
    net = Used()
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ["hidden.bias"])
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.01)
    state = gradsync.register(ddp, SyncConfig(compressor="fp16", plan="auto", min_compress_numel=0))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(tuner.warmup_steps(state.config) + 3):
        optimizer.zero_grad()
        x, y = batch(step)
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    assert isinstance(state, AutoState) and state.plan is not None
    planned = {param for group in state.plan.groups for param in group.params}
    assert planned == {0, 2, 3, 4, 5}  # every parameter but hidden.bias (1)
    state.plan.check(ddp)


class TwoDtypes(nn.Module):
    """A bf16 layer between fp32 ones: DDP buckets each dtype apart (two initial buckets)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.middle, self.last = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.middle.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.middle(self.first(x).to(torch.bfloat16)).float())


def static_steps(
    steps: range, saved: dict | None = None, hooked: bool = False
) -> tuple[DistributedDataParallel, Any]:
    ddp = DistributedDataParallel(TwoDtypes(), bucket_cap_mb=0.002, static_graph=True)
    config = SyncConfig(compressor="fp16", warmup_steps=2, min_compress_numel=0)
    return steps_from(ddp, config, steps, saved, hooked)


def test_static_graphs_first_iteration_over_several_buckets_is_a_step_and_resumes_exactly(
    one_rank: None,
) -> None:
    # There DDP hands every bucket as index 0 and none as the last: the step must still count,
    # and a restored state's regrouping of it must not outlive it.
    continuous, state = static_steps(range(6))
    assert state.step == 6
    first, state = static_steps(range(3))
    saved = {
        "model": {k: v.clone() for k, v in first.module.state_dict().items()},
        "gradsync": state.state_dict(),
    }
    resumed, state = static_steps(range(3, 6), saved)
    assert state.step == 6 and state._regroup is None
    for a, b in zip(resumed.parameters(), continuous.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_state_made_without_the_model_counts_static_graphs_first_iteration_over_several_buckets(
    one_rank: None,
) -> None:
    # There DDP names no bucket the last, and a state made without the model (register_comm_hook)
    # cannot count the parameters to see the step end: it must still count the step, train as
    # the state register() made does, bit for bit, and save the right step after it.
    registered, _ = static_steps(range(6))
    continuous, state = static_steps(range(6), hooked=True)
    assert state.step == 6 and state.stats()["total"]["compressed_groups"] > 0
    for a, b in zip(continuous.parameters(), registered.parameters(), strict=True):
        assert torch.equal(a, b)
    for cut in (1, 3):
        first, state = static_steps(range(cut), hooked=True)
        assert state.stats()["step"] == cut  # read between steps, the first one has ended
        saved = {
            "model": {k: v.clone() for k, v in first.module.state_dict().items()},
            "gradsync": state.state_dict(),
        }
        # Resumed, it is numbered as the continuous run (not its bits: a state without the model
        # averages a fresh DDP's first two steps uncompressed, as docs/integrations.md says).
        _, state = static_steps(range(cut, 6), saved, hooked=True)
        assert state.step == 6


def test_parameters_frozen_after_ddp_was_built_still_step_once_per_iteration(one_rank: None) -> None:
    # DDP's buckets hold what was trainable when it was built: the hook counts a step at DDP's
    # last bucket, not by how many parameters are trainable now.
    ddp = DistributedDataParallel(Used(), bucket_cap_mb=0.01, find_unused_parameters=True)
    for p in ddp.module.hidden.parameters():
        p.requires_grad_(False)
    state = gradsync.register(ddp, SyncConfig(warmup_steps=2, min_compress_numel=0))
    for step in range(4):
        x, y = batch(step)
        nn.functional.cross_entropy(ddp(x), y).backward()
    assert state.step == 4


class Scaled(Used):
    """A parameter of the root module itself, beside its layers'."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


@pytest.mark.parametrize(
    "ignored", [[], ["hidden.bias"], ["scale", "out.weight"], ["spare.weight", "spare.bias"]], ids=str
)
def test_the_parameters_gradsync_takes_ddp_to_average_are_ddps_own(
    one_rank: None, ignored: list[str]
) -> None:
    # DDP names a parameter "<module>.<name>" when it checks what to ignore, so a root module's
    # own ("scale") is never ignored: gradsync must follow DDP's rule, not the names as given.
    from gradsync.sync import averaged

    net = Scaled()
    net.hidden.weight.requires_grad_(False)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ignored)
    ddp = DistributedDataParallel(net)
    position = {id(p): i for i, p in enumerate(ddp.parameters())}
    assert averaged(ddp) == {position[id(p)] for p in ddp._build_params_for_reducer()[0]}


def planned_steps(plan: Plan, steps: range, saved: dict | None = None) -> tuple[DistributedDataParallel, Any]:
    ddp = DistributedDataParallel(TwoDtypes(), bucket_cap_mb=0.002)
    config = SyncConfig(compressor="fp16", plan=plan, warmup_steps=2, min_compress_numel=0)
    return steps_from(ddp, config, steps, saved)


def test_a_plan_group_laid_out_as_one_of_ddps_initial_buckets_is_not_taken_as_synced_in_place(
    one_rank: None,
) -> None:
    # DDP's first iteration buckets each dtype whole; at its first rebuilt step the hook has seen
    # only the new bucket 0, and the initial buckets' other indices are stale: a group laid out as
    # one of them must be cut out of the new buckets, not awaited in a bucket that is gone.
    first = DistributedDataParallel(TwoDtypes(), bucket_cap_mb=0.002)
    _, probe = steps_from(first, SyncConfig(warmup_steps=2, min_compress_numel=0), range(1))
    initial = [params for _, params in sorted(probe._ddp_layout.values())]
    assert len(initial) == 2  # one bucket per dtype
    params = list(TwoDtypes().parameters())
    plan = Plan(
        signature(TwoDtypes()),
        1,
        tuple(GroupPlan(group, sum(params[p].numel() for p in group), "fp16") for group in initial),
    )
    continuous, _ = planned_steps(plan, range(6))
    head, state = planned_steps(plan, range(3))
    saved = {
        "model": {k: v.clone() for k, v in head.module.state_dict().items()},
        "gradsync": state.state_dict(),
    }
    resumed, state = planned_steps(plan, range(3, 6), saved)
    assert state.step == 6
    for a, b in zip(resumed.parameters(), continuous.parameters(), strict=True):
        assert torch.equal(a, b)


def test_static_graphs_first_iteration_counts_parameters_frozen_after_ddp_was_built(one_rank: None) -> None:
    # DDP's buckets hold what was trainable when it was built: a step of its first iteration, whose
    # buckets name none as the last, ends once those have all arrived, the frozen one included.
    def frozen_steps(steps: range, saved: dict | None = None) -> tuple[DistributedDataParallel, Any]:
        ddp = DistributedDataParallel(TwoDtypes(), bucket_cap_mb=0.002, static_graph=True)
        ddp.module.first.bias.requires_grad_(False)
        config = SyncConfig(compressor="fp16", warmup_steps=2, min_compress_numel=0)
        return steps_from(ddp, config, steps, saved)

    continuous, state = frozen_steps(range(6))
    assert state._averaged == 6
    head, state = frozen_steps(range(3))
    model = {k: v.clone() for k, v in head.module.state_dict().items()}
    resumed, state = frozen_steps(range(3, 6), {"model": model, "gradsync": state.state_dict()})
    assert state.step == 6
    for a, b in zip(resumed.parameters(), continuous.parameters(), strict=True):
        assert torch.equal(a, b)


def test_under_nccl_checkpoint_collectives_run_on_the_models_gpu(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not cuda:current_device(): a script handing DDP device_ids=[local_rank] without
    # torch.cuda.set_device has every rank's current device at cuda:0, where NCCL fails.
    from gradsync import sync
    from gradsync.comm import TorchComm

    monkeypatch.setattr(sync.dist, "get_backend", lambda group=None: "nccl")
    assert sync.collective_device(TorchComm(None), torch.device("cuda", 3)) == torch.device("cuda", 3)
    # ... and every checkpoint collective of a SyncState asks for it: each call site records the
    # device it passes (the collectives themselves then run on this machine's CPU).
    state = gradsync.register(DistributedDataParallel(nn.Linear(4, 4)), SyncConfig(compressor="fp16"))
    state._device = torch.device("cuda", 3)
    devices: list[torch.device] = []

    def recorded(real: Callable[..., Any]) -> Callable[..., Any]:
        def collective(*args: Any) -> Any:
            devices.append(args[-1])
            return real(*args[:-1], torch.device("cpu"))

        return collective

    monkeypatch.setattr(sync, "allgather_object", recorded(sync.allgather_object))
    monkeypatch.setattr(sync, "gather_object", recorded(sync.gather_object))
    state.full_state_dict()
    state.full_state_dict(to=0)
    monkeypatch.setattr(sync.checkpoint, "own_part", lambda *args: (None, ["not this rank's"]))
    with pytest.raises(ValueError, match="not this rank's"):
        state.load_state_dict({})
    assert devices == [torch.device("cuda", 3)] * 3
