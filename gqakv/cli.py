"""The ``gqakv`` command: ``info``, ``bench`` (the default job), ``size``, ``generate``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; they are imported only when chosen.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS = {
    "bench": ("gqakv.bench", "run a Llama-3.1-8B-shaped prefill + decode workload (default)"),
    "info": ("gqakv.info", "list the backends, whether each can run here, and why not"),
    "size": ("gqakv.sizing", "KV cache bytes for a model, and the largest batch/length that fits"),
    "generate": ("gqakv.examples.generate", "greedy generation with the example Llama model"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gqakv", description="Grouped-query attention over a preallocated KV cache.")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ImportError as exc:  # an optional piece missing must not break the others
            p.set_defaults(_import_error=exc)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["bench", *argv]  # the main job is the default
    args = build_parser().parse_args(argv)
    if getattr(args, "_import_error", None) is not None:
        print(f"gqakv {args.command}: unavailable ({args._import_error})", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
