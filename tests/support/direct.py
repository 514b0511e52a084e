"""The direct model of a KV cache: what the row operations mean, written without gqakv.

``Direct`` is one layer: a list of per-row float64 arrays ``[Hkv, L, d]`` that are
concatenated, sliced and copied by plain Python (arrays are never written in place, so
rows may share them). ``DirectCache`` is one ``Direct`` per layer, indexed
``k[layer][row]``. The helpers compare a cache with the model exactly (copies must be
bit-exact), snapshot a cache's buffers, and poison dead slots with NaN.
"""

from __future__ import annotations

import numpy as np

import gqakv


class Direct:
    """What one layer of a cache holds, per row, as float64 ``[Hkv, L, d]`` arrays."""

    def __init__(self, batch: int, kv_heads: int, head_dim: int):
        empty = np.zeros((kv_heads, 0, head_dim))
        self.k, self.v = [empty] * batch, [empty] * batch

    @property
    def lens(self) -> list[int]:
        return [r.shape[1] for r in self.k]

    def append(self, rows, k, v, n) -> None:
        """k, v: [B', Hkv, T, d] float64; entry i's first n[i] tokens go to rows[i]."""
        for i, r in enumerate(rows):
            self.k[r] = np.concatenate([self.k[r], k[i, :, :int(n[i])]], axis=1)
            self.v[r] = np.concatenate([self.v[r], v[i, :, :int(n[i])]], axis=1)

    def reorder(self, src) -> None:
        self.k, self.v = [self.k[s] for s in src], [self.v[s] for s in src]

    def fork(self, src, dst) -> None:
        for d in dst:
            self.k[d], self.v[d] = self.k[src], self.v[src]

    def truncate(self, rows, lens) -> None:
        for r, n in zip(rows, lens):
            self.k[r], self.v[r] = self.k[r][:, :n], self.v[r][:, :n]

    def reset(self, rows) -> None:
        self.truncate(rows, [0] * len(rows))


class DirectCache:
    """What a (model) KV cache should hold: ``k[layer][row]`` is ``[Hkv, L, d]`` float64."""

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int):
        self.layers = [Direct(batch, kv_heads, head_dim) for _ in range(layers)]

    @property
    def k(self) -> list[list[np.ndarray]]:
        return [layer.k for layer in self.layers]

    @property
    def v(self) -> list[list[np.ndarray]]:
        return [layer.v for layer in self.layers]

    @property
    def lens(self) -> list[int]:
        return self.layers[0].lens

    def append(self, layer, rows, k_new, v_new, n_new) -> None:
        """k_new, v_new: [B', Hkv, T, d] float64; entry i's first n_new[i] go to rows[i]."""
        self.layers[layer].append(rows, k_new, v_new, n_new)

    def reorder(self, src) -> None:
        for layer in self.layers:
            layer.reorder(src)

    def fork(self, src, dst) -> None:
        for layer in self.layers:
            layer.fork(src, dst)

    def truncate(self, rows, new_lens) -> None:
        for layer in self.layers:
            layer.truncate(rows, new_lens)

    def reset(self, rows) -> None:
        for layer in self.layers:
            layer.reset(rows)


def layer_caches(cache) -> list:
    """Per-layer KVCache objects of a KVCache (itself) or a ModelKVCache (its views)."""
    if isinstance(cache, gqakv.ModelKVCache):
        return [cache.layer(l) for l in range(cache.layers)]
    return [cache]


def assert_matches(cache, direct: DirectCache, arrays) -> None:
    """Lengths equal and every row's live K/V bit-equal to the direct model, on every layer."""
    np.testing.assert_array_equal(cache.host_lens, direct.lens)
    for l, layer in enumerate(layer_caches(cache)):
        for b in range(layer.batch):
            k, v = layer.live_kv(b)
            np.testing.assert_array_equal(arrays.to_numpy(k), direct.k[l][b], err_msg=f"K layer {l} row {b}")
            np.testing.assert_array_equal(arrays.to_numpy(v), direct.v[l][b], err_msg=f"V layer {l} row {b}")


def snapshot(cache, arrays) -> tuple:
    """Full copies of the buffers (dead slots too) and the lengths."""
    return (arrays.to_numpy(cache.k).copy(), arrays.to_numpy(cache.v).copy(), cache.host_lens.copy())


def assert_unchanged(cache, arrays, before) -> None:
    k, v, lens = before
    np.testing.assert_array_equal(cache.host_lens, lens)
    np.testing.assert_array_equal(arrays.to_numpy(cache.k), k)  # NaN == NaN here
    np.testing.assert_array_equal(arrays.to_numpy(cache.v), v)


def fill_nan(cache) -> None:
    """Poison every slot: a dead token that leaks into live data or attention shows up."""
    cache.store.fill(float("nan"))


def make_cache(kind, backend, *, layers=2, batch=4, kv_heads=2, max_len=12, head_dim=3,
               dtype="float64") -> tuple:
    """A NaN-poisoned ``ModelKVCache`` (kind "model") or ``KVCache`` and its empty direct model."""
    if kind == "model":
        cache = gqakv.ModelKVCache(layers, batch, kv_heads, max_len, head_dim, dtype, backend)
    else:
        cache = gqakv.KVCache(batch, kv_heads, max_len, head_dim, dtype, backend)
    fill_nan(cache)
    nl = layers if kind == "model" else 1
    return cache, DirectCache(nl, batch, kv_heads, head_dim)


def fill_rows(cache, direct, arrays, lens, rng, dtype="float64") -> None:
    """Append ``lens[b]`` random tokens to each row (all layers) and mirror them."""
    lens = np.asarray(lens)
    T = max(1, int(lens.max()))
    B, hkv, d = cache.batch, cache.kv_heads, cache.head_dim
    layers = layer_caches(cache)
    data = [(rng.standard_normal((B, hkv, T, d)), rng.standard_normal((B, hkv, T, d)))
            for _ in layers]
    # Round to the cache dtype first so the direct model holds exactly what is stored.
    data = [tuple(arrays.to_numpy(arrays.asarray(x, dtype)) for x in kv) for kv in data]
    if isinstance(cache, gqakv.ModelKVCache):
        with cache.step(lens) as step:
            for l, (k, v) in enumerate(data):
                step.write(l, arrays.asarray(k, dtype), arrays.asarray(v, dtype))
    else:
        cache.append(arrays.asarray(data[0][0], dtype), arrays.asarray(data[0][1], dtype), lens)
    for l, (k, v) in enumerate(data):
        direct.append(l, range(B), k, v, lens)
