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


def quantize(xp, x, kv_dtype: str):
    """Quantize ``x`` ``[..., d]`` (any float dtype) token by token along the last axis.

    Returns ``(codes [..., d], scales [...] float32)``; see the module docstring."""
    qmax = QMAX[kv_dtype]
    x = xp.astype(x, xp.float32)
    amax = xp.max(xp.abs(x), axis=-1)
    finite = xp.isfinite(amax)
    scale = xp.where(finite, amax / qmax, xp.asarray(math.nan, dtype=xp.float32))
    ok = finite & (scale > 0)
    y = x / xp.where(ok, scale, xp.asarray(1.0, dtype=xp.float32))[..., None]
    y = xp.where(ok[..., None], y, xp.asarray(0.0, dtype=xp.float32))
    y = xp.clip(y, -qmax, qmax)
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
