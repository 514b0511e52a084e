"""Validate once, then trust: every check on append and attention inputs lives here.

Validation runs completely before anything is written, so a rejected call leaves
every row's data and length as it was. Errors name the argument, the row and the
numbers involved. Backends receive only validated inputs (host int arrays for the
per-row bookkeeping) and do not check again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import dtypes as _dtypes
from . import invariance as _invariance
from .host_arrays import to_numpy as _to_numpy
from .semantics import AttentionParams, key_range
from .tree import DraftTree


def immutable_ints(a) -> np.ndarray:
    """An int64 copy of ``a`` (same shape) that cannot be written: its memory is a
    ``bytes`` object, so even ``setflags(write=True)`` is refused (a read-only *view* of
    an array, or a copy marked read-only, can be made writable again)."""
    a = np.asarray(a, dtype=np.int64)
    return np.frombuffer(a.tobytes(), dtype=np.int64).reshape(a.shape)


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


def ints_1d(x, what: str) -> np.ndarray:
    """``x`` (an int, a sequence or a 1-D integer array) as host int64 ``[n]``; TypeError /
    ValueError naming ``what`` otherwise (row lists, lengths, token ids)."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        x = [x]
    if isinstance(x, (list, tuple, range)):
        x = list(x)
        return host_ints(x, what, len(x))  # checks the elements before NumPy sees them
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 1:
        raise ValueError(f"{what} must be a 1-D list of integers, got {x!r}")
    return host_ints(x, what, int(shape[0]))


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
    if distinct and len(set(r.tolist())) != r.size:  # (a set: 0.3 us for 8 rows, np.unique 2)
        vals, counts = np.unique(r, return_counts=True)
        raise ValueError(f"{what} must be distinct; row {int(vals[counts > 1][0])} repeats")
    return r


@dataclass(frozen=True)
class AppendInputs:
    """Validated append: batch entry i writes n_new[i] tokens to cache row rows[i] at starts[i]."""

    rows: np.ndarray  # [B] int64, distinct cache rows
    starts: np.ndarray  # [B] int64, the rows' lengths before the append
    n_new: np.ndarray  # [B] int64, 0 <= n_new <= T
    #: None: k_new / v_new are padded ``[B, Hkv, T, d]``; else packed ``[N, Hkv, d]`` and
    #: entry i's tokens are ``offsets[i] : offsets[i] + n_new[i]`` of dim 0 ([B] int64).
    offsets: np.ndarray | None = None


def validate_append(cache, k_new, v_new, n_new, rows=None) -> AppendInputs:
    """The checked append of ``k_new`` / ``v_new``: padded ``[B, Hkv, T, d]`` (entry i's
    first ``n_new[i]`` slots are real) or packed ``[N, Hkv, d]`` (every entry's tokens end
    to end, ``N = sum(n_new)``; see ``packed_offsets``)."""
    for what, x in (("k_new", k_new), ("v_new", v_new)):
        _check_same_library(cache, x, what)
        if x.ndim not in (3, 4):
            raise ValueError(f"{what} must be [B, Hkv, T, d] (padded) or [N, Hkv, d] (packed), "
                             f"got {x.ndim} dims {list(x.shape)}")
    if tuple(k_new.shape) != tuple(v_new.shape):
        raise ValueError(f"k_new {list(k_new.shape)} and v_new {list(v_new.shape)} differ in shape")
    packed = k_new.ndim == 3
    if packed:
        check_packed_backend(cache.backend, "k_new / v_new")
    shape = [int(s) for s in k_new.shape]
    hkv, d = shape[-2:] if packed else shape[1::2]
    if (hkv, d) != (cache.kv_heads, cache.head_dim):
        named = "N={}, Hkv={}, d={}" if packed else "B={}, Hkv={}, T={}, d={}"
        raise ValueError(
            f"k_new/v_new are [{named.format(*shape)}], the cache has "
            f"Hkv={cache.kv_heads}, d={cache.head_dim}"
        )
    want = cache.store.spec.input_dtype
    _check_dtype(want, k_new, "k_new")
    _check_dtype(want, v_new, "v_new")
    if packed:
        B = batch_of_n_new(n_new)
        r = _rows(cache, rows, B, distinct=True, batch_of="n_new")
        n = host_ints(n_new, "n_new", B)
        offsets = packed_offsets(n, shape[0], "k_new")
    else:
        B, T = shape[0], shape[2]
        r = _rows(cache, rows, B, distinct=True, batch_of="k_new")
        n = host_ints(n_new, "n_new", B)
        for i in range(B):
            if not 0 <= n[i] <= T:
                raise ValueError(f"n_new[{i}]={int(n[i])} is outside 0..T={T} for row {int(r[i])}")
        offsets = None
    starts = cache.host_lens[r].copy()
    check_capacity(r, starts, n, cache.max_len)
    return AppendInputs(rows=r, starts=starts, n_new=n, offsets=offsets)


