"""``gqakv bench``: the main job, a Llama-3.1-8B-shaped prefill + decode workload.

One attention layer of Llama-3.1-8B (32 query heads, 8 KV heads, head dim 128) on
the chosen backend: a batch of ragged prompts is prefilled in chunks, then every row
decodes token by token. The report gives the time of each phase, the decode step's
achieved bandwidth (bytes of live K/V read per step / time) against the machine's
measured read bandwidth, the cache's memory, and how many bytes a cache grown by
concatenation would have copied for the same run. ``--kv-dtype CODEC`` (int8, float8_e4m3fn,
or a grouped codec: int8_g32, int4_g32, int4_g64, int4_g32_rotated) runs it over a quantized
cache (alone or with ``--page-size``): every byte count is of what the cache actually
stores, the codes plus their float32 scales. ``--compare torch``
times torch's ``scaled_dot_product_attention(enable_gqa=True)`` over the same live views;
``--compare onnxruntime`` times ONNX Runtime's ``com.microsoft.GroupQueryAttention`` on its
CPU provider against gqakv's decode step on the same state, after checking that both
compute the same outputs.

The measuring helpers here (``read_bandwidth``, ``concat_bytes``, ``torch_sdpa``,
``onnxruntime_gqa``, ``alternating_blocks``, ``median_time``) are shared with the asv benchmarks; timings wait for the device through
``Backend.synchronize``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..caches.cache import KVCache
from ..caches.paged_cache import PagedKVCache
from ..core.units import human_bytes
from ..dispatch.registry import get_backend
from ..ops.attention import gqa_attention
from ..storage import codecs as _codecs
from ..storage import store as _store
from ..storage.paged import pages_for
from .errors import UsageError
from .timing import _timed, alternating_blocks  # noqa: F401  (callers use bench.alternating_blocks)

LLAMA_8B = dict(heads=32, kv_heads=8, head_dim=128, layers=32)


# -- shared measuring helpers ----------------------------------------------------------------

def read_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> dict[str, float]:
    """The machine's streaming read bandwidth in bytes/s, measured three ways.

    ``numpy_sum_1thread``: NumPy's sum over a ``nbytes`` float32 array (one core).
    ``numpy_sum_threads``: the same array summed in parts by one thread per BLAS
    thread (NumPy's reductions release the GIL).
    ``blas_gemv``: the array as a ``[n, 128]`` matrix times a vector, BLAS's
    threaded matrix-vector product, usually the fastest plain reader on the CPU.
    ``best`` is the largest: the honest reference for a percentage.
    """
    a = np.ones(nbytes // 4, dtype=np.float32)
    workers = get_backend("numpy").thread_count() or 1  # as many parts as NumPy's workers
    parts = np.array_split(a, workers)

    def best_time(fn):
        fn()
        return min(_timed(fn) for _ in range(repeats))

    out = {"numpy_sum_1thread": a.nbytes / best_time(a.sum)}
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            out["numpy_sum_threads"] = a.nbytes / best_time(lambda: list(pool.map(np.sum, parts)))
    matrix, x = a.reshape(-1, 128), np.ones(128, dtype=np.float32)
    out["blas_gemv"] = a.nbytes / best_time(lambda: matrix @ x)
    out["best"] = max(out.values())
    return out


def matmul_rate(n: int = 2048, repeats: int = 5) -> float:
    """The machine's float32 matrix-multiply rate in FLOP/s: NumPy's ``[n, n] @ [n, n]``
    (BLAS's sgemm with its threads as they are), best of ``repeats``: the yardstick of
    prefill attention, whose work is two matmuls per key block (the float16 and bfloat16
    caches are computed in float32 too)."""
    a = np.ones((n, n), dtype=np.float32)
    a @ a
    return 2 * n ** 3 / min(_timed(lambda: a @ a) for _ in range(repeats))


def token_bytes(kv_heads: int, head_dim: int, dtype, kv_dtype=None) -> int:
    """Bytes of K plus V for one token of one layer as stored (``kv_dtype``: the codes plus
    the token's float32 scales, ``2 x Hkv x (d + 4)``)."""
    # the one formula (gqakv.storage.store)
    return _store.StorageSpec.of(dtype, kv_dtype=kv_dtype).bytes_per_slot(kv_heads, head_dim)


def concat_bytes(lens_before, n_new, tok_bytes: int) -> int:
    """Bytes a concatenation-grown cache copies for one append: every row that grows
    is rebuilt, copying all the tokens it already held (K and V)."""
    return int(sum(int(L) for L, n in zip(lens_before, n_new) if n > 0)) * tok_bytes


def torch_sdpa(q, k_buf, v_buf, lens, n_new):
    """torch's SDPA (enable_gqa=True) over views of the same buffers, sliced to each row's
    live length, with the bottom-right causal mask for chunks. Returns a callable.

    Rows of equal length and chunk size go in one batched call; ragged rows one call
    each (torch has no ragged lengths). Raises ImportError without torch.
    """
    import torch
    import torch.nn.functional as F

    Q, K, V = (_as_torch(x) for x in (q, k_buf, v_buf))
    lens, n_new = [int(x) for x in lens], [int(x) for x in n_new]

    def mask(n, L):
        return None if n == 1 else torch.ones(n, L, dtype=torch.bool, device=K.device).tril(L - n)

    if len(set(lens)) == 1 and len(set(n_new)) == 1:
        L, n = lens[0], n_new[0]
        m = mask(n, L)
        return lambda: F.scaled_dot_product_attention(
            Q[:, :, :n], K[:, :, :L], V[:, :, :L], attn_mask=m, enable_gqa=True)
    calls = [(b, n, L, mask(n, L)) for b, (n, L) in enumerate(zip(n_new, lens)) if n > 0]

    def run():
        for b, n, L, m in calls:
            F.scaled_dot_product_attention(Q[b:b + 1, :, :n], K[b:b + 1, :, :L], V[b:b + 1, :, :L],
                                           attn_mask=m, enable_gqa=True)
    return run


def _as_torch(x):
    """A torch tensor sharing x's memory (NumPy via from_numpy; others via DLPack)."""
    import torch

    if isinstance(x, np.ndarray):
        if x.dtype.name == "bfloat16":  # ml_dtypes bfloat16 has torch.bfloat16's bits
            return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(x)
    return torch.from_dlpack(x)


#: How to install the torch peer: the exact CPU pin of the test extra (a range admitting newer
#: releases pulls multi-GB CUDA builds); the torch backend's own hint.
TORCH_INSTALL = "pip install torch==2.13.0 (CPU build) or a CUDA build from pytorch.org"
#: The pip command that installs the ONNX Runtime peer (the ``compare`` extra).
ORT_INSTALL = "pip install 'gqakv[compare]'  (or: pip install onnx onnxruntime)"


def import_onnxruntime():
    """``(onnx, onnxruntime)``, or ImportError whose one-line message names the pip command."""
    try:
        import onnx
        import onnxruntime
    except ImportError as exc:
        raise ImportError(f"--compare onnxruntime needs the onnx and onnxruntime packages ({exc.name} "
                          f"is missing): {ORT_INSTALL}") from None
    return onnx, onnxruntime


def onnxruntime_gqa(q, k_new, v_new, k_buf, v_buf, past_lens, *, threads: int | None = None,
                    spinning: bool = True):
    """ONNX Runtime's ``com.microsoft.GroupQueryAttention`` (CPU provider) for one step of
    T new tokens per row (T = 1: a decode step; T > 1: a prefill chunk): row b's new
    token t attends, bottom-right causal, over its ``past_lens[b]`` cached tokens and new
    tokens 0..t, and the op writes the new K/V from position ``past_lens[b]`` on. Returns
    ``(run, out)``: ``run()`` executes the step, ``out`` is ``[B, Hq, T, d]`` (a view of
    the op's ``[B, T, Hq * d]`` output buffer, refreshed by every ``run()``).

    Shapes: q ``[B, Hq, T, d]``; k_new, v_new ``[B, Hkv, T, d]`` (read once here: for
    T > 1 the op's token-major copies are made here, outside ``run``); k_buf, v_buf
    ``[B, Hkv, max_len, d]``, float32 or float16 NumPy arrays, C-contiguous (ONNX
    Runtime's past/present layout, BNSH, is gqakv's contiguous cache layout), written in
    place: past and present are bound to one buffer of ``max_len`` tokens (ONNX Runtime
    then appends in place instead of copying the cache). ``seqlens_k`` is
    ``past_lens + T - 1`` (the op wants total length - 1) and ``total_sequence_length``
    ``max(past_lens) + T``; no rotary embedding, scale ``1/sqrt(d)``. ONNX Runtime 1.32
    refuses T > 1 over a past at B > 1 (its error, from ``run()``). ``threads``: ONNX
    Runtime's intra-op threads; ``spinning``: whether they spin while waiting for work
    (ONNX Runtime's default, kept: measured 1.2x faster than without on this loaded
    machine, and the peer gets its best settings). Raises ImportError (with the pip
    command) without onnx/onnxruntime, ValueError for another dtype or layout.
    """
    onnx, ort = import_onnxruntime()
    from onnx import TensorProto, helper

    elem = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}.get(np.dtype(k_buf.dtype).name)
    if elem is None:
        raise ValueError(f"onnxruntime's GroupQueryAttention on the CPU takes float32 or float16, "
                         f"not {np.dtype(k_buf.dtype).name}")
    B, Hkv, M, d = k_buf.shape
    Hq = q.shape[1]
    T = q.shape[2] if q.ndim == 4 else 0
    past_lens = np.asarray(past_lens, dtype=np.int64)
    arrays = {"query": q, "key": k_new, "value": v_new, "past_key": k_buf, "past_value": v_buf}
    for name, a in arrays.items():
        if not isinstance(a, np.ndarray) or a.dtype != k_buf.dtype or not a.flags.c_contiguous:
            raise ValueError(f"onnxruntime_gqa: {name} must be a C-contiguous NumPy array of "
                             f"{k_buf.dtype}, got {type(a).__name__} "
                             f"{getattr(a, 'dtype', '?')}")
    if T < 1 or q.shape != (B, Hq, T, d) or k_new.shape != (B, Hkv, T, d) \
            or v_new.shape != k_new.shape or v_buf.shape != k_buf.shape or Hq % Hkv:
        raise ValueError(f"onnxruntime_gqa: shapes q {q.shape}, k_new {k_new.shape}, v_new "
                         f"{v_new.shape}, buffers {k_buf.shape}/{v_buf.shape} are not one step "
                         "of T >= 1 new tokens per row")
    if past_lens.shape != (B,) or past_lens.min(initial=0) < 0 or past_lens.max(initial=0) > M - T:
        raise ValueError(f"onnxruntime_gqa: past_lens={past_lens.tolist()} must be [B={B}] ints "
                         f"in [0, max_len - T = {M - T}] (room for the {T} new tokens)")

    def info(name, shape, kind=elem):
        return helper.make_tensor_value_info(name, kind, list(shape))

    node = helper.make_node(
        "GroupQueryAttention", domain="com.microsoft", num_heads=Hq, kv_num_heads=Hkv,
        scale=1.0 / math.sqrt(d), do_rotary=0,
        inputs=["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"],
        outputs=["output", "present_key", "present_value"])
    graph = helper.make_graph(
        [node], "gqakv_compare_decode",
        [info("query", (B, T, Hq * d)), info("key", (B, T, Hkv * d)), info("value", (B, T, Hkv * d)),
         info("past_key", k_buf.shape), info("past_value", v_buf.shape),
         info("seqlens_k", (B,), TensorProto.INT32), info("total_sequence_length", (1,), TensorProto.INT32)],
        [info("output", (B, T, Hq * d)), info("present_key", k_buf.shape),
         info("present_value", v_buf.shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8  # readable by every onnxruntime since 1.10
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = int(threads or 0)
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    try:
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # e.g. an onnxruntime without this op or dtype on the CPU
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"onnxruntime {ort.__version__} cannot run GroupQueryAttention in "
                         f"{np.dtype(k_buf.dtype).name} on the CPU ({first})") from None

    def token_major(x, heads):  # [B, heads, T, d] -> the op's [B, T, heads * d] (a view at T = 1)
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(B, T, heads * d)

    out = np.empty((B, T, Hq * d), dtype=k_buf.dtype)
    values = {
        "query": token_major(q, Hq), "key": token_major(k_new, Hkv),
        "value": token_major(v_new, Hkv), "past_key": k_buf, "past_value": v_buf,
        "seqlens_k": (past_lens + T - 1).astype(np.int32),
        "total_sequence_length": np.array([int(past_lens.max(initial=0)) + T], dtype=np.int32),
    }
    # OrtValues over the NumPy memory (no copies); present_* bound to the past_* buffers.
    ort_values = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in values.items()}
    binding = sess.io_binding()
    for name, value in ort_values.items():
        binding.bind_ortvalue_input(name, value)
    binding.bind_ortvalue_output("output", ort.OrtValue.ortvalue_from_numpy(out))
    binding.bind_ortvalue_output("present_key", ort_values["past_key"])
    binding.bind_ortvalue_output("present_value", ort_values["past_value"])

    def run():
        sess.run_with_iobinding(binding)

    setattr(run, "_keep", (values, ort_values, sess))  # the memory the binding points at
    return run, out.reshape(B, T, Hq, d).transpose(0, 2, 1, 3)


def compare_onnxruntime(cache, heads: int, *, seed: int = 0, rounds: int = 5, block_s: float = 0.1) -> dict:
    """gqakv's decode step against ONNX Runtime's GroupQueryAttention on the same state.

    From ``cache`` (a contiguous, unquantized KVCache on a backend holding NumPy arrays,
    every row with at least one token), each row's last token is dropped, and both sides
    run one decode step from there: a new token's K/V written at ``lens - 1`` and its
    ``heads`` query heads attending over the row (gqakv: ``append`` + ``gqa_attention``,
    then ``truncate`` back, outside the timing; ONNX Runtime: one GroupQueryAttention call
    over its own copy of the buffers, past and present sharing them). The outputs are
    checked to agree first (ValueError otherwise); then both are timed in alternating
    blocks with the same number of threads. ``ratio`` is ONNX Runtime time / gqakv time
    (above 1: gqakv is faster), on the medians.
    """
    import_onnxruntime()
    backend = cache.backend
    if cache.store.kind != _store.CONTIGUOUS or cache.store.quantized:
        raise ValueError("--compare onnxruntime reads a contiguous cache of float32 or float16 values; "
                         "it cannot run with --page-size or --kv-dtype")
    if not isinstance(cache.k, np.ndarray):
        raise ValueError(f"--compare onnxruntime needs a backend holding NumPy arrays (numpy, numba), "
                         f"got backend {backend.name!r}")
    if cache.dtype not in ("float32", "float16"):
        raise ValueError(f"--compare onnxruntime: onnxruntime's GroupQueryAttention on the CPU takes "
                         f"float32 or float16, got --dtype {cache.dtype}")
    lens = cache.host_lens.copy()
    if lens.min(initial=1) < 1:
        raise ValueError(f"compare_onnxruntime: every row needs a token to re-decode, lens={lens.tolist()}")
    B, Hkv, d = cache.batch, cache.kv_heads, cache.head_dim
    rows, base = np.arange(B), lens - 1
    rng = np.random.default_rng(seed)

    def draw(h):
        return rng.standard_normal((B, h, 1, d), dtype=np.float32).astype(cache.dtype)

    q, k_new, v_new = draw(heads), draw(Hkv), draw(Hkv)
    ones = np.ones(B, dtype=np.int64)
    cache.truncate(rows, base)
    try:
        threads = backend_threads(backend)
        k_ort, v_ort = np.ascontiguousarray(cache.k), np.ascontiguousarray(cache.v)  # ORT's own copies
        ort_step, ort_out = onnxruntime_gqa(q, k_new, v_new, k_ort, v_ort, base, threads=threads)

        def gqakv_step():
            cache.append(k_new, v_new, ones)
            return gqa_attention(q, cache, ones)

        # -- agreement: both outputs as close to the float64 result as FlashAttention's rule
        # allows (2x the error of a plain float32 computation rounded to dtype, + 1e-6), and the
        # new K/V written where gqakv wrote them
        ours = np.asarray(gqakv_step(), dtype=np.float64)
        cache.truncate(rows, base)
        ort_step()
        theirs = np.asarray(ort_out, dtype=np.float64)
        exact, plain = decode_reference(q, cache.k, cache.v, lens)  # the appended token is in place
        tol = 2 * float(np.abs(plain - exact).max()) + 1e-6
        err_g, err_o = (float(np.abs(x - exact).max()) for x in (ours, theirs))
        written = all(np.array_equal(buf[b, :, base[b]], new[b, :, 0])
                      for buf, new in ((k_ort, k_new), (v_ort, v_new)) for b in range(B))
        if not (err_g <= tol and err_o <= tol and written):
            raise ValueError(f"onnxruntime's GroupQueryAttention and gqakv disagree on this decode step "
                             f"(max |error| against float64: onnxruntime {err_o:.3g}, gqakv {err_g:.3g}, "
                             f"allowed {tol:.3g}; new K/V written at the right slots: {written}): "
                             "not timing different computations")

        def gqakv_timed():
            gqakv_step()
            cache.truncate(rows, base)  # O(1) bookkeeping: back to the same state

        times = alternating_blocks({"gqakv": gqakv_timed, "onnxruntime": ort_step}, backend,
                                   rounds=rounds, block_s=block_s)
    finally:  # success or not, the cache ends as documented: every row's lengths as they
        # started, its last token replaced by the step's new one
        cache.truncate(rows, base)
        cache.append(k_new, v_new, ones)
    import onnxruntime

    return {"decode": {"batch": B, "lens": lens.tolist(), "dtype": cache.dtype, "threads": threads,
                       "max_abs_difference": float(np.abs(ours - theirs).max()),
                       "error_gqakv": err_g, "error_onnxruntime": err_o, "tolerance": tol, **{f"{k}_s": v["median_s"]
                       for k, v in times.items()}, "blocks": times,
                       "ratio": times["onnxruntime"]["median_s"] / times["gqakv"]["median_s"]},
            "onnxruntime": f"onnxruntime {onnxruntime.__version__}, CPUExecutionProvider, "
                           f"{threads} intra-op threads"}


def decode_reference(q, k, v, lens):
    """One decode step computed directly: ``(exact, plain)``, ``[B, Hq, 1, d]`` float64 each.

    q ``[B, Hq, 1, d]``; k, v ``[B, Hkv, >= max(lens), d]`` NumPy arrays; row b's query
    attends over its ``lens[b]`` keys (the newest included). ``exact``: in float64.
    ``plain``: the same written plainly in float32 (scores, softmax, weighted sum through
    NumPy's matmul) and rounded to q's dtype, the yardstick for a low-precision error.
    One (row, KV head) at a time, so at most one row's head is converted at once."""
    B, Hq, _, d = q.shape
    G, scale = Hq // k.shape[1], 1.0 / math.sqrt(d)
    exact = np.zeros((B, Hq, 1, d))
    plain = np.zeros((B, Hq, 1, d), dtype=np.float32)
    for b in range(B):
        for h in range(k.shape[1]):
            heads = slice(h * G, (h + 1) * G)
            for out, ft in ((exact, np.float64), (plain, np.float32)):
                keys, vals = k[b, h, :lens[b]].astype(ft), v[b, h, :lens[b]].astype(ft)
                s = keys @ q[b, heads, 0].astype(ft).T * ft(scale)  # [L, G]
                p = np.exp(s - s.max(axis=0))
                out[b, heads, 0] = (p.T @ vals) / p.sum(axis=0)[:, None]
    return exact, plain.astype(q.dtype).astype(np.float64)


def backend_threads(backend) -> int:
    """The threads gqakv's CPU backend runs a call on (the peer gets as many): the
    backend's ``thread_count`` (1 for a backend that does not thread)."""
    return backend.thread_count() or 1


def median_time(fn, backend, repeats: int = 5) -> float:
    """Median wall time of ``fn()`` after one warm-up call, synchronizing the backend."""
    fn()
    backend.synchronize()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        backend.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


# -- the workload --------------------------------------------------------------------------

@dataclass
class Config:
    batch: int = 8
    # Ragged on purpose: an 8k-token row beside a 100-token one.
    prompt_lens: tuple[int, ...] = (8192, 4096, 3000, 2048, 1024, 512, 256, 100)
    chunk: int = 512
    steps: int = 1024
    heads: int = LLAMA_8B["heads"]
    kv_heads: int = LLAMA_8B["kv_heads"]
    head_dim: int = LLAMA_8B["head_dim"]
    dtype: str = "float32"
    backend: str | None = None
    seed: int = 0
    page_size: int | None = None  # a paged cache (gqakv.PagedKVCache) with pages of this size
    kv_dtype: str | None = None  # K/V stored quantized: "int8" or "float8_e4m3fn"

    def row_prompts(self) -> list[int]:
        """Prompt length of each row: the given lengths, cycled over the batch."""
        return [self.prompt_lens[b % len(self.prompt_lens)] for b in range(self.batch)]


@dataclass
class Phase:
    calls: int = 0
    append_s: float = 0.0
    attention_s: float = 0.0
    tokens: int = 0
    kv_bytes_read: int = 0  # live K/V bytes the attention calls read
    flops: float = 0.0  # 4 * Hq * d per visible query-key pair
    concat_bytes: int = 0  # what a concatenation-grown cache would have copied


@dataclass
class Result:
    config: dict
    backend: str
    device: str  # where the cache lives: "cpu", "cuda:0", ...
    threads: int | None  # the threads gqakv's CPU backend runs a call on (None: a GPU, or not set by gqakv)
    threads_detail: str  # how those threads are set (numpy: BLAS library and kernel), or ""
    cache_bytes: int
    live_bytes: int
    contiguous_bytes: int = 0  # a contiguous cache of the same rows at max_len
    pages: int | None = None  # pages in a paged cache's pool
    prefill: Phase = field(default_factory=Phase)
    decode: Phase = field(default_factory=Phase)
    wall_s: float = 0.0
    _cache: Any = field(default=None, repr=False, compare=False)  # the run's cache, kept for --compare


class _Progress:
    """One updating line on a terminal, a few plain lines otherwise; nothing when quiet."""

    def __init__(self, enabled: bool, stream=None):
        self.enabled, self.stream = enabled, stream or sys.stderr
        self.tty = enabled and self.stream.isatty()
        self._last: dict[str, int] = {}

    def __call__(self, phase: str, i: int, total: int) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write(f"\r  {phase}: {i}/{total}")
            if i == total:
                self.stream.write("\n")
            self.stream.flush()
        else:
            quarter = (4 * i) // total
            if i == total or quarter > self._last.get(phase, 0):
                self._last[phase] = quarter
                print(f"  {phase}: {i}/{total}", file=self.stream, flush=True)


def prefill_chunk(cfg: Config) -> int:
    """The prefill chunk actually used: ``cfg.chunk``, clamped to the longest prompt."""
    return max(1, min(cfg.chunk, max(cfg.row_prompts(), default=1)))


def make_cache(cfg: Config):
    """The workload's KVCache: every row holds its prompt plus ``cfg.steps`` tokens. With
    ``cfg.page_size``, a PagedKVCache whose pool holds exactly the pages the run's rows end
    with (``sum(ceil((prompt + steps) / page_size))``): memory follows the live tokens.

    Raises BackendError (backend unknown or unable to run) or MemoryError (too big) before
    anything has run."""
    max_len = max(cfg.row_prompts(), default=0) + cfg.steps
    if cfg.page_size is not None:
        pages = sum(pages_for(p + cfg.steps, cfg.page_size) for p in cfg.row_prompts())
        return PagedKVCache(cfg.batch, cfg.kv_heads, max_len, cfg.head_dim, dtype=cfg.dtype,
                            backend=cfg.backend, page_size=cfg.page_size, num_pages=pages,
                            kv_dtype=cfg.kv_dtype)
    return KVCache(cfg.batch, cfg.kv_heads, max_len, cfg.head_dim, dtype=cfg.dtype,
                   backend=cfg.backend, kv_dtype=cfg.kv_dtype)


def run_workload(cfg: Config, progress=None, cache=None) -> Result:
    """Prefill every row's prompt in chunks, then decode ``cfg.steps`` tokens per row
    (into ``cache``, an empty ``make_cache(cfg)``, made here when not given)."""
    progress = progress or (lambda *a: None)
    prompts = cfg.row_prompts()
    B, Hq, Hkv, d = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim
    cache = make_cache(cfg) if cache is None else cache
    backend = cache.backend
    tok = token_bytes(Hkv, d, cfg.dtype, cfg.kv_dtype)  # as stored: codes + scales if quantized
    rng = np.random.default_rng(cfg.seed)

    def data(T, heads):  # one random block, reused: values do not change the work
        return backend.from_numpy(rng.standard_normal((B, heads, T, d), dtype=np.float32), cfg.dtype)

    device = cache_device(cache)
    res = Result(config=asdict(cfg), backend=backend.name, device=device,
                 threads=thread_count(backend, device), threads_detail=_threads_line(backend),
                 cache_bytes=cache.nbytes, live_bytes=0,
                 contiguous_bytes=KVCache.nbytes_for(B, Hkv, cache.max_len, d, cfg.dtype,
                                                     kv_dtype=cfg.kv_dtype),
                 pages=cache.num_pages if cache.store.kind == "paged" else None)
    t_start = time.perf_counter()

    def step(phase: Phase, k_new, q, n_new):
        before = cache.host_lens.copy()
        t0 = time.perf_counter()
        cache.append(k_new, k_new, n_new)
        backend.synchronize()
        t1 = time.perf_counter()
        gqa_attention(q, cache, n_new)
        backend.synchronize()
        t2 = time.perf_counter()
        lens = cache.host_lens
        phase.calls += 1
        phase.append_s += t1 - t0
        phase.attention_s += t2 - t1
        phase.tokens += int(sum(n_new))
        phase.kv_bytes_read += int(sum(int(L) for L, n in zip(lens, n_new) if n > 0)) * tok
        # query t of a row sees before + t + 1 keys
        phase.flops += 4.0 * Hq * d * sum(n * int(b) + n * (n + 1) / 2 for b, n in zip(before, n_new))
        phase.concat_bytes += concat_bytes(before, n_new, tok)

    chunk = prefill_chunk(cfg)
    n_chunks = math.ceil(max(prompts, default=0) / chunk)
    k_chunk, q_chunk = data(chunk, Hkv), data(chunk, Hq)
    for c in range(n_chunks):
        n_new = np.array([min(chunk, max(0, p - c * chunk)) for p in prompts], dtype=np.int64)
        step(res.prefill, k_chunk, q_chunk, n_new)
        progress("prefill chunks", c + 1, n_chunks)
    k_one, q_one = data(1, Hkv), data(1, Hq)
    ones = np.ones(B, dtype=np.int64)
    for s in range(cfg.steps):
        step(res.decode, k_one, q_one, ones)
        progress("decode steps", s + 1, cfg.steps)
    res.wall_s = time.perf_counter() - t_start
    res.live_bytes = int(cache.host_lens.sum()) * tok
    res._cache = cache  # kept for --compare
    return res


def cache_device(cache) -> str:
    """Where the cache's buffers live: ``"cpu"`` for NumPy arrays, else the array's device
    (``"cpu"``, ``"cuda:0"``: torch's spelling; CuPy's device as ``"cuda:N"``)."""
    if isinstance(cache.k, np.ndarray):
        return "cpu"
    dev = getattr(cache.k, "device", None)
    if dev is None:
        return "cpu"
    if not hasattr(dev, "type") and hasattr(dev, "id"):  # a CuPy Device
        return f"cuda:{dev.id}"
    return str(dev)


def thread_count(backend, device: str) -> int | None:
    """The threads a call runs on (the JSON field ``threads``): the backend's
    ``thread_count`` on the CPU; None on a GPU or for a backend gqakv does not thread."""
    if device != "cpu":
        return None
    return backend.thread_count()


def _threads_line(backend) -> str:
    """How the backend threads (numpy: its BLAS library and kernel, held to one thread
    while its own workers run), or "". Raises ValueError for a bad GQAKV_NUM_THREADS
    (``run`` calls it before any output)."""
    return backend.threads_line()


# -- the command ---------------------------------------------------------------------------

def add_arguments(parser) -> None:
    c = Config()
    parser.add_argument("--batch", type=int, default=c.batch, help="rows (default %(default)s)")
    parser.add_argument("--prompt-lens", default=",".join(map(str, c.prompt_lens)),
                        help="comma-separated prompt lengths, cycled over the rows "
                             "(default %(default)s)")
    parser.add_argument("--chunk", type=int, default=c.chunk, help="prefill chunk (default %(default)s)")
    parser.add_argument("--steps", type=int, default=c.steps, help="decode steps (default %(default)s)")
    parser.add_argument("--heads", type=int, default=c.heads, help="query heads (default %(default)s)")
    parser.add_argument("--kv-heads", type=int, default=c.kv_heads, help="KV heads (default %(default)s)")
    parser.add_argument("--head-dim", type=int, default=c.head_dim, help="head dim (default %(default)s)")
    parser.add_argument("--dtype", default=c.dtype,
                        choices=["float32", "float16", "bfloat16", "float64"])
    parser.add_argument("--backend", default=None,
                        help="backend name (default: GQAKV_BACKEND, else the automatic choice)")
    parser.add_argument("--seed", type=int, default=c.seed)
    parser.add_argument("--page-size", type=int, default=None,
                        help="run on a paged cache (gqakv.PagedKVCache) with pages of this many "
                             "tokens, its pool sized to the run's final rows")
    parser.add_argument("--kv-dtype", choices=sorted(_codecs.names()), default=None,
                        help="store K and V quantized (int8 / float8_e4m3fn: 8-bit codes plus a "
                             "float32 scale per token and KV head; int8_g32, int4_g32, int4_g64, "
                             "int4_g32_rotated: a float32 scale per block of 32 or 64 values "
                             "along d, see docs/guides/storage.md); --dtype stays the dtype of "
                             "q, new K/V and the output. Byte counts and bandwidth are of what "
                             "is stored")
    parser.add_argument("--compare", choices=["torch", "onnxruntime"], default=None,
                        help="torch: also time torch SDPA (enable_gqa) over the same live views; "
                             "onnxruntime: ONNX Runtime's GroupQueryAttention (CPU provider, "
                             "float32/float16) against gqakv's decode step on the final rows, "
                             "outputs checked to agree first (needs: " + ORT_INSTALL + ")")
    parser.add_argument("--no-bandwidth", action="store_true",
                        help="skip measuring the machine's yardsticks: read bandwidth and float32 "
                             "matmul rate (about 2 s)")
    parser.add_argument("--host-time", action="store_true",
                        help="also time a 32-layer decode step (B=8, Hkv=8, G=4, d=64, 16 live "
                             "tokens) as it is and with the backend's kernels no-op'd: the host "
                             "time per layer, in a tight loop and with the caches cold (32 MiB "
                             "read before each layer, as a model's matmuls leave them); over "
                             "--page-size pages and in --kv-dtype codes when given")
    parser.add_argument("--mixed-batch", action="store_true",
                        help="also time a mixed batch (1 row attending a 512-token prefill chunk, "
                             "31 decoding one token, rows of 2,048 tokens; Hkv=8, G=4, d=64): "
                             "packed, padded and as two separate calls")
    parser.add_argument("--shared-prefix", type=int, default=None, metavar="N",
                        help="also time one decode step of --shared-rows rows sharing an N-token "
                             "prefix (forked: its pages read once, gqakv.ops.shared_prefix), each "
                             "with --shared-suffix tokens of its own, against the same rows "
                             "holding copies of the prefix (--heads/--kv-heads/--head-dim/--dtype, "
                             "--page-size (default 16), --kv-dtype); alternating, one ratio")
    parser.add_argument("--shared-rows", type=int, default=SHARED_PREFIX["rows"],
                        help="rows of --shared-prefix (default %(default)s)")
    parser.add_argument("--shared-suffix", type=int, default=SHARED_PREFIX["suffix"],
                        help="each row's own tokens past the shared prefix (default %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def _config(args) -> Config:
    try:
        prompts = tuple(int(x) for x in str(args.prompt_lens).split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--prompt-lens must be comma-separated ints >= 1, got {args.prompt_lens!r}") from None
    checks = [("--batch", args.batch, 1), ("--chunk", args.chunk, 1), ("--steps", args.steps, 0),
              ("--heads", args.heads, 1), ("--kv-heads", args.kv_heads, 1), ("--head-dim", args.head_dim, 1)]
    for name, value, low in checks:
        if value < low:
            raise UsageError(f"{name} must be >= {low}, got {value}")
    if not prompts or min(prompts) < 1:
        raise UsageError(f"--prompt-lens must be comma-separated ints >= 1, got {args.prompt_lens!r}")
    page_size = getattr(args, "page_size", None)
    if page_size is not None and page_size < 1:
        raise UsageError(f"--page-size must be >= 1, got {page_size}")
    if page_size is not None and args.compare == "torch":
        raise UsageError("--compare torch reads contiguous rows; it cannot run with --page-size")
    kv_dtype = getattr(args, "kv_dtype", None)
    if kv_dtype is not None and args.dtype == "float64":
        raise UsageError(f"--kv-dtype {kv_dtype} needs --dtype float32, float16 or bfloat16, "
                         "got float64 (the reference precision is never quantized)")
    if kv_dtype is not None and args.compare == "torch":
        raise UsageError(f"--compare torch reads K/V as {args.dtype} values; it cannot run with "
                         f"--kv-dtype {kv_dtype} (the cache holds codes and scales)")
    if args.compare == "torch":
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            raise UsageError(f"--compare torch needs torch ({exc}): {TORCH_INSTALL}") from None
    if args.compare == "onnxruntime":
        if page_size is not None or kv_dtype is not None:
            raise UsageError("--compare onnxruntime reads a contiguous cache of --dtype values; it "
                             "cannot run with --page-size or --kv-dtype")
        if args.dtype not in ("float32", "float16"):
            raise UsageError(f"--compare onnxruntime: onnxruntime's GroupQueryAttention on the CPU "
                             f"takes --dtype float32 or float16, got {args.dtype}")
        try:
            import_onnxruntime()
        except ImportError as exc:
            raise UsageError(str(exc)) from None
    if args.heads % args.kv_heads:
        raise UsageError(f"--heads={args.heads} must be a multiple of --kv-heads={args.kv_heads}")
    shared = getattr(args, "shared_prefix", None)
    if shared is not None:
        for name, value, low in (("--shared-prefix", shared, 1),
                                 ("--shared-rows", args.shared_rows, 2),
                                 ("--shared-suffix", args.shared_suffix, 0)):
            if value < low:
                raise UsageError(f"{name} must be >= {low}, got {value}")
    return Config(batch=args.batch, prompt_lens=prompts, chunk=args.chunk, steps=args.steps,
                  heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                  dtype=args.dtype, backend=args.backend, seed=args.seed, page_size=page_size,
                  kv_dtype=kv_dtype)


def run(args) -> int:
    t_start = time.perf_counter()
    cfg = _config(args)
    # Everything that can fail on the user's input fails here, before any output: the
    # backend (--backend, GQAKV_BACKEND), the cache's size, GQAKV_NUM_THREADS.
    cache = make_cache(cfg)
    if args.shared_prefix is not None:
        _check_shared_prefix(args, cfg, cache.backend)
    _threads_line(cache.backend)
    if args.compare == "onnxruntime" and not isinstance(cache.k, np.ndarray):
        raise ValueError(f"--compare onnxruntime needs a backend holding NumPy arrays (numpy, "
                         f"numba), got --backend {cache.backend.name}")
    progress = _Progress(not args.quiet and not args.json)
    if not args.json:
        prompts, chunk = cfg.row_prompts(), prefill_chunk(cfg)
        clamped = f" (--chunk {cfg.chunk} clamped to the longest prompt)" if chunk != cfg.chunk else ""
        print(f"gqakv bench: one attention layer, Hq={cfg.heads} Hkv={cfg.kv_heads} d={cfg.head_dim} "
              f"(Llama-3.1-8B: 32/8/128), {cfg.dtype}")
        if cfg.kv_dtype:
            tok = token_bytes(cfg.kv_heads, cfg.head_dim, cfg.dtype, cfg.kv_dtype)
            print(f"  K/V stored as {cfg.kv_dtype} with per-token float32 scales: {tok:,} bytes "
                  f"per token (codes + scales) against "
                  f"{token_bytes(cfg.kv_heads, cfg.head_dim, cfg.dtype):,} as {cfg.dtype}")
        print(f"  batch {cfg.batch}, prompts {'/'.join(map(str, prompts))} tokens, prefill chunk "
              f"{chunk}{clamped}, then {cfg.steps} decode steps per row", flush=True)
    res = run_workload(cfg, progress, cache=cache)
    t_bw = time.perf_counter()
    bw = None if args.no_bandwidth else read_bandwidth()
    matmul = None if args.no_bandwidth else matmul_rate()
    t_compare = time.perf_counter()
    compare = (_compare_torch(res, cfg) if args.compare == "torch" else
               compare_onnxruntime(res._cache, cfg.heads, seed=cfg.seed + 1)
               if args.compare == "onnxruntime" else None)
    host = None
    if args.host_time:
        from .host_time import HOST_EVICT_BYTES, step_host_time

        # as a tight loop leaves the caches, then cold as a model's matmuls leave them
        host = [step_host_time(cache.backend, page_size=cfg.page_size, kv_dtype=cfg.kv_dtype),
                step_host_time(cache.backend, evict_bytes=HOST_EVICT_BYTES,
                               page_size=cfg.page_size, kv_dtype=cfg.kv_dtype)]
    mixed = None
    if args.mixed_batch:
        from .mixed_batch import mixed_batch_times

        mixed = mixed_batch_times(cache.backend, **MIXED_BATCH)
    shared = None
    if args.shared_prefix is not None:
        from .shared_prefix_times import shared_prefix_times

        shared = shared_prefix_times(
            cache.backend, prefix=args.shared_prefix, rows=args.shared_rows,
            suffix=args.shared_suffix, kv_heads=cfg.kv_heads, group=cfg.heads // cfg.kv_heads,
            head_dim=cfg.head_dim, dtype=cfg.dtype, page_size=cfg.page_size or 16,
            kv_dtype=cfg.kv_dtype, **SHARED_PREFIX_TIMING)
    t_end = time.perf_counter()
    times = {"workload_s": res.wall_s, "bandwidth_s": t_compare - t_bw if bw else None,
             "compare_s": t_end - t_compare if compare else None,
             # from the start of the command to the report: setup and allocation included
             "total_s": t_end - t_start}
    report = _report(res, bw, compare, times)
    report["matmul_flops_per_s"] = matmul
    if host is not None:
        report["host_time"], report["host_time_cold"] = host
    if mixed is not None:
        report["mixed_batch"] = mixed
    if shared is not None:
        report["shared_prefix"] = shared
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
        if host is not None:
            for h in host:
                _print_host_time(h)
        if mixed is not None:
            _print_mixed_batch(mixed)
        if shared is not None:
            _print_shared_prefix(shared)
    return 0


def _check_shared_prefix(args, cfg: Config, backend) -> None:
    """--shared-prefix's sizes against the plan's thresholds (``shared_prefix.decide``'s
    ``MIN_SHARED_TOKENS`` and ``min_saved_tokens``), before the workload runs: the rows
    share the prefix's full pages, and ``rows - 1`` of them save reading those."""
    from ..ops import shared_prefix as sp

    P = cfg.page_size or 16
    shared = args.shared_prefix // P * P
    saved = (args.shared_rows - 1) * shared
    least = sp.min_saved_tokens(backend, _store.StorageSpec.of(cfg.dtype, kv_dtype=cfg.kv_dtype),
                                cfg.head_dim)
    if shared < sp.MIN_SHARED_TOKENS or saved < least:
        raise UsageError(f"--shared-prefix {args.shared_prefix}: the shared plan would form no "
                         f"group ({args.shared_rows} rows share {shared} tokens of full pages, "
                         f"saving {saved} key reads; a group needs {sp.MIN_SHARED_TOKENS} shared "
                         f"tokens and {least} saved reads on {backend.name} over "
                         f"{cfg.kv_dtype or cfg.dtype}); give a longer prefix or more rows")


#: ``--shared-prefix``'s defaults (``gqakv.tools.shared_prefix_times`` keywords).
SHARED_PREFIX: dict[str, Any] = {"rows": 32, "suffix": 64}
#: How ``--shared-prefix`` times (``timing.alternating_blocks``: rounds, seconds per block).
SHARED_PREFIX_TIMING: dict[str, Any] = {"rounds": 5, "block_s": 0.2}


def _print_shared_prefix(s: dict) -> None:
    t = s["median_s"]
    kv = f", K/V {s['kv_dtype']}" if s["kv_dtype"] else ""
    print(f"shared prefix: {s['rows']} rows sharing a {s['prefix']}-token prefix, "
          f"{s['suffix']} tokens of their own, one decode token (Hkv={s['kv_heads']}, "
          f"G={s['group']}, d={s['head_dim']}, {s['dtype']}{kv}, pages of {s['page_size']}): "
          f"shared {t['shared'] * 1e3:.2f} ms = {s['shared_over_unshared']:.3f}x the unshared "
          f"copies' {t['unshared'] * 1e3:.2f} ms ({s['gflop']:.2f} GFLOP either way; "
          f"plans {s['plan_s']['shared'] * 1e3:.2f} / {s['plan_s']['unshared'] * 1e3:.2f} ms; "
          f"outputs differ by {s['max_abs_diff']:.2g})")
    print(f"  {s['decision']}")


#: ``--mixed-batch``'s batch (``gqakv.tools.mixed_batch.mixed_batch_times`` keywords).
MIXED_BATCH: dict[str, Any] = {"decoders": 31, "chunk": 512, "row_len": 2048}


def _print_mixed_batch(m: dict) -> None:
    t, mib = m["median_s"], 1 << 20
    print(f"mixed batch: 1 x {m['chunk']}-token chunk + {m['decoders']} decode tokens over "
          f"{m['row_len']}-token rows, Hkv={m['kv_heads']}, G={m['group']}, d={m['head_dim']}, "
          f"{m['dtype']}: packed {t['packed'] * 1e3:.1f} ms = {m['packed_over_separate']:.2f}x "
          f"the separate calls' {t['separate'] * 1e3:.1f} ms; padded {t['padded'] * 1e3:.1f} ms = "
          f"{m['padded_over_separate']:.2f}x; queries {m['query_bytes']['packed'] / mib:.1f} MiB "
          f"packed, {m['query_bytes']['padded'] / mib:.1f} MiB padded")


def _print_host_time(h: dict) -> None:
    pages = (f", pages of {h['page_size']}" if h.get("page_size") else "") + (
        f", kv_dtype {h['kv_dtype']}" if h.get("kv_dtype") else "")
    shape = (f"{h['layers']}-layer decode step, B={h['batch']}, Hkv={h['kv_heads']}, G={h['group']}, "
             f"d={h['head_dim']}, {h['live']} live tokens, {h['dtype']}{pages}")
    caches = (f", caches cold ({h['evict_bytes'] >> 20} MiB read before each layer, untimed)"
              if h["evict_bytes"] else "")
    if h["host_s"] is None:
        print(f"host time: {shape}{caches}: step {h['step_s'] * 1e3:.2f} ms (the backend declares no "
              "kernel entries to exclude)")
        return
    print(f"host time: {shape}{caches}: step {h['step_s'] * 1e3:.2f} ms, kernels no-op'd "
          f"{h['host_s'] * 1e3:.2f} ms = {h['host_per_layer_us']:.0f} us of host work per layer")


def _compare_torch(res: Result, cfg: Config) -> dict:
    """Time gqakv and torch SDPA on the final cache: one decode step, one prefill chunk."""
    cache, backend = res._cache, res._cache.backend
    lens = cache.host_lens.copy()
    rng = np.random.default_rng(cfg.seed + 1)
    out: dict[str, Any] = {}
    # Prefill-shaped: each row's last `chunk` tokens as the queries (nothing is appended).
    chunk = max(1, min(cfg.chunk, int(lens.min())))
    for name, T in (("decode", 1), ("prefill_chunk", chunk)):
        q = backend.from_numpy(rng.standard_normal((cfg.batch, cfg.heads, T, cfg.head_dim),
                                                   dtype=np.float32), cfg.dtype)
        n_new = np.full(cfg.batch, T, dtype=np.int64)
        try:
            sdpa = torch_sdpa(q, cache.k, cache.v, lens, n_new)
        except Exception as exc:  # e.g. a backend whose arrays torch cannot view
            return {"error": f"torch cannot view {backend.name} arrays: {exc}"}
        t_g = median_time(lambda: gqa_attention(q, cache, n_new), backend, repeats=3)
        t_t = median_time(sdpa, backend, repeats=3)
        # peer time / gqakv time, as for onnxruntime: above 1, gqakv is faster
        out[name] = {"tokens_per_row": T, "gqakv_s": t_g, "torch_s": t_t, "ratio": t_t / t_g}
    import torch

    out["torch"] = f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    return out


def _report(res: Result, bw, compare, times: dict | None = None) -> dict:
    """The numbers of a run; ``times``: the seconds of each part of the command
    (workload_s, bandwidth_s, compare_s, total_s; ``wall_s`` is the workload alone)."""
    d = res.decode
    times = times or {"workload_s": res.wall_s, "bandwidth_s": None, "compare_s": None,
                      "total_s": res.wall_s}
    report = {
        "config": res.config, "backend": res.backend, "device": res.device, "threads": res.threads,
        "threads_detail": res.threads_detail,
        "cache_bytes": res.cache_bytes, "live_bytes": res.live_bytes, "wall_s": res.wall_s,
        "contiguous_bytes": res.contiguous_bytes, "pages": res.pages,
        # K + V bytes of one token as stored (codes + scales when quantized): every byte
        # count and the decode bandwidth are multiples of it
        "token_bytes": token_bytes(res.config["kv_heads"], res.config["head_dim"],
                                   res.config["dtype"], res.config.get("kv_dtype")),
        "times": times,
        "prefill": asdict(res.prefill), "decode": asdict(d),
        "concat_bytes": res.prefill.concat_bytes + d.concat_bytes,
        "decode_bytes_per_s": d.kv_bytes_read / d.attention_s if d.attention_s else None,
        "prefill_flops_per_s": (res.prefill.flops / res.prefill.attention_s
                                if res.prefill.attention_s else None),
        "read_bandwidth": bw, "compare": compare,
    }
    return report


def _print_report(r: dict) -> None:
    p, d = r["prefill"], r["decode"]
    kv = "K and V" if not r["config"].get("kv_dtype") else "K and V codes + scales"
    where = [r["device"]]
    if r["threads"] is not None:
        where.append(f"{r['threads']} thread{'s' if r['threads'] != 1 else ''}")
    detail = f"; {r['threads_detail']}" if r["threads_detail"] else ""
    print(f"\nbackend: {r['backend']} ({', '.join(where)}{detail})")
    print(f"cache: {human_bytes(r['cache_bytes'])} allocated once ({kv}), {human_bytes(r['live_bytes'])} "
          "live at the end")
    if r.get("pages") is not None:
        ps = r["config"]["page_size"]
        print(f"  paged: {r['pages']:,} pages of {ps} tokens ({r['cache_bytes']:,} bytes); a contiguous "
              f"cache of the same rows at max_len would allocate {r['contiguous_bytes']:,} bytes "
              f"({human_bytes(r['contiguous_bytes'])}, {r['contiguous_bytes'] / max(1, r['cache_bytes']):.2f}x)")
    print(f"\n{'phase':<20}{'calls':>7}{'tokens':>9}{'total s':>10}{'per call ms':>13}")
    for name, ph, what in (("prefill", p, "chunk"), ("decode", d, "step")):
        for part in ("append", "attention"):
            secs = ph[f"{part}_s"]
            per = 1e3 * secs / ph["calls"] if ph["calls"] else 0.0
            print(f"{name + ' ' + part:<20}{ph['calls']:>7}{ph['tokens']:>9}{secs:>10.3f}{per:>13.3f}")
    print("(the first appends also map the freshly allocated cache's pages into memory)")
    if r["prefill_flops_per_s"]:
        line = f"\nprefill attention: {r['prefill_flops_per_s'] / 1e9:.1f} GFLOP/s"
        if r.get("matmul_flops_per_s"):
            line += (f", {100 * r['prefill_flops_per_s'] / r['matmul_flops_per_s']:.0f}% of the float32 "
                     f"matmul rate ({r['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s, 2,048-square sgemm)")
        print(line)
    bw = r["read_bandwidth"]
    if r["decode_bytes_per_s"]:
        per_step = d["kv_bytes_read"] / d["calls"]
        stored = "K/V" if not r["config"].get("kv_dtype") else "K/V codes + scales"
        line = (f"decode attention: {r['decode_bytes_per_s'] / 1e9:.1f} GB/s of live {stored} "
                f"({human_bytes(per_step)} read per step)")
        if bw:
            line += (f",\n  {100 * r['decode_bytes_per_s'] / bw['best']:.0f}% of the best measured read "
                     f"bandwidth, {100 * r['decode_bytes_per_s'] / bw['numpy_sum_1thread']:.0f}% of one "
                     "core's NumPy sum")
        print(line)
    if bw:
        rates = ", ".join(f"{k.replace('_', ' ')} {v / 1e9:.1f} GB/s" for k, v in bw.items() if k != "best")
        print(f"read bandwidth (reading 256 MiB): {rates}")
    c = r["compare"]
    if c and "onnxruntime" in c:
        x = c["decode"]
        print(f"\nvs ONNX Runtime GroupQueryAttention, one decode step of the final rows "
              f"({c['onnxruntime']}):")
        print(f"  outputs agree: max |error| against float64 gqakv {x['error_gqakv']:.2g}, "
              f"onnxruntime {x['error_onnxruntime']:.2g} (allowed {x['tolerance']:.2g})")
        print(f"  decode step  gqakv {1e3 * x['gqakv_s']:8.3f} ms   onnxruntime "
              f"{1e3 * x['onnxruntime_s']:8.3f} ms   onnxruntime/gqakv {x['ratio']:.2f}x")
        print(f"  (ratio: peer time / gqakv time, above 1: gqakv is faster; medians of "
              f"{x['blocks']['gqakv']['blocks']} alternating blocks)")
    elif c:
        if "error" in c:
            print(f"torch comparison: {c['error']}")
        else:
            print(f"\nvs torch SDPA (enable_gqa=True) over the same live views ({c['torch']}):")
            for name in ("decode", "prefill_chunk"):
                x = c[name]
                label = "decode step" if name == "decode" else f"{x['tokens_per_row']}-token chunk"
                print(f"  {label:<18} gqakv {1e3 * x['gqakv_s']:8.2f} ms   torch {1e3 * x['torch_s']:8.2f} ms"
                      f"   torch/gqakv {x['ratio']:.2f}x")
            print("  (ratio: peer time / gqakv time, above 1: gqakv is faster)")
    cfg = r["config"]
    concat = r["concat_bytes"]
    tok = token_bytes(cfg["kv_heads"], cfg["head_dim"], cfg["dtype"], cfg.get("kv_dtype"))
    print(f"\nconcatenation: a cache grown by concatenation copies every cached token at each append;"
          f"\n  for this run it would have copied {concat:,} bytes ({human_bytes(concat)}) "
          f"= {concat / max(1, r['live_bytes']):.0f}x the final live cache; gqakv copied 0.")
    if (cfg["heads"], cfg["kv_heads"], cfg["head_dim"]) == (32, 8, 128):
        layers = LLAMA_8B["layers"]
        print(f"  across all {layers} layers of Llama-3.1-8B: {human_bytes(concat * layers)} "
              f"({tok * layers:,} bytes of K+V per token)")
    t = r["times"]
    parts = [f"workload {t['workload_s']:.1f} s"]
    if t["bandwidth_s"] is not None:
        parts.append(f"read bandwidth and matmul {t['bandwidth_s']:.1f} s")
    if t["compare_s"] is not None:
        peer = "onnxruntime" if r["compare"] and "onnxruntime" in r["compare"] else "torch"
        parts.append(f"{peer} comparison {t['compare_s']:.1f} s")
    print(f"\ntotal {t['total_s']:.1f} s (the whole command: {', '.join(parts)})")
