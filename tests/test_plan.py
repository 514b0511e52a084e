"""Plan once, run per layer (gqakv.ops.plan), and caller-owned outputs (``out=``, ``lse_out=``).

- a 32-layer step validates its append once, validates and plans its attention once
  (counted), and every layer's result is the float64 reference's;
- ``gqakv.plan_attention`` / ``plan.run``: the same bits as ``gqa_attention``; a plan
  refuses a cache whose rows changed since (stale), another backend or storage, and a q
  of another shape; a step's plan is refused by another step and with variant keywords;
- ``out`` / ``lse_out`` on ``gqa_attention``, ``Step.attend`` and ``paged_attention`` on
  every backend: filled with the result (padded slots 0 and -inf over garbage) and
  returned; a wrong shape, dtype or library is refused before anything is written (the
  step's K/V, the cache and the buffers unchanged).
"""

from __future__ import annotations

import numpy as np
import pytest

import gqakv
from gqakv.caches import model_cache

from .support.spies import counting
from .support.reference import reference_on_buffers
from .support.tolerance import max_error, plain_float32_attention

LAYERS, B, HKV, G, D = 32, 3, 2, 2, 20  # d=20: a head dim the CUDA emulator instantiates


def _rng_arrays(backend, rng, shape, dtype="float32"):
    return backend.from_numpy(rng.standard_normal(shape), dtype)


def test_a_step_validates_and_plans_its_batch_once(backend, monkeypatch):
    """32 layers of one step: validate_append, validate_attention_batch and the backend's
    plan_attention each run once; every layer's output matches the float64 reference of
    its own K/V (the layers hold different data, so a plan that read layer 0's K/V for
    every layer fails here)."""
    rng = np.random.default_rng(7)
    cache = gqakv.ModelKVCache(LAYERS, B, HKV, 32, D, dtype="float32", backend=backend)
    # float32 values from the start: the reference sees exactly what the cache holds
    history = [rng.standard_normal((B, HKV, 6, D)).astype(np.float32) for _ in range(LAYERS)]
    with cache.step([6, 2, 4]) as step:
        for l in range(LAYERS):
            x = backend.from_numpy(history[l], "float32")
            step.write(l, x, x)
    appends = counting(monkeypatch, model_cache, "validate_append")
    batches = counting(monkeypatch, model_cache, "validate_attention_batch")
    plans = counting(monkeypatch, backend, "plan_attention")
    n_new = [3, 1, 0]
    q = [rng.standard_normal((B, HKV * G, 3, D)).astype(np.float32) for _ in range(LAYERS)]
    k = [rng.standard_normal((B, HKV, 3, D)).astype(np.float32) for _ in range(LAYERS)]
    outs = []
    with cache.step(n_new) as step:
        for l in range(LAYERS):
            kl = backend.from_numpy(k[l], "float32")
            outs.append(step.attend(l, backend.from_numpy(q[l], "float32"), kl, kl, window=4))
    assert (len(appends), len(batches), len(plans)) == (1, 1, 1)
    lens = [6 + 3, 2 + 1, 4]
    for l in (0, 1, LAYERS - 1):
        full = np.zeros((B, HKV, 9, D))
        for b, (before, n) in enumerate(zip((6, 2, 4), n_new)):
            full[b, :, :before] = history[l][b, :, :before]
            full[b, :, before:before + n] = k[l][b, :, :n]
        ref, _ = reference_on_buffers(q[l], full, full, lens, n_new, window=4)
        rows = [full[b, :, :L] for b, L in enumerate(lens)]
        err_plain = max_error(plain_float32_attention(q[l], rows, rows, n_new, D ** -0.5,
                                                      window=4), ref)
        # float32 compute: within the plain float32 computation's error on these values
        # (FlashAttention's rule, as tests/test_numba_storage.py), plus 1e-6
        assert max_error(backend.to_numpy(outs[l]), ref) <= 4 * err_plain + 1e-6, l


