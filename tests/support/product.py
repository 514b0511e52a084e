"""The parity product's axes: backend x storage spec x attention params x dtype, its
sampling (``product_cases``) and one point of it (``Case``). tests/conftest.py turns it into
the ``case`` fixture; tests that need the axes themselves import them from here."""

from __future__ import annotations

import gqakv

from .quantization import GROUPED


def _emulated_cupy():
    """The cupy backend's own glue and .cu kernels on the CPU emulation harness
    (tests/cuda_emu/emulated_backend.py); not registered with gqakv, only a test param."""
    from ..cuda_emu.emulated_backend import EmulatedCupyBackend

    return EmulatedCupyBackend()


#: Every backend the tests run on: the registered ones, then the emulated CuPy backend.
BACKENDS = [*gqakv.list_backends(), _emulated_cupy()]

# -- the product's axes: backend x storage spec x attention params x dtype ------------------
# A new storage kind or attention variant adds one entry here (and the library's one
# store or params class and planner-table line); every test taking ``case`` then runs it
# on every backend. When the product outgrows PRODUCT_LIMIT it is sampled so that every
# (backend, storage), (backend, params) and (backend, dtype) pair still runs, and every
# (backend, storage, dtype) triple (CI time stays bounded). Each cross-cutting test
# asserts the route it meant to exercise (tests/support/routes.py, the ``route_spy``
# fixture), so a fast path that silently falls back fails it.

#: Storage specs under test: name -> keyword arguments of KVCache / ModelKVCache.
STORAGE_SPECS = {"contiguous": {"storage": "contiguous"},
                 "paged": {"storage": "paged", "page_size": 4},
                 # quantized K/V: the cache's dtype must be float32/float16/bfloat16, and it
                 # holds tests/support/quantization.held(x) for the values x appended
                 "int8": {"kv_dtype": "int8"},
                 "fp8": {"kv_dtype": "float8_e4m3fn"},
                 # both: numba's kernels and numpy's 8-bit reader over pages read it; CuPy
                 # refuses it (generic path, the route says why)
                 "paged+int8": {"storage": "paged", "page_size": 4, "kv_dtype": "int8"}}
#: Attention params under test: name -> the fields of ``gqakv.AttentionParams`` besides
#: ``scale`` (tests build ``AttentionParams(scale=..., **fields)`` and pass ``params=``).
ATTENTION_PARAMS = {"causal": {}, "window": {"window": 3}, "softcap": {"softcap": 0.5},
                    # one sink per query head: the tests that take ``case`` use Hq = 6
                    "sinks": {"sinks": (0.5, -1.0, 2.0, float("-inf"), 4.0, 0.0)},
                    "window+softcap+sinks": {"window": 2, "softcap": 0.5,
                                             "sinks": (1.0, 0.0, -2.0, 3.0, float("-inf"), 0.5)},
                    # one ALiBi slope per query head (BLOOM's for 8 heads, then 0 and < 0)
                    "alibi": {"alibi_slopes": (0.5, 0.25, 0.125, 0.0625, 0.0, -0.25)},
                    "window+softcap+sinks+alibi": {
                        "window": 3, "softcap": 2.0, "sinks": (1.0, 0.0, -2.0, 3.0, float("-inf"), 0.5),
                        "alibi_slopes": (0.75, 0.5, 0.25, 0.125, 0.0625, 1.5)}}
#: Cache dtypes under test, where a backend declares them: the dtypes the kernels are
#: built for (float64 runs only the references' own checks: no fast path has it).
PRODUCT_DTYPES = ("float32", "bfloat16", "float16")
#: Largest product run in full.
PRODUCT_LIMIT = 64

# -- the grouped codecs' axis: its own head dim --------------------------------------------
#: The grouped codecs (tests/support/quantization.py GROUPED, written apart from the
#: library's table: a scale per block of 32 or 64 values along d), contiguous and paged: their blocks need d a multiple of 64 for every one of
#: them, so they are an axis of their own at GROUPED_HEAD_DIM (the product above runs d = 8).
#: name -> KVCache / ModelKVCache keyword arguments, as STORAGE_SPECS.
GROUPED_SPECS = {f"{layout}{name}": {**spec, "kv_dtype": name}
                 for name in GROUPED
                 for layout, spec in (("", {}), ("paged+", {"storage": "paged", "page_size": 4}))}
