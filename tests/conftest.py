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


# -- the product's axes: backend x storage spec x attention params -------------------------
# A new storage kind or attention variant adds one entry here (and the library's one
# store or params class and planner-table line); every test taking ``case`` then runs it
# on every backend. When the product outgrows PRODUCT_LIMIT it is sampled so that every
# (backend, storage) and every (backend, params) pair still runs (CI time stays bounded).

#: Storage specs under test: name -> keyword arguments of KVCache / ModelKVCache.
STORAGE_SPECS = {"contiguous": {"storage": "contiguous"},
                 "paged": {"storage": "paged", "page_size": 4},
                 # quantized K/V: the cache's dtype must be float32/float16/bfloat16, and it
                 # holds tests/test_quantized.held(x) for the values x appended
                 "int8": {"kv_dtype": "int8"},
                 "fp8": {"kv_dtype": "float8_e4m3fn"}}
#: Attention params under test: name -> the fields of ``gqakv.AttentionParams`` besides
#: ``scale`` (tests build ``AttentionParams(scale=..., **fields)`` and pass ``params=``).
ATTENTION_PARAMS = {"causal": {}, "window": {"window": 3}, "softcap": {"softcap": 0.5},
                    # one sink per query head: the tests that take ``case`` use Hq = 6
                    "sinks": {"sinks": (0.5, -1.0, 2.0, float("-inf"), 4.0, 0.0)},
                    "window+softcap+sinks": {"window": 2, "softcap": 0.5,
                                             "sinks": (1.0, 0.0, -2.0, 3.0, float("-inf"), 0.5)}}
#: Largest product run in full.
PRODUCT_LIMIT = 64


def product_cases(backends, storage_specs, params) -> list[tuple]:
    """(backend, storage name, params name) triples: the full product when it is at most
    PRODUCT_LIMIT, else a sample covering every (backend, storage) and (backend, params)
    pair (each storage paired with a params value in turn, and vice versa)."""
    kinds, variants = list(storage_specs), list(params)
    full = [(b, s, p) for b in backends for s in kinds for p in variants]
    if len(full) <= PRODUCT_LIMIT:
        return full
    picked = []
    for i, b in enumerate(backends):
        for j, s in enumerate(kinds):
            picked.append((b, s, variants[(i + j) % len(variants)]))
        for j, p in enumerate(variants):
            picked.append((b, kinds[(i + j) % len(kinds)], p))
    return list(dict.fromkeys(picked))  # in order, without repeats


def _case_param(b, s, p):
    why = b.unavailable_reason()
    marks = [pytest.mark.skip(reason=f"backend {b.name}: {why}")] if why else []
    return pytest.param((b, s, p), id=f"{b.name}-{s}-{p}", marks=marks)


class Case:
    """One point of the product: ``backend``, ``storage`` (KVCache keyword arguments) and
    ``params`` (AttentionParams fields besides scale), with their names."""

    def __init__(self, backend, storage_name: str, params_name: str):
        self.backend = backend
        self.storage_name, self.params_name = storage_name, params_name
        self.storage = STORAGE_SPECS[storage_name]
        self.params = ATTENTION_PARAMS[params_name]


@pytest.fixture(params=[_case_param(*c) for c in product_cases(_BACKENDS, STORAGE_SPECS,
                                                                     ATTENTION_PARAMS)])
def case(request) -> Case:
    """A point of backend x storage spec x attention params (see ``product_cases``)."""
    return Case(*request.param)
