"""The cupy backend: the cache on a CUDA device, fused CUDA kernels for the hot paths.

* ``write_kv`` (append) is one kernel launch for all rows, ragged ``n_new`` included.
* ``copy_tokens`` (the row copies of reorder and fork) is one launch per call: every
  layer, every (dst, src) row pair, only the first ``n_tokens[i]`` tokens of each.
* ``attention`` runs the decode kernel for T <= 4 (the G query heads of a KV head folded
  into one CTA's query tile, so live K/V are read once per KV head), split-KV plus a
  merge kernel when the batch is too small to fill the GPU, and the chunked-prefill
  kernel (FlashAttention-style tiles, bottom-right causal mask) for longer chunks.
* Fused kernels exist for float32, float16 and bfloat16 and any head dim up to 256; float64
  and larger head dims use the generic array-API code on CuPy arrays (still correct, not fused).
* Paged caches (``gqakv.PagedKVCache``): the append and every attention kernel have a paged
  instantiation that reads or writes K/V through the page table (kernels/paged_kv.cuh),
  uploaded with the call; pages are taken on the host (``gqakv.storage.paged.reserve``) and the
  copy on write of a shared last page is a ``copy_tokens`` over the pool's pages as rows.
* Quantized caches (``kv_dtype`` int8 / float8_e4m3fn, contiguous or paged): the append
  quantizes on the device (gqakv_write_kv_quantized, gqakv.storage.quantize's rule bit for bit),
  copies carry the scales, and the fp32-FMA decode / prefill kernels read codes and scales
  through the QuantizedKV reader (kernels/quantized_kv.cuh: code x scale in registers or
  per key-tile row as read, never a dequantized row), which wraps the contiguous or the
  paged reader: paged 8-bit pages run on the same kernels. The grouped codecs (int8_g32,
  int4_g32, int4_g64, int4_g32_rotated: a scale per block of values, 4-bit codes two a
  byte) run on the same reader and append (a scale per 8-value vector); their row copies
  run on the same copy kernel (codes as rows of d * bits / 8 bytes, scales as rows of d / g
  floats: ``instantiations.copy_entries``), and the rotated codec computes in float32 (q
  arrives rotated in float32; the append rotates K first).
* Planned batches (``plan_attention``, work.py): a step's layers share one kernel plan,
  one upload of rows / lengths / n_new (and sinks, slopes, page table) and the split
  workspaces; a run given ``out`` / ``lse_out`` allocates nothing and copies nothing to
  the device. Fixed plans (``plan_fixed_attention``, for CUDA graphs) are sized for the
  capacities, so their launches do not depend on the lengths, which ``update_attention``
  rewrites in place; they plan the step's append too (``write_kv(..., work=)``: a grid
  fixed by T over the plan's device ints and page table), so a whole step launches the
  same kernels with the same arguments every time, with nothing uploaded.
* Draft trees (speculative verification, ``gqa_attention(..., tree=)``): the prefill
  kernels' tree instantiation (variant.cuh's TREE flag) serves a tree call of any t_q, over
  every storage and with every variant; the tree's ancestor sets and depths are uploaded
  once per plan (work.tree_arrays). The decode kernels have no tree clause.
* What each kernel implements (layouts, codecs, variant features) is declared as data,
  ``CupyBackend.fast_paths`` (``routing.FAST_PATHS``); anything else (an unknown codec, a
  variant no kernel implements) is refused by the kernels with that declaration's sentence.

Devices: the cache lives on the device that was current when it was made (or the one
passed to ``empty``). Every hot operation makes the device of the cache buffers current
for its duration, so kernels compile and launch there, and index uploads and outputs are
allocated there, whatever device the caller has current (CuPy launches on the current
device, and a pointer into another device's memory would fault).

bfloat16: the cache is a CuPy array of dtype ``ml_dtypes.bfloat16`` (CuPy 14+); the
kernels read its 16-bit storage directly, and host exchange goes through
``ml_dtypes.bfloat16`` NumPy arrays. A CuPy without that support serves float32 and
float16 only, and says so when asked for bfloat16.

Routing: each hot call is routed first (routing.py): a fused kernel, or the generic
array-API code with the reason each kernel was not eligible; ``CupyBackend.route`` answers
the same question for given facts (``gqakv info``, benchmarks, tests).

CuPy is reached only through the backend's ``runtime`` (runtime.py), which imports it on
first use: never when this module is imported. The CPU emulation passes its own.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import OrderedDict
from typing import cast

import numpy as np

from gqakv.dispatch.backend import GENERIC, Backend, Route
from gqakv.dispatch.request import Request, as_request, key_bucket
from gqakv.storage.codecs import PLAIN_NAME
from gqakv.core.inputs import PACKED, PADDED
from gqakv.ops.outputs import write_into
from gqakv.storage.store import PAGED

from . import instantiations as _table
from . import plan as _plan
from . import limits, routing
from . import work as _work
from . import sources as sources  # the kernel table, an attribute of the package
from .runtime import CupyRuntime
from .work import CupyWork


class CupyBackend(Backend):
    """runtime: what the backend takes from CuPy (``runtime.CupyRuntime``); None builds
    the default one, which imports cupy on first use."""

    name = "cupy"
    priority = 100
    array_library = "cupy"
    device_kind = "cuda"
    dtypes = ("float32", "float16", "bfloat16", "float64")
    head_dims = None  # fused for d <= 256, generic array-API above
    features = frozenset({
        "fused_append", "fused_row_copies", "fused_decode", "split_kv", "fused_chunked_prefill",
        "fp32 accumulation", "float64 and head_dim > 256 via array API", "paged_kv",
    })
    #: packed [N, H, d] tokens: the kernels declare padded ones only (``fast_paths``), so a
    #: packed call routes to the generic array-API code on CuPy arrays
    packed_tokens = True
    #: What each kernel implements (layouts, codecs, variant features), in the order the
    #: routes try them; the per-call conditions are routing.py's.
    fast_paths = routing.FAST_PATHS

    def __init__(self, runtime: CupyRuntime | None = None):
        self._reason: str | None | bool = False  # False: not checked yet
        self._runtime = runtime
        self._device_facts: dict[int, tuple[int, int]] = {}
        # Every layer of a model step plans the same launches and uploads the same
        # rows/lengths: both are kept (by value) so only the first layer pays for them.
        self._plans = _LruCache(64)
        self._uploads = _LruCache(64)
        # (inputs, store geometry, (T, k_new strides, unfixed), plan) of the last append
        self._last_write_plan: tuple | None = None
        # (inputs, (device, stream), device ints) and ((device, stream), host entries,
        # device table) of the last unplanned append (``_append_arrays``)
        self._last_append_ints: tuple | None = None
        self._last_append_table: tuple | None = None
        self._array_type: type | None = None  # (see owns)

    @property
    def runtime(self) -> CupyRuntime:
        """CuPy as this backend uses it (the default runtime is built on first use)."""
        if self._runtime is None:
            self._runtime = CupyRuntime()
        return self._runtime

    # -- availability --------------------------------------------------------------------

    def unavailable_reason(self) -> str | None:
        if self._reason is False:
            self._reason = _probe()
        return cast("str | None", self._reason)  # checked: a reason or None

    # -- routing -------------------------------------------------------------------------

    def route(self, request: Request | str, **facts) -> Route:
        """Which kernel (or the generic array-API code) runs ``request`` (a ``Request``, or
        an operation and its facts: dtype and head_dim needed; t_q, capability, buffers,
        grid, layout, codec, features as ``routing`` reads them), and why each other
        implementation was not eligible, judged by the kernels' declarations
        (``fast_paths``) and conditions. The hot operations route every call through the
        same functions."""
        request = as_request(request, facts)
        if request.op is None:
            return super().route(request)  # says an operation is needed
        route = routing.ROUTES[request.op](request)  # kept and shared: the caller gets a copy
        return Route(route.impl, dict(route.rejected))

    def implementations(self) -> dict[str, str]:
        return routing.implementations()

    # -- hooks for the tools (gqakv.dispatch.backend.Backend) ----------------------------------------

    def compile_kernels(self, dtypes, head_dims) -> list[str]:
        """The instantiation table's plain-causal entries at these dtypes and head dims,
        over every storage and reader (the quantized and paged lines run them), built
        through the module cache; the variant lines compile theirs on first use. float64
        runs the array-API code: nothing to compile for it."""
        from . import instantiations, modules

        names = []
        for entry in instantiations.select(dtypes=[d for d in dtypes if d in instantiations.CTYPES],
                                           head_dims=head_dims, variants=(0,)):
            modules.get_function(entry.kernel, entry.name)
            names.append(entry.name)
        return names

    def split_attention(self, dtype: str):
        return None, "the planner's split-KV + merge kernel (few rows, long keys) + merge_attention"

    def for_local_device(self, index: int) -> "CupyBackend":
        """Makes device ``index`` CuPy's current device (every later allocation and launch
        of this process goes there)."""
        import cupy

        cupy.cuda.Device(int(index)).use()
        return self

    # -- arrays --------------------------------------------------------------------------

    def namespace(self):
        import array_api_compat.cupy as xp

        return xp

    def not_supported_reasons(self, request: Request | None = None, **facts) -> list[str]:
        reasons = super().not_supported_reasons(request, **facts)
        if reasons:
            return reasons
        if (as_request(request, facts).dtype == "bfloat16"
                and not self.runtime.bf16_supported()):
            reasons.append(f"dtype=bfloat16 needs CuPy >= 14 (ml_dtypes arrays); this is "
                           f"CuPy {self.runtime.version}")
        return reasons

    def dtype(self, name: str):
        """CuPy dtype for a gqakv dtype; bfloat16 is ml_dtypes.bfloat16."""
        name = _canonical(name)
        if name == "bfloat16":
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return getattr(self.runtime.cp, name)

    def empty(self, shape: tuple[int, ...], dtype: str, device=None):
        """Uninitialized CuPy buffer on ``device`` (an id; None: the current device)."""
        rt = self.runtime
        with rt.device(device):
            return rt.cp.empty(shape, dtype=self.dtype(dtype))

    def owns(self, x) -> bool:
        array_type = self._array_type  # CuPy's ndarray, looked up once (every layer asks often)
        if array_type is None:
            array_type = self._array_type = self.runtime.cp.ndarray
        return isinstance(x, array_type)

    def device_of(self, x):
        return x.device.id

    def from_numpy(self, a: np.ndarray, dtype=None):
        a = np.asarray(a)
        if dtype is not None:
            a = a.astype(self.dtype(dtype), copy=False)  # cast on the host: ml_dtypes knows bf16
        return self.runtime.cp.asarray(a)

    def to_numpy(self, x) -> np.ndarray:
        """Host copy of a CuPy array (bfloat16 comes back as ml_dtypes.bfloat16)."""
        if isinstance(x, np.ndarray):
            return x
        return x.get()

    def from_host_ints(self, a, device=None):
        cp = self.runtime.cp
        if device is None:
            return cp.asarray(a, dtype=cp.int64)
        with self.runtime.device(device):
            return cp.asarray(a, dtype=cp.int64)

    # -- hot operations ------------------------------------------------------------------
    # Each routes the call (routing.py) from its Request, then runs the chosen kernel's
    # kept plan or, when the route says so, the generic array-API code (Backend's method).
    # A planner refusal (grid beyond CUDA's limits) is routed again as the ``grid`` fact.
    # The store's layout, codec and the variant are judged by the kernels' declarations
    # (``fast_paths``); a paged call adds the page table.

    def write_kv(self, store, k_new, v_new, inputs, *, work=None) -> None:
        """One launch for all rows; see ``Backend.write_kv``. k/v_new are [B, Hkv, T, d].

        work: a fixed plan's ``CupyWork`` (``gqakv.ops.plan.AttentionPlan.write``): when it
        serves this append (``work.serves_write``: its step's rows, starts and n_new, T new
        tokens per entry) the launch is its capacity plan (grid by T) over its device ints
        and page table: nothing uploaded, nothing allocated for aligned K/V. Otherwise (or
        without it) the append is planned and uploaded for its own n_new."""
        device = self._device_id(store.k)
        with self._on_device(device):
            if not (isinstance(work, CupyWork)
                    and _work.serves_write(work, inputs, store, k_new, device)):
                work = None
            self._write_kv(store, k_new, v_new, inputs, work, device)

    def _write_plan(self, store, n_new, t_new: int, new_strides):
        """The append's launch plan for host ``n_new`` [B] into k_new of ``t_new`` tokens
        and ``new_strides`` (batch, head, token), kept by value (or the planner's refusal)."""
        dtype, kv_dtype = _dtypes_of(store)
        args = (dtype, int(store.head_dim), np.asarray(n_new, dtype=np.int64),
                int(store.k.shape[1]), int(t_new), tuple(new_strides), _strides(store.k)[:3])
        options = dict(pages=_pages_arg(store), kv_dtype=kv_dtype,
                       scale_strides=_strides(store.k_scale)[:3] if kv_dtype else None)
        return self._plans.get(("write_kv", *_hashable(args), *options.values()),
                               lambda: _plan_or_refusal(_plan.plan_write_kv, *args, **options))

    def _write_kv(self, store, k_new, v_new, inputs, work, device) -> None:
        """``write_kv`` on ``store``'s device (``device``: its id, made current by the caller)."""
        k_buf, v_buf = store.k, store.v
        facts = _write_facts(store, PACKED if k_new.ndim == 3 else PADDED)
        dtype, kv_dtype, d = facts.dtype, facts.kv_dtype, facts.head_dim
        route = facts.route
        if route.impl != GENERIC:
            layout = facts.store_rejection
            if layout is None and facts.rotates_keys:
                # keys stored rotated: rotated here (float32, the generic write's bits), V
                # cast to float32 (exact), and quantized by the float32 instantiation
                xp = self.namespace()
                k_new, v_new = store.codec.rotate_queries(xp, k_new), xp.astype(v_new, xp.float32)
            if layout is None:
                k_new, v_new = self._aligned(k_new, dtype, d), self._aligned(v_new, dtype, d)
                layout = (facts.buffers_rejection
                          or _new_kv_rejection(k_new, v_new)
                          or _input_dtype_rejection(k_new, v_new, dtype)
                          or facts.scales_rejection)
            route = facts.route_with(layout)
        if route.impl == GENERIC:
            return super().write_kv(store, k_new, v_new, inputs)
        t_new, new_strides = int(k_new.shape[2]), _strides(k_new)[:3]
        # every layer of a step appends the same inputs into stores of one geometry: the
        # plan of the last append serves when both are the same
        memo = self._last_write_plan
        if (memo is not None and memo[0] is inputs and memo[1] == facts.geometry
                and memo[2] == (t_new, new_strides, work is None)):
            plan = memo[3]
        else:
            n_new = np.asarray(inputs.n_new, dtype=np.int64)
            # a fixed work's append: T tokens per entry, whatever this step's n_new (the
            # kernel stops at each entry's own n_new, read on the device)
            planned = np.full_like(n_new, t_new) if work is not None else n_new
            plan = self._write_plan(store, planned, t_new, new_strides)
            self._last_write_plan = (inputs, facts.geometry, (t_new, new_strides, work is None),
                                     plan)
        if isinstance(plan, str):  # the planner refused the grid: routed again with that fact
            route = routing.route_write_kv(facts.request.with_(grid=plan))
        if route.impl == GENERIC:
            return super().write_kv(store, k_new, v_new, inputs)
        if not plan.launches:
            return
        if work is not None:  # the work's device ints and table, updated for this step
            arrays = {name: work.arrays[name] for name in ("rows", "starts", "n_new")}
            if "table" in work.arrays:
                arrays["table"] = work.arrays["table"]
        else:
            arrays = self._append_arrays(inputs, device, store if facts.paged else None)
        arrays.update(k_new=k_new, v_new=v_new, k_buf=k_buf, v_buf=v_buf)
        if kv_dtype:
            arrays.update(k_scale=store.k_scale, v_scale=store.v_scale)
        self.runtime.run_plan(plan, arrays, dtype, d)

    def _append_arrays(self, inputs, device: int, paged_store=None) -> dict:
        """The append's device rows, starts and n_new (``_upload_ints``'s) and, for a
        ``paged_store``, its page table (``_upload_table``'s), kept for the next layers of
        the step on the same device (``device``: the current one, the cache's) and stream:
        the ints while the ``inputs`` object is the same (a step never changes its host
        arrays), the table while it is the same table at the same version
        (``work.same_table``: a table changes in place). So later layers look nothing up
        by value."""
        where = (device, self.runtime.stream_ptr())
        memo = self._last_append_ints
        if memo is not None and memo[0] is inputs and memo[1] == where:
            arrays = dict(memo[2])
        else:
            rows_d, starts_d, n_new_d = self._upload_ints(inputs.rows, inputs.starts, inputs.n_new)
            arrays = {"rows": rows_d, "starts": starts_d, "n_new": n_new_d}
            self._last_append_ints = (inputs, where, dict(arrays))
        if paged_store is not None:
            page_table = paged_store.page_table
            table = self._last_append_table
            if not (table is not None and table[0] == where
                    and _work.same_table(table[1], page_table)):
                table = (where, _work.table_stamp(page_table), self._upload_table(paged_store))
                self._last_append_table = table
            arrays["table"] = table[2]
        return arrays

    def _fixed_append(self, store, q_shape):
        """A fixed work's append plan (``CupyWork.append``): T new tokens per entry of
        contiguous k_new ``[B, Hkv, T, d]``, the grid fixed by T; or why the step's append
        stays unplanned (a sentence)."""
        if store.spec.codec.rotates_keys:
            return "keys are stored rotated: each append rotates K into a new array first"
        facts = _write_facts(store, PADDED)
        d = facts.head_dim
        B, _, T, _ = q_shape
        # the cache's own buffers judged here (the append's facts); each write's K/V when it comes
        layout = facts.store_rejection or facts.buffers_rejection or facts.scales_rejection
        route = facts.route_with(layout)
        if route.impl != GENERIC:
            new_strides = _contiguous_strides((B, int(store.k.shape[1]), T, d))[:3]
            plan = self._write_plan(store, np.full(B, T, dtype=np.int64), T, new_strides)
            if not isinstance(plan, str):
                return plan
            route = routing.route_write_kv(facts.request.with_(grid=plan))
        return f"the append's route is {route}"

    def copy_tokens(self, dst, dst_rows, src, src_rows, n_tokens) -> None:
        """All copies of the call in one launch; see ``Backend.copy_tokens``.

        Stores hold ``[layers, rows, Hkv, S, d]`` (dst and src may differ in rows and S).
        Layouts the kernel does not take (not CuPy arrays, mixed dtypes, float64, d > 256,
        unaligned rows, K and V strided differently, storage that is not contiguous) use
        the generic copies; the route (``routing.route_copy_tokens``) says which.
        """
        with self._device_of(dst.k):
            self._copy_tokens(dst, dst_rows, src, src_rows, n_tokens)

    def _copy_tokens(self, dst, dst_rows, src, src_rows, n_tokens) -> None:
        dst_k, dst_v, src_k, src_v = dst.k, dst.v, src.k, src.v
        n_tokens = np.asarray(n_tokens, dtype=np.int64)
        dtype, kv_dtype = _dtypes_of(dst)
        d = int(dst.head_dim)  # the values per token (a grouped code row holds d * bits / 8 bytes)
        request = Request.of_store("copy_tokens", dst)
        if routing.route_copy_tokens(request).impl != GENERIC:
            # the rows each launch moves (instantiations.copy_entries): values or codes, then scales
            entries = _table.copy_entries(dtype, d, kv_dtype)
            request = request.with_(buffers=(
                ("src and dst stored differently" if src.spec != dst.spec else None)
                or self._copy_layout_rejection(dst_k, dst_v, src_k, src_v, entries[0])
                or (self._copy_scales_rejection(dst, src, entries[1]) if kv_dtype else None)))
        route = routing.route_copy_tokens(request)
        if route.impl == GENERIC:
            return super().copy_tokens(dst, dst_rows, src, src_rows, n_tokens)
        scale_strides = ((_strides(dst.k_scale)[:4], _strides(src.k_scale)[:4]) if kv_dtype
                         else (None, None))
        plan = _plan_or_refusal(_plan.plan_copy_tokens, dtype, d, n_tokens, int(dst_k.shape[0]),
                                int(dst_k.shape[2]), _strides(dst_k)[:4], _strides(src_k)[:4],
                                kv_dtype, *scale_strides)
        if isinstance(plan, str):  # the planner refused the grid: routed again with that fact
            route = routing.route_copy_tokens(request.with_(grid=plan))
        if route.impl == GENERIC:
            return super().copy_tokens(dst, dst_rows, src, src_rows, n_tokens)
        if not plan.launches:
            return
        pairs = _pack_ints(dst_rows, src_rows, n_tokens)  # [3, P]: one upload
        arrays = {"dst_k": dst_k, "dst_v": dst_v, "src_k": src_k, "src_v": src_v,
                  "pairs": self.runtime.cp.asarray(pairs)}
        if kv_dtype:
            arrays.update(dst_k_scale=dst.k_scale, dst_v_scale=dst.v_scale,
                          src_k_scale=src.k_scale, src_v_scale=src.v_scale)
        self.runtime.run_plan(plan, arrays, dtype, d)

    def _copy_scales_rejection(self, dst, src, entry) -> str | None:
        """Why the scale copy (``entry``: ``gqakv_copy_tokens<float, n>``, n scales per
        token) cannot move these scales: float32 ``[layers, R, Hkv, S]`` (n = 1) or
        ``[layers, R, Hkv, S, n]`` (a grouped codec's blocks, last axis of stride 1), rows
        aligned for the kernel's vector loads."""
        scales = (dst.k_scale, dst.v_scale, src.k_scale, src.v_scale)
        blocks = getattr(dst.spec.codec, "group", None) is not None  # a grouped codec: a block axis
        ndim = 5 if blocks else 4
        if not all(self.owns(x) and x.ndim == ndim and _dtype_name(x) == "float32" for x in scales):
            return f"scales that are not {ndim}-d float32 CuPy arrays"
        if any(self.device_of(x) != self.device_of(dst.k) for x in scales):
            return "scales on another device than their codes"
        if dst.k_scale.strides != dst.v_scale.strides or src.k_scale.strides != src.v_scale.strides:
            return "K and V scales strided differently"
        if blocks and not all(int(x.shape[-1]) == entry.head_dim
                              and _is_aligned(x, "float32", entry.head_dim) for x in scales):
            return f"block scales not in rows of {entry.head_dim} aligned for the kernel's vector loads"
        return None

    def _copy_layout_rejection(self, dst_k, dst_v, src_k, src_v, entry) -> str | None:
        """Why the copy kernel (``entry``: the instantiation moving the values or codes, rows
        of ``entry.head_dim`` elements) cannot read src and write dst in place (None: it can)."""
        bufs = (dst_k, dst_v, src_k, src_v)
        if not all(self.owns(x) and x.ndim == 5 for x in bufs):
            return "buffers that are not 5-d CuPy arrays"
        element, width = entry.kv_dtype or entry.dtype, entry.head_dim
        if any(x.dtype != dst_k.dtype or self.device_of(x) != self.device_of(dst_k) for x in bufs):
            return "buffers of mixed dtypes or devices"
        if (dst_v.shape != dst_k.shape or src_v.shape != src_k.shape
                or src_k.shape[0] != dst_k.shape[0] or src_k.shape[2] != dst_k.shape[2]
                or src_k.shape[4] != width or dst_k.shape[4] != width):
            return "src and dst differ in layers, heads or head dim, or K and V in shape"
        if not (dst_k.strides == dst_v.strides and src_k.strides == src_v.strides):
            return "K and V buffers strided differently"
        if not all(_is_aligned(x, element, width) for x in bufs):
            return "rows not aligned for the kernel's vector loads"
        return None

    def attention(self, q, store, inputs, params, *, return_lse: bool, work=None, out=None,
                  lse_out=None):
        """Fused GQA attention; see ``gqakv.gqa_attention``. q, out: [B, Hq, T, d].

        work: this batch's ``CupyWork`` (``plan_attention``): its kernel plan, device index
        arrays and workspaces serve the call (no upload, no planning); this layer's own
        buffers (alignment, strides of q and K/V) are still judged. out, lse_out: the
        caller's buffers, written by the kernels when they can take them (out aligned for
        their vector stores and not overlapping q, lse_out C-contiguous), else filled
        from the kernels' own (a device copy). A work for other inputs is not used."""
        device = self._device_id(store.k)
        with self._on_device(device):
            if isinstance(work, CupyWork) and self._work_serves(work, store, inputs, device):
                return self._run_work(work, q, store, return_lse, out, lse_out)
            if out is None and lse_out is None:
                return self._attention(q, store, inputs, params, return_lse=return_lse)
            result = self._attention(q, store, inputs, params, return_lse=True)
            return write_into(result, return_lse, out, lse_out)

    def plan_attention(self, store, inputs, params, q_shape):
        """A ``CupyWork`` (work.py) when the fused kernels serve this batch (routed as
        ``attention`` routes it, judging the planning layer's K/V), else None: packed
        queries, float64, head dims past 256, a grid the planner refuses, ... take the
        generic code per call as before."""
        with self._device_of(store.k):
            work = self._plan_work(store, inputs, params, tuple(q_shape))
        return None if isinstance(work, str) else work

    def plan_fixed_attention(self, store, inputs, params, q_shape, *, splits=None):
        """A fixed-capacity ``CupyWork`` (work.py, fixed mode: grid and arguments
        independent of the lengths; ``update_attention`` takes the next ones). splits: the
        decode split count (None: the planner's choice for rows as long as the store
        holds). ValueError when no kernel serves the batch (the route's reasons)."""
        if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int)
                                   or splits < 1):
            raise ValueError(f"splits must be an int >= 1 (or None), got {splits!r}")
        with self._device_of(store.k):
            work = self._plan_work(store, inputs, params, tuple(q_shape), fixed=True,
                                   splits=splits)
        if isinstance(work, str):
            raise ValueError(f"no fixed-buffer plan on {self.name}: {work}")
        return work

    def update_attention(self, work, store, inputs) -> None:
        """Rewrite a fixed work's device rows / lengths / n_new (and page table) in place
        for ``inputs`` (validated by the caller against the planned q shape)."""
        if not (isinstance(work, CupyWork) and work.fixed):
            raise ValueError("update takes a fixed plan (plan_attention(..., fixed=True))")
        if (work.kwargs["pages"] is None) != (store.kind != PAGED):
            raise ValueError("the plan was made for another storage kind")
        with self._device_of(store.k):
            _work.update(work, store, inputs)

    def _attention_route(self, store, inputs, params, q_shape):
        """(route, request, sm_count, capability) of an attention call over ``store`` with
        queries of ``q_shape``, judging its K/V buffers (facts None on the generic route).
        Kept in the store's memo by the current device and its facts and the call's
        request facts (its variant features and token facts), which are all that it
        reads of the call."""
        facts = inputs.token_facts(q_shape)
        facts["keys"] = key_bucket(facts["keys"])  # as the request keeps them
        key = ("cupy attention route", self.runtime.device().id, self._facts(),
               inputs.features, *sorted(facts.items()))
        kept = store.memo.get(key)
        if kept is None:
            if len(store.memo) > 512:  # chunks of ever new sizes: their routes go, not the rest
                for old in [k for k in store.memo if k[0] == key[0]]:
                    del store.memo[old]
            kept = store.memo[key] = self._route_attention(store, inputs.features, facts)
        return kept

    def _route_attention(self, store, features, token_facts: dict):
        """``_attention_route``'s value, from the request facts its memo key holds."""
        dtype, kv_dtype = _dtypes_of(store)
        d = int(store.head_dim)
        sm_count = capability = None
        request = Request.of_store("attention", store, features=features, **token_facts)
        if routing.route_attention(request).impl != GENERIC:
            sm_count, capability = self._facts()
            request = request.with_(capability=capability, buffers=self._buffers_rejection(
                store, kv_dtype or dtype, d))
        return routing.route_attention(request), request, sm_count, capability

    @staticmethod
    def _buffers_rejection(store, dtype: str, d: int) -> str | None:
        """Why the attention kernels cannot read this layer's K/V (and scales); kept in the
        store's memo (it judges the store's buffers alone, which never move)."""
        key = ("cupy attention buffers", dtype, d)
        try:
            return store.memo[key]
        except KeyError:
            pass
        why = store.memo[key] = (
            _store_rejection(store)
            or _attention_layout_rejection(store.k, store.v, dtype, d)
            or (_scales_rejection(store, d) if store.spec.codec.name != PLAIN_NAME else None))
        return why

    def _kernel_plan(self, dtype: str, d: int, kwargs: dict):
        """The planner's plan for these keywords (or its refusal), kept by its ``Extent``
        and the keywords but the lengths: the next decode step, its rows one token longer,
        finds it (the split planner runs, the launches are not made again: ``plan_attention``
        is ``plan_attention_extent`` of ``attention_extent``)."""
        extent = _plan.attention_extent(dtype, d, **kwargs)
        layout = tuple(item for item in kwargs.items() if item[0] not in ("lens", "n_new"))
        return self._plans.get(("attention", dtype, d, extent, *layout),
                               lambda: _plan_or_refusal(_plan.plan_attention, dtype, d, **kwargs))

    def _plan_kwargs(self, store, q_shape, lens, n_new, params, sm_count, capability,
                     q_strides, out_strides, force_splits=None, invariant=False,
                     tree_stride=None) -> dict:
        B, Hq, T, _ = (int(s) for s in q_shape)
        Hkv = int(store.k.shape[1])
        kwargs = dict(batch=B, kv_heads=Hkv, group=Hq // Hkv, t_q=T,
                      lens=np.asarray(lens, dtype=np.int64),
                      n_new=np.asarray(n_new, dtype=np.int64), params=params,
                      q_strides=tuple(q_strides), buf_strides=_strides(store.k)[:3],
                      out_strides=tuple(out_strides), sm_count=sm_count,
                      tensor_cores=capability >= limits.MMA_MIN_CAPABILITY,
                      pages=_pages_arg(store), kv_dtype=_dtypes_of(store)[1])
        if force_splits is not None:
            kwargs["force_splits"] = int(force_splits)
        if invariant:
            kwargs["invariant"] = True
        if tree_stride is not None:  # a draft tree: the prefill kernels' tree instantiation
            kwargs["tree_stride"] = int(tree_stride)
        return kwargs

    def _plan_work(self, store, inputs, params, q_shape, *, fixed: bool = False, splits=None):
        """The batch's ``CupyWork``, or why the kernels do not serve it (a sentence)."""
        if inputs.offsets is not None or len(q_shape) != 4:
            return "packed queries [N, Hq, d] take the generic code (the kernels read padded ones)"
        route, request, sm_count, capability = self._attention_route(store, inputs, params, q_shape)
        if route.impl == GENERIC:
            return f"the route is {route}"
        dtype, kv_dtype = _dtypes_of(store)
        d = int(store.head_dim)
        B, _, T, _ = q_shape
        lens, n_new = inputs.lens, inputs.n_new
        if fixed:  # sized for the capacity: rows as long as the store holds, T queries each
            lens = np.full(B, int(store.max_len), dtype=np.int64)
            n_new = np.full(B, T, dtype=np.int64)
        contiguous = _contiguous_strides(q_shape)[:3]
        kwargs = self._plan_kwargs(store, q_shape, lens, n_new, params, sm_count, capability,
                                   contiguous, contiguous, splits if fixed else None,
                                   invariant=inputs.invariant, tree_stride=_work.tree_stride(inputs))
        plan = self._kernel_plan(dtype, d, kwargs)
        if isinstance(plan, str):  # the planner refused the grid: routed again with that fact
            return f"the route is {routing.route_attention(request.with_(grid=plan))}"
        if plan.keys_per_split > limits.MAX_KEYS_PER_SPLIT:  # forced splits are not checked there
            return (f"{plan.num_splits} splits of {plan.keys_per_split} keys (the decode kernel "
                    f"counts a split's keys in an int: at most {limits.MAX_KEYS_PER_SPLIT})")
        work = CupyWork(inputs=inputs, q_shape=q_shape, dtype=dtype, kv_dtype=kv_dtype,
                        head_dim=d, kwargs=kwargs, plan=plan, device=self.runtime.device().id,
                        stream=self.runtime.stream_ptr(),
                        fill=_work.needs_fill(q_shape, inputs.n_new, fixed), fixed=fixed)
        _work.upload(self.runtime.cp, work, store, params, None if fixed else self._upload)
        if fixed:
            work.append = self._fixed_append(store, q_shape)
        return work

    def _work_serves(self, work, store, inputs, device) -> bool:
        """Whether ``work`` runs this call: its inputs, device (``device``: the store's,
        current) and page table (``work.serves``), a store of its kind, and this layer's K/V
        readable by the kernels (else the call is routed as an unplanned one, which says
        why)."""
        if (work.kwargs["pages"] is None) != (store.kind != PAGED):
            return False
        if not _work.serves(work, inputs, store, device, self.runtime.stream_ptr()):
            return False
        return self._buffers_rejection(store, work.kv_dtype or work.dtype, work.head_dim) is None

    def _run_work(self, work, q, store, return_lse: bool, out=None, lse_out=None):
        """The planned launches over this layer's q and K/V, into ``out`` / ``lse_out``
        when the kernels can write them (no allocation, no host-to-device copy), else into
        buffers allocated here and copied over. An unaligned q is copied (as unplanned)."""
        cp = self.runtime.cp
        dtype, d = work.dtype, work.head_dim
        B, Hq, T, _ = work.q_shape
        kw = work.kwargs
        q_start = _address(q)
        if not _is_aligned(q, dtype, d, q_start):
            q = self.runtime.cp.ascontiguousarray(q)
            q_start = _address(q)
        q_span = _extent(q, q_start) if out is not None or lse_out is not None else (0, 0)
        o = out if out is not None and _writable_out(out, q_span, dtype, d) else None
        lse = lse_out if lse_out is not None and _writable_lse(lse_out, q_span) else None
        if o is None:
            o = (cp.zeros if work.fill else cp.empty)((B, Hq, T, d), dtype=q.dtype)
        elif work.fill:
            o.fill(0)
        if lse is None:
            lse = (cp.full((B, Hq, T), -math.inf, dtype=cp.float32) if work.fill
                   else cp.empty((B, Hq, T), dtype=cp.float32))
        elif work.fill:
            lse.fill(-math.inf)
        plan = work.plan
        # (an out allocated here is C-contiguous: the strides the plan was made for)
        strides = (_strides(q)[:3], _strides(store.k)[:3],
                   kw["out_strides"] if o is not out else _strides(o)[:3])
        if strides != (kw["q_strides"], kw["buf_strides"], kw["out_strides"]):
            # this layer's q / K/V / out are laid out otherwise: the same launches with its
            # strides (kept by value; the grid and the workspaces do not depend on them)
            plan = self._kernel_plan(dtype, d, {**kw, "q_strides": strides[0],
                                                "buf_strides": strides[1],
                                                "out_strides": strides[2]})
            assert not isinstance(plan, str) and plan.workspace == work.plan.workspace
        if plan.launches:
            arrays = {**work.arrays, "q": q, "k_buf": store.k, "v_buf": store.v, "out": o,
                      "lse": lse}
            if work.kv_dtype:
                arrays.update(k_scale=store.k_scale, v_scale=store.v_scale)
            self.runtime.run_plan(plan, arrays, dtype, d)
        if out is not None and o is not out:
            out[...] = o
            o = out
        if lse_out is not None and lse is not lse_out:
            lse_out[...] = lse
            lse = lse_out
        return (o, lse) if return_lse else o

    def _attention(self, q, store, inputs, params, *, return_lse: bool):
        """The unplanned call: routed, planned (kept by value) and uploaded (kept by value)
        here."""
        k_buf, v_buf = store.k, store.v
        rows, lens, n_new = inputs.rows, inputs.lens, inputs.n_new
        dtype, kv_dtype = _dtypes_of(store)
        d = int(store.head_dim)
        route, request, sm_count, capability = self._attention_route(store, inputs, params,
                                                                     tuple(q.shape))
        if route.impl == GENERIC:
            return super().attention(q, store, inputs, params, return_lse=return_lse)
        B, Hq, T, _ = (int(s) for s in q.shape)  # padded: the kernels read [B, Hq, T, d]
        cp = self.runtime.cp
        q = self._aligned(q, dtype, d)
        if not _work.needs_fill((B, Hq, T, d), n_new, False):
            # No padded query: the kernels write every element of out and lse, so the two
            # fill launches are skipped (the common decode and prefill steps).
            out = cp.empty((B, Hq, T, d), dtype=q.dtype)
            lse = cp.empty((B, Hq, T), dtype=cp.float32)
        else:  # padded queries and idle rows keep these values: 0 and -inf
            out = cp.zeros((B, Hq, T, d), dtype=q.dtype)
            lse = cp.full((B, Hq, T), -math.inf, dtype=cp.float32)
        assert capability is not None  # a kernel route: the device's facts were read above
        kwargs = self._plan_kwargs(store, (B, Hq, T, d), lens, n_new, params, sm_count,
                                   capability, _strides(q)[:3], _strides(out)[:3],
                                   invariant=inputs.invariant, tree_stride=_work.tree_stride(inputs))
        plan = self._kernel_plan(dtype, d, kwargs)
        if isinstance(plan, str):  # the planner refused the grid: routed again with that fact
            route = routing.route_attention(request.with_(grid=plan))
        if route.impl == GENERIC:
            return super().attention(q, store, inputs, params, return_lse=return_lse)
        if plan.launches:
            rows_d, lens_d, n_new_d = self._upload_ints(rows, lens, n_new)
            arrays = {"q": q, "k_buf": k_buf, "v_buf": v_buf, "rows": rows_d, "lens": lens_d,
                      "n_new": n_new_d, "out": out, "lse": lse}
            if params.sinks is not None:  # [Hq] float32 on the device, kept by value
                arrays["sinks"] = self._upload_floats(params.sinks)
            if params.alibi_slopes is not None:  # [Hq] float32 slopes, kept by value
                arrays["alibi"] = self._upload_floats(params.alibi_slopes)
            if inputs.tree is not None:  # its ancestor sets and depths, kept by value
                arrays["tree_mask"], arrays["tree_depth"] = (
                    self._upload(a) for a in _work.tree_arrays(inputs.tree))
            if kwargs["pages"] is not None:
                arrays["table"] = self._upload_table(store)
            if kv_dtype:
                arrays.update(k_scale=store.k_scale, v_scale=store.v_scale)
            self.runtime.run_plan(plan, arrays, dtype, d)
        return (out, lse) if return_lse else out

    def synchronize(self) -> None:
        """Wait for the current device's queued work (benchmarks time through this)."""
        self.runtime.synchronize()

    def _device_of(self, buf):
        """Context making ``buf``'s device current (a no-op for arrays that are not CuPy's:
        the generic fallbacks take those as they are)."""
        return self._on_device(self._device_id(buf))

    def _device_id(self, buf) -> int | None:
        """``buf``'s device id, or None for an array that is not CuPy's."""
        return self.device_of(buf) if self.owns(buf) else None

    def _on_device(self, device: int | None):
        """Context making device ``device`` current (``_device_id``'s; None: a no-op)."""
        return contextlib.nullcontext() if device is None else self.runtime.device(device)

    def _facts(self) -> tuple[int, int]:
        """(multiprocessors, compute capability as CuPy spells it, e.g. 90) of the current
        device (the hot ops make the cache's device current)."""
        dev = self.runtime.device().id
        facts = self._device_facts.get(dev)
        if facts is None:
            facts = self._device_facts[dev] = self.runtime.device_facts()
        return facts

    def _upload_ints(self, *host_arrays):
        """Device int64 views of equally long host int arrays, through one host-to-device
        copy, kept by value (per device and stream) for the next layers of the same step."""
        device = self._upload(_pack_ints(*host_arrays))
        return tuple(device[i] for i in range(len(host_arrays)))

    def _upload(self, host: np.ndarray):
        """A device copy of a host array, kept by value (dtype, shape, bytes) per device and
        stream: read-only, shared by every call that uploads the same values."""
        rt = self.runtime
        key = (rt.device().id, rt.stream_ptr(), host.dtype.str, host.shape, host.tobytes())
        return self._uploads.get(key, lambda: rt.cp.asarray(host))

    def _upload_floats(self, values):
        """A device float32 copy of a tuple of floats (the sink logits, the ALiBi slopes), kept by value per
        device and stream like ``_upload_ints``."""
        rt = self.runtime
        host = np.asarray(values, dtype=np.float32)
        key = (rt.device().id, rt.stream_ptr(), "f4", host.tobytes())
        return self._uploads.get(key, lambda: rt.cp.asarray(host))

    def _upload_table(self, store):
        """A device int32 copy of a paged store's page table ``[rows, pages_per_row]``, kept
        by value per device and stream like ``_upload_ints`` (every layer of a model step
        pages through one table: one upload per step)."""
        rt = self.runtime
        host = np.ascontiguousarray(store.page_table.entries, dtype=np.int32)
        key = (rt.device().id, rt.stream_ptr(), "i4", host.shape, host.tobytes())
        return self._uploads.get(key, lambda: rt.cp.asarray(host))

    def _aligned(self, x, dtype: str, d: int):
        """x itself when the kernels can read it in place, else a contiguous copy (inputs only)."""
        if _is_aligned(x, dtype, d):
            return x
        return self.runtime.cp.ascontiguousarray(x)


