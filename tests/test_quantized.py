"""The quantized (int8 / float8_e4m3fn) KV cache: the scheme's exact rules, the cache on
every backend against the float64 reference on the dequantized values, the error the
quantization itself costs, row operations carrying scales, and bad inputs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gqakv.storage import quantize as Q

from .support.quantization import dequantized, hard_tokens, reference_quantize
from .support.tolerance import max_error, round_to

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


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("ns", NAMESPACES, ids=[n[0] for n in NAMESPACES])
def test_quantize_follows_the_rule_exactly(ns, kv_dtype):
    _, xp, to_xp, to_np = ns
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, 64)).astype(np.float32) * rng.uniform(1e-3, 1e3, (3, 5, 1)).astype(np.float32)
    x[0, 0] = 0.0  # an all-zero token
    x[1, 2, 7] = 40.0  # an outlier channel
    codes, scale = Q.quantize(xp, to_xp(x), kv_dtype)
    want_codes, want_scale = reference_quantize(x, kv_dtype)
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


# -- the cache on every backend ------------------------------------------------------------------

import math  # noqa: E402

import gqakv  # noqa: E402
from gqakv.storage import store as store_module  # noqa: E402

from gqakv.ops.attention import attention_array_api  # noqa: E402
from gqakv.core.inputs import validate_attention  # noqa: E402

from .support.arrays import BackendArrays  # noqa: E402
from .support.reference import reference_attention  # noqa: E402


def _dtypes_of(backend) -> list[str]:
    return [d for d in ("float32", "bfloat16") if d in backend.dtypes]


def _fill(arrays, cache, chunks, dtype):
    """Append each (k, v, n_new) chunk; returns per-row lists of the appended input values
    (as the input dtype holds them) for the reference."""
    B = cache.batch
    rows_k = [[] for _ in range(B)]
    rows_v = [[] for _ in range(B)]
    for k, v, n_new in chunks:
        kx, vx = arrays.asarray(k, dtype), arrays.asarray(v, dtype)
        cache.append(kx, vx, n_new)
        k_in, v_in = arrays.to_numpy(kx, np.float32), arrays.to_numpy(vx, np.float32)
        for b in range(B):
            rows_k[b].append(k_in[b, :, :n_new[b]])
            rows_v[b].append(v_in[b, :, :n_new[b]])
    cat = [np.concatenate(r, axis=1) for r in rows_k], [np.concatenate(r, axis=1) for r in rows_v]
    return cat


def _assert_within_quantization(arrays, qx, plain, n_new, dtype, out_q, lse, want_q, lse_q, want_p):
    """A quantized cache's attention (``out_q``, ``lse``) against the float64 reference on its
    dequantized values (``want_q``, ``lse_q``): its error at most twice that of the same
    computation (the generic path, which every backend runs for quantized storage) over the
    unquantized cache ``plain`` (reference ``want_p``), or of the exact result rounded to
    ``dtype``, plus 1e-6; the lse where finite within 1e-5, -inf in the same places."""
    inp = validate_attention(plain, qx, n_new)
    out_p = attention_array_api(qx, plain.store, inp, inp.params, return_lse=False)
    err_q = max_error(arrays.to_numpy(out_q), want_q)
    err_p = max_error(arrays.to_numpy(out_p), want_p)
    # No output in ``dtype`` beats the exact result rounded to ``dtype``: over a bfloat16
    # cache a one-hot softmax returns a stored (bfloat16) value exactly, while a dequantized
    # value is float32 and must be rounded.
    err_round = max_error(round_to(want_q, dtype), want_q)
    assert err_q <= 2 * max(err_p, err_round) + 1e-6, (dtype, n_new, err_q, err_p, err_round)
    lse = arrays.to_numpy(lse)
    finite = np.isfinite(lse_q)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], lse_q[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_attention_matches_reference_on_dequantized_values(backend, kv_dtype):
    """Ragged rows, padded query slots, an idle entry, a chunked prefill then a decode,
    hard tokens, dead slots poisoned with NaN: the output over a quantized cache matches
    the float64 reference on the dequantized values within 2x the error the same call
    shows over an unquantized cache of ``dtype`` (plus 1e-6), and the stored codes and
    scales are exactly the rule's."""
    arrays = BackendArrays(backend)
    rng = np.random.default_rng(5)
    B, hkv, G, d, S = 3, 2, 3, 16, 40
    for dtype in _dtypes_of(backend):
        quant = gqakv.KVCache(B, hkv, S, d, dtype, backend=backend, kv_dtype=kv_dtype)
        plain = gqakv.KVCache(B, hkv, S, d, dtype, backend=backend)
        for c in (quant, plain):
            c.store.fill(math.nan)
        chunks = []
        for n_new, T in (([9, 0, 13], 13), ([4, 3, 0], 5), ([1, 1, 1], 1)):
            k = hard_tokens(rng, (B, hkv, T, d), dtype)
            v = hard_tokens(rng, (B, hkv, T, d), dtype)
            chunks.append((k, v, n_new))
        ins_q = _fill(arrays, quant, chunks, dtype)
        ins_p = _fill(arrays, plain, chunks, dtype)
        # The stored codes and scales are the rule's, token by token.
        for b in range(B):
            L = int(quant.host_lens[b])
            for buf, scales, x in ((quant.k, quant.store.k_scale, ins_q[0][b]),
                                   (quant.v, quant.store.v_scale, ins_q[1][b])):
                want_codes, want_scale = reference_quantize(x, kv_dtype)
                np.testing.assert_array_equal(arrays.to_numpy(buf[b, :, :L, :], np.float64),
                                              want_codes.astype(np.float64))
                np.testing.assert_array_equal(arrays.to_numpy(scales[b, :, :L], np.float32),
                                              want_scale)
        for n_new, T in (([4, 3, 0], 5), ([1, 1, 1], 1), ([2, 0, 9], 9)):
            q = rng.standard_normal((B, hkv * G, T, d))
            qx = arrays.asarray(q, dtype)
            q_in = arrays.to_numpy(qx)
            deq_k = [dequantized(x, kv_dtype) for x in ins_q[0]]
            deq_v = [dequantized(x, kv_dtype) for x in ins_q[1]]
            want_q, lse_q = reference_attention(q_in, deq_k, deq_v, n_new)
            want_p, _ = reference_attention(q_in, ins_p[0], ins_p[1], n_new)
            out_q, lse = gqakv.gqa_attention(qx, quant, n_new, return_lse=True)
            _assert_within_quantization(arrays, qx, plain, n_new, dtype, out_q, lse, want_q, lse_q, want_p)
            assert not np.isnan(arrays.to_numpy(out_q)).any()
            # Padded query slots are exactly 0.
            for b in range(B):
                assert (arrays.to_numpy(out_q)[b, :, n_new[b]:] == 0).all()
            # live_kv reads the dequantized values.
        for b in range(B):
            k_live, v_live = quant.live_kv(b)
            np.testing.assert_array_equal(arrays.to_numpy(k_live, np.float32), deq_k[b])
            np.testing.assert_array_equal(arrays.to_numpy(v_live, np.float32), deq_v[b])


