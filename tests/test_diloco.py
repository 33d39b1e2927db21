"""gradsync.DiLoCo in a world of one: when it syncs, what the outer step computes, streaming
fragments and their delay, skipped non-finite syncs, exact resume and refused input. Several
ranks: tests/distributed/test_dist_diloco.py."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import threading
from typing import Any

import pytest
import torch
from torch import nn

import gradsync
from gradsync import diloco
from gradsync.diloco import DEFAULTS, cut


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # test data only; gradsync itself never touches the global RNG
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def train(
    net: nn.Module, optimizer: torch.optim.Optimizer, steps: range, features: int = 8, size: int = 32
) -> list[list[torch.Tensor]]:
    """Inner steps on seeded batches; the parameters after each step."""
    after = []
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(size, features, generator=generator), torch.randn(size, 4, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
        after.append([p.detach().clone() for p in net.parameters()])
    return after


def params(net: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def test_nothing_syncs_before_the_hth_step_then_local_becomes_the_nesterov_stepped_global() -> None:
    net = model()
    start = params(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = gradsync.DiLoCo(net, optimizer, sync_every=3, outer_lr=0.7, outer_momentum=0.9)
    plain = model()
    local = train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), range(3))
    after = train(net, optimizer, range(3))
    for got, want in zip(after[1], local[1], strict=True):
        assert torch.equal(got, want)  # step 2: no sync yet, the inner trajectory untouched
    # Step 3: the first outer step from a zero momentum buffer, Nesterov: lr (1 + momentum) delta.
    for got, theta0, theta in zip(after[2], start, local[2], strict=True):
        torch.testing.assert_close(got, theta0 - 0.7 * 1.9 * (theta0 - theta))
    assert outer.stats()["inner_steps"] == 3 and outer.stats()["step"] == 1  # one fragment sync


def test_fragments_too_small_to_compress_are_said_when_diloco_is_built(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # In DiLoCo's own terms (fragments), once: not a bucket's advice to set a SyncConfig it
    # does not take.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 4096), nn.Tanh(), nn.Linear(4096, 4))  # 53,252 elements
    with caplog.at_level("WARNING", logger="gradsync"):
        for fragments in (2, 4):  # 26,626 and 13,313 elements each
            optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
            outer = gradsync.DiLoCo(net, optimizer, sync_every=4, fragments=fragments, compressor="int4")
            train(net, optimizer, range(8))
            outer.close()
    said = [r.getMessage() for r in caplog.records if "nothing is compressed" in r.getMessage()]
    assert said == [
        "gradsync DiLoCo: nothing is compressed: the largest fragment, 13313 elements, is below "
        "min_compress_numel=16384 (where compressing costs more than it saves); fewer fragments "
        "make larger ones"
    ]


def test_top_k_compresses_outer_gradients_at_its_ratio_from_the_first_sync() -> None:
    # Its sparsity warm-up counts steps of training; counted in outer syncs (one per H steps) it
    # would span most of a run, so outer gradients are sparsified at `ratio` from the first.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 4096), nn.Tanh(), nn.Linear(4096, 4))  # above min_compress_numel
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = gradsync.DiLoCo(net, optimizer, sync_every=2, compressor="topk", compressor_args={"ratio": 0.1})
    before = params(net)
    train(net, optimizer, range(2))
    moved = sum(int((a != b).sum()) for a, b in zip(params(net), before, strict=True))
    numel = sum(p.numel() for p in net.parameters())
    assert moved == round(0.1 * numel)  # one sync: only the entries top-k sent moved the global
    assert outer.stats()["step"] == 1


def test_local_sgd_in_a_world_of_one_is_plain_training() -> None:
    net, plain = model(), model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    outer = gradsync.DiLoCo(net, optimizer, sync_every=2, outer_lr=1.0, outer_momentum=0.0)
    got = train(net, optimizer, range(6))[-1]
    assert outer.stats()["step"] == 3  # it did sync, three times
    want = train(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9), range(6))[-1]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # global - (global - local): rounding only


def test_fragments_cover_every_element_once_in_order_in_equal_ranges_staggered_over_the_round() -> None:
    sizes = [100, 10, 100, 10, 7000, 70, 3]  # lopsided: one tensor holds most elements
    parts = cut(sizes, 3, 12)
    assert [f.step for f in parts] == [0, 4, 8]
    flat = [(i, e) for f in parts for i, start, end in f.pieces for e in range(start, end)]
    assert flat == [(i, e) for i, size in enumerate(sizes) for e in range(size)]  # once, in order
    assert max(f.numel for f in parts) - min(f.numel for f in parts) <= 1
    # The big tensor is split between fragments: none is larger than its share.
    assert [i for i, _, _ in parts[1].pieces] == [4]
    # One element each, as many fragments as elements.
    assert [f.pieces for f in cut([2, 1], 3, 3)] == [((0, 0, 1),), ((0, 1, 2),), ((1, 0, 1),)]


def test_a_strided_parameter_is_cut_and_written_as_a_contiguous_one_is() -> None:
    # channels_last conv weights have no flat view: fragments split them all the same.
    def run(channels_last: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 4))
        if channels_last:
            net[0].to(memory_format=torch.channels_last)
            assert not net[0].weight.is_contiguous()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        outer = gradsync.DiLoCo(net, optimizer, sync_every=3, fragments=3, delay=1, alpha=0.5)
        g = torch.Generator().manual_seed(1)
        for _ in range(7):
            x, y = torch.randn(8, 3, 6, 6, generator=g), torch.randint(4, (8,), generator=g)
            nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().contiguous() for p in net.parameters()] + outer.global_parameters()

    strided, plain = run(True), run(False)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(strided, plain, strict=True))


def test_streaming_fragments_sync_at_their_own_steps_and_a_delay_applies_later() -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = gradsync.DiLoCo(net, optimizer, sync_every=4, fragments=2, delay=1)
    syncs, loaded = [], []
    for step in range(1, 9):
        train(net, optimizer, range(step, step + 1))
        syncs.append(outer.stats()["step"])
        loaded.append(
            [
                f
                for f, fragment in enumerate(outer._fragments)
                if torch.equal(outer._local(fragment), outer._global[f])
            ]
        )
    # Fragment 1 starts at steps 2 and 6, fragment 0 at 4 and 8; each is applied (the local
    # parameters replaced by the global ones) one inner step later.
    assert syncs == [0, 1, 1, 2, 2, 3, 3, 4]
    assert loaded == [[], [], [1], [], [0], [], [1], []]
    assert set(outer._pending) == {0}  # fragment 0's step-8 exchange is due at step 9


def test_a_delayed_fragment_mixes_the_global_into_the_local_with_alpha() -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = gradsync.DiLoCo(
        net, optimizer, sync_every=2, delay=1, alpha=0.25, outer_lr=1.0, outer_momentum=0.0
    )
    before = train(net, optimizer, range(2))[-1]  # step 2 starts the exchange of these
    plain = model()
    plain.load_state_dict(net.state_dict())
    inner = torch.optim.SGD(plain.parameters(), lr=0.1)
    trained = train(plain, inner, range(2, 3))[-1]  # what step 3 trains, before the mix
    after = train(net, optimizer, range(2, 3))[-1]
    for got, local, global_ in zip(after, trained, before, strict=True):
        torch.testing.assert_close(got, 0.25 * local + 0.75 * global_)
    assert not outer._pending


def test_a_non_finite_outer_gradient_skips_the_sync_and_resets_to_the_global_parameters() -> None:
    net = model()
    start = params(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = gradsync.DiLoCo(net, optimizer, sync_every=2)
    train(net, optimizer, range(1))
    with torch.no_grad():
        next(net.parameters())[0, 0] = float("nan")
    after = train(net, optimizer, range(1, 2))[-1]
    assert outer.skipped == 1
    for got, want in zip(after, start, strict=True):
        assert torch.equal(got, want)  # the global parameters, untouched by the outer optimizer
    assert all(
        s.abs().sum() == 0 for s in outer._outer.state.values() for s in s.values() if torch.is_tensor(s)
    )


def delayed(compressor: str, **options: Any) -> tuple[nn.Module, torch.optim.Optimizer, gradsync.DiLoCo]:
    """A model whose 2 fragments are each over min_compress_numel (int8 compresses both), under
    DiLoCo with a delay of one inner step: an exchange is in flight between two steps."""
    net = nn.Sequential(nn.Linear(256, 160), nn.Tanh(), nn.Linear(160, 4))
    torch.manual_seed(1)
    for p in net.parameters():
        nn.init.normal_(p, std=0.1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    outer = gradsync.DiLoCo(
        net, optimizer, sync_every=4, fragments=2, delay=1, compressor=compressor, **options
    )
    return net, optimizer, outer


# int4's error memories resume too (int8 keeps none).
@pytest.mark.parametrize(("compressor", "alpha"), [("none", 0.5), ("int8", 0.5), ("int4", 0.5)])
def test_a_resumed_run_continues_bit_identically_with_an_exchange_in_flight(
    compressor: str, alpha: float
) -> None:
    def make() -> tuple[nn.Module, torch.optim.Optimizer, gradsync.DiLoCo]:
        return delayed(compressor, alpha=alpha)

    def batches(net: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
        train(net, optimizer, steps, features=256, size=16)

    net, optimizer, outer = make()
    batches(net, optimizer, range(12))
    want = params(net)

    net, optimizer, outer = make()
    batches(net, optimizer, range(6))
    assert outer._pending  # fragment 1's step-6 exchange is due at step 7
    # Copies, as torch.save makes: close() applies the exchange in flight to the live model.
    saved = copy.deepcopy((net.state_dict(), optimizer.state_dict(), outer.state_dict()))
    outer.close()
    net, optimizer, outer = make()
    net.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    outer.load_state_dict(saved[2])
    batches(net, optimizer, range(6, 12))
    for got, expected in zip(params(net), want, strict=True):
        assert torch.equal(got, expected)
    if compressor != "none":
        assert outer.stats()["total"]["compressed_groups"] > 0


def test_a_rollback_in_the_same_process_waits_for_the_exchanges_in_flight_and_resumes_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Loading a state into the DiLoCo that saved it, with its own exchanges still in flight (a
    rollback, say after a loss spike): those complete before load_state_dict's first collective,
    whose order every rank must share, and training goes on as from the saved point."""

    net, optimizer, outer = delayed("int8")
    train(net, optimizer, range(12), features=256, size=16)
    want = params(net)

    net, optimizer, outer = delayed("int8")
    train(net, optimizer, range(6), features=256, size=16)
    saved = copy.deepcopy((net.state_dict(), optimizer.state_dict(), outer.state_dict()))
    train(net, optimizer, range(6, 10), features=256, size=16)
    assert outer._pending  # fragment 1's step-10 exchange is due at step 11
    # One process's exchange is over at once: this one's result arrives 0.2 s later, as a peer's
    # would on a slow link.
    for index, pending in list(outer._pending.items()):
        late: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        threading.Timer(0.2, late.set_result, args=(pending.average.wait(),)).start()
        outer._pending[index] = dataclasses.replace(pending, average=late)
    in_flight = list(outer._pending.values())
    issued = []  # at each of load_state_dict's collectives: whether the exchanges had completed
    real = diloco.allgather_object

    def collective(*args: object) -> object:
        issued.append(all(p.average.done() for p in in_flight))
        return real(*args)

    monkeypatch.setattr(diloco, "allgather_object", collective)
    net.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    outer.load_state_dict(saved[2])
    assert issued and all(issued)
    train(net, optimizer, range(6, 12), features=256, size=16)
    for got, expected in zip(params(net), want, strict=True):
        assert torch.equal(got, expected)


