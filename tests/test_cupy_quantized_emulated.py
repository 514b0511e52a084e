"""The cupy backend's kernels over a quantized (int8 / float8_e4m3fn) cache, on the CPU
emulator (tests/cuda_emu), through CupyBackend itself (only allocation and launch
substituted).

* the quantizing append (gqakv_write_kv_quantized) stores codes and scales bit for bit
  equal to ``gqakv.storage.quantize.quantize`` on hard tokens: all-zero and negative-zero tokens,
  huge (1e30, near the float32 maximum), tiny and subnormal ones, a scale that underflows
  to 0, NaN / inf tokens, int8 ties (x.5 at scale 1) and every e4m3 value, midpoint and
  neighbour of a midpoint (at scale 1), in float32, float16 and bfloat16 inputs;
* attention (decode, small-T decode, split decode + merge, chunked prefill, ragged rows,
  padded queries, an idle entry) is within the issue's kernel-exactness bound: the error
  against the float64 reference on the dequantized values at most 2x the error the same
  kernels show over an unquantized cache of ``dtype`` (or the exact result's rounding to
  ``dtype``), plus 1e-6;
* row copies (fork, reorder) move codes and scales together (gqakv_copy_tokens twice);
* routing: the fp32-FMA kernels serve quantized caches, the tensor-core ones say why not,
  a kv_dtype no kernel declares goes generic with the declaration's sentence (paged 8-bit
  caches: tests/test_cupy_emulated_paged_quantized.py).

The generic path is patched to fail in these tests, so a silent fallback cannot pass them.
Scenario-level checks (and the AddressSanitizer run) are tests/cuda_emu/quantized_cases.py,
part of test_cupy_emulated.py's grid.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import gqakv
from gqakv.storage import quantize as Q

from .cuda_emu import emulated_backend
from .cuda_emu import harness
from .support.reference import reference_attention

if harness.compiler() is None:
    pytest.skip("no C++ compiler (g++) for the CUDA emulation harness", allow_module_level=True)

KV_DTYPES = ("int8", "float8_e4m3fn")
NP_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
             "bfloat16": np.dtype(ml_dtypes.bfloat16)}
D = 16  # a library test_cupy_emulated_dims builds too


@pytest.fixture
def backend(monkeypatch):
    """The emulated CupyBackend, with the generic fallbacks made to fail and every
    launched kernel name recorded in ``backend.kernels``."""
    return emulated_backend.kernels_only(monkeypatch, "quantized kernels")


def _hard_tokens(dtype: str, kv_dtype: str) -> np.ndarray:
    """[2, 2, T, D] float64 tokens, each a hard case of the rule (see the module docstring)."""
    rng = np.random.default_rng(1)
    big = 6e4 if dtype == "float16" else 1e30
    tiny = 1e-7 if dtype == "float16" else 1e-40
    toks = [np.zeros(D), -np.zeros(D), np.r_[-0.0, 0.0, np.zeros(D - 2)],
            rng.uniform(-1, 1, D) * big, rng.standard_normal(D) * tiny,
            np.r_[big, rng.standard_normal(D - 1)], np.r_[1.0, np.zeros(D - 1)] * tiny * 1e-10,
            np.r_[np.nan, np.ones(D - 1)], np.r_[np.ones(D - 1), np.inf], np.r_[-np.inf, np.ones(D - 1)]]
    if dtype != "float16":
        toks.append(rng.uniform(-3.4e38, 3.4e38, D))  # near the float32 maximum
    toks += [rng.standard_normal(D) * s for s in (1e-3, 1.0, 7.0, 1e3)]
    if kv_dtype == "int8":  # scale exactly 1: every x.5 is a tie
        ties = np.r_[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.5, 64.5, -63.5, 0.49, 5.5, 6.5]
        toks += [np.r_[127.0, ties, -127.0], np.r_[127.0, -ties, 1.0]]
    else:  # scale exactly 1: the e4m3 values, their midpoints and the floats next to them
        t = Q.e4m3_table()
        pos = np.unique(t[np.isfinite(t) & (t >= 0)])
        mids = (pos[1:] + pos[:-1]) / 2
        probes = np.concatenate([pos, mids, np.nextafter(mids, np.float32(0)),
                                 np.nextafter(mids, np.float32(448))]).astype(np.float32)
        probes = np.concatenate([probes, -probes])
        for i in range(0, probes.size, D - 1):
            chunk = probes[i:i + D - 1]
            toks.append(np.r_[448.0, chunk, np.ones(D - 1 - chunk.size)])
    toks = np.array(toks)
    T = -(-len(toks) // 4)
    toks = np.concatenate([toks, rng.standard_normal((4 * T - len(toks), D))])
    return toks.reshape(2, 2, T, D)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_append_quantizes_bit_for_bit(backend, dtype, kv_dtype):
    x = _hard_tokens(dtype, kv_dtype)
    B, H, T, _ = x.shape
    cache = gqakv.KVCache(B, H, T + 3, D, dtype, backend=backend, kv_dtype=kv_dtype)
    x_in = x.astype(NP_DTYPES[dtype])
    cache.append(backend.from_numpy(x_in, dtype), backend.from_numpy(x_in[:, :, ::-1].copy(), dtype),
                 [T, T - 1])
    assert backend.kernels and all(k.startswith("gqakv_write_kv_quantized<") for k in backend.kernels)
    for buf, scales, x_src in ((cache.store.k, cache.store.k_scale, x_in),
                               (cache.store.v, cache.store.v_scale, x_in[:, :, ::-1])):
        codes, scale = Q.quantize(np, x_src.astype(np.float32), kv_dtype)
        for b, n in enumerate((T, T - 1)):
            got_c = backend.to_numpy(buf)[b, :, :n].view(np.uint8)
            got_s = backend.to_numpy(scales)[b, :, :n].view(np.uint32)
            np.testing.assert_array_equal(got_c, codes[b, :, :n].view(np.uint8))
            np.testing.assert_array_equal(got_s, scale[b, :, :n].view(np.uint32))


def _error(out, want) -> float:
    return float(np.abs(np.asarray(out, np.float64) - want).max())


@pytest.mark.parametrize("kv_dtype,dtype,d", [("int8", "float32", 16), ("float8_e4m3fn", "bfloat16", 16)])
def test_attention_within_the_kernel_exactness_bound(backend, kv_dtype, dtype, d):
    """Chunked prefill (T = 13, 6), small-T decode (T = 3), decode with an idle entry, and a
    long row whose decode splits (split-KV + merge): the quantized cache's output error
    against the float64 reference on its dequantized values is at most 2x the unquantized
    cache's (same kernels) or the exact result's rounding to ``dtype``, plus 1e-6."""
    rng = np.random.default_rng(2)
    B, H, G, S = 3, 2, 3, 200
    quant = gqakv.KVCache(B, H, S, d, dtype, backend=backend, kv_dtype=kv_dtype)
    plain = gqakv.KVCache(B, H, S, d, dtype, backend=backend)
    rows_k = [np.zeros((H, 0, d)) for _ in range(B)]
    rows_v = [np.zeros((H, 0, d)) for _ in range(B)]
    np_dt = NP_DTYPES[dtype]
    for T, n_new in ((13, [9, 0, 13]), (1, [1, 1, 0]), (3, [3, 2, 0]), (6, [0, 0, 6]),
                     (150, [0, 0, 150]), (1, [1, 0, 1]), (1, [0, 1, 1])):
        k = rng.standard_normal((B, H, T, d))
        v = rng.standard_normal((B, H, T, d))
        k[..., 3] *= 20.0  # an outlier channel
        k[0, 0, 0] = 0.0  # an all-zero token
        v[0, 1, 0] = 0.0
        k[-1, -1, 0] *= 1e-4 if dtype == "float16" else 1e-35  # a tiny key token
        v[0, -1, -1] *= 1e-4 if dtype == "float16" else 1e-35
        kx, vx = k.astype(np_dt), v.astype(np_dt)
        for c in (quant, plain):
            c.append(backend.from_numpy(kx, dtype), backend.from_numpy(vx, dtype), n_new)
        for b in range(B):
            rows_k[b] = np.concatenate([rows_k[b], kx[b, :, :n_new[b]].astype(np.float64)], axis=1)
            rows_v[b] = np.concatenate([rows_v[b], vx[b, :, :n_new[b]].astype(np.float64)], axis=1)
        q = rng.standard_normal((B, H * G, T, d)).astype(np_dt)
        qx = backend.from_numpy(q, dtype)
        deq = [[Q.dequantize(np, *Q.quantize(np, r.astype(np.float32), kv_dtype), kv_dtype)
                .astype(np.float64) for r in rows] for rows in (rows_k, rows_v)]
        want_q, lse_q = reference_attention(q.astype(np.float64), deq[0], deq[1], n_new)
        want_p, _ = reference_attention(q.astype(np.float64), rows_k, rows_v, n_new)
        out_q, lse = gqakv.gqa_attention(qx, quant, n_new, return_lse=True)
        out_p = gqakv.gqa_attention(qx, plain, n_new)
        out_q = backend.to_numpy(out_q).astype(np.float64)
        err_q, err_p = _error(out_q, want_q), _error(backend.to_numpy(out_p), want_p)
        err_round = _error(want_q.astype(np.float32).astype(np_dt).astype(np.float64), want_q)
        assert err_q <= 2 * max(err_p, err_round) + 1e-6, (T, n_new, err_q, err_p, err_round)
        lse = backend.to_numpy(lse)
        finite = np.isfinite(lse_q)
        np.testing.assert_array_equal(np.isfinite(lse), finite)
        np.testing.assert_allclose(lse[finite], lse_q[finite], rtol=1e-5, atol=1e-5)
        for b in range(B):
            assert (out_q[b, :, n_new[b]:] == 0).all()
    # A huge value token (1e30; 2e3 in float16): no NaN, no inf, the reference's values to
    # float32 precision. (The 2x bound above is not applied to it: errors there are one or
    # two ulps of 1e30 on either cache, a ratio decided by chance.)
    k = rng.standard_normal((B, H, 1, d))
    v = rng.standard_normal((B, H, 1, d))
    v[:, 0] *= 2e3 if dtype == "float16" else 1e30
    kx, vx = k.astype(np_dt), v.astype(np_dt)
    quant.append(backend.from_numpy(kx, dtype), backend.from_numpy(vx, dtype), [1, 1, 1])
    for b in range(B):
        rows_k[b] = np.concatenate([rows_k[b], kx[b].astype(np.float64)], axis=1)
        rows_v[b] = np.concatenate([rows_v[b], vx[b].astype(np.float64)], axis=1)
    q = rng.standard_normal((B, H * G, 1, d)).astype(np_dt)
    out = backend.to_numpy(gqakv.gqa_attention(backend.from_numpy(q, dtype), quant, [1, 1, 1]))
    deq = [[Q.dequantize(np, *Q.quantize(np, r.astype(np.float32), kv_dtype), kv_dtype)
            .astype(np.float64) for r in rows] for rows in (rows_k, rows_v)]
    want, _ = reference_attention(q.astype(np.float64), deq[0], deq[1], [1, 1, 1])
    assert np.isfinite(out.astype(np.float64)).all()
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=1e-5 if dtype == "float32" else 1e-2,
                               atol=1e-5 if dtype == "float32" else 1e-2)
    code = "gqakv_i8" if kv_dtype == "int8" else "gqakv_e4m3"
    launched = {k.split("<")[0] for k in backend.kernels if code in k}
    assert {"gqakv_decode", "gqakv_prefill", "gqakv_write_kv_quantized"} <= launched, backend.kernels
    assert any(k.startswith("gqakv_merge<") for k in backend.kernels), "no decode split"


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_row_copies_carry_scales(backend, kv_dtype):
    """fork and reorder (duplicates, a permutation cycle through the temporary) of a
    two-layer model cache on the kernels (gqakv_copy_tokens for the codes, <float, 1> for
    the scales) move each token's codes and both scales together: the result equals the
    numpy backend's cache after the same operations, byte for byte."""
    rng = np.random.default_rng(3)
    layers, B, H, S = 2, 4, 2, 24
    ref_be = gqakv.get_backend("numpy")
    caches = [gqakv.ModelKVCache(layers, B, H, S, D, "float32", backend=be, kv_dtype=kv_dtype)
              for be in (backend, ref_be)]
    lens = [5, 9, 3, 7]
    mags = np.array([1e-3, 1.0, 40.0, 1e4])[:, None, None, None]  # a scale that moved alone shows
    k = rng.standard_normal((layers, B, H, 9, D)) * mags
    v = rng.standard_normal((layers, B, H, 9, D)) * mags[::-1]
    for c, be in zip(caches, (backend, ref_be)):
        with c.step(lens) as step:
            for layer in range(layers):
                step.write(layer, be.from_numpy(k[layer], "float32"), be.from_numpy(v[layer], "float32"))
        c.fork(1, [0, 3])
        c.reorder([3, 0, 0, 2])
        c.reorder([1, 2, 3, 0])
    assert any(k.startswith("gqakv_copy_tokens<gqakv_") for k in backend.kernels), backend.kernels
    assert "gqakv_copy_tokens<float, 1>" in backend.kernels
    got, want = caches
    np.testing.assert_array_equal(got.host_lens, want.host_lens)
    for layer in range(layers):
        for b in range(B):
            n = int(want.host_lens[b])
            for name in ("k", "v", "k_scale", "v_scale"):
                g = np.asarray(backend.to_numpy(getattr(got.store, name)))[layer, b, :, :n]
                w = np.asarray(getattr(want.store, name))[layer, b, :, :n]
                assert g.tobytes() == w.tobytes(), (name, layer, b)


def test_routes_for_quantized_caches(backend):
    """The fp32-FMA kernels serve a quantized cache, the tensor-core ones say why not; a
    kv_dtype the kernels do not read goes generic with its reason."""
    from gqakv.dispatch.backend import GENERIC

    for t_q, fma, mma in ((1, "gqakv_decode", "gqakv_decode_mma"), (64, "gqakv_prefill", "gqakv_prefill_mma")):
        route = backend.route("attention", dtype="bfloat16", head_dim=128, t_q=t_q, capability=90,
                              codec="float8_e4m3fn")
        assert route.impl == fma
        assert "16-bit copy" in route.rejected[mma]
    assert backend.route("write_kv", dtype="float16", head_dim=64, codec="int8").impl == \
        "gqakv_write_kv_quantized"
    assert backend.route("copy_tokens", dtype="float16", head_dim=64, codec="int8").impl == \
        "gqakv_copy_tokens"
    route = backend.route("attention", dtype="float32", head_dim=64, t_q=1, codec="int4")
    assert route.impl == GENERIC and "kv_dtype='int4'" in route.rejected["gqakv_decode"]
