"""Rows that share a prefix: one decode step with the prefix's pages read once, against the
same rows holding copies of it.

``shared_prefix_times`` builds two paged caches of ``rows`` rows whose tokens are the same:
an ``prefix``-token prompt, then each row's own ``suffix`` tokens and one decode token.
In the *shared* cache the rows were forked from one row (they name the prompt's pages);
in the *unshared* one every row holds its own copy of the prompt. One layer's decode
attention of each (a step's plan, run; the plan is made once per step) is timed in
alternating blocks (``timing.alternating_blocks``), so the ratio ``shared / unshared``
comes from one run under one load. The shared plan must have formed its group
(``plan.shared_prefix``, ``gqakv.ops.shared_prefix``) and both outputs must agree.
"""

from __future__ import annotations

import time

import numpy as np

from ..caches.paged_cache import PagedKVCache
from ..ops.plan import AttentionPlan


def shared_prefix_times(backend, *, prefix: int = 4096, rows: int = 32, suffix: int = 64,
                        kv_heads: int = 8, group: int = 4, head_dim: int = 128,
                        dtype: str = "float32", page_size: int = 16, kv_dtype=None,
                        rounds: int = 5, block_s: float = 0.2, seed: int = 0) -> dict:
    """Median seconds per decode call over the shared and the unshared cache (see the
    module docstring), their ratio, the plans' decisions and the outputs' difference."""
    from .timing import alternating_blocks

    rng = np.random.default_rng(seed)
    hq, max_len = kv_heads * group, prefix + suffix + 1

    def data(*shape):
        return backend.from_numpy(rng.standard_normal(shape, dtype=np.float32), dtype)

    caches = {name: PagedKVCache(rows, kv_heads, max_len, head_dim, dtype=dtype, backend=backend,
                                 page_size=page_size, kv_dtype=kv_dtype)
              for name in ("shared", "unshared")}
    pk, pv = data(1, kv_heads, prefix, head_dim), data(1, kv_heads, prefix, head_dim)
    caches["shared"].append(pk, pv, [prefix], rows=[0])
    caches["shared"].fork(0, list(range(1, rows)))
    for r in range(rows):
        caches["unshared"].append(pk, pv, [prefix], rows=[r])
    steps = [(data(rows, kv_heads, suffix, head_dim), data(rows, kv_heads, suffix, head_dim), suffix),
             (data(rows, kv_heads, 1, head_dim), data(rows, kv_heads, 1, head_dim), 1)]
    for k, v, n in steps:
        for cache in caches.values():
            cache.append(k, v, [n] * rows)
    q = data(rows, hq, 1, head_dim)
    plans, plan_s = {}, {}
    for name, cache in caches.items():
        t = time.perf_counter()
        plans[name] = AttentionPlan.of(cache, [1] * rows, q_heads=hq)
        plan_s[name] = time.perf_counter() - t
    decision = plans["shared"].shared_prefix
    if not decision.used:
        raise ValueError(f"--shared-prefix {prefix}: the shared cache's plan formed no group "
                         f"({decision.reason}); give a longer prefix")
    outs = {name: np.asarray(backend.to_numpy(plans[name].run(q, caches[name])), np.float64)
            for name in caches}
    fns = {name: (lambda p=plans[name], c=caches[name]: p.run(q, c)) for name in caches}
    times = alternating_blocks(fns, backend, rounds=rounds, block_s=block_s)
    med = {name: t["median_s"] for name, t in times.items()}
    item_tokens = rows * (prefix + suffix + 1)
    return {"prefix": prefix, "rows": rows, "suffix": suffix, "kv_heads": kv_heads,
            "group": group, "head_dim": head_dim, "dtype": dtype, "page_size": page_size,
            "kv_dtype": kv_dtype, "median_s": med, "plan_s": plan_s,
            "shared_over_unshared": med["shared"] / med["unshared"],
            "decision": str(decision), "unshared_decision": str(plans["unshared"].shared_prefix),
            "max_abs_diff": float(np.max(np.abs(outs["shared"] - outs["unshared"]))),
            # 2 (QK and PV) x 2 flops per multiply-add, every query head, every key
            "gflop": 4.0 * hq * head_dim * item_tokens / 1e9}