def test_the_constructors_defaults_are_the_ones_tools_name() -> None:
    signature = inspect.signature(gradsync.DiLoCo)
    assert {key: signature.parameters[key].default for key in DEFAULTS} == DEFAULTS


def test_close_applies_an_exchange_still_in_flight() -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = gradsync.DiLoCo(net, optimizer, sync_every=2, delay=1, outer_lr=1.0, outer_momentum=0.0)
    started = train(net, optimizer, range(2))[-1]  # step 2 starts an exchange due at step 3
    assert outer._pending
    outer.close()
    assert not outer._pending
    for got, want in zip(outer.global_parameters(), started, strict=True):
        torch.testing.assert_close(got, want)  # Local SGD in a world of one: the local parameters


def test_close_ends_the_thread_of_the_exchanges_that_wait_on_a_collective() -> None:
    # PowerSGD waits for its P before it issues Q: its exchanges run on the lane's thread. (A
    # model large enough to be compressed: 2 x 64 x 256 entries and more.)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 2048), nn.Tanh(), nn.Linear(2048, 4))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = gradsync.DiLoCo(net, optimizer, sync_every=2, compressor="powersgd", compressor_args={"rank": 1})
    train(net, optimizer, range(2))
    thread = outer.sync_state.lane._thread
    assert thread is not None and thread.is_alive()  # it idles a minute after its last exchange
    outer.close()
    assert not thread.is_alive()


