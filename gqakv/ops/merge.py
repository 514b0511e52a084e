"""The online softmax and the merging of attention results over disjoint key sets
(split-KV, key pieces, shared prefixes), written once in Python.

Convention (the only one in Python code): scores are the natural ``scale * q . k``; a
partial result is either *unnormalized* (``SoftmaxState``: running max ``m``, sum of
exponentials ``l`` and weighted values ``o``, all relative to ``m``) or *normalized*
(``merge_attention``: ``out = o / l`` and ``lse = m + log(l)``). A query that has seen
no key yet has ``m = -inf``, ``l = 0``, ``o = 0``; nothing assumes any key is visible,
so a block that masks every key of some query (a window, a key piece) is exact.

Sinks (``AttentionParams.sinks``) are not keys: partials over keys are computed and
merged without them, and ``apply_sinks`` adds each head's sink term once, at the end.
"""

from __future__ import annotations

import math

import numpy as np
from array_api_compat import array_namespace

from ..core import dtypes as _dtypes


_LOWEST = {np.dtype(t).char: np.finfo(t).min for t in (np.float32, np.float64)}
_TINY = {np.dtype(t).char: np.finfo(t).tiny for t in (np.float32, np.float64)}


def _shift(xp, m):
    """The value exponentials are taken relative to: ``m``, or 0 where ``m`` is -inf (no
    key seen: every score is -inf and exp(-inf - 0) = 0, where -inf - -inf would be NaN).
    A NaN max stays NaN, so a NaN score reaches the result."""
    if isinstance(m, np.ndarray):
        # the lowest finite value instead of 0: the same exponentials, one ufunc, no copy
        lowest = _LOWEST.get(m.dtype.char)
        return np.maximum(m, np.finfo(m.dtype).min if lowest is None else lowest)
    return xp.where(m == -math.inf, xp.zeros_like(m), m)


# -- argument checks (merge_attention, apply_sinks): every shape exact, nothing broadcast ---


def _kind(x) -> str:
    """``x``'s type as ``library.Type`` (``numpy.ndarray``, ``torch.Tensor``, ...)."""
    return f"{type(x).__module__.split('.')[0]}.{type(x).__name__}"


def _namespace(args: dict, role: dict):
    """The one array namespace of ``args`` (name -> value, in the order they are named
    in errors); TypeError naming the first argument that is not an array of a supported
    library, or of another library than the first. ``role``: name -> what it holds."""
    xp = first = None
    for name, x in args.items():
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be an array {role[name]}, got {type(x).__name__} {x!r:.80}")
        try:
            x_xp = array_namespace(x)
        except TypeError as exc:
            raise TypeError(f"{name} is a {_kind(x)}, not an array of a supported library ({exc})") from None
        if xp is None:
            xp, first = x_xp, name
        elif x_xp is not xp:
            raise TypeError(f"{name} is a {_kind(x)}, but {first} is a {_kind(args[first])}: "
                            "every argument must be an array of one library")
    return xp


def _float_dtype(x, name: str) -> str:
    """The canonical name of ``x``'s floating dtype; TypeError naming ``name`` otherwise."""
    try:
        return _dtypes.canonical_name(x.dtype)
    except TypeError:
        raise TypeError(f"{name} has dtype {x.dtype}; it must be a floating dtype "
                        f"({', '.join(_dtypes.ITEMSIZE)})") from None


def _dims(shape) -> list:
    return [int(s) for s in shape]


def _same_shape(x, name: str, want, want_what: str) -> None:
    """ValueError naming ``name``, its shape, the shape ``want`` (``want_what`` says why)
    and the first dim that differs, unless ``x.shape == want`` exactly."""
    got, want = _dims(x.shape), _dims(want)
    if got == want:
        return
    if len(got) != len(want):
        where = f"{len(got)} dims, not {len(want)}"
    else:
        i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        where = f"dim {i} is {got[i]}, not {want[i]}"
    raise ValueError(f"{name} has shape {got}, but {want_what} of shape {want} ({where}; "
                     "nothing is broadcast)")


# NumPy temporaries are updated in place (the CPU hot path); other libraries' arrays are
# not, so that autograd (torch) can differentiate through the state.


