"""What every benchmark rank does around its own work: join the process group, run, report, leave.

The runners (bench/train.py, sparse.py, fidelity.py) start one process per rank with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT and GLOO_SOCKET_IFNAME set, and a JSON spec whose `threads`,
`timeout_s` and `out` every worker reads; rank 0 writes the work's result to `out`.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

Work = Callable[[dict[str, Any], int, int], dict[str, Any]]  # (spec, rank, world_size) -> result


def serve(spec_path: str, work: Work) -> int:
    """Run `work` on this rank of a gloo group; rank 0 writes its result to spec["out"]."""
    faulthandler.enable()  # a crash in native code leaves the Python stack in the rank's log
    spec = json.loads(Path(spec_path).read_text())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(spec["threads"])
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=spec["timeout_s"])
    )
    try:
        result = work(spec, rank, world_size)
        if rank == 0:
            Path(spec["out"]).write_text(json.dumps(result))
        # Leave together: rank 0 hosts the rendezvous store, and a rank still tearing down its
        # process group when rank 0 has gone aborts.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def leave(code: int) -> NoReturn:
    """End a rank's process with `code`, skipping the interpreter's teardown: with torch and gloo
    loaded it can abort ("terminate called without an active exception") after the work is done
    and the group destroyed, and a rank dead by SIGABRT fails its run; nothing is left to clean up."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
