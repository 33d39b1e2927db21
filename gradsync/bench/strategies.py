"""The gradient exchanges a training benchmark compares, and how each is installed on a DDP model.

A strategy is named on the command line as `name[:key=value:key=value...]`:

- `ddp`: DDP with no hook (fp32 allreduce), the reference;
- `torch-fp16`: PyTorch's own `fp16_compress_hook`;
- `torch-powersgd`: PyTorch's own PowerSGD hook (options `rank`, `min_rate` and `warmup`, its
  start_powerSGD_iter: by default gradsync's default warm-up, so the two start at the same step);
- any gradsync compressor (`gradsync list`), e.g. `topk:ratio=0.001`: gradsync's hook with that
  compressor. Options are the compressor's arguments plus `ef` (error-feedback form), `warmup`
  and `sparse` (the sparse scheme, SyncConfig.sparse_scheme: `identity:sparse=balanced` sends
  dense buckets as they are and an embedding's sparse gradient by Zen's balanced scheme).
  Each takes the compressor's own defaults: what a user gets who names it (`int4`, gradsync's
  default, is SyncConfig()).
- `diloco[:key=value...]`: no DDP: gradsync.DiLoCo on the plain model and the workload's own
  optimizer. Keys: DiLoCo's sync_every (default 100), outer_lr, outer_momentum, fragments, delay
  and alpha; compressor (of the outer gradient, default none) and ef; any other key is the
  compressor's argument. Evaluated on the global parameters.
- `fsdp[:compressor=NAME:key=value...]`: no DDP: the model sharded by FSDP2 (fully_shard on
  every block, then on the whole); plain `fsdp` is FSDP's own fp32 reduce-scatter (a reference
  where `ddp` is not run), with a compressor gradsync is its reduce-scatter (gradsync.fsdp; `ef`
  and `warmup` as for gradsync). Evaluated on an unsharded copy of the parameters.
- `torchft-diloco[:sync_every=H:outer_lr=L:outer_momentum=M]`: torchft's own DiLoCo (`pip install
  torchft`) on the plain model, fp32 outer gradients, a baseline for gradsync's
  (bench/torchft_diloco.py). Evaluated on its global parameters.
- `auto[:compressor=NAME:key=value...]`: gradsync with SyncConfig(plan="auto"): it measures the
  first steps, plans per group among fp32, fp16, bf16 and the levels of NAME (default
  SyncConfig's) within the error of NAME with its arguments everywhere (gradsync.levels),
  confirms the best candidates on real steps and adopts the fastest measured.

Example:
    >>> parse("topk:ratio=0.001").config.compressor_args["ratio"]
    0.001
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import compress, registry, tuner
from ..api import register
from ..config import AUTO_PLAN, NO_COMPRESSION, SyncConfig
from ..diloco import DEFAULTS as DILOCO_DEFAULTS
from ..diloco import DiLoCo, check_options
from ..exchange import allreduce_sent_nbytes
from ..strategy import shards
from .torchft_diloco import OPTIONS as TORCHFT_OPTIONS
from .torchft_diloco import TorchftDiLoCo

BASELINES = ("ddp", "torch-fp16", "torch-powersgd")
DILOCO = "diloco"
FSDP = "fsdp"
TORCHFT = "torchft-diloco"
_DILOCO_OPTIONS = {
    "sync_every": 50,
    "outer_lr": 0.7,
    "outer_momentum": 0.9,
    "fragments": 1,
    "delay": 0,
    "alpha": 0.0,
}
WARMUP_STEPS = SyncConfig().warmup_steps
# torch's own defaults but for the start (torch's is step 1,000), which is gradsync's.
_POWERSGD_OPTIONS = {"rank": 1, "min_rate": 2.0, "warmup": WARMUP_STEPS}


@dataclass(frozen=True)
class Strategy:
    """One way to exchange gradients: a baseline, or gradsync with a SyncConfig."""

    text: str  # as given, e.g. "topk:ratio=0.001"
    kind: str  # "ddp", "torch-fp16", "torch-powersgd", "gradsync", "diloco", "torchft-diloco" or "fsdp"
    options: dict[str, Any]
    config: SyncConfig | None = None  # gradsync, diloco (how the outer gradient is sent), fsdp with a codec

    @property
    def wraps_in_ddp(self) -> bool:
        """Whether the model is trained under DDP: all but DiLoCo's (the plain model) and FSDP2."""
        return self.kind not in (DILOCO, TORCHFT, FSDP)

    @property
    def is_reference(self) -> bool:
        """Whether time to accuracy can be measured against this run: DDP's, or FSDP2's own
        reduce-scatter where no DDP run was made (DDP first where both were)."""
        return self.kind == "ddp" or (self.kind == FSDP and self.config is None)

    @property
    def ddp_options(self) -> dict[str, Any]:
        """DistributedDataParallel arguments this strategy needs besides the common ones.

        torch's PowerSGD hook launches its second allreduce from the first one's completion
        callback, so with several buckets on gloo two ranks can issue them in different orders
        and hang (seen here with 4 buckets on 4 ranks). One bucket leaves nothing to interleave.
        """
        return {"bucket_cap_mb": 1 << 16} if self.kind == "torch-powersgd" else {}

    @property
    def warmup_steps(self) -> int:
        """Steps before this strategy compresses: gradsync's warm-up (plan="auto" measures and
        confirms in it), PowerSGD's start step."""
        if self.kind == TORCHFT:
            return 0
        if self.kind == "torch-powersgd":
            return self.options["warmup"]
        if self.config is None:
            return WARMUP_STEPS
        if self.kind == DILOCO:
            return 0
        if self.config.plan == AUTO_PLAN:
            return tuner.warmup_steps(self.config)
        return self.config.warmup_steps

    @property
    def label(self) -> str:
        """A short human name for tables and plots."""
        if self.kind == "ddp":
            return "DDP fp32 (no hook)"
        if self.kind == "torch-fp16":
            return "torch fp16 hook"
        if self.kind == "torch-powersgd":
            return f"torch PowerSGD rank {self.options['rank']}"
        if self.kind == FSDP and self.config is None:
            return "FSDP2 fp32 (no hook)"
        if self.kind == TORCHFT:
            o = self.options
            name = "Local SGD" if (o["outer_lr"], o["outer_momentum"]) == (1.0, 0.0) else "DiLoCo"
            return f"torchft {name} H={o['sync_every']} (fp32)"
        assert self.config is not None
        if self.kind == FSDP:
            feedback = self.config.feedback_name
            name = f"gradsync FSDP2 {self.config.compressor}"
            return name + ("" if feedback == "none" else f" + {feedback}")
        args = ", ".join(f"{k}={v}" for k, v in self.config.compressor_args.items())
        if self.kind == DILOCO:
            o = self.options
            name = "Local SGD" if (o["outer_lr"], o["outer_momentum"]) == (1.0, 0.0) else "DiLoCo"
            streaming = f", {o['fragments']} fragments, delay {o['delay']}" if o["fragments"] > 1 else ""
            codec = "fp32" if self.config.compressor == NO_COMPRESSION else self.config.compressor
            return f"gradsync {name} H={o['sync_every']}{streaming} ({codec}" + (f" {args})" if args else ")")
        if self.config.plan == AUTO_PLAN:
            return f"gradsync plan=auto ({self.config.compressor}" + (f" {args})" if args else ")")
        feedback = self.config.feedback_name
        scheme = self.config.sparse_scheme
        if self.config.compressor == NO_COMPRESSION:
            return f"gradsync, no compression, sparse {scheme}"
        return (
            f"gradsync {self.config.compressor}"
            + (f" ({args})" if args else "")
            + (f" + {feedback}" if feedback != "none" else "")
            + (f", sparse {scheme}" if scheme != "auto" else "")
        )