class SoftmaxState:
    """The online-softmax state of a set of queries over the key blocks seen so far.

    ``m``, ``l``: ``[..., q, 1]``; ``o``: ``[..., q, d]``, in the compute dtype; all None
    before the first block. ``add`` folds in one block; ``merge`` combines states of
    the same queries over disjoint keys; ``result`` normalizes.
    """

    __slots__ = ("xp", "m", "l", "o")

    def __init__(self, xp, m=None, l=None, o=None):
        self.xp, self.m, self.l, self.o = xp, m, l, o

    def add(self, s, v) -> None:
        """Fold in one key block: ``s`` ``[..., q, k]`` scores (masked keys -inf; consumed:
        its memory may be reused), ``v`` ``[..., k, d]`` the block's values (compute dtype)."""
        xp = self.xp
        if isinstance(s, np.ndarray):  # NumPy: array methods and in-place ufuncs (hot path)
            s_max = s.max(axis=-1, keepdims=True)
            m_new = s_max if self.m is None else np.maximum(self.m, s_max)
            shift = _shift(xp, m_new)
            s -= shift
            p = np.exp(s, out=s)
            l_blk = p.sum(axis=-1, keepdims=True)
        else:
            s_max = xp.max(s, axis=-1, keepdims=True)
            m_new = s_max if self.m is None else xp.maximum(self.m, s_max)
            shift = _shift(xp, m_new)
            p = xp.exp(s - shift)
            l_blk = xp.sum(p, axis=-1, keepdims=True)
        o_blk = p @ v
        if self.m is None:
            self.l, self.o = l_blk, o_blk
        else:
            # exp(m - shift) is 0 where the old state saw no key (m = -inf), at most 1 otherwise
            alpha = xp.exp(self.m - shift)
            if isinstance(self.o, np.ndarray):
                self.l *= alpha
                self.l += l_blk
                self.o *= alpha
                self.o += o_blk
            else:
                self.l = alpha * self.l + l_blk
                self.o = alpha * self.o + o_blk
        self.m = m_new

    @classmethod
    def merge(cls, xp, states) -> "SoftmaxState":
        """One state over the union of the keys of ``states`` (same queries, disjoint keys)."""
        m = states[0].m
        for st in states[1:]:
            m = xp.maximum(m, st.m)
        shift = _shift(xp, m)
        l = o = None
        for st in states:
            w = xp.exp(st.m - shift)  # 0 for a state that saw no key of a query
            if o is None:
                l, o = w * st.l, w * st.o
            else:
                l = l + w * st.l
                o = o + w * st.o
        return cls(xp, m, l, o)

    def result(self):
        """``(out, lse)``: ``out = o / l`` ``[..., q, d]`` (in place: the state is spent) and
        ``lse = m + log(l)`` ``[..., q, 1]``; a query that saw no key gives out 0 and lse -inf."""
        xp = self.xp
        l, out = self.l, self.o
        if isinstance(out, np.ndarray):
            # A query that saw a key has l >= 1 (its max term is exp(0)); one that saw none
            # has l = 0, o = 0, m = -inf: the smallest positive l gives it out 0, lse -inf.
            tiny = _TINY.get(l.dtype.char)
            l = np.maximum(l, np.finfo(l.dtype).tiny if tiny is None else tiny)
            out /= l
            return out, self.m + np.log(l)
        unseen = l == 0  # (a NaN sum is "seen": its NaN reaches out and lse)
        l = xp.where(unseen, xp.ones_like(l), l)
        return out / l, xp.where(unseen, xp.full_like(l, -math.inf), self.m + xp.log(l))


