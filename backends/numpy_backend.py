"""The NumPy backend: the reference, and the default on machines without a GPU."""

from __future__ import annotations

import functools

from gqakv.dispatch.backend import GENERIC, Backend, FastPath, Route, choose
from gqakv.dispatch.request import Request, as_request
from gqakv.ops.outputs import write_into
from gqakv.storage.codecs import GROUPED, PLAIN_NAME
from gqakv.core.inputs import PACKED, PADDED, immutable_ints
from gqakv.storage.store import CONTIGUOUS, PAGED

#: The NumPy backend's attention fast path (BLAS matmuls on live blocks; see ``route_attention``):
#: one item kernel (``numpy_attention``) over the block readers of ``numpy_readers``.
BLAS = "numpy BLAS"
BLAS_PATHS = (BLAS,)
#: The NumPy backend's append into plain storage (contiguous rows or pages): every entry's
#: tokens by one fancy-indexed assignment per buffer (``numpy_batch.write_tokens``), not
#: one slice per row (and page).
WRITE = "numpy write_tokens"

#: The variant features the item kernel implements (``numpy_attention.fold_block``).
BLAS_FEATURES = frozenset({"window", "softcap", "sinks", "alibi", "tree"})
#: What the fast path reads, as data: every layout with a base reader
#: (``numpy_readers.BASE_READERS``: contiguous rows, pages), with values stored plain or
#: as the codes of a codec whose ``dequantize_into`` the 8-bit reader calls (``Coded``:
#: over either base reader). Any other codec is refused here and runs the generic path.
FAST_PATHS: tuple[FastPath, ...] = (
    FastPath(BLAS, "attention", frozenset({CONTIGUOUS, PAGED}),
             frozenset({PLAIN_NAME, "int8", "float8_e4m3fn", *GROUPED}), BLAS_FEATURES,
             tokens=frozenset({PADDED, PACKED}), invariant=True),
)
#: Appends (``numpy_batch.append``): plain values by one assignment per buffer, and the
#: built-in codecs' codes and scales by one encode of every new token and one assignment
#: per part (each token is encoded from its own values alone, so the parts are those of
#: the generic per-row writes, bit for bit).
WRITE_PATH = FastPath(WRITE, "write_kv", frozenset({CONTIGUOUS, PAGED}),
                      frozenset({PLAIN_NAME, "int8", "float8_e4m3fn", *GROUPED}),
                      tokens=frozenset({PADDED, PACKED}))


@functools.lru_cache(maxsize=256)
def route_write(request: Request) -> Route:
    """The NumPy backend's append decision: ``numpy_batch.append`` into storage,
    contiguous or paged, of the codecs ``WRITE_PATH`` declares, held in NumPy arrays
    (``buffers`` None), else the generic per-row writes."""
    why = WRITE_PATH.rejection(request) or request.buffers
    if why:
        return Route(GENERIC, {WRITE: why})
    return Route(WRITE, {GENERIC: f"{WRITE} serves this call (one assignment for every row)"})


@functools.lru_cache(maxsize=1024)
def route_attention(request: Request) -> Route:
    """The NumPy backend's attention decision (its dispatch and ``route`` both ask it):
    the BLAS path when it declares the request's layout, codec and variant
    (``FAST_PATHS``; every dtype, head dim and chunk length), else the generic code."""
    return choose(FAST_PATHS, request)


@functools.lru_cache(maxsize=256)
def write_request(spec, head_dim: int, tokens: str, buffers: str | None = None) -> Request:
    """The routing request of an append into a store of ``spec`` (kept: every layer of
    every step asks, and building a Request costs more than the lookup)."""
    return Request.make("write_kv", dtype=spec.q_dtype, head_dim=head_dim, layout=spec.kind,
                        codec=spec.codec.name, buffers=buffers, tokens=tokens)


