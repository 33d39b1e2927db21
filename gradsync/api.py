"""register(): gradsync on a DDP model in one line.

It resolves the config's plan (a Plan, its dict, a plan file, or "auto"), checks it against the
model before any training, and installs the hook: gradsync.ddp's for a plan or none, the tuner's
for plan="auto".
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from . import compress
from .comm import TorchComm
from .compress.base import check_int
from .config import AUTO_PLAN, NO_COMPRESSION, SyncConfig, require_config
from .ddp import hook
from .plan import Plan
from .strategy import shards
from .sync import SyncState
from .tuner import AutoState, auto_hook

log = logging.getLogger("gradsync")


def register(
    model: nn.Module, config: SyncConfig | None = None, *, replicate_group: ProcessGroup | None = None
) -> SyncState:
    """Install gradsync's communication hook on a DDP model and return its state. On an FSDP2
    model (fully_shard), gradsync becomes its gradient reduce-scatter instead (gradsync.fsdp);
    `replicate_group` (FSDP2 only): the group of this rank's replicas, for HSDP, whose all-reduce
    of each shard gradsync then compresses too.

    Call it once, on every rank, before the first backward pass, with the same config.

    Example:
        >>> model = DistributedDataParallel(net)
        >>> state = gradsync.register(model, gradsync.SyncConfig(compressor="topk",
        ...                           compressor_args={"ratio": 0.01}, error_feedback="ef"))
    """
    if config is None:
        config = SyncConfig()
    require_config(config)
    if _is_sharded(model):
        return _register_sharded(model, config, replicate_group)
    if replicate_group is not None:
        raise ValueError(
            "replicate_group is for a model sharded by fully_shard (HSDP); a DDP model averages over "
            "its own process_group: drop replicate_group"
        )
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"gradsync.register expects a torch.nn.parallel.DistributedDataParallel model or one "
            f"sharded by fully_shard, got {type(model).__name__}; wrap it first: "
            "DistributedDataParallel(model)"
        )
    check_int("warmup_steps", config.warmup_steps, 2, why="DDP rebuilds its buckets after the first step")
    if getattr(model, "mixed_precision", None) is not None:
        raise ValueError(
            "DistributedDataParallel(mixed_precision=...) averages gradients by a comm hook of its own, "
            "and DDP takes one; drop mixed_precision (gradsync's fp16 or bf16 compressor sends half "
            "precision), or leave gradsync out"
        )
    # DDP's record of register_comm_hook's calls. Its reducer, not the record, says whether a hook
    # is installed: a deepcopied or unpickled DDP keeps the record but builds a fresh reducer.
    earlier = list(getattr(model, "_comm_hooks", None) or [])
    comm = TorchComm(model.process_group)
    if config.plan == AUTO_PLAN:
        _refuse_sparse_gradients(model)
        state: SyncState = AutoState(config, comm, model)
        installed = auto_hook
    else:
        if config.plan is not None:  # a bad plan fails here, before training
            plan = read_plan(config.plan)
            plan.check(model, comm.world_size)
            _check_executable(plan, model)
            config = dataclasses.replace(config, plan=plan)  # its codecs checked with the config's feedback
        state = SyncState(config, comm, model)
        installed = hook
    try:
        model.register_comm_hook(state, installed)
    except BaseException as error:
        # Nothing of gradsync stays behind on a model it could not be installed on: DDP records a
        # hook before its reducer refuses it.
        if getattr(model, "_comm_hooks", None) and model._comm_hooks[-1][1] is state:
            model._comm_hooks.pop()
        state.close()
        if isinstance(error, RuntimeError) and "can only be called once" in str(error):
            named = getattr(earlier[0][0], "__qualname__", earlier[0][0]) if earlier else "a built-in one"
            raise ValueError(
                f"this DDP model has a comm hook already ({named}: an earlier gradsync.register, or "
                "torch's or a framework's ddp_comm_hook), and DDP takes one; register gradsync once "
                "per DDP model and keep the state it returns"
            ) from error
        raise
    if earlier:  # the reducer took the hook: the record's earlier entries were of another reducer
        model._comm_hooks[:] = model._comm_hooks[len(earlier) :]
    log.info("gradsync registered on rank %d of %d: %s", comm.rank, comm.world_size, config)
    return state


def _is_sharded(model: nn.Module) -> bool:
    """Whether `model` is an FSDP2 (fully_shard) module. A sharded model means its user imported
    torch.distributed.fsdp already; looking it up in sys.modules spares every DDP user that import
    (about 0.9 s of DTensor set-up on this machine, paid by every rank at start)."""
    torch_fsdp = sys.modules.get("torch.distributed.fsdp")
    return torch_fsdp is not None and isinstance(model, getattr(torch_fsdp, "FSDPModule", ()))


def _register_sharded(
    model: nn.Module, config: SyncConfig, replicate_group: ProcessGroup | None
) -> SyncState:
    from . import fsdp  # only sharded models pay for torch.distributed.fsdp (_is_sharded)

    if fsdp.FSDPModule is None:  # FSDP2 without a custom reduce-scatter (an older torch)
        raise RuntimeError(
            f"gradsync on an FSDP2 model needs FSDPModule.set_custom_reduce_scatter, which torch "
            f"{torch.__version__} lacks: use a newer torch, or wrap the model in "
            "DistributedDataParallel instead"
        )
    if config.plan is not None:
        raise ValueError(
            f"SyncConfig(plan={config.plan!r}) on an FSDP2 model: plans group DDP's buckets, and FSDP "
            "groups gradients by fully_shard-ed module; drop plan"
        )
    codec = compress.lookup(config.compressor) if config.compressor != NO_COMPRESSION else None
    if codec is not None and not shards(codec):
        raise ValueError(
            f"SyncConfig(compressor={config.compressor!r}) on an FSDP2 model: its reduce-scatter needs "
            "fixed-size dense payloads that an owner can decode and sum per shard; use fp16, bf16, int8, "
            "int4 or another such codec (gradsync list)"
        )
    form = config.feedback_for(config.compressor)
    if form not in fsdp.FEEDBACK:
        raise ValueError(
            f"SyncConfig(error_feedback={config.error_feedback!r}) gives {form!r} on an FSDP2 model, "
            f"whose ranks each hold one shard of the sum that {form!r} would mirror whole; use one of "
            f"{fsdp.FEEDBACK}"
        )
    state = fsdp.register(model, config, replicate_group)
    log.info("gradsync registered on FSDP2, rank %d of %d: %s", state.rank, state.world_size, config)
    return state


def read_plan(value: Any) -> Plan:
    """The plan `value` names: a Plan, a plan's dict, or the path of a plan file."""
    if isinstance(value, Plan):
        plan = value
    elif isinstance(value, Mapping):
        plan = Plan.from_dict(value)
    elif isinstance(value, (str, os.PathLike)):
        plan = Plan.load(value)  # ValueError naming the file and what is wrong with it
    else:
        raise TypeError(f"plan={value!r} is a {type(value).__name__}, not a plan, its dict or a file")
    for index, group in enumerate(plan.groups):
        if "seed" in dict(group.parsed.args):
            raise ValueError(
                f"plan group {index} has strategy {group.strategy!r}, which sets seed; drop it and set "
                "SyncConfig(seed=...) instead: gradsync derives each group's seed from it so that ranks agree"
            )
    return plan