def test_attention_reads_small_dequantized_blocks(monkeypatch):
    """On the generic path a long row is dequantized span by span (never a whole-row
    copy); the many-block online softmax still matches the reference."""
    backend = gqakv.get_backend("torch")
    rng = np.random.default_rng(6)
    B, hkv, G, d, L = 1, 2, 2, 8, 300
    monkeypatch.setattr(store_module, "DEQUANT_BLOCK_ELEMENTS", 32 * hkv * d)
    cache = gqakv.KVCache(B, hkv, L, d, "float32", backend=backend, kv_dtype="int8")
    k, v = rng.standard_normal((2, B, hkv, L, d)).astype(np.float32)
    cache.append(backend.from_numpy(k), backend.from_numpy(v), [L])
    spans = []
    blocks = type(cache.store).blocks

    def spy(self, row, j0, j1):
        spans.append(j1 - j0)
        return blocks(self, row, j0, j1)

    monkeypatch.setattr(type(cache.store), "blocks", spy)
    q = rng.standard_normal((B, hkv * G, 5, d)).astype(np.float32)
    out = backend.to_numpy(gqakv.gqa_attention(backend.from_numpy(q), cache, [5]))
    assert spans and max(spans) <= 32 and len(spans) >= L // 32
    want, _ = reference_attention(q, [dequantized(k[0], "int8")], [dequantized(v[0], "int8")], [5])
    np.testing.assert_allclose(out, want, atol=2e-6)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_row_operations_carry_scales(backend, kv_dtype):
    """reorder (duplicates and a permutation cycle, through the temporary), fork, truncate,
    reset and appends after them: every row reads back exactly the dequantized values of
    the tokens it should hold, and attention over it matches the reference."""
    arrays = BackendArrays(backend)
    rng = np.random.default_rng(7)
    B, hkv, d, S = 4, 2, 8, 24
    cache = gqakv.KVCache(B, hkv, S, d, "float32", backend=backend, kv_dtype=kv_dtype)
    lens = [5, 9, 3, 7]
    # Each row's tokens get a distinct magnitude, so a scale that moved without its codes shows.
    k = rng.standard_normal((B, hkv, 9, d)) * np.array([1, 2, 4, 8])[:, None, None, None]
    v = rng.standard_normal((B, hkv, 9, d)) * np.array([3, 6, 12, 24])[:, None, None, None]
    cache.append(arrays.asarray(k, "float32"), arrays.asarray(v, "float32"), lens)
    model = [(dequantized(k[b, :, :lens[b]].astype(np.float32), kv_dtype),
              dequantized(v[b, :, :lens[b]].astype(np.float32), kv_dtype)) for b in range(B)]

    def check():
        for b in range(B):
            kb, vb = cache.live_kv(b)
            np.testing.assert_array_equal(arrays.to_numpy(kb, np.float32), model[b][0])
            np.testing.assert_array_equal(arrays.to_numpy(vb, np.float32), model[b][1])

    cache.reorder([1, 2, 0, 1])  # a cycle 0 <- 1 <- 2 <- 0 and a duplicate
    model = [model[1], model[2], model[0], model[1]]
    check()
    cache.fork(2, [0, 3])
    model = [model[2], model[1], model[2], model[2]]
    check()
    cache.truncate([0], [2])
    model[0] = (model[0][0][:, :2], model[0][1][:, :2])
    cache.reset([3])
    model[3] = (model[3][0][:, :0], model[3][1][:, :0])
    check()
    k2 = rng.standard_normal((B, hkv, 2, d)) * 2
    v2 = rng.standard_normal((B, hkv, 2, d)) * 2
    cache.append(arrays.asarray(k2, "float32"), arrays.asarray(v2, "float32"), [2, 2, 1, 2])
    for b, n in enumerate([2, 2, 1, 2]):
        model[b] = tuple(np.concatenate([m, dequantized(x[b, :, :n].astype(np.float32), kv_dtype)], axis=1)
                         for m, x in zip(model[b], (k2, v2)))
    check()
    q = rng.standard_normal((B, hkv * 2, 2, d))
    out = arrays.to_numpy(gqakv.gqa_attention(arrays.asarray(q, "float32"), cache, [2, 2, 1, 2]))
    want, _ = reference_attention(arrays.to_numpy(arrays.asarray(q, "float32")),
                                  [m[0] for m in model], [m[1] for m in model], [2, 2, 1, 2])
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_model_cache_step_and_row_ops(backend, kv_dtype):
    """ModelKVCache(kv_dtype=...): Step.attend on every layer matches the reference on the
    dequantized values; a layer view reads like a quantized KVCache; reorder moves every
    layer's scales."""
    arrays = BackendArrays(backend)
    rng = np.random.default_rng(8)
    layers, B, hkv, G, d, S = 2, 2, 1, 2, 8, 16
    model = gqakv.ModelKVCache(layers, B, hkv, S, d, "float32", backend=backend, kv_dtype=kv_dtype)
    assert model.kv_dtype == kv_dtype and model.layer(1).kv_dtype == kv_dtype
    assert model.layer(0).dtype == "float32"
    hist = [[None] * B for _ in range(layers)]
    for n_new, T in (([5, 3], 5), ([1, 1], 1)):
        q = rng.standard_normal((B, hkv * G, T, d))
        with model.step(n_new) as step:
            for l in range(layers):
                k, v = rng.standard_normal((2, B, hkv, T, d)) * (l + 1)
                for b in range(B):
                    new = (dequantized(k[b, :, :n_new[b]].astype(np.float32), kv_dtype),
                           dequantized(v[b, :, :n_new[b]].astype(np.float32), kv_dtype))
                    hist[l][b] = new if hist[l][b] is None else tuple(
                        np.concatenate([h, x], axis=1) for h, x in zip(hist[l][b], new))
                out = step.attend(l, arrays.asarray(q, "float32"), arrays.asarray(k, "float32"),
                                  arrays.asarray(v, "float32"))
                want, _ = reference_attention(q.astype(np.float32), [h[0] for h in hist[l]],
                                              [h[1] for h in hist[l]], n_new)
                np.testing.assert_allclose(arrays.to_numpy(out), want, atol=1e-5)
    model.reorder([1, 0])
    for l in range(layers):
        for b in range(B):
            kb, vb = model.live_kv(l, b)
            np.testing.assert_array_equal(arrays.to_numpy(kb, np.float32), hist[l][1 - b][0])
            np.testing.assert_array_equal(arrays.to_numpy(vb, np.float32), hist[l][1 - b][1])


