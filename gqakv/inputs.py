"""Validate once, then trust: every check on append and attention inputs lives here.

Validation runs completely before anything is written, so a rejected call leaves
every row's data and length as it was. Errors name the argument, the row and the
numbers involved. Backends receive only validated inputs (host int arrays for the
per-row bookkeeping) and do not check again.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from . import dtypes as _dtypes
from .semantics import AttentionParams


def _to_numpy(x) -> np.ndarray:
    """Host copy of a small integer array from any library (list, NumPy, DLPack, CuPy)."""
    if isinstance(x, (np.ndarray, list, tuple, int, np.integer)):
        return np.asarray(x)
    if hasattr(x, "get") and type(x).__module__.startswith("cupy"):
        return x.get()
    try:
        return np.from_dlpack(x)
    except Exception:
        return np.asarray(x)


def check_no_bools(x, what: str) -> None:
    """TypeError naming the first bool in a list/tuple ``x`` (nested too). NumPy would
    turn ``[1, True]`` into an int array, so the elements are checked before it sees them."""
    if isinstance(x, (list, tuple, range)):
        for i, v in enumerate(x):
            if isinstance(v, (bool, np.bool_)):
                raise TypeError(f"{what}[{i}]={v!r} is a bool; {what} must hold integers")
            check_no_bools(v, f"{what}[{i}]")


def check_flag(value, what: str) -> bool:
    """``value`` if it is a bool (Python or NumPy); TypeError naming ``what`` otherwise."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be a bool (True or False), got {value!r}")
    return bool(value)


def host_ints(x, what: str, length: int) -> np.ndarray:
    """``x`` as a host int64 array of shape [length]; TypeError/ValueError otherwise."""
    if isinstance(x, (bool, np.bool_)) or x is None:
        raise TypeError(f"{what} must be integers of shape [{length}], got {x!r}")
    check_no_bools(x, what)
    if isinstance(x, (list, tuple)):  # before NumPy turns an out-of-range int into float/object
        for i, v in enumerate(x):
            if isinstance(v, (int, np.integer)) and not -2**63 <= v < 2**63:
                raise ValueError(f"{what}[{i}]={int(v)} is out of range (integers must fit in int64)")
    a = _to_numpy(x)
    if a.dtype.kind not in "iu" or a.dtype == np.bool_:
        if a.size == 0 and a.dtype.kind == "f":  # [] from an empty list is float64
            a = a.astype(np.int64)
        else:
            raise TypeError(f"{what} must have an integer dtype, got {a.dtype}")
    if a.shape != (length,):
        raise ValueError(f"{what} must have shape [{length}] (one per batch row), got {list(a.shape)}")
    if a.dtype.kind == "u" and a.size and a.max() > np.iinfo(np.int64).max:
        i = int(np.argmax(a > np.iinfo(np.int64).max))  # int64 would wrap it negative
        raise ValueError(f"{what}[{i}]={int(a[i])} is out of range")
    return a.astype(np.int64, copy=True)


def _check_same_library(cache, x, what: str) -> None:
    backend = cache.backend
    if not backend.owns(x):
        raise TypeError(
            f"{what} is a {type(x).__module__}.{type(x).__name__}, but the cache's backend "
            f"{backend.name!r} holds {backend.array_library} arrays"
        )
    dev, want = backend.device_of(x), backend.device_of(cache.store.k)
    if dev != want:
        raise ValueError(f"{what} is on device {dev}, the cache is on {want}")


def _check_dtype(want: str, x, what: str) -> None:
    """``x``'s dtype must be ``want``: the store's ``q_dtype`` for queries, its
    ``input_dtype`` for new keys/values (both the storage dtype today)."""
    got = _dtypes.canonical_name(x.dtype) if _is_float(x.dtype) else str(x.dtype)
    if got != want:
        raise TypeError(
            f"{what} has dtype {got}, the cache holds {want}; convert it explicitly "
            "(gqakv never casts the cache or its inputs silently)"
        )


def _is_float(dt) -> bool:
    try:
        _dtypes.canonical_name(dt)
        return True
    except TypeError:
        return False


def _rows(cache, rows, batch: int, *, distinct: bool, batch_of: str | None = None) -> np.ndarray:
    """Cache row of each batch entry: ``arange(cache.batch)`` or the given indirection.
    ``batch_of`` names the array whose dim 0 is ``batch`` (for the error when rows differs)."""
    if rows is None:
        if batch != cache.batch:
            raise ValueError(
                f"batch size {batch} does not match the cache's {cache.batch} rows "
                "(pass rows= to address a subset of rows)"
            )
        return np.arange(cache.batch, dtype=np.int64)
    count = None
    if isinstance(rows, (list, tuple, range)):
        count = len(rows)
    elif len(getattr(rows, "shape", ())) == 1:
        count = int(rows.shape[0])
    if batch_of is not None and count is not None and count != batch:
        raise ValueError(f"rows has {count} entries but {batch_of} has batch {batch} (dim 0); "
                         "rows needs one cache row per batch entry")
    return check_rows(host_ints(rows, "rows", batch), "rows", cache.batch, distinct=distinct)


def check_rows(r: np.ndarray, what: str, batch: int, *, distinct: bool) -> np.ndarray:
    """``r`` itself if every entry is a row in ``0..batch-1`` (and distinct, if asked);
    else ValueError naming the first bad entry."""
    bad = np.flatnonzero((r < 0) | (r >= batch))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{what}[{i}]={int(r[i])} is out of range for a cache of {batch} rows")
    if distinct and np.unique(r).size != r.size:
        vals, counts = np.unique(r, return_counts=True)
        raise ValueError(f"{what} must be distinct; row {int(vals[counts > 1][0])} repeats")
    return r