def check_same_layout(q, k_new) -> None:
    """ValueError when one of q and k_new is padded (rank 4) and the other packed (rank 3):
    a call's new tokens share one layout (other ranks are judged by their own checks)."""
    q_rank, k_rank = len(getattr(q, "shape", ())), len(getattr(k_new, "shape", ()))
    if q_rank in (3, 4) and k_rank in (3, 4) and q_rank != k_rank:
        raise ValueError(f"q {list(q.shape)} and k_new {list(k_new.shape)} are laid out "
                         "differently: both padded ([B, H, T, d]) or both packed ([N, H, d])")


def check_packed_backend(backend, what: str) -> None:
    """TypeError unless ``backend`` takes packed tokens (``Backend.packed_tokens``)."""
    if not getattr(backend, "packed_tokens", False):
        raise TypeError(f"{what} are packed [N, H, d], but backend {backend.name!r} takes only "
                        "padded [B, H, T, d] tokens (it does not declare packed_tokens)")


def batch_of_n_new(n_new) -> int:
    """B, the length of a 1-D ``n_new`` (packed tensors do not carry the batch)."""
    if isinstance(n_new, (list, tuple, range)):
        return len(n_new)
    shape = getattr(n_new, "shape", None)
    if shape is None or len(shape) != 1:
        raise ValueError(f"n_new must be 1-D [B] ints, got {n_new!r}" if shape is None else
                         f"n_new must be 1-D [B] ints, got shape {list(shape)}")
    return int(shape[0])


def packed_offsets(n_new: np.ndarray, tokens: int, what: str) -> np.ndarray:
    """Where each entry's tokens start in a packed tensor of ``tokens`` rows: the exclusive
    cumulative sum of ``n_new`` (host int64 [B], FlashAttention's ``cu_seqlens[:-1]``),
    after checking that every n_new is >= 0 and that they add up to ``tokens``."""
    bad = np.flatnonzero(n_new < 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"n_new[{i}]={int(n_new[i])} is negative")
    total = int(sum(int(x) for x in n_new))  # Python ints: no int64 wrap
    if total != tokens:
        raise ValueError(f"{what} is packed with {tokens} tokens (dim 0), but n_new adds up to "
                         f"{total}: a packed tensor holds every entry's n_new[i] tokens end to end")
    return np.concatenate(([0], np.cumsum(n_new)[:-1])).astype(np.int64) if n_new.size else \
        np.zeros(0, np.int64)


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
    params: AttentionParams  # scale, window, softcap, sinks (all checked)
    #: None: q (and out) are padded ``[B, Hq, T, d]``; else packed ``[N, Hq, d]`` and entry
    #: i's queries are ``offsets[i] : offsets[i] + n_new[i]`` of dim 0 ([B] int64).
    offsets: np.ndarray | None = None
    #: batch-invariant mode (``gqakv.core.invariance``), as it was when the call was validated
    invariant: bool = False
    #: None, or the entries' draft trees (``gqakv.core.tree.DraftTree``): chunk query t sees
    #: the prefix and its ancestors in the chunk only
    tree: DraftTree | None = None

    @property
    def features(self) -> frozenset[str]:
        """The variant features of this call (``AttentionParams.features``) plus ``"tree"``
        for a draft tree: what a fast path must declare to serve it."""
        return self.params.features | {"tree"} if self.tree is not None else self.params.features

    def entry_tree(self, i: int):
        """Entry i's ``EntryTree`` (None without a tree), built once per tree
        (``DraftTree.entry``)."""
        return None if self.tree is None else self.tree.entry(i)

    @property
    def scale(self) -> float:
        return self.params.scale

    def token_facts(self, q_shape) -> dict:
        """The ``Request`` facts of this call's queries ``q_shape``: ``t_q`` (query tokens
        per row: T padded, the largest n_new packed), ``keys`` (the longest row's live
        tokens), ``tokens`` (their layout) and ``invariant`` (batch-invariant mode)."""
        mode = {"invariant": True} if self.invariant else {}
        keys = int(self.lens.max(initial=0))
        if self.offsets is None:
            return {"t_q": int(q_shape[2]), "keys": keys, **mode}
        return {"t_q": max(1, int(self.n_new.max(initial=0))), "keys": keys, "tokens": PACKED,
                **mode}


