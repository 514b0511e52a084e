"""The numba backend: the NumPy backend's arrays, with compiled attention kernels.

Buffers are the NumPy arrays the numpy backend would hold (this class extends it).
Appends and row copies into contiguous, unquantized storage run one compiled call for
all their rows (``write_tokens``, ``copy_rows``: a ``memmove`` per contiguous run, so
the bytes move at memcpy speed and a decode step's append skips the per-row Python
round trip); paged and quantized writes take the NumPy path. Attention over float32, float16 and
bfloat16 caches runs the kernels of ``numba_kernels``: one pass over each live K/V
row, the G query heads of a KV head (times the queries of a small chunk) folded into
one tile, online softmax in float32, float16/bfloat16 converted in registers. Paged
and quantized stores run the same kernels over their ``kernel_layout``: the pool read
through the page table a page run at a time (pages of at most a key block: every KV
head of an item a page at a time, so the pool is read in address order, and such calls
are planned keys first, ``plan_numba``'s ``page_size``); int8 / float8_e4m3fn codes decoded in
registers with each token's scale folded into its score and its p; grouped codes (a
scale per block of values along d, 8 or 4 bits) decoded in registers too, times their
block's scale, or for tall tiles a key block at a time into an L1-sized float32 block
(``numba_kernels.run_dots``).

Which implementation serves a call, and why, is ``route_attention`` (asked by the dispatch,
by ``route`` and by ``attention_route(...)``):
- "numba kernel": float32/float16/bfloat16 contiguous or paged storage, or int8 /
  float8_e4m3fn / grouped (int8_g32, int4_g32, int4_g64, int4_g32_rotated) quantized
  storage (contiguous or paged), with C-contiguous buffers and chunks of
  at most ``KERNEL_MAX_QUERIES`` queries (decode and short chunks) whose tiles (G heads x
  T queries) hold at most ``KERNEL_MAX_TILE_ROWS`` rows, or of any length and tile size
  where every row holds at most ``KERNEL_SHORT_ROW_KEYS`` keys (``Request.keys``);
- otherwise the numpy backend's decision for the call (``numpy_backend.route_attention``:
  "numpy BLAS" (its item kernel over every layout and codec it reads), or the generic
  code for a codec neither declares): float64 (no kernel is compiled for it), strided buffers,
  and long prefill chunks (compute-bound, where BLAS's matmuls are faster). On that path
  this backend folds each float32 block of causal or windowed scores with one compiled
  step (``FusedSoftmaxState``: mask, max, exp and sum in two vectorized passes per row,
  ``numba_kernels.softmax_block``) instead of NumPy's five.
- "numba bf16 products": that BLAS path with its items on bfloat16 products with float32
  sums (``amx_prefill``): AMX tiles, or AVX-512 BF16 dot products on CPUs without tiles
  (``amx.engine``), for the calls ``AMX_PATH`` declares (bfloat16 queries over plain
  bfloat16 storage or int8 / float8_e4m3fn codes with per-token scales; window, softcap,
  sinks; d a multiple of 32) where the CPU has them and ``GQAKV_AMX`` is not 0. Within
  such a call, items too small to pay for their layout steps, and float32 queries that
  are not bfloat16 values, run the float32 matmuls (``amx_prefill.declines``);
  ``served_counts`` counts the items the products ran.
Appends and row copies: ``route_copy``.

Work is cut by the CPU planner shared with the numpy backend (``cpu_plan``): items of
about equal cost, key splits when rows x KV heads are too few to fill the threads,
consecutive runs of items per thread; key pieces are merged through their
log-sum-exp. Attention variants: items start at a sliding window's first key (so a
decode reads min(L, W) keys), the kernels mask within it and soft-cap each score, and
sinks join once per query after its pieces are merged (``numba_kernels``). Threads: GQAKV_NUM_THREADS, else every core numba may use
(``numba.set_num_threads`` per call), with BLAS held to one thread meanwhile.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from gqakv.dispatch.backend import GENERIC, Backend, FastPath, Route
from gqakv.dispatch.request import Request, as_request
from gqakv.storage.codecs import GROUPED, PLAIN_NAME
from gqakv.core.inputs import PACKED, PADDED, AttentionInputs
from gqakv.core.semantics import AttentionParams, block_keys
from gqakv.core.tree import DraftTree
from gqakv.ops.merge import SoftmaxState
from gqakv.storage.store import CONTIGUOUS, PAGED

from . import amx
from . import numpy_backend as _numpy
from .cpu_plan import ENV_THREADS, INVARIANT_NO_SPLIT, _plan, _share, _threads
from .numpy_backend import NumpyBackend

#: Chunks of more queries than this take the NumPy BLAS path (see ``route_attention``).
#: Where the two cross (both paths alternating in one process, Llama-3.1-8B layer):
#: kernel / BLAS time at T = 4, 8, 12, 16 queries: float32 B=1 L=4,096 0.93, 0.91, 1.27,
#: 1.34; bfloat16 B=4 L=2,048 0.65, 1.06, -, 1.42; int8 0.74 (T=8), 1.16 (12), 1.04 (16);
#: paged (16) 0.77, 0.97, 1.06. The kernel's work grows with the G x T rows of its tile
#: while BLAS's matmuls stay efficient, so past 8 queries BLAS is faster.
KERNEL_MAX_QUERIES = 8
#: Tiles of more rows than this (G query heads x T queries of one KV head) take the NumPy
#: BLAS path: the kernel's work per key grows with its tile's rows, BLAS's matmuls stay
#: efficient, but each BLAS item costs host time, so where they cross depends on the rows'
#: lengths, which a route does not see. It matters for shared-prefix calls
#: (``gqakv.ops.shared_prefix``: a group's queries stacked into the heads, G' = G x
#: queries) and for large G x T. Kernel / BLAS time, d=128, 2 threads, both alternating in
#: one process (2026-12-05, load 0.3-0.7, with the BLAS path's fused softmax step and
#: compiled paged gather):
#: - Hkv=8, B=1, 4,096 keys, T = 1: G = 32: 1.01, 64: 1.23 (bfloat16 1.04, pages of 16
#:   1.09), 128: 1.59 (bfloat16 1.46, pages 1.62); G = 4, T = 4 / 8: 0.72 / 0.86; G = 8,
#:   T = 4 / 8: 0.92 / 1.20; G = 16, T = 4: 1.24;
#: - Hkv=1, 256 keys (short rows), T = 1: G = 64: 0.67 at B=32 (bfloat16 G = 48: 0.46),
#:   0.54 at B=8 paged; G = 128: 0.97-0.99; G = 256: 1.49; G = 128 over 1,024 keys: 1.30.
#: So past 64 rows BLAS is about as fast (short rows, 128: 0.97-0.99) or faster; at 64 the
#: kernel's lead on short rows (1.5-2x) outweighs BLAS's on long ones (1.04-1.23). (Before
#: those two changes the kernel led up to 256 rows, the cap until then: 0.78 at 128.)
KERNEL_MAX_TILE_ROWS = 64
#: Calls whose rows hold at most this many keys (``Request.keys``: the longest row's, a
#: power of two) take the kernels at every chunk length and tile size: the BLAS path's
#: items cost host work each (their blocks, softmax states, matmul calls) that short rows'
#: arithmetic does not repay. Kernel / BLAS time on a 2-core AMD EPYC (2026-12-06, float32,
#: both alternating in one process; the performance guide, "On another CPU"), T queries
#: over P cached keys: SmolLM2's layer (Hq 9, Hkv 3, d 64) T = 16-128 at P = 0: 0.54-0.81
#: (B=8, T = 64: 0.40), T = 64 at P = 32 / 64: 0.98 / 1.08-1.11 (B=8: 0.69); Llama-3.1-8B's
#: (Hq 32, Hkv 8, d 128) T = 16-128 at P = 0: 0.46-0.64, T = 32-64 at P = 32-96: 0.70-0.88.
#: Longer rows stay with the caps above (at 256 keys 0.79-0.96, 512 0.97-1.07 there, and
#: on the Xeon BLAS won from 12 queries over 4,096 keys).
KERNEL_SHORT_ROW_KEYS = 128
#: Queries of one item: the tile holds G * QUERY_BLOCK rows.
QUERY_BLOCK = 16
#: A row's keys are split across threads only into pieces at least this long.
MIN_KEY_SPLIT = 256
#: Keys per block of the kernels: each tile row takes one max, one rescale of its running
#: output and one pass of exponentials per block, so that cost shrinks as blocks grow; the
#: score block is tile rows x KEY_BLOCK float32 (4 KiB for a decode tile of G = 4). 256
#: against the 32 of 16 KiB float32 rows at d = 128 before 2026-12-07 (2-core AMD EPYC, load
#: about 1, both alternating in one process, median of 10-40 calls, one and two threads):
#: decode B=4 L=4,096 0.82-0.94x the time in float32, float16, bfloat16, int8 and int4_g32,
#: B=32 L=1,024 0.77-0.82x, B=1 L=32,768 0.88x, 8-query chunks 0.88-0.94x, d = 64 (B=8
#: L=1,024) 0.93-0.94x; 512 and 1,024 were no better for chunks (the score block of their
#: 32-row tiles outgrows L1).
KEY_BLOCK = 256
#: Pages of at most this many bytes of float32 rows of the head dim (32 tokens at d = 128)
#: have their KV heads read together by the kernels (``reads_heads_together``).
TOGETHER_PAGE_BYTES = 16 << 10
#: Below this much work (query-key-head products) one thread runs the call. Alone, two
#: threads already pay from about 2^18 multiply-adds (products x d; decode, float32,
#: 2026-12-05, warm / cold caches: 2 threads / 1 at 74K 0.99 / 1.13, 147K 1.06 / 1.10,
#: 262K 0.74-0.96 / 0.89-1.09, 590K 0.67 / 0.81, 1M and more 0.61-0.71). But in a model
#: whose matmuls run on OpenBLAS's threads, those threads still spin when attention
#: starts, and the kernels' OpenMP threads wait for the cores: SmolLM2-135M's decode with
#: NumPy matmuls took 37 -> 311 ms per step at B=1 over 512 tokens and 100 -> 223 ms at
#: B=8 with the cut at 2^18 multiply-adds (with the example model's numba matmuls,
#: gqakv_examples.few_rows, 38.5 -> 38.9 and 70.2 -> 61.8 ms). So small calls stay on one
#: thread.
PARALLEL_MIN_WORK = 1 << 16
#: Prefill chunks (calls with a row of more than ``KERNEL_MAX_QUERIES`` queries, which
#: the kernels take over short rows and in batch-invariant mode) run on one thread below
#: this many multiply-adds (query-key-head products x d), whatever ``PARALLEL_MIN_WORK``.
#: They are compute-bound and come right after the model's matmuls over as many rows,
#: which run on OpenBLAS's threads: a second thread that finds OpenBLAS's worker still
#: spinning waits most of a scheduler slice (3-10 ms) for a core. (Decode and short chunks
#: keep ``PARALLEL_MIN_WORK``: they read long rows at the memory's pace, and a model's
#: matmuls of so few rows need not run threaded; the performance guide, "Threads shared
#: with the model's BLAS".) Kernel time on a 2-core AMD EPYC (2026-12-06, float32 prefill
#: over short rows; 2 threads / 1, alone / right after a [B*T, 576] @ [576, 1536] matmul):
#: SmolLM2's layer B=1 T=128 (2^22.3 products x d) 1.16 / 4.2, B=8 T=64 (2^23.5) 0.72 /
#: 2.4, T=128 (2^25.3) 1.38 / 1.48; Llama-3.1-8B's layer B=1 T=128 (2^25.2) 0.62 / 1.82,
#: B=8 T=64 (2^26.3) 0.56 / 1.09, B=8 T=128 (2^28.2) 0.56 / 1.08: past this size a lone
#: call's second thread is worth it. In the example model on SmolLM2's weights, 64-token
#: prompts at B=8: attention 182-190 ms a prompt on two threads, 116-130 with this floor
#: (the BLAS path 156-191).
CHUNK_PARALLEL_MIN_MACS = 1 << 26

_KERNEL_DTYPES = ("float32", "float16", "bfloat16")
#: The codecs the kernels decode (codes x per-token scale), declared by name: each one's
#: ``Codec.kernel_tag`` picks its decoder (``numba_kernels.CODE_VIEWS``).
_KERNEL_KV_DTYPES = ("int8", "float8_e4m3fn")
#: The grouped codecs the kernels decode (``gqakv.storage.codecs.Grouped``: a scale per
#: block of g values along d; 8-bit or two 4-bit codes per byte), declared by name: their
#: codes reach the kernels as stored (int8, or uint8 nibble pairs) with 2-D scales
#: (``numba_kernels.Grouped``), decoded in registers (``numba_kernels.run_dots``), 32
#: values at a time, so only blocks of a multiple of 32 values (every built-in group).
_KERNEL_GROUPED = tuple(name for name, (_, group, _) in GROUPED.items() if group % 32 == 0)

#: Implementation names in routes: the attention kernels, the compiled append, the
#: compiled row copy.
KERNEL = "numba kernel"
#: The BLAS path with its items on bfloat16 products (``amx_prefill``: AMX tiles or AVX-512
#: BF16 dot products), where the CPU has them.
AMX = "numba bf16 products"
WRITE_KERNEL = "numba write_tokens"
COPY_KERNEL = "numba copy_rows"
#: Why the buffers do not suit the attention kernels (the request's ``buffers``).
NOT_CONTIGUOUS = "K/V buffers are not C-contiguous (kernels read contiguous rows)"


_CODECS = frozenset({PLAIN_NAME, *_KERNEL_KV_DTYPES, *_KERNEL_GROUPED})
#: What the compiled paths implement (as data; ``route_*`` adds the per-call conditions:
#: chunk length and buffer layout).
KERNEL_PATH = FastPath(KERNEL, "attention", frozenset({CONTIGUOUS, PAGED}), _CODECS,
                       frozenset({"window", "softcap", "sinks", "alibi", "tree"}),
                       frozenset(_KERNEL_DTYPES),
                       tokens=frozenset({PADDED, PACKED}), invariant=True)
#: What the BLAS path's items on bf16 products take (``amx_prefill.declines``, as data; the
#: per-call conditions are the BLAS path's, d a multiple of ``amx.TILE_BLOCK`` and the
#: machine's ``amx.why_not``): bfloat16 queries over a plain bfloat16 cache or 8-bit codes
#: with per-token scales (every code's value is a bfloat16).
AMX_PATH = FastPath(AMX, "attention", frozenset({CONTIGUOUS, PAGED}),
                    frozenset({PLAIN_NAME, *_KERNEL_KV_DTYPES}),
                    frozenset({"window", "softcap", "sinks"}), frozenset({"bfloat16"}),
                    tokens=frozenset({PADDED, PACKED}))
WRITE_PATH = FastPath(WRITE_KERNEL, "write_kv", frozenset({CONTIGUOUS}), frozenset({PLAIN_NAME}),
                      tokens=frozenset({PADDED, PACKED}))
COPY_PATH = FastPath(COPY_KERNEL, "copy_tokens", frozenset({CONTIGUOUS}), frozenset({PLAIN_NAME}))


def route_attention(request: Request) -> Route:
    """The numba backend's attention decision (its dispatch, ``attention_route`` and
    ``route`` all ask it): the kernels (``KERNEL_PATH``, then the chunk and buffer
    conditions), else the NumPy backend's decision for the call
    (``numpy_backend.route_attention``), with the reason the kernels do not serve it;
    where that is the BLAS path and the call is one ``AMX_PATH`` takes, "numba bf16 products" when
    this machine has them (``amx.why_not``, asked per call: ``GQAKV_AMX`` may change)."""
    route = _route_by_facts(request)
    if route.impl != AMX:
        return route
    why = amx.why_not()
    if why is None:
        return route
    rejected = dict(route.rejected)
    del rejected[_numpy.BLAS]
    return Route(_numpy.BLAS, {**rejected, AMX: f"this machine runs no bfloat16 products (AMX "
                                                f"tiles or AVX-512 BF16): {why}"})


def _amx_rejection(request: Request) -> str | None:
    """Why the BLAS path's items do not run on bfloat16 products for ``request`` (its facts only)."""
    why = AMX_PATH.rejection(request)
    if why is None and request.head_dim is not None and request.head_dim % amx.TILE_BLOCK:
        why = f"head_dim={request.head_dim} ({AMX} needs d a multiple of {amx.TILE_BLOCK})"
    return why


