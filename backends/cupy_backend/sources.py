"""The CUDA sources of the cupy backend: where they are, how they are named and compiled.

Kernel sources ship as package data (``kernels/*.cu``, ``kernels/*.cuh``) and are read
with importlib.resources. ``compose_source`` inlines the local ``#include "x.cuh"`` lines,
so NVRTC needs no include path and the text compiled is exactly one string. The cupy
backend (``modules.py``) and the NVRTC compile test (``nvrtc.py``) both compile
``compose_source(kernel)`` with ``COMPILE_OPTIONS`` and the template instantiation named by
``name_expression``; the CPU emulation harness compiles the same files with g++.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

from . import instantiations as table
from . import limits

#: Kernel name -> source file (the instantiation table, instantiations.KERNELS). Each kernel
#: is a template over its type tag and head dim (and more: instantiations.Kernel.params).
#: gqakv_prefill_mma (tensor cores) exists only where ``prefill_mma_supported``.
KERNEL_FILES = {name: k.file for name, k in table.KERNELS.items()}

#: gqakv dtype name -> C++ storage type in the kernels (16-bit types are raw bits).
CTYPES = table.CTYPES
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}

#: Quantized K/V storage (gqakv.storage.quantize) -> the kernels' code type (kernels/quantized_kv.cuh).
#: A kernel over a quantized cache names ``gqakv_quantized<q type, code type>`` where others
#: name the storage type; gqakv_write_kv_quantized names both, ``<input type, code type, D>``;
#: copy_tokens moves codes as ``<code type, D>`` and scales as ``<float, 1>`` (a grouped
#: cache: codes as bytes ``<gqakv_i8, d * bits / 8>``, scales ``<float, d / g>``;
#: instantiations.copy_entries).
CODE_CTYPES = table.CODE_CTYPES

#: Query tiles (queries per CTA) gqakv_decode is instantiated for, smallest first.
DECODE_QUERY_TILES = limits.DECODE_QUERY_TILES

#: Largest head dim the fused kernels are instantiated for (any d <= this works).
MAX_FUSED_HEAD_DIM = limits.MAX_FUSED_HEAD_DIM

#: Options for every compile (the GPU architecture is added by the caller): the kernels'
#: limits come as -D options (kernels/limits.cuh refuses to compile without them).
COMPILE_OPTIONS = ("-std=c++17", *limits.define_options())

_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.MULTILINE)


def read_kernel_file(filename: str) -> str:
    """Text of a file under ``kernels/`` (package data)."""
    return resources.files(__package__).joinpath("kernels", filename).read_text(encoding="utf-8")


@functools.cache
def compose_source(kernel: str) -> str:
    """Full source text of ``kernel``'s file with local includes inlined (each once)."""
    seen: set[str] = set()

    def expand(filename: str) -> str:
        if filename in seen:
            return ""
        seen.add(filename)
        text = read_kernel_file(filename).replace("#pragma once", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(KERNEL_FILES[kernel])


#: dtypes the tensor-core prefill takes (mma.m16n8k16 with 16-bit inputs, fp32 accumulation).
PREFILL_MMA_DTYPES = limits.MMA_DTYPES


def prefill_mma_supported(dtype: str, head_dim: int) -> bool:
    """Whether gqakv_prefill_mma serves (dtype, head_dim): 16-bit dtypes and head dims that
    are a multiple of 16 (the mma's k); everything else keeps the fp32-FMA gqakv_prefill."""
    return limits.prefill_mma_rejection(dtype, head_dim) is None


#: dtypes and head dims the tensor-core decode (gqakv_decode_mma) serves; gqakv_decode
#: (fp32 FMA) takes every other case.
DECODE_MMA_DTYPES = limits.MMA_DTYPES
DECODE_MMA_HEAD_DIMS = limits.DECODE_MMA_HEAD_DIMS


def decode_mma_supported(dtype: str, head_dim: int) -> bool:
    """Whether gqakv_decode_mma serves (dtype, head_dim)."""
    return limits.decode_mma_rejection(dtype, head_dim) is None


#: Kernels composed with the variant trait (kernels/variant.cuh): their variant parameter
#: is the variant's flags (plan.VARIANT_FLAGS), left out when 0 (plain causal).
VARIANT_KERNELS = tuple(n for n, k in table.KERNELS.items() if k.variant_mask)

#: Kernels with a paged instantiation (kernels/paged_kv.cuh): their K/V pack names
#: ``PAGES_CTYPE`` and they read or write K/V through the page table. Page copies need no
#: kernel of their own: gqakv_copy_tokens copies pages as rows of the pool.
PAGED_KERNELS = tuple(table.kernels_with(reader="paged"))
PAGES_CTYPE = table.READERS["paged"]


def entry(kernel: str, dtype: str, head_dim: int, query_tile: int | None = None, variant: int = 0,
          kv_dtype: str | None = None, reader: str = "contiguous") -> table.Instantiation:
    """The table's entry for these arguments (KeyError naming the axis when there is none).
    The merge reads only fp32 partials: over a quantized cache it is its plain entry."""
    kernel_decl = table.KERNELS.get(kernel)
    if kernel_decl is not None and kernel_decl.storage_blind:
        if kv_dtype is not None and kv_dtype not in CODE_CTYPES:
            raise KeyError(f"kv_dtype={kv_dtype!r} (quantized: {', '.join(CODE_CTYPES)})")
        kv_dtype = None
    inst = table.Instantiation(kernel, dtype, int(head_dim), kv_dtype, reader, int(variant),
                               None if query_tile is None else int(query_tile))
    why = table.rejection(inst)
    if why is not None:
        raise KeyError(why)
    return inst


@functools.lru_cache(maxsize=4096)  # every step's plan names its launches again
def name_expression(kernel: str, dtype: str, head_dim: int, query_tile: int | None = None,
                    variant: int = 0, kv_dtype: str | None = None) -> str:
    """The template instantiation, e.g. ``gqakv_write_kv<gqakv_bf16, 128>`` or
    ``gqakv_decode<gqakv_bf16, 128, 4>`` (decode needs ``query_tile``, others refuse it);
    ``variant``: the variant trait's flags (1 window, 2 softcap, 4 sinks, 8 alibi), appended when
    not 0, e.g. ``gqakv_prefill<float, 64, 3>``; ``kv_dtype``: a quantized storage dtype
    (CODE_CTYPES), e.g. ``gqakv_decode<gqakv_quantized<gqakv_bf16, gqakv_i8>, 128, 4>``
    (spelled by ``instantiations.Instantiation.name``)."""
    return entry(kernel, dtype, head_dim, query_tile, variant, kv_dtype).name


@functools.lru_cache(maxsize=4096)
def paged_name_expression(kernel: str, dtype: str, head_dim: int, query_tile: int | None = None,
                          variant: int = 0, kv_dtype: str | None = None) -> str:
    """The paged instantiation of ``kernel``: ``name_expression``'s with the variant flags
    spelled out (0 too) and ``KVPages`` appended, e.g. ``gqakv_decode<float, 64, 4, 0,
    KVPages>`` or ``gqakv_write_kv<gqakv_bf16, 128, KVPages>`` (over quantized K/V only
    where the table's LAYOUTS has ("quantized", "paged"); KeyError otherwise)."""
    return entry(kernel, dtype, head_dim, query_tile, variant, kv_dtype, reader="paged").name


def paged_instantiations(kernel: str, dtype: str, head_dim: int, variant: int = 0,
                         kv_dtype: str | None = None) -> list[str]:
    """``instantiations`` of ``kernel`` (with ``kv_dtype``: over that 8-bit storage), paged
    (empty for kernels without a paged one)."""
    if kernel not in PAGED_KERNELS:
        return []
    _check_axes(kernel, dtype, head_dim, variant)
    return table.names(table.select([kernel], [dtype], [head_dim], [kv_dtype], ["paged"], [variant]))


def _check_axes(kernel: str, dtype: str, head_dim: int, variant: int = 0) -> None:
    """KeyError for a kernel, dtype, head dim or variant outside the table (a kernel that
    does not serve (dtype, head_dim), such as the tensor-core ones, just has none)."""
    decl = table.KERNELS.get(kernel)
    if decl is None:
        raise KeyError(f"unknown kernel {kernel!r} (known: {', '.join(table.KERNELS)})")
    if dtype not in CTYPES:
        raise KeyError(f"no fused kernels for dtype {dtype!r} (fused: {', '.join(CTYPES)})")
    if not 1 <= head_dim <= MAX_FUSED_HEAD_DIM:
        raise KeyError(f"no fused kernels for head_dim={head_dim} (fused: 1..{MAX_FUSED_HEAD_DIM})")
    if variant not in decl.variants():
        raise KeyError(f"{kernel} has no variant={variant} (takes: {decl.variants()})")


def instantiations(kernel: str, dtype: str, head_dim: int, kv_dtype: str | None = None) -> list[str]:
    """Every name expression of ``kernel`` for one dtype and head dim (decode: one per tile;
    none for gqakv_prefill_mma where it does not apply); with ``kv_dtype`` those over a
    cache of that quantized storage (none for kernels without quantized instantiations),
    without it none for gqakv_write_kv_quantized."""
    _check_axes(kernel, dtype, head_dim)
    if table.KERNELS[kernel].storage_blind:
        kv_dtype = None
    if kv_dtype is not None and kv_dtype not in CODE_CTYPES:
        raise KeyError(f"kv_dtype={kv_dtype!r} (quantized: {', '.join(CODE_CTYPES)})")
    return table.names(table.select([kernel], [dtype], [head_dim], [kv_dtype], ["contiguous"], [0]))


def vec_width(dtype: str, head_dim: int) -> int:
    """Values per vector access; mirrors ``VecWidth`` in common.cuh (and its specialisations
    for codes in quantized_kv.cuh: 8 values, 8-byte int8 / e4m3 loads where d allows)."""
    if dtype in CODE_CTYPES:
        return 8 if head_dim % 8 == 0 else 1
    size = ITEMSIZE[dtype]
    return 16 // size if (head_dim * size) % 16 == 0 else 1


def values_per_element(dtype: str) -> int:
    """Values one element of a K/V buffer holds (``CodeLayout<T>::PACK``): 2 for 4-bit codes."""
    return 2 if CODE_CTYPES.get(dtype, "").startswith("gqakv_i4g") else 1
