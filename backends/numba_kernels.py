"""Numba kernels of the numba backend: attention over the live cache, one pass over K/V.

The attention loop is composed of small ``@njit`` pieces that LLVM inlines into it,
so later storage kinds and attention variants replace one piece, not the loop:

- how K/V are read: ``key_run(buf, r, h, j, n)`` gives the stored rows of keys
  j .. j + m - 1 of KV head h of cache row r that lie together in storage (m <= n),
  chosen at compile time by the layout's type: contiguous rows (an array: all n keys,
  a view), ``Paged`` (a pool and page table: up to the end of j's page, one table lookup
  per run), ``Quantized`` (codes and a per-token scale, either of those layouts),
  ``Grouped`` / ``PagedGrouped`` (codes and a scale per block of values along d: a run is
  decoded in registers, or once into an L1-sized float32 block for tall tiles,
  ``run_dots``); and
  ``decode(x)`` turns one stored element into float32, chosen by the element type
  (float32 as is; float16 bits as uint16 and bfloat16 bits as int16, int8 codes, and
  float8_e4m3fn bits as uint8, converted in registers: ``half_to_float``,
  ``bfloat16_to_float``, ``e4m3_to_float``). A quantized token's scale never touches its
  row: ``factor`` multiplies its dot product (K) and its p (V), 1 otherwise (folded away);
- which keys a query sees: ``visible_keys(q_pos, window)`` gives the key range
  ``lo, hi`` (bottom-right causal, ``0, q_pos + 1``, with a sliding window's first key
  as ``lo``: ``gqakv.core.semantics.key_range`` in kernel form; the planner's items already
  start at the window, so only the first block of a query block is masked by it); a
  draft tree (``Tree``: ancestors and depths, or None, chosen by type) adds its clause to
  the blocks that reach into the chunk (``tree_masks_block``, ``tree_score_row``: a chunk
  key is seen only by its descendants, windows and ALiBi measure logical positions);
- how a score is modified (the score hook, ``semantics.transform``): ``score(dot, scale,
  softcap)`` (scaling, then the soft-cap ``c * tanh(s / c)`` when softcap > 0, through
  the vectorizable ``tanh_f32``), then ``bias(alibi, x, head, q_pos, j)`` (ALiBi's
  ``slope[head] * (j - q_pos)``; chosen by ``alibi``'s type, so a call without ALiBi
  compiles without it);
- sinks: ``join_sink`` adds a query head's sink to a finished (m, l) once every key
  of the query is summed (an item's own keys, or its merged key pieces).

Per block of keys (``key_block``, 256 by default): the dots of the whole tile (G heads x
queries) against the block with the loop over d vectorized (``_block_dots``: two keys
x up to four rows of accumulators in registers, written as vector IR in ``_dots_rows``
where d is a multiple of 16, their sums reduced by one tree of shuffles; bfloat16
queries over bfloat16 keys as AVX-512 BF16 pair products where the CPU has them: each
product exact, half the instructions, 0.90-0.93x the bfloat16 decode time), then per row
the mask, one max and rescale per block and the exponentials, then O += P V
(``_accumulate``: where d is a multiple of 16, up to four rows at a time with their
accumulators in registers for the whole run, vector IR in ``_pv_rows``; else four
values into four rows per pass with the loop over d vectorized); both walk
the block one storage run at a time and prefetch the rows ``PREFETCH_BYTES`` ahead
into every cache level, float32 rows by the CPU's plan (``float32_prefetch``: on AMD
Zen 8 KB ahead into L2) (``prefetch_ahead``: contiguous rows, and paged rows within
their page, ``page_rows``; float32 pages read heads together compile without it except
under that plan), and on AMD Zen contiguous 16-bit rows also 16 KB farther into L2
(``far_ahead``, ``far_prefetch_16``). Over pages small enough
(``numba_backend.together_page_limit``: 32 tokens at d = 128, within a key block), whose
KV heads lie heads-major in each page, an item's heads (up to
``PAGED_TILE_ROWS`` tile rows) are attended in one pass, each storage run read for every
head in turn (``heads_per_pass``), so a page is read in address order (paged 16 /
contiguous float32 decode 1.28-1.31 -> 1.03-1.06 and bfloat16 1.37-1.47 -> 0.94, one
thread, B=4 L=4,096 and B=1 L=32,768). Each K/V element is read and
converted once per four tile rows, straight from the cache or pool (no scratch copy, no
dequantized copy). Grouped codes are decoded in registers too, each vector times its
block's scale (``_emit_grouped_vectors``), except under tiles too tall for that to pay:
there each run is decoded once into a float32 block of at most ``key_block`` rows (128
KiB at d = 128: L2, not L1, yet an 8-query int4_g32 chunk took 0.91x the time of 32-key
blocks decoded into 16 KiB, 2026-12-07) that the same loops then read (``run_dots``; the same bits either way). The per-block pieces (``_block_dots``, ``_score_row``, ``_accumulate``) are
inlined into ``_attend`` by numba (``inline="always"``), so the array views of each
storage run (one per page when paged) are not passed through calls with their reference
counting on the shared buffers (measured on the loaded 2-core machine against the called
version: contiguous decode 0.92-0.96x the time, paged at 16-token pages 0.90-1.01x;
B=32 L=1024 and B=4 L=4096).

The online softmax keeps a running max ``m`` and sum ``l`` in float32 per tile row and
is correct when a whole key block is masked (rows whose max is still -inf add
nothing); a NaN score makes the row's m and l NaN (NaN out and lse, as the
reference). Exponentials go through ``exp_nonpos``, a vectorizable float32 exp (LLVM
from pip has no vector math library, and a scalar ``expf`` call per score costs as
much as reading the key).

fastmath is limited to {contract, reassoc, arcp}: never 'nnan'/'ninf', since masked
scores are -inf and a NaN in a live K/V value must reach the output as it does in
the reference. The vector loops ask LLVM for 512-bit vectors where the CPU has them
(``_prefer_512_bit_vectors``).

Appends and row copies (``write_tokens``, ``copy_rows``) move each contiguous run of
tokens with one C-library ``memmove`` (``_move``): one compiled call per append or
wave of copies, at memcpy speed.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.np.arrayobj import make_view

FASTMATH = {"contract", "reassoc", "arcp"}
#: How the kernels take each cache dtype's buffers: the view whose element type
#: ``decode`` converts (float16 and bfloat16 as their 16-bit patterns).
BITS_VIEW = {"float32": np.float32, "float16": np.uint16, "bfloat16": np.int16}

_NEG_INF = np.float32(-np.inf)


#: How far ahead of the key (or value) being read the rows stored after it are
#: prefetched, in bytes (4 rows of a float32 d=128 head, 8 of bfloat16). Measured on
#: the 2-core Xeon (decode, B=4 L=4,096, alternating processes): 4 KB and 8 KB alike,
#: contiguous decode 1.2-1.5x faster than without (one core's demand misses alone read
#: ~7 GB/s: between the loop's bursts of loads the line fill buffers sit idle unless
#: the next rows are already on their way). Nearer is faster still (2026-12-05, 512 B
#: to 8 KB in alternating processes, 3 rounds, load 1.1-3.8): 2 KB against 8 KB, two
#: threads, float32 B=4 L=8,192 13.6-14.3 -> 10.9-11.2 ms, B=32 L=1,024 13.5-14.5 ->
#: 10.8-11.4, float16 8.55-8.65 -> 6.87-7.55, bfloat16 7.80-8.16 -> 6.23-7.06, int8
#: 5.65-5.76 -> 5.23-5.68 (4-bit, compute-bound, alike); one thread float32 26.5-27.4 ->
#: 21.2-21.4, bfloat16 16.1-16.4 -> 12.8-12.9; 512 B and 1 KB about as 2 KB, 4 KB between.
PREFETCH_BYTES = 2 << 10


def float32_prefetch(cpu: str) -> tuple[int, int, bool]:
    """``(bytes ahead, locality, small pages)`` of the prefetches over rows of float32 on
    the CPU LLVM calls ``cpu``; rows of 16 and 8 bits keep ``PREFETCH_BYTES`` into every
    level. Locality is ``llvm.prefetch``'s: 3 every cache level (``prefetcht0``), 1 the
    outer ones (``prefetcht2``, L2 on down). ``small pages``: whether float32 pages whose
    heads are read together (``heads_per_pass``) are prefetched too.

    On AMD Zen (``znver*``) float32 rows are prefetched 8 KB ahead into L2 only. One
    core's float32 decode there read 12.5 GB/s against 27 GB/s for a plain sum over the
    same rows (2026-12-07): each prefetch into L1 holds one of the few L1 miss buffers
    for the whole trip to memory, so a core keeps too few lines in flight, while L2 has
    more. Two threads, the Llama-3.1-8B layer, kernel copies alternating call by call in
    one process (load about 1), time / the 2 KB into-L1 kernels': decode B=4 L=4,096
    float32 0.67-0.89 at 8 KB into L2 (0.68-0.84 at 16 KB, 0.78 at 32 KB; 2 KB into L1
    plus more into L2 0.69-0.70), 256-token pages 0.82-0.91, 16-token pages (not
    prefetched before) 0.70-0.91; bfloat16 0.94-1.00, and int8 codes 1.15-1.29 with any
    far prefetch (their dequantizing, not memory, bounds them), so narrower rows keep the
    near one (the performance guide has the table). Other
    CPUs keep 2 KB into L1 and no prefetch over small float32 pages (both measured on the
    Xeon, above and at ``prefetch_ahead``; there an L2 prefetch 8-32 KB ahead beside the
    near one did not pay, the performance guide)."""
    if cpu.startswith("znver"):
        return 8 << 10, 1, True
    return PREFETCH_BYTES, 3, False


def _target_cpu() -> str:
    """The CPU numba compiles for: ``NUMBA_CPU_NAME`` where set, else the host's."""
    import llvmlite.binding as llvm
    from numba.core import config

    return config.CPU_NAME or llvm.get_host_cpu_name()


#: ``float32_prefetch`` of the CPU the kernels are compiled for (numba's cache keeps a
#: kernel per CPU name and features, so a cached kernel was built with this plan).
FLOAT32_PREFETCH_BYTES, FLOAT32_PREFETCH_LOCALITY, FLOAT32_SMALL_PAGE_PREFETCH = \
    float32_prefetch(_target_cpu())


def far_prefetch_16(cpu: str) -> int:
    """How many bytes past the near prefetch (``PREFETCH_BYTES`` into every level) rows
    of 16-bit elements (float16 and bfloat16 bits) of contiguous layouts are also
    prefetched into L2 only (``prefetcht2``) on the CPU LLVM calls ``cpu``; 0: none
    (``far_ahead``).

    On AMD Zen (``znver*``) 16 KB: there a near prefetch alone keeps too few lines in
    flight (``float32_prefetch``). A small gain, measured with kernel copies alternating
    call by call in one process over one cache, two threads, the Llama-3.1-8B layer, a
    read probe in the same rounds (2026-12-07, load 0-1.5; median time against the near
    prefetch alone, several runs): bfloat16 B=4 L=4,096 0.88-0.97, float16 B=4 L=4,096
    0.92-0.93 and B=1 L=32,768 0.93; bfloat16 B=1 L=32,768 0.94-1.05 and B=32 L=1,024
    0.99-1.05 (0.96 where the far row may lie past the view), within this method's
    spread (two copies of one kernel differed by up to 4%, unchanged paged and int8
    kernels by 3-7%). 14-32 KB alike. Not paged layouts:
    at 256-token pages every far variant was slower (1.05-1.10 with the near one, 1.22
    alone); not int8 or e4m3 codes, which their conversion, not memory, bounds (a far
    prefetch cost them 1.15-1.29x for float32's plan). Other CPUs: none (on the Xeon an
    L2 prefetch 8-32 KB ahead beside the near one did not pay for float32 rows; 16-bit
    rows not measured there)."""
    return 16 << 10 if cpu.startswith("znver") else 0


#: ``far_prefetch_16`` of the CPU the kernels are compiled for.
FAR_PREFETCH_16_BYTES = far_prefetch_16(_target_cpu())


def _emit_row_prefetches(context, builder, base, nbytes, locality):
    """IR: one ``llvm.prefetch`` (read, ``locality``, data cache) per 64-byte line of the
    ``nbytes`` (intp) bytes from ``base`` (an i8 pointer)."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    prefetch = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
    with cgutils.for_range_slice(builder, context.get_constant(types.intp, 0), nbytes,
                                 context.get_constant(types.intp, 64)) as (offset, _):
        builder.call(prefetch, [builder.gep(base, [offset]), ir.Constant(i32, 0),
                                ir.Constant(i32, locality), ir.Constant(i32, 1)])


def _prefetch_locality(stored) -> int:
    """``llvm.prefetch``'s locality for rows whose elements are numba type ``stored``."""
    return FLOAT32_PREFETCH_LOCALITY if stored == types.float32 else 3


@intrinsic
def _prefetch_row(typingctx, rows, i):
    """Start loading row i of a [n, d] view (d contiguous) into the cache: one
    ``llvm.prefetch`` per 64-byte line, into the levels the rows' element type is
    prefetched into (``_prefetch_locality``). A hint, never a fault; callers stay inside
    the view so that no load is wasted on other rows."""
    return _prefetch_row_ir(rows, i, near=True)


