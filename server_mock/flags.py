"""How a declared setting becomes a ``pytrio-worker serve`` flag: ``setting`` declares a field with its help, bounds
and ``--help`` section; ``add_flags`` turns a settings class into flags whose help ends with the default (in bytes or
seconds where that is the unit); ``from_args`` builds the class back from parsed flags, checking the bounds. What
the settings are is server_mock/config.py."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, field, fields
from typing import Any

# The --help sections, in the order they are printed: a setting's ``group`` is one of these keys
GROUPS = {
    "serve": "serving",
    "bodies": "limits: request bodies and connections",
    "sampling": "limits: sampling",
    "training": "limits: training",
    "tenants": "limits: per API key and worker-wide",
    "storage": "limits: storage, checkpoints and results",
    "limits": "limits: other",
    "tinker": "protocols: Tinker (the official tinker SDK; docs/tinker.md)",
    "pytrio": "protocols: PyTRIO (the official pytrio SDK; docs/pytrio.md)",
    "model": "forward/backward and decoding",
    "ray": "Ray cluster (pip install -e .[worker,cluster]; docs/scaling.md)",
}


def setting(default: Any, help: str, *, flag: str | None = None, choices: dict[str, Any] | None = None,
            minimum: float | None = None, maximum: float | None = None, why: str = "",
            metavar: str | None = None, group: str | None = None, aliases: tuple[str, ...] = (),
            parse: Any = None, shown: str | None = None) -> Any:
    """A field with its flag's help text; ``choices`` maps flag values to field values, ``minimum`` and ``maximum``
    are checked by ``from_args`` (``why`` says what the bounds mean). ``group`` is a key of ``GROUPS``;
    ``aliases`` are older names the flag keeps answering to; ``parse`` turns the flag's text into the value;
    ``shown`` is how --help shows a default that is not a value. A list default makes a repeatable flag."""
    assert group is None or group in GROUPS, f"unknown settings group {group!r}"
    meta = {"help": help, "flag": flag, "choices": choices, "minimum": minimum, "maximum": maximum, "why": why,
            "metavar": metavar, "group": group, "aliases": aliases, "parse": parse, "shown": shown}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _flag(f) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _default(f) -> Any:
    return f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default


def _is_bytes(f) -> bool:
    metavar = f.metadata.get("metavar")
    return metavar == "BYTES" if metavar else "bytes" in f.name


def _is_seconds(f) -> bool:
    metavar = f.metadata.get("metavar")
    if metavar:
        return metavar == "S"
    return any(word in f.name for word in ("seconds", "ttl", "timeout", "_wait", "keepalive"))


def _sized(n: int) -> str:
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if n >= 1024 ** power and n % 1024 ** power == 0:
            return f"{n // 1024 ** power} {unit}"
    return f"{n} bytes"


def shown_default(f) -> str:
    """The field's default as its help shows it: by unit (64 MiB, 1800 s), a choice's name, on/off, none."""
    default, meta = _default(f), f.metadata
    if meta.get("shown"):
        return meta["shown"]
    if meta.get("choices"):
        return {value: name for name, value in meta["choices"].items()}[default]
    if isinstance(default, bool):
        return "off"  # the flag not given
    if default is None or default == []:
        return "none"
    if isinstance(default, int) and _is_bytes(f) and default:
        return _sized(default)
    if isinstance(default, (int, float)):
        return f"{default:g} s" if _is_seconds(f) else f"{default:g}" if isinstance(default, float) else str(default)
    return str(default)


def _metavar(f) -> str | None:
    if f.metadata.get("metavar"):
        return f.metadata["metavar"]
    default = _default(f)
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return "BYTES" if _is_bytes(f) else "S" if _is_seconds(f) else "N"
    return None


def _section(parser: argparse.ArgumentParser, key: str) -> argparse._ArgumentGroup:
    """The argument group of ``GROUPS[key]``, made once per parser."""
    sections = parser.__dict__.setdefault("_setting_sections", {})
    if key not in sections:
        sections[key] = parser.add_argument_group(GROUPS[key])
    return sections[key]


def add_sections(parser: argparse.ArgumentParser) -> None:
    """Make every group of ``GROUPS`` now, so that --help lists them in that order whatever is added first."""
    for key in GROUPS:
        _section(parser, key)


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One flag per field of the settings dataclass ``cls``, under its group (given a parser; given an argument
    group, every flag goes there), its help ending with its default."""
    for f in fields(cls):
        meta, default = f.metadata, _default(f)
        assert default is not MISSING, f"{cls.__name__}.{f.name} needs a default to be a flag"
        target = parser
        if isinstance(parser, argparse.ArgumentParser):
            target = _section(parser, meta.get("group") or getattr(cls, "GROUP", "limits"))
        names = [_flag(f), *meta.get("aliases", ())]
        help_text = f"{meta['help']} (default: {shown_default(f)})"
        if meta.get("choices"):
            names_of = {value: name for name, value in meta["choices"].items()}
            target.add_argument(*names, dest=f.name, default=names_of[default], choices=list(meta["choices"]),
                                help=help_text)
        elif isinstance(default, bool):
            target.add_argument(*names, dest=f.name, action="store_false" if default else "store_true",
                                help=help_text)
        elif isinstance(default, list):
            target.add_argument(*names, dest=f.name, action="append", type=meta.get("parse") or str, default=[],
                                metavar=_metavar(f), help=help_text)
        else:
            kind = meta.get("parse") or (str if default is None else type(default))
            target.add_argument(*names, dest=f.name, type=kind, default=default, metavar=_metavar(f),
                                help=help_text)


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """The settings dataclass ``cls`` from parsed flags; a ``ValueError`` naming the flag for a value out of range."""
    values = {}
    for f in fields(cls):
        value = getattr(args, f.name)
        if f.metadata.get("choices"):
            value = f.metadata["choices"][value]
        minimum = f.metadata.get("minimum")
        maximum = f.metadata.get("maximum")
        why = f.metadata.get("why")
        if minimum is not None and value < minimum:
            raise ValueError(f"{_flag(f)} must be >= {minimum:g}" + (f" ({why})" if why else ""))
        if maximum is not None and value > maximum:
            raise ValueError(f"{_flag(f)} must be <= {maximum:g}" + (f" ({why})" if why else ""))
        values[f.name] = value
    return cls(**values)