#: The two layouts of a call's new tokens (q, k_new, v_new, out; ``Request.tokens``):
#: padded ``[B, H, T, d]`` and packed ``[N, H, d]`` (every entry's tokens end to end).
PADDED, PACKED = "padded", "packed"


def validate_attention(cache, q, n_new, rows=None, scale=None, params=None, *,
                       window=None, softcap=None, sinks=None, alibi_slopes=None,
                       tree=None) -> AttentionInputs:
    """The checked call: the tensor ``q`` (``check_queries``) and everything else
    (``validate_attention_batch``, with q's shape)."""
    check_queries(cache, q)
    return validate_attention_batch(cache, tuple(int(s) for s in q.shape), n_new, rows, scale,
                                    params, window=window, softcap=softcap, sinks=sinks,
                                    alibi_slopes=alibi_slopes, tree=tree)


def check_queries(cache, q, what: str = "q") -> None:
    """The per-tensor checks of queries (or of an output like them): an array of the
    cache's library on its device, of rank 4 (padded ``[B, Hq, T, d]``) or 3 (packed
    ``[N, Hq, d]``), in the store's ``q_dtype``."""
    _check_same_library(cache, q, what)
    if q.ndim not in (3, 4):
        raise ValueError(f"{what} must be [B, Hq, T, d] (padded) or [N, Hq, d] (packed), got "
                         f"{q.ndim} dims {list(q.shape)}")
    _check_dtype(cache.store.spec.q_dtype, q, what)


