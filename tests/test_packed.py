"""Packed tokens: q / k_new / v_new ``[N, H, d]`` with every entry's tokens end to end.

- a mixed step (a prefill chunk and decode tokens in one batch, an idle row) through
  ``Step.attend`` packed: the float64 reference, and the padded step's bits where the same
  implementation serves both; one plan for every layer;
- numba's kernels read packed q and write packed outputs in place (``[N, Hq, 1, d]``
  views: no padded query buffer);
- ``paged_append_attention``: one call appending into caller-owned pools and attending,
  padded and packed, the bits of ``paged_append`` then ``paged_attention``; a refused
  call leaves the pools unchanged;
- refusals: n_new not adding up, q and K/V laid out differently, wrong packed outputs,
  ``t_q`` with ``packed=True``, a backend that does not declare ``packed_tokens``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import gqakv
from gqakv.caches import model_cache
from gqakv.storage.paged import pages_for

from .support.spies import counting
from .support.arrays import BackendArrays
from .support.packing import pack_tokens
from .support.reference import reference_attention

LAYERS, B, HKV, G, D, S = 3, 4, 2, 2, 8, 48  # d=8: the emulator holds every variant there, paged too


def _history(rng, lens_before):
    """Per layer, K (=V) of each row's first tokens: float32 values, held exactly."""
    return [rng.standard_normal((B, HKV, max(lens_before), D)).astype(np.float32)
            for _ in range(LAYERS)]


@pytest.mark.parametrize("storage", [{}, {"storage": "paged", "page_size": 8}],
                         ids=["contiguous", "paged"])
@pytest.mark.parametrize("n_new", [[9, 1, 0, 1], [1, 1, 0, 1]], ids=["mixed", "decode"])
def test_packed_step_matches_reference_and_padded(backend, n_new, storage, monkeypatch):
    """One step of LAYERS layers, packed and padded, over caches holding the same
    history: each layer's packed output is the float64 reference's, its bits the padded
    step's when one implementation serves both, and the packed step validates and plans
    once."""
    rng = np.random.default_rng(3)
    arrays = BackendArrays(backend)
    n_new = np.array(n_new)
    # the first row past numba's KERNEL_SHORT_ROW_KEYS: over shorter rows its kernels take
    # every chunk, and the mixed batch would not be split
    lens_before = np.array([130, 7, 5, 0])
    caches = [gqakv.ModelKVCache(LAYERS, B, HKV, 144, D, dtype="float32", backend=backend, **storage)
              for _ in range(2)]
    hist = _history(rng, lens_before)
    for c in caches:
        c.store.fill(math.nan)
        with c.step(lens_before) as step:
            for l in range(LAYERS):
                x = arrays.asarray(hist[l], "float32")
                step.write(l, x, x)
    T = int(n_new.max())
    q = [rng.standard_normal((B, HKV * G, T, D)).astype(np.float32) for _ in range(LAYERS)]
    k = [rng.standard_normal((B, HKV, T, D)).astype(np.float32) for _ in range(LAYERS)]
    with caches[0].step(n_new) as step:
        padded = [arrays.to_numpy(step.attend(l, arrays.asarray(q[l]), arrays.asarray(k[l]),
                                              arrays.asarray(k[l]), window=12))
                  for l in range(LAYERS)]
    batches = counting(monkeypatch, model_cache, "validate_attention_batch")
    plans = counting(monkeypatch, backend, "plan_attention")
    with caches[1].step(n_new) as step:
        # numba splits a packed mixed batch: rows of <= 8 queries to its kernels, longer
        # chunks to the BLAS path (each part's bits are its implementation's)
        split = getattr(step.plan_attention(HKV * G, packed=True, window=12).work, "long", None)
        batches.clear()
        plans.clear()
        packed = []
        for l in range(LAYERS):
            kp = arrays.asarray(np.ascontiguousarray(pack_tokens(k[l], n_new)))
            out = step.attend(l, arrays.asarray(np.ascontiguousarray(pack_tokens(q[l], n_new))),
                              kp, kp, window=12)
            assert tuple(out.shape) == (int(n_new.sum()), HKV * G, D)
            packed.append(arrays.to_numpy(out))
    assert (len(batches), len(plans)) == (1, 1)
    lens = lens_before + n_new
    for l in range(LAYERS):
        rows = [np.concatenate([hist[l][b, :, :lens_before[b]], k[l][b, :, :n_new[b]]], axis=1)
                for b in range(B)]
        want, _ = reference_attention(q[l], rows, rows, n_new, window=12)
        np.testing.assert_allclose(packed[l], pack_tokens(want, n_new), atol=2e-6, rtol=0)
        assert all(len(r[0]) == L for r, L in zip(rows, lens))
    assert (split is not None) == (backend.name == "numba" and T > 8)
    request = dict(dtype="float32", head_dim=D, t_q=T, features=frozenset({"window"}),
                   layout=storage.get("storage", "contiguous"))
    if backend.route("attention", **request).impl == backend.route(
            "attention", tokens="packed", **request).impl:
        # where split, the long rows ran BLAS in both calls: their bits agree
        same = np.ones(B, bool) if split is None else n_new > 8
        tokens = np.repeat(same, n_new)
        for l in range(LAYERS):
            np.testing.assert_array_equal(packed[l][tokens], pack_tokens(padded[l], n_new)[tokens])
    # the caches hold the same tokens: packed appends wrote what padded ones did
    for l in range(LAYERS):
        for b in range(B):
            got = [arrays.to_numpy(x) for x in caches[1].live_kv(l, b)]
            want_kv = [arrays.to_numpy(x) for x in caches[0].live_kv(l, b)]
            np.testing.assert_array_equal(got[0], want_kv[0])
            np.testing.assert_array_equal(got[1], want_kv[1])


