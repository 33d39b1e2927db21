"""What a checkpoint of gradsync's state must be to be loaded: its format and its checks.

A rank's own state holds its rank, the world size, the step, the config, the model's parameter
shapes (hashed), its error memories and codec state. Its shape changes as training goes (points
appear after warm-up), and its tensors differ from rank to rank, so a state_dict() is that state
packed as one opaque entry under the rank's own key: {"format": 4, "rank 1": bytes}. Its shape is
then fixed from registration on, which torch.distributed.checkpoint needs (it loads into the keys
of a fresh state, and it deduplicates equal keys across ranks as if they were replicated), and
every rank's entries merge into one dict: full_state_dict(), for one rank to save for all. An
entry ends with a SHA-256 digest of the bytes before it: a flipped bit in an error memory unpickles
as well as the saved one, and would change training silently.

`pack` and `own_part` make and read that form; `problems` says what stops a rank's state from
being loaded into a run, each problem with what to do. Pure functions: SyncState.load_state_dict
runs them on every rank and refuses on all of them alike.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

# state_dict's layout. 2: rank, world size, step, config and model recorded and checked; 3: packed
# under the rank's key, a fixed shape; 4: each entry ends with its digest (3's still load, unchecked).
FORMAT = 4
READABLE = (3, FORMAT)
_DIGEST_MARK = b"gradsync-sha256:"  # then the 32-byte digest of the torch.save bytes before it
KEYS = ("rank", "world_size", "step", "config", "model", "points", "layout", "sparse")


def part_key(rank: int) -> str:
    """The key of rank `rank`'s entry in a state_dict() or full_state_dict()."""
    return f"rank {rank}"


