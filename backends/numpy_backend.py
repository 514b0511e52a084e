"""The NumPy backend: the reference, and the default on machines without a GPU."""

from __future__ import annotations

import functools

from gqakv.dispatch.backend import GENERIC, Backend, Route, route_facts
from gqakv.core.semantics import unsupported
from gqakv.core.inputs import immutable_ints
from gqakv.storage.store import CONTIGUOUS, PAGED

#: The NumPy backend's attention paths (BLAS matmuls on live views; see ``route_attention``).
BLAS = "numpy BLAS"
BLAS_PAGED = "numpy BLAS paged"
BLAS_QUANTIZED = "numpy BLAS quantized"
BLAS_PATHS = (BLAS, BLAS_PAGED, BLAS_QUANTIZED)

#: The facts ``route`` reads on the CPU backends (numpy, numba), with their favourable
#: defaults: dtype (the cache's, of q and the output), head_dim, t_q (query tokens per
#: row), storage (the layout kind), kv_dtype (a quantized cache's storage, None when
#: unquantized), features (the variant's ``AttentionParams.features``), layout (why the
#: buffers do not suit a kernel, None when they do: numba only).
_STORE_FACTS = {"dtype": "float32", "head_dim": None, "storage": CONTIGUOUS, "kv_dtype": None,
                "layout": None}
CPU_FACTS: dict[str, dict] = {
    "attention": {**_STORE_FACTS, "t_q": 1, "features": frozenset()},
    "write_kv": _STORE_FACTS,
    "copy_tokens": _STORE_FACTS,
}


@functools.lru_cache(maxsize=256)
def route_attention(storage: str, kv_dtype: str | None, features: frozenset) -> Route:
    """The NumPy backend's attention decision (its dispatch and ``route`` both ask it):
    BLAS over contiguous rows, over paged rows (the page table read per block) or over
    quantized rows (each block dequantized as read); paged and quantized at once, other
    storage kinds and variants the BLAS paths do not implement: the generic code."""
    why = unsupported(features, BLAS)
    if why:
        return Route(GENERIC, {impl: why for impl in BLAS_PATHS})
    if storage not in (CONTIGUOUS, PAGED):
        why = f"storage kind {storage!r} (the BLAS paths read {CONTIGUOUS} or {PAGED} K/V)"
        return Route(GENERIC, {impl: why for impl in BLAS_PATHS})
    paged, quantized = storage == PAGED, kv_dtype is not None
    rejected = {
        BLAS: (f"storage kind {storage!r} ({BLAS} reads {CONTIGUOUS} rows)" if paged else
               f"kv_dtype={kv_dtype!r} ({BLAS} reads unquantized K/V)" if quantized else None),
        BLAS_PAGED: (f"storage kind {storage!r} ({BLAS_PAGED} reads {PAGED} K/V)" if not paged else
                     f"kv_dtype={kv_dtype!r} ({BLAS_PAGED} reads unquantized pages; paged "
                     "quantized K/V take the generic path)" if quantized else None),
        BLAS_QUANTIZED: (f"no kv_dtype ({BLAS_QUANTIZED} reads int8 / float8_e4m3fn codes)"
                         if not quantized else
                         f"storage kind {storage!r} ({BLAS_QUANTIZED} reads {CONTIGUOUS} "
                         "quantized rows)" if paged else None),
    }
    chosen = [impl for impl, why in rejected.items() if why is None]
    if not chosen:
        return Route(GENERIC, {impl: str(why) for impl, why in rejected.items()})
    impl = chosen[0]
    return Route(impl, {**{i: str(w) for i, w in rejected.items() if i != impl},
                        GENERIC: f"{impl} serves this call (BLAS paths come first)"})


class NumpyBackend(Backend):
    name = "numpy"
    priority = 10
    array_library = "numpy"
    device_kind = "cpu"
    dtypes = ("float32", "float64", "float16", "bfloat16")
    head_dims = None
    features = frozenset({"array_api", "bfloat16 via ml_dtypes", "float16/bfloat16 computed in float32",
                          "threaded BLAS attention (GQAKV_NUM_THREADS)"})

    def namespace(self):
        import array_api_compat.numpy as xp

        return xp

    def dtype(self, name: str):
        from gqakv.core.dtypes import canonical_name

        name = canonical_name(name)
        if name == "bfloat16":
            import ml_dtypes

            return ml_dtypes.bfloat16
        return getattr(self.namespace(), name)

    def owns(self, x) -> bool:
        import numpy as np

        return isinstance(x, np.ndarray)

    def device_of(self, x):
        return "cpu"

    def from_host_ints(self, a, device=None):
        # A copy no one can make writable again (a read-only view of ``a`` could be, and
        # then write ``a``: the cache's own lengths, once).
        return immutable_ints(a)

    # -- routing ---------------------------------------------------------------------------

    def route(self, op: str, **facts) -> Route:
        """The implementation that runs ``op`` for these facts (``CPU_FACTS``: those not
        given are taken as favourable), from the decision the dispatch itself takes
        (``route_attention``); appends and row copies are the generic code here."""
        facts = route_facts(op, facts, CPU_FACTS)
        if op != "attention":
            return Route(GENERIC)
        route = route_attention(facts["storage"], facts["kv_dtype"], facts["features"])
        return Route(route.impl, dict(route.rejected))  # the kept route stays unshared

    def implementations(self) -> dict[str, str]:
        return {
            BLAS: "attention over contiguous rows, every dtype (float16/bfloat16 in float32); "
                  "window, softcap, sinks",
            BLAS_PAGED: "attention over paged rows (the page table read per key block)",
            BLAS_QUANTIZED: "attention over contiguous int8 / float8_e4m3fn rows (each block "
                            "dequantized as read)",
            GENERIC: "appends, row copies, paged quantized attention",
        }

    def attention(self, q, store, inputs, params, *, return_lse: bool):
        """BLAS matmuls on live views, shared among threads (see ``numpy_attention``), for
        contiguous storage, paged storage (``numpy_paged``) and quantized storage (each
        K/V block dequantized as it is read, ``numpy_quantized``) with the variants they
        implement; otherwise the generic path (``route_attention`` decides)."""
        impl = route_attention(store.kind, store.dtype if store.quantized else None,
                               params.features).impl
        if impl == BLAS_PAGED:
            # reads through the page table
            from .numpy_paged import attention_numpy_paged

            return attention_numpy_paged(q, store, inputs, params, return_lse=return_lse)
        if impl == BLAS_QUANTIZED:
            from .numpy_quantized import attention_numpy_quantized

            return attention_numpy_quantized(q, store, inputs, params, return_lse=return_lse)
        if impl == BLAS:
            from .numpy_attention import attention_numpy

            return attention_numpy(q, store.k, store.v, inputs.rows, inputs.lens, inputs.n_new,
                                   scale=params.scale, return_lse=return_lse, params=params)
        return super().attention(q, store, inputs, params, return_lse=return_lse)