@functools.lru_cache(maxsize=1024)
def _route_by_facts(request: Request) -> Route:
    """``route_attention`` from the request's facts alone (kept: the machine's part is
    asked per call)."""
    t_q, rows = request.t_q, request.group * request.t_q
    # every chunk length and tile size: batch-invariant calls, and calls over short rows
    any_chunk = request.invariant or (request.keys is not None
                                      and request.keys <= KERNEL_SHORT_ROW_KEYS)
    rows_then = ("" if request.keys is None else
                 f" over rows of up to {request.keys} keys (the kernels take every chunk over "
                 f"rows of at most {KERNEL_SHORT_ROW_KEYS})")
    why = (KERNEL_PATH.rejection(request)
           or request.buffers
           or (f"T={t_q} queries > {KERNEL_MAX_QUERIES}{rows_then}: a prefill chunk is "
               "compute-bound, BLAS matmuls are faster there" + (
                   f" (a packed batch's rows of at most {KERNEL_MAX_QUERIES} queries still run "
                   "the kernels, plan_mixed)" if request.tokens == PACKED else "")
               if t_q > KERNEL_MAX_QUERIES and not any_chunk else None)
           or (f"tiles of G={request.group} heads x T={t_q} queries = {rows} rows > "
               f"{KERNEL_MAX_TILE_ROWS}{rows_then}: compute-bound, BLAS matmuls are faster there"
               if rows > KERNEL_MAX_TILE_ROWS and not any_chunk else None))
    if why:
        fallback = _numpy.route_attention(request)
        why_not_amx = _amx_rejection(request)
        if fallback.impl != _numpy.BLAS:  # the tiles run the BLAS path's items only
            return Route(fallback.impl, {KERNEL: why, AMX: why_not_amx or (
                f"{AMX} runs the numpy BLAS path's items, which does not serve this call"),
                **fallback.rejected})
        if why_not_amx:
            return Route(_numpy.BLAS, {KERNEL: why, AMX: why_not_amx, **fallback.rejected})
        return Route(AMX, {KERNEL: why, _numpy.BLAS: (
            f"{AMX} serves this call: its items on bf16 products (those too small to pay for the "
            "tiles' layout steps, amx_prefill.MIN_ITEM_WORK, and float32 queries that are not "
            "bfloat16 values run the float32 matmuls)"), **fallback.rejected})
    served = f"{KERNEL} serves this call (kernels come first" + (
        "; batch-invariant mode: every chunk length, so a query's bits do not depend on its chunk)"
        if request.invariant else
        f"; rows of at most {KERNEL_SHORT_ROW_KEYS} keys: every chunk length)"
        if t_q > KERNEL_MAX_QUERIES or rows > KERNEL_MAX_TILE_ROWS else ")")
    return Route(KERNEL, {impl: served for impl in (AMX, *_numpy.BLAS_PATHS, GENERIC)})


