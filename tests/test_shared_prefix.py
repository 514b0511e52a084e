"""Shared-prefix attention (gqakv.ops.shared_prefix): rows that share pages read them once.

Every case builds ragged batches whose rows share a prefix through ``fork`` (a
``PagedKVCache``, a paged ``ModelKVCache`` stepped with ``Step.attend``) or through a
caller's page table that repeats page ids (``paged_attention``), runs chunked prefill and
decode steps, padded and packed, and compares every output and LSE with the float64 loop
reference (tests/support/reference.py) over the values the cache holds; each asserts that
the decomposition ran (the plan's groups, and a counting spy on its launch), and the
cases where it must not run assert the plan's reason. The thresholds that keep tiny
batches on the normal path (``MIN_SHARED_TOKENS``, ``MIN_SAVED_TOKENS``) are lowered here, so the
small shapes exercise the decomposition itself.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import gqakv
from gqakv.dispatch.request import Request
from gqakv.ops import shared_prefix as sp
from gqakv.storage.paged import PagedStore
from gqakv.storage.store import StorageSpec

from .support.arrays import BackendArrays
from .support.packing import pack_tokens
from .support.parity import LOW_PRECISION, assert_matches_reference, low_precision_bounds
from .support.reference import reference_attention
from .support.spies import counting
from .support.seeds import stable_seed

SINKS4 = (0.5, -1.0, 2.0, float("-inf"))
ALIBI4 = (0.5, 0.25, 0.125, 0.0)
VARIANTS = {"causal": {}, "softcap": {"softcap": 0.7}, "sinks": {"sinks": SINKS4},
            "softcap+sinks": {"softcap": 2.0, "sinks": SINKS4}, "alibi": {"alibi_slopes": ALIBI4},
            "alibi+softcap+sinks": {"alibi_slopes": ALIBI4, "softcap": 1.5, "sinks": SINKS4}}


@pytest.fixture
def small_groups(monkeypatch):
    """Groups form from one shared page (the default threshold is for real sizes)."""
    monkeypatch.setattr(sp, "MIN_SHARED_TOKENS", 1)
    monkeypatch.setattr(sp, "MIN_SAVED_TOKENS", 1)


def _skip_unless(backend, dtype, d=8):
    if backend.unavailable_reason():
        pytest.skip(backend.unavailable_reason())
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} has no {dtype}")


def _held(arrays, x, dtype):
    """The values an array of ``dtype`` holds, as float64 NumPy."""
    return arrays.to_numpy(arrays.asarray(x, dtype))


def _rows_of(cache, arrays, B):
    """Every row's live K and V as the cache holds them (dequantized for codes), float64."""
    kv = [cache.live_kv(b) for b in range(B)]
    return [arrays.to_numpy(k) for k, _ in kv], [arrays.to_numpy(v) for _, v in kv]


def _check(dtype, got, got_lse, q, k_rows, v_rows, n_new, variant, what, quantized=False):
    want, want_lse = reference_attention(q, k_rows, v_rows, n_new, **variant)
    bounds = None
    if dtype in LOW_PRECISION:
        bounds = low_precision_bounds(dtype, want, want_lse, q, k_rows, v_rows, n_new,
                                      1 / np.sqrt(q.shape[-1]), **variant)
    # 8-bit storage: the reference reads the dequantized values the cache holds, so the
    # computation itself is float32's (the quantization error is not in the comparison)
    assert_matches_reference(got, got_lse, want, want_lse, dtype, bounds, what=what)


def _prefix_cache(backend, arrays, rng, dtype, kv_dtype, *, B=6, Hkv=2, d=8, P=4, prefix=11,
                  max_len=40):
    """A PagedKVCache whose rows 0..3 share a ``prefix``-token prompt (fork), row 4 has its
    own prompt and row 5 is empty."""
    cache = gqakv.PagedKVCache(B, Hkv, max_len, d, dtype=dtype, backend=backend, page_size=P,
                               kv_dtype=kv_dtype)
    k, v = (_held(arrays, rng.standard_normal((1, Hkv, prefix, d)), dtype) for _ in range(2))
    cache.append(arrays.asarray(k, dtype), arrays.asarray(v, dtype), [prefix], rows=[0])
    k, v = (_held(arrays, rng.standard_normal((1, Hkv, 6, d)), dtype) for _ in range(2))
    cache.append(arrays.asarray(k, dtype), arrays.asarray(v, dtype), [6], rows=[4])
    cache.fork(0, [1, 2, 3])
    return cache


# -- PagedKVCache: chunked prefill then decode, padded and packed ---------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("dtype,kv_dtype", [("float32", None), ("bfloat16", None),
                                            ("float32", "int8")])