def test_close_stops_counting_inner_steps() -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = gradsync.DiLoCo(net, optimizer, sync_every=2)
    train(net, optimizer, range(1))
    outer.close()
    local = train(net, optimizer, range(1, 3))
    assert outer.step == 1 and outer.stats()["step"] == 0
    assert not torch.equal(local[0][0], local[1][0])  # training went on, unsynced


def test_with_alpha_and_a_memory_nothing_held_back_is_lost_or_sent_twice() -> None:
    # One rank, Local SGD's outer step (outer_lr=1, no momentum), gradients that do not depend on
    # the parameters, int4 and its residual memory m, alpha 0.5. The local lead kept at a sync
    # holds alpha of what int4 held back, which m sends too; the next sync takes that overshoot
    # back: local - (1 - alpha) m is, after every sync, where the uncompressed run's parameters
    # are (they are the sum of the inner steps). Scaling m by 1 - alpha, or keeping none, loses
    # a part of each sync's residual for good.
    alpha, lr = 0.5, 0.05
    torch.manual_seed(0)  # the test's initial parameters
    net = nn.Linear(256, 160)  # over min_compress_numel
    start = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    outer = gradsync.DiLoCo(
        net, optimizer, sync_every=2, outer_lr=1.0, outer_momentum=0.0, compressor="int4", alpha=alpha
    )
    moved = torch.zeros_like(start)
    for step in range(8):  # 4 syncs
        c = torch.randn(start.numel(), generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        weight, bias = c.split([net.weight.numel(), net.bias.numel()])
        ((net.weight * weight.view_as(net.weight)).sum() + (net.bias * bias).sum()).backward()
        optimizer.step()
        moved -= lr * c
        if (step + 1) % 2 == 0:
            local = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
            memory = outer.sync_state.points[0].feedback.error  # type: ignore[attr-defined]
            assert float(memory.abs().max()) > 1e-4  # int4 held something back
            torch.testing.assert_close(local - (1 - alpha) * memory, start + moved, rtol=0, atol=2e-5)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"sync_every": 0}, ["sync_every=0", "[1, inf]"]),
        ({"sync_every": 4, "fragments": 5}, ["fragments=5", "[1, 4]"]),
        ({"sync_every": 4, "fragments": 0}, ["fragments=0"]),
        ({"sync_every": 4, "delay": 4}, ["delay=4", "[0, 3]"]),
        ({"alpha": 1.5}, ["alpha=1.5", "[0, 1)"]),
        ({"alpha": 1.0}, ["alpha=1.0", "[0, 1)", "never mix"]),
        ({"outer_lr": 0.0}, ["outer_lr=0.0", "Local SGD"]),
        ({"outer_momentum": 1.0}, ["outer_momentum=1.0", "[0, 1)"]),
        ({"compressor": "nope"}, ["nope"]),
    ],
)
def test_bad_options_are_refused_naming_the_value_and_the_range(kwargs: dict, words: list[str]) -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises((ValueError, KeyError)) as excinfo:
        gradsync.DiLoCo(net, optimizer, **kwargs)
    for word in words:
        assert word in str(excinfo.value)
    assert not optimizer._optimizer_step_post_hooks  # nothing left installed


