"""``import pytrio`` answered by this SDK, for scripts started with ``pytrio-compat run``.

Nothing here is active on a plain ``import pytrio_compat``: the alias is installed only by ``run``
(``install()``), in that process, and ``run`` installs it only when no real ``pytrio`` is importable
(or when told to with ``--override``). So a real PyTRIO installed beside this package is never
shadowed in ordinary imports.

Under the alias, ``pytrio`` and ``pytrio.X`` are ``pytrio_compat`` and ``pytrio_compat.X`` (the
same module objects), ``pytrio.errors.<anything>`` is ``pytrio_compat.errors`` (PyTRIO splits its
errors over several modules), and ``importlib.metadata.version("pytrio")`` is this package's version.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

ALIAS, TARGET = "pytrio", "pytrio_compat"


def real_pytrio_spec():
    """The spec of an importable ``pytrio`` other than this alias, or None."""
    if any(isinstance(f, AliasFinder) for f in sys.meta_path):
        return None
    try:
        return importlib.util.find_spec(ALIAS)
    except (ImportError, ValueError):
        return None


def target_name(fullname: str) -> str | None:
    """The pytrio_compat module that answers ``fullname`` (a pytrio module name), or None."""
    if fullname == ALIAS:
        return TARGET
    if not fullname.startswith(ALIAS + "."):
        return None
    rest = fullname[len(ALIAS) + 1:]
    if rest == "errors" or rest.startswith("errors."):
        return TARGET + ".errors"
    return f"{TARGET}.{rest}"


class _ExistingModule(importlib.abc.Loader):
    """Loads an alias as the already-imported target module itself."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        if spec.submodule_search_locations is not None and not hasattr(module, "__path__"):
            module.__path__ = []  # pytrio.errors is a package in PyTRIO: pytrio.errors.base must import
        return module

    def exec_module(self, module) -> None:
        """The target module ran when it was imported."""


class _Distribution(importlib.metadata.Distribution):
    """``pytrio`` as a distribution: its version is this package's."""

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            from . import __version__

            return f"Metadata-Version: 2.1\nName: {ALIAS}\nVersion: {__version__}\n" \
                   f"Summary: provided by {TARGET} (pytrio-compat run)\n"
        return None

    def locate_file(self, path) -> Path:
        return Path(__file__).parent / str(path)


class AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        name = target_name(fullname)
        if name is None:
            return None
        try:
            found = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            found = None
        if found is None:
            return None
        package = fullname == ALIAS or found.submodule_search_locations is not None or name == TARGET + ".errors"
        return importlib.machinery.ModuleSpec(fullname, _ExistingModule(name), is_package=package)

    def find_distributions(self, context=None):
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("-", "_") == ALIAS:
            yield _Distribution()


def install() -> AliasFinder:
    """Put the alias first on ``sys.meta_path`` (once); drop any ``pytrio`` modules imported before."""
    for finder in sys.meta_path:
        if isinstance(finder, AliasFinder):
            return finder
    for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
        del sys.modules[name]
    finder = AliasFinder()
    sys.meta_path.insert(0, finder)
    return finder
