"""SyncConfig: validated when made, read-only afterwards, picklable and comparable."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import warnings
from typing import Any

import pytest
import torch

import gradsync
from gradsync import SyncConfig, compress, feedback, sparse
from gradsync.comm import LocalComm


def test_defaults_are_valid_and_build_a_compressor_and_feedback() -> None:
    cfg = SyncConfig()
    assert cfg.compressor in compress.names()
    assert cfg.error_feedback == "auto"
    assert cfg.feedback_name in feedback.names()
    assert cfg.warmup_steps >= 2
    assert isinstance(cfg.build_compressor(seed=1), compress.lookup(cfg.compressor))
    assert isinstance(cfg.build_feedback(), feedback.Feedback)


@pytest.mark.parametrize("warmup_steps", [-1, -3])
def test_negative_warmup_raises_value_error_with_the_value_and_range(warmup_steps: int) -> None:
    with pytest.raises(ValueError) as excinfo:
        SyncConfig(warmup_steps=warmup_steps)
    message = str(excinfo.value)
    assert f"warmup_steps={warmup_steps}" in message
    assert "[0, inf]" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("warmup_steps", 2.5),
        ("warmup_steps", True),
        ("warmup_steps", "10"),
        ("min_compress_numel", -1),
        ("min_compress_numel", 1.0),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", False),
        ("sparse_every", 0),
        ("sparse_every", 2.0),
    ],
)
def test_bad_integer_fields_raise_value_error_naming_the_value(field: str, value: Any) -> None:
    with pytest.raises(ValueError) as excinfo:
        SyncConfig(**{field: value})
    message = str(excinfo.value)
    assert f"{field}={value!r}" in message or f"{field}={value}" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [("warmup_steps", 2), ("min_compress_numel", 0), ("seed", 2**63 - 1), ("sparse_every", 1)],
)
def test_integer_fields_accept_their_bounds(field: str, value: int) -> None:
    assert getattr(SyncConfig(**{field: value}), field) == value


def test_unknown_compressor_raises_key_error_listing_the_names() -> None:
    with pytest.raises(KeyError) as excinfo:
        SyncConfig(compressor="zip")
    message = excinfo.value.args[0]
    assert "'zip'" in message
    assert all(name in message for name in compress.names())


def test_unknown_error_feedback_raises_key_error_listing_the_forms() -> None:
    with pytest.raises(KeyError) as excinfo:
        SyncConfig(error_feedback="ef2")
    message = excinfo.value.args[0]
    assert all(form in message for form in feedback.names())


def test_unknown_compressor_argument_raises_type_error_listing_the_valid_ones() -> None:
    with pytest.raises(TypeError) as excinfo:
        SyncConfig(compressor="qsgd", compressor_args={"level": 3})
    message = str(excinfo.value)
    assert "level" in message
    assert all(param in message for param in compress.parameters("qsgd"))


@pytest.mark.parametrize(
    ("compressor", "args", "shown"),
    [
        ("topk", {"ratio": 0}, "ratio=0"),
        ("topk", {"ratio": 1.5}, "ratio=1.5"),
        ("qsgd", {"levels": 200}, "levels=200"),
        ("powersgd", {"rank": 0}, "rank=0"),
    ],
)
def test_out_of_range_compressor_argument_raises_value_error(compressor: str, args: dict, shown: str) -> None:
    with pytest.raises(ValueError, match=shown):
        SyncConfig(compressor=compressor, compressor_args=args)


def test_bad_error_feedback_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="eta=2"):
        SyncConfig(error_feedback="econtrol", error_feedback_args={"eta": 2})
    with pytest.raises(TypeError, match="eta"):
        SyncConfig(error_feedback="ef", error_feedback_args={"eta": 0.1})


def test_a_whole_number_for_a_float_parameter_gives_the_floats_fingerprint() -> None:
    # Ranks given ratio=1 and ratio=1.0 are configured alike, and must not refuse each other.
    assert (
        SyncConfig(compressor="topk", compressor_args={"ratio": 1}).fingerprint()
        == SyncConfig(compressor="topk", compressor_args={"ratio": 1.0}).fingerprint()
    )
    alike = [SyncConfig(error_feedback="econtrol", error_feedback_args={"eta": e}) for e in (1, 1.0)]
    assert alike[0].fingerprint() == alike[1].fingerprint()
    assert SyncConfig(compressor="qsgd", compressor_args={"levels": 4}).compressor_args["levels"] == 4
    assert type(SyncConfig(compressor="qsgd", compressor_args={"levels": 4}).compressor_args["levels"]) is int
    # The annotation decides, not the default: DGC's clip_norm defaults to None.
    clipped = [SyncConfig(compressor="dgc", compressor_args={"clip_norm": c}) for c in (1, 1.0)]
    assert clipped[0].fingerprint() == clipped[1].fingerprint()
    # An error quotes the value as the user wrote it.
    with pytest.raises(ValueError, match=r"ratio=2\b(?!\.)"):
        SyncConfig(compressor="topk", compressor_args={"ratio": 2})


def test_a_misspelt_field_or_plan_is_refused_with_what_was_meant() -> None:
    with pytest.raises(
        TypeError, match=r"unknown field\(s\) \['compresor'\]; 'compresor': did you mean 'compressor'"
    ):
        SyncConfig(compresor="int4")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=r"plan='Auto' is no plan file here; did you mean plan='auto'"):
        SyncConfig(plan="Auto")
    assert dataclasses.replace(SyncConfig(), seed=3).seed == 3  # replace() goes through the check
    # ... and the fields are still the constructor's signature, for help(), IDEs and config tools.
    assert list(inspect.signature(SyncConfig).parameters) == [f.name for f in dataclasses.fields(SyncConfig)]
    assert pickle.loads(pickle.dumps(SyncConfig(seed=4))) == SyncConfig(seed=4)


def test_a_dict_given_for_a_config_is_refused_saying_how_to_make_one() -> None:
    with pytest.raises(TypeError, match=r"got dict: make one with gradsync.SyncConfig\(\*\*config\)"):
        gradsync.SyncState({"compressor": "int8"})  # type: ignore[arg-type]


def test_argument_mappings_may_be_none_and_must_otherwise_be_mappings() -> None:
    assert SyncConfig(compressor_args=None, error_feedback_args=None) == SyncConfig()  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"compressor_args=\[\('ratio', 0.01\)\] must be a mapping"):
        SyncConfig(compressor="topk", compressor_args=[("ratio", 0.01)])  # type: ignore[arg-type]


def test_plan_auto_without_a_compressor_checks_error_feedback_for_the_casts_it_may_choose() -> None:
    # Else the bad form would first be built in DDP's hook, mid-training.
    with pytest.raises(KeyError, match="bogus"):
        SyncConfig(compressor="none", plan="auto", error_feedback="bogus")
    with pytest.raises(ValueError, match="eta=5"):
        SyncConfig(compressor="none", plan="auto", error_feedback="econtrol", error_feedback_args={"eta": 5})
    SyncConfig(compressor="none", plan="auto", error_feedback="ef")  # a form the casts take


@pytest.mark.parametrize("compressor", ["topk", "randk", "qsgd", "powersgd"])
def test_a_seed_inside_compressor_args_is_refused(compressor: str) -> None:
    with pytest.raises(ValueError, match=r"seed=5.*SyncConfig\(seed=\.\.\.\)"):
        SyncConfig(compressor=compressor, compressor_args={"seed": 5})


def test_the_seed_reaches_only_compressors_that_take_one() -> None:
    cfg = SyncConfig(compressor="topk", compressor_args={"ratio": 0.1, "mode": "sampled"})
    assert cfg.build_compressor(seed=42).seed == 42
    assert "seed" not in vars(SyncConfig(compressor="efsignsgd").build_compressor(seed=42))


def test_arguments_are_read_only_and_copied_from_the_callers_dict() -> None:
    args = {"ratio": 0.1}
    cfg = SyncConfig(
        compressor="topk", compressor_args=args, error_feedback="econtrol", error_feedback_args={"eta": 0.1}
    )
    args["ratio"] = 0.5  # the caller's dict is not the config's
    assert cfg.compressor_args == {"ratio": 0.1}
    for mapping in (cfg.compressor_args, cfg.error_feedback_args):
        with pytest.raises(TypeError, match="read-only"):
            mapping["ratio"] = 0.2
        with pytest.raises(TypeError, match="read-only"):
            mapping.update(ratio=0.2)
        with pytest.raises(TypeError, match="read-only"):
            mapping.pop("ratio", None)
        with pytest.raises(TypeError, match="read-only"):
            mapping.clear()
        with pytest.raises(TypeError, match="read-only"):
            del mapping["eta"]
        with pytest.raises(TypeError, match="read-only"):
            mapping |= {"ratio": 0.2}
    assert cfg.compressor_args == {"ratio": 0.1}
    assert cfg.error_feedback_args == {"eta": 0.1}
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.compressor = "qsgd"  # type: ignore[misc]


def test_replace_makes_a_new_validated_config() -> None:
    cfg = SyncConfig(compressor="topk", compressor_args={"ratio": 0.1})
    assert dataclasses.replace(cfg, warmup_steps=5).warmup_steps == 5
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        dataclasses.replace(cfg, warmup_steps=-1)


def make_config(**overrides: Any) -> SyncConfig:
    fields = {
        "compressor": "qsgd",
        "compressor_args": {"levels": 3, "bucket_size": 100},
        "error_feedback": "econtrol",
        "error_feedback_args": {"eta": 0.05},
        "warmup_steps": 4,
        "min_compress_numel": 10,
        "seed": 7,
    }
    return SyncConfig(**{**fields, **overrides})


def test_configs_with_the_same_fields_are_equal_and_share_a_fingerprint() -> None:
    a, b = make_config(), make_config()
    assert a == b
    assert a.fingerprint() == b.fingerprint()


@pytest.mark.parametrize(
    "change",
    [
        {"seed": 8},
        {"warmup_steps": 5},
        {"compressor_args": {"levels": 3, "bucket_size": 101}},
        {"error_feedback_args": {"eta": 0.06}},
        {"min_compress_numel": 11},
        {"sparse_scheme": "balanced"},
        {"sparse_every": 7},
    ],
    ids=lambda change: next(iter(change)),
)
def test_configs_that_differ_in_any_field_differ_and_have_different_fingerprints(change: dict) -> None:
    a, b = make_config(), make_config(**change)
    assert a != b
    assert a.fingerprint() != b.fingerprint()


def test_fingerprint_ignores_argument_order() -> None:
    a = make_config(compressor_args={"levels": 3, "bucket_size": 100})
    b = make_config(compressor_args={"bucket_size": 100, "levels": 3})
    assert a.fingerprint() == b.fingerprint()


def test_to_dict_rebuilds_an_equal_config_of_plain_dicts() -> None:
    cfg = make_config()
    as_dict = cfg.to_dict()
    assert type(as_dict["compressor_args"]) is dict
    assert SyncConfig(**as_dict) == cfg


@pytest.mark.parametrize(
    "clone",
    [lambda c: pickle.loads(pickle.dumps(c)), copy.deepcopy, copy.copy],
    ids=["pickle", "deepcopy", "copy"],
)
def test_a_config_pickles_and_copies_to_an_equal_read_only_config(clone: Any) -> None:
    cfg = make_config()
    restored = clone(cfg)
    assert restored == cfg
    assert restored.fingerprint() == cfg.fingerprint()
    with pytest.raises(TypeError, match="read-only"):
        restored.compressor_args["levels"] = 5


@pytest.mark.parametrize("compressor", [n for n in compress.names() if compress.lookup(n).needs_feedback])
def test_a_compressor_that_needs_feedback_warns_without_it_at_the_callers_line(compressor: str) -> None:
    with pytest.warns(UserWarning, match=f"{compressor!r} is biased") as record:
        SyncConfig(compressor=compressor, error_feedback="none")
    assert record[0].filename == __file__


@pytest.mark.parametrize(
    ("compressor", "error_feedback"),
    [
        ("none", "none"),
        ("qsgd", "none"),
        ("fp16", "none"),
        ("bf16", "none"),
        ("topk", "ef"),
        ("topk", "ef21"),
        ("powersgd", "econtrol"),
    ],
)
def test_no_warning_for_casts_unbiased_compressors_or_with_error_feedback(
    compressor: str, error_feedback: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SyncConfig(compressor=compressor, error_feedback=error_feedback)


# -- error_feedback="auto" and the codecs that refuse feedback ------------------------------------

EXPLICIT_FORMS = [f for f in feedback.names() if f != "none"]


def refuses_feedback(compressor: str) -> bool:
    codec = compress.lookup(compressor)
    return codec.owns_memory or codec.majority_vote


@pytest.mark.parametrize("compressor", compress.names())
def test_auto_feedback_is_ef_exactly_for_compressors_that_need_feedback(compressor: str) -> None:
    cfg = SyncConfig(compressor=compressor)
    expected = "ef" if compress.lookup(compressor).needs_feedback else "none"
    assert cfg.error_feedback == "auto"
    assert cfg.feedback_name == expected
    assert type(cfg.build_feedback()) is feedback.REGISTRY[expected]


@pytest.mark.parametrize(
    ("compressor", "expected"),
    [
        ("topk", "ef"),
        ("threshold", "ef"),
        ("onebit", "ef"),
        ("powersgd", "ef"),
        ("none", "none"),
        ("qsgd", "none"),
        ("int8", "none"),
        ("dgc", "none"),
        ("signsgd", "none"),
        ("signum", "none"),
    ],
)
def test_auto_feedback_anchors(compressor: str, expected: str) -> None:
    # The registry-wide test follows the flags; these pin the flags of a few known codecs.
    assert SyncConfig(compressor=compressor).feedback_name == expected


@pytest.mark.parametrize("form", feedback.names())
def test_an_explicit_feedback_form_is_used_as_given(form: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # topk without feedback warns: not the subject here
        cfg = SyncConfig(compressor="topk", error_feedback=form)
    assert cfg.feedback_name == form
    assert type(cfg.build_feedback()) is feedback.REGISTRY[form]


def test_exactly_dgc_and_the_majority_vote_codecs_refuse_feedback() -> None:
    assert [n for n in compress.names() if refuses_feedback(n)] == ["dgc", "signsgd", "signum"]


@pytest.mark.parametrize("form", EXPLICIT_FORMS)
@pytest.mark.parametrize("compressor", [n for n in compress.names() if refuses_feedback(n)])
def test_explicit_feedback_with_dgc_or_a_majority_vote_raises_value_error_naming_the_fix(
    compressor: str, form: str
) -> None:
    with pytest.raises(ValueError) as excinfo:
        SyncConfig(compressor=compressor, error_feedback=form)
    message = str(excinfo.value)
    assert repr(compressor) in message
    assert f"error_feedback={form!r}" in message
    assert "'none'" in message


@pytest.mark.parametrize("form", ["none", "auto"])
@pytest.mark.parametrize("compressor", [n for n in compress.names() if refuses_feedback(n)])
def test_dgc_and_majority_vote_accept_none_and_auto_without_warning(compressor: str, form: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SyncConfig(compressor=compressor, error_feedback=form).feedback_name == "none"


@pytest.mark.parametrize("form", EXPLICIT_FORMS)
@pytest.mark.parametrize(
    "compressor", [n for n in compress.names() if n != "none" and not refuses_feedback(n)]
)
def test_every_other_compressor_accepts_every_feedback_form(compressor: str, form: str) -> None:
    assert SyncConfig(compressor=compressor, error_feedback=form).feedback_name == form


@pytest.mark.parametrize("args", [{"eta": 0.1}, {"anything": 1}])
def test_error_feedback_args_with_auto_raise_value_error(args: dict) -> None:
    with pytest.raises(ValueError, match=r"error_feedback_args=.*error_feedback='auto'.*econtrol"):
        SyncConfig(error_feedback_args=args)


@pytest.mark.parametrize("compressor", compress.names())
def test_auto_never_warns(compressor: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SyncConfig(compressor=compressor)


def test_to_dict_and_fingerprint_keep_auto_rather_than_its_resolution() -> None:
    auto = SyncConfig(compressor="topk")
    explicit = SyncConfig(compressor="topk", error_feedback="ef")
    assert auto.to_dict()["error_feedback"] == "auto"
    assert SyncConfig(**auto.to_dict()) == auto
    assert '"error_feedback": "auto"' in auto.fingerprint()
    # The same resolved form, but another config: a checkpoint records what the user asked for.
    assert auto.feedback_name == explicit.feedback_name
    assert auto != explicit
    assert auto.fingerprint() != explicit.fingerprint()


@pytest.mark.parametrize("scheme", ["auto", *sparse.names()])
def test_every_sparse_scheme_and_auto_are_accepted(scheme: str) -> None:
    assert SyncConfig(sparse_scheme=scheme).sparse_scheme == scheme


def test_an_unknown_sparse_scheme_raises_value_error_listing_the_schemes() -> None:
    with pytest.raises(
        ValueError, match=r"sparse_scheme='zen'.*auto, dense, agsparse, balanced, recursive-doubling"
    ):
        SyncConfig(sparse_scheme="zen")


def test_compressor_none_compresses_nothing_and_has_no_feedback() -> None:
    config = SyncConfig(compressor="none")
    assert config.feedback_name == "none"
    state = gradsync.SyncState(config, LocalComm())
    x = torch.arange(40_000.0)
    assert torch.equal(state.sync(x.clone(), 0, True).wait(), x)
    assert state.stats()["total"]["compressed_groups"] == 0


@pytest.mark.parametrize(
    "extra", [{"compressor_args": {"ratio": 0.1}}, {"error_feedback": "ef"}, {"error_feedback": "econtrol"}]
)
def test_compressor_none_refuses_compression_settings_naming_the_fix(extra: dict) -> None:
    with pytest.raises(ValueError, match="compressor='none'"):
        SyncConfig(compressor="none", **extra)


def test_compressor_none_refuses_feedback_arguments_naming_them_not_the_form_left_alone() -> None:
    with pytest.raises(ValueError) as refused:
        SyncConfig(compressor="none", error_feedback_args={"eta": 0.1})
    message = str(refused.value)
    assert "error_feedback_args={'eta': 0.1}" in message and "compressor='none'" in message
    assert "error_feedback='auto' given" not in message
