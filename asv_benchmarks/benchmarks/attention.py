"""Attention: decode at three Llama-3.1-8B sizes, half precision, ragged rows, a sliding
window on a long row, chunked prefill, torch SDPA as a peer, and the temporaries a call allocates.

Targets (issue 4): decode no slower than torch SDPA(enable_gqa) over the same live
views and >= 70% of the machine's read bandwidth (``track_x_read_bound`` <= 1.43); prefill
<= 1.5x torch SDPA with an explicit bottom-right mask; ragged cost follows the sum of
live lengths. Every number is lower-is-better.
"""

from __future__ import annotations

import time

import numpy as np

import gqakv

from .common import (BACKENDS, D, HKV, HQ, attend, backend_or_skip, best_seconds, filled_cache, live_kv_bytes,
                     matmul, prefill_flops, queries, ratio, reader, require, sync, temp_mib, timing,
                     torch_or_skip)

DECODE_SIZES = ["4x4096", "1x32768", "32x1024"]  # batch x live length


def _sizes(spec: str) -> tuple[int, int]:
    b, l = spec.split("x")
    return int(b), int(l)


@timing
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

    def track_x_read_bound(self, backend, size):
        """Step time / the time a parallel read (``common.reader``: numba's sum, else BLAS's
        matrix-vector product) takes to stream as many bytes as the step's live K/V, calls
        interleaved so that load from elsewhere on the machine slows both: 1.0 is the bound,
        1.43 is 70% of it. Until 2026-12-07 the read was BLAS's, whose spinning workers
        slowed the step after it (``common.reader``), so earlier values are higher."""
        return ratio(self._call, reader(live_kv_bytes(self.cache)), self.backend, repeats=9)

    track_x_read_bound.unit = "x read-bound time"


def _windowed(window: int):
    """gqa_attention's parameters with a sliding window (scale 1/sqrt(D)), or
    NotImplementedError (asv: skipped) in a commit without attention variants."""
    import dataclasses
    import math

    params = getattr(gqakv, "AttentionParams", None)
    if params is None or "window" not in {f.name for f in dataclasses.fields(params)}:
        raise NotImplementedError("gqakv.AttentionParams has no window in this commit (added later)")
    return params(scale=1.0 / math.sqrt(D), window=window)


@timing
class WindowedDecode:
    """Decode on one row of 32,768 tokens with a sliding window of 4,096 (issue 13): work
    and bytes read follow min(L, W). ``track_ratio_to_full``: about W / L = 0.125 against
    the same step without a window; ``track_ratio_to_window_length``: about 1.0 against a
    step without a window over a row of W tokens (the same keys read)."""

    params = [BACKENDS]
    param_names = ["backend"]
    timeout = 300
    L, W = 32768, 4096

    def setup(self, backend):
        self.backend = backend_or_skip(backend)
        self.attn_params = _windowed(self.W)  # (not self.params: asv's parameter list)
        self.cache = filled_cache(self.backend, [self.L])
        self.q = queries(self.backend, 1, 1)
        self.n_new = np.ones(1, dtype=np.int64)

    def _call(self):
        gqakv.gqa_attention(self.q, self.cache, self.n_new, params=self.attn_params)
        sync(self.backend)

    def time_decode_window(self, backend):
        self._call()

    def track_ratio_to_full(self, backend):
        return ratio(self._call, lambda: attend(self.backend, self.q, self.cache, self.n_new),
                     self.backend, repeats=9)

    track_ratio_to_full.unit = "x time without a window"

    def track_ratio_to_window_length(self, backend):
        short = filled_cache(self.backend, [self.W])
        return ratio(self._call, lambda: attend(self.backend, self.q, short, self.n_new),
                     self.backend, repeats=9)

    track_ratio_to_window_length.unit = "x time of an unwindowed [4096] row"