def test_emulated_cupy_kernels_read_contiguous_and_paged_quantized_storage():
    """The cupy kernels read codes and scales of an 8-bit cache, contiguous (writes, copies
    and attention all launch) or paged (the append and attention launch through the page
    table; a paged reorder moves pages by bookkeeping, no launch)."""
    from .cuda_emu.emulated_backend import EmulatedCupyBackend

    backend = EmulatedCupyBackend()
    if backend.unavailable_reason():
        pytest.skip(backend.unavailable_reason())
    from gqakv_backends.cupy_backend import _store_rejection

    x = backend.from_numpy(np.ones((2, 1, 3, 16), np.float32))
    q = backend.from_numpy(np.ones((2, 2, 1, 16), np.float32))
    cache = gqakv.KVCache(2, 1, 8, 16, "float32", backend=backend, kv_dtype="int8")
    assert _store_rejection(cache.store) is None
    for op in (lambda: cache.append(x, x, [3, 2]), lambda: cache.reorder([1, 0]),
               lambda: gqakv.gqa_attention(q, cache, [1, 1])):
        before = backend.launches
        op()
        assert backend.launches > before
    paged = gqakv.PagedKVCache(2, 1, 8, 16, "float32", backend=backend, page_size=4, kv_dtype="int8")
    assert _store_rejection(paged.store) is None
    for op in (lambda: paged.append(x, x, [3, 2]), lambda: gqakv.gqa_attention(q, paged, [1, 1])):
        before = backend.launches
        op()
        assert backend.launches > before
    before = backend.launches
    paged.reorder([1, 0])
    assert backend.launches == before


