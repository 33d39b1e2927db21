"""gradsync in PyTorch Lightning: a callback that compresses the DDP model Lightning builds, and
keeps every rank's state in Lightning's checkpoints.

    >>> from gradsync.lightning import GradSync
    >>> trainer = lightning.pytorch.Trainer(strategy="ddp", callbacks=[GradSync()])

Why a callback: Lightning wraps the model in DDP inside fit(), after the `setup` hook, so the
callback registers in `on_fit_start`, the first hook that sees the DDP model. Lightning's own
`DDPStrategy(ddp_comm_hook=...)` is no substitute: it installs comm hooks on CUDA only (on CPU
training silently runs as plain DDP), and it needs the hook's state before the process group
exists.

Checkpoints: Lightning writes them from rank 0 only, but asks every rank for its callbacks' state,
so the callback's state is every rank's (SyncState.full_state_dict()), and on restore each rank
takes its own part. Imports `lightning.pytorch` (the `lightning` package, gradsync's `lightning`
extra); with the older `pytorch_lightning` package alone, that one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from .api import register
from .config import SyncConfig
from .sync import SyncState

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError as error:
        raise ImportError(
            "gradsync.lightning needs Lightning: pip install 'gradsync[lightning]' (or lightning)"
        ) from error


class GradSync(pl.Callback):
    """Registers gradsync on the DDP model of every fit(), afresh or from the checkpoint fit()
    resumes from; its SyncState is `self.state`."""

    def __init__(self, config: SyncConfig | None = None) -> None:
        self.config = config if config is not None else SyncConfig()
        self.state: SyncState | None = None
        self._restored: Mapping[str, Any] | None = None  # a checkpoint's state, until fit starts

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise ValueError(
                f"gradsync.lightning.GradSync needs a DDP model, but Trainer(strategy="
                f"{type(trainer.strategy).__name__}) trains a {type(model).__name__}: use "
                "strategy='ddp' (or a DDPStrategy)"
            )
        self.state = register(model, self.config)
        if self._restored is not None:
            self.state.load_state_dict(self._restored)  # every rank: a collective
            self._restored = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # A checkpoint restored for validate(), test() or predict() (ckpt_path=...) belongs to no
        # fit: a later fit() starts afresh, as its optimizer and loops do.
        self._restored = None
        if stage == "fit" and self.state is not None:
            self.state.close()  # plan="auto"'s timers and the learning-rate watch, per fit

    def state_dict(self) -> dict[str, Any]:
        # Every rank is asked (a collective); rank 0 writes what it returns, the others' is dropped.
        return self.state.full_state_dict(to=0) if self.state is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores a DDP run's callbacks before fit starts: the state the next
        # on_fit_start registers takes it (a state of an earlier fit() is not reused).
        self._restored = state_dict or None  # {}: saved before any fit started
