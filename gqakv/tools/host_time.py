"""Host time of a model step: what a step costs besides its kernels.

A decode step runs every layer's append and attention; on a small batch the kernels run
for microseconds and the host work around them (validation, planning, dispatch,
allocation) can set the pace. ``step_host_time`` times a ``ModelKVCache`` decode step of
``layers`` layers twice in alternating rounds: as it is, and with the backend's kernels
replaced by no-ops (``Backend.kernel_entries``: the functions that do the arithmetic and
move the bytes), so the second time is the host's alone. Backends that declare no kernel
entries get only the first (their work is all array-library calls).

In a model the layers' matmuls run between attention calls and stream their weights
through the CPU's caches, so the host code runs cold: SmolLM2-135M's decode measured its
attention host work at 101-139 us per layer in place, against 29-32 us in this loop with
the same shapes (``gqakv_examples.real_bench``; the real-model guide). ``evict_bytes``
reproduces that: the loop reads a buffer that large before every layer (untimed).
"""

from __future__ import annotations

import contextlib
import importlib
import time

import numpy as np

from ..caches.model_cache import ModelKVCache

#: What ``gqakv bench --host-time`` and asv read before each layer for the cold figure:
#: more than this machine's L2 (2 MiB per core), and a model layer's weights (SmolLM2-135M:
#: 14 MiB in float32; Llama-3.1-8B: 416 MiB in bfloat16) pass through the caches anyway.
HOST_EVICT_BYTES = 32 << 20


@contextlib.contextmanager
def kernels_wrapped(backend, wrap):
    """Every ``backend.kernel_entries()`` function replaced by ``wrap(function)`` (a timer,
    a no-op), and put back on exit."""
    saved = []
    try:
        for module_name, name in backend.kernel_entries():
            module = importlib.import_module(module_name)
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, wrap(getattr(module, name)))
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def kernels_as_no_ops(backend):
    """Every ``backend.kernel_entries()`` function replaced by one that returns None."""
    return kernels_wrapped(backend, lambda fn: lambda *args, **kwargs: None)


def step_host_time(backend, *, layers: int = 32, batch: int = 8, kv_heads: int = 8,
                   group: int = 4, head_dim: int = 64, live: int = 16, dtype: str = "float32",
                   rounds: int = 7, steps_per_round: int = 3, evict_bytes: int = 0,
                   page_size: int | None = None, kv_dtype: str | None = None) -> dict:
    """Median seconds of one decode step (``step_s``), of the same step with the kernels
    no-op'd (``host_s``, None when the backend declares no kernel entries), and the host
    time per layer (``host_per_layer_us``), over rows holding ``live`` tokens.
    ``evict_bytes``: read a buffer of this many bytes before every layer (not timed), so
    that each layer's host work starts with the caches as a model's matmuls leave them.
    ``page_size``: the cache in pages of this many tokens (None: contiguous rows);
    ``kv_dtype``: its codec (None: values stored as ``dtype``)."""
    cache = ModelKVCache(layers, batch, kv_heads, live + rounds * steps_per_round * 2 + 8,
                         head_dim, dtype=dtype, backend=backend, page_size=page_size,
                         kv_dtype=kv_dtype)
    rng = np.random.default_rng(0)
    x = backend.from_numpy(rng.standard_normal((batch, kv_heads, live, head_dim)), dtype)
    with cache.step([live] * batch) as step:
        for l in range(layers):
            step.write(l, x, x)
    q = backend.from_numpy(rng.standard_normal((batch, kv_heads * group, 1, head_dim)), dtype)
    k = backend.from_numpy(rng.standard_normal((batch, kv_heads, 1, head_dim)), dtype)
    ones = [1] * batch
    sweep = np.ones(max(0, int(evict_bytes)) // 8) if evict_bytes else None

    def one_step() -> float:
        """Seconds of one step (open, every layer's attend, commit), without the sweeps."""
        t0 = time.perf_counter()
        with cache.step(ones) as s:
            spent = time.perf_counter() - t0
            for l in range(layers):
                if sweep is not None:
                    sweep.sum()  # the caches cold, as a layer's matmuls leave them
                t0 = time.perf_counter()
                s.attend(l, q, k, k)
                spent += time.perf_counter() - t0
            t0 = time.perf_counter()
        backend.synchronize()
        return spent + time.perf_counter() - t0

    def timed():
        return sum(one_step() for _ in range(steps_per_round)) / steps_per_round

    def trimmed():  # keep the rows at about ``live`` tokens: every step appends one
        cache.truncate(list(range(batch)), [live] * batch)

    one_step()  # compile / warm
    has_kernels = bool(backend.kernel_entries())
    full, host = [], []
    for _ in range(rounds):  # alternating rounds: the machine's drift hits both alike
        trimmed()
        full.append(timed())
        if has_kernels:
            trimmed()
            with kernels_as_no_ops(backend):
                host.append(timed())
    step_s = float(np.median(full))
    host_s = float(np.median(host)) if host else None
    return {"layers": layers, "batch": batch, "kv_heads": kv_heads, "group": group,
            "head_dim": head_dim, "live": live, "dtype": dtype, "evict_bytes": int(evict_bytes),
            "page_size": None if page_size is None else int(page_size), "kv_dtype": kv_dtype,
            "step_s": step_s, "host_s": host_s,
            "host_per_layer_us": None if host_s is None else host_s / layers * 1e6,
            "kernel_share": None if host_s is None else max(0.0, 1 - host_s / step_s)}