@timing
class DecodeHalf:
    """float16/bfloat16 caches, computed in float32 blocks: cost relative to float32."""

    params = [BACKENDS, ["float16", "bfloat16"]]
    param_names = ["backend", "dtype"]
    timeout = 300
    SIZE = (4, 4096)  # batch, live length

    def setup(self, backend, dtype):
        self.backend = backend_or_skip(backend)
        if dtype not in getattr(self.backend, "dtypes", ()):
            raise NotImplementedError(f"{backend} does not hold {dtype}")
        B, L = self.SIZE
        self.cache = filled_cache(self.backend, [L] * B, dtype=dtype)
        self.q = queries(self.backend, B, 1, dtype=dtype)
        self.n_new = np.ones(B, dtype=np.int64)

    def _call(self):
        attend(self.backend, self.q, self.cache, self.n_new)

    def track_ratio_to_float32(self, backend, dtype):
        B, L = self.SIZE
        c32 = filled_cache(self.backend, [L] * B)
        q32 = queries(self.backend, B, 1)
        return ratio(self._call, lambda: attend(self.backend, q32, c32, self.n_new), self.backend)

    track_ratio_to_float32.unit = "x float32 time"


@timing
class RaggedDecode:
    """A 100-token row beside a 16k-token row: cost follows the sum of live lengths."""

    params = [BACKENDS]
    param_names = ["backend"]
    timeout = 300
    LENS = (100, 16000)

    def setup(self, backend):
        self.backend = backend_or_skip(backend)
        self.ragged = filled_cache(self.backend, list(self.LENS))
        self.q = queries(self.backend, 2, 1)
        self.ones = np.ones(2, dtype=np.int64)

    def _ragged(self):
        attend(self.backend, self.q, self.ragged, self.ones)

    def track_ratio_to_padded(self, backend):
        """About 0.5 when work follows live lengths, 1.0 if it followed the longest row."""
        padded = filled_cache(self.backend, [max(self.LENS)] * 2)  # what B x longest would cost
        return ratio(self._ragged, lambda: attend(self.backend, self.q, padded, self.ones), self.backend)

    track_ratio_to_padded.unit = "x time of [16000, 16000]"

    def track_ratio_to_same_total(self, backend):
        """About 1.0: the same 16,100 live tokens in one row."""
        single = filled_cache(self.backend, [sum(self.LENS)])
        q1 = queries(self.backend, 1, 1)
        return ratio(self._ragged, lambda: attend(self.backend, q1, single, self.ones[:1]), self.backend)

    track_ratio_to_same_total.unit = "x time of [16100]"


@timing
class ChunkedPrefill:
    """'512 onto 3000': one 512-token chunk's attention over 3,512 live tokens.
    '4096 in 8': a 4,096-token prompt appended and attended in 8 chunks of 512.
    '4096 at once': a 4,096-token prompt's attention in one call (the cache already holds it).
    ``track_x_matmul_bound``: the call's time over the time BLAS's float32 matmul takes for
    as many FLOP (issue 31's target: at most 1 / 0.6 = 1.67)."""

    params = [BACKENDS, ["512 onto 3000", "4096 in 8", "4096 at once"]]
    param_names = ["backend", "case"]
    timeout = 600
    # Calls of 0.1 to 1 s (more on a busy machine): a few samples per round (two rounds,
    # common.TIMING), no separate warm-up (each call of '4096 in 8' resets and refills the
    # cache; the set-up ran one of '512 onto 3000').
    repeat = (2, 3, 1.5)
    min_run_count = 3
    warmup_time = 0.0
    CASES = {"512 onto 3000": (512, 3512), "4096 in 8": (512, 4096), "4096 at once": (4096, 4096)}  # chunk, final length

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
        else:
            self._attention_only()  # warm-up: thread pools, first-touch of the output

    def _attention_only(self):
        attend(self.backend, self.q, self.cache, self.n_new)

    def _call(self):
        (self._prompt if self.case == "4096 in 8" else self._attention_only)()

    def _prompt(self):
        self.cache.reset()
        for _ in range(self.n_chunks):
            self.cache.append(self.kv, self.kv, self.n_new)
            attend(self.backend, self.q, self.cache, self.n_new)

    def time_prefill(self, backend, case):
        self._call()

    def track_x_matmul_bound(self, backend, case):
        L = self.n_chunks * self.chunk
        flops = prefill_flops([L], [L]) if case == "4096 in 8" else prefill_flops([L], [self.chunk])
        yardstick, done = matmul(flops)
        return ratio(self._call, yardstick, self.backend, repeats=3) * done / flops

    track_x_matmul_bound.unit = "x matmul-bound time"


