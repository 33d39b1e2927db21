"""Error memories follow the learning rate of the user's SGD (gradsync.learning_rate)."""

from __future__ import annotations

import gc
import logging
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from gradsync import SyncConfig, SyncState
from gradsync.comm import LocalComm
from gradsync.learning_rate import LearningRate, held_at

WARMUP = 2
STEPS = 30


def _model() -> nn.Module:
    torch.manual_seed(0)  # a test's model; gradients below come from seeded generators
    return nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 5))


def _train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: SyncState,
    steps: int = STEPS,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Train on seeded random gradients through state.sync, one group holding every parameter;
    returns (sum of rate x gradient over the steps, sum of rate x update applied, the last
    step's rate)."""
    params = list(model.parameters())
    rate = 0.0
    generator = torch.Generator().manual_seed(seed)
    wanted = torch.zeros(sum(p.numel() for p in params))
    applied = torch.zeros_like(wanted)
    for _ in range(steps):
        g = torch.randn(wanted.numel(), generator=generator)
        average = state.sync(g.clone(), 0, True, params=list(range(len(params)))).wait()
        rate = optimizer.param_groups[0]["lr"]
        wanted.add_(g, alpha=rate)
        applied.add_(average, alpha=rate)
        for p, part in zip(params, average.split([p.numel() for p in params]), strict=True):
            p.grad = part.view_as(p).clone()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return wanted, applied, rate


def _state(model: nn.Module, **fields: object) -> SyncState:
    fields = {"warmup_steps": WARMUP, "min_compress_numel": 0, "compressor": "topk", **fields}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return SyncState(SyncConfig(**fields), LocalComm(), model)  # type: ignore[arg-type]


def _memory(state: SyncState) -> torch.Tensor:
    """Everything the group's memories hold back: the residual, and two-shot's owner's."""
    error = state.points[0].feedback.error  # type: ignore[attr-defined]
    assert error is not None
    shard = state.points[0].shard_error
    return error if shard is None else error + shard  # a world of one owns the whole group


@pytest.mark.parametrize("follows", [True, False])
@pytest.mark.parametrize(("compressor", "args"), [("topk", {"ratio": 0.05}), ("int4", {})])
def test_nothing_is_lost_in_parameter_units_under_a_decaying_rate(
    follows: bool, compressor: str, args: dict[str, float]
) -> None:
    # Residual feedback with memories that follow the rate: what SGD applied plus what the memories
    # still hold, at the rate they are held for, is what DDP would have applied, sum of rate x g
    # (int4's fused encode reads the rescaled memory; in a world of one its owner's re-encoding
    # loses nothing). A state used without DDP or the model cannot follow the rate, and falls
    # short.
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS + 5)
    state = _state(model, compressor=compressor, compressor_args=args)
    if not follows:
        state = SyncState(state.config, LocalComm())
    wanted, applied, last = _train(model, optimizer, state, scheduler=scheduler)
    if follows:
        assert state.points[0].rates == (last,)
        torch.testing.assert_close(applied + _memory(state) * last, wanted, rtol=1e-4, atol=1e-6)
    else:
        assert state.points[0].rates is None
        assert not torch.allclose(applied + _memory(state) * last, wanted, rtol=1e-4, atol=1e-6)


