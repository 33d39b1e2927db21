"""gradsync: communication-efficient data-parallel PyTorch training.

One line on a DDP model compresses its gradients with error feedback:

    >>> import gradsync
    >>> state = gradsync.register(ddp_model)  # int4 with error feedback, by two-shot

Or, syncing rarely, every 50 steps of a plain model's own optimizer (DiLoCo):

    >>> outer = gradsync.DiLoCo(model, optimizer, sync_every=50)
"""

from . import compress, feedback
from .api import register
from .checkpoint import AllRanks
from .config import SyncConfig
from .ddp import hook
from .diloco import DiLoCo
from .sync import SyncState

__version__ = "0.1.0"

__all__ = [
    "AllRanks",
    "DiLoCo",
    "SyncConfig",
    "SyncState",
    "__version__",
    "compress",
    "feedback",
    "hook",
    "register",
]
