"""Merging attention results computed over disjoint key sets (split-KV, shared prefixes)."""

from __future__ import annotations

import math

from array_api_compat import array_namespace


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
    query's merged output and lse are NaN. Nothing is raised, so no device sync is needed.
    """
    xp = array_namespace(out_a, lse_a, out_b, lse_b)
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
