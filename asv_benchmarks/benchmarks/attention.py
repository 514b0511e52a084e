"""Attention: decode at three Llama-3.1-8B sizes, half precision, ragged rows, chunked prefill.

Targets (issue 4): decode no slower than torch SDPA(enable_gqa) over the same live
views and >= 70% of measured read bandwidth; prefill <= 1.5x torch SDPA with an
explicit bottom-right mask; ragged cost follows the sum of live lengths.
"""

from __future__ import annotations

import numpy as np

from .common import (BACKENDS, D, HKV, attend, backend_or_skip, filled_cache, live_kv_bytes, queries,
                     read_bandwidth, seconds, temp_bytes, torch_ratio)

DECODE_SIZES = ["4x4096", "1x32768", "32x1024"]  # batch x live length


def _sizes(spec: str) -> tuple[int, int]:
    b, l = spec.split("x")
    return int(b), int(l)


class Decode:
    """One decode step (T = 1) of every row over its live K/V."""

    params = [BACKENDS, DECODE_SIZES]
    param_names = ["backend", "batch x length"]
    timeout = 300

    def setup(self, backend, size):
        self.backend = backend_or_skip(backend)
        B, L = _sizes(size)
        self.cache = filled_cache(self.backend, [L] * B)
        self.q = queries(self.backend, B, 1)
        self.n_new = np.ones(B, dtype=np.int64)

    def _call(self):
        attend(self.backend, self.q, self.cache, self.n_new)

    def time_decode(self, backend, size):
        self._call()

    def peakmem_decode(self, backend, size):
        self._call()

    def track_gbps(self, backend, size):
        return live_kv_bytes(self.cache) / seconds(self._call, self.backend) / 1e9

    track_gbps.unit = "GB/s"

    def track_pct_of_read_bandwidth(self, backend, size):
        return 100 * live_kv_bytes(self.cache) / seconds(self._call, self.backend) / read_bandwidth()

    track_pct_of_read_bandwidth.unit = "%"

    def track_ratio_to_torch(self, backend, size):
        return torch_ratio(self._call, self.q, self.cache, self.n_new, self.backend)

    track_ratio_to_torch.unit = "gqakv/torch"

    def track_temp_mib(self, backend, size):
        return temp_bytes(self._call, self.backend) / 2**20

    track_temp_mib.unit = "MiB"


class DecodeHalf:
    """float16/bfloat16 caches, computed in float32 blocks: cost relative to float32."""

    params = [BACKENDS, ["float16", "bfloat16"]]
    param_names = ["backend", "dtype"]
    timeout = 300
    SIZE = (4, 4096)  # batch, live length

    def setup(self, backend, dtype):
        self.backend = backend_or_skip(backend)
        if dtype not in self.backend.dtypes:
            raise NotImplementedError(f"{backend} does not hold {dtype}")
        B, L = self.SIZE
        self.cache = filled_cache(self.backend, [L] * B, dtype=dtype)
        self.q = queries(self.backend, B, 1, dtype=dtype)
        self.n_new = np.ones(B, dtype=np.int64)

    def _call(self):
        attend(self.backend, self.q, self.cache, self.n_new)

    def time_decode(self, backend, dtype):
        self._call()

    def track_ratio_to_float32(self, backend, dtype):
        t_half = seconds(self._call, self.backend)
        B, L = self.SIZE
        c32 = filled_cache(self.backend, [L] * B)
        q32 = queries(self.backend, B, 1)
        t_32 = seconds(lambda: attend(self.backend, q32, c32, self.n_new), self.backend)
        return t_half / t_32

    track_ratio_to_float32.unit = "x float32 time"

    def track_gbps(self, backend, dtype):
        return live_kv_bytes(self.cache) / seconds(self._call, self.backend) / 1e9

    track_gbps.unit = "GB/s"


