"""The ``export`` command both command lines share: ``pytrio-compat export`` and ``pytrio-worker export``.

    export ADAPTER [--base MODEL] [--merged OUT] [--gguf OUT.gguf [--gguf-dtype auto|f32|f16|bf16]] [--overwrite]

ADAPTER is a checkpoint archive (``download_checkpoint``'s tar) or an adapter folder (the worker CLI also
takes a ``trio://`` path in its --storage). MODEL, the base model, defaults to the adapter's
``base_model_name_or_path``: a folder, or a Hugging Face id the caller's resolver can fetch.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from .adapter import CONFIG_FILE, ExportError, extract_archive

__all__ = ["ExportError", "add_arguments", "hub_or_folder", "run"]
from .gguf_file import DTYPES, write_gguf
from .merge import merge


def add_arguments(parser: argparse.ArgumentParser, adapter_help: str) -> None:
    parser.add_argument("adapter", metavar="ADAPTER", help=adapter_help)
    parser.add_argument("--base", metavar="MODEL", help="the base model: a folder or a Hugging Face id (default: the "
                                                        "adapter's base_model_name_or_path)")
    parser.add_argument("--merged", metavar="OUT", help="write the merged model here: safetensors shards, config, "
                                                        "tokenizer and generation config")
    parser.add_argument("--gguf", metavar="OUT.gguf", help="also write a GGUF for llama.cpp / Ollama (Llama, Mistral, "
                                                           "Qwen2 and Qwen3 models)")
    parser.add_argument("--gguf-dtype", default="auto", choices=DTYPES,
                        help="GGUF tensor type (default: the merged model's)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")


def hub_or_folder(name: str) -> Path:
    """A local base model folder: ``name`` itself, or its Hugging Face snapshot (weights as safetensors only)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja",
                                                            "*.tiktoken", "tokenizer*"]))
    except Exception as exc:  # noqa: BLE001 - offline, unknown id, no access: all mean "give me a folder"
        raise ExportError(f"base model {name!r} is not a folder and could not be fetched from the Hugging Face hub "
                          f"({type(exc).__name__}: {exc}); pass --base FOLDER") from None


def run(options: argparse.Namespace, adapter_folder: Callable[[str], Path | None] = lambda _: None,
        resolve_base: Callable[[str], Path] = hub_or_folder) -> int:
    """Run the export; 0 on success, 2 with the reason on stderr when it cannot be done as asked.
    ``adapter_folder(ADAPTER)`` may map the argument to a folder first (the worker's trio:// paths)."""
    if not options.merged and not options.gguf:
        print("export: nothing to do: pass --merged OUT and/or --gguf OUT.gguf", file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="pytrio-export-") as scratch:
            folder = adapter_folder(options.adapter) or Path(options.adapter)
            if folder.is_file():
                folder = extract_archive(folder, Path(scratch) / "adapter")
            elif not folder.is_dir():
                raise ExportError(f"{options.adapter}: no such archive or adapter folder")
            base = options.base or _adapter_base(folder)
            merged = Path(options.merged) if options.merged else Path(scratch) / "merged"
            report = {"merged": merge(resolve_base(base), folder, merged, overwrite=options.overwrite)}
            if options.gguf:
                gguf = write_gguf(merged, Path(options.gguf), options.gguf_dtype)
                report["gguf"] = {k: v for k, v in gguf.items() if k != "tensors"}
            if not options.merged:
                report.pop("merged")
    except ExportError as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1))
    return 0


def _adapter_base(folder: Path) -> str:
    try:
        base = json.loads((folder / CONFIG_FILE).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, RecursionError):
        base = None
    if not isinstance(base, str) or not base:
        raise ExportError(f"{folder / CONFIG_FILE} names no base model: pass --base MODEL")
    return base
