"""Trace: what the hook sent and how long it took, per bucket, summed per step."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

# Fields summed over the buckets of a step, and over all steps.
_SUMMED = (
    "buckets",
    "compressed_buckets",
    "numel",
    "payload_bytes",
    "bytes_sent",
    "bytes_fp32",
    "compress_s",
    "communicate_s",
    "decompress_s",
)


@dataclass
class BucketRecord:
    """One bucket's (or plan group's) exchange in one step, as seen by this rank."""

    step: int
    bucket: int
    numel: int
    compressed: bool
    scheme: str  # how it was exchanged: one of gradsync.exchange.SCHEMES
    payload_bytes: int  # this rank's payload (fp32 bytes when uncompressed)
    bytes_sent: int  # bytes this rank sent over its links
    bytes_fp32: int  # bytes it would have sent with a plain fp32 allreduce
    compress_s: float
    communicate_s: float  # from launching the collective to its completion
    decompress_s: float


class Trace:
    """Per-step sums of BucketRecords for the last `keep_steps` steps, and totals over all steps.

    Records arrive from the collectives' completion callbacks, so access is locked.
    """

    def __init__(self, keep_steps: int = 1000) -> None:
        self.keep_steps = keep_steps
        self._steps: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._total = _empty()
        self._lock = threading.Lock()

    def record(self, rec: BucketRecord) -> None:
        row = asdict(rec)
        row["buckets"] = 1
        row["compressed_buckets"] = int(rec.compressed)
        with self._lock:
            step = self._steps.get(rec.step)
            if step is None:
                step = self._steps[rec.step] = {"step": rec.step, **_empty()}
                while len(self._steps) > self.keep_steps:
                    self._steps.popitem(last=False)
            for key in _SUMMED:
                step[key] += row[key]
                self._total[key] += row[key]

    def stats(self) -> dict[str, Any]:
        """{"steps": per-step sums (oldest first), "last_step": the newest, "total": all steps}.

        Each sum has buckets, compressed_buckets, numel, payload_bytes, bytes_sent, bytes_fp32,
        compress_s, communicate_s, decompress_s and compression_ratio (bytes_fp32 / bytes_sent,
        None when nothing was sent, as in a world of one).
        """
        with self._lock:
            steps = [_with_ratio(dict(s)) for s in self._steps.values()]
            total = _with_ratio(dict(self._total))
        return {"steps": steps, "last_step": steps[-1] if steps else None, "total": total}

    def __getstate__(self) -> dict[str, Any]:
        with self._lock:
            return {"keep_steps": self.keep_steps, "_steps": self._steps.copy(), "_total": dict(self._total)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _empty() -> dict[str, Any]:
    return {key: 0 for key in _SUMMED}


def _with_ratio(row: dict[str, Any]) -> dict[str, Any]:
    row["compression_ratio"] = row["bytes_fp32"] / row["bytes_sent"] if row["bytes_sent"] else None
    return row
