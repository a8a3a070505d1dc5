"""The worker's layers, checked on every run: each module imports only its own package and the layers below it,
the protocol packages never import each other, and no import circle exists anywhere in ``server_mock``.

Layers, top to bottom (docs/architecture.md draws them):
  cli / __main__  ->  app, connections  ->  api  ->  service  ->  cluster  ->  engine  ->  training, sampling,
  storage  ->  lora, config -> flags, errors
Inside ``api``, the shared plumbing (auth, bodies, endpoint, browser_safety, downloads) sits below the
protocol packages. Imports under ``if TYPE_CHECKING:`` count too: a type is a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "server_mock"

# rank: a module may import modules of a lower rank, or of its own unit (a package or module of the same name)
RANKS = [
    ("server_mock.__main__", 10), ("server_mock.cli", 9), ("server_mock.app", 8), ("server_mock.connections", 8),
    ("server_mock.allocator", 8),
    ("server_mock.api.native", 7), ("server_mock.api.tinker", 7), ("server_mock.api.openai", 7),
    ("server_mock.api.pytrio", 7), ("server_mock.operator", 7), ("server_mock.api", 6),
    ("server_mock.service", 5), ("server_mock.cluster", 4), ("server_mock.engine", 3),
    ("server_mock.training", 2), ("server_mock.sampling", 2), ("server_mock.storage", 2),
    ("server_mock.lora", 1), ("server_mock.config", 1), ("server_mock.flags", 0), ("server_mock.errors", 0),
]
PROTOCOLS = {"server_mock.api.native", "server_mock.api.tinker", "server_mock.api.openai", "server_mock.api.pytrio"}


def _unit(module: str) -> tuple[str, int]:
    if module == "server_mock":
        return module, 11
    for prefix, rank in RANKS:
        if module == prefix or module.startswith(prefix + "."):
            return prefix, rank
    raise AssertionError(f"{module} belongs to no layer: add it to RANKS in tests/test_layers.py")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    """server_mock module -> the server_mock modules it imports (absolute, at any depth of the file)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py") if "_pb2" not in p.name}
    out: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{name}: relative import (the worker imports absolutely)"
                if node.module:  # `from pkg import submodule` depends on the submodule; `from pkg import name` on pkg
                    subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                    found.update(subs)
                    if len(subs) < len(node.names):
                        found.add(node.module)
        out[name] = {m for m in found if m in modules and m != name}
    return out


def test_every_module_imports_only_its_own_unit_and_lower_layers():
    bad = []
    for module, targets in _imports().items():
        unit, rank = _unit(module)
        for target in targets:
            target_unit, target_rank = _unit(target)
            if target_unit != unit and target_rank >= rank and not module.startswith(target_unit + "."):
                bad.append(f"{module} (layer {rank}) imports {target} (layer {target_rank})")
    assert not bad, "\n".join(sorted(bad))


def test_protocol_packages_never_import_each_other():
    bad = [f"{m} imports {t}" for m, targets in _imports().items() for t in targets
           if _unit(m)[0] in PROTOCOLS and _unit(t)[0] in PROTOCOLS and _unit(m)[0] != _unit(t)[0]]
    assert not bad, "\n".join(bad)


def test_no_import_circle_in_the_worker():
    graph = _imports()
    # Tarjan's strongly connected components: any component of more than one module is a circle
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not circles, circles


def test_the_scan_sees_the_imports():
    graph = _imports()
    assert "server_mock.engine.queue" in graph["server_mock.service.models"]  # a known arrow is found
    assert len(graph) > 50