@functools.lru_cache(maxsize=256)
def _write_route(spec, head_dim: int, buffers: str | None, tokens: str) -> Route:
    """``route_copy`` of an append into a store of ``spec`` (kept: every layer of every
    step asks it)."""
    return route_copy(_numpy.write_request(spec, head_dim, tokens, buffers))


@functools.lru_cache(maxsize=256)
def route_copy(request: Request) -> Route:
    """The numba backend's append (``write_kv``) and row-copy (``copy_tokens``) decision:
    one compiled call for every row (``numba_kernels.write_tokens``, ``copy_rows``: a
    ``memmove`` per contiguous run) into contiguous, plain storage (a paged pool's pages
    count as such rows for a copy) whose buffers suit it (``buffers`` None); else an
    append takes the NumPy backend's decision (``numpy_backend.route_write``: pages and
    the built-in codecs by one assignment per buffer, ``numpy_batch.append``), and a copy
    the generic code (codes, scales and their copies are computed there)."""
    path = WRITE_PATH if request.op == "write_kv" else COPY_PATH
    why = path.rejection(request) or request.buffers
    if why and request.op == "write_kv":  # pages, codes: the NumPy backend's appends
        fallback = _numpy.route_write(request)
        return Route(fallback.impl, {path.name: why, **fallback.rejected})
    if why:
        return Route(GENERIC, {path.name: why})
    return Route(path.name, {GENERIC: f"{path.name} serves this call (kernels come first)"})


