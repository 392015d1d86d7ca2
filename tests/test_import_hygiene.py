"""How core's modules import each other, read from their source: core never imports a plugin (plugins
come in only through the registry's entry points), and no two modules of core import each other, even
lazily inside a function or only for type checking; ``import mlxchat`` loads no plugin, no test or
fixture-building library."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "core"


def module_name(path: Path) -> str:
    parts = ["mlxchat", *path.relative_to(CORE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(CORE.rglob("*.py"))}


def imported(name: str) -> set[str]:
    """Every module ``name`` imports anywhere in its source (absolute names; ``from a import b`` counts
    ``a.b`` too when that is a module)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            found.add(target)
            found |= {f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in MODULES}
    return found


def core_graph() -> dict[str, set[str]]:
    """Module -> the core modules it imports, leaving out its own enclosing packages (importing a module
    always imports those first)."""
    return {name: {m for m in imported(name) if m in MODULES and m != name and not name.startswith(m + ".")}
            for name in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(group) > 1:
                found.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def plugin_packages() -> set[str]:
    return {entry.value.split(".")[0].split(":")[0]
            for entry in importlib.metadata.entry_points(group="mlxchat.plugins")}


def test_the_walk_sees_core_and_its_plugins() -> None:
    assert {"mlxchat", "mlxchat.registry", "mlxchat.layers.rope", "mlxchat.testing.parity"} <= set(MODULES)
    assert {"mlxchat_qwen3", "mlxchat_qwen35", "mlxchat_lfm2", "mlxchat_gemma4"} <= plugin_packages()
    assert "mlxchat.layers.rope" in core_graph()["mlxchat.layers"]


def test_core_never_imports_a_plugin() -> None:
    plugins = plugin_packages()
    offenders = {name: sorted(m for m in imported(name) if m.split(".")[0] in plugins) for name in MODULES}
    assert not {name: found for name, found in offenders.items() if found}


def test_core_has_no_import_circles() -> None:
    assert cycles(core_graph()) == []


def test_cycles_are_found_when_there_are_some() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_importing_mlxchat_loads_no_plugin_and_no_test_or_fixture_library() -> None:
    unwanted = sorted(plugin_packages() | {"pytest", "_pytest", "torch", "transformers", "mlx_lm"})
    code = f"import sys, mlxchat; print(sorted({{m.split('.')[0] for m in sys.modules}} & set({unwanted!r})))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