def pack(own: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """A rank's own state (a dict of KEYS, and more) as a state_dict(): one entry, bytes, under
    its `rank` in the default group (unique across the job, also where gradsync averages over a
    sub-group, as beside tensor parallelism)."""
    buffer = io.BytesIO()
    torch.save(dict(own), buffer)
    buffer.write(_DIGEST_MARK + hashlib.sha256(buffer.getbuffer()).digest())
    return {"format": FORMAT, part_key(rank): buffer.getvalue()}


def entry_body(entry: bytes) -> memoryview:
    """The torch.save bytes of a format-4 entry, once its digest shows them as saved; ValueError
    naming what is wrong where not (the file was damaged, or cut short)."""
    body_end = len(entry) - 32 - len(_DIGEST_MARK)
    if body_end < 0 or entry[body_end : body_end + len(_DIGEST_MARK)] != _DIGEST_MARK:
        raise ValueError("it does not end with its digest: the file was cut short or is not of this gradsync")
    body = memoryview(entry)[:body_end]
    if hashlib.sha256(body).digest() != entry[body_end + len(_DIGEST_MARK) :]:
        raise ValueError(
            "its bytes differ from those saved (their SHA-256 digest does not match): the file is damaged"
        )
    return body


def problems(
    state: Mapping[str, Any], world_size: int, config: Mapping[str, Any], model: str | None
) -> list[str]:
    """What is wrong with `state`, a rank's own part, for this run: its `world_size`,
    its config (as to_dict() gives it) and its model (`digest` of the parameters' shapes)."""
    found = []
    if state["world_size"] != world_size:
        found.append(
            f"it was saved by a run of {state['world_size']} ranks, this run has {world_size}: "
            "error memories and compressor state belong to their ranks; register afresh for a new size"
        )
    if None not in (state["model"], model) and state["model"] != model:
        found.append(
            "it was saved for a model with other parameters (their shapes differ): its error memories "
            "would not fit; load a checkpoint of this model, or register afresh"
        )
    if state["config"] != config:
        saved = state["config"] if isinstance(state["config"], Mapping) else {}
        differing = "; ".join(
            f"{key} {saved.get(key)!r} there, {config.get(key)!r} here"
            for key in sorted({*saved, *config}, key=str)
            if saved.get(key) != config.get(key)
        )
        found.append(
            f"it was made with another SyncConfig ({differing}): resume with the same SyncConfig "
            f"(the saved one: {saved})"
        )
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        found.append(f"its step is {step!r}, not a count of steps >= 0: the file is damaged")
    bad = non_finite(state["points"])
    if bad:
        found.append(
            f"its {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} hold NaN or inf: a non-finite "
            "memory would poison every later step; resume from an earlier checkpoint"
        )
    return found


def own_part(
    state: Any, rank: int, device: torch.device | None = None
) -> tuple[Mapping[str, Any] | None, list[str]]:
    """Rank `rank`'s own state out of a state_dict() or full_state_dict() (or several ranks'
    merged), its tensors on `device` (the model's; see `onto`), or what is wrong with it. Never
    raises: every rank must reach the check that compares them."""
    try:
        return _own_part(state, rank, device)
    except Exception as error:
        return None, [f"it is not a gradsync state ({type(error).__name__}: {error})"]


def _own_part(
    state: Any, rank: int, device: torch.device | None
) -> tuple[Mapping[str, Any] | None, list[str]]:
    if not isinstance(state, Mapping):
        return None, [f"a gradsync state is a dict from SyncState.state_dict(), got a {type(state).__name__}"]
    if state.get("format") not in READABLE:
        older = (
            " (gradsync 0.1's before checkpoints were packed per rank)" if state.get("format") == 2 else ""
        )
        return None, [
            f"its format is {state.get('format')!r}{older}, not one of {list(READABLE)}: it is not a "
            "state_dict() of this gradsync; resume from a checkpoint this version saved, or register afresh"
        ]
    if part_key(rank) not in state:
        held = [key for key in state if isinstance(key, str) and key.startswith("rank ")]
        owner = f"{held[0]}'s state" if len(held) == 1 else f"the states of {held or 'no rank'}"
        return None, [
            f"it holds {owner}, loaded on rank {rank}: each rank's error memory is its own. Load on "
            f"each rank the file that rank saved (here rank {rank}'s state_dict()), or one file for all, "
            "saved by full_state_dict() on every rank (gradsync.AllRanks(state) gives a framework "
            "that saves from rank 0 that)"
        ]
    entry = state[part_key(rank)]
    try:
        body = entry_body(entry) if state["format"] == FORMAT else entry
    except ValueError as error:
        return None, [f"its entry for rank {rank}: {error}; resume from another checkpoint"]
    try:
        own = torch.load(io.BytesIO(body), map_location=onto(device), weights_only=True)
    except Exception as error:  # damaged bytes: refused like any other bad state, on every rank
        return None, [f"its entry for rank {rank} cannot be read ({type(error).__name__}: {error})"]
    if not isinstance(own, Mapping):
        return None, [f"its entry for rank {rank} holds a {type(own).__name__}, not a rank's state"]
    missing = sorted(set(KEYS) - set(own))
    if missing:
        return None, [f"it lacks {missing}: not a whole SyncState.state_dict()"]
    return own, []


def onto(device: torch.device | None) -> Callable[[torch.UntypedStorage, str], torch.UntypedStorage]:
    """torch.load's map_location for a rank's own state: every tensor onto `device`, where this
    rank's model is, whichever device saved it (rank 5 saved on GPU 5 of an 8-GPU node resumes on
    GPU 1 of a 4-GPU one, where GPU 5 is absent or another rank's). Where the model's device is
    not known (a state made without the model): a GPU's tensors onto this process's current GPU,
    or the CPU where it has none; a CPU's stay."""

    def place(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        # `storage` is torch's first deserialization of it, on the CPU.
        if device is not None and device.type == "cuda":
            return storage.cuda(device.index if device.index is not None else torch.cuda.current_device())
        if device is not None and device.type == "cpu":
            return storage
        if location.startswith("cuda") and torch.cuda.is_available():
            return storage.cuda(torch.cuda.current_device())
        return storage

    return place


def non_finite(tree: Any) -> list[str]:
    """The paths of the floating-point tensors in `tree` (nested dicts and lists) that hold NaN or
    inf: a memory that would poison every later step."""
    return sorted(name for name, t in _tensors(tree) if t.is_floating_point() and not t.isfinite().all())


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


class AllRanks:
    """A SyncState as a framework that saves from rank 0 only needs it: state_dict() gathers every
    rank's state into one on rank 0 (full_state_dict(to=0): a collective, which such frameworks
    call on every rank before rank 0 writes; the other ranks get {}), and load_state_dict(), on
    every rank, takes each rank's own part.

    `to`: the rank that writes; None where several do (Accelerate's save_on_each_node=True
    writes from each node's first rank): every rank then gets every rank's state, world size
    states in memory each.

    Example (Accelerate, whose save_state writes custom objects from rank 0 only):
        >>> accelerator.register_for_checkpointing(gradsync.AllRanks(state))
    """

    def __init__(self, state: Any, to: int | None = 0) -> None:
        self.state = state  # a SyncState (not imported: the runtime imports this module)
        self.to = to

    def state_dict(self) -> dict[str, Any]:
        return self.state.full_state_dict(to=self.to)  # the saving ranks alone hold every rank's

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state.load_state_dict(state)
