"""A mixed batch: one row prefilling a chunk while the others decode one token each.

Engines batch prefill chunks and decode tokens together (continuous batching, chunked
prefill). ``mixed_batch_times`` times the attention of such a batch three ways, in
alternating blocks (``timing.alternating_blocks``) over one cache whose rows already hold
their tokens:

- ``packed``: one call with the step's queries packed end to end, ``q [N, Hq, d]``
  (``N = chunk + decoders``): no padded query slot is allocated or computed;
- ``padded``: one call with ``q [B, Hq, chunk, d]`` (every decode row padded to the chunk);
- ``separate``: the prefill row's call and the decode rows' call, one after the other
  (the yardstick: what the two kinds of work cost apart).

It reports each one's median seconds, ``packed / separate`` and ``padded / separate``,
and the bytes of the query buffers each layout needs.
"""

from __future__ import annotations

import numpy as np

from ..caches.cache import KVCache
from ..core import dtypes as _dtypes
from ..ops.attention import gqa_attention


def mixed_batch_times(backend, *, decoders: int = 31, chunk: int = 512, row_len: int = 2048,
                      kv_heads: int = 8, group: int = 4, head_dim: int = 64,
                      dtype: str = "float32", rounds: int = 5, block_s: float = 0.2) -> dict:
    """Median seconds per call of the packed, padded and separate forms of a batch of one
    row attending a ``chunk``-token prefill chunk and ``decoders`` rows one decode token
    each, every row holding ``row_len`` tokens after the step (see the module docstring)."""
    from .timing import alternating_blocks

    B, hq = decoders + 1, kv_heads * group
    cache = KVCache(B, kv_heads, row_len, head_dim, dtype=dtype, backend=backend)
    rng = np.random.default_rng(0)
    kv = backend.from_numpy(rng.standard_normal((B, kv_heads, row_len, head_dim)), dtype)
    cache.append(kv, kv, [row_len] * B)
    n_new = np.array([chunk] + [1] * decoders)
    packed_q = backend.from_numpy(rng.standard_normal((chunk + decoders, hq, head_dim)), dtype)
    padded_q = backend.from_numpy(rng.standard_normal((B, hq, chunk, head_dim)), dtype)
    prefill_q = backend.from_numpy(rng.standard_normal((1, hq, chunk, head_dim)), dtype)
    decode_q = backend.from_numpy(rng.standard_normal((decoders, hq, 1, head_dim)), dtype)
    decode_rows = list(range(1, B))

    def separate():
        gqa_attention(prefill_q, cache, [chunk], rows=[0])
        gqa_attention(decode_q, cache, [1] * decoders, rows=decode_rows)

    fns = {"packed": lambda: gqa_attention(packed_q, cache, n_new),
           "padded": lambda: gqa_attention(padded_q, cache, n_new),
           "separate": separate}
    times = alternating_blocks(fns, backend, rounds=rounds, block_s=block_s)
    item = _dtypes.ITEMSIZE[_dtypes.canonical_name(dtype)]
    med = {name: t["median_s"] for name, t in times.items()}
    return {"decoders": decoders, "chunk": chunk, "row_len": row_len, "kv_heads": kv_heads,
            "group": group, "head_dim": head_dim, "dtype": dtype, "median_s": med,
            "packed_over_separate": med["packed"] / med["separate"],
            "padded_over_separate": med["padded"] / med["separate"],
            "query_bytes": {"packed": (chunk + decoders) * hq * head_dim * item,
                            "padded": B * hq * chunk * head_dim * item}}