class NumpyBackend(Backend):
    name = "numpy"
    priority = 10
    array_library = "numpy"
    device_kind = "cpu"
    dtypes = ("float32", "float64", "float16", "bfloat16")
    head_dims = None
    features = frozenset({"array_api", "bfloat16 via ml_dtypes", "float16/bfloat16 computed in float32",
                          "threaded BLAS attention (GQAKV_NUM_THREADS)"})
    fast_paths = (*FAST_PATHS, WRITE_PATH)
    packed_tokens = True  # the BLAS path and the generic defaults take [N, H, d] tokens
    wide_queries = True  # float32 q over a 16-bit store: computed and returned in float32
    generic_invariant = True  # equal operands and shapes give equal bits (CPU libraries)
    #: Whether a small call runs as one pass over the whole batch (``numpy_batch``).
    one_pass_batches = True

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

    def signature(self, x):
        import numpy as np

        return (type(x), x.shape, x.dtype) if isinstance(x, np.ndarray) else None  # one device

    def from_host_ints(self, a, device=None):
        # A copy no one can make writable again (a read-only view of ``a`` could be, and
        # then write ``a``: the cache's own lengths, once).
        return immutable_ints(a)

    # -- hooks for the tools (gqakv.dispatch.backend.Backend) ----------------------------------------

    #: What forces the BLAS path's key splits on small shapes (the self-test's split line).
    SPLIT_KNOBS: dict = dict(workers=2, min_key_split=16, parallel_min_work=0,
                             score_block_elements=1 << 10)

    def split_attention(self, dtype: str):
        from .numpy_attention import attention_numpy

        knobs = self.SPLIT_KNOBS

        def split(q, k, v, rows, lens, n_new, *, scale, return_lse):
            return attention_numpy(q, k, v, rows, lens, n_new, scale=scale, return_lse=return_lse,
                                   **knobs)
        return split, "forced splits (attention_numpy, 16-key pieces, 2 workers) + merge_attention"

    def thread_count(self) -> int | None:
        from .cpu_plan import _threads

        return _threads.default_workers()

    def threads_line(self) -> str:
        """The BLAS library and kernel (held to one thread while the backend's own workers
        run); validates GQAKV_NUM_THREADS first."""
        self.thread_count()
        try:
            from threadpoolctl import threadpool_info
        except ImportError:
            return "BLAS threads not controlled (threadpoolctl missing)"
        return ", ".join(f"{info.get('internal_api')} {info.get('version')} kernel {info.get('architecture')}"
                         for info in threadpool_info() if info.get("user_api") == "blas")

    def thread_note(self) -> str | None:
        from .cpu_plan import blas_spin_note

        return blas_spin_note()

    # -- routing ---------------------------------------------------------------------------

    def route(self, request: Request | str, **facts) -> Route:
        """The implementation that runs ``request`` (a ``Request`` or an operation and its
        facts; those not given are taken as favourable), from the decision the dispatch
        itself takes (``route_attention``; appends: ``route_write``); row copies are the
        generic code here."""
        request = as_request(request, facts)
        if request.op == "write_kv":
            return route_write(request)
        if request.op != "attention":
            return super().route(request)
        route = route_attention(request)
        return Route(route.impl, dict(route.rejected))  # the kept route stays unshared

    def implementations(self) -> dict[str, str]:
        return {
            BLAS: "attention over contiguous or paged rows (the page table read per key block), "
                  "plain or int8 / float8_e4m3fn (each block dequantized as read), every dtype "
                  "(float16/bfloat16 in float32); window, softcap, sinks, alibi, draft trees; "
                  "a small call as one pass over the whole batch (numpy_batch)",
            WRITE: "appends to rows or pages (plain, or the built-in codecs' codes and "
                   "scales, every token encoded at once), one assignment for every row",
            GENERIC: "appends in other codecs, row copies, attention over other codecs",
        }

    def write_kv(self, store, k_new, v_new, inputs) -> None:
        """Every entry's tokens by one assignment per buffer (``numpy_batch.append``;
        codes and scales encoded for every token at once; chunks of more than
        ``WRITE_MAX_ROW_TOKENS`` row by row), contiguous or paged; other codecs: the
        generic per-row writes (``route_write`` decides)."""
        from . import numpy_batch

        tokens = PACKED if k_new.ndim == 3 else PADDED
        if route_write(write_request(store.spec, store.head_dim, tokens)).impl == WRITE:
            numpy_batch.append(store, k_new, v_new, inputs)
        else:
            super().write_kv(store, k_new, v_new, inputs)

    def kernel_entries(self) -> tuple[tuple[str, str], ...]:
        """The one-pass batch's arithmetic, its gather of paged keys, its decoding of codes
        and the append's byte moves and encoding (``numpy_batch``); the item kernel's NumPy
        calls are not separable from the host work around them."""
        return ((f"{__package__}.numpy_batch", "attend_batch"),
                (f"{__package__}.numpy_batch", "gather_pages"),
                (f"{__package__}.numpy_batch", "decode_values"),
                (f"{__package__}.numpy_batch", "write_tokens"),
                (f"{__package__}.numpy_batch", "write_coded"),
                (f"{__package__}.numpy_batch", "write_rows"))

    def plan_attention(self, store, inputs, params, q_shape):
        """The BLAS path's work items and their sharing among threads (``numpy_attention.
        plan_items``) when it serves this batch, else None; with them, a small batch's
        one-pass plan (``numpy_batch.plan_batch``, None where the items run)."""
        if route_attention(Request.of_store("attention", store, features=inputs.features,
                                            **inputs.token_facts(q_shape))).impl != BLAS:
            return None
        from . import numpy_batch
        from .numpy_attention import entry_trees, plan_items

        work = plan_items(inputs.lens, inputs.n_new, q_shape, store.kv_heads, params,
                          invariant=inputs.invariant, trees=entry_trees(inputs),
                          blas_items=self.items_on_blas(store, inputs, q_shape))
        if self.one_pass_batches:
            work.batch = numpy_batch.plan_batch(store, inputs, params, q_shape)
        work.inputs = inputs  # the batch it was planned for (attention uses it for that one only)
        return work

    def items_on_blas(self, store, inputs, q_shape) -> bool:
        """Whether the BLAS path's items of this batch multiply on BLAS (``plan_items``'
        ``blas_items``): yes here; a subclass whose own item kernel takes them says no."""
        return True

    def blas_options(self) -> dict:
        """Keywords of ``numpy_attention.attend`` this backend's BLAS path runs with (a
        subclass's faster pieces; none here)."""
        return {}

    def attention(self, q, store, inputs, params, *, return_lse: bool, work=None, out=None,
                  lse_out=None):
        """BLAS matmuls on live blocks, shared among threads (``numpy_attention``), read
        through the store's block reader (``numpy_readers``: contiguous or paged, plain or
        dequantized as read) for the layouts, codecs and variants ``FAST_PATHS`` declares;
        otherwise the generic path (``route_attention`` decides). ``work``: this batch's
        ``plan_items`` (from ``plan_attention``); ``out`` / ``lse_out``: the caller's
        buffers, filled from the result."""
        from . import numpy_batch
        from .numpy_attention import NumpyWork, attention_store

        want_lse = return_lse or lse_out is not None
        if not (isinstance(work, NumpyWork) and work.inputs is inputs):
            work = None  # planned for another batch (or not for this path): plan here
        if work is not None and work.batch is not None:  # a small call: one pass over the batch
            result = numpy_batch.attention(work.batch, q, store, params, return_lse=want_lse)
        elif work is not None or route_attention(Request.of_store(
                "attention", store, features=inputs.features,
                **inputs.token_facts(q.shape))).impl == BLAS:
            result = attention_store(q, store, inputs, params, return_lse=want_lse,
                                     planned=work, **self.blas_options())
        else:
            result = super().attention(q, store, inputs, params, return_lse=want_lse)
        if out is None and lse_out is None:
            return result
        return write_into(result, return_lse, out, lse_out)