def test_momentum_correction_moves_the_parameters_as_momentum_sgd_would() -> None:
    # Under SGD with momentum and momentum correction, from the first step compressed: the
    # parameters' movement plus the residual at its rate is DDP's, sum of rate x velocity. The
    # optimizer is found before its first step (among the live objects).
    model = _model()
    start = torch.cat([p.detach().view(-1) for p in model.parameters()])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS + 5)
    state = _state(model, warmup_steps=0, error_feedback="momentum", compressor_args={"ratio": 0.05})
    params = list(model.parameters())
    generator = torch.Generator().manual_seed(0)
    velocity, wanted, rate = torch.zeros_like(start), torch.zeros_like(start), 0.0
    for _ in range(STEPS):
        g = torch.randn(start.numel(), generator=generator)
        average = state.sync(g.clone(), 0, True, params=list(range(len(params)))).wait()
        rate = optimizer.param_groups[0]["lr"]
        velocity.mul_(0.9).add_(g)
        wanted.add_(velocity, alpha=rate)
        for p, part in zip(params, average.split([p.numel() for p in params]), strict=True):
            p.grad = part.view_as(p).clone()
        optimizer.step()
        scheduler.step()
    moved = start - torch.cat([p.detach().view(-1) for p in model.parameters()])
    torch.testing.assert_close(moved + rate * _memory(state), wanted, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("beta", "sgd", "warned"),
    [
        (0.9, {"momentum": 0.9}, False),
        (0.9, {"momentum": 0.0}, True),
        (0.9, {"momentum": 0.9, "nesterov": True}, True),
        (0.9, {"momentum": 0.9, "dampening": 0.1}, True),
        (0.0, {"momentum": 0.9}, False),  # beta 0 is residual feedback, under any optimizer
    ],
)
def test_momentum_correction_under_another_sgd_momentum_is_warned_once(
    beta: float, sgd: dict, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # It hands SGD D - beta * D_prev: only SGD(momentum=beta) without dampening or Nesterov turns
    # that back into D; any other steps the model silently by another rule.
    model = _model()
    said = _momentum_warnings(model, torch.optim.SGD(model.parameters(), lr=0.1, **sgd), beta, caplog)
    assert len(said) == (1 if warned else 0)
    if warned:
        assert f"stepped by SGD(momentum={sgd['momentum']}" in said[0]


def test_momentum_correction_under_adam_is_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    # Adam keeps its own moments of what it is handed: D - beta * D_prev is not D to it either.
    model = _model()
    said = _momentum_warnings(model, torch.optim.Adam(model.parameters(), lr=0.01), 0.9, caplog)
    assert len(said) == 1 and "but the model is stepped by Adam:" in said[0]


def _momentum_warnings(
    model: nn.Module, optimizer: torch.optim.Optimizer, beta: float, caplog: pytest.LogCaptureFixture
) -> list[str]:
    """The momentum-correction warnings of training `model` by `optimizer` past warm-up."""
    state = _state(
        model,
        error_feedback="momentum",
        error_feedback_args={"momentum": beta},
        compressor_args={"ratio": 0.05},
    )
    params = list(model.parameters())
    generator = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        for _ in range(WARMUP + 3):
            g = torch.randn(sum(p.numel() for p in params), generator=generator)
            average = state.sync(g, 0, True, params=list(range(len(params)))).wait()
            for p, part in zip(params, average.split([p.numel() for p in params]), strict=True):
                p.grad = part.view_as(p).clone()
            optimizer.step()
    return [r.getMessage() for r in caplog.records if "error_feedback='momentum' corrects" in r.getMessage()]


def test_a_constant_rate_leaves_memories_in_gradient_units() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = _state(model, compressor_args={"ratio": 0.05})
    wanted, applied, _ = _train(model, optimizer, state)
    torch.testing.assert_close(applied + 0.1 * _memory(state), wanted, rtol=1e-4, atol=1e-5)


def test_adaptive_optimizers_are_not_followed() -> None:
    # Adam's step is not proportional to the gradient: the memory stays in gradient units, as
    # without a model, whatever the schedule does.
    results = []
    for with_model in (True, False):
        model = _model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        state = _state(model, compressor_args={"ratio": 0.05})
        if not with_model:
            state = SyncState(state.config, LocalComm())
        _train(model, optimizer, state, scheduler=scheduler)
        results.append(_memory(state))
    assert torch.equal(results[0], results[1])


def test_a_checkpoint_keeps_the_rate_its_memories_are_held_at() -> None:
    # Resumed after a save, training goes on exactly as without the interruption.
    def run(interrupt: bool) -> torch.Tensor:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        # Rates change before the save and at the first step after the restore, before the
        # optimizer steps again (the new state finds it among the live objects).
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[5, 10], gamma=0.5)
        state = _state(model, error_feedback="momentum", compressor_args={"ratio": 0.05})
        _train(model, optimizer, state, steps=10, scheduler=scheduler)
        if interrupt:
            saved = state.state_dict()
            state.close()
            state = _state(model, error_feedback="momentum", compressor_args={"ratio": 0.05})
            state.load_state_dict(saved)
        _train(model, optimizer, state, steps=10, scheduler=scheduler, seed=1)
        return torch.cat([p.detach().view(-1) for p in model.parameters()])

    assert torch.equal(run(interrupt=True), run(interrupt=False))


def test_the_watcher_finds_sgd_over_the_model_only() -> None:
    model, other = _model(), _model()
    watcher = LearningRate(model.parameters())
    assert watcher.now() is None  # nothing stepped yet
    elsewhere = torch.optim.SGD(other.parameters(), lr=0.5)
    adam = torch.optim.Adam(other.parameters(), lr=0.3)
    groups = [{"params": model[0].parameters(), "lr": 0.2}, {"params": model[1].parameters()}]
    sgd = torch.optim.SGD(groups, lr=0.1)
    for optimizer in (elsewhere, adam, sgd):
        optimizer.step()
    assert watcher.now() == (0.2, 0.1)
    sgd.param_groups[0]["lr"] = 0.4
    assert watcher.now() == (0.4, 0.1)
    watcher.close()
    later = torch.optim.SGD(model.parameters(), lr=0.7)
    later.step()  # not seen: the hook is gone
    assert watcher.now() == (0.4, 0.1)


