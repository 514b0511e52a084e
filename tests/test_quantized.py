"""The quantized (int8 / float8_e4m3fn) KV cache: the scheme's exact rules, the cache on
every backend against the float64 reference on the dequantized values, the error the
quantization itself costs, row operations carrying scales, and bad inputs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gqakv import quantize as Q

KV_DTYPES = ("int8", "float8_e4m3fn")


def _namespaces():
    """(name, xp, to_xp, to_numpy) for the array libraries the generic code runs on here."""
    import array_api_compat.numpy as xn

    out = [("numpy", xn, lambda a: a, np.asarray)]
    try:
        import array_api_strict as xs

        out.append(("array_api_strict", xs, xs.asarray, np.asarray))
    except ImportError:
        pass
    try:
        import array_api_compat.torch as xt
        import torch

        out.append(("torch", xt, torch.from_numpy, lambda a: a.numpy()))
    except ImportError:
        pass
    return out


NAMESPACES = _namespaces()


# -- the scheme ----------------------------------------------------------------------------------


def _e4m3_probe_values() -> np.ndarray:
    """Every finite e4m3fn value, every midpoint between neighbours (the ties), the floats
    next to each midpoint, and random values over the whole range, both signs."""
    rng = np.random.default_rng(0)
    t = Q.e4m3_table()
    pos = np.unique(t[np.isfinite(t) & (t >= 0)])
    mids = (pos[1:] + pos[:-1]) / 2
    vals = np.concatenate([
        pos, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(448)),
        rng.uniform(-448, 448, 20000), rng.standard_normal(20000) * 1e-2,
        rng.standard_normal(5000) * 1e-4, [0.0, 448.0, 2.0 ** -9, 2.0 ** -10, 2.0 ** -6]]).astype(np.float32)
    return np.concatenate([vals, -vals])


@pytest.mark.parametrize("ns", NAMESPACES, ids=[n[0] for n in NAMESPACES])
def test_encode_e4m3_matches_ml_dtypes_bit_for_bit(ns):
    """The array-API encoder (used off NumPy) rounds exactly as ml_dtypes' cast: nearest,
    ties to even, subnormals, the 448 edge, -0.0."""
    _, xp, to_xp, to_np = ns
    vals = _e4m3_probe_values()
    want = vals.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    got = to_np(Q.encode_e4m3(xp, to_xp(vals)))
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} mismatches, first: {vals[bad[:5]]} -> {got[bad[:5]]} vs {want[bad[:5]]}"
    # The ties really are in the probe, and ties went to the even pattern.
    t = Q.e4m3_table()
    mid = np.float32((t[0x38] + t[0x39]) / 2)  # between 1.0 (0x38) and 1.125 (0x39)
    assert to_np(Q.encode_e4m3(xp, to_xp(np.array([mid], dtype=np.float32))))[0] == 0x38


def _reference_quantize(x: np.ndarray, kv_dtype: str):
    """The issue's rule written directly in NumPy float32 (independent of gqakv.quantize)."""
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


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("ns", NAMESPACES, ids=[n[0] for n in NAMESPACES])
def test_quantize_follows_the_rule_exactly(ns, kv_dtype):
    _, xp, to_xp, to_np = ns
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, 64)).astype(np.float32) * rng.uniform(1e-3, 1e3, (3, 5, 1)).astype(np.float32)
    x[0, 0] = 0.0  # an all-zero token
    x[1, 2, 7] = 40.0  # an outlier channel
    codes, scale = Q.quantize(xp, to_xp(x), kv_dtype)
    want_codes, want_scale = _reference_quantize(x, kv_dtype)
    np.testing.assert_array_equal(to_np(scale), want_scale)
    np.testing.assert_array_equal(to_np(codes), want_codes)
    assert to_np(scale)[0, 0] == 0 and not to_np(codes)[0, 0].any()  # zeros: scale 0, codes 0
    # Dequantized = code x scale in float32; the largest value comes back exactly (+-QMAX x scale).
    table = to_xp(Q.e4m3_table())
    deq = to_np(Q.dequantize(xp, codes, scale, kv_dtype, table))
    assert deq.dtype == np.float32
    values = want_codes.astype(np.float32) if kv_dtype == "int8" else Q.e4m3_table()[want_codes]
    np.testing.assert_array_equal(deq, values * want_scale[..., None])


def test_int8_rounds_half_to_even_and_clips():
    import array_api_compat.numpy as xp

    # amax 127 -> scale exactly 1, so x / scale is x: ties at .5 go to the even integer.
    x = np.array([[127.0, 2.5, 3.5, -2.5, -3.5, 0.5, 1.5, -126.5]], dtype=np.float32)
    codes, scale = Q.quantize(xp, x, "int8")
    assert scale[0] == 1.0
    assert codes[0].tolist() == [127, 2, 4, -2, -4, 0, 2, -126]
    # A scale that rounds down makes amax / scale a hair above 127: clipped, never 128 / wrap.
    rng = np.random.default_rng(2)
    x = rng.uniform(-1, 1, (20000, 8)).astype(np.float32)
    codes, scale = Q.quantize(xp, x, "int8")
    assert codes.min() >= -127 and codes.max() <= 127
    amax_pos = np.abs(x).argmax(axis=-1)
    assert (np.abs(codes[np.arange(len(x)), amax_pos]) == 127).all()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("ns", NAMESPACES, ids=[n[0] for n in NAMESPACES])
def test_nonfinite_and_tiny_tokens(ns, kv_dtype):
    """A token with NaN or inf stores scale NaN and zero codes (all of it reads NaN); a
    token whose scale underflows stores scale 0 and zeros; huge finite tokens stay finite."""
    _, xp, to_xp, to_np = ns
    x = np.ones((5, 16), dtype=np.float32)
    x[0, 3] = np.nan
    x[1, 0] = np.inf
    x[2] = 1e-45  # the smallest subnormal: amax / QMAX is 0
    x[3] = 3e38  # near float32's largest
    x[4] = 0.0
    codes, scale = Q.quantize(xp, to_xp(x), kv_dtype)
    s, c = to_np(scale), to_np(codes)
    assert np.isnan(s[:2]).all() and not c[:2].any()
    assert s[2] == 0 and not c[2].any()
    assert s[4] == 0 and not c[4].any()
    deq = to_np(Q.dequantize(xp, codes, scale, kv_dtype, to_xp(Q.e4m3_table())))
    assert np.isnan(deq[:2]).all()
    assert (deq[2] == 0).all() and (deq[4] == 0).all()
    np.testing.assert_allclose(deq[3], x[3], rtol=0)  # 3e38 = QMAX codes x scale, exactly