class Bfloat16PrefillTiles:
    """bfloat16 prefill on the numba backend where the CPU has bfloat16 products (AMX
    tiles, or AVX-512 BF16 dot products since 2026-12-06: ``amx.engine``): the product
    items (``amx_prefill``) against the float32 path they replace (``GQAKV_AMX=0``), calls
    interleaved in one process. ``track_ratio_to_float32_path``: product time /
    float32-path time (below 1: the products are faster; 0.45-0.5 on AMX tiles on the
    Xeon, 2026-12-05; 0.71-0.77 on AVX-512 BF16 on the AMD EPYC, 2026-12-06). Skipped,
    saying why, on CPUs without either or before the tiles existed."""

    params = [["512 onto 3000", "4096 at once"]]
    param_names = ["case"]
    timeout = 300
    CASES = {"512 onto 3000": (512, 3512), "4096 at once": (4096, 4096)}  # chunk, live length

    def setup(self, case):
        self.backend = backend_or_skip("numba")
        try:
            from gqakv_backends import amx
        except ImportError:
            raise NotImplementedError("gqakv_backends.amx does not exist in this commit") from None
        why = amx.why_not()
        if why is not None:
            raise NotImplementedError(f"no bfloat16 products: {why}")
        self.env = amx.ENV_AMX
        chunk, L = self.CASES[case]
        self.cache = filled_cache(self.backend, [L], dtype="bfloat16")
        self.q = queries(self.backend, 1, chunk, dtype="bfloat16")
        self.n_new = np.array([chunk])

    def _float32_path(self):
        import os

        before = os.environ.get(self.env)
        os.environ[self.env] = "0"
        try:
            attend(self.backend, self.q, self.cache, self.n_new)
        finally:
            if before is None:
                del os.environ[self.env]
            else:
                os.environ[self.env] = before

    def time_prefill(self, case):
        attend(self.backend, self.q, self.cache, self.n_new)

    def track_ratio_to_float32_path(self, case):
        return ratio(lambda: attend(self.backend, self.q, self.cache, self.n_new), self._float32_path,
                     self.backend, repeats=3)

    track_ratio_to_float32_path.unit = "bf16-product / float32-path time"


class VsTorch:
    """gqakv (NumPy backend) / torch SDPA(enable_gqa=True, bottom-right mask) over the same
    live views, calls interleaved. Below 1: gqakv is faster. Skipped, saying so, without torch."""

    CASES = {f"decode {s}": (*_sizes(s), 1) for s in DECODE_SIZES}  # case -> (batch, live length, T)
    CASES["prefill 512 onto 3000"] = (1, 3512, 512)
    CASES["prefill 512 onto 3000, 4 rows"] = (4, 3512, 512)
    CASES["prefill 4096 at once"] = (1, 4096, 4096)
    params = [list(CASES)]
    param_names = ["case"]
    timeout = 300

    def setup(self, case):
        self.backend = backend_or_skip("numpy")
        torch_or_skip()
        from .common import bench  # the commit's bench module, wherever it lives

        B, L, T = self.CASES[case]
        self.cache = filled_cache(self.backend, [L] * B)
        self.q = queries(self.backend, B, T)
        self.n_new = np.full(B, T, dtype=np.int64)
        self.sdpa = bench.torch_sdpa(self.q, self.cache.k, self.cache.v, self.cache.host_lens, self.n_new)

    def track_ratio_to_torch(self, case):
        return ratio(lambda: attend(self.backend, self.q, self.cache, self.n_new), self.sdpa, self.backend,
                     repeats=5)

    track_ratio_to_torch.unit = "gqakv/torch time"