def test_numba_kernels_read_and_write_packed_tokens_in_place(monkeypatch):
    """The numba kernels take a packed call's q and outputs as [N, Hq, 1, d] views of the
    caller's [N, Hq, d] arrays (out= written directly): no padded [B, Hq, T, d] buffer."""
    backend = gqakv.get_backend("numba")
    if backend.unavailable_reason():
        pytest.skip(backend.unavailable_reason())
    from gqakv_backends import numba_kernels as nk

    seen = []
    real = nk.attention_items

    def spy(*args):
        seen.append((args[0].shape, args[15]))
        return real(*args)

    monkeypatch.setattr(nk, "attention_items", spy)
    rng = np.random.default_rng(5)
    cache = gqakv.KVCache(3, HKV, S, D, dtype="float32", backend=backend)
    n0 = np.array([6, 0, 3])
    k0 = rng.standard_normal((int(n0.sum()), HKV, D)).astype(np.float32)
    cache.append(k0, k0, n0)
    n_new = np.array([2, 1, 0])
    k1 = rng.standard_normal((3, HKV, D)).astype(np.float32)
    cache.append(k1, k1, n_new)
    q = rng.standard_normal((3, HKV * G, D)).astype(np.float32)
    out = np.full((3, HKV * G, D), np.nan, np.float32)
    got = gqakv.gqa_attention(q, cache, n_new, out=out)
    assert got is out
    assert seen and seen[0][0] == (3, HKV * G, 1, D)
    assert np.shares_memory(seen[0][1], out)
    rows = [np.concatenate([np.swapaxes(k0[:6], 0, 1), np.swapaxes(k1[:2], 0, 1)], axis=1),
            np.swapaxes(k1[2:3], 0, 1), np.swapaxes(k0[6:9], 0, 1)]
    q_padded = np.zeros((3, HKV * G, 2, D), np.float32)
    q_padded[0, :, :2] = np.swapaxes(q[:2], 0, 1)
    q_padded[1, :, :1] = np.swapaxes(q[2:3], 0, 1)
    want, _ = reference_attention(q_padded, rows, rows, n_new)
    np.testing.assert_allclose(out, pack_tokens(want, n_new), atol=2e-6, rtol=0)


