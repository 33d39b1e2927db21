"""The DDP communication hook: its state, the hook itself, and register().

Without a plan, every DDP bucket is one compression point, compressed by config.compressor. With
a plan (SyncConfig.plan), the steps from the first compressed one on are cut into the plan's groups
(gradsync.regroup), each a compression point exchanged by its own strategy.

No `from __future__ import annotations` here: DDP checks the hook's annotations as real objects.
"""

import contextlib
import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from . import compress, exchange, feedback
from .comm import CollectiveError, Comm, TorchComm, allgather_object, allreduce_sent_bytes, completed, then
from .compress import Compressor, lookup
from .config import AUTO_PLAN, NO_COMPRESSION, SyncConfig, build_codec
from .feedback import Feedback
from .regroup import Regroup
from .sparse.result import SparseResult
from .sparse.router import AUTO, Router
from .sparse.rows import SparseRows
from .trace import BucketRecord, Trace

if TYPE_CHECKING:  # not imported at run time: gradsync.plan pulls in the planner and simulator
    from .autoplan import Auto
    from .plan import Plan
    from .sim.strategy import Strategy

log = logging.getLogger("gradsync")


@dataclass
class CompressionPoint:
    """One bucket's (or plan group's) compressor and error memory: everything compression keeps
    between steps."""

    numel: int
    codec: Compressor
    feedback: Feedback

    def state_dict(self) -> dict[str, Any]:
        return {"numel": self.numel, "codec": self.codec.state_dict(), "feedback": self.feedback.state_dict()}


