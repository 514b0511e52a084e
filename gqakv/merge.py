"""Merging attention results computed over disjoint key sets (split-KV, shared prefixes)."""

from __future__ import annotations

from array_api_compat import array_namespace


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Combine two partial attentions of the same queries over disjoint keys.

    Args:
        out_a, out_b: ``[..., d]`` partial outputs (each softmax-normalized over its keys).
        lse_a, lse_b: ``[...]`` natural-log log-sum-exp of each part's scaled scores;
            ``-inf`` where a part saw no key (that part then contributes nothing).

    Returns ``(out, lse)``: the attention over the union of the keys, in ``out_a``'s
    dtype, and its log-sum-exp. Queries no part saw give out = 0 and lse = -inf.
    """
    xp = array_namespace(out_a, lse_a, out_b, lse_b)
    lse = xp.maximum(lse_a, lse_b)
    # Guard fully-unseen queries: -inf - -inf would be NaN.
    base = xp.where(xp.isinf(lse) & (lse < 0), xp.zeros_like(lse), lse)
    w_a = xp.exp(lse_a - base)
    w_b = xp.exp(lse_b - base)
    total = w_a + w_b
    safe = xp.where(total > 0, total, xp.ones_like(total))
    acc = lse.dtype
    zero = xp.zeros((), dtype=acc)
    # A part that saw no key (weight 0) contributes nothing, even if its output holds NaN.
    part_a = xp.where((w_a > 0)[..., None], xp.astype(out_a, acc) * (w_a / safe)[..., None], zero)
    part_b = xp.where((w_b > 0)[..., None], xp.astype(out_b, acc) * (w_b / safe)[..., None], zero)
    out = part_a + part_b
    lse_out = xp.where(total > 0, base + xp.log(safe), lse)
    return xp.astype(out, out_a.dtype), lse_out
