"""Which implementation a backend's hot operations actually ran, and the checks that
``Backend.route`` names it and that it is the path a test meant to exercise.

``RouteSpy(backend, monkeypatch)`` wraps the backend's three hot operations (on the
instance: ``write_kv``, ``copy_tokens``, ``attention``) and the entry of every
implementation they can reach: the generic array-API functions, the NumPy BLAS path
(``numpy_attention.attention_store``: one item kernel over every reader), the numba kernels
(``numba_kernels.attention_items``, ``write_tokens``, ``copy_rows``; the BLAS path's
items on bf16 products, where its hook takes a call) and, for the
emulated CuPy backend, its kernel launches (``EmulatedCupyBackend._run_plan``: the first
launch's kernel). Each hot-operation call is recorded as a ``Call``: the operation, the
facts ``route`` reads, worked out here from the call's arguments (not by the backend's
code), and the implementations entered during it, first the one that ran.

``assert_routes_ran(spy)`` asks ``backend.route(op, **facts)`` for every recorded call
and fails unless it names the implementation that ran; ``assert_intended(spy)`` fails
unless what ran is what the test means to exercise (``intended``: written from each
backend's documentation, not its dispatch code), so a fast path that silently falls
back to a slower one fails both.

The spy is per thread (calls made from other threads are recorded too: each thread has
its own open call).
"""

from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gqakv.dispatch.backend import GENERIC, HOT_OPS

#: The entries of the generic array-API code (gqakv's Backend defaults), by operation.
GENERIC_ENTRIES = (("gqakv.ops.attention", "attention_array_api"),
                   ("gqakv.ops.cache_ops", "write_kv_array_api"),
                   ("gqakv.ops.row_ops", "copy_tokens_array_api"))
#: (module, function, implementation name) of the NumPy backend's BLAS path.
#: (A small call's one pass over the batch, ``numpy_batch.attention``, is the BLAS path too.)
NUMPY_ENTRIES = (("gqakv_backends.numpy_attention", "attention_store", "numpy BLAS"),
                 ("gqakv_backends.numpy_batch", "attention", "numpy BLAS"),
                 ("gqakv_backends.numpy_batch", "write_tokens", "numpy write_tokens"),
                 ("gqakv_backends.numpy_batch", "write_coded", "numpy write_tokens"),
                 ("gqakv_backends.numpy_batch", "write_rows", "numpy write_tokens"))
#: ... and of the numba backend's kernels (it also reaches the NumPy paths).
NUMBA_ENTRIES = (("gqakv_backends.numba_kernels", "attention_items", "numba kernel"),
                 ("gqakv_backends.numba_kernels", "write_tokens", "numba write_tokens"),
                 ("gqakv_backends.numba_kernels", "copy_rows", "numba copy_rows"))
#: The numba backend's BLAS path with its items on bf16 products: the hook that hands a call's
#: items to the tiles (its result None: the call is not theirs). A call it takes ran
#: "numba bf16 products" rather than the BLAS path it refines.
NUMBA_AMX_ENTRY = ("gqakv_backends.numba_backend", "_amx_items", "numba bf16 products", "numpy BLAS")


@dataclass
class Call:
    """One hot-operation call: ``op``, the route ``facts`` of its arguments, whether it
    had any token to write / copy / attend (``work``), and the implementations entered
    while it ran (``ran``; the first is the one that ran)."""

    op: str
    facts: dict[str, Any]
    work: bool
    ran: list[str] = field(default_factory=list)
    #: a packed batch split between the numba kernels (rows of at most 8 queries) and
    #: the BLAS path (``numba_backend.run_mixed``): its route names the long rows' path
    #: (``t_q`` is the longest row's), so that path is the one it ran, the kernels after
    mixed: bool = False