@dataclass(eq=False)
class _Segment:
    """One tensor of a bucket, as a [num_rows, width] table at `offset` in the flat buffer."""

    key: str  # the router's name for it: "param 3", or "bucket 1" for a whole bucket
    offset: int
    num_rows: int
    width: int
    sparse: bool = True  # through gradsync.sparse, else in a plain allreduce

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + self.num_rows * self.width].view(self.num_rows, self.width)


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
        # The plan executed from the first compressed step on (a Plan in the config); None: each
        # DDP bucket compressed by config.compressor. register() checks it against the model.
        self.plan: Plan | None = None
        self._strategies: list[Strategy] = []  # the plan's, parsed once
        # -- internal state
        self.step = 0  # training steps whose last bucket reached the hook
        self.points: dict[int, CompressionPoint] = {}  # by DDP bucket index, or by plan group
        # Each bucket's parameters (positions in model.parameters()) in buffer order, as of the
        # compressed steps: a restored state needs them when DDP lays out buckets otherwise. With
        # a plan: its groups.
        self.layout: dict[int, tuple[int, ...]] = {}
        self._param_index: dict[int, int] | None = None  # id(parameter) -> position; by register()
        self._param_shapes: list[torch.Size] | None = None  # by position; by register()
        # How sparse rows are exchanged (sparse gradients, sparsifier payloads, sparse tensors of
        # uncompressed buckets), and the "auto" selector's choices.
        self.sparse = Router(config.sparse_scheme, config.sparse_every, config.seed)
        self._layout_checked: set[int] = set()  # buckets seen laid out as in `layout`
        self._regroup: Regroup | None = None  # this step's regrouping, while DDP's layout differs
        # With a plan: DDP's buckets as the hook last saw them (bucket index -> parameters), and the
        # plan groups laid out exactly as one of them (parameters -> group), synced in place.
        self._ddp_layout: dict[int, tuple[int, ...]] = {}
        self._direct: dict[tuple[int, ...], int] = {}
        self._local_steps = 0  # steps this process's hook has seen: DDP rebuilds buckets after one
        self._ranks_agree = False  # set once every rank's config was compared
        # -- statistics
        self.trace = Trace()
        self._executed: dict[int, dict[str, Any]] = {}  # plan group -> its newest exchange, for stats()
        # plan="auto": what measures, plans and confirms in the first steps (by register()).
        self.auto: Auto | None = None
        if config.plan is not None and config.plan != AUTO_PLAN:
            self.use_plan(config.plan)

    def use_plan(self, plan: "Plan") -> None:
        """Execute `plan` from the next compressed step on: its groups become the compression
        points (any earlier ones are dropped) and the layout. Every rank must adopt the same plan
        at the same step; register() does it for a plan in the config."""
        self.plan = plan
        self._strategies = plan.strategies
        self.layout = {index: group.params for index, group in enumerate(plan.groups)}
        self.points = {}
        self._executed = {}

    def sync(
        self, buffer: torch.Tensor, bucket_index: int, is_last: bool, may_compress: bool = True
    ) -> Future[torch.Tensor]:
        """Average `buffer` over the ranks: the hook's whole job, usable without DDP too.

        The future holds a tensor shaped like `buffer`: `buffer` itself where the average can be
        written there (uncompressed steps; compressed ones whose payloads are allgathered, where
        nothing reads `buffer` any more, see below), else a fresh one. `buffer` is divided by the
        world size in place and must stay untouched until the future completes. With a plan,
        `bucket_index` is the plan group's index and `buffer` its gradients, except where
        may_compress is False (a DDP bucket of a warm-up step).
        """
        comm = self._comm()
        step = self._begin(is_last, buffer.device)
        buffer.div_(comm.world_size)  # before compressing: low-precision sums cannot overflow
        strategy = self._strategies[bucket_index] if self.plan is not None and may_compress else None
        where = f"{'group' if strategy is not None else 'bucket'} {bucket_index} at step {step}"
        with self._failures_named(where):
            if not self._compresses(buffer, step, may_compress, strategy):
                future = self._sync_uncompressed(buffer, bucket_index, step, may_compress, strategy)
            else:
                future = self._sync_compressed(buffer, bucket_index, step, strategy)
        return self._named(future, where)

    def sync_rows(self, grad: torch.Tensor, key: str, is_last: bool) -> Future[torch.Tensor]:
        """Average a sparse COO gradient (nn.Embedding(sparse=True)) over the ranks through
        gradsync.sparse; the future holds the coalesced sparse average. Never compressed."""
        comm = self._comm()
        step = self._begin(is_last, grad.device)
        clock = time.perf_counter()
        rows = SparseRows.from_coo(grad)
        rows = rows.like(rows.indices, rows.values / comm.world_size)
        with self._failures_named(f"sparse gradient {key} at step {step}"):
            result = self.sparse.sync(key, rows, comm, step)
        total = result.total.rows().to_coo(grad.shape)
        payload_bytes = rows.nnz * (4 + rows.width * rows.values.element_size())
        self._record_uncompressed(step, -1, grad.numel(), payload_bytes, result.bytes_sent, clock, "sparse")
        return completed(total)

    def stats(self) -> dict[str, Any]:
        """Bytes and seconds per step and in total (see Trace.stats), and under "sparse" each
        sparse-synced tensor's scheme, density, overlap, densification and imbalance (see
        gradsync.sparse.router.Router.stats).

        With a plan, under "groups", per plan group in index order, what its newest exchange ran
        (None before its first, in warm-up): {"group", "step", "strategy" (the plan's text),
        "codec" (the compressor's registry name, or "none"), "exchange" (the scheme that ran,
        one of gradsync.exchange.SCHEMES), "feedback" (the error-feedback form), "numel",
        "tensors", "bytes_sent", "payload_bytes"}.
        """
        out = {"step": self.step, **self.trace.stats(), "sparse": self.sparse.stats()}
        if self.auto is not None:
            out["auto"] = self.auto.stats()
        if self.plan is not None:
            out["groups"] = [self._executed.get(index) for index in range(len(self.plan.groups))]
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue the exact same trajectory."""
        return {
            "config": self.config.to_dict(),
            "step": self.step,
            "points": {index: point.state_dict() for index, point in self.points.items()},
            "layout": {index: list(params) for index, params in self.layout.items()},
            "sparse": self.sparse.state_dict(),
            # The plan plan="auto" adopted: a resumed run executes it rather than planning anew.
            "plan": self.plan.to_dict() if self.auto is not None and self.plan is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["config"] != self.config.to_dict():
            raise ValueError(
                f"the checkpoint was made with SyncConfig {state['config']}, but this run uses "
                f"{self.config.to_dict()}; its error memories and compressor state would not fit: "
                "resume with the same SyncConfig"
            )
        self.step = state["step"]
        if self.auto is not None and state.get("plan") is not None:
            from .plan import Plan

            self.auto.restore(Plan.from_dict(state["plan"]))
        self.points = {}
        for index, saved_point in state["points"].items():
            point = self._new_point(int(index), saved_point["numel"])
            point.codec.load_state_dict(saved_point["codec"])
            point.feedback.load_state_dict(saved_point["feedback"])
            self.points[int(index)] = point
        self.layout = {int(index): tuple(params) for index, params in state.get("layout", {}).items()}
        if "sparse" in state:
            self.sparse.load_state_dict(state["sparse"])
        self._layout_checked = set()
        self._regroup = None

    def __getstate__(self) -> dict[str, Any]:
        # The process group cannot be pickled; everything else can.
        return {**self.__dict__, "comm": None, "_param_index": None, "auto": None}

    # -- helpers ---------------------------------------------------------------------------------

    def _comm(self) -> Comm:
        if self.comm is None:
            raise RuntimeError(
                "this SyncState was unpickled and has no process group; call "
                "gradsync.register(ddp_model, config) and load_state_dict(old_state.state_dict())"
            )
        return self.comm

    @contextlib.contextmanager
    def _failures_named(self, where: str) -> Iterator[None]:
        """A CollectiveError raised inside, with `where` (which bucket or group, which step) and
        what to do added."""
        try:
            yield
        except CollectiveError as error:
            raise self._failure(error, where) from error

    def _named(self, future: Future[torch.Tensor], where: str) -> Future[torch.Tensor]:
        """`future`, with `where` and what to do added to a CollectiveError it fails with.

        Chained by Future.then, unlike the steps inside: DDP shows an error that reaches it so
        as "... CollectiveError: <message>", but one set on a future directly as "Unable to cast
        <message> to Tensor".
        """

        def check(source: Future[torch.Tensor]) -> torch.Tensor:
            try:
                return source.value()
            except CollectiveError as error:
                raise self._failure(error, where) from None

        return future.then(check)

    def _failure(self, error: CollectiveError, where: str) -> CollectiveError:
        timeout = getattr(self.comm, "timeout", None)
        waited = f", here {timeout}" if timeout is not None else ""
        return CollectiveError(
            f"gradsync: {where}: {error}\nA peer rank died, or stalled past the process group's timeout "
            f"(init_process_group(timeout=...){waited}). This step's gradients were not averaged and must "
            "not be applied: stop every rank and resume from the last checkpoint (torchrun "
            "--max-restarts restarts them)."
        )

    def _begin(self, is_last: bool, device: torch.device) -> int:
        """The step this bucket belongs to; counts the step once its last bucket arrives."""
        if not self._ranks_agree:
            self._check_ranks_agree(device)
        step = self.step
        if is_last:
            self.step += 1
        return step

    def _sync_uncompressed(
        self,
        buffer: torch.Tensor,
        bucket_index: int,
        step: int,
        may_compress: bool,
        strategy: "Strategy | None",
    ) -> Future[torch.Tensor]:
        # A plan's fp32 group goes through gradsync.sparse only where its strategy says so.
        if strategy is None or strategy.exchange == "sparse":
            segments = self._sparse_segments(buffer, bucket_index, step, may_compress)
            if segments is not None:
                return completed(self._sync_segments(buffer, bucket_index, step, segments, strategy))
        future = exchange.start(None, buffer, self._comm())
        return then(future, lambda result: self._finish(result, step, bucket_index, buffer, None, strategy))

    def _sync_compressed(
        self, buffer: torch.Tensor, bucket_index: int, step: int, strategy: "Strategy | None"
    ) -> Future[torch.Tensor]:
        comm = self._comm()
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
        key = f"group {bucket_index}" if strategy is not None else f"bucket {bucket_index}"

        def route(rows: SparseRows, finite: bool) -> SparseResult:
            return self.sparse.sync(key, rows, comm, step, finite)

        sparse, allgather = self._exchange_options(point.codec, strategy)
        future = exchange.start(
            point.codec,
            p,
            comm,
            finite,
            out=buffer if into_buffer else None,
            sparse=route if sparse else None,
            allgather=allgather,
        )
        compressed = (point, p)
        return then(future, lambda result: self._finish(result, step, bucket_index, buffer, compressed, strategy))

    def _compresses(
        self, buffer: torch.Tensor, step: int, may_compress: bool, strategy: "Strategy | None"
    ) -> bool:
        if not may_compress or step < self.config.warmup_steps:
            return False
        if strategy is not None:
            return strategy.compressed  # the plan decided: min_compress_numel does not apply
        return self.config.compressor != NO_COMPRESSION and buffer.numel() >= self.config.min_compress_numel

    @staticmethod
    def _exchange_options(codec: Compressor, strategy: "Strategy | None") -> tuple[bool, bool]:
        """(through the sparse route, allgather forced) for `codec` under a plan group's strategy.

        Without a plan the codec's capabilities decide (sparse-row payloads take the route). The
        strategy syntax writes exchange=allgather for every codec that is not summable, so for
        multi-round codecs and majority votes, which cannot be allgathered, it means their own
        scheme, and stats() reports which ran.
        """
        if strategy is None:
            return True, False
        forced = strategy.exchange == "allgather" and exchange.can_allgather(codec)
        return strategy.exchange == "sparse", forced

    def _sparse_segments(
        self, buffer: torch.Tensor, bucket_index: int, step: int, may_compress: bool
    ) -> list[_Segment] | None:
        """The tensors of an uncompressed bucket and whether each goes through gradsync.sparse;
        None where the whole bucket is one plain allreduce.

        A forced scheme takes every tensor. "auto" measures each tensor's density on its
        decision steps: those where a sparse scheme could beat dense are gathered and decided by
        the selector (on its next measurement they are looked at again); the others are dense.
        """
        scheme = self.config.sparse_scheme
        if scheme == "dense":
            return None
        segments = self._segments(buffer, bucket_index, may_compress)
        if scheme != AUTO:
            return segments
        if not may_compress:
            return None  # DDP's first-iteration buckets: no layout to key choices by
        comm = self._comm()
        selector = self.sparse.selector
        due = [seg for seg in segments if selector.due(seg.key, step)]
        if due:
            flat = buffer.view(-1)
            counts = torch.tensor(
                [float(seg.rows(flat).ne(0).any(dim=1).sum()) for seg in due], dtype=torch.float64
            )
            mean_rows = comm.allreduce(counts.to(buffer.device)).wait().cpu() / comm.world_size
            for seg, rows in zip(due, mean_rows.tolist(), strict=True):
                density = rows / seg.num_rows
                seg.sparse = not self.sparse.choose_dense(
                    seg.key, density, seg.rows(flat), comm.world_size, step
                )
        for seg in segments:
            if seg not in due:
                seg.sparse = selector.choices[seg.key].scheme != "dense"
        return segments if any(seg.sparse for seg in segments) else None

    def _segments(self, buffer: torch.Tensor, bucket_index: int, may_compress: bool) -> list[_Segment]:
        """The bucket's parameters as tables of rows (a parameter's first dimension), in buffer
        order; the whole bucket as a column where its parameters are not known."""
        numel = buffer.numel()
        params = self.layout.get(bucket_index) if may_compress and self._param_shapes else None
        if params is not None:
            shapes = [self._param_shapes[param] for param in params]  # type: ignore[index]
            if sum(shape.numel() for shape in shapes) == numel:
                segments, offset = [], 0
                for param, shape in zip(params, shapes, strict=True):
                    num_rows = shape[0] if len(shape) else 1
                    segments.append(
                        _Segment(f"param {param}", offset, num_rows, shape.numel() // max(num_rows, 1))
                    )
                    offset += shape.numel()
                return segments
        return [_Segment(f"bucket {bucket_index}", 0, numel, 1)]

    def _sync_segments(
        self,
        buffer: torch.Tensor,
        bucket_index: int,
        step: int,
        segments: list[_Segment],
        strategy: "Strategy | None" = None,
    ) -> torch.Tensor:
        """Consecutive dense tensors by one allreduce each run, sparse ones through the router."""
        comm = self._comm()
        clock = time.perf_counter()
        flat = buffer.view(-1)
        pending, sent = [], 0
        run_start = None  # where the current run of dense tensors began
        for seg in [*segments, None]:
            if seg is not None and not seg.sparse:
                run_start = seg.offset if run_start is None else run_start
                continue
            if run_start is not None:
                run = flat[run_start : flat.numel() if seg is None else seg.offset]
                pending.append(comm.allreduce(run))
                sent += allreduce_sent_bytes(run.nbytes, comm.world_size)
                run_start = None
            if seg is not None:
                table = seg.rows(flat)
                result = self.sparse.sync(seg.key, SparseRows.from_dense(table), comm, step, in_bucket=True)
                result.total.into(table)
                sent += result.bytes_sent
        for future in pending:
            future.wait()
        scheme = "sparse" if any(seg.sparse for seg in segments) else "plain"
        self._record_uncompressed(step, bucket_index, buffer.numel(), buffer.nbytes, sent, clock, scheme)
        if strategy is not None:
            self._note_group(bucket_index, step, None, scheme, buffer.numel(), buffer.nbytes, sent)
        return buffer

    def _record_uncompressed(
        self,
        step: int,
        bucket_index: int,
        numel: int,
        payload_bytes: int,
        bytes_sent: int,
        started: float,
        scheme: str,
    ) -> None:
        """Trace an exchange that compressed nothing and took since `started` (perf_counter)."""
        self.trace.record(
            BucketRecord(
                step=step,
                bucket=bucket_index,
                numel=numel,
                compressed=False,
                scheme=scheme,
                payload_bytes=payload_bytes,
                bytes_sent=bytes_sent,
                bytes_fp32=allreduce_sent_bytes(4 * numel, self._comm().world_size),
                compress_s=0.0,
                communicate_s=time.perf_counter() - started,
                decompress_s=0.0,
            )
        )

    def _finish(
        self,
        result: exchange.Exchanged,
        step: int,
        bucket_index: int,
        buffer: torch.Tensor,
        compressed: tuple[CompressionPoint, torch.Tensor] | None,
        strategy: "Strategy | None" = None,
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
                scheme=result.scheme,
                payload_bytes=result.payload_bytes,
                bytes_sent=result.bytes_sent,
                bytes_fp32=exchange.allreduce_sent_bytes(4 * numel, self._comm().world_size),
                compress_s=result.seconds.get("compress", 0.0),
                communicate_s=result.seconds.get("communicate", 0.0),
                decompress_s=result.seconds.get("decompress", 0.0),
            )
        )
        if strategy is not None:
            point = None if compressed is None else compressed[0]
            self._note_group(
                bucket_index, step, point, result.scheme, numel, result.payload_bytes, result.bytes_sent
            )
        return out

    def _note_group(
        self,
        index: int,
        step: int,
        point: CompressionPoint | None,
        scheme: str,
        numel: int,
        payload_bytes: int,
        bytes_sent: int,
    ) -> None:
        """Keep what plan group `index` ran at `step`, for stats(): read from the objects that ran
        it (the compression point, the exchange's result), not from the plan."""
        assert self.plan is not None
        self._executed[index] = {
            "group": index,
            "step": step,
            "strategy": self.plan.groups[index].strategy,
            "codec": NO_COMPRESSION if point is None else _registry_name(compress.REGISTRY, point.codec),
            "exchange": scheme,
            "feedback": "none" if point is None else _registry_name(feedback.REGISTRY, point.feedback),
            "numel": numel,
            "tensors": len(self.layout[index]),
            "bytes_sent": bytes_sent,
            "payload_bytes": payload_bytes,
        }

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
        """A fresh point for a bucket (config.compressor), or for a plan group (its strategy's codec)."""
        comm = self._comm()
        if self.plan is None:
            name, args = self.config.compressor, dict(self.config.compressor_args)
        else:
            strategy = self._strategies[bucket_index]
            name, args = strategy.codec, dict(strategy.args)
        local_stream = lookup(name).randomness == "local"
        rank = comm.rank if local_stream else 0
        seed = _derive_seed(self.config.seed, bucket_index, rank)
        return CompressionPoint(numel, build_codec(name, args, seed), self.config.build_feedback(name))

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
    buffer = bucket.buffer()
    if buffer.is_sparse:  # a sparse gradient (nn.Embedding(sparse=True)) has a bucket of its own
        if is_last:
            state._regroup = None  # a regrouped step's dense groups all arrived before it
        (param,) = bucket.parameters()
        key = f"param {state._param_index[id(param)]}" if state._param_index else f"bucket {index}"
        return state.sync_rows(buffer, key, is_last)
    if state.auto is not None and not state.auto.done:
        return state.auto.hook(bucket, is_last)
    if state.plan is not None:
        return _planned(state, bucket, is_last, first_iteration)
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


def _planned(
    state: SyncState, bucket: dist.GradBucket, is_last: bool, first_iteration: bool
) -> Future[torch.Tensor]:
    """The hook under a plan: warm-up steps average DDP's buckets in fp32; from the first
    compressed step on, the plan's groups are cut out of the buckets and each exchanged by its own
    strategy. The plan's groups do not depend on DDP's buckets, so a state restored past warm-up
    compresses the first iteration of a fresh DDP model too.

    A group laid out exactly as one of DDP's buckets (as the hook saw them the step before) is
    synced in the bucket itself, sparing the copies out of and back into it; the others go
    through one Regroup per step."""
    if state._param_index is None:
        raise RuntimeError(
            "gradsync's hook runs a plan but does not know the model's parameters: install it with "
            "gradsync.register(ddp_model, config), not register_comm_hook"
        )
    bucket_params = bucket.parameters()
    params = tuple(state._param_index[id(p)] for p in bucket_params)
    if not first_iteration:  # DDP rebuilds its buckets after the first iteration, then keeps them
        state._ddp_layout[bucket.index()] = params
    if state._regroup is None:
        if state.step < state.config.warmup_steps:
            return state.sync(bucket.buffer(), bucket.index(), is_last, may_compress=False)
        buckets = set(state._ddp_layout.values()) if not first_iteration else set()
        state._direct = {group: index for index, group in state.layout.items() if group in buckets}
        direct = set(state._direct.values())
        state._regroup = Regroup(state.sync, {i: g for i, g in state.layout.items() if i not in direct})
    regroup = state._regroup
    if params in state._direct:
        future = state.sync(bucket.buffer(), state._direct[params], is_last)
        if is_last:
            regroup.check_complete()
    else:
        future = regroup.add(bucket.buffer(), params, [p.numel() for p in bucket_params], is_last)
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
    comm = TorchComm(model.process_group)
    plan = _resolve_plan(config, model, comm.world_size)  # a bad plan fails here, before training
    state = SyncState(config, comm)  # adopts a Plan the config holds
    if plan is not state.plan:  # one resolved here rather than given (plan="auto")
        state.use_plan(plan)
    state._param_index = {id(p): i for i, p in enumerate(model.parameters())}
    state._param_shapes = [p.shape for p in model.parameters()]
    if config.plan == AUTO_PLAN:
        from .autoplan import Auto

        state.auto = Auto(state, model)
    model.register_comm_hook(state, hook)
    log.info("gradsync registered on rank %d of %d: %s", state.comm.rank, state.comm.world_size, config)
    return state


def _resolve_plan(config: SyncConfig, model: DistributedDataParallel, world_size: int) -> "Plan | None":
    """The plan the hook will execute, checked against the model and the runtime; None without one.

    The one place a plan is resolved: plan="auto" is to be made here.
    """
    if config.plan is None:
        return None
    if config.plan == AUTO_PLAN:
        sparse = sorted(_sparse_gradient_params(model))
        if sparse:
            raise ValueError(
                f"SyncConfig(plan='auto'): parameters {sparse} have sparse (COO) gradients "
                "(nn.Embedding(sparse=True)), which a plan's groups cannot hold; use sparse=False (the "
                "planner then weighs sending the embedding's rows by gradsync.sparse), or no plan"
            )
        return None  # made in the first steps: gradsync.autoplan
    plan = config.plan
    plan.check(model, world_size)
    _check_executable(plan, model)
    return plan


def _check_executable(plan: "Plan", model: nn.Module) -> None:
    """Refuse, before training, what the hook cannot execute yet, naming the group and the fix."""
    params = list(model.parameters())
    sparse_grads = _sparse_gradient_params(model)
    for index, (group, strategy) in enumerate(zip(plan.groups, plan.strategies, strict=True)):
        where = f"plan group {index} (strategy {group.strategy!r})"
        if strategy.exchange == "hierarchical":
            raise ValueError(
                f"{where}: exchange=hierarchical needs intra- and inter-node process groups, which "
                "gradsync's hook does not build yet; use exchange=allreduce (summable codecs) or "
                "exchange=allgather, or make the plan afresh"
            )
        on_device = [p for p in group.params if params[p].device.type != "cpu"]
        if strategy.on == "cpu" and on_device:
            raise ValueError(
                f"{where}: on=cpu offloads compression to a CPU thread, which gradsync's hook does not "
                f"do yet, and parameters {on_device} are on {params[on_device[0]].device}; drop on=cpu "
                "(compress on the device) or make the plan afresh"
            )
        sparse = sorted(sparse_grads & set(group.params))
        if sparse:
            raise ValueError(
                f"{where}: parameters {sparse} have sparse (COO) gradients (nn.Embedding(sparse=True)), "
                "which a plan's groups cannot hold yet; use sparse=False and strategy "
                "fp32:exchange=sparse for the embedding, or run without a plan"
            )


def _sparse_gradient_params(model: nn.Module) -> set[int]:
    """Positions in model.parameters() of the parameters whose gradients are sparse COO tensors."""
    sparse = {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
    }
    return {index for index, p in enumerate(model.parameters()) if id(p) in sparse}


def _registry_name(table: dict[str, type], obj: object) -> str:
    """The name `obj`'s class is registered under in `table`."""
    return next(name for name, cls in table.items() if type(obj) is cls)


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
