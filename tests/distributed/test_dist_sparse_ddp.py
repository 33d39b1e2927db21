"""gradsync.sparse through the DDP hook, on 3 real gloo ranks (not a power of two: recursive
doubling folds a rank in), against plain DDP as the oracle.

- A model with an nn.Embedding, its gradient sparse (COO, a bucket of its own) or dense (zero
  outside the batch's rows, sharing a bucket with dense layers), trains to the same parameters as
  plain DDP under every sparse_scheme: forced schemes apply to the embedding and stay exact, and
  "auto" routes the embedding through a sparse scheme while the dense layers stay dense.
- A top-k payload exchanged by each scheme gives the same averaged gradient; "auto" allgathers
  it, and agsparse and balanced add every index's contributions in rank order, so those agree
  bit for bit.
- stats() reports what each tensor was exchanged by, with its density, overlap, densification
  and balanced's push and pull imbalance; the selector's choices survive state_dict().
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradsync
from gradsync import sparse
from gradsync.sparse.router import Router

WORLD = 3
SCHEMES = ["auto", *sparse.names()]
VOCAB, DIM, CONTEXT, CLASSES = 1 << 19, 8, 4, 16  # a dense allreduce of 16 MB loses to sparse
STEPS = 4


class EmbedNet(nn.Module):
    def __init__(self, sparse_grad: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM, sparse=sparse_grad)
        self.head = nn.Linear(CONTEXT * DIM, CLASSES)

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(words).flatten(1))


def make(sparse_grad: bool) -> nn.Module:
    torch.manual_seed(0)  # the test's own process: the same initial model on every rank
    return EmbedNet(sparse_grad)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    # Zipf-like words: a few frequent ones shared by ranks, a tail that is not.
    words = (torch.rand(8, CONTEXT, generator=generator) ** 3 * VOCAB).long()
    return words, torch.randint(CLASSES, (8,), generator=generator)


def train(rank: int, sparse_grad: bool, config: gradsync.SyncConfig | None) -> tuple[list, dict | None]:
    model = make(sparse_grad)
    ddp = DistributedDataParallel(model)
    state = gradsync.register(ddp, config) if config is not None else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        words, targets = batch(rank, step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(words), targets).backward()
        optimizer.step()
    params = [p.detach().clone() for p in model.parameters()]
    return params, None if state is None else {"stats": state.stats(), "saved": state._own_state()}


def training_worker(rank: int, world_size: int) -> dict:
    out = {}
    for sparse_grad in (True, False):
        out[sparse_grad, "ddp"] = train(rank, sparse_grad, None)
        for scheme in SCHEMES:
            config = gradsync.SyncConfig(sparse_scheme=scheme, warmup_steps=100, sparse_every=2)
            out[sparse_grad, scheme] = train(rank, sparse_grad, config)
    return out


def topk_worker(rank: int, world_size: int) -> dict:
    out = {}
    for scheme in SCHEMES:
        model = make(False)
        ddp = DistributedDataParallel(model)
        config = gradsync.SyncConfig(
            compressor="topk",
            compressor_args={"ratio": 0.05},
            warmup_steps=2,
            min_compress_numel=0,
            sparse_scheme=scheme,
        )
        state = gradsync.register(ddp, config)
        for step in range(3):  # the last step compresses
            words, targets = batch(rank, step)
            model.zero_grad()
            nn.functional.cross_entropy(ddp(words), targets).backward()
        out[scheme] = ([p.grad.clone() for p in model.parameters()], state.stats()["sparse"])
    return out


@pytest.fixture(scope="module")
def trained() -> list[dict]:
    return run_ranks(training_worker, WORLD, timeout_s=180)


@pytest.fixture(scope="module")
def topk() -> list[dict]:
    return run_ranks(topk_worker, WORLD, timeout_s=120)


@pytest.mark.parametrize("sparse_grad", [True, False], ids=["coo-grad", "dense-grad"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_training_through_a_sparse_scheme_matches_plain_ddp(
    trained: list[dict], sparse_grad: bool, scheme: str
):
    for rank_out in trained:
        reference, _ = rank_out[sparse_grad, "ddp"]
        params, _ = rank_out[sparse_grad, scheme]
        for got, expected in zip(params, reference, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    first = trained[0][sparse_grad, scheme][0]
    for rank_out in trained[1:]:  # every rank applied bit-identical averages
        for a, b in zip(first, rank_out[sparse_grad, scheme][0], strict=True):
            assert torch.equal(a, b)


def test_a_forced_scheme_exchanges_every_tensor_and_reports_balance(trained: list[dict]) -> None:
    stats = trained[0][False, "balanced"][1]["stats"]["sparse"]
    # The embedding only: the head's rows are never zero, and it joins the bucket's allreduce.
    assert set(stats) == {"param 0"}
    for row in stats.values():
        assert row["exchanged_by"] == "balanced"
        assert row["push_imbalance"] >= 1 and row["pull_imbalance"] >= 1
        assert row["rows"] <= row["union_rows"] <= row["num_rows"]


@pytest.mark.parametrize("sparse_grad", [True, False], ids=["coo-grad", "dense-grad"])
def test_auto_sends_the_embedding_sparse_and_dense_layers_dense(
    trained: list[dict], sparse_grad: bool
) -> None:
    stats = trained[0][sparse_grad, "auto"][1]["stats"]["sparse"]
    # Only the embedding went through gradsync.sparse; the head's dense gradients were allreduced.
    assert set(stats) == {"param 0"}
    embedding = stats["param 0"]
    assert embedding["scheme"] != "dense"
    assert 0 < embedding["density"] < 0.2
    assert 0 <= embedding["overlap"] <= 1
    assert 1 <= embedding["densification"] <= WORLD
    assert set(embedding["predicted_s"]) == set(sparse.names())
    assert min(embedding["predicted_s"], key=embedding["predicted_s"].get) == embedding["scheme"]


def test_the_selector_choices_are_saved_and_restored(trained: list[dict]) -> None:
    saved = trained[0][True, "auto"][1]["saved"]
    assert saved["sparse"]["choices"]["param 0"][1] == STEPS - 2  # decided every sparse_every=2 steps
    router = Router("auto", every=2, seed=0)
    router.load_state_dict(saved["sparse"])
    assert router.state_dict() == saved["sparse"]
    # Every rank chose alike, from the same gathered rows, without timing anything.
    assert all(rank_out[True, "auto"][1]["saved"]["sparse"] == saved["sparse"] for rank_out in trained)


def test_a_topk_payload_is_averaged_alike_by_every_scheme(topk: list[dict]) -> None:
    for rank_out in topk:
        reference, _ = rank_out["agsparse"]
        for scheme in SCHEMES:
            grads, stats = rank_out[scheme]
            assert scheme == "auto" or stats["bucket 0"]["rows"] > 0  # "auto": allgathered, no rows
            for got, expected in zip(grads, reference, strict=True):
                if scheme in ("balanced", "auto"):  # rank-order sums, as agsparse's
                    assert torch.equal(got, expected)
                else:
                    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


class _Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(1000, 16)  # a dense gradient, mostly zero rows
        self.head = nn.Linear(16, 4)

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(words).mean(1))


def _unequal_densities(rank: int, world: int) -> dict:
    # Rank 0 touches 95% of the table's rows, rank 1 10%: each alone would decide differently
    # (dense, rows), and ranks that issue different collectives hang. The decision is taken on
    # the mean count of rows, the same on every rank.
    words = torch.arange(950 if rank == 0 else 100).view(-1, 1)
    out = {}
    for label in ("ddp", "gradsync"):
        model = _Table()
        ddp = DistributedDataParallel(model)
        config = gradsync.SyncConfig(sparse_scheme="auto", warmup_steps=100)  # uncompressed buckets
        state = gradsync.register(ddp, config) if label == "gradsync" else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(2):
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(words), torch.zeros(len(words), dtype=torch.long)).backward()
            optimizer.step()
        out[label] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        if state is not None:
            out["schemes"] = {key: s["exchanged_by"] for key, s in state.stats()["sparse"].items()}
    return out


def test_ranks_of_unequal_density_choose_one_scheme_and_match_ddp() -> None:
    ranks = run_ranks(_unequal_densities, 2, timeout_s=60)
    assert ranks[0]["schemes"] and ranks[0]["schemes"] == ranks[1]["schemes"]
    for r in ranks:
        torch.testing.assert_close(r["gradsync"], r["ddp"])
