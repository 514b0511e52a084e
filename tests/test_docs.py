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

import importlib.util
import inspect
import re
import time
import zlib
from pathlib import Path

import pytest

from .support.docs import run_page  # skips this module where sybil is not installed

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


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
        assert f"gqakv.storage.sizing.{name}" in names
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
    _check_reference_details(out, names)


def _check_reference_details(out: Path, names: set[str]) -> None:
    """Internal helpers stay off the reference; each argument has its own description; code
    blocks wrap long lines (no horizontal scroll)."""
    assert "gqakv.KVCache.view_of" not in names and "gqakv.KVCache._view_of" not in names
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", (out / "reference" / "caches.html").read_text()))
    described = re.findall(r"num_pages – ([^.]*)", text)
    assert described and not any("tokens per page" in d for d in described), described
    index = (out / "index.html").read_text()
    assert "code-wrap.css" in index
    css = next(out.rglob("code-wrap.css")).read_text()
    assert re.search(r"\.highlight pre,\s*pre\.literal-block \{[^}]*white-space: pre-wrap", css), css


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
    # each point: its start time and the load average just before and after it, on the figure
    for r in data["runs"]:
        assert {"date", "load_before", "load_after"} <= set(r) and r["date"].endswith("UTC")
        assert len(r["loads_of_repeats"]) == r["repeats"]
    import matplotlib.pyplot as plt

    fig = plt.figure()
    module._stamp(fig, data)
    stamp = " ".join(t.get_text() for t in fig.texts)
    plt.close(fig)
    lo = min(min(r["load_before"], r["load_after"]) for r in data["runs"])
    assert data["machine"]["started"] in stamp and data["machine"]["date"] in stamp
    assert f"1-minute load average before/after each point: {lo:g} to" in stamp, stamp


def test_figure_script_waits_for_a_quiet_machine(monkeypatch):
    """--max-load: before a point, the script waits until the load average falls to the
    value (or the wait runs out), and returns the load it measured at."""
    script = DOCS / "figures" / "make_figures.py"
    spec = importlib.util.spec_from_file_location("make_figures", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loads, slept = iter([9.0, 6.0, 1.5, 0.5]), []
    monkeypatch.setattr(module, "load_average", lambda: next(loads))
    monkeypatch.setattr(time, "sleep", slept.append)
    assert module.wait_for_load(2.0, max_wait_s=100, poll_s=10) == 1.5 and slept == [10, 10]
    loads = iter([9.0, 9.0, 9.0])
    assert module.wait_for_load(2.0, max_wait_s=10, poll_s=10) == 9.0  # measured anyway
    assert module.wait_for_load(None, max_wait_s=10) == 9.0


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


# Run in a child process: torch and transformers made unimportable (as in a venv with only
# the docs extra), then sphinx-build as the README runs it.
_HIDDEN_BUILD = r"""
import sys

HIDDEN = ("torch", "transformers")
tried = []


class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            tried.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None


sys.meta_path.insert(0, Hide())
from sphinx.cmd.build import build_main

status = build_main(sys.argv[1:])
real = [n for n in HIDDEN if n in sys.modules and getattr(sys.modules[n], "__file__", None)]
print("real modules imported:", real)
sys.exit(status)
"""


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_sphinx_build_without_torch_or_transformers(tmp_path):
    """The README's docs build with only the docs extra: torch and transformers cannot be
    imported, the build still has no warnings, and the Integrations page documents the
    transformers integration (autodoc reads it against mocked torch/transformers)."""
    pytest.importorskip("sphinx", reason="sphinx not installed (pip install -e '.[docs]')")
    import subprocess
    import sys

    out, log = tmp_path / "html", tmp_path / "warnings.txt"
    done = subprocess.run([sys.executable, "-c", _HIDDEN_BUILD, "-W", "--keep-going", "-n", "-q", "-w", str(log),
                           "-b", "html", "-d", str(tmp_path / "doctrees"), str(DOCS), str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, log.read_text() if log.exists() else done.stderr
    assert "real modules imported: []" in done.stdout, done.stdout
    names = _inventory(out / "objects.inv")
    for name in ("register", "GqakvCache", "GqakvLayer", "GqakvLayer.reorder_cache", "gqakv_attention",
                 "gqakv_mask", "CACHE_KWARG"):
        assert f"gqakv.integrations.transformers.{name}" in names, name
    page = (out / "reference" / "integrations.html").read_text()
    assert "max_cache_len" in page and "beam" in page.lower()
