"""``pytrio-compat``: run unmodified PyTRIO scripts against this SDK.

    pytrio-compat run SCRIPT.py [ARGS...]        (or: python -m pytrio_compat run ...)

runs the script as ``python SCRIPT.py ARGS...`` would, with ``import pytrio`` answered by
``pytrio_compat`` (see pytrio_alias.py). If a real ``pytrio`` is importable, ``run`` stops with an
error rather than pick one silently; ``run --override`` then runs the script on this SDK anyway.

    pytrio-compat export ARCHIVE_OR_FOLDER --base MODEL --merged OUT [--gguf OUT.gguf]

merges a downloaded checkpoint into its base model (see pytrio_compat/export/).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from . import __version__, pytrio_alias
from .export import cli as export_cli


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pytrio-compat", description="Run PyTRIO scripts against pytrio_compat.")
    parser.add_argument("-V", "--version", action="version", version=f"pytrio_compat {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a script that imports pytrio, on this SDK",
                         description="Run SCRIPT with `import pytrio` answered by pytrio_compat.")
    run.add_argument("--override", action="store_true",
                     help="use this SDK even though a real pytrio is installed (for this script only)")
    run.add_argument("script", help="the Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    export = sub.add_parser("export", help="merge a downloaded checkpoint into its base model (and write a GGUF)",
                            description="Merge a checkpoint's LoRA into its base model: a full Hugging Face model "
                                        "folder that computes what the worker computed with the adapter.")
    export_cli.add_arguments(export, "a checkpoint archive (.tar, from RestClient.download_checkpoint) or an "
                                     "adapter folder")
    return parser


def run_script(script: str, args: list[str], override: bool = False) -> int:
    if not os.path.isfile(script):
        print(f"pytrio-compat run: no such script: {script}", file=sys.stderr)
        return 2
    real = pytrio_alias.real_pytrio_spec()
    if real is not None and not override:
        where = real.origin or ", ".join(real.submodule_search_locations or []) or "sys.path"
        print(f"pytrio-compat run: a real pytrio is installed ({where}); refusing to choose between it and "
              "pytrio_compat. Run the script with plain `python` to use the real pytrio, or with "
              "`pytrio-compat run --override` to use pytrio_compat.", file=sys.stderr)
        return 2
    pytrio_alias.install()
    sys.argv = [script, *args]
    sys.path[0:1] = [os.path.dirname(os.path.abspath(script))]  # as `python SCRIPT.py` would
    runpy.run_path(script, run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    if options.command == "run":
        return run_script(options.script, options.args, options.override)
    if options.command == "export":
        return export_cli.run(options)
    return 2  # pragma: no cover - argparse requires a command


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