def _prefetch_row_ir(rows, i, near: bool):
    """The typing and codegen of ``_prefetch_row`` (``near``) and ``_prefetch_row_l2``."""
    if not (isinstance(rows, types.Array) and rows.ndim == 2 and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        aryty, ity = signature.args
        arr = context.make_array(aryty)(context, builder, args[0])
        at = [context.cast(builder, args[1], ity, types.intp), context.get_constant(types.intp, 0)]
        ptr = cgutils.get_item_pointer(context, builder, aryty, arr, at, wraparound=False)
        itemsize = context.get_abi_sizeof(context.get_data_type(aryty.dtype))
        nbytes = builder.mul(builder.extract_value(arr.shape, 1),
                             context.get_constant(types.intp, itemsize))
        locality = _prefetch_locality(aryty.dtype) if near else 1
        _emit_row_prefetches(context, builder, builder.bitcast(ptr, ir.IntType(8).as_pointer()),
                             nbytes, locality)
        return context.get_dummy_value()

    return types.none(rows, i), codegen


@intrinsic
def _prefetch_row_l2(typingctx, rows, i):
    """``_prefetch_row`` into the outer cache levels only (``prefetcht2``): the far
    prefetch (``far_ahead``)."""
    return _prefetch_row_ir(rows, i, near=False)


# -- bits ----------------------------------------------------------------------------------

@intrinsic
def _bits_to_float32(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as a float32 (a register move)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        value = args[0]
        if bits.bitwidth > 32:
            value = builder.trunc(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _float32_bits(typingctx, x):
    """The bits of a float32 as an int32 (a register move)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(x), codegen


@njit(cache=True)
def _order_key(b):
    """float32 bits (int32) -> an integer with the floats' order (-inf < ... < -0 < +0 <
    ... < +inf); its own inverse. LLVM vectorizes an integer max reduction, but not a
    float one without 'nnan' (which these kernels never use)."""
    return b ^ ((b >> 31) & 0x7FFFFFFF)


#: ``_order_key`` of -inf's bits (0xFF800000).
_NEG_INF_KEY = -0x7F800001


def _splat(ty, value):
    """An IR constant of ``ty`` (a scalar type, or a vector of it with every lane ``value``)."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [value] * ty.count)
    return ir.Constant(ty, value)


def _like(ty, element):
    """``element`` as a vector of ``ty``'s lane count when ``ty`` is a vector, else as is."""
    return ir.VectorType(element, ty.count) if isinstance(ty, ir.VectorType) else element


def _emit_to_float32(builder, raw, code, nan_bits: bool = True):
    """IR: stored elements ``raw`` (a scalar or a vector of the stored integer type, or of
    float) -> float32, by ``code``, the stored element's numba type (``decode``'s table):
    float32 as is, uint16 float16 bits (``_half_bits_to_float32``), int16 bfloat16 bits,
    int8 codes, uint8 float8_e4m3fn bits (``_e4m3_bits_to_float32``). One spelling for the
    scalar intrinsics and for the vector loop of ``_dots_4x2``."""
    ty = raw.type
    i16, i32 = _like(ty, ir.IntType(16)), _like(ty, ir.IntType(32))
    f16, f32 = _like(ty, ir.HalfType()), _like(ty, ir.FloatType())
    if code == types.float32:
        return raw
    if code == types.int16:  # bfloat16: the upper half of the float32 bits
        return builder.bitcast(builder.shl(builder.zext(raw, i32), _splat(i32, 16)), f32)
    if code == types.int8:
        return builder.sitofp(raw, f32)
    if code == types.uint16:
        # LLVM's ``fpext half`` is exact but the hardware quiets a signaling NaN (sets
        # float32 bit 22): where the result is NaN and the float16 quiet bit (bit 9) was
        # clear, bit 22 is cleared again (a test and a masked AND per vector), unless
        # ``nan_bits`` is False: for values only multiplied and summed, where any NaN
        # gives NaN whatever its bits (the dots and P V; 4 of a vector's 5 operations).
        f = builder.fpext(builder.bitcast(raw, f16), f32)
        if not nan_bits:
            return f
        is_nan = builder.fcmp_unordered("uno", f, f)
        was_signaling = builder.icmp_unsigned("==", builder.and_(raw, _splat(i16, 0x0200)),
                                              _splat(i16, 0))
        fb = builder.bitcast(f, i32)
        cleared = builder.and_(fb, _splat(i32, 0xFFBFFFFF))
        return builder.bitcast(builder.select(builder.and_(is_nan, was_signaling), cleared, fb), f32)
    if code == types.uint8:  # e4m3fn, on 16-bit lanes so LLVM keeps them narrow
        b = builder.zext(raw, i16)
        a = builder.and_(b, _splat(i16, 0x7F))
        h = builder.or_(builder.shl(a, _splat(i16, 7)),
                        builder.shl(builder.and_(b, _splat(i16, 0x80)), _splat(i16, 8)))
        nan = builder.icmp_unsigned("==", a, _splat(i16, 0x7F))
        h = builder.select(nan, _splat(i16, 0x7E00), h)  # float16's quiet NaN
        f = builder.fpext(builder.bitcast(h, f16), f32)
        return builder.fmul(f, _splat(f32, 256.0))
    raise TypeError(f"no float32 decoder for stored elements of type {code}")


@intrinsic
def _half_bits_to_float32(typingctx, bits):
    """float16 bits (uint16) -> float32, bit-exact as NumPy's cast, in a few vector ops
    (``_emit_to_float32``: ``fpext half`` with the signaling-NaN fix-up)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return _emit_to_float32(builder, args[0], types.uint16)

    return types.float32(bits), codegen


@intrinsic
def _dequantize_16(typingctx, src, at, dst, scale):
    """Sixteen code bytes of ``src`` from element ``at`` on, times ``scale``, into ``dst``
    (float32) as one vector operation: int8 codes -> ``dst[at:at + 16]``, each its value
    times scale; uint8 bytes of two 4-bit codes (value 2i in the low nibble of byte i,
    each nibble the code + 8) -> ``dst[2 at:2 at + 32]``. The same float32 products as the
    element loop, written as vectors (``_emit_grouped_vectors``, the decoder the dots and
    P V read codes in registers with) because LLVM vectorizes that loop badly at 32 or 64
    codes a group (an 8-lane loop with its checks around every group)."""
    if not (isinstance(src, types.Array) and src.ndim == 1 and src.dtype in (types.int8, types.uint8)
            and isinstance(dst, types.Array) and dst.ndim == 1 and dst.dtype == types.float32
            and isinstance(at, types.Integer) and scale == types.float32):
        return None
    four_bit = src.dtype == types.uint8

    def codegen(context, builder, signature, args):
        src_ty, at_ty, dst_ty, _ = signature.args
        src_arr = context.make_array(src_ty)(context, builder, args[0])
        dst_arr = context.make_array(dst_ty)(context, builder, args[2])
        i = context.cast(builder, args[1], at_ty, types.intp)
        lanes = _vector_lanes(context)
        column = builder.shl(i, context.get_constant(types.intp, 1)) if four_bit else i
        row = cgutils.get_item_pointer(context, builder, src_ty, src_arr,
                                       [context.get_constant(types.intp, 0)], wraparound=False)
        vectors = _emit_grouped_vectors(builder, row, column, args[3], lanes, four_bit,
                                        (32 if four_bit else 16) // lanes)
        for v, values in enumerate(vectors):
            out = cgutils.get_item_pointer(
                context, builder, dst_ty, dst_arr,
                [builder.add(column, context.get_constant(types.intp, lanes * v))], wraparound=False)
            builder.store(values, builder.bitcast(out, values.type.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(src, at, dst, scale), codegen


#: Stored element types ``_dots_4x2`` decodes in vectors (``_emit_to_float32``).
_VECTOR_CODES = (types.float32, types.uint16, types.int16, types.int8, types.uint8)


#: float32 value of each 4-bit nibble (the code + 8): the table ``_emit_grouped_vectors``
#: looks nibbles up in with one AVX-512 permute (``vpermps`` reads an index's low 4 bits).
_NIBBLE_VALUES = [float(i - 8) for i in range(16)]


def _emit_grouped_vectors(builder, row, c, scale, lanes, four_bit, count):
    """IR: ``count`` float32 vectors of ``lanes`` values, columns c .. c + count x lanes - 1
    of a grouped code row (``Grouped``: ``row`` points at its first code element, i8 or
    u8), each its code times ``scale`` (the float32 scale of the block holding them;
    blocks are multiples of 32 values): the same float32 products as ``dequantize_block``.
    4-bit: column c is nibble c % 2 of byte c // 2 (the code + 8). With AVX-512 (16 lanes)
    a nibble becomes its value by one table permute (``_NIBBLE_VALUES``), and a pair of
    vectors (count even, c a multiple of 32) comes from one 16-byte load: low and high
    nibbles split by a shift, interleaved into column order by two permutes (int4_g32, one
    thread's dots and P V of G = 4 rows, d = 128: 40 ns per key by lanes of the bytes
    shifted, masked and converted, 38 so, 35-36 with the scaled table)."""
    i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
    vi, vf = ir.VectorType(i32, lanes), ir.VectorType(f32, lanes)
    splat = builder.shuffle_vector(builder.insert_element(ir.Constant(vf, ir.Undefined), scale,
                                                          ir.Constant(i32, 0)),
                                   ir.Constant(vf, ir.Undefined), ir.Constant(vi, [0] * lanes))
    mask = lambda m: ir.Constant(ir.VectorType(i32, len(m)), m)  # noqa: E731

    def bytes_at(column, nbytes):
        at = builder.lshr(column, ir.Constant(column.type, 1)) if four_bit else column
        ty = ir.VectorType(i8, nbytes)
        return builder.load(builder.bitcast(builder.gep(row, [at]), ty.as_pointer()), align=1)

    # With the table permute the table is scaled once (the same products, one multiply
    # per 16 nibble values instead of one per vector); 8-bit codes and AVX2 multiply after.
    table = builder.fmul(ir.Constant(vf, _NIBBLE_VALUES), splat) if lanes == 16 else None

    def nibble_values(nibbles):  # i32 lanes whose low 4 bits are nibbles -> value x scale
        if table is not None:
            permute = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vf, [vf, vi]), "llvm.x86.avx512.permvar.sf.512")
            return builder.call(permute, [table, nibbles])
        values = builder.sitofp(builder.sub(builder.and_(nibbles, _splat(vi, 15)), _splat(vi, 8)), vf)
        return builder.fmul(values, splat)

    out = []
    if four_bit and lanes == 16 and count % 2 == 0:
        for pair in range(count // 2):
            wide = builder.zext(bytes_at(builder.add(c, ir.Constant(c.type, 32 * pair)), 16), vi)
            low, high = wide, builder.lshr(wide, _splat(vi, 4))  # the permute masks the low one
            for half in range(2):
                out.append(nibble_values(builder.shuffle_vector(
                    low, high, mask([8 * half + k // 2 + 16 * (k % 2) for k in range(16)]))))
        return out
    for v in range(count):
        column = builder.add(c, ir.Constant(c.type, lanes * v))
        if four_bit:
            raw = bytes_at(column, lanes // 2)
            pairs = builder.shuffle_vector(raw, ir.Constant(raw.type, ir.Undefined),
                                           mask([k // 2 for k in range(lanes)]))
            nibbles = builder.lshr(builder.zext(pairs, vi), mask([4 * (k % 2) for k in range(lanes)]))
            out.append(nibble_values(nibbles))
        else:
            out.append(builder.fmul(builder.sitofp(bytes_at(column, lanes), vf), splat))
    return out


def _is_grouped_scales(scales):
    """Whether a run's scales (``key_run``) are a grouped codec's: [n, d / g] float32."""
    return isinstance(scales, types.Array) and scales.ndim == 2 and scales.dtype == types.float32


def _halves_masks(n, width):
    """Shuffle masks of ``_dots_4x2``'s reduction step over two n-lane vectors x, y (y's
    lanes numbered n..2n-1): ``lo`` takes x's and y's blocks of ``width`` lanes at even
    block positions, alternately, ``hi`` the blocks right after them."""
    lo = [i for blk in range(0, n, 2 * width)
          for i in list(range(blk, blk + width)) + list(range(n + blk, n + blk + width))]
    return lo[:n], [i + width for i in lo[:n]]


def _sum_tree(vals, halves, lanes):
    """The lane sums of eight vectors of ``lanes`` (16 or 8) lanes by a tree of ``halves``
    steps: pairs of vectors folded into one (blocks of lanes / 2 lanes, then half that,
    ...), then the last vector folded on itself while blocks are left. Each vector's sum
    ends in one lane of the result (``_tree_order`` says which)."""
    width, level = lanes // 2, list(vals)
    while len(level) > 1:
        level = [halves(level[i], level[i + 1], width) for i in range(0, len(level), 2)]
        width //= 2
    last = level[0]
    while width >= 1:
        last = halves(last, last, width)
        width //= 2
    return last


def _tree_order(lanes):
    """The lane of ``_sum_tree``'s result that holds each of the eight sums (a0..a3,
    b0..b3 of ``_dots_4x2``): the tree run on labels instead of values."""
    def halves(x, y, width):
        lo, _ = _halves_masks(len(x), width)
        return [(x + y)[i] for i in lo]
    last = _sum_tree([[v] * lanes for v in range(8)], halves, lanes)
    return [last.index(v) for v in range(8)]


def _target_features(context) -> str:
    """The CPU features numba's target compiles for (LLVM's "+avx512f,-amx-bf16,..." list)."""
    return str(getattr(context.codegen(), "_tm_features", ""))


def _vector_lanes(context) -> int:
    """float32 lanes of the widest vector register numba's target has: 16 with AVX-512,
    else 8 (AVX2; a 16-lane vector there is two registers and its shuffles cross them)."""
    return 16 if "+avx512f" in _target_features(context) else 8


class _BFloat16(ir.types._BaseFloatType):
    """LLVM's ``bfloat`` (llvmlite.ir spells float, double and half only): the operand
    type of ``vdpbf16ps`` (``llvm.x86.avx512bf16.dpbf16ps.512``)."""
    null = "0.0"
    intrinsic_name = "bf16"

    def __str__(self):
        return "bfloat"


_BFloat16._create_instance()


def _has_bf16_dots(context) -> bool:
    """Whether numba's target CPU has AVX-512 BF16 dot products (``vdpbf16ps``: AMD Zen 4
    and later, Intel Cooper Lake and Sapphire Rapids and later)."""
    features = _target_features(context)
    return "+avx512f" in features and "+avx512bf16" in features


def _dots_rows(R: int):
    """An intrinsic ``(qt, rr, krows, kscales, j0, j1)``: the 2R dot products of query rows
    ``qt[rr:rr + R]`` (float32 [*, d], or bfloat16 bits as int16 where krows are bfloat16
    too: see below) with two stored rows ``krows[j0]``, ``krows[j1]``
    (a [n, >= d] array of a ``decode`` element type, rows of unit stride) as ``(a_0 ..
    a_{R-1}, b_0 .. b_{R-1})``: a_i = qt[rr + i] . krows[j0], b_i = . krows[j1]. Rows are
    addressed, not viewed: a view of a row would count a reference on the whole buffer
    (an atomic add and subtract on a counter every thread shares) for every key.
    ``kscales``: None or per-token scales [n] (ignored here: the caller's ``factor``), or
    a grouped codec's [n, d / g] (``_is_grouped_scales``): then krows are its codes (int8
    [n, d], or uint8 nibble pairs [n, d / 2]) and each vector of them is decoded in
    registers times its block's scale (``_emit_grouped_vectors``: the float32 values
    ``dequantize_rows`` would write), so the dots are those over the decoded rows, bit
    for bit, without writing them.

    For d a multiple of 16 (the caller's check). Written as vectors because LLVM's own
    vectorization of the dot loop ends each dot with a horizontal sum of its own (nine
    shuffles and adds each at 16 lanes, as many operations as the loop's FMAs at d = 128);
    here the accumulators are summed together in a tree of shuffles (``_sum_tree``: 24
    operations for eight sums; with fewer than four rows the missing ones are -0.0 vectors,
    which the adds fold away). Vectors are as wide as the target's registers
    (``_vector_lanes``: 16 float32 lanes with AVX-512, else 8). Each key element is loaded
    and converted once for the R rows; lane c of an accumulator sums elements c, c +
    lanes, ... in order, then the tree adds lanes pairwise, so a row's dots are the same
    bits whichever R its pass has.

    bfloat16 queries over bfloat16 keys (qt int16, krows int16): every product of two
    bfloat16 values is exact in float32, so where the target has AVX-512 BF16
    (``_has_bf16_dots``) each 32 columns are one ``vdpbf16ps`` per row and key, which
    folds lane c's pair of products (columns 2c, 2c + 1 of the 32) into its float32
    accumulator: half the instructions of widening both operands and two FMAs, the keys
    never widened (the instruction treats denormal inputs as zero: bfloat16 magnitudes
    below 2^-126). A last 16 columns (d an odd multiple of 16), and every column on
    targets without the instruction, are widened and go through FMAs as above."""

    @intrinsic
    def dots(typingctx, qt, rr, krows, kscales, j0, j1):
        if not (isinstance(qt, types.Array) and qt.ndim == 2
                and isinstance(krows, types.Array) and krows.ndim == 2
                and krows.dtype in _VECTOR_CODES
                and all(isinstance(x, types.Integer) for x in (rr, j0, j1))):
            return None
        code = krows.dtype
        grouped = _is_grouped_scales(kscales)
        if grouped and code not in (types.int8, types.uint8):
            return None
        if not (qt.dtype == types.float32
                or (qt.dtype == types.int16 and code == types.int16 and not grouped)):
            return None
        q_code = qt.dtype

        def codegen(context, builder, signature, args):
            qt_ty, rr_ty, k_ty, sc_ty, j0_ty, j1_ty = signature.args
            i32, f32 = ir.IntType(32), ir.FloatType()
            lanes = _vector_lanes(context)
            vf = ir.VectorType(f32, lanes)
            stored = context.get_data_type(code)
            vk = ir.VectorType(stored, lanes)
            q_stored = context.get_data_type(q_code)
            vq = ir.VectorType(q_stored, lanes)
            intp = lambda x: context.get_constant(types.intp, x)  # noqa: E731
            q_arr = context.make_array(qt_ty)(context, builder, args[0])
            row = context.cast(builder, args[1], rr_ty, types.intp)
            zero = intp(0)
            q_rows = [cgutils.get_item_pointer(context, builder, qt_ty, q_arr,
                                               [builder.add(row, intp(i)), zero], wraparound=False)
                      for i in range(R)]
            k_arr = context.make_array(k_ty)(context, builder, args[2])
            js = [context.cast(builder, j, j_ty, types.intp)
                  for j, j_ty in ((args[4], j0_ty), (args[5], j1_ty))]
            k_rows = [cgutils.get_item_pointer(context, builder, k_ty, k_arr, [j, zero],
                                               wraparound=False) for j in js]
            d = builder.extract_value(q_arr.shape, 1)
            fmuladd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]),
                                                     f"llvm.fmuladd.v{lanes}f32")
            accs = {(j, i): cgutils.alloca_once_value(builder, ir.Constant(vf, None))
                    for j in range(2) for i in range(R)}

            def columns(c, ks):
                """The FMAs of columns c .. c + lanes - 1, given the two keys' vectors."""
                qs = [_emit_to_float32(builder, builder.load(
                    builder.bitcast(builder.gep(q, [c]), vq.as_pointer()),
                    align=context.get_abi_sizeof(q_stored)), q_code) for q in q_rows]
                for j, kv in enumerate(ks):
                    for i, qv in enumerate(qs):
                        acc = accs[j, i]
                        builder.store(builder.call(fmuladd, [qv, kv, builder.load(acc)]), acc)

            if grouped:  # block by block: each block's scales loaded once per key
                sc_arr = context.make_array(sc_ty)(context, builder, args[3])
                blocks = builder.extract_value(sc_arr.shape, 1)
                g = builder.sdiv(d, blocks)
                with cgutils.for_range_slice(builder, zero, blocks, intp(1)) as (b, _):
                    scales = [builder.load(cgutils.get_item_pointer(context, builder, sc_ty, sc_arr,
                                                                    [j, b], wraparound=False))
                              for j in js]
                    c0 = builder.mul(b, g)
                    per = 2 if code == types.uint8 and lanes == 16 else 1  # vectors per step
                    with cgutils.for_range_slice(builder, c0, builder.add(c0, g),
                                                 intp(lanes * per)) as (c, _):
                        ks = [_emit_grouped_vectors(builder, k, c, f, lanes, code == types.uint8, per)
                              for k, f in zip(k_rows, scales)]
                        for v in range(per):
                            columns(builder.add(c, intp(lanes * v)), [k[v] for k in ks])
            else:
                widened_from = zero
                if q_code == types.int16 and lanes == 16 and _has_bf16_dots(context):
                    # 32 columns a step in pair products (see above), the rest widened
                    widened_from = builder.sub(d, builder.srem(d, intp(32)))
                    v32 = ir.VectorType(_BFloat16(), 32)
                    dot = cgutils.get_or_insert_function(
                        builder.module, ir.FunctionType(vf, [vf, v32, v32]),
                        "llvm.x86.avx512bf16.dpbf16ps.512")
                    w32 = ir.VectorType(ir.IntType(16), 32).as_pointer()
                    with cgutils.for_range_slice(builder, zero, widened_from, intp(32)) as (c, _):
                        qs = [builder.bitcast(builder.load(builder.bitcast(builder.gep(q, [c]), w32),
                                                           align=2), v32) for q in q_rows]
                        ks = [builder.bitcast(builder.load(builder.bitcast(builder.gep(k, [c]), w32),
                                                           align=2), v32) for k in k_rows]
                        for j, kv in enumerate(ks):
                            for i, qv in enumerate(qs):
                                acc = accs[j, i]
                                builder.store(builder.call(dot, [builder.load(acc), qv, kv]), acc)
                with cgutils.for_range_slice(builder, widened_from, d, intp(lanes)) as (c, _):
                    columns(c, [_emit_to_float32(builder, builder.load(
                        builder.bitcast(builder.gep(k, [c]), vk.as_pointer()),
                        align=context.get_abi_sizeof(stored)), code, nan_bits=False)
                        for k in k_rows])
            pad = ir.Constant(vf, [-0.0] * lanes)  # x + -0.0 is x: the tree's adds fold
            vals = [builder.load(accs[j, i]) if i < R else pad for j in range(2) for i in range(4)]

            def halves(x, y, width):
                """Two vectors -> one: blocks of `width` lanes taken alternately from x and
                y, each the sum of a block and the block after it (``_halves_masks``)."""
                lo, hi = _halves_masks(x.type.count, width)
                mask = lambda m: ir.Constant(ir.VectorType(i32, len(m)), m)  # noqa: E731
                return builder.fadd(builder.shuffle_vector(x, y, mask(lo)),
                                    builder.shuffle_vector(x, y, mask(hi)))
            sums = _sum_tree(vals, halves, lanes)
            order = _tree_order(lanes)
            out = [builder.extract_element(sums, ir.Constant(i32, order[4 * j + i]))
                   for j in range(2) for i in range(R)]
            return context.make_tuple(builder, signature.return_type, out)

        return types.UniTuple(types.float32, 2 * R)(qt, rr, krows, kscales, j0, j1), codegen

    return dots


#: ``_dots_rows`` for four rows (the tiles' passes), and for the last three, two or one.
_dots_4x2, _dots_3x2, _dots_2x2, _dots_1x2 = (_dots_rows(r) for r in (4, 3, 2, 1))


def _pv_rows(R: int):
    """An intrinsic ``(acc, rr, s, o, vrows, vscales, n, ahead, far)``: for the ``R`` rows from
    ``rr``, ``acc[rr + i, :] += sum_jj p_ij * value jj`` over the run's ``n`` values
    (``p_ij = s[rr + i, o + jj]`` times value jj's scale, ``vscales`` [n] float32 or None),
    the values rows of ``vrows`` (a [n, >= d] array of a ``decode`` element type, rows of
    unit stride; d = acc's row length, a multiple of 16) converted in registers once for
    the R rows. Grouped codes (``vscales`` [n, d / g], ``_is_grouped_scales``; vrows int8
    [n, d] or uint8 nibble pairs [n, d / 2]): each vector is decoded times its block's
    scale (``_emit_grouped_vectors``), the values ``dequantize_rows`` would write, and p
    is used as it is.

    The columns go by in passes of V vectors (then one) over the run, each pass's R x V
    (R x 1) accumulators in registers for the whole run (one FMA per value vector and row, in key
    order) and loaded and stored once, where a loop over d per key loads and stores them
    every few keys: 27-28 against 33-40 ns per key for one thread's whole ``_attend``
    (bfloat16, float32 or int8, G = 4, d = 128, an L2-resident row). ``ahead`` > 0: the
    first pass also prefetches value row jj + ahead at step jj (inside the view), as
    ``_prefetch_row``, and ``far`` > 0 row jj + far into L2 (``far_ahead``).
    Vectors are as wide as the target's registers (``_vector_lanes``):
    passes of four 16-lane vectors a row with AVX-512 (32 registers), of two 8-lane ones
    with AVX2 (16), so the accumulators never spill."""

    @intrinsic
    def pv(typingctx, acc, rr, s, o, vrows, vscales, n, ahead, far):
        if not (isinstance(acc, types.Array) and acc.ndim == 2 and acc.dtype == types.float32
                and isinstance(s, types.Array) and s.ndim == 2 and s.dtype == types.float32
                and isinstance(vrows, types.Array) and vrows.ndim == 2
                and vrows.dtype in _VECTOR_CODES
                and (isinstance(vscales, types.NoneType)
                     or (isinstance(vscales, types.Array) and vscales.ndim in (1, 2)
                         and vscales.dtype == types.float32))
                and all(isinstance(x, types.Integer) for x in (rr, o, n, ahead, far))):
            return None
        code = vrows.dtype
        grouped = _is_grouped_scales(vscales)
        if grouped and code not in (types.int8, types.uint8):
            return None
        scaled = isinstance(vscales, types.Array) and not grouped

        def codegen(context, builder, signature, args):
            acc_ty, rr_ty, s_ty, o_ty, v_ty, sc_ty, n_ty, ah_ty, far_ty = signature.args
            lanes = _vector_lanes(context)
            V = 4 if lanes == 16 else 2  # vectors a row per pass: R x V accumulators
            intp = lambda x, ty: context.cast(builder, x, ty, types.intp)  # noqa: E731
            const = lambda x: context.get_constant(types.intp, x)  # noqa: E731
            f32 = ir.FloatType()
            vf = ir.VectorType(f32, lanes)
            stored = context.get_data_type(code)
            vk = ir.VectorType(stored, lanes)
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            acc_arr = context.make_array(acc_ty)(context, builder, args[0])
            s_arr = context.make_array(s_ty)(context, builder, args[2])
            v_arr = context.make_array(v_ty)(context, builder, args[4])
            sc_arr = (context.make_array(sc_ty)(context, builder, args[5])
                      if scaled or grouped else None)
            rr_, o_, n_ = intp(args[1], rr_ty), intp(args[3], o_ty), intp(args[6], n_ty)
            ahead_, far_ = intp(args[7], ah_ty), intp(args[8], far_ty)
            fmuladd = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fmuladd.v{lanes}f32")
            nrows = builder.extract_value(v_arr.shape, 0)
            row_bytes = builder.mul(builder.extract_value(v_arr.shape, 1),
                                    const(context.get_abi_sizeof(stored)))
            zero = const(0)
            d = builder.extract_value(acc_arr.shape, 1)

            def one_pass(c0, vectors):
                """Columns c0 .. c0 + lanes x vectors of the R rows over the whole run."""
                acc_ptrs = [[builder.bitcast(cgutils.get_item_pointer(
                    context, builder, acc_ty, acc_arr,
                    [builder.add(rr_, const(i)), builder.add(c0, const(lanes * v))],
                    wraparound=False), vf.as_pointer()) for v in range(vectors)] for i in range(R)]
                accs = [[cgutils.alloca_once_value(builder, builder.load(p, align=4)) for p in row]
                        for row in acc_ptrs]
                if grouped:  # the block of each vector's columns (blocks: multiples of lanes)
                    g = builder.sdiv(d, builder.extract_value(sc_arr.shape, 1))
                    blocks = [builder.sdiv(builder.add(c0, const(lanes * v)), g)
                              for v in range(vectors)]
                first = builder.icmp_signed("==", c0, zero)  # the pass that prefetches
                with cgutils.for_range_slice(builder, zero, n_, const(1)) as (jj, _):
                    # the near prefetch, then the far one into L2 (each: 0 for none)
                    for rows_ahead, locality in ((ahead_, _prefetch_locality(code)), (far_, 1)):
                        pf_row = builder.add(jj, rows_ahead)
                        wanted = builder.and_(first, builder.and_(
                            builder.icmp_signed(">", rows_ahead, zero),
                            builder.icmp_signed("<", pf_row, nrows)))
                        with builder.if_then(wanted, likely=True):
                            base = builder.bitcast(cgutils.get_item_pointer(
                                context, builder, v_ty, v_arr, [pf_row, zero], wraparound=False), i8p)
                            _emit_row_prefetches(context, builder, base, row_bytes, locality)
                    factor_ = None
                    if scaled:
                        factor_ = builder.load(cgutils.get_item_pointer(
                            context, builder, sc_ty, sc_arr, [jj], wraparound=False))
                    ps = []
                    for i in range(R):
                        p = builder.load(cgutils.get_item_pointer(
                            context, builder, s_ty, s_arr,
                            [builder.add(rr_, const(i)), builder.add(o_, jj)], wraparound=False))
                        if factor_ is not None:
                            p = builder.fmul(p, factor_)
                        splat = builder.insert_element(ir.Constant(vf, None), p, ir.Constant(i32, 0))
                        ps.append(builder.shuffle_vector(
                            splat, ir.Constant(vf, None),
                            ir.Constant(ir.VectorType(i32, lanes), [0] * lanes)))
                    if grouped:  # pairs of vectors share a block (blocks: multiples of 32)
                        row = cgutils.get_item_pointer(context, builder, v_ty, v_arr, [jj, zero],
                                                       wraparound=False)
                        per = 2 if vectors % 2 == 0 else 1
                        xs = []
                        for v in range(0, vectors, per):
                            scale = builder.load(cgutils.get_item_pointer(
                                context, builder, sc_ty, sc_arr, [jj, blocks[v]], wraparound=False))
                            xs += _emit_grouped_vectors(builder, row, builder.add(c0, const(lanes * v)),
                                                        scale, lanes, code == types.uint8, per)
                    for v in range(vectors):
                        c = builder.add(c0, const(lanes * v))
                        if grouped:
                            x = xs[v]
                        else:
                            ptr = cgutils.get_item_pointer(context, builder, v_ty, v_arr, [jj, c],
                                                           wraparound=False)
                            raw = builder.load(builder.bitcast(ptr, vk.as_pointer()),
                                               align=context.get_abi_sizeof(stored))
                            x = _emit_to_float32(builder, raw, code, nan_bits=False)
                        for i in range(R):
                            slot = accs[i][v]
                            builder.store(builder.call(fmuladd, [ps[i], x, builder.load(slot)]), slot)
                for i in range(R):
                    for v in range(vectors):
                        builder.store(builder.load(accs[i][v]), acc_ptrs[i][v], align=4)

            wide = builder.sub(d, builder.srem(d, const(V * lanes)))  # columns in whole passes
            with cgutils.for_range_slice(builder, zero, wide, const(V * lanes)) as (c0, _):
                one_pass(c0, V)
            with cgutils.for_range_slice(builder, wide, d, const(lanes)) as (c0, _):
                one_pass(c0, 1)
            return context.get_dummy_value()

        return types.none(acc, rr, s, o, vrows, vscales, n, ahead, far), codegen

    return pv


#: ``_pv_rows`` for four rows (the tiles' passes), and for the last three, two or one.
_pv_4, _pv_3, _pv_2, _pv_1 = (_pv_rows(r) for r in (4, 3, 2, 1))


@intrinsic
def _prefer_512_bit_vectors(typingctx):
    """Let LLVM vectorize the calling function with 512-bit registers.

    On AVX-512 CPUs LLVM defaults to 256-bit vectors (``prefer-256-bit`` tuning, for
    the clock penalty of heavy 512-bit code on older Xeons); these kernels are FMA-bound
    with all data in L1, where zmm doubles the throughput. Sets the function attribute
    ``"prefer-vector-width"="512"``; a no-op where the CPU has no AVX-512 or llvmlite
    refuses the attribute.
    """
    def codegen(context, builder, signature, args):
        try:
            set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        except Exception:  # llvmlite internals changed: keep LLVM's default width
            pass
        return context.get_dummy_value()

    return types.none(), codegen


@njit(cache=True)
def half_to_float(h):
    """float16 bits (uint16) -> float32, bit-exact as NumPy's cast (zeros, subnormals,
    normals, infinities, NaN sign and payload); branch-free, so loops vectorize."""
    return _half_bits_to_float32(h)


@njit(cache=True)
def bfloat16_to_float(h):
    """bfloat16 bits (int16 or uint16) -> float32: the upper half of the float32 bits."""
    return _bits_to_float32(np.uint32(h) << np.uint32(16))


@intrinsic
def _e4m3_bits_to_float32(typingctx, bits):
    """float8_e4m3fn bits (uint8) -> float32 in a few narrow vector ops (see
    ``e4m3_to_float``; ``_emit_to_float32``)."""
    if bits != types.uint8:
        return None

    def codegen(context, builder, signature, args):
        return _emit_to_float32(builder, args[0], types.uint8)

    return types.float32(bits), codegen


@njit(cache=True)
def e4m3_to_float(x):
    """float8_e4m3fn bits (uint8) -> float32, exact (zeros, subnormals, normals; the NaN
    patterns 0x7F/0xFF give NaN), branch-free: e4m3fn's exponent and mantissa fields,
    moved up 7 bits, are the float16 bits of the value / 256 (float16's bias 15 is
    e4m3fn's 7 + 8, and its subnormals cover e4m3fn's), converted by one vcvtph2ps per
    vector and scaled back by 256 (exact); the NaN patterns become float16's quiet NaN."""
    return _e4m3_bits_to_float32(x)


@intrinsic
def _float32_to_half_bits(typingctx, x):
    """float32 -> float16 bits (uint16): LLVM's ``fptrunc`` to half, the hardware's
    conversion (F16C ``vcvtps2ph``): round to nearest even, overflow to infinity,
    subnormals kept; a NaN stays a NaN (quieted)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(x), codegen


@njit(cache=True, nogil=True)
def narrow_to_half(src, dst):
    """dst[:] = float16 bits (uint16) of the float32 values src, NumPy's cast (round to
    nearest even) in vectors; NaN payloads may differ (the hardware quiets them). Releases
    the GIL: the BLAS path's items store float16 results with it on Python threads
    (``numba_backend.narrow_block``)."""
    _prefer_512_bit_vectors()
    for x in range(src.size):
        dst[x] = _float32_to_half_bits(src[x])


@njit(cache=True, nogil=True)
def dequantize_per_token(codes, scales, out):
    """out[j, :] = value of codes[j, :] x scales[j] (float32, one rounding: NumPy's
    codec arithmetic, bit for bit; e4m3fn's NaN patterns give NaN): codes [n, d] int8 codes or uint8 float8_e4m3fn bits
    (``decode``), scales [n] float32, out [n, d] float32. Releases the GIL: the BLAS
    path's items dequantize their blocks with it on Python threads
    (``numba_backend.dequantize_block``)."""
    _prefer_512_bit_vectors()
    for j in range(codes.shape[0]):
        s = scales[j]
        row, o = codes[j], out[j]
        for e in range(row.size):
            o[e] = decode(row[e]) * s


@njit(cache=True, nogil=True)
def convert_bits(src, dst):
    """dst[:] = float32 values of the stored elements src, by src's dtype (``decode``):
    uint16 float16 bits, int16 bfloat16 bits, int8 codes, uint8 e4m3fn bits. Releases the
    GIL: the BLAS path's items widen their float16/bfloat16 blocks with it on Python
    threads (``numba_backend.widen_block``)."""
    _prefer_512_bit_vectors()
    for x in range(src.size):
        dst[x] = decode(src[x])


@njit(cache=True)
def exp_nonpos(x):
    """exp(x) in float32 for x <= 0 (-inf gives 0, NaN stays NaN), vectorizable.

    Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, Cephes' degree-6 polynomial
    (about 1 ulp), times 2**n built from bits. Compiled without fastmath so the
    reduction is not reassociated (flags are per instruction after inlining).
    """
    if x < np.float32(-87.0):  # below float32's normal range (NaN compares false)
        return np.float32(0.0)
    n = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
    r = x - n * np.float32(0.693359375)
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = p * r * r + r + np.float32(1.0)
    if not (n == n):  # NaN input
        return x
    return y * _bits_to_float32((np.int32(n) + np.int32(127)) << np.int32(23))


@njit(cache=True)
def tanh_f32(x):
    """tanh(x) in float32 (Cephes' tanhf: about 2 ulp), vectorizable: a degree-9 odd
    polynomial for |x| < 0.625, else (1 - e) / (1 + e) with e = exp(-2|x|) <= 0.29 (no
    cancellation); +-inf gives +-1, NaN stays NaN. Without fastmath, as ``exp_nonpos``."""
    z = abs(x)
    e = exp_nonpos(np.float32(-2.0) * z)
    big = (np.float32(1.0) - e) / (np.float32(1.0) + e)
    if x < 0:
        big = -big
    zz = x * x
    p = np.float32(-5.70498872745e-3)
    p = p * zz + np.float32(2.06390887954e-2)
    p = p * zz + np.float32(-5.37397155531e-2)
    p = p * zz + np.float32(1.33314422036e-1)
    p = p * zz + np.float32(-3.33332819422e-1)
    small = p * zz * x + x
    return big if z >= np.float32(0.625) else small


@njit(cache=True, inline="always")
def bfloat16_parts(p):
    """p (float32, >= 0) as two bfloat16 bit patterns (uint16): its top 16 bits, and the
    top 16 of p minus them (exact in float32): truncation, which rounds p >= 0 towards 0,
    so the parts sum to p within 2^-14 of it, below it (``softmax_block``'s P split)."""
    bits = _float32_bits(p)
    return (np.uint16(bits >> 16),
            np.uint16(_float32_bits(p - _bits_to_float32(bits & np.int32(-65536))) >> 16))


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def softmax_block(s, m, l, alpha, nq, pos0, window, scale, keys, p_hi, p_lo):
    """One online-softmax step over a block of causal scores, in place, for the NumPy
    BLAS path (``numba_backend.FusedSoftmaxState``, ``amx_prefill``): the scale, mask,
    max, subtract, exp and sum passes NumPy makes over ``s`` fused into two over each row
    (the max as an integer reduction, ``_order_key``; the exp vectorized, ``exp_nonpos``).

    s: [R, K] float32 scores of one block, each to be multiplied by ``scale`` (> 0), row
    r holding query t = r % nq of the block's queries; it sees the block's keys lo <= j <
    hi, hi = pos0 + t + 1 (pos0: the block's first query's position relative to the
    block's first key) and, with a window W > 0, lo = pos0 + t + 1 - W, both clipped to
    0..keys (lo from the unclipped end: a query past the block's last key sees only the
    block's keys inside its window)
    (``keys`` <= K: the columns past it are padding, never seen). s is overwritten by p =
    exp(scale * s - shift), 0 outside [lo, hi). m, l: [R] the running max and sum of the
    scaled scores, updated; alpha: [R] out, exp(m_old - shift), the factor the running
    output is rescaled by. shift is the new max, or the lowest finite float where it is
    -inf (no key seen yet: exp(-inf - shift) = 0 where -inf - -inf would be NaN), as
    ``gqakv.ops.merge.SoftmaxState``; a NaN among a row's visible scores (or in m) makes
    its p, m, l and alpha NaN. p_hi, p_lo: [R, K] uint16, or empty: p is then written as
    two bfloat16 parts (bits) instead of into s: p_hi = p's top 16 bits, p_lo = p - p_hi
    (exact in float32) cut the same way, so p_hi + p_lo is p to within 2^-14 of itself,
    below it (truncation: the whole step about 1.5x faster than with rounding to nearest;
    the bound is ``amx_prefill``'s P V product's). Releases the GIL: the BLAS path's items
    run on Python threads.
    """
    _prefer_512_bit_vectors()
    lowest = np.float32(-3.4028234663852886e38)
    scale = np.float32(scale)
    for r in range(s.shape[0]):
        end = pos0 + r % nq + 1  # one past the query's own key (the window ends there too)
        hi = min(keys, max(0, end))
        lo = 0 if window <= 0 else min(hi, max(0, end - window))
        row = s[r]
        seen = row[lo:hi]  # loops over a whole view: indices provably in bounds, so they vectorize
        key = np.int32(_NEG_INF_KEY)
        bad = False
        for j in range(seen.size):
            key = max(key, _order_key(_float32_bits(seen[j])))
            bad |= seen[j] != seen[j]
        m_old = m[r]
        # rounding is monotone, so the max of the scaled scores is the scaled max
        s_max = _bits_to_float32(_order_key(key)) * scale
        m_new = s_max if s_max > m_old else m_old
        if bad or m_old != m_old:
            m_new = np.float32(np.nan)
        shift = lowest if m_new == np.float32(-np.inf) else m_new
        total = np.float32(0.0)
        if p_hi.shape[0] == 0:
            for j in range(seen.size):
                p = exp_nonpos(seen[j] * scale - shift)
                seen[j] = p
                total += p
            row[:lo] = 0
            row[hi:] = 0
        else:
            hi_row, lo_row = p_hi[r], p_lo[r]
            hi_seen, lo_seen = hi_row[lo:hi], lo_row[lo:hi]
            for j in range(seen.size):
                p = exp_nonpos(seen[j] * scale - shift)
                total += p
                hi_seen[j], lo_seen[j] = bfloat16_parts(p)
            hi_row[:lo] = 0
            hi_row[hi:] = 0
            lo_row[:lo] = 0
            lo_row[hi:] = 0
        a = exp_nonpos(m_old - shift)
        alpha[r] = a
        l[r] = l[r] * a + total
        m[r] = m_new


# -- the pieces: reader, visibility, score --------------------------------------------------

def decode(x):
    """One stored K/V element as float32, by the buffer's element type (implemented by
    the overload below; plain Python cannot call it): float32 as is, uint16 as float16
    bits (``half_to_float``), int16 as bfloat16 bits (``bfloat16_to_float``), int8 codes
    as their value, uint8 as float8_e4m3fn codes (``e4m3_to_float``). The type picks
    the conversion at compile time, so the loops over d stay branch-free."""
    raise NotImplementedError


#: The element type a codec's codes reach the kernels as, by its ``Codec.kernel_tag``
#: (``decode`` specializes on it at compile time): int8 codes are their value, e4m3fn
#: codes are bit patterns (uint8). A codec whose tag is not here has no kernel decoder.
CODE_VIEWS = {"int8": np.int8, "e4m3fn": np.uint8}


@overload(decode, jit_options={"cache": True})
def _decode(x):
    if x == types.float32:
        return lambda x: x
    if x == types.uint16:
        return lambda x: half_to_float(x)
    if x == types.int16:
        return lambda x: bfloat16_to_float(x)
    if x == types.int8:
        return lambda x: np.float32(x)
    if x == types.uint8:
        return lambda x: e4m3_to_float(x)
    return None


#: Paged storage as the kernels take it: ``pool`` [num_pages, Hkv, page_size, ...] and
#: ``table`` [rows, pages_per_row] int32 (row r's pages in token order; token j of head
#: h is ``pool[table[r, j // page_size], h, j % page_size]``); ``shift``: log2(page_size)
#: when it is a power of two (j's page and place by shift and mask), else -1;
#: ``together``: True where the kernels may read a page's KV heads together (pages of at
#: most a key block, ``heads_per_pass``), None where they read one head per pass: a
#: choice made by the field's type, so large pages compile the one-head loops (a head
#: count known only at run time cost paged 256 / contiguous float32 decode 0.96-1.05 ->
#: 1.12-1.14, B=1 L=32,768). Make it with ``paged(pool, table, together)``.
Paged = namedtuple("Paged", ["pool", "table", "shift", "together"])


def paged(pool, table, together: bool) -> Paged:
    """The ``Paged`` layout of ``pool`` [num_pages, Hkv, page_size, ...] and ``table``
    (``together``: whether its pages are small enough for the kernels to read their KV
    heads together, ``Paged``'s field)."""
    P = int(pool.shape[2])
    return Paged(pool, table, np.int64(P.bit_length() - 1 if P & (P - 1) == 0 else -1),
                 True if together else None)
#: Quantized storage as the kernels take it: ``codes`` (int8, or uint8 e4m3fn patterns;
#: an array [rows, Hkv, max_len, d] or a ``Paged`` of them) and ``scales`` (float32, one
#: per token: [rows, Hkv, max_len] or a ``Paged`` of them).
Quantized = namedtuple("Quantized", ["codes", "scales"])
#: Paged quantized storage: ``codes`` [num_pages, Hkv, page_size, d] and ``scales``
#: [num_pages, Hkv, page_size] paged through one ``table`` (``shift`` as ``Paged``'s).
#: Flat, not a Quantized of Paged: numba's parallel loops take no nested tuples of arrays.
PagedQuantized = namedtuple("PagedQuantized", ["codes", "scales", "table", "shift", "together"])
#: Grouped codes (``gqakv.storage.codecs.Grouped``: a float32 scale per block of g values
#: along d): ``codes`` int8 ``[rows, Hkv, max_len, d]`` (8-bit) or uint8 ``[..., d / 2]``
#: (4-bit: value 2i in the low nibble of byte i, each nibble the code + 8) and ``scales``
#: float32 ``[rows, Hkv, max_len, d / g]``. The element type picks the decoder
#: (``dequantize_rows``); g is d / scales.shape[-1].
Grouped = namedtuple("Grouped", ["codes", "scales"])
#: Paged grouped codes: pools ``[num_pages, Hkv, page_size, ...]`` of codes and scales
#: through one ``table`` (``shift`` as ``Paged``'s).
PagedGrouped = namedtuple("PagedGrouped", ["codes", "scales", "table", "shift", "together"])


def _is(buf, cls):
    return isinstance(buf, types.BaseNamedTuple) and buf.instance_class is cls


def _is_paged(buf):
    """Whether a layout's type reads through a page table (pages hold every KV head)."""
    return _is(buf, Paged) or _is(buf, PagedQuantized) or _is(buf, PagedGrouped)


def _is_rows(buf):
    """Whether a layout's type is contiguous rows (plain arrays or quantized codes)."""
    return isinstance(buf, types.Array) or _is(buf, Quantized) or _is(buf, Grouped)


def key_run(buf, r, h, j, n):
    """``(rows, scales, m)``: keys (or values) j .. j + m - 1 of KV head h of cache row r,
    1 <= m <= n, as they lie together in storage (overloaded below by the layout's type):

    - rows: a view of the stored rows from key j on, [>= m, d], elements read through
      ``decode``; the run is its first m rows, and rows past them lie in storage right
      after it (how far ``_prefetch_row`` may look ahead): contiguous rows to the row's
      capacity, a page's rows to the page's end;
    - scales: the per-token scales of ``Quantized`` / ``PagedQuantized`` codes, [>= m]
      likewise, the per-block scales of ``Grouped`` / ``PagedGrouped`` codes, [>= m, d / g]
      (``run_dots``), else None (``factor``);
    - an array [rows, Hkv, max_len, d] gives all n keys (m = n); ``Paged`` up to the end
      of j's page: one page-table lookup per run, never per key.
    """
    raise NotImplementedError


@overload(key_run, jit_options={"cache": True})
def _key_run(buf, r, h, j, n):
    if isinstance(buf, types.Array):
        return lambda buf, r, h, j, n: (buf[r, h, j:], None, n)
    if _is(buf, Paged):
        def paged_run(buf, r, h, j, n):
            P = buf.pool.shape[2]
            page, at = _page_and_slot(buf.shift, P, j)
            rows = pool_rows(buf.pool, buf.together, buf.table[r, page], h, at)
            return rows, None, min(n, P - at)
        return paged_run
    if _is(buf, PagedQuantized) or _is(buf, PagedGrouped):
        # (the codes' and the scales' views straight from their pools: a Paged tuple made
        # of each here would count a reference on the pool and the table per run)
        def paged_quantized_run(buf, r, h, j, n):
            P = buf.codes.shape[2]
            page, at = _page_and_slot(buf.shift, P, j)
            p = buf.table[r, page]
            return (pool_rows(buf.codes, buf.together, p, h, at),
                    pool_rows(buf.scales, buf.together, p, h, at), min(n, P - at))
        return paged_quantized_run
    if _is(buf, Quantized) or _is(buf, Grouped):
        def quantized_run(buf, r, h, j, n):
            rows, _, m = key_run(buf.codes, r, h, j, n)
            scales, _, _ = key_run(buf.scales, r, h, j, m)
            return rows, scales, m
        return quantized_run
    return None


@njit(cache=True, inline="always")
def _page_and_slot(shift, P, j):
    """(j // P, j % P): the page index of token j in its row's table and its slot there
    (``shift`` >= 0: P is 2**shift, no division)."""
    if shift >= 0:
        return j >> shift, j & (P - 1)
    page = j // P
    return page, j - page * P


def page_rows(buf, page, h, at):
    """The rows of a ``Paged`` pool's ``page`` from head h's row ``at`` on, in storage
    order, as far as the kernels may prefetch: ``pool_rows(buf.pool, buf.together, ...)``."""
    raise NotImplementedError


def pool_rows(pool, together, page, h, at):
    """The rows (or scales) of ``pool``'s ``page`` from head h's row ``at`` on, in storage
    order, as far as the kernels may prefetch (overloaded below): to the end of head h's
    slice where heads are read one per pass (``together`` None); over the page's later
    heads too where they are read together (``together`` True: the next head's slice is
    read next, so a page [Hkv, P, d] is one stream [Hkv * P, d] in address order)."""
    raise NotImplementedError


@intrinsic
def _rows_from(typingctx, arr, a, b, j, count):
    """``count`` rows of a C-contiguous array [A, B, n, d] (or [A, B, n]) from row
    ``arr[a, b, j]`` on, in address order: the view ``arr[a, b, j:j + count]`` where the
    rows stay in ``arr[a, b]``, and where they run on into ``arr[a, b + 1]``, ... (a page's
    heads one after another: ``arr[a].reshape(-1, d)[b * n + j:][:count]``); the caller
    keeps them inside the array. [count, d] (or [count]), C-contiguous, on arr's buffer,
    made by address arithmetic and unowned:

    - address arithmetic: numba's reshape calls a C helper that cannot be inlined (19 ns
      a view, one per head and storage run of a page-order read: K and V, two per 16
      key-heads at 16-token pages, about 2.4 ns per key-head of a bfloat16 decode whose
      kernel does about 34; measured 2026-12-07, one thread);
    - unowned (no meminfo, so no reference count): a view that names the array's meminfo
      adds and drops a reference on it, an atomic add on a counter that both threads'
      views share. At 16-token pages that was 10-13% of a bfloat16 paged decode (paged
      16 / contiguous 1.30 -> 1.14 with two threads, 1.31 -> 1.22 with one; B=4 L=4,096,
      2026-12-07). The view is valid while ``arr`` is, which the kernel's caller holds for
      the whole call; it must never leave the kernel (returned or kept, it would not keep
      the array alive)."""
    if not (_c_rows(arr) and all(isinstance(x, types.Integer) for x in (a, b, j, count))):
        return None
    rows_of_values = arr.ndim == 4
    view_ty = types.Array(arr.dtype, 2 if rows_of_values else 1, "C")

    def codegen(context, builder, signature, args):
        arr_ty = signature.args[0]
        ary = context.make_array(arr_ty)(context, builder, args[0])
        a_, b_, j_, count_ = (context.cast(builder, v, t, types.intp)
                              for v, t in zip(args[1:], signature.args[1:]))
        zero = context.get_constant(types.intp, 0)
        shape = cgutils.unpack_tuple(builder, ary.shape, arr_ty.ndim)
        strides = cgutils.unpack_tuple(builder, ary.strides, arr_ty.ndim)
        at = [a_, b_, j_] + ([zero] if rows_of_values else [])
        data = cgutils.get_item_pointer(context, builder, arr_ty, ary, at, wraparound=False)
        view_shape = [count_, shape[3]] if rows_of_values else [count_]
        view = make_view(context, builder, arr_ty, ary, view_ty, data,
                         cgutils.pack_array(builder, view_shape),
                         cgutils.pack_array(builder, list(strides[2:])))
        view.meminfo = cgutils.get_null_value(view.meminfo.type)  # unowned (see above)
        return view._getvalue()

    return view_ty(arr, a, b, j, count), codegen


def _c_rows(arr) -> bool:
    """Whether ``_rows_from`` takes an array of this type (3-D or 4-D, C-contiguous: the
    caches' buffers, pools and scales)."""
    return isinstance(arr, types.Array) and arr.ndim in (3, 4) and arr.layout == "C"


@overload(page_rows, inline="always", jit_options={"cache": True})
def _page_rows(buf, page, h, at):
    if _is(buf, Paged):
        return lambda buf, page, h, at: pool_rows(buf.pool, buf.together, page, h, at)
    return None


@overload(pool_rows, inline="always", jit_options={"cache": True})
def _pool_rows(pool, together, page, h, at):
    one_head = isinstance(together, types.NoneType)
    if _c_rows(pool):  # (a pool or scales the cache allocated: C-contiguous)
        if one_head:
            return lambda pool, together, page, h, at: _rows_from(pool, page, h, at,
                                                                  pool.shape[2] - at)
        # the page's rows from head h's row `at` on, its later heads' too
        def stream(pool, together, page, h, at):
            start = h * pool.shape[2] + at
            return _rows_from(pool, page, 0, start, pool.shape[1] * pool.shape[2] - start)
        return stream
    if isinstance(pool, types.Array):  # other layouts: head h's slice (prefetch stops there)
        return lambda pool, together, page, h, at: pool[page, h, at:]
    return None


def factor(scales, jj):
    """The factor of a run's key jj's decoded row (overloaded below): its per-token scale,
    or 1 where ``scales`` is None (a constant: the multiply folds away). The kernels fold
    it into the dot product (K) and into p (V), never into the row."""
    raise NotImplementedError


@overload(factor, jit_options={"cache": True})
def _factor(scales, jj):
    if isinstance(scales, types.NoneType) or _is_grouped_scales(scales):  # grouped: per vector
        return lambda scales, jj: np.float32(1.0)
    if isinstance(scales, types.Array):
        return lambda scales, jj: scales[jj]
    return None


def kv_heads(buf):
    """Hkv of a layout (overloaded below)."""
    raise NotImplementedError


@overload(kv_heads, jit_options={"cache": True})
def _kv_heads(buf):
    if isinstance(buf, types.Array):
        return lambda buf: buf.shape[1]
    if _is(buf, Paged):
        return lambda buf: buf.pool.shape[1]
    if _is(buf, Quantized) or _is(buf, PagedQuantized) or _is(buf, Grouped) or _is(buf, PagedGrouped):
        return lambda buf: buf.codes.shape[1]
    return None


def prefetch_ahead(buf):
    """How many rows ahead of the one being read the kernels prefetch in a layout
    (overloaded below): ``prefetch_bytes`` of rows for contiguous rows (quantized: of
    codes) and for paged layouts within a page (``page_rows``: one head's slice of a large
    page, the whole page in address order where its heads are read together), except
    float32 pages read heads together where the CPU's plan says so
    (``float32_prefetch``): 0, a constant the compiler folds, so no prefetch code is left
    in their kernels. Measured with 2 KB into every level on the Xeon 2026-12-05 (alternating processes, B=4
    L=4,096 and B=1 L=32,768, load 1.0-1.5): 256-token pages float32 / bfloat16 paged /
    contiguous 1.24 / 1.41-1.45 -> 1.10-1.12 / 1.12-1.18; 16-token pages bfloat16
    1.18-1.30 -> 1.14-1.19, float32 1.28-1.40 -> 1.37-1.43 (left without)."""
    raise NotImplementedError


def prefetch_bytes(rows):
    """How many bytes ahead rows of this array's element type are prefetched (overloaded
    below, a constant of the type): ``FLOAT32_PREFETCH_BYTES`` for float32, else
    ``PREFETCH_BYTES``."""
    raise NotImplementedError


@overload(prefetch_bytes, inline="always", jit_options={"cache": True})
def _prefetch_bytes(rows):
    if isinstance(rows, types.Array):
        ahead = FLOAT32_PREFETCH_BYTES if rows.dtype == types.float32 else PREFETCH_BYTES
        return lambda rows: ahead
    return None


@njit(cache=True, inline="always")
def _rows_in(rows, nbytes):
    """How many rows of an array [..., d] ``nbytes`` bytes span (at least 1)."""
    return max(1, nbytes // (rows.shape[-1] * rows.itemsize))


@njit(cache=True, inline="always")
def _row_prefetch(rows):
    """The prefetch distance in rows of an array [..., d] (at least 1):
    ``prefetch_bytes`` of them."""
    return _rows_in(rows, prefetch_bytes(rows))


@overload(prefetch_ahead, inline="always", jit_options={"cache": True})
def _prefetch_ahead(buf):
    if isinstance(buf, types.Array):
        return lambda buf: _row_prefetch(buf)
    if _is(buf, Quantized) or _is(buf, Grouped):
        return lambda buf: _row_prefetch(buf.codes)
    if (_is(buf, Paged) and not _one_head(buf) and buf.types[0].dtype.bitwidth > 16
            and not FLOAT32_SMALL_PAGE_PREFETCH):
        return lambda buf: 0  # float32 small pages, 2 KB into L1: 1.03-1.06x slower with it
    if _is(buf, Paged):
        return lambda buf: _row_prefetch(buf.pool)
    if _is(buf, PagedQuantized) or _is(buf, PagedGrouped):
        return lambda buf: _row_prefetch(buf.codes)
    return None


def far_ahead(buf):
    """How many rows ahead of the one being read the kernels also prefetch into L2 in a
    layout (overloaded below; 0: none, a constant the compiler folds): contiguous rows
    of 16-bit elements where the CPU's plan has a far prefetch (``far_prefetch_16``:
    ``PREFETCH_BYTES`` plus that many bytes of rows), else 0 (paged and quantized
    layouts, float32 rows)."""
    raise NotImplementedError


@overload(far_ahead, inline="always", jit_options={"cache": True})
def _far_ahead(buf):
    if isinstance(buf, types.Array):
        if FAR_PREFETCH_16_BYTES and buf.dtype in (types.int16, types.uint16):
            ahead = PREFETCH_BYTES + FAR_PREFETCH_16_BYTES
            return lambda buf: _rows_in(buf, ahead)
        return lambda buf: 0
    if (_is(buf, Paged) or _is(buf, Quantized) or _is(buf, Grouped) or _is(buf, PagedQuantized)
            or _is(buf, PagedGrouped)):
        return lambda buf: 0
    return None


#: Most tile rows (KV heads x G x queries) one pass of the kernel holds when it reads the
#: KV heads of a page together (``heads_per_pass``): the rows of a decode over every KV
#: head of Llama-3.1-8B (8 x 4), and of one head's tile of an 8-query chunk. Though its
#: accumulators and queries (32 KiB at d = 128) fill a 32 KiB L1, half of it lost on the
#: AMD EPYC (2026-12-06, B=4 L=4,096, pages of 16 / contiguous, 2 rounds, load 1.0-1.2):
#: bfloat16 1.15 -> 1.42-1.68, float32 1.10-1.13 -> 1.12-1.20 (a page read in two passes).
PAGED_TILE_ROWS = 32


def heads_per_pass(buf, rows, key_block):
    """How many KV heads the kernel reads together, a storage run at a time, given one
    head's tile of ``rows`` rows and ``key_block`` keys per block (overloaded below): for
    paged layouts whose heads are read together (``Paged``'s ``together``: pages of at most
    ``numba_backend.together_page_limit`` tokens) and of at most ``key_block``, whose runs are then a head's
    whole slice of a page ([Hkv, page_size, d], heads-major), as many heads as
    ``PAGED_TILE_ROWS`` rows hold (at least 1), so a page's heads are read one after
    another, in address order, instead of one head's slice of every page before the next
    head's; else 1 (contiguous rows: each head's keys lie together already; larger pages:
    a run is part of a head's slice, and heads read together would interleave Hkv streams
    a slice apart, measured 1.2x slower at 256-token pages)."""
    raise NotImplementedError


def heads_read(buf, nh):
    """``nh`` for paged layouts that read heads together (``Paged``'s ``together``); the
    constant 1 for the others (overloaded below), so their kernels compile the one-head
    loops they had before heads were read together."""
    raise NotImplementedError


def _one_head(buf):
    """Whether a layout's type reads one KV head per pass: contiguous rows, and pages
    whose ``together`` is None."""
    return _is_rows(buf) or (_is_paged(buf) and isinstance(buf.types[-1], types.NoneType))


@overload(heads_read, inline="always", jit_options={"cache": True})
def _heads_read(buf, nh):
    if _one_head(buf):
        return lambda buf, nh: 1
    if _is_paged(buf):
        return lambda buf, nh: nh
    return None


@njit(cache=True)
def _paged_heads_per_pass(page_size, rows, key_block):
    """``heads_per_pass`` of a paged layout of pages of ``page_size`` tokens."""
    if page_size > key_block:
        return 1
    return max(1, PAGED_TILE_ROWS // rows)


@overload(heads_per_pass, jit_options={"cache": True})
def _heads_per_pass(buf, rows, key_block):
    if _one_head(buf):
        return lambda buf, rows, key_block: 1
    if _is(buf, Paged):
        return lambda buf, rows, key_block: \
            _paged_heads_per_pass(buf.pool.shape[2], rows, key_block)
    if _is(buf, PagedQuantized) or _is(buf, PagedGrouped):
        return lambda buf, rows, key_block: \
            _paged_heads_per_pass(buf.codes.shape[2], rows, key_block)
    return None


#: ``window`` of a call without a sliding window: no query's first key moves.
NO_WINDOW = 1 << 62


@njit(cache=True)
def visible_keys(q_pos, window):
    """Keys [lo, hi) seen by the query at absolute position q_pos: bottom-right causal,
    within the last ``window`` positions (``NO_WINDOW``: all); as ``semantics.key_range``."""
    return max(0, q_pos - window + 1), q_pos + 1


def bias(alibi, x, head, q_pos, j):
    """The score hook's position-dependent part (overloaded below; ``semantics.transform``
    after the soft-cap): ``x + alibi[head] * (j - q_pos)`` for ALiBi slopes ``alibi``
    (float32 [Hq]), ``x`` itself where ``alibi`` is None. The type picks it at compile
    time, so a call without ALiBi compiles no trace of it (``x + 0`` would not fold:
    IEEE's -0 + 0 is +0)."""
    raise NotImplementedError


@overload(bias, jit_options={"cache": True})
def _bias(alibi, x, head, q_pos, j):
    if isinstance(alibi, types.NoneType):
        return lambda alibi, x, head, q_pos, j: x
    if isinstance(alibi, types.Array):
        return lambda alibi, x, head, q_pos, j: x + alibi[head] * np.float32(j - q_pos)
    return None


@njit(cache=True)
def score(dot, scale, softcap):
    """The score of one (query, key) pair from its dot product: scaled, then soft-capped
    (``c * tanh(s / c)``) when softcap > 0, before the mask (``semantics.transform_scores``)."""
    x = dot * scale
    if softcap > 0:
        x = softcap * tanh_f32(x / softcap)
    return x


@njit(cache=True)
def join_sink(m, l, sink):
    """The sink logit joined to a finished row (max m > -inf or NaN, sum l; every key of
    the query summed): ``(a, l', m')`` with the row's output scaled by ``a`` and the sum
    and max now ``l'`` = l a + e^{sink - m'} and ``m' = max(m, sink)`` (exponentials
    relative to the larger, so a sink of 1e38 neither overflows nor loses the keys'
    share). A sink of -inf gives (1, l, m); a NaN row stays NaN."""
    if sink > m:
        a = exp_nonpos(m - sink)
        return a, l * a + np.float32(1.0), sink
    return np.float32(1.0), l + exp_nonpos(sink - m), m


#: A draft tree as the kernels take it (``gqakv.core.tree.DraftTree``): ``ancestors``
#: uint8 [B, T, T] (1 where chunk key u is query t or one of its ancestors) and ``depth``
#: int64 [B, T] (a root's is 0). A call without a tree passes None: the tree's clause then
#: compiles to nothing (``tree_query_position``, ``tree_masks_block``).
Tree = namedtuple("Tree", ["ancestors", "depth"])


def tree_query_position(tree, i, t, start):
    """The position windows and ALiBi measure for entry i's chunk query t, the chunk
    starting at ``start`` (overloaded below): ``start + t``, or with a ``Tree`` the logical
    ``start + depth[i, t]`` (``semantics.query_positions``)."""
    raise NotImplementedError


@overload(tree_query_position, jit_options={"cache": True})
def _tree_query_position(tree, i, t, start):
    if isinstance(tree, types.NoneType):
        return lambda tree, i, t, start: start + t
    if _is(tree, Tree):
        return lambda tree, i, t, start: start + tree.depth[i, t]
    return None


def tree_masks_block(tree, js, n, start):
    """Whether keys js .. js + n - 1 hold chunk keys (>= ``start``) that a ``Tree`` may
    hide from a query (overloaded below): always False without a tree (a constant, so the
    tree's scoring is not compiled in)."""
    raise NotImplementedError


@overload(tree_masks_block, jit_options={"cache": True})
def _tree_masks_block(tree, js, n, start):
    if isinstance(tree, types.NoneType):
        return lambda tree, js, n, start: False
    if _is(tree, Tree):
        return lambda tree, js, n, start: js + n > start
    return None


def tree_score_row(tree, i, t, start, s_row, n, js, lo, hi, scale, softcap, alibi, head, q_pos):
    """``_score_row`` with the tree's clause (overloaded below; only called when
    ``tree_masks_block``): chunk key u = j - start is seen only when ``ancestors[i, t, u]``
    and, like the prefix keys, only from ``lo`` on in logical positions (``start +
    depth[i, u]``), where ALiBi measures it too (``semantics.tree_visible``)."""
    raise NotImplementedError


@overload(tree_score_row, jit_options={"cache": True})
def _tree_score_row(tree, i, t, start, s_row, n, js, lo, hi, scale, softcap, alibi, head, q_pos):
    if isinstance(tree, types.NoneType):  # never called (tree_masks_block is False)
        return lambda tree, i, t, start, s_row, n, js, lo, hi, scale, softcap, alibi, head, q_pos: \
            (np.float32(0.0), False)
    if _is(tree, Tree):
        return lambda tree, i, t, start, s_row, n, js, lo, hi, scale, softcap, alibi, head, q_pos: \
            _score_row_tree(s_row, n, js, lo, hi, scale, softcap, alibi, head, q_pos,
                            tree.ancestors[i, t], tree.depth[i], start)
    return None


# -- attention -----------------------------------------------------------------------------

@njit(fastmath=FASTMATH, cache=True, inline="always")
def dequantize_rows(rows, scales, n, out, ahead):
    """out[jj, :] = the float32 values of grouped code rows jj < n (``Grouped``): each
    code times its block's scale, exactly ``Grouped.dequantize_into``'s float32 products
    (``dequantize_block``, by the code type). ``ahead``: rows of codes to prefetch ahead
    (``prefetch_ahead``; 0: none)."""
    _prefer_512_bit_vectors()
    nb = scales.shape[1]
    for jj in range(n):
        if ahead > 0 and jj + ahead < rows.shape[0]:
            _prefetch_row(rows, jj + ahead)
        src, dst = rows[jj], out[jj]
        for b in range(nb):
            dequantize_block(src, dst, np.uint64(b), np.uint64(src.shape[0] // nb), scales[jj, b])


def dequantize_block(src, dst, b, width, scale):
    """dst's values of block b = its codes (``width`` code elements from ``b * width`` on in
    ``src``) times ``scale`` (overloaded by the code type): int8 codes are their value;
    uint8 bytes hold two 4-bit codes (value 2i in the low nibble of byte i, each nibble
    the code + 8). Blocks of a multiple of 16 code bytes (every built-in group) go 16 bytes
    at a time through ``_dequantize_16``: LLVM's own vectorization of the element loop
    runs 8 lanes wide with its checks around every block of 32 or 64 codes (int4_g32
    decode, B=4 L=4,096 bfloat16: 1.9x -> 1.5x the bfloat16 time). Other widths take the
    element loop; its offsets are unsigned, so it vectorizes without negative-index fix-ups."""
    raise NotImplementedError


@overload(dequantize_block, inline="always", jit_options={"cache": True})
def _dequantize_block(src, dst, b, width, scale):
    if not isinstance(src, types.Array):
        return None
    if src.dtype == types.int8:
        def eight_bit(src, dst, b, width, scale):
            at = b * width
            if width % np.uint64(16) == np.uint64(0):  # every built-in group: 32 or 64 codes
                for c in range(at, at + width, np.uint64(16)):
                    _dequantize_16(src, c, dst, scale)
                return
            for c in range(width):
                dst[at + c] = np.float32(src[at + c]) * scale
        return eight_bit
    if src.dtype == types.uint8:
        def four_bit(src, dst, b, width, scale):
            at = b * width
            if width % np.uint64(16) == np.uint64(0):  # groups of 32 or 64 values
                for i in range(at, at + width, np.uint64(16)):
                    _dequantize_16(src, i, dst, scale)
                return
            one = np.uint64(1)
            for i in range(width):
                x = np.int32(src[at + i])
                dst[(at + i) << one] = np.float32((x & 15) - 8) * scale
                dst[((at + i) << one) + one] = np.float32((x >> 4) - 8) * scale
        return four_bit
    return None


#: Most tile rows for which grouped codes are decoded in registers by every pass of up to
#: four rows over a run (``run_dots``, ``run_accumulate``), by code type; taller tiles
#: decode each run once into a float32 block that the passes then read. Measured
#: 2026-12-06 (one thread, a block's dots then its P V, d = 128, blocks of 32, 32,768
#: keys, ns per key in registers / from the block): 4-bit 4 rows 35-38 / 41-57, 8 rows
#: 74 / 66.5; 8-bit 4 rows 30-32 / 38-44, 8 rows 66 / 80, 12 and 16 rows alike.
GROUPED_REGISTER_ROWS = {types.int8: 8, types.uint8: 4}


def run_dots(qt, r0, r1, rows, scales, n, s, o, ahead, far, scratch):
    """``_block_dots`` over a storage run (``key_run``: ``rows``, ``scales``) as its layout
    is best read (overloaded by the run's scales, ``_run_overload``): in place for every
    layout (``decode`` and ``factor``, grouped codes decoded in registers,
    ``_dots_rows``), except grouped codes under tiles of more than
    ``GROUPED_REGISTER_ROWS`` rows: decoded once into ``scratch`` [>= n, d] float32
    (``dequantize_rows``: an L1-sized block, one conversion per element for every row of
    the tile), which the passes read."""
    raise NotImplementedError


def run_accumulate(acc, r0, r1, rows, scales, n, s, o, ahead, far, scratch):
    """``_accumulate`` over a storage run of values (as ``run_dots``' arguments), read as
    ``run_dots`` reads keys."""
    raise NotImplementedError


def _run_overload(step):
    """The overload of ``run_dots`` / ``run_accumulate`` around ``step(x, r0, r1, rows,
    scales, n, s, o, ahead, far)`` (x: qt or acc)."""
    def typed(x, r0, r1, rows, scales, n, s, o, ahead, far, scratch):
        if not _is_grouped_scales(scales):
            return lambda x, r0, r1, rows, scales, n, s, o, ahead, far, scratch: \
                step(x, r0, r1, rows, scales, n, s, o, ahead, far)
        most = GROUPED_REGISTER_ROWS[rows.dtype]

        def grouped(x, r0, r1, rows, scales, n, s, o, ahead, far, scratch):
            if r1 - r0 <= most:
                step(x, r0, r1, rows, scales, n, s, o, ahead, far)
            else:
                dequantize_rows(rows, scales, n, scratch, ahead)
                step(x, r0, r1, scratch, None, n, s, o, 0, 0)
        return grouped
    return typed


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _block_dots(qt, r0, r1, krows, kscales, n, s, o, ahead, far):
    """s[rr, o + jj] = qt[rr] . key jj of a run (``key_run``: rows krows [n, d], scales
    kscales), for r0 <= rr < r1 and jj < n: raw dot products, times a quantized key's scale.

    ``ahead`` (``prefetch_ahead``): prefetch distance in rows, 0 for none; ``far``
    (``far_ahead``): the same into L2 only, farther ahead, 0 for none.

    Two keys against four query rows per pass over d: eight accumulators in registers,
    each key element loaded and converted once per four rows; a tile's last three or two
    rows (G not a multiple of 4) share a pass too, a last single row has its own. Four rows
    at a time go through ``_dots_4x2`` where d is a multiple of 16, which addresses the
    rows without making views of them (each view counts a reference on the buffer: two
    atomic operations on a counter the threads share, per key); so do the last three,
    two or one rows (``_dots_rows``). Where d is not a multiple of 16 (no model's head dim)
    the passes take views indexed by the loop counter alone (no negative-index fix-up), so
    their loop over d compiles to plain vector loads and FMAs: four rows a pass, the last
    rows one at a time; queries as bfloat16 bits are widened there (``decode``).
    """
    _prefer_512_bit_vectors()
    d = qt.shape[1]
    in_vectors = d % 16 == 0  # dots by _dots_rows (one reduction tree per pass)
    jj = 0
    while jj < n:
        two = jj + 1 < n
        j1 = jj + 1 if two else jj
        f0 = factor(kscales, jj)
        f1 = factor(kscales, jj + 1) if two else f0
        if ahead > 0 and jj + ahead + 1 < krows.shape[0]:  # rows stored right after
            _prefetch_row(krows, jj + ahead)
            _prefetch_row(krows, jj + ahead + 1)
        if far > 0 and jj + far + 1 < krows.shape[0]:
            _prefetch_row_l2(krows, jj + far)
            _prefetch_row_l2(krows, jj + far + 1)
        rr = r0
        while rr + 4 <= r1:
            if in_vectors:
                a0, a1, a2, a3, b0, b1, b2, b3 = _dots_4x2(qt, rr, krows, kscales, jj, j1)
            else:
                k0, k1 = krows[jj], krows[j1]
                q0, q1, q2, q3 = qt[rr], qt[rr + 1], qt[rr + 2], qt[rr + 3]
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                a2 = np.float32(0.0)
                a3 = np.float32(0.0)
                b0 = np.float32(0.0)
                b1 = np.float32(0.0)
                b2 = np.float32(0.0)
                b3 = np.float32(0.0)
                for c in range(d):
                    x = decode(k0[c])
                    y = decode(k1[c])
                    a0 += decode(q0[c]) * x
                    a1 += decode(q1[c]) * x
                    a2 += decode(q2[c]) * x
                    a3 += decode(q3[c]) * x
                    b0 += decode(q0[c]) * y
                    b1 += decode(q1[c]) * y
                    b2 += decode(q2[c]) * y
                    b3 += decode(q3[c]) * y
            s[rr, o + jj] = a0 * f0
            s[rr + 1, o + jj] = a1 * f0
            s[rr + 2, o + jj] = a2 * f0
            s[rr + 3, o + jj] = a3 * f0
            if two:
                s[rr, o + jj + 1] = b0 * f1
                s[rr + 1, o + jj + 1] = b1 * f1
                s[rr + 2, o + jj + 1] = b2 * f1
                s[rr + 3, o + jj + 1] = b3 * f1
            rr += 4
        if r1 - rr == 3 and in_vectors:  # G = 3, 7, ...: the last three rows in one pass too
            a0, a1, a2, b0, b1, b2 = _dots_3x2(qt, rr, krows, kscales, jj, j1)
            s[rr, o + jj] = a0 * f0
            s[rr + 1, o + jj] = a1 * f0
            s[rr + 2, o + jj] = a2 * f0
            if two:
                s[rr, o + jj + 1] = b0 * f1
                s[rr + 1, o + jj + 1] = b1 * f1
                s[rr + 2, o + jj + 1] = b2 * f1
            rr += 3
        elif r1 - rr == 2 and in_vectors:  # G = 2, 6, ...
            a0, a1, b0, b1 = _dots_2x2(qt, rr, krows, kscales, jj, j1)
            s[rr, o + jj] = a0 * f0
            s[rr + 1, o + jj] = a1 * f0
            if two:
                s[rr, o + jj + 1] = b0 * f1
                s[rr + 1, o + jj + 1] = b1 * f1
            rr += 2
        elif r1 - rr == 1 and in_vectors:  # G = 1, 5, ...
            a0, b0 = _dots_1x2(qt, rr, krows, kscales, jj, j1)
            s[rr, o + jj] = a0 * f0
            if two:
                s[rr, o + jj + 1] = b0 * f1
            rr += 1
        while rr < r1:  # d off multiples of 16: the last rows one at a time
            k0, k1 = krows[jj], krows[j1]
            q0 = qt[rr]
            a0 = np.float32(0.0)
            b0 = np.float32(0.0)
            for c in range(d):
                a0 += decode(q0[c]) * decode(k0[c])
                b0 += decode(q0[c]) * decode(k1[c])
            s[rr, o + jj] = a0 * f0
            if two:
                s[rr, o + jj + 1] = b0 * f1
            rr += 1
        jj += 2


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _accumulate(acc, r0, r1, s, o, vrows, vscales, n, ahead, far):
    """acc[rr] += sum_jj s[rr, o + jj] * value jj of a run (``key_run``: rows vrows
    [n, d], scales vscales), for r0 <= rr < r1 and jj < n (a quantized value's scale multiplies
    its p here; s itself is not changed). ``ahead``, ``far``: as ``_block_dots``' (``far``
    taken only where d is a multiple of 16, by ``_pv_rows``).

    Where d is a multiple of 16 (every head dim the models use), up to four rows at a
    time through ``_pv_rows``: their accumulators in registers for the whole run, each
    value vector loaded and converted once for the rows. Otherwise four values into four
    rows per pass over d: each value element is loaded and converted once for four rows,
    each accumulator element loaded and stored once per four values (16 FMAs per 8 loads
    and 4 stores); the loop over d vectorizes.
    """
    _prefer_512_bit_vectors()
    if acc.shape[1] % 16 == 0:  # accumulators in registers for the run (_pv_rows)
        rr = r0
        while rr + 4 <= r1:
            first = rr == r0  # the pass that prefetches
            _pv_4(acc, rr, s, o, vrows, vscales, n, ahead if first else 0, far if first else 0)
            rr += 4
        left_ahead, left_far = (ahead, far) if rr == r0 else (0, 0)
        if r1 - rr == 3:
            _pv_3(acc, rr, s, o, vrows, vscales, n, left_ahead, left_far)
        elif r1 - rr == 2:
            _pv_2(acc, rr, s, o, vrows, vscales, n, left_ahead, left_far)
        elif r1 - rr == 1:
            _pv_1(acc, rr, s, o, vrows, vscales, n, left_ahead, left_far)
        return
    rr = r0
    while rr + 4 <= r1:
        _accumulate4(acc, rr, s, o, vrows, vscales, n, ahead)
        rr += 4
    # rows left over when G * queries is not a multiple of 4, in one pass; it prefetches
    # only when it is the first pass over the values (fewer than 4 rows in all)
    left_ahead = ahead if r1 - r0 < 4 else 0
    if r1 - rr == 3:
        _accumulate3(acc[rr], acc[rr + 1], acc[rr + 2], s[rr, o:], s[rr + 1, o:], s[rr + 2, o:],
                     vrows, vscales, n, left_ahead)
    elif r1 - rr == 2:
        _accumulate2(acc[rr], acc[rr + 1], s[rr, o:], s[rr + 1, o:], vrows, vscales, n, left_ahead)
    elif r1 - rr == 1:
        a0, p = acc[rr], s[rr, o:]
        d = a0.size
        for jj in range(n):
            v0 = vrows[jj]
            if left_ahead > 0 and jj + left_ahead < vrows.shape[0]:
                _prefetch_row(vrows, jj + left_ahead)
            p0 = p[jj] * factor(vscales, jj)
            for c in range(d):
                a0[c] += p0 * decode(v0[c])


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _accumulate_run(acc, r0, r1, rows, scales, n, s, o, ahead, far):
    """``_accumulate`` with ``run_dots``' order of arguments (``_run_overload``)."""
    _accumulate(acc, r0, r1, s, o, rows, scales, n, ahead, far)


overload(run_dots, inline="always", jit_options={"cache": True})(_run_overload(_block_dots))
overload(run_accumulate, inline="always", jit_options={"cache": True})(
    _run_overload(_accumulate_run))


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _accumulate4(acc, rr, s, o, vrows, vscales, n, ahead):
    """Four rows of ``_accumulate``: acc[rr + i, :] += sum_jj s[rr + i, o + jj] * value jj
    of the run (i < 4). Rows of acc, s and vrows are addressed, not viewed (``_block_dots``
    says why)."""
    _prefer_512_bit_vectors()
    d = acc.shape[1]
    r1, r2, r3 = rr + 1, rr + 2, rr + 3
    jj = 0
    while jj + 4 <= n:
        if ahead > 0 and jj + ahead + 3 < vrows.shape[0]:  # rows stored right after
            for k in range(4):
                _prefetch_row(vrows, jj + ahead + k)
        j1, j2, j3 = jj + 1, jj + 2, jj + 3
        f0 = factor(vscales, jj)
        f1 = factor(vscales, j1)
        f2 = factor(vscales, j2)
        f3 = factor(vscales, j3)
        p00, p01, p02, p03 = s[rr, o + jj] * f0, s[rr, o + j1] * f1, s[rr, o + j2] * f2, s[rr, o + j3] * f3
        p10, p11, p12, p13 = s[r1, o + jj] * f0, s[r1, o + j1] * f1, s[r1, o + j2] * f2, s[r1, o + j3] * f3
        p20, p21, p22, p23 = s[r2, o + jj] * f0, s[r2, o + j1] * f1, s[r2, o + j2] * f2, s[r2, o + j3] * f3
        p30, p31, p32, p33 = s[r3, o + jj] * f0, s[r3, o + j1] * f1, s[r3, o + j2] * f2, s[r3, o + j3] * f3
        for c in range(d):
            x0 = decode(vrows[jj, c])
            x1 = decode(vrows[j1, c])
            x2 = decode(vrows[j2, c])
            x3 = decode(vrows[j3, c])
            acc[rr, c] += p00 * x0 + p01 * x1 + p02 * x2 + p03 * x3
            acc[r1, c] += p10 * x0 + p11 * x1 + p12 * x2 + p13 * x3
            acc[r2, c] += p20 * x0 + p21 * x1 + p22 * x2 + p23 * x3
            acc[r3, c] += p30 * x0 + p31 * x1 + p32 * x2 + p33 * x3
        jj += 4
    while jj < n:
        f0 = factor(vscales, jj)
        p00, p10, p20, p30 = s[rr, o + jj] * f0, s[r1, o + jj] * f0, s[r2, o + jj] * f0, s[r3, o + jj] * f0
        for c in range(d):
            x0 = decode(vrows[jj, c])
            acc[rr, c] += p00 * x0
            acc[r1, c] += p10 * x0
            acc[r2, c] += p20 * x0
            acc[r3, c] += p30 * x0
        jj += 1


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _accumulate3(a0, a1, a2, s0, s1, s2, vrows, vscales, n, ahead):
    """Three rows of ``_accumulate`` (``_accumulate4``'s loop with a row fewer)."""
    _prefer_512_bit_vectors()
    d = a0.size
    jj = 0
    while jj + 4 <= n:
        if ahead > 0 and jj + ahead + 3 < vrows.shape[0]:
            for k in range(4):
                _prefetch_row(vrows, jj + ahead + k)
        j1, j2, j3 = jj + 1, jj + 2, jj + 3
        f0 = factor(vscales, jj)
        f1 = factor(vscales, jj + 1)
        f2 = factor(vscales, jj + 2)
        f3 = factor(vscales, jj + 3)
        p00, p01, p02, p03 = s0[jj] * f0, s0[jj + 1] * f1, s0[jj + 2] * f2, s0[jj + 3] * f3
        p10, p11, p12, p13 = s1[jj] * f0, s1[jj + 1] * f1, s1[jj + 2] * f2, s1[jj + 3] * f3
        p20, p21, p22, p23 = s2[jj] * f0, s2[jj + 1] * f1, s2[jj + 2] * f2, s2[jj + 3] * f3
        for c in range(d):  # rows addressed, not viewed (``_block_dots`` says why)
            x0 = decode(vrows[jj, c])
            x1 = decode(vrows[j1, c])
            x2 = decode(vrows[j2, c])
            x3 = decode(vrows[j3, c])
            a0[c] += p00 * x0 + p01 * x1 + p02 * x2 + p03 * x3
            a1[c] += p10 * x0 + p11 * x1 + p12 * x2 + p13 * x3
            a2[c] += p20 * x0 + p21 * x1 + p22 * x2 + p23 * x3
        jj += 4
    while jj < n:
        v0 = vrows[jj]
        f0 = factor(vscales, jj)
        p00, p10, p20 = s0[jj] * f0, s1[jj] * f0, s2[jj] * f0
        for c in range(d):
            x0 = decode(v0[c])
            a0[c] += p00 * x0
            a1[c] += p10 * x0
            a2[c] += p20 * x0
        jj += 1


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _accumulate2(a0, a1, s0, s1, vrows, vscales, n, ahead):
    """Two rows of ``_accumulate`` (``_accumulate4``'s loop with two rows fewer)."""
    _prefer_512_bit_vectors()
    d = a0.size
    jj = 0
    while jj + 4 <= n:
        if ahead > 0 and jj + ahead + 3 < vrows.shape[0]:
            for k in range(4):
                _prefetch_row(vrows, jj + ahead + k)
        j1, j2, j3 = jj + 1, jj + 2, jj + 3
        f0 = factor(vscales, jj)
        f1 = factor(vscales, jj + 1)
        f2 = factor(vscales, jj + 2)
        f3 = factor(vscales, jj + 3)
        p00, p01, p02, p03 = s0[jj] * f0, s0[jj + 1] * f1, s0[jj + 2] * f2, s0[jj + 3] * f3
        p10, p11, p12, p13 = s1[jj] * f0, s1[jj + 1] * f1, s1[jj + 2] * f2, s1[jj + 3] * f3
        for c in range(d):  # rows addressed, not viewed (``_block_dots`` says why)
            x0 = decode(vrows[jj, c])
            x1 = decode(vrows[j1, c])
            x2 = decode(vrows[j2, c])
            x3 = decode(vrows[j3, c])
            a0[c] += p00 * x0 + p01 * x1 + p02 * x2 + p03 * x3
            a1[c] += p10 * x0 + p11 * x1 + p12 * x2 + p13 * x3
        jj += 4
    while jj < n:
        v0 = vrows[jj]
        f0 = factor(vscales, jj)
        p00, p10 = s0[jj] * f0, s1[jj] * f0
        for c in range(d):
            x0 = decode(v0[c])
            a0[c] += p00 * x0
            a1[c] += p10 * x0
        jj += 1


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _score_row(s_row, n, js, lo, hi, scale, softcap, alibi, head, q_pos):
    """In place, s_row[jj] (the dot with key js + jj, jj < n) becomes its score (scaled,
    soft-capped, then ``bias``: ALiBi's for query head ``head`` at ``q_pos`` when
    ``alibi`` is its slopes), or -inf outside the query's keys [lo, hi); returns (the
    block max, whether a score is NaN). The max and the NaN test are integer reductions,
    so the loop vectorizes."""
    km = _NEG_INF_KEY
    nan = False
    for jj in range(n):
        j = js + jj
        x = bias(alibi, score(s_row[jj], scale, softcap), head, q_pos, j)
        if (j < lo) | (j >= hi):
            x = _NEG_INF
        s_row[jj] = x
        b = _float32_bits(x)
        nan |= (b & 0x7FFFFFFF) > 0x7F800000
        km = max(km, _order_key(b))
    return _bits_to_float32(_order_key(km)), nan


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _score_row_tree(s_row, n, js, lo, hi, scale, softcap, alibi, head, q_pos, seen, depth, start):
    """``_score_row`` for a block reaching into a draft tree's chunk (from key ``start``):
    key j < start stands at j, chunk key u = j - start at ``start + depth[u]`` and is seen
    only where ``seen[u]`` (the query's ancestors and itself); ``lo`` bounds the logical
    positions (a window, by the query's logical position ``q_pos``), ``hi`` the keys."""
    km = _NEG_INF_KEY
    nan = False
    last = depth.shape[0] - 1
    for jj in range(n):
        j = js + jj
        u = min(max(j - start, 0), last)
        chunk = j >= start
        k_pos = start + depth[u] if chunk else j
        x = bias(alibi, score(s_row[jj], scale, softcap), head, q_pos, k_pos)
        if (k_pos < lo) | (j >= hi) | (chunk & (seen[u] == 0)):
            x = _NEG_INF
        s_row[jj] = x
        b = _float32_bits(x)
        nan |= (b & 0x7FFFFFFF) > 0x7F800000
        km = max(km, _order_key(b))
    return _bits_to_float32(_order_key(km)), nan


@njit(fastmath=FASTMATH, cache=True)
def _attend(qt, k_buf, v_buf, r, h0, nh, start, t0, nq, G, j0, j1, scale, softcap, window,
            alibi, key_block, s, acc, m, l, tree, i, scratch):
    """Online softmax of the tiles of KV heads h0 .. h0 + nh - 1 of row r (queries
    t0..t0+nq) over keys j0:j1, one tile of nq * G rows per head.

    qt: [nh * nq * G, d] float32 (or bfloat16 bits as int16: ``_dots_rows``), row
    (hh * nq + t) * G + g is query t0 + t of query head
    (h0 + hh) * G + g; acc: [>= nh * nq * G, d], m, l: [>= nh * nq * G] are reset here and
    hold the unnormalized output, running max and sum on return; s: [>= nh * nq * G,
    key_block] scratch. Per storage run (a page, when paged) the heads are read one after
    another, so a page holding all KV heads heads-major ([Hkv, page_size, d]) is read in
    address order (``heads_per_pass``); each head's tile does exactly the arithmetic it
    would alone.
    A row with a NaN score (a NaN query, or a NaN in a live key it sees) ends with m
    and l NaN (its output is NaN, as in the reference); other rows are unaffected.

    alibi: None, or ALiBi's float32 slopes [Hq] (row rr is query head h * G + rr % G).
    tree: None, or the call's ``Tree`` (i: the tile's batch entry): blocks reaching into
    the chunk are scored by its clause (``tree_score_row``), queries placed by depth.
    Per block of keys: all dots of the tile (``_block_dots``), then per row the score
    (``_score_row``: scale, soft-cap, ALiBi, visibility mask), the block max (one rescale per
    block) and the exponentials, then the P V update of the whole tile (``_accumulate``).
    """
    d = qt.shape[1]
    nh = heads_read(k_buf, nh)  # a constant 1 where heads are never read together
    R = nq * G  # rows of one head's tile
    RT = nh * R
    kahead, vahead = prefetch_ahead(k_buf), prefetch_ahead(v_buf)  # 0: none
    kfar, vfar = far_ahead(k_buf), far_ahead(v_buf)  # 0: none
    for rr in range(RT):
        m[rr] = _NEG_INF
        l[rr] = 0.0
        for c in range(d):
            acc[rr, c] = 0.0
    for js in range(j0, j1, key_block):
        n = min(key_block, j1 - js)
        o = 0
        while o < n:  # the block's keys, one storage run at a time, every head's
            w = n - o
            for hh in range(nh):  # one run's length for every head (the same pages)
                krun, kscales_run, w = key_run(k_buf, r, h0 + hh, js + o, w)
                run_dots(qt, hh * R, hh * R + R, krun, kscales_run, w, s, o, kahead, kfar,
                         scratch)
            o += w
        for rr in range(RT):
            if m[rr] != m[rr]:  # NaN already: nothing can change it
                for jj in range(n):
                    s[rr, jj] = 0.0
                continue
            t = t0 + (rr % R) // G
            q_pos = tree_query_position(tree, i, t, start)  # what windows and ALiBi measure
            lo, _ = visible_keys(q_pos, window)
            hi = start + t + 1  # no key past the query's own slot
            head = (h0 + rr // R) * G + rr % G
            if tree_masks_block(tree, js, n, start):  # False without a tree: folded away
                if softcap > 0:
                    bm, nan = tree_score_row(tree, i, t, start, s[rr], n, js, lo, hi, scale,
                                             softcap, alibi, head, q_pos)
                else:
                    bm, nan = tree_score_row(tree, i, t, start, s[rr], n, js, lo, hi, scale,
                                             np.float32(0.0), alibi, head, q_pos)
            elif softcap > 0:
                bm, nan = _score_row(s[rr], n, js, lo, hi, scale, softcap, alibi, head, q_pos)
            else:  # the soft-cap's branch folds away in this copy
                bm, nan = _score_row(s[rr], n, js, lo, hi, scale, np.float32(0.0), alibi, head,
                                     q_pos)
            if nan:
                m[rr] = np.float32(np.nan)
                l[rr] = np.float32(np.nan)
                for jj in range(n):
                    s[rr, jj] = 0.0
                continue
            mn = m[rr] if m[rr] > bm else bm
            if mn == _NEG_INF:  # every key so far is masked: nothing to add
                for jj in range(n):
                    s[rr, jj] = 0.0
                continue
            if mn != m[rr]:
                alpha = exp_nonpos(m[rr] - mn)
                l[rr] *= alpha
                for c in range(d):
                    acc[rr, c] *= alpha
                m[rr] = mn
            tot = np.float32(0.0)
            for jj in range(n):
                p = exp_nonpos(s[rr, jj] - mn)
                s[rr, jj] = p
                tot += p
            l[rr] += tot
        o = 0
        while o < n:
            w = n - o
            for hh in range(nh):
                vrun, vscales_run, w = key_run(v_buf, r, h0 + hh, js + o, w)
                run_accumulate(acc, hh * R, hh * R + R, vrun, vscales_run, w, s, o, vahead,
                               vfar, scratch)
            o += w


@njit(cache=True)
def query_slot(offsets, i, t):
    """(dim 0, dim 2) of entry i's query t in the kernels' 4-D queries and outputs:
    ``(i, t)`` of padded ``[B, Hq, T, d]`` (``offsets`` empty), ``(offsets[i] + t, 0)`` of
    packed ``[N, Hq, 1, d]`` (a packed ``[N, Hq, d]`` with a unit axis: one array type, so
    one compiled kernel, serves both)."""
    if offsets.size == 0:
        return i, t
    return offsets[i] + t, 0


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def attention_items(q, k_buf, v_buf, rows, lens, n_new, items, run_starts, part_rows,
                    scale, softcap, window, sinks, alibi, key_block, out, lse, o_part, ml_part,
                    offsets, tree):
    """Every item of the plan; runs of items go to threads (one prange index per run).

    q: [B, Hq, T, d] float32, or bfloat16 bits (int16) over bfloat16 keys (the dots'
    pair products, ``_dots_rows``); out float32 alike and lse [B, Hq, T]; or packed
    [N, Hq, 1, d] with
    ``offsets`` [B] (entry i's first query's row; empty: padded; ``query_slot``);
    k_buf, v_buf: the layout (``key_run``): arrays
    [rows_total, Hkv, max_len, d], a ``Paged`` pool and table, or ``Quantized`` codes and
    scales; elements float32, float16 bits as uint16, bfloat16 bits as int16, int8 codes
    or e4m3fn bits as uint8 (``decode``); items: int64 [n_items, 7] rows
    (i, h0, h1, t0, t1, j0, j1), run r being items run_starts[r]:run_starts[r+1];
    part_rows[it]: -1 when the item covers every key its queries see (it writes
    out [B, Hq, T, d] and lse [B, Hq, T] itself), else the first row of its
    (h1-h0) * nq * G rows in o_part [P, d] (unnormalized output) and ml_part [P, 2]
    (running max, sum), merged by ``merge_pieces``. scale, softcap (0: none): float32;
    window: int (``NO_WINDOW``: none); sinks: float32 [Hq] (-inf: none), joined to an
    item that covers every key of its queries, else after the merge; alibi: None (no
    ALiBi: compiled without it) or float32 slopes [Hq] (``bias``); tree: None (compiled
    without the clause) or a ``Tree`` over the B entries (draft-tree verification).
    """
    d = q.shape[3]
    Hkv = kv_heads(k_buf)
    G = q.shape[1] // Hkv
    qmax = 1
    hmax = 1  # most heads of one _attend pass
    for it in range(items.shape[0]):
        qmax = max(qmax, items[it, 4] - items[it, 3])
        hmax = max(hmax, min(items[it, 2] - items[it, 1],
                             heads_per_pass(k_buf, (items[it, 4] - items[it, 3]) * G,
                                            key_block)))
    Rmax = qmax * G * hmax
    for run in prange(run_starts.size - 1):
        s = np.empty((Rmax, key_block), np.float32)
        acc = np.empty((Rmax, d), np.float32)
        m = np.empty(Rmax, np.float32)
        l = np.empty(Rmax, np.float32)
        qt = np.empty((Rmax, d), q.dtype)  # float32, or bfloat16 bits (int16)
        scratch = np.empty((key_block, d), np.float32)  # grouped codes' decoded run
        for it in range(run_starts[run], run_starts[run + 1]):
            i, h0, h1, t0, t1, j0, j1 = (items[it, 0], items[it, 1], items[it, 2], items[it, 3],
                                         items[it, 4], items[it, 5], items[it, 6])
            nq = t1 - t0
            R = nq * G
            r = rows[i]
            start = lens[i] - n_new[i]  # query t sits at absolute position start + t
            hp = heads_per_pass(k_buf, R, key_block)
            for hb in range(h0, h1, hp):
                nh = min(hp, h1 - hb)
                for hh in range(nh):
                    h = hb + hh
                    for t in range(nq):
                        ia, ib = query_slot(offsets, i, t0 + t)
                        for g in range(G):
                            for c in range(d):
                                qt[hh * R + t * G + g, c] = q[ia, h * G + g, ib, c]
                _attend(qt, k_buf, v_buf, r, hb, nh, start, t0, nq, G, j0, j1, scale, softcap,
                        window, alibi, key_block, s, acc, m, l, tree, i, scratch)
                base = part_rows[it]
                for hh in range(nh):
                    h = hb + hh
                    for t in range(nq):
                        ia, ib = query_slot(offsets, i, t0 + t)
                        for g in range(G):
                            rr = hh * R + t * G + g
                            if base < 0:
                                if m[rr] == _NEG_INF:  # saw no key (no real query does)
                                    continue
                                a, tot, mx = join_sink(m[rr], l[rr], sinks[h * G + g])
                                inv = a / tot
                                for c in range(d):
                                    out[ia, h * G + g, ib, c] = acc[rr, c] * inv
                                lse[ia, h * G + g, ib] = mx + np.log(tot)
                            else:
                                p = base + (h - h0) * R + t * G + g
                                for c in range(d):
                                    o_part[p, c] = acc[rr, c]
                                ml_part[p, 0] = m[rr]
                                ml_part[p, 1] = l[rr]


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def merge_pieces(groups, group_starts, piece_rows, o_part, ml_part, G, sinks, out, lse, offsets):
    """Combine the key pieces of split items through their log-sum-exp, then join each
    query head's sink (float32 [Hq], -inf: none) once to the merged sum.

    groups: int64 [n_groups, 5] (i, h0, h1, t0, t1); group gi's pieces start at rows
    piece_rows[group_starts[gi]:group_starts[gi+1]] of o_part / ml_part (layout of
    ``attention_items``). Writes the normalized out and lse of the group's queries
    (``offsets``: as there).
    """
    d = o_part.shape[1]
    for gi in prange(groups.shape[0]):
        i, h0, h1, t0, t1 = groups[gi, 0], groups[gi, 1], groups[gi, 2], groups[gi, 3], groups[gi, 4]
        nq = t1 - t0
        R = nq * G
        for hh in range(h1 - h0):
            for rr in range(R):
                row = hh * R + rr
                mx = _NEG_INF
                nan = False
                for pi in range(group_starts[gi], group_starts[gi + 1]):
                    mp = ml_part[piece_rows[pi] + row, 0]
                    nan |= mp != mp
                    mx = mp if mp > mx else mx
                t, g = rr // G, rr % G
                hq = (h0 + hh) * G + g
                ia, ib = query_slot(offsets, i, t0 + t)
                if nan:  # a piece saw a NaN score: the whole query is NaN
                    for c in range(d):
                        out[ia, hq, ib, c] = np.nan
                    lse[ia, hq, ib] = np.nan
                    continue
                if mx == _NEG_INF:  # no piece saw a key: the query stays 0 / -inf
                    continue
                sink = sinks[hq]
                # relative to max(mx, sink): the sink's term is e^{sink - mx}
                tot = exp_nonpos(sink - mx) if sink <= mx else np.float32(1.0)
                mx = mx if sink <= mx else sink
                for pi in range(group_starts[gi], group_starts[gi + 1]):
                    p = piece_rows[pi] + row
                    w = exp_nonpos(ml_part[p, 0] - mx)
                    tot += w * ml_part[p, 1]
                    for c in range(d):
                        out[ia, hq, ib, c] += w * o_part[p, c]
                inv = np.float32(1.0) / tot
                for c in range(d):
                    out[ia, hq, ib, c] *= inv
                lse[ia, hq, ib] = mx + np.log(tot)


# -- writes and row copies -----------------------------------------------------------------

#: How the write and copy kernels take a buffer: its elements as unsigned integers of the
#: same width (a copy moves bits; one compiled loop per width serves every float dtype).
COPY_VIEW = {2: np.uint16, 4: np.uint32, 8: np.uint64}
#: ``gather_pages``' element views by itemsize (bytes too: codes and nibble pairs).
GATHER_VIEW = {1: np.uint8, **COPY_VIEW}


@njit(cache=True, nogil=True)
def gather_pages(pool, pages, h0, h1, out):
    """out[h, j] = pool[pages[j], h0 + h] for the KV heads h0:h1 and the listed pages: a
    paged block's pages gathered into the BLAS path's buffer in one compiled call (the
    NumPy reader's loop makes a Python slice assignment per page and array, and holds the
    GIL meanwhile). pool: [num_pages, Hkv, P, tail]; out: [h1 - h0, >= len(pages), P,
    tail], both of one unsigned-integer view of the stored element (``GATHER_VIEW``).
    Releases the GIL: the BLAS path's items run on Python threads."""
    for h in range(h1 - h0):
        for j in range(pages.size):
            src = pool[pages[j], h0 + h]
            dst = out[h, j]
            for t in range(src.shape[0]):
                for e in range(src.shape[1]):
                    dst[t, e] = src[t, e]


@intrinsic
def _move(typingctx, dst, dst_at, src, src_at, n):
    """Copy n elements from ``src[src_at]`` on to ``dst[dst_at]`` on: one ``memmove`` (the C
    library's, as fast as NumPy's own copies), for element runs contiguous in both arrays
    (the caller's guarantee). ``dst_at``, ``src_at``: full index tuples."""
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array)
            and dst.dtype == src.dtype and isinstance(dst_at, types.UniTuple)
            and isinstance(src_at, types.UniTuple) and len(dst_at) == dst.ndim
            and len(src_at) == src.ndim):
        return None

    def codegen(context, builder, signature, args):
        dty, dat, sty, sat, _ = signature.args

        def pointer(aryty, ary, at_ty, at):
            arr = context.make_array(aryty)(context, builder, ary)
            idx = [context.cast(builder, builder.extract_value(at, k), at_ty.dtype, types.intp)
                   for k in range(len(at_ty))]
            return cgutils.get_item_pointer(context, builder, aryty, arr, idx, wraparound=False)

        dp = pointer(dty, args[0], dat, args[1])
        sp = pointer(sty, args[2], sat, args[3])
        count = context.cast(builder, args[4], signature.args[4], types.intp)
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(dty.dtype)))
        cgutils.raw_memmove(builder, dp, sp, count, itemsize)
        return context.get_dummy_value()

    return types.none(dst, dst_at, src, src_at, n), codegen


@njit(cache=True)
def write_tokens(k_buf, v_buf, k_new, v_new, rows, starts, n_new, offsets):
    """k_buf[rows[i], h, starts[i] + t] = k_new[i, h, t] (and V) for t < n_new[i]: every
    entry of an append in one call, a ``memmove`` per contiguous run (what this saves over
    the NumPy path is its Python round trip per row; the bytes move at memcpy speed either way).

    k_buf, v_buf: [rows_total, Hkv, max_len, d] C-contiguous; k_new, v_new: [B, Hkv, T, d]
    with contiguous last axes (any other strides, read-only or not: K and V are typed
    apart, so they need not share a layout or writability), or packed [N, Hkv, 1, d] with
    ``offsets`` [B] (entry i's first token's row; empty: padded; ``query_slot``); all four
    of one element width (``COPY_VIEW``). Inputs are validated by the caller (distinct
    rows, capacity), so no write overlaps another.
    """
    _write_one(k_buf, k_new, rows, starts, n_new, offsets)
    _write_one(v_buf, v_new, rows, starts, n_new, offsets)


@njit(cache=True)
def _write_one(dst, src, rows, starts, n_new, offsets):
    """write_tokens for one of K and V: ``dst`` the buffer, ``src`` the new tokens (its own
    array type: a loop over the (K, V) pair would need both to have one)."""
    H, d = src.shape[1], src.shape[3]
    # an entry's tokens of a head lie together (padded, token stride d)
    block = offsets.size == 0 and src.strides[2] == d * src.itemsize
    for i in range(rows.size):
        r, s0, n = rows[i], starts[i], n_new[i]
        if n <= 0:
            continue
        for h in range(H):
            if block:
                _move(dst, (r, h, s0, 0), src, (i, h, 0, 0), n * d)
            else:
                for t in range(n):
                    ia, ib = query_slot(offsets, i, t)
                    _move(dst, (r, h, s0 + t, 0), src, (ia, h, ib, 0), d)


@njit(cache=True)
def copy_rows(dst_k, dst_v, src_k, src_v, dst_rows, src_rows, n_tokens):
    """dst[l, dst_rows[i], h, :n_tokens[i]] = src[l, src_rows[i], h, :n_tokens[i]] for every
    layer l and KV head h (K and V): the copies of a row operation's wave, a ``memmove``
    of n_tokens[i] x d elements each.

    All four [layers, rows, Hkv, max_len, d] C-contiguous, of one element width; dst and
    src may be the same buffers: the copies of one call are independent (no copy reads a
    row another writes, ``Backend.copy_tokens``), so their order does not matter.
    """
    layers, _, H, _, d = dst_k.shape
    for dst, src in ((dst_k, src_k), (dst_v, src_v)):
        for i in range(dst_rows.size):
            a, b, n = dst_rows[i], src_rows[i], n_tokens[i]
            if n <= 0:
                continue
            for layer in range(layers):
                for h in range(H):
                    _move(dst, (layer, a, h, 0, 0), src, (layer, b, h, 0, 0), n * d)
