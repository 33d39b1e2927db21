"""Fixtures shared by the single-process tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A gloo process group of one rank, so that register() and DDP run in this process."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
