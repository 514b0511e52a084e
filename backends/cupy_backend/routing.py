"""Which implementation runs each hot operation of the cupy backend, and why not the others.

One routing step per operation (``route_write_kv``, ``route_copy_tokens``,
``route_attention``): from a call's ``gqakv.dispatch.request.Request`` it returns a
``gqakv.dispatch.backend.Route`` naming the fused kernel that runs (or the generic
array-API code) and, for every other implementation, the sentence saying why it was not
eligible. ``CupyBackend`` routes every call through these before planning, and
``CupyBackend.route`` answers the same question for ``gqakv info``, the benchmarks and
the tests; the planner's kernel choice (``plan.decode_kernel``, ``plan.prefill_kernel``)
uses the same predicates (limits.py).

What the routes read of a request (frozen and hashable: the routes are kept, so a routed
call costs one cache lookup):
  dtype, head_dim: the dtype of q / new K/V / the output, and d (both needed here).
  t_q:        query tokens per row of the call (attention only).
  capability: the device's compute capability as CuPy spells it (90 for 9.0); None when
              not known (then the tensor-core kernels are not ruled out by it).
  buffers:    why the buffers do not suit the kernels (unaligned rows, K and V strided
              differently, rows past the paged kernels' 32-bit key index, ...), None
              when they do.
  layout, codec, features: judged by each kernel's declaration (``FAST_PATHS``): every
              kernel below but gqakv_copy_tokens and gqakv_merge has a paged instantiation
              (kernels/paged_kv.cuh), over 8-bit and grouped codes too (the append and the
              fp32-FMA attention kernels), and copy on write copies pages as rows of the
              pool with gqakv_copy_tokens (every codec: codes and scales as rows of their
              own width, instantiations.copy_entries).
  grid:       the planner's refusal of the launch grid (beyond CUDA's limits), None when
              it fits (or before planning).
"""

from __future__ import annotations

import functools

from gqakv.dispatch.backend import GENERIC, FastPath, Route
from gqakv.dispatch.request import Request
from gqakv.storage.codecs import PLAIN_NAME
from gqakv.storage.store import CONTIGUOUS, PAGED

from . import instantiations as table
from . import limits, sources

#: dtypes the fused kernels are built for (the C++ storage types of sources.CTYPES).
FUSED_DTYPES = tuple(sources.CTYPES)

DECODE_KERNELS = ("gqakv_decode_mma", "gqakv_decode")  # preferred first
PREFILL_KERNELS = ("gqakv_prefill_mma", "gqakv_prefill")


def _fused_rejection(dtype: str, head_dim: int, codec: str | None = None) -> str | None:
    return (limits.dtype_rejection(dtype, FUSED_DTYPES) or limits.head_dim_rejection(head_dim)
            # a grouped codec's caches refuse such head dims; a bare request may still name one
            or table.block_rejection(codec, head_dim))


#: Quantized storage the kernels read (kernels/quantized_kv.cuh): 8-bit codes with a scale
#: per token, and the grouped codes with a scale per block of values (instantiations.GROUPS).
QUANTIZED_DTYPES = tuple(sources.CODE_CTYPES)
GROUPED_DTYPES = tuple(table.GROUPS)
#: Why the tensor-core kernels do not serve a quantized cache.
MMA_QUANTIZED_REJECTION = ("kv_dtype={kv_dtype!r}: the tensor-core kernels take 16-bit K/V fragments; "
                           "a quantized cache would need its tiles dequantized into a 16-bit copy "
                           "(rounding code x scale to {dtype}), so the fp32-FMA kernel serves it")

