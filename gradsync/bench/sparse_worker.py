"""One rank of the sparse exchange benchmark: `python -m gradsync.bench.sparse_worker JOB.json`.

The runner (bench/sparse.py) starts one such process per rank, on loopback or inside a testbed
host's network namespace, with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and GLOO_SOCKET_IFNAME
set. Every rank builds its own rows of the job's input, then exchanges them by every scheme in
turn; rank 0 writes the measurements to the job's `out`. A sum that differs from the dense
scheme's, or between ranks, ends the rank with an error naming the scheme.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
import sys
import time
import zlib
from typing import Any

import torch
import torch.distributed as dist

from ..comm import TorchComm, allgather_object
from ..sparse import SparseResult, exchange
from ..sparse.select import calibrate
from .rank import leave, serve
from .sparse_inputs import Source, parse_input
from .sparse_schemes import ATOL_SCALE, RTOL, base_scheme, partition_for
from .worker import TxCounter


class SumMismatch(RuntimeError):
    """A scheme's sum differs from the dense scheme's, or between ranks."""


def main(job_path: str) -> int:
    return serve(job_path, lambda job, _rank, _world_size: bench(job, TorchComm()))


def bench(job: dict[str, Any], comm: TorchComm) -> dict[str, Any]:
    """Every scheme of the job on this rank's rows; what rank 0 reports. Every rank must call it."""
    rank, n = comm.rank, comm.world_size
    started = time.perf_counter()
    source = Source(parse_input(job["input"]), job["seed"])
    rows = source.rows(rank, n)
    setup_s = time.perf_counter() - started
    me = {"rows": rows.nnz, "index_sum": int(rows.indices.sum())}
    rank_rows = allgather_object(comm, me, _CPU)
    # The sum every scheme's must match (untimed; it also opens the connections).
    reference = Reference(exchange(rows, comm, "dense").total.dense().clone())
    # This network's rounds (each collective's latency) and bandwidth, as the DDP selector
    # calibrates them.
    network = calibrate(comm, _CPU)
    tx = TxCounter(os.environ.get("GLOO_SOCKET_IFNAME"))
    schemes = []
    for scheme in job["schemes"]:
        partition = partition_for(scheme, rows.num_rows, n)  # built once, as DDP's router keeps it

        def once(scheme: str = scheme, partition: Any = partition) -> SparseResult:
            return exchange(rows, comm, base_scheme(scheme), partition=partition)

        errors = [reference.check(once(), scheme, comm) for _ in range(job["warmup"])]
        seconds, user, system, wire = [], [], [], []
        for _ in range(job["reps"]):
            dist.barrier()  # start together, so a rep measures the exchange, not a straggler
            tx.start()
            cpu_start, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            result = once()
            seconds.append(time.perf_counter() - start)
            cpu_end = resource.getrusage(resource.RUSAGE_SELF)  # every thread's, in microseconds
            user.append(cpu_end.ru_utime - cpu_start.ru_utime)
            system.append(cpu_end.ru_stime - cpu_start.ru_stime)
            wire.append(tx.per_step(1))
            errors.append(reference.check(result, scheme, comm))
        slowest = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        cpu = torch.tensor([user, system], dtype=torch.float64)
        dist.all_reduce(cpu)
        cpu /= n
        wire_mean = None if None in wire else statistics.fmean(wire)
        gathered = allgather_object(comm, (result.sent_nbytes, wire_mean, max(errors)), _CPU)
        wires = [w for _, w, _ in gathered]
        schemes.append(
            {
                "scheme": scheme,
                "seconds": slowest.tolist(),
                "cpu_seconds": cpu.sum(0).tolist(),  # user + system, mean over ranks
                "cpu_user_seconds": cpu[0].tolist(),
                "cpu_system_seconds": cpu[1].tolist(),
                "sent_nbytes": [b for b, _, _ in gathered],
                "wire_bytes": None if None in wires else wires,
                "push_imbalance": result.push_imbalance,
                "pull_imbalance": result.pull_imbalance,
                "checks": len(errors),
                "max_error": max(e for _, _, e in gathered),
            }
        )
        if rank == 0:
            print(json.dumps({"scheme": scheme, "median_s": statistics.median(seconds)}), flush=True)
    return {
        "input": job["input"],
        "num_rows": rows.num_rows,
        "width": rows.width,
        "value_nbytes": rows.values.element_size(),
        "rank_rows": rank_rows,
        "setup_s": setup_s,
        "calibrated": dataclasses.asdict(network),
        "schemes": schemes,
    }


_CPU = torch.device("cpu")


class Reference:
    """The dense scheme's sum, and the check of every other sum against it."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.atol = ATOL_SCALE * float(table.abs().max()) if table.numel() else 0.0
        self.occupied = table.ne(0).any(dim=1).nonzero().squeeze(1)  # rows a sum must hold

    def check(self, result: SparseResult, scheme: str, comm: TorchComm) -> float:
        """The largest |difference| from the dense sum. SumMismatch, raised on every rank alike (or
        the others would wait in the next collective), where some rank's sum is not allclose to the
        dense one, is flagged non-finite, or differs from rank 0's in any bit (every scheme promises
        equal bits on every rank).

        A sum in sparse parts is compared on its rows, and must hold every row the dense sum has
        non-zero: the same as comparing its dense form, without building one.
        """
        total = result.total
        if total.is_dense:
            got, expected, missing = total.dense().contiguous(), self.table, 0
            digest = _crc(got)
        else:
            rows = total.rows()
            got, expected = rows.values, self.table.index_select(0, rows.indices)
            missing = int((~torch.isin(self.occupied, rows.indices)).sum())
            digest = _crc(rows.indices, rows.values)
        close = missing == 0 and torch.allclose(got, expected, rtol=RTOL, atol=self.atol)
        error = float((got - expected).abs().max()) if got.numel() else 0.0
        gathered = allgather_object(comm, (close, error, missing, result.finite, digest), _CPU)
        problems = []
        for rank, (close_, error_, missing_, finite, digest_) in enumerate(gathered):
            if not close_:
                problems.append(
                    f"rank {rank}'s sum differs from dense's by up to {error_:.3g} and lacks {missing_} of "
                    f"its non-zero rows (torch.allclose with rtol={RTOL:g}, atol={self.atol:.3g})"
                )
            if not finite:
                problems.append(f"rank {rank} flags the sum of finite rows as non-finite")
            if digest_ != gathered[0][4]:
                problems.append(
                    f"rank {rank}'s sum differs from rank 0's in some bits (crc32 {digest_:#x}, rank 0's "
                    f"{gathered[0][4]:#x})"
                )
        if problems:
            raise SumMismatch(f"scheme {scheme!r}: " + "; ".join(problems))
        return error


def _crc(*tensors: torch.Tensor) -> int:
    crc = 0
    for tensor in tensors:
        crc = zlib.crc32(tensor.contiguous().view(-1).view(torch.uint8).numpy(), crc)
    return crc


if __name__ == "__main__":
    leave(main(sys.argv[1]))
