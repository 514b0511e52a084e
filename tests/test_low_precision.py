"""float16 and bfloat16 caches on every backend that declares them.

Tolerances follow FlashAttention's tests: gqakv's error against the float64 reference
must be within ``K_ERR x`` the error of a naive attention computed in the same
low-precision dtype the way an eager framework does it (every intermediate -- scores,
softmax, weighted sum -- rounded to the dtype), plus a tiny ``EPS``. gqakv accumulates
in float32 and rounds once, at the output. Stored K/V must be bit-exact.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import gqakv

from .support.reference import reference_attention

K_ERR = 2.0
EPS = 1e-6
NUMPY_DTYPE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def naive_attention(q, k_rows, v_rows, n_new, dtype):
    """Eager-framework attention in ``dtype``: each operation (scores, scale, max, exp,
    sum, weighted sum, division) accumulates in float32, as a bf16/fp16 matmul does,
    and its result is rounded to ``dtype``. q: [B, Hq, T, d] float64 holding
    dtype-representable values; k_rows[b], v_rows[b]: [Hkv, L, d]. Returns float64."""
    nd = NUMPY_DTYPE[dtype]

    def r(x):  # round to the narrow dtype, keep computing in float32
        return np.asarray(x, dtype=np.float32).astype(nd).astype(np.float32)

    B, Hq, T, d = q.shape
    out = np.zeros((B, Hq, T, d))
    for b in range(B):
        k, v = r(k_rows[b]), r(v_rows[b])
        Hkv, L, _ = k.shape
        G, n = Hq // Hkv, int(n_new[b])
        if n == 0:
            continue
        kh, vh = np.repeat(k, G, axis=0), np.repeat(v, G, axis=0)  # test code: clarity first
        s = r(r(r(q[b, :, :n]) @ kh.transpose(0, 2, 1)) * r(1.0 / math.sqrt(d)))  # [Hq, n, L]
        pos = L - n + np.arange(n)
        s = np.where(np.arange(L)[None, :] <= pos[:, None], s, -np.inf)
        p = r(np.exp(r(s - s.max(-1, keepdims=True))))
        out[b, :, :n] = r(r(p @ vh) / r(p.sum(-1, keepdims=True)))
    return out


def _round(arrays, x, dtype):
    """x rounded to dtype and back to float64 (what the cache will hold)."""
    return arrays.to_numpy(arrays.asarray(x, dtype))


def _check_parity(out, q, k_rows, v_rows, n_new, dtype, arrays, what):
    assert gqakv.core.dtypes.canonical_name(out.dtype) == dtype  # out in q's dtype
    got = arrays.to_numpy(out)
    want, _ = reference_attention(q, k_rows, v_rows, n_new)
    naive = naive_attention(q, k_rows, v_rows, n_new, dtype)
    err, naive_err = np.max(np.abs(got - want)), np.max(np.abs(naive - want))
    assert naive_err > 0, "inputs too easy: the naive computation is exact"
    assert err <= K_ERR * naive_err + EPS, (
        f"{what}: error {err:.3g} vs float64 exceeds {K_ERR} x the same-dtype naive error "
        f"{naive_err:.3g} + {EPS}")
    for b, n in enumerate(n_new):  # padded query slots are exactly zero
        assert np.all(got[b, :, int(n):] == 0)
    return err, naive_err


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_model_cache_low_precision_parity(dtype, backend, arrays):
    if dtype not in backend.dtypes:
        pytest.skip(f"backend {backend.name} does not declare {dtype} (dtypes: {backend.dtypes})")
    rng = np.random.default_rng(7)
    layers, B, hkv, G, d, S = 2, 3, 2, 3, 32, 48
    cache = gqakv.ModelKVCache(layers, B, hkv, S, d, dtype, backend)
    cache.store.fill(float("nan"))
    rows_k = [[np.zeros((hkv, 0, d))] * B for _ in range(layers)]
    rows_v = [[np.zeros((hkv, 0, d))] * B for _ in range(layers)]
    final = [40, 17, 1]
    schedule = []
    fed = [0] * B
    while fed != final:  # chunked prefill of 16, then decode (ragged: rows finish early)
        n = [min(16 if fed[b] < 32 else 1, final[b] - fed[b]) for b in range(B)]
        schedule.append(n)
        fed = [f + x for f, x in zip(fed, n)]
    errs = []
    for n_new in schedule:
        T = max(n_new)
        with cache.step(n_new) as step:
            for l in range(layers):
                q = _round(arrays, rng.standard_normal((B, hkv * G, T, d)), dtype)
                k = _round(arrays, rng.standard_normal((B, hkv, T, d)), dtype)
                v = _round(arrays, rng.standard_normal((B, hkv, T, d)), dtype)
                out = step.attend(l, *(arrays.asarray(x, dtype) for x in (q, k, v)))
                for b in range(B):
                    rows_k[l][b] = np.concatenate([rows_k[l][b], k[b, :, :n_new[b]]], axis=1)
                    rows_v[l][b] = np.concatenate([rows_v[l][b], v[b, :, :n_new[b]]], axis=1)
                errs.append(_check_parity(out, q, rows_k[l], rows_v[l], n_new, dtype, arrays,
                                          f"layer {l}, n_new {n_new}"))
    for l in range(layers):  # stored in the cache dtype, bit-exact
        for b in range(B):
            k, v = cache.live_kv(l, b)
            np.testing.assert_array_equal(arrays.to_numpy(k), rows_k[l][b])
            np.testing.assert_array_equal(arrays.to_numpy(v), rows_v[l][b])
    assert len(errs) == layers * len(schedule)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_single_cache_low_precision_parity_and_lse(dtype, backend, arrays):
    if dtype not in backend.dtypes:
        pytest.skip(f"backend {backend.name} does not declare {dtype} (dtypes: {backend.dtypes})")
    rng = np.random.default_rng(8)
    B, hkv, G, d = 2, 1, 4, 64
    cache = gqakv.KVCache(B, hkv, 64, d, dtype, backend)
    k = _round(arrays, rng.standard_normal((B, hkv, 50, d)), dtype)
    v = _round(arrays, rng.standard_normal((B, hkv, 50, d)), dtype)
    q = _round(arrays, 2.0 * rng.standard_normal((B, hkv * G, 50, d)), dtype)  # peakier softmax
    n_new = [50, 23]
    cache.append(arrays.asarray(k, dtype), arrays.asarray(v, dtype), n_new)
    out, lse = gqakv.gqa_attention(arrays.asarray(q, dtype), cache, n_new, return_lse=True)
    k_rows = [k[b, :, :n_new[b]] for b in range(B)]
    v_rows = [v[b, :, :n_new[b]] for b in range(B)]
    _check_parity(out, q, k_rows, v_rows, n_new, dtype, arrays, "prefill")
    _, want_lse = reference_attention(q, k_rows, v_rows, n_new)
    assert gqakv.core.dtypes.canonical_name(lse.dtype) == "float32"  # accumulated in float32
    got_lse = arrays.to_numpy(lse)
    live = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(got_lse), live)
    # LSE never passes through the narrow dtype: float32 accuracy on O(10) values
    np.testing.assert_allclose(got_lse[live], want_lse[live], rtol=0, atol=1e-4)


def test_low_precision_sizes(backend):
    for dtype, item in (("float16", 2), ("bfloat16", 2), ("float32", 4)):
        assert gqakv.ModelKVCache.nbytes_for(32, 1, 8, 4096, 128, dtype) == 2 * 32 * 8 * 128 * item * 4096


def test_dtype_names_are_the_same_from_every_library_and_every_call():
    """canonical_name keeps names by (type, dtype): repeated calls, and dtypes of other
    libraries that hash alike, give the right name; unsupported dtypes keep failing."""
    array_api_strict = pytest.importorskip("array_api_strict")
    torch = pytest.importorskip("torch")

    cases = [(np.float32, "float32"), (np.dtype(np.float16), "float16"),
             (np.dtype(ml_dtypes.bfloat16), "bfloat16"), (torch.bfloat16, "bfloat16"),
             (torch.float64, "float64"), (array_api_strict.float32, "float32"), ("float16", "float16")]
    for _ in range(2):  # the second pass reads the kept names
        for dtype, name in cases:
            assert gqakv.core.dtypes.canonical_name(dtype) == name
    for bad in (np.int64, np.dtype("int32"), torch.int8, "f4"):
        for _ in range(2):
            with pytest.raises(TypeError, match="not supported by gqakv"):
                gqakv.core.dtypes.canonical_name(bad)