class RouteSpy:
    """Records what each hot-operation call of ``backend`` ran (see the module docstring);
    undone with ``monkeypatch``."""

    def __init__(self, backend, monkeypatch):
        self.backend = backend
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        for module, name in GENERIC_ENTRIES:
            self._spy_entry(monkeypatch, module, name, GENERIC)
        kind = _kind(backend)
        if kind in ("numpy", "numba"):
            for module, name, impl in NUMPY_ENTRIES:
                self._spy_entry(monkeypatch, module, name, impl)
        if kind == "numba":
            for module, name, impl in NUMBA_ENTRIES:
                self._spy_entry(monkeypatch, module, name, impl)
            self._spy_refinement(monkeypatch, *NUMBA_AMX_ENTRY)
            self._spy_mixed(monkeypatch)
        if kind == "cupy_emulated":
            real_run = backend._run_plan

            def run_plan(plan, *rest):
                if plan.launches:
                    self._entered(plan.launches[0].kernel)
                return real_run(plan, *rest)

            monkeypatch.setattr(backend, "_run_plan", run_plan)
        for op in HOT_OPS:
            monkeypatch.setattr(backend, op, self._spy_op(op, getattr(backend, op)))

    def _frames(self) -> list[Call]:
        frames = getattr(self._local, "frames", None)
        if frames is None:
            frames = self._local.frames = []
        return frames

    def _entered(self, impl: str) -> None:
        frames = self._frames()
        if frames:  # an entry reached outside a hot operation is not a route's business
            frames[-1].ran.append(impl)

    def _spy_entry(self, monkeypatch, module: str, name: str, impl: str) -> None:
        mod = importlib.import_module(module)
        real = getattr(mod, name)

        def entry(*args, **kwargs):
            self._entered(impl)
            return real(*args, **kwargs)

        monkeypatch.setattr(mod, name, entry)

    def _spy_refinement(self, monkeypatch, module: str, name: str, impl: str, refines: str) -> None:
        """Spy on a hook through which the implementation ``refines`` hands a call to
        ``impl`` (a result that is not None: it took the call): the call then ran ``impl``."""
        mod = importlib.import_module(module)
        real = getattr(mod, name)

        def hook(*args, **kwargs):
            result = real(*args, **kwargs)
            frames = self._frames()
            if result is not None and frames and refines in frames[-1].ran:
                ran = frames[-1].ran
                if impl not in ran:
                    ran.insert(ran.index(refines), impl)
            return result

        monkeypatch.setattr(mod, name, hook)

    def _spy_mixed(self, monkeypatch) -> None:
        """Mark the calls that run a packed batch split in two (``Call.mixed``); its BLAS
        part enters ``numpy_attention.attend`` directly, recorded as the BLAS path."""
        from gqakv_backends import numba_backend, numpy_attention

        real_mixed, real_attend = numba_backend.run_mixed, numpy_attention.attend

        def run_mixed(*args, **kwargs):
            frames = self._frames()
            if frames:
                frames[-1].mixed = True
            return real_mixed(*args, **kwargs)

        def attend(*args, **kwargs):
            frames = self._frames()
            if frames and frames[-1].mixed and "numpy BLAS" not in frames[-1].ran:
                frames[-1].ran.append("numpy BLAS")
            return real_attend(*args, **kwargs)

        monkeypatch.setattr(numba_backend, "run_mixed", run_mixed)
        monkeypatch.setattr(numpy_attention, "attend", attend)

    def _spy_op(self, op: str, real):
        def hot(*args, **kwargs):
            call = Call(op, call_facts(self.backend, op, args), _has_work(op, args))
            self._frames().append(call)
            try:
                return real(*args, **kwargs)
            finally:
                self._frames().pop()
                if call.mixed:  # the long rows' path first (stable: the kernels after it)
                    call.ran.sort(key=lambda impl: impl == "numba kernel")
                with self._lock:
                    self.calls.append(call)

        return hot

    def ran(self, op: str) -> list[str | None]:
        """What each recorded ``op`` call ran (None: nothing was entered)."""
        return [c.ran[0] if c.ran else None for c in self.calls if c.op == op]


def _kind(backend) -> str:
    """Which entries a backend can reach: by its class, so a subclass is spied on too."""
    names = {cls.__name__ for cls in type(backend).__mro__}
    if "EmulatedCupyBackend" in names:
        return "cupy_emulated"
    if "NumbaBackend" in names:
        return "numba"
    if "NumpyBackend" in names:
        return "numpy"
    return "generic"


