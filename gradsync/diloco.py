"""DiLoCo: sync rarely. Local SGD, DiLoCo and Streaming DiLoCo on a plain (not DDP) model.

Every rank trains its own copy with its own inner optimizer; every `sync_every` inner steps the
outer gradient (global parameters minus local ones) goes through the same path as the DDP hook's
gradients (SyncState.sync: error memory, codec, collective, decode), and an outer optimizer
(Nesterov momentum SGD, DiLoCo's defaults) steps the global parameters, which every rank loads.

Streaming DiLoCo: the parameters, flattened in order, are cut into `fragments` ranges of equal
size (a range may start or end inside a tensor, so that no fragment is larger than its share and
the peak of one sync is 1/fragments of DiLoCo's), synced at staggered inner steps; each
fragment's exchange flies while the next `delay` inner steps run, and the new global fragment is
mixed into the local one as alpha * local + (1 - alpha) * global.

    outer = gradsync.DiLoCo(model, inner_optimizer, sync_every=50)
    # the loop as usual: loss.backward(); inner_optimizer.step(); inner_optimizer.zero_grad()

The global parameters are bit-identical on every rank after every sync: every rank decodes the
same average and applies the same outer step.

(Over 500 lines: the outer loop, its fragments' schedule, its checkpoint and the checks that
every rank runs alike are one object's state; the pure pieces, cut() and check_options(), are
functions here because nothing else uses them.)
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from . import checkpoint
from .comm import Comm, LocalComm, TorchComm, allgather_object
from .compress import PAST_WARMUP
from .compress.base import check_int, check_real
from .config import NO_COMPRESSION, SyncConfig
from .sync import SyncState, collective_device, describe_differences, warn_nothing_compressed

log = logging.getLogger("gradsync")

FORMAT = 2  # state_dict's layout; 2: global parameters and outer momentum per fragment
# DiLoCo's defaults, for the tools that name its options in text (bench, simulate); the same as
# the constructor's (a test checks).
DEFAULTS = {
    "sync_every": 100,
    "outer_lr": 0.7,
    "outer_momentum": 0.9,
    "fragments": 1,
    "delay": 0,
    "alpha": 0.0,
}


class _OuterSyncState(SyncState):
    """SyncState for outer gradients: a codec that warms up (top-k's sparsity warm-up) starts past
    its warm-up. The warm-up guards the first steps' fast-changing gradients, which are the inner
    optimizer's here; counted in outer syncs (one per H steps, and per fragment) it would span most
    of a run, sending a quarter of the entries where `ratio` was asked for."""

    # The outer gradient is applied at the outer optimizer's rate, not at the inner SGD's that
    # gradsync.learning_rate would find over the same parameters.
    follows_learning_rate = False
    follows_loss_scale = False  # outer gradients are parameter differences, not scaled gradients
    says_nothing_compressed = False  # DiLoCo says it of its fragments, in its own terms

    def _compressed_before(self, step: int) -> int:
        return PAST_WARMUP

    def _where(self, group: int, step: int, compress: bool) -> str:
        # A step here is one fragment's outer sync: DiLoCo has no buckets and no step of its own.
        return f"fragment {group}'s outer gradient at outer sync {step} (of every fragment, from 0)"


@dataclass(frozen=True)
class Fragment:
    """A range of the flattened parameters, synced at inner step `step` (mod sync_every)."""

    step: int
    pieces: tuple[tuple[int, int, int], ...]  # (tensor position, first element, end element)

    @property
    def numel(self) -> int:
        return sum(end - start for _, start, end in self.pieces)


@dataclass
class _Pending:
    """A fragment's exchange in flight: its average is applied after inner step `due`."""

    due: int
    average: Future[torch.Tensor]


class DiLoCo:
    """Rare, compressed synchronisation of a plain model's parameters (see the module docstring).

    Args:
        model: the plain model every rank trains (not wrapped in DDP: DDP would average every step).
        inner_optimizer: the user's optimizer over the model's parameters; each of its step() calls
            is counted by a hook, and the `sync_every`-th one synchronises.
        sync_every: inner steps between two syncs of a fragment (DiLoCo's H).
        outer_lr, outer_momentum: the outer optimizer, SGD with Nesterov momentum (DiLoCo: 0.7 and
            0.9). outer_lr=1 and outer_momentum=0 is Local SGD: the global parameters become the
            average of the local ones.
        compressor, compressor_args, error_feedback, error_feedback_args, seed: how the outer
            gradient is sent, as in SyncConfig ("none": uncompressed allreduce).
        fragments: parameter fragments synced at staggered steps (Streaming DiLoCo); 1: DiLoCo.
        delay: inner steps a fragment's exchange may overlap before its result is applied. While
            it overlaps, issue collectives of your own (a metric's all_reduce) on another process
            group, or they may interleave with the exchange's differently on different ranks.
        alpha: weight of the local parameters when the new global ones are mixed in (0: replaced).
        process_group: the ranks to average over (default: the world; a world of one without one).

    Every rank must call inner_optimizer.step() equally often: a step one rank skips (a GradScaler
    finding inf there alone) would shift its syncs against the others'. Parameters and buffers
    (BatchNorm's statistics) are broadcast from the first rank at the start and stay each rank's
    own after: to resume, build DiLoCo first, then load the model, the inner optimizer and
    load_state_dict().
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_every: int = 100,
        *,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        compressor: str = NO_COMPRESSION,
        compressor_args: Mapping[str, Any] | None = None,
        error_feedback: str = "auto",
        error_feedback_args: Mapping[str, Any] | None = None,
        fragments: int = 1,
        delay: int = 0,
        alpha: float = 0.0,
        seed: int = 0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if isinstance(model, DistributedDataParallel):
            raise TypeError(
                "gradsync.DiLoCo takes the plain model, not a DistributedDataParallel one: DDP would "
                "average the gradients every step; pass model.module"
            )
        params = [p for p in model.parameters() if p.requires_grad]
        sizes = [p.numel() for p in params]
        comm: Comm = TorchComm(process_group) if dist.is_initialized() else LocalComm()
        # Every check runs before the ranks compare notes, and what one rank finds fails them all:
        # a rank that raised alone would leave the others waiting in the comparison's collective.
        try:
            self._check_optimizer(inner_optimizer, model)
            self.options = check_options(sync_every, outer_lr, outer_momentum, fragments, delay, alpha)
            check_int("fragments", fragments, 1, sum(sizes), why="at most one per element of the model")
            # warmup_steps=0: unlike DDP's buckets, a fragment's layout is fixed from the first sync.
            config = SyncConfig(
                compressor=compressor,
                compressor_args=compressor_args or {},
                error_feedback=error_feedback,
                error_feedback_args=error_feedback_args or {},
                warmup_steps=0,
                seed=seed,
            )
        except Exception as error:  # whatever one rank finds, every rank fails with
            self._check_ranks_agree(comm, None, params, error)
            raise
        self._check_ranks_agree(comm, config, params)
        self.sync_every, self.delay, self.alpha = sync_every, delay, float(alpha)
        self.sync_state = _OuterSyncState(config, comm, model)
        self._params = params
        self._broadcast_from_first(model, comm, process_group)
        self._fragments = cut(sizes, fragments, sync_every)
        largest = max(f.numel for f in self._fragments)
        if config.compressor != NO_COMPRESSION and largest < config.min_compress_numel:
            fix = "fewer fragments make larger ones"
            warn_nothing_compressed("gradsync DiLoCo", "fragment", largest, config, fix)
        # The global parameters, one flat tensor per fragment, in fp32 at least: a bf16 model's
        # outer gradient and momentum would lose what inner steps add. The outer optimizer steps a
        # fragment's tensor alone (the others have no gradient then).
        self._global = [self._local(f).to(_global_dtype(params, f), copy=True) for f in self._fragments]
        self._outer = torch.optim.SGD(
            self._global, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0
        )
        self.step = 0  # inner steps taken
        self.skipped = 0  # syncs skipped on every rank for a non-finite outer gradient
        self._pending: dict[int, _Pending] = {}
        self._handle = inner_optimizer.register_step_post_hook(lambda *_: self._after_inner_step())
        log.info("gradsync DiLoCo on rank %d of %d: %s, %s", comm.rank, comm.world_size, self.options, config)

    # -- the public surface -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop counting inner steps (remove the optimizer hook). Exchanges still in flight are
        awaited and applied, so global_parameters() hold every sync that was started; the
        exchanges' thread ends."""
        self._handle.remove()
        self._apply_due(until=None)
        self.sync_state.close()  # its lane's thread ends (a later sync starts one again)

    def global_parameters(self) -> list[torch.Tensor]:
        """A copy of the global parameters, the same on every rank, shaped as the model's trainable
        parameters and in their order: the model to evaluate or keep (between syncs the local
        ones differ per rank)."""
        out = [torch.empty(p.shape, dtype=_global_dtype([p], None), device=p.device) for p in self._params]
        for fragment, flat in zip(self._fragments, self._global, strict=True):
            for (i, start, end), part in zip(fragment.pieces, _split(flat, fragment), strict=True):
                out[i].view(-1)[start:end] = part
        return out

    def stats(self) -> dict[str, Any]:
        """Inner steps, syncs and skipped syncs; bytes and seconds of the outer exchanges as
        SyncState.stats() counts them (its "step" is the number of fragment syncs)."""
        return {"inner_steps": self.step, "skipped_syncs": self.skipped, **self.sync_state.stats()}

    def state_dict(self) -> dict[str, Any]:
        """What this rank's resumed run needs, besides the model and inner optimizer the user saves
        (each rank's own: local parameters differ between syncs): the global parameters, the outer
        optimizer, this rank's error memories and any exchange in flight, awaited. Save one file per
        rank (or gather them: the error memories are each rank's own)."""
        return {
            "format": FORMAT,
            "step": self.step,
            "skipped": self.skipped,
            "options": dict(self.options),
            "global": [g.clone() for g in self._global],
            "outer_optimizer": copy.deepcopy(self._outer.state_dict()),  # not the live momentum
            "pending": {
                index: {"due": p.due, "average": p.average.wait().clone()}
                for index, p in self._pending.items()
            },
            "sync": self.sync_state.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what state_dict() saved. A collective: call it on every rank. Refused on every
        rank alike where a state is of other options, another model or another step than the other
        ranks' (the error memories are checked by SyncState.load_state_dict)."""
        # Exchanges still in flight (issued without draining) may be issuing collectives from the
        # lane's thread: they complete before this rank issues its own below, or the ranks' orders
        # of collectives could differ (an in-process rollback). Their results are not applied: a
        # load replaces them with the saved state's own, a refused one leaves them pending.
        for pending in self._pending.values():
            pending.average.wait()
        try:  # a rank must not leave before the collective below, or the others wait for it
            problems = self._state_problems(state)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as error:
            problems = [f"not a gradsync DiLoCo state ({type(error).__name__}: {error}): pass state_dict()'s"]
        comm = self.sync_state._comm()
        # The global parameters have the same bits on every rank of one run: a digest that differs
        # tells files of two runs saved at the same step apart.
        shared = (state["step"], _bits_digest(state["global"])) if not problems else None
        reports = allgather_object(comm, (problems, shared), collective_device(comm, self.sync_state._device))
        found = {rank: p for rank, (p, _) in enumerate(reports) if p}
        steps = sorted({step for _, (step, _) in reports}) if not found else []
        if len(steps) > 1:
            found = {-1: [f"the ranks' states are of different inner steps {steps}: load one checkpoint"]}
        elif not found and len({digest for _, (_, digest) in reports}) > 1:
            found = {
                -1: [
                    "the ranks' states hold different global parameters (files of two runs, or ranks "
                    "whose arithmetic differs): load one run's checkpoint"
                ]
            }
        if found:
            lines = "\n".join(
                f"  {'all ranks' if r < 0 else f'rank {r}'}: {'; '.join(p)}" for r, p in found.items()
            )
            raise ValueError(f"gradsync: DiLoCo.load_state_dict refused, nothing was loaded:\n{lines}")
        self.sync_state.load_state_dict(state["sync"])
        self.step, self.skipped = state["step"], state["skipped"]
        with torch.no_grad():
            for g, saved in zip(self._global, state["global"], strict=True):
                g.copy_(saved)
        self._outer.load_state_dict(copy.deepcopy(state["outer_optimizer"]))
        self._pending = {}  # their collectives completed above
        for index, saved in state["pending"].items():
            done: Future[torch.Tensor] = Future()
            done.set_result(saved["average"].clone())
            self._pending[int(index)] = _Pending(saved["due"], done)

    # -- the outer loop ---------------------------------------------------------------------------

    def _after_inner_step(self) -> None:
        self.step += 1
        for index, fragment in enumerate(self._fragments):
            if self.step % self.sync_every == fragment.step:
                self._start(index)
        self._apply_due(until=self.step)

    def _apply_due(self, until: int | None) -> None:
        """Apply the exchanges due by inner step `until` (None: all), the earliest due first."""
        for index in sorted(self._pending, key=lambda i: (self._pending[i].due, i)):
            if until is None or self._pending[index].due <= until:
                self._apply(index, self._pending.pop(index).average.wait())

    @torch.no_grad()
    def _start(self, index: int) -> None:
        """Issue fragment `index`'s exchange: its outer gradient, global minus local, averaged."""
        outer_gradient = self._global[index] - self._local(self._fragments[index])
        # Not drained: with a delay, the exchange goes on issuing beside the next inner steps.
        future = self.sync_state.sync(outer_gradient, index, is_last=True, drain=False)
        self._pending[index] = _Pending(self.step + self.delay, future)

    @torch.no_grad()
    def _apply(self, index: int, average: torch.Tensor) -> None:
        """The outer step on fragment `index`, then the new global parameters mixed into the local
        ones. A non-finite average (every rank decodes the same one) skips the step on every rank."""
        fragment, glob = self._fragments[index], self._global[index]
        finite = bool(torch.isfinite(average).all())
        if finite:
            glob.grad = average.to(glob.device, glob.dtype)  # restored by torch.load wherever it was mapped
            self._outer.step()
            glob.grad = None
        else:
            self.skipped += 1
            log.warning(
                "gradsync DiLoCo: fragment %d's outer gradient is not finite at inner step %d: sync "
                "skipped on every rank, local parameters reset to the global ones",
                *(index, self.step),
            )
        for (i, start, end), part in zip(fragment.pieces, _split(glob, fragment), strict=True):
            param = self._params[i]
            # A strided parameter (channels_last) has no flat view: its flat copy is written back.
            flat = param.view(-1) if param.is_contiguous() else param.detach().reshape(-1)
            local = flat[start:end]
            if self.alpha == 0.0 or not finite:
                local.copy_(part)  # exactly the global parameters (a lerp could round them)
            else:
                local.lerp_(part.to(local.dtype), 1.0 - self.alpha)
            if not param.is_contiguous():
                param.copy_(flat.view(param.shape))

    def _local(self, fragment: Fragment) -> torch.Tensor:
        """The fragment's local parameters, flat (a fresh tensor)."""
        pieces = [self._params[i].detach().reshape(-1)[start:end] for i, start, end in fragment.pieces]
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()

    # -- checks -----------------------------------------------------------------------------------

    @staticmethod
    def _check_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"inner_optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        # Frozen parameters may be in it (torch steps only those with a gradient); DiLoCo syncs
        # the trainable ones.
        mine = {id(p) for p in model.parameters()}
        stray = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in mine)
        if stray:
            raise ValueError(
                f"inner_optimizer steps {stray} tensor(s) that are not parameters of the model; "
                "DiLoCo syncs the model's parameters: build the optimizer on model.parameters()"
            )

    def _check_ranks_agree(
        self,
        comm: Comm,
        config: SyncConfig | None,
        params: list[nn.Parameter],
        error: Exception | None = None,
    ) -> None:
        """Fail on every rank, with one message, when ranks were configured differently or one
        found its options invalid (`error`: this rank's, which the caller raises after this)."""
        if error is not None:
            mine = json.dumps({"invalid": f"{type(error).__name__}: {error}"})
        else:
            assert config is not None
            # Each tensor's shape and dtype, in order: a fragment's global tensor must be alike.
            dtypes = ";".join(str(p.dtype) for p in params)
            shapes = {
                "tensors": len(params),
                "shapes": checkpoint.digest([p.shape for p in params]),
                "dtypes": hashlib.sha256(dtypes.encode()).hexdigest()[:16],
            }
            mine = json.dumps({**self.options, **json.loads(config.fingerprint()), **shapes}, sort_keys=True)
        device = params[0].device if params else None
        fingerprints = allgather_object(comm, mine, collective_device(comm, device))
        if error is not None:
            return  # this rank's own error says what to fix here
        parsed = [json.loads(f) for f in fingerprints]
        invalid = {r: f["invalid"] for r, f in enumerate(parsed) if "invalid" in f}
        if invalid:
            named = "; ".join(f"rank {r}: {message}" for r, message in invalid.items())
            raise ValueError(f"gradsync: DiLoCo could not start: other ranks' options are invalid: {named}")
        if len(set(fingerprints)) > 1:
            raise ValueError(
                "gradsync: the ranks were given different DiLoCo options, so they cannot sync:\n"
                f"{describe_differences(fingerprints)}\nPass the same options on every rank."
            )

    @staticmethod
    def _broadcast_from_first(model: nn.Module, comm: Comm, group: dist.ProcessGroup | None) -> None:
        """Every rank starts from the first rank's parameters and buffers, as DDP does."""
        if comm.world_size == 1:
            return
        first = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            for t in itertools.chain(model.parameters(), model.buffers()):
                dist.broadcast(t.data, first, group=group)

    def _state_problems(self, state: Mapping[str, Any]) -> list[str]:
        if not isinstance(state, Mapping) or state.get("format") != FORMAT:
            return [f"not a gradsync DiLoCo state of format {FORMAT}: pass what DiLoCo.state_dict() returned"]
        problems = []
        missing = [
            key
            for key in ("step", "skipped", "options", "global", "outer_optimizer", "pending", "sync")
            if key not in state
        ]
        if missing:
            return [f"its keys {missing} are missing: pass what DiLoCo.state_dict() returned"]
        if state["options"] != self.options:
            problems.append(f"saved with options {state['options']}, these are {self.options}: use the same")
        shapes = [tuple(t.shape) for t in state["global"]]
        if shapes != [tuple(g.shape) for g in self._global]:
            problems.append("its global parameters are of another model: load the checkpoint of this model")
        elif not all(bool(torch.isfinite(t).all()) for t in state["global"]):
            problems.append("its global parameters are not finite: load an earlier checkpoint")
        else:
            problems += self._restorable(state)
        return problems

    def _restorable(self, state: Mapping[str, Any]) -> list[str]:
        """What would fail as load_state_dict assigns the outer optimizer's state and the exchanges
        in flight, found before any rank assigns anything (a damaged file on one rank)."""
        shapes = [tuple(g.shape) for g in self._global]
        # Loaded into an optimizer over shapeless stand-ins: torch's own checks, no memory.
        stand_ins = [torch.empty_like(g, device="meta") for g in self._global]
        try:
            torch.optim.SGD(stand_ins, lr=1.0).load_state_dict(state["outer_optimizer"])
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            return [f"its outer optimizer's state cannot be loaded ({type(error).__name__}: {error})"]
        buffers = {
            int(k): tuple(v["momentum_buffer"].shape)
            for k, v in state["outer_optimizer"]["state"].items()
            if v.get("momentum_buffer") is not None
        }
        pending = {int(k): (v["due"], tuple(v["average"].shape)) for k, v in state["pending"].items()}
        if any(shape != shapes[k] for k, shape in buffers.items()) or any(
            not isinstance(due, int) or shape != shapes[k] for k, (due, shape) in pending.items()
        ):
            return ["its outer momentum or its exchanges in flight are not shaped as the fragments: damaged"]
        return []


def check_options(
    sync_every: int, outer_lr: float, outer_momentum: float, fragments: int, delay: int, alpha: float
) -> dict[str, Any]:
    """DiLoCo's options as a dict, if valid; else ValueError naming the value, its range and why."""
    check_int("sync_every", sync_every, 1, why="inner steps between two syncs")
    check_int(
        "fragments", fragments, 1, sync_every, why="each fragment syncs at its own inner step of a round"
    )
    check_int("delay", delay, 0, sync_every - 1, why="a fragment's exchange ends before its next one starts")
    check_real(
        "alpha", alpha, 0.0, 1.0, "[)", "the local weight in the mix; 1 would never mix the global ones in"
    )
    check_real(
        "outer_lr", outer_lr, 0.0, float("inf"), "()", "DiLoCo uses 0.7; 1 with momentum 0 is Local SGD"
    )
    check_real("outer_momentum", outer_momentum, 0.0, 1.0, "[)", "DiLoCo uses 0.9")
    # The real-valued options as floats, so that ranks given outer_momentum=0 and 0.0 agree.
    return {
        "sync_every": sync_every, "outer_lr": float(outer_lr), "outer_momentum": float(outer_momentum),
        "fragments": fragments, "delay": delay, "alpha": float(alpha),
    }  # fmt: skip


def cut(sizes: Sequence[int], fragments: int, sync_every: int) -> list[Fragment]:
    """The tensors (of `sizes` elements, in order), flattened end to end, cut into `fragments`
    ranges of equal size (to one element), each with the inner step (mod `sync_every`) it syncs
    at, staggered evenly over a round: f * H // fragments. Pure: the simulator cuts the same way."""
    total = sum(sizes)
    bounds = [f * total // fragments for f in range(fragments + 1)]
    starts = list(itertools.accumulate(sizes, initial=0))  # each tensor's first flat element
    out = []
    for f in range(fragments):
        lo, hi = bounds[f], bounds[f + 1]
        pieces = tuple(
            (i, max(lo, first) - first, min(hi, first + size) - first)
            for i, (first, size) in enumerate(zip(starts, sizes, strict=False))
            if first < hi and lo < first + size
        )
        out.append(Fragment(f * sync_every // fragments, pieces))
    return out


def _split(flat: torch.Tensor, fragment: Fragment) -> tuple[torch.Tensor, ...]:
    """A fragment's flat tensor as its pieces, views."""
    return flat.split([end - start for _, start, end in fragment.pieces])


def _bits_digest(tensors: Sequence[torch.Tensor]) -> str:
    """A hash of the tensors' bits: equal only where every bit is (a sum's would depend on the
    order it adds in, which threads and devices change). Hashed a slice at a time, on the CPU."""
    hashed = hashlib.sha256()
    for t in tensors:
        flat = t.detach().reshape(-1)
        for part in flat.split(1 << 22):
            hashed.update(part.cpu().contiguous().view(torch.uint8).numpy())
    return hashed.hexdigest()


def _global_dtype(params: Sequence[torch.Tensor], fragment: Fragment | None) -> torch.dtype:
    """fp32, or wider where a parameter of the fragment (None: every one of `params`) is."""
    dtype = torch.float32
    for i in range(len(params)) if fragment is None else (i for i, _, _ in fragment.pieces):
        dtype = torch.promote_types(dtype, params[i].dtype)
    return dtype
