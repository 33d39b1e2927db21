"""SyncState: what gradsync keeps between steps, and one straight path per group of gradients.

Each group (a DDP bucket, or a plan's group) goes through `_sync_group`, top to bottom: error
memory added, compressed, exchanged (gradsync.exchange: every collective), decoded, residual kept,
recorded. gradsync.ddp maps DDP's buckets to groups; SyncState.sync also works without DDP.

Failures are never silent: a collective that fails (a peer died, or stalled past the process
group's timeout) fails the group's future with a CollectiveError that names the group and the
step; nothing of that step reaches the gradients.

(Over 400 lines: the state and its one path belong together; checkpoint checks are in
gradsync.checkpoint, the DDP glue in gradsync.ddp.)
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from . import checkpoint, compress, exchange, feedback, loss_scale
from .comm import (
    CollectiveError,
    Comm,
    TorchComm,
    allgather_object,
    allreduce_sent_nbytes,
    completed,
    gather_object,
    on_nccl,
    then,
)
from .compress import Compressor, lookup
from .compress.base import check_int, is_finite
from .config import NO_COMPRESSION, PlanLike, SyncConfig, build_codec, require_config
from .feedback import Feedback
from .lane import Lane
from .learning_rate import LearningRate, Rates, held_at
from .regroup import Regroup
from .sparse.router import Router, Table
from .sparse.rows import SparseRows
from .strategy import Strategy, default_collective
from .trace import GroupRecord, Trace

log = logging.getLogger("gradsync")


@dataclass
class CompressionPoint:
    """One group's compressor and error memory: everything compression keeps between steps."""

    numel: int
    codec: Compressor
    feedback: Feedback
    # The group's parameters (positions in model.parameters()) where known: the shapes the codec
    # was told (uses_shapes), told again on restore.
    params: tuple[int, ...] | None = None
    # Two-shot with error feedback: the memory of re-encoding the shard this rank owns.
    shard_error: torch.Tensor | None = None
    # The learning rates the memories hold updates for (gradsync.learning_rate); None: unknown.
    rates: tuple[float, ...] | None = None
    # AMP's loss scale the memories hold gradients at (gradsync.loss_scale); None: unscaled.
    loss_scale: float | None = None
    # Where the exchange writes the shard memory's next value; keep() swaps it in, undo() back.
    _shard_spare: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _shard_kept: bool = field(default=False, init=False, repr=False, compare=False)

    def state_dict(self) -> dict[str, Any]:
        return {
            "numel": self.numel,
            "params": None if self.params is None else list(self.params),
            "codec": self.codec.state_dict(),
            "feedback": self.feedback.state_dict(),
            "shard_error": None if self.shard_error is None else self.shard_error.clone(),
            "rates": None if self.rates is None else list(self.rates),
            "loss_scale": self.loss_scale,
        }

    @property
    def guarded(self) -> bool:
        """Whether a non-finite step must be found and skipped here: everywhere but where nothing
        keeps state it could poison (a cast without error memory), whose payload carries NaN and
        inf by itself, with no check and no flag (as PyTorch's fp16 hook)."""
        return not (type(self.codec).preserves_nonfinite and isinstance(self.feedback, feedback.NoFeedback))

    def rescale(self, ratio: float) -> None:
        """Scale every memory that holds back part of the update (Feedback.rescale). The shard's
        re-encoding memory too where the form's own memory holds back (residual feedback); under
        EF21 it is what the broadcast mirror lacks of the ranks' mirrors' sum, unscaled as they are."""
        self.feedback.rescale(ratio)
        if self.shard_error is not None and type(self.feedback).holds_back:
            self.shard_error.mul_(ratio)

    def rescale_units(self, ratio: float) -> None:
        """The gradients' units changed by `ratio` (AMP's loss scale): every memory and codec
        state that holds gradients is scaled, the shard's re-encoding memory too."""
        self.feedback.rescale_units(ratio)
        self.codec.rescale_units(ratio)
        if self.shard_error is not None:
            self.shard_error.mul_(ratio)

    def hand_over(self, rank: int, world_size: int) -> torch.Tensor | None:
        """Everything this point holds back of the gradient, shaped like the group, in this rank's
        share's units (Feedback.held_back), for a plan that replaces the point: the residual
        memory, and, where this rank owns a shard of a two-shot exchange, the memory of
        re-encoding that shard's sum (added to one rank's share, it reaches the average whole).
        The memory itself, the shard's added into it, not a copy (a fresh one of a group's size
        costs its page faults in the step of the hand-over): the point must not run again. None
        where the memory holds nothing back as such."""
        memory = self.feedback.held_back()
        if memory is None:
            return None
        if self.shard_error is not None:
            start, end = exchange.shard_bounds(self.numel, world_size)[rank]
            memory.view(-1)[start:end].add_(self.shard_error)
        return memory

    def shard_memory(
        self, like: torch.Tensor, rank: int, world_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The shard's error memory, zero on first use (a two-shot group with error feedback), and
        the buffer the exchange writes its next value into (keep() makes that the memory)."""
        start, end = exchange.shard_bounds(self.numel, world_size)[rank]
        if self.shard_error is None or self.shard_error.numel() != end - start:
            self.shard_error = like.new_zeros(end - start)
        spare = self._shard_spare
        if spare is None or spare.shape != self.shard_error.shape or spare.device != self.shard_error.device:
            spare = self._shard_spare = torch.empty_like(self.shard_error)
        self._shard_kept = False
        return self.shard_error, spare

    def __getstate__(self) -> dict[str, Any]:
        # The spare holds nothing worth keeping, as feedback's spares.
        return {**self.__dict__, "_shard_spare": None, "_shard_kept": False}

    def keep(self) -> None:
        """The step's exchange ended finite: the shard memory's next value (written by the exchange
        into its spare) becomes the memory. The feedback form keeps its own in update."""
        if self._shard_spare is not None and not self._shard_kept:
            self.shard_error, self._shard_spare = self._shard_spare, self.shard_error
            self._shard_kept = True

    def undo(self) -> None:
        """Put back what this step changed (its update ran): the codec's state, the error
        memories, the shard's memory. The step is skipped after all: another group's average
        was not finite, so the optimizer skips the whole step."""
        self.codec.undo()
        self.feedback.undo()
        if self._shard_kept:
            self.shard_error, self._shard_spare = self._shard_spare, self.shard_error
            self._shard_kept = False


class SyncState:
    """What gradsync's hook keeps between steps. Returned by gradsync.register().

    Example:
        >>> state = gradsync.register(ddp_model, gradsync.SyncConfig(compressor="topk"))
        >>> ...train...
        >>> state.stats()["last_step"]["compression_ratio"]
        >>> torch.save(state.state_dict(), f"gradsync-rank{rank}.pt")  # one file per rank
    """

    # Whether error memories follow the learning rate of an SGD over the model's parameters
    # (gradsync.learning_rate): a gradient's held-back part moves them as far as it would have.
    follows_learning_rate: ClassVar[bool] = True
    # Whether they follow AMP's loss scale (gradsync.loss_scale): what is synced are gradients
    # of the scaled loss (not DiLoCo's outer gradients).
    follows_loss_scale: ClassVar[bool] = True
    # Whether a run whose groups are all below min_compress_numel is warned about after warm-up
    # (DiLoCo says it of its fragments when it is built).
    says_nothing_compressed: ClassVar[bool] = True
    says_compressing: ClassVar[bool] = True  # whether the first compressed exchange is logged
    # Whether the groups of one step number are one training step, so that a step found not
    # finite in one group is undone in all (not where each group counts its own steps: HSDP's
    # replica average).
    steps_together: ClassVar[bool] = True
    group_noun: ClassVar[str] = "bucket"  # what a group is, in the user's terms

    def __init__(self, config: SyncConfig, comm: Comm | None = None, model: nn.Module | None = None) -> None:
        """`comm`: the ranks to average over. None binds the default process group at the first
        exchange, so that a state can be handed to a framework before it creates the group:
        DDPStrategy(ddp_comm_hook=gradsync.hook, ddp_comm_state=gradsync.SyncState(config)) in
        Lightning; pass TorchComm(group) where DDP averages over another group. Without `model`
        the state works on DDP's buckets alone (see gradsync.ddp)."""
        require_config(config)
        # -- hyperparameters
        self.config = config
        # -- the ranks to average over and the order collectives go out in (not pickled)
        self.comm: Comm | None = None
        self._binds_default_group = comm is None
        self.rank: int | None = None  # these three kept when unpickled, for state_dict
        self.world_size: int | None = None
        self._key_rank: int | None = None
        if comm is not None:
            self._bind(comm)
        self.lane = Lane()
        # -- the model: positions, shapes and which parameters are embedding tables (rows)
        params = list(model.parameters()) if model is not None else []
        self._param_index: dict[int, int] | None = {id(p): i for i, p in enumerate(params)} if model else None
        self._param_shapes = [p.shape for p in params]
        self._averaged = _reducer_params(model) if model is not None else None  # in DDP's buckets
        # The ids of the parameters that reached the hook in DDP's first iteration while no
        # bucket of it was named the last (static_graph over several buckets never names one):
        # all that DDP averages end it; without the model, a repeat, or a read between steps.
        self._first_arrivals: set[int] = set()
        self._embeddings = _embedding_params(model) if model is not None else set()
        self._shapes_digest = checkpoint.digest(self._param_shapes) if model is not None else None
        self._device = params[0].device if params else None  # where a checkpoint's tensors go
        # The rate the user's SGD applies to those parameters, which error memories follow.
        follows = model is not None and self.follows_learning_rate
        self._learning_rate = LearningRate(params) if follows else None
        self._rates: tuple[int, Rates | None] = (-1, None)  # (step, the rates read at it)
        self._follows_scale = self.follows_loss_scale
        if self._follows_scale:
            loss_scale.watch()
        self._scale: tuple[int, float | None] = (-1, None)  # (step, the loss scale read at it)
        # -- the plan executed from the first compressed step on; None: config.compressor per bucket
        self.plan: PlanLike | None = None
        self._strategies: list[Strategy] = []
        # -- internal state
        self.step = 0  # training steps whose last bucket reached the hook
        self.points: dict[int, CompressionPoint] = {}  # by group (DDP bucket or plan group)
        # Each group's parameters (positions in model.parameters()) in buffer order, as of the
        # compressed steps: a restored state needs them where DDP lays out buckets otherwise.
        self.layout: dict[int, tuple[int, ...]] = {}
        self.sparse = Router(config.sparse_scheme, config.sparse_every, config.seed)
        self._layout_checked: set[int] = set()  # buckets seen laid out as in `layout`
        self._regroup: Regroup | None = None  # this step's regrouping, while DDP's layout differs
        # With a plan: DDP's buckets as last seen, each with the local step it was seen at (an
        # index a later layout has not reached again holds an earlier layout's bucket).
        self._ddp_layout: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._direct: dict[tuple[int, ...], int] = {}  # plan groups laid out as a bucket: synced in place
        # (a step of this process, its buckets synced in place as laid out in `layout`)
        self._in_place: tuple[int, set[int]] = (-1, set())
        self._local_steps = 0  # steps this process's hook has seen: DDP rebuilds buckets after one
        # ... or after two with static_graph=True (its first iteration traces the graph). A state
        # made without the model (register_comm_hook) cannot tell, so it waits for two: a point
        # made on DDP's second iteration would not fit the buckets rebuilt after it.
        self._initial_iterations = 1 if model is not None and not getattr(model, "static_graph", False) else 2
        self._ranks_agree = False  # set once every rank's config was compared
        self._compressing = False  # set (and logged) at the first compressed exchange
        self._largest_small = 0  # the largest group left uncompressed for its size
        self._largest_met = 0  # the largest group _say_if_nothing_compressed was told of
        self._said_nothing_compressed = False
        self._momentum_checked = False  # momentum correction's beta against the optimizer's, once
        # Per parameter, what to add to its next gradient (the average's share) before it is
        # exchanged: error memories of a plan given up (plan="auto" hands over between plans).
        self._carry: dict[int, torch.Tensor] = {}
        # The loss scale and learning rates what is carried is held at, as a point's memories
        # (_follow_carry): a carry put back by a skipped step waits for the next at them.
        self._carry_at: tuple[float | None, Rates | None] = (None, None)
        # A step whose average is not finite in one group keeps nothing in any (the optimizer
        # skips it whole): the step and the points that kept what its finite groups sent, each
        # with what it took of the carry, to undo where a later group of the step is not finite;
        # and the last step found so.
        self._kept_at: tuple[int, list[tuple[CompressionPoint, dict[int, torch.Tensor]]]] = (-1, [])
        self._skipped_at = -1
        self._finishing = threading.Lock()
        # -- statistics
        self.trace = Trace()
        self._executed: dict[int, dict[str, Any]] = {}  # group -> its newest exchange, for stats()
        if config.planned:
            self.use_plan(config.plan)  # type: ignore[arg-type]

    # -- the public surface -----------------------------------------------------------------------

    def use_plan(self, plan: PlanLike, carry: bool = False) -> None:
        """Execute `plan` (a gradsync.plan.Plan, checked against the model) from the next compressed
        step on: its groups become the compression points and the layout. Every rank must adopt
        the same plan at the same step.

        The earlier points are dropped; with `carry`, what their residual memories (error_feedback
        "ef") hold back is first carried, per parameter, into the next step's gradients, so that
        nothing compression held back is lost (Feedback.held_back): the memories themselves are
        handed over (CompressionPoint.hand_over), so a point of the old plan, held elsewhere, is
        spent. Other memory forms (EF21's and EControl's mirrors, momentum correction's
        velocities, DGC's accumulators) cannot be split that way and start afresh."""
        dropped, self.points = self.points, {}  # dropped first: none runs again, even where carrying fails
        if carry:
            self._carry_memories(dropped)
        self.plan = plan
        self._strategies = list(plan.strategies)
        self.layout = {index: tuple(group.params) for index, group in enumerate(plan.groups)}
        self._executed = {}

    def close(self) -> None:
        """Remove what gradsync added to the model besides its hook (plan="auto"'s timers), stop
        watching the optimizer's steps (gradsync.learning_rate) and end the lane's thread (it
        would otherwise idle a minute; a later exchange starts one again)."""
        if self._learning_rate is not None:
            self._learning_rate.close()
        self.lane.stop()

    def sync(
        self,
        buffer: torch.Tensor,
        group: int,
        is_last: bool,
        compress: bool = True,
        params: Sequence[int] | None = None,
        *,
        drain: bool = True,
    ) -> Future[torch.Tensor]:
        """Average `buffer` (one group's flat gradients) over the ranks: the hook's whole job,
        usable without DDP too.

        The future holds a tensor shaped like `buffer`: `buffer` itself where the average can be
        written there, else a fresh one. `buffer` is divided by the world size in place and must
        stay untouched until the future completes. `compress` False: exchanged uncompressed (a
        warm-up step, DDP's first buckets). `is_last`: the step's last group; the step is counted.
        `params`: the group's parameters (positions in model.parameters()) in buffer order, where
        known: an embedding table among them may go as rows, and PowerSGD approximates each weight
        as its own matrix. `drain` False: at the step's last group, return while collectives that
        wait on one another may still be issuing from the lane's thread, for a caller that issues
        no collective of its own until the future is done (DiLoCo overlapping an exchange with
        inner steps).
        """
        self._comm()
        step = self._begin(is_last, buffer.device)
        where = self._where(group, step, compress)
        with self._failures_named(where):
            try:
                future = self._sync_group(buffer, group, step, compress, params)
            except BaseException:
                # Nothing of gradsync's may still be issuing when the caller's handler issues
                # collectives of its own (a checkpoint): they would interleave differently per rank.
                self.lane.drain()
                raise
            # Nothing of gradsync's is still being issued when DDP or the user issue theirs.
            if is_last and drain:
                self.lane.drain()
        return self._named(future, where)

    def _where(self, group: int, step: int, compress: bool) -> str:
        """The exchange a failure names: which bucket or plan group, at which step."""
        return f"{'group' if self.plan is not None and compress else 'bucket'} {group} at step {step}"

    def sync_rows(self, grad: torch.Tensor, key: str, is_last: bool) -> Future[torch.Tensor]:
        """Average a sparse COO gradient (nn.Embedding(sparse=True)) over the ranks through
        gradsync.sparse; the future holds the coalesced sparse average. Never compressed."""
        comm = self._comm()
        step = self._begin(is_last, grad.device)
        where = f"sparse gradient {key} at step {step}"
        clock = time.perf_counter()
        rows = SparseRows.from_coo(grad)
        rows = rows.like(rows.indices, rows.values / comm.world_size)

        def program() -> Future[torch.Tensor]:
            result = self.sparse.sync(key, rows, comm, step)
            payload = rows.nnz * (4 + rows.width * rows.values.element_size())
            self.trace.record(
                GroupRecord(step, -1, grad.numel(), NO_COMPRESSION, "allreduce", result.scheme, payload,
                            result.sent_nbytes, allreduce_sent_nbytes(4 * grad.numel(), comm.world_size),
                            0.0, time.perf_counter() - clock, 0.0)
            )  # fmt: skip
            return completed(result.total.rows().to_coo(grad.shape))

        with self._failures_named(where):
            future = self.lane.run(program, blocking=True, device=grad.device)
            if is_last:
                self.lane.drain()
        return self._named(future, where)

    def stats(self) -> dict[str, Any]:
        """Bytes and seconds per step and in total (see Trace.stats), under "sparse" each
        sparse-synced tensor's scheme, density, overlap, densification and imbalance (see
        gradsync.sparse.router.Router.stats), and under "groups", per group in index order, what
        its newest exchange ran (None before its first): {"group", "step", "strategy", "codec",
        "collective", "scheme", "feedback", "numel", "tensors", "sent_nbytes", "payload_nbytes"}.
        """
        self._end_unannounced_step()
        count = len(self.plan.groups) if self.plan is not None else max(self._executed, default=-1) + 1
        return {
            "step": self.step,
            **self.trace.stats(),
            "sparse": self.sparse.stats(),
            "groups": [self._executed.get(index) for index in range(count)],
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything this rank's resumed run needs to continue the exact same trajectory.

        It is this rank's own (error memories differ from rank to rank), packed as one entry under
        its rank's key: {"format": 4, "rank <r>": bytes}, a shape fixed from registration on. Save
        one file per rank; or gather every rank's into one with full_state_dict(); or pass the
        state itself to torch.distributed.checkpoint (dcp.save({"gradsync": state}, ...)).
        """
        if self._key_rank is None:
            self._comm()  # a state on the default group binds it here if no step has yet
        return checkpoint.pack(self._own_state(), self._key_rank)

    def full_state_dict(self, to: int | None = None) -> dict[str, Any]:
        """Every rank's state_dict() merged into one, for a checkpoint that one rank saves: a
        collective, call it on every rank. load_state_dict() takes each rank's own part of it.
        `to`: the one rank (of the state's group) that gets it; the others get {} and never hold
        more than their own state (None: every rank gets it, world_size states in memory each)."""
        comm = self._comm()
        own = self.state_dict()
        if to is not None:
            check_int("to", to, 0, comm.world_size - 1, why="a rank of the state's process group")
        with self._failures_named("full_state_dict", "nothing was saved"):
            if to is None:
                parts = allgather_object(comm, own, collective_device(comm, self._device))
            else:
                parts = gather_object(comm, own, to, collective_device(comm, self._device)) or []
        return {key: value for part in parts for key, value in part.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what state_dict() (or full_state_dict()) saved. A collective: call it on every
        rank. Refused on every rank alike, with what to do, where any rank's state is not its own
        (another rank's, another step than the other ranks', another config or world size), holds
        a non-finite error memory, or is not a gradsync state at all."""
        comm = self._comm()
        mine, problems = checkpoint.own_part(state, self._key_rank, getattr(self, "_device", None))
        if mine is not None:
            try:  # every rank must reach the comparison below, whatever its file holds
                problems += self._state_problems(mine)
            except Exception as error:
                problems.append(f"it is not a whole gradsync state ({type(error).__name__}: {error})")
        restore: Callable[[], None] | None = None
        if mine is not None and not problems:
            try:
                restore = self._prepare_restore(mine)
            except Exception as error:  # a damaged entry a codec or plan refuses: refused everywhere
                problems.append(
                    f"its saved state cannot be rebuilt ({type(error).__name__}: {error}): the file is "
                    "damaged; resume from an earlier checkpoint"
                )
        with self._failures_named("load_state_dict", "nothing was loaded"):
            shared = (mine["step"], self._shared_digest(mine)) if mine and not problems else (None, None)
            reports = allgather_object(comm, (problems, *shared), collective_device(comm, self._device))
        refused = {rank: found for rank, (found, _, _) in enumerate(reports) if found}
        steps = {rank: step for rank, (_, step, _) in enumerate(reports)}
        if not refused and len(set(steps.values())) > 1:
            refused = {-1: [f"the ranks' states are of different steps {steps}: load one checkpoint's files"]}
        elif not refused and len({digest for _, _, digest in reports}) > 1:
            refused = {
                -1: [
                    "the ranks' states were saved by different runs (what every rank of one run holds alike "
                    "differs): load one checkpoint's files"
                ]
            }
        if refused:
            lines = "\n".join(
                f"  {'all ranks' if rank < 0 else f'rank {rank}'}: {'; '.join(found)}"
                for rank, found in refused.items()
            )
            raise ValueError(f"gradsync: load_state_dict refused, nothing was loaded:\n{lines}")
        assert restore is not None
        restore()

    def __getstate__(self) -> dict[str, Any]:
        # The process group and the model cannot be pickled; everything else can. A state bound to
        # a group refuses to sync once unpickled; one still waiting to bind the default group binds
        # wherever it is unpickled (a framework may pickle it to its processes, as ddp_spawn does).
        unbound = self._binds_default_group and self.comm is None
        return {
            **self.__dict__,
            "comm": None,
            "_param_index": None,
            "_binds_default_group": unbound,
            "_learning_rate": None,  # it watches this process's optimizers
            "_kept_at": (-1, []),  # undone only within the step that kept it
            "_finishing": None,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._finishing = threading.Lock()

    # -- one group's path -----------------------------------------------------------------------

    def _sync_group(
        self, x: torch.Tensor, group: int, step: int, compress: bool, params: Sequence[int] | None
    ) -> Future[torch.Tensor]:
        """Average one group: the straight walk, everything it keeps and everything it records."""
        comm = self._comm()
        strategy = self._strategy(group, x.numel(), step, compress)
        route = exchange.Route(
            comm, self.lane, self.sparse, _key(self.plan is not None and compress, group), step
        )
        started = time.perf_counter()
        if not strategy.compressed:
            x.div_(comm.world_size)
            carried = self._add_carried(x, params, step)
            tables = self._tables(params, x.numel(), strategy)
            future = exchange.uncompressed(x, route, tables, strategy.scheme)
            shown = self.plan is None or compress  # a plan's warm-up runs DDP's buckets, not its groups

            def done(result: exchange.Exchanged) -> torch.Tensor:
                if carried:  # what a plan given up carried in: into the next step if this one is skipped
                    with self._finishing:
                        self._keep_carried(carried, x)
                        self._kept(step, None, carried)
                return self._record(result, x, group, step, strategy, None, started, shown)

            return then(future, done, x.device)
        self._note_compressing(step, _key(self.plan is not None, group), strategy)
        point = self._point(group, x, step, params)
        self._follow_learning_rate(point, step)
        self._follow_loss_scale(point, step)
        guard = point.guarded
        # Where the payload shows a non-finite input by itself, the exchange's check finds it: the
        # hook need not look (nor where there is nothing to guard).
        unchecked = not guard or type(point.codec).reveals_nonfinite
        # Whether a plan given up carries anything into this group: its own parameters decide, so
        # that a step's put-back (_keep_carried, from another group's callback, whenever it runs
        # on this rank) never changes how this step's other groups are encoded.
        carries = bool(self._carry) and params is not None and any(p in self._carry for p in params)
        # p: what is compressed, from this rank's share x / n (the division first: low-precision
        # sums cannot overflow); error memory added. A non-finite gradient never enters a memory.
        # Where nothing is added, the codec takes x itself and divides as it compresses (a cast
        # in one pass, not two).
        divisor = comm.world_size if type(point.feedback) is feedback.NoFeedback and not carries else 1
        # Residual feedback's add, the encode and the residual in one pass, where the codec can
        # (int8, int4 by two-shot): p is computed as it is encoded, so only a payload that shows a
        # non-finite p can tell of one, which every such codec's does (Compressor refuses
        # fuses_feedback without reveals_nonfinite).
        fuse = strategy.collective == "two-shot" and type(point.codec).fuses_feedback and not carries
        deferred = point.feedback.defer(x, comm.world_size) if fuse else None
        carried: dict[int, torch.Tensor] = {}  # what a plan given up carries into this step
        if deferred is not None:  # nothing carried (fuse), and p not yet written
            p, corrected = deferred
        else:  # prepare writes spares only: the memories stay untouched until update
            p, corrected = point.feedback.prepare(x, comm.world_size) if divisor == 1 else x, None
            carried = self._add_carried(p, params, step)
        # What is compressed is checked, not the gradient: a memory added to a finite gradient can
        # pass a narrow dtype's range (fp16's 65504), and a payload that hides it (natural
        # compression saturates) would leave an inf in the memory, and every later step skipped.
        finite = unchecked or is_finite(p)
        # The sum is decoded into `x`, as PyTorch's own hooks return the bucket they were given (a
        # fresh full-size tensor costs as much in page faults as a copy), wherever nothing reads `x`
        # afterwards: what was compressed is another tensor, or its decode is not needed again.
        uses_local = type(point.feedback).uses_local
        into_x = (p is not x or not uses_local) and not type(point.feedback).reads_gradient
        # Error feedback covers both encodings of a two-shot exchange, the owner's second one too
        # (a rank alone sends its own payload on: there is no second encoding).
        second = (
            strategy.collective == "two-shot"
            and not isinstance(point.feedback, feedback.NoFeedback)
            and comm.world_size > 1
        )
        shard, shard_next = point.shard_memory(x, comm.rank, comm.world_size) if second else (None, None)
        future = exchange.start(
            point.codec,
            p,
            route,
            strategy.collective,
            strategy.scheme,
            finite,
            out=x if into_x else None,
            keep_local=uses_local,
            guard=guard,
            shard_error=shard,
            divisor=divisor,
            corrected=corrected,
            shard_error_out=shard_next,
        )

        def finish(result: exchange.Exchanged) -> torch.Tensor:
            with self._finishing:  # groups' callbacks may run on several of the backend's threads
                if not result.finite and self.steps_together:
                    self._skip(step)
                skipped = not result.finite or (self.steps_together and step == self._skipped_at)
                if skipped:  # this group's average or another's of the step is not finite
                    point.codec.undo()  # a skipped step leaves no trace in codec state either
                    self._carry.update(carried)  # what was carried in goes into the next step
                    # The average is NaN on every rank: AMP's GradScaler skips the step.
                    out = result.total if result.finite else x.fill_(math.nan)
                else:
                    out = point.feedback.update(x, p, result.local, result.total, result.remove_local_)
                    point.keep()
                    self._keep_carried(carried, out)
                    self._kept(step, point, carried)
            return self._record(result, out, group, step, strategy, point, started)

        return then(future, finish, x.device)

    def _kept(self, step: int, point: CompressionPoint | None, carried: dict[int, torch.Tensor]) -> None:
        """Note what `step` kept in `point` (None: an uncompressed group) and took of the carry,
        for _skip to put back; where the step is found skipped already, put the carry back now.
        Under the lock."""
        if not self.steps_together:
            return
        if step == self._skipped_at:
            self._carry.update(carried)
            return
        if self._kept_at[0] != step:
            self._kept_at = (step, [])
        self._kept_at[1].append((point, carried))

    def _skip(self, step: int) -> None:
        """`step` is skipped (a group's average is not finite on every rank, so the optimizer
        skips it whole): put back what its groups that finished already kept, and what was
        carried into them; those that finish later keep nothing (SyncState._sync_group).
        Under the lock."""
        if self._skipped_at == step:
            return
        self._skipped_at = step
        kept_at, kept = self._kept_at
        if kept_at == step:
            for point, carried in reversed(kept):
                if point is not None:
                    point.undo()
                self._carry.update(carried)
        self._kept_at = (step, [])

    def _strategy(self, group: int, numel: int, step: int, compress: bool) -> Strategy:
        """What runs for `group` this step: uncompressed in warm-up, else the plan's strategy or
        the config's compressor (uncompressed below min_compress_numel)."""
        if not compress or step < self.config.warmup_steps:
            return self._uncompressed
        if self.plan is not None:
            return self._strategies[group]
        if self.config.compressor == NO_COMPRESSION:
            return self._uncompressed
        if numel < self.config.min_compress_numel:
            self._largest_small = max(self._largest_small, numel)
            return self._uncompressed
        return self._compressor

    @property
    def _uncompressed(self) -> Strategy:
        scheme = self.config.sparse_scheme
        return Strategy(scheme=None if scheme == "dense" else scheme)

    @property
    def _compressor(self) -> Strategy:
        """config.compressor as a strategy: its default collective; a sparsifier's payload by the
        sparse scheme where one is forced (sparse_scheme "auto" allgathers it: one collective,
        overlapped, decoded in rank order)."""
        name, scheme = self.config.compressor, self.config.sparse_scheme
        rows = lookup(name).sparse_rows and scheme != "auto"
        args = tuple(sorted(self.config.compressor_args.items()))
        return Strategy(name, args, default_collective(name), scheme if rows else None)

    def _tables(self, params: Sequence[int] | None, numel: int, strategy: Strategy) -> list[Table]:
        """The embedding tables in an uncompressed group, where its strategy sends rows."""
        if strategy.scheme is None or params is None or not self._embeddings.intersection(params):
            return []
        tables, offset = [], 0
        for param in params:
            shape = self._param_shapes[param]
            if param in self._embeddings:
                tables.append(Table(f"param {param}", offset, shape[0], shape.numel() // max(shape[0], 1)))
            offset += shape.numel()
        return tables if offset == numel else []

    def _carry_memories(self, points: Mapping[int, CompressionPoint]) -> None:
        """What `points` (of the plan in self.layout) hold back, into self._carry per parameter."""
        if not points:  # nothing held (and maybe no process group bound yet)
            return
        comm = self._comm()
        self._follow_carry(self.step)  # what waits already, in this step's units
        for group, point in points.items():
            self._follow_learning_rate(point, self.step)  # carried into this step's gradients
            self._follow_loss_scale(point, self.step)
            self._carry_at = (point.loss_scale, point.rates)
            memory = point.hand_over(comm.rank, comm.world_size)  # dropped: none runs again
            if memory is None:
                continue
            params = self.layout[group]
            sizes = [self._param_shapes[p].numel() for p in params]
            for param, part in zip(params, memory.view(-1).split(sizes), strict=True):
                held = self._carry.get(param)
                self._carry[param] = part if held is None else held.add_(part)

    def _add_carried(
        self, x: torch.Tensor, params: Sequence[int] | None, step: int
    ) -> dict[int, torch.Tensor]:
        """x += what is carried for its parameters (in buffer order), which is then used up;
        returned, for a step found non-finite to put back (the average is NaN: it would be lost)."""
        taken: dict[int, torch.Tensor] = {}
        if not self._carry or params is None:
            return taken
        self._follow_carry(step)
        flat, offset = x.view(-1), 0
        for param in params:
            numel = self._param_shapes[param].numel()
            held = self._carry.pop(param, None)
            if held is not None:
                flat[offset : offset + numel].add_(held.view(-1).to(x.dtype))
                taken[param] = held
            offset += numel
        return taken

    def _keep_carried(self, carried: dict[int, torch.Tensor], average: torch.Tensor) -> None:
        """Where the step's `average` is not finite (the same on every rank: alike everywhere),
        the optimizer skips it, and what was `carried` into it goes into the next step instead."""
        if carried and not is_finite(average):
            self._carry.update(carried)

    def _record(
        self,
        result: exchange.Exchanged,
        out: torch.Tensor,
        group: int,
        step: int,
        strategy: Strategy,
        point: CompressionPoint | None,
        started: float,
        shown: bool = True,
        reference_nbytes: int | None = None,
    ) -> torch.Tensor:
        """Trace one group's exchange and, where `shown`, keep it for stats()["groups"]; returns
        `out`. `reference_nbytes`: what the uncompressed collective would send (default: an fp32
        allreduce of `out`)."""
        numel, n = out.numel(), self._comm().world_size
        if reference_nbytes is None:
            reference_nbytes = allreduce_sent_nbytes(4 * numel, n)
        codec = NO_COMPRESSION if point is None else _registry_name(compress.REGISTRY, point.codec)
        seconds = result.seconds
        communicate_s = seconds.get("communicate", time.perf_counter() - started)
        self.trace.record(
            GroupRecord(step, group, numel, codec, result.collective, result.scheme, result.payload_nbytes,
                        result.sent_nbytes, reference_nbytes, seconds.get("compress", 0.0),
                        communicate_s, seconds.get("decompress", 0.0))
        )  # fmt: skip
        if not shown:
            return out
        self._executed[group] = {
            "group": group,
            "step": step,
            "strategy": strategy.text,
            "codec": codec,
            "collective": result.collective,
            "scheme": result.scheme,
            "feedback": "none" if point is None else _registry_name(feedback.REGISTRY, point.feedback),
            "numel": numel,
            "tensors": len(self.layout.get(group, ())) or None,
            "sent_nbytes": result.sent_nbytes,
            "payload_nbytes": result.payload_nbytes,
        }
        return out

    # -- helpers ---------------------------------------------------------------------------------

    def _bind(self, comm: Comm) -> None:
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        # A checkpoint entry's key: the rank in the default group, unique in the job also where
        # `comm` is a sub-group (data parallelism beside tensor or pipeline parallelism).
        self._key_rank = dist.get_rank() if isinstance(comm, TorchComm) else comm.rank

    def _comm(self) -> Comm:
        if self.comm is None and getattr(self, "_binds_default_group", False):
            if not dist.is_initialized():
                raise RuntimeError(
                    "this SyncState averages over the default process group, which does not exist yet; "
                    "call torch.distributed.init_process_group first (a framework does so before training)"
                )
            self._bind(TorchComm(None))
        if self.comm is None:
            raise RuntimeError(
                "this SyncState was unpickled and has no process group; call "
                "gradsync.register(ddp_model, config) and load_state_dict(old_state.state_dict())"
            )
        return self.comm

    def _begin(self, is_last: bool, device: torch.device) -> int:
        """The step this group belongs to; counts the step once its last group arrives."""
        if not self._ranks_agree:
            self._check_ranks_agree(device)
        step = self.step
        if is_last:
            self.step += 1
        self._say_if_nothing_compressed(step)
        return step

    def _end_unannounced_step(self) -> None:
        """Count DDP's first iteration where nothing said it ended (see _first_arrivals): the
        hook calls this as a parameter arrives again, and a read between steps (stats, a
        checkpoint) before that."""
        if self._first_arrivals and self._local_steps == 0:
            self._first_arrivals = set()
            self._local_steps = 1
            self.step += 1

    def _note_compressing(self, step: int, first: str, strategy: Strategy) -> None:
        """Log, once, the step compression begins at and what is compressed first."""
        if not self._compressing:
            self._compressing = True
            if not self.says_compressing:
                return
            log.info(
                "gradsync: compressing from step %d on, %s first: %s by %s",
                *(step, first, strategy.text, strategy.collective),
            )

    def _say_if_nothing_compressed(self, step: int, numel: int = 0) -> None:
        """Warn once, as the step after the first one allowed to compress begins, where every group
        of that step stayed below min_compress_numel: the one line on a small model compresses
        nothing, and its user must hear why rather than find it in stats().

        `numel`: the calling group's size, where groups keep counts of their own (FSDP's modules,
        whose steps are their own calls). A group at or above min_compress_numel that runs less
        often than the others has not reached warmup_steps when they have, and compresses once it
        does: once met, nothing is said."""
        self._largest_met = max(self._largest_met, numel)
        if (
            step == self.config.warmup_steps + 1
            and self._largest_small > 0
            and self._largest_met < self.config.min_compress_numel
            and not self._compressing
            and not self._said_nothing_compressed
            and self.says_nothing_compressed
        ):
            fix = "lower SyncConfig(min_compress_numel=...) to compress smaller ones"
            warn_nothing_compressed("gradsync", self.group_noun, self._largest_small, self.config, fix)
            self._said_nothing_compressed = True

    @contextlib.contextmanager
    def _failures_named(self, where: str, outcome: str = "") -> Iterator[None]:
        """A CollectiveError raised inside, with `where` (which bucket or group, which step, or
        which call) and what to do added; `outcome`: what the failure left undone, where not a
        step's gradients."""
        try:
            yield
        except CollectiveError as error:
            raise self._failure(error, where, outcome) from None

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

    def _failure(self, error: CollectiveError, where: str, outcome: str = "") -> CollectiveError:
        if str(error).startswith("gradsync: "):
            return error  # named already (an inner exchange of this step)
        timeout = getattr(self.comm, "timeout", None)
        waited = f", here {timeout}" if timeout is not None else ""
        outcome = outcome or "this step's gradients were not averaged and must not be applied"
        return CollectiveError(
            f"gradsync: {where}: {error}\nA peer rank died, or stalled past the process group's timeout "
            f"(init_process_group(timeout=...){waited}). {outcome[0].upper()}{outcome[1:]}: stop every "
            "rank and resume from the last checkpoint (torchrun --max-restarts restarts them)."
        )

    def _point(
        self, group: int, x: torch.Tensor, step: int, params: Sequence[int] | None = None
    ) -> CompressionPoint:
        point = self.points.get(group)
        if point is None:
            point = self.points[group] = self._new_point(group, x.numel(), params, self._strategies)
            self._set_warmup(point, step)  # a codec made mid-run (a new plan) is as far along
        elif point.numel != x.numel():
            raise ValueError(
                f"gradsync group {group} has {x.numel()} elements but its state was made for "
                f"{point.numel}: the layout changed (another model, bucket_cap_mb or a checkpoint from "
                "another run); register gradsync afresh for this layout"
            )
        return point

    def _watch(self, params: Sequence[nn.Parameter]) -> None:
        """A DDP bucket's parameters, for a state made without the model (register_comm_hook, as
        Lightning's ddp_comm_state): their learning rate is followed as register()'s is."""
        if not self.follows_learning_rate:
            return
        if self._learning_rate is None:
            self._learning_rate = LearningRate(params)
        else:
            self._learning_rate.watch(params)

    def _check_momentum(self, momentum: float) -> None:
        """Momentum correction hands SGD D - beta * D_prev, which its buffer turns back into D only
        where SGD's momentum is beta, without dampening or Nesterov: say where it is not, or where
        another optimizer (Adam) steps the model (it would step silently by another rule)."""
        assert self._learning_rate is not None
        if momentum == 0:  # residual feedback, whatever the optimizer does with the average
            return
        wanted = (momentum, 0.0, False)
        found = self._learning_rate.sgd_momenta() - {wanted}
        other = self._learning_rate.other_optimizer  # Adam's moments do not undo it either
        if found or other is not None:
            shown = ", ".join(
                [f"SGD(momentum={m}, dampening={d}, nesterov={n})" for m, d, n in sorted(found)]
                + ([other] if other is not None else [])
            )
            log.warning(
                "gradsync: error_feedback='momentum' corrects for SGD(momentum=%s, dampening=0, "
                "nesterov=False), but the model is stepped by %s: the update is not the one momentum "
                "SGD would apply; pass error_feedback_args={'momentum': <your optimizer's>}, or use "
                "error_feedback='ef'",
                *(momentum, shown),
            )

    def _follow_learning_rate(self, point: CompressionPoint, step: int) -> None:
        """Where the learning rate changed since the point's memories were last used, scale them
        by old rate / new (gradsync.learning_rate), before `step` adds to them. Also on a step
        then found non-finite: the memories hold the same movement at the rate now applied."""
        if self._learning_rate is None:
            return
        if not self._momentum_checked and isinstance(point.feedback, feedback.MomentumCorrection):
            self._momentum_checked = self._learning_rate.optimizers_known
            self._check_momentum(point.feedback.momentum)
        now = self._rates_at(step)
        ratio = self._learning_rate.ratio(point.rates, now)
        if ratio != 1.0:
            point.rescale(ratio)
        point.rates = held_at(point.rates, now)

    def _follow_loss_scale(self, point: CompressionPoint, step: int) -> None:
        """Where AMP's loss scale changed since the point's memories were last used, scale them
        by new scale / old (gradsync.loss_scale), before `step` adds to them."""
        if not self._follows_scale:
            return
        now = self._scale_at(step)
        ratio = loss_scale.ratio(point.loss_scale, now)
        if ratio != 1.0:
            point.rescale_units(ratio)
        if now is not None:
            point.loss_scale = now

    def _follow_carry(self, step: int) -> None:
        """Bring what is carried to `step`'s loss scale and learning rates, as a point's memories
        are brought (the two methods above): a carry put back by a skipped step would otherwise
        enter the next step's gradients at the skipped one's scale (GradScaler halves it there)."""
        if not self._carry:
            return
        scale, rates = self._carry_at
        ratio = 1.0
        if self._follows_scale:
            now = self._scale_at(step)
            ratio *= loss_scale.ratio(scale, now)
            scale = now if now is not None else scale
        if self._learning_rate is not None:
            now_rates = self._rates_at(step)
            ratio *= self._learning_rate.ratio(rates, now_rates)
            rates = held_at(rates, now_rates)
        if ratio != 1.0:
            for held in self._carry.values():
                held.mul_(ratio)
        self._carry_at = (scale, rates)

    def _scale_at(self, step: int) -> float | None:
        if self._scale[0] != step:  # read once a step (from the device, on a GPU)
            self._scale = (step, loss_scale.now())
        return self._scale[1]

    def _rates_at(self, step: int) -> Rates | None:
        assert self._learning_rate is not None
        if self._rates[0] != step:  # read once a step (a tensor rate is read from its device)
            self._rates = (step, self._learning_rate.now())
        return self._rates[1]

    def _set_warmup(self, point: CompressionPoint, step: int) -> None:
        """Where the point's codec warms up (Compressor.warms_up), put it where training stands at
        `step` (_compressed_before)."""
        if type(point.codec).warms_up:
            point.codec.steps = self._compressed_before(step)

    def _compressed_before(self, step: int) -> int:
        """Steps compressed before `step`: where a codec made at `step` stands in its warm-up
        (Compressor.warms_up), so that the warm-up follows training, not the codec's age."""
        return max(0, step - self.config.warmup_steps)

    def _new_point(
        self,
        group: int,
        numel: int,
        params: Sequence[int] | None,
        strategies: Sequence[Strategy],
    ) -> CompressionPoint:
        """A fresh point: the strategy's codec for a plan group (`strategies`: the plan's), or
        config.compressor for a bucket (`strategies` empty: no plan); told the shapes of the
        group's parameters where known and the codec uses them."""
        if not strategies:
            name, args = self.config.compressor, dict(self.config.compressor_args)
        else:
            strategy = strategies[group]
            name, args = strategy.codec, dict(strategy.args)
        rank = self._comm().rank if lookup(name).randomness == "local" else 0
        codec = build_codec(name, args, seed=_derive_seed(self.config.seed, group, rank))
        shapes = [self._param_shapes[param] for param in params or ()] if self._param_shapes else []
        shaped = type(codec).uses_shapes and bool(shapes) and sum(s.numel() for s in shapes) == numel
        if shaped:
            codec.use_shapes(shapes)  # PowerSGD: each weight as its own matrix
        kept = tuple(params) if shaped and params is not None else None  # shapes come from params
        return CompressionPoint(numel, codec, self.config.build_feedback(name), kept)

    def _check_ranks_agree(self, device: torch.device, comms: Sequence[Comm] = ()) -> None:
        """Fail on every rank, with the same message, when ranks were configured differently.

        Runs on the first call (at registration for FSDP), before any gradient is exchanged, so
        that differing settings (warm-up length, compressor) can never make ranks issue different
        collectives and hang. `comms` (default: the state's): groups compared in turn, each
        passing on every config the ones before gathered, so that where each group meets the next
        at every rank (the dimensions of a mesh), every rank of them all ends with every config.
        """
        seen = {_global_rank(self._comm()): self.config.fingerprint()}
        check = "the check that every rank has the same SyncConfig"
        with self._failures_named(check, "nothing was exchanged"):
            for comm in comms or (self._comm(),):
                for part in allgather_object(comm, seen, device):
                    seen.update(part)
        if len(set(seen.values())) > 1:  # and checked again on the next call: nothing may be exchanged
            raise ValueError(
                "gradsync: the ranks were given different SyncConfigs, so their gradients cannot be "
                f"exchanged:\n{describe_differences(seen)}\nPass the same SyncConfig on every rank."
            )
        self._ranks_agree = True

    def _own_state(self) -> dict[str, Any]:
        """This rank's state, unpacked (checkpoint.KEYS)."""
        self._end_unannounced_step()
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "step": self.step,
            "config": self.config.to_dict(),
            "model": self._shapes_digest,  # the parameters' shapes, hashed: None without a model
            "points": {index: point.state_dict() for index, point in self.points.items()},
            "layout": {index: list(params) for index, params in self.layout.items()},
            "sparse": self.sparse.state_dict(),
        }

    def _shared_digest(self, state: Mapping[str, Any]) -> str | None:
        """A digest of what every rank of one run holds alike in its part of a checkpoint, beyond
        the step (plan="auto"'s plans and their order), which load_state_dict compares: None here."""
        return None

    def _state_problems(self, state: Mapping[str, Any]) -> list[str]:
        """What is wrong with this rank's own part of a checkpoint, each with what to do."""
        comm = self._comm()
        return checkpoint.problems(state, comm.world_size, self.config.to_dict(), self._shapes_digest)

    def _prepare_restore(
        self, state: Mapping[str, Any], strategies: Sequence[Strategy] | None = None
    ) -> Callable[[], None]:
        """Restoring `state` in two halves: everything it builds is built here, where a damaged
        entry (a codec refusing its saved state) raises before anything is assigned, inside
        load_state_dict's check that every rank runs; the function returned assigns what was
        built and cannot fail, so that every rank restores or none does. `strategies`: the plan
        the saved points belong to (see _new_point), where not the plan in use."""
        strategies = self._strategies if strategies is None else strategies
        points = {}
        for index, saved in state["points"].items():
            # Checkpoints before shaped codecs name no params: their codecs saw flat groups.
            params = saved.get("params")
            kept = None if params is None else tuple(params)
            point = self._new_point(int(index), saved["numel"], kept, strategies)
            point.codec.load_state_dict(saved["codec"])
            point.feedback.load_state_dict(saved["feedback"])
            point.shard_error = saved.get("shard_error")  # absent from checkpoints before two-shot
            rates = saved.get("rates")  # absent from checkpoints before memories followed the rate
            point.rates = None if rates is None else tuple(rates)
            point.loss_scale = saved.get("loss_scale")  # ... or the loss scale
            points[int(index)] = point
        layout = {int(index): tuple(params) for index, params in state["layout"].items()}
        choices = Router.saved_choices(state["sparse"])
        step = state["step"]

        def assign() -> None:
            self.step, self.points, self.layout = step, points, layout
            self._kept_at, self._skipped_at = (-1, []), -1  # a step met again is not skipped
            self.sparse.selector.choices = choices
            self._layout_checked = set()
            self._regroup = None
            log.info(
                "gradsync: restored on rank %d at step %d: %d compression point(s), %d group(s) as saved",
                *(self.rank, self.step, len(self.points), len(self.layout)),
            )

        return assign


def _key(planned: bool, group: int) -> str:
    """The sparse router's name for a group's payload: its scheme choices follow it."""
    return f"group {group}" if planned else f"bucket {group}"


def averaged(model: nn.Module) -> set[int]:
    """The positions (in model.parameters()) of the parameters DDP averages, by DDP's own rule
    (DistributedDataParallel._build_params_for_reducer): each module's own trainable parameters
    but for those DDP was told to ignore, named "<module>.<parameter>" in its module (so a root
    module's own are never ignored), as frameworks set for expert-parallel parameters."""
    ignored = getattr(model, "parameters_to_ignore", None) or set()
    inner = getattr(model, "module", model) if isinstance(model, DistributedDataParallel) else model
    position = {id(p): i for i, p in enumerate(model.parameters())}
    return {
        position[id(p)]
        for module_name, module in inner.named_modules()
        for name, p in module.named_parameters(recurse=False)
        if p.requires_grad and f"{module_name}.{name}" not in ignored and id(p) in position
    }


def _reducer_params(model: nn.Module) -> int:
    """How many parameters DDP's buckets hold: the count DDP logged when it was built (what was
    trainable then: a parameter frozen since still arrives), else DDP's rule applied now."""
    if isinstance(model, DistributedDataParallel):
        count = model._get_ddp_logging_data().get("num_parameter_tensors")
        if isinstance(count, int) and count > 0:
            return count
    return len(averaged(model))


def _embedding_params(model: nn.Module) -> set[int]:
    """Positions in model.parameters() of embedding tables with dense gradients: the tensors whose
    rows a step may leave untouched, which the sparse schemes can send as rows."""
    tables = {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and not module.sparse
    }
    return {index for index, p in enumerate(model.parameters()) if id(p) in tables}


def collective_device(comm: Comm, model_device: torch.device | None = None) -> torch.device:
    """Where small collectives (checks, checkpoints) over `comm` run: the model's device. Under
    NCCL, the model's GPU where known: a script that hands DDP device_ids=[local_rank] without
    torch.cuda.set_device has every rank's current device at cuda:0."""
    if on_nccl(comm):
        if model_device is not None and model_device.type == "cuda":
            return model_device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _registry_name(table: dict[str, type], obj: object) -> str:
    """The name `obj`'s class is registered under in `table`."""
    return next(name for name, cls in table.items() if type(obj) is cls)


def describe_differences(fingerprints: Sequence[str] | Mapping[int, str]) -> str:
    """Ranks grouped by config (`fingerprints` in rank order, or by rank); each group names the
    fields where it differs from the most common."""
    by_rank = fingerprints if isinstance(fingerprints, Mapping) else dict(enumerate(fingerprints))
    groups: dict[str, list[int]] = {}
    for rank in sorted(by_rank):
        groups.setdefault(by_rank[rank], []).append(rank)
    common = max(groups, key=lambda f: len(groups[f]))  # first seen wins a tie
    reference = json.loads(common)
    lines = []
    for fingerprint, ranks in groups.items():
        config = json.loads(fingerprint)
        differing = ", ".join(f"{k}={v!r}" for k, v in config.items() if reference.get(k) != v)
        lines.append(f"  ranks {ranks}: {differing or 'the most common config'}   (full: {fingerprint})")
    return "\n".join(lines)


def _global_rank(comm: Comm) -> int:
    """This process's rank in the default group, which names it in every group; the comm's own
    rank in a world without one (LocalComm)."""
    return dist.get_rank() if dist.is_initialized() else comm.rank


def warn_nothing_compressed(who: str, noun: str, largest: int, config: SyncConfig, fix: str) -> None:
    """The one warning, worded alike wherever it is given, that every group of a run (its largest
    `noun` of `largest` elements) stays below config.min_compress_numel."""
    log.warning(
        "%s: nothing is compressed: the largest %s, %d elements, is below min_compress_numel=%d "
        "(where compressing costs more than it saves); %s",
        *(who, noun, largest, config.min_compress_numel, fix),
    )


def _derive_seed(root: int, group: int, rank: int) -> int:
    """Independent-looking seeds per (root, group, rank), the same on every run."""
    mixed = (root * 1_000_003 + group) * 1_000_003 + rank
    return (mixed * 0x9E3779B97F4A7C15) % (2**63 - 1)
