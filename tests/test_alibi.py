"""ALiBi against an independent implementation: transformers' eager BLOOM attention.

BLOOM builds its bias with ``build_alibi_tensor`` (slope_h x key position, the slopes
of its geometric rule, non-powers of two included) and adds it to ``q . k / sqrt(d)``
before its causal mask and softmax; the code below does exactly that in float64 torch
(the bias rebuilt in float64 from BLOOM's slopes, and checked equal to BLOOM's float32 one),
with each query head reading its KV head (h // G) by indexing. gqakv takes the slopes
and adds ``slope_h x (j - p)``: the same softmax (a per-query constant apart), so the
outputs must agree, and the LSE differs by exactly ``slope_h x p``.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import gqakv

from .support.arrays import BackendArrays

torch = pytest.importorskip("torch")
bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")


def _bloom_eager(q, k_rows, v_rows, n_new, slopes_heads: int):
    """transformers' BLOOM eager attention (its alibi tensor + scaled scores, causal mask,
    softmax) per row, in float64: q [B, Hq, T, d]; k_rows[b], v_rows[b] [Hkv, L_b, d].
    Returns out [B, Hq, T, d] and lse [B, Hq, T] (of BLOOM's own scores; padded: 0, -inf)."""
    B, Hq, T, d = q.shape
    out = np.zeros((B, Hq, T, d))
    lse = np.full((B, Hq, T), -math.inf)
    for b in range(B):
        k = torch.from_numpy(np.asarray(k_rows[b], np.float64))
        v = torch.from_numpy(np.asarray(v_rows[b], np.float64))
        Hkv, L, _ = k.shape
        n = int(n_new[b])
        if n == 0:
            continue
        # BLOOM's bias [Hq, 1, L], slope_h x key position: formed in float32 by
        # build_alibi_tensor, so it is rebuilt here in float64 from its slopes (position 1)
        # and its positions (cumsum of the mask - 1), and checked against BLOOM's own.
        ones = torch.ones(1, L, dtype=torch.int64)
        theirs = bloom.build_alibi_tensor(ones, slopes_heads, torch.float64)
        slopes = bloom.build_alibi_tensor(torch.ones(1, 2, dtype=torch.int64), slopes_heads,
                                          torch.float64)[:, 0, 1]
        alibi = slopes[:, None, None] * (ones.cumsum(dim=-1) - 1).to(torch.float64)[None]
        torch.testing.assert_close(theirs, alibi, atol=0, rtol=2 ** -23)
        kv = torch.arange(Hq) // (Hq // Hkv)  # query head h reads KV head h // G
        qb = torch.from_numpy(np.asarray(q[b, :, :n], np.float64))  # [Hq, n, d]
        scores = alibi + (qb @ k[kv].transpose(1, 2)) / math.sqrt(d)  # [Hq, n, L]
        pos = torch.arange(L - n, L)[:, None]  # the chunk's queries sit at the end
        scores = scores.masked_fill(torch.arange(L)[None, :] > pos, -math.inf)
        out[b, :, :n] = (torch.softmax(scores, dim=-1) @ v[kv]).numpy()
        lse[b, :, :n] = torch.logsumexp(scores, dim=-1).numpy()
    return out, lse


@pytest.mark.parametrize("hkv, G", [(2, 4), (3, 4), (1, 6)])  # Hq 8, 12 (not a power of 2), 6
def test_alibi_matches_transformers_bloom_eager(backend, hkv, G):
    """Ragged chunked prefill then decode steps, every result against BLOOM's eager
    attention with its own slopes; LSE = BLOOM's minus slope_h x p."""
    dtype = "float64" if "float64" in backend.dtypes else "float32"
    tol = 1e-10 if dtype == "float64" else 2e-5
    arrays = BackendArrays(backend)
    rng = np.random.default_rng(hkv * 10 + G)
    B, d, Hq = 3, 16, hkv * G
    slopes = bloom.build_alibi_tensor(torch.ones(1, 2, dtype=torch.int64), Hq,
                                      torch.float64)[:, 0, 1].numpy()  # slope_h x position 1
    cache = gqakv.KVCache(B, hkv, 40, d, dtype=dtype, backend=backend)
    k_rows = [np.zeros((hkv, 0, d)) for _ in range(B)]
    v_rows = [np.zeros((hkv, 0, d)) for _ in range(B)]
    for n_new in ([9, 0, 4], [5, 3, 0], [1, 1, 1], [1, 0, 1]):
        T = max(n_new)
        k = rng.standard_normal((B, hkv, T, d))
        v = rng.standard_normal((B, hkv, T, d))
        q = rng.standard_normal((B, Hq, T, d)) * 2
        if dtype == "float32":  # the values the cache holds
            k, v, q = (x.astype(np.float32).astype(np.float64) for x in (k, v, q))
        for b, n in enumerate(n_new):
            k_rows[b] = np.concatenate([k_rows[b], k[b, :, :n]], axis=1)
            v_rows[b] = np.concatenate([v_rows[b], v[b, :, :n]], axis=1)
        cache.append(arrays.asarray(k, dtype), arrays.asarray(v, dtype), n_new)
        out, lse = gqakv.gqa_attention(arrays.asarray(q, dtype), cache, n_new, return_lse=True,
                                       alibi_slopes=slopes)
        want, want_lse = _bloom_eager(q, k_rows, v_rows, n_new, Hq)
        got = arrays.to_numpy(out)
        np.testing.assert_allclose(got, want, atol=tol, rtol=0)
        lens = cache.host_lens
        for b, n in enumerate(n_new):
            p = lens[b] - n + np.arange(n)  # the queries' positions
            shifted = want_lse[b, :, :n] - slopes[:, None] * p[None, :]
            np.testing.assert_allclose(arrays.to_numpy(lse)[b, :, :n], shifted, atol=10 * tol)
            assert not got[b, :, n:].any()  # padded queries exactly 0


def test_alibi_changes_the_result_and_zero_slopes_do_not():
    """The bias is applied (slopes move the output) and all-zero slopes are plain causal."""
    rng = np.random.default_rng(0)
    cache = gqakv.KVCache(1, 2, 16, 8, dtype="float64", backend="numpy")
    k = rng.standard_normal((1, 2, 10, 8))
    cache.append(k, k, [10])
    q = rng.standard_normal((1, 4, 10, 8))
    plain = gqakv.gqa_attention(q, cache, [10])
    zero = gqakv.gqa_attention(q, cache, [10], alibi_slopes=[0.0] * 4)
    biased = gqakv.gqa_attention(q, cache, [10], alibi_slopes=[0.5] * 4)
    np.testing.assert_array_equal(zero, plain)
    assert np.abs(biased - plain).max() > 0.05


@pytest.mark.parametrize("slopes, err, words", [
    ([0.5] * 3, ValueError, "shape [Hq=4]"),
    ([0.5, math.nan, 0.1, 0.2], ValueError, "alibi_slopes[1]"),
    ([0.5, 0.1, math.inf, 0.2], ValueError, "alibi_slopes[2]"),
    ([0.5, 1e39, 0.1, 0.2], ValueError, "alibi_slopes[1]"),
    ([True, 0.5, 0.1, 0.2], TypeError, "alibi_slopes[0]"),
    (0.5, TypeError, "alibi_slopes must be a [Hq]"),
])
def test_bad_alibi_slopes_are_refused_before_any_write(slopes, err, words):
    """Wrong length, NaN, infinities, values past float32, bools and scalars: an error
    naming the argument, raised by Step.attend before its write (the cache unchanged)."""
    model = gqakv.ModelKVCache(1, 1, 2, 16, 8, dtype="float32", backend="numpy")
    k = np.ones((1, 2, 3, 8), np.float32)
    q = np.ones((1, 4, 3, 8), np.float32)
    with pytest.raises(err, match=re.escape(words)):
        with model.step([3]) as step:
            step.attend(0, q, k, k, alibi_slopes=slopes)
    assert list(model.host_lens) == [0]
    with pytest.raises(err, match=re.escape(words)):
        gqakv.gqa_attention(q, _filled(), [3], alibi_slopes=slopes)


def _filled():
    cache = gqakv.KVCache(1, 2, 16, 8, dtype="float32", backend="numpy")
    cache.append(np.ones((1, 2, 3, 8), np.float32), np.ones((1, 2, 3, 8), np.float32), [3])
    return cache


def test_alibi_is_a_variant_feature_and_params_carry_it():
    """``params.features`` names alibi (what fast paths are judged by), ``params=`` and the
    keyword give the same result, and both at once are refused."""
    params = gqakv.AttentionParams(scale=0.3, alibi_slopes=(0.5, 0.25, 0.125, 0.0625))
    assert "alibi" in params.features and params.variant == "causal+alibi"
    cache = _filled()
    q = np.random.default_rng(1).standard_normal((1, 4, 3, 8)).astype(np.float32)
    a = gqakv.gqa_attention(q, cache, [3], params=params)
    b = gqakv.gqa_attention(q, cache, [3], scale=0.3, alibi_slopes=params.alibi_slopes)
    np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match="alibi_slopes="):
        gqakv.gqa_attention(q, cache, [3], params=params, alibi_slopes=params.alibi_slopes)
