"""The NumPy backend: the reference, and the default on machines without a GPU."""

from __future__ import annotations

from gqakv.backend import Backend
from gqakv.semantics import unsupported
from gqakv.store import CONTIGUOUS, PAGED


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
        from gqakv.dtypes import canonical_name

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
        view = a.view()
        view.flags.writeable = False
        return view

    def attention(self, q, store, inputs, params, *, return_lse: bool):
        """BLAS matmuls on live views, shared among threads (see ``numpy_attention``), for
        contiguous storage and the variants it implements (quantized storage: each K/V block
        dequantized as it is read, ``numpy_quantized``); otherwise the generic path."""
        if store.kind == PAGED and not unsupported(params, "numpy BLAS"):
            from .numpy_paged import attention_numpy_paged  # reads through the page table

            return attention_numpy_paged(q, store, inputs, params, return_lse=return_lse)
        if store.kind != CONTIGUOUS or unsupported(params, "numpy BLAS"):
            return super().attention(q, store, inputs, params, return_lse=return_lse)
        if store.quantized:
            from .numpy_quantized import attention_numpy_quantized

            return attention_numpy_quantized(q, store, inputs, params, return_lse=return_lse)
        from .numpy_attention import attention_numpy

        return attention_numpy(q, store.k, store.v, inputs.rows, inputs.lens, inputs.n_new,
                               scale=params.scale, return_lse=return_lse, params=params)
