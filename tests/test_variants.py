"""Attention variants (sliding window, soft-cap, sinks; issue 13) on every backend, against
the independent float64 loop reference (tests/support/reference.py): each alone and combined,
over ragged rows, padding, chunked prefill, row operations and split-then-merged keys;
and their validation (a bad value is named and changes nothing)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import gqakv
from gqakv.ops.merge import apply_sinks, merge_attention
from gqakv.core.semantics import AttentionParams

from .support.product import Case
from .support.arrays import BackendArrays
from .support.parity import LOW_PRECISION, assert_matches_reference, low_precision_bounds
from .support.quantization import GROUPED, held
from .support.reference import reference_attention
from .support.routes import assert_product_routes

#: Tolerances against the float64 reference (outputs are O(1), lse O(10)).
ATOL = {"float64": 1e-10, "float32": 2e-5}


def _sinks(rng, hq, kind):
    """[Hq] float32 sink logits: moderate, very large, very negative or -inf ones mixed."""
    s = rng.normal(0.0, 2.0, hq).astype(np.float32)
    if kind == "extreme":
        s[0] = 1e4  # the sink takes everything: out ~ 0, lse = sink
        if hq > 1:
            s[1] = -np.inf  # no sink for this head
        if hq > 2:
            s[2] = -1e4
    return s


def _variant(rng, max_row: int, chunk: int):
    """A random (window, softcap, sinks kind) drawn from the interesting values: W = 1, W
    smaller than the chunk, W larger than any row; softcaps that saturate tanh; sinks."""
    window = rng.choice([None, 1, max(1, chunk - 1), 3, max_row + 5])
    softcap = rng.choice([None, 1e-3, 0.7, 30.0])
    sinks = rng.choice([None, "normal", "extreme"])
    return (None if window is None else int(window),
            None if softcap is None else float(softcap), sinks)


class Rows:
    """A KVCache and a ModelKVCache (2 layers, same data) with a host float64 copy of
    every row's live K/V, for the reference. Dead slots are NaN (a read past a row's end
    or of a padded slot shows)."""

    def __init__(self, backend, dtype, B, hkv, max_len, d, rng, storage=None):
        self.arrays = BackendArrays(backend)
        self.dtype, self.rng = dtype, rng
        storage = storage or {}
        self.storage = storage
        self.cache = gqakv.KVCache(B, hkv, max_len, d, dtype=dtype, backend=backend, **storage)
        self.model = gqakv.ModelKVCache(2, B, hkv, max_len, d, dtype=dtype, backend=backend,
                                        **storage)
        for c in (self.cache, self.model):
            c.store.fill(math.nan)
        self.k = [np.zeros((hkv, 0, d)) for _ in range(B)]
        self.v = [np.zeros((hkv, 0, d)) for _ in range(B)]
        self.shape = (B, hkv, d)

    def dev(self, x):
        return self.arrays.asarray(x.astype(np.float32 if self.dtype == "float32" else np.float64),
                                   self.dtype)

    def host(self, x):
        return self.arrays.to_numpy(x)

    def chunk(self, n_new, T: int, hq: int, variant: dict, scale: float, tree=None):
        """Append n_new[i] of T tokens to every row of both caches, attend with
        ``variant`` (and the draft ``tree``'s parents [B, T], if any) through gqa_attention
        and Step.attend, and check both."""
        B, hkv, d = self.shape
        n_new = np.asarray(n_new, dtype=np.int64)
        k = self.rng.standard_normal((B, hkv, T, d)) * 1.5
        v = self.rng.standard_normal((B, hkv, T, d))
        q = self.rng.standard_normal((B, hq, T, d)) * 1.5
        for i, n in enumerate(n_new):
            k[i, :, n:] = v[i, :, n:] = q[i, :, n:] = 1e3  # padding: never read
        kd, vd, qd = self.dev(k), self.dev(v), self.dev(q)
        # the data as the cache's dtype holds them
        k, v, q = self.host(kd), self.host(vd), self.host(qd)
        for i, n in enumerate(n_new):
            self.k[i] = np.concatenate([self.k[i], held(k[i, :, :n], self.storage, keys=True)], axis=1)
            self.v[i] = np.concatenate([self.v[i], held(v[i, :, :n], self.storage)], axis=1)
        self.cache.append(kd, vd, n_new)
        out, lse = gqakv.gqa_attention(qd, self.cache, n_new, scale=scale, return_lse=True,
                                       tree=tree, **variant)
        with self.model.step(n_new, tree=tree) as st:
            outs = [st.attend(0, qd, kd, vd, scale=scale, **variant),
                    st.attend(1, qd, kd, vd, return_lse=True,
                              params=AttentionParams(scale=scale, **_as_params(variant)))]
        self.check(q, n_new, scale, variant, [(out, lse), (outs[0], None), outs[1]], tree)

    def check(self, q, n_new, scale, variant, results, tree=None):
        """Every (out, lse) of ``results`` equals the reference; padding exactly 0 / -inf."""
        want, want_lse = reference_attention(np.where(np.isfinite(q), q, 0), self.k, self.v,
                                             n_new, scale, parents=tree, **variant)
        T = q.shape[2]
        pad = np.arange(T)[None, :] >= np.asarray(n_new)[:, None]  # [B, T]
        bounds = None
        if self.dtype in LOW_PRECISION:  # the same attention computed naively in the dtype
            bounds = low_precision_bounds(self.dtype, want, want_lse,
                                          np.where(np.isfinite(q), q, 0), self.k, self.v,
                                          n_new, scale, tree=tree, **variant)
        for out, lse in results:
            got = self.host(out)
            assert not np.isnan(got).any(), variant
            assert (got.transpose(0, 2, 1, 3)[pad] == 0).all()  # padded slots exactly 0
            got_lse = None if lse is None else self.host(lse)
            if got_lse is not None:
                assert not np.isnan(got_lse).any()
                assert np.isneginf(got_lse.transpose(0, 2, 1)[pad]).all()
            assert_matches_reference(got, got_lse, want, want_lse, self.dtype, bounds,
                                     what=str(variant))


def _as_params(variant: dict) -> dict:
    """Keyword arguments -> AttentionParams fields (sinks as float32-valued floats)."""
    p = dict(variant)
    if p.get("sinks") is not None:
        p["sinks"] = tuple(float(x) for x in np.asarray(p["sinks"], np.float32))
    if p.get("alibi_slopes") is not None:
        p["alibi_slopes"] = tuple(float(x) for x in p["alibi_slopes"])
    return p


def _keywords(rng, hq, window, softcap, sinks_kind, alibi=None) -> dict:
    kw = {}
    if alibi is not None:  # ALiBi slopes: BLOOM's geometric ones ("bloom") or random reals
        kw["alibi_slopes"] = (2.0 ** (-8.0 * (np.arange(hq) + 1) / hq) if alibi == "bloom"
                              else rng.normal(0.0, 0.5, hq)).astype(np.float32)
    if window is not None:
        kw["window"] = window
    if softcap is not None:
        kw["softcap"] = softcap
    if sinks_kind is not None:
        kw["sinks"] = _sinks(rng, hq, sinks_kind)
    return kw


@pytest.mark.parametrize("seed", [0, 1])
def test_random_variants_chunked_ragged_padded(backend, seed):
    """Random shapes and variants: ragged prompts (one row empty all along) appended in
    T-token chunks with padding, each chunk attended by gqa_attention and Step.attend
    (keywords and params=), then decode steps with idle rows; every result against the
    float64 loop reference."""
    dtype = "float64" if "float64" in backend.dtypes else "float32"
    rng = np.random.default_rng([seed, 13])
    for case in range(3):
        B, hkv, G, d = int(rng.integers(1, 4)), int(rng.integers(1, 3)), int(rng.choice([1, 3])), 8
        hq = hkv * G
        T = int(rng.choice([1, 4, 7]))
        prompts = rng.integers(1, 3 * T + 3, B)
        if B > 1:
            prompts[0] = 0
        max_len = int(prompts.max()) + 3
        rows = Rows(backend, dtype, B, hkv, max_len, d, rng)
        window, softcap, sinks_kind = _variant(rng, max_len, T)
        variant = _keywords(rng, hq, window, softcap, sinks_kind)
        scale = float(rng.choice([0.35, 1.0]))
        for c in range(-(-int(prompts.max()) // T)):
            rows.chunk(np.clip(prompts - c * T, 0, T), T, hq, variant, scale)
        for _ in range(2):  # decode steps, some rows idle
            rows.chunk((rng.random(B) < 0.7).astype(np.int64), 1, hq, variant, scale)


COMBINATIONS = [
    {"window": 1}, {"window": 3}, {"window": 100},
    {"softcap": 1e-4}, {"softcap": 2.0},
    {"sinks": "extreme"}, {"sinks": "normal"},
    {"window": 2, "softcap": 0.5}, {"window": 2, "sinks": "extreme"},
    {"softcap": 0.5, "sinks": "normal"},
    {"window": 4, "softcap": 1e-3, "sinks": "extreme"},
    {"alibi": "bloom"}, {"alibi": "random"}, {"window": 3, "alibi": "bloom"},
    {"softcap": 0.5, "sinks": "extreme", "alibi": "random"},
]


@pytest.mark.parametrize("combo", COMBINATIONS, ids=lambda c: "+".join(f"{k}={v}" for k, v in c.items()))
def test_each_variant_and_combination(backend, combo):
    """Each variant alone and combined, prefill (a chunk longer than the window) then
    decode, over ragged rows with an empty row and a padded slot."""
    dtype = "float64" if "float64" in backend.dtypes else "float32"
    rng = np.random.default_rng(len(COMBINATIONS) + COMBINATIONS.index(combo))
    B, hkv, G, d, T = 3, 2, 2, 8, 6
    hq = hkv * G
    rows = Rows(backend, dtype, B, hkv, 24, d, rng)
    variant = _keywords(rng, hq, combo.get("window"), combo.get("softcap"), combo.get("sinks"),
                        combo.get("alibi"))
    rows.chunk([6, 0, 4], T, hq, variant, 0.5)
    rows.chunk([5, 0, 6], T, hq, variant, 0.5)
    rows.chunk([1, 1, 0], 1, hq, variant, 0.5)


@pytest.mark.parametrize("op", ["reorder", "fork", "truncate"])
def test_variants_after_row_operations(backend, op):
    """Rows reordered (with a duplicate), forked or truncated, then attended with a
    window, a soft-cap and sinks together: the reference follows the moved rows."""
    dtype = "float64" if "float64" in backend.dtypes else "float32"
    rng = np.random.default_rng(["reorder", "fork", "truncate"].index(op))
    B, hkv, G, d = 3, 2, 2, 8
    hq = hkv * G
    rows = Rows(backend, dtype, B, hkv, 30, d, rng)
    variant = _keywords(rng, hq, 3, 0.8, "extreme")
    rows.chunk([9, 5, 7], 9, hq, variant, 0.4)
    if op == "reorder":
        src = [2, 0, 2]
        for c in (rows.cache, rows.model):
            c.reorder(src)
        rows.k, rows.v = [rows.k[s] for s in src], [rows.v[s] for s in src]
    elif op == "fork":
        for c in (rows.cache, rows.model):
            c.fork(1, [0, 2])
        rows.k, rows.v = [rows.k[1]] * 3, [rows.v[1]] * 3
    else:
        new = [4, 5, 1]
        for c in (rows.cache, rows.model):
            c.truncate([0, 1, 2], new)
        rows.k = [k[:, :n] for k, n in zip(rows.k, new)]
        rows.v = [v[:, :n] for v, n in zip(rows.v, new)]
    rows.chunk([2, 1, 2], 2, hq, variant, 0.4)
    rows.chunk([1, 1, 1], 1, hq, variant, 0.4)


def test_window_decode_reads_only_the_window(backend):
    """A decode step with a window on long rows whose keys and values before the window
    are NaN: the result is finite and right, so no key outside the window was read (a
    read key, even masked, would bring its NaN value in)."""
    dtype = "float64" if "float64" in backend.dtypes else "float32"
    arrays = BackendArrays(backend)
    rng = np.random.default_rng(5)
    B, hkv, G, d, W = 2, 2, 2, 8, 5
    lens = np.array([40, 23])
    cache = gqakv.KVCache(B, hkv, 48, d, dtype=dtype, backend=backend)
    k = rng.standard_normal((B, hkv, 40, d))
    v = rng.standard_normal((B, hkv, 40, d))
    for b, L in enumerate(lens):
        k[b, :, :L - W] = v[b, :, :L - W] = np.nan  # the step's query (p = L - 1) never sees them
    cache.append(arrays.asarray(k, dtype), arrays.asarray(v, dtype), lens)
    q = rng.standard_normal((B, hkv * G, 1, d))
    sinks = _sinks(rng, hkv * G, "normal")
    out, lse = gqakv.gqa_attention(arrays.asarray(q, dtype), cache, [1, 1], window=W,
                                   softcap=5.0, sinks=sinks, return_lse=True)
    kr = [k[b, :, L - W:L] for b, L in enumerate(lens)]
    vr = [v[b, :, L - W:L] for b, L in enumerate(lens)]
    want, want_lse = reference_attention(q, kr, vr, [1, 1], softcap=5.0, sinks=sinks)
    np.testing.assert_allclose(arrays.to_numpy(out), want, atol=ATOL[dtype], rtol=0)
    np.testing.assert_allclose(arrays.to_numpy(lse), want_lse, atol=10 * ATOL[dtype], rtol=0)


@pytest.mark.parametrize("window", [None, 3])
def test_partials_merged_then_sinks_equal_the_whole(backend, window):
    """The contract for split keys: each part attended without sinks (its lse over its
    keys), parts merged by merge_attention, then apply_sinks once equals the whole call
    with sinks (and its full-denominator lse); a part with no keys is neutral."""
    dtype = "float64" if "float64" in backend.dtypes else "float32"
    arrays = BackendArrays(backend)
    xp = backend.namespace()
    rng = np.random.default_rng(7)
    hkv, G, d, L = 2, 3, 8, 17
    hq = hkv * G
    k = rng.standard_normal((1, hkv, L, d))
    v = rng.standard_normal((1, hkv, L, d))
    q = rng.standard_normal((1, hq, 1, d))
    sinks = _sinks(rng, hq, "extreme")
    whole = gqakv.KVCache(1, hkv, L, d, dtype=dtype, backend=backend)
    whole.append(arrays.asarray(k, dtype), arrays.asarray(v, dtype), [L])
    qd = arrays.asarray(q, dtype)
    want, want_lse = gqakv.gqa_attention(qd, whole, [1], window=window, softcap=3.0,
                                         sinks=sinks, return_lse=True)
    lo = 0 if window is None else L - window  # the keys the decode query sees: lo..L-1
    for cut in (lo, lo + 1, L - 1):  # cut == lo: the first part is empty
        parts = []
        for a, b in ((lo, cut), (cut, L)):
            part = gqakv.KVCache(1, hkv, L, d, dtype=dtype, backend=backend)
            part.append(arrays.asarray(k[:, :, a:b], dtype), arrays.asarray(v[:, :, a:b], dtype),
                        [b - a])
            parts.append(gqakv.gqa_attention(qd, part, [1 if b > a else 0], softcap=3.0,
                                             return_lse=True))
        out, lse = merge_attention(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
        out, lse = apply_sinks(out, lse, xp.asarray(arrays.asarray(sinks, "float32"),
                                                    dtype=lse.dtype))
        np.testing.assert_allclose(arrays.to_numpy(out), arrays.to_numpy(want), atol=ATOL[dtype])
        np.testing.assert_allclose(arrays.to_numpy(lse), arrays.to_numpy(want_lse),
                                   atol=10 * ATOL[dtype])


#: The product's draft tree (speculative verification): per row the parents of its chunk
#: tokens (-1: a child of the cached prefix), a branching tree, a chain, an empty draft.
PRODUCT_TREE = [[-1, 0, 0, 1, -1, 4], [-1, 0, 1, 2, -1, -1], [-1] * 6]


def _product_point(case: Case, spy, d: int = 8, tree: bool = True) -> None:
    """One point of the product through chunked prefill (7 queries), a decode-sized
    chunk, a draft tree's chunk (unless not ``tree``), a fork (its copy on write on a paged
    cache) and decode, on a KVCache and a 2-layer ModelKVCache of head dim ``d``, the
    case's params given as params= and as keywords; every result against the float64
    reference, every hot call's route against what ran."""
    rng = np.random.default_rng(3)
    B, hkv, G = 3, 2, 3
    hq = hkv * G
    rows = Rows(case.backend, case.dtype, B, hkv, 32, d, rng, storage=case.storage)
    variant = dict(case.params)
    rows.chunk([7, 0, 5], 7, hq, variant, 0.45)
    rows.chunk([3, 2, 0], 3, hq, variant, 0.45)
    if tree:
        rows.chunk([6, 4, 0], 6, hq, variant, 0.45, tree=PRODUCT_TREE)
    for c in (rows.cache, rows.model):
        c.fork(0, [2])
    rows.k[2], rows.v[2] = rows.k[0], rows.v[0]
    rows.chunk([1, 1, 1], 1, hq, variant, 0.45)
    assert_product_routes(spy)