def parse(text: str) -> Strategy:
    """The Strategy named by `text`; ValueError naming the problem and the valid choices."""
    name, options = registry.parse_spec(text, "strategy")
    if name == "ddp" or name == "torch-fp16":
        if options:
            raise ValueError(f"strategy {text!r}: {name} takes no options, got {sorted(options)}")
        return Strategy(text, name, {})
    if name == "torch-powersgd":
        unknown = set(options) - set(_POWERSGD_OPTIONS)
        if unknown:
            raise ValueError(
                f"strategy {text!r}: unknown option(s) {sorted(unknown)}; torch-powersgd takes "
                f"{sorted(_POWERSGD_OPTIONS)}, e.g. torch-powersgd:rank=4"
            )
        merged = {**_POWERSGD_OPTIONS, **options}
        if not isinstance(merged["rank"], int) or merged["rank"] < 1:
            raise ValueError(f"strategy {text!r}: rank={merged['rank']!r} must be an integer >= 1")
        if not isinstance(merged["warmup"], int) or merged["warmup"] < 2:
            raise ValueError(
                f"strategy {text!r}: warmup={merged['warmup']!r} must be an integer >= 2 (torch's "
                "PowerSGD starts after DDP's bucket rebuild at the earliest)"
            )
        return Strategy(text, name, merged)
    if name == DILOCO:
        return _diloco(text, options)
    if name == FSDP:
        return _fsdp(text, options)
    if name == TORCHFT:
        return _torchft(text, options)
    plan = None
    if name == AUTO_PLAN:
        plan, name = AUTO_PLAN, options.pop("compressor", SyncConfig().compressor)
    if name not in (*compress.names(), NO_COMPRESSION):
        raise ValueError(
            f"unknown strategy {name!r} in {text!r}; choose one of {', '.join(BASELINES)} or a gradsync "
            f"compressor: {', '.join(compress.names())}"
        )
    feedback = options.pop("ef", "auto")
    warmup = options.pop("warmup", WARMUP_STEPS)
    scheme = options.pop("sparse", "auto")
    try:
        config = SyncConfig(
            compressor=name,
            compressor_args=options,
            error_feedback=feedback,
            warmup_steps=warmup,
            sparse_scheme=scheme,
            plan=plan,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"strategy {text!r}: {err}") from err
    return Strategy(text, "gradsync", options, config)


