"""Trace: what the hook sent and how long it took, per group, summed per step."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

# Fields summed over the groups of a step, and over all steps.
_SUMMED = (
    "groups",
    "compressed_groups",
    "numel",
    "payload_nbytes",
    "sent_nbytes",
    "fp32_nbytes",
    "compress_s",
    "communicate_s",
    "decompress_s",
)


@dataclass
class GroupRecord:
    """One group's exchange (a DDP bucket or a plan group; -1: a sparse gradient) in one step, as
    seen by this rank."""

    step: int
    group: int
    numel: int
    codec: str  # the codec's registry name; "none": uncompressed
    collective: str  # "allreduce" or "allgather"
    scheme: str | None  # the sparse scheme that carried rows, if any
    payload_nbytes: int  # this rank's payload (fp32 bytes when uncompressed)
    sent_nbytes: int  # bytes this rank sent over its links
    fp32_nbytes: int  # bytes it would have sent with a plain fp32 allreduce
    compress_s: float
    communicate_s: float  # from launching the collective to its completion
    decompress_s: float


class Trace:
    """Per-step sums of GroupRecords for the last `keep_steps` steps, and totals over all steps.

    Records arrive from the collectives' completion callbacks, so access is locked.
    """

    def __init__(self, keep_steps: int = 1000) -> None:
        self.keep_steps = keep_steps
        self._steps: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._total = _empty()
        self._lock = threading.Lock()

    def record(self, rec: GroupRecord) -> None:
        row = asdict(rec)
        row["groups"] = 1
        row["compressed_groups"] = int(rec.codec != "none")
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

        Each sum has groups, compressed_groups, numel, payload_nbytes, sent_nbytes, fp32_nbytes,
        compress_s, communicate_s, decompress_s and compression_ratio (fp32_nbytes / sent_nbytes,
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
    row["compression_ratio"] = row["fp32_nbytes"] / row["sent_nbytes"] if row["sent_nbytes"] else None
    return row
