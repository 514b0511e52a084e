"""The 8-bit K/V storage scheme: one float32 scale per (row, KV head, token).

Exactly (so anyone can reproduce it), for one token's ``d`` values ``x`` (computed in
float32 from the input dtype):

- ``amax = max|x|``; ``scale = amax / QMAX`` (float32 division; QMAX = 127 for int8,
  448 for float8_e4m3fn);
- int8: stored ``round_half_to_even(x / scale)`` clipped to [-127, 127];
- float8_e4m3fn: stored ``x / scale`` clipped to [-448, 448] (a no-op but for float32
  rounding of the division) and rounded to the nearest e4m3fn value, ties to even
  (ml_dtypes' ``float8_e4m3fn`` cast on NumPy; ``encode_e4m3`` elsewhere, bit-identical);
- a token whose values are all 0 (or whose scale underflows to 0) stores scale 0 and
  zeros; a token holding a NaN or an infinity stores scale NaN and zeros, so every one
  of its dequantized values is NaN (the NaN rule: a non-finite input is never hidden);
- dequantized value = stored value x scale, in float32.

Codes are kept in int8 (int8) or uint8 holding the e4m3fn bit pattern (float8_e4m3fn:
every array library has uint8, few have a float8 type). Appends never rescale older
tokens: each token's scale depends on that token alone.

Written once against the array API (``xp``), with NumPy shortcuts through ml_dtypes.
"""

from __future__ import annotations

import math

import numpy as np

#: Largest stored magnitude of each quantized storage dtype.
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
#: Bytes of one token's scale (float32).
SCALE_BYTES = 4


def code_dtype(xp, kv_dtype: str):
    """The array dtype the codes of ``kv_dtype`` are stored in (``xp``'s int8 or uint8)."""
    return xp.int8 if kv_dtype == "int8" else xp.uint8


def _is_numpy(x) -> bool:
    return isinstance(x, np.ndarray)  # subclasses too (the emulated CuPy arrays)


# -- float8_e4m3fn bits ------------------------------------------------------------------------


def e4m3_table() -> np.ndarray:
    """The float32 value of each of the 256 e4m3fn bit patterns ([256]; 0x7F/0xFF are NaN)."""
    import ml_dtypes

    return np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def encode_e4m3(xp, y):
    """e4m3fn bit patterns (uint8) of float32 ``y`` with every ``|y| <= 448``, finite:
    round to nearest, ties to even, as ml_dtypes does.

    A value of binade e (``2**e <= |y| < 2**(e+1)``, e clamped to -6..8: below 2**-6 the
    subnormals share the quantum 2**-9) has the quantum ``2**(e-3)``; with
    ``r = round(|y| / 2**(e-3))`` (an exact division; r in 0..16), the pattern is
    ``8 * (e + 7) + (r - 8)``, which also covers subnormals (e = -6, r < 8) and a carry
    into the next binade (r = 16). The sign is bit 7.
    """
    a = xp.abs(y)
    safe = xp.where(a > 0, a, xp.asarray(2.0 ** -9, dtype=a.dtype))
    e = xp.floor(xp.log2(safe))
    # log2 may round an argument just below a power of two up to it: fix e exactly.
    e = xp.where(2.0 ** e > safe, e - 1, e)
    e = xp.where(2.0 ** (e + 1) <= safe, e + 1, e)
    e = xp.clip(e, -6.0, 8.0)
    r = xp.round(a / 2.0 ** (e - 3))
    sign = xp.astype(xp.signbit(y), a.dtype) * 128
    bits = 8 * e + 48 + r + sign
    return xp.astype(bits, xp.uint8)


# -- quantize / dequantize ---------------------------------------------------------------------