def _onnxruntime_peer_or_skip():
    """(the CPU default backend, the commit's ``gqakv.tools.bench``) for the ONNX Runtime
    ratios; NotImplementedError (asv: skipped, with the reason) without onnxruntime or in
    a commit older than the peer."""
    backend = backend_or_skip("numba" if "numba" in BACKENDS else "numpy")
    from .common import bench  # the commit's bench module, wherever it lives

    if not hasattr(bench, "onnxruntime_gqa"):
        raise NotImplementedError("gqakv.tools.bench.onnxruntime_gqa does not exist in this commit (added later)")
    try:
        bench.import_onnxruntime()
    except ImportError as exc:
        raise NotImplementedError(str(exc)) from None
    return backend, bench


def _append_attend_reset(backend, cache, q, kv, n_new, rows, base):
    """A call that appends ``kv`` as K and V (``n_new`` tokens per row), attends with
    ``q`` and returns the output, then truncates ``rows`` back to ``base`` (O(1)), so
    every call starts from the same state."""
    def step():
        cache.append(kv, kv, n_new)
        out = attend(backend, q, cache, n_new)
        cache.truncate(rows, base)
        return out
    return step


class VsOnnxRuntime:
    """gqakv's decode step (append + attention on the CPU default backend) / ONNX Runtime's
    ``com.microsoft.GroupQueryAttention`` (CPU provider, past and present sharing one
    buffer, as many threads) from the same state, calls interleaved (issue 11: below 1,
    gqakv is faster). ``setup`` first checks that both compute the same step
    (``gqakv.tools.bench.compare_onnxruntime``). Skipped, saying so, without onnxruntime."""

    CASES = {s: _sizes(s) for s in DECODE_SIZES}  # case -> (batch, live length)
    params = [list(CASES), ["float32", "float16"]]
    param_names = ["batch x length", "dtype"]
    timeout = 600

    def setup(self, case, dtype):
        self.backend, bench = _onnxruntime_peer_or_skip()
        B, L = self.CASES[case]
        cache = filled_cache(self.backend, [L] * B, dtype=dtype)
        bench.compare_onnxruntime(cache, HQ, rounds=1, block_s=0.0)  # ValueError if they differ
        rows, base = np.arange(B), cache.host_lens - 1
        cache.truncate(rows, base)
        q = queries(self.backend, B, 1, dtype)
        kv = np.ascontiguousarray(q[:, :HKV])
        ones = np.ones(B, dtype=np.int64)
        self.ort, _ = bench.onnxruntime_gqa(q, kv, kv, np.ascontiguousarray(cache.k),
                                            np.ascontiguousarray(cache.v), base,
                                            threads=bench.backend_threads(self.backend))

        self.step = _append_attend_reset(self.backend, cache, q, kv, ones, rows, base)

    def track_ratio_to_onnxruntime(self, case, dtype):
        return ratio(self.step, self.ort, self.backend, repeats=7)

    track_ratio_to_onnxruntime.unit = "gqakv/onnxruntime time"