# -- helpers ----------------------------------------------------------------------------------

def _probe() -> str | None:
    """Why CuPy cannot run kernels here, or None."""
    try:
        import cupy
    except ImportError:
        return "cupy: not installed (pip install 'gqakv[cupy]')"
    except Exception as exc:  # a broken install (e.g. a CUDA library mismatch)
        return f"cupy: failed to import ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"cupy: no CUDA driver found ({exc})"
    if count == 0:
        return "cupy: no CUDA device"
    try:
        cupy.cuda.nvrtc.getVersion()
    except Exception as exc:
        return f"cupy: NVRTC is not available ({exc})"
    return None


def _canonical(dtype) -> str:
    from gqakv.core.dtypes import canonical_name

    return canonical_name(dtype)


def _dtype_name(x) -> str:
    """dtype name of a buffer, e.g. "bfloat16" (routing decides whether a kernel takes it;
    another library's dtype keeps its own spelling, which no kernel takes). Kept by dtype
    object: NumPy works a name out in Python, and every layer's call asks several times."""
    dt = x.dtype
    try:
        return _DTYPE_NAMES[dt]
    except (KeyError, TypeError):  # not seen yet, or not hashable
        pass
    try:
        name = np.dtype(dt).name
    except TypeError:
        name = str(dt)
    try:
        if len(_DTYPE_NAMES) < 256:  # the few dtypes of real buffers
            _DTYPE_NAMES[dt] = name
    except TypeError:
        pass
    return name


