"""The backend registry: entry points, run-time registration, choice precedence, reasons."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from importlib.metadata import entry_points

import numpy as np
import pytest

import gqakv
from gqakv.dispatch import registry
from gqakv.dispatch.backend import Backend


class FakeBackend(Backend):
    """A high-priority backend that cannot run here (like CuPy without a GPU)."""

    name = "fake_gpu"
    priority = 1000
    dtypes = ("float32",)
    head_dims = (64, 128)

    def unavailable_reason(self):
        return "fake_gpu: no CUDA driver found"


class FakeRunnable(Backend):
    """A runnable high-priority backend supporting only float32 and d in (64, 128)."""

    name = "fake_fast"
    priority = 1000
    dtypes = ("float32",)
    head_dims = (64, 128)

    def namespace(self):
        import array_api_compat.numpy as xp

        return xp


@pytest.fixture
def isolated_registry(monkeypatch):
    """A registry whose run-time registrations vanish after the test."""
    registry.list_backends()  # load the entry points first
    # without the numba backend (the CPU default where numba imports), so the choices
    # below are the same on every machine
    monkeypatch.setattr(registry, "_backends",
                        {k: b for k, b in registry._backends.items() if k != "numba"})
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    return registry


def test_builtin_backends_come_from_entry_points():
    eps = {ep.name: ep.value for ep in entry_points(group="gqakv.backends")}
    assert eps["numpy"] == "gqakv_backends.numpy_backend:NumpyBackend"
    assert "array_api_strict" in eps  # the project's own plugin proves the mechanism end to end
    names = [b.name for b in gqakv.list_backends()]
    assert {"numpy", "array_api_strict"} <= set(names)
    assert type(gqakv.get_backend("array_api_strict")).__module__ == "gqakv_backends.strict_backend"


def test_auto_picks_highest_priority_that_can_serve(isolated_registry):
    gqakv.register_backend(FakeBackend)
    assert gqakv.get_backend().name == "numpy"  # fake_gpu cannot run: skipped by auto
    gqakv.register_backend(FakeRunnable)
    assert gqakv.get_backend(dtype="float32", head_dim=128).name == "fake_fast"
    # fake_fast cannot serve float16 or d=96: auto goes on to numpy
    assert gqakv.get_backend(dtype="float16", head_dim=128).name == "numpy"
    assert gqakv.get_backend(dtype="float32", head_dim=96).name == "numpy"


def test_explicit_backend_never_falls_back(isolated_registry):
    gqakv.register_backend(FakeBackend)
    with pytest.raises(gqakv.BackendError, match="fake_gpu: no CUDA driver found"):
        gqakv.KVCache(1, 1, 4, 64, backend="fake_gpu")
    gqakv.register_backend(FakeRunnable)
    with pytest.raises(gqakv.BackendError, match=r"head_dim=96 \(supported: 64, 128\)"):
        gqakv.KVCache(1, 1, 4, 96, backend="fake_fast")
    with pytest.raises(gqakv.BackendError, match=r"dtype=float16 \(supported: float32\)"):
        gqakv.KVCache(1, 1, 4, 64, dtype="float16", backend="fake_fast")


def test_no_backend_explains_every_rejection(isolated_registry, monkeypatch):
    monkeypatch.setattr(registry, "_backends", {"fake_gpu": FakeBackend()})
    with pytest.raises(gqakv.BackendError) as info:
        gqakv.get_backend(dtype="float32", head_dim=64)
    assert "fake_gpu: fake_gpu: no CUDA driver found" in str(info.value)


def test_register_backend_at_run_time(isolated_registry):
    b = gqakv.register_backend(FakeRunnable())
    assert gqakv.get_backend("fake_fast") is b
    with pytest.raises(ValueError, match="already registered"):
        gqakv.register_backend(FakeRunnable)
    assert gqakv.register_backend(FakeRunnable, replace=True) is not b
    with pytest.raises(TypeError, match="Backend"):
        gqakv.register_backend(object)


def test_precedence_argument_context_environment_auto(isolated_registry, monkeypatch):
    assert gqakv.get_backend().name == "numpy"
    monkeypatch.setenv("GQAKV_BACKEND", "array_api_strict")
    assert gqakv.get_backend().name == "array_api_strict"
    assert gqakv.KVCache(1, 1, 2, 2).backend.name == "array_api_strict"
    with gqakv.use_backend("numpy"):
        assert gqakv.get_backend().name == "numpy"  # context beats environment
        assert gqakv.get_backend("array_api_strict").name == "array_api_strict"  # argument beats both
        with gqakv.use_backend("array_api_strict"):
            assert gqakv.get_backend().name == "array_api_strict"
        assert gqakv.get_backend().name == "numpy"
    monkeypatch.setenv("GQAKV_BACKEND", "nope")
    with pytest.raises(gqakv.BackendError, match="unknown backend 'nope'"):
        gqakv.get_backend()


def test_environment_choice_does_not_fall_back(isolated_registry, monkeypatch):
    gqakv.register_backend(FakeBackend)
    monkeypatch.setenv("GQAKV_BACKEND", "fake_gpu")
    with pytest.raises(gqakv.BackendError, match="GQAKV_BACKEND=fake_gpu.*no CUDA driver"):
        gqakv.KVCache(1, 1, 4, 64)


def test_use_backend_is_scoped_per_thread(isolated_registry):
    seen = {}
    entered, release = threading.Event(), threading.Event()

    def other():
        entered.wait()
        seen["other"] = gqakv.get_backend().name
        release.set()

    t = threading.Thread(target=other)
    t.start()
    with gqakv.use_backend("array_api_strict"):
        entered.set()
        release.wait()
        seen["inside"] = gqakv.get_backend().name
    t.join()
    assert seen == {"inside": "array_api_strict", "other": "numpy"}
    with pytest.raises(gqakv.BackendError, match="unknown backend"):
        with gqakv.use_backend("nope"):
            pass


def test_broken_plugin_warns_and_others_still_work(monkeypatch):
    class BrokenEntryPoint:
        name, value = "broken", "nowhere.module:Thing"

        def load(self):
            raise ImportError("No module named 'nowhere'")

    real = registry.entry_points
    monkeypatch.setattr(registry, "entry_points",
                        lambda group: [*real(group=group), BrokenEntryPoint()])
    monkeypatch.setattr(registry, "_backends", {})
    monkeypatch.setattr(registry, "_plugin_errors", {})
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    with pytest.warns(RuntimeWarning, match="plugin 'broken'.*failed to load"):
        names = [b.name for b in gqakv.list_backends()]
    assert "numpy" in names and "broken" not in names
    rows = {r["name"]: r for r in gqakv.describe_backends()}
    assert not rows["broken"]["available"] and "nowhere" in rows["broken"]["reason"]
    with pytest.raises(gqakv.BackendError, match="failed to load"):
        gqakv.get_backend("broken")


def test_import_does_not_import_optional_backends():
    code = ("import sys, gqakv; "
            "bad = [m for m in ('cupy', 'torch', 'array_api_strict', 'gqakv_backends') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("cmd", [
    [sys.executable, "-m", "gqakv", "info"],
    [str(Path(sys.executable).parent / "gqakv"), "info"],  # the installed console script
])
def test_info_command_lists_backends_and_reasons(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    assert "numpy" in out and "array_api_strict" in out and "available" in out
    assert "auto/default choice here" in out


def test_from_numpy_takes_negative_strides(backend):
    """``Backend.from_numpy`` of a reversed NumPy view (torch refuses negative strides)."""
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)[:, ::-1, ::-2]
    got = backend.from_numpy(a)
    np.testing.assert_array_equal(np.asarray(backend.to_numpy(got)), a)
    np.testing.assert_array_equal(np.asarray(backend.to_numpy(backend.from_numpy(a, "float64"))), a)


# -- routing: route() names what runs, for every storage fact -----------------------------------

ROUTE_STORAGE = {"contiguous": {}, "paged": {"storage": "paged", "page_size": 4},
                 "int8": {"kv_dtype": "int8"}, "fp8": {"kv_dtype": "float8_e4m3fn"},
                 "paged+int8": {"storage": "paged", "page_size": 4, "kv_dtype": "int8"}}


@pytest.mark.parametrize("storage", list(ROUTE_STORAGE))
def test_route_names_what_runs_for_every_storage_and_chunk(backend, storage, route_spy):
    """On every backend, for contiguous, paged, 8-bit and paged 8-bit caches: appends
    (prefill, then a fork's copy on write on a paged cache) and attention with a decode,
    a short and a long chunk (both sides of numba's 8 and CuPy's 4 query tokens) and a
    float64 cache where it is held; each call ran what ``route()`` names for its facts
    (tests/support/routes.py spies on every implementation's entry)."""
    from .support.routes import assert_routes_ran

    spec = ROUTE_STORAGE[storage]
    dtypes = [d for d in ("float32", "float64") if d in backend.dtypes
              and not (d == "float64" and "kv_dtype" in spec)]  # 8-bit: a float32 cache
    rng = np.random.default_rng(5)
    spy = route_spy(backend)
    for dtype in dtypes:
        cache = gqakv.KVCache(2, 1, 40, 8, dtype=dtype, backend=backend, **spec)
        x = backend.from_numpy(rng.standard_normal((2, 1, 10, 8)), dtype)
        cache.append(x, x, [10, 6])
        cache.fork(0, [1])
        for t_q in (1, 5, 9):
            q = backend.from_numpy(rng.standard_normal((2, 2, t_q, 8)), dtype)
            y = backend.from_numpy(rng.standard_normal((2, 1, t_q, 8)), dtype)
            cache.append(y, y, [t_q, t_q])  # the fork's shared last page: copied on write
            gqakv.gqa_attention(q, cache, [t_q, t_q])
    assert_routes_ran(spy)
    ops = {c.op for c in spy.calls}
    assert {"write_kv", "attention"} <= ops and ("copy_tokens" in ops or storage != "paged")
    if storage == "paged+int8" and backend.name == "numpy":  # the 8-bit reader over pages
        assert backend.route("attention", dtype="float32", head_dim=8, t_q=1, layout="paged",
                             codec="int8").impl == "numpy BLAS"
    if storage == "paged+int8" and backend.name == "cupy_emulated":  # the 8-bit reader over pages
        route = backend.route("attention", dtype="float32", head_dim=8, t_q=1,
                              layout="paged", codec="int8")
        assert route.impl == "gqakv_decode", route


@pytest.mark.parametrize("name", ["numpy", "numba"])
def test_cpu_routes_check_their_facts(name):
    """numpy and numba ``route`` know their facts (an unknown one is named) and say why
    each other path was not taken."""
    from gqakv.dispatch.backend import GENERIC

    backend = next(b for b in gqakv.list_backends() if b.name == name)
    if backend.unavailable_reason():
        pytest.skip(backend.unavailable_reason())
    with pytest.raises(ValueError, match=r"attention facts colour \(known: dtype"):
        backend.route("attention", dtype="float32", colour="red")
    with pytest.raises(ValueError, match="op='prefill'"):
        backend.route("prefill")
    route = backend.route("attention", dtype="float64", head_dim=8, t_q=1, layout="paged")
    assert route.impl == "numpy BLAS" and GENERIC in route.rejected
    if name == "numba":
        assert route.rejected["numba kernel"].startswith("dtype=float64")
        from .support.routes import cpu_has_bf16_products

        t9 = backend.route("attention", dtype="bfloat16", t_q=9, codec="int8")
        amx = "numba bf16 products" if cpu_has_bf16_products() else "numpy BLAS"
        assert t9.impl == amx and "T=9" in t9.rejected["numba kernel"], t9
        # the BLAS path's items on bf16 products: what they do not take is named
        for facts, words in (({"head_dim": 80}, "head_dim=80"), ({"dtype": "float16"}, "float16"),
                             ({"codec": "int4_g32"}, "int4_g32"),
                             ({"features": frozenset({"alibi"})}, "alibi")):
            route = backend.route("attention", **{"dtype": "bfloat16", "t_q": 9, **facts})
            assert route.impl == "numpy BLAS" and words in route.rejected["numba bf16 products"], route
        assert backend.route("attention", dtype="bfloat16", t_q=8, layout="paged",
                             codec="int8").impl == "numba kernel"
        assert backend.route("write_kv", dtype="float32").impl == "numba write_tokens"
        assert "kv_dtype='int8'" in backend.route("write_kv", codec="int8").rejected[
            "numba write_tokens"]
        # pages and codes: the NumPy backend's one assignment per buffer (through the table)
        paged = backend.route("write_kv", dtype="bfloat16", layout="paged")
        assert paged.impl == "numpy write_tokens" and "paged" in paged.rejected["numba write_tokens"]
        for layout in ("contiguous", "paged"):
            assert backend.route("write_kv", layout=layout, codec="int4_g32").impl == "numpy write_tokens"
    gen = backend.route("attention", layout="paged", codec="int8")
    assert gen.impl == ("numpy BLAS" if name == "numpy" else "numba kernel")
