"""Random attention variants (window, softcap, sinks) with their edge values, for the
parity tests' random cases."""

from __future__ import annotations

import numpy as np


def random_variant(rng: np.random.Generator, Hq: int, max_len: int) -> dict:
    """A random mix of the variants, as ``AttentionParams`` fields besides ``scale``, with
    their edge values: W = 1, W past every row, tiny (saturating) and large soft-caps,
    large and -inf sinks (one per query head, float32-representable)."""
    window = [None, 1, 2, int(rng.integers(1, max_len + 2)), max_len + 50][int(rng.integers(5))]
    softcap = [None, None, 1e-3, 0.3, float(rng.uniform(1, 30))][int(rng.integers(5))]
    sinks = None
    if rng.integers(3):
        sinks = rng.standard_normal(Hq) * 3
        sinks[rng.random(Hq) < 0.25] = -np.inf
        sinks[rng.random(Hq) < 0.15] = 60.0  # dominates every score
        sinks = tuple(float(np.float32(x)) for x in sinks)
    return dict(window=window, softcap=softcap, sinks=sinks)