def test_a_plan_runs_like_gqa_attention_and_refuses_what_it_was_not_made_for(backend):
    rng = np.random.default_rng(3)
    cache = gqakv.KVCache(batch=B, kv_heads=HKV, max_len=32, head_dim=D, backend=backend)
    x = _rng_arrays(backend, rng, (B, HKV, 5, D))
    cache.append(x, x, [5, 3, 0])
    q = _rng_arrays(backend, rng, (B, HKV * G, 5, D))
    plan = gqakv.plan_attention(cache, [5, 3, 0], q_heads=HKV * G, softcap=3.0)
    want = gqakv.gqa_attention(q, cache, [5, 3, 0], softcap=3.0, return_lse=True)
    got = plan.run(q, cache, return_lse=True)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(backend.to_numpy(a), backend.to_numpy(b))
    with pytest.raises(ValueError, match=r"q has shape \[3, 4, 4, 20\], the plan is for \[3, 4, 5, 20\]"):
        plan.run(q[:, :, :4, :], cache)
    other = gqakv.KVCache(batch=B, kv_heads=HKV, max_len=32, head_dim=D, dtype="float64",
                          backend=backend) if "float64" in backend.dtypes else None
    if other is not None:
        with pytest.raises(ValueError, match="the plan was made for float32 contiguous storage"):
            plan.run(q, other)
    cache.append(x[:, :, :1, :], x[:, :, :1, :], [1, 0, 0])
    with pytest.raises(ValueError, match="the plan is stale: row 0 held 5 tokens when it was "
                                         "planned and holds 6 now"):
        plan.run(q, cache)


def _two_layer_decode(backend, seed):
    """A 2-layer ModelKVCache and one decode token's K/V ``x`` and queries ``q``."""
    rng = np.random.default_rng(seed)
    cache = gqakv.ModelKVCache(2, B, HKV, 16, D, dtype="float32", backend=backend)
    return cache, _rng_arrays(backend, rng, (B, HKV, 1, D)), _rng_arrays(backend, rng, (B, HKV * G, 1, D))


def test_a_steps_plan_is_its_own(backend):
    cache, x, q = _two_layer_decode(backend, 4)
    with cache.step([1, 1, 1]) as step:
        plan = step.plan_attention(HKV * G, window=2)
        with pytest.raises(TypeError, match="give plan= or variant keywords"):
            step.attend(0, q, x, x, plan=plan, window=2)
        a = step.attend(0, q, x, x, plan=plan)
        b = step.attend(1, q, x, x, window=2)  # the same variant by keywords
        np.testing.assert_array_equal(backend.to_numpy(a), backend.to_numpy(b))
    with cache.step([1, 1, 1]) as later:
        with pytest.raises(ValueError, match="plan= takes this step's own plan_attention"):
            later.attend(0, q, x, x, plan=plan)
        later.abort()


def _garbage(backend, shape, dtype):
    return backend.from_numpy(np.full(shape, 7.0), dtype)