def _diloco(text: str, options: dict[str, Any]) -> Strategy:
    outer = {key: options.pop(key, default) for key, default in DILOCO_DEFAULTS.items()}
    try:
        check_options(**outer)
        config = SyncConfig(
            compressor=options.pop("compressor", NO_COMPRESSION),
            error_feedback=options.pop("ef", "auto"),
            compressor_args=options,
            warmup_steps=0,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"strategy {text!r}: {err}") from err
    return Strategy(text, DILOCO, outer, config)


def _torchft(text: str, options: dict[str, Any]) -> Strategy:
    unknown = sorted(set(options) - set(TORCHFT_OPTIONS))
    if unknown:
        raise ValueError(
            f"strategy {text!r}: unknown option(s) {unknown}; it takes {sorted(TORCHFT_OPTIONS)}"
        )
    merged = {**TORCHFT_OPTIONS, **options}
    try:
        check_options(**{**DILOCO_DEFAULTS, **merged})
    except (TypeError, ValueError) as err:
        raise ValueError(f"strategy {text!r}: {err}") from err
    if importlib.util.find_spec("torchft") is None:
        raise ValueError(
            f"strategy {text!r} runs torchft's DiLoCo, and torchft is not installed: pip install torchft"
        )
    return Strategy(text, TORCHFT, merged)


def _fsdp(text: str, options: dict[str, Any]) -> Strategy:
    if not options:
        return Strategy(text, FSDP, {})
    try:
        config = SyncConfig(
            compressor=options.pop("compressor", NO_COMPRESSION),
            error_feedback=options.pop("ef", "auto"),
            warmup_steps=options.pop("warmup", WARMUP_STEPS),
            compressor_args=options,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"strategy {text!r}: {err}") from err
    if config.compressor != NO_COMPRESSION and not shards(compress.lookup(config.compressor)):
        raise ValueError(
            f"strategy {text!r}: FSDP2's reduce-scatter needs a codec whose fixed-size payload an owner "
            "can decode and sum per shard; use fp16, bf16, int8 or int4"
        )
    return Strategy(text, FSDP, {}, config)


def parse_list(text: str) -> list[Strategy]:
    """Comma-separated strategies, each once."""
    strategies = [parse(item) for item in text.split(",") if item.strip()]
    if not strategies:
        raise ValueError(f"no strategy in {text!r}; e.g. ddp,torch-fp16,torch-powersgd,topk")
    seen = [s.text for s in strategies]
    duplicates = sorted({t for t in seen if seen.count(t) > 1})
    if duplicates:
        raise ValueError(f"strategies {duplicates} are given twice in {text!r}; name each once")
    return strategies


def install(
    strategy: Strategy,
    module: nn.Module,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
) -> tuple[nn.Module, torch.optim.Optimizer, Installed]:
    """The model as `strategy` trains it (under DDP, plain for DiLoCo, sharded for FSDP2), its
    optimizer from `make_optimizer`, and the strategy installed on them."""
    model: nn.Module = module
    unsharded = None
    if strategy.wraps_in_ddp:
        # Gradients as views into DDP's buckets save two copies of every gradient per step, for
        # every strategy alike; it is DDP's own recommended setting for speed.
        model = DistributedDataParallel(module, gradient_as_bucket_view=True, **strategy.ddp_options)
    elif strategy.kind == FSDP:
        unsharded = copy.deepcopy(module)  # evaluated: each rank's forward count may differ
        model = _shard(module)
    optimizer = make_optimizer(model.parameters())
    installed = Installed(strategy, model, optimizer)
    installed.unsharded = unsharded
    return model, optimizer, installed


