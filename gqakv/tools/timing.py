"""Timing helpers shared by ``gqakv bench``, its side measurements and the asv benchmarks."""

from __future__ import annotations

import time

import numpy as np


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def alternating_blocks(fns: dict, backend=None, *, rounds: int = 5, block_s: float = 0.1) -> dict:
    """Seconds per call of each callable, timed in alternating blocks (a block of calls of
    the first, then of the second, ..., ``rounds`` times) so that a burst of other load on
    the machine hits every side alike. A block repeats its call enough times to last about
    ``block_s`` (after a warm-up call, sized from a second, timed one). Returns ``{name: {"median_s", "min_s",
    "blocks"}}``: the median and the minimum over blocks of the block's time per call."""
    sync = backend.synchronize if backend is not None else (lambda: None)
    reps = {}
    for name, fn in fns.items():
        fn()
        sync()
        reps[name] = max(1, int(block_s / max(_timed(lambda: (fn(), sync())), 1e-6)))
    per_call: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            sync()
            per_call[name].append((time.perf_counter() - t) / reps[name])
    return {name: {"median_s": float(np.median(ts)), "min_s": min(ts), "blocks": len(ts),
                   "calls_per_block": reps[name]} for name, ts in per_call.items()}