def _check_executable(plan: Plan, model: nn.Module) -> None:
    """Refuse, before training, what the hook cannot execute yet, naming the group and the fix."""
    params = list(model.parameters())
    sparse_grads = _sparse_gradient_params(model)
    for index, (group, strategy) in enumerate(zip(plan.groups, plan.strategies, strict=True)):
        where = f"plan group {index} (strategy {group.strategy!r})"
        if strategy.collective == "two-level":
            raise ValueError(
                f"{where}: collective=two-level needs intra- and inter-node process groups, which "
                "gradsync's hook does not build yet; use collective=allreduce (summable codecs) or "
                "collective=allgather, or make the plan afresh"
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
                "which a plan's groups cannot hold yet; use sparse=False and strategy none:scheme=auto "
                "for the embedding, or run without a plan"
            )


def _refuse_sparse_gradients(model: nn.Module) -> None:
    sparse = sorted(_sparse_gradient_params(model))
    if sparse:
        raise ValueError(
            f"SyncConfig(plan='auto'): parameters {sparse} have sparse (COO) gradients "
            "(nn.Embedding(sparse=True)), which a plan's groups cannot hold; use sparse=False (the "
            "planner then weighs sending the embedding's rows by gradsync.sparse), or no plan"
        )


def _sparse_gradient_params(model: nn.Module) -> set[int]:
    """Positions in model.parameters() of the parameters whose gradients are sparse COO tensors."""
    sparse = {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
    }
    return {index for index, p in enumerate(model.parameters()) if id(p) in sparse}