def _scaled(xp, x, qmax: float):
    """``(y, scale)`` for float32 ``x`` ``[..., n]``, scaled over its last axis: ``scale =
    max|x| / qmax`` ``[...]`` (0 for all zeros, NaN for a non-finite amax) and ``y = x /
    scale`` clipped to [-qmax, qmax] (0 where the scale is 0 or NaN): the rule every
    scheme here rounds ``y`` from."""
    amax = xp.max(xp.abs(x), axis=-1)
    finite = xp.isfinite(amax)
    scale = xp.where(finite, amax / qmax, xp.asarray(math.nan, dtype=xp.float32))
    ok = finite & (scale > 0)
    y = x / xp.where(ok, scale, xp.asarray(1.0, dtype=xp.float32))[..., None]
    y = xp.where(ok[..., None], y, xp.asarray(0.0, dtype=xp.float32))
    return xp.clip(y, -qmax, qmax), scale


def quantize(xp, x, kv_dtype: str):
    """Quantize ``x`` ``[..., d]`` (any float dtype) token by token along the last axis.

    Returns ``(codes [..., d], scales [...] float32)``; see the module docstring."""
    qmax = QMAX[kv_dtype]
    y, scale = _scaled(xp, xp.astype(x, xp.float32), qmax)
    if kv_dtype == "int8":
        codes = xp.astype(xp.round(y), xp.int8)
    elif _is_numpy(y):
        import ml_dtypes

        codes = y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    else:
        codes = encode_e4m3(xp, y)
    return codes, scale


def dequantize(xp, codes, scales, kv_dtype: str, table=None):
    """float32 ``codes * scales[..., None]``: codes ``[..., d]``, scales ``[...]``.

    ``table``: for float8_e4m3fn off NumPy, ``e4m3_table()`` as an array of ``xp`` on the
    codes' device (the value of each bit pattern, looked up with ``take``)."""
    if kv_dtype == "int8":
        values = xp.astype(codes, xp.float32)
    elif _is_numpy(codes):
        import ml_dtypes

        values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        shape = tuple(codes.shape)
        flat = xp.reshape(xp.astype(codes, xp.int64), (-1,))
        values = xp.reshape(xp.take(table, flat, axis=0), shape)
    return values * scales[..., None]


# -- grouped codes: a scale per block of values along d ----------------------------------------
#
# The grouped schemes (``gqakv.storage.codecs.Grouped``: ``int8_g32``, ``int4_g32``,
# ``int4_g64``, ``int4_g32_rotated``), exactly, for one token's ``d`` values ``x`` (float32):
#
# - the values are cut into ``d / g`` blocks of ``g`` consecutive values (``g`` divides d);
#   per block ``amax = max|x|``, ``scale = amax / QMAX`` (127 for 8 bits, 7 for 4 bits),
#   stored ``round_half_to_even(x / scale)`` clipped to [-QMAX, QMAX]; the zero and NaN
#   rules above hold per block (an all-zero block: scale 0; a block holding a NaN or an
#   infinity: scale NaN, so each of its values dequantizes to NaN);
# - 4 bits: code c is kept as the nibble ``c + 8`` (1..15), value ``2i`` in the low nibble
#   of byte ``i`` and value ``2i + 1`` in its high nibble, so a token of d values takes d / 2
#   bytes;
# - dequantized value = code x its block's scale, in float32.
#
# ``_rotated`` schemes first rotate each key (never a value) by the orthogonal
# ``R = diag(s) H / sqrt(d)`` (``hadamard_rotation``: H the d x d Walsh-Hadamard matrix, s
# fixed random signs): an outlier channel is spread over every channel of the block, so the
# blocks' scales stop being set by it. Queries are rotated by the same R at attention, so
# q . k is unchanged in exact arithmetic (R is orthogonal: q R . k R = q . k). ``x R`` is
# computed exactly so (``rotate``), in float32 (float64 for float64 inputs): ``y = x * s``,
# then the fast Walsh-Hadamard transform's stages h = 1, 2, 4, ..., d / 2, each replacing
# every pair ``(y[i], y[i + h])`` (i in a block of 2h starting at a multiple of 2h, i within
# its first h) by ``(y[i] + y[i + h], y[i] - y[i + h])``, then ``y * (1 / sqrt(d))`` (the
# factor rounded to the dtype). Every element is one fixed sequence of additions, so every
# library and batch shape gets the same bits.

#: Largest stored magnitude of each code width of the grouped schemes.
GROUP_QMAX = {8: 127.0, 4: 7.0}
#: The seed of the rotation's signs (fixed: every cache and process rotates alike).
ROTATION_SEED = 0x6A9B