def test_out_and_lse_out_receive_the_result(backend):
    """gqa_attention, Step.attend and paged_attention write into the caller's buffers
    (prefilled with 7s: padded slots must come back 0 and -inf) and return them."""
    rng = np.random.default_rng(5)
    lse_dtype = "float32"
    cache = gqakv.KVCache(batch=B, kv_heads=HKV, max_len=32, head_dim=D, backend=backend)
    x = _rng_arrays(backend, rng, (B, HKV, 4, D))
    cache.append(x, x, [4, 2, 0])
    q = _rng_arrays(backend, rng, (B, HKV * G, 4, D))
    want, want_lse = gqakv.gqa_attention(q, cache, [4, 2, 0], return_lse=True)
    out = _garbage(backend, (B, HKV * G, 4, D), "float32")
    lse = _garbage(backend, (B, HKV * G, 4), lse_dtype)
    got = gqakv.gqa_attention(q, cache, [4, 2, 0], out=out, lse_out=lse, return_lse=True)
    assert got[0] is out and got[1] is lse
    np.testing.assert_array_equal(backend.to_numpy(out), backend.to_numpy(want))
    np.testing.assert_array_equal(backend.to_numpy(lse), backend.to_numpy(want_lse))
    assert np.all(backend.to_numpy(out)[1, :, 2:] == 0) and np.all(backend.to_numpy(lse)[2] == -np.inf)
    only_lse = _garbage(backend, (B, HKV * G, 4), lse_dtype)
    o = gqakv.gqa_attention(q, cache, [4, 2, 0], lse_out=only_lse)  # lse without return_lse
    np.testing.assert_array_equal(backend.to_numpy(o), backend.to_numpy(want))
    np.testing.assert_array_equal(backend.to_numpy(only_lse), backend.to_numpy(want_lse))

    model = gqakv.ModelKVCache(2, B, HKV, 32, D, dtype="float32", backend=backend)
    with model.step([4, 2, 0]) as step:
        outs = [_garbage(backend, (B, HKV * G, 4, D), "float32") for _ in range(2)]
        for l in range(2):
            assert step.attend(l, q, x, x, out=outs[l]) is outs[l]
    for o in outs:
        np.testing.assert_array_equal(backend.to_numpy(o), backend.to_numpy(want))

    pages = gqakv.PagedKVCache(batch=B, kv_heads=HKV, max_len=32, head_dim=D, page_size=4,
                               backend=backend)
    pages.append(x, x, [4, 2, 0])
    entries = pages.store.page_table.entries
    k_pool, v_pool = pages.store.k, pages.store.v
    out = _garbage(backend, (B, HKV * G, 4, D), "float32")
    got = gqakv.paged_attention(q, k_pool, v_pool, entries, pages.host_lens, [4, 2, 0],
                                backend=backend, out=out)
    assert got is out
    np.testing.assert_allclose(backend.to_numpy(out), backend.to_numpy(want), rtol=0, atol=1e-6)


def test_bad_outputs_are_refused_before_anything_is_written(backend):
    rng = np.random.default_rng(6)
    model = gqakv.ModelKVCache(1, B, HKV, 16, D, dtype="float32", backend=backend)
    x = _rng_arrays(backend, rng, (B, HKV, 2, D))
    q = _rng_arrays(backend, rng, (B, HKV * G, 2, D))
    good_lse = _garbage(backend, (B, HKV * G, 2), "float32")
    bad = [
        (dict(out=_garbage(backend, (B, HKV * G, 2, D + 1), "float32")), ValueError,
         r"out has shape \[3, 4, 2, 21\], the call's queries are \[3, 4, 2, 20\]"),
        (dict(out=_garbage(backend, (B, HKV * G, 2, D), "float64")), TypeError,
         "out has dtype float64, the cache holds float32"),
        (dict(lse_out=_garbage(backend, (B, HKV * G, 3), "float32")), ValueError,
         r"lse_out has shape \[3, 4, 3\], expected \[B, Hq, T\] = \[3, 4, 2\]"),
        (dict(lse_out=_garbage(backend, (B, HKV * G, 2), "float64"), out=None), TypeError,
         "lse_out has dtype float64; the log-sum-exp of a float32 call is float32"),
        (dict(out=np.zeros((B, HKV * G, 2, D), np.float32), lse_out=good_lse), TypeError,
         "out is a numpy.ndarray"),
    ]
    if "float64" not in backend.dtypes:
        bad = [b for b in bad if "float64" not in b[2]]
    for kwargs, exc, match in bad:
        if "numpy.ndarray" in match and backend.owns(np.zeros(1)):
            continue  # a NumPy out is the right library on the NumPy backends
        with model.step([2, 1, 0]) as step:
            before = [np.array(backend.to_numpy(b)) for b in (model.store.k, model.store.v)]
            given = [v for v in kwargs.values() if v is not None and backend.owns(v)]
            given_before = [np.array(backend.to_numpy(v)) for v in given]
            with pytest.raises(exc, match=match):
                step.attend(0, q, x, x, **kwargs)
            assert not step._written[0]  # the layer's K/V were not written
            for b, a in zip(before, (model.store.k, model.store.v)):
                np.testing.assert_array_equal(b, backend.to_numpy(a))
            for b, v in zip(given_before, given):
                np.testing.assert_array_equal(b, backend.to_numpy(v))
            step.abort()
        cache = gqakv.KVCache(batch=B, kv_heads=HKV, max_len=16, head_dim=D, backend=backend)
        cache.append(x, x, [2, 1, 0])
        with pytest.raises(exc, match=match):
            gqakv.gqa_attention(q, cache, [2, 1, 0], **kwargs)


