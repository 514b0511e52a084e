"""Host time of the cupy backend's glue per layer, on the emulated backend with launches
no-op'd (what is left is Python: routing, planning, uploads, allocations, checks).

    python -m tests.cuda_emu.glue_time [--layers 32] [--batch 8] [--kv-heads 8] [--group 4]
                                       [--head-dim 64] [--steps 30] [--storage contiguous]
                                       [--wall] [--unpoisoned]

A decode step of ``layers`` layers (``Step.attend`` per layer: its append and its
attention), ``steps`` times (each step one token longer, so every step's first layer
plans anew); prints the median per-layer time of ``Step.attend``, with and without
caller's ``out`` / ``lse_out``, and of a fixed step (a fixed plan adopted at the step's
start, its append and attention over the plan's buffers; the ``adopt`` itself is timed
per step beside it). Not a GPU measurement: the stand-in cupy's allocations are NumPy's
(``empty`` fills NaN), the launches do nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import gqakv

from .emulated_backend import EmulatedCupyBackend, _on_device


#: The clock: this thread's CPU time (other processes on a loaded machine count less
#: than in wall time); ``--wall`` takes time.perf_counter.
CLOCK = time.thread_time


def step_times(backend, cache, layers, q, k, out, lse_out, steps, fixed=None):
    """Median seconds per layer of ``Step.attend``, and of the backend's ``attention``
    inside it (the write into out / lse_out included), over ``steps`` decode steps.
    ``fixed``: a fixed plan each step adopts (then also the median seconds of ``adopt``)."""
    inner = [0.0]
    attention = type(backend).attention

    def timed(*args, **kwargs):
        t0 = CLOCK()
        try:
            return attention(backend, *args, **kwargs)
        finally:
            inner[0] += CLOCK() - t0

    backend.attention = timed
    per, per_inner, adopt = [], [], []
    try:
        for _ in range(steps):
            with cache.step([1] * cache.batch) as step:
                if fixed is not None:
                    t0 = CLOCK()
                    step.adopt(fixed)
                    adopt.append(CLOCK() - t0)
                inner[0] = 0.0
                t0 = CLOCK()
                for l in range(layers):
                    step.attend(l, q, k, k, out=out, lse_out=lse_out,
                                return_lse=lse_out is not None, plan=fixed)
                per.append((CLOCK() - t0) / layers)
                per_inner.append(inner[0] / layers)
    finally:
        del backend.attention
    return (statistics.median(per), statistics.median(per_inner),
            statistics.median(adopt) if adopt else 0.0)


def unpoisoned_empty(shape, dtype=float):
    """The emulator's ``cupy.empty`` without its NaN fill (``--unpoisoned``)."""
    return _on_device(np.empty(shape, dtype=dtype))


def replay_times(cache, fixed, steps):
    """Median seconds of a whole replayed step on the host: the step's open, ``adopt``,
    ``Step.replay`` of a no-op (a CUDA graph's launch, not timed here) and the commit."""
    per = []
    for _ in range(steps):
        t0 = CLOCK()
        with cache.step([1] * cache.batch) as step:
            step.adopt(fixed)
            step.replay(lambda: None)
        per.append(CLOCK() - t0)
    return statistics.median(per)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--storage", default="contiguous", choices=("contiguous", "paged"))
    ap.add_argument("--wall", action="store_true", help="wall time (default: thread CPU time)")
    ap.add_argument("--unpoisoned", action="store_true",
                    help="allocations not filled with NaN (the tests' emulator fills them, so "
                         "that a read before a write shows; CuPy's pool fills nothing)")
    a = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.perf_counter if a.wall else time.thread_time
    backend = EmulatedCupyBackend()
    if a.unpoisoned:
        backend.runtime.cp.empty = unpoisoned_empty
    backend._run_plan = lambda *args: None  # launches no-op'd: host time only
    kw = dict(page_size=16) if a.storage == "paged" else {}
    cache = gqakv.ModelKVCache(a.layers, a.batch, a.kv_heads, a.max_len, a.head_dim,
                               backend=backend, **kw)
    rng = np.random.default_rng(0)
    history = rng.integers(a.max_len // 4, a.max_len // 2, a.batch)
    with cache.step(history) as step:
        x = backend.from_numpy(np.zeros((a.batch, a.kv_heads, int(history.max()), a.head_dim)),
                               "float32")
        for l in range(a.layers):
            step.write(l, x, x)
    hq = a.kv_heads * a.group
    q = backend.from_numpy(rng.standard_normal((a.batch, hq, 1, a.head_dim)), "float32")
    k = backend.from_numpy(rng.standard_normal((a.batch, a.kv_heads, 1, a.head_dim)), "float32")
    out = backend.from_numpy(np.zeros((a.batch, hq, 1, a.head_dim)), "float32")
    lse = backend.from_numpy(np.zeros((a.batch, hq, 1)), "float32")
    step_times(backend, cache, a.layers, q, k, None, None, 3)  # warm-up
    plain = step_times(backend, cache, a.layers, q, k, None, None, a.steps)
    given = step_times(backend, cache, a.layers, q, k, out, lse, a.steps)
    with cache.step([1] * a.batch) as step:  # the fixed plan, made in a step of its own
        fixed = step.plan_attention(hq, t_q=1, fixed=True)
        for l in range(a.layers):
            step.attend(l, q, k, k, plan=fixed, out=out, lse_out=lse)
    step_times(backend, cache, a.layers, q, k, out, lse, 3, fixed)  # warm-up
    fixed_times = step_times(backend, cache, a.layers, q, k, out, lse, a.steps, fixed)
    replayed = replay_times(cache, fixed, a.steps)
    print(f"{a.storage} decode, {a.layers} layers, B={a.batch} Hkv={a.kv_heads} G={a.group} "
          f"d={a.head_dim}, {'wall' if a.wall else 'CPU'} time{', unpoisoned' if a.unpoisoned else ''}, median of {a.steps} steps, per layer: Step.attend {plain[0] * 1e6:.1f} "
          f"us (attention {plain[1] * 1e6:.1f} us); with out/lse_out {given[0] * 1e6:.1f} us "
          f"(attention {given[1] * 1e6:.1f} us); fixed plan adopted, out/lse_out "
          f"{fixed_times[0] * 1e6:.1f} us (attention {fixed_times[1] * 1e6:.1f} us), adopt "
          f"{fixed_times[2] * 1e6:.1f} us per step; a replayed step (open, adopt, replay, "
          f"commit; the graph launch not included) {replayed * 1e6:.1f} us")


if __name__ == "__main__":
    main()