def validate_attention_batch(cache, q_shape: tuple[int, ...], n_new, rows=None,
                             scale=None, params=None, *, window=None, softcap=None, sinks=None,
                             alibi_slopes=None, tree=None) -> AttentionInputs:
    """Everything of an attention call but the query tensor itself, checked once for a
    batch (a plan serves every layer of a step with it): q's shape ``[B, Hq, T, d]``
    against the cache, rows, n_new against the rows' lengths, and the variant (a packed
    ``q_shape`` ``[N, Hq, d]``: B is n_new's length and ``sum(n_new) == N``). ``params``
    (an AttentionParams) is an alternative to ``scale``, ``window``, ``softcap``,
    ``sinks`` and ``alibi_slopes`` that carries them all (not both). Every field of the
    resulting params is checked here (``check_scale``, ``check_window``,
    ``check_softcap``, ``check_sinks``, ``check_alibi``), whichever way it was given.
    ``tree``: None, or each entry's draft tree over its n_new tokens (``gqakv.core.tree``:
    parents ``[B, T]`` or an ancestor mask ``[B, T, T]``), checked here."""
    if params is not None:
        if not isinstance(params, AttentionParams):
            raise TypeError(f"params must be a gqakv.AttentionParams, got {params!r}")
        given = [f"{name}={value!r}" for name, value in (("scale", scale), ("window", window),
                                                         ("softcap", softcap), ("sinks", sinks),
                                                         ("alibi_slopes", alibi_slopes))
                 if value is not None]
        if given:
            raise TypeError(f"give {', '.join(given)} or params={params!r}, not both "
                            "(params carries scale, window, softcap, sinks and alibi_slopes)")
        scale, window, softcap, sinks = params.scale, params.window, params.softcap, params.sinks
        alibi_slopes = params.alibi_slopes
    packed = len(q_shape) == 3
    if packed:
        check_packed_backend(cache.backend, "q")
        N, hq, d = q_shape
        B = batch_of_n_new(n_new)
        T = max(0, N)
    else:
        B, hq, T, d = q_shape
    if d != cache.head_dim:
        raise ValueError(f"q has head dim d={d}, the cache has d={cache.head_dim}")
    if hq % cache.kv_heads:
        raise ValueError(
            f"query heads Hq={hq} must be a multiple of the cache's KV heads Hkv={cache.kv_heads}"
        )
    if hq == 0:
        raise ValueError("q has no heads (Hq=0)")
    r = _rows(cache, rows, B, distinct=False, batch_of="n_new" if packed else "q")
    n = host_ints(n_new, "n_new", B)
    offsets = packed_offsets(n, N, "q") if packed else None
    lens = cache.host_lens[r]
    for i in range(B):
        if not 0 <= n[i] <= T:
            raise ValueError(f"n_new[{i}]={int(n[i])} is outside 0..T={T}")
        if n[i] > lens[i]:
            raise ValueError(
                f"n_new[{i}]={int(n[i])} but row {int(r[i])} holds only {int(lens[i])} tokens "
                "(attention takes the lengths after the append)"
            )
    if tree is not None:
        tree = DraftTree.of(tree, n)
    scale = 1.0 / math.sqrt(d) if scale is None else check_scale(scale)
    params = AttentionParams(scale=scale, window=check_window(window),
                             softcap=check_softcap(softcap), sinks=check_sinks(sinks, hq),
                             alibi_slopes=check_alibi(alibi_slopes, hq))
    check_held_keys(cache.store, params, r, lens, n)
    return AttentionInputs(rows=r, lens=lens.copy(), n_new=n, params=params, offsets=offsets,
                           invariant=_invariance.enabled(), tree=tree)


def check_held_keys(store, params: AttentionParams, rows, lens, n_new) -> None:
    """Refuse (ValueError naming the entry and the numbers) a call whose queries would read
    keys a sliding-window store released (``store.first_held``): entry i's first query
    (at position ``lens[i] - n_new[i]``; a draft tree's roots stand there too) sees keys
    from ``key_range(params, ...)``'s ``lo`` on, which must be held."""
    if getattr(store, "window", None) is None:
        return
    held = store.first_held(rows)
    for i in range(len(rows)):
        if int(n_new[i]) == 0 or int(held[i]) == 0:
            continue
        lo, _ = key_range(params, int(lens[i]), int(n_new[i]), 0)
        if lo < int(held[i]):
            first = int(lens[i]) - int(n_new[i])
            raise ValueError(
                f"entry {i}: row {int(rows[i])} holds keys {int(held[i])}..{int(lens[i]) - 1} only "
                f"(its sliding window, window={store.window}, released the earlier ones), but its "
                f"first query (position {first}) would read keys from {int(lo)} on with "
                f"window={params.window} (attend with window={store.window} or a smaller one, "
                f"over at most the tokens appended since the window last moved)")


def lse_dtype(q_dtype: str) -> str:
    """The dtype of a call's log-sum-exp: float64 for float64 queries, else float32."""
    return "float64" if q_dtype == "float64" else "float32"