@pytest.mark.parametrize("given_plan", [False, True], ids=["planned-by-step", "plan="])
def test_later_layers_tensors_are_checked_like_the_first(backend, given_plan):
    """A step checks a later layer's q / k_new / v_new by comparing their signatures
    (``Backend.signature``) with what the first layer passed: a later layer's wrong dtype,
    shape or library is refused as the first layer's would be, with nothing written, and
    good tensors after it go on; alike with the step's own plan passed as ``plan=``."""
    rng = np.random.default_rng(8)
    model = gqakv.ModelKVCache(3, B, HKV, 16, D, dtype="float32", backend=backend)
    x = _rng_arrays(backend, rng, (B, HKV, 2, D))
    q = _rng_arrays(backend, rng, (B, HKV * G, 2, D))
    wide_q = backend.from_numpy(rng.standard_normal((B, HKV * G, 2, D)), "float64")
    wide_x = backend.from_numpy(rng.standard_normal((B, HKV, 2, D)), "float64")
    short_q = _rng_arrays(backend, rng, (B, HKV * G, 1, D))
    bad = [((wide_q, x, x), TypeError, "q has dtype float64, the cache holds float32"),
           ((q, wide_x, x), TypeError, "k_new has dtype float64"),
           ((q, x, wide_x), TypeError, "v_new has dtype float64"),
           ((short_q, x, x), ValueError, r"q \[3, 4, 1, 20\] does not match k_new")]
    if not backend.owns(np.zeros(1)):
        bad.append(((np.asarray(backend.to_numpy(q)), x, x), TypeError, "q is a numpy.ndarray"))
    with model.step([2, 1, 0]) as step:
        kw = dict(plan=step.plan_attention(HKV * G, t_q=2)) if given_plan else {}
        first = step.attend(0, q, x, x, **kw)
        before = [np.array(backend.to_numpy(b)) for b in (model.store.k, model.store.v)]
        for args, exc, match in bad:
            with pytest.raises(exc, match=match):
                step.attend(1, *args, **kw)
            assert not step._written[1]
            for b, a in zip(before, (model.store.k, model.store.v)):
                np.testing.assert_array_equal(b, backend.to_numpy(a))
        for l in (1, 2):  # the same data in every layer: the same result
            np.testing.assert_array_equal(backend.to_numpy(step.attend(l, q, x, x, **kw)),
                                          backend.to_numpy(first))