# -- what each kernel family implements, as data (gqakv.dispatch.backend.FastPath) ----------------------
# The layouts (kernels/paged_kv.cuh: every kernel but the row copy has a paged instantiation),
# codecs (quantized_kv.cuh: the 8-bit reader wraps the contiguous or the paged reader; the
# tensor-core kernels take 16-bit fragments only) and variant features (variant.cuh's
# flags) each kernel serves. A call outside its declaration is refused with FastPath's
# sentence (an unknown codec too: no kernel declares it); dtypes, head dims, tiles, device
# and buffer layout are the per-call conditions of the route functions below.
_LAYOUTS = frozenset({CONTIGUOUS, PAGED})
_QUANTIZED = frozenset(QUANTIZED_DTYPES)
_CODECS = frozenset({PLAIN_NAME, *QUANTIZED_DTYPES})
#: The variant features of variant.cuh's trait (plan.VARIANT_FLAGS).
VARIANT_FEATURES = frozenset({"window", "softcap", "sinks", "alibi"})
#: A draft tree's clause (speculative verification): the prefill kernels' TREE flag only,
#: so a tree call of any t_q runs on them (route_attention).
TREE_FEATURE = "tree"
_MMA = frozenset(limits.MMA_DTYPES)
FAST_PATHS: tuple[FastPath, ...] = (
    FastPath("gqakv_write_kv", "write_kv", _LAYOUTS, frozenset({PLAIN_NAME}), dtypes=frozenset(FUSED_DTYPES)),
    FastPath("gqakv_write_kv_quantized", "write_kv", _LAYOUTS, _QUANTIZED, dtypes=frozenset(FUSED_DTYPES)),
    # contiguous rows only: paged rows move by sharing pages, a page copy is a row copy of
    # the pool (gqakv.storage.paged.PagedStore.pool_rows, a contiguous store)
    # the row copy moves rows of any width and element type, one launch per part of a token
    # (instantiations.copy_entries: values; per-token codes and their scale; grouped codes as
    # d * bits / 8 bytes and their d / g block scales), so it declares every codec the kernels read
    FastPath("gqakv_copy_tokens", "copy_tokens", frozenset({CONTIGUOUS}), _CODECS,
             dtypes=frozenset(FUSED_DTYPES)),
    FastPath("gqakv_decode_mma", "attention", _LAYOUTS, frozenset({PLAIN_NAME}), VARIANT_FEATURES, _MMA),
    FastPath("gqakv_decode", "attention", _LAYOUTS, _CODECS, VARIANT_FEATURES, frozenset(FUSED_DTYPES)),
    # the prefill kernels keep a query's bits independent of its block (key tiles at multiples
    # of their width, each row's softmax its own): batch-invariant mode runs every t_q on them
    # and they take a draft tree (instantiations.TREE)
    FastPath("gqakv_prefill_mma", "attention", _LAYOUTS, frozenset({PLAIN_NAME}),
             VARIANT_FEATURES | {TREE_FEATURE}, _MMA, invariant=True),
    FastPath("gqakv_prefill", "attention", _LAYOUTS, _CODECS, VARIANT_FEATURES | {TREE_FEATURE},
             frozenset(FUSED_DTYPES), invariant=True),
)
PATHS = {p.name: p for p in FAST_PATHS}


def _declared_rejection(kernel: str, request: Request) -> str | None:
    """Why ``kernel``'s declaration (``FAST_PATHS``) does not cover this storage and variant."""
    return PATHS[kernel].rejection(request)


def _needs_dtype_and_head_dim(request: Request) -> tuple[str, int]:
    """The request's dtype and head dim (the kernels are built per both); ValueError
    naming the missing ones."""
    missing = [name for name in ("dtype", "head_dim") if getattr(request, name) is None]
    if missing or request.dtype is None or request.head_dim is None:
        raise ValueError(f"{request.op} needs the facts {', '.join(missing)} (the kernels are "
                         "built per dtype and head dim)")
    return request.dtype, request.head_dim


def _chosen(impl: str, rejected: dict[str, str]) -> Route:
    if impl != GENERIC:
        rejected[GENERIC] = f"{impl} serves this call (fused kernels come first)"
    return Route(impl, rejected)


@functools.lru_cache(maxsize=1024)
def route_write_kv(request: Request) -> Route:
    """gqakv_write_kv (one launch for all rows), gqakv_write_kv_quantized (the same for a
    quantized cache, quantizing on the device) or the generic slice writes; both over
    contiguous rows or through the page table."""
    dtype, head_dim = _needs_dtype_and_head_dim(request)
    quantized = request.quantized_dtype is not None
    kernel = "gqakv_write_kv_quantized" if quantized else "gqakv_write_kv"
    # a codes-and-scales cache is no candidate for the plain append: its declaration says why
    plain = _declared_rejection("gqakv_write_kv", request) if quantized else None
    rejected = {"gqakv_write_kv": plain} if plain else {}
    why = (_fused_rejection(dtype, head_dim, request.codec) or _declared_rejection(kernel, request)
           or request.buffers or request.grid)
    if why:
        return Route(GENERIC, {kernel: why, **rejected})
    return _chosen(kernel, rejected)


@functools.lru_cache(maxsize=1024)
def route_copy_tokens(request: Request) -> Route:
    """gqakv_copy_tokens (every layer and row pair in one launch; a quantized cache's
    scales in a second launch of it: instantiations.copy_entries) or the generic copies."""
    dtype, head_dim = _needs_dtype_and_head_dim(request)
    # a grouped codec at a head dim that splits a block has no copy entries (a bare request may name one)
    why = (_fused_rejection(dtype, head_dim, request.codec)
           or _declared_rejection("gqakv_copy_tokens", request) or request.buffers or request.grid)
    if why:
        return Route(GENERIC, {"gqakv_copy_tokens": why})
    return _chosen("gqakv_copy_tokens", {})


