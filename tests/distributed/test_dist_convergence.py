"""Error feedback makes 1% top-k train as well as no compression, on non-IID data, 4 ranks.

Softmax regression (one nn.Linear(64, 10): 650 parameters, so 1% keeps 7 entries per rank and
step) on scikit-learn's digits, standardized, with a fixed stratified 70/30 split. The training
set is sorted by label and each rank gets a contiguous quarter: every rank sees only two or three
digits. Plain SGD, each rank's step on its whole quarter (deterministic gradients).

  (i)   identity           the uncompressed reference
  (ii)  topk 1% + ef       must end within 1 accuracy point of (i)
  (iii) topk 1%, no feedback   must end at least 5 points below (ii)

Why full-quarter batches: without feedback, top-k with deterministic gradients keeps selecting
the same few coordinates, and what it drops is lost for good, so (iii) stalls; minibatch noise
spreads the selection and shrinks the gap to about 3 points, too close to call robustly.
Measured while tuning (these settings, init seeds 0-9, one process emulating the 4 ranks with
gradsync's own codecs, which reproduced the gloo runs' accuracies exactly where compared):
(i) 96.3-97.0%, (i) - (ii) within [-0.4, +0.2] points, (ii) - (iii) within [7.3, 10.2] points.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from dist_harness import config, ddp, run_ranks
from torch import nn

import gradsync

# A convergence run (~20 s of 4 ranks): `make test-all` runs it, `make test` does not.
pytestmark = pytest.mark.slow

WORLD_SIZE = 4
STEPS = 400
LR = 0.25
SEED = 0
# At 1% from the first step: the test is about error feedback, not top-k's sparsity warm-up.
TOPK = {"ratio": 0.01, "sparsity_warmup_steps": 0}
RUNS = {"none": ("none", {}, "none"), "topk+ef": ("topk", TOPK, "ef")}
RUNS["topk+none"] = ("topk", TOPK, "none")
MAX_EF_LOSS_POINTS = 1.0
MIN_NO_FEEDBACK_LOSS_POINTS = 5.0


def digits_shards() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """Each rank's non-IID quarter of the training set, and the test set."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.3, random_state=0, stratify=y)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    std[std == 0] = 1.0  # pixels that are always blank
    x_train = torch.tensor((x_train - mean) / std, dtype=torch.float32)
    x_test = torch.tensor((x_test - mean) / std, dtype=torch.float32)
    y_train, y_test = torch.tensor(y_train), torch.tensor(y_test)
    by_label = torch.argsort(y_train, stable=True)
    x_train, y_train = x_train[by_label], y_train[by_label]
    n = len(y_train)
    bounds = [n * r // WORLD_SIZE for r in range(WORLD_SIZE + 1)]
    shards = [(x_train[lo:hi], y_train[lo:hi]) for lo, hi in itertools.pairwise(bounds)]
    return shards, x_test, y_test


def train_softmax_regression(rank: int, world_size: int, shards: list, seed: int) -> dict:
    x, y = shards[rank]
    out = {}
    for label, (name, args, form) in RUNS.items():
        torch.manual_seed(seed)
        model = ddp(nn.Linear(64, 10))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # topk without feedback: the point of run (iii)
            cfg = config(compressor=name, compressor_args=args, error_feedback=form)
        state = gradsync.register(model, cfg)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for _ in range(STEPS):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        out[label] = {
            "weight": model.module.weight.detach().clone(),
            "bias": model.module.bias.detach().clone(),
            "compressed_groups": state.stats()["total"]["compressed_groups"],
        }
    return out


@pytest.fixture(scope="module")
def accuracies() -> dict[str, float]:
    shards, x_test, y_test = digits_shards()
    runs = run_ranks(train_softmax_regression, WORLD_SIZE, (shards, SEED), timeout_s=240)
    result = {}
    for label in RUNS:
        final = runs[0][label]
        for rank, out in enumerate(runs):
            assert torch.equal(out[label]["weight"], final["weight"]), f"{label}: rank {rank} differs"
            compressed = 0 if label == "none" else STEPS - 2  # "none": the uncompressed reference
            assert out[label]["compressed_groups"] == compressed, f"{label}: compressed steps"
        logits = x_test @ final["weight"].T + final["bias"]
        result[label] = 100.0 * (logits.argmax(dim=1) == y_test).double().mean().item()
    return result


def test_shards_are_non_iid() -> None:
    shards, _, _ = digits_shards()
    labels_per_rank = [set(y.tolist()) for _, y in shards]
    assert all(len(labels) <= 4 for labels in labels_per_rank), labels_per_rank
    assert set().union(*labels_per_rank) == set(range(10))


def test_topk_with_error_feedback_matches_uncompressed_accuracy(accuracies: dict[str, float]) -> None:
    assert accuracies["none"] > 90.0, accuracies  # the reference itself learned the task
    assert accuracies["topk+ef"] >= accuracies["none"] - MAX_EF_LOSS_POINTS, accuracies


def test_topk_without_feedback_is_clearly_worse_than_with_it(accuracies: dict[str, float]) -> None:
    assert accuracies["topk+none"] <= accuracies["topk+ef"] - MIN_NO_FEEDBACK_LOSS_POINTS, accuracies