def test_attention_over_the_product_with_variants(case, route_spy):
    """Every point of backend x storage x params x dtype (tests/conftest.py): results
    against the float64 reference (float16/bfloat16 by the same-dtype naive rule), and
    each append, copy and attention ran what ``route()`` names and the path meant
    (tests/support/routes.py: a kernel that silently falls back fails here)."""
    _product_point(case, route_spy(case.backend))


def test_grouped_codecs_over_the_product(grouped_case, route_spy, monkeypatch):
    """The grouped codecs (int8_g32, int4_g32, int4_g64, int4_g32_rotated), contiguous and
    paged, on every backend at d = 64 (tests/support/product.py ``grouped_product_cases``):
    the product point (chunked prefill, a chunk, a fork, decode; ragged rows, an idle one)
    against the float64 reference over what the cache holds (the rule's dequantized
    values, keys rotated back: ``quantization.held_grouped``), float16 / bfloat16 by the
    same-dtype naive rule, each hot call on the path meant; and on numba
    every attention call ran the kernels over the grouped layout, on the emulated CuPy
    backend every append and attention launch was a grouped instantiation (and every row
    copy one of the grouped copy entries)."""
    from .support.product import GROUPED_HEAD_DIM
    from .support.spies import kernel_layouts

    case = grouped_case
    codec, paged = case.storage["kv_dtype"], case.storage.get("storage") == "paged"
    spy = route_spy(case.backend)
    layouts = kernel_layouts(monkeypatch) if case.backend.name == "numba" else None
    launched: list[str] = []
    emulated = case.backend.name == "cupy_emulated"
    if emulated:  # wrapped after the spy's: every launch's instantiation, by name
        run = case.backend._run_plan

        def recorded(plan, *args):
            launched.extend(launch.name for launch in plan.launches)
            return run(plan, *args)

        monkeypatch.setattr(case.backend, "_run_plan", recorded)
    # a draft tree's chunk on the emulated CuPy backend (its grouped library holds the tree
    # with every product variant, harness.grouped_units); elsewhere trees over grouped codes
    # are tests/test_numba_grouped.py's (here each would be one more numba compile per variant)
    _product_point(case, spy, d=GROUPED_HEAD_DIM, tree=emulated)
    if layouts is not None:
        assert set(layouts) == {"PagedGrouped" if paged else "Grouped"}, layouts
    if emulated:
        from gqakv_backends.cupy_backend import instantiations as table

        # row copies move codes as bytes and scales as floats (instantiations.copy_entries)
        copies = {n for n in launched if n.startswith("gqakv_copy_tokens<")}
        assert copies <= set(table.names(table.copy_entries("float32", GROUPED_HEAD_DIM, codec))), copies
        kernels = [n for n in launched if not n.startswith(("gqakv_merge", "gqakv_copy_tokens"))]  # merge: fp32 partials
        assert all(f"{table.CODE_CTYPES[codec]}" in n for n in kernels), kernels
        assert all(n.endswith("KVPages>") == paged for n in kernels), kernels
        for kernel in ("gqakv_write_kv_quantized<", "gqakv_prefill<", "gqakv_decode<"):
            assert any(n.startswith(kernel) for n in kernels), (kernel, kernels)
        # the tree chunk ran the prefill kernel's tree instantiation (variant flags past 15)
        flags = [int(m.group(1)) for n in kernels if n.startswith("gqakv_prefill<")
                 for m in [re.search(rf", {GROUPED_HEAD_DIM}, (\d+)[,>]", n)] if m]
        assert any(f & table.TREE for f in flags), kernels