_DTYPE_NAMES: dict = {}


def _plan_or_refusal(planner, *args, **kwargs):
    """The planner's plan, or its refusal (a sentence) when the grid is beyond CUDA's
    limits; refusals are kept like plans, so a refused shape is planned once."""
    try:
        return planner(*args, **kwargs)
    except NotImplementedError as exc:
        return str(exc)


def _store_rejection(store) -> str | None:
    """Why the kernels cannot serve this store beyond what their declarations say (None:
    they can): paged rows of 2^31 slots or more (the paged kernels index a row's keys in
    32 bits). The store's kind and codec and the call's variant are routing facts, judged
    by ``fast_paths``."""
    slots = store.page_table.entries.shape[1] * store.page_size if store.kind == PAGED else 0
    if slots >= _plan.MAX_PAGED_ROW_SLOTS:
        return (f"paged rows of {slots} slots (the paged "
                f"kernels index a row's keys in 32 bits: fewer than {_plan.MAX_PAGED_ROW_SLOTS})")
    return None


class _WriteFacts:
    """What an append into one store judges of the store alone, worked out once and kept
    in ``store.memo`` (its buffers never move; every layer of every step appends):

    dtype, kv_dtype: ``_dtypes_of(store)``; head_dim; paged: whether it pages;
    request: the append's ``Request`` over it (no ``buffers`` fact); route: its route;
    store_rejection, buffers_rejection, scales_rejection: ``_store_rejection``,
    ``_cache_rows_rejection`` and ``_scales_rejection`` (None: no objection; the last two
    judged only where the route and the store leave the kernel possible);
    rotates_keys: the codec's; geometry: what ``_write_plan`` reads of the store.
    ``route_with(layout)``: the route with the call's ``buffers`` fact, kept by value.
    """

    __slots__ = ("dtype", "kv_dtype", "head_dim", "paged", "request", "route", "store_rejection",
                 "buffers_rejection", "scales_rejection", "rotates_keys", "geometry", "_routes")

    def __init__(self, store, tokens: str):
        self.dtype, self.kv_dtype = _dtypes_of(store)
        d = self.head_dim = int(store.head_dim)
        pages = _pages_arg(store)
        self.paged = pages is not None
        self.request = Request.of_store("write_kv", store, tokens=tokens)
        self.route = routing.route_write_kv(self.request)
        self.store_rejection = _store_rejection(store)
        self.rotates_keys = bool(store.codec.rotates_keys)
        self.buffers_rejection = self.scales_rejection = None
        if self.route.impl != GENERIC and self.store_rejection is None:
            self.buffers_rejection = _cache_rows_rejection(store.k, store.v,
                                                           self.kv_dtype or self.dtype, d)
            self.scales_rejection = _scales_rejection(store, d) if self.kv_dtype else None
        self.geometry = (self.dtype, d, int(store.k.shape[1]), _strides(store.k)[:3], pages,
                         self.kv_dtype,
                         _strides(store.k_scale)[:3] if self.kv_dtype else None)
        self._routes: dict = {}

    def route_with(self, layout: str | None) -> Route:
        route = self._routes.get(layout)
        if route is None:
            route = self._routes[layout] = routing.route_write_kv(self.request.with_(buffers=layout))
        return route