class NumbaBackend(NumpyBackend):
    name = "numba"
    priority = 20  # above numpy (10): the CPU default when numba imports; below cupy (100)
    #: No: small calls take the kernels, and the longer chunks that reach the BLAS path ran
    #: 1.2-1.45x slower as the one pass than on its items (fused softmax).
    one_pass_batches = False
    # array_library, device_kind, dtypes and head_dims are NumpyBackend's (same arrays)
    features = frozenset({
        f"numba kernels: decode and chunks <= {KERNEL_MAX_QUERIES} queries, every chunk over rows "
        f"<= {KERNEL_SHORT_ROW_KEYS} keys (float32, float16, bfloat16)",
        "paged storage in the kernels (page table read once per page run)",
        "int8 / float8_e4m3fn storage in the kernels (decoded in registers, scales folded)",
        "float16/bfloat16 converted in registers, computed in float32",
        "float64 and long prefill chunks: the numpy backend's BLAS path",
        "threads: GQAKV_NUM_THREADS, else all cores",
        "variants in the kernels: window (reads min(L, W) keys), softcap, sinks, ALiBi",
        "draft trees in the kernels (speculative verification: ancestors per chunk query)",
    })

    fast_paths = (KERNEL_PATH, AMX_PATH, *_numpy.FAST_PATHS, WRITE_PATH, _numpy.WRITE_PATH,
                  COPY_PATH)
    # The kernels are compute-bound at G = 4 (a shared call's tile does the rows'
    # arithmetic), so a shared-prefix group over 16-bit or 8-bit storage, whose reads cost
    # less, must save more of them. Measured 2026-12-05 (shared_prefix_times, Hkv 8, G 4,
    # d 128, pages of 16, 2 threads, load about 1; shared / unshared time, rows x prefix,
    # saved reads): bfloat16 8 x 1,024 (7,168) 1.24, 4 x 4,096 (12,288) 0.97, 8 x 4,096
    # (28,672) 0.84, 16 x 2,048 (30,720) 0.91, 32 x 4,096 0.46; int8 / e4m3 8 x 1,024
    # 1.08 / 1.14, 8 x 4,096 0.91 / 0.92, 32 x 1,024 (31,744; the shared call's 128 rows
    # on the float32 BLAS path) 1.38 / 1.20, 16 x 4,096 (61,440) 0.90 / 0.89, 32 x 4,096
    # 0.74 / 0.67; float32 0.30-0.60 on all of these (the default threshold, 4,096).
    shared_prefix_read_factor = {2: 4, 1: 16}

    def __init__(self):
        self._reason: str | None | bool = False  # False: not checked yet

    def unavailable_reason(self) -> str | None:
        if self._reason is False:
            try:
                import numba  # noqa: F401
            except Exception as exc:  # missing, or broken against this NumPy
                self._reason = f"numba is not importable ({type(exc).__name__}: {exc})"
            else:
                self._reason = None
        return None if isinstance(self._reason, bool) else self._reason  # checked: never a bool

    def blas_options(self) -> dict:
        """The BLAS path's online softmax fused into one compiled pass per block, its
        paged blocks gathered, its float16/bfloat16 blocks and queries widened, its 8-bit
        code blocks dequantized and its float16 results narrowed by compiled calls, and
        bfloat16 items on bf16 products where the CPU has them (``amx_prefill``):
        ``_blas_hooks``."""
        return _blas_hooks()

    # -- hooks for the tools (gqakv.dispatch.backend.Backend) ----------------------------------------

    def split_attention(self, dtype: str):
        if dtype not in _KERNEL_DTYPES:  # float64: the numpy backend's BLAS path
            return super().split_attention(dtype)

        def split(q, k, v, rows, lens, n_new, *, scale, return_lse):
            return attention_numba(q, k, v, rows, lens, n_new, scale=scale, return_lse=return_lse,
                                   workers=2, min_key_split=16, parallel_min_work=0)
        return split, "forced splits (attention_numba, 16-key pieces, 2 workers) + merge_attention"

    def kernel_entries(self) -> tuple[tuple[str, str], ...]:
        """The compiled kernels, and the appends this backend's route hands to the NumPy
        backend (``numpy_batch.write_tokens`` into pages, ``write_coded`` of codes,
        ``write_rows`` of long chunks)."""
        kernels = f"{__package__}.numba_kernels"
        return (*((kernels, name) for name in ("attention_items", "merge_pieces", "write_tokens",
                                               "copy_rows")),
                (f"{__package__}.numpy_batch", "write_tokens"),
                (f"{__package__}.numpy_batch", "write_coded"),
                (f"{__package__}.numpy_batch", "write_rows"))

    def thread_count(self) -> int | None:
        return default_workers()

    def threads_line(self) -> str:
        default_workers()  # validates GQAKV_NUM_THREADS
        return ""

    def compile_note(self) -> str | None:
        return jit_note()

    def served_counts(self) -> dict[str, int]:
        """The BLAS path's items run on bfloat16 products (``amx_prefill``): the numpy BLAS route's
        bfloat16 fast path where the CPU has the tiles."""
        return {"items on bf16 products": _amx_items_served()}

    def route(self, request: Request | str, **facts) -> Route:
        """The implementation that runs ``request`` (a ``Request`` or an operation and its
        facts; those not given are taken as favourable), from the decisions the dispatch
        takes (``route_attention``, ``route_copy``)."""
        request = as_request(request, facts)
        if request.op is None:
            return super().route(request)  # says an operation is needed
        route = (route_attention if request.op == "attention" else route_copy)(request)
        return Route(route.impl, dict(route.rejected))  # the kept route stays unshared

    def implementations(self) -> dict[str, str]:
        kinds = ", ".join(_KERNEL_DTYPES + _KERNEL_KV_DTYPES + _KERNEL_GROUPED)
        return {
            KERNEL: (f"attention, t_q <= {KERNEL_MAX_QUERIES} (any t_q over rows of at most "
                     f"{KERNEL_SHORT_ROW_KEYS} keys); {kinds}; contiguous or paged "
                     "C-contiguous buffers; window, softcap, sinks, alibi"),
            WRITE_KERNEL: "appends to contiguous unquantized rows",
            COPY_KERNEL: "row copies between contiguous unquantized stores (and page copies)",
            AMX: _amx_line(),
            **{impl: f"{why} (the numpy backend's)"
               for impl, why in super().implementations().items() if impl != GENERIC},
            GENERIC: "quantized row copies, appends and attention in other codecs",
        }

    def _attention_decision(self, q, k_buf, v_buf, store=None, features=frozenset(),
                            tokens=None) -> Route:
        """``route_attention`` for a call's arrays (``store``: its KVStore, when its kind or
        quantized storage matters; ``k_buf``/``v_buf`` are then the pool or the codes;
        ``tokens``: the call's ``AttentionInputs.token_facts``, default padded q's)."""
        arrays = [k_buf, v_buf]
        if store is None:
            request = Request("attention", dtype=_dtype_name(k_buf.dtype), head_dim=k_buf.shape[-1],
                              group=max(1, int(q.shape[1]) // _kv_heads(k_buf)))
        else:
            request = Request.of_store("attention", store,
                                       group=max(1, int(q.shape[1]) // store.kv_heads))
            arrays += [a for a in (store.k_scale, store.v_scale) if a is not None]
        buffers = None if all(a.flags.c_contiguous for a in arrays) else NOT_CONTIGUOUS
        tokens = {"t_q": q.shape[2]} if tokens is None else tokens
        return route_attention(request.with_(features=features, buffers=buffers, **tokens))

    def attention_route(self, q, k_buf, v_buf, store=None) -> tuple[str, str]:
        """(implementation, why) for a plain causal attention call over these arrays:
        "numba kernel" with an empty reason, or "numpy BLAS" / "numba bf16 products" (the NumPy
        backend's path for the storage kind, its items on bf16 products where they take the
        call) with the reason the kernel is not used.
        ``store``: the call's KVStore, when its kind (paged: ``k_buf``/``v_buf`` are the
        pool) or quantized storage (``k_buf``/``v_buf`` hold codes) matters."""
        route = self._attention_decision(q, k_buf, v_buf, store)
        if route.impl == KERNEL:
            return KERNEL, ""
        return route.impl, route.rejected[KERNEL]

    def _write_decision(self, store, k_new, v_new) -> tuple[Route, list | None]:
        """``route_copy`` for an append, and the buffers as the copy kernel's bits."""
        bits, layout = None, None
        args = store_args(store)
        if args.write_view is not False:  # contiguous and not quantized
            if not k_new.dtype == store.k.dtype == v_new.dtype:
                layout = (f"k_new / v_new of dtype {k_new.dtype} / {v_new.dtype} "
                          f"({WRITE_KERNEL} copies the cache's {store.k.dtype} values)")
            elif not args.c_contiguous:
                layout = "cache buffers are not C-contiguous"
            elif not (k_new.strides[-1] == k_new.itemsize and v_new.strides[-1] == v_new.itemsize):
                layout = "k_new / v_new head dim is strided (the kernel copies contiguous runs of d)"
            elif (args.write_view is None or not isinstance(k_new, np.ndarray)
                  or not isinstance(v_new, np.ndarray)):
                layout = "buffers that are not NumPy arrays of one element width"
            else:  # one width: the store's dtype is k_new's
                bits = [*args.write_bits, k_new.view(args.write_view), v_new.view(args.write_view)]
        tokens = PACKED if k_new.ndim == 3 else PADDED
        route = args.write_routes.get((layout, tokens))
        if route is None:
            route = args.write_routes[layout, tokens] = _write_route(store.spec, store.head_dim,
                                                                     layout, tokens)
        if bits is not None and tokens == PACKED:  # [N, Hkv, d] as [N, Hkv, 1, d] (query_slot)
            bits[2:] = [x.reshape(x.shape[0], x.shape[1], 1, x.shape[2]) for x in bits[2:]]
        return route, bits

    def write_kv(self, store, k_new, v_new, inputs) -> None:
        """Contiguous, unquantized storage: every entry's tokens written by one compiled
        call (``numba_kernels.write_tokens``) instead of a slice assignment per row;
        pages and codecs: the NumPy backend's appends (``numpy_batch.append``: one
        assignment per buffer through the page table, codes encoded for every token at
        once; chunks of more than ``WRITE_MAX_ROW_TOKENS`` row by row)."""
        route, bits = self._write_decision(store, k_new, v_new)
        if route.impl == GENERIC:  # the generic per-row writes (this backend's route says so)
            return Backend.write_kv(self, store, k_new, v_new, inputs)
        if route.impl == _numpy.WRITE:  # pages, codes: the NumPy backend's appends
            from . import numpy_batch

            return numpy_batch.append(store, k_new, v_new, inputs)
        assert bits is not None  # the route chose the kernel: its buffers were viewed
        _kernels().write_tokens(*bits, np.asarray(inputs.rows, dtype=np.int64),
                                np.asarray(inputs.starts, dtype=np.int64),
                                np.asarray(inputs.n_new, dtype=np.int64),
                                _PADDED_OFFSETS if inputs.offsets is None else
                                np.asarray(inputs.offsets, dtype=np.int64))

    def copy_tokens(self, dst, dst_rows, src, src_rows, n_tokens) -> None:
        """Contiguous, unquantized stores (rows, or a paged pool's pages as rows): every copy
        of the call by one compiled call (``numba_kernels.copy_rows``); quantized stores
        (scales travel too): the NumPy path (``route_copy`` decides)."""
        bits, layout = None, None
        if src.spec != dst.spec:
            layout = "src and dst stored differently"
        elif dst.kind == CONTIGUOUS and not dst.quantized:
            if not all(x.flags.c_contiguous for x in (dst.k, dst.v, src.k, src.v)):
                layout = "buffers are not C-contiguous"
            else:
                bits = _copy_bits(dst.k, dst.v, src.k, src.v)
                if bits is None:
                    layout = "buffers that are not NumPy arrays of one element width"
        route = route_copy(Request.of_store("copy_tokens", dst, buffers=layout))
        if route.impl == GENERIC:
            return super().copy_tokens(dst, dst_rows, src, src_rows, n_tokens)
        nk = _kernels()
        assert bits is not None  # the route chose the kernel: its buffers were viewed
        nk.copy_rows(*bits, *(np.asarray(a, dtype=np.int64).reshape(-1) for a in
                              (dst_rows, src_rows, n_tokens)))

    def plan_attention(self, store, inputs, params, q_shape):
        """The kernels' items, thread runs and merge layout (``plan_numba``) when they serve
        this batch (``route_attention`` without the per-call buffer check); a packed batch
        mixing long chunks and short ones split in two (``plan_mixed``); else the NumPy
        backend's plan."""
        request = _attention_request(store, inputs, q_shape)
        if route_attention(request).impl != KERNEL:  # the NumPy backend's path plans its own
            mixed = plan_mixed(store, inputs, params, q_shape, request)
            return mixed if mixed is not None else super().plan_attention(store, inputs, params,
                                                                           q_shape)
        work = plan_numba(inputs.lens, inputs.n_new, q_shape, store.kv_heads, params,
                          invariant=inputs.invariant, tree=inputs.tree,
                          page_size=_page_size(store))
        work.inputs = inputs  # the batch it was planned for (attention uses it for that one only)
        return work

    def items_on_blas(self, store, inputs, q_shape) -> bool:
        """No where the BLAS path's items run on bfloat16 products (route "numba bf16
        products"): one worker would run them on one core."""
        return route_attention(_attention_request(store, inputs, q_shape)).impl != AMX

    def attention(self, q, store, inputs, params, *, return_lse: bool, work=None, out=None,
                  lse_out=None):
        """Compiled decode/short-chunk attention over contiguous, paged or quantized
        storage with the variants the kernels implement, else the NumPy backend's path
        (``route_attention`` decides; the NumPy backend hands what its BLAS paths do not
        serve on to the generic code). ``work``: this batch's ``plan_numba`` (from
        ``plan_attention``); ``out`` / ``lse_out``: the caller's buffers (see there)."""
        args = store_args(store)
        if isinstance(work, MixedWork) and work.inputs is inputs and args.c_contiguous:
            return run_mixed(work, q, store, return_lse=return_lse, out=out, lse_out=lse_out)
        # planned: the route was the kernels' for this storage, chunk and variant; only
        # this layer's buffers are left to judge
        planned = isinstance(work, NumbaWork) and work.inputs is inputs and args.c_contiguous
        if not planned and self._attention_decision(q, store.k, store.v, store, inputs.features,
                                                    inputs.token_facts(q.shape)).impl != KERNEL:
            # the NumPy backend's path, with its own plan when the batch was planned for it
            return super().attention(q, store, inputs, params, return_lse=return_lse,
                                     work=None if isinstance(work, NumbaWork) else work,
                                     out=out, lse_out=lse_out)
        k_buf, v_buf = args.layout(store)
        if not (isinstance(work, NumbaWork) and work.inputs is inputs):
            work = plan_numba(inputs.lens, inputs.n_new, tuple(q.shape), _kv_heads(k_buf), params,
                              invariant=inputs.invariant, tree=inputs.tree,
                              page_size=_page_size(store))
        return run_numba(work, q, k_buf, v_buf, inputs.rows, inputs.lens, inputs.n_new,
                         return_lse=return_lse, out=out, lse_out=lse_out, offsets=inputs.offsets)


class FusedSoftmaxState(SoftmaxState):
    """``SoftmaxState`` with one more step, ``add_causal``: a float32 block of causal
    (or sliding-window) scores masked, reduced and exponentiated by one compiled kernel
    (``numba_kernels.softmax_block``) between BLAS's two matmuls. In a long prefill chunk
    NumPy's five elementwise passes over each score block (mask, max, subtract, exp,
    sum) cost about as much as the matmuls at d = 64. The same states (merge, result);
    exponentials within about 1 ulp of NumPy's. ``numpy_attention.fold_block`` asks
    ``add_causal`` first and masks and calls ``add`` when it declines."""

    __slots__ = ()

    def add_causal(self, s, v, nq: int, pos0: int, window: int) -> bool:
        """Fold in one key block: ``s`` [..., rows, K] scaled scores, unmasked (consumed),
        row r holding query r % nq, which sees keys j with j <= pos0 + r % nq (and, with a
        ``window`` W > 0, j > pos0 + r % nq - W), j counted from the block's first key;
        ``v`` [..., K, d]. False, with nothing changed, unless both are float32 and s is
        C-contiguous (the caller then masks and calls ``add``)."""
        if not (s.dtype == v.dtype == np.float32 and s.flags.c_contiguous and s.shape[-1] > 0):
            return False
        if self.m is not None and not all(x.dtype == np.float32 and x.flags.c_contiguous
                                          for x in (self.m, self.l)):
            return False  # a state NumPy's passes began in another layout: they go on
        if self.m is None:
            self.m = np.full(s.shape[:-1] + (1,), -np.inf, dtype=np.float32)
            self.l = np.zeros(s.shape[:-1] + (1,), dtype=np.float32)
        alpha = np.empty_like(self.m)
        # m, l: contiguous arrays this state made, so their flat views are updated in place
        _kernels().softmax_block(s.reshape(-1, s.shape[-1]), self.m.reshape(-1), self.l.reshape(-1),
                                 alpha.reshape(-1), nq, pos0, window, 1.0, s.shape[-1],
                                 _NO_SPLIT, _NO_SPLIT)
        o_blk = s @ v  # s now holds p
        if self.o is None:
            self.o = o_blk
        else:
            self.o *= alpha
            self.o += o_blk
        return True


_NO_SPLIT = np.empty((0, 0), dtype=np.uint16)  # softmax_block writes p itself


def _attention_request(store, inputs, q_shape) -> Request:
    """The routing request of a planned attention batch (``plan_attention``'s facts)."""
    return Request.of_store("attention", store, features=inputs.features,
                            group=max(1, int(q_shape[1]) // store.kv_heads),
                            **inputs.token_facts(q_shape))


def _amx_line() -> str:
    """What ``gqakv info`` says of the BLAS path's items on bf16 products."""
    why = amx.why_not()
    here = f"on, {amx.engine()}" if why is None else f"off, {why}"
    return ("the numpy BLAS path's calls with their items on bfloat16 products where the CPU has "
            f"them, AMX tiles or AVX-512 BF16 (amx_prefill; here: {here}): bfloat16 queries "
            "over a plain bfloat16 cache or int8 / float8_e4m3fn codes with per-token scales, "
            f"contiguous or paged, d a multiple of {amx.TILE_BLOCK}; window, softcap, sinks; "
            "items too small to pay for their layout steps run the float32 matmuls")


def _amx_items_served() -> int:
    """``amx_prefill.items_served``, 0 while that module is not loaded (nothing can have
    run on the tiles; importing it would compile its kernels)."""
    import sys

    module = sys.modules.get(f"{__package__}.amx_prefill")
    return 0 if module is None else module.items_served()


def _amx_items(q, reader, params, trees):
    """``amx_prefill.item_kernel`` (imported on first use: it compiles numba kernels)."""
    from . import amx_prefill

    return amx_prefill.item_kernel(q, reader, params, trees)


def gather_pages(pool, pages, h0: int, h1: int, out) -> bool:
    """The BLAS path's paged gather (``numpy_readers.Pages``' ``gather``) through
    ``numba_kernels.gather_pages``: ``out[:, j] = pool[pages[j], h0:h1]`` for C-contiguous
    ``pool`` [num_pages, Hkv, P, *tail] and ``out`` [h1 - h0, >= len(pages), P, *tail] of
    one element size (any dtype: copied as unsigned integers of that size). False, with
    nothing written, for any other arrays or a page id outside the pool (the reader's own
    loop then copies, or raises NumPy's IndexError)."""
    nk = _kernels()
    bits = _copy_bits(pool, out, views=nk.GATHER_VIEW)
    pages = np.asarray(pages)
    if (bits is None or not pool.flags.c_contiguous or not out.flags.c_contiguous
            or pool.ndim != out.ndim or pool.ndim < 3 or len(pages) > out.shape[1]
            or not 0 <= h0 <= h1 <= pool.shape[1] or h1 - h0 != out.shape[0]):
        return False
    if len(pages) and not (0 <= int(pages.min()) and int(pages.max()) < pool.shape[0]):
        return False  # the kernel does not check bounds: the reader's loop raises NumPy's error
    src, dst = (b.reshape(*b.shape[:3], -1) for b in bits)
    nk.gather_pages(src, pages, h0, h1, dst)
    return True


#: The element views ``widen_block`` hands ``numba_kernels.convert_bits`` (its ``decode``
#: reads uint16 as float16 bits and int16 as bfloat16 bits).
_WIDEN_VIEW = {"float16": np.uint16, "bfloat16": np.int16}


def widen_block(x, out):
    """The BLAS path's float16/bfloat16 block cast (``numpy_readers.Plain``'s ``widen``,
    ``numpy_attention.attend``'s for query tiles): ``out[:] = x`` as float32, one GIL-free
    compiled pass per head (``numba_kernels.convert_bits``: the hardware's float16
    conversion, exact with infinities and NaN), where NumPy's cast takes six passes over
    float16 bits and holds the GIL between them. ``x`` [hh, n, d] and ``out`` (float32, its
    shape) must each be C-contiguous within a head, as the readers' blocks are; returns
    ``out``, or None with nothing written for anything else (NumPy's cast then runs)."""
    view = _WIDEN_VIEW.get(_dtype_name(x.dtype)) if isinstance(x, np.ndarray) else None
    if (view is None or not isinstance(out, np.ndarray) or out.dtype != np.float32
            or out.shape != x.shape or x.ndim < 2):
        return None
    return _each_head(_kernels().convert_bits, out, x.view(view))


def narrow_block(x, out):
    """The BLAS path's float16 result store (``numpy_attention.attend``'s ``narrow``) and
    the kernels' (``_hand_back``): ``out[:] = x`` for float32 ``x`` [hh, n, d] into float16
    ``out`` (its shape), one GIL-free compiled pass per head
    (``numba_kernels.narrow_to_half``: the hardware's conversion, rounding to nearest even
    as NumPy's cast, which is scalar code here). Both must be C-contiguous within a head
    (a padded output's tile is; a packed one's is not); returns ``out``, or None with
    nothing written for anything else (NumPy's assignment then runs)."""
    if (not isinstance(x, np.ndarray) or not isinstance(out, np.ndarray) or x.dtype != np.float32
            or out.dtype != np.float16 or out.shape != x.shape or x.ndim < 2):
        return None
    done = _each_head(_kernels().narrow_to_half, out.view(np.uint16), x)
    return None if done is None else out


#: The per-token codecs whose codes ``numba_kernels.decode`` reads as stored: int8 codes,
#: uint8 float8_e4m3fn bit patterns.
_PER_TOKEN_CODES = {"int8": np.int8, "float8_e4m3fn": np.uint8}


def dequantize_block(codec, codes, scales, out):
    """The BLAS path's dequantization of an 8-bit block with per-token scales
    (``numpy_readers.Coded``'s ``dequantize``): ``out[h, j] = value(codes[h, j]) x
    scales[h, j]``, one GIL-free compiled pass per head
    (``numba_kernels.dequantize_per_token``: the codec's own float32 arithmetic, bit for
    bit; e4m3fn's NaN codes give NaN), where NumPy's int8 cast and e4m3 lookup run one to
    two orders slower. ``codes`` [hh, n, d], ``scales`` [hh, n] float32 and ``out`` [hh,
    n, d] float32, each
    C-contiguous within a head; returns ``out``, or None with nothing written for any
    other codec (block scales) or layout (the codec's NumPy pass then runs)."""
    view = _PER_TOKEN_CODES.get(getattr(codec, "name", None))
    arrays = (codes, scales, out)
    if (view is None or not all(isinstance(a, np.ndarray) for a in arrays)
            or codes.dtype.itemsize != 1 or scales.dtype != np.float32 or out.dtype != np.float32
            or codes.ndim < 2 or out.shape != codes.shape or scales.shape != codes.shape[:-1]):
        return None
    return _each_head(_kernels().dequantize_per_token, out, codes.view(view), scales, flat=False)


def _each_head(kernel, out, *arrays, flat: bool = True):
    """``kernel(*heads, out_head)`` for each head h (dim 0) of ``arrays`` and ``out``, the
    heads flattened where ``flat`` (the element-wise kernels take 1-D arrays); returns
    ``out``, or None with nothing written unless every head of each is C-contiguous (so a
    flattened head is a view, never a copy). The callers check shapes and dtypes."""
    every = (*arrays, out)
    heads = [[a[h] for a in every] for h in range(out.shape[0])]
    if not all(part.flags.c_contiguous for parts in heads for part in parts):
        return None
    for parts in heads:
        kernel(*(part.reshape(-1) if flat else part for part in parts))
    return out


def _dtype_name(dtype) -> str:
    from gqakv.core.dtypes import canonical_name

    return canonical_name(dtype)


def jit_note(where=None) -> str:
    """What ``gqakv selftest``'s compile line says for numba: nothing is built ahead, its
    kernels compile (one specialization per dtype, layout and variant reached) on their
    first call in the lines below, and numba caches them on disk, so a first run is far
    slower. ``where``: the cache folder (default: the one numba's cache locator chose)."""
    from pathlib import Path

    if where is None:
        from . import numba_kernels

        where = numba_kernels._attend._cache._cache_path
    folder = Path(where)
    cached = len(list(folder.glob("numba_kernels.*.nbi"))) if folder.is_dir() else 0
    state = (f"{cached} kernel cache indexes found there: compiled kernels load from it" if cached else
             "none cached there yet: this run compiles them (a few minutes; about 3 on an idle 2-core machine, "
             "where a cached run takes about 30 s)")
    return (f"built on first call: numba compiles each kernel specialization the lines below reach and "
            f"caches it on disk ({folder}); {state}")


def default_workers() -> int:
    """GQAKV_NUM_THREADS if set, else every thread numba may start (its core count)."""
    import numba

    limit = numba.config.NUMBA_NUM_THREADS
    if os.environ.get(ENV_THREADS):
        return min(_threads.default_workers(), limit)
    return limit


def _copy_bits(*arrays, views=None):
    """The arrays as unsigned integers of their element width (views; ``views``, default
    ``COPY_VIEW``), or None when they do not share one width the kernels take."""
    nk = _kernels()
    widths = {a.dtype.itemsize for a in arrays}
    if len(widths) != 1 or not all(isinstance(a, np.ndarray) for a in arrays):
        return None
    view = (nk.COPY_VIEW if views is None else views).get(widths.pop())
    return None if view is None else [a.view(view) for a in arrays]


def attention_numba(q, k_buf, v_buf, rows, lens, n_new, *, scale: float, return_lse: bool,
                    workers: int | None = None, query_block: int = QUERY_BLOCK,
                    min_key_split: int = MIN_KEY_SPLIT, key_block: int | None = None,
                    parallel_min_work: int | None = None,
                    params: AttentionParams | None = None):
    """Attention through the numba kernels; see ``gqakv.gqa_attention`` for the semantics.

    q: [B, Hq, T, d] (the cache's dtype); k_buf, v_buf: [rows_total, Hkv, max_len, d]
    C-contiguous float32/float16/bfloat16, or a store's layout from ``kernel_layout``
    (paged, quantized); rows, lens, n_new: host ints [B]. Returns
    out [B, Hq, T, d] in q's dtype and, with ``return_lse``, lse [B, Hq, T] float32
    (padded queries: 0 and -inf). The keywords expose the blocking so tests can force
    every split on small shapes. ``params``: the call's ``AttentionParams`` (default:
    plain causal with ``scale``; when given, its scale is the one used), its variants included.
    ``plan_numba`` then ``run_numba``: the planned part serves every layer of a step.
    """
    if params is None:
        params = AttentionParams(scale=scale)
    if isinstance(k_buf, np.ndarray):  # contiguous arrays: float16/bfloat16 as their bits
        nk = _kernels()
        k_buf, v_buf = _kernel_buffers(k_buf, v_buf, nk)
    work = plan_numba(lens, n_new, tuple(q.shape), _kv_heads(k_buf), params, workers=workers,
                      query_block=query_block, min_key_split=min_key_split, key_block=key_block,
                      parallel_min_work=parallel_min_work, page_size=_layout_page_size(k_buf))
    return run_numba(work, q, k_buf, v_buf, rows, lens, n_new, return_lse=return_lse)


def default_parallel_min_work(n_new, head_dim: int) -> int:
    """The work (query-key-head products) below which a call runs on one thread when it
    names none: ``PARALLEL_MIN_WORK``, raised to ``CHUNK_PARALLEL_MIN_MACS`` / d where a
    row takes more than ``KERNEL_MAX_QUERIES`` queries (n_new: host ints [B])."""
    if int(np.max(n_new, initial=0)) > KERNEL_MAX_QUERIES:
        return max(PARALLEL_MIN_WORK, -(-CHUNK_PARALLEL_MIN_MACS // head_dim))
    return PARALLEL_MIN_WORK


def default_key_block(head_dim: int) -> int:
    """Keys per block of the kernels when a call names none: ``KEY_BLOCK`` for every head
    dim (``head_dim``: kept for callers that ask by it)."""
    return KEY_BLOCK


def together_page_limit(head_dim: int) -> int:
    """The largest page (tokens) whose KV heads the kernels read together: float32 rows of
    ``TOGETHER_PAGE_BYTES`` (at least 8), within the default key block."""
    return min(KEY_BLOCK, max(8, TOGETHER_PAGE_BYTES // (4 * head_dim)))


def reads_heads_together(store) -> bool:
    """Whether the kernels read the KV heads of a paged store's pages together: pages of at
    most ``together_page_limit`` tokens (``numba_kernels.heads_per_pass``; the layout's
    ``together``, and ``plan_numba`` plans such calls keys first). Larger pages keep one
    head per pass: read together, 8 streams 128 KB apart cost 1.2x at 256-token pages
    (the performance guide)."""
    return (store.kind == PAGED
            and store.page_table.page_size <= together_page_limit(store.head_dim))


def _page_size(store) -> int | None:
    """Tokens per page of a paged store (``plan_numba``'s ``page_size``), else None."""
    return int(store.page_table.page_size) if store.kind == PAGED else None


def _layout_page_size(k_buf) -> int | None:
    """Tokens per page of a kernel layout (``kernel_layout``), None when it is not paged."""
    if isinstance(k_buf, np.ndarray) or not hasattr(k_buf, "table"):
        return None
    return int((k_buf.pool if hasattr(k_buf, "pool") else k_buf.codes).shape[2])


class NumbaWork:
    """The planned part of a numba attention call (``plan_numba``): everything that depends
    on the batch (lengths, n_new, q's shape, the variant), not on q or the layer's K/V.

    items [n, 7] int64 ``(i, h0, h1, t0, t1, j0, j1)`` in thread order; run_starts
    [workers + 1]; part_rows [n] (an item's first row in the split partials, -1 when the
    item covers all its queries' keys); groups / group_starts / piece_rows: the key pieces
    merged per (i, h0, h1, t0, t1); n_part: rows of the partials; the variant's kernel
    arguments (scale, softcap, window, sinks [Hq], alibi [Hq] or None, tree: a
    ``numba_kernels.Tree`` or None)."""

    q_shape: tuple[int, ...]
    G: int
    workers: int
    items: np.ndarray
    run_starts: np.ndarray
    part_rows: np.ndarray
    groups: np.ndarray | None
    group_starts: np.ndarray
    piece_rows: np.ndarray
    n_part: int
    key_block: int
    scale: np.float32
    softcap: np.float32
    window: int
    sinks: np.ndarray
    alibi: np.ndarray | None
    tree: object  # numba_kernels.Tree, or None: compiled without the tree's clause
    inputs: object  # the AttentionInputs it was planned for (None: planned for a bare call)


def plan_numba(lens, n_new, q_shape, kv_heads: int, params: AttentionParams, *,
               workers: int | None = None, query_block: int = QUERY_BLOCK,
               min_key_split: int = MIN_KEY_SPLIT, key_block: int | None = None,
               parallel_min_work: int | None = None, invariant: bool = False,
               tree=None, page_size: int | None = None) -> NumbaWork:
    """The items, their sharing among threads and the merge layout of a call with these
    lengths, queries of ``q_shape`` (padded ``[B, Hq, T, d]`` or packed ``[N, Hq, d]``) and
    variant (see ``NumbaWork``). ``invariant`` (batch-invariant mode): one query per item
    and no key splits, so each query's keys are folded from its first visible key in
    blocks of ``key_block`` (``KEY_BLOCK`` by default) whatever the batch. ``tree``: the
    call's ``DraftTree`` (None: none): key spans by the tree rule (``cpu_plan._plan``) and
    the kernels' ``Tree``. ``page_size``: the call reads paged storage of pages of this
    many tokens (None: contiguous), whose pages hold every KV head; pages of at most
    ``key_block`` and ``together_page_limit`` tokens, whose KV heads the kernels read together
    (``numba_kernels.heads_per_pass``), have their rows cut into key pieces before heads
    (``_plan``'s ``keys_first``), so an item covers all KV heads of its keys and its pages
    are read whole, in address order. ``parallel_min_work``: a call of less work
    (query-key-head products) runs on one thread (None: ``default_parallel_min_work``)."""
    import numba

    nk = _kernels()
    Hq, d = int(q_shape[1]), int(q_shape[-1])  # Hq is dim 1 in both layouts
    G = Hq // kv_heads
    lens = np.asarray(lens, dtype=np.int64)
    n_new = np.asarray(n_new, dtype=np.int64)
    w = NumbaWork()
    w.inputs = None
    w.q_shape, w.G = tuple(int(s) for s in q_shape), G
    w.scale = np.float32(params.scale)
    w.window = nk.NO_WINDOW if params.window is None else params.window
    w.softcap = np.float32(0.0 if params.softcap is None else params.softcap)
    w.sinks = np.full(Hq, -np.inf, np.float32) if params.sinks is None else \
        np.asarray(params.sinks, dtype=np.float32)
    # None compiles the kernels without ALiBi (numba_kernels.bias)
    w.alibi = None if params.alibi_slopes is None else np.asarray(params.alibi_slopes, np.float32)
    w.key_block = default_key_block(d) if key_block is None else key_block
    trees, w.tree = None, None
    if tree is not None:
        entries = [tree.entry(i) for i in range(tree.batch)]
        trees = entries.__getitem__
        ancestors = np.zeros(tree.parents.shape + tree.parents.shape[1:], dtype=np.uint8)
        for i, e in enumerate(entries):
            ancestors[i, :e.size, :e.size] = e.ancestors
        w.tree = nk.Tree(ancestors, np.ascontiguousarray(tree.depth, dtype=np.int64))
    if workers is None:
        workers = default_workers()
    workers = max(1, min(workers, numba.config.NUMBA_NUM_THREADS))
    if invariant:
        query_block, min_key_split = 1, INVARIANT_NO_SPLIT
    # keys first where the kernels read a page's heads together (the layout's ``together``)
    keys_first = (page_size is not None
                  and page_size <= min(w.key_block, together_page_limit(d)))
    if parallel_min_work is None:
        parallel_min_work = default_parallel_min_work(n_new, d)
    # a call below parallel_min_work is cut for one thread (no key pieces to merge)
    items, total = _plan(lens, n_new, kv_heads, G, workers, query_block, min_key_split,
                         params=params, trees=trees, keys_first=keys_first,
                         parallel_min_work=parallel_min_work)
    if items and total < parallel_min_work:
        workers = 1
    w.workers = workers
    runs = _share(items, workers) if items else []
    order = [it for run in runs for it in run]
    w.run_starts = np.cumsum([0] + [len(run) for run in runs], dtype=np.int64)
    w.part_rows = np.full(len(order), -1, dtype=np.int64)
    groups: dict[tuple, list[int]] = {}
    n_part = 0
    for x, (i, h0, h1, t0, t1, j0, j1, _) in enumerate(order):
        tr = None if trees is None else trees(i)
        if (j0, j1) != block_keys(params, int(lens[i]), int(n_new[i]), t0, t1, tr):  # a key piece
            w.part_rows[x] = n_part
            groups.setdefault((i, h0, h1, t0, t1), []).append(n_part)
            n_part += (h1 - h0) * G * (t1 - t0)
    w.n_part = n_part
    w.items = np.array([it[:7] for it in order], dtype=np.int64).reshape(-1, 7)
    keys = list(groups)
    w.groups = np.array(keys, dtype=np.int64).reshape(-1, 5) if keys else None
    w.group_starts = np.cumsum([0] + [len(groups[k]) for k in keys], dtype=np.int64)
    w.piece_rows = np.array([p for k in keys for p in groups[k]], dtype=np.int64)
    return w


def run_numba(work: NumbaWork, q, k_buf, v_buf, rows, lens, n_new, *, return_lse: bool,
              out=None, lse_out=None, offsets=None):
    """The kernels of a planned call (``plan_numba``) over this layer's q and K/V (as
    ``attention_numba`` takes them; packed q ``[N, Hq, d]`` with ``offsets``, entry i's
    first query's row). ``out`` (q's shape and dtype) and ``lse_out`` (q's shape without
    d, float32), when given, receive the results (checked by the caller) and are
    returned; padded query slots are 0 and -inf there too."""
    nk = _kernels()
    shape = work.q_shape
    d = shape[-1]
    o, lse = _result_buffers(q, shape, out, lse_out)
    # padded queries, idle rows and a query whose every score is -inf keep 0 and -inf
    o[...] = 0
    lse[...] = -np.inf
    if len(work.items):
        rows = np.asarray(rows, dtype=np.int64)
        lens = np.asarray(lens, dtype=np.int64)
        n_new = np.asarray(n_new, dtype=np.int64)
        o_part = np.empty((work.n_part, d), dtype=np.float32)
        ml_part = np.empty((work.n_part, 2), dtype=np.float32)
        qk = _kernel_queries(q, k_buf, nk)
        q4, o4, lse3 = qk, o, lse
        if len(shape) == 3:  # packed [N, Hq, d] as [N, Hq, 1, d] (numba_kernels.query_slot)
            N, Hq = shape[:2]
            q4, o4, lse3 = qk.reshape(N, Hq, 1, d), o.reshape(N, Hq, 1, d), lse.reshape(N, Hq, 1)
        at = _PADDED_OFFSETS if offsets is None else np.asarray(offsets, dtype=np.int64)
        # BLAS held at one thread while numba's threads run (one worker: the calling
        # thread alone, nothing to share the cores with)
        if work.workers > 1:
            with _threads:
                _run_items(nk, work, q4, k_buf, v_buf, rows, lens, n_new, o4, lse3, o_part,
                           ml_part, at)
        else:
            _run_items(nk, work, q4, k_buf, v_buf, rows, lens, n_new, o4, lse3, o_part, ml_part,
                       at)
    return _hand_back(q, o, lse, out, lse_out, return_lse)


def _kernel_queries(q, k_buf, nk):
    """q (C-contiguous) as the kernels take it: bfloat16 bits (int16) where the keys are
    plain bfloat16 (an int16 array, or a ``Paged`` pool of them) and q holds bfloat16
    values (bfloat16, or float32 whose low 16 bits are all zero), so the dots run on
    bfloat16 pair products (``numba_kernels._dots_rows``: each product exact, as the
    float32 route's); else float32."""
    keys = k_buf.pool if isinstance(k_buf, nk.Paged) else k_buf
    if isinstance(keys, np.ndarray) and keys.dtype == np.int16:
        if _dtype_name(q.dtype) == "bfloat16":
            return np.ascontiguousarray(q).view(np.int16)
        if amx.holds_bfloat16(q):
            return (np.ascontiguousarray(q).view(np.uint32) >> np.uint32(16)).astype(np.int16)
    return np.ascontiguousarray(q, dtype=np.float32)


def _set_threads(n: int) -> None:
    """``numba.set_num_threads(n)``. That call takes two locks and checks its argument on
    every call, about 1 us that every layer's launch paid; once numba's threading layer
    is up, the C function it ends in (``_set_num_threads``, not public: without it the
    public call serves) sets the same per-thread count for n in its range."""
    global _SET_THREADS
    if _SET_THREADS is None:
        import numba
        from numba.np.ufunc import parallel

        numba.set_num_threads(n)  # starts the threading layer, checks n
        direct = getattr(parallel, "_set_num_threads", None)
        _SET_THREADS = (direct if callable(direct) else numba.set_num_threads,
                        int(numba.config.NUMBA_NUM_THREADS))
        return
    direct, limit = _SET_THREADS
    if 1 <= n <= limit:
        direct(n)
    else:
        import numba

        numba.set_num_threads(n)  # numba's own error


_SET_THREADS: tuple | None = None


def _run_items(nk, work: NumbaWork, q4, k_buf, v_buf, rows, lens, n_new, o4, lse3, o_part,
               ml_part, at) -> None:
    """``run_numba``'s kernels, on ``work.workers`` threads."""
    _set_threads(work.workers)
    nk.attention_items(q4, k_buf, v_buf, rows, lens, n_new, work.items, work.run_starts,
                       work.part_rows, work.scale, work.softcap, work.window, work.sinks,
                       work.alibi, work.key_block, o4, lse3, o_part, ml_part, at, work.tree)
    if work.groups is not None:
        nk.merge_pieces(work.groups, work.group_starts, work.piece_rows, o_part, ml_part,
                        work.G, work.sinks, o4, lse3, at)


class MixedWork:
    """A packed batch whose rows take both paths (``plan_mixed``): the rows of at most
    ``KERNEL_MAX_QUERIES`` queries (decode tokens, short chunks) through the kernels, the
    longer chunks through the NumPy backend's BLAS path, each part with its own inputs
    (a subset of the batch's: the packed offsets address the one q and out) and plan."""

    __slots__ = ("inputs", "short", "short_work", "long", "long_work")

    def __init__(self, inputs, short, short_work, long, long_work):
        self.inputs, self.short, self.short_work = inputs, short, short_work
        self.long, self.long_work = long, long_work


def _subset(inputs, selected: np.ndarray):
    """The AttentionInputs of the batch entries ``selected`` (a packed batch: their offsets
    still address the whole q)."""
    tree = inputs.tree
    if tree is not None:  # the selected entries' trees
        tree = DraftTree(parents=tree.parents[selected], depth=tree.depth[selected],
                         n=tree.n[selected])
    return AttentionInputs(rows=inputs.rows[selected], lens=inputs.lens[selected],
                           n_new=inputs.n_new[selected], params=inputs.params,
                           offsets=inputs.offsets[selected], invariant=inputs.invariant,
                           tree=tree)


def plan_mixed(store, inputs, params, q_shape, request) -> MixedWork | None:
    """The split plan of a packed batch that mixes rows of at most ``KERNEL_MAX_QUERIES``
    queries with longer ones, when the kernels serve the short rows (their storage,
    variant, dtype) and the BLAS path the long ones; None for any other batch (a padded
    one included: its subsets would need copies of q). Continuous batching's step (one
    prefill chunk among decode tokens) then costs what its two kinds of rows cost apart."""
    from .numpy_attention import entry_trees, plan_items

    if inputs.offsets is None or inputs.invariant:  # invariant: the kernels serve every row
        return None
    # idle rows (no query) join neither part: a packed batch has no slot of theirs
    short = (inputs.n_new > 0) & (inputs.n_new <= KERNEL_MAX_QUERIES)
    long = inputs.n_new > KERNEL_MAX_QUERIES
    if not (short.any() and long.any()):
        return None
    if (route_attention(request.with_(t_q=KERNEL_MAX_QUERIES)).impl != KERNEL
            or _numpy.route_attention(request).impl != _numpy.BLAS):
        return None
    a, b = _subset(inputs, np.flatnonzero(short)), _subset(inputs, np.flatnonzero(long))
    return MixedWork(inputs, a, plan_numba(a.lens, a.n_new, q_shape, store.kv_heads, params,
                                           tree=a.tree, page_size=_page_size(store)),
                     b, plan_items(b.lens, b.n_new, q_shape, store.kv_heads, params,
                                   trees=entry_trees(b),
                                   blas_items=route_attention(request).impl != AMX))


def run_mixed(work: MixedWork, q, store, *, return_lse: bool, out=None, lse_out=None):
    """``plan_mixed``'s two parts over this layer: the kernels write the short rows of
    one float32 out / lse ``[N, Hq, d]`` / ``[N, Hq]`` (zeroing the rest), then the BLAS
    path writes the long rows into the same arrays; ``out`` / ``lse_out`` as in
    ``run_numba``."""
    from .numpy_attention import attention_store

    o, lse = _result_buffers(q, q.shape, out, lse_out)
    k_buf, v_buf = store_args(store).layout(store)
    a, b = work.short, work.long
    run_numba(work.short_work, q, k_buf, v_buf, a.rows, a.lens, a.n_new, return_lse=True,
              out=o, lse_out=lse, offsets=a.offsets)
    attention_store(q, store, b, b.params, return_lse=True, planned=work.long_work,
                    into=(o, lse), **_blas_hooks())
    return _hand_back(q, o, lse, out, lse_out, return_lse)


def _blas_hooks() -> dict:
    """The compiled pieces numba lends the NumPy BLAS path (``attention_store``'s and
    ``attend``'s keywords), for whole calls (``blas_options``) and a mixed batch's long
    rows (``run_mixed``) alike."""
    return {"state_class": FusedSoftmaxState, "gather": gather_pages, "widen": widen_block,
            "narrow": narrow_block, "dequantize": dequantize_block, "item_kernel": _amx_items}


def _result_buffers(q, shape, out, lse_out):
    """The float32 out ``shape`` and lse ``shape[:-1]`` the kernels write (C-contiguous):
    the caller's ``out`` / ``lse_out`` where they are such (not when they share memory
    with q: the kernels read q after the output is zeroed), else new ones."""
    direct = (out is not None and out.dtype == np.float32 and out.flags.c_contiguous
              and not np.may_share_memory(out, q))
    lse_direct = (lse_out is not None and lse_out.flags.c_contiguous
                  and not np.may_share_memory(lse_out, q))
    return (out if direct else np.empty(shape, dtype=np.float32),
            lse_out if lse_direct else np.empty(shape[:-1], dtype=np.float32))


def _hand_back(q, o, lse, out, lse_out, return_lse: bool):
    """The call's result from the buffers ``_result_buffers`` chose: copied into the
    caller's ``out`` / ``lse_out`` where the kernels did not write them, else o in q's
    dtype (float16 through ``narrow_block``)."""
    if out is not None:  # (returned as given: never a cast copy of it)
        if o is not out:
            if narrow_block(o, out) is None:
                out[...] = o
            o = out
    elif o.dtype != q.dtype:
        narrowed = narrow_block(o, np.empty(o.shape, dtype=q.dtype))
        o = o.astype(q.dtype) if narrowed is None else narrowed
    if lse_out is not None and lse is not lse_out:
        lse_out[...] = lse
        lse = lse_out
    return (o, lse) if return_lse else o


_PADDED_OFFSETS = np.zeros(0, dtype=np.int64)  # the kernels' offsets of padded tokens (query_slot)
_KERNEL_MODULE = None


def _kernels():
    """``numba_kernels``, imported on first use (importing the backend does not import
    numba); kept, since the hot calls ask for it on every layer."""
    global _KERNEL_MODULE
    if _KERNEL_MODULE is None:
        from . import numba_kernels

        _KERNEL_MODULE = numba_kernels
    return _KERNEL_MODULE


def _c_contiguous(store) -> bool:
    """Whether every buffer of ``store`` (K, V and the scales) is C-contiguous."""
    return all(a.flags.c_contiguous for a in (store.k, store.v, store.k_scale, store.v_scale)
               if a is not None)


class StoreArgs:
    """What the kernels take of one KVStore (no leading axes), worked out once and kept
    in ``store.memo``: every layer of every step asks, and a store's buffers never move.

    c_contiguous: ``_c_contiguous(store)``.
    write_view: False unless the store is contiguous and not quantized; then the unsigned
        integer type the copy kernel takes the values as (None: no such type of their width).
    write_bits: K and V viewed as ``write_view`` (empty when there is none).
    write_routes: ``_write_route``'s answers for this store, by (buffers, tokens).
    table: a paged store's table entries when this was made (the kernel layout holds them;
        a store whose table is another object now is worked out again).
    ``layout(store)``: ``(K, V)`` as the kernels read them, made on first use (a store the
    kernels do not read, float64 say, never asks).
    """

    __slots__ = ("_layout", "c_contiguous", "write_view", "write_bits", "write_routes",
                 "table")

    def __init__(self, store, table):
        self.table = table
        self.c_contiguous = _c_contiguous(store)
        self._layout: tuple | None = None
        self.write_view, self.write_bits, self.write_routes = False, (), {}
        if store.kind == CONTIGUOUS and not store.quantized:
            bits = _copy_bits(store.k, store.v)
            self.write_view = None if bits is None else bits[0].dtype.type
            self.write_bits = () if bits is None else tuple(bits)

    def layout(self, store) -> tuple:
        """``kernel_layout(store)``, contiguous float16/bfloat16 as their bits."""
        if self._layout is None:
            k_buf, v_buf = kernel_layout(store)
            if isinstance(k_buf, np.ndarray):
                k_buf, v_buf = _kernel_buffers(k_buf, v_buf, _kernels())
            if self.table is not None and getattr(k_buf, "table", None) is not self.table:
                return k_buf, v_buf  # the kernels read a copy of the table: made each call
            self._layout = (k_buf, v_buf)
        return self._layout


_MEMO_KEY = "numba"


def store_args(store) -> StoreArgs:
    """``store``'s ``StoreArgs``, from its memo when its buffers (and a paged store's
    table) are the ones it was made for."""
    args = store.memo.get(_MEMO_KEY)
    if args is None or (args.table is not None and args.table is not store.page_table.entries):
        table = store.page_table.entries if store.kind == PAGED else None
        args = store.memo[_MEMO_KEY] = StoreArgs(store, table)
    return args


def _kernel_buffers(k_buf, v_buf, nk):
    """(K, V) as the kernels take them: float32 as is, float16 as uint16 bits, bfloat16
    as int16 bits (the element type selects the conversion at compile time)."""
    view = nk.BITS_VIEW[_dtype_name(k_buf.dtype)]
    return k_buf.view(view), v_buf.view(view)


def _kv_heads(buf) -> int:
    """Hkv of an array or of a ``kernel_layout`` layout."""
    nk = _kernels()
    if isinstance(buf, nk.Paged):
        return _kv_heads(buf.pool)
    if isinstance(buf, (nk.Quantized, nk.PagedQuantized, nk.Grouped, nk.PagedGrouped)):
        return _kv_heads(buf.codes)
    return int(buf.shape[1])


def kernel_layout(store):
    """(K, V) of a KVStore (no leading axes) as the kernels read them (``key_row``):
    contiguous: the arrays [rows, Hkv, max_len, d] themselves; paged (float16/bfloat16
    pools as their bits):
    ``Paged`` (pool [num_pages, Hkv, page_size, d], table [rows, pages_per_row] int32);
    quantized: ``Quantized(codes, scales [rows, Hkv, max_len])``; paged and quantized:
    ``PagedQuantized(codes pool, scales pool [num_pages, Hkv, page_size], table, shift,
    together)`` (``together``: ``reads_heads_together``, as a type). Views, no copies."""
    nk = _kernels()
    if store.quantized and store.spec.codec.name in _KERNEL_GROUPED:  # codes as stored, 2-D scales
        if store.kind == PAGED:
            table = np.ascontiguousarray(store.page_table.entries, dtype=np.int32)
            _, _, shift, together = nk.paged(store.k, table, reads_heads_together(store))
            return (nk.PagedGrouped(store.k, store.k_scale, table, shift, together),
                    nk.PagedGrouped(store.v, store.v_scale, table, shift, together))
        return nk.Grouped(store.k, store.k_scale), nk.Grouped(store.v, store.v_scale)
    codes = None
    if store.quantized:  # the codes as the element type the kernels decode the codec's tag from
        view = nk.CODE_VIEWS[store.spec.codec.kernel_tag]
        codes = store.k.view(view), store.v.view(view)
    if store.kind == PAGED:
        table = np.ascontiguousarray(store.page_table.entries, dtype=np.int32)
        if codes is not None:  # codes and scales, both paged through the one table
            _, _, shift, together = nk.paged(store.k, table, reads_heads_together(store))
            return (nk.PagedQuantized(codes[0], store.k_scale, table, shift, together),
                    nk.PagedQuantized(codes[1], store.v_scale, table, shift, together))
        k, v = _kernel_buffers(store.k, store.v, nk)
        together = reads_heads_together(store)
        return nk.paged(k, table, together), nk.paged(v, table, together)
    if codes is not None:
        return (nk.Quantized(codes[0], store.k_scale), nk.Quantized(codes[1], store.v_scale))
    return store.k, store.v  # attention_numba takes their bits