P, NUM_PAGES = 4, 24


def _pools(arrays, rng, lens_before, n_new):
    nan = np.full((NUM_PAGES, HKV, P, D), math.nan)
    k_pages, v_pages = arrays.asarray(nan, "float32"), arrays.asarray(nan.copy(), "float32")
    lens = lens_before + n_new
    table = np.full((B, pages_for(S, P)), -1, np.int32)
    free = list(rng.permutation(NUM_PAGES))
    for b in range(B):
        for j in range(pages_for(int(lens[b]), P)):
            table[b, j] = free.pop()
    return k_pages, v_pages, table, lens


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_paged_append_attention_is_append_then_attention(backend, layout):
    """paged_append_attention over caller pools: the bits of paged_append then
    paged_attention on a twin of the pools, both layouts, and the float64 reference."""
    arrays = BackendArrays(backend)
    rng = np.random.default_rng(9)
    lens_before, n_new = np.array([5, 0, 9, 2]), np.array([3, 4, 0, 1])
    k_pages, v_pages, table, lens = _pools(arrays, rng, lens_before, n_new)
    twin = [arrays.asarray(arrays.to_numpy(x), "float32") for x in (k_pages, v_pages)]
    k_hist = rng.standard_normal((B, HKV, 9, D)).astype(np.float32)
    for pools in ((k_pages, v_pages), twin):
        gqakv.paged_append(*pools, table, lens_before, arrays.asarray(k_hist),
                           arrays.asarray(k_hist), lens_before)
    k = rng.standard_normal((B, HKV, 4, D)).astype(np.float32)
    q = rng.standard_normal((B, HKV * G, 4, D)).astype(np.float32)
    if layout == "packed":
        kx, qx = (arrays.asarray(np.ascontiguousarray(pack_tokens(x, n_new))) for x in (k, q))
    else:
        kx, qx = arrays.asarray(k), arrays.asarray(q)
    out, lse = gqakv.paged_append_attention(qx, kx, kx, k_pages, v_pages, table, lens, n_new,
                                            softcap=3.0, return_lse=True)
    gqakv.paged_append(*twin, table, lens, kx, kx, n_new)
    out2, lse2 = gqakv.paged_attention(qx, *twin, table, lens, n_new, softcap=3.0,
                                       return_lse=True)
    for a, b in ((out, out2), (lse, lse2), (k_pages, twin[0]), (v_pages, twin[1])):
        np.testing.assert_array_equal(arrays.to_numpy(a), arrays.to_numpy(b))
    rows = [np.concatenate([k_hist[b, :, :lens_before[b]], k[b, :, :n_new[b]]], axis=1)
            for b in range(B)]
    want, _ = reference_attention(q, rows, rows, n_new, softcap=3.0)
    if layout == "packed":
        want = pack_tokens(want, n_new)
    np.testing.assert_allclose(arrays.to_numpy(out), want, atol=2e-6, rtol=0)