@functools.lru_cache(maxsize=1024)
def route_attention(request: Request) -> Route:
    """The decode kernels for t_q <= DECODE_MAX_T, the prefill kernels above (and for a
    draft tree at every t_q: only they have its clause); in each
    family the tensor-core kernel where it serves (dtype, head_dim) and the device has
    mma.m16n8k16, else the fp32-FMA one; the generic code when neither can run.
    ``grid`` (the planner's refusal) rules out the kernel the family would have run;
    layout, codec and features are judged by each kernel's declaration
    (``FAST_PATHS``)."""
    dtype, head_dim = _needs_dtype_and_head_dim(request)
    t_q = request.t_q
    rejected: dict[str, str] = {}
    tree = TREE_FEATURE in request.features
    decode = t_q <= limits.DECODE_MAX_T and not request.invariant and not tree
    family, other = (DECODE_KERNELS, PREFILL_KERNELS) if decode else (PREFILL_KERNELS, DECODE_KERNELS)
    why_family = (f"t_q={t_q} <= {limits.DECODE_MAX_T}: the decode kernels serve it" if decode else
                  "a draft tree: the prefill kernels serve every t_q" if tree else
                  "batch-invariant mode: the prefill kernels serve every t_q (the decode kernels' "
                  "key splits follow the batch)" if request.invariant else
                  f"t_q={t_q} (the decode kernels serve up to {limits.DECODE_MAX_T} query tokens)")
    for kernel in other:
        # a tree: the decode kernels' own declaration says why (they do not implement it)
        declared = _declared_rejection(kernel, request) if tree else None
        rejected[kernel] = f"{declared} ({why_family})" if declared else why_family
    mma, fma = family
    # the fp32-FMA kernel declares every layout, codec and feature the family has
    why = (_fused_rejection(dtype, head_dim, request.codec) or _declared_rejection(fma, request)
           or request.buffers)
    if why:
        rejected.update((kernel, why) for kernel in family)
        return Route(GENERIC, rejected)
    mma_instance = limits.decode_mma_rejection if decode else limits.prefill_mma_rejection
    # the tensor-core kernel declares the fp32-FMA one's layouts and features, 16-bit codecs only
    why_mma = ((MMA_QUANTIZED_REJECTION.format(kv_dtype=request.codec, dtype=dtype)
                if request.codec not in PATHS[mma].codecs else None)
               or mma_instance(dtype, head_dim) or limits.capability_rejection(request.capability))
    if why_mma:
        rejected[mma] = why_mma
        chosen = fma
    else:
        rejected[fma] = f"{mma} serves this call (tensor cores first)"
        chosen = mma
    if request.grid:
        rejected[chosen] = request.grid
        return Route(GENERIC, rejected)
    return _chosen(chosen, rejected)


ROUTES = {"write_kv": route_write_kv, "copy_tokens": route_copy_tokens,
          "attention": route_attention}


def implementations() -> dict[str, str]:
    """Each implementation of the cupy backend and its declared limits (``gqakv info``)."""
    fused = f"{', '.join(FUSED_DTYPES)}; head_dim 1..{limits.MAX_FUSED_HEAD_DIM}"
    mma_cc = f"compute capability {limits.MMA_MIN_CAPABILITY // 10}.{limits.MMA_MIN_CAPABILITY % 10}+"
    mma = ", ".join(limits.MMA_DTYPES)
    t = limits.DECODE_MAX_T
    paged = "contiguous or paged K/V (page table read per key)"
    quant = ", ".join(QUANTIZED_DTYPES)
    return {
        "gqakv_write_kv": f"{fused}; rows aligned for vector loads; {paged}",
        "gqakv_write_kv_quantized": (f"{fused}; kv_dtype {quant} (quantizes on the device, "
                                     f"gqakv.storage.quantize's rule bit for bit; grouped codecs at "
                                     f"head dims holding whole blocks); {paged}"),
        "gqakv_copy_tokens": (f"{fused}; rows aligned for vector loads; contiguous rows (paged: "
                              "pages as rows of the pool, the copy on write of a shared last page); "
                              f"unquantized or {quant} K/V (codes and scales as rows of their own: "
                              "grouped codes as d * bits / 8 bytes, their scales as d / g floats)"),
        "gqakv_decode_mma": (f"t_q <= {t}; {mma}; head_dim in "
                             f"{', '.join(map(str, limits.DECODE_MMA_HEAD_DIMS))}; {mma_cc}; {paged}"),
        "gqakv_decode": (f"t_q <= {t}; {fused}; query tiles "
                         f"{', '.join(map(str, limits.DECODE_QUERY_TILES))}; {paged}; also over "
                         f"{quant} K/V (contiguous or paged; dequantized in registers)"),
        "gqakv_merge": "joins split-KV decode partials",
        "gqakv_prefill_mma": (f"t_q > {t} (draft trees: every t_q); {mma}; head_dim a multiple of "
                              f"{limits.PREFILL_MMA_HEAD_DIM_MULTIPLE} up to "
                              f"{limits.MAX_FUSED_HEAD_DIM}; {mma_cc}; {paged}"),
        "gqakv_prefill": (f"t_q > {t} (draft trees: every t_q); {fused}; {paged}; also over {quant} K/V "
                          "(contiguous or paged)"),
        GENERIC: "everything else (float64, larger head dims, other layouts, grids past "
                 f"CUDA's limits of {limits.MAX_GRID_X} x {limits.MAX_GRID_Y} CTAs)",
    }
