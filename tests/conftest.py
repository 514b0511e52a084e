"""Backend fixtures: every test that takes ``backend`` runs on each registered backend
that can run here; the others are reported as skipped with their reason."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import settings

import gqakv

# CI (CI=true) replays the same examples every run, so a landing never depends on the
# draw; local runs explore new examples each time.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

_BACKENDS = gqakv.list_backends()


def _emulated_cupy():
    """The cupy backend's own glue and .cu kernels on the CPU emulation harness
    (tests/cuda_emu/emulated_backend.py); not registered with gqakv, only a test param."""
    from .cuda_emu.emulated_backend import EmulatedCupyBackend

    return EmulatedCupyBackend()


_BACKENDS.append(_emulated_cupy())


def _param(b):
    why = b.unavailable_reason()
    marks = [pytest.mark.skip(reason=f"backend {b.name}: {why}")] if why else []
    return pytest.param(b, id=b.name, marks=marks)


@pytest.fixture(params=[_param(b) for b in _BACKENDS])
def backend(request):
    """A runnable backend (one test per registered backend; unavailable ones skip)."""
    return request.param


class BackendArrays:
    """Moves NumPy test data into a backend's library and back."""

    def __init__(self, backend):
        self.backend = backend
        self.xp = backend.namespace()

    def asarray(self, a, dtype=None):
        a = np.asarray(a)
        return self.backend.from_numpy(a, dtype or a.dtype.name)

    def to_numpy(self, x, dtype=np.float64):
        return np.asarray(self.backend.to_numpy(x)).astype(dtype)


@pytest.fixture
def arrays(backend):
    return BackendArrays(backend)
