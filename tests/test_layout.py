"""The package's layout shows its architecture, and imports flow one way (no cycles)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "src" / "mha"


def imports() -> dict[str, set[str]]:
    """Each module's intra-package imports, as dotted names relative to ``mha``."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "mha"
        package = parts[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
                found.add(target or "mha")
        graph[name] = found
    return graph


def test_there_are_no_import_cycles():
    graph = imports()

    def visit(node, trail):
        assert node not in trail, " -> ".join([*trail, node])
        for target in graph.get(node, ()):
            if target in graph:
                visit(target, [*trail, node])

    for module in graph:
        visit(module, [])


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("_kernel", ("functional", "module", "integrations", "cli")),
        ("integrations.pytorch", ("module", "cli")),
        ("integrations.transformers", ("module", "cli")),
        ("integrations.npz", ("module", "functional", "cli")),
    ],
)
def test_lower_layers_never_import_upper_ones(folder, forbidden):
    for module, targets in imports().items():
        if module == folder or module.startswith(folder + "."):
            for target in targets:
                assert not target.startswith(forbidden), f"{module} imports {target}"
