"""array-api-strict backend: the generic array-API code on a minimal, strict library.

It proves that gqakv's shared code uses nothing beyond the array API standard, and
it is the project's own end-to-end test of the entry-point plugin mechanism. Lowest
priority: 'auto' never picks it while another backend can run.
"""

from __future__ import annotations

from gqakv.dispatch.backend import Backend


class StrictBackend(Backend):
    name = "array_api_strict"
    priority = -100
    array_library = "array_api_strict"
    device_kind = "cpu"
    dtypes = ("float32", "float64")
    head_dims = None
    features = frozenset({"array_api",
                          "attention variants (window, softcap, sinks) on the generic array-API path"})
    packed_tokens = True  # the generic defaults take packed [N, H, d] tokens
    wide_queries = True  # float32 q over a 16-bit store: computed and returned in float32
    generic_invariant = True  # equal operands and shapes give equal bits (CPU libraries)

    def unavailable_reason(self):
        try:
            import array_api_strict  # noqa: F401
        except ImportError:
            return "array_api_strict: not installed (pip install array-api-strict)"
        return None

    def namespace(self):
        import array_api_strict

        return array_api_strict