def test_the_product_sample_covers_every_pair():
    """The sampled product still runs every (backend, storage), (backend, params) and
    (backend, dtype) pair, and every (backend, storage, dtype) triple, for every backend's
    declared product dtypes (no float64), within a bound that follows the axes."""
    from .support.product import BACKENDS as _BACKENDS
    from .support.product import ATTENTION_PARAMS, PRODUCT_DTYPES, STORAGE_SPECS, product_cases

    cases = product_cases(_BACKENDS, STORAGE_SPECS, ATTENTION_PARAMS)
    seen = {(b.name, s, p, d) for b, s, p, d in cases}
    assert len(seen) == len(cases)
    for b in _BACKENDS:
        dtypes = [d for d in PRODUCT_DTYPES if d in b.dtypes]
        mine = [(s, p, d) for name, s, p, d in seen if name == b.name]
        assert {d for *_, d in mine} == set(dtypes) and "float64" not in dtypes
        assert {(s, d) for s, _, d in mine} == {(s, d) for s in STORAGE_SPECS for d in dtypes}
        assert {p for _, p, _ in mine} == set(ATTENTION_PARAMS)
    assert len(cases) <= len(_BACKENDS) * len(STORAGE_SPECS) * len(PRODUCT_DTYPES)


def test_the_grouped_sample_covers_every_spec():
    """The grouped axis runs every (backend, grouped spec) pair once, every product dtype
    and params value the backend runs grouped codes with (``_grouped_axes``), and no
    float64; the emulated CuPy backend's points are what its grouped library holds."""
    from .support.product import BACKENDS as _BACKENDS
    from .support.product import ATTENTION_PARAMS, GROUPED_SPECS, _grouped_axes, grouped_product_cases

    cases = grouped_product_cases(_BACKENDS)
    assert len({(b.name, s, p, d) for b, s, p, d in cases}) == len(cases)
    for b in _BACKENDS:
        params, dtypes = _grouped_axes(b)
        mine = [(s, p, d) for x, s, p, d in cases if x is b]
        assert sorted(s for s, _, _ in mine) == sorted(GROUPED_SPECS)
        assert {d for *_, d in mine} == set(dtypes) and "float64" not in dtypes
        assert {p for _, p, _ in mine} == set(params)
        assert {GROUPED_SPECS[s]["kv_dtype"] for s in GROUPED_SPECS} == set(GROUPED)
    emulated = _grouped_axes(next(b for b in _BACKENDS if b.name == "cupy_emulated"))
    # the grouped emulation library holds every variant and dtype of the product
    assert set(emulated[0]) == set(ATTENTION_PARAMS)
    assert emulated[1] == ["float32", "bfloat16", "float16"]