def test_forked_rows_match_reference(backend, arrays, small_groups, monkeypatch, dtype, kv_dtype,
                                     packed, variant):
    """Forked rows share a prompt's pages; ragged chunks (an idle entry, an empty row, a
    row of its own) then decode steps: every output and LSE matches the float64 reference,
    and the plan read the shared pages once (its groups; the spy counts each launch)."""
    if "emulated" in backend.name:
        pytest.skip("the emulator's time: its tiny case is test_cupy_emulated_shared_prefix")
    _skip_unless(backend, dtype)
    if packed and not backend.packed_tokens:
        pytest.skip(f"{backend.name} takes padded tokens only")
    rng = np.random.default_rng(stable_seed(dtype, kv_dtype, packed, variant))
    B, Hkv, G, d = 6, 2, 2, 8
    cache = _prefix_cache(backend, arrays, rng, dtype, kv_dtype)
    launches = counting(monkeypatch, sp.SharedPrefixWork, "launch")
    for step, (T, n_new) in enumerate([(5, [5, 2, 0, 3, 4, 2]), (1, [1, 1, 1, 1, 1, 1]),
                                       (3, [1, 3, 2, 1, 0, 1]), (1, [1, 1, 0, 1, 1, 1])]):
        k, v = (_held(arrays, rng.standard_normal((B, Hkv, T, d)), dtype) for _ in range(2))
        q = _held(arrays, rng.standard_normal((B, Hkv * G, T, d)), dtype)
        cache.append(arrays.asarray(k, dtype), arrays.asarray(v, dtype), n_new)
        plan = gqakv.plan_attention(cache, n_new, q_heads=Hkv * G, t_q=None if packed else T,
                                    packed=packed, **VARIANTS[variant])
        assert plan.shared_prefix.used, plan.shared_prefix.reason
        grouped = {i for g in plan.shared_prefix.groups for i in g.entries}
        assert grouped <= {0, 1, 2, 3} and len(grouped) >= 2, plan.shared_prefix
        assert "shared prefix: entries" in repr(plan)
        qx = arrays.asarray(pack_tokens(q, n_new) if packed else q, dtype)
        out, lse = plan.run(qx, cache, return_lse=True)
        out, lse = arrays.to_numpy(out), arrays.to_numpy(lse)
        if packed:  # back to padded for the comparison
            out, lse = _unpack(out, lse, n_new, T)
        k_rows, v_rows = _rows_of(cache, arrays, B)
        _check(dtype, out, lse, q, k_rows, v_rows, n_new, VARIANTS[variant],
               f"step {step}", quantized=kv_dtype is not None)
        assert len(launches) == step + 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sixteen_bit_results_are_rounded_once(backend, arrays, small_groups, dtype):
    """A backend that takes float32 queries over a 16-bit store (``wide_queries``) runs
    both parts in float32 and rounds once, after the merge: every output lies within one
    16-bit spacing of the float64 reference (plus 1e-5 for float32's own error where
    values cancel). Rounding each part first missed by thousands of spacings on these
    draws (partials of size ~1 rounded, merged into results of size ~1e-4)."""
    if "emulated" in backend.name:
        pytest.skip("the emulator's time: its tiny case is test_cupy_emulated_shared_prefix")
    _skip_unless(backend, dtype)
    if not backend.wide_queries:
        pytest.skip(f"{backend.name} rounds each part to q's dtype (no wide_queries)")
    fmt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    B, Hkv, G, d = 6, 2, 2, 8
    for seed in range(4):
        rng = np.random.default_rng(stable_seed("rounded once", dtype, seed))
        cache = _prefix_cache(backend, arrays, rng, dtype, None)
        for T, n_new in [(5, [5, 2, 0, 3, 4, 2]), (1, [1, 1, 1, 1, 1, 1])]:
            k, v = (_held(arrays, rng.standard_normal((B, Hkv, T, d)), dtype) for _ in range(2))
            q = _held(arrays, rng.standard_normal((B, Hkv * G, T, d)), dtype)
            cache.append(arrays.asarray(k, dtype), arrays.asarray(v, dtype), n_new)
            variant = VARIANTS["softcap+sinks"]
            plan = gqakv.plan_attention(cache, n_new, q_heads=Hkv * G, t_q=T, **variant)
            assert plan.shared_prefix.used, plan.shared_prefix.reason
            out = arrays.to_numpy(plan.run(arrays.asarray(q, dtype), cache))
            k_rows, v_rows = _rows_of(cache, arrays, B)
            want, _ = reference_attention(q, k_rows, v_rows, n_new, **variant)
            spacing = np.abs(np.spacing(want.astype(fmt))).astype(np.float64)
            err = np.abs(out - want)
            worst = float(np.max(err / (spacing + 1e-5)))
            assert worst <= 1.0, (f"seed {seed}, T={T}: an output is {worst:.3g} x (one {dtype} "
                                  "spacing + 1e-5) from the float64 reference: rounded twice?")


