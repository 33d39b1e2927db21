"""What a checkpoint of gradsync's state must be to be loaded: its format and its checks.

A state_dict() is one rank's: its rank, the world size, the step, the config, the model's
parameter shapes (hashed), its error memories and codec state. full_state_dict() holds every
rank's. `own_part` takes a rank's part out of either; `problems` says what stops it from being
loaded into a run, each problem with what to do. Pure functions: SyncState.load_state_dict runs
them on every rank and refuses on all of them alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

FORMAT = 2  # state_dict's layout; 2: rank, world size, step, config and model recorded and checked
KEYS = ("rank", "world_size", "step", "config", "model", "points", "layout", "sparse")


def problems(
    state: Mapping[str, Any], rank: int, world_size: int, config: Mapping[str, Any], model: str | None
) -> list[str]:
    """What is wrong with `state`, a rank's own part, for this run: its `rank` of `world_size`,
    its config (as to_dict() gives it) and its model (`digest` of the parameters' shapes)."""
    found = []
    if state["world_size"] != world_size:
        found.append(
            f"it was saved by a run of {state['world_size']} ranks, this run has {world_size}: "
            "error memories and compressor state belong to their ranks; register afresh for a new size"
        )
    elif state["rank"] != rank:
        found.append(
            f"it is rank {state['rank']}'s state, loaded on rank {rank}: each rank's error memory "
            "is its own. Save one file per rank (state_dict() on every rank), or one file for all with "
            "full_state_dict() on every rank"
        )
    if None not in (state["model"], model) and state["model"] != model:
        found.append(
            "it was saved for a model with other parameters (their shapes differ): its error memories "
            "would not fit; load a checkpoint of this model, or register afresh"
        )
    if state["config"] != config:
        found.append(
            f"it was made with SyncConfig {state['config']}, but this run uses {dict(config)}: "
            "resume with the same SyncConfig"
        )
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        found.append(f"its step is {step!r}, not a count of steps >= 0: the file is damaged")
    bad = sorted(
        name for name, t in _tensors(state["points"]) if t.is_floating_point() and not t.isfinite().all()
    )
    if bad:
        found.append(
            f"its {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} hold NaN or inf: a non-finite "
            "memory would poison every later step; resume from an earlier checkpoint"
        )
    return found


def own_part(state: Any, rank: int, world_size: int) -> tuple[Mapping[str, Any] | None, list[str]]:
    """This rank's state out of a state_dict() or full_state_dict(), or what is wrong with it."""
    if not isinstance(state, Mapping):
        return None, [f"a gradsync state is a dict from SyncState.state_dict(), got a {type(state).__name__}"]
    if state.get("format") != FORMAT:
        return None, [
            f"its format is {state.get('format')!r}, not {FORMAT}: it is not a state_dict() of this "
            "gradsync (an older version's, or another object's)"
        ]
    if "ranks" in state:
        parts = state["ranks"]
        if len(parts) != world_size:
            return None, [f"it holds {len(parts)} ranks' states, this run has {world_size} ranks"]
        state = parts[rank]
    missing = sorted(
        {"rank", "world_size", "step", "config", "model", "points", "layout", "sparse"} - set(state)
    )
    if missing:
        return None, [f"it lacks {missing}: not a whole SyncState.state_dict()"]
    return state, []


def _tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in nested dicts and lists, with its path ("group 0 feedback error")."""
    if isinstance(tree, torch.Tensor):
        yield prefix.strip(), tree
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _tensors(value, f"{prefix} {'group ' + str(key) if prefix == '' else key}")
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value, prefix)


def digest(shapes: Sequence[torch.Size]) -> str:
    """A short hash of the parameters' shapes, in model.parameters() order."""
    text = ";".join("x".join(map(str, shape)) for shape in shapes)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