def test_rates_are_ordered_by_the_model_whichever_optimizer_steps_first() -> None:
    # A restored run finds its optimizers among the live objects, in another order than the
    # original run saw them step: the rates must line up with the memories' saved ones.
    model = _model()
    orders = []
    for first_steps in (0, 1):
        watcher = LearningRate(model.parameters())
        optimizers = [
            torch.optim.SGD(model[0].parameters(), lr=0.1),
            torch.optim.SGD(model[1].parameters(), lr=0.01),
        ]
        optimizers[first_steps].step()
        optimizers[1 - first_steps].step()
        orders.append(watcher.now())
        watcher.close()
    assert orders == [(0.1, 0.01), (0.1, 0.01)]


def test_an_optimizer_other_than_sgd_beside_sgd_leaves_memories_unscaled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A bucket's memory may hold both optimizers' parameters: SGD's rate must not scale Adam's.
    model = _model()
    watcher = LearningRate(model.parameters())
    sgd = torch.optim.SGD(model[0].parameters(), lr=0.1)
    adam = torch.optim.Adam(model[1].parameters(), lr=0.3)
    with caplog.at_level("WARNING", logger="gradsync"):
        sgd.step()
        assert watcher.now() == (0.1,)
        adam.step()
    assert watcher.now() is None
    assert "Adam steps some of the model's parameters beside SGD" in caplog.text
    watcher.close()


class _Wrapper(torch.optim.Optimizer):
    """Steps an SGD it wraps, as ZeroRedundancyOptimizer and PostLocalSGDOptimizer do."""

    def __init__(self, params: Any) -> None:
        params = list(params)
        super().__init__(params, {"lr": 0.1})
        self.optim = torch.optim.SGD(params, lr=0.1)

    def step(self, closure: Any = None) -> None:
        self.optim.step()


def test_a_wrapper_of_sgd_is_not_taken_for_another_optimizer() -> None:
    model = _model()
    watcher = LearningRate(model.parameters())
    wrapper = _Wrapper(model.parameters())
    wrapper.step()
    assert watcher.now() == (0.1,)
    watcher.close()


def test_ratio_rules(caplog: pytest.LogCaptureFixture) -> None:
    watcher = LearningRate([])
    assert watcher.ratio((0.1, 0.2), (0.05, 0.1)) == pytest.approx(2.0)
    assert watcher.ratio(None, (0.1,)) == 1.0
    assert watcher.ratio((0.1,), None) == 1.0
    assert watcher.ratio((0.1,), (0.0,)) == 1.0  # a zero rate applies nothing: memories wait
    assert watcher.ratio((0.0, 0.1), (0.0, 0.05)) == pytest.approx(2.0)  # a frozen group aside
    assert watcher.ratio((0.1,), (0.1, 0.2)) == 1.0  # another optimizer appeared
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        assert watcher.ratio((0.1, 0.2), (0.05, 0.2)) == 1.0
        assert watcher.ratio((0.1, 0.2), (0.05, 0.2)) == 1.0
    assert len([r for r in caplog.records if "different factors" in r.message]) == 1


def test_one_global_hook_serves_every_watcher_and_a_collected_one_is_let_go() -> None:
    # Watchers come and go without adding or removing PyTorch's hooks: removing one as a watcher
    # is collected, which can happen inside another hook, fails PyTorch's iteration over them.
    from torch.optim import optimizer as optim_module

    from gradsync import learning_rate

    hooks = optim_module._global_optimizer_pre_hooks
    first = LearningRate(_model().parameters())
    count = len(hooks)
    second = LearningRate(_model().parameters())
    assert len(hooks) == count
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None and second in learning_rate._WATCHERS
    second.close()
    assert second not in learning_rate._WATCHERS and len(hooks) == count


def test_a_memory_waits_at_its_last_positive_rate() -> None:
    assert held_at(None, (0.1, 0.2)) == (0.1, 0.2)
    assert held_at(None, (0.0, 0.2)) is None  # nothing to measure a zero group's change against
    assert held_at((0.1, 0.2), None) == (0.1, 0.2)
    assert held_at((0.1, 0.2), (0.0, 0.1)) == (0.1, 0.1)
    # Back from zero, the change is measured from the rate before it.
    assert LearningRate([]).ratio(held_at((0.1,), (0.0,)), (0.05,)) == pytest.approx(2.0)