# -- sizes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_bytes_count_codes_and_scales(kv_dtype):
    B, hkv, S, d = 3, 2, 10, 16
    cache = gqakv.KVCache(B, hkv, S, d, "bfloat16", backend="numpy", kv_dtype=kv_dtype)
    want = 2 * B * S * hkv * (d + 4)
    assert cache.nbytes == want == gqakv.KVCache.nbytes_for(B, hkv, S, d, "bfloat16", kv_dtype=kv_dtype)
    actual = sum(a.nbytes for a in (cache.store.k, cache.store.v, cache.store.k_scale, cache.store.v_scale))
    assert actual == want
    model = gqakv.ModelKVCache(4, B, hkv, S, d, "float16", backend="numpy", kv_dtype=kv_dtype)
    assert model.nbytes == 4 * want == gqakv.ModelKVCache.nbytes_for(4, B, hkv, S, d, kv_dtype=kv_dtype)
    # Llama-3.1-8B: 2 x 8 x (128 + 4) x 32 layers per token, against 131,072 for bfloat16.
    assert gqakv.ModelKVCache.nbytes_for(32, 1, 8, 1, 128, "bfloat16", kv_dtype=kv_dtype) == 67_584


# -- bad inputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, words", [
    ({"kv_dtype": "int4"}, ValueError, ["kv_dtype='int4'", "allowed: None, 'int8', 'float8_e4m3fn'"]),
    ({"kv_dtype": "float8_e5m2"}, ValueError, ["kv_dtype='float8_e5m2'", "allowed"]),
    ({"kv_dtype": 8}, ValueError, ["kv_dtype=8"]),
    ({"kv_dtype": "int8", "dtype": "float64"}, ValueError, ["kv_dtype='int8'", "dtype=float64",
                                                             "float32, float16 or bfloat16"]),
])
def test_bad_kv_dtype_is_named(kwargs, error, words):
    args = dict(dtype="float32", backend="numpy")
    args.update(kwargs)
    with pytest.raises(error) as info:
        gqakv.KVCache(2, 1, 4, 8, **args)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    with pytest.raises(error):
        gqakv.ModelKVCache(2, 2, 1, 4, 8, **args)
    with pytest.raises(error):
        gqakv.KVCache.nbytes_for(2, 1, 4, 8, args["dtype"], kv_dtype=args["kv_dtype"])
    with pytest.raises(error):
        gqakv.PagedKVCache(2, 1, 4, 8, **args)


