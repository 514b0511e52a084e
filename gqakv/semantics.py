"""What attention computes, defined once: its parameters and each query's visible keys.

Every implementation (the generic array-API path, the NumPy/numba planner, the CUDA
planner, ``gqakv.reference``) asks this module which keys a query sees instead of
writing the rule again, so an attention variant (a sliding window, a soft-cap,
sinks) is one change here plus the fast paths that declare they implement it.

Positions (bottom-right causal): in a row holding ``L`` tokens after appending ``n``,
query ``t`` (0 <= t < n) sits at absolute position ``p = L - n + t`` and sees the keys
``[lo, hi)`` with ``lo = 0`` and ``hi = p + 1``. Every function below works on Python
ints and, elementwise, on NumPy int arrays.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionParams:
    """How scores are formed and masked; validated (``gqakv.inputs``) before any backend
    sees it.

    scale: the softmax scale applied to ``q . k`` (a Python float).
    Later fields (window, softcap, sinks) default to "off", so a call that does not ask
    for them is the plain causal attention every fast path implements.
    """

    scale: float

    #: Name of the variant, checked against what each fast path implements
    #: (``FAST_PATH_VARIANTS``); the generic path implements every variant.
    @property
    def variant(self) -> str:
        return "causal"


#: Which variants each fast path implements (the planner's table): a call whose
#: ``params.variant`` is not listed for a fast path takes the generic array-API path
#: (a backend's route says so). A new variant adds its name to the fast paths that
#: implement it, nowhere else.
FAST_PATH_VARIANTS: dict[str, frozenset[str]] = {
    "numpy BLAS": frozenset({"causal"}),
    "numba kernel": frozenset({"causal"}),
    "cupy kernels": frozenset({"causal"}),
}


def key_range(params: AttentionParams, L, n, t):
    """``(lo, hi)``: query ``t`` sees the keys ``lo <= j < hi`` (``hi <= L``)."""
    return 0, L - n + t + 1  # query t sits at p = L - n + t and sees keys 0..p


def block_keys(params: AttentionParams, L, n, t0: int, t1: int):
    """``(lo, hi)``: the keys at least one query of ``t0..t1-1`` sees (a block's key span;
    keys outside it are never read)."""
    return key_range(params, L, n, t0)[0], key_range(params, L, n, t1 - 1)[1]


def common_keys(params: AttentionParams, L, n, t0: int, t1: int):
    """``(lo, hi)``: the keys every query of ``t0..t1-1`` sees (``lo >= hi``: none). A key
    piece cut inside it is masked for no query of the block."""
    return key_range(params, L, n, t1 - 1)[0], key_range(params, L, n, t0)[1]


def keys_read(params: AttentionParams, lens, n_new):
    """Keys an entry's queries read at most (the span of its last query; 0 for an entry
    without queries): what a planner sizes key splits by. ``lens``, ``n_new``: [B]."""
    hi = key_range(params, lens, n_new, n_new - 1)[1]
    return hi * (n_new > 0)


def visible_mask(params: AttentionParams, L: int, n: int, t0: int, t1: int, j0: int, j1: int,
                 xp=None, device=None):
    """None when every query of ``t0..t1-1`` sees every key of ``j0..j1-1``, else the bool
    mask ``[t1 - t0, j1 - j0]`` (True: visible), built with ``xp`` (default NumPy)."""
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
