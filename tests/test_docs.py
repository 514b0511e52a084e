"""The documentation site builds cleanly and every example in it runs as written.

- Each Markdown page under docs/ is one test: Sybil (a library that runs the code blocks
  of documentation under pytest) runs its ```python blocks in order, in one namespace per
  page, including the hidden ``<!-- invisible-code-block: python -->`` blocks that assert
  what the visible ones claim; a line ``# prints TEXT`` (alone or after a ``print(...)``)
  must match what the block printed, line for line. Its ```console blocks run each
  ``$ gqakv ...`` command in this process and compare the whole output (a line ``...``
  stands for any lines); a command with no output shown must exit 0.
- ``<!-- skip: start if(condition, reason="...") -->`` ... ``<!-- skip: end -->`` skips the
  blocks between where their dependencies are missing, with the reason (the transformers
  guide without torch).
- ``sphinx-build -W -n`` (warnings as errors, nitpicky: every reference must resolve)
  builds the site into a temporary folder, and every public name of gqakv is on a
  reference page.
- The figure script runs on tiny inputs (the committed figures are not redrawn here).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import re
import shlex
import time
import zlib
from pathlib import Path

import pytest

pytest.importorskip("sybil", reason="sybil not installed (pip install -e '.[docs]'; the test extra has it)")
from sybil import Sybil  # noqa: E402
from sybil.evaluators.python import pad  # noqa: E402
from sybil.parsers.markdown import CodeBlockParser, SkipParser  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PRINTS = re.compile(r"#\s*prints (.*)$")


# -- running the examples of a page ----------------------------------------------------------


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
    """Each ``$ gqakv ARGS`` line runs ``gqakv.cli.main(ARGS)`` here; the lines after it,
    up to the next ``$``, are its whole output (stdout then stderr)."""
    __tracebackhide__ = True
    from gqakv import cli

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


# guides/scaling.md is run by tests/test_distributed.py (its blocks need torch.distributed
# and its console blocks are torchrun commands).
OWN_TESTS = {"guides/scaling.md"}
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts and p.name != "README.md"
               and str(p.relative_to(DOCS)) not in OWN_TESTS)
# Reading the real model's GGUF file takes tens of seconds: with the slow real-model tests.
SLOW_PAGES = {"guides/real-model.md"}


@pytest.mark.parametrize("page", [pytest.param(p, marks=[pytest.mark.slow] if str(p.relative_to(DOCS)) in SLOW_PAGES
                                                else [], id=str(p.relative_to(DOCS))) for p in PAGES])
def test_page_examples_run_as_written(page):
    run_page(page)


def test_every_guide_has_examples_that_run():
    """A guide without a python or console block would pass without running anything."""
    for page in (DOCS / "guides").glob("*.md"):
        if page.name in ("index.md", "scaling.md"):
            continue
        kinds = re.findall(r"^```(python|console)$|invisible-code-block: python", page.read_text(), re.M)
        assert kinds, f"{page.relative_to(ROOT)} has no example the tests run"


# -- the build ---------------------------------------------------------------------------------


# Sphinx's warnings are the test's subject (-W makes each one an error); Python's deprecation
# warnings that Sphinx extensions raise about Sphinx's own next versions are not.
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning")
def test_sphinx_build_has_no_warnings(tmp_path):
    """The site builds with warnings as errors and nitpicky references; every public name of
    gqakv (``gqakv.__all__``) and of its documented modules is on a reference page."""
    pytest.importorskip("sphinx", reason="sphinx not installed (pip install -e '.[docs]')")
    from sphinx.cmd.build import build_main

    out = tmp_path / "html"
    start = time.perf_counter()
    # In this process: gqakv, torch and transformers (the integration's reference imports
    # them) are already imported by the examples above, which saves seconds of imports.
    log = tmp_path / "warnings.txt"
    status = build_main(["-W", "--keep-going", "-n", "-q", "-w", str(log), "-b", "html",
                         "-d", str(tmp_path / "doctrees"), str(DOCS), str(out)])
    assert status == 0, log.read_text()
    print(f"sphinx-build: {time.perf_counter() - start:.1f} s")
    names = _inventory(out / "objects.inv")
    import gqakv

    missing = [n for n in gqakv.__all__ if f"gqakv.{n}" not in names]
    assert not missing, f"public names with no reference entry: {missing}"
    undocumented = [n for n in gqakv.__all__ if not inspect.getdoc(getattr(gqakv, n))]
    assert not undocumented, f"public names without a docstring: {undocumented}"
    for name in ("cache_bytes", "paged_cache_bytes", "max_batch", "max_len_for", "parse_bytes",
                 "tensor_parallel_traffic", "TensorParallelTraffic", "ModelConfig.per_device"):
        assert f"gqakv.sizing.{name}" in names
    for name in ("reorder", "fork", "truncate", "reset", "append", "live_kv"):
        assert f"gqakv.KVCache.{name}" in names
    from gqakv import distributed

    assert "gqakv.distributed" in names
    public = [n for n, o in vars(distributed).items() if not n.startswith("_")
              and (inspect.isclass(o) or inspect.isfunction(o)) and o.__module__ == distributed.__name__]
    missing = [n for n in public if f"gqakv.distributed.{n}" not in names]
    assert public and not missing, f"gqakv.distributed names with no reference entry: {missing}"
    for page in out.rglob("*.html"):  # MyST or reStructuredText that was not parsed
        html = page.read_text()
        for raw in ("```", "{eval-rst}", ".. auto", ":param ", "{py:"):
            assert raw not in html, f"raw markup {raw!r} in {page.relative_to(out)}"
    for figure in ("decode_bandwidth.png", "cache_memory.png", "concat_bytes.png"):
        assert list(out.rglob(figure)), f"figure {figure} missing from the built site"


def _inventory(path: Path) -> set[str]:
    """Object names in a Sphinx objects.inv (version 2: four header lines, then zlib)."""
    raw = path.read_bytes()
    body = raw.split(b"\n", 4)[4]
    return {line.split(" ", 1)[0] for line in zlib.decompress(body).decode().splitlines()}


def test_figure_script_runs_on_tiny_inputs(tmp_path, capsys):
    """make_figures.py measures (tiny shapes, numpy backend), saves its data, draws all three
    figures with the machine and date, and redraws them from the saved data."""
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install -e '.[docs]')")
    script = DOCS / "figures" / "make_figures.py"
    spec = importlib.util.spec_from_file_location("make_figures", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--tiny", "--out", str(tmp_path)]) == 0
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["cache_memory.png", "concat_bytes.png", "decode_bandwidth.png"]
    for p in tmp_path.glob("*.png"):
        p.unlink()
    assert module.main(["--from-data", "--out", str(tmp_path)]) == 0
    assert len(list(tmp_path.glob("*.png"))) == 3
    import json

    data = json.loads((tmp_path / "data" / "figures.json").read_text())
    assert {"cpu", "cores", "date", "load_avg_1min"} <= set(data["machine"])
    assert [r["config"]["prompt_lens"][0] for r in data["runs"]] == list(module.TINY["lengths"])
    assert all(r["decode_bytes_per_s"] > 0 and r["concat_bytes"] > r["live_bytes"] for r in data["runs"])
    mem = data["memory"]["bytes"]
    assert mem["live tokens bfloat16"] < mem["paged bfloat16"] < mem["contiguous bfloat16"]
    assert mem["contiguous int8"] < mem["contiguous bfloat16"]


def test_committed_figures_come_from_the_committed_data():
    """The committed data, docs/figures/data/figures.json, are full runs (Llama-3.1-8B
    layer shapes), not the tiny check's, and every committed PNG is a real drawing (over
    10 kB). That the PNGs were drawn from this data is not checked: redrawing it here
    would compare pixels across matplotlib versions."""
    import json

    data = json.loads((DOCS / "figures" / "data" / "figures.json").read_text())
    shapes = {(r["config"]["heads"], r["config"]["kv_heads"], r["config"]["head_dim"]) for r in data["runs"]}
    assert shapes == {(32, 8, 128)}
    for name in ("decode_bandwidth.png", "cache_memory.png", "concat_bytes.png"):
        assert (DOCS / "figures" / name).stat().st_size > 10_000