def _runnable(name: str):
    from .support.product import BACKENDS as _BACKENDS

    backend = next(b for b in _BACKENDS if b.name == name)
    if backend.unavailable_reason():
        pytest.skip(f"backend {name}: {backend.unavailable_reason()}")
    return backend


@pytest.mark.parametrize("storage", ["contiguous", "paged+int8"])
def test_a_numba_kernel_that_falls_back_fails_the_product(storage, monkeypatch, route_spy):
    """The product's route check catches a fast path that silently falls back: the numba
    kernel entry (``attention_numba``) patched to return the NumPy backend's result for the
    call (same numbers within tolerance, so only the route check can see it) makes the
    product point fail, naming both paths; unpatched, the point passes."""
    from gqakv_backends import numba_backend

    from gqakv_backends.numpy_backend import NumpyBackend

    backend = _runnable("numba")
    current: dict = {}
    real_attention = numba_backend.NumbaBackend.attention

    def remember(self, q, store, inputs, params, *, return_lse, **planned):
        current.update(store=store, inputs=inputs)  # for the fallback below
        return real_attention(self, q, store, inputs, params, return_lse=return_lse, **planned)

    def numpy_result(work, q, k_buf, v_buf, rows, lens, n_new, *, return_lse, **kw):
        """What a silent fallback returns: the NumPy backend's result for the same call."""
        inputs = current["inputs"]
        return NumpyBackend.attention(backend, q, current["store"], inputs, inputs.params,
                                      return_lse=return_lse)

    monkeypatch.setattr(numba_backend.NumbaBackend, "attention", remember)
    case = Case(backend, storage, "window+softcap+sinks", "bfloat16")
    _product_point(case, route_spy(backend))  # the kernel as it is: passes
    monkeypatch.setattr(numba_backend, "run_numba", numpy_result)
    with pytest.raises(AssertionError, match=r"attention .*route says 'numba kernel', ran "
                                             r"'(numpy BLAS|generic array-API)'"):
        _product_point(case, route_spy(backend))


