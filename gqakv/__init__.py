"""gqakv: grouped-query attention over a preallocated, in-place KV cache.

    cache = gqakv.KVCache(batch=B, kv_heads=Hkv, max_len=S, head_dim=d)
    cache.append(k_new, v_new, n_new)           # [B, Hkv, T, d] written at lens[b]
    out = gqakv.gqa_attention(q, cache, n_new)  # q, out: [B, Hq, T, d]

Importing gqakv imports no optional backend (CuPy, torch): plugins load on first use.
"""

from .ops.attention import gqa_attention
from .dispatch.backend import Backend
from .caches.cache import KVCache
from .caches.model_cache import ModelKVCache, Step
from .storage.paged import OutOfPages
from .caches.paged_cache import PagedKVCache
from .caches.paged_functional import paged_append, paged_attention
from .ops.merge import apply_sinks, merge_attention
from .core.semantics import AttentionParams
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

__all__ = [
    "AttentionParams",
    "Backend",
    "BackendError",
    "KVCache",
    "KVStore",
    "ModelKVCache",
    "OutOfPages",
    "PagedKVCache",
    "Step",
    "StorageSpec",
    "apply_sinks",
    "describe_backends",
    "get_backend",
    "gqa_attention",
    "list_backends",
    "merge_attention",
    "paged_append",
    "paged_attention",
    "register_backend",
    "unregister_backend",
    "use_backend",
]
