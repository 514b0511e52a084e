"""What a backend is: a capability table plus the few operations gqakv needs.

A backend owns where cache buffers live (array library and device) and how the hot
operations run: writing new K/V in place (``write_kv``), copying rows' tokens
(``copy_tokens``) and grouped-query attention over the live part of the cache
(``attention``). Each takes the cache's ``gqakv.storage.store.KVStore`` (layout, dtypes and the
buffers) rather than raw buffers, and attention its ``AttentionParams``. The defaults
here are the generic array-API implementations, which read and write only through the
store's methods, so a backend for a new array library only has to say how to allocate,
and a new storage kind or attention variant runs on every backend through them; a
backend with fused kernels overrides the hot operations for the storage kinds and
variants it implements and hands the others to these defaults.

Capabilities are plain data (``dtypes``, ``head_dims``, ``features``, ``fast_paths``) and
``not_supported_reasons`` turns them into sentences, so the dispatcher and
``gqakv info`` can explain every rejection. Per call, ``route`` says which implementation
of a hot operation runs and why each other one was not eligible (``Route``). Both take
one ``gqakv.dispatch.request.Request``: the call's dtype, head dim, layout, codec,
variant features and measured conditions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..core import dtypes as _dtypes
# the generic implementations, looked up on their modules at each call (tests spy on them there)
from ..ops import attention as _attention, cache_ops as _cache_ops, row_ops as _row_ops
from ..storage.codecs import PLAIN_NAME
from ..core.inputs import PADDED
from .request import HOT_OPS, Request, as_request

__all__ = ["GENERIC", "HOT_OPS", "Backend", "FastPath", "Request", "Route", "choose"]

#: The implementation name of the generic array-API code (the ``Backend`` defaults).
GENERIC = "generic array-API"


@dataclass(frozen=True)
class Route:
    """Which implementation runs a call (``impl``: a fused kernel's name or ``GENERIC``)
    and, for each implementation not chosen, the sentence saying why it was not eligible
    (``rejected``; read-only by convention: routes are kept and shared)."""

    impl: str
    rejected: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        why = "".join(f"; not {name}: {reason}" for name, reason in self.rejected.items())
        return f"{self.impl}{why}"


@dataclass(frozen=True)
class FastPath:
    """What one fast path of a backend implements, declared as data on the backend class
    (``Backend.fast_paths``): the hot operation it serves, the storage layouts
    (``"contiguous"``, ``"paged"``) and codecs (``gqakv.storage.codecs``: ``"none"`` for plain
    values, ``"int8"``, ...) it reads or writes, the attention variant features it
    implements (``AttentionParams.features``), the dtypes of q / new K/V (None: every
    dtype of the backend) and the layouts of the new tokens it takes (``Request.tokens``:
    padded ``[B, H, T, d]`` and/or packed ``[N, H, d]``). A call it does not declare is refused by ``rejection`` with a
    sentence, never computed: a new codec or variant is served by no fast path until one
    declares it, and runs on the generic array-API path meanwhile.
    """

    name: str
    op: str
    layouts: frozenset[str]
    codecs: frozenset[str]
    features: frozenset[str] = frozenset()
    dtypes: frozenset[str] | None = None
    tokens: frozenset[str] = frozenset({PADDED})
    #: whether it keeps a query's bits independent of the batch when asked
    #: (``Request.invariant``, ``gqakv.core.invariance``)
    invariant: bool = False

    def rejection(self, request: Request) -> str | None:
        """None when this path implements ``request`` (its layout, codec, variant features
        and dtype; the other facts are the backend's per-call conditions), else why not
        (one sentence)."""
        features, layout, codec, dtype = request.features, request.layout, request.codec, request.dtype
        missing = features - self.features
        if missing:
            variant = "+".join(("causal", *sorted(features)))  # AttentionParams.variant's name
            return (f"attention variant {variant!r}: {self.name} does not implement "
                    f"{', '.join(sorted(missing))}")
        if layout not in self.layouts:
            return f"storage layout {layout!r} ({self.name} reads {', '.join(sorted(self.layouts))})"
        if codec not in self.codecs:
            known = [("unquantized" if c == PLAIN_NAME else f"kv_dtype={c!r}") for c in sorted(self.codecs)]
            what = "unquantized K/V" if codec == PLAIN_NAME else f"kv_dtype={codec!r}"
            return f"{what} ({self.name} reads {', '.join(known)} K/V)"
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            return f"dtype={dtype} ({self.name} computes {', '.join(sorted(self.dtypes))})"
        if request.tokens not in self.tokens:
            return (f"{request.tokens} tokens ({self.name} takes "
                    f"{' and '.join(sorted(self.tokens))} q / K / V)")
        if request.invariant and not self.invariant:
            return f"batch-invariant mode ({self.name}'s results depend on the batch)"
        return None

    def describe(self) -> str:
        """One line for ``gqakv info``: what this path declares."""
        parts = [f"{self.op} over {'/'.join(sorted(self.layouts))} storage, codecs "
                 f"{'/'.join(sorted(self.codecs))}"]
        if self.features:
            parts.append(f"variants {'/'.join(sorted(self.features))}")
        if self.dtypes is not None:
            parts.append(f"dtypes {'/'.join(sorted(self.dtypes))}")
        if self.tokens != {PADDED}:
            parts.append(f"tokens {'/'.join(sorted(self.tokens))}")
        if self.invariant:
            parts.append("batch-invariant mode")
        return "; ".join(parts)


def choose(paths, request: Request) -> Route:
    """The first of ``paths`` (FastPaths, in priority order) that implements ``request``
    (``FastPath.rejection``), else the generic code; every path not chosen with its
    reason."""
    rejected: dict[str, str] = {}
    paths = tuple(paths)
    for i, path in enumerate(paths):
        why = path.rejection(request)
        if why is None:
            served = f"{path.name} serves this call (fast paths come first)"
            later = {p.name: served for p in paths[i + 1:]}
            return Route(path.name, {**rejected, **later, GENERIC: served})
        rejected[path.name] = why
    return Route(GENERIC, rejected)


class Backend:
    """Base class for gqakv backends; subclasses set the class attributes below."""

    #: Name used with ``backend=...``, ``use_backend(...)`` and ``GQAKV_BACKEND``.
    name: ClassVar[str] = "?"
    #: 'auto' picks the runnable backend with the highest priority.
    priority: ClassVar[int] = 0
    #: Array library the buffers belong to, and the kind of device.
    array_library: ClassVar[str] = "?"
    device_kind: ClassVar[str] = "cpu"
    #: Cache dtypes this backend stores and computes with.
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "float64")
    #: Head dims supported; None means any positive head dim.
    head_dims: ClassVar[tuple[int, ...] | None] = None
    #: Free-form feature names shown by ``gqakv info`` (e.g. "fused_decode").
    features: ClassVar[frozenset[str]] = frozenset()
    #: What each fast path implements (``FastPath``), in the order dispatch tries them;
    #: empty: every call runs the generic array-API code.
    fast_paths: ClassVar[tuple[FastPath, ...]] = ()
    #: Whether ``write_kv`` and ``attention`` take packed new tokens (``inputs.offsets``
    #: set: k_new / v_new ``[N, Hkv, d]``, q and out ``[N, Hq, d]``, lse ``[N, Hq]``). The
    #: generic defaults do; a backend that overrides them says so once it handles them
    #: (False: a packed call to it is refused before anything is written).
    packed_tokens: ClassVar[bool] = False
    #: Whether ``attention`` takes float32 queries over a float16 / bfloat16 store (of
    #: work planned for the store's own q dtype) and returns float32 outputs: what lets a
    #: call made of parts (``gqakv.ops.shared_prefix``) merge unrounded partials and round
    #: once. The generic defaults do (they compute in the wider dtype); a backend whose
    #: compiled kernels are built per q dtype leaves it False, and its partials are then
    #: rounded to the q dtype before the merge.
    wide_queries: ClassVar[bool] = False
    #: How many times ``gqakv.ops.shared_prefix.MIN_SAVED_TOKENS`` key reads a shared-prefix
    #: group must save on this backend, by bytes per stored K/V value (4, 2, 1: codes and
    #: narrower). A group's shared call does the same arithmetic the rows would (so it pays
    #: only where reading a key costs more than G rows' arithmetic over it), and narrower
    #: storage saves fewer bytes per read: a backend whose kernels are compute-bound on
    #: narrow storage asks for more. Missing entries: 1.
    shared_prefix_read_factor: ClassVar[dict[int, int]] = {}
    #: Whether the generic array-API code keeps a query's bits independent of the batch
    #: in batch-invariant mode (``gqakv.core.invariance``) on this backend's arrays. In
    #: that mode the generic code gives each query its own tile, so its keys are read in
    #: the same blocks whatever its chunk or batch; what it cannot know is whether the
    #: array library gives equal bits for equal operands and shapes (a matmul that splits
    #: its reduction by load or by the device's occupancy does not). A backend says so
    #: once it does (NumPy, torch on the CPU, array-api-strict); False: a call in the mode
    #: that would take the generic code is refused.
    generic_invariant: ClassVar[bool] = False

    # -- availability and capabilities ---------------------------------------------------

    def unavailable_reason(self) -> str | None:
        """None when this backend can run here, else a sentence saying why not."""
        return None

    def not_supported_reasons(self, request: Request | None = None, **facts) -> list[str]:
        """Why this backend cannot serve ``request`` (a ``Request``, or its facts as
        keywords: ``dtype=``, ``head_dim=``, ...): it cannot run here, or it cannot hold a
        cache of that dtype or head dim. Empty: it can (every layout, codec and variant
        runs at least on the generic path; ``route`` says which implementation serves a
        call)."""
        why = self.unavailable_reason()
        reasons = [why] if why else []
        try:
            request = as_request(request, facts)
        except TypeError as exc:  # a dtype gqakv does not know
            return [*reasons, str(exc)]
        if request.dtype is not None and request.dtype not in self.dtypes:
            reasons.append(f"dtype={request.dtype} (supported: {', '.join(self.dtypes)})")
        head_dim = request.head_dim
        if head_dim is not None and self.head_dims is not None and head_dim not in self.head_dims:
            dims = ", ".join(str(h) for h in self.head_dims)
            reasons.append(f"head_dim={head_dim} (supported: {dims})")
        return reasons

    # -- arrays ----------------------------------------------------------------------------

    def namespace(self):
        """The array-API namespace of this backend's arrays."""
        raise NotImplementedError

    def dtype(self, name: str):
        """This library's dtype object for a gqakv dtype name."""
        return getattr(self.namespace(), _dtypes.canonical_name(name))

    def empty(self, shape: tuple[int, ...], dtype: str, device=None):
        """Uninitialized buffer of ``shape`` on ``device`` (as ``device_of`` reports it; None:
        the library's default); raises MemoryError when it cannot fit."""
        xp = self.namespace()
        if device is None:
            return xp.empty(shape, dtype=self.dtype(dtype))
        return xp.empty(shape, dtype=self.dtype(dtype), device=device)

    def owns(self, x) -> bool:
        """True when ``x`` is an array of this backend's library."""
        from array_api_compat import array_namespace

        try:
            return array_namespace(x) is self.namespace()
        except TypeError:
            return False

    def device_of(self, x) -> Any:
        from array_api_compat import device

        return device(x)

    def signature(self, x) -> tuple | None:
        """What the checks of an array argument judge of ``x`` (its type, device, shape and
        dtype) as a hashable tuple: two arrays with equal signatures pass or fail the same
        checks, so a step checks each layer's tensors by comparing them. None when ``x``
        is not an array of this backend (it is then checked in full every time)."""
        try:
            if not self.owns(x):
                return None
            return (type(x), self.device_of(x), tuple(x.shape), x.dtype)
        except Exception:  # anything odd: checked in full
            return None

    def from_numpy(self, a: np.ndarray, dtype=None):
        """A copy of the NumPy array ``a`` in this backend's library (optionally cast to ``dtype``)."""
        xp = self.namespace()
        if dtype is None:
            return xp.asarray(a)
        return xp.asarray(np.asarray(a), dtype=self.dtype(dtype))

    def to_numpy(self, x) -> np.ndarray:
        """A NumPy array holding the values of ``x`` (a host copy for device arrays)."""
        if isinstance(x, np.ndarray):
            return x
        return np.from_dlpack(x)

    def from_host_ints(self, a: np.ndarray, device=None):
        """An int64 array of this backend holding the host values ``a``."""
        xp = self.namespace()
        return xp.asarray(a, dtype=xp.int64, device=device)

    # -- routing -----------------------------------------------------------------------------

    def route(self, request: Request | str, **facts) -> Route:
        """Which implementation runs ``request`` (a ``Request``, or an operation of
        ``HOT_OPS`` with its facts as keywords: dtype, head_dim, t_q, layout, codec,
        features, ...; those not given are taken as favourable), and why each other one
        was not eligible. The default: the generic array-API code, with nothing else to
        choose from; a backend with ``fast_paths`` chooses among them (``choose``)."""
        request = as_request(request, facts)
        if request.op is None:
            raise ValueError(f"route needs an operation (one of {', '.join(HOT_OPS)})")
        paths = [p for p in self.fast_paths if p.op == request.op]
        return choose(paths, request) if paths else Route(GENERIC)

    def implementations(self) -> dict[str, str]:
        """Implementation name -> its declared limits, for ``gqakv info`` (empty: nothing
        beyond the capability table)."""
        return {}

    # -- hot operations (generic array-API defaults) -------------------------------------------

    def write_kv(self, store, k_new, v_new, inputs) -> None:
        """Write entry i's first ``inputs.n_new[i]`` tokens of ``k_new``/``v_new``
        (``[B, Hkv, T, d]``; packed ``[N, Hkv, d]`` when ``inputs.offsets`` is set) into row
        ``inputs.rows[i]`` of ``store`` (a KVStore without leading axes) at tokens
        ``inputs.starts[i]...``.

        ``inputs`` is the validated ``gqakv.core.inputs.AppendInputs`` (host int arrays).
        """
        _cache_ops.write_kv_array_api(store, k_new, v_new, inputs.rows, inputs.starts, inputs.n_new,
                                      getattr(inputs, "offsets", None))

    def copy_tokens(self, dst, dst_rows, src, src_rows, n_tokens) -> None:
        """Copy tokens ``:n_tokens[i]`` of row ``src_rows[i]`` of ``src`` to row ``dst_rows[i]``
        of ``dst``, every layer.

        ``dst`` and ``src`` are KVStores with a leading layer axis (K and V
        ``[layers, rows, Hkv, max_len, d]`` for contiguous storage; they may be the same
        store). The copies of one call are independent: no destination is read by
        another copy of the call, so a backend may run them all in one launch. Inputs are
        validated and ordered by ``gqakv.ops.row_ops``; the index arrays are host ints.
        """
        _row_ops.copy_tokens_array_api(dst, dst_rows, src, src_rows, n_tokens)

    def plan_attention(self, store, inputs, params, q_shape) -> Any:
        """What this backend can work out once for every attention call of a batch (a step's
        layers): ``store`` is the first layer's KVStore, ``inputs`` the validated
        ``AttentionInputs``, ``q_shape`` ``(B, Hq, T, d)`` (packed: ``(N, Hq, d)``). None
        (the default): nothing; each call is then ``attention(q, store, inputs, params,
        return_lse=...)`` as always. Anything else is handed back to each call as
        ``attention(..., return_lse=True, work=..., out=..., lse_out=...)``, which must
        then write into the caller's ``out`` / ``lse_out`` when they are given (checked
        already) and return ``(out, lse)`` (``gqakv.ops.plan``)."""
        return None

    def plan_fixed_attention(self, store, inputs, params, q_shape, *, splits=None) -> Any:
        """``plan_attention`` for fixed capacities (CUDA graphs): work whose launches and
        device buffers do not depend on the lengths, so that ``update_attention`` can
        give it the next step's in place (``splits``: a fixed decode split count, None:
        the backend's choice). The default: ValueError (this backend plans per batch)."""
        raise ValueError(f"backend {self.name!r} has no fixed-buffer attention plans (it plans "
                         "each batch for its lengths: use plan_attention without fixed=)")

    def update_attention(self, work, store, inputs) -> None:
        """Give ``plan_fixed_attention``'s work new ``inputs`` (the same query shape and
        variant, validated) in place."""
        raise ValueError(f"backend {self.name!r} has no fixed-buffer attention plans")

    def attention(self, q, store, inputs, params, *, return_lse: bool):
        """Grouped-query attention of ``q`` over the live cache; see ``gqakv.gqa_attention``.

        store: the KVStore (no leading axes); inputs: the validated
        ``gqakv.core.inputs.AttentionInputs`` (rows, lens, n_new: host ints [B]); params: the
        ``gqakv.core.semantics.AttentionParams``. A backend whose ``plan_attention``
        returns work also takes ``work``, ``out`` and ``lse_out`` here (see there).
        """
        return _attention.attention_array_api(q, store, inputs, params, return_lse=return_lse)

    def invariant_attention(self) -> frozenset[str]:
        """The names of the attention implementations that honour batch-invariant mode:
        the fast paths that declare it (``FastPath.invariant``), and the generic code where
        ``generic_invariant`` says this backend's array library allows it."""
        names = {p.name for p in self.fast_paths if p.op == "attention" and p.invariant}
        return frozenset(names | ({GENERIC} if self.generic_invariant else set()))

    # -- hooks for the tools (selftest, bench, distributed, integrations) ------------------
    # The tools ask the backend instead of switching on its name, so a third-party backend
    # can say the same things about itself.

    def compile_kernels(self, dtypes, head_dims) -> list[str]:
        """Build every kernel this backend would compile for caches of ``dtypes`` and
        ``head_dims`` ahead of use; returns the names built (empty: nothing is built ahead,
        see ``compile_note``)."""
        return []

    def compile_note(self) -> str | None:
        """How kernels are built when ``compile_kernels`` builds none ahead (a JIT, ...),
        for ``gqakv selftest``'s compile line; None: this backend has no kernels."""
        return None

    def split_attention(self, dtype: str):
        """``(fn, note)`` for the self-test's split line: ``fn(q, k, v, rows, lens, n_new, *,
        scale, return_lse)`` runs this backend's attention over contiguous buffers with its
        key range forced into small pieces (None when the backend has no such knob), and
        ``note`` says how the line exercises splits."""
        return None, "long rows through the backend's attention + merge_attention"

    def served_counts(self) -> dict[str, int]:
        """Running counts of the work done by fast paths inside an implementation that are
        not routes of their own (name -> count in this process), so ``gqakv selftest``
        can say which of them its lines reached; empty by default."""
        return {}

    def kernel_entries(self) -> tuple[tuple[str, str], ...]:
        """``(module, function)`` of each function that runs this backend's kernels (the
        arithmetic and the byte moves, not the host work around them), for the host-time
        benchmark (``gqakv.tools.host_time``), which replaces them with no-ops. Empty: the
        backend's work is array-library calls with no such boundary."""
        return ()

    def thread_count(self) -> int | None:
        """The CPU threads a hot call runs on (``gqakv bench``'s ``threads``; a peer gets as
        many), or None (a device backend, or one that does not thread)."""
        return None

    def threads_line(self) -> str:
        """One line on how this backend threads, for ``gqakv bench`` ("" for nothing to
        say); raises ValueError for a bad thread setting (GQAKV_NUM_THREADS)."""
        return ""

    def thread_note(self) -> str | None:
        """Advice about the process's threads that would cost this backend time (``gqakv
        info`` and ``gqakv generate`` print it), or None: nothing to say."""
        return None

    def for_device(self, device) -> "Backend":
        """This backend allocating on ``device`` (a device of its array library); the
        default, for single-device backends: itself when ``device`` is None."""
        if device is None:
            return self
        raise ValueError(f"backend {self.name!r} has one device; device={device!r} is not one of its own")

    def for_local_device(self, index: int) -> "Backend":
        """This backend bound to the process's device ``index`` on its node (torchrun's
        LOCAL_RANK), for ``gqakv.distributed``: CPU backends are returned as they are."""
        return self

    def synchronize(self) -> None:
        """Wait for work queued on the device (a no-op for synchronous CPU libraries), so
        that wall-clock timings are honest."""

    def __repr__(self) -> str:
        return f"<gqakv backend {self.name!r}>"