def test_a_ddp_model_or_a_foreign_optimizer_is_refused_with_the_fix() -> None:
    net = model()
    with pytest.raises(ValueError, match=r"model\.parameters"):
        gradsync.DiLoCo(net, torch.optim.SGD(model(1).parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        gradsync.DiLoCo(net, "sgd")  # type: ignore[arg-type]


def test_frozen_parameters_in_the_optimizer_are_accepted_and_left_alone() -> None:
    net = model()
    net[0].weight.requires_grad_(False)
    frozen = net[0].weight.detach().clone()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)  # frozen ones too: torch skips them
    outer = gradsync.DiLoCo(net, optimizer, sync_every=2)
    train(net, optimizer, range(4))
    assert outer.stats()["inner_steps"] == 4
    assert torch.equal(net[0].weight, frozen)


def test_a_state_of_other_options_is_refused_and_nothing_is_loaded() -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = gradsync.DiLoCo(net, optimizer, sync_every=2)
    train(net, optimizer, range(2))
    saved = outer.state_dict()
    other_net = model()
    other_optimizer = torch.optim.SGD(other_net.parameters(), lr=0.1)
    other = gradsync.DiLoCo(other_net, other_optimizer, sync_every=3)
    with pytest.raises(ValueError, match="sync_every") as excinfo:
        other.load_state_dict(saved)
    assert "nothing was loaded" in str(excinfo.value)
    assert other.step == 0 and all(
        torch.equal(g, p) for g, p in zip(other.global_parameters(), other_net.parameters(), strict=True)
    )
    with pytest.raises(ValueError, match="not a gradsync DiLoCo state"):
        other.load_state_dict({"points": {}})
    with pytest.raises(ValueError, match=r"keys \['step'"):
        other.load_state_dict({"format": 2})
    with pytest.raises(ValueError, match="not a gradsync DiLoCo state"):
        other.load_state_dict(["not", "a", "mapping"])  # type: ignore[arg-type]


@pytest.mark.parametrize("damage", ["outer optimizer", "momentum", "in flight"])
def test_a_damaged_outer_state_is_refused_before_anything_is_loaded(damage: str) -> None:
    # Found before the error memories are loaded: a rank must restore all of it or none.
    net, optimizer, outer = delayed("int4")
    train(net, optimizer, range(6), features=256, size=16)
    saved = copy.deepcopy(outer.state_dict())
    assert saved["pending"] and saved["outer_optimizer"]["state"]
    if damage == "outer optimizer":
        saved["outer_optimizer"]["param_groups"][0]["params"].append(7)
    elif damage == "momentum":
        saved["outer_optimizer"]["state"][0]["momentum_buffer"] = torch.zeros(3)
    else:
        (pending,) = saved["pending"].values()
        pending["average"] = pending["average"][:-1]
    fresh = delayed("int4")[2]
    found = r"(?s)nothing was loaded.*(outer optimizer's state cannot be loaded|not shaped as the fragments)"
    with pytest.raises(ValueError, match=found):
        fresh.load_state_dict(saved)
    assert fresh.step == 0 and fresh.sync_state.step == 0 and not fresh.sync_state.points
