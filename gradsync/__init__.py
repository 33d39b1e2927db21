"""gradsync: communication-efficient data-parallel PyTorch training.

One line on a DDP model compresses its gradients with error feedback:

    >>> import gradsync
    >>> state = gradsync.register(ddp_model, gradsync.SyncConfig(compressor="topk"))
"""

from . import compress, feedback
from .api import register
from .config import SyncConfig
from .ddp import hook
from .sync import SyncState

__version__ = "0.1.0"

__all__ = ["SyncConfig", "SyncState", "__version__", "compress", "feedback", "hook", "register"]
