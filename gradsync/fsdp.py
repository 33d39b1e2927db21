"""FSDP2 (fully_shard): the gradient reduce-scatter compressed, with error feedback.

FSDP2 reduces each parameter group's gradients by one reduce-scatter of a flat buffer: every rank
holds the whole (padded) gradient of the group and ends with its own shard of the sum. gradsync
becomes that reduce-scatter (FSDPModule.set_custom_reduce_scatter): each rank adds its error
memory, encodes every shard of the gradient, and sends each owner its shard by one all_to_all; the
owner decodes the shards and sums them in rank order (two-shot's first half, exchange.reduce_scatter).
An fp32 reduce-scatter sends (n-1)/n of the gradient's 4 bytes per element; bf16 and fp16 send
half of that, int8 about a quarter, int4 about an eighth.

The error memory is as large as the group's whole gradient on every rank, since the encoding error
is made before the gradient is split into shards: memory that sharding saves elsewhere. With
error_feedback="auto", casts (fp16, bf16) keep none, as PyTorch's own low-precision reductions do,
and so does int8, whose rounding is fine enough; int4 keeps one ("ef"; the other forms keep
mirrors of the sum, which a rank holding only its shard cannot). Groups below min_compress_numel
and warm-up steps run the backend's own reduce-scatter, FSDP's result exactly.

HSDP (replicas of a sharded model): FSDP2's native HSDP (a 2-D mesh) all-reduces each shard across
replicas itself, uncompressed, with no way to replace that collective. gradsync compresses it
where the model is sharded over the shard dimension alone (fully_shard(..., mesh=mesh["shard"]))
and register() is given the replicas' group: FSDP then calls gradsync after each reduce-scatter
(FSDPModule.set_all_reduce_hook), and gradsync averages the shard across replicas by the same
path as a DDP bucket (the config's codec, error feedback on the shard), so replicas hold the same
bits. The hook waits for that exchange: it does not overlap the backward pass. FSDP's
set_requires_all_reduce(False) has no effect on it (FSDP asks that of its native HSDP only).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import exchange
from .comm import Comm, TorchComm
from .compress.base import is_finite
from .config import SyncConfig
from .strategy import Strategy
from .sync import SyncState, collective_device

try:  # FSDP2 with a custom reduce-scatter: recent torch only (the DDP path needs none of it)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - depends on the torch installed
    FSDPModule = None  # type: ignore[assignment,misc]
    ReduceScatter = object  # type: ignore[assignment,misc]

FEEDBACK = ("none", "ef")  # the forms a rank holding one shard of the sum can keep


class ShardedState(SyncState):
    """A SyncState whose groups are FSDP2's parameter groups (one per fully_shard-ed module, in
    model.modules() order), each reduced to this rank's shard. Returned by gradsync.register()
    for an FSDP2 model; its stats(), state_dict() and load_state_dict() are SyncState's."""

    group_noun = "fully_shard-ed module's gradient"

    def __init__(
        self, config: SyncConfig, comm: Comm, model: nn.Module, replicas: Comm | None = None
    ) -> None:
        super().__init__(config, comm, model)
        self._calls: dict[int, int] = {}  # group -> reduce-scatters so far: its step
        self._replica_calls: dict[int, int] = {}  # group -> replica all-reduces so far
        self._resumed_at = 0  # where a group absent from a restored state's counts starts
        # How each parameter is sharded (its shard group's size): memories laid out by one
        # sharding would be added to other elements under another of the same padded size.
        self._sharding = [_shard_size(p) for p in model.parameters()]
        # HSDP: each group's shard averaged across replicas, a DDP bucket's path over `replicas`
        # (its own stats(); its memories are checkpointed with this state's). Given the model, its
        # memories follow the learning rate of an SGD over it, as the shard's do.
        self.replica_state = _ReplicaState(config, replicas, model) if replicas is not None else None

    def reduce_scatter(
        self, x: torch.Tensor, out: torch.Tensor, group: int, comm: Comm, average: bool
    ) -> None:
        """Write this rank's shard of the sum (`average`: the mean) of `x` over the ranks into `out`."""
        _check_fp32(x, group)
        self._comm()
        step = self._calls.get(group, self._resumed_at)
        self._calls[group] = step + 1
        self.step = max(self.step, step + 1)
        self._say_if_nothing_compressed(step, x.numel())
        with self._failures_named(f"group {group} at step {step}"):
            self._reduce_scatter(x, out, group, step, comm, average)

    def _reduce_scatter(
        self, x: torch.Tensor, out: torch.Tensor, group: int, step: int, comm: Comm, average: bool
    ) -> None:
        started = time.perf_counter()
        strategy = self._strategy(group, x.numel(), step, True)
        reference = (comm.world_size - 1) * out.numel() * 4  # FSDP's own fp32 reduce-scatter
        if not strategy.compressed:
            result = exchange.reduce_scatter(None, x, out, comm, average)
            self._record(result, x, group, step, strategy, None, started, reference_nbytes=reference)
            return
        self._note_compressing(step, f"group {group}", strategy)
        point = self._point(group, x, step)
        self._follow_learning_rate(point, step)
        self._follow_loss_scale(point, step)
        guard = point.guarded
        # p is checked, not x: prepare writes spares only, and a memory added to a finite x can
        # pass the dtype's range where x did not (SyncState._sync_group checks the same).
        p = point.feedback.prepare(x, 1)
        finite = not guard or is_finite(p)
        result = exchange.reduce_scatter(point.codec, p, out, comm, average, finite, agree=guard)
        if guard and self.replica_state is not None:  # HSDP: the other replicas' shards too
            result.finite = self._replicas_agree(result.finite, x.device)
        if result.finite:
            point.feedback.update(x, p, result.local, out, result.remove_local_)  # "none", "ef": out as it is
        else:
            point.codec.undo()  # a skipped step leaves no trace in codec state either
            out.fill_(math.nan)  # on every rank (agreed): AMP's GradScaler skips the step
        self._record(result, x, group, step, strategy, point, started, reference_nbytes=reference)

    def _replicas_agree(self, finite: bool, device: torch.device) -> bool:
        """Whether this shard was finite on every replica: where one replica's was not, the replica
        all-reduce that follows makes the step NaN everywhere (and AMP skips it), so no replica
        may keep what this step put in its memories."""
        replicas = self.replica_state._comm()  # type: ignore[union-attr]
        flag = torch.tensor([float(finite)], device=device)
        return bool(replicas.allreduce(flag).wait() == replicas.world_size)

    def all_reduce_replicas(self, shard: torch.Tensor, group: int) -> None:
        """Average this rank's shard of `group`'s gradient (already reduced over the shard group)
        across replicas, in place: every replica ends with the same bits."""
        replicas = self.replica_state
        assert replicas is not None
        # Checked here too: FSDP runs no reduce-scatter of its own on a one-rank shard group.
        _check_fp32(shard, group)
        # Counted here, not from the reduce-scatter: FSDP skips that on a one-rank shard group.
        step = self._replica_calls.get(group, self._resumed_at)
        self._replica_calls[group] = step + 1
        self.step = max(self.step, step + 1)
        replicas.step = max(replicas.step, step + 1)
        # Said here where FSDP runs no reduce-scatter for the group (a one-rank shard group), so a
        # model too small to compress would otherwise go unsaid; where it does, the reduce-scatter
        # says it of the whole gradient, and a shard, 1/k of it, may stay below where it is not.
        if group not in self._calls:
            replicas._say_if_nothing_compressed(step, shard.numel())
        with replicas._failures_named(f"group {group}'s replica all-reduce at step {step}"):
            future = replicas._sync_group(shard, group, step, True, None)
            replicas.lane.drain()
            average = future.wait()
        if average is not shard:
            shard.copy_(average)

    def close(self) -> None:
        super().close()
        if self.replica_state is not None:
            self.replica_state.close()

    def _own_state(self) -> dict[str, Any]:
        own = super()._own_state()
        own["calls"], own["replica_calls"] = dict(self._calls), dict(self._replica_calls)
        own["sharding"] = list(self._sharding)
        if self.replica_state is not None:
            own["replicas"] = self.replica_state._own_state()
        return own

    def _state_problems(self, state: Any) -> list[str]:
        found = super()._state_problems(state)
        saved = state.get("sharding")  # absent from checkpoints before it was recorded
        if saved is not None and list(saved) != self._sharding:
            found.append(
                f"it was saved with the parameters sharded over groups of {_sizes(saved)} ranks, and this "
                f"run shards them over {_sizes(self._sharding)}: its error memories are laid out by "
                "shard; shard the model as the saving run did, or register afresh"
            )
        if (self.replica_state is not None) != ("replicas" in state):
            saved, now = ("no ", "") if self.replica_state is not None else ("", "no ")
            found.append(
                f"it was saved with {saved}replicate_group and this run registered with {now}"
                "replicate_group: register as the saving run did"
            )
        elif self.replica_state is not None:
            found += [
                f"its replica state: {problem}"
                for problem in self.replica_state._state_problems(state["replicas"])
            ]
        return found

    def _prepare_restore(
        self, state: Any, strategies: Sequence[Strategy] | None = None
    ) -> Callable[[], None]:
        restore = super()._prepare_restore(state, strategies)
        replicas = self.replica_state._prepare_restore(state["replicas"]) if self.replica_state else None

        # Each group's own count: a module that does not run every step is behind the others
        # (checkpoints before they were saved: every group resumes at the state's step).
        calls = {int(group): count for group, count in state.get("calls", {}).items()}
        replica_calls = {int(group): count for group, count in state.get("replica_calls", {}).items()}

        def assign() -> None:
            restore()
            self._calls, self._replica_calls, self._resumed_at = calls, replica_calls, self.step
            if replicas is not None:
                replicas()

        return assign


