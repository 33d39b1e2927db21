"""The library's imports point one way: down its layers, never in a cycle.

Every module of gradsync belongs to one layer (LAYERS, bottom first, as docs/architecture.md draws
them) and may import only from its own layer or below. Every import counts: at module level, in a
function, under `if TYPE_CHECKING`. The tools (cli, bench, testbed, workloads, demo) sit on top:
the library never imports them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gradsync"

# Bottom first. A module is matched by its dotted name or a prefix ending in ".".
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("registry", "wire", "units", "cost")),
    ("codecs", ("compress.",)),
    (
        "runtime",
        (
            *("comm", "lane", "sparse.", "strategy", "feedback", "learning_rate", "loss_scale"),
            *("config", "trace"),
            *("regroup", "exchange"),
            *("checkpoint", "sync", "ddp", "fsdp", "diloco"),
        ),
    ),
    ("plans", ("plan",)),
    ("planning", ("sim.", "levels", "planner", "schedule", "autoplan")),
    ("measure", ("profile", "profile.")),
    ("entry", ("tuner", "api", "", "lightning")),  # "": the package itself, gradsync/__init__.py
    ("tools", ("cli", "cli.", "__main__", "bench.", "testbed", "testbed.", "workloads.", "demo")),
]


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name ("" for the package itself)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = modules()


def layer_of(name: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix.rstrip(".") or (prefix.endswith(".") and name.startswith(prefix)):
                return index
    raise AssertionError(f"module gradsync.{name} is in no layer of tests/test_layers.py: give it one")


def imports(name: str, source: str | None = None) -> set[str]:
    """The package's modules that module `name` imports, anywhere in its source."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                stem = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == "gradsync":
                stem = node.module.split(".")[1:]
            else:
                continue
            targets = [[*stem, alias.name] for alias in node.names] + ([stem] if node.module else [])
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == "gradsync"]
        for parts in targets:
            while parts and ".".join(parts) not in MODULES:
                parts = parts[:-1]
            target = ".".join(parts)
            if target in MODULES and target != name:
                found.add(target)
    return found


GRAPH = {name: imports(name) for name in MODULES}


@pytest.mark.parametrize("name", sorted(MODULES), ids=lambda n: n or "gradsync")
def test_a_module_imports_only_its_own_layer_or_below(name: str) -> None:
    own = layer_of(name)
    upward = sorted(t for t in GRAPH[name] if layer_of(t) > own)
    assert not upward, (
        f"gradsync.{name} ({LAYERS[own][0]}) imports "
        + ", ".join(f"gradsync.{t} ({LAYERS[layer_of(t)][0]})" for t in upward)
        + ": pass what it needs in as data instead"
    )


def test_no_import_cycle() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in MODULES:
        if name not in index:
            visit(name)
    assert not cycles, f"import cycles: {cycles}"


def test_the_check_sees_function_level_and_type_checking_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .plan import Plan\n"
        "def later():\n    from . import tuner\n    import gradsync.bench.train\n"
    )
    assert imports("ddp", source) == {"plan", "tuner", "bench.train"}
    assert imports("sim.engine", "from ..cost import Link\nfrom . import quick\n") == {"cost", "sim.quick"}


def test_importing_gradsync_leaves_fsdp_and_the_tools_unimported() -> None:
    # torch.distributed.fsdp costs every rank ~0.9 s at start (DTensor); only an FSDP2 user, who
    # imported it already, should pay it (gradsync.fsdp loads on such a model only). The tools are
    # never the library's.
    script = "import sys, gradsync; print(sorted(m for m in sys.modules if m.startswith(PREFIXES)))"
    prefixes = (
        "torch.distributed.fsdp",
        "torch.distributed.tensor",
        "gradsync.fsdp",
        *("gradsync.bench", "gradsync.cli", "gradsync.testbed", "gradsync.workloads", "gradsync.demo"),
        "gradsync.__main__",
    )
    script = script.replace("PREFIXES", repr(prefixes))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