def test_kv_dtype_objects_are_accepted():
    import torch

    for obj, name in ((np.int8, "int8"), (torch.int8, "int8"), (ml_dtypes.float8_e4m3fn, "float8_e4m3fn"),
                      (torch.float8_e4m3fn, "float8_e4m3fn")):
        assert gqakv.KVCache(1, 1, 2, 4, backend="numpy", kv_dtype=obj).kv_dtype == name


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_bad_append_changes_nothing(kv_dtype):
    """Rejected appends (a quantized dtype as input, too many tokens) leave codes, scales
    and lengths as they were: validation runs before quantizing."""
    cache = gqakv.KVCache(2, 1, 4, 8, "float32", backend="numpy", kv_dtype=kv_dtype)
    x = np.random.default_rng(9).standard_normal((2, 1, 3, 8)).astype(np.float32)
    cache.append(x, x, [3, 1])
    st = cache.store
    before = [a.copy() for a in (st.k, st.v, st.k_scale, st.v_scale)]
    with pytest.raises(TypeError, match="k_new has dtype int8, the cache holds float32"):
        cache.append(x.astype(np.int8), x, [1, 1])
    with pytest.raises(ValueError, match="max_len=4"):
        cache.append(x, x, [2, 3])
    for a, b in zip((st.k, st.v, st.k_scale, st.v_scale), before):
        assert a.tobytes() == b.tobytes()
    assert cache.host_lens.tolist() == [3, 1]


def test_sizing_counts_scales(capsys):
    from gqakv.storage import sizing
    from gqakv.tools.cli import main

    cfg = sizing.get_preset("llama-3.1-8b")
    assert cfg.bytes_per_token("bfloat16") == 131_072
    for kv_dtype in KV_DTYPES:
        assert cfg.bytes_per_token("bfloat16", kv_dtype) == 2 * 32 * 8 * (128 + 4) == 67_584
        assert sizing.cache_bytes(cfg, max_len=4096, batch=2, kv_dtype=kv_dtype) == 2 * 4096 * 67_584
        assert sizing.max_batch(cfg, max_len=4096, budget="80GiB", kv_dtype=kv_dtype) == \
            80 * 2**30 // (4096 * 67_584)
        assert sizing.max_len_for(cfg, batch=1, budget=67_584 * 10 + 5, kv_dtype=kv_dtype) == 10
    assert main(["size", "llama-3.1-8b", "--kv-dtype", "int8"]) == 0
    out = capsys.readouterr().out
    assert "per token : 67,584 bytes" in out and "0.52x of bfloat16's 131,072" in out
    assert "276,824,064 bytes" in out  # 4,096 tokens
    assert main(["size", "--dtype", "float64", "--kv-dtype", "int8"]) == 2
    assert "kv_dtype='int8' needs dtype float32" in capsys.readouterr().err


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("split", ["one item", "heads and keys split, small blocks"])
@pytest.mark.parametrize("page_size", [None, 3, 16], ids=["contiguous", "paged3", "paged16"])
def test_numpy_quantized_path_under_every_split(kv_dtype, split, page_size, monkeypatch):
    """The NumPy fast path (the item kernel through ``numpy_readers.Coded``, dequantizing
    each block, over contiguous rows or pages) under forced splits, tiny blocks and
    gathers of a few pages, against the reference on the dequantized values; the numpy
    backend routes a quantized cache, contiguous or paged, to it."""
    from gqakv.core.inputs import validate_attention
    from gqakv_backends import numpy_readers
    from gqakv_backends.numpy_attention import attention_store as attention_numpy_quantized

    rng = np.random.default_rng(10)
    B, hkv, G, d, S = 3, 2, 4, 16, 300
    if page_size is None:
        cache = gqakv.KVCache(B, hkv, S, d, "bfloat16", backend="numpy", kv_dtype=kv_dtype)
    else:
        monkeypatch.setattr(numpy_readers, "GATHER_ELEMENTS", hkv * d * 4 * page_size)
        cache = gqakv.PagedKVCache(B, hkv, S, d, "bfloat16", backend="numpy", kv_dtype=kv_dtype,
                                   page_size=page_size)
        assert isinstance(numpy_readers.reader_of(cache.store, [0]).base, numpy_readers.Pages)
    cache.store.fill(np.nan)
    lens = [290, 0, 41]
    k = hard_tokens(rng, (B, hkv, 290, d), "bfloat16").astype(ml_dtypes.bfloat16)
    v = hard_tokens(rng, (B, hkv, 290, d), "bfloat16").astype(ml_dtypes.bfloat16)
    for a, b in ((0, 20), (20, 290)):  # two appends: the rows' pages interleave in the pool
        cache.append(k[:, :, a:b], v[:, :, a:b], np.clip(np.asarray(lens) - a, 0, b - a))
    n_new = [5, 0, 3]
    q = rng.standard_normal((B, hkv * G, 5, d)).astype(ml_dtypes.bfloat16)
    blocking = {} if split == "one item" else dict(workers=3, min_key_split=16,
                                                    score_block_elements=256, query_block=2)
    inputs = validate_attention(cache, q, n_new)
    out, lse = attention_numpy_quantized(q, cache.store, inputs, inputs.params, return_lse=True,
                                         **blocking)
    deq = [(dequantized(k[b, :, :lens[b]].astype(np.float32), kv_dtype),
            dequantized(v[b, :, :lens[b]].astype(np.float32), kv_dtype)) for b in range(B)]
    want, want_lse = reference_attention(q.astype(np.float32), [x[0] for x in deq],
                                         [x[1] for x in deq], n_new)
    err_round = max_error(round_to(want, "bfloat16"), want)
    assert max_error(out.astype(np.float64), want) <= 2 * err_round + 1e-6
    finite = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-5)
    # (numba decodes quantized storage in its own kernels: tests/test_numba_storage.py)
    for name in ("numpy",):
        backend = gqakv.get_backend(name) if not gqakv.get_backend(name).unavailable_reason() else None
        if backend is None:
            continue
        assert backend.route("attention", layout=cache.store.kind, codec=kv_dtype,
                             t_q=5).impl == "numpy BLAS"
        got = backend.attention(q, cache.store, inputs, inputs.params, return_lse=False)
        np.testing.assert_array_equal(got.astype(np.float64),
                                      attention_numpy_quantized(q, cache.store, inputs, inputs.params,
                                                                return_lse=False).astype(np.float64))