def test_a_numba_decision_that_gives_up_the_kernel_fails_the_product(monkeypatch, route_spy):
    """A fallback the route itself reports (the decision changed so that dispatch and
    ``route()`` both hand decode to the NumPy path: they agree, nothing drifts) still
    fails the product: the path the test means for a numba decode is the kernel."""
    from gqakv_backends import numba_backend, numpy_backend

    backend = _runnable("numba")

    def numpy_only(request):
        return numpy_backend.route_attention(request)

    monkeypatch.setattr(numba_backend, "route_attention", numpy_only)
    case = Case(backend, "paged", "causal", "float32")
    with pytest.raises(AssertionError, match=r"attention .*meant 'numba kernel', ran "
                                             r"'numpy BLAS'"):
        _product_point(case, route_spy(backend))


@pytest.mark.parametrize("storage", ["contiguous", "paged"])
def test_an_emulated_cupy_kernel_that_falls_back_fails_the_product(storage, monkeypatch,
                                                                   route_spy):
    """The same on the emulated CuPy backend: its attention planner made to refuse (so
    the backend runs the generic code, as it does for a grid beyond CUDA's limits) makes
    the product point fail on the route check; unpatched, the point passes."""
    from gqakv_backends import cupy_backend

    from .cuda_emu.emulated_backend import EmulatedCupyBackend

    _runnable("cupy_emulated")
    backend = EmulatedCupyBackend()  # its own plan cache: nothing kept from other tests
    case = Case(backend, storage, "causal", "float16")
    _product_point(case, route_spy(backend))

    def refusing(*args, **kwargs):
        raise NotImplementedError("gqakv_decode: a grid of (2147483648, 1) CTAs (test)")

    monkeypatch.setattr(cupy_backend._plan, "plan_attention", refusing)
    backend = EmulatedCupyBackend()
    case = Case(backend, storage, "causal", "float16")
    with pytest.raises(AssertionError, match=r"attention .*route says 'gqakv_\w+', ran "
                                             r"'generic array-API'"):
        _product_point(case, route_spy(backend))


