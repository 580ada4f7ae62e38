"""The package's layout shows its architecture, and imports flow one way (no cycles)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "src" / "mha"


@functools.cache  # the files are read once a process: the graph is only read
def imports(runtime_only: bool = False) -> dict[str, set[str]]:
    """Each module's intra-package imports, as dotted names relative to ``mha``; with
    ``runtime_only``, without those under ``if TYPE_CHECKING:`` (annotations only)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "mha"
        package = parts[:-1]
        tree = ast.parse(path.read_text())
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
            for inner in ast.walk(node)
        }
        found = set()
        for node in ast.walk(tree):
            if runtime_only and id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
                if node.module:
                    found.add(target or "mha")
                else:  # from . import a, b: the modules a and b
                    found.update(".".join([*base, alias.name]) for alias in node.names)
        graph[name] = found
    return graph


@pytest.mark.parametrize("runtime_only", [True, False])
def test_there_are_no_import_cycles(runtime_only):
    """None at run time, and none for the type checker either."""
    graph = imports(runtime_only=runtime_only)
    assert_acyclic(graph)


def assert_acyclic(graph):
    """No module of ``graph`` reaches itself; a cycle is named by its trail. A module whose
    imports were all followed without one is not followed again (depth-first, linear time:
    following every path took 20 s a call)."""
    cleared = set()

    def visit(node, trail):
        assert node not in trail, " -> ".join([*trail, node])
        if node in cleared:
            return
        for target in graph.get(node, ()):
            if target in graph:
                visit(target, [*trail, node])
        cleared.add(node)

    for module in graph:
        visit(module, [])


def test_a_cycle_is_named_by_its_trail():
    """The check above fails on a cycle, however deep, and passes a diamond."""
    assert_acyclic({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()})
    with pytest.raises(AssertionError, match="a -> b -> c -> a"):
        assert_acyclic({"a": {"b"}, "b": {"c"}, "c": {"a"}})
    with pytest.raises(AssertionError, match="c -> d -> e -> c"):
        assert_acyclic({"a": {"c"}, "b": {"c"}, "c": {"d"}, "d": {"e"}, "e": {"c"}})


PUBLIC_PATHS = (
    "functional",
    "module",
    "cache",
    "rotary",
    "dask",
    "torch_compat",
    "flash_compat",
)
"""Modules that only re-export, so that the import paths users know stay where they were."""


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("_kernel", ("api", "integrations", "cli", *PUBLIC_PATHS)),
        ("api", ("cli", "integrations", *PUBLIC_PATHS)),
        ("integrations.pytorch", ("api", "cli", *PUBLIC_PATHS)),
        ("integrations.transformers", ("api", "cli", *PUBLIC_PATHS)),
        ("integrations.npz", ("api", "cli", *PUBLIC_PATHS)),
        ("integrations.dask", ("cli", *PUBLIC_PATHS)),
        ("integrations.torch_functional", ("cli", *PUBLIC_PATHS)),
        ("integrations.flash_attention", ("cli", *PUBLIC_PATHS)),
        ("integrations.flash_kvcache", ("cli", *PUBLIC_PATHS)),
        ("cli", PUBLIC_PATHS),
    ],
)
def test_lower_layers_never_import_upper_ones(folder, forbidden):
    for module, targets in imports().items():
        if module == folder or module.startswith(folder + "."):
            for target in targets:
                assert not target.startswith(forbidden), f"{module} imports {target}"


def test_public_paths_only_re_export_and_every_file_stays_readable():
    """The public import paths hold no code of their own, and no module of the package
    grows past what a reader holds in one sitting."""
    for name in PUBLIC_PATHS:
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        code = [node for node in tree.body if not isinstance(node, (ast.ImportFrom, ast.Import))]
        kinds = {type(node).__name__ for node in code}
        assert kinds <= {"Expr", "Assign"}, f"mha.{name} defines {kinds}"
    for path in PACKAGE.rglob("*.py"):
        lines = len(path.read_text().splitlines())
        assert lines <= 800, f"{path.relative_to(PACKAGE)} has {lines} lines: split it"


@pytest.mark.parametrize(
    ("where", "names"),
    [
        ("mha", ("scaled_dot_product_attention", "multi_head_attention", "merge_attention",
                 "MultiHeadAttention", "KVCache", "apply_rotary")),
        ("mha.functional", ("scaled_dot_product_attention", "multi_head_attention",
                            "merge_attention")),
        ("mha.module", ("MultiHeadAttention",)),
        ("mha.cache", ("KVCache",)),
        ("mha.rotary", ("apply_rotary",)),
        ("mha.torch_compat", ("multi_head_attention_forward",)),
        ("mha.cli", ("main", "entry")),
    ],
)  # fmt: skip
def test_public_import_paths_stay(where, names):
    import importlib

    module = importlib.import_module(where)
    for name in names:
        assert callable(getattr(module, name)), f"{where}.{name}"


def test_the_public_paths_are_attributes_after_import_mha_alone():
    """``import mha`` then ``mha.functional...``, as before the API moved under mha/api."""
    import subprocess
    import sys

    code = (
        "import mha; mha.functional.multi_head_attention; mha.module.MultiHeadAttention; "
        "mha.cache.KVCache; mha.rotary.apply_rotary; from mha.rotary import check_rotary"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