def test_quantization_error_against_the_float32_cache():
    """What the 8 bits cost (docs/guides/storage.md, "8-bit cache"): decode over Gaussian K/V against the
    same call over an unquantized float32 cache. Measured rms relative error ~0.9% (int8)
    and ~3.8% (e4m3) at this shape (seeded: the same every run); the upper bounds leave
    about 1.5x, so they catch a gross change of the error (e.g. half the int8 levels),
    not a subtle one (the exact rule is tested above)."""
    rng = np.random.default_rng(12)
    B, hkv, G, d, L = 2, 4, 4, 128, 512
    k, v = rng.standard_normal((2, B, hkv, L, d)).astype(np.float32)
    q = rng.standard_normal((B, hkv * G, 1, d)).astype(np.float32)
    plain = gqakv.KVCache(B, hkv, L, d, "float32", backend="numpy")
    plain.append(k, v, [L] * B)
    want = gqakv.gqa_attention(q, plain, [1] * B).astype(np.float64)
    rms = {}
    for kv_dtype in KV_DTYPES:
        cache = gqakv.KVCache(B, hkv, L, d, "float32", backend="numpy", kv_dtype=kv_dtype)
        cache.append(k, v, [L] * B)
        err = gqakv.gqa_attention(q, cache, [1] * B).astype(np.float64) - want
        rms[kv_dtype] = np.sqrt((err ** 2).mean() / (want ** 2).mean())
    assert 1e-3 < rms["int8"] < 0.014, rms
    assert 1e-2 < rms["float8_e4m3fn"] < 0.055, rms


# -- paged quantized storage ---------------------------------------------------------------------


def _page_slots(arrays, pool, table, row: int, L: int) -> np.ndarray:
    """Row ``row``'s first L tokens read from ``pool`` ``[num_pages, Hkv, P, ...]`` through
    its pages, as float64 ``[Hkv, L, ...]`` (codes or scales, on the host)."""
    host = arrays.to_numpy(pool, np.float64)
    pages = host[table.row_pages(row)]  # [n_pages, Hkv, P, ...]
    joined = np.concatenate(list(pages), axis=1) if len(pages) else host[:0].sum(axis=0)
    return joined[:, :L]


