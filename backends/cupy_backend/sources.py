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

from . import limits

#: Kernel name -> source file. Each kernel is a template ``<T, D>`` over the storage type
#: and the head dim; gqakv_decode also over its query tile, ``<T, D, QB>``.
#: gqakv_prefill_mma (tensor cores) exists only where ``prefill_mma_supported``.
KERNEL_FILES = {
    "gqakv_write_kv": "write_kv.cu",
    "gqakv_write_kv_quantized": "write_kv_quantized.cu",
    "gqakv_copy_tokens": "copy_tokens.cu",
    "gqakv_decode": "decode.cu",
    "gqakv_decode_mma": "decode_mma.cu",
    "gqakv_merge": "merge.cu",
    "gqakv_prefill": "prefill.cu",
    "gqakv_prefill_mma": "prefill_mma.cu",
}

#: gqakv dtype name -> C++ storage type in the kernels (16-bit types are raw bits).
CTYPES = {"float32": "float", "float16": "gqakv_half", "bfloat16": "gqakv_bf16"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}

#: Quantized K/V storage (gqakv.quantize) -> the kernels' code type (kernels/quantized_kv.cuh).
#: A kernel over a quantized cache names ``gqakv_quantized<q type, code type>`` where others
#: name the storage type; gqakv_write_kv_quantized names both, ``<input type, code type, D>``;
#: copy_tokens moves codes as ``<code type, D>`` and scales as ``<float, 1>``.
CODE_CTYPES = {"int8": "gqakv_i8", "float8_e4m3fn": "gqakv_e4m3"}
#: Kernels with quantized instantiations (the tensor-core ones have none: routing.py says why).
QUANTIZED_KERNELS = ("gqakv_write_kv_quantized", "gqakv_copy_tokens", "gqakv_decode", "gqakv_merge",
                     "gqakv_prefill")

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


#: Kernels composed with the variant trait (kernels/variant.cuh): their last template
#: parameter is the variant's flags (plan.VARIANT_FLAGS), left out when 0 (plain causal).
VARIANT_KERNELS = ("gqakv_decode", "gqakv_decode_mma", "gqakv_merge", "gqakv_prefill",
                   "gqakv_prefill_mma")


def name_expression(kernel: str, dtype: str, head_dim: int, query_tile: int | None = None,
                    variant: int = 0, kv_dtype: str | None = None) -> str:
    """The template instantiation, e.g. ``gqakv_write_kv<gqakv_bf16, 128>`` or
    ``gqakv_decode<gqakv_bf16, 128, 4>`` (decode needs ``query_tile``, others refuse it);
    ``variant``: the variant trait's flags (1 window, 2 softcap, 4 sinks, 8 alibi), appended when
    not 0, e.g. ``gqakv_prefill<float, 64, 3>``; ``kv_dtype``: a quantized storage dtype
    (CODE_CTYPES), e.g. ``gqakv_decode<gqakv_quantized<gqakv_bf16, gqakv_i8>, 128, 4>``."""
    if kv_dtype is not None or kernel == "gqakv_write_kv_quantized":
        return _quantized_name(kernel, dtype, head_dim, query_tile, variant, kv_dtype)
    if variant:
        if kernel not in VARIANT_KERNELS or not 0 < variant < 16:
            raise KeyError(f"{kernel} has no variant={variant} (variants: flags 1..15 of "
                           f"{', '.join(VARIANT_KERNELS)})")
        base = name_expression(kernel, dtype, head_dim, query_tile)
        return f"{base[:-1]}, {int(variant)}>"
    if kernel not in KERNEL_FILES:
        raise KeyError(f"unknown kernel {kernel!r} (known: {', '.join(KERNEL_FILES)})")
    if dtype not in CTYPES:
        raise KeyError(f"no fused kernels for dtype {dtype!r} (fused: {', '.join(CTYPES)})")
    if not 1 <= head_dim <= MAX_FUSED_HEAD_DIM:
        raise KeyError(f"no fused kernels for head_dim={head_dim} (fused: 1..{MAX_FUSED_HEAD_DIM})")
    if kernel == "gqakv_decode":
        if query_tile not in DECODE_QUERY_TILES:
            raise KeyError(f"gqakv_decode has no query_tile={query_tile} "
                           f"(instantiated: {', '.join(map(str, DECODE_QUERY_TILES))})")
        return f"{kernel}<{CTYPES[dtype]}, {int(head_dim)}, {int(query_tile)}>"
    if query_tile is not None:
        raise KeyError(f"{kernel} takes no query_tile (got {query_tile})")
    if kernel == "gqakv_decode_mma" and not decode_mma_supported(dtype, head_dim):
        raise KeyError(f"gqakv_decode_mma has no {dtype} head_dim={head_dim} (served: "
                       f"{', '.join(DECODE_MMA_DTYPES)} with head_dim in {DECODE_MMA_HEAD_DIMS})")
    if kernel == "gqakv_prefill_mma" and not prefill_mma_supported(dtype, head_dim):
        raise KeyError(f"gqakv_prefill_mma has no {dtype} head_dim={head_dim} (served: "
                       f"{', '.join(PREFILL_MMA_DTYPES)} with head_dim a multiple of "
                       f"{limits.PREFILL_MMA_HEAD_DIM_MULTIPLE})")
    return f"{kernel}<{CTYPES[dtype]}, {int(head_dim)}>"


#: Kernels with a paged instantiation (kernels/paged_kv.cuh): their K/V pack names
#: ``PAGES_CTYPE`` and they read or write K/V through the page table (8-bit pages too: the
#: quantized reader wraps the paged one). Page copies need no kernel of their own:
#: gqakv_copy_tokens copies pages as rows of the pool.
PAGED_KERNELS = ("gqakv_write_kv", "gqakv_write_kv_quantized", "gqakv_decode", "gqakv_decode_mma",
                 "gqakv_prefill", "gqakv_prefill_mma")