def test_gqa_attention_and_out_buffers(backend, arrays, small_groups, monkeypatch):
    """``gqa_attention`` on a paged cache takes the decomposition with no new argument, and
    writes the caller's ``out`` / ``lse_out``; padded slots are exactly 0 / -inf."""
    if "emulated" in backend.name:
        pytest.skip("the emulator's time: its tiny case is test_cupy_emulated_shared_prefix")
    dtype = "float32"
    _skip_unless(backend, dtype)
    rng = np.random.default_rng(3)
    B, Hkv, G, d, T = 6, 2, 2, 8, 3
    cache = _prefix_cache(backend, arrays, rng, dtype, None)
    n_new = [3, 1, 2, 0, 3, 1]
    k, v = (_held(arrays, rng.standard_normal((B, Hkv, T, d)), dtype) for _ in range(2))
    q = _held(arrays, rng.standard_normal((B, Hkv * G, T, d)), dtype)
    cache.append(arrays.asarray(k, dtype), arrays.asarray(v, dtype), n_new)
    launches = counting(monkeypatch, sp.SharedPrefixWork, "launch")
    xp = backend.namespace()
    out = xp.full((B, Hkv * G, T, d), 7.0, dtype=xp.float32)
    lse_out = xp.full((B, Hkv * G, T), 7.0, dtype=xp.float32)
    got, got_lse = gqakv.gqa_attention(arrays.asarray(q, dtype), cache, n_new, return_lse=True,
                                       out=out, lse_out=lse_out)
    assert got is out and got_lse is lse_out and launches == ["launch"]
    got, got_lse = arrays.to_numpy(out), arrays.to_numpy(lse_out)
    k_rows, v_rows = _rows_of(cache, arrays, B)
    _check(dtype, got, got_lse, q, k_rows, v_rows, n_new, {}, "gqa_attention")
    assert (got[3] == 0).all() and np.isneginf(got_lse[3]).all()
    assert (got[1, :, 1:] == 0).all() and np.isneginf(got_lse[1, :, 1:]).all()


def _unpack(out, lse, n_new, T):
    """Packed out [N, Hq, d] / lse [N, Hq] as padded [B, Hq, T, d] / [B, Hq, T] (0, -inf)."""
    B, (_, Hq, d) = len(n_new), out.shape
    full, full_lse = np.zeros((B, Hq, T, d)), np.full((B, Hq, T), -np.inf)
    o = 0
    for b, n in enumerate(n_new):
        full[b, :, :n] = np.swapaxes(out[o:o + n], 0, 1)
        full_lse[b, :, :n] = lse[o:o + n].T
        o += n
    return full, full_lse


# -- a paged ModelKVCache stepped with Step.attend ------------------------------------------


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_cache_step_attend(backend, arrays, small_groups, monkeypatch, dtype, packed):
    """A paged ModelKVCache: a prompt prefilled into row 0, forked into rows 1..3 (beams),
    then decode steps and a two-token step through ``Step.attend`` on every layer: each
    layer matches the reference over that layer's pages, and each layer launched the
    decomposition planned once for the step."""
    if "emulated" in backend.name:
        pytest.skip("the emulator's time: its tiny case is test_cupy_emulated_shared_prefix")
    _skip_unless(backend, dtype)
    if packed and not backend.packed_tokens:
        pytest.skip(f"{backend.name} takes padded tokens only")
    rng = np.random.default_rng(5)
    layers, B, Hkv, G, d = 2, 5, 2, 3, 8
    cache = gqakv.ModelKVCache(layers, B, Hkv, 32, d, dtype=dtype, backend=backend,
                               storage="paged", page_size=4)
    kv = {l: ([], []) for l in range(layers)}  # the direct model: per layer, per row K / V
    prompt = 10
    with cache.step([prompt], rows=[0]) as step:
        for l in range(layers):
            k, v = (_held(arrays, rng.standard_normal((1, Hkv, prompt, d)), dtype) for _ in range(2))
            step.write(l, arrays.asarray(k, dtype), arrays.asarray(v, dtype))
            kv[l] = ([k[0]] * 4 + [np.zeros((Hkv, 0, d))], [v[0]] * 4 + [np.zeros((Hkv, 0, d))])
    cache.fork(0, [1, 2, 3])
    launches = counting(monkeypatch, sp.SharedPrefixWork, "launch")
    for T, n_new in [(1, [1, 1, 1, 1, 1]), (2, [2, 1, 2, 0, 2]), (1, [1, 1, 1, 1, 1])]:
        before = len(launches)
        with cache.step(n_new) as step:
            for l in range(layers):
                k, v = (_held(arrays, rng.standard_normal((B, Hkv, T, d)), dtype) for _ in range(2))
                q = _held(arrays, rng.standard_normal((B, Hkv * G, T, d)), dtype)
                for b, n in enumerate(n_new):
                    kv[l][0][b] = np.concatenate([kv[l][0][b], k[b, :, :n]], axis=1)
                    kv[l][1][b] = np.concatenate([kv[l][1][b], v[b, :, :n]], axis=1)
                xs = [pack_tokens(x, n_new) if packed else x for x in (q, k, v)]
                out, lse = step.attend(l, *(arrays.asarray(x, dtype) for x in xs), return_lse=True)
                out, lse = arrays.to_numpy(out), arrays.to_numpy(lse)
                if packed:
                    out, lse = _unpack(out, lse, n_new, T)
                _check(dtype, out, lse, q, kv[l][0], kv[l][1], n_new, {}, f"layer {l} n_new {n_new}")
            plan = (step.plan_attention(Hkv * G, packed=True) if packed
                    else step.plan_attention(Hkv * G, t_q=T))
            assert plan.shared_prefix.used, plan.shared_prefix.reason
        assert len(launches) - before == layers