def _write_facts(store, tokens: str) -> _WriteFacts:
    """``store``'s ``_WriteFacts`` for appends of ``tokens`` (padded or packed), kept in its memo."""
    key = ("cupy write", tokens)
    facts = store.memo.get(key)
    if facts is None:
        facts = store.memo[key] = _WriteFacts(store, tokens)
    return facts


def _pages_arg(store) -> "_plan.PageTableArg | None":
    """The paged kernels' page-table argument for a paged store (None: contiguous)."""
    if store.kind != PAGED:
        return None
    return _plan.PageTableArg(table_stride=int(store.page_table.entries.shape[1]),
                              page_size=int(store.page_size))


def _dtypes_of(store) -> tuple[str, str | None]:
    """(dtype, kv_dtype) as routing takes them: the buffers' dtype and None, or for a
    cache of another codec the dtype of q / inputs / outputs and the codec's name ("int8",
    ...: the kernels' declarations say which they read). A codec that stores keys rotated
    computes in float32 whatever the cache's dtype: q reaches attention rotated in float32
    (gqakv.ops.plan) and the append rotates K into float32 (``_write_kv``)."""
    codec = store.spec.codec
    if codec.name != PLAIN_NAME:
        return ("float32" if codec.rotates_keys else store.spec.q_dtype), codec.name
    return _dtype_name(store.k), None