def test_paged_append_attention_refusals_leave_the_pools_unchanged(backend):
    arrays = BackendArrays(backend)
    rng = np.random.default_rng(1)
    n_new = np.array([1, 1, 0, 2])
    k_pages, v_pages, table, lens = _pools(arrays, rng, np.zeros(B, np.int64), n_new)
    before = [arrays.to_numpy(x).copy() for x in (k_pages, v_pages)]
    kp = arrays.asarray(rng.standard_normal((4, HKV, D)), "float32")
    qp = arrays.asarray(rng.standard_normal((4, HKV * G, D)), "float32")
    cases = [
        # q padded, K/V packed
        ((arrays.asarray(np.zeros((B, HKV * G, 2, D)), "float32"), kp, kp), {},
         ValueError, "laid out differently"),
        # q in another dtype
        ((arrays.asarray(np.zeros((4, HKV * G, D)), "float64")
          if "float64" in backend.dtypes else arrays.asarray(np.zeros((4, HKV * G, D)), "float16")
          if "float16" in backend.dtypes else None, kp, kp), {}, TypeError, "dtype"),
        # the packed q holds 3 tokens for 4
        ((arrays.asarray(np.zeros((3, HKV * G, D)), "float32"), kp, kp), {}, ValueError,
         "adds up to 4"),
        # out shaped like a padded call's
        ((qp, kp, kp), {"out": arrays.asarray(np.zeros((B, HKV * G, 2, D)), "float32")},
         ValueError, "out has shape"),
        # lse_out of the wrong shape
        ((qp, kp, kp), {"lse_out": arrays.asarray(np.zeros((4, HKV * G + 1)), "float32")},
         ValueError, "expected [N, Hq] = [4, 4]"),
    ]
    for (q, k, v), kw, error, words in cases:
        if q is None:
            continue
        with pytest.raises(error) as info:
            gqakv.paged_append_attention(q, k, v, k_pages, v_pages, table, lens, n_new, **kw)
        assert words in str(info.value), str(info.value)
        for x, was in zip((k_pages, v_pages), before):
            np.testing.assert_array_equal(arrays.to_numpy(x), was)


def test_packed_refusals_change_nothing():
    """Errors that name the packed layout's numbers, raised before anything is written."""
    rng = np.random.default_rng(2)
    cache = gqakv.ModelKVCache(2, 3, HKV, 16, D, dtype="float32", backend="numpy")
    x = rng.standard_normal((3, HKV, D)).astype(np.float32)
    q = rng.standard_normal((3, HKV * G, D)).astype(np.float32)
    with cache.step([1, 2, 0]) as step:
        k4 = np.zeros((3, HKV, 2, D), np.float32)
        with pytest.raises(ValueError, match="laid out differently"):
            step.attend(0, q, k4, k4)
        with pytest.raises(ValueError, match=r"k_new is packed with 2 tokens \(dim 0\), but "
                                             "n_new adds up to 3"):
            step.attend(0, q[:2], x[:2], x[:2])  # the append is refused first
        with pytest.raises(ValueError, match="hold different numbers of tokens"):
            step.attend(0, q[:2], x, x)
        with pytest.raises(TypeError, match="t_q applies to padded queries"):
            step.plan_attention(HKV * G, t_q=2, packed=True)
        plan = step.plan_attention(HKV * G, packed=True)
        assert plan.q_shape == (3, HKV * G, D)
        with pytest.raises(ValueError, match=r"the plan is for \[3, 4, 8\] \[N, Hq, d\]"):
            step.attend(0, q[:, :HKV], x, x, plan=plan)  # Hq = 2
        assert not step._written.any()
        out = step.attend(0, q, x, x, plan=plan)
        step.attend(1, q, x, x, plan=plan)
    assert out.shape == (3, HKV * G, D) and np.isfinite(out).all()
    assert cache.layer(0).host_lens.tolist() == [1, 2, 0]


def test_a_backend_without_packed_tokens_refuses_them():
    """A backend that does not declare ``packed_tokens`` (a third party's that overrides
    the hot operations) is never handed packed tensors: refused with its name."""
    from gqakv_backends.numpy_backend import NumpyBackend

    class PaddedOnly(NumpyBackend):
        name = "padded_only"
        packed_tokens = False

    cache = gqakv.KVCache(2, HKV, 8, D, dtype="float32", backend=PaddedOnly())
    x = np.zeros((3, HKV, D), np.float32)
    with pytest.raises(TypeError, match="backend 'padded_only' takes only padded"):
        cache.append(x, x, [2, 1])
    assert cache.host_lens.tolist() == [0, 0]
    cache.append(np.zeros((2, HKV, 2, D), np.float32), np.zeros((2, HKV, 2, D), np.float32), [2, 1])
    with pytest.raises(TypeError, match="does not declare packed_tokens"):
        gqakv.gqa_attention(np.zeros((3, HKV * G, D), np.float32), cache, [2, 1])
