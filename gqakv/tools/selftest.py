"""``gqakv selftest``: prove a backend right on this machine, kernel family by kernel family.

The first command to run on new hardware. For the chosen backend (``--backend``; default
the one gqakv would pick here; ``all``: every backend that can run):

1. ``compile``: builds every kernel the backend has, in every dtype it declares, at the
   head dims tested below (``Backend.compile_kernels``; cupy: each kernel source and
   template instantiation through its module cache); a backend that builds nothing
   ahead says how its kernels are built (``Backend.compile_note``; numba: on their first
   call in the lines below, cached on disk, with the cache folder); the others have
   nothing to compile.
2. For each dtype the backend declares, randomized cases of each family against the
   float64 reference (``gqakv.ops.reference``), with ragged rows, idle and empty rows, padded
   slots (``n_new < T``; padded K/V slots hold a sentinel, padded queries NaN) and cache
   buffers filled with NaN before anything is appended (a kernel reading past a row's
   length, or a padded slot written, shows up):

   - ``append``: every cache row after each ``write_kv``: live tokens bit-exact, the
     slots past the length still NaN;
   - ``decode``: T = 1 steps over ragged rows, some rows idle;
   - ``split+merge``: long rows and small batches, where the key range is cut into
     pieces merged through their log-sum-exp: through ``Backend.split_attention`` where
     the backend has a knob forcing small pieces (numpy, numba: 16-key pieces and 2
     workers); cupy through its planner (split-KV plus the merge kernel whenever a few
     rows cannot fill the GPU: what these shapes are). For every backend
     also each row's keys cut in two caches, attended separately (``return_lse``) and
     combined with ``gqakv.merge_attention``;
   - ``prefill``: T > 1 chunks appended over several calls (later chunks see earlier
     ones), ragged, padded and finished rows;
   - ``long prefill``, ``long int8``: the same with chunks of 64 or 96 queries
     (G = 4, d = 128 or 64), items big enough for a backend's compute-bound path, over
     plain and int8 storage (the codes read back as for ``quant int8``); its note gives
     the work done by the paths a backend counts (``Backend.served_counts``; numba: the
     BLAS path's bfloat16 items on bf16 products, where the CPU has them);
   - ``row copies``: ``reorder`` (with duplicates) and ``fork`` on a 2-layer
     ModelKVCache: copied rows bit-exact, slots past the copied length and rows not
     copied to untouched;
   - ``variants``: sliding window, soft-cap and sinks, alone and combined (W = 1, W
     shorter than the chunk, W past every row; softcaps where tanh saturates; sinks far
     above the scores and -inf), over chunked prefill and decode with ragged, padded
     and empty rows, and a windowed decode over long rows (what a key-split planner
     must start at the window);
   - ``paged P=1``, ``paged P=16``: a ``PagedKVCache`` of that page size (its whole pool
     NaN): ragged prompts, a fork of one row into others (pages shared, partly filled
     last pages among them), then a prefill chunk and decode steps writing into the
     shared pages (copy on write): after every append each row read back through its
     pages bit-exact and the pool's accounting audited (``PageTable.audit``), every
     attention call against the reference;
   - ``quant int8``, ``quant e4m3``: a ``KVCache`` with ``kv_dtype`` int8 /
     float8_e4m3fn (not for float64, which refuses it: SKIP): chunked prefill and decode
     with a large (x 20) and an all-zero token per append; after every append the stored
     codes x scales equal the scheme applied on the host (``gqakv.storage.quantize`` through
     NumPy/ml_dtypes) and every slot past a row's length has scale NaN; attention
     against the reference on the dequantized values, with the tolerances of ``dtype``;
   - ``quant i8/32``, ``quant i4/32r``, ``quant i4/64``: the same with a scale per block
     of 32 values (``int8_g32``; ``int4_g32_rotated``, two 4-bit codes a byte and keys
     stored Hadamard-rotated: the mirror holds them rotated back, as ``live_kv`` hands
     them) or of 64 (``int4_g64``);
   - ``paged int8``, ``paged i4/32``: the paged case at page size 16 over int8 pages
     (scales paged with their tokens) and over ``int4_g32`` pages (a scale per block of
     32 values), rows read back as their dequantized values;
   - ``shared pages``: a ``PagedKVCache`` (page size 16) whose rows share a prompt of
     enough tokens for a group (``MIN_SHARED_TOKENS``, ``MIN_SAVED_TOKENS``) through
     ``fork`` (one row with a prompt of its own, one idle entry), then a short chunk, decode
     steps and a decode with soft-cap, sinks and ALiBi: each plan must have formed its
     groups (``plan.shared_prefix``: the shared pages read once,
     ``gqakv.ops.shared_prefix``; a plan that did not fails the line with its reason),
     and every call matches the reference.
   - ``draft tree``: a prompt, then per row a chunk of draft tokens given as a random tree
     (``gqakv.core.tree``; ragged, an empty draft among them), plain and with a window,
     soft-cap and ALiBi over logical positions, against the reference over the ancestor
     sets; the first case's drafts hold at most 8 tokens (the numba kernels serve those),
     the others up to 32 (the BLAS path on the CPU; on CuPy the prefill kernels' tree
     instantiation serves every case).

Tolerances (attention outputs and LSEs, at the queries that are not padding; padded
queries must give exactly 0 and -inf): float16/bfloat16 follow FlashAttention's rule,
``err <= K_NAIVE * err_naive + eps``, where ``err_naive`` is the error of the same
computation done plainly in that dtype (``reference.naive_low_precision``) and ``eps``
one rounding of the largest output. float32 and float64 have a fixed bound,
``REL_BOUND[dtype] * (1 + max |reference|)``: 1e-5 for float32 is about 80 float32 ulps
of the largest value, far above the rounding of a softmax-weighted average over these
lengths (measured worst: a few ulps) and far below what a wrong key, mask or merge gives
(1e-2 and up); 1e-12 for float64 in the same way.

Prints one line per family and dtype (cases, worst error over its tolerance, PASS/FAIL)
and the worst case of any failing line; exit status 0 when everything passed, 1 otherwise.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import cast
from dataclasses import dataclass

import numpy as np

from ..caches.cache import KVCache
from ..caches.model_cache import ModelKVCache
from ..caches.paged_cache import PagedKVCache
from ..core.inputs import validate_attention
from ..dispatch.registry import get_backend, list_backends
from ..ops.attention import gqa_attention
from ..ops import shared_prefix as _shared_prefix
from ..ops.merge import merge_attention
from ..ops.plan import AttentionPlan
from ..ops.reference import naive_low_precision, reference_attention
from ..storage.codecs import GROUPED
from ..storage.store import StorageSpec
from ..storage.quantize import dequantize_groups, e4m3_table, quantize, quantize_groups, rotate
from .errors import UsageError

#: Error bound of the low-precision rule, as FlashAttention's tests use it.
K_NAIVE = 2.0
#: Fixed relative bounds for the wide dtypes (see the module docstring).
REL_BOUND = {"float32": 1e-5, "float64": 1e-12}
#: Unit roundoff (half an ulp of 1.0) of the narrow dtypes.
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
#: What a padded K/V slot holds in an append (never written) and a padded query (ignored).
PAD_KV = 1000.0
#: Head dims the cases draw from (quick, full): 128 (Llama), 64, and dims the tensor-core
#: kernels do not take (72: not a multiple of 16), so both kernel variants of cupy run.
HEAD_DIMS = {True: (128, 72), False: (64, 128, 80, 72)}
#: Cases per family and dtype (quick, full).
CASES = {True: 2, False: 12}
#: Page sizes of the paged families (one line each): 1 (every token its own page) and 16
#: (the default; forks share a partly filled last page, copied on write).
PAGE_SIZES = (1, 16)
#: Quantized storage of the quantized families (one line each): kv_dtype -> line name.
KV_DTYPES = {"int8": "quant int8", "float8_e4m3fn": "quant e4m3",
             # a scale per block of 32 values: 8-bit, and 4-bit with keys rotated; per block
             # of 64 (the other block width the kernels are built for), 4-bit
             "int8_g32": "quant i8/32", "int4_g32_rotated": "quant i4/32r", "int4_g64": "quant i4/64"}
#: Head dims of the grouped lines (whole blocks; a power of two for the rotation).
GROUPED_HEAD_DIMS = (64, 128)
#: Paged and quantized at once (page size 16, int8): the scales paged with their tokens.
PAGED_QUANT = "paged int8"
#: ... and over 4-bit codes with a scale per block of 32 values (their block scales paged too).
PAGED_GROUPED = "paged i4/32"
#: The paged quantized lines: kv_dtype -> line name.
PAGED_KV_DTYPES = {"int8": PAGED_QUANT, "int4_g32": PAGED_GROUPED}
#: Rows sharing a prompt's pages, read once per plan (``gqakv.ops.shared_prefix``).
SHARED_PREFIX = "shared pages"
#: Draft-tree chunks (speculative verification; ``gqakv.core.tree``).
DRAFT_TREE = "draft tree"
#: Prefill chunks long enough for compute-bound paths (the CPU's tiles, the GPU's MMA
#: kernels): 64 or 96 queries of 4 query heads per KV head.
LONG_PREFILL = "long prefill"
#: ... over int8 codes with per-token scales (numba's AMX items take those too).
LONG_PREFILL_INT8 = "long int8"
LONG_LINES = (LONG_PREFILL, LONG_PREFILL_INT8)
#: The chunk lengths and head dims of the long-prefill lines.
LONG_CHUNKS, LONG_HEAD_DIMS = (96, 64), (128, 64)
FAMILIES = ("compile", "append", "decode", "split+merge", "prefill", LONG_PREFILL, LONG_PREFILL_INT8,
            "row copies", "variants", *(f"paged P={p}" for p in PAGE_SIZES), *KV_DTYPES.values(),
            *PAGED_KV_DTYPES.values(), SHARED_PREFIX, DRAFT_TREE)


# -- bookkeeping -------------------------------------------------------------------------------

@dataclass
class Check:
    """One output line: a family in one dtype."""

    family: str
    dtype: str
    cases: int = 0
    worst: float = 0.0  # largest err / tol seen; inf for an exact check that failed
    worst_what: str = ""
    note: str = ""
    skipped: str = ""  # why the line did not run
    required: bool = True  # False: a line that may have no cases (nothing to compile)

    def add(self, what: str, err: float, tol: float) -> None:
        if not math.isfinite(err):
            ratio = math.inf
        elif tol > 0:
            ratio = err / tol
        else:
            ratio = 0.0 if err == 0 else math.inf
        if ratio > self.worst or not self.worst_what:
            self.worst, self.worst_what = ratio, f"{what}: error {err:.3g}, tolerance {tol:.3g}"

    def exact(self, what: str, mismatches: int, total: int) -> None:
        """A bit-exact check: ratio 0 when every element matched, inf otherwise."""
        if mismatches:
            self.worst = math.inf
            self.worst_what = f"{what}: {mismatches} of {total} elements differ"

    @property
    def passed(self) -> bool:
        if self.skipped:
            return True
        return self.worst <= 1.0 and (self.cases > 0 or not self.required)

    def line(self) -> str:
        if self.skipped:
            return f"{self.family:<13}{self.dtype:<10}{'-':>6}{'-':>14}  SKIP  {self.skipped}"
        worst = "-" if not self.cases and not self.worst_what else f"{self.worst:.3g}"
        result = "PASS" if self.passed else "FAIL"
        return f"{self.family:<13}{self.dtype:<10}{self.cases:>6}{worst:>14}  {result}" + (
            f"  {self.note}" if self.note else "")


def _tolerance(dtype: str, ref, naive_err: float | None) -> float:
    scale = float(np.max(np.abs(ref), initial=0.0, where=np.isfinite(ref)))
    if dtype in REL_BOUND:
        return REL_BOUND[dtype] * (1.0 + scale)
    assert naive_err is not None, f"{dtype}: the tolerance needs the naive error"
    return K_NAIVE * naive_err + UNIT_ROUNDOFF[dtype] * max(scale, 1.0)


def _max_err(got, want, mask) -> float:
    """max |got - want| over ``mask``; NaN or inf anywhere in it gives inf."""
    if not mask.any():
        return 0.0
    d = np.abs(got[mask].astype(np.float64) - want[mask])
    return float(d.max()) if np.isfinite(d).all() else math.inf


def _rounder(dtype: str):
    """float32 array -> the nearest values of ``dtype`` (as float32)."""
    if dtype == "float16":
        return lambda x: np.asarray(x, np.float32).astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        import ml_dtypes

        return lambda x: np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    return None


def _dequantize_host(codes: np.ndarray, scales: np.ndarray, kv_dtype: str,
                     keys: bool = False) -> np.ndarray:
    """float64 of float32 ``value(code) x scale`` (the scheme's dequantization, on the host);
    a grouped scheme's block scales, and ``keys`` of a rotated one rotated back in float64."""
    if kv_dtype in GROUPED:
        bits, group, rotated = GROUPED[kv_dtype]
        values = dequantize_groups(np, codes, scales.astype(np.float32), bits, group)
        if rotated and keys:  # the library's rotation: the same bits on both sides
            values = rotate(np, values, inverse=True)
        return values.astype(np.float64)
    values = codes.astype(np.float32) if kv_dtype == "int8" else e4m3_table()[codes]
    return (values * scales.astype(np.float32)[..., None]).astype(np.float64)


def _dequantized_rule(x: np.ndarray, kv_dtype: str, keys: bool = False) -> np.ndarray:
    """What a quantized cache must hold for float32 tokens ``x`` [..., d]: the scheme of
    ``gqakv.storage.quantize`` applied on the host (NumPy, ml_dtypes), then dequantized
    (``keys`` of a rotated scheme: rotated, stored, rotated back)."""
    if kv_dtype in GROUPED:
        bits, group, rotated = GROUPED[kv_dtype]
        if rotated and keys:
            x = rotate(np, x)
        codes, scales = quantize_groups(np, x, bits, group)
    else:
        codes, scales = quantize(np, x, kv_dtype)
    return _dequantize_host(np.asarray(codes), np.asarray(scales), kv_dtype, keys)


# -- a cache with a host mirror ------------------------------------------------------------------

class Mirror:
    """A KVCache (or one layer of a ModelKVCache) filled with NaN, and the float64 values
    every row should hold. Data go in through the backend and come back through it, so
    the mirror holds exactly the values of the cache's dtype. ``page_size``: a
    PagedKVCache (its whole pool NaN); ``kv_dtype``: a quantized cache, the mirror holding
    the dequantized values of the scheme (``gqakv.storage.quantize``, computed here on the host)."""

    def __init__(self, backend, dtype, batch, kv_heads, max_len, head_dim, rng, *,
                 page_size=None, kv_dtype=None):
        self.backend, self.dtype, self.rng = backend, dtype, rng
        self.kv_dtype = kv_dtype
        if page_size is not None:
            self.cache = PagedKVCache(batch, kv_heads, max_len, head_dim, dtype=dtype,
                                      backend=backend, page_size=page_size, kv_dtype=kv_dtype)
        else:
            self.cache = KVCache(batch, kv_heads, max_len, head_dim, dtype=dtype, backend=backend,
                                 kv_dtype=kv_dtype)
        nan = np.full((batch, kv_heads, max_len, head_dim), np.nan, dtype=np.float32)
        dev = backend.from_numpy(nan, dtype)
        self.cache.append(dev, dev, np.full(batch, max_len))  # every slot (page) NaN ...
        self.cache.reset()  # ... and every row empty
        self.k = [np.zeros((kv_heads, 0, head_dim)) for _ in range(batch)]
        self.v = [np.zeros((kv_heads, 0, head_dim)) for _ in range(batch)]

    def host(self, x) -> np.ndarray:
        return np.asarray(self.backend.to_numpy(x)).astype(np.float64)

    def tokens(self, shape, n_new, keys: bool = False):
        """Random [B, H, T, d] data (device, host float64 of what the cache should hold:
        quantized, the dequantized values); slots t >= n_new[i] hold PAD_KV (never to be
        written). Quantized: a few real tokens are large (x 20) or all zero."""
        x = self.rng.standard_normal(shape, dtype=np.float32)
        if self.kv_dtype is not None:
            for factor in (20.0, 0.0):
                i, h, t = (int(self.rng.integers(n)) for n in shape[:3])
                x[i, h, t] *= factor
        for i, n in enumerate(n_new):
            x[i, :, n:] = PAD_KV
        dev = self.backend.from_numpy(x, self.dtype)
        host = self.host(dev)
        if self.kv_dtype is not None:
            host = _dequantized_rule(host.astype(np.float32), self.kv_dtype, keys)
        return dev, host

    def append(self, n_new, T: int, check: Check | None, what: str):
        """Append random tokens (n_new[i] of T slots real) and check the buffers."""
        c = self.cache
        k_dev, k_host = self.tokens((c.batch, c.kv_heads, T, c.head_dim), n_new, keys=True)
        v_dev, v_host = self.tokens((c.batch, c.kv_heads, T, c.head_dim), n_new)
        self.cache.append(k_dev, v_dev, np.asarray(n_new, dtype=np.int64))
        for b, n in enumerate(n_new):
            self.k[b] = np.concatenate([self.k[b], k_host[b, :, :n]], axis=1)
            self.v[b] = np.concatenate([self.v[b], v_host[b, :, :n]], axis=1)
        if check is not None:
            check.cases += 1
            self.check_buffers(check, what)

    def fork(self, src: int, dst) -> None:
        """``cache.fork`` and the same copies in the mirror."""
        self.cache.fork(src, dst)
        for b in dst:
            self.k[b], self.v[b] = self.k[src].copy(), self.v[src].copy()

    def check_buffers(self, check: Check, what: str) -> None:
        """Live tokens equal the mirror bit for bit; every slot past the length is NaN.
        Paged: each row read back through its pages (``live_kv``) and the pool's accounting
        sound (``PageTable.audit``); quantized: codes x scales (dequantized here) equal
        the mirror's dequantized values, and the scale of every slot past the length NaN."""
        store = self.cache.store
        if store.kind != "contiguous":
            self._check_paged(check, what)
            return
        if store.quantized:
            raw = lambda x: np.asarray(self.backend.to_numpy(x))  # noqa: E731
            k = _dequantize_host(raw(store.k), raw(store.k_scale), self.kv_dtype, keys=True)
            v = _dequantize_host(raw(store.v), raw(store.v_scale), self.kv_dtype)
        else:
            k, v = self.host(self.cache.k), self.host(self.cache.v)
        bad = total = 0
        for b, L in enumerate(self.cache.host_lens):
            for buf, want in ((k, self.k[b]), (v, self.v[b])):
                live, tail = buf[b, :, :L], buf[b, :, L:]
                bad += int((live != want).sum()) + int((~np.isnan(tail)).sum())
                total += live.size + tail.size
        check.exact(what, bad, total)

    def _check_paged(self, check: Check, what: str) -> None:
        bad = total = 0
        for b in range(self.cache.batch):
            k, v = self.cache.live_kv(b)
            for got, want in ((self.host(k), self.k[b]), (self.host(v), self.v[b])):
                bad += got.size if got.shape != want.shape else int((got != want).sum())
                total += want.size
        check.exact(what, bad, total)
        problems = self.cache.store.page_table.audit(self.cache.host_lens)
        if problems:
            check.worst = math.inf
            check.worst_what = f"{what}: page accounting: {'; '.join(problems[:3])}"

    def queries(self, Hq: int, T: int, n_new):
        """Random queries [B, Hq, T, d]; padded slots NaN (their outputs must be 0)."""
        B, d = self.cache.batch, self.cache.head_dim
        x = self.rng.standard_normal((B, Hq, T, d), dtype=np.float32)
        for i, n in enumerate(n_new):
            x[i, :, n:] = np.nan
        dev = self.backend.from_numpy(x, self.dtype)
        return dev, self.host(dev)


def _compare(check: Check, what: str, mirror: Mirror, q_host, n_new, out, lse,
             variant: dict | None = None) -> None:
    """Score one attention call against the reference (out and lse, padding exactly);
    ``variant``: the call's window / softcap / sinks keywords."""
    n_new = np.asarray(n_new)
    variant = variant or {}
    q_ref = np.nan_to_num(q_host)  # padded queries: any finite value, their rows are masked
    ref_out, ref_lse = reference_attention(q_ref, mirror.k, mirror.v, n_new, **variant)
    got_out = mirror.host(out)
    got_lse = np.asarray(mirror.backend.to_numpy(lse), dtype=np.float64)
    T = q_host.shape[2]
    real = np.arange(T)[None, :] < n_new[:, None]  # [B, T]
    real_q = np.broadcast_to(real[:, None, :], ref_lse.shape)
    real_o = np.broadcast_to(real_q[..., None], ref_out.shape)
    naive_out = naive_lse = None
    round_to = _rounder(mirror.dtype)
    if round_to is not None:
        n_out, n_lse = naive_low_precision(q_ref, mirror.k, mirror.v, n_new, round_to, **variant)
        naive_out, naive_lse = _max_err(n_out, ref_out, real_o), _max_err(n_lse, ref_lse, real_q)
    check.add(f"{what} out", _max_err(got_out, ref_out, real_o),
              _tolerance(mirror.dtype, ref_out[real_o], naive_out))
    lse_dtype = mirror.dtype if mirror.dtype == "float64" else "float32"
    lse_tol = (_tolerance(lse_dtype, ref_lse[real_q], None) if naive_lse is None
               else K_NAIVE * naive_lse + REL_BOUND["float32"] * (1 + np.abs(ref_lse[real_q]).max(initial=0)))
    check.add(f"{what} lse", _max_err(got_lse, ref_lse, real_q), lse_tol)
    pad_o, pad_q = ~real_o, ~real_q
    bad = int((got_out[pad_o] != 0).sum()) + int((got_lse[pad_q] != -np.inf).sum())
    check.exact(f"{what} padded queries (must be 0 and -inf)", bad, int(pad_o.sum() + pad_q.sum()))


# -- the families ------------------------------------------------------------------------------

@dataclass
class Shape:
    batch: int
    kv_heads: int
    group: int
    head_dim: int

    def __str__(self) -> str:
        return f"B={self.batch} Hkv={self.kv_heads} G={self.group} d={self.head_dim}"


def _shape(rng, quick: bool, batch=(1, 5)) -> Shape:
    return Shape(int(rng.integers(*batch)), int(rng.integers(1, 4)),
                 int(rng.choice([1, 2, 4, 5])), int(rng.choice(HEAD_DIMS[quick])))


def _decode(backend, dtype, rng, quick, checks) -> None:
    """Ragged prompts (some rows empty), then T = 1 steps with some rows idle."""
    append, decode = checks["append"], checks["decode"]
    for c in range(CASES[quick]):
        s = _shape(rng, quick)
        prompts = rng.integers(0, 70, s.batch)
        prompts[rng.integers(s.batch)] = 0  # one row starts empty
        steps = 3
        m = Mirror(backend, dtype, s.batch, s.kv_heads, int(prompts.max()) + steps, s.head_dim, rng)
        m.append(prompts, max(1, int(prompts.max())), append, f"case {c} ({s}) prompt append")
        for step in range(steps):
            n_new = (rng.random(s.batch) < 0.75).astype(np.int64)  # the others idle (padded)
            m.append(n_new, 1, append, f"case {c} ({s}) decode append {step}")
            q_dev, q_host = m.queries(s.kv_heads * s.group, 1, n_new)
            out, lse = gqa_attention(q_dev, m.cache, n_new, return_lse=True)
            decode.cases += 1
            _compare(decode, f"case {c} ({s}) step {step}, lens {list(m.cache.host_lens)}",
                     m, q_host, n_new, out, lse)


def _split_attention(backend, dtype):
    """(the backend's attention with its key range forced into pieces, a note), or
    (None, note) when it has no such knob (its own planner may split these shapes):
    ``Backend.split_attention``."""
    return backend.split_attention(dtype)


def _split(backend, dtype, rng, quick, checks) -> None:
    """Long rows, small batch: decode (and a short chunk) over a split key range, and the
    same keys cut into two caches whose results merge_attention combines."""
    check = checks["split+merge"]
    forced, check.note = _split_attention(backend, dtype)
    for c in range(CASES[quick]):
        s = _shape(rng, quick, batch=(1, 3))
        lens = rng.integers(300, 1500 if quick else 2500, s.batch)
        T = int(rng.choice([1, 1, 3]))
        m = Mirror(backend, dtype, s.batch, s.kv_heads, int(lens.max()), s.head_dim, rng)
        m.append(lens - T, int(lens.max()), None, "")
        n_new = np.full(s.batch, T)
        n_new[rng.integers(s.batch)] = int(rng.integers(0, T + 1))  # one row padded or idle
        m.append(n_new, T, checks["append"], f"case {c} ({s}) split append")
        q_dev, q_host = m.queries(s.kv_heads * s.group, T, n_new)
        what = f"case {c} ({s}) T={T} lens {list(m.cache.host_lens)}"
        if forced is not None:
            inp = validate_attention(m.cache, q_dev, n_new, None, None)
            out, lse = forced(q_dev, m.cache.k, m.cache.v, inp.rows, inp.lens, inp.n_new,
                              scale=inp.scale, return_lse=True)
        else:
            out, lse = gqa_attention(q_dev, m.cache, n_new, return_lse=True)
        check.cases += 1
        _compare(check, what + " split", m, q_host, n_new, out, lse)
        if T == 1:  # merge_attention over two caches holding each row's keys cut in two
            _merge_halves(backend, dtype, m, q_dev, q_host, n_new, rng, check, what)
            check.cases += 1


def _merge_halves(backend, dtype, m, q_dev, q_host, n_new, rng, check, what) -> None:
    """Keys [0, j) in one cache and [j, L) in another (decode: the query sees all keys of
    both), attention on each with its LSE, merged; a row cut at 0 tests an empty part."""
    B, Hkv, _, d = m.cache.k.shape
    parts = []
    cuts = [int(rng.integers(0, int(L) + 1)) for L in m.cache.host_lens]
    if B > 1:
        cuts[0] = 0  # one part without keys: it must contribute nothing
    for lo_hi in ((0, None), (None, 0)):
        ks, vs, lens = [], [], []
        for b in range(B):
            j, L = cuts[b], int(m.cache.host_lens[b])
            sl = slice(0, j) if lo_hi[1] is None else slice(j, L)
            ks.append(m.k[b][:, sl])
            vs.append(m.v[b][:, sl])
            lens.append(ks[-1].shape[1])
        part = Mirror(backend, dtype, B, Hkv, max(1, max(lens)), d, rng)
        L_max = max(1, max(lens))
        k_pad = np.full((B, Hkv, L_max, d), PAD_KV)  # float64: the mirror's exact values
        v_pad = k_pad.copy()
        for b in range(B):
            k_pad[b, :, :lens[b]] = ks[b]
            v_pad[b, :, :lens[b]] = vs[b]
        part.cache.append(backend.from_numpy(k_pad, dtype), backend.from_numpy(v_pad, dtype),
                          np.asarray(lens, dtype=np.int64))
        # decode: the query of each row sees all of this part's keys (n_new 1 where any)
        n_part = np.where(np.asarray(lens) > 0, np.asarray(n_new), 0)
        parts.append(gqa_attention(q_dev, part.cache, n_part, return_lse=True))
    out, lse = merge_attention(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    _compare(check, what + f" merged at {cuts}", m, q_host, n_new, out, lse)


def _ragged_prompts(rng, batch: int, T: int, shortest: int = 1):
    """Prompt lengths ``[batch]`` of ``shortest``..3T+1 tokens with one row empty all along
    (batch > 1), and the chunks ``[batch]`` of at most T new tokens each that append them."""
    prompts = rng.integers(shortest, 3 * T + 2, batch)
    if batch > 1:
        prompts[rng.integers(batch)] = 0  # an empty row all along
    return prompts, [np.clip(prompts - i * T, 0, T) for i in range(-(-int(prompts.max()) // T))]


def _chunked_prefill(backend, dtype, rng, c: int, s: Shape, T: int, prompts, chunks,
                     append: Check, check: Check, kv_dtype=None) -> None:
    """Case ``c``: ``prompts`` appended ``chunks`` after ``chunks`` (``_ragged_prompts``) to
    a fresh mirror (of ``kv_dtype`` storage), each chunk's T queries attended and compared
    (``check``), every append read back (``append``)."""
    m = Mirror(backend, dtype, s.batch, s.kv_heads, int(prompts.max()) + 1, s.head_dim, rng,
               kv_dtype=kv_dtype)
    for chunk, n_new in enumerate(chunks):
        m.append(n_new, T, append, f"case {c} ({s}) T={T} chunk {chunk} append")
        q_dev, q_host = m.queries(s.kv_heads * s.group, T, n_new)
        out, lse = gqa_attention(q_dev, m.cache, n_new, return_lse=True)
        check.cases += 1
        _compare(check, f"case {c} ({s}) T={T} chunk {chunk} n_new {list(n_new)}", m,
                 q_host, n_new, out, lse)


def _prefill(backend, dtype, rng, quick, checks) -> None:
    """Prompts appended in T-token chunks over several calls; rows ragged, padded in the
    last chunk, finished (idle) or empty."""
    for c in range(CASES[quick]):
        s = _shape(rng, quick)
        T = int(rng.choice([2, 5, 16, 37]))
        prompts, chunks = _ragged_prompts(rng, s.batch, T)
        _chunked_prefill(backend, dtype, rng, c, s, T, prompts, chunks, checks["append"],
                         checks["prefill"])


def _long_prefill(backend, dtype, rng, quick, checks, kv_dtype=None) -> None:
    """Prompts of 2T + 1 to 3T + 1 tokens appended in chunks of T = 64 or 96 (G = 4, d = 128
    or 64, ragged and padded, one row empty), over plain or ``kv_dtype`` storage: items big
    enough for a backend's compute-bound path (numba: the chunks over rows of more than
    ``KERNEL_SHORT_ROW_KEYS`` keys; the first ones take its kernels); the line's note gives
    the work its ``served_counts`` paths did (numba: items on bf16 products, bfloat16 only)."""
    check = checks[LONG_PREFILL_INT8 if kv_dtype == "int8" else LONG_PREFILL]
    append = check if kv_dtype else checks["append"]  # codes read back as the quant lines do
    before = backend.served_counts()
    for c in range(1 if quick else 3):
        s = Shape(3, 2, 4, LONG_HEAD_DIMS[c % 2])
        T = LONG_CHUNKS[c % 2]
        # later chunks see 2T+ keys
        prompts, chunks = _ragged_prompts(rng, s.batch, T, shortest=2 * T + 1)
        _chunked_prefill(backend, dtype, rng, c, s, T, prompts, chunks, append, check, kv_dtype)
    served = {name: n - before.get(name, 0) for name, n in backend.served_counts().items()}
    check.note = ", ".join(f"{name}: {n}" for name, n in served.items())


def _row_copies(backend, dtype, rng, quick, checks) -> None:
    """reorder (duplicates, cycles) and fork on a 2-layer ModelKVCache filled with NaN."""
    check = checks["row copies"]
    for c in range(CASES[quick]):
        s = _shape(rng, quick, batch=(3, 7))
        layers, max_len = 2, 40
        cache = ModelKVCache(layers, s.batch, s.kv_heads, max_len, s.head_dim, dtype=dtype,
                             backend=backend)
        nan = backend.from_numpy(np.full((s.batch, s.kv_heads, max_len, s.head_dim), np.nan,
                                         dtype=np.float32), dtype)
        with cache.step(np.full(s.batch, max_len)) as st:
            for l in range(layers):
                st.write(l, nan, nan)
        cache.reset()
        lens = rng.integers(0, max_len + 1, s.batch)
        T = max(1, int(lens.max()))
        with cache.step(lens) as st:
            for l in range(layers):
                x = rng.standard_normal((s.batch, s.kv_heads, T, s.head_dim), dtype=np.float32)
                st.write(l, backend.from_numpy(x, dtype), backend.from_numpy(-x, dtype))

        def snapshot():
            return (np.array(backend.to_numpy(cache.k), np.float64),  # copies, not views
                    np.array(backend.to_numpy(cache.v), np.float64), cache.host_lens.copy())

        for op in ("reorder", "fork"):
            k0, v0, lens0 = snapshot()
            if op == "reorder":
                src = rng.integers(0, s.batch, s.batch)
                src[: s.batch // 2] = rng.permutation(s.batch)[: s.batch // 2]  # a cycle or two
                cache.reorder(src)
                moves = {b: int(src[b]) for b in range(s.batch)}
                what = f"case {c} ({s}) reorder {list(src)} lens {list(lens0)}"
            else:
                source = int(rng.integers(s.batch))
                dst = [int(r) for r in rng.permutation(s.batch)[: max(1, s.batch // 2)] if r != source]
                dst = dst or [(source + 1) % s.batch]
                cache.fork(source, dst)
                moves = {b: (source if b in dst else b) for b in range(s.batch)}
                what = f"case {c} ({s}) fork {source} -> {dst} lens {list(lens0)}"
            k1, v1, lens1 = snapshot()
            bad = total = 0
            for b, src_row in moves.items():
                n = int(lens0[src_row])
                bad += int(lens1[b] != n)
                for new, old in ((k1, k0), (v1, v0)):
                    got, want = new[:, b, :, :n], old[:, src_row, :, :n]
                    # past the copied tokens the row keeps what it held (only live tokens move)
                    rest_got, rest_old = new[:, b, :, n:], old[:, b, :, n:]
                    bad += int((got != want).sum())
                    bad += int((~((rest_got == rest_old) | (np.isnan(rest_got) & np.isnan(rest_old)))).sum())
                    total += got.size + rest_got.size
            check.cases += 1
            check.exact(what, bad, total)


def _variant(rng, s: Shape, T: int, longest: int) -> dict:
    """Random window / softcap / sinks / ALiBi keywords, at least one of them."""
    while True:
        kw: dict[str, object] = {}
        window = rng.choice([0, 1, max(1, T - 1), 7, longest + 3])
        if window:
            kw["window"] = int(window)
        softcap = rng.choice([0.0, 0.02, 1.0, 30.0])
        if softcap:
            kw["softcap"] = float(softcap)
        if rng.random() < 0.5:
            hq = s.kv_heads * s.group
            sinks = rng.normal(0.0, 2.0, hq).astype(np.float32)
            sinks[rng.integers(hq)] = 40.0  # far above the scores: that head's out ~ 0
            sinks[rng.integers(hq)] = -np.inf  # no sink
            kw["sinks"] = sinks
        if rng.random() < 0.4:  # ALiBi: BLOOM's geometric slopes, in a random head order
            hq = s.kv_heads * s.group
            kw["alibi_slopes"] = rng.permutation(2.0 ** (-8.0 * (np.arange(hq) + 1) / hq))
        if kw:
            return kw


def _variants(backend, dtype, rng, quick, checks) -> None:
    """Window / softcap / sinks / ALiBi: chunked prefill then decode (ragged, padded, one row empty),
    and one windowed decode over long rows per case."""
    check = checks["variants"]
    for c in range(CASES[quick]):
        s = _shape(rng, quick)
        T = int(rng.choice([1, 4, 9]))
        prompts, chunks = _ragged_prompts(rng, s.batch, T)
        variant = _variant(rng, s, T, int(prompts.max()) + 1)
        m = Mirror(backend, dtype, s.batch, s.kv_heads, int(prompts.max()) + 1, s.head_dim, rng)
        for i, n_new in enumerate(chunks + [(rng.random(s.batch) < 0.7).astype(np.int64)]):
            width = T if i < len(chunks) else 1
            n_new = np.minimum(n_new, m.cache.max_len - m.cache.host_lens)
            m.append(n_new, width, None, "")
            q_dev, q_host = m.queries(s.kv_heads * s.group, width, n_new)
            out, lse = gqa_attention(q_dev, m.cache, n_new, return_lse=True, **variant)
            check.cases += 1
            _compare(check, f"case {c} ({s}) {_describe(variant)} T={width} n_new {list(n_new)}",
                     m, q_host, n_new, out, lse, variant)
        # a windowed decode over long rows: the keys read start at the window
        s = _shape(rng, quick, batch=(1, 3))
        lens = rng.integers(300, 900, s.batch)
        variant = _variant(rng, s, 1, int(lens.max()))
        variant["window"] = int(rng.integers(16, 200))
        m = Mirror(backend, dtype, s.batch, s.kv_heads, int(lens.max()), s.head_dim, rng)
        m.append(lens - 1, int(lens.max()), None, "")
        n_new = np.ones(s.batch, dtype=np.int64)
        m.append(n_new, 1, None, "")
        q_dev, q_host = m.queries(s.kv_heads * s.group, 1, n_new)
        out, lse = gqa_attention(q_dev, m.cache, n_new, return_lse=True, **variant)
        check.cases += 1
        _compare(check, f"case {c} ({s}) long rows {list(lens)} {_describe(variant)}", m,
                 q_host, n_new, out, lse, variant)


def _paged(page_size, backend, dtype, rng, quick, checks, kv_dtype=None) -> None:
    """A PagedKVCache of ``page_size`` (and ``kv_dtype``: the ``paged int8`` line, the
    mirror holding dequantized values as for the quantized lines): ragged prompts, a fork of one row into others
    (pages shared, a partly filled last page among them), then a prefill chunk and decode
    steps that write into the shared pages (copy on write): after every append each row
    read back through its pages and the pool's accounting audited; every attention call
    against the reference."""
    check = checks[PAGED_KV_DTYPES[kv_dtype] if kv_dtype else f"paged P={page_size}"]
    for c in range(CASES[quick]):
        s = _shape(rng, quick, batch=(3, 6))
        if kv_dtype in GROUPED:  # whole blocks
            s.head_dim = int(rng.choice(GROUPED_HEAD_DIMS))
        prompts = rng.integers(1, 70, s.batch)
        T, steps = int(rng.choice([3, 16])), 2
        m = Mirror(backend, dtype, s.batch, s.kv_heads, int(prompts.max()) + T + steps,
                   s.head_dim, rng, page_size=page_size, kv_dtype=kv_dtype)
        what = f"case {c} ({s}) page_size {page_size}" + (f" {kv_dtype}" if kv_dtype else "")
        m.append(prompts, int(prompts.max()), check, f"{what} prompt append")
        source = int(rng.integers(s.batch))
        dst = [r for r in rng.permutation(s.batch)[: max(1, s.batch // 2)].tolist() if r != source]
        dst = dst or [(source + 1) % s.batch]
        m.fork(source, dst)
        check.cases += 1
        m.check_buffers(check, f"{what} after fork {source} -> {dst}")
        what += f" forked {source} -> {dst}"
        chunk = rng.integers(0, T + 1, s.batch)
        chunk[source] = T  # the source writes into its (shared) last page too
        for step, (width, n_new) in enumerate(
                [(T, chunk)] + [(1, (rng.random(s.batch) < 0.8).astype(np.int64)) for _ in range(steps)]):
            m.append(n_new, width, check, f"{what} append {step}")
            q_dev, q_host = m.queries(s.kv_heads * s.group, width, n_new)
            out, lse = gqa_attention(q_dev, m.cache, n_new, return_lse=True)
            check.cases += 1
            _compare(check, f"{what} T={width} n_new {list(n_new)} lens {list(m.cache.host_lens)}",
                     m, q_host, n_new, out, lse)


def _quantized(kv_dtype, backend, dtype, rng, quick, checks) -> None:
    """A KVCache with ``kv_dtype`` storage: ragged prompts in chunks (one row empty, padded
    slots, a huge and an all-zero token per append), then decode steps: the stored codes x
    scales equal the scheme's after every append, and every attention call matches the
    reference on the dequantized values."""
    check = checks[KV_DTYPES[kv_dtype]]
    for c in range(CASES[quick]):
        s = _shape(rng, quick)
        if kv_dtype in GROUPED:  # whole blocks of 32 (and a power of two for the rotation)
            s.head_dim = int(rng.choice(GROUPED_HEAD_DIMS))
        T = int(rng.choice([1, 5, 16]))
        prompts, chunks = _ragged_prompts(rng, s.batch, T)
        m = Mirror(backend, dtype, s.batch, s.kv_heads, int(prompts.max()) + 2, s.head_dim, rng,
                   kv_dtype=kv_dtype)
        steps = [(rng.random(s.batch) < 0.75).astype(np.int64) for _ in range(2)]
        for i, n_new in enumerate(chunks + steps):
            width = T if i < len(chunks) else 1
            what = f"case {c} ({s}) {kv_dtype} T={width} n_new {list(n_new)}"
            m.append(n_new, width, check, what + " append")
            q_dev, q_host = m.queries(s.kv_heads * s.group, width, n_new)
            out, lse = gqa_attention(q_dev, m.cache, n_new, return_lse=True)
            check.cases += 1
            _compare(check, what, m, q_host, n_new, out, lse)


def _shared_prefix_family(backend, dtype, rng, quick, checks) -> None:
    """Rows that share a prompt of at least ``MIN_SHARED_TOKENS`` tokens (fork), one row
    with its own prompt, an idle entry: a short chunk and decode steps (one soft-capped
    with sinks), each planned (the plan must have formed its groups) and run against the
    reference."""
    check = checks[SHARED_PREFIX]
    P = 16
    for c in range(1 if quick else 3):
        s = _shape(rng, quick, batch=(4, 7))
        members = s.batch - 2  # rows 0 .. B-3 share the prompt; B-2 idle, B-1 its own
        least = _shared_prefix.min_saved_tokens(backend, StorageSpec.of(dtype), s.head_dim)
        prompt = max(_shared_prefix.MIN_SHARED_TOKENS,
                     -(-least // max(1, members - 1))) + P + int(rng.integers(0, 40))
        steps = [(3, rng.integers(1, 4, s.batch))] + [(1, np.ones(s.batch, np.int64))] * 2
        m = Mirror(backend, dtype, s.batch, s.kv_heads, prompt + 8, s.head_dim, rng, page_size=P)
        first = np.zeros(s.batch, np.int64)
        first[0], first[-1] = prompt, int(rng.integers(1, 40))
        m.append(first, prompt, None, "")
        m.fork(0, list(range(1, s.batch - 1)))
        Hq = s.kv_heads * s.group
        for step, (width, n_new) in enumerate(steps):
            n_new = np.array([int(x) for x in n_new], np.int64)
            n_new[-2] = 0  # an idle entry (its pages shared, no queries)
            m.append(n_new, width, None, "")
            variant = ({"softcap": 3.0, "sinks": rng.standard_normal(Hq).astype(np.float32),
                        "alibi_slopes": rng.uniform(0.0, 0.5, Hq)}
                       if step == len(steps) - 1 else {})
            what = f"case {c} ({s}) prompt {prompt} T={width} n_new {list(n_new)} {_describe(variant)}"
            plan = AttentionPlan.of(m.cache, n_new, q_heads=Hq, t_q=width, **variant)
            check.cases += 1
            if not plan.shared_prefix.used:
                check.worst, check.worst_what = math.inf, f"{what}: {plan.shared_prefix}"
                continue
            q_dev, q_host = m.queries(Hq, width, n_new)
            out, lse = plan.run(q_dev, m.cache, return_lse=True)
            _compare(check, what, m, q_host, n_new, out, lse, variant)


def _draft_tree_family(backend, dtype, rng, quick, checks) -> None:
    """A prompt, then a chunk of draft tokens per row given as a random tree (ragged, an
    empty draft among them; random parents, each before its child), plain and with a
    window, soft-cap and ALiBi, against the reference over the ancestor sets."""
    check = checks[DRAFT_TREE]
    for c in range(2 if quick else 3):  # case 0: the kernels' trees (<= 8 tokens)
        s = _shape(rng, quick, batch=(2, 5))
        width = int(rng.integers(2, 9) if c == 0 else rng.integers(9, 33))
        m = Mirror(backend, dtype, s.batch, s.kv_heads, 64 + width, s.head_dim, rng)
        m.append(rng.integers(0, 64, s.batch), 64, None, "")
        n_new = rng.integers(1, width + 1, s.batch)
        n_new[-1] = 0  # an empty draft
        parents = np.full((s.batch, width), -1, np.int64)
        for b in range(s.batch):
            parents[b, :n_new[b]] = [int(rng.integers(-1, t)) for t in range(int(n_new[b]))]
        m.append(n_new, width, None, "")
        Hq = s.kv_heads * s.group
        for variant in ({"tree": parents},
                        {"tree": parents, "window": int(rng.integers(1, 40)), "softcap": 3.0,
                         "alibi_slopes": rng.uniform(-0.25, 0.5, Hq)}):
            what = f"case {c} ({s}) T={width} n_new {list(n_new)} {_describe(variant)}"
            q_dev, q_host = m.queries(Hq, width, n_new)
            out, lse = gqa_attention(q_dev, m.cache, n_new, return_lse=True, **variant)
            check.cases += 1
            _compare(check, what, m, q_host, n_new, out, lse, variant)


def _describe(variant: dict) -> str:
    return " ".join(f"{k}={list(np.round(v, 2)) if k in ('sinks', 'alibi_slopes') else v}"
                    for k, v in variant.items() if k != "tree")


def _compile(backend, dtypes, quick) -> Check:
    """Build every kernel of the backend (see the module docstring)."""
    check = Check("compile", "all")
    t = time.perf_counter()
    names = backend.compile_kernels(dtypes, HEAD_DIMS[quick])
    if not names:
        note = backend.compile_note()
        check.note = note or "nothing to build ahead (this backend declares no kernels)"
        check.required = False
        return check
    check.cases = len(names)
    check.note = f"{len(names)} kernel instantiations built in {time.perf_counter() - t:.1f} s"
    return check


_FAMILY_RUNNERS: tuple[tuple[str, Callable[..., None]], ...] = (
    ("append/decode", _decode), ("split+merge", _split), ("prefill", _prefill),
    ("row copies", _row_copies), ("variants", _variants),
    *((f"paged P={p}", functools.partial(_paged, p)) for p in PAGE_SIZES),
    *((line, functools.partial(_quantized, kv)) for kv, line in KV_DTYPES.items()),
    (PAGED_QUANT, functools.partial(_paged, 16, kv_dtype="int8")),
    (SHARED_PREFIX, _shared_prefix_family), (DRAFT_TREE, _draft_tree_family),
    # last: their draws leave the families before them what a seed gave them before they came
    (PAGED_GROUPED, functools.partial(_paged, 16, kv_dtype="int4_g32")), (LONG_PREFILL, _long_prefill),
    (LONG_PREFILL_INT8, functools.partial(_long_prefill, kv_dtype="int8")))


def selftest_backend(backend, *, quick: bool = False, seed: int = 0, say=print) -> list[Check]:
    """Run every family on ``backend`` (a Backend that can run); print and return the lines."""
    import traceback

    dtypes = list(backend.dtypes)
    lines: list[Check] = []
    try:
        lines.append(_compile(backend, dtypes, quick))
    except Exception as exc:  # a kernel that does not build is a failure, not a crash
        c = Check("compile", "all", worst=math.inf, worst_what=f"{type(exc).__name__}: {exc}")
        lines.append(c)
    say(lines[-1].line())
    for dtype in dtypes:
        checks = {f: Check(f, dtype) for f in FAMILIES[1:]}
        reasons = backend.not_supported_reasons(dtype=dtype)
        if reasons:
            for chk in checks.values():
                chk.skipped = "; ".join(reasons)
        else:
            if dtype == "float64":  # StorageSpec refuses it: float64 is the reference precision
                for line in (*KV_DTYPES.values(), *PAGED_KV_DTYPES.values(), LONG_PREFILL_INT8):
                    checks[line].skipped = "quantized K/V take dtype float32, float16 or bfloat16"
            # seeded by the lines before this dtype's, not counting the long-prefill lines
            # (added later, run last): every other line draws what a seed gave it before
            rng = np.random.default_rng([seed, sum(c.family not in LONG_LINES for c in lines)])
            for family, runner in _FAMILY_RUNNERS:
                if family in checks and checks[family].skipped:
                    continue
                try:
                    runner(backend, dtype, rng, quick, checks)
                except Exception as exc:  # a crash inside a family fails that family
                    target = checks["decode" if family == "append/decode" else family]
                    target.worst = math.inf
                    target.worst_what = (f"raised {type(exc).__name__}: {exc}\n"
                                         + traceback.format_exc(limit=-3))
        for chk in checks.values():
            say(chk.line())
            lines.append(chk)
    return lines


# -- the command -------------------------------------------------------------------------------

def add_arguments(parser) -> None:
    parser.add_argument("--backend", default=None,
                        help="backend to test, or 'all' (every backend that can run here); "
                             "default: the one gqakv picks here (GQAKV_BACKEND, then auto)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer cases and head dims (seconds instead of tens of seconds)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the random cases (default: a fresh one, printed)")


def _backends(name):
    if name == "all":
        runnable = [b for b in list_backends() if b.unavailable_reason() is None]
        skipped = [(b.name, b.unavailable_reason()) for b in list_backends() if b not in runnable]
        return runnable, skipped
    return [get_backend(name)], []


def run(args) -> int:
    if args.seed is not None and args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    seed = cast(int, np.random.SeedSequence().entropy) % 2**32 if args.seed is None else args.seed
    backends, skipped = _backends(args.backend)
    start = time.perf_counter()
    failed = 0
    for backend in backends:
        t = time.perf_counter()
        print(f"gqakv selftest: backend {backend.name} ({backend.array_library}/{backend.device_kind}), "
              f"dtypes {', '.join(backend.dtypes)}, {'quick' if args.quick else 'full'}, "
              f"seed {seed} (--seed {seed} repeats it)", flush=True)
        print(f"{'family':<13}{'dtype':<10}{'cases':>6}{'worst err/tol':>14}  result")
        lines = selftest_backend(backend, quick=args.quick, seed=seed,
                                 say=lambda s: print(s, flush=True))
        bad = [c for c in lines if not c.passed]
        for c in bad:
            print(f"FAIL {c.family} {c.dtype}: worst {c.worst_what}")
        failed += len(bad)
        print(f"{backend.name}: {'FAILED' if bad else 'passed'} "
              f"({len(lines) - len(bad)} of {len(lines)} lines) in {time.perf_counter() - t:.1f} s\n")
    for name, why in skipped:
        print(f"{name}: not tested ({why})")
    print(f"selftest {'FAILED' if failed else 'passed'} in {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0
