"""A user's Lightning training script with gradsync's callback, run by
tests/integrations/test_frameworks.py under torchrun on 2 CPU ranks (strategy="ddp", gloo).

In one launch it fits 16 steps (2 epochs) without a break, ModelCheckpoint saving at each epoch's
end, then fits a fresh module (initialized differently) from the first epoch's checkpoint, at step 8,
to step 16, and fits afresh after validate() from that checkpoint by the same Trainer. The data is
drawn from the rank and the step, not from the loader: Lightning's own resume from an epoch's end
checkpoint does not replay the loader's order exactly (with plain DDP too), which is not what this
tests.

First of all it fits 16 steps with DDPStrategy(ddp_comm_hook=gradsync.hook,
ddp_comm_state=SyncState(config)), the state made before Lightning creates the process group (it
binds the default group at its first exchange). Lightning installs a comm hook only on CUDA; the
strategy here runs Lightning's own installer on CPU as it would on a GPU. Each rank writes to
OUT/rank<r>.pt the parameters and gradsync's own state (its error memories) after each run.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync.lightning import GradSync

STEPS, EPOCH, BATCH = 16, 8, 16
# Small model: compress it all, from step 4, so that memories exist at the resume (step 8).
CONFIG = gradsync.SyncConfig(min_compress_numel=0, warmup_steps=4)


class Net(pl.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1_000_003 * (self.global_rank + 1) + self.global_step)
        x, y = torch.randn(BATCH, 64, generator=generator), torch.randint(8, (BATCH,), generator=generator)
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        return self.net(torch.ones(1, 64)).sum()

    def configure_optimizers(self) -> dict:
        # The rate halves every 4 steps, at the resume step too: gradsync's memories follow it
        # (gradsync.learning_rate), through the callback and the comm hook alike.
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def data() -> DataLoader:
    # An epoch is EPOCH steps on each of 2 ranks; the samples are indices, unused.
    return DataLoader(TensorDataset(torch.arange(2 * EPOCH * BATCH)), batch_size=BATCH, shuffle=False)


def fit(out: str, seed: int, ckpt: str | None = None, validated: str | None = None) -> tuple[Net, GradSync]:
    """A fit from `ckpt`, or afresh; `validated`: after validate() from that checkpoint, by the
    same Trainer and callback (whose restored state must not reach the fit)."""
    callback = GradSync(CONFIG)
    every_epoch = ModelCheckpoint(
        dirpath=out, filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=True
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=STEPS,
        callbacks=[callback, every_epoch],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if validated is not None:
        trainer.validate(Net(seed + 1), data(), ckpt_path=validated)
    module = Net(seed)
    trainer.fit(module, data(), ckpt_path=ckpt)
    return module, callback


class CommHookOnCpu(DDPStrategy):
    """DDPStrategy installing its ddp_comm_hook with Lightning's own installer on any device: as
    Lightning does on CUDA (on CPU it skips the hook)."""

    def _register_ddp_hooks(self) -> None:
        _register_ddp_comm_hook(
            model=self.model,
            ddp_comm_state=self._ddp_comm_state,
            ddp_comm_hook=self._ddp_comm_hook,
            ddp_comm_wrapper=self._ddp_comm_wrapper,
        )


def fit_with_comm_hook() -> tuple[Net, gradsync.SyncState]:
    assert not torch.distributed.is_initialized()
    state = gradsync.SyncState(CONFIG)  # before Lightning creates the process group
    strategy = CommHookOnCpu(ddp_comm_hook=gradsync.hook, ddp_comm_state=state)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Net(seed=0)
    trainer.fit(module, data())
    return module, state


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    # First, while no process group exists: Lightning keeps the one it creates for later fits.
    hooked, state = fit_with_comm_hook()
    results = {"comm_hook": flat(hooked), "comm_hook_state": own(state, rank)}
    module, callback = fit(out, seed=0)
    results |= {"continuous": flat(module), "continuous_state": own(callback.state, rank)}
    results["compression_ratio"] = callback.state.stats()["last_step"]["compression_ratio"]
    module, callback = fit(os.path.join(out, "resumed"), seed=1, ckpt=os.path.join(out, "epoch=0.ckpt"))
    results |= {"resumed": flat(module), "resumed_state": own(callback.state, rank)}
    epoch0 = os.path.join(out, "epoch=0.ckpt")
    module, callback = fit(os.path.join(out, "validated"), seed=0, validated=epoch0)
    results |= {"after_validate": flat(module)}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def own(state: gradsync.SyncState, rank: int) -> dict:
    """This rank's gradsync state, unpacked: step, error memories, codec state."""
    return gradsync.checkpoint.own_part(state.state_dict(), rank)[0]


if __name__ == "__main__":
    main(sys.argv[1])