class RaggedDecode:
    """A 100-token row beside a 16k-token row: cost follows the sum of live lengths."""

    params = [BACKENDS]
    param_names = ["backend"]
    timeout = 300
    LENS = (100, 16000)

    def setup(self, backend):
        self.backend = backend_or_skip(backend)
        short, long = self.LENS
        self.ragged = filled_cache(self.backend, [short, long])
        self.padded = filled_cache(self.backend, [long, long])  # what B x longest would cost
        self.single = filled_cache(self.backend, [short + long])  # the same total in one row
        self.q = queries(self.backend, 2, 1)
        self.q1 = queries(self.backend, 1, 1)
        self.ones = np.ones(2, dtype=np.int64)

    def _ragged(self):
        attend(self.backend, self.q, self.ragged, self.ones)

    def time_ragged(self, backend):
        self._ragged()

    def track_ratio_to_padded(self, backend):
        """About 0.5 when work follows live lengths, 1.0 if it followed the longest row."""
        t_pad = seconds(lambda: attend(self.backend, self.q, self.padded, self.ones), self.backend)
        return seconds(self._ragged, self.backend) / t_pad

    track_ratio_to_padded.unit = "x time of [16000, 16000]"

    def track_ratio_to_same_total(self, backend):
        """About 1.0: the same 16,100 live tokens in one row."""
        t_one = seconds(lambda: attend(self.backend, self.q1, self.single, self.ones[:1]),
                        self.backend)
        return seconds(self._ragged, self.backend) / t_one

    track_ratio_to_same_total.unit = "x time of [16100]"


class ChunkedPrefill:
    """'512 onto 3000': one 512-token chunk's attention over 3,512 live tokens.
    '4096 in 8': a 4,096-token prompt appended and attended in 8 chunks of 512."""

    params = [BACKENDS, ["512 onto 3000", "4096 in 8"]]
    param_names = ["backend", "case"]
    timeout = 600
    CASES = {"512 onto 3000": (512, 3512), "4096 in 8": (512, 4096)}  # chunk, final length

    def setup(self, backend, case):
        self.backend = backend_or_skip(backend)
        self.case = case
        self.chunk, L = self.CASES[case]
        self.n_chunks = L // self.chunk
        self.cache = filled_cache(self.backend, [L])
        self.q = queries(self.backend, 1, self.chunk)
        self.n_new = np.array([self.chunk])
        if case == "4096 in 8":
            rng = np.random.default_rng(2)
            self.kv = self.backend.from_numpy(
                rng.standard_normal((1, HKV, self.chunk, D), dtype=np.float32), "float32")

    def _attention_only(self):
        attend(self.backend, self.q, self.cache, self.n_new)

    def _prompt(self):
        self.cache.reset()
        for _ in range(self.n_chunks):
            self.cache.append(self.kv, self.kv, self.n_new)
            attend(self.backend, self.q, self.cache, self.n_new)

    def _call(self):
        (self._attention_only if self.case == "512 onto 3000" else self._prompt)()

    def time_prefill(self, backend, case):
        self._call()

    def peakmem_prefill(self, backend, case):
        self._call()

    def track_ratio_to_torch(self, backend, case):
        """Attention only, both sides; for '4096 in 8' the sum over the 8 chunk states."""
        if case == "512 onto 3000":
            return torch_ratio(self._attention_only, self.q, self.cache, self.n_new, self.backend)
        from gqakv import bench

        t_g = t_t = 0.0
        try:
            for c in range(self.n_chunks, 0, -1):  # truncate only shortens: longest first
                self.cache.truncate([0], [c * self.chunk])
                sdpa = bench.torch_sdpa(self.q, self.cache.k, self.cache.v,
                                        self.cache.host_lens, self.n_new)
                t_g += seconds(self._attention_only, self.backend, repeats=3)
                t_t += seconds(sdpa, self.backend, repeats=3)
        except ImportError:
            return float("nan")
        finally:
            self._prompt()  # the whole prompt again
        return t_g / t_t

    track_ratio_to_torch.unit = "gqakv/torch"

    def track_temp_mib(self, backend, case):
        return temp_bytes(self._attention_only, self.backend) / 2**20

    track_temp_mib.unit = "MiB"
