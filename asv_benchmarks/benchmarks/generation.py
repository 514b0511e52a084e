"""A full generation loop (chunked prefill, then 256 decode steps), and the same loop on a
cache grown by concatenation (the baseline gqakv replaces): time and bytes copied."""

from __future__ import annotations

import math

import numpy as np

import gqakv

from .common import BACKENDS, D, HKV, HQ, backend_or_skip, seconds

SIZES = ["1x2048", "4x1024"]  # batch x prompt length
CHUNK, STEPS = 512, 256


def _sizes(spec):
    b, p = spec.split("x")
    return int(b), int(p)


def _data(backend, B, T, heads, seed):
    rng = np.random.default_rng(seed)
    return backend.from_numpy(rng.standard_normal((B, heads, T, D), dtype=np.float32), "float32")


class GenerationLoop:
    """gqakv: the cache is allocated once; every append writes in place."""

    params = [BACKENDS, SIZES]
    param_names = ["backend", "batch x prompt"]
    timeout = 600

    def setup(self, backend, size):
        self.backend = backend_or_skip(backend)
        self.B, self.P = _sizes(size)
        self.cache = gqakv.KVCache(self.B, HKV, self.P + STEPS, D, backend=self.backend)
        self.kv_chunk, self.q_chunk = (_data(self.backend, self.B, CHUNK, h, s)
                                       for h, s in ((HKV, 0), (HQ, 1)))
        self.kv_one, self.q_one = (_data(self.backend, self.B, 1, h, s) for h, s in ((HKV, 2), (HQ, 3)))

    def _generate(self):
        cache, B = self.cache, self.B
        cache.reset()
        for start in range(0, self.P, CHUNK):
            n = np.full(B, min(CHUNK, self.P - start), dtype=np.int64)
            cache.append(self.kv_chunk, self.kv_chunk, n)
            gqakv.gqa_attention(self.q_chunk, cache, n)
        ones = np.ones(B, dtype=np.int64)
        for _ in range(STEPS):
            cache.append(self.kv_one, self.kv_one, ones)
            gqakv.gqa_attention(self.q_one, cache, ones)
        self.backend.synchronize()

    def time_generate(self, backend, size):
        self._generate()

    def peakmem_generate(self, backend, size):
        self._generate()

    def track_bytes_copied(self, backend, size):
        """Bytes of cached K/V moved to grow the cache: none."""
        return 0

    track_bytes_copied.unit = "bytes"


class ConcatBaseline:
    """The same loop on NumPy arrays grown by np.concatenate at every append (K and V
    [B, Hkv, S, d]), with gqakv's NumPy attention over them: only the cache differs."""

    params = [SIZES]
    param_names = ["batch x prompt"]
    timeout = 600

    def setup(self, size):
        self.B, self.P = _sizes(size)
        self.numpy = gqakv.get_backend("numpy")
        self.kv_chunk, self.q_chunk = (_data(self.numpy, self.B, CHUNK, h, s) for h, s in ((HKV, 0), (HQ, 1)))
        self.kv_one, self.q_one = (_data(self.numpy, self.B, 1, h, s) for h, s in ((HKV, 2), (HQ, 3)))
        self.scale = 1.0 / math.sqrt(D)

    def _attend(self, q, k, v, n):
        from gqakv_backends.numpy_attention import attention_numpy

        B, L = k.shape[0], k.shape[2]
        return attention_numpy(q, k, v, np.arange(B), np.full(B, L), n, scale=self.scale,
                               return_lse=False)

    def _generate(self):
        """Returns the bytes of already-cached K/V copied by the concatenations."""
        B = self.B
        k = v = np.empty((B, HKV, 0, D), dtype=np.float32)
        copied = 0
        for start in range(0, self.P, CHUNK):
            T = min(CHUNK, self.P - start)
            copied += k.nbytes + v.nbytes
            k = np.concatenate([k, self.kv_chunk[:, :, :T]], axis=2)
            v = np.concatenate([v, self.kv_chunk[:, :, :T]], axis=2)
            self._attend(self.q_chunk[:, :, :T], k, v, np.full(B, T))
        ones = np.ones(B, dtype=np.int64)
        for _ in range(STEPS):
            copied += k.nbytes + v.nbytes
            k = np.concatenate([k, self.kv_one], axis=2)
            v = np.concatenate([v, self.kv_one], axis=2)
            self._attend(self.q_one, k, v, ones)
        return copied

    def time_generate(self, size):
        self._generate()

    def peakmem_generate(self, size):
        self._generate()

    def track_bytes_copied(self, size):
        return self._generate()

    track_bytes_copied.unit = "bytes"

    def track_ratio_to_gqakv(self, size):
        """Time of the concatenation loop / time of gqakv's loop (NumPy backend)."""
        loop = GenerationLoop()
        loop.setup("numpy", size)
        return seconds(self._generate, self.numpy, repeats=3) / seconds(loop._generate, self.numpy,
                                                                        repeats=3)

    track_ratio_to_gqakv.unit = "x gqakv time"