@pytest.mark.parametrize("page_size", [1, 5])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_paged_quantized_cache(backend, kv_dtype, page_size):
    """PagedKVCache(kv_dtype=...): ragged chunks of hard tokens, a fork (rows sharing a
    partly filled last page), appends into the shared page (copy on write must carry the
    scales), a reorder with duplicates, a truncate inside a shared page and appends after
    it. After every operation: each row's codes and scales, read through its pages, are
    the rule's for the tokens it holds; live_kv gives exactly their dequantized values;
    the pool's accounting is sound. Every attention call matches the float64 reference on
    the dequantized values within 2x the error the same call shows over an unquantized
    paged cache of ``dtype`` (or the output dtype's rounding) plus 1e-6."""
    from .support.direct import Direct
    from .support.pages import audit

    arrays = BackendArrays(backend)
    rng = np.random.default_rng(11)
    B, hkv, G, d, S = 3, 2, 3, 16, 40
    for dtype in _dtypes_of(backend):
        quant = gqakv.PagedKVCache(B, hkv, S, d, dtype, backend=backend, page_size=page_size,
                                   kv_dtype=kv_dtype)
        plain = gqakv.PagedKVCache(B, hkv, S, d, dtype, backend=backend, page_size=page_size)
        assert quant.kv_dtype == kv_dtype and plain.kv_dtype is None
        for c in (quant, plain):
            c.store.fill(math.nan)
        direct = Direct(B, hkv, d)  # the input values (float32) each row holds

        def check_rows():
            audit(quant)
            np.testing.assert_array_equal(quant.host_lens, [k.shape[1] for k in direct.k])
            for b in range(B):
                L = int(quant.host_lens[b])
                for pool, scales, x in ((quant.store.k, quant.store.k_scale, direct.k[b]),
                                        (quant.store.v, quant.store.v_scale, direct.v[b])):
                    want_codes, want_scale = reference_quantize(x, kv_dtype)
                    np.testing.assert_array_equal(_page_slots(arrays, pool, quant.store.page_table, b, L),
                                                  want_codes.astype(np.float64))
                    np.testing.assert_array_equal(_page_slots(arrays, scales, quant.store.page_table, b, L),
                                                  want_scale.astype(np.float64))
                k_live, v_live = quant.live_kv(b)
                np.testing.assert_array_equal(arrays.to_numpy(k_live, np.float32),
                                              dequantized(direct.k[b], kv_dtype))
                np.testing.assert_array_equal(arrays.to_numpy(v_live, np.float32),
                                              dequantized(direct.v[b], kv_dtype))

        def append(n_new, T):
            k = hard_tokens(rng, (B, hkv, T, d), dtype)
            v = hard_tokens(rng, (B, hkv, T, d), dtype)
            kx, vx = arrays.asarray(k, dtype), arrays.asarray(v, dtype)
            for c in (quant, plain):
                c.append(kx, vx, n_new)
            direct.append(range(B), arrays.to_numpy(kx, np.float32), arrays.to_numpy(vx, np.float32),
                          n_new)
            check_rows()

        def attend(n_new, T):
            q = rng.standard_normal((B, hkv * G, T, d))
            qx = arrays.asarray(q, dtype)
            q_in = arrays.to_numpy(qx)
            want_q, lse_q = reference_attention(q_in, [dequantized(x, kv_dtype) for x in direct.k],
                                                [dequantized(x, kv_dtype) for x in direct.v], n_new)
            want_p, _ = reference_attention(q_in, direct.k, direct.v, n_new)
            out_q, lse = gqakv.gqa_attention(qx, quant, n_new, return_lse=True)
            _assert_within_quantization(arrays, qx, plain, n_new, dtype, out_q, lse, want_q, lse_q, want_p)
            for b in range(B):
                assert (arrays.to_numpy(out_q)[b, :, n_new[b]:] == 0).all()

        append([9, 0, 13], 13)
        append([4, 3, 0], 5)
        attend([4, 3, 0], 5)
        for c in (quant, plain):
            c.fork(0, [1])  # row 0's 13 tokens: a partly filled last page at page size 5
        direct.fork(0, [1])
        check_rows()
        append([1, 1, 1], 1)  # rows 0 and 1 write into their shared last page
        attend([1, 1, 1], 1)
        for c in (quant, plain):
            c.reorder([2, 0, 0])
        direct.reorder([2, 0, 0])
        check_rows()
        for c in (quant, plain):
            c.truncate([1], [7])  # inside a page row 2 still shares
        direct.truncate([1], [7])
        check_rows()
        append([2, 5, 1], 5)
        attend([2, 5, 1], 5)
        append([1, 1, 0], 1)
        attend([1, 1, 0], 1)
        for c in (quant, plain):
            c.reset()
        direct = Direct(B, hkv, d)
        check_rows()
        assert quant.pages_used == 0


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_paged_quantized_model_cache(backend, kv_dtype):
    """A paged ModelKVCache with kv_dtype: every layer's step.attend matches the float64
    reference on the dequantized values (float32 tolerance: the generic path's float32
    accumulation), forks share pages across layers, and the pool counts scales."""
    from .support.direct import Direct
    from .support.pages import audit

    arrays = BackendArrays(backend)
    rng = np.random.default_rng(12)
    layers, B, hkv, G, d, S, P = 2, 3, 2, 2, 8, 24, 4
    cache = gqakv.ModelKVCache(layers, B, hkv, S, d, "float32", backend=backend, page_size=P,
                               num_pages=14, kv_dtype=kv_dtype)
    assert cache.store.kind == "paged" and cache.kv_dtype == kv_dtype
    assert cache.nbytes == layers * 14 * P * 2 * hkv * (d + 4)  # codes of 1 byte + a float32 scale
    cache.store.fill(math.nan)
    directs = [Direct(B, hkv, d) for _ in range(layers)]

    def step(n, T):
        data = rng.standard_normal((layers, 3, B, hkv * G, T, d)).astype(np.float32)
        with cache.step(n) as st:
            outs = [st.attend(l, arrays.asarray(data[l, 0], "float32"),
                              arrays.asarray(data[l, 1, :, :hkv], "float32"),
                              arrays.asarray(data[l, 2, :, :hkv], "float32")) for l in range(layers)]
        for l in range(layers):
            directs[l].append(range(B), data[l, 1, :, :hkv], data[l, 2, :, :hkv], n)
            deq_k = [dequantized(x.astype(np.float32), kv_dtype) for x in directs[l].k]
            deq_v = [dequantized(x.astype(np.float32), kv_dtype) for x in directs[l].v]
            want, _ = reference_attention(data[l, 0].astype(np.float64), deq_k, deq_v, n)
            np.testing.assert_allclose(arrays.to_numpy(outs[l]), want, atol=2e-5, rtol=1e-5)
            for b in range(B):
                k, v = cache.live_kv(l, b)
                np.testing.assert_array_equal(arrays.to_numpy(k, np.float32), deq_k[b])
                np.testing.assert_array_equal(arrays.to_numpy(v, np.float32), deq_v[b])
        audit(cache)

    step(np.array([6, 3, 0]), 6)
    assert cache.pages_used == 2 + 1  # once for all layers
    cache.fork(0, [2])
    for dr in directs:
        dr.fork(0, [2])
    step(np.array([2, 1, 3]), 3)  # rows 0 and 2 write into their shared last page
    cache.reorder([2, 2, 1])
    for dr in directs:
        dr.reorder([2, 2, 1])
    step(np.array([1, 1, 1]), 1)


