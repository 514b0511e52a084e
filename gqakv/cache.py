"""The KV cache: K and V allocated once, written in place at each row's length.

Layout (gpt-fast style): ``k`` and ``v`` are each ``[B, Hkv, max_len, d]``; row b's
live tokens are ``k[b, :, :lens[b], :]``. Appends write at ``lens[b]`` and then
advance it; nothing is ever concatenated, stacked, repeated or reallocated.
"""

from __future__ import annotations

import numpy as np

from . import dtypes as _dtypes
from .inputs import validate_append
from .registry import get_backend


def _check_dim(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class KVCache:
    """A preallocated per-layer KV cache with ragged per-row lengths.

    Args:
        batch: B, number of rows (sequences).
        kv_heads: Hkv, number of key/value heads.
        max_len: capacity in tokens of every row.
        head_dim: d.
        dtype: "float32" (default), "float16", "bfloat16", "float64" or a dtype object.
        backend: a backend name, a Backend, "auto" or None (see ``gqakv.get_backend``).

    Attributes:
        k, v: the buffers, ``[B, Hkv, max_len, d]`` each, allocated once.
        lens: ``[B]`` int64, live tokens per row (read-only; changed by ``append``).
        backend: the Backend holding the buffers.
    """

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype="float32", backend=None):
        self.batch = _check_dim("batch", batch, 0)
        self.kv_heads = _check_dim("kv_heads", kv_heads, 1)
        self.max_len = _check_dim("max_len", max_len, 0)
        self.head_dim = _check_dim("head_dim", head_dim, 1)
        self.dtype = _dtypes.canonical_name(dtype)
        self.backend = get_backend(backend, dtype=self.dtype, head_dim=self.head_dim)
        shape = (self.batch, self.kv_heads, self.max_len, self.head_dim)
        nbytes = self.nbytes_for(self.batch, self.kv_heads, self.max_len, self.head_dim, self.dtype)
        try:
            self.k = self.backend.empty(shape, self.dtype)
            self.v = self.backend.empty(shape, self.dtype)
        except MemoryError as exc:
            raise MemoryError(
                f"cannot allocate a KV cache of {nbytes:,} bytes ({_human(nbytes)}; K and V "
                f"each {list(shape)} {self.dtype}) on backend {self.backend.name!r}: {exc}"
            ) from None
        # Host copy of the lengths is the source of truth: validation reads it without a
        # device round trip. The backend's array view of it is made on demand.
        self._lens = np.zeros(self.batch, dtype=np.int64)
        self._lens_device = None

    # -- sizing ----------------------------------------------------------------------------

    @staticmethod
    def nbytes_for(batch: int, kv_heads: int, max_len: int, head_dim: int, dtype="float32") -> int:
        """Bytes the K and V buffers of such a cache take together, computed before allocating."""
        return 2 * batch * kv_heads * max_len * head_dim * _dtypes.itemsize(dtype)

    @property
    def nbytes(self) -> int:
        return self.nbytes_for(self.batch, self.kv_heads, self.max_len, self.head_dim, self.dtype)

    # -- lengths ---------------------------------------------------------------------------

    @property
    def host_lens(self) -> np.ndarray:
        """Live tokens per row as a read-only NumPy int64 array (no device round trip)."""
        view = self._lens.view()
        view.flags.writeable = False
        return view

    @property
    def lens(self):
        """Live tokens per row, ``[B]`` int64, as an array of the cache's backend."""
        if self._lens_device is None:
            self._lens_device = self.backend.from_host_ints(
                self._lens, device=self.backend.device_of(self.k))
        return self._lens_device

    def _set_lens(self, rows: np.ndarray, values: np.ndarray) -> None:
        self._lens[rows] = values
        self._lens_device = None

    # -- writing ---------------------------------------------------------------------------

    def append(self, k_new, v_new, n_new, *, rows=None) -> None:
        """Write new tokens in place at each row's current length, then advance the lengths.

        Args:
            k_new, v_new: ``[B, Hkv, T, d]`` in the cache's dtype and array library.
            n_new: ``[B]`` ints, ``0 <= n_new[i] <= T``: the first n_new[i] of entry i's
                T slots are real tokens, the rest is padding and is not written.
            rows: optional ``[B]`` distinct cache rows (default ``0..B-1``): entry i writes
                to cache row ``rows[i]`` (continuous batching over a larger cache).

        Everything is validated before anything is written: on error (TypeError or
        ValueError naming the row and the numbers) no row's data or length changes.
        """
        inputs = validate_append(self, k_new, v_new, n_new, rows)
        self.backend.write_kv(self.k, self.v, k_new, v_new, inputs.rows, inputs.starts, inputs.n_new)
        self._set_lens(inputs.rows, inputs.starts + inputs.n_new)

    def live_kv(self, row: int):
        """Views ``k[row, :, :lens[row]]`` and ``v[row, :, :lens[row]]``, ``[Hkv, L, d]`` each."""
        n = int(self._lens[row])
        return self.k[row, :, :n, :], self.v[row, :, :n, :]

    def __repr__(self) -> str:
        return (f"KVCache(batch={self.batch}, kv_heads={self.kv_heads}, max_len={self.max_len}, "
                f"head_dim={self.head_dim}, dtype={self.dtype!r}, backend={self.backend.name!r}, "
                f"{_human(self.nbytes)})")


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if nbytes < 1024 or unit == "EiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError
