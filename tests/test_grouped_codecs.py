"""Grouped K/V codecs (issue 29): a float32 scale per block of 32 or 64 values along d,
8-bit codes or 4-bit codes two per byte, keys optionally Hadamard-rotated.

- the stored codes and scales equal the documented rule (tests/support/quantization.py,
  written apart from gqakv.storage.quantize) bit for bit, on every backend, hard tokens
  included (an outlier channel, a zero token, huge and tiny ones, NaN and inf);
- attention over chunked, ragged appends, a fork and decode equals the float64 loop
  reference over the values the cache holds (dequantized, rotated back), contiguous and
  paged, with the route each backend documents (the NumPy BLAS path on numpy, the kernels
  on numba, the generic code elsewhere);
- ``live_kv`` hands keys back in the caller's basis; bad head dims are refused before
  anything is allocated; sizes follow ``d * bits / 8 + 4 * d / g`` bytes per token-head;
- with outlier key channels the grouped schemes are more accurate than one scale per token.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import gqakv
from gqakv.storage import codecs
from gqakv.storage.store import StorageSpec

from .support.arrays import BackendArrays
from .support.quantization import (GROUPED, hard_tokens, held_grouped, reference_grouped, rotation,
                                   walsh_hadamard_rotation)
from .support.reference import reference_attention
from .support.routes import assert_product_routes
from .support.seeds import stable_seed

NAMES = list(GROUPED)
STORAGES = {"contiguous": {}, "paged": {"storage": "paged", "page_size": 4}}


def _values(cache, arrays):
    """(codes, scales) of K and of V as host arrays, each ``[B, Hkv, max_len, ...]``
    (contiguous storage)."""
    store, host = cache.store, cache.backend.to_numpy
    return [(np.asarray(host(c)), np.asarray(host(s)))
            for c, s in ((store.k, store.k_scale), (store.v, store.v_scale))]


@pytest.mark.parametrize("name", NAMES)
def test_stored_codes_and_scales_follow_the_rule(backend, name, route_spy):
    """Appends in two chunks (ragged); every live slot's codes and scales equal the rule's
    bit for bit (NaN scales where the rule gives NaN), on the append each backend documents
    (the CUDA kernels' on cupy)."""
    arrays = BackendArrays(backend)
    spy = route_spy(backend)
    dtype = "float32"
    rng = np.random.default_rng(len(name))
    B, Hkv, d = 2, 2, 64
    cache = gqakv.KVCache(B, Hkv, 16, d, dtype=dtype, backend=backend, kv_dtype=name)
    k = hard_tokens(rng, (B, Hkv, 6, d), dtype).astype(np.float32)
    v = hard_tokens(rng, (B, Hkv, 6, d), dtype).astype(np.float32)
    k[1, 0, 4, 5] = np.nan  # a NaN, and an inf: their blocks read NaN
    v[1, 1, 3, 40] = np.inf
    cache.append(arrays.asarray(k[:, :, :4], dtype), arrays.asarray(v[:, :, :4], dtype), [4, 3])
    cache.append(arrays.asarray(k[:, :, 4:], dtype), arrays.asarray(v[:, :, 4:], dtype), [2, 2])
    lens = [6, 5]
    (kc, ks), (vc, vs) = _values(cache, arrays)
    for b, L in enumerate(lens):
        taken = np.r_[0:4, 4:6] if b == 0 else np.r_[0:3, 4:6]  # row 1 took 3 then 2
        for got_c, got_s, x, keys in ((kc, ks, k, True), (vc, vs, v, False)):
            want_c, want_s, _ = reference_grouped(x[b][:, taken], name, keys)
            np.testing.assert_array_equal(got_c[b, :, :L], want_c)
            np.testing.assert_array_equal(got_s[b, :, :L], want_s)  # NaN where the rule's is
    if spy.calls:  # backends without a fused append record nothing
        assert_product_routes(spy)
    bits = GROUPED[name][0]
    if bits == 4:  # every code is a nibble 1..15 (c + 8 for c in -7..7)
        nibbles = np.concatenate([kc[0, :, :6] & 15, kc[0, :, :6] >> 4]).ravel()
        assert nibbles.min() >= 1 and nibbles.max() <= 15


@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("name", NAMES)
def test_attention_matches_the_reference_over_what_the_cache_holds(backend, name, storage,
                                                                   route_spy):
    """Chunked ragged prefill, a fork, then decode with a window and soft-cap: out and lse
    against the float64 reference over the held values (the rule's dequantized values,
    keys rotated back); each call ran the path the backend documents."""
    arrays = BackendArrays(backend)
    dtype = "float32"
    spy = route_spy(backend)
    rng = np.random.default_rng(stable_seed(name, storage))
    B, Hkv, G, d = 3, 2, 2, 64  # every grouped codec's blocks fit (one emulator library)
    cache = gqakv.KVCache(B, Hkv, 24, d, dtype=dtype, backend=backend, kv_dtype=name,
                          **STORAGES[storage])
    rows_k = [np.zeros((Hkv, 0, d)) for _ in range(B)]
    rows_v = [np.zeros((Hkv, 0, d)) for _ in range(B)]

    def step(n_new, variant):
        T = max(n_new)
        k = rng.standard_normal((B, Hkv, T, d)).astype(np.float32)
        k[..., 1] *= 20.0  # an outlier key channel
        v = rng.standard_normal((B, Hkv, T, d)).astype(np.float32)
        q = rng.standard_normal((B, Hkv * G, T, d)).astype(np.float32)
        for b, n in enumerate(n_new):
            rows_k[b] = np.concatenate([rows_k[b], held_grouped(k[b, :, :n], name, True)], axis=1)
            rows_v[b] = np.concatenate([rows_v[b], held_grouped(v[b, :, :n], name, False)], axis=1)
        cache.append(arrays.asarray(k, dtype), arrays.asarray(v, dtype), n_new)
        out, lse = gqakv.gqa_attention(arrays.asarray(q, dtype), cache, n_new, return_lse=True,
                                       **variant)
        want, want_lse = reference_attention(q.astype(np.float64), rows_k, rows_v, n_new, **variant)
        np.testing.assert_allclose(arrays.to_numpy(out), want, atol=2e-5, rtol=0)
        got_lse = arrays.to_numpy(lse)
        real = np.isfinite(want_lse)
        np.testing.assert_allclose(got_lse[real], want_lse[real], atol=2e-4, rtol=0)
        assert np.isneginf(got_lse[~real]).all()

    step([7, 3, 0], {})
    step([2, 4, 5], {"window": 6})
    cache.fork(0, [2])
    rows_k[2], rows_v[2] = rows_k[0].copy(), rows_v[0].copy()
    step([1, 1, 1], {"window": 5, "softcap": 4.0})
    assert_product_routes(spy)


@pytest.mark.parametrize("name", ["int4_g32", "int4_g32_rotated"])
def test_live_kv_gives_keys_in_the_callers_basis(name):
    """A rotated codec stores R k; ``live_kv`` hands back its values rotated back (the
    rule's dequantized values times R.T), an unrotated one the values themselves."""
    rng = np.random.default_rng(4)
    cache = gqakv.KVCache(1, 2, 8, 32, dtype="float32", backend="numpy", kv_dtype=name)
    k = rng.standard_normal((1, 2, 5, 32)).astype(np.float32)
    cache.append(k, k, [5])
    got_k, got_v = cache.live_kv(0)
    np.testing.assert_allclose(got_k, held_grouped(k[0], name, True), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(got_v, reference_grouped(k[0], name, False)[2])
    if GROUPED[name][2]:  # and keys really are stored rotated
        stored = codecs.of(name).dequantize(np, cache.store.k[0, :, :5], cache.store.k_scale[0, :, :5])
        np.testing.assert_allclose(stored, k[0].astype(np.float64) @ rotation(32), atol=0.5)
        assert not np.allclose(stored, k[0], atol=0.5)


def test_rotation_is_orthogonal_and_the_documented_one():
    """R (built here from the Hadamard matrix's formula) is orthogonal and is the library's;
    the butterflies compute x R (and y R.T) to float32 rounding, the library's bit for bit
    with this file's, whatever the batch shape."""
    from gqakv.storage import quantize

    rng = np.random.default_rng(1)
    for d in (1, 2, 8, 64, 128):
        R = rotation(d)
        np.testing.assert_allclose(R @ R.T, np.eye(d), atol=1e-12)
        np.testing.assert_array_equal(quantize.hadamard_rotation(d), R)
        x = rng.standard_normal((3, 4, d)).astype(np.float32)
        y = walsh_hadamard_rotation(x)
        np.testing.assert_allclose(y, x.astype(np.float64) @ R, atol=1e-6, rtol=0)
        np.testing.assert_allclose(walsh_hadamard_rotation(y, inverse=True), x, atol=1e-6, rtol=0)
        np.testing.assert_array_equal(quantize.rotate(np, x), y)
        np.testing.assert_array_equal(quantize.rotate(np, x[1:2, 1:]), y[1:2, 1:])  # shape-blind
        np.testing.assert_array_equal(quantize.rotate(np, y, inverse=True),
                                      walsh_hadamard_rotation(y, inverse=True))


@pytest.mark.parametrize("name,d,words", [
    ("int8_g32", 48, "head_dim=48 is not a multiple of 32"),
    ("int4_g64", 96, "head_dim=96 is not a multiple of 64"),
    ("int4_g32_rotated", 96, "head_dim=96 is not a power of two"),
])
def test_head_dims_the_blocks_do_not_fit_are_refused(name, d, words):
    for make in (lambda: gqakv.KVCache(1, 1, 8, d, kv_dtype=name, backend="numpy"),
                 lambda: gqakv.KVCache(1, 1, 8, d, kv_dtype=name, backend="numpy", storage="paged",
                                       page_size=4),
                 lambda: gqakv.ModelKVCache(2, 1, 1, 8, d, kv_dtype=name, backend="numpy")):
        with pytest.raises(ValueError, match=words):
            make()


@pytest.mark.parametrize("name", NAMES)
def test_bytes_per_token_head(name):
    """``d * bits / 8`` bytes of codes plus a float32 scale per block, for K and for V; a
    cache's nbytes and the sizing functions agree."""
    bits, g, _ = GROUPED[name]
    d, Hkv = 128, 8
    per_head = d * bits // 8 + 4 * d // g
    assert codecs.of(name).bytes_per_token_head(d, 0) == per_head
    spec = StorageSpec.of("bfloat16", kv_dtype=name)
    assert spec.nbytes(10, Hkv, d) == 10 * 2 * Hkv * per_head
    cache = gqakv.KVCache(2, Hkv, 16, d, dtype="bfloat16", kv_dtype=name, backend="numpy")
    assert cache.nbytes == 2 * 16 * 2 * Hkv * per_head
    from gqakv.storage.sizing import PRESETS

    llama = PRESETS["llama-3.1-8b"]
    assert llama.bytes_per_token("bfloat16", name) == 2 * 32 * 8 * per_head


def test_the_routes_name_the_paths():
    """numpy reads the grouped codes on the BLAS path, numba in its kernels (a key block
    decoded at a time); CuPy's fp32-FMA kernels read them and its row copy moves them (the
    tensor-core ones refuse them by name, as does every kernel at a head dim that splits a
    block)."""
    from gqakv_backends.cupy_backend import routing as cupy_routing  # no CuPy needed

    from gqakv.dispatch.request import Request

    for name in NAMES:
        request = Request("attention", dtype="float32", head_dim=64, t_q=1, codec=name)
        assert gqakv.get_backend("numpy").route(request).impl == "numpy BLAS"
        for layout in ("contiguous", "paged"):
            assert gqakv.get_backend("numba").route(request.with_(layout=layout)).impl == "numba kernel"
        cupy = cupy_routing.route_attention(request)
        assert cupy.impl == "gqakv_decode", cupy
        assert f"kv_dtype={name!r}" in cupy.rejected["gqakv_decode_mma"]
        prefill = cupy_routing.route_attention(request.with_(t_q=64, dtype="bfloat16"))
        assert prefill.impl == "gqakv_prefill", prefill
        assert f"kv_dtype={name!r}" in prefill.rejected["gqakv_prefill_mma"]
        write = cupy_routing.route_write_kv(Request("write_kv", dtype="float32", head_dim=64, codec=name))
        assert write.impl == "gqakv_write_kv_quantized", write
        copy = cupy_routing.route_copy_tokens(Request("copy_tokens", dtype="float32", head_dim=64, codec=name))
        assert copy.impl == "gqakv_copy_tokens", copy
        split = cupy_routing.route_attention(request.with_(head_dim=96))  # 96 % 64: a split block
        split_copy = cupy_routing.route_copy_tokens(Request("copy_tokens", dtype="float32", head_dim=96, codec=name))
        if GROUPED[name][1] == 64:
            assert split.impl.startswith("generic") and "head_dim=96" in split.rejected["gqakv_decode"]
            assert split_copy.impl.startswith("generic") and "head_dim=96" in split_copy.rejected["gqakv_copy_tokens"]


def test_outlier_key_channels_cost_grouped_scales_less():
    """Decode over 512 keys with 4 key channels x30: the relative error of the output
    against an unquantized float32 cache, per scheme (each scheme's own rule): a scale per
    block of 32 beats one per token at 8 bits, and rotation beats no rotation at 4 bits."""
    rng = np.random.default_rng(7)
    B, Hkv, G, d, L = 2, 2, 4, 128, 512
    k = rng.standard_normal((B, Hkv, L, d)).astype(np.float32)
    k[..., [3, 17, 64, 100]] *= 30.0
    v = rng.standard_normal((B, Hkv, L, d)).astype(np.float32)
    q = rng.standard_normal((B, Hkv * G, 1, d)).astype(np.float32) * 0.1
    errors = {}
    for name in (None, "int8", *NAMES):
        cache = gqakv.KVCache(B, Hkv, L, d, dtype="float32", backend="numpy", kv_dtype=name)
        cache.append(k, v, [L, L])
        errors[name] = gqakv.gqa_attention(q, cache, [1, 1])  # the last token's query
    exact = errors.pop(None)
    rel = {name: float(np.sqrt(np.mean((o - exact) ** 2)) / np.sqrt(np.mean(exact ** 2)))
           for name, o in errors.items()}
    assert rel["int8_g32"] < rel["int8"], rel
    assert rel["int4_g32_rotated"] < rel["int4_g32"] < rel["int4_g64"], rel
    assert all(math.isfinite(e) for e in rel.values())
