"""The worker shares only the wire protocol module with the client, and the client never imports the worker."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(package: str) -> dict[str, set[str]]:
    """Every absolute module a package's sources import, by file."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
        out[str(path.relative_to(ROOT))] = names
    return out


def test_the_worker_imports_only_the_wire_module_of_the_client():
    found = {f: sorted(n for n in names if n.split(".")[0] == "pytrio_compat" and n != "pytrio_compat.wire")
             for f, names in _imports("server_mock").items()}
    assert not {f: n for f, n in found.items() if n}, "import these through pytrio_compat.wire"
    assert any("pytrio_compat.wire" in names for names in _imports("server_mock").values())  # the scan sees imports


def test_the_client_never_imports_the_worker():
    found = {f: sorted(n for n in names if n.split(".")[0] == "server_mock")
             for f, names in _imports("pytrio_compat").items()}
    assert not {f: n for f, n in found.items() if n}
