"""convnet: a small residual CNN on scikit-learn's 8x8 handwritten digits (no download)."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..compress.base import check_int
from .base import Workload, epoch_indices, generator_for

# The held-out split is fixed, not drawn from the workload's seed: every seed is scored on the
# same images.
SPLIT_SEED = 20240601
NUM_IMAGES = 1797  # load_digits()
NUM_CLASSES = 10
# GroupNorm instead of BatchNorm: no running statistics, so no buffers for DDP to broadcast
# and no train/eval difference; and the result does not depend on the per-rank batch size.
GROUPS = 8


@functools.lru_cache(maxsize=1)
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """(images (1797, 1, 8, 8) float32 in [0, 1], labels (1797,) int64) from scikit-learn."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ImportError(
            "the convnet workload reads scikit-learn's bundled digits; "
            "install scikit-learn with `pip install scikit-learn`"
        ) from e
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixels are 0..16
    return images, torch.tensor(data.target, dtype=torch.long)


class ResidualBlock(nn.Module):
    """conv-GN-ReLU-conv-GN plus the input (through a strided 1x1 conv where the shape changes), ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(GROUPS, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(GROUPS, out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.GroupNorm(GROUPS, out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(y)) + self.shortcut(x))


def residual_cnn(channels: int) -> nn.Sequential:
    """Stem, two blocks at 8x8, two at 4x4 with twice the channels, global average pool, linear."""
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1, bias=False),
        nn.GroupNorm(GROUPS, channels),
        nn.ReLU(),
        ResidualBlock(channels, channels),
        ResidualBlock(channels, channels),
        ResidualBlock(channels, 2 * channels, stride=2),
        ResidualBlock(2 * channels, 2 * channels),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * channels, NUM_CLASSES),
    )


def init_cnn(model: nn.Module, generator: torch.Generator) -> None:
    """He initialization for convolutions, unit GroupNorms except the last of each residual
    branch, which starts at zero so that every block starts as the identity (Goyal et al.,
    "Accurate, Large Minibatch SGD", 2017); N(0, 1/fan_in) for the classifier."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            fan_in = module.in_channels * math.prod(module.kernel_size)
            nn.init.normal_(module.weight, 0.0, math.sqrt(2.0 / fan_in), generator=generator)
        elif isinstance(module, nn.GroupNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, math.sqrt(1.0 / module.in_features), generator=generator)
            nn.init.zeros_(module.bias)
    for module in model.modules():
        if isinstance(module, ResidualBlock):
            nn.init.zeros_(module.norm2.weight)


class Convnet(Workload):
    """Digit classification (10 classes) on the 1797 8x8 images of scikit-learn's load_digits,
    standardized with the training set's pixel mean and deviation. A fixed seeded permutation
    holds out `eval_samples` images; the rest are visited in seeded epochs."""

    name = "convnet"
    counts_correct = True
    eval_chunk = 512
    recommended_lr = 0.05

    def __init__(
        self, seed: int = 0, channels: int = 32, batch_size: int = 32, eval_samples: int = 297
    ) -> None:
        super().__init__(seed, batch_size)
        self.channels = check_int(
            "channels", channels, GROUPS, why=f"a multiple of GroupNorm's {GROUPS} groups"
        )
        if channels % GROUPS:
            raise ValueError(
                f"channels={channels} is not a multiple of {GROUPS}: GroupNorm splits the channels into "
                f"{GROUPS} groups; pick a multiple of {GROUPS}"
            )
        self.eval_samples = check_int(
            "eval_samples", eval_samples, 1, NUM_IMAGES - 1, why=f"held-out images out of {NUM_IMAGES}"
        )
        images, labels = digits()
        order = torch.randperm(len(images), generator=generator_for(SPLIT_SEED, "split"))
        train, heldout = order[eval_samples:], order[:eval_samples]
        mean, std = images[train].mean(), images[train].std()
        self.train_images, self.train_labels = (images[train] - mean) / std, labels[train]
        self.heldout_images, self.heldout_labels = (images[heldout] - mean) / std, labels[heldout]

    def architecture(self) -> nn.Module:
        return residual_cnn(self.channels)

    def initialize(self, model: nn.Module, generator: torch.Generator) -> None:
        init_cnn(model, generator)

    def sample_indices(self, step: int, global_batch: int) -> torch.Tensor:
        return epoch_indices(self.seed, step, global_batch, len(self.train_labels))

    def training_samples(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.train_images[indices], self.train_labels[indices]

    @property
    def heldout_size(self) -> int:
        return self.eval_samples

    def heldout_samples(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heldout_images[indices], self.heldout_labels[indices]

    def recommended_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """SGD with momentum 0.9 at recommended_lr (0.05)."""
        return torch.optim.SGD(params, lr=self.recommended_lr, momentum=0.9)

    def data_summary(self) -> str:
        return (
            f"sklearn digits 8x8, {len(self.train_labels):,} training / {self.eval_samples} held-out images"
        )
