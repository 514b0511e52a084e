"""GPU benchmarks of the cupy backend's fused kernels (skipped where cupy cannot run).

Decode: Llama-3.1-8B layer shapes (32 query heads, 8 KV heads, d = 128, bfloat16), batch
1 to 64, live length 1k to 32k. ``track_decode_x_peak_time`` is the step time over the time
to read its live K and V at the device's peak HBM bandwidth (GQAKV_PEAK_HBM_TBS, default 4.8
for an H200); the target is <= 1.25 (80% of peak) at long context.
``track_time_vs_array_api`` compares with the same backend's non-fused array-API path on the
same cache; ``track_decode_splits`` records the split-KV count the planner chose for the shape.
Prefill: a 512-token chunk on a 3k to 32k cache; ``track_prefill_x_peak_time`` against
GQAKV_PEAK_TFLOPS (default 989, H200 dense bf16). Every timed call synchronizes the device,
and every number is lower-is-better (asv's regressions point the right way).
"""

from __future__ import annotations

import os

import numpy as np

import gqakv
from gqakv.tools import bench
from gqakv.dispatch.backend import Backend
from gqakv.core.inputs import validate_attention

from .common import D, HKV, HQ, backend_or_skip, best_seconds, filled_cache, queries, ratio

DTYPE = "bfloat16"
PEAK_TBS = float(os.environ.get("GQAKV_PEAK_HBM_TBS", "4.8"))
PEAK_TFLOPS = float(os.environ.get("GQAKV_PEAK_TFLOPS", "989"))


def _cupy():
    backend = backend_or_skip("cupy")
    return backend


class GpuDecode:
    params = [[1, 8, 64], [1024, 8192, 32768]]
    param_names = ["batch", "live_len"]
    timeout = 300

    def setup(self, batch, live_len):
        self.backend = _cupy()
        self.cache = filled_cache(self.backend, [live_len] * batch, dtype=DTYPE)
        self.q = queries(self.backend, batch, 1, dtype=DTYPE)
        self.n_new = np.ones(batch, dtype=np.int64)
        self.read_bytes = batch * live_len * bench.token_bytes(HKV, D, DTYPE)

    def _fused(self):
        gqakv.gqa_attention(self.q, self.cache, self.n_new)
        self.backend.synchronize()

    def _array_api(self):
        c = self.cache
        inp = validate_attention(c, self.q, self.n_new, None, D ** -0.5)
        Backend.attention(self.backend, self.q, c.store, inp, inp.params, return_lse=False)
        self.backend.synchronize()

    def time_decode(self, batch, live_len):
        self._fused()

    def track_decode_x_peak_time(self, batch, live_len):
        """Step time / (live K/V bytes at peak HBM bandwidth): 1.0 is the bound."""
        return best_seconds(self._fused, self.backend, repeats=20) / (self.read_bytes / (PEAK_TBS * 1e12))

    track_decode_x_peak_time.unit = "x peak-bandwidth time"

    def track_decode_splits(self, batch, live_len):
        """Split-KV chunks per row the planner chose (1: no merge launch)."""
        import cupy

        from gqakv_backends.cupy_backend import plan

        dev = cupy.cuda.Device()
        sms = dev.attributes["MultiProcessorCount"]
        mma = int(dev.compute_capability) >= 80  # as CupyBackend tells the planner
        _, _, chunks, per_sm = plan.decode_kernel(DTYPE, D, HQ // HKV, mma)
        return plan.choose_splits(self.cache.host_lens, HKV * chunks, sms, per_sm)[0]

    track_decode_splits.unit = "splits"

    def track_time_vs_array_api(self, batch, live_len):
        """Fused kernels' time / the generic array-API code's time on the same cache."""
        return ratio(self._fused, self._array_api, self.backend)

    track_time_vs_array_api.unit = "x array-API time"


class GpuPrefill:
    params = [[3072, 8192, 32768]]
    param_names = ["cache_len"]
    timeout = 300

    def setup(self, cache_len):
        self.backend = _cupy()
        self.cache = filled_cache(self.backend, [cache_len], dtype=DTYPE)
        self.q = queries(self.backend, 1, 512, dtype=DTYPE)
        self.n_new = np.array([512])
        # 2 matmuls x 2 flops x Hq x d per visible (query, key) pair; bottom-right causal.
        pairs = sum(cache_len - 512 + t + 1 for t in range(512))
        self.flops = 4 * HQ * D * pairs

    def _call(self):
        gqakv.gqa_attention(self.q, self.cache, self.n_new)
        self.backend.synchronize()

    def time_prefill(self, cache_len):
        self._call()

    def track_prefill_x_peak_time(self, cache_len):
        """Chunk time / (its FLOPs at GQAKV_PEAK_TFLOPS): 1.0 is the bound."""
        return best_seconds(self._call, self.backend, repeats=20) / (self.flops / (PEAK_TFLOPS * 1e12))

    track_prefill_x_peak_time.unit = "x peak-FLOP/s time"
