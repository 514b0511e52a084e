"""Sphinx configuration for the gqakv documentation (see docs/README.md for why these tools).

Build: ``python -m sphinx -W --keep-going -n -b html docs docs/_build/html``; the tests
(tests/test_docs.py) run the same build, so a broken reference, a failing autodoc import or
a missing figure fails CI.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # gqakv from this checkout, installed or not

import gqakv  # noqa: E402
from sphinx.ext.napoleon.docstring import GoogleDocstring  # noqa: E402

project = "gqakv"
author = "the gqakv authors"
copyright = "the gqakv authors, Apache-2.0"
release = version = gqakv.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md", "figures/data"]

# -- MyST (Markdown) ---------------------------------------------------------------------------
myst_heading_anchors = 3  # [text](page.md#a-heading) links are checked like references

# -- autodoc / napoleon ------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True}
autoclass_content = "both"  # the class docstring and __init__'s
# The docs extra installs neither torch nor transformers (torch alone is hundreds of MB):
# without them autodoc imports gqakv.integrations.transformers against Sphinx's mock
# modules, so the Integrations page is documented from the docstrings either way. With
# them installed (CI's test extra) the real modules are imported, and nothing is mocked.
def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:  # missing, or installed but broken: mocked either way
        return False
    return True


autodoc_mock_imports = [name for name in ("torch", "transformers") if not _importable(name)]

# napoleon reads the Google-style sections (Args:, Returns:, Raises:); it is called from
# _docstring below rather than on its own, so that properties skip it (it would read a
# property's first line "K: the buffer ..." as "type: description").
napoleon_google_docstring = False
napoleon_numpy_docstring = False

# -- nitpicky: every cross-reference must resolve --------------------------------------------
# Annotations name types from other libraries; without network access (CI has none) there
# is no intersphinx inventory for them, so these are the only names let through.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(numpy|np|torch|cupy|transformers|array_api_strict|numba)(\..*)?"),
    (r"py:.*", r"(ArrayLike|NDArray|DTypeLike|Any|Callable|Iterator|Iterable|Sequence|Mapping)"),
    (r"py:class", r"(Cache|CacheLayerMixin|PretrainedConfig|ContextVar|Token|ModuleType)"),
    (r"py:class", r"(collections\.abc|typing|contextvars|types|dataclasses|enum)\..*"),
    (r"py:class", r"(optional|default .*|array|array-like|int|float|str|bool|tuple|list|dict)"),
    # private helpers that appear in public signatures
    (r"py:class", r"gqakv\.(caches\.cache\.Lengths|dispatch\.backend\.Route|caches\.cache\.RowsAndLengths|integrations\.transformers\.Padding)"),
]

# -- HTML --------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"gqakv {release}"
html_static_path = ["_static"]
html_css_files = ["code-wrap.css"]  # long code lines wrap (no horizontal scroll)
html_show_sourcelink = False
html_copy_source = False

# -- the docstrings' own conventions ---------------------------------------------------------
# gqakv's docstrings list fields as "name: description" lines, continued on indented lines
# (``scale: the softmax scale ...``), outside the Google sections too. As reStructuredText
# those are paragraphs run together; before napoleon sees them, each such line becomes a
# field of a field list (":name: description"), which renders as the docstring meant it.
NAME = r"[A-Za-z_][\w.]*(?:\[[^\]]*\])?"  # name, a.b, k[i]
FIELD = re.compile(rf"^(\s*)({NAME}(?:(?:, | / ){NAME})*): (\S.*)$")  # "k, v: ...", "lens / host_lens: ..."
ATTRIBUTES = re.compile(r"^Attributes( \(.*\))?:$")
SECTIONS = {"args", "arguments", "parameters", "params", "keyword args", "keyword arguments",
            "other parameters", "returns", "return", "yields", "yield", "raises",
            "example", "examples", "note", "notes", "warning", "warnings", "see also", "methods",
            "references", "todo"}


def _fields(lines: list[str]) -> None:
    out: list[str] = []
    in_section = in_literal = in_attributes = False
    literal_indent = field_indent = -1
    for line in lines:
        # "Attributes:" (or "Attributes (besides ...):") becomes a rubric over a field list:
        # napoleon's attribute entries would duplicate the properties documented as members.
        if ATTRIBUTES.match(line):
            out += [f".. rubric:: {line.strip().rstrip(':')}", ""]
            in_attributes, field_indent = True, -1
            continue
        if in_attributes:
            if line.strip() and not line[0].isspace():
                in_attributes = False
            else:
                line = line[4:] if line.startswith("    ") else line
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            field_indent = -1
            out.append(line)
            continue
        if indent == 0:
            in_section = line.strip().rstrip(":").lower() in SECTIONS and line.rstrip().endswith(":")
        if in_literal and indent <= literal_indent:
            in_literal = False
        if in_literal or (in_section and indent > 0):
            out.append(line)
            continue
        if 0 <= field_indent < indent:  # a field's continuation
            out.append(line)
            continue
        if line.rstrip().endswith("::"):
            in_literal, literal_indent = True, indent
        m = FIELD.match(line)
        if m and not in_section:
            field_indent = indent
            out.append(f"{m.group(1)}:{m.group(2)}: {m.group(3)}")
            continue
        if 0 <= field_indent and indent <= field_indent:
            out.append("")  # a paragraph after a field list needs a blank line
            field_indent = -1
        out.append(line)
    lines[:] = out


def _docstring(app, what, name, obj, options, lines):
    if what in ("property", "attribute", "data"):
        return  # plain reStructuredText
    _fields(lines)
    lines[:] = GoogleDocstring(lines, app.config, app, what, name, obj, options).lines()


def setup(app):
    app.connect("autodoc-process-docstring", _docstring)
