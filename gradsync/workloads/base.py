"""The Workload contract the benchmark runner trains against, and the pieces the workloads share."""

from __future__ import annotations

import abc
import functools
import hashlib
from collections.abc import Callable, Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..compress.base import check_int

SEED_BOUND = 2**63 - 1


def derived_seed(*keys: int | str) -> int:
    """A 63-bit seed mixed from `keys` by a hash, so that nearby keys (step 7 and step 8, seed 0
    and seed 1) give unrelated random streams; the same on every platform and Python version."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator_for(*keys: int | str) -> torch.Generator:
    """A fresh CPU generator seeded from `keys` (see derived_seed); never the global RNG."""
    return torch.Generator().manual_seed(derived_seed(*keys))


def shard_bounds(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """[lo, hi) of rank's contiguous share of `total` items: disjoint over ranks, covering all of
    them, sizes differing by at most one."""
    return rank * total // world_size, (rank + 1) * total // world_size


def epoch_indices(seed: int, step: int, global_batch: int, population: int) -> torch.Tensor:
    """Indices of `step`'s global batch when a finite training set is visited in epochs.

    Batches tile the infinite sequence perm(epoch 0), perm(epoch 1), ..., each a seeded
    permutation of range(population): within an epoch no sample repeats. One call costs
    O(global_batch) plus one permutation per epoch it touches, cached.
    """
    first = step * global_batch
    pieces = []
    for epoch in range(first // population, (first + global_batch - 1) // population + 1):
        perm = _epoch_permutation(seed, epoch, population)
        lo = max(first - epoch * population, 0)
        hi = min(first + global_batch - epoch * population, population)
        pieces.append(perm[lo:hi])
    return torch.cat(pieces)


@functools.lru_cache(maxsize=4)
def _epoch_permutation(seed: int, epoch: int, population: int) -> torch.Tensor:
    return torch.randperm(population, generator=generator_for(seed, "epoch", epoch))


def materialize(
    architecture: Callable[[], nn.Module],
    initialize: Callable[[nn.Module, torch.Generator], None],
    generator: torch.Generator,
) -> nn.Module:
    """Build `architecture()` without touching the global RNG, then let `initialize` fill it.

    The module is constructed on the meta device, where the default initializers draw nothing,
    and then given uninitialized CPU memory. It is filled with NaN first, so that a tensor the
    initializer forgets cannot pass silently for weights.
    """
    with torch.device("meta"):
        module = architecture()
    module = module.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
        initialize(module, generator)
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        assert not tensor.is_floating_point() or torch.isfinite(tensor).all(), f"{name} left uninitialized"
    return module


def count_params(architecture: Callable[[], nn.Module]) -> int:
    """Parameters of `architecture()`, counted on the meta device: no memory, no initialization."""
    with torch.device("meta"):
        return sum(p.numel() for p in architecture().parameters())


def flat_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits (..., classes) against class indices (...)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)


def heldout_sums(losses: torch.Tensor, correct: int, counts_correct: bool) -> dict[str, float]:
    """What a shard's evaluation adds to the held-out totals, from its per-prediction `losses` and
    `correct` count (Workload.heldout_losses): loss_sum, loss_sq_sum (of the squared losses, for
    the mean's standard error), count (predictions) and, for classifiers, correct. Sum them over
    ranks, then divide by the summed count."""
    sums = {
        "loss_sum": losses.sum().item(),
        "loss_sq_sum": losses.square().sum().item(),
        "count": float(losses.numel()),
    }
    if counts_correct:
        sums["correct"] = float(correct)
    return sums


class Workload(abc.ABC):
    """A model, its training data and its held-out data, for data-parallel training.

    Every rank builds the same workload with the same seed. Rank r of world_size trains on its
    own slice of each step's global batch of batch_size * world_size samples, which depends only
    on (seed, step, batch_size * world_size); so the union over ranks is the global batch, and a
    run is the same whatever the timing. The held-out set does not depend on the seed: runs with
    different seeds are replicates of one task.

    Subclasses declare the architecture, its initialization, how a step's sample indices are
    drawn and how indices become tensors; the base class does the sharding and the evaluation.

    Example:
        >>> from gradsync import workloads
        >>> w = workloads.build("convnet", seed=0)
        >>> model = w.model()
        >>> opt = w.recommended_optimizer(model.parameters())
        >>> inputs, targets = w.batch(step=0, rank=0, world_size=1)
        >>> w.loss(model, inputs, targets).backward()
        >>> opt.step()
    """

    name: ClassVar[str]
    metric: ClassVar[str] = "loss"  # held-out cross-entropy per prediction, lower is better
    # Classifiers also count correct predictions in heldout_losses(); the LMs do not.
    counts_correct: ClassVar[bool] = False
    # Held-out samples per forward pass in heldout_losses(): bounds the activation memory.
    eval_chunk: ClassVar[int] = 256

    def __init__(self, seed: int, batch_size: int) -> None:
        self.seed = check_int("seed", seed, 0, SEED_BOUND, why="seeds are non-negative 63-bit integers")
        self.batch_size = check_int("batch_size", batch_size, 1, why="samples per rank per step")

    # --- what each workload declares -------------------------------------------------------------

    @abc.abstractmethod
    def architecture(self) -> nn.Module:
        """The untrained model, built with PyTorch's default initializers (replaced in model())."""

    @abc.abstractmethod
    def initialize(self, model: nn.Module, generator: torch.Generator) -> None:
        """Fill every parameter and buffer of `model` from `generator` (called under no_grad)."""

    @abc.abstractmethod
    def sample_indices(self, step: int, global_batch: int) -> torch.Tensor:
        """Indices of the training samples of `step`'s global batch, a function of (seed, step,
        global_batch) only; cheap."""

    @abc.abstractmethod
    def training_samples(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the training samples at `indices`."""

    @property
    @abc.abstractmethod
    def heldout_size(self) -> int:
        """Number of held-out samples; heldout_losses() covers indices 0 .. heldout_size - 1."""

    @abc.abstractmethod
    def heldout_samples(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the held-out samples at `indices`."""

    @abc.abstractmethod
    def recommended_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer and learning rate these defaults were checked with."""

    @abc.abstractmethod
    def data_summary(self) -> str:
        """A few words on the data, for describe()."""

    # --- the contract the runner uses --------------------------------------------------------------

    def model(self) -> nn.Module:
        """A fresh model; the same weights for the same seed, on any rank and any run."""
        return materialize(self.architecture, self.initialize, generator_for(self.seed, "init"))

    def num_params(self) -> int:
        return count_params(self.architecture)

    def batch(self, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank's slice of the global batch of `step` (batch_size samples)."""
        check_int("step", step, 0, why="steps count from 0")
        world_size = check_int("world_size", world_size, 1, why="the number of ranks")
        check_int("rank", rank, 0, world_size - 1, why="ranks are 0 .. world_size - 1")
        indices = self.sample_indices(step, self.batch_size * world_size)
        return self.training_samples(indices[rank * self.batch_size : (rank + 1) * self.batch_size])

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the batch (per token for the language models)."""
        return flat_cross_entropy(model(inputs), targets)

    def recommended_schedule(
        self, optimizer: torch.optim.Optimizer, steps: int
    ) -> torch.optim.lr_scheduler.LRScheduler | None:
        """The learning-rate schedule these defaults were checked with, over a run of `steps`
        optimizer steps (call its step() after each optimizer.step()); None: a constant rate."""
        return None

    def heldout_losses(self, model: nn.Module, rank: int, world_size: int) -> tuple[torch.Tensor, int]:
        """Rank's disjoint shard of the held-out set, evaluated: every prediction's loss (float64
        holding the float32 values computed, in held-out order) and, for classifiers, how many
        predictions were correct (else 0). heldout_sums() turns them into the held-out totals.

        Runs under no_grad in eval mode and restores the model's mode after. The number of
        forward passes differs between ranks when the shards do, so pass the bare module
        rather than a DDP wrapper that might run collectives in forward.
        """
        world_size = check_int("world_size", world_size, 1, why="the number of ranks")
        check_int("rank", rank, 0, world_size - 1, why="ranks are 0 .. world_size - 1")
        lo, hi = shard_bounds(self.heldout_size, rank, world_size)
        losses, correct = [torch.zeros(0, dtype=torch.float64)], 0
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for start in range(lo, hi, self.eval_chunk):
                    inputs, targets = self.heldout_samples(
                        torch.arange(start, min(start + self.eval_chunk, hi))
                    )
                    logits = model(inputs)
                    losses.append(flat_cross_entropy(logits, targets, reduction="none").double())
                    if self.counts_correct:
                        correct += int((logits.argmax(-1) == targets).sum())
        finally:
            model.train(was_training)
        return torch.cat(losses), correct

    def schedule_summary(self) -> str:
        """A few words on recommended_schedule, for describe(); "" for a constant rate."""
        return ""

    def describe(self) -> str:
        schedule = f"; {self.schedule_summary()}" if self.schedule_summary() else ""
        return (
            f"{self.name}: {self.num_params():,} parameters; {self.data_summary()}; "
            f"batch {self.batch_size} per rank{schedule}; seed {self.seed}"
        )

    def __repr__(self) -> str:
        return f"<Workload {self.describe()}>"
