"""A user's Accelerate training script with gradsync, run by tests/integrations/test_accelerate.py
under torchrun on 2 CPU ranks: bf16 autocast, 2 micro-batches per optimizer step.

In one launch it trains 16 steps without a break, then 8 steps and save_state, then a fresh model,
optimizer and gradsync state that load_state and train the other 8. Each rank writes to
OUT/rank<r>.pt the parameters and gradsync's own state (its error memories) after both runs.
"""

from __future__ import annotations

import os
import sys

import torch
from accelerate import Accelerator
from torch import nn

import gradsync

STEPS, SAVE_AT, ACCUMULATE = 16, 8, 2


def make_model(seed: int) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def batch(rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1_000_003 * (rank + 1) + index)
    return torch.randn(16, 64, generator=generator), torch.randint(8, (16,), generator=generator)


def build(seed: int):
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=ACCUMULATE)
    model = make_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)
    # The line a user adds: on the prepared (DDP) model. Small model: compress every bucket.
    state = gradsync.register(model, gradsync.SyncConfig(min_compress_numel=0))
    # Accelerate saves custom objects from rank 0 only: AllRanks hands it every rank's state.
    accelerator.register_for_checkpointing(gradsync.AllRanks(state))
    return accelerator, model, opt, state


def train(accelerator: Accelerator, model: nn.Module, opt, steps: range) -> None:
    rank = accelerator.process_index
    for step in steps:
        for micro in range(ACCUMULATE):
            x, y = batch(rank, step * ACCUMULATE + micro)
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    accelerator, model, opt, state = build(0)
    train(accelerator, model, opt, range(STEPS))
    results = {"continuous": flat(model), "continuous_state": own(state, rank)}
    results["compression_ratio"] = state.stats()["last_step"]["compression_ratio"]

    accelerator, model, opt, state = build(0)
    train(accelerator, model, opt, range(SAVE_AT))
    accelerator.save_state(os.path.join(out, "checkpoint"))
    accelerator, model, opt, state = build(1)
    accelerator.load_state(os.path.join(out, "checkpoint"))
    train(accelerator, model, opt, range(SAVE_AT, STEPS))
    results |= {"resumed": flat(model), "resumed_state": own(state, rank)}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    accelerator.end_training()  # destroys the process group: a gloo group left to exit may abort


def own(state: gradsync.SyncState, rank: int) -> dict:
    """This rank's gradsync state, unpacked: step, error memories, codec state."""
    return gradsync.checkpoint.own_part(state.state_dict(), rank)[0]


if __name__ == "__main__":
    main(sys.argv[1])