class _ReplicaState(SyncState):
    """HSDP's average of each shard across replicas: a DDP bucket's path, over the replicas."""

    group_noun = "shard averaged across replicas"
    # Each shard counts its own replica averages (a module may run less often): one number is not
    # one training step across groups, so a group found not finite is undone alone.
    steps_together = False


class _CompressedReduceScatter(ReduceScatter):  # type: ignore[misc,valid-type]
    """One FSDP module's reduce-scatter, run by the state as its group `group`."""

    def __init__(self, state: ShardedState, group: int) -> None:
        self.state, self.group = state, group
        self._comms: dict[int, TorchComm] = {}

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(
                f"gradsync runs FSDP's reduce-scatter with SUM or AVG, and this one asks for {op} "
                "(set_gradient_divide_factor): leave the divide factor at its default"
            )
        comm = self._comms.get(id(group))
        if comm is None:
            comm = self._comms[id(group)] = TorchComm(group)
        self.state.reduce_scatter(input_tensor, output_tensor, self.group, comm, op == dist.ReduceOp.AVG)
        return None


class _ReplicaAllReduce:
    """One FSDP module's all-reduce hook: its shard averaged across replicas as group `group`."""

    def __init__(self, state: ShardedState, group: int, module: nn.Module) -> None:
        self.state, self.group, self.module = state, group, module

    def __call__(self, shard: torch.Tensor) -> None:
        factors = _divide_factors(self.module)
        if factors:
            raise ValueError(
                f"group {self.group} has a gradient divide factor of {sorted(factors)} "
                "(set_gradient_divide_factor) and a replicate_group: FSDP divides the shard group's "
                "sum by it and gradsync then averages across replicas, which FSDP's own HSDP would "
                "not; leave the divide factor at its default, or scale the loss instead"
            )
        self.state.all_reduce_replicas(shard, self.group)


