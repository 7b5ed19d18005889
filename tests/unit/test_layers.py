"""The package's layers import only downward, and no modules import each other in a circle.

The order below is the one docs/architecture.md draws; every import counts, function-level ones included (a
circle held open by an import inside a function is still a circle).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "clustertrain"
# top to bottom: a layer may import the layers below it, never those above
LAYERS = ["cli", "doctor", "launch", "train inference harness", "resolve", "plan", "checkpoint", "parallel", "model", "lora", "data", "distributed", "config",
          "errors files torch_check run_dir hardware"]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names.split()}


def imports() -> dict[str, set[str]]:
    """Each module of the package (dotted name) and the package modules it imports."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "clustertrain":
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names if alias.name.startswith("clustertrain."))
        found[module] = names
    return {module: {name for name in names if name in found and name != module} for module, names in found.items()}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "errors"  # the package's __init__: its version, nothing else
    return "cli" if parts[1] == "__main__" else parts[1]


def test_every_module_has_a_layer():
    assert {layer(m) for m in imports()} <= set(RANK)


def test_layers_import_only_downward():
    upward = [f"{module} ({layer(module)}) imports {name} ({layer(name)})"
              for module, names in imports().items() if layer(module) in RANK
              for name in names if layer(name) in RANK and RANK[layer(name)] < RANK[layer(module)]]
    assert not upward, "\n".join(upward)


def test_no_import_circles():
    graph = imports()
    circles = []

    def visit(module: str, path: list[str]) -> None:
        for name in graph[module]:
            if name in path:
                circles.append(" -> ".join(path[path.index(name):] + [name]))
            elif name not in done:
                visit(name, path + [name])
        done.add(module)

    done: set[str] = set()
    for module in graph:
        if module not in done:
            visit(module, [module])
    assert not circles, "\n".join(sorted(set(circles)))
