"""gradsync.loss_scale: the GradScaler is met as it steps an optimizer, and read as it moves."""

from __future__ import annotations

import torch

from gradsync import loss_scale


def _step(
    scaler: torch.amp.GradScaler | None, optimizer: torch.optim.Optimizer, model: torch.nn.Module
) -> None:
    optimizer.zero_grad()
    loss = model(torch.ones(2, 3)).sum()
    if scaler is None:
        loss.backward()
        optimizer.step()
        return
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def test_the_scaler_that_steps_the_optimizer_is_followed_as_its_scale_moves() -> None:
    loss_scale.watch()
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(None, optimizer, model)
    assert loss_scale.now() is None  # an optimizer stepped, by no scaler
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)
    _step(scaler, optimizer, model)
    assert loss_scale.now() == scaler.get_scale() == 2.0**5  # grown after one good step
    _step(scaler, optimizer, model)
    assert loss_scale.now() == 2.0**6
    del scaler
    assert loss_scale.now() is None  # followed while it lives


def test_a_disabled_scaler_gives_no_scale() -> None:
    loss_scale.watch()
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    _step(scaler, optimizer, model)
    assert loss_scale.now() is None


def test_the_ratio_takes_a_memory_into_the_new_scales_units() -> None:
    assert loss_scale.ratio(2.0**10, 2.0**9) == 0.5
    assert loss_scale.ratio(2.0**10, 2.0**11) == 2.0
    assert loss_scale.ratio(None, 8.0) == loss_scale.ratio(8.0, None) == loss_scale.ratio(8.0, 8.0) == 1.0
