"""The int-argument checks every gqakv constructor uses (cache dimensions, layer counts,
ranks): a Python or NumPy int (bools refused) at least ``minimum``, else TypeError /
ValueError naming the argument."""

from __future__ import annotations

import numpy as np


def check_dim(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_dims(batch, kv_heads, max_len, head_dim) -> tuple[int, int, int, int]:
    """The cache dimensions as Python ints: batch, max_len >= 0; kv_heads, head_dim >= 1."""
    return (check_dim("batch", batch, 0), check_dim("kv_heads", kv_heads, 1),
            check_dim("max_len", max_len, 0), check_dim("head_dim", head_dim, 1))