# -- validation ------------------------------------------------------------------------------

BAD_VARIANTS = [
    (dict(window=0), ValueError, "window=0"),
    (dict(window=-3), ValueError, "window=-3"),
    (dict(window=True), TypeError, "window must be an int >= 1"),
    (dict(window=2.0), TypeError, "got 2.0"),
    (dict(window=np.float64(4)), TypeError, "window must be an int"),
    (dict(window="3"), TypeError, "got '3'"),
    (dict(window=2**70), ValueError, "out of range"),
    (dict(softcap=0), ValueError, "softcap=0 "),
    (dict(softcap=-1.5), ValueError, "softcap=-1.5"),
    (dict(softcap=math.inf), ValueError, "softcap=inf"),
    (dict(softcap=math.nan), ValueError, "softcap=nan"),
    (dict(softcap=True), TypeError, "softcap must be a finite real number > 0"),
    (dict(softcap="1"), TypeError, "got '1'"),
    (dict(softcap=1e-40), ValueError, "outside the supported range"),
    (dict(softcap=1e40), ValueError, "outside the supported range"),
    (dict(sinks=[0.0, 1.0, 2.0]), ValueError, r"sinks must have shape \[Hq=4\].*got \[3\]"),
    (dict(sinks=np.zeros((2, 2))), ValueError, r"got \[2, 2\]"),
    (dict(sinks=[0.0, math.nan, 0.0, 0.0]), ValueError, r"sinks\[1\]=nan.*NaN"),
    (dict(sinks=[0.0, 0.0, math.inf, 0.0]), ValueError, r"sinks\[2\]=inf.*\+inf"),
    (dict(sinks=[0.0, 0.0, 0.0, 1e39]), ValueError, r"sinks\[3\]=1e\+39.*float32"),
    (dict(sinks=[0.0, True, 0.0, 0.0]), TypeError, r"sinks\[1\]=True is not a real number"),
    (dict(sinks=["a", 0.0, 0.0, 0.0]), TypeError, r"sinks\[0\]='a'"),
    (dict(sinks=1.0), TypeError, "sinks must be a \\[Hq\\] array"),
    (dict(sinks="abcd"), TypeError, "sinks must be a \\[Hq\\] array"),
    (dict(sinks=np.array([1, 0, 1, 0], dtype=bool)), TypeError, "real"),
    (dict(sinks=np.zeros(4, dtype=np.complex64)), TypeError, "real"),
    (dict(window=2, params=AttentionParams(scale=1.0)), TypeError, "give window=2 or params="),
    (dict(sinks=[0.0] * 4, params=AttentionParams(scale=1.0)), TypeError, "not both"),
    (dict(params=AttentionParams(scale=1.0, window=0)), ValueError, "window=0"),
    (dict(params=AttentionParams(scale=1.0, softcap=-1.0)), ValueError, "softcap=-1.0"),
    (dict(params=AttentionParams(scale=1.0, sinks=(0.0,))), ValueError, r"shape \[Hq=4\]"),
]


