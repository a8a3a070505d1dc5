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


SHARED = ("pytrio_compat.wire", "pytrio_compat.export")  # the protocol, and the exporter both CLIs run


def _shared(name: str) -> bool:
    return any(name == s or name.startswith(s + ".") for s in SHARED)


def test_the_worker_imports_only_the_wire_module_and_the_exporter_of_the_client():
    found = {f: sorted(n for n in names if n.split(".")[0] == "pytrio_compat" and not _shared(n))
             for f, names in _imports("server_mock").items()}
    assert not {f: n for f, n in found.items() if n}, "import these through pytrio_compat.wire"
    assert any("pytrio_compat.wire" in names for names in _imports("server_mock").values())  # the scan sees imports
    assert any("pytrio_compat.export" in names for names in _imports("server_mock").values())


def test_the_exporter_stands_alone():
    """pytrio_compat.export imports nothing else of the SDK (relative imports stay inside it) and no heavy
    library at import time, so the worker's CLI can use it."""
    heavy = {"torch", "transformers", "safetensors", "gguf", "peft", "numpy", "httpx"}
    for path in sorted((ROOT / "pytrio_compat" / "export").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:  # module level only: functions import their heavy libraries when they run
            if isinstance(node, ast.ImportFrom):
                assert node.level == 1 or node.module == "__future__" or node.module.split(".")[0] not in (
                    "pytrio_compat", *heavy), f"{path.name}: from {node.module} import ..."
                assert node.level <= 1, f"{path.name}: imports from outside pytrio_compat.export"
            elif isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & (heavy | {"pytrio_compat"}), path.name


def test_the_client_never_imports_the_worker():
    found = {f: sorted(n for n in names if n.split(".")[0] == "server_mock")
             for f, names in _imports("pytrio_compat").items()}
    assert not {f: n for f, n in found.items() if n}
