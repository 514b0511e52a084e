"""The 8-bit K/V scheme's rule written directly in NumPy float32 (independent of
gqakv.storage.quantize's arithmetic), what a cache holds for the values appended, and the tokens
that test the scheme."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from gqakv.storage import quantize as Q


def reference_quantize(x: np.ndarray, kv_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """x [..., d] -> (codes [..., d], scale [...] float32): per token, scale = amax / QMAX
    (127 for int8, 448 for float8_e4m3fn), codes = x / scale rounded half to even (int8)
    or to the nearest e4m3fn (as uint8 bits), clipped; a zero token gets scale 0, codes 0."""
    x = x.astype(np.float32)
    qmax = np.float32(127 if kv_dtype == "int8" else 448)
    amax = np.abs(x).max(axis=-1)
    scale = (amax / qmax).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        y = x / scale[..., None]
    y = np.where(scale[..., None] > 0, y, np.float32(0)).astype(np.float32)
    if kv_dtype == "int8":
        codes = np.clip(np.rint(y), -127, 127).astype(np.int8)  # rint: half to even
    else:
        codes = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return codes, scale


def dequantized(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """What a quantized cache holds for input values ``x`` [..., d] (the reference rule),
    float32: each code's value times its token's scale."""
    codes, scale = reference_quantize(x, kv_dtype)
    values = codes.astype(np.float32) if kv_dtype == "int8" else Q.e4m3_table()[codes]
    return (values * scale[..., None]).astype(np.float32)


def held(x: np.ndarray, storage: dict, keys: bool = False) -> np.ndarray:
    """What a cache made with the keyword arguments ``storage`` (a conftest STORAGE_SPECS
    or GROUPED_SPECS entry) holds for the values ``x`` [..., d] appended: ``x`` itself, or
    for a ``kv_dtype`` its dequantized values (float32; a grouped codec's by
    ``held_grouped``, float64, ``keys`` of a rotated one rotated back). For the product
    tests' references."""
    kv_dtype = storage.get("kv_dtype")
    if kv_dtype in GROUPED:
        return held_grouped(np.asarray(x, np.float32), kv_dtype, keys)
    return x if kv_dtype is None else dequantized(np.asarray(x, np.float32), kv_dtype)


def hard_tokens(rng: np.random.Generator, shape: tuple, dtype: str) -> np.ndarray:
    """Gaussian K/V [B, Hkv, T, d] float64 with the tokens that test the scheme: an
    outlier channel, an all-zero token, a huge token (near the input dtype's range), a
    tiny one."""
    x = rng.standard_normal(shape)
    x[..., 3] *= 20.0  # an outlier channel, as real keys have
    T = shape[2]
    x[0, 0, min(1, T - 1)] = 0.0
    x[-1, -1, min(2, T - 1)] *= 3e4 if dtype == "float16" else 1e30
    x[0, -1, 0] *= 1e-30 if dtype != "float16" else 1e-4
    return x


# -- the grouped schemes (gqakv.storage.codecs.Grouped), written here apart from the library ----

#: codec name -> (bits, group, keys rotated), as gqakv/storage/quantize.py documents them.
GROUPED = {"int8_g32": (8, 32, False), "int4_g32": (4, 32, False), "int4_g64": (4, 64, False),
           "int4_g32_rotated": (4, 32, True)}


def rotation(d: int) -> np.ndarray:
    """[d, d] float64 ``diag(s) H / sqrt(d)``: H[i, j] = (-1)^popcount(i & j) (Sylvester's
    Walsh-Hadamard matrix), s the documented seed's signs (``quantize.ROTATION_SEED``)."""
    i = np.arange(d)
    H = np.array([[(-1.0) ** bin(a & b).count("1") for b in i] for a in i])
    s = np.where(np.random.default_rng(Q.ROTATION_SEED).random(d) < 0.5, -1.0, 1.0)
    return s[:, None] * H / np.sqrt(d)


def walsh_hadamard_rotation(x: np.ndarray, inverse: bool = False) -> np.ndarray:
    """x [..., d] float32 times R (``inverse``: R.T) by the documented butterflies, element
    by element: signs first (inverse: last), stages h = 1, 2, ..., each pair (i, i + h) of
    a block of 2h becoming (a + b, a - b), then times float32(1 / sqrt(d))."""
    y = np.array(x, dtype=np.float32)
    d = y.shape[-1]
    s = np.where(np.random.default_rng(Q.ROTATION_SEED).random(d) < 0.5, -1, 1).astype(np.float32)
    if not inverse:
        y = y * s
    h = 1
    while h < d:
        out = np.empty_like(y)
        for start in range(0, d, 2 * h):
            for i in range(start, start + h):
                a, b = y[..., i], y[..., i + h]
                out[..., i], out[..., i + h] = a + b, a - b
        y = out
        h *= 2
    y = y * np.float32(1.0 / np.sqrt(d))
    return y * s if inverse else y


def reference_grouped(x: np.ndarray, name: str, keys: bool = False):
    """x [..., d] -> (stored codes, scales [..., d / g] float32, dequantized float32 [..., d]
    in the stored basis) under the grouped rule: per block of g values scale = amax /
    QMAX (127, or 7 for 4 bits), codes = x / scale rounded half to even, clipped; a zero
    block: scale 0 and codes 0; a non-finite block: scale NaN, codes 0. 4 bits: nibble
    c + 8, value 2i low, 2i + 1 high. ``keys`` of a rotated codec are first rotated
    (``walsh_hadamard_rotation``, float32)."""
    bits, g, rotated = GROUPED[name]
    x = np.asarray(x, np.float32)
    if rotated and keys:
        x = walsh_hadamard_rotation(x)
    d = x.shape[-1]
    qmax = np.float32(127 if bits == 8 else 7)
    blocks = x.reshape(*x.shape[:-1], d // g, g)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.abs(blocks).max(axis=-1)
        scale = np.where(np.isfinite(amax), amax / qmax, np.float32(np.nan)).astype(np.float32)
        ok = np.isfinite(scale) & (scale > 0)
        y = np.where(ok[..., None], blocks / np.where(ok, scale, 1)[..., None], 0).astype(np.float32)
    c = np.clip(np.rint(y), -qmax, qmax).reshape(x.shape)
    values = (c.reshape(blocks.shape) * scale[..., None]).reshape(x.shape).astype(np.float32)
    if bits == 8:
        return c.astype(np.int8), scale, values
    u = (c + 8).astype(np.uint8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8), scale, values


def held_grouped(x: np.ndarray, name: str, keys: bool) -> np.ndarray:
    """What a cache of grouped codec ``name`` holds for ``x`` [..., d], in the caller's
    basis (float64): the dequantized values, keys of a rotated codec rotated back."""
    values = reference_grouped(x, name, keys)[2]
    if GROUPED[name][2] and keys:
        values = walsh_hadamard_rotation(values, inverse=True)
    return values.astype(np.float64)