def call_facts(backend, op: str, args: tuple) -> dict[str, Any]:
    """The facts ``route`` reads, from a hot operation's positional arguments (attention:
    q, store, inputs, params; write_kv: store, k_new, v_new, inputs; copy_tokens: dst,
    dst_rows, src, src_rows, n_tokens)."""
    store = args[1] if op == "attention" else args[0]
    facts: dict[str, Any] = {
        "dtype": store.spec.q_dtype, "head_dim": int(store.head_dim),
        "layout": store.kind, "codec": store.dtype if store.quantized else None}
    if op == "attention":
        q, inputs, params = args[0], args[2], args[3]
        facts["group"] = max(1, int(q.shape[1]) // int(store.kv_heads))
        # the params' variants, and "tree" for a draft tree's call
        features = params.features | ({"tree"} if getattr(inputs, "tree", None) is not None
                                      else set())
        if getattr(inputs, "offsets", None) is None:
            facts.update(t_q=int(q.shape[2]), features=features)
        else:  # packed [N, Hq, d]: the queries per row are n_new's (at least one)
            facts.update(t_q=max(1, int(np.max(inputs.n_new, initial=0))),
                         features=features, tokens="packed")
        facts["keys"] = int(np.max(inputs.lens, initial=0))  # the longest row's live tokens
        if getattr(inputs, "invariant", False):  # batch-invariant mode, as validated
            facts["invariant"] = True
        if _kind(backend) == "cupy_emulated":
            from ..cuda_emu.emulated_backend import EmulatedDevice

            facts["capability"] = int(EmulatedDevice.compute_capability)
    elif op == "write_kv" and args[1].ndim == 3:  # packed new K/V [N, Hkv, d]
        facts["tokens"] = "packed"
    return facts


def _has_work(op: str, args: tuple) -> bool:
    if op == "copy_tokens":
        return int(np.sum(np.asarray(args[4]))) > 0
    inputs = args[2] if op == "attention" else args[3]
    return int(np.sum(np.asarray(inputs.n_new))) > 0


def assert_routes_ran(spy: RouteSpy, ops=HOT_OPS) -> None:
    """Every recorded call of ``ops`` ran what ``backend.route`` names for its facts (a
    call with no token to move may enter nothing)."""
    calls = [c for c in spy.calls if c.op in ops]
    assert calls, f"no {'/'.join(ops)} call was recorded on {spy.backend.name}"
    for call in calls:
        route = spy.backend.route(call.op, **call.facts)
        ran = call.ran[0] if call.ran else None
        if ran is None and not call.work:
            continue
        assert ran == route.impl, (f"{spy.backend.name} {call.op} {call.facts}: route says "
                                   f"{route.impl!r}, ran {ran!r} (route: {route})")


#: What the cross-cutting tests mean to exercise, from each backend's documentation
#: (README / module docstrings), written apart from the dispatch code: backend name ->
#: op -> function(facts) -> an implementation name, FAST (any path but the generic one),
#: GENERIC (the backend has no other), or REFUSED(words) (the generic code, with a
#: route naming why: every word in its sentence).
FAST = "a fast path"


@dataclass(frozen=True)
class Refused:
    words: tuple[str, ...]


#: The 8-bit per-token codecs (the numba kernels decode these and the grouped ones).
CPU_CODECS = (None, "int8", "float8_e4m3fn")
#: The grouped codecs (a scale per block of values).
GROUPED_CODECS = ("int8_g32", "int4_g32", "int4_g64", "int4_g32_rotated")
#: ... and the NumPy BLAS path's (numpy_readers' coded reader over either layout): those and
#: the grouped codecs. Any other is refused by name.
BLAS_CODECS = (*CPU_CODECS, *GROUPED_CODECS)
#: The CUDA append, attention and row-copy kernels' (kernels/quantized_kv.cuh's reader and
#: append; the copy moves codes and scales as rows of their own width).
CUDA_CODECS = BLAS_CODECS


def _numpy_attention(f) -> Any:
    if f["codec"] not in BLAS_CODECS:
        return Refused((f"kv_dtype={f['codec']!r}",))
    return FAST


def cpu_has_bf16_products() -> bool:
    """Whether this machine runs gqakv's bfloat16 products (AMX tiles or AVX-512 BF16 dot
    products): Linux's CPU flags name ``amx_bf16`` or ``avx512_bf16`` and ``GQAKV_AMX`` is
    not 0 (the performance guide's conditions)."""
    if os.environ.get("GQAKV_AMX", "1").strip() == "0":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and {"amx_bf16", "avx512_bf16"} & set(line.split())
                       for line in f)
    except OSError:
        return False


def _numba_blas(f) -> Any:
    # the BLAS path; its items on bf16 products where the CPU has them, for bfloat16 queries
    # over plain bfloat16 or per-token 8-bit codes, d a multiple of 32, and the variants
    # window, softcap and sinks (the performance guide, "bfloat16 on AMX tiles")
    want = _numpy_attention(f)
    if (want == FAST and f["dtype"] == "bfloat16" and f["codec"] in CPU_CODECS
            and f["head_dim"] % 32 == 0 and not f.get("features", set()) - {"window", "softcap", "sinks"}
            and cpu_has_bf16_products()):
        return "numba bf16 products"
    return want


