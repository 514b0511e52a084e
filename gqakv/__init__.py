"""gqakv: grouped-query attention over a preallocated, in-place KV cache.

    cache = gqakv.KVCache(batch=B, kv_heads=Hkv, max_len=S, head_dim=d)
    cache.append(k_new, v_new, n_new)           # [B, Hkv, T, d] written at lens[b]
    out = gqakv.gqa_attention(q, cache, n_new)  # q, out: [B, Hq, T, d]

Importing gqakv imports no optional backend (CuPy, torch): plugins load on first use.
"""

from .ops.attention import gqa_attention
from .ops.plan import AttentionPlan
from .dispatch.backend import Backend
from .dispatch.request import Request
from .caches.cache import KVCache
from .caches.model_cache import ModelKVCache, Step
from .storage.paged import OutOfPages
from .storage.prefix_index import PrefixIndex
from .caches.paged_cache import PagedKVCache
from .caches.paged_functional import paged_accept, paged_append, paged_append_attention, paged_attention
from .ops.merge import apply_sinks, merge_attention
from .core.semantics import AttentionParams
from .core.tree import DraftTree
from .core.invariance import batch_invariant, set_batch_invariant
from .storage.store import KVStore, StorageSpec
from .dispatch.registry import (
    BackendError,
    describe_backends,
    get_backend,
    list_backends,
    register_backend,
    unregister_backend,
    use_backend,
)

__version__ = "0.1.0"


def plan_attention(cache, n_new, *, q_heads: int, t_q: int | None = None, packed: bool = False,
                   rows=None, scale=None, window=None, softcap=None, sinks=None,
                   alibi_slopes=None, params=None, fixed: bool = False,
                   splits: int | None = None, tree=None) -> AttentionPlan:
    """The plan of ``gqa_attention(q, cache, n_new, rows=rows, ...)`` for queries
    ``[len(n_new), q_heads, t_q, d]`` (``t_q`` default: the largest n_new), or packed
    ``[sum(n_new), q_heads, d]`` with ``packed=True``: validated and planned once, then
    ``plan.run(q, cache, out=..., return_lse=...)`` per call while the rows keep their
    lengths (for example every layer of a model over caches of one batch). See
    ``gqakv.ops.plan``. ``fixed=True`` (CUDA graphs; the cupy backend): planned for the
    capacities, ``plan.update(cache, n_new, rows=...)`` takes each next batch in place;
    ``splits``: its decode split count."""
    return AttentionPlan.of(cache, n_new, q_heads=q_heads, t_q=t_q, packed=packed, rows=rows, scale=scale,
                            params=params, window=window, softcap=softcap, sinks=sinks,
                            alibi_slopes=alibi_slopes, fixed=fixed, splits=splits, tree=tree)


__all__ = [
    "AttentionParams",
    "AttentionPlan",
    "Backend",
    "DraftTree",
    "Request",
    "BackendError",
    "KVCache",
    "KVStore",
    "ModelKVCache",
    "OutOfPages",
    "PagedKVCache",
    "PrefixIndex",
    "Step",
    "StorageSpec",
    "apply_sinks",
    "batch_invariant",
    "describe_backends",
    "get_backend",
    "gqa_attention",
    "list_backends",
    "merge_attention",
    "paged_accept",
    "paged_append",
    "paged_append_attention",
    "paged_attention",
    "plan_attention",
    "register_backend",
    "set_batch_invariant",
    "unregister_backend",
    "use_backend",
]