# -- the functional API with a caller's table that repeats page ids -------------------------


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_paged_attention_caller_table(backend, arrays, small_groups, monkeypatch, packed):
    """``paged_attention`` over caller-owned pools whose table names the same first pages
    in rows 0, 1 and 3 (row 2 its own pages): the decomposition groups them and the result
    matches the reference over the rows the table describes."""
    if "emulated" in backend.name:
        pytest.skip("the emulator's time: its tiny case is test_cupy_emulated_shared_prefix")
    dtype = "float32"
    _skip_unless(backend, dtype)
    if packed and not backend.packed_tokens:
        pytest.skip(f"{backend.name} takes padded tokens only")
    rng = np.random.default_rng(11)
    Hkv, G, d, P, num_pages = 2, 2, 8, 4, 24
    k_pool = _held(arrays, rng.standard_normal((num_pages, Hkv, P, d)), dtype)
    v_pool = _held(arrays, rng.standard_normal((num_pages, Hkv, P, d)), dtype)
    table = np.full((4, 6), -1, np.int32)
    table[0, :5] = [3, 7, 1, 9, 10]
    table[1, :4] = [3, 7, 1, 12]
    table[2, :3] = [4, 5, 6]
    table[3, :6] = [3, 7, 1, 9, 15, 16]
    lens = np.array([19, 14, 12, 22])
    n_new = np.array([2, 1, 3, 2])
    T = 3
    q = _held(arrays, rng.standard_normal((4, Hkv * G, T, d)), dtype)
    for b, n in enumerate(n_new):
        q[b, :, n:] = 0
    launches = counting(monkeypatch, sp.SharedPrefixWork, "launch")
    qx = arrays.asarray(pack_tokens(q, n_new) if packed else q, dtype)
    out, lse = gqakv.paged_attention(qx, arrays.asarray(k_pool, dtype), arrays.asarray(v_pool, dtype),
                                     table, lens, n_new, return_lse=True, backend=backend)
    assert launches == ["launch"]
    out, lse = arrays.to_numpy(out), arrays.to_numpy(lse)
    if packed:
        want, want_lse = reference_attention(q, *_table_rows(k_pool, v_pool, table, lens, P), n_new)
        np.testing.assert_allclose(out, pack_tokens(want, n_new), atol=2e-5, rtol=0)
        np.testing.assert_allclose(lse, pack_tokens(want_lse, n_new), atol=2e-4, rtol=2e-5)
        return
    k_rows, v_rows = _table_rows(k_pool, v_pool, table, lens, P)
    _check(dtype, out, lse, q, k_rows, v_rows, n_new, {}, "paged_attention")


def test_paged_append_attention_caller_table(backend, arrays, small_groups, monkeypatch):
    """``paged_append_attention`` plans before it writes: rows 0 and 1 name the same first
    pages, each appends into its own last page, and the decomposition reads the shared
    ones once; the result matches the reference over the pools after the append."""
    if "emulated" in backend.name:
        pytest.skip("the emulator's time: its tiny case is test_cupy_emulated_shared_prefix")
    dtype = "float32"
    _skip_unless(backend, dtype)
    rng = np.random.default_rng(12)
    Hkv, G, d, P, T = 2, 2, 8, 4, 2
    k_pool, v_pool = (_held(arrays, rng.standard_normal((10, Hkv, P, d)), dtype) for _ in range(2))
    table = np.array([[2, 5, 7, -1], [2, 5, 8, 9], [1, 3, -1, -1]], np.int32)
    lens, n_new = np.array([10, 14, 6]), np.array([2, 1, 2])
    k_new, v_new = (_held(arrays, rng.standard_normal((3, Hkv, T, d)), dtype) for _ in range(2))
    q = _held(arrays, rng.standard_normal((3, Hkv * G, T, d)), dtype)
    kp, vp = arrays.asarray(k_pool, dtype), arrays.asarray(v_pool, dtype)
    launches = counting(monkeypatch, sp.SharedPrefixWork, "launch")
    out, lse = gqakv.paged_append_attention(arrays.asarray(q, dtype), arrays.asarray(k_new, dtype),
                                            arrays.asarray(v_new, dtype), kp, vp, table, lens, n_new,
                                            return_lse=True, backend=backend)
    assert launches == ["launch"]
    k_rows, v_rows = _table_rows(arrays.to_numpy(kp), arrays.to_numpy(vp), table, lens, P)
    _check(dtype, arrays.to_numpy(out), arrays.to_numpy(lse), q, k_rows, v_rows, n_new, {},
           "paged_append_attention")