def register(
    model: nn.Module, config: SyncConfig, replicate_group: dist.ProcessGroup | None = None
) -> ShardedState:
    """Install gradsync as the gradient reduce-scatter of every fully_shard-ed module of `model`,
    and, given the replicas' group (HSDP), as the all-reduce of each shard across replicas."""
    shards = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if replicate_group is not None and any(_meshes(model)):
        raise ValueError(
            "register(..., replicate_group=...) on a model sharded over a 2-D mesh: FSDP's native HSDP "
            "already all-reduces across replicas (uncompressed); shard over the shard dimension alone, "
            'fully_shard(module, mesh=mesh["shard"]), for gradsync to compress that all-reduce, or drop '
            "replicate_group"
        )
    if replicate_group is not None:
        _check_crossing(model, replicate_group)
    replicas = TorchComm(replicate_group) if replicate_group is not None else None
    state = ShardedState(config, TorchComm(None), model, replicas)
    # Every config compared here, before training, over each dimension of the model's mesh and
    # then the replicas, each round passing on what the ones before gathered: every rank of them
    # all ends with every config (one group alone would not see a difference outside it, and
    # its ranks would go on and wait for those that raised). Not over the default group: a
    # model sharded over part of the ranks (pipeline stages, a second model) is registered by
    # that part only; not in the backward pass: other stages may wait on this one's activations.
    comms = [TorchComm(group) for group in _mesh_groups(model)] + ([replicas] if replicas else [])
    state._check_ranks_agree(collective_device(state._comm(), state._device), comms)
    if state.replica_state is not None:
        state.replica_state._ranks_agree = True  # the same config, compared above
    for index, module in enumerate(shards):
        module.set_custom_reduce_scatter(_CompressedReduceScatter(state, index))
        if replicas is not None:
            module.set_all_reduce_hook(_ReplicaAllReduce(state, index, module))
    return state