def test_later_layers_outputs_are_checked_like_the_first(backend):
    """A step checks a later layer's out / lse_out by comparing their signatures with the
    last ones it checked in full: a later layer's out of the wrong dtype or shape, or an
    lse_out of the wrong dtype, is refused as the first layer's would be, with nothing
    written (not the cache, not the buffers), and good buffers after it go on."""
    rng = np.random.default_rng(9)
    model = gqakv.ModelKVCache(3, B, HKV, 16, D, dtype="float32", backend=backend)
    x = _rng_arrays(backend, rng, (B, HKV, 1, D))
    q = _rng_arrays(backend, rng, (B, HKV * G, 1, D))
    out = backend.from_numpy(np.zeros((B, HKV * G, 1, D)), "float32")
    lse = backend.from_numpy(np.zeros((B, HKV * G, 1)), "float32")
    bad = [((backend.from_numpy(np.zeros((B, HKV * G, 1, D)), "float64"), lse), TypeError,
            "out has dtype float64"),
           ((backend.from_numpy(np.zeros((B, HKV * G, 2, D)), "float32"), lse), ValueError,
            r"out has shape \[3, 4, 2, 20\]"),
           ((out, backend.from_numpy(np.zeros((B, HKV * G, 1)), "float64")), TypeError,
            "lse_out has dtype float64")]
    with model.step([1, 1, 1]) as step:
        first, first_lse = step.attend(0, q, x, x, out=out, lse_out=lse, return_lse=True)
        first, first_lse = backend.to_numpy(first).copy(), backend.to_numpy(first_lse).copy()
        before = [np.array(backend.to_numpy(b)) for b in (model.store.k, model.store.v, out, lse)]
        for (o, l), exc, match in bad:
            with pytest.raises(exc, match=match):
                step.attend(1, q, x, x, out=o, lse_out=l, return_lse=True)
            assert not step._written[1]
            for b, a in zip(before, (model.store.k, model.store.v, out, lse)):
                np.testing.assert_array_equal(b, backend.to_numpy(a))
        for l in (1, 2):  # the same data in every layer: the same result
            got, got_lse = step.attend(l, q, x, x, out=out, lse_out=lse, return_lse=True)
            np.testing.assert_array_equal(backend.to_numpy(got), first)
            np.testing.assert_array_equal(backend.to_numpy(got_lse), first_lse)


def test_out_may_be_q_itself(backend):
    """``out=q``: the result is the same as into a fresh buffer (a kernel that zeroed or
    wrote out before reading q would compute from its own output)."""
    rng = np.random.default_rng(8)
    cache = gqakv.KVCache(batch=B, kv_heads=HKV, max_len=32, head_dim=D, backend=backend)
    x = _rng_arrays(backend, rng, (B, HKV, 3, D))
    cache.append(x, x, [3, 3, 3])
    q = _rng_arrays(backend, rng, (B, HKV, 3, D))  # G = 1: q has out's shape
    want = backend.to_numpy(gqakv.gqa_attention(q, cache, [3, 3, 3])).copy()
    got = gqakv.gqa_attention(q, cache, [3, 3, 3], out=q)
    np.testing.assert_array_equal(backend.to_numpy(got), want)


def test_a_bool_window_is_refused_after_an_int_window_planned(backend):
    cache, x, q = _two_layer_decode(backend, 9)
    with cache.step([1, 1, 1]) as step:
        step.attend(0, q, x, x, window=1)
        with pytest.raises(TypeError, match="window"):
            step.attend(1, q, x, x, window=True)
        step.abort()


@pytest.mark.parametrize("name, t_q, planner", [("numba", 1, "numba"), ("numba", 16, "numpy"),
                                                 ("numpy", 1, "numpy")])
def test_the_cpu_backends_use_their_plan_on_every_layer(monkeypatch, name, t_q, planner):
    """The work a CPU backend planned is what every layer runs: numba's kernels
    (plan_numba) for decode, the NumPy BLAS path (plan_items) for a 16-query chunk on
    numba (over rows longer than its KERNEL_SHORT_ROW_KEYS: shorter ones take its
    kernels) and on numpy: one planning call for 32 layers, none per layer."""
    from gqakv_backends import numba_backend, numpy_attention

    backend = gqakv.get_backend(name)
    cache = gqakv.ModelKVCache(LAYERS, 2, HKV, 160, D, dtype="float32", backend=backend)
    before = 130  # tokens already in each row
    h = np.ones((2, HKV, before, D), np.float32)
    with cache.step([before, before]) as step:
        for l in range(LAYERS):
            step.write(l, h, h)
    calls = counting(monkeypatch, numba_backend if planner == "numba" else numpy_attention,
                      "plan_numba" if planner == "numba" else "plan_items")
    x = np.ones((2, HKV, t_q, D), np.float32)
    q = np.ones((2, HKV * G, t_q, D), np.float32)
    with cache.step([t_q, t_q]) as step:
        for l in range(LAYERS):
            step.attend(l, q, x, x)
    assert len(calls) == 1
