"""The DDP communication hook: its state, the hook itself, and register().

No `from __future__ import annotations` here: DDP checks the hook's annotations as real objects.
"""

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from . import exchange
from .comm import Comm, TorchComm, allgather_object
from .compress import Compressor, lookup
from .config import SyncConfig
from .feedback import Feedback
from .regroup import Regroup
from .trace import BucketRecord, Trace

log = logging.getLogger("gradsync")


@dataclass
class CompressionPoint:
    """One bucket's compressor and error memory: everything compression keeps between steps."""

    numel: int
    codec: Compressor
    feedback: Feedback

    def state_dict(self) -> dict[str, Any]:
        return {"numel": self.numel, "codec": self.codec.state_dict(), "feedback": self.feedback.state_dict()}


class SyncState:
    """What gradsync's hook keeps between steps. Returned by register().

    Example:
        >>> state = gradsync.register(ddp_model, gradsync.SyncConfig(compressor="topk"))
        >>> ...train...
        >>> state.stats()["last_step"]["compression_ratio"]
        >>> torch.save(state.state_dict(), "gradsync.pt")
    """

    def __init__(self, config: SyncConfig, comm: Comm) -> None:
        # -- hyperparameters
        self.config = config
        # -- the ranks to average over (not pickled)
        self.comm: Comm | None = comm
        # -- internal state
        self.step = 0  # training steps whose last bucket reached the hook
        self.points: dict[int, CompressionPoint] = {}  # by DDP bucket index
        # Each bucket's parameters (positions in model.parameters()) in buffer order, as of the
        # compressed steps: a restored state needs them when DDP lays out buckets otherwise.
        self.layout: dict[int, tuple[int, ...]] = {}
        self._param_index: dict[int, int] | None = None  # id(parameter) -> position; by register()
        self._layout_checked: set[int] = set()  # buckets seen laid out as in `layout`
        self._regroup: Regroup | None = None  # this step's regrouping, while DDP's layout differs
        self._local_steps = 0  # steps this process's hook has seen: DDP rebuilds buckets after one
        self._ranks_agree = False  # set once every rank's config was compared
        # -- statistics
        self.trace = Trace()

    def sync(
        self, buffer: torch.Tensor, bucket_index: int, is_last: bool, may_compress: bool = True
    ) -> Future[torch.Tensor]:
        """Average `buffer` over the ranks: the hook's whole job, usable without DDP too.

        The future holds a tensor shaped like `buffer`: `buffer` itself where the average can be
        written there (uncompressed steps; compressed ones whose payloads are allgathered, where
        nothing reads `buffer` any more, see below), else a fresh one. `buffer` is divided by the
        world size in place and must stay untouched until the future completes.
        """
        comm = self._comm()
        if not self._ranks_agree:
            self._check_ranks_agree(buffer.device)
        step = self.step
        if is_last:
            self.step += 1
        buffer.div_(comm.world_size)  # before compressing: low-precision sums cannot overflow
        compress = (
            may_compress
            and step >= self.config.warmup_steps
            and buffer.numel() >= self.config.min_compress_numel
        )
        if not compress:
            future = exchange.start(None, buffer, comm)
            return future.then(lambda f: self._finish(f.value(), step, bucket_index, buffer, None))
        point = self._point(bucket_index, buffer)
        finite = _is_finite(buffer)
        # A non-finite gradient never enters a memory: it is not even added to one.
        p = point.feedback.prepare(buffer) if finite else buffer
        # The sum is decoded into `buffer`, as PyTorch's own hooks return the bucket they were
        # given: a fresh full-size tensor costs as much in page faults as a copy, and DDP has
        # nothing to copy back where gradients are views of the bucket. Only when nothing reads
        # `buffer` afterwards: what was compressed is another tensor, and feedback's update does
        # not read the gradient.
        into_buffer = p is not buffer and not type(point.feedback).reads_gradient
        future = exchange.start(point.codec, p, comm, finite, out=buffer if into_buffer else None)
        return future.then(lambda f: self._finish(f.value(), step, bucket_index, buffer, (point, p)))

    def stats(self) -> dict[str, Any]:
        """Bytes and seconds per step and in total; see Trace.stats."""
        return {"step": self.step, **self.trace.stats()}

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue the exact same trajectory."""
        return {
            "config": self.config.to_dict(),
            "step": self.step,
            "points": {index: point.state_dict() for index, point in self.points.items()},
            "layout": {index: list(params) for index, params in self.layout.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["config"] != self.config.to_dict():
            raise ValueError(
                f"the checkpoint was made with SyncConfig {state['config']}, but this run uses "
                f"{self.config.to_dict()}; its error memories and compressor state would not fit: "
                "resume with the same SyncConfig"
            )
        self.step = state["step"]
        self.points = {}
        for index, saved_point in state["points"].items():
            point = self._new_point(int(index), saved_point["numel"])
            point.codec.load_state_dict(saved_point["codec"])
            point.feedback.load_state_dict(saved_point["feedback"])
            self.points[int(index)] = point
        self.layout = {int(index): tuple(params) for index, params in state.get("layout", {}).items()}
        self._layout_checked = set()
        self._regroup = None

    def __getstate__(self) -> dict[str, Any]:
        # The process group cannot be pickled; everything else can.
        return {**self.__dict__, "comm": None, "_param_index": None}

    # -- helpers ---------------------------------------------------------------------------------

    def _comm(self) -> Comm:
        if self.comm is None:
            raise RuntimeError(
                "this SyncState was unpickled and has no process group; call "
                "gradsync.register(ddp_model, config) and load_state_dict(old_state.state_dict())"
            )
        return self.comm

    def _finish(
        self,
        result: exchange.Exchanged,
        step: int,
        bucket_index: int,
        buffer: torch.Tensor,
        compressed: tuple[CompressionPoint, torch.Tensor] | None,
    ) -> torch.Tensor:
        if not result.finite:
            out = torch.full_like(buffer, math.nan)  # AMP's GradScaler then skips the step
            if compressed is not None:
                compressed[0].codec.undo()  # a skipped step leaves no trace in codec state
        elif compressed is None:
            out = result.total
        else:
            point, p = compressed
            out = point.feedback.update(buffer, p, result.local, result.total, result.remove_local_)
        numel = buffer.numel()
        self.trace.record(
            BucketRecord(
                step=step,
                bucket=bucket_index,
                numel=numel,
                compressed=compressed is not None,
                payload_bytes=result.payload_bytes,
                bytes_sent=result.bytes_sent,
                bytes_fp32=exchange.allreduce_sent_bytes(4 * numel, self._comm().world_size),
                compress_s=result.seconds.get("compress", 0.0),
                communicate_s=result.seconds.get("communicate", 0.0),
                decompress_s=result.seconds.get("decompress", 0.0),
            )
        )
        return out

    def _point(self, bucket_index: int, buffer: torch.Tensor) -> CompressionPoint:
        point = self.points.get(bucket_index)
        if point is None:
            point = self.points[bucket_index] = self._new_point(bucket_index, buffer.numel())
        elif point.numel != buffer.numel():
            raise ValueError(
                f"DDP bucket {bucket_index} has {buffer.numel()} elements but its gradsync state was "
                f"made for {point.numel}: the bucket layout changed (another model, bucket_cap_mb or "
                "a checkpoint from another run); register gradsync afresh for this layout"
            )
        return point

    def _new_point(self, bucket_index: int, numel: int) -> CompressionPoint:
        comm = self._comm()
        local_stream = lookup(self.config.compressor).randomness == "local"
        rank = comm.rank if local_stream else 0
        seed = _derive_seed(self.config.seed, bucket_index, rank)
        return CompressionPoint(numel, self.config.build_compressor(seed), self.config.build_feedback())

    def _check_ranks_agree(self, device: torch.device) -> None:
        """Fail on every rank, with the same message, when ranks were configured differently.

        Runs on the first call, before any gradient is exchanged, so that differing settings
        (warm-up length, compressor) can never make ranks issue different collectives and hang.
        """
        fingerprints = allgather_object(self._comm(), self.config.fingerprint(), device)
        self._ranks_agree = True
        if len(set(fingerprints)) > 1:
            raise ValueError(
                "gradsync: the ranks were given different SyncConfigs, so their gradients cannot be "
                f"exchanged:\n{_describe_differences(fingerprints)}\nPass the same SyncConfig on every rank."
            )


def hook(state: SyncState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average one bucket with compression and error feedback."""
    index, is_last = bucket.index(), bucket.is_last()
    first_iteration = state._local_steps == 0  # DDP's initial buckets; rebuilt after this step
    if is_last:
        state._local_steps += 1
    if state._param_index is None or (
        state._regroup is None and not first_iteration and index in state._layout_checked
    ):
        return state.sync(bucket.buffer(), index, is_last)
    bucket_params = bucket.parameters()
    params = tuple(state._param_index[id(p)] for p in bucket_params)
    if state._regroup is None:
        if first_iteration and not state.layout:
            # Nothing saved to follow, and compression state must be keyed by the rebuilt buckets
            # to come: this step goes uncompressed (only a state saved before it saw a rebuilt
            # bucket can get here past its warm-up).
            return state.sync(bucket.buffer(), index, is_last, may_compress=False)
        if not first_iteration and _laid_out_as_saved(state, index, params):
            state._layout_checked.add(index)
            return state.sync(bucket.buffer(), index, is_last)
        # DDP's buckets differ from those the state was made for (the first iteration of a fresh
        # DDP model after a restore): sync the saved groups instead, for this step.
        state._regroup = Regroup(state.sync, state.layout)
    numels = [p.numel() for p in bucket_params]
    future = state._regroup.add(bucket.buffer(), params, numels, is_last)
    if is_last:
        state._regroup = None
    return future