class PrefillVsOnnxRuntime:
    """gqakv's prefill chunk (append + attention on the CPU default backend) / ONNX Runtime's
    ``com.microsoft.GroupQueryAttention`` doing the same (its chunk's K/V written in place,
    2 threads as gqakv's), calls interleaved; below 1, gqakv is faster (issue 31's prefill
    target). One row: ONNX Runtime refuses a chunk over a past at B > 1. ``setup`` first
    checks that both give the same outputs. Skipped, saying so, without onnxruntime."""

    CASES = {"512 onto 3000": (3000, 512), "4096 at once": (0, 4096)}  # case -> (past, T)
    params = [list(CASES), ["float32", "float16"]]
    param_names = ["chunk", "dtype"]
    timeout = 600

    def setup(self, case, dtype):
        self.backend, bench = _onnxruntime_peer_or_skip()
        past, T = self.CASES[case]
        cache = (filled_cache(self.backend, [past], max_len=past + T, dtype=dtype) if past
                 else gqakv.KVCache(1, HKV, T, D, dtype=dtype, backend=self.backend))
        q = queries(self.backend, 1, T, dtype)
        kv = np.ascontiguousarray(q[:, :HKV])
        n_new, rows, base = np.array([T]), np.array([0]), np.array([past])
        try:
            self.ort, ort_out = bench.onnxruntime_gqa(
                q, kv, kv, np.ascontiguousarray(cache.k), np.ascontiguousarray(cache.v), base,
                threads=bench.backend_threads(self.backend))
        except ValueError as exc:  # an onnxruntime without this op or dtype
            raise NotImplementedError(str(exc)) from None

        step = _append_attend_reset(self.backend, cache, q, kv, n_new, rows, base)
        self.ort()
        ours = np.asarray(step(), dtype=np.float64)
        tol = 8 * float(np.finfo(dtype).eps) * max(1.0, float(np.abs(ours).max()))
        if not np.abs(ours - np.asarray(ort_out, dtype=np.float64)).max() <= tol:
            raise ValueError(f"onnxruntime and gqakv disagree on the prefill chunk {case} ({dtype})")
        self.step = step

    def track_ratio_to_onnxruntime(self, case, dtype):
        return ratio(self.step, self.ort, self.backend, repeats=5)

    track_ratio_to_onnxruntime.unit = "gqakv/onnxruntime time"


class TempMemory:
    """Peak MiB a call allocates beyond its inputs and the cache (NumPy backend, tracemalloc
    started after set-up): about workers x 3 x 1 MiB score blocks plus queries and output for
    a prefill chunk, the output for a decode step, nothing for an append (written in place)."""

    # case -> (batch, live length, T): attention of T new tokens per row over L live ones,
    # or for "append", appending T tokens to rows holding L
    CASES = {"decode 4x4096": (4, 4096, 1), "prefill 512 onto 16000": (1, 16000, 512),
             "append 4x512 onto 1000": (4, 1000, 512)}
    params = [list(CASES)]
    param_names = ["case"]
    timeout = 300

    def setup(self, case):
        self.backend = backend_or_skip("numpy")
        B, L, T = self.CASES[case]
        self.n_new = np.full(B, T, dtype=np.int64)
        if case.startswith("append"):
            self.cache = filled_cache(self.backend, [L] * B, max_len=L + T)
            self.kv = np.ascontiguousarray(queries(self.backend, B, T)[:, :HKV])  # any [B, Hkv, T, d] data
            base = self.cache.host_lens.copy()
            rows = np.arange(B)

            def call():
                self.cache.truncate(rows, base)  # O(1): back to L tokens
                self.cache.append(self.kv, self.kv, self.n_new)
        else:
            self.cache = filled_cache(self.backend, [L] * B)
            self.q = queries(self.backend, B, T)

            def call():
                attend(self.backend, self.q, self.cache, self.n_new)
        self.call = call

    def track_temp_mib(self, case):
        return temp_mib(self.call)

    track_temp_mib.unit = "MiB"


@timing
class DraftTree:
    """Speculative verification: a draft tree of T tokens over a 4,096-token row against the
    causal chunk of the same length, the same tokens (issue 28's target: at most 1.0x)."""

    params = [BACKENDS, [8, 16, 64], ["float32", "bfloat16"]]
    param_names = ["backend", "draft_tokens", "dtype"]
    timeout = 300
    PREFIX = 4096

    def setup(self, backend, draft_tokens, dtype):
        self.backend = backend_or_skip(backend)
        require(gqakv, "DraftTree")
        if dtype not in getattr(self.backend, "dtypes", ()):
            raise NotImplementedError(f"{backend} does not hold {dtype}")
        T = draft_tokens
        self.cache = filled_cache(self.backend, [self.PREFIX + T], dtype=dtype)
        self.q = queries(self.backend, 1, T, dtype=dtype)
        self.n_new = np.array([T], dtype=np.int64)
        rng = np.random.default_rng(T)  # a random tree: each token's parent any earlier one
        self.parents = np.array([[int(rng.integers(-1, t)) for t in range(T)]])

    def _tree(self):
        gqakv.gqa_attention(self.q, self.cache, self.n_new, tree=self.parents)
        sync(self.backend)

    def time_tree(self, backend, draft_tokens, dtype):
        self._tree()

    def track_ratio_to_causal(self, backend, draft_tokens, dtype):
        return ratio(self._tree, lambda: attend(self.backend, self.q, self.cache, self.n_new),
                     self.backend)

    track_ratio_to_causal.unit = "x the causal chunk's time"


