"""A full generation loop (chunked prefill, then decode steps), and the same loop on a
cache grown by concatenation (the baseline gqakv replaces): time and bytes copied.

By default one short loop (a 1,024-token prompt, 64 steps); GQAKV_ASV_FULL=1 adds the
long ones (2,048- and 4 x 1,024-token prompts, 256 steps), which take minutes per commit
on two cores, mostly in the concatenation baseline.
"""

from __future__ import annotations

import inspect
import math

import numpy as np

import gqakv

from .common import BACKENDS, D, FULL, HKV, HQ, backend_or_skip, ratio, sync, timing

SIZES = ["1x1024"] + (["1x2048", "4x1024"] if FULL else [])  # batch x prompt length
CHUNK, STEPS = 512, (256 if FULL else 64)


def _sizes(spec):
    b, p = spec.split("x")
    return int(b), int(p)


def _data(backend, B, T, heads, seed):
    rng = np.random.default_rng(seed)
    return backend.from_numpy(rng.standard_normal((B, heads, T, D), dtype=np.float32), "float32")


@timing
class GenerationLoop:
    """gqakv: the cache is allocated once; every append writes in place."""

    params = [BACKENDS, SIZES]
    param_names = ["backend", "batch x prompt"]
    timeout = 600
    repeat = (2, 4, 2.0)  # calls of 0.2 s to seconds; two rounds (common.TIMING)

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
        sync(self.backend)

    def time_generate(self, backend, size):
        self._generate()


class ConcatBaseline:
    """The same loop on NumPy arrays grown by np.concatenate at every append (K and V
    [B, Hkv, S, d]), with gqakv's NumPy attention over them: only the cache differs."""

    params = [SIZES]
    param_names = ["batch x prompt"]
    timeout = 900

    def setup(self, size):
        self.B, self.P = _sizes(size)
        self.numpy = backend_or_skip("numpy")
        try:
            from gqakv_backends.numpy_attention import attention_numpy
        except ImportError:
            raise NotImplementedError("gqakv_backends.numpy_attention.attention_numpy does not exist in "
                                      "this commit") from None
        self.attention_numpy = attention_numpy
        self.kv_chunk, self.q_chunk = (_data(self.numpy, self.B, CHUNK, h, s) for h, s in ((HKV, 0), (HQ, 1)))
        self.kv_one, self.q_one = (_data(self.numpy, self.B, 1, h, s) for h, s in ((HKV, 2), (HQ, 3)))
        self.scale = 1.0 / math.sqrt(D)

    def _attend(self, q, k, v, n):
        B, L = k.shape[0], k.shape[2]
        return self.attention_numpy(q, k, v, np.arange(B), np.full(B, L), n, scale=self.scale,
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

    def track_bytes_copied(self, size):
        return self._generate()

    track_bytes_copied.unit = "bytes"

    def track_time_vs_concat(self, size):
        """Time of gqakv's loop (NumPy backend) / time of the concatenation loop, calls
        interleaved: below 1 while gqakv is faster; a gqakv slowdown raises it."""
        loop = GenerationLoop()
        loop.setup("numpy", size)
        return ratio(loop._generate, self._generate, self.numpy, repeats=3)

    track_time_vs_concat.unit = "x concatenation-loop time"


class StepHostTime:
    """Host time per layer of a 32-layer decode step (B=8, Hkv=8, G=4, d=64, 16 live tokens):
    the step timed as it is and with the backend's kernels no-op'd, in alternating rounds
    (``gqakv.tools.host_time``); the issue's target is 40 us per layer on numba and numpy. Also cold:
    32 MiB read before each layer (untimed), as a model's matmuls leave the caches (3.5x
    the tight loop's figure on numba, as SmolLM2's decode measures in place). Backends
    that declare no kernel entries are skipped. Contiguous rows, and pages of 16 tokens (the
    serving default)."""

    params = [BACKENDS, ["contiguous", "paged 16"]]
    param_names = ["backend", "storage"]
    timeout = 300
    LAYERS, ROUNDS = 32, 5

    def setup(self, backend, storage):
        b = backend_or_skip(backend)
        paged = {} if storage == "contiguous" else {"page_size": int(storage.split()[-1])}
        try:
            from gqakv.tools.host_time import step_host_time
        except ImportError:
            raise NotImplementedError("gqakv.tools.host_time does not exist in this commit") from None
        if not b.kernel_entries():
            raise NotImplementedError(f"{backend}: declares no kernel entries to exclude")
        if paged and "page_size" not in inspect.signature(step_host_time).parameters:
            raise NotImplementedError("this commit's host_time has no paged step")
        self.result = step_host_time(b, layers=self.LAYERS, rounds=self.ROUNDS, **paged)
        try:  # cold: the caches as a model's matmuls leave them (HOST_EVICT_BYTES read before each layer)
            from gqakv.tools.host_time import HOST_EVICT_BYTES
        except ImportError:
            self.cold = None
        else:
            self.cold = step_host_time(b, layers=self.LAYERS, rounds=self.ROUNDS,
                                       evict_bytes=HOST_EVICT_BYTES, **paged)

    def track_host_us_per_layer(self, backend, storage):
        return self.result["host_per_layer_us"]

    track_host_us_per_layer.unit = "us"

    def track_host_us_per_layer_cold(self, backend, storage):
        if self.cold is None:
            raise NotImplementedError("this commit's host_time has no cold measurement")
        return self.cold["host_per_layer_us"]

    track_host_us_per_layer_cold.unit = "us"

    def track_kernel_share(self, backend, storage):
        return self.result["kernel_share"]

    track_kernel_share.unit = "fraction"


class MixedBatch:
    """A mixed batch (1 row attending a 512-token prefill chunk, 31 rows one decode token
    each, rows of 2,048 tokens; Hkv=8, G=4, d=64) packed ``[N, Hq, d]``, padded to the
    chunk, and as the two separate calls, in alternating blocks
    (``gqakv.tools.mixed_batch``): the packed call's time over the separate calls' (the
    issue's target: at most 1.05), the padded one's, and the query bytes each layout needs."""

    params = [BACKENDS]
    param_names = ["backend"]
    timeout = 600
    CASE = {"decoders": 31, "chunk": 512, "row_len": 2048}
    ROUNDS = 5

    def setup(self, backend):
        b = backend_or_skip(backend)
        try:
            from gqakv.tools.mixed_batch import mixed_batch_times
        except ImportError:
            raise NotImplementedError("gqakv.tools.mixed_batch does not exist in this commit") from None
        self.result = mixed_batch_times(b, rounds=self.ROUNDS, **self.CASE)

    def track_packed_over_separate(self, backend):
        return self.result["packed_over_separate"]

    track_packed_over_separate.unit = "x separate calls"

    def track_padded_over_separate(self, backend):
        return self.result["padded_over_separate"]

    track_padded_over_separate.unit = "x separate calls"

    def track_query_bytes_packed(self, backend):
        return self.result["query_bytes"]["packed"]

    track_query_bytes_packed.unit = "bytes"
