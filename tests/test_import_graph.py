"""The package's import graph: no circles, layers that only look down.

Every module of gqakv/, backends/ (installed as ``gqakv_backends``) and gqakv_examples/ is
parsed (not imported) and every import of one of these modules is an edge, wherever it
stands: at module level, inside a function or under ``if TYPE_CHECKING``. Relative imports
are resolved; ``from package import name`` is an edge to the submodule ``package.name``
when that is a module, else to the package itself; importing ``a.b.c`` counts as an edge
to ``a.b.c`` only (its parent packages are imported first by Python, but that is not a
dependency one module chose). A package's ``__init__`` importing its own submodules is an
edge like any other.

A function-local import does not hide a circle here: a circle held apart by imports in
function bodies is still a circle (it breaks when someone moves the import to the top).

The test suite keeps one rule of its own: no module under tests/ imports a ``tests/test_*.py``
module (shared helpers live in tests/support/ and tests/cuda_emu/), so collecting or
running one test file never runs another's module code.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: installed package name -> source folder (pyproject's [tool.setuptools] package-dir)
PACKAGES = {"gqakv": ROOT / "gqakv", "gqakv_backends": ROOT / "backends",
            "gqakv_examples": ROOT / "gqakv_examples"}

#: The only part of gqakv/ allowed to import a backend plugin module by name (the self-test
#: and the benchmark reach into plugins' kernels and thread settings); every other part
#: goes through the registry, which loads plugins by entry point.
TOOLS = "gqakv.tools"
EXAMPLES = "gqakv_examples"
PLUGINS = "gqakv_backends"

#: The floors, lowest first: a module imports only from its own floor or those below. The
#: plugins sit on the caches' floor (they implement what the dispatch layer declares and
#: import core, storage, ops and dispatch, never a cache); ``gqakv`` is the package's
#: ``__init__`` (the public API), ``gqakv.distributed`` and ``gqakv.context_parallel`` run a
#: cache per rank.
LAYERS = [
    ("gqakv.core",),
    ("gqakv.storage",),
    ("gqakv.ops",),
    ("gqakv.dispatch",),
    ("gqakv.caches", PLUGINS),
    ("gqakv", "gqakv.distributed", "gqakv.context_parallel"),
    ("gqakv.integrations",),
    (TOOLS,),
    ("gqakv.__main__", EXAMPLES),
]


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the three packages."""
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _internal(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` is, or the innermost of our modules above it (an import of a
    data-only folder inside a package); None when it is not one of ours."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported internal module, line) for every import statement in ``path``."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _internal(alias.name, modules)
                if target is not None:
                    out.append((target, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[: -(node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if _internal(base, modules) is None:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in modules else _internal(base, modules)
                assert target is not None
                out.append((target, node.lineno))
    return out


def import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    """The edges (module -> the internal modules it imports) and, per edge, a line where
    the import is (for the failure message)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    where: dict[tuple[str, str], int] = {}
    for module, path in modules.items():
        for target, line in _imports(module, path, modules):
            if target != module:
                graph[module].add(target)
                where.setdefault((module, target), line)
    return graph, where


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's circles as chains ``[a, b, ..., a]``: for each strongly connected
    component (Tarjan's algorithm), the shortest circle through each of its modules,
    deduplicated up to rotation. Empty exactly when the graph has no circle; every module
    on a circle appears in at least one chain."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(v: str) -> None:  # recursion depth is bounded by the module count
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp: set[str] = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    cycles: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()
    for comp in components:
        for start in sorted(comp):
            # breadth-first: the shortest path start -> ... -> start inside the component
            parents: dict[str, str] = {}
            frontier = [start]
            found = None
            while frontier and found is None:
                nxt = []
                for u in frontier:
                    for w in sorted(graph[u] & comp):
                        if w == start:
                            found = u
                            break
                        if w not in parents:
                            parents[w] = u
                            nxt.append(w)
                    if found is not None:
                        break
                frontier = nxt
            assert found is not None  # start is in a strongly connected component
            chain = [found]
            while chain[-1] != start:
                chain.append(parents[chain[-1]])
            chain.reverse()
            key_i = chain.index(min(chain))
            key = tuple(chain[key_i:] + chain[:key_i])
            if key not in seen:
                seen.add(key)
                cycles.append([*chain, start])
    return cycles


def _describe(chain: list[str], where: dict[tuple[str, str], int]) -> str:
    hops = [f"{a} (line {where[(a, b)]})" for a, b in zip(chain, chain[1:])]
    return " -> ".join(chain) + "\n      imports at: " + ", ".join(hops)


def test_no_import_cycles() -> None:
    graph, where = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, (f"{len(cycles)} import circle(s) in gqakv/, backends/, gqakv_examples/ "
                        "(function-local imports included):\n  "
                        + "\n  ".join(_describe(c, where) for c in cycles))


def _violations(graph, where, source_ok, target_bad) -> list[str]:
    return [f"{m} (line {where[(m, t)]}) imports {t}" for m in sorted(graph) for t in sorted(graph[m])
            if source_ok(m) and target_bad(t)]


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _layer(module: str) -> int:
    """The floor of ``module``: its longest package prefix named in LAYERS."""
    best = (-1, -1)
    for floor, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best[0]:
                best = (len(name), floor)
    assert best[1] >= 0, f"{module} is on no floor of LAYERS: add its package there"
    return best[1]


def test_layers_depend_only_downward() -> None:
    graph, where = import_graph()
    up = [f"{m} (floor {_layer(m)}, line {where[(m, t)]}) imports {t} (floor {_layer(t)})"
          for m in sorted(graph) for t in sorted(graph[m]) if _layer(t) > _layer(m)]
    assert not up, "imports that go up a floor (see LAYERS):\n  " + "\n  ".join(up)


def test_library_never_imports_the_examples() -> None:
    # the CLI's ``generate`` loads gqakv_examples by name (importlib), only when chosen
    graph, where = import_graph()
    bad = _violations(graph, where, lambda m: _inside(m, "gqakv"), lambda t: _inside(t, EXAMPLES))
    assert not bad, "the gqakv library imports the examples package:\n  " + "\n  ".join(bad)


def test_only_the_tools_import_plugin_modules() -> None:
    graph, where = import_graph()
    bad = _violations(graph, where, lambda m: _inside(m, "gqakv") and not _inside(m, TOOLS),
                      lambda t: _inside(t, PLUGINS))
    assert not bad, ("outside gqakv.tools, gqakv imports a backend plugin module directly (use "
                     "the registry: gqakv.get_backend(name)):\n  " + "\n  ".join(bad))


def test_the_graph_sees_every_kind_of_import(tmp_path, monkeypatch) -> None:
    """The parser finds a circle made only of a function-local ``from . import x``, a
    ``from .x import y`` and an absolute ``import pkg.x``, and a package ``__init__``
    importing its own submodule."""
    pkg = tmp_path / "gqakv"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n    return b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("import gqakv.sub.c\n")
    (pkg / "sub" / "c.py").write_text("def g():\n    from .. import a\n")
    (pkg / "d.py").write_text("from gqakv import e\n")
    (pkg / "e.py").write_text("from .d import X\n")
    monkeypatch.setitem(PACKAGES, "gqakv", pkg)
    monkeypatch.setitem(PACKAGES, "gqakv_backends", tmp_path / "none")
    monkeypatch.setitem(PACKAGES, "gqakv_examples", tmp_path / "none")
    graph, _ = import_graph()
    assert graph["gqakv"] == {"gqakv.a"}
    assert graph["gqakv.a"] == {"gqakv.sub.b"}
    assert graph["gqakv.sub.c"] == {"gqakv.a"}
    cycles = {" -> ".join(c) for c in find_cycles(graph)}
    assert cycles == {"gqakv.a -> gqakv.sub.b -> gqakv.sub.c -> gqakv.a", "gqakv.d -> gqakv.e -> gqakv.d"}


# -- the test suite: no test module imports another ----------------------------------------------

def _test_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file of every module under ``root``/tests (the package ``tests``), and
    each ``tests.test_*`` module once more under its bare name (``import test_x`` with tests/
    itself on sys.path reaches the same file)."""
    found: dict[str, Path] = {}
    for path in sorted((root / "tests").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    found.update({name.partition(".")[2]: path for name, path in list(found.items())
                  if _is_test_module(name)})
    return found


def _is_test_module(name: str) -> bool:
    """``tests.test_*`` (or its bare name ``test_*``): a module pytest collects tests from."""
    package, _, leaf = name.rpartition(".")
    return package in ("tests", "") and leaf.startswith("test_")


def _test_module_imports(root: Path = ROOT) -> list[str]:
    """Every import, in any module under tests/, of a ``tests/test_*.py`` module (other
    than itself), as ``"module (line N) imports tests.test_x"``."""
    modules = _test_modules(root)
    bad = []
    for module, path in modules.items():
        if not module.startswith("tests"):
            continue  # a bare-name alias: its file is listed under its dotted name too
        for target, line in _imports(module, path, modules):
            if _is_test_module(target) and modules[target] != path:
                bad.append(f"{module} (line {line}) imports {target}")
    return bad


def test_no_test_module_imports_another() -> None:
    bad = _test_module_imports()
    assert not bad, ("test modules import other test modules (move the shared helpers into "
                     "tests/support/ or tests/cuda_emu/):\n  " + "\n  ".join(bad))


def test_the_test_import_check_sees_every_kind_of_import(tmp_path) -> None:
    """``from . import test_x``, ``from .test_x import y``, ``from tests import test_x``,
    ``import tests.test_x`` and a bare ``import test_x`` are each found, in a test module and
    in a helper module; imports of helpers (and a module naming itself) are not."""
    tests = tmp_path / "tests"
    (tests / "support").mkdir(parents=True)
    for name in ("__init__.py", "support/__init__.py", "support/helpers.py", "test_a.py"):
        (tests / name).write_text("")
    (tests / "test_b.py").write_text(
        "from . import test_a\nfrom .test_a import f\nfrom .support import helpers\n"
        "from tests import test_a as a\nimport tests.test_a\nimport test_a\nfrom . import test_b\n")
    (tests / "support" / "more.py").write_text("def g():\n    from ..test_a import f\n")
    assert sorted(_test_module_imports(tmp_path)) == sorted([
        *(f"tests.test_b (line {n}) imports tests.test_a" for n in (1, 2, 4, 5)),
        "tests.test_b (line 6) imports test_a",
        "tests.support.more (line 2) imports tests.test_a",
    ])