class AfterModelMatmul:
    """A short prefill chunk's attention (a prompt of T tokens, B rows) timed right after a
    model-sized float32 matmul on NumPy's BLAS, over the same call's best time alone: what
    a NumPy model's layer gets of the call's speed. NumPy's OpenBLAS keeps its workers
    spinning about 0.1 s after each threaded call, and an attention call that starts a
    second thread then waits for a core (on a 2-core machine SmolLM2's 64-token chunks at
    B=8 took 2.4x as long on the numba kernels' two threads as on one after a matmul,
    before chunks below
    ``CHUNK_PARALLEL_MIN_MACS`` stayed on one thread: the performance guide, "On another
    CPU"). 1.0: the model gets the call's best. Both sides take the same route and thread
    count, so what one thread costs a call alone shows in ``ChunkedPrefill`` and the
    ``gqakv bench`` figures, not here. Cases 'B x T': 1x128 and 8x32 fall below numba's
    chunk thread floor, 8x64 and 8x128 above it. Measured 2026-12-06 (2-core AMD EPYC, load
    about 1, two runs): numba with the floor 1.20-1.21, 1.25-1.34, 1.24-2.39, 2.04-2.16;
    without it (every chunk past ``PARALLEL_MIN_WORK`` on two threads) 1.60-1.62,
    1.60-1.68, 1.30-1.97, 1.86-1.90; numpy 1.04, 1.10, 1.76, 1.66. 1x512 takes the BLAS
    path on both backends, one worker on BLAS's own threads where OpenBLAS spins (below
    ``numpy_attention.SPINNING_BLAS_ONE_WORKER_MACS``), added with that rule: the same
    day, 3 runs each, load about 1-5, numpy 1.00-1.03 with it against 1.80-1.83 before
    (8x64: 1.06-1.09 against 1.80-1.86), numba 1.01-1.04 against 1.85-1.89."""

    params = [[b for b in BACKENDS if b in ("numpy", "numba")],
              ["1x128", "8x32", "8x64", "8x128", "1x512"]]
    param_names = ["backend", "batch x prompt"]
    timeout = 300
    PAUSE_S = 0.15  # past OpenBLAS's spin (about 0.1 s): the calls alone meet no spinning worker

    def setup(self, backend, case):
        self.backend = backend_or_skip(backend)
        B, T = _sizes(case)
        self.cache = filled_cache(self.backend, [T] * B)
        self.q = queries(self.backend, B, T)
        self.n_new = np.full(B, T)
        rng = np.random.default_rng(3)
        # the key projection's shape in a layer of this model: [B*T, Hq*d] @ [Hq*d, Hkv*d]
        self.x = rng.standard_normal((B * T, HQ * D), dtype=np.float32)
        self.w = rng.standard_normal((HQ * D, HKV * D), dtype=np.float32) / (HQ * D)

    def _timed(self):
        t = time.perf_counter()
        attend(self.backend, self.q, self.cache, self.n_new)
        return time.perf_counter() - t

    def track_ratio_after_matmul(self, backend, case):
        """The median over 15 calls each right after a matmul (whether a call meets a
        spinning worker varies from call to call; a minimum would pick the lucky one) over
        the best of 7 calls back to back after a pause (thread pools warm, BLAS idle)."""
        time.sleep(self.PAUSE_S)
        alone = best_seconds(lambda: attend(self.backend, self.q, self.cache, self.n_new),
                             self.backend, repeats=7)
        after = []
        for _ in range(15):
            self.x @ self.w
            after.append(self._timed())
        return float(np.median(after) / alone)

    track_ratio_after_matmul.unit = "x best time alone"