@pytest.mark.parametrize("kw, error, words", BAD_VARIANTS,
                         ids=[f"{i}-{next(iter(c[0]))}" for i, c in enumerate(BAD_VARIANTS)])
def test_bad_variant_values_are_named_and_change_nothing(kw, error, words):
    """gqa_attention and Step.attend refuse each bad value with a message naming it and
    what is allowed; Step.attend writes nothing (the layer stays unwritten, lengths and
    buffers as they were) and the step stays usable."""
    rng = np.random.default_rng(0)
    cache = gqakv.KVCache(1, 2, 8, 4, dtype="float32", backend="numpy")
    x = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    cache.append(x, x, [3])
    q = rng.standard_normal((1, 4, 3, 4)).astype(np.float32)
    with pytest.raises(error, match=words):
        gqakv.gqa_attention(q, cache, [3], **kw)
    model = gqakv.ModelKVCache(1, 1, 2, 8, 4, dtype="float32", backend="numpy")
    before = (model.k.copy(), model.v.copy())
    with model.step([3]) as st:
        with pytest.raises(error, match=words):
            st.attend(0, q, x, x, **kw)
        np.testing.assert_array_equal(model.k, before[0])
        np.testing.assert_array_equal(model.v, before[1])
        st.attend(0, q, x, x)  # still unwritten, so this write is allowed
    assert list(model.host_lens) == [3]


def test_good_variant_values_are_normalized():
    """Accepted forms: NumPy ints for window, ints for softcap, sinks from a list, NumPy
    (any real dtype) or torch; sinks are held as float32-rounded Python floats."""
    from gqakv.core.inputs import check_sinks, check_softcap, check_window

    assert check_window(np.int32(4)) == 4 and type(check_window(np.int64(1))) is int
    assert check_softcap(3) == 3.0 and type(check_softcap(np.float32(0.5))) is float
    s = check_sinks([0.1, -math.inf], 2)
    assert s == (float(np.float32(0.1)), -math.inf)
    assert check_sinks(np.array([1, 2], np.int8), 2) == (1.0, 2.0)
    assert check_sinks(np.array([-1e39, 0.0]), 2) == (-math.inf, 0.0)  # rounds to -inf: no sink
    torch = pytest.importorskip("torch")
    t = torch.tensor([0.25, -3.0], dtype=torch.bfloat16, requires_grad=True)
    assert check_sinks(t, 2) == (0.25, -3.0)


def test_variant_keywords_and_params_agree():
    """window=/softcap=/sinks= give bit-for-bit the result of the same AttentionParams."""
    rng = np.random.default_rng(2)
    cache = gqakv.KVCache(2, 2, 16, 8, dtype="float32", backend="numpy")
    x = rng.standard_normal((2, 2, 9, 8)).astype(np.float32)
    cache.append(x, x, [9, 4])
    q = rng.standard_normal((2, 4, 2, 8)).astype(np.float32)
    sinks = np.array([0.5, -1.0, 2.0, -np.inf], np.float32)
    a = gqakv.gqa_attention(q, cache, [2, 1], scale=0.3, window=3, softcap=1.5, sinks=sinks)
    p = AttentionParams(scale=0.3, window=3, softcap=1.5, sinks=tuple(map(float, sinks)))
    np.testing.assert_array_equal(a, gqakv.gqa_attention(q, cache, [2, 1], params=p))
    assert p.variant == "causal+sinks+softcap+window"


