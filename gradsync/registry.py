"""Name -> class lookup shared by the compressor and error-feedback tables, and the
`name:key=value:...` form every command line and spec names them in."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def lookup(table: Mapping[str, type[T]], kind: str, name: str) -> type[T]:
    """The class registered as `name`; KeyError listing the valid names otherwise."""
    try:
        return table[name]
    except (KeyError, TypeError):
        raise KeyError(f"unknown {kind} {name!r}; available: {', '.join(table)}") from None


def parameters(cls: type) -> dict[str, Any]:
    """Constructor parameters of `cls` with their defaults (empty for a class without any)."""
    if cls.__init__ is object.__init__:
        return {}
    signature = inspect.signature(cls.__init__)
    return {p.name: p.default for p in list(signature.parameters.values())[1:]}


def float_parameters(cls: type) -> set[str]:
    """Constructor parameters of `cls` annotated as floats (`float`, `float | None`): a whole
    number given for one stands for that float (ratio=1 is ratio=1.0)."""
    if cls.__init__ is object.__init__:
        return set()
    found = set()
    for param in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        annotation = (
            param.annotation
            if isinstance(param.annotation, str)
            else getattr(param.annotation, "__name__", "")
        )
        kinds = {part.strip() for part in annotation.split("|")}
        if "float" in kinds and "int" not in kinds:
            found.add(param.name)
    return found


def construct(table: Mapping[str, type[T]], kind: str, name: str, params: Mapping[str, Any]) -> T:
    """Build `name` from `params`; TypeError listing the valid parameters for an unknown one."""
    cls = lookup(table, kind, name)
    valid = sorted(parameters(cls))
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise TypeError(
            f"{kind} {name!r} got unknown parameter(s) {unknown}; valid parameters: {valid or 'none'}"
        )
    return cls(**params)


def parse_value(text: str) -> Any:
    """Numbers and booleans as such; anything else as a string (mode=sampled, ef=ef21)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_spec(text: str, what: str = "spec") -> tuple[str, dict[str, Any]]:
    """("topk", {"ratio": 0.01}) from "topk:ratio=0.01": a name and its options, values read by
    parse_value; ValueError naming `what` and `text` for an item that is not key=value."""
    name, *items = text.strip().split(":")
    options: dict[str, Any] = {}
    for item in filter(None, items):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what} {text!r}: {item!r} is not key=value, e.g. 'topk:ratio=0.01'")
        options[key.strip()] = parse_value(value.strip())
    return name.strip(), options