PAGES_CTYPE = "KVPages"


def paged_name_expression(kernel: str, dtype: str, head_dim: int, query_tile: int | None = None,
                          variant: int = 0, kv_dtype: str | None = None) -> str:
    """The paged instantiation of ``kernel``: ``name_expression``'s with the variant flags
    spelled out (0 too) and ``KVPages`` appended, e.g. ``gqakv_decode<float, 64, 4, 0,
    KVPages>`` or ``gqakv_write_kv<gqakv_bf16, 128, KVPages>``; with ``kv_dtype`` the
    8-bit reader over pages, e.g. ``gqakv_decode<gqakv_quantized<float, gqakv_i8>, 64, 4,
    0, KVPages>`` or ``gqakv_write_kv_quantized<float, gqakv_i8, 64, KVPages>``."""
    if kernel not in PAGED_KERNELS:
        raise KeyError(f"{kernel} has no paged instantiation (paged: {', '.join(PAGED_KERNELS)})")
    base = name_expression(kernel, dtype, head_dim, query_tile, variant, kv_dtype=kv_dtype)
    if kernel in VARIANT_KERNELS and not variant:
        base = f"{base[:-1]}, 0>"
    return f"{base[:-1]}, {PAGES_CTYPE}>"


def paged_instantiations(kernel: str, dtype: str, head_dim: int, variant: int = 0,
                         kv_dtype: str | None = None) -> list[str]:
    """``instantiations`` of ``kernel`` (with ``kv_dtype``: over that 8-bit storage), paged
    (empty for kernels without a paged one)."""
    if kernel not in PAGED_KERNELS:
        return []
    out = []
    for name in instantiations(kernel, dtype, head_dim, kv_dtype=kv_dtype):
        tile = int(name.rsplit(", ", 1)[1].rstrip(">")) if kernel == "gqakv_decode" else None
        out.append(paged_name_expression(kernel, dtype, head_dim, tile, variant, kv_dtype=kv_dtype))
    return out


def _quantized_name(kernel: str, dtype: str, head_dim: int, query_tile: int | None,
                    variant: int, kv_dtype: str | None) -> str:
    """name_expression for a quantized cache: the unquantized name with the storage type
    replaced (the code type for copies, the gqakv_quantized tag for attention; merge
    reads only fp32 partials and writes dtype, so it keeps its plain name)."""
    if kernel not in QUANTIZED_KERNELS:
        raise KeyError(f"{kernel} has no quantized instantiation (quantized: "
                       f"{', '.join(QUANTIZED_KERNELS)})")
    if kv_dtype not in CODE_CTYPES:
        raise KeyError(f"kv_dtype={kv_dtype!r} (quantized: {', '.join(CODE_CTYPES)})")
    code = CODE_CTYPES[kv_dtype]
    if kernel == "gqakv_copy_tokens":
        base = name_expression(kernel, "float32", head_dim)
        return base.replace("<float,", f"<{code},", 1)
    if kernel == "gqakv_write_kv_quantized":
        base = name_expression("gqakv_write_kv", dtype, head_dim)
        return base.replace("gqakv_write_kv<", "gqakv_write_kv_quantized<", 1).replace(
            f"<{CTYPES[dtype]},", f"<{CTYPES[dtype]}, {code},", 1)
    if kernel == "gqakv_merge":
        return name_expression(kernel, dtype, head_dim, query_tile, variant)
    base = name_expression(kernel, dtype, head_dim, query_tile, variant)
    return base.replace(f"<{CTYPES[dtype]},", f"<gqakv_quantized<{CTYPES[dtype]}, {code}>,", 1)


def quantized_instantiations(kernel: str, dtype: str, head_dim: int, kv_dtype: str) -> list[str]:
    """Every quantized name expression of ``kernel`` for one q dtype, head dim and kv_dtype."""
    if kernel == "gqakv_decode":
        return [name_expression(kernel, dtype, head_dim, qb, kv_dtype=kv_dtype)
                for qb in DECODE_QUERY_TILES]
    return [name_expression(kernel, dtype, head_dim, kv_dtype=kv_dtype)]


def instantiations(kernel: str, dtype: str, head_dim: int, kv_dtype: str | None = None) -> list[str]:
    """Every name expression of ``kernel`` for one dtype and head dim (decode: one per tile;
    none for gqakv_prefill_mma where it does not apply); with ``kv_dtype`` those over a
    cache of that quantized storage (none for kernels without quantized instantiations),
    without it none for gqakv_write_kv_quantized."""
    if kv_dtype is not None:
        if kernel not in QUANTIZED_KERNELS:
            return []
        return quantized_instantiations(kernel, dtype, head_dim, kv_dtype)
    if kernel == "gqakv_write_kv_quantized":
        return []
    if kernel == "gqakv_prefill_mma" and not prefill_mma_supported(dtype, head_dim):
        return []
    if kernel == "gqakv_decode_mma" and not decode_mma_supported(dtype, head_dim):
        return []
    if kernel == "gqakv_decode":
        return [name_expression(kernel, dtype, head_dim, qb) for qb in DECODE_QUERY_TILES]
    return [name_expression(kernel, dtype, head_dim)]


def vec_width(dtype: str, head_dim: int) -> int:
    """Elements per vector access; mirrors ``VecWidth`` in common.cuh (and its 8-byte
    specialisation for codes in quantized_kv.cuh)."""
    if dtype in CODE_CTYPES:
        return 8 if head_dim % 8 == 0 else 1
    size = ITEMSIZE[dtype]
    return 16 // size if (head_dim * size) % 16 == 0 else 1