def _check_merge_args(out_a, lse_a, out_b, lse_b):
    """merge_attention's argument checks (see its docstring); returns their namespace."""
    part = "(the partial attention [..., d] of part {})"
    lse = "(the log-sum-exp [...] of part {}'s scores, one per query of out_{})"
    args = {"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b}
    xp = _namespace(args, {"out_a": part.format("a"), "out_b": part.format("b"),
                      "lse_a": lse.format("a", "a"), "lse_b": lse.format("b", "b")})
    for name, x in args.items():
        _float_dtype(x, name)
    if lse_a.dtype != lse_b.dtype:
        raise TypeError(f"lse_b has dtype {_float_dtype(lse_b, 'lse_b')} but lse_a has "
                        f"{_float_dtype(lse_a, 'lse_a')}; the parts' lse must share one dtype "
                        "(the merged lse's)")
    if len(out_a.shape) < 1:
        raise ValueError(f"out_a must be [..., d] (at least one dim), got shape {_dims(out_a.shape)}")
    _same_shape(out_b, "out_b", out_a.shape, f"out_a {_dims(out_a.shape)} needs out_b")
    queries = tuple(out_a.shape)[:-1]
    _same_shape(lse_a, "lse_a", queries, f"out_a {_dims(out_a.shape)} needs lse_a")
    _same_shape(lse_b, "lse_b", queries, f"out_b {_dims(out_b.shape)} needs lse_b")
    return xp


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Combine two partial attentions of the same queries over disjoint keys.

    Args:
        out_a, out_b: ``[..., d]`` partial outputs (each softmax-normalized over its keys).
        lse_a, lse_b: ``[...]`` natural-log log-sum-exp of each part's scaled scores;
            ``-inf`` where a part saw no key (that part then contributes nothing, even if
            its output holds NaN).

    Returns ``(out, lse)``: the attention over the union of the keys, in ``out_a``'s
    dtype, and its log-sum-exp. Queries no part saw give out = 0 and lse = -inf.

    Non-finite partials are never hidden: a NaN in the lse of a part, or in the output
    of a part that saw keys, gives NaN in the merged output (a NaN lse: the whole query's
    output and lse; a NaN output element: that element). An lse of ``+inf`` is not a
    result any softmax produces (its scores overflowed), so it is treated as NaN: that
    query's merged output and lse are NaN. Nothing is raised for values, so no device sync
    is needed; arguments are checked (TypeError/ValueError naming the argument): all four
    arrays of one library, floating dtypes, ``lse_a`` and ``lse_b`` of one dtype, and the
    shapes exactly ``out_b == out_a`` (``[..., d]``, at least one dim) and
    ``lse_a == lse_b == out_a.shape[:-1]``: nothing is broadcast (an ``out`` laid out
    ``[B, T, Hq, d]`` against an lse ``[B, Hq, T]``, or an lse of batch 1, is refused).
    """
    xp = _check_merge_args(out_a, lse_a, out_b, lse_b)
    acc = lse_a.dtype
    dev = getattr(lse_a, "device", None)
    inf = xp.asarray(math.inf, dtype=acc, device=dev)
    nan = xp.asarray(math.nan, dtype=acc, device=dev)
    zero = xp.zeros((), dtype=acc, device=dev)
    # NaN or +inf in either lse: the query's result is NaN. Those lse are replaced by 0
    # for the arithmetic below (no inf - inf warnings) and the result overwritten at the end.
    bad = ~((lse_a < inf) & (lse_b < inf))
    lse_a = xp.where(bad, zero, lse_a)
    lse_b = xp.where(bad, zero, lse_b)
    # A part saw keys unless its lse is -inf; only such a part contributes.
    seen_a = lse_a > -inf
    seen_b = lse_b > -inf
    seen = seen_a | seen_b
    lse = xp.maximum(lse_a, lse_b)
    base = xp.where(seen, lse, zero)  # fully unseen queries: -inf - -inf would be NaN
    w_a = xp.where(seen_a, xp.exp(lse_a - base), zero)
    w_b = xp.where(seen_b, xp.exp(lse_b - base), zero)
    total = xp.where(seen, w_a + w_b, xp.ones_like(base))  # >= 1 where seen (max weight is 1)
    # An unseen part is masked out (its output may hold NaN); a seen part is multiplied
    # even when its weight underflowed to 0, so a NaN in its output still shows.
    part_a = xp.where(seen_a[..., None], xp.astype(out_a, acc) * (w_a / total)[..., None], zero)
    part_b = xp.where(seen_b[..., None], xp.astype(out_b, acc) * (w_b / total)[..., None], zero)
    out = xp.where(bad[..., None], nan, part_a + part_b)
    lse_out = xp.where(bad, nan, xp.where(seen, base + xp.log(total), -inf))
    return xp.astype(out, out_a.dtype), lse_out


def _check_sinks_args(out, lse, sinks):
    """apply_sinks's argument checks (see its docstring); returns their namespace."""
    xp = _namespace({"lse": lse, "out": out, "sinks": sinks},
               {"out": "(the attention [..., Hq, T, d] normalized over the keys)",
                "lse": "(the log-sum-exp [..., Hq, T] of the keys' scores)",
                "sinks": "of lse's library ([Hq] sink logits, one per query head)"})
    for name, x in (("out", out), ("lse", lse), ("sinks", sinks)):
        _float_dtype(x, name)
    lse_dims = _dims(lse.shape)
    if len(lse_dims) < 2:
        raise ValueError(f"lse must be [..., Hq, T] (at least two dims), got shape {lse_dims}")
    if len(out.shape) < 1:
        raise ValueError(f"out must be [..., Hq, T, d], got shape {_dims(out.shape)}")
    _same_shape(lse, "lse", tuple(out.shape)[:-1], f"out {_dims(out.shape)} needs lse")
    if _dims(sinks.shape) != [lse_dims[-2]]:
        raise ValueError(f"sinks must be [Hq] = [{lse_dims[-2]}] logits (one per query head of "
                         f"lse {lse_dims}), got shape {_dims(sinks.shape)}")
    return xp


def apply_sinks(out, lse, sinks):
    """Add each query head's sink to a finished attention (every key already summed).

    Args:
        out: ``[..., Hq, T, d]`` attention normalized over the keys only.
        lse: ``[..., Hq, T]`` natural-log log-sum-exp of those keys' scores (``-inf``
            where a query saw no key).
        sinks: ``[Hq]`` sink logits, an array of lse's library (-inf: no sink).

    Returns ``(out * 1 / (1 + e^{sink - lse}), logaddexp(lse, sink))`` (out in its own
    dtype, computed in lse's): the softmax with the extra valueless term ``e^{sink}`` in
    its denominator, and the log of that full denominator. A query whose lse is -inf is
    left as it is (out 0, lse -inf): a query that sees no key returns 0 with or without a
    sink. A NaN lse stays NaN and makes the query's out NaN (never hidden); a ``+inf`` sink
    or lse is not a logit any softmax has, so, as in ``merge_attention``, that query's out
    and lse are NaN. Nothing is raised for values (no device sync); a ``sinks`` whose shape
    is not ``[Hq]`` raises a ValueError.

    In the unnormalized form of ``SoftmaxState`` (``m``, ``l``, ``o``) the same step is
    ``l += e^{sink - m}``; apply it once per query, never per key block or split.

    Arguments are checked (TypeError/ValueError naming the argument): all three arrays of
    one library (a list of sinks is refused: ``xp.asarray`` it), floating dtypes, ``lse``
    ``[..., Hq, T]`` (at least two dims) with ``out.shape == (*lse.shape, d)`` exactly.
    """
    xp = _check_sinks_args(out, lse, sinks)
    acc = lse.dtype
    dev = getattr(lse, "device", None)
    neg_inf = xp.asarray(-math.inf, dtype=acc, device=dev)
    zero = xp.zeros((), dtype=acc, device=dev)
    one = xp.ones((), dtype=acc, device=dev)
    sink = xp.astype(sinks, acc)[:, None]  # [Hq, 1] against lse's [..., Hq, T]
    pos_inf = -neg_inf
    bad = (sink == pos_inf) | (lse == pos_inf)  # [..., Hq, T]: NaN out and lse
    nan = xp.asarray(math.nan, dtype=acc, device=dev)
    sink = xp.where(sink == pos_inf, zero, sink)
    lse = xp.where(lse == pos_inf, zero, lse)
    unseen = lse == neg_inf
    base = xp.where(unseen, zero, lse)  # no -inf - -inf below
    # e^{sink - lse} overflows to inf for a sink far above the keys: factor 0, lse = sink.
    # A NaN lse (a NaN score) is meant to come out NaN: no warning for it.
    with np.errstate(over="ignore", invalid="ignore"):
        factor = xp.where(unseen, one, one / (one + xp.exp(sink - base)))
        lse_out = xp.where(unseen, lse, xp.logaddexp(base, sink))
    factor = xp.where(bad, nan, factor)
    lse_out = xp.where(bad, nan, lse_out)
    out_acc = xp.astype(out, acc) * factor[..., None]
    return xp.astype(out_acc, out.dtype), lse_out