def check_outputs(cache, q_shape: tuple[int, ...], out=None, lse_out=None) -> None:
    """The caller's output buffers of an attention call with queries of ``q_shape``
    (padded ``[B, Hq, T, d]`` or packed ``[N, Hq, d]``): ``out`` like q (same shape, the
    store's ``q_dtype``) and ``lse_out`` q's shape without d (``[B, Hq, T]`` / ``[N, Hq]``)
    in ``lse_dtype``, each an array of the cache's library on its device (None: not
    given). Checked before anything is written."""
    names = "[N, Hq, d]" if len(q_shape) == 3 else "[B, Hq, T, d]"
    if out is not None:
        check_queries(cache, out, "out")
        if tuple(int(s) for s in out.shape) != tuple(q_shape):
            raise ValueError(f"out has shape {list(out.shape)}, the call's queries are "
                             f"{list(q_shape)} (out must be {names} like q)")
    if lse_out is not None:
        _check_same_library(cache, lse_out, "lse_out")
        want = tuple(q_shape[:-1])
        if tuple(int(s) for s in lse_out.shape) != want:
            raise ValueError(f"lse_out has shape {list(lse_out.shape)}, expected "
                             f"{names[:-4]}] = {list(want)}")
        q_dtype = cache.store.spec.q_dtype
        got = _dtypes.canonical_name(lse_out.dtype) if _is_float(lse_out.dtype) else str(lse_out.dtype)
        if got != lse_dtype(q_dtype):
            raise TypeError(f"lse_out has dtype {got}; the log-sum-exp of a {q_dtype} call is "
                            f"{lse_dtype(q_dtype)}")


# -- attention variants (gqakv.core.semantics.AttentionParams) -------------------------------------

#: The largest ``|scale|`` taken. Every fast path multiplies in float32 (the numba kernels
#: take ``float32(scale)``, the CUDA kernels fold ``scale * log2(e)`` in float32), where
#: 1e39 is inf (``inf * 0`` is NaN) and ``3.4e38 * log2(e)`` overflows; 1e38 keeps both
#: finite. Within it a result is still only as good as its scores: a query whose scaled
#: score ``scale * q . k`` overflows float32 (``|s| > 3.4e38``, a huge scale or huge q)
#: gets NaN when its largest score is +inf (never hidden), and 0 when every score is -inf.
#: Values are not checked here (that would read q and K: a device sync).
SCALE_MAX = 1e38


def check_scale(scale) -> float:
    """The softmax scale as a Python float: any finite real number with ``|scale| <=
    SCALE_MAX`` (0 and negative scales included; NumPy scalars and ints taken);
    TypeError for a non-number or a non-finite one, ValueError past the range."""
    if (isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating))
            or not math.isfinite(_as_float(scale))):
        raise TypeError(f"scale must be a finite real number, got {scale!r}")
    # A Python float keeps the computation in the cache's dtype (a NumPy float64 scalar
    # would promote a float32 step to a float64 copy of every block it touches).
    value = _as_float(scale)
    if not abs(value) <= SCALE_MAX:
        raise ValueError(f"scale={scale!r} is outside the supported range |scale| <= {SCALE_MAX:g} "
                         "(scores are formed in float32, where a larger scale overflows)")
    return value

#: The soft-cap's allowed range: both ``c`` and ``1 / c`` must be normal float32 numbers
#: (scores are soft-capped in float32 for every narrower cache), so ``tanh(s / c) * c``
#: never meets an infinite factor (``0 * inf`` would be NaN).
SOFTCAP_RANGE = (1e-30, 1e30)


def check_window(window) -> int | None:
    """None, or the sliding window W as a Python int >= 1; TypeError/ValueError otherwise."""
    if window is None:
        return None
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)):
        raise TypeError(f"window must be an int >= 1 (the number of most recent keys a query "
                        f"sees, its own included) or None, got {window!r}")
    w = int(window)
    if w < 1:
        raise ValueError(f"window={w} is not allowed: window must be an int >= 1 "
                         "(1: each query sees only its own key) or None for no window")
    if w > np.iinfo(np.int64).max:
        raise ValueError(f"window={w} is out of range (at most 2**63 - 1; None means no window)")
    return w