def _input_dtype_rejection(k_new, v_new, dtype: str) -> str | None:
    """Why the quantizing append cannot read these inputs (it is built for ``dtype``)."""
    if _dtype_name(k_new) != dtype or _dtype_name(v_new) != dtype:
        return f"k_new / v_new of dtype {_dtype_name(k_new)} / {_dtype_name(v_new)} (the kernel reads {dtype})"
    return None


def _scales_rejection(store, d: int) -> str | None:
    """Why the quantized kernels cannot find each token's scales (None: they can): float32
    scales of the codes' device laid out like the codes with the code row (``width``
    elements) replaced by its ``n`` scales (one per token, or one per block of a grouped
    codec: a last axis of stride 1), so the reader finds a key's scales at its code offset
    / width x n (kernels/quantized_kv.cuh)."""
    ks, vs = store.k_scale, store.v_scale
    if _dtype_name(ks) != "float32" or _dtype_name(vs) != "float32":
        return "scales that are not float32"
    code, scales = _strides(store.k)[:-1], _strides(ks)
    width = int(store.k.shape[-1])
    group = getattr(store.spec.codec, "group", None)
    if group is not None:  # [.., S, d / group]: blocks contiguous
        if ks.ndim != store.k.ndim or scales[-1] != 1:
            return "block scales whose last axis is not contiguous"
        scales, n = scales[:-1], d // group
    else:
        n = 1
    if not (_strides(ks) == _strides(vs) and _strides(store.v)[:-1] == code
            and all(c % width == 0 and c // width * n == s for c, s in zip(code, scales))):
        return "scales not laid out like their codes (strides x head_dim)"
    return None


def _cache_rows_rejection(k_buf, v_buf, dtype: str, d: int) -> str | None:
    """Why the kernels cannot read or write the cache's K and V rows in place: rows not
    aligned for their vector accesses, or K and V strided differently."""
    if not (_is_aligned(k_buf, dtype, d) and _is_aligned(v_buf, dtype, d)):
        return "cache rows not aligned for the kernel's vector loads"
    if k_buf.strides != v_buf.strides:
        return "K and V strided differently"
    return None


def _new_kv_rejection(k_new, v_new) -> str | None:
    """Why gqakv_write_kv cannot read these new K/V (already aligned copies) together."""
    return "K and V strided differently" if k_new.strides != v_new.strides else None


def _attention_layout_rejection(k_buf, v_buf, dtype: str, d: int) -> str | None:
    """Why the attention kernels cannot read this cache (q is copied when unaligned)."""
    return (_cache_rows_rejection(k_buf, v_buf, dtype, d)
            or limits.key_span_rejection(int(k_buf.shape[2]), _strides(k_buf)[2], d))


class _LruCache:
    """The last ``size`` values by key: ``get(key, make)`` returns the kept value or keeps
    ``make()``'s. Values are never changed after they are made (plans, read-only uploads)."""

    def __init__(self, size: int):
        self.size = size
        self._values: OrderedDict = OrderedDict()
        self._lock = threading.Lock()  # one backend serves every thread (registry singleton)

    def get(self, key, make):
        with self._lock:
            value = self._values.get(key)
            if value is None:
                value = make()
                self._values[key] = value
                if len(self._values) > self.size:
                    self._values.popitem(last=False)
            else:
                self._values.move_to_end(key)
            return value


def _hashable(values) -> tuple:
    """``values`` as a cache key: NumPy arrays by dtype, shape and bytes."""
    return tuple((a.dtype.str, a.shape, a.tobytes()) if isinstance(a, np.ndarray) else a
                 for a in values)


def _pack_ints(*host_arrays) -> np.ndarray:
    """Equally long host int arrays as the rows of one ``[len(host_arrays), n]`` int64 array."""
    return np.array([np.asarray(a, dtype=np.int64).reshape(-1) for a in host_arrays], dtype=np.int64)


def _contiguous_strides(shape) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of ``shape``."""
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= int(size)
    return tuple(reversed(strides))


def _extent(x, start: int | None = None) -> tuple[int, int]:
    """[first, last + 1) byte addresses ``x`` covers (any strides, a flipped view's
    negative ones included; empty: (0, 0)). ``start``: x's ``_address``, when known.
    The offsets from the first element are kept by (shape, strides, itemsize)."""
    key = (x.shape, x.strides, x.itemsize)
    offsets = _EXTENT_OFFSETS.get(key)
    if offsets is None:  # (empty, from the first element's address down, up)
        steps = [(n - 1) * s for n, s in zip(x.shape, x.strides)]  # negative strides reach below
        offsets = (x.size == 0, sum(t for t in steps if t < 0),
                   sum(t for t in steps if t > 0) + x.itemsize)
        _EXTENT_OFFSETS[key] = offsets
        if len(_EXTENT_OFFSETS) > 4096:
            _EXTENT_OFFSETS.clear()
    if offsets[0]:
        return 0, 0
    start = _address(x) if start is None else start
    return start + offsets[1], start + offsets[2]


_EXTENT_OFFSETS: dict = {}


def _disjoint(x, span: tuple[int, int], start: int | None = None) -> bool:
    """Whether ``x`` (at ``start``, when known) shares no byte with the ``_extent`` ``span``."""
    lo, hi = _extent(x, start)
    return lo == hi or span[0] == span[1] or hi <= span[0] or span[1] <= lo


def _writable_out(out, q_span, dtype: str, d: int) -> bool:
    """Whether the kernels may write ``out`` in place: rows aligned for their vector
    stores, and no memory shared with q (``q_span``: the pre-fill, or another CTA's
    stores, would change queries not yet read)."""
    start = _address(out)
    return _is_aligned(out, dtype, d, start) and _disjoint(out, q_span, start)


def _writable_lse(lse, q_span) -> bool:
    """The kernels write lse ``[B, Hq, T]`` C-contiguous (no strides of their own)."""
    return bool(lse.flags.c_contiguous) and _disjoint(lse, q_span)


def _strides(x) -> tuple[int, ...]:
    """x's strides in elements, kept by (byte strides, itemsize): every layer's call asks
    for several buffers of a few layouts."""
    key = (x.strides, x.itemsize)
    strides = _ELEMENT_STRIDES.get(key)
    if strides is None:
        strides = _ELEMENT_STRIDES[key] = tuple(s // x.itemsize for s in x.strides)
        if len(_ELEMENT_STRIDES) > 4096:
            _ELEMENT_STRIDES.clear()
    return strides


_ELEMENT_STRIDES: dict = {}


def _address(x) -> int:
    """Device address of x's first element (a host address for NumPy stand-ins in tests)."""
    if isinstance(x, np.ndarray):
        return x.ctypes.data
    return x.data.ptr


def _is_aligned(x, dtype: str, d: int, start: int | None = None) -> bool:
    """``aligned_for_vectors`` of x (at ``start``, its ``_address`` when known): its
    strides' part kept by (strides, itemsize, dtype, d), so a call judges only the
    address (every layer's call asks for each buffer)."""
    key = (x.strides, x.itemsize, dtype, d)
    rule = _ALIGNMENT_RULES.get(key)
    if rule is None:
        rule = _ALIGNMENT_RULES[key] = _plan.vector_alignment(_strides(x), dtype, d)
        if len(_ALIGNMENT_RULES) > 4096:
            _ALIGNMENT_RULES.clear()
    return rule != 0 and (_address(x) if start is None else start) % rule == 0


_ALIGNMENT_RULES: dict = {}