@dataclass(frozen=True)
class AppendInputs:
    """Validated append: batch entry i writes n_new[i] tokens to cache row rows[i] at starts[i]."""

    rows: np.ndarray  # [B] int64, distinct cache rows
    starts: np.ndarray  # [B] int64, the rows' lengths before the append
    n_new: np.ndarray  # [B] int64, 0 <= n_new <= T


def validate_append(cache, k_new, v_new, n_new, rows=None) -> AppendInputs:
    for what, x in (("k_new", k_new), ("v_new", v_new)):
        _check_same_library(cache, x, what)
        if x.ndim != 4:
            raise ValueError(f"{what} must be [B, Hkv, T, d], got {x.ndim} dims {list(x.shape)}")
    if tuple(k_new.shape) != tuple(v_new.shape):
        raise ValueError(f"k_new {list(k_new.shape)} and v_new {list(v_new.shape)} differ in shape")
    B, hkv, T, d = (int(s) for s in k_new.shape)
    if (hkv, d) != (cache.kv_heads, cache.head_dim):
        raise ValueError(
            f"k_new/v_new are [B={B}, Hkv={hkv}, T={T}, d={d}], the cache has "
            f"Hkv={cache.kv_heads}, d={cache.head_dim}"
        )
    want = cache.store.spec.input_dtype
    _check_dtype(want, k_new, "k_new")
    _check_dtype(want, v_new, "v_new")
    r = _rows(cache, rows, B, distinct=True, batch_of="k_new")
    n = host_ints(n_new, "n_new", B)
    for i in range(B):
        if not 0 <= n[i] <= T:
            raise ValueError(f"n_new[{i}]={int(n[i])} is outside 0..T={T} for row {int(r[i])}")
    starts = cache.host_lens[r].copy()
    check_capacity(r, starts, n, cache.max_len)
    return AppendInputs(rows=r, starts=starts, n_new=n)


def check_capacity(rows: np.ndarray, starts: np.ndarray, n_new: np.ndarray, max_len: int) -> None:
    """ValueError naming the first entry i whose row ``rows[i]`` cannot take ``n_new[i]`` more tokens."""
    for i in range(len(rows)):
        start, n = int(starts[i]), int(n_new[i])  # Python ints: int64 would wrap past 2**63
        if start + n > max_len:
            raise ValueError(
                f"row {int(rows[i])} holds {start} tokens; appending n_new[{i}]={n} "
                f"would make {start + n} > max_len={max_len}"
            )


def _as_float(x) -> float:
    """``float(x)``, or inf for an int too large for a float (no OverflowError)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf


@dataclass(frozen=True)
class AttentionInputs:
    """Validated attention call: batch entry i reads cache row rows[i] of length lens[i]."""

    rows: np.ndarray  # [B] int64
    lens: np.ndarray  # [B] int64, live tokens of each row (after the append)
    n_new: np.ndarray  # [B] int64, queries of entry i are the last n_new[i] tokens of its row
    group: int  # G = Hq // Hkv
    params: AttentionParams  # scale (and, later, the variant's fields)

    @property
    def scale(self) -> float:
        return self.params.scale


def validate_attention(cache, q, n_new, rows=None, scale=None, params=None) -> AttentionInputs:
    """The checked call; ``params`` (an AttentionParams) is an alternative to ``scale``
    that carries a variant's fields too (not both)."""
    if params is not None:
        if not isinstance(params, AttentionParams):
            raise TypeError(f"params must be a gqakv.AttentionParams, got {params!r}")
        if scale is not None:
            raise TypeError(f"give scale={scale!r} or params={params!r}, not both")
        scale = params.scale
    _check_same_library(cache, q, "q")
    if q.ndim != 4:
        raise ValueError(f"q must be [B, Hq, T, d], got {q.ndim} dims {list(q.shape)}")
    B, hq, T, d = (int(s) for s in q.shape)
    if d != cache.head_dim:
        raise ValueError(f"q has head dim d={d}, the cache has d={cache.head_dim}")
    if hq % cache.kv_heads:
        raise ValueError(
            f"query heads Hq={hq} must be a multiple of the cache's KV heads Hkv={cache.kv_heads}"
        )
    if hq == 0:
        raise ValueError("q has no heads (Hq=0)")
    _check_dtype(cache.store.spec.q_dtype, q, "q")
    r = _rows(cache, rows, B, distinct=False, batch_of="q")
    n = host_ints(n_new, "n_new", B)
    lens = cache.host_lens[r]
    for i in range(B):
        if not 0 <= n[i] <= T:
            raise ValueError(f"n_new[{i}]={int(n[i])} is outside 0..T={T}")
        if n[i] > lens[i]:
            raise ValueError(
                f"n_new[{i}]={int(n[i])} but row {int(r[i])} holds only {int(lens[i])} tokens "
                "(attention takes the lengths after the append)"
            )
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif (isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating))
          or not math.isfinite(_as_float(scale))):
        raise TypeError(f"scale must be a finite real number, got {scale!r}")
    # A Python float keeps the computation in the cache's dtype (a NumPy float64 scalar
    # would promote a float32 step to a float64 copy of every block it touches).
    scale = float(scale)
    params = AttentionParams(scale=scale) if params is None else dataclasses.replace(params, scale=scale)
    return AttentionInputs(rows=r, lens=lens.copy(), n_new=n, group=hq // cache.kv_heads,
                           params=params)