def _numba_attention(f) -> Any:
    # the kernels decode the 8-bit per-token codes and the grouped ones (a key block at a
    # time); any other codec: the BLAS path's
    if f["codec"] not in (*CPU_CODECS, *GROUPED_CODECS):
        return _numpy_attention(f)
    # decode and short chunks whose tiles (G heads x T queries) hold at most 64 rows: the
    # kernels (numba_backend.KERNEL_MAX_TILE_ROWS); batch-invariant calls at every chunk
    # length and tile size (one query per item, so a query's bits do not depend on its chunk),
    # and so are calls whose rows hold at most 128 keys (KERNEL_SHORT_ROW_KEYS)
    short_rows = f.get("keys") is not None and f["keys"] <= 128
    if f["dtype"] != "float64" and (f.get("invariant") or short_rows or (
            f["t_q"] <= 8 and f.get("group", 1) * f["t_q"] <= 64)):
        return "numba kernel"
    return _numba_blas(f)


def _numpy_write(f):
    # every built-in codec (codes encoded for every token at once); a codec registered
    # elsewhere takes the generic per-row writes
    return "numpy write_tokens" if f["codec"] in BLAS_CODECS else GENERIC


def _plain_contiguous(impl):
    return lambda f: impl if f["layout"] == "contiguous" and not f["codec"] else GENERIC


def _cupy_store(f) -> Any:
    # every (layout, codec) pair and variant the product has, paged 8-bit and ALiBi too
    # (the 8-bit reader wraps the paged one; ALiBi is a flag of the variant trait), and draft
    # trees (the prefill kernels' TREE flag, at every t_q); float64
    # has no kernels; the kernels read padded tokens only: packed ones are refused by name
    if f["dtype"] == "float64":
        return GENERIC
    if f.get("codec") not in CUDA_CODECS:  # the kernels decode the 8-bit and grouped codes only
        return Refused((f"kv_dtype={f['codec']!r}",))
    if f.get("tokens") == "packed":
        return Refused(("packed tokens",))
    return FAST


INTENDED = {
    "numpy": {"attention": _numpy_attention,
              "write_kv": lambda f: _numpy_write(f)},
    "numba": {"attention": _numba_attention,
              "write_kv": lambda f: ("numba write_tokens" if f["layout"] == "contiguous"
                                     and not f["codec"] else _numpy_write(f)),
              "copy_tokens": _plain_contiguous("numba copy_rows")},
    "cupy_emulated": {"attention": _cupy_store, "write_kv": _cupy_store,
                      "copy_tokens": _cupy_store},
}


def intended(backend_name: str, op: str, facts: dict[str, Any]) -> Any:
    """What a test means ``op`` with ``facts`` to run on ``backend_name`` (see INTENDED;
    a backend or operation not listed has only the generic code)."""
    rule = INTENDED.get(backend_name, {}).get(op)
    return GENERIC if rule is None else rule(facts)


def assert_intended(spy: RouteSpy, ops=HOT_OPS) -> None:
    """Every recorded call of ``ops`` that had work ran the implementation the test meant
    (``intended``); a refused one ran the generic code with a route saying why."""
    calls = [c for c in spy.calls if c.op in ops and c.work]
    assert calls, f"no {'/'.join(ops)} call with work was recorded on {spy.backend.name}"
    for call in calls:
        want = intended(spy.backend.name, call.op, call.facts)
        ran = call.ran[0] if call.ran else None
        where = f"{spy.backend.name} {call.op} {call.facts}"
        if want == FAST:
            assert ran not in (None, GENERIC), f"{where}: meant a fast path, ran {ran!r}"
        elif isinstance(want, Refused):
            why = str(spy.backend.route(call.op, **call.facts))
            assert ran == GENERIC and all(w in why for w in want.words), (
                f"{where}: meant the generic code with a refusal naming {want.words}, ran "
                f"{ran!r} (route: {why})")
        else:
            assert ran == want, f"{where}: meant {want!r}, ran {ran!r}"


def assert_product_routes(spy: RouteSpy, ops=HOT_OPS) -> None:
    """Both checks: route() tells the truth, and the truth is the path meant."""
    assert_routes_ran(spy, ops)
    assert_intended(spy, ops)