@pytest.mark.parametrize("score_block_elements, query_block", [(64, 3), (16, 4), (1 << 22, 256)])
def test_generic_path_blocks_masked_whole(backend, score_block_elements, query_block):
    """The generic array-API path with tiny key and query blocks (5 keys; 1 key): with a window, whole
    key blocks are masked for some queries of a block (and some query blocks see only
    part of the row); the online softmax stays exact, sinks join once at the end."""
    from gqakv.ops.attention import attention_array_api
    from gqakv.core.inputs import validate_attention

    dtype = "float64" if "float64" in backend.dtypes else "float32"
    arrays = BackendArrays(backend)
    rng = np.random.default_rng(score_block_elements)
    B, hkv, G, d, T = 2, 2, 2, 8, 12
    lens = np.array([30, 12])
    cache = gqakv.KVCache(B, hkv, 32, d, dtype=dtype, backend=backend)
    cache.store.fill(math.nan)
    k = rng.standard_normal((B, hkv, 30, d))
    v = rng.standard_normal((B, hkv, 30, d))
    cache.append(arrays.asarray(k, dtype), arrays.asarray(v, dtype), lens)
    q = rng.standard_normal((B, hkv * G, T, d))
    sinks = _sinks(rng, hkv * G, "extreme")
    n_new = [12, 9]
    for variant in (dict(window=2), dict(window=5, softcap=0.5, sinks=sinks)):
        inputs = validate_attention(cache, arrays.asarray(q, dtype), n_new, **variant)
        out, lse = attention_array_api(arrays.asarray(q, dtype), cache.store, inputs,
                                       inputs.params, return_lse=True,
                                       score_block_elements=score_block_elements,
                                       query_block=query_block)
        want, want_lse = reference_attention(q, [k[b, :, :L] for b, L in enumerate(lens)],
                                             [v[b, :, :L] for b, L in enumerate(lens)], n_new,
                                             **variant)
        np.testing.assert_allclose(arrays.to_numpy(out), want, atol=ATOL[dtype], rtol=0)
        got_lse = arrays.to_numpy(lse)
        np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
        fin = np.isfinite(want_lse)
        np.testing.assert_allclose(got_lse[fin], want_lse[fin], atol=10 * ATOL[dtype], rtol=1e-6)


def test_several_appends_then_one_attention(backend):
    """Chunks appended over several calls without attending, then one call whose queries
    are the last tokens of several appends (n_new up to the row's length; one row idle)."""
    dtype = "float64" if "float64" in backend.dtypes else "float32"
    arrays = BackendArrays(backend)
    rng = np.random.default_rng(9)
    B, hkv, G, d = 3, 2, 2, 8
    cache = gqakv.KVCache(B, hkv, 24, d, dtype=dtype, backend=backend)
    cache.store.fill(math.nan)
    ks, vs = [np.zeros((hkv, 0, d)) for _ in range(B)], [np.zeros((hkv, 0, d)) for _ in range(B)]
    for n_new in ([5, 3, 0], [4, 0, 2], [3, 6, 1]):
        k = rng.standard_normal((B, hkv, 6, d))
        v = rng.standard_normal((B, hkv, 6, d))
        cache.append(arrays.asarray(k, dtype), arrays.asarray(v, dtype), n_new)
        for b, n in enumerate(n_new):
            ks[b] = np.concatenate([ks[b], k[b, :, :n]], axis=1)
            vs[b] = np.concatenate([vs[b], v[b, :, :n]], axis=1)
    n_q = [10, 9, 0]  # row 0: its last two appends and one token before; row 1: all of it
    q = rng.standard_normal((B, hkv * G, 10, d))
    sinks = _sinks(rng, hkv * G, "normal")
    for variant in (dict(window=4), dict(window=1, sinks=sinks),
                    dict(window=3, softcap=0.2, sinks=sinks)):
        out, lse = gqakv.gqa_attention(arrays.asarray(q, dtype), cache, n_q, return_lse=True,
                                       **variant)
        want, want_lse = reference_attention(q, ks, vs, n_q, **variant)
        np.testing.assert_allclose(arrays.to_numpy(out), want, atol=ATOL[dtype], rtol=0)
        assert (arrays.to_numpy(out)[2] == 0).all()
        got_lse = arrays.to_numpy(lse)
        np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
        fin = np.isfinite(want_lse)
        np.testing.assert_allclose(got_lse[fin], want_lse[fin], atol=10 * ATOL[dtype], rtol=1e-6)