def _table_rows(k_pool, v_pool, table, lens, P):
    """Each row's live K / V [Hkv, L, d] read through a page table (the reference's rows)."""
    ks, vs = [], []
    for b, L in enumerate(lens):
        pages = table[b, :-(-int(L) // P)]
        ks.append(np.concatenate([k_pool[p] for p in pages], axis=1)[:, :L])
        vs.append(np.concatenate([v_pool[p] for p in pages], axis=1)[:, :L])
    return ks, vs


# -- where it must not run, and why -----------------------------------------------------------


@pytest.mark.parametrize("what,variant,reason", [
    ("window", {"window": 3}, "sliding window=3"),
    ("window+alibi", {"window": 5, "alibi_slopes": ALIBI4}, "sliding window=5"),
    ("negative alibi", {"alibi_slopes": (0.5, -0.25, 0.0, 0.1)}, "ALiBi with a negative slope"),
])
def test_refused_for_position_dependent_variants(small_groups, monkeypatch, what, variant, reason):
    """Which keys a query sees under a window its rows outgrow (12 tokens here) depends on
    its position, and a negative ALiBi slope makes LSEs as large as the positions: the plan
    keeps the normal path, says why, and still matches the reference."""
    backend = gqakv.get_backend("numpy")
    arrays = BackendArrays(backend)
    rng = np.random.default_rng(2)
    cache = _prefix_cache(backend, arrays, rng, "float64", None)
    n_new = [1, 1, 1, 1, 1, 0]
    k = rng.standard_normal((6, 2, 1, 8))
    cache.append(k, k, n_new)
    launches = counting(monkeypatch, sp.SharedPrefixWork, "launch")
    plan = gqakv.plan_attention(cache, n_new, q_heads=4, **variant)
    assert not plan.shared_prefix.used and reason in plan.shared_prefix.reason
    assert "shared prefix not used" in repr(plan)
    q = rng.standard_normal((6, 4, 1, 8))
    out, lse = plan.run(q, cache, return_lse=True)
    assert launches == []
    k_rows, v_rows = _rows_of(cache, arrays, 6)
    _check("float64", out, lse, q, k_rows, v_rows, n_new, variant, what)


@pytest.mark.parametrize("variant", [{"window": 16}, {"window": 16, "softcap": 2.0, "sinks": SINKS4},
                                     {"window": 16, "alibi_slopes": ALIBI4}],
                         ids=["window", "window+softcap+sinks", "window+alibi"])
def test_a_window_groups_the_rows_it_does_not_reach_into(backend, arrays, small_groups,
                                                         monkeypatch, variant):
    """Forked rows under a 16-token window: an entry whose row is at most 16 tokens long
    (its queries' windows reach back to key 0) is grouped, a longer one takes the normal
    path, and once every sharing entry is longer the plan says why; every step matches
    the float64 reference with the window (which the rows past 16 tokens feel)."""
    if "emulated" in backend.name:
        pytest.skip("the emulator's time: its tiny case is test_cupy_emulated_shared_prefix")
    _skip_unless(backend, "float32")
    rng = np.random.default_rng(stable_seed("window", *variant))
    B, Hkv, G, d, W = 6, 2, 2, 8, 16
    cache = _prefix_cache(backend, arrays, rng, "float32", None)
    launches = counting(monkeypatch, sp.SharedPrefixWork, "launch")
    steps = [(5, [5, 2, 0, 3, 4, 2], {0, 1, 3}), (1, [1, 1, 1, 1, 1, 1], {1, 2, 3}),
             (3, [1, 3, 2, 1, 0, 1], {2, 3}), (1, [1, 1, 0, 1, 1, 1], None)]
    for step, (T, n_new, grouped) in enumerate(steps):
        k, v = (_held(arrays, rng.standard_normal((B, Hkv, T, d)), "float32") for _ in range(2))
        q = _held(arrays, rng.standard_normal((B, Hkv * G, T, d)), "float32")
        cache.append(arrays.asarray(k, "float32"), arrays.asarray(v, "float32"), n_new)
        plan = gqakv.plan_attention(cache, n_new, q_heads=Hkv * G, t_q=T, **variant)
        if grouped is None:  # rows 0, 1 and 3 are 17-19 tokens long, row 2 has no query
            assert not plan.shared_prefix.used
            assert (f"sliding window={W}: 3 entries are longer than the window"
                    in plan.shared_prefix.reason), plan.shared_prefix.reason
        else:
            assert {i for g in plan.shared_prefix.groups for i in g.entries} == grouped
        out, lse = plan.run(arrays.asarray(q, "float32"), cache, return_lse=True)
        k_rows, v_rows = _rows_of(cache, arrays, B)
        assert max(len(r[0, :, 0]) for r in k_rows) > W or step < 2  # the window bites some rows
        _check("float32", arrays.to_numpy(out), arrays.to_numpy(lse), q, k_rows, v_rows, n_new,
               variant, f"step {step}")
    assert len(launches) == 3


def test_refused_without_shared_pages(monkeypatch):
    """Contiguous storage, paged rows that share nothing, and (at the real threshold) a
    prefix shorter than MIN_SHARED_TOKENS: each plan gives its reason."""
    rng = np.random.default_rng(4)
    d = 8
    k = rng.standard_normal((4, 2, 20, d))
    flat = gqakv.KVCache(4, 2, 32, d, dtype="float64", backend="numpy")
    flat.append(k, k, [20] * 4)
    plan = gqakv.plan_attention(flat, [1] * 4, q_heads=4)
    assert not plan.shared_prefix.used and "contiguous storage" in plan.shared_prefix.reason
    own = gqakv.PagedKVCache(4, 2, 32, d, dtype="float64", backend="numpy", page_size=4)
    own.append(k, k, [20] * 4)
    plan = gqakv.plan_attention(own, [1] * 4, q_heads=4)
    assert "no two entries' rows share a page" in plan.shared_prefix.reason
    shared = gqakv.PagedKVCache(4, 2, 300, d, dtype="float64", backend="numpy", page_size=4)
    shared.append(k[:1], k[:1], [20], rows=[0])
    shared.fork(0, [1, 2, 3])
    plan = gqakv.plan_attention(shared, [1] * 4, q_heads=4)
    assert not plan.shared_prefix.used
    assert "rows share at most 16 tokens" in plan.shared_prefix.reason
    assert f"MIN_SHARED_TOKENS={sp.MIN_SHARED_TOKENS}" in plan.shared_prefix.reason
    # past MIN_SHARED_TOKENS, a group must still save MIN_SAVED_TOKENS key reads
    monkeypatch.setattr(sp, "MIN_SHARED_TOKENS", 1)
    monkeypatch.setattr(sp, "MIN_SAVED_TOKENS", 49)
    reason = gqakv.plan_attention(shared, [1] * 4, q_heads=4).shared_prefix.reason
    assert reason == "the best group saves 48 key reads (fewer than MIN_SAVED_TOKENS=49)"
    monkeypatch.setattr(sp, "MIN_SAVED_TOKENS", 48)
    assert gqakv.plan_attention(shared, [1] * 4, q_heads=4).shared_prefix.used
    monkeypatch.setattr(sp, "MIN_SAVED_TOKENS", 1)
    # idle entries never join a group
    plan = gqakv.plan_attention(shared, [1, 0, 0, 0], q_heads=4)
    assert "1 entries with queries" in plan.shared_prefix.reason
    assert gqakv.plan_attention(shared, [0, 1, 0, 1], q_heads=4).shared_prefix.groups == (
        sp.SharedGroup((1, 3), 4, 16),)


def test_batch_invariant_mode_turns_it_off(small_groups, monkeypatch):
    """In batch-invariant mode a query's bits must not depend on which rows share its
    pages: the plan runs the normal path and says why."""
    from gqakv.core import invariance

    cache = gqakv.PagedKVCache(3, 1, 16, 4, dtype="float64", backend="numpy", page_size=4)
    k = np.ones((1, 1, 9, 4))
    cache.append(k, k, [9], rows=[0])
    cache.fork(0, [1, 2])
    assert gqakv.plan_attention(cache, [1, 1, 1], q_heads=1).shared_prefix.used
    launches = counting(monkeypatch, sp.SharedPrefixWork, "launch")
    with invariance.batch_invariant():
        plan = gqakv.plan_attention(cache, [1, 1, 1], q_heads=1)
        plan.run(np.ones((3, 1, 1, 4)), cache)
    assert "batch-invariant mode" in plan.shared_prefix.reason and launches == []


def test_decide_an_off_switch_and_fixed_plans():
    """The one decision point: a mode's sentence (``off``) and fixed plans turn it off."""
    cache = gqakv.PagedKVCache(2, 1, 16, 4, dtype="float64", backend="numpy", page_size=4)
    k = np.ones((1, 1, 9, 4))
    cache.append(k, k, [9], rows=[0])
    cache.fork(0, [1])
    plan = gqakv.plan_attention(cache, [1, 1], q_heads=1)
    inputs = plan.inputs
    got = sp.decide(cache.store, inputs, plan.q_shape, off="batch-invariant mode")
    assert not got.used and got.reason == "batch-invariant mode"
    assert "fixed plan" in sp.decide(cache.store, inputs, plan.q_shape, fixed=True).reason


def test_grouping(monkeypatch):
    """Two prompts forked into two families form two groups, each over its common pages;
    a family whose members share fewer pages with one member leaves that one out when
    grouping it costs more reads than it saves; MAX_GROUP_QUERIES cuts a long group."""
    monkeypatch.setattr(sp, "MIN_SHARED_TOKENS", 1)
    monkeypatch.setattr(sp, "MIN_SAVED_TOKENS", 1)
    rng = np.random.default_rng(0)
    c = gqakv.PagedKVCache(8, 1, 64, 4, dtype="float64", backend="numpy", page_size=4)
    a, b = rng.standard_normal((2, 1, 1, 24, 4))
    c.append(a, a, [24], rows=[0])
    c.append(b, b, [12], rows=[4])
    c.fork(0, [1, 2])
    c.fork(4, [5, 6])
    c.truncate([3], [0])
    # row 3 shares only the first page of family 0 (a fork truncated to 4 tokens)
    c.fork(0, [3])
    c.truncate([3], [4])
    x = rng.standard_normal((8, 1, 1, 4))
    n = [1, 1, 1, 1, 1, 1, 1, 0]
    c.append(x, x, n)
    plan = gqakv.plan_attention(c, n, q_heads=1)
    assert plan.shared_prefix.groups == (sp.SharedGroup((0, 1, 2), 6, 24),
                                         sp.SharedGroup((4, 5, 6), 3, 12))
    monkeypatch.setattr(sp, "MAX_GROUP_QUERIES", 2)
    plan = gqakv.plan_attention(c, n, q_heads=1)
    # two queries per group: family 0 splits, its rest (2 and 3) share one page
    assert plan.shared_prefix.groups == (sp.SharedGroup((0, 1), 6, 24), sp.SharedGroup((2, 3), 1, 4),
                                         sp.SharedGroup((4, 5), 3, 12))
    monkeypatch.setattr(sp, "MAX_GROUP_QUERIES", 1)
    reason = gqakv.plan_attention(c, n, q_heads=1).shared_prefix.reason
    assert reason == "two entries' queries (G x n_new each) exceed MAX_GROUP_QUERIES=1 per KV head"
    # a group needs MIN_SHARED_TOKENS: family 0 alone (24 tokens) then, row 3 left out
    monkeypatch.setattr(sp, "MAX_GROUP_QUERIES", 4096)
    monkeypatch.setattr(sp, "MIN_SHARED_TOKENS", 20)
    plan = gqakv.plan_attention(c, n, q_heads=1)
    assert plan.shared_prefix.groups == (sp.SharedGroup((0, 1, 2), 6, 24),)


@pytest.mark.parametrize("backend_name", ["numpy", "numba"])
def test_narrow_storage_asks_the_backends_factor_of_saved_reads(backend_name):
    """A group must save ``MIN_SAVED_TOKENS`` key reads times its backend's
    ``shared_prefix_read_factor`` for the storage's bytes per value: numba's kernels are
    compute-bound on 16-bit and 8-bit storage (4x and 16x: a shared call there costs
    about what the reads it saves do), numpy keeps the default (1x). Rows forked from one
    prompt, one decode token each, at the edges of each threshold; the refusal names it."""
    be = gqakv.get_backend(backend_name)
    if be.unavailable_reason():
        pytest.skip(be.unavailable_reason())
    P, d = 16, 16
    factors = {"float32": 1, "bfloat16": 4, "int8": 16} if backend_name == "numba" else \
        {"float32": 1, "bfloat16": 1, "int8": 1}
    rng = np.random.default_rng(5)
    for storage, factor in factors.items():
        dtype, kv_dtype = ("bfloat16", "int8") if storage == "int8" else (storage, None)
        least = sp.MIN_SAVED_TOKENS * factor
        assert sp.min_saved_tokens(be, StorageSpec.of(dtype, kv_dtype=kv_dtype), d) == least
        prompt = least // 2  # 3 rows save 2 x prompt reads: exactly the threshold
        for rows, grouped in ((3, True), (2, False)):
            c = gqakv.PagedKVCache(rows, 1, prompt + 1, d, dtype=dtype, backend=be, page_size=P,
                                   kv_dtype=kv_dtype)
            x = rng.standard_normal((1, 1, prompt, d)).astype(np.float32)
            k = be.from_numpy(x, dtype)
            c.append(k, k, [prompt], rows=[0])
            c.fork(0, list(range(1, rows)))
            x = be.from_numpy(rng.standard_normal((rows, 1, 1, d)).astype(np.float32), dtype)
            c.append(x, x, [1] * rows)
            decision = gqakv.plan_attention(c, [1] * rows, q_heads=4).shared_prefix
            assert decision.used == grouped, (storage, rows, decision)
            if not grouped:
                assert f"fewer than {least}" in decision.reason or \
                    f"MIN_SAVED_TOKENS={least}" in decision.reason, decision.reason
                if factor > 1:
                    assert f"x {factor}" in decision.reason and storage in decision.reason


def test_stale_pages_refused(small_groups):
    """A held plan refuses a cache whose rows kept their lengths but changed pages (a
    reorder): its tables were read when it was planned."""
    rng = np.random.default_rng(1)
    c = gqakv.PagedKVCache(3, 1, 32, 4, dtype="float64", backend="numpy", page_size=4)
    x = rng.standard_normal((1, 1, 12, 4))
    c.append(x, x, [12], rows=[0])
    c.fork(0, [1])
    y = rng.standard_normal((1, 1, 12, 4))
    c.append(y, y, [12], rows=[2])
    plan = gqakv.plan_attention(c, [1, 1, 1], q_heads=2, t_q=1)
    assert plan.shared_prefix.used
    c.reorder([2, 1, 0])
    with pytest.raises(ValueError, match="row 0's pages changed"):
        plan.run(rng.standard_normal((3, 2, 1, 4)), c)


def test_store_views_share_the_pool(small_groups):
    """The per-layer views read the layer's own pool through the planned tables (no copy)."""
    c = gqakv.PagedKVCache(2, 1, 32, 4, dtype="float64", backend="numpy", page_size=4)
    x = np.ones((1, 1, 12, 4))
    c.append(x, x, [12], rows=[0])
    c.fork(0, [1])
    c.append(np.ones((2, 1, 1, 4)), np.ones((2, 1, 1, 4)), [1, 1])
    plan = gqakv.plan_attention(c, [1, 1], q_heads=1)
    work = plan._shared
    for view in (work.shared_store(c.store), work.suffix_store(c.store)):
        assert isinstance(view, PagedStore) and view.k is c.store.k and view.v is c.store.v
    assert work.shared_table.entries.tolist() == [c.store.page_table.entries[0, :3].tolist()]


@pytest.mark.parametrize("rows,want", [(4, "numba kernel"), (40, "numpy BLAS")])
def test_numba_virtual_call_route(small_groups, monkeypatch, rows, want):
    """On numba the shared call (G' = G x the group's queries per KV head, one query
    position) runs the kernel while its tile holds at most KERNEL_MAX_TILE_ROWS rows and
    the BLAS path past it (measured faster there) over a prefix longer than
    KERNEL_SHORT_ROW_KEYS (shorter rows take the kernels at any tile size); spies on both
    entries say which ran."""
    from gqakv_backends import numba_backend, numpy_attention

    backend = gqakv.get_backend("numba")
    if backend.unavailable_reason():
        pytest.skip(backend.unavailable_reason())
    G = 8  # 4 rows x 8 heads = 32 tile rows (the kernel's, at most 64), 40 x 8 = 320 (BLAS)
    c = gqakv.PagedKVCache(rows, 1, 144, 8, dtype="float32", backend=backend, page_size=4)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, 136, 8)).astype(np.float32)
    c.append(x, x, [136], rows=[0])
    c.fork(0, list(range(1, rows)))
    y = rng.standard_normal((rows, 1, 1, 8)).astype(np.float32)
    c.append(y, y, [1] * rows)
    plan = gqakv.plan_attention(c, [1] * rows, q_heads=G)
    assert plan.shared_prefix.groups == (sp.SharedGroup(tuple(range(rows)), 34, 136),)
    v_inputs, v_shape, _ = plan._shared.shared[0]
    assert v_shape == (1, G * rows, 1, 8)
    request = Request.of_store("attention", c.store, group=G * rows)
    assert backend.route(request).impl == want
    kernels = counting(monkeypatch, numba_backend, "run_numba")
    blas = counting(monkeypatch, numpy_attention, "attention_store")
    q = rng.standard_normal((rows, G, 1, 8)).astype(np.float32)
    out, lse = plan.run(q, c, return_lse=True)
    # the suffix call (G = 8 rows per tile) runs the kernel either way
    assert (len(kernels), len(blas)) == ((2, 0) if want == "numba kernel" else (1, 1))
    k_rows, v_rows = _rows_of(c, BackendArrays(backend), rows)
    _check("float32", out, lse, q, k_rows, v_rows, [1] * rows, {}, "numba route")


