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

Devices: the cache lives on the device that was current when it was made (or the one
passed to ``empty``). Every hot operation makes the device of the cache buffers current
for its duration, so kernels compile and launch there, and index uploads and outputs are
allocated there, whatever device the caller has current (CuPy launches on the current
device, and a pointer into another device's memory would fault).

bfloat16: the cache is a CuPy array of dtype ``ml_dtypes.bfloat16`` (CuPy 14+); the
kernels read its 16-bit storage directly, and host exchange goes through
``ml_dtypes.bfloat16`` NumPy arrays. A CuPy without that support serves float32 and
float16 only, and says so when asked for bfloat16.

CuPy is never imported when this module is imported; only inside methods.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import numpy as np

from gqakv.backend import Backend

from . import plan as _plan
from . import sources


class CupyBackend(Backend):
    name = "cupy"
    priority = 100
    array_library = "cupy"
    device_kind = "cuda"
    dtypes = ("float32", "float16", "bfloat16", "float64")
    head_dims = None  # fused for d <= 256, generic array-API above
    features = frozenset({
        "fused_append", "fused_row_copies", "fused_decode", "split_kv", "fused_chunked_prefill",
        "fp32 accumulation", "float64 and head_dim > 256 via array API",
    })

    def __init__(self):
        self._reason: str | None | bool = False  # False: not checked yet
        self._device_facts: dict[int, tuple[int, bool]] = {}
        # Every layer of a model step plans the same launches and uploads the same
        # rows/lengths: both are kept (by value) so only the first layer pays for them.
        self._plans = _LruCache(64)
        self._uploads = _LruCache(64)

    # -- availability --------------------------------------------------------------------

    def unavailable_reason(self) -> str | None:
        if self._reason is False:
            self._reason = _probe()
        return self._reason

    # -- arrays --------------------------------------------------------------------------

    def namespace(self):
        import array_api_compat.cupy as xp

        return xp

    def not_supported_reasons(self, *, dtype=None, head_dim: int | None = None) -> list[str]:
        reasons = super().not_supported_reasons(dtype=dtype, head_dim=head_dim)
        if not reasons and dtype is not None and _canonical(dtype) == "bfloat16" and not _bf16_supported():
            import cupy

            reasons.append(f"dtype=bfloat16 needs CuPy >= 14 (ml_dtypes arrays); this is CuPy {cupy.__version__}")
        return reasons

    def dtype(self, name: str):
        """CuPy dtype for a gqakv dtype; bfloat16 is ml_dtypes.bfloat16."""
        name = _canonical(name)
        if name == "bfloat16":
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        import cupy

        return getattr(cupy, name)

    def empty(self, shape: tuple[int, ...], dtype: str, device=None):
        """Uninitialized CuPy buffer on ``device`` (an id; None: the current device)."""
        import cupy

        with cupy.cuda.Device(device):
            return cupy.empty(shape, dtype=self.dtype(dtype))

    def owns(self, x) -> bool:
        import cupy

        return isinstance(x, cupy.ndarray)

    def device_of(self, x):
        return x.device.id

    def from_numpy(self, a: np.ndarray, dtype=None):
        import cupy

        a = np.asarray(a)
        if dtype is not None:
            a = a.astype(self.dtype(dtype), copy=False)  # cast on the host: ml_dtypes knows bf16
        return cupy.asarray(a)

    def to_numpy(self, x) -> np.ndarray:
        """Host copy of a CuPy array (bfloat16 comes back as ml_dtypes.bfloat16)."""
        if isinstance(x, np.ndarray):
            return x
        return x.get()

    def from_host_ints(self, a, device=None):
        import cupy

        if device is None:
            return cupy.asarray(a, dtype=cupy.int64)
        with cupy.cuda.Device(device):
            return cupy.asarray(a, dtype=cupy.int64)

    # -- hot operations ------------------------------------------------------------------

    def write_kv(self, k_buf, v_buf, k_new, v_new, rows, starts, n_new) -> None:
        """One launch for all rows; see ``Backend.write_kv``. k/v_new are [B, Hkv, T, d]."""
        with self._device_of(k_buf):
            self._write_kv(k_buf, v_buf, k_new, v_new, rows, starts, n_new)

    def _write_kv(self, k_buf, v_buf, k_new, v_new, rows, starts, n_new) -> None:
        dtype = _kernel_dtype(k_buf)
        d = int(k_buf.shape[-1])
        if dtype is None or d > sources.MAX_FUSED_HEAD_DIM:
            return super().write_kv(k_buf, v_buf, k_new, v_new, rows, starts, n_new)
        k_new, v_new = _aligned(k_new, dtype, d), _aligned(v_new, dtype, d)
        if not (_is_aligned(k_buf, dtype, d) and _is_aligned(v_buf, dtype, d)
                and k_buf.strides == v_buf.strides and k_new.strides == v_new.strides):
            return super().write_kv(k_buf, v_buf, k_new, v_new, rows, starts, n_new)
        n_new = np.asarray(n_new, dtype=np.int64)
        args = (dtype, d, n_new, int(k_buf.shape[1]), int(k_new.shape[2]), _strides(k_new)[:3],
                _strides(k_buf)[:3])
        try:
            plan = self._plans.get(("write_kv", *_hashable(args)), lambda: _plan.plan_write_kv(*args))
        except NotImplementedError:  # beyond the grid limits
            return super().write_kv(k_buf, v_buf, k_new, v_new, rows, starts, n_new)
        if not plan.launches:
            return
        from .modules import run_plan

        rows_d, starts_d, n_new_d = self._upload_ints(rows, starts, n_new)
        run_plan(plan, {"k_new": k_new, "v_new": v_new, "k_buf": k_buf, "v_buf": v_buf,
                        "rows": rows_d, "starts": starts_d, "n_new": n_new_d}, dtype, d)

    def copy_tokens(self, dst_k, dst_v, dst_rows, src_k, src_v, src_rows, n_tokens) -> None:
        """All copies of the call in one launch; see ``Backend.copy_tokens``.

        Buffers are ``[layers, rows, Hkv, S, d]`` (dst and src may differ in rows and S).
        Layouts the kernel does not take (not CuPy arrays, mixed dtypes, float64, d > 256,
        unaligned rows, K and V strided differently) use the generic slice copies.
        """
        with self._device_of(dst_k):
            self._copy_tokens(dst_k, dst_v, dst_rows, src_k, src_v, src_rows, n_tokens)

    def _copy_tokens(self, dst_k, dst_v, dst_rows, src_k, src_v, src_rows, n_tokens) -> None:
        n_tokens = np.asarray(n_tokens, dtype=np.int64)
        if not self._fused_copy_layout(dst_k, dst_v, src_k, src_v):
            return super().copy_tokens(dst_k, dst_v, dst_rows, src_k, src_v, src_rows, n_tokens)
        dtype, d = _kernel_dtype(dst_k), int(dst_k.shape[-1])
        try:
            plan = _plan.plan_copy_tokens(dtype, d, n_tokens, int(dst_k.shape[0]),
                                          int(dst_k.shape[2]), _strides(dst_k)[:4],
                                          _strides(src_k)[:4])
        except NotImplementedError:  # beyond the grid limits
            return super().copy_tokens(dst_k, dst_v, dst_rows, src_k, src_v, src_rows, n_tokens)
        if not plan.launches:
            return
        import cupy

        from .modules import run_plan

        pairs = _pack_ints(dst_rows, src_rows, n_tokens)  # [3, P]: one upload
        run_plan(plan, {"dst_k": dst_k, "dst_v": dst_v, "src_k": src_k, "src_v": src_v,
                        "pairs": cupy.asarray(pairs)}, dtype, d)

    def _fused_copy_layout(self, dst_k, dst_v, src_k, src_v) -> bool:
        """Whether the copy kernel can read src and write dst in place."""
        bufs = (dst_k, dst_v, src_k, src_v)
        if not all(self.owns(x) and x.ndim == 5 for x in bufs):
            return False
        dtype, d = _kernel_dtype(dst_k), int(dst_k.shape[-1])
        if dtype is None or d > sources.MAX_FUSED_HEAD_DIM:
            return False
        if any(x.dtype != dst_k.dtype or self.device_of(x) != self.device_of(dst_k) for x in bufs):
            return False
        if (dst_v.shape != dst_k.shape or src_v.shape != src_k.shape
                or src_k.shape[0] != dst_k.shape[0] or src_k.shape[2] != dst_k.shape[2]
                or src_k.shape[4] != d):
            return False
        return (dst_k.strides == dst_v.strides and src_k.strides == src_v.strides
                and all(_is_aligned(x, dtype, d) for x in bufs))

    def attention(self, q, k_buf, v_buf, rows, lens, n_new, *, scale: float, return_lse: bool):
        """Fused GQA attention; see ``gqakv.gqa_attention``. q, out: [B, Hq, T, d]."""
        with self._device_of(k_buf):
            return self._attention(q, k_buf, v_buf, rows, lens, n_new, scale=scale,
                                   return_lse=return_lse)

    def _attention(self, q, k_buf, v_buf, rows, lens, n_new, *, scale: float, return_lse: bool):
        dtype = _kernel_dtype(k_buf)
        d = int(k_buf.shape[-1])
        if (dtype is None or d > sources.MAX_FUSED_HEAD_DIM or not _is_aligned(k_buf, dtype, d)
                or k_buf.strides != v_buf.strides):
            return super().attention(q, k_buf, v_buf, rows, lens, n_new, scale=scale,
                                     return_lse=return_lse)
        import cupy

        q = _aligned(q, dtype, d)
        B, Hq, T, _ = (int(s) for s in q.shape)
        Hkv = int(k_buf.shape[1])
        lens = np.asarray(lens, dtype=np.int64)
        n_new = np.asarray(n_new, dtype=np.int64)
        if B and T and int(n_new.min()) == T:
            # No padded query: the kernels write every element of out and lse, so the two
            # fill launches are skipped (the common decode and prefill steps).
            out = cupy.empty((B, Hq, T, d), dtype=q.dtype)
            lse = cupy.empty((B, Hq, T), dtype=cupy.float32)
        else:  # padded queries and idle rows keep these values: 0 and -inf
            out = cupy.zeros((B, Hq, T, d), dtype=q.dtype)
            lse = cupy.full((B, Hq, T), -math.inf, dtype=cupy.float32)
        sm_count, tensor_cores = self._facts()
        kwargs = dict(batch=B, kv_heads=Hkv, group=Hq // Hkv, t_q=T, lens=lens, n_new=n_new,
                      scale=scale, q_strides=_strides(q)[:3], buf_strides=_strides(k_buf)[:3],
                      out_strides=_strides(out)[:3], sm_count=sm_count, tensor_cores=tensor_cores)
        try:
            plan = self._plans.get(("attention", dtype, d, *_hashable(kwargs.values())),
                                   lambda: _plan.plan_attention(dtype, d, **kwargs))
        except NotImplementedError:  # beyond the grid limits of the fused kernels
            return super().attention(q, k_buf, v_buf, rows, lens, n_new, scale=scale,
                                     return_lse=return_lse)
        if plan.launches:
            from .modules import run_plan

            rows_d, lens_d, n_new_d = self._upload_ints(rows, lens, n_new)
            run_plan(plan, {"q": q, "k_buf": k_buf, "v_buf": v_buf, "rows": rows_d,
                            "lens": lens_d, "n_new": n_new_d, "out": out, "lse": lse}, dtype, d)
        return (out, lse) if return_lse else out

    def synchronize(self) -> None:
        """Wait for the current device's queued work (benchmarks time through this)."""
        import cupy

        cupy.cuda.get_current_stream().synchronize()

    def _device_of(self, buf):
        """Context making ``buf``'s device current (a no-op for arrays that are not CuPy's:
        the generic fallbacks take those as they are)."""
        import contextlib

        import cupy

        if not self.owns(buf):
            return contextlib.nullcontext()
        return cupy.cuda.Device(self.device_of(buf))

    def _facts(self) -> tuple[int, bool]:
        """(multiprocessors, has mma.m16n8k16 i.e. compute capability 8.0+) of the current
        device (the hot ops make the cache's device current)."""
        import cupy

        dev = cupy.cuda.Device()
        if dev.id not in self._device_facts:
            self._device_facts[dev.id] = (int(dev.attributes["MultiProcessorCount"]),
                                          int(dev.compute_capability) >= 80)
        return self._device_facts[dev.id]

    def _upload_ints(self, *host_arrays):
        """Device int64 views of equally long host int arrays, through one host-to-device
        copy, kept by value (per device and stream) for the next layers of the same step."""
        import cupy

        packed = _pack_ints(*host_arrays)
        key = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr, packed.shape,
               packed.tobytes())
        device = self._uploads.get(key, lambda: cupy.asarray(packed))
        return tuple(device[i] for i in range(len(host_arrays)))


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


