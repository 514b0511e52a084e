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
from gqakv import registry
from gqakv.backend import Backend


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