def check_softcap(softcap) -> float | None:
    """None, or the soft-cap c as a Python float in ``SOFTCAP_RANGE``."""
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(
            softcap, (int, float, np.integer, np.floating)):
        raise TypeError(f"softcap must be a finite real number > 0 or None, got {softcap!r}")
    c = _as_float(softcap)
    lo, hi = SOFTCAP_RANGE
    if not math.isfinite(c) or c <= 0:
        raise ValueError(f"softcap={softcap!r} is not allowed: softcap must be a finite real "
                         "number > 0 (scores s become softcap * tanh(s / softcap)) or None")
    if not lo <= c <= hi:
        raise ValueError(f"softcap={softcap!r} is outside the supported range {lo:g}..{hi:g} "
                         "(softcap and 1 / softcap must be normal float32 numbers)")
    return c


def _per_head_values(values, what: str, hq: int, each: str) -> np.ndarray:
    """A host float64 copy ``[hq]`` of a per-query-head array/sequence from any library
    (``sinks``, ``alibi_slopes``): bool elements refused, the shape checked (``each``: what
    one entry is, for the message)."""
    if isinstance(values, (bool, np.bool_, str, bytes)) or np.isscalar(values):
        raise TypeError(f"{what} must be a [Hq] array or sequence of real numbers (one value "
                        f"per query head) or None, got {values!r}")
    if isinstance(values, (list, tuple)):
        for i, v in enumerate(values):
            if isinstance(v, (bool, np.bool_)) or not isinstance(
                    v, (int, float, np.integer, np.floating)):
                raise TypeError(f"{what}[{i}]={v!r} is not a real number; {what} must hold "
                                "one real value per query head")
        a = np.array([_as_float(v) for v in values], dtype=np.float64)
    else:
        if hasattr(values, "detach"):  # a torch tensor (maybe requiring grad, maybe bfloat16)
            values = values.detach().cpu().double()
        try:
            a = _to_numpy(values)
        except Exception as exc:
            raise TypeError(f"{what} must be a [Hq] array or sequence of real numbers, got "
                            f"{type(values).__name__} ({exc})") from None
        if a.dtype.kind not in "iuf" and not _is_float(a.dtype):
            raise TypeError(f"{what} must have a real (integer or floating) dtype, got {a.dtype}")
        a = np.asarray(a, dtype=np.float64)
    if a.shape != (hq,):
        raise ValueError(f"{what} must have shape [Hq={hq}] (one {each} per query head of q), "
                         f"got {list(a.shape)}")
    return a


def check_sinks(sinks, hq: int) -> tuple[float, ...] | None:
    """None, or the sinks as a tuple of ``hq`` Python floats holding float32 values: one
    logit per query head, -inf allowed (no effect), NaN, +inf and values past float32's
    range refused."""
    if sinks is None:
        return None
    a = _per_head_values(sinks, "sinks", hq, "logit")
    with np.errstate(over="ignore"):
        a32 = a.astype(np.float32)
    bad = np.flatnonzero(np.isnan(a32) | (a32 == np.inf))
    if bad.size:
        i = int(bad[0])
        why = "NaN" if np.isnan(a[i]) else ("+inf" if a[i] == np.inf else "beyond float32's range")
        raise ValueError(f"sinks[{i}]={float(a[i])!r} is not allowed ({why}): sinks must be real "
                         "logits, finite or -inf (-inf: no sink for that head)")
    return tuple(float(x) for x in a32)


def check_alibi(slopes, hq: int) -> tuple[float, ...] | None:
    """None, or ALiBi's slopes as a tuple of ``hq`` Python floats: one finite real per
    query head (0: no bias for that head), kept exact (a float64 cache uses them as
    given; float32 kernels round them once); NaN, infinities and values past float32's
    range refused."""
    if slopes is None:
        return None
    a = _per_head_values(slopes, "alibi_slopes", hq, "slope")
    bad = np.flatnonzero(~(np.abs(a) <= np.finfo(np.float32).max))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"alibi_slopes[{i}]={float(a[i])!r} is not allowed: slopes must be finite "
                         "real numbers within float32's range")
    return tuple(float(x) for x in a)
