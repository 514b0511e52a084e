"""What attention computes, defined once: its parameters and each query's visible keys.

Every implementation (the generic array-API path, the NumPy/numba planner, the CUDA
planner, ``gqakv.ops.reference``) asks this module which keys a query sees instead of
writing the rule again, so an attention variant (a sliding window, a soft-cap,
sinks) is one change here plus the fast paths that declare they implement it
(``gqakv.dispatch.backend.FastPath.features``, class data of each backend).

Positions (bottom-right causal): in a row holding ``L`` tokens after appending ``n``,
query ``t`` (0 <= t < n) sits at absolute position ``p = L - n + t`` and sees the keys
``[lo, hi)`` with ``hi = p + 1`` and ``lo = 0`` (``lo = max(0, p - W + 1)`` with a
sliding window of W). Every function below works on Python
ints and, elementwise, on NumPy int arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AttentionParams:
    """How scores are formed and masked; validated (``gqakv.core.inputs``) before any backend
    sees it. Every field but ``scale`` defaults to "off", so a call that asks for no
    variant is the plain causal attention.

    scale: the softmax scale applied to ``q . k`` (a Python float).
    window: None, or W >= 1: the query at absolute position p sees only the keys
        ``max(0, p - W + 1) .. p`` (the W most recent positions, its own included).
    softcap: None, or c > 0: each scaled score s becomes ``c * tanh(s / c)`` before the
        mask and the softmax (Gemma 2's order).
    sinks: None, or one logit per query head (a tuple of Hq Python floats, float32
        values): an extra softmax term without a value,
        ``out = sum_j e^{s_j} v_j / (e^{sink_h} + sum_j e^{s_j})``. Applied once, after
        every key is summed (``gqakv.ops.merge.apply_sinks``), never per key block or split.
    alibi_slopes: None, or one slope per query head (a tuple of Hq Python floats, as
        given): ALiBi (BLOOM, MPT, Falcon-style checkpoints). Query head h at position p
        adds ``alibi_slopes[h] * (j - p)`` to its score of key j, after the soft-cap and before
        the mask and the softmax (``transform``); a sink's logit gets no bias.
    """

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: tuple[float, ...] | None = None
    alibi_slopes: tuple[float, ...] | None = None

    @property
    def features(self) -> frozenset[str]:
        """The variant features this call uses (empty: plain causal), checked against
        what each fast path declares it implements (``gqakv.dispatch.backend.FastPath``)."""
        return frozenset(name for name, on in (("window", self.window is not None),
                                               ("softcap", self.softcap is not None),
                                               ("sinks", self.sinks is not None),
                                               ("alibi", self.alibi_slopes is not None)) if on)

    @property
    def variant(self) -> str:
        """A readable name of the variant: ``"causal"`` or e.g. ``"causal+softcap+window"``."""
        return "+".join(("causal", *sorted(self.features)))


def key_range(params: AttentionParams, L, n, t, tree=None):
    """``(lo, hi)``: query ``t`` sees the keys ``lo <= j < hi`` (``0 <= lo``, ``hi <= L``;
    ``lo < hi`` for every real query). With a ``tree`` (an ``EntryTree``) the range bounds
    what t sees: the window's first key by t's logical position, up to t's own slot."""
    if tree is not None:
        P = L - n
        depth = int(tree.depth[t]) if isinstance(t, int) else tree.depth[np.asarray(t)]
        lo, _ = key_range(params, L, n, depth)  # t's logical position is P + depth
        return lo, P + t + 1
    p = L - n + t  # query t's absolute position: it sees keys up to p
    if params.window is None:
        return 0, p + 1
    lo = p - (params.window - 1)
    if isinstance(lo, int):
        return max(0, lo), p + 1
    if isinstance(lo, (np.ndarray, np.generic)):
        return np.maximum(lo, 0), p + 1
    from array_api_compat import array_namespace  # another library's array (visible_mask's xp)

    xp = array_namespace(lo)
    return xp.where(lo > 0, lo, xp.zeros_like(lo)), p + 1


def block_keys(params: AttentionParams, L, n, t0: int, t1: int, tree=None):
    """``(lo, hi)``: the keys at least one query of ``t0..t1-1`` sees (a block's key span;
    keys outside it are never read)."""
    if tree is not None:  # the shallowest query's window starts first
        if params.window is None:  # every query's keys start at 0 (no arrays: planners ask often)
            return 0, L - n + t1
        return int(np.min(key_range(params, L, n, np.arange(t0, t1), tree)[0])), L - n + t1
    return key_range(params, L, n, t0)[0], key_range(params, L, n, t1 - 1)[1]


def common_keys(params: AttentionParams, L, n, t0: int, t1: int, tree=None):
    """``(lo, hi)``: the keys every query of ``t0..t1-1`` sees (``lo >= hi``: none). A key
    piece cut inside it is masked for no query of the block. With a tree: prefix keys only
    (two roots do not see each other)."""
    if tree is not None:
        if params.window is None:
            return 0, L - n
        return int(np.max(key_range(params, L, n, np.arange(t0, t1), tree)[0])), L - n
    return key_range(params, L, n, t1 - 1)[0], key_range(params, L, n, t0)[1]


def keys_read(params: AttentionParams, lens, n_new):
    """Keys an entry's queries read together (the span from its first query's first key
    to its last query's last key; 0 for an entry without queries): what a planner sizes
    key splits by. ``lens``, ``n_new``: [B]."""
    lo = key_range(params, lens, n_new, 0 * n_new)[0]
    hi = key_range(params, lens, n_new, n_new - 1)[1]
    return (hi - lo) * (n_new > 0)


def transform_scores(params: AttentionParams, s, xp):
    """The score modifier: ``s`` (the scaled scores ``scale * q . k``, any shape) as the
    softmax takes them, before the mask. Identity unless ``params.softcap``."""
    if params.softcap is None:
        return s
    c = params.softcap
    return xp.tanh(s * (1.0 / c)) * c


def allowed(params: AttentionParams, q_pos, k_pos, head=None):
    """The mask hook: whether the query at absolute position ``q_pos`` (of query head
    ``head``: every head alike today) may see the key at ``k_pos`` (Python ints or,
    elementwise, NumPy int arrays). The same rule as ``key_range``, per pair; a draft
    tree's clause (which is no key range) is ``tree_visible``."""
    lo = 0 if params.window is None else q_pos - (params.window - 1)
    return (k_pos >= lo) & (k_pos <= q_pos)


def alibi_slopes(params: AttentionParams, head, xp, dtype=None, device=None):
    """ALiBi's slope of query head(s) ``head`` (an int, or an int array of ``xp``)."""
    given = params.alibi_slopes
    if given is None:
        raise ValueError("alibi_slopes: this call has no ALiBi")
    if isinstance(head, int):
        return given[head]
    slopes = xp.asarray(given, dtype=dtype, device=device)
    return xp.reshape(xp.take(slopes, xp.reshape(head, (-1,)), axis=0), head.shape)


def transform(params: AttentionParams, s, q_pos, k_pos, head, xp):
    """The score hook: the scaled scores ``s`` (``scale * q . k``) of query head(s)
    ``head`` at absolute position(s) ``q_pos`` against key position(s) ``k_pos``, as the
    softmax takes them (before the mask): the soft-cap, then ALiBi's
    ``alibi_slopes[head] * (k_pos - q_pos)``. Broadcasts like arithmetic (``s`` of ``xp``, the
    positions and heads Python ints or int arrays of ``xp`` shaped to broadcast with it)."""
    s = transform_scores(params, s, xp)
    if params.alibi_slopes is None:
        return s
    if isinstance(s, float):
        return s + alibi_slopes(params, head, xp) * (k_pos - q_pos)
    dev = getattr(s, "device", None)
    slope = alibi_slopes(params, head, xp, dtype=s.dtype, device=dev)
    dist = k_pos - q_pos
    if not isinstance(dist, int):
        dist = xp.astype(dist, s.dtype)
    return s + slope * dist


def query_positions(L: int, n: int, t0: int, t1: int, tree=None) -> np.ndarray:
    """``[t1 - t0]`` int64: the positions of queries t0..t1-1 that windows and ALiBi measure
    (``L - n + t``; with a tree the logical ``L - n + depth[t]``)."""
    if tree is None:
        return np.arange(L - n + t0, L - n + t1, dtype=np.int64)
    return (L - n) + tree.depth[t0:t1]


def key_positions(L: int, n: int, j0: int, j1: int, tree=None) -> np.ndarray:
    """``[j1 - j0]`` int64: the positions of keys j0..j1-1 (< L) that windows and ALiBi
    measure (j; with a tree a chunk key u = j - (L - n) stands at ``L - n + depth[u]``)."""
    j = np.arange(j0, j1, dtype=np.int64)
    if tree is None or n == 0:
        return j
    P = L - n
    return np.where(j < P, j, P + tree.depth[np.clip(j - P, 0, n - 1)])


def tree_visible(params: AttentionParams, L: int, n: int, t0: int, t1: int, j0: int, j1: int,
                 tree) -> np.ndarray:
    """``[t1 - t0, j1 - j0]`` bools (keys < L): the mask hook's tree clause. Query t sees
    a prefix key (``j < P = L - n``) and the chunk keys ``P + u`` with ``ancestors[t, u]``;
    a window keeps the keys whose logical position is within W of t's."""
    P = L - n
    a = min(max(j0, P), j1)  # the block's first chunk key (j1: none)
    # slices, not a gather: each item's masked block runs this
    vis = np.empty((t1 - t0, j1 - j0), dtype=bool)
    vis[:, :a - j0] = True
    vis[:, a - j0:] = tree.ancestors[t0:t1, a - P:j1 - P]
    if params.window is not None:
        q_pos = query_positions(L, n, t0, t1, tree)[:, None]
        vis &= key_positions(L, n, j0, j1, tree)[None, :] >= q_pos - (params.window - 1)
    return vis


def visible_mask(params: AttentionParams, L: int, n: int, t0: int, t1: int, j0: int, j1: int,
                 xp=None, device=None, tree=None):
    """None when every query of ``t0..t1-1`` sees every key of ``j0..j1-1``, else the bool
    mask ``[t1 - t0, j1 - j0]`` (True: visible), built with ``xp`` (default NumPy).
    ``tree``: an entry's draft tree (``tree_visible``)."""
    if tree is not None:
        if j1 <= L - n and params.window is None:  # prefix keys only: each query sees them all
            return None
        vis = tree_visible(params, L, n, t0, t1, j0, j1, tree)
        if vis.all():
            return None
        if xp is None or xp is np:
            return vis
        return xp.asarray(vis) if device is None else xp.asarray(vis, device=device)
    lo, hi = common_keys(params, L, n, t0, t1)
    if lo <= j0 and j1 <= hi:
        return None
    if xp is None:
        import numpy as xp
    if device is None:
        key = xp.arange(j0, j1)[None, :]
        query = xp.arange(t0, t1)[:, None]
    else:
        key = xp.arange(j0, j1, device=device)[None, :]
        query = xp.arange(t0, t1, device=device)[:, None]
    q_lo, q_hi = key_range(params, L, n, query)
    if isinstance(q_lo, int) and q_lo <= j0:  # no query's range starts inside the block
        return key < q_hi
    return (key >= q_lo) & (key < q_hi)