def _shard(module: nn.Module) -> nn.Module:
    """FSDP2 as its tutorials apply it: each block (a child, or each module of a child list) its
    own fully_shard group, then the whole model (what is left: norms, small tensors)."""
    from torch.distributed.fsdp import fully_shard

    for child in module.children():
        blocks = child.children() if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else (child,)
        for block in blocks:
            if any(p.requires_grad for p in block.parameters()):
                fully_shard(block)
    fully_shard(module)
    return module


class Installed:
    """A strategy installed on one rank's model and optimizer; counts the bytes it puts on the wire."""

    def __init__(self, strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.strategy = strategy
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.gradsync = None
        self.powersgd = None
        self.diloco: Any = None  # gradsync.DiLoCo, or torchft's (the same three methods the run asks)
        self.unsharded: nn.Module | None = None  # FSDP2: a plain copy the parameters are gathered into
        self._counted = {"sent_nbytes": 0, "seconds": 0.0}  # DiLoCo's totals as of the last step
        if strategy.kind == "torch-fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif strategy.kind == "torch-powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            self.powersgd = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=strategy.options["rank"],
                min_compression_rate=strategy.options["min_rate"],
                start_powerSGD_iter=strategy.options["warmup"],
            )
            model.register_comm_hook(self.powersgd, powerSGD_hook.powerSGD_hook)
        elif strategy.kind == "gradsync" or (strategy.kind == FSDP and strategy.config is not None):
            self.gradsync = register(model, strategy.config)
        elif strategy.kind == TORCHFT:
            self.diloco = TorchftDiLoCo(model, optimizer, strategy.options)
        elif strategy.kind == DILOCO:
            config = strategy.config
            assert config is not None
            # A process group of its own: an exchange still issuing beside inner steps (delay > 0)
            # must not interleave with the benchmark's own collectives (evaluations, barriers).
            self.diloco = DiLoCo(
                model,
                optimizer,
                process_group=dist.new_group(),
                compressor=config.compressor,
                compressor_args=config.compressor_args,
                error_feedback=config.error_feedback,
                **strategy.options,
            )
        self._powersgd_counted = 0

    def sent_nbytes(self, step: int) -> int:
        """Bytes this rank sent in `step` (ring algorithms; no TCP/IP headers). Call once per step."""
        fp32 = allreduce_sent_nbytes(4 * self.numel, self.world_size)
        if self.diloco is not None:
            return self._diloco_since_last("sent_nbytes")
        if self.gradsync is not None:
            record = self._gradsync_step(step)
            return record["sent_nbytes"] if record else 0
        if self.strategy.kind == "torch-fp16":
            return allreduce_sent_nbytes(2 * self.numel, self.world_size)
        if self.strategy.kind == FSDP:  # its reduce-scatter: the first half of a ring allreduce
            return fp32 // 2
        if self.powersgd is not None:
            # The hook counts the elements it allreduces on compressed steps (P, Q and the
            # tensors it leaves uncompressed); before its start step it allreduces plain fp32.
            counted = self.powersgd.total_numel_after_compression
            new, self._powersgd_counted = counted - self._powersgd_counted, counted
            return allreduce_sent_nbytes(4 * new, self.world_size) if new else fp32
        return fp32

    def compression_seconds(self, step: int) -> float | None:
        """gradsync's own compress + decompress time in `step`; None for hooks that do not time it."""
        if self.diloco is not None:
            return self._diloco_since_last("seconds")
        if self.gradsync is None:
            return None
        record = self._gradsync_step(step)
        return record["compress_s"] + record["decompress_s"] if record else 0.0

    def _gradsync_step(self, step: int) -> dict[str, Any] | None:
        """gradsync's sums for `step`, the step just trained (its newest), or None."""
        assert self.gradsync is not None
        newest = self.gradsync.stats()["last_step"]
        return newest if newest is not None and newest["step"] == step else None

    def _diloco_since_last(self, what: str) -> float:
        """DiLoCo's bytes sent, or compress + decompress seconds, since the last call: its syncs
        finish within inner steps (or `delay` steps later), not per DDP step."""
        assert self.diloco is not None
        total = self.diloco.stats()["total"]
        now = total["sent_nbytes"] if what == "sent_nbytes" else total["compress_s"] + total["decompress_s"]
        new, self._counted[what] = now - self._counted[what], now
        return new