# -- the CUDA kernels on the emulator: one tiny case ----------------------------------------


def test_cupy_emulated_shared_prefix(small_groups, monkeypatch):
    """The cupy backend (its kernels on the CPU emulator), d = 8, float32 pages: a forked
    decode batch runs both parts through the paged kernels and matches the reference
    (plain causal: the emulation library builds the paged kernels for plain causal,
    window+softcap+sinks and all four features only, and a window turns the
    decomposition off)."""
    variant = "causal"
    from .cuda_emu import harness

    if harness.compiler() is None:
        pytest.skip("no C++ compiler (g++) for the CUDA emulation harness")
    from .support.product import _emulated_cupy

    backend = _emulated_cupy()
    if backend.unavailable_reason():
        pytest.skip(backend.unavailable_reason())
    arrays = BackendArrays(backend)
    rng = np.random.default_rng(9)
    B, Hkv, G, d = 4, 1, 4, 8
    cache = gqakv.PagedKVCache(B, Hkv, 24, d, dtype="float32", backend=backend, page_size=4)
    k, v = (_held(arrays, rng.standard_normal((1, Hkv, 9, d)), "float32") for _ in range(2))
    cache.append(arrays.asarray(k, "float32"), arrays.asarray(v, "float32"), [9], rows=[0])
    cache.fork(0, [1, 2])
    n_new = [1, 1, 1, 0]
    k, v = (_held(arrays, rng.standard_normal((B, Hkv, 1, d)), "float32") for _ in range(2))
    q = _held(arrays, rng.standard_normal((B, Hkv * G, 1, d)), "float32")
    cache.append(arrays.asarray(k, "float32"), arrays.asarray(v, "float32"), n_new)
    launches = counting(monkeypatch, sp.SharedPrefixWork, "launch")
    plan = gqakv.plan_attention(cache, n_new, q_heads=Hkv * G, **VARIANTS[variant])
    assert plan.shared_prefix.groups == (sp.SharedGroup((0, 1, 2), 2, 8),)
    out, lse = plan.run(arrays.asarray(q, "float32"), cache, return_lse=True)
    assert launches == ["launch"]
    k_rows, v_rows = _rows_of(cache, arrays, B)
    _check("float32", arrays.to_numpy(out), arrays.to_numpy(lse), q, k_rows, v_rows, n_new,
           VARIANTS[variant], "cupy_emulated")
