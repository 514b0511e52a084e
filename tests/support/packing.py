"""Packed tokens for tests: the ``[N, H, ...]`` form of padded ``[B, H, T, ...]`` arrays."""

from __future__ import annotations

import numpy as np


def pack_tokens(x, n_new) -> np.ndarray:
    """``[B, H, T, ...]`` -> ``[N, H, ...]``: entry b's first ``n_new[b]`` tokens, entries
    end to end (``N = sum(n_new)``), as gqakv's packed q / k_new / v_new / out and, for
    ``[B, H, T]``, its packed lse ``[N, H]``."""
    x = np.asarray(x)
    return np.concatenate([np.swapaxes(x[b], 0, 1)[:int(n)] for b, n in enumerate(n_new)], axis=0)
