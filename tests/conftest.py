"""Backend fixtures: every test that takes ``backend`` runs on each registered backend
that can run here; the others are reported as skipped with their reason."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from .support.arrays import BackendArrays
from .support.product import (ATTENTION_PARAMS, BACKENDS, STORAGE_SPECS, Case, grouped_product_cases,
                               product_cases)

# CI (CI=true) replays the same examples every run, so a landing never depends on the
# draw; local runs explore new examples each time.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

_BACKENDS = BACKENDS


def _param(b):
    why = b.unavailable_reason()
    marks = [pytest.mark.skip(reason=f"backend {b.name}: {why}")] if why else []
    return pytest.param(b, id=b.name, marks=marks)


@pytest.fixture(params=[_param(b) for b in _BACKENDS])
def backend(request):
    """A runnable backend (one test per registered backend; unavailable ones skip)."""
    return request.param


@pytest.fixture
def arrays(backend):
    return BackendArrays(backend)


# -- the product (tests/support/product.py): one ``case`` per sampled point -----------------


def _case_param(b, s, p, d):
    why = b.unavailable_reason()
    marks = [pytest.mark.skip(reason=f"backend {b.name}: {why}")] if why else []
    return pytest.param((b, s, p, d), id=f"{b.name}-{s}-{p}-{d}", marks=marks)


@pytest.fixture(params=[_case_param(*c) for c in product_cases(_BACKENDS, STORAGE_SPECS,
                                                                     ATTENTION_PARAMS)])
def case(request) -> Case:
    """A point of backend x storage spec x attention params x dtype (``product_cases``)."""
    return Case(*request.param)


@pytest.fixture(params=[_case_param(*c) for c in grouped_product_cases(_BACKENDS)])
def grouped_case(request) -> Case:
    """A point of backend x grouped codec spec x attention params x dtype
    (``grouped_product_cases``: the grouped codecs at their own head dim)."""
    return Case(*request.param)


@pytest.fixture
def route_spy(monkeypatch):
    """``route_spy(backend)``: a ``tests.support.routes.RouteSpy`` on ``backend`` for this
    test (what each hot operation ran, for ``assert_product_routes``)."""
    from .support.routes import RouteSpy

    return lambda backend: RouteSpy(backend, monkeypatch)


# -- emulation libraries: queued at collection, compiled while the first tests run ---------
def pytest_collection_finish(session) -> None:
    """Start compiling, in the background, the CUDA emulation libraries the selected tests
    will load (tests/cuda_emu/emulated_backend.prebuild_for); a test that needs one waits
    only for what is left of it."""
    if session.config.option.collectonly:
        return
    from .cuda_emu.emulated_backend import prebuild_for

    prebuild_for(session.items)
