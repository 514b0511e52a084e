"""Merging partial attentions never hides a NaN: gqakv.merge_attention on every backend,
the NumPy backend's merge of split key pieces, and the cupy backend's split-decode merge
kernel (merge.cu) on the CPU emulator.

The rule, everywhere: a partial whose lse is -inf saw no key and contributes nothing (even
if its output holds NaN); a NaN in a contributing partial's output, or a NaN or +inf in
any partial's lse, gives NaN in the merged result, never 0; a query no partial saw gives
out = 0, lse = -inf.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import gqakv

from .support.reference import reference_attention

NAN, INF = math.nan, math.inf


def merged_reference(outs, lses):
    """The merge of S partials in float64, straight from the definition and the rule.

    outs: [S, ..., d]; lses: [S, ...]. Returns (out [..., d], lse [...])."""
    outs, lses = np.asarray(outs, np.float64), np.asarray(lses, np.float64)
    out = np.zeros(outs.shape[1:])
    lse = np.full(lses.shape[1:], -INF)
    for idx in np.ndindex(*lses.shape[1:]):
        ls = lses[(slice(None), *idx)]
        if np.isnan(ls).any() or (ls == INF).any():
            out[idx], lse[idx] = NAN, NAN
            continue
        seen = ls > -INF
        if not seen.any():
            continue
        m = ls[seen].max()
        w = np.exp(ls[seen] - m)
        out[idx] = (w[:, None] * outs[(seen, *idx)]).sum(axis=0) / w.sum()
        lse[idx] = m + math.log(w.sum())
    return out, lse


# (name, lse_a, out_a, lse_b, out_b, expected out, expected lse); out rows have d = 4.
ONES, TWOS = [1.0] * 4, [2.0] * 4
CASES = [
    ("nan_lse_and_out_vs_good", NAN, [NAN] * 4, 0.0, ONES, [NAN] * 4, NAN),
    ("nan_lse_finite_out", NAN, TWOS, 0.0, ONES, [NAN] * 4, NAN),
    ("good_vs_nan_lse", 0.0, ONES, NAN, TWOS, [NAN] * 4, NAN),
    ("both_nan", NAN, ONES, NAN, TWOS, [NAN] * 4, NAN),
    ("empty_part_nan_out", -INF, [NAN] * 4, 0.5, ONES, ONES, 0.5),
    ("empty_vs_nan_lse", -INF, ONES, NAN, TWOS, [NAN] * 4, NAN),
    ("nan_out_element", 0.0, [2.0, NAN, 2.0, 2.0], 0.0, ONES, [1.5, NAN, 1.5, 1.5], math.log(2)),
    # weight exp(-200) underflows to 0 in float32: the NaN must still show
    ("nan_out_tiny_weight", -200.0, [2.0, NAN, 2.0, 2.0], 0.0, ONES, [1.0, NAN, 1.0, 1.0], 0.0),
    ("plus_inf_lse", INF, TWOS, 0.0, ONES, [NAN] * 4, NAN),
    ("both_plus_inf", INF, TWOS, INF, ONES, [NAN] * 4, NAN),
    ("plus_inf_vs_empty", INF, TWOS, -INF, ONES, [NAN] * 4, NAN),
    ("both_empty", -INF, [NAN] * 4, -INF, [NAN] * 4, [0.0] * 4, -INF),
    ("finite", 1.0, TWOS, 0.0, ONES, [1 + 1 / (1 + math.exp(-1))] * 4, 1 + math.log1p(math.exp(-1))),
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_merge_attention_non_finite_partials(backend, arrays, dtype):
    """Every case of the table at once (one query per case), so the cases also show that
    a NaN query leaves its neighbours alone."""
    lse_a = arrays.asarray(np.array([c[1] for c in CASES], dtype))
    out_a = arrays.asarray(np.array([c[2] for c in CASES], dtype))
    lse_b = arrays.asarray(np.array([c[3] for c in CASES], dtype))
    out_b = arrays.asarray(np.array([c[4] for c in CASES], dtype))
    out, lse = gqakv.merge_attention(out_a, lse_a, out_b, lse_b)
    out, lse = arrays.to_numpy(out), arrays.to_numpy(lse)
    tol = 1e-6 if dtype == "float32" else 1e-12
    for i, (name, *_, want_out, want_lse) in enumerate(CASES):
        np.testing.assert_allclose(out[i], want_out, rtol=tol, atol=tol, err_msg=name)
        np.testing.assert_allclose(lse[i], want_lse, rtol=tol, atol=tol, err_msg=name)
    # the float64 loop of the rule agrees with the table
    ref_out, ref_lse = merged_reference([[c[2] for c in CASES], [c[4] for c in CASES]],
                                        [[c[1] for c in CASES], [c[3] for c in CASES]])
    nan_out_cases = {"nan_out_element", "nan_out_tiny_weight"}
    for i, (name, *_rest) in enumerate(CASES):
        if name not in nan_out_cases:  # the reference does not model element-wise NaN outputs
            np.testing.assert_allclose(ref_out[i], out[i], rtol=tol, atol=tol, err_msg=name)
        np.testing.assert_allclose(ref_lse[i], lse[i], rtol=tol, atol=tol, err_msg=name)


def test_merge_attention_random_parts_match_reference(backend, arrays):
    """Random lse over several orders of magnitude, with empty parts: float64 merge equals
    the reference formula; merging three parts in either association gives the same."""
    rng = np.random.default_rng(3)
    S, n, d = 3, 40, 8
    outs = rng.standard_normal((S, n, d))
    lses = rng.standard_normal((S, n)) * 30
    lses[rng.random((S, n)) < 0.3] = -INF
    outs[np.isneginf(lses)] = NAN  # an empty part's output is never read
    want_out, want_lse = merged_reference(outs, lses)
    a = [(arrays.asarray(outs[s], "float64"), arrays.asarray(lses[s], "float64")) for s in range(S)]
    left = gqakv.merge_attention(*gqakv.merge_attention(*a[0], *a[1]), *a[2])
    right = gqakv.merge_attention(*a[0], *gqakv.merge_attention(*a[1], *a[2]))
    for out, lse in (left, right):
        np.testing.assert_allclose(arrays.to_numpy(out), want_out, atol=1e-12)
        np.testing.assert_allclose(arrays.to_numpy(lse), want_lse, atol=1e-12)


# -- the NumPy backend's merge of split key pieces --------------------------------------------


def test_numpy_split_rows_keep_a_nan_query_nan():
    """attention_numpy cuts long rows into key pieces and merges them (backends/numpy_attention
    ``_merge``); a NaN query on such a row gives NaN for that query only, every other query
    matches the float64 reference."""
    from gqakv_backends.numpy_attention import _plan, attention_numpy

    rng = np.random.default_rng(4)
    B, Hkv, G, T, d, L = 2, 2, 3, 2, 16, 300
    k = rng.standard_normal((B, Hkv, L, d))
    v = rng.standard_normal((B, Hkv, L, d))
    q = rng.standard_normal((B, Hkv * G, T, d))
    q[0, 4, 1] = NAN  # entry 0, query head 4 (KV head 1), token 1
    lens, n_new, rows = np.array([L, L - 40]), np.array([T, T]), np.arange(B)
    kw = dict(min_key_split=16, workers=2, parallel_min_work=0)
    items, _ = _plan(lens, n_new, Hkv, G, 2, 256, 16)
    assert any(it[5] > 0 for it in items if it[0] == 0), "row 0 was not split into key pieces"
    out, lse = attention_numpy(q, k, v, rows, lens, n_new, scale=1 / math.sqrt(d),
                               return_lse=True, **kw)
    ref, ref_lse = reference_attention(q, [k[b, :, :lens[b]] for b in range(B)],
                                       [v[b, :, :lens[b]] for b in range(B)], n_new)
    bad = np.zeros((B, Hkv * G, T), bool)
    bad[0, 4, 1] = True
    assert np.isnan(out[bad]).all() and np.isnan(lse[bad]).all()
    assert not np.isnan(out[~bad]).any() and not np.isnan(lse[~bad]).any()
    np.testing.assert_allclose(out[~bad], ref[~bad], atol=1e-12)
    np.testing.assert_allclose(lse[~bad], ref_lse[~bad], atol=1e-12)


# -- the cupy backend's split-decode merge kernel, on the CPU emulator ------------------------


def _emulator():
    from .cuda_emu import harness

    if harness.compiler() is None:
        pytest.skip("no C++ compiler (g++) for the CUDA emulation harness")
    return harness


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("d", [64, 20])
def test_cuda_merge_kernel_non_finite_partials(dtype, d):
    """gqakv_merge (merge.cu) alone, on hand-made fp32 partials [B, Hq, 1, S, d]: one query
    per case of the rule over three splits, against the float64 merge of the rule."""
    harness = _emulator()
    import ml_dtypes

    from gqakv_backends.cupy_backend import plan as planmod
    from gqakv_backends.cupy_backend import sources

    rng = np.random.default_rng(5)
    S, keys = 3, 10
    # per query: lse of splits 0..2, and (split, element) of part_o set to NaN (or None)
    rows = [
        ((0.3, 1.2, -0.5), None),           # finite
        ((0.3, NAN, -0.5), None),           # a NaN lse
        ((NAN, NAN, NAN), None),            # all NaN (fmaxf alone would give -inf, then 0)
        ((0.3, 1.2, -INF), (2, "all")),     # split 2 saw no key; its output is garbage
        ((INF, 1.2, -0.5), None),           # +inf lse
        ((-INF, -INF, -INF), (0, "all")),   # no key at all: 0 and -inf
        ((0.3, 1.2, -0.5), (1, 3)),         # one NaN element of a contributing split
        ((-150.0, 0.0, -INF), (0, 5)),      # its weight underflows to 0: NaN still shows
        ((-INF, NAN, 0.0), None),           # NaN next to an empty split
    ]
    Hq = len(rows)
    part_lse = np.array([r[0] for r in rows], np.float32).reshape(1, Hq, 1, S)
    part_o = rng.standard_normal((1, Hq, 1, S, d)).astype(np.float32)
    for h, (_, poison) in enumerate(rows):
        if poison is not None:
            s, e = poison
            part_o[0, h, 0, s, slice(None) if e == "all" else e] = NAN
    st = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    out = np.full((1, Hq, 1, d), 7.0, st)  # every element is written: 7 would show a gap
    lse = np.full((1, Hq, 1), 7.0, np.float32)
    lens, n_new = np.array([S * keys], np.int64), np.array([1], np.int64)
    strides = tuple(np.int64(s // out.itemsize) for s in out.strides[:3])
    launch = planmod.Launch("gqakv_merge", sources.name_expression("gqakv_merge", dtype, d),
                            (Hq, 1, 1), planmod.BLOCK,
                            (planmod.Buf("part_o"), planmod.Buf("part_lse"), planmod.Buf("n_new"),
                             planmod.Buf("out"), planmod.Buf("lse"), np.int32(Hq), np.int32(1),
                             np.int32(S), planmod.KernelParams(scale=1.0), *strides))
    emu = harness.Emulator(harness.build(asan=False))
    emu.run(planmod.Plan(launches=[launch]),
            {"part_o": part_o, "part_lse": part_lse, "lens": lens, "n_new": n_new,
             "out": out, "lse": lse})
    want_out = np.zeros((Hq, d))
    want_lse = np.zeros(Hq)
    for h in range(Hq):
        o, l_ = merged_reference(part_o[0, h, 0][:, None, :], part_lse[0, h, 0][:, None])
        want_out[h], want_lse[h] = o[0], l_[0]
        s_e = rows[h][1]
        if s_e is not None and s_e[1] != "all" and part_lse[0, h, 0, s_e[0]] > -INF:
            want_out[h, s_e[1]] = NAN  # the element-wise NaN of a contributing split
    got = out.astype(np.float64)[0, :, 0]
    rounding = np.abs(want_out.astype(st).astype(np.float64) - want_out)
    tol = 2 * np.nanmax(rounding) + 2e-6
    for h in range(Hq):
        np.testing.assert_array_equal(np.isnan(got[h]), np.isnan(want_out[h]), err_msg=f"query {h}")
        ok = ~np.isnan(want_out[h])
        assert np.abs(got[h][ok] - want_out[h][ok]).max(initial=0) <= tol, f"query {h}"
        if np.isnan(want_lse[h]):
            assert np.isnan(lse[0, h, 0]), f"query {h}: lse {lse[0, h, 0]} is not NaN"
        else:
            np.testing.assert_allclose(lse[0, h, 0], want_lse[h], atol=1e-5, err_msg=f"query {h}")


def _split_decode_with_a_nan_query(dtype, d):
    """A forced split decode (gqakv_decode* then gqakv_merge) with one NaN query row, on
    the emulator. Returns (out, lse, ref, ref_lse, bad mask, plan)."""
    harness = _emulator()
    import ml_dtypes

    from gqakv_backends.cupy_backend import plan as planmod

    st = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    rng = np.random.default_rng(6)
    B, Hkv, G, T, L = 2, 1, 4, 1, 150
    k = rng.standard_normal((B, Hkv, L + 8, d)).astype(st)
    v = rng.standard_normal(k.shape).astype(st)
    lens, n_new, rows = np.array([L, L - 23], np.int64), np.array([T, T], np.int64), np.arange(B)
    q = rng.standard_normal((B, Hkv * G, T, d)).astype(st)
    bad = np.zeros((B, Hkv * G, T), bool)
    bad[0, 1, 0] = True
    q[bad] = NAN
    out = np.zeros(q.shape, st)
    lse = np.full(q.shape[:3], -INF, np.float32)

    def es(a):
        return tuple(s // a.itemsize for s in a.strides)[:3]

    plan = planmod.plan_attention(dtype, d, batch=B, kv_heads=Hkv, group=G, t_q=T, lens=lens,
                                  n_new=n_new, scale=1 / math.sqrt(d), q_strides=es(q),
                                  buf_strides=es(k), out_strides=es(out), sm_count=2,
                                  min_keys_per_split=8)
    assert plan.num_splits > 1 and any(l.kernel == "gqakv_merge" for l in plan.launches)
    harness.Emulator(harness.build(asan=False)).run(
        plan, {"q": q, "k_buf": k, "v_buf": v, "rows": rows, "lens": lens, "n_new": n_new,
               "out": out, "lse": lse})
    ref, ref_lse = reference_attention(q.astype(np.float64),
                                       [k[b, :, :lens[b]].astype(np.float64) for b in range(B)],
                                       [v[b, :, :lens[b]].astype(np.float64) for b in range(B)], n_new)
    rounding = np.abs(ref[~bad].astype(st).astype(np.float64) - ref[~bad]).max()
    return out.astype(np.float64), lse, ref, ref_lse, bad, 2 * rounding + 2e-6


@pytest.mark.parametrize("dtype, d", [("float32", 64), ("bfloat16", 128)])
def test_emulated_split_decode_other_queries_unharmed_by_a_nan_query(dtype, d):
    """The other queries of a split decode (same CTA, same KV head) stay right."""
    out, lse, ref, ref_lse, bad, tol = _split_decode_with_a_nan_query(dtype, d)
    assert not np.isnan(out[~bad]).any()
    assert np.abs(out[~bad] - ref[~bad]).max() <= tol
    assert np.abs(lse[~bad] - ref_lse[~bad]).max() <= 1e-5


@pytest.mark.parametrize("dtype, d", [("float32", 64), ("bfloat16", 128)])
def test_emulated_split_decode_keeps_a_nan_query_nan(dtype, d):
    out, lse, _ref, _ref_lse, bad, _tol = _split_decode_with_a_nan_query(dtype, d)
    assert np.isnan(out[bad]).all() and np.isnan(lse[bad]).all()


def test_softmax_state_with_fully_masked_blocks(backend, arrays):
    """gqakv.ops.merge.SoftmaxState: a key block that masks every key of some query (as a
    window or a key piece will) leaves that query's state empty instead of NaN; blocks in
    either order, and states merged with an empty one, give the plain softmax; a query
    that saw no key at all gives out 0 and lse -inf."""
    from gqakv.ops.merge import SoftmaxState

    xp = backend.namespace()
    rng = np.random.default_rng(5)
    s = rng.standard_normal((2, 3, 6)) * 4  # [heads, queries, keys]
    v = rng.standard_normal((2, 6, 4))
    visible = np.ones((3, 6), dtype=bool)
    visible[0, :3] = False  # query 0 sees no key of the first block
    visible[1, 3:] = False  # query 1 sees no key of the second block
    visible[2, :] = False  # query 2 sees nothing
    masked = np.where(visible, s, -np.inf)
    want_p = np.where(visible, np.exp(masked - np.max(np.where(visible, s, -1e300), axis=-1,
                                                           keepdims=True)), 0.0)
    want_l = want_p.sum(axis=-1, keepdims=True)
    want_out = np.where(want_l > 0, want_p @ v / np.where(want_l > 0, want_l, 1), 0.0)
    with np.errstate(divide="ignore"):  # log(0) = -inf for the query that sees nothing
        want_lse = np.log(want_l) + np.max(np.where(visible, s, -1e300), axis=-1, keepdims=True)

    def run(order):
        state = SoftmaxState(xp)
        for j0, j1 in order:
            state.add(arrays.asarray(masked[..., j0:j1].copy(), "float64"),  # consumed
                      arrays.asarray(v[:, j0:j1], "float64"))
        return state

    for order in (((0, 3), (3, 6)), ((3, 6), (0, 3)), ((0, 6),)):
        out, lse = run(order).result()
        out, lse = arrays.to_numpy(out), arrays.to_numpy(lse)
        np.testing.assert_allclose(out[:, :2], want_out[:, :2], atol=1e-12)
        np.testing.assert_allclose(lse[:, :2], want_lse[:, :2], atol=1e-12)
        assert (out[:, 2] == 0).all() and (lse[:, 2] == -np.inf).all(), order
    merged = SoftmaxState.merge(xp, [run(((0, 3),)), run(((3, 6),))])
    out, lse = merged.result()
    np.testing.assert_allclose(arrays.to_numpy(out)[:, :2], want_out[:, :2], atol=1e-12)
    np.testing.assert_allclose(arrays.to_numpy(lse)[:, :2], want_lse[:, :2], atol=1e-12)
    assert (arrays.to_numpy(out)[:, 2] == 0).all()


def test_merge_ignores_the_output_of_a_part_that_saw_no_key(backend, arrays):
    """A part with lse = -inf contributes nothing, even when its output slots hold NaN
    (a kernel's uninitialized output for an empty key split)."""
    d = 4
    out_a = arrays.asarray(np.full((3, d), np.nan, np.float32))
    lse_a = arrays.asarray(np.array([-np.inf, -np.inf, 0.25], np.float32))
    vals = np.arange(3 * d, dtype=np.float32).reshape(3, d)
    out_b = arrays.asarray(vals)
    lse_b = arrays.asarray(np.array([0.5, -np.inf, -np.inf], np.float32))
    out, lse = gqakv.merge_attention(out_a, lse_a, out_b, lse_b)
    out = arrays.to_numpy(out)
    np.testing.assert_array_equal(out[0], vals[0])
    np.testing.assert_array_equal(out[1], 0.0)
    assert np.isnan(out[2]).all()  # a part that saw keys keeps its (NaN) output
    np.testing.assert_allclose(arrays.to_numpy(lse), [0.5, -np.inf, 0.25])


# -- sinks: applied once, after every key is merged --------------------------------------------

# (name, lse, out, sink, expected out, expected lse): one query head each, d = 2.
SINK_CASES = [
    ("no_sink", 0.5, [1.0, -2.0], -INF, [1.0, -2.0], 0.5),
    ("sink_equals_lse", 0.5, [1.0, -2.0], 0.5, [0.5, -1.0], 0.5 + math.log(2)),
    ("sink_takes_all", 0.0, [1.0, -2.0], 1e4, [0.0, 0.0], 1e4),
    ("sink_negligible", 3.0, [1.0, -2.0], -1e4, [1.0, -2.0], 3.0),
    ("no_key_seen", -INF, [0.0, 0.0], 5.0, [0.0, 0.0], -INF),
    ("nan_lse", NAN, [1.0, 1.0], 0.0, [NAN, NAN], NAN),
    ("inf_sink", 0.0, [1.0, 1.0], INF, [NAN, NAN], NAN),  # not a logit: NaN, as merge's +inf lse
    ("inf_lse", INF, [1.0, 1.0], 0.0, [NAN, NAN], NAN),
    ("nan_out_element", 0.0, [NAN, 2.0], 0.0, [NAN, 1.0], math.log(2)),
    ("finite", 1.0, [2.0, 4.0], 0.0, [2 / (1 + math.exp(-1)), 4 / (1 + math.exp(-1))],
     math.log(math.exp(1) + 1)),
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_apply_sinks_table(backend, arrays, dtype):
    """apply_sinks on every case at once (heads of one query): the sink's share of the
    denominator, -inf sinks and unseen queries untouched, NaN never hidden."""
    from gqakv.ops.merge import apply_sinks

    if dtype not in backend.dtypes:
        pytest.skip(f"backend {backend.name} has no {dtype}")
    lse = arrays.asarray(np.array([[[c[1]] for c in SINK_CASES]], dtype))  # [1, Hq, 1]
    out = arrays.asarray(np.array([[[c[2]] for c in SINK_CASES]], dtype))  # [1, Hq, 1, 2]
    sinks = arrays.asarray(np.array([c[3] for c in SINK_CASES], dtype))
    got_out, got_lse = apply_sinks(out, lse, sinks)
    assert got_out.dtype == out.dtype and got_lse.dtype == lse.dtype
    got_out, got_lse = arrays.to_numpy(got_out), arrays.to_numpy(got_lse)
    tol = 1e-6 if dtype == "float32" else 1e-12
    for i, (name, *_, want_out, want_lse) in enumerate(SINK_CASES):
        np.testing.assert_allclose(got_out[0, i, 0], want_out, rtol=tol, atol=tol, err_msg=name)
        np.testing.assert_allclose(got_lse[0, i, 0], want_lse, rtol=tol, atol=tol, err_msg=name)


def test_apply_sinks_random_matches_the_definition(backend, arrays):
    """[B, Hq, T, d] partial results with random lse and sinks (some -inf, some queries
    unseen): out * e^lse / (e^lse + e^sink) and log(e^lse + e^sink) in float64."""
    from gqakv.ops.merge import apply_sinks

    rng = np.random.default_rng(4)
    B, hq, T, d = 2, 5, 3, 4
    out = rng.standard_normal((B, hq, T, d))
    lse = rng.standard_normal((B, hq, T)) * 20
    lse[:, :, 2] = -INF
    out[:, :, 2] = 0.0
    sinks = (rng.standard_normal(hq) * 20).astype(np.float32).astype(np.float64)
    sinks[1] = -INF
    dtype = "float64" if "float64" in backend.dtypes else "float32"
    got_out, got_lse = apply_sinks(arrays.asarray(out, dtype), arrays.asarray(lse, dtype),
                                   arrays.asarray(sinks, dtype))
    s = sinks[None, :, None]
    with np.errstate(invalid="ignore"):
        want_lse = np.where(np.isneginf(lse), -INF, np.logaddexp(lse, s))
        want_out = np.where(np.isneginf(lse)[..., None], 0.0,
                            out * np.exp(lse - np.maximum(lse, s))[..., None]
                            / (np.exp(lse - np.maximum(lse, s)) + np.exp(s - np.maximum(lse, s)))[..., None])
    tol = 1e-12 if dtype == "float64" else 1e-5
    np.testing.assert_allclose(arrays.to_numpy(got_out), want_out, atol=tol, rtol=tol)
    np.testing.assert_array_equal(arrays.to_numpy(got_lse) == -INF, want_lse == -INF)
    np.testing.assert_allclose(arrays.to_numpy(got_lse), want_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("sinks_shape", [(1,), (2, 4), (5,), ()])
def test_apply_sinks_refuses_sinks_not_one_per_head(backend, arrays, sinks_shape):
    """sinks must be [Hq]: a length-1 array is not broadcast to every head, a 2-D one is
    named, not left to a broadcasting error."""
    from gqakv.ops.merge import apply_sinks

    out = arrays.asarray(np.ones((2, 4, 3, 8), np.float32))
    lse = arrays.asarray(np.zeros((2, 4, 3), np.float32))
    sinks = arrays.asarray(np.zeros(sinks_shape, np.float32))
    with pytest.raises(ValueError, match=r"sinks must be \[Hq\] = \[4\] logits .* got shape"):
        apply_sinks(out, lse, sinks)

