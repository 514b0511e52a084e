"""The ``gqakv`` command: ``info``, ``bench`` (the default job), ``size``, ``generate``,
``selftest``, ``work``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; they are imported only when chosen.

Errors: a user error (a bad flag or value, a backend that does not exist or cannot run
here, a bad ``GQAKV_*`` environment variable, a size that does not fit) prints one line
``gqakv: error: ...`` on stderr and exits 2. Which exceptions count as user errors is
``USER_ERRORS`` below; anything else is a bug in gqakv and keeps its traceback (exit 1).
``--debug`` (before or after the subcommand) shows the traceback of user errors too.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from ..dispatch.registry import BackendError
from .errors import UsageError  # noqa: F401  (re-exported: gqakv.tools.cli.UsageError)

# name -> (module, one-line help)
SUBCOMMANDS = {
    "bench": ("gqakv.tools.bench", "run a Llama-3.1-8B-shaped prefill + decode workload (default)"),
    "info": ("gqakv.tools.info", "list the backends, whether each can run here, and why not"),
    "size": ("gqakv.tools.size", "KV cache bytes for a model, and the largest batch/length that fit"),
    "generate": ("gqakv_examples.generate", "greedy generation with the example Llama model (random "
                                            "weights, or real ones: --model smollm2-135m, --gguf PATH)"),
    "selftest": ("gqakv.tools.selftest", "check every kernel family of a backend against the float64 "
                                   "reference (run this first on new hardware)"),
    "work": ("gqakv.tools.work_count", "count the instructions and simulated cache misses of fixed "
                                       "headline calls under valgrind: a benchmark metric that does "
                                       "not move with the machine's load"),
}

EXIT_USAGE = 2
DEBUG_FLAG = "--debug"


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the input was wrong", not "gqakv is broken".

    ValueError, TypeError, OverflowError, MemoryError and LookupError are what gqakv's
    validation raises for a bad value or a size that cannot be allocated; BackendError
    says a backend does not exist or cannot run here.
    """
    return (ValueError, TypeError, OverflowError, MemoryError, LookupError, BackendError)


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors in the one-line form of every other user error."""

    def error(self, message):
        raise _ArgparseError(message)


class _ArgparseError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gqakv", description="Grouped-query attention over a preallocated KV cache.")
    debug_help = "on an error, show the Python traceback (accepted anywhere on the line)"
    parser.add_argument(DEBUG_FLAG, action="store_true", help=debug_help)
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument(DEBUG_FLAG, action="store_true", default=argparse.SUPPRESS, help=debug_help)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ImportError as exc:  # an optional piece missing must not break the others
            p.set_defaults(_import_error=exc)
    return parser


def error_line(exc: BaseException) -> str:
    """The one line printed for a user error: multi-line messages joined with '; '."""
    text = str(exc)
    if isinstance(exc, KeyError) and exc.args:
        text = str(exc.args[0])  # KeyError's str() is the repr of its key
    parts = [p.strip() for p in text.splitlines() if p.strip()]
    text = "; ".join(parts) or type(exc).__name__
    return f"gqakv: error: {text}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug is global: take it out wherever it stands (before "--", which ends options).
    end = argv.index("--") if "--" in argv else len(argv)
    debug = DEBUG_FLAG in argv[:end]
    argv = [a for i, a in enumerate(argv) if i >= end or a != DEBUG_FLAG]
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["bench", *argv]  # the main job is the default
    try:
        args = build_parser().parse_args(argv)
    except _ArgparseError as exc:
        command = "gqakv " + argv[0] if argv[0] in SUBCOMMANDS else "gqakv"
        print(f"gqakv: error: {exc} (see '{command} --help')", file=sys.stderr)
        return EXIT_USAGE
    if getattr(args, "_import_error", None) is not None:
        print(f"gqakv: error: {args.command} is unavailable ({args._import_error})", file=sys.stderr)
        return EXIT_USAGE
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except _user_errors() as exc:
        sys.stdout.flush()
        if debug:
            traceback.print_exc()
        print(error_line(exc), file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
