"""Running a Markdown page's examples under pytest with Sybil (a library that runs the
code blocks of documentation): its ```python blocks in order in one namespace per page
(``# prints TEXT`` lines must match what a block printed), its ```console blocks as
``gqakv`` commands in this process (the lines after a ``$`` line are its whole output; a
line ``...`` stands for any lines), and ``<!-- skip: ... -->`` markers."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

pytest.importorskip("sybil", reason="sybil not installed (pip install -e '.[docs]'; the test extra has it)")
from sybil import Sybil  # noqa: E402
from sybil.evaluators.python import pad  # noqa: E402
from sybil.parsers.markdown import CodeBlockParser, SkipParser  # noqa: E402

PRINTS = re.compile(r"#\s*prints (.*)$")


def run_python(example) -> None:
    """exec the block in the page's namespace; its ``# prints`` lines must be its output."""
    __tracebackhide__ = True
    source = example.parsed
    out = io.StringIO()
    code = compile(pad(source, example.line + source.line_offset), example.path, "exec")
    with contextlib.redirect_stdout(out):
        exec(code, example.namespace)
    example.namespace.pop("__builtins__", None)
    expected = [m.group(1).rstrip() for line in source.splitlines() if (m := PRINTS.search(line))]
    got = [line.rstrip() for line in out.getvalue().splitlines()]
    assert got == expected, (f"{example.path}, line {example.line}: the block printed {got}, "
                             f"its '# prints' comments say {expected}")


def _matches(expected: list[str], got: list[str]) -> bool:
    """Line for line, a line '...' standing for any number of lines."""
    if not expected:
        return not got
    if expected[0].strip() == "...":
        return any(_matches(expected[1:], got[i:]) for i in range(len(got) + 1))
    return bool(got) and expected[0] == got[0] and _matches(expected[1:], got[1:])


def run_console(example) -> None:
    """Each ``$ gqakv ARGS`` line runs ``gqakv.tools.cli.main(ARGS)`` here; the lines after it,
    up to the next ``$``, are its whole output (stdout then stderr)."""
    __tracebackhide__ = True
    from gqakv.tools import cli

    commands: list[tuple[str, list[str]]] = []
    for line in example.parsed.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif commands:
            commands[-1][1].append(line.rstrip())
    assert commands, f"{example.path}, line {example.line}: a console block without a '$ ' command"
    for command, expected in commands:
        argv = shlex.split(command, comments=True)
        assert argv[0] == "gqakv", f"console blocks run gqakv commands only, not {command!r}"
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(argv[1:])
        got = (out.getvalue() + err.getvalue()).rstrip("\n").splitlines()
        while expected and not expected[-1]:
            expected.pop()
        if not expected:
            assert rc == 0, f"$ {command}: exit status {rc}\n{err.getvalue()}"
            continue
        errors = any(line.startswith("gqakv: error:") for line in expected)
        assert rc == (2 if errors else 0), f"$ {command}: exit status {rc}"
        assert _matches(expected, [g.rstrip() for g in got]), (
            f"$ {command}\nthe page shows:\n" + "\n".join(expected) + "\nit printed:\n" + "\n".join(got))


SYBIL = Sybil(
    parsers=[CodeBlockParser("python", run_python), CodeBlockParser("console", run_console),
             SkipParser()],
    patterns=["*.md"],
)


def run_page(path: Path) -> dict:
    """Every example of one Markdown page, in order; returns the page's namespace after them
    (with ``__examples_run__``: how many examples ran)."""
    document = SYBIL.parse(path)
    ran = 0
    try:
        for example in document.examples():
            example.evaluate()
            ran += 1
        return {**document.namespace, "__examples_run__": ran}
    finally:
        document.namespace.clear()
