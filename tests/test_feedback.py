"""Error feedback driven by hand in a world of one, where the decoded total is the local decode."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradsync import compress, feedback
from gradsync.compress.base import SeededCompressor

# Arguments that make a codec lossy enough to leave an error behind at NUMEL elements.
ARGS: dict[str, dict[str, Any]] = {
    "topk": {"ratio": 0.1},
    "randk": {"ratio": 0.1},
    "threshold": {"threshold": 0.5},
    "qsgd": {"levels": 3},
    "powersgd": {"rank": 2},
}


def codec_args(name: str) -> dict[str, Any]:
    seed = {"seed": 3} if "seed" in compress.parameters(name) else {}
    return {**ARGS.get(name, {}), **seed}


# Every lossy codec that takes error feedback (DGC keeps its own memory and the majority vote
# refuses it; identity is lossless and has its own test).
CODECS: list[tuple[str, dict[str, Any]]] = [
    (name, codec_args(name))
    for name in compress.names()
    if name != "none" and not (compress.lookup(name).owns_memory or compress.lookup(name).majority_vote)
]
CODEC_IDS = [name for name, _ in CODECS]
FORMS = feedback.names()
NUMEL = 600
STEPS = 5


def gradients(steps: int = STEPS, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=generator) for _ in range(steps)]


class Step:
    """One step of a world of one: prepare, compress, decode, update."""

    def __init__(self, fb: feedback.Feedback, codec: compress.Compressor, g: torch.Tensor) -> None:
        self.local_calls = 0
        self.p = fb.prepare(g)
        payload, ctx = codec.compress(self.p)
        self.decoded = codec.decompress(payload, ctx)
        self.out = fb.update(g, self.p, self.local, self.decoded.clone())

    def local(self) -> torch.Tensor:
        self.local_calls += 1
        return self.decoded.clone()


def run(form: str, codec: compress.Compressor, gs: list[torch.Tensor], **params: Any) -> list[Step]:
    fb = feedback.build(form, **params)
    return [Step(fb, codec, g) for g in gs]


def float_tolerance(*tensors: torch.Tensor) -> float:
    """A few float32 roundings of the largest magnitude involved."""
    return 8 * torch.finfo(torch.float32).eps * max(float(t.abs().max()) for t in tensors)


def states_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if set(a) != set(b):
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize(("name", "args"), CODECS, ids=CODEC_IDS)
def test_ef_conserves_gradient_plus_error_as_decoded_plus_new_error(name: str, args: dict) -> None:
    fb = feedback.build("ef")
    codec = compress.build(name, **args)
    error = torch.zeros(NUMEL)
    for g in gradients():
        step = Step(fb, codec, g)
        assert torch.equal(step.out, step.decoded)  # ef steps with the decoded average
        lhs, rhs = g + error, step.decoded + fb.error
        assert float((lhs - rhs).abs().max()) <= float_tolerance(lhs, step.decoded)
        assert float(fb.error.abs().max()) > 0  # a lossy codec leaves something behind
        error = fb.error.clone()


def test_ef_with_a_lossless_codec_returns_the_gradient_and_keeps_zero_error() -> None:
    fb = feedback.build("ef")
    codec = compress.build("none")
    for g in gradients():
        step = Step(fb, codec, g)
        assert torch.equal(step.out, g)
        assert not bool(fb.error.any())


@pytest.mark.parametrize(("name", "args"), CODECS, ids=CODEC_IDS)
def test_none_compresses_the_gradient_itself_and_returns_the_decoded_tensor(name: str, args: dict) -> None:
    fb = feedback.build("none")
    codec = compress.build(name, **args)
    for g in gradients():
        step = Step(fb, codec, g)
        assert step.p is g
        assert torch.equal(step.out, step.decoded)
    assert fb.state_dict() == {}


@pytest.mark.parametrize("form", FORMS)
def test_uses_local_declares_whether_update_decodes_the_local_payload(form: str) -> None:
    fb = feedback.build(form)
    codec = compress.build("topk", ratio=0.1)
    steps = [Step(fb, codec, g) for g in gradients(3)]
    called = all(s.local_calls > 0 for s in steps)
    never = all(s.local_calls == 0 for s in steps)
    assert called if type(fb).uses_local else never


@pytest.mark.parametrize(("name", "args"), CODECS, ids=CODEC_IDS)
def test_ef21_mean_memory_equals_local_memory_in_a_world_of_one(name: str, args: dict) -> None:
    fb = feedback.build("ef21")
    codec = compress.build(name, **args)
    h = torch.zeros(NUMEL)
    for g in gradients():
        step = Step(fb, codec, g)
        assert torch.equal(step.p, g - h)  # sends C(g - h)
        h = h + step.decoded
        assert torch.equal(fb.h_mean, fb.h_local)
        assert torch.equal(fb.h_local, h)
        assert torch.equal(step.out, fb.h_mean)


@pytest.mark.parametrize(("name", "args"), CODECS, ids=CODEC_IDS)
def test_econtrol_with_eta_zero_is_exactly_ef21(name: str, args: dict) -> None:
    gs = gradients(8)
    ef21 = run("ef21", compress.build(name, **args), gs)
    econtrol = run("econtrol", compress.build(name, **args), gs, eta=0.0)
    for a, b in zip(ef21, econtrol, strict=True):
        assert torch.equal(a.p, b.p)
        assert torch.equal(a.out, b.out)


def test_econtrol_with_positive_eta_differs_from_ef21() -> None:
    # The previous test would pass trivially if eta were ignored.
    gs = gradients(4)
    ef21 = run("ef21", compress.build("topk", ratio=0.1), gs)
    econtrol = run("econtrol", compress.build("topk", ratio=0.1), gs, eta=0.5)
    assert not torch.equal(ef21[-1].out, econtrol[-1].out)


@pytest.mark.parametrize(("name", "args"), CODECS, ids=CODEC_IDS)
def test_econtrol_conserves_old_error_plus_gradient_as_new_error_plus_memory(name: str, args: dict) -> None:
    # e <- e + g - h - delta and h <- h + delta: what the memory did not take stays in the error.
    fb = feedback.build("econtrol", eta=0.3)
    codec = compress.build(name, **args)
    error, h = torch.zeros(NUMEL), torch.zeros(NUMEL)
    for g in gradients():
        step = Step(fb, codec, g)
        assert float((step.p - (g - h + 0.3 * error)).abs().max()) <= float_tolerance(step.p)
        lhs, rhs = error + g, fb.error + fb.h_local
        assert float((lhs - rhs).abs().max()) <= float_tolerance(lhs, rhs, fb.error)
        assert torch.equal(fb.h_local, h + step.decoded)
        assert torch.equal(fb.h_mean, fb.h_local)
        assert torch.equal(step.out, fb.h_mean)
        error, h = fb.error.clone(), fb.h_local.clone()


@pytest.mark.parametrize("form", ["ef21", "econtrol"])
def test_the_returned_gradient_is_a_copy_of_the_memory(form: str) -> None:
    # DDP may write into the tensor it is handed; that must not reach the memory.
    fb = feedback.build(form)
    codec = compress.build("topk", ratio=0.1)
    step = Step(fb, codec, gradients(1)[0])
    before = fb.h_mean.clone()
    step.out.add_(1.0)
    assert torch.equal(fb.h_mean, before)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("name", "args"), CODECS, ids=CODEC_IDS)
def test_a_restored_state_continues_identically(form: str, name: str, args: dict) -> None:
    gs = gradients(6)
    fb, codec = feedback.build(form), compress.build(name, **args)
    for g in gs[:3]:
        Step(fb, codec, g)
    fb_state, codec_state = fb.state_dict(), codec.state_dict()
    expected = [Step(fb, codec, g).out for g in gs[3:]]  # after the snapshot: it must be a copy
    restored, restored_codec = feedback.build(form), compress.build(name, **args)
    restored.load_state_dict(fb_state)
    restored_codec.load_state_dict(codec_state)
    for g, out in zip(gs[3:], expected, strict=True):
        assert torch.equal(Step(restored, restored_codec, g).out, out)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("name", "args"), CODECS, ids=CODEC_IDS)
def test_an_undone_step_leaves_the_memories_as_the_run_that_never_had_it(
    form: str, name: str, args: dict
) -> None:
    # A step found skipped after its update ran (another group's average was not finite).
    gs = gradients(6)
    fb, codec = feedback.build(form), compress.build(name, **args)
    clean, clean_codec = feedback.build(form), compress.build(name, **args)
    for g in gs[:3]:
        Step(fb, codec, g.clone())
        Step(clean, clean_codec, g.clone())
    before = fb.state_dict()
    Step(fb, codec, gs[3].clone())
    assert form == "none" or not states_equal(fb.state_dict(), before), "the step changed nothing: void"
    fb.undo()
    codec.undo()
    assert states_equal(fb.state_dict(), before)
    fb.undo()  # a second undo has nothing left to put back
    assert states_equal(fb.state_dict(), before)
    if isinstance(codec, SeededCompressor):
        return  # its random stream is not rewound (every rank drew alike): the run goes on apart
    for g in gs[4:]:
        assert torch.equal(Step(fb, codec, g.clone()).out, Step(clean, clean_codec, g.clone()).out)


@pytest.mark.parametrize("form", [f for f in FORMS if f != "none"])
def test_a_fresh_memory_does_not_continue_identically(form: str) -> None:
    # The previous test depends on the memory: without it, the next step differs.
    gs = gradients(4)
    fb, codec = feedback.build(form), compress.build("topk", ratio=0.1)
    for g in gs[:3]:
        Step(fb, codec, g)
    fresh = Step(feedback.build(form), compress.build("topk", ratio=0.1), gs[3])
    assert not torch.equal(Step(fb, codec, gs[3]).out, fresh.out)


@pytest.mark.parametrize("form", FORMS)
def test_state_dict_round_trips_before_the_first_step(form: str) -> None:
    fb = feedback.build(form)
    restored = feedback.build(form)
    restored.load_state_dict(fb.state_dict())
    assert states_equal(restored.state_dict(), fb.state_dict())


@pytest.mark.parametrize(("source", "target"), [("ef", "ef21"), ("ef21", "econtrol"), ("econtrol", "none")])
def test_loading_another_forms_state_raises_value_error(source: str, target: str) -> None:
    fb = feedback.build(source)
    Step(fb, compress.build("topk", ratio=0.1), gradients(1)[0])
    with pytest.raises(ValueError, match="another error_feedback setting"):
        feedback.build(target).load_state_dict(fb.state_dict())


@pytest.mark.parametrize("form", [f for f in FORMS if f != "none"])
def test_a_memory_of_another_shape_raises_value_error(form: str) -> None:
    fb = feedback.build(form)
    Step(fb, compress.build("topk", ratio=0.1), gradients(1)[0])
    with pytest.raises(ValueError, match=rf"\({NUMEL},\)"):
        fb.prepare(torch.zeros(NUMEL + 1))


def test_unknown_form_raises_key_error_listing_the_forms() -> None:
    with pytest.raises(KeyError) as excinfo:
        feedback.build("nope")
    message = excinfo.value.args[0]
    assert "'nope'" in message
    assert all(form in message for form in FORMS)


@pytest.mark.parametrize("form", FORMS)
def test_unknown_parameter_raises_type_error_listing_the_valid_ones(form: str) -> None:
    with pytest.raises(TypeError) as excinfo:
        feedback.build(form, gamma=0.1)
    message = str(excinfo.value)
    assert "gamma" in message
    assert ("eta" in message) == (form == "econtrol")


@pytest.mark.parametrize("eta", [-0.1, 1.5, float("nan")])
def test_econtrol_eta_out_of_range_raises_value_error_naming_it(eta: Any) -> None:
    with pytest.raises(ValueError, match=r"eta=.*out of range \[0, 1\]") as excinfo:
        feedback.build("econtrol", eta=eta)
    assert repr(eta) in str(excinfo.value)


@pytest.mark.parametrize("eta", [True, "0.1", None])
def test_econtrol_eta_that_is_not_a_number_raises_value_error_naming_it(eta: Any) -> None:
    with pytest.raises(ValueError, match=r"eta=.* must be a number in \[0, 1\]") as excinfo:
        feedback.build("econtrol", eta=eta)
    assert repr(eta) in str(excinfo.value)


@pytest.mark.parametrize("eta", [0, 0.0, 0.01, 1])
def test_econtrol_accepts_eta_in_the_closed_unit_interval(eta: float) -> None:
    assert feedback.build("econtrol", eta=eta).eta == float(eta)


# -- momentum correction (DGC's, under the user's momentum optimizer) --------------------------------


def test_momentum_correction_with_a_lossless_codec_returns_the_gradient() -> None:
    # u_t - beta u_{t-1} is g_t: what the optimizer gets when nothing is held back.
    steps = run("momentum", compress.build("none"), gradients(), momentum=0.9)
    for step, g in zip(steps, gradients(), strict=True):
        assert float((step.out - g).abs().max()) <= float_tolerance(g, step.decoded)


@pytest.mark.parametrize(("name", "args"), CODECS, ids=CODEC_IDS)
def test_momentum_correction_conserves_velocity_as_sent_plus_what_waits(name: str, args: dict) -> None:
    fb = feedback.build("momentum", momentum=0.9)
    codec = compress.build(name, **args)
    velocity, accumulated, sent = torch.zeros(NUMEL), torch.zeros(NUMEL), torch.zeros(NUMEL)
    for g in gradients():
        step = Step(fb, codec, g)
        velocity = 0.9 * velocity + g
        accumulated += velocity
        sent += step.decoded
        lhs, rhs = accumulated, sent + fb.error
        assert float((lhs - rhs).abs().max()) <= 4 * float_tolerance(lhs, sent)


def test_sgd_with_the_same_momentum_then_holds_dgcs_update_direction_in_its_buffer() -> None:
    fb = feedback.build("momentum", momentum=0.9)
    codec = compress.build("topk", ratio=0.1)
    param = torch.nn.Parameter(torch.zeros(NUMEL))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    for g in gradients(8):
        step = Step(fb, codec, g)
        param.grad = step.out
        optimizer.step()
        buffer = optimizer.state[param]["momentum_buffer"]
        assert float((buffer - step.decoded).abs().max()) <= float_tolerance(buffer, step.decoded)
