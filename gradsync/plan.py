"""Plan: how each group of gradients is exchanged, as the DDP hook executes it and a person reads it.

A plan cuts the model's gradients, in backprop order, into groups (gradsync.schedule chooses the
cuts) and gives each group a strategy (gradsync.planner chooses them; gradsync.autoplan.make does
both): a codec with its arguments, the collective, the sparse scheme and where the codec runs, as
gradsync.strategy writes them: `none`, `fp16`, `topk:ratio=0.01:scheme=auto`,
`qsgd:collective=two-level`. It records what it was made for (the model's tensors, the world
size), the predicted step time, the reason for each choice, and the measured step time where it
was measured. A plan is data: the hook executes it, the planners make it, files hold it.

Example:
    >>> plan = Plan.load("plan.json")
    >>> print(plan.describe())
    >>> state = gradsync.register(ddp_model, gradsync.SyncConfig(plan="plan.json"))
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torch import nn

from .strategy import Strategy, parse
from .sync import averaged

VERSION = 2  # 2: strategies in gradsync.strategy's words (collective=, scheme=, none)


@dataclass(frozen=True)
class GroupPlan:
    """One group: its parameters (positions in model.parameters(), backprop order) and strategy."""

    params: tuple[int, ...]
    numel: int
    strategy: str  # gradsync.strategy text, e.g. "fp16" or "topk:ratio=0.01:scheme=auto"
    reason: str = ""  # why the planner chose it
    names: tuple[str, ...] = ()  # the parameters' names, for people

    @property
    def parsed(self) -> Strategy:
        return parse(self.strategy)


@dataclass(frozen=True)
class Plan:
    """Groups with their strategies, for one model at one world size."""

    model: str  # signature(): the model's parameter names and shapes, hashed
    world_size: int
    groups: tuple[GroupPlan, ...]
    predicted_step_s: float | None = None
    measured_step_s: float | None = None
    # Predicted (and, where measured, measured) step times of the alternatives the planner weighed:
    # {"fp32 ddp": 0.41, "fp16 uniform": 0.30, ...}.
    alternatives: Mapping[str, float] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)  # cluster, decision time, how it was made

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"plan world_size={self.world_size} must be >= 1 rank")
        if not self.groups:
            raise ValueError(
                "a plan needs at least one group; make one with gradsync.planner or `gradsync plan`"
            )
        for index, group in enumerate(self.groups):
            try:
                parse(group.strategy)
            except ValueError as error:
                raise ValueError(f"plan group {index} has strategy {group.strategy!r}: {error}") from None
            if not group.params:
                raise ValueError(f"plan group {index} has no parameters; every group needs at least one")

    @property
    def strategies(self) -> list[Strategy]:
        return [group.parsed for group in self.groups]

    @property
    def num_params(self) -> int:
        return sum(group.numel for group in self.groups)

    def with_measured(self, step_s: float, **alternatives: float) -> Plan:
        return replace(self, measured_step_s=step_s, alternatives={**self.alternatives, **alternatives})

    def check(self, model: nn.Module, world_size: int | None = None) -> None:
        """Raise ValueError, before training starts, unless this plan fits `model`: the same
        parameters (names and shapes), each trainable one in exactly one group."""
        found = signature(model)
        if found != self.model:
            raise ValueError(
                f"this plan was made for another model (signature {self.model}, {self.num_params:,} "
                f"parameters in {sum(len(g.params) for g in self.groups)} tensors), but the model given "
                f"has signature {found} ({sum(p.numel() for p in model.parameters()):,} parameters): its "
                "parameter names or shapes differ. Make a plan for this model (`gradsync plan`, or "
                "SyncConfig(plan='auto'))"
            )
        params = list(model.parameters())
        trainable = averaged(model)
        placed: dict[int, int] = {}
        for index, group in enumerate(self.groups):
            for param in group.params:
                if param in placed:
                    raise ValueError(
                        f"parameter {param} is in plan groups {placed[param]} and {index}; every parameter "
                        "must be in exactly one group"
                    )
                placed[param] = index
            numel = sum(params[p].numel() for p in group.params if 0 <= p < len(params))
            if numel != group.numel:
                raise ValueError(
                    f"plan group {index} says {group.numel:,} elements but its parameters hold {numel:,}; "
                    "the plan file was edited or made for another model: make it afresh"
                )
        missing, extra = sorted(trainable - set(placed)), sorted(set(placed) - trainable)
        if missing or extra:
            raise ValueError(
                f"the plan's groups do not cover the model: trainable parameters {missing} are in no "
                f"group and {extra} are in a group but are not parameters DDP averages (trainable, "
                "not among those DDP was told to ignore). Every such parameter must be in exactly "
                "one group; make the plan afresh"
            )
        if world_size is not None and world_size != self.world_size:
            raise ValueError(
                f"this plan was made for {self.world_size} ranks but runs on {world_size}: its predicted "
                "costs no longer hold. Make a plan for this world size (`gradsync plan --world "
                f"{world_size}`, or SyncConfig(plan='auto'))"
            )

    # -- files ------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "model": self.model,
            "world_size": self.world_size,
            "predicted_step_s": self.predicted_step_s,
            "measured_step_s": self.measured_step_s,
            "alternatives": dict(self.alternatives),
            "meta": dict(self.meta),
            "groups": [
                {
                    "params": list(g.params),
                    "numel": g.numel,
                    "strategy": g.strategy,
                    "reason": g.reason,
                    "names": list(g.names),
                }
                for g in self.groups
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        if not isinstance(data, Mapping):
            raise ValueError(f"a plan is a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if version != VERSION:
            raise ValueError(
                f"plan version {version!r} is not {VERSION}, the version this gradsync reads; make the plan "
                "afresh (`gradsync plan`, or SyncConfig(plan='auto'))"
            )
        expected = {"version", "model", "world_size", "predicted_step_s", "measured_step_s"}
        expected |= {"alternatives", "meta", "groups"}
        missing = sorted(expected - set(data))
        if missing:
            raise ValueError(f"the plan lacks field(s) {missing}")
        if type(data["world_size"]) is not int:  # 2.9 or true would pass for 2 or 1
            raise ValueError(f"the plan's world_size {data['world_size']!r} is not an integer")
        try:
            return cls._from_fields(data)
        except (TypeError, AttributeError) as error:  # a field of another type ("groups": null)
            raise ValueError(
                f"a plan field is not of the type a plan writes ({type(error).__name__}: {error}); "
                "make the plan afresh (`gradsync plan`, or SyncConfig(plan='auto'))"
            ) from None

    @classmethod
    def _from_fields(cls, data: Mapping[str, Any]) -> Plan:
        groups = []
        for index, g in enumerate(data["groups"]):
            if not isinstance(g, Mapping) or not {"params", "numel", "strategy"} <= set(g):
                raise ValueError(f"plan group {index} must be an object with params, numel and strategy")
            groups.append(
                GroupPlan(
                    tuple(int(p) for p in g["params"]),
                    int(g["numel"]),
                    str(g["strategy"]),
                    str(g.get("reason", "")),
                    tuple(str(n) for n in g.get("names", ())),
                )
            )
        return cls(
            str(data["model"]),
            int(data["world_size"]),
            tuple(groups),
            _optional_float(data["predicted_step_s"]),
            _optional_float(data["measured_step_s"]),
            {str(k): float(v) for k, v in data["alternatives"].items()},
            dict(data["meta"]),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"a plan file must be JSON: {error}") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ValueError(f"cannot read plan file {str(path)!r}: {error.strerror}") from None
        try:
            return cls.from_json(text)
        except ValueError as error:
            raise ValueError(f"plan file {str(path)!r}: {error}") from None

    # -- people -----------------------------------------------------------------------------------

    def describe(self) -> str:
        """The plan as a table: each group's tensors, size, strategy and the reason for it."""
        lines = [f"plan for model {self.model} on {self.world_size} ranks, {len(self.groups)} groups"]
        if self.predicted_step_s is not None:
            lines.append(f"predicted step: {1e3 * self.predicted_step_s:.2f} ms")
        if self.measured_step_s is not None:
            lines.append(f"measured step:  {1e3 * self.measured_step_s:.2f} ms")
        width = max((len(name) for name in self.alternatives), default=0)
        for name, seconds in sorted(self.alternatives.items(), key=lambda item: item[1]):
            lines.append(f"  {name:<{width}}  {1e3 * seconds:9.2f} ms")
        lines.append(f"{'group':>5}  {'tensors':>7}  {'elements':>12}  {'strategy':<36} reason")
        for index, g in enumerate(self.groups):
            first = f"  ({g.names[0]} .. {g.names[-1]})" if g.names else ""
            lines.append(
                f"{index:>5}  {len(g.params):>7}  {g.numel:>12,}  {g.strategy:<36} {g.reason}{first}"
            )
        return "\n".join(lines)


def signature(model: nn.Module | Sequence[tuple[str, Sequence[int]]]) -> str:
    """A short hash of the model's parameter names and shapes, in model.parameters() order (a DDP
    wrapper's "module." prefix dropped): equal for the same architecture, different otherwise."""
    if isinstance(model, nn.Module):
        items = [(name.removeprefix("module."), tuple(p.shape)) for name, p in model.named_parameters()]
    else:
        items = [(name, tuple(shape)) for name, shape in model]
    text = ";".join(f"{name}:{'x'.join(map(str, shape))}" for name, shape in items)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