def quantize_groups(xp, x, bits: int, group: int):
    """``(codes, scales)`` of ``x`` ``[..., d]``: int8 codes ``[..., d]`` (8 bits) or uint8
    nibble pairs ``[..., d / 2]`` (4 bits), float32 scales ``[..., d / group]``; see above."""
    qmax = GROUP_QMAX[bits]
    x = xp.astype(x, xp.float32)
    shape = tuple(x.shape)
    d = shape[-1]
    y, scale = _scaled(xp, xp.reshape(x, (*shape[:-1], d // group, group)), qmax)
    c = xp.reshape(xp.round(y), shape)
    if bits == 8:
        return xp.astype(c, xp.int8), scale
    u = xp.reshape(xp.astype(c + 8, xp.uint8), (*shape[:-1], d // 2, 2))
    return u[..., 0] | (u[..., 1] << 4), scale


def group_values(xp, codes, bits: int, d: int):
    """float32 codes ``[..., d]`` of stored ``codes`` (int8, or uint8 nibble pairs)."""
    if bits == 8:
        return xp.astype(codes, xp.float32)
    lo = xp.astype(codes & 15, xp.float32) - 8
    hi = xp.astype(codes >> 4, xp.float32) - 8
    return xp.reshape(xp.stack([lo, hi], axis=-1), (*tuple(codes.shape)[:-1], d))


def dequantize_groups(xp, codes, scales, bits: int, group: int):
    """float32 ``[..., d]``: each value's code times its block's scale."""
    n_groups = int(scales.shape[-1])
    d = n_groups * group
    values = group_values(xp, codes, bits, d)
    lead = tuple(values.shape)[:-1]
    out = xp.reshape(values, (*lead, n_groups, group)) * scales[..., None]
    return xp.reshape(out, (*lead, d))


def _walsh_hadamard(xp, y):
    """``y @ H`` (Sylvester's order) by the transform's butterflies, stage h = 1, 2, ...."""
    shape = tuple(y.shape)
    d = shape[-1]
    h = 1
    while h < d:
        pairs = xp.reshape(y, (*shape[:-1], d // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = xp.reshape(xp.stack([a + b, a - b], axis=-2), shape)
        h *= 2
    return y


def _signs(xp, d: int, like):
    """The rotation's fixed signs s ``[d]`` as an array of ``xp`` in like's dtype and device."""
    s = np.where(np.random.default_rng(ROTATION_SEED).random(d) < 0.5, -1.0, 1.0)
    return xp.asarray(s.astype(np.float64 if like.dtype == xp.float64 else np.float32),
                      device=getattr(like, "device", None))


def rotate(xp, x, inverse: bool = False):
    """``x @ R`` (``inverse``: ``x @ R.T``) for x ``[..., d]``, d a power of two, computed as
    the module docstring says, in float32 (float64 for float64 x)."""
    compute = xp.float64 if x.dtype == xp.float64 else xp.float32
    y = xp.astype(x, compute)
    d = int(y.shape[-1])
    s = _signs(xp, d, y)
    factor = xp.asarray(1.0 / math.sqrt(d), dtype=compute)
    if inverse:  # R.T = H diag(s) / sqrt(d)
        return _walsh_hadamard(xp, y) * factor * s
    return _walsh_hadamard(xp, y * s) * factor


def hadamard_rotation(d: int) -> np.ndarray:
    """``[d, d]`` float64 orthogonal ``R = diag(s) H / sqrt(d)`` (d a power of two): a row
    vector x rotates as ``x @ R``, back as ``y @ R.T``. H is Sylvester's Walsh-Hadamard
    matrix; s are ``ROTATION_SEED``'s random signs."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs a head dim that is a power of two, got d={d}")
    H = np.ones((1, 1))
    while H.shape[0] < d:
        H = np.block([[H, H], [H, -H]])
    signs = np.where(np.random.default_rng(ROTATION_SEED).random(d) < 0.5, -1.0, 1.0)
    return signs[:, None] * H / math.sqrt(d)