_BF16_SUPPORTED = None


def _canonical(dtype) -> str:
    from gqakv.dtypes import canonical_name

    return canonical_name(dtype)


def _bf16_supported() -> bool:
    """Whether this CuPy can hold ml_dtypes.bfloat16 arrays (CuPy 14+)."""
    global _BF16_SUPPORTED
    if _BF16_SUPPORTED is None:
        import cupy
        import ml_dtypes

        try:
            cupy.empty(1, dtype=ml_dtypes.bfloat16)
            _BF16_SUPPORTED = True
        except Exception:
            _BF16_SUPPORTED = False
    return _BF16_SUPPORTED


def _kernel_dtype(x) -> str | None:
    """gqakv dtype name of a buffer if the fused kernels handle it, else None."""
    name = np.dtype(x.dtype).name
    if name == "bfloat16":
        return "bfloat16"
    return name if name in sources.CTYPES else None


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


def _strides(x) -> tuple[int, ...]:
    return tuple(s // x.itemsize for s in x.strides)


def _address(x) -> int:
    """Device address of x's first element (a host address for NumPy stand-ins in tests)."""
    if isinstance(x, np.ndarray):
        return x.ctypes.data
    return x.data.ptr


def _is_aligned(x, dtype: str, d: int) -> bool:
    return _plan.aligned_for_vectors(_address(x), _strides(x), dtype, d)


def _aligned(x, dtype: str, d: int):
    """x itself when the kernels can read it in place, else a contiguous copy (inputs only)."""
    if _is_aligned(x, dtype, d):
        return x
    import cupy

    return cupy.ascontiguousarray(x)