def _mesh_groups(model: nn.Module) -> list[dist.ProcessGroup]:
    """The groups of the model's mesh, one per dimension (that of its first sharded parameter)."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return [mesh.get_group(dim) for dim in range(mesh.ndim)]
    return []


def _check_fp32(x: torch.Tensor, group: int) -> None:
    if x.dtype != torch.float32:
        raise ValueError(
            f"gradsync compresses FSDP's fp32 gradient reduction, but group {group} reduces in "
            f"{x.dtype}: pass fully_shard(..., mp_policy=MixedPrecisionPolicy(..., "
            "reduce_dtype=torch.float32))"
        )


def _divide_factors(module: nn.Module) -> set[float]:
    """The gradient divide factors set on `module` (FSDPModule.set_gradient_divide_factor),
    which FSDP keeps on its parameter groups and offers no getter for."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch before 2.13: at most one group per module, under another name
        groups = [group] if (group := getattr(state, "_fsdp_param_group", None)) is not None else []
    factors = (getattr(group, "gradient_divide_factor", None) for group in groups)
    return {factor for factor in factors if factor is not None}


def _shard_size(p: torch.Tensor) -> int:
    mesh = getattr(p, "device_mesh", None)
    return mesh.size() if mesh is not None else 1


def _sizes(sharding: Sequence[int]) -> str:
    return " and ".join(str(size) for size in sorted(set(sharding)))


def _check_crossing(model: nn.Module, replicate_group: dist.ProcessGroup) -> None:
    """The replicas' group must meet each shard group at this rank alone: it then joins the
    ranks holding the same shard. Another group would average different shards together."""
    me, replicas = dist.get_rank(), set(dist.get_process_group_ranks(replicate_group))
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        shards = set(dist.get_process_group_ranks(mesh.get_group())) if mesh is not None else {me}
        if replicas & shards != {me}:
            raise ValueError(
                f"replicate_group holds ranks {sorted(replicas)} and this rank's shard group "
                f"{sorted(shards)}: "
                f"they must meet at this rank ({me}) alone, replicas being the ranks that hold the same "
                'shard; pass mesh["replicate"].get_group() of the mesh whose "shard" dimension sharded '
                "the model"
            )


def _meshes(model: nn.Module) -> list[bool]:
    """For each sharded parameter, whether its mesh has two dimensions (native HSDP)."""
    meshes = [getattr(p, "device_mesh", None) for p in model.parameters()]
    return [mesh is not None and mesh.ndim > 1 for mesh in meshes]