#: Head dim of the grouped points: one block of 64, two of 32.
GROUPED_HEAD_DIM = 64


def _grouped_axes(backend) -> tuple[list[str], list[str]]:
    """(params names, dtypes) of the grouped product on ``backend``: the product's, but on
    the emulated CuPy backend only those its grouped emulation library instantiates
    (tests/cuda_emu/harness.py GROUPED_VARIANTS, GROUPED_DTYPES: CUDA compiles any on a
    GPU; the emulator's library holds what the tests run)."""
    dtypes = [d for d in PRODUCT_DTYPES if d in backend.dtypes]
    if backend.name != "cupy_emulated":
        return list(ATTENTION_PARAMS), dtypes
    from gqakv_backends.cupy_backend import instantiations as table

    from ..cuda_emu import harness

    def flags(fields):  # the variant.cuh flags of a params entry
        return sum(table.VARIANT_FLAGS[f] for f in gqakv.AttentionParams(scale=1.0, **fields).features)

    return ([p for p, fields in ATTENTION_PARAMS.items() if flags(fields) in harness.GROUPED_VARIANTS],
            [d for d in dtypes if d in harness.GROUPED_DTYPES])


def grouped_product_cases(backends) -> list[tuple]:
    """(backend, grouped spec name, params name, dtype) points: every (backend, spec) pair
    once, the backend's dtypes and params (``_grouped_axes``) taken in turn, so every
    (backend, dtype) and (backend, params) pair runs too (8 specs >= 7 params)."""
    picked = []
    for i, b in enumerate(backends):
        variants, dtypes = _grouped_axes(b)
        for n, s in enumerate(GROUPED_SPECS):
            picked.append((b, s, variants[(i + n) % len(variants)], dtypes[n % len(dtypes)]))
    return picked


def product_cases(backends, storage_specs, params, dtypes=PRODUCT_DTYPES) -> list[tuple]:
    """(backend, storage name, params name, dtype) points: the full product when it is at
    most PRODUCT_LIMIT, else a sample: for each backend every (storage, dtype) pair of the
    dtypes it declares, with the params taken in turn (so each backend also runs every
    params value, once per len(params) points; a backend with fewer such pairs than
    params values gets one more point for each value not reached)."""
    kinds, variants = list(storage_specs), list(params)
    declared = {b.name: [d for d in dtypes if d in b.dtypes] for b in backends}
    full = [(b, s, p, d) for b in backends for s in kinds for p in variants
            for d in declared[b.name]]
    if len(full) <= PRODUCT_LIMIT:
        return full
    picked = []
    for i, b in enumerate(backends):
        n = 0
        for s in kinds:
            for d in declared[b.name]:
                picked.append((b, s, variants[(i + n) % len(variants)], d))
                n += 1
        # a backend with fewer (storage, dtype) pairs than params: one more point for each
        # params value not reached yet, on the storage kinds in turn
        reached = {variants[(i + k) % len(variants)] for k in range(n)}
        for p in (p for p in variants if p not in reached):
            picked.append((b, kinds[n % len(kinds)], p, declared[b.name][0]))
            n += 1
    return picked


class Case:
    """One point of the product: ``backend``, ``storage`` (KVCache keyword arguments),
    ``params`` (AttentionParams fields besides scale) and ``dtype`` (the cache's), with
    their names."""

    def __init__(self, backend, storage_name: str, params_name: str, dtype: str = "float32"):
        self.backend = backend
        self.storage_name, self.params_name, self.dtype = storage_name, params_name, dtype
        self.storage = {**STORAGE_SPECS, **GROUPED_SPECS}[storage_name]
        self.params = ATTENTION_PARAMS[params_name]

    def __repr__(self) -> str:
        return f"Case({self.backend.name}, {self.storage_name}, {self.params_name}, {self.dtype})"