def _laid_out_as_saved(state: SyncState, index: int, params: tuple[int, ...]) -> bool:
    """Whether bucket `index` holds what the state's layout says; records it if the layout is new."""
    saved = state.layout.get(index)
    if saved is None:
        known = {param for group in state.layout.values() for param in group}
        if known.isdisjoint(params):
            state.layout[index] = params
            return True
        return False
    return saved == params


def register(model: DistributedDataParallel, config: SyncConfig | None = None) -> SyncState:
    """Install gradsync's communication hook on a DDP model and return its state.

    Call it once, on every rank, before the first backward pass, with the same config.

    Example:
        >>> model = DistributedDataParallel(net)
        >>> state = gradsync.register(model, gradsync.SyncConfig(compressor="topk",
        ...                           compressor_args={"ratio": 0.01}, error_feedback="ef"))
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"gradsync.register expects a torch.nn.parallel.DistributedDataParallel model, got "
            f"{type(model).__name__}; wrap it first: DistributedDataParallel(model)"
        )
    if config is None:
        config = SyncConfig()
    if not isinstance(config, SyncConfig):
        raise TypeError(f"config must be a gradsync.SyncConfig, got {type(config).__name__}")
    state = SyncState(config, TorchComm(model.process_group))
    state._param_index = {id(p): i for i, p in enumerate(model.parameters())}
    model.register_comm_hook(state, hook)
    log.info("gradsync registered on rank %d of %d: %s", state.comm.rank, state.comm.world_size, config)
    return state


def _describe_differences(fingerprints: list[str]) -> str:
    """Ranks grouped by config; each group names the fields where it differs from the most common."""
    groups: dict[str, list[int]] = {}
    for rank, fingerprint in enumerate(fingerprints):
        groups.setdefault(fingerprint, []).append(rank)
    common = max(groups, key=lambda f: len(groups[f]))  # first seen wins a tie
    reference = json.loads(common)
    lines = []
    for fingerprint, ranks in groups.items():
        config = json.loads(fingerprint)
        differing = ", ".join(f"{k}={v!r}" for k, v in config.items() if reference.get(k) != v)
        lines.append(f"  ranks {ranks}: {differing or 'the most common config'}   (full: {fingerprint})")
    return "\n".join(lines)


def _is_finite(t: torch.Tensor) -> bool:
    # One reduction pass instead of an isfinite() mask; a sum that overflows is checked exactly.
    if bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(t).all())


def _derive_seed(root: int, bucket_index: int, rank: int) -> int:
    """Independent-looking seeds per (root, bucket, rank), the same on every run."""
    mixed = (root * 1_000_003 + bucket_index) * 1_000_003 + rank
    return (mixed * 0x9E3779B97F4A7C15) % (2**63 - 1)