# -- transformers: GqakvCache(kv_dtype=...) ------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_transformers_cache_with_kv_dtype(kv_dtype, monkeypatch):
    """A tiny Llama generating through GqakvCache(kv_dtype=...) equals the same model on
    transformers' sdpa attention with each K/V token replaced by its dequantized value
    (the rule, applied to the whole DynamicCache every call: per-token, so the past comes
    out the same): the same greedy tokens, logits within float32 rounding, far closer
    than either is to the unquantized model (so the quantization did happen)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from gqakv.integrations.transformers import GqakvCache

    from .support.hf import greedy_generate, tiny_llama, token_ids

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: torch's spinning pool only slows it
    try:
        model, ids = tiny_llama(torch.float32), token_ids(batch=2, length=9, seed=3)
        plain_seq, plain_logits = greedy_generate(model, ids, "sdpa", n=8)
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

        def held(x):
            return torch.from_numpy(dequantized(x.detach().numpy(), kv_dtype))

        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa",
                            lambda module, q, k, v, *a, **kw: sdpa(module, q, held(k), held(v), *a, **kw))
        want_seq, want_logits = greedy_generate(model, ids, "sdpa", n=8)
        monkeypatch.undo()
        cache = GqakvCache(model.config, max_cache_len=17, kv_dtype=kv_dtype)
        got_seq, got_logits = greedy_generate(model, ids, "gqakv", n=8, cache=cache)
    finally:
        torch.set_num_threads(threads)
    assert all(kv.kv_dtype == kv_dtype and kv.host_lens.tolist() == [9 + 7] * 2 for kv in cache.kv_caches)
    assert torch.equal(got_seq, want_seq)
    err = (got_logits - want_logits).abs().max().item()
    quantization = (want_logits - plain_logits).abs().max().item()
    print(f"{kv_dtype}: logits vs fake-quantized sdpa {err:.3g}, vs unquantized {quantization:.3g}")
    assert err <= 1e-5 and quantization >= 100 * err, (err, quantization)


def test_transformers_cache_refuses_a_bad_kv_dtype():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gqakv.integrations.transformers import CACHE_KWARG, GqakvCache

    from .support.hf import tiny_llama, token_ids

    model = tiny_llama(torch.float32)
    with pytest.raises(ValueError, match=r"kv_dtype='int4'.*allowed"):
        GqakvCache(model.config, max_cache_len=8, kv_dtype="int4")
    model = tiny_llama(torch.float64)
    model.set_attn_implementation("gqakv")
    with pytest.raises(ValueError, match="dtype=float64"), torch.no_grad():
        model(token_ids(batch=1, length=3), **{CACHE_KWARG: GqakvCache(model.config, 8, kv_dtype="int8")})
