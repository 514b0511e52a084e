"""Draft-tree attention (speculative verification) against the loop reference.

The reference (tests/support/reference.py) walks each query's parents up to a root and
takes the prefix plus those chunk keys, with windows and ALiBi over logical positions
(prefix + depth); it shares nothing with gqakv.core.semantics. Trees are drawn at random
(chains, stars, deep and wide ones, up to 64 tokens, ragged across rows, empty drafts)
and run on every backend, contiguous, paged and 8-bit storage, plain and with every
variant; the calls that mean to reach the generic path assert that they did.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import gqakv
from gqakv.core.tree import DraftTree, chain
from gqakv.dispatch.request import Request

from .support.arrays import BackendArrays
from .support.reference import reference_attention
from .support.seeds import stable_seed


def random_parents(rng, n: int, shape: str) -> list[int]:
    """A tree of n tokens in topological order: a chain, a star (every token a root's
    child... or a root), a deep tree, a wide one, or random parents."""
    if shape == "chain":
        return list(range(-1, n - 1))
    if shape == "star":
        return [-1] * n
    if shape == "deep":  # mostly the previous token, sometimes a branch
        return [-1] + [t - 1 if rng.random() < 0.8 else int(rng.integers(-1, t)) for t in range(1, n)]
    if shape == "wide":  # few levels, many siblings
        return [-1] + [int(rng.integers(-1, min(t, 4))) for t in range(1, n)]
    return [int(rng.integers(-1, t)) for t in range(n)]


SHAPES = ("chain", "star", "deep", "wide", "random")
VARIANTS = [
    {},
    {"window": 5},
    {"softcap": 4.0, "sinks": [0.5, -1.0, 2.0, -np.inf]},
    {"alibi_slopes": [0.25, -0.125, 0.0625, 0.5], "window": 9},
]
STORAGES = [{}, {"storage": "paged", "page_size": 4}, {"kv_dtype": "int8"}]


def _draw(rng, B, T_max):
    n = [int(rng.integers(0, T_max + 1)) for _ in range(B)]
    n[0] = T_max  # the longest tree is always there
    if B > 2:
        n[-1] = 0  # and an empty draft
    T = max(n)
    parents = np.full((B, T), -1, dtype=np.int64)
    for b in range(B):
        parents[b, :n[b]] = random_parents(rng, n[b], SHAPES[(b + int(rng.integers(5))) % 5])
    return n, parents


@pytest.mark.parametrize("storage", STORAGES, ids=["contiguous", "paged", "int8"])
@pytest.mark.parametrize("variant", VARIANTS, ids=["plain", "window", "softcap+sinks", "alibi+window"])
def test_tree_attention_matches_the_reference(backend, storage, variant):
    """Prefix chunks, then a tree chunk per row: out and lse against the loop reference
    on what the cache holds (``live_kv``); padded queries exactly 0."""
    if storage.get("kv_dtype") and backend.name not in ("numpy", "numba", "cupy"):
        pytest.skip("8-bit storage runs on the numpy, numba and cupy backends")
    dtype = "float64" if "float64" in backend.dtypes and not storage.get("kv_dtype") else "float32"
    arrays = BackendArrays(backend)
    rng = np.random.default_rng(stable_seed(backend.name, storage, variant))
    B, Hkv, G, d = 3, 2, 2, 8
    cache = gqakv.KVCache(B, Hkv, 96, d, dtype=dtype, backend=backend, **storage)
    pre = [int(x) for x in rng.integers(0, 20, B)]
    k0 = rng.standard_normal((B, Hkv, max(pre), d))
    cache.append(arrays.asarray(k0, dtype), arrays.asarray(rng.standard_normal(k0.shape), dtype), pre)
    n, parents = _draw(rng, B, 24)
    T = parents.shape[1]
    k = rng.standard_normal((B, Hkv, T, d))
    cache.append(arrays.asarray(k, dtype), arrays.asarray(rng.standard_normal(k.shape), dtype), n)
    q = rng.standard_normal((B, Hkv * G, T, d))
    if dtype == "float32":
        q = q.astype(np.float32).astype(np.float64)
    out, lse = gqakv.gqa_attention(arrays.asarray(q, dtype), cache, n, tree=parents,
                                   return_lse=True, **variant)
    rows = [cache.live_kv(b) for b in range(B)]
    k_rows = [arrays.to_numpy(r[0]) for r in rows]
    v_rows = [arrays.to_numpy(r[1]) for r in rows]
    want, want_lse = reference_attention(q, k_rows, v_rows, n, window=variant.get("window"),
                                         softcap=variant.get("softcap"), sinks=variant.get("sinks"),
                                         alibi_slopes=variant.get("alibi_slopes"), parents=parents)
    tol = 1e-10 if dtype == "float64" else 3e-5
    got, got_lse = arrays.to_numpy(out), arrays.to_numpy(lse)
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)
    real = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[real], want_lse[real], atol=tol * 10, rtol=0)
    for b in range(B):
        assert not got[b, :, n[b]:].any()  # padding: exactly 0


def test_deep_and_wide_trees_of_64_tokens_over_a_long_prefix():
    """T = 64 (the EAGLE-sized tree), every shape, numba and numpy, float64."""
    rng = np.random.default_rng(64)
    for name in ("numpy", "numba"):
        B, Hkv, G, d = 5, 1, 4, 8
        cache = gqakv.KVCache(B, Hkv, 200, d, dtype="float64", backend=name)
        cache.append(rng.standard_normal((B, Hkv, 100, d)), rng.standard_normal((B, Hkv, 100, d)),
                     [100, 37, 1, 0, 64])
        parents = np.array([random_parents(rng, 64, s) for s in SHAPES])
        k = rng.standard_normal((B, Hkv, 64, d))
        cache.append(k, rng.standard_normal(k.shape), [64] * B)
        q = rng.standard_normal((B, Hkv * G, 64, d))
        out = gqakv.gqa_attention(q, cache, [64] * B, tree=parents)
        rows = [cache.live_kv(b) for b in range(B)]
        want, _ = reference_attention(q, [r[0] for r in rows], [r[1] for r in rows], [64] * B,
                                      parents=parents)
        np.testing.assert_allclose(out, want, atol=1e-10, rtol=0)


def test_a_chain_tree_is_the_causal_chunk_and_a_star_sees_only_itself():
    """A chain equals no tree (same values; the generic path serves trees); in a star each
    token sees the prefix and itself only: its result is that of a one-token chunk."""
    rng = np.random.default_rng(3)
    cache = gqakv.KVCache(1, 2, 40, 8, dtype="float64", backend="numpy")
    cache.append(rng.standard_normal((1, 2, 10, 8)), rng.standard_normal((1, 2, 10, 8)), [10])
    k, v = rng.standard_normal((1, 2, 6, 8)), rng.standard_normal((1, 2, 6, 8))
    cache.append(k, v, [6])
    q = rng.standard_normal((1, 4, 6, 8))
    causal = gqakv.gqa_attention(q, cache, [6])
    np.testing.assert_allclose(gqakv.gqa_attention(q, cache, [6], tree=chain([6])), causal,
                               atol=1e-13, rtol=0)
    star = gqakv.gqa_attention(q, cache, [6], tree=[[-1] * 6])
    for t in range(6):  # token t alone after the prefix
        one = gqakv.KVCache(1, 2, 40, 8, dtype="float64", backend="numpy")
        one.append(np.asarray(cache.live_kv(0)[0])[None, :, :10], np.asarray(cache.live_kv(0)[1])[None, :, :10], [10])
        one.append(k[:, :, t:t + 1], v[:, :, t:t + 1], [1])
        np.testing.assert_allclose(star[:, :, t], gqakv.gqa_attention(q[:, :, t:t + 1], one, [1])[:, :, 0],
                                   atol=1e-13, rtol=0)


def test_mask_and_parents_forms_agree_and_bad_trees_are_refused():
    """The ancestor mask of a tree gives the parents' result; malformed trees (a parent
    after its child, a mask without its diagonal, a mask that is no ancestor set, wrong
    shapes, bools as parents, too few tokens) raise naming the entry and token, before
    anything is computed."""
    rng = np.random.default_rng(5)
    cache = gqakv.KVCache(2, 1, 30, 4, dtype="float64", backend="numpy")
    cache.append(rng.standard_normal((2, 1, 9, 4)), rng.standard_normal((2, 1, 9, 4)), [9, 5])
    q = rng.standard_normal((2, 2, 5, 4))
    parents = [[-1, 0, 0, 1, 2], [-1, -1, 1, 0, -1]]
    tree = DraftTree.of(parents, [5, 4])
    mask = tree.ancestor_mask()
    a = gqakv.gqa_attention(q, cache, [5, 4], tree=parents)
    b = gqakv.gqa_attention(q, cache, [5, 4], tree=mask)
    np.testing.assert_array_equal(a, b)
    assert tree.depth.tolist() == [[0, 1, 1, 2, 2], [0, 0, 1, 1, 0]]
    bad = [
        ([[-1, 1, 0, 1, 2], [-1] * 5], ValueError, "parents[0, 1]=1"),
        ([[-1, 0, 0, 1, 7], [-1] * 5], ValueError, "parents[0, 4]=7"),
        ([[-1, 0], [-1, -1]], ValueError, "entry 0 has n_new=5"),
        ([[True] * 5, [False] * 5], TypeError, "integers"),
        ([-1, 0, 0], ValueError, "got 1 dims"),
    ]
    no_diag = mask.copy()
    no_diag[1, 2, 2] = False
    bad.append((no_diag, ValueError, "mask[1, 2, 2] is False"))
    not_closed = mask.copy()
    not_closed[0, 3, 0] = False  # token 3's parent is 1, whose ancestors include 0
    bad.append((not_closed, ValueError, "mask[0, 3] is not an ancestor set"))
    upper = mask.copy()
    upper[0, 1, 3] = True
    bad.append((upper, ValueError, "mask[0, 1, 3] is True"))
    for tree_arg, err, words in bad:
        with pytest.raises(err, match=re.escape(words)):
            gqakv.gqa_attention(q, cache, [5, 4], tree=tree_arg)


def test_entry_trees_are_built_once_and_match_the_parents():
    """Each entry's ancestor sets (built from bitsets, ``DraftTree.entry``) are its parents'
    closures walked here one token at a time, for trees across the byte and 64-bit
    widths; built once per tree (layers reuse them), read-only, like the tree's arrays."""
    rng = np.random.default_rng(8)
    for T in (1, 7, 8, 9, 63, 64, 65, 130):
        n = [T, int(rng.integers(0, T + 1)), 0]
        parents = np.full((3, T), -1, dtype=np.int64)
        for b in range(3):
            parents[b, :n[b]] = random_parents(rng, n[b], SHAPES[(b + T) % 5])
        tree = DraftTree.of(parents, n)
        for b in range(3):
            e = tree.entry(b)
            assert e is tree.entry(b)
            want = np.zeros((n[b], n[b]), dtype=bool)
            for t in range(n[b]):
                u = t
                while u >= 0:  # t and every ancestor
                    want[t, u] = True
                    u = int(parents[b, u])
            assert e.ancestors.dtype == np.bool_ and np.array_equal(e.ancestors, want), (T, b)
            assert e.depth.tolist() == [int(r.sum()) - 1 for r in want]
            for a in (e.ancestors, e.depth, e.parents, tree.parents, tree.depth, tree.n):
                assert not a.flags.writeable


def test_tree_calls_reach_the_fast_paths_and_the_cuda_kernels_say_why(monkeypatch):
    """The NumPy BLAS path and the numba kernels declare ``tree``: numba's kernels serve a
    tree of up to 8 tokens (its chunk limit; longer ones go to the BLAS path with that
    reason, not the tree); of the CUDA kernels the prefill ones declare it and serve a
    tree call of every length, the decode ones reject it with a sentence naming it. What
    ran is counted, with its tree, so a silent fallback fails here."""
    from gqakv_backends import numba_kernels, numpy_attention
    from gqakv_backends.cupy_backend import routing as cupy_routing  # no CuPy needed

    def request(t_q):
        return Request("attention", dtype="float32", head_dim=64, t_q=t_q,
                       features=frozenset({"tree"}))

    assert gqakv.get_backend("numpy").route(request(16)).impl == "numpy BLAS"
    numba = gqakv.get_backend("numba")
    assert numba.route(request(8)).impl == "numba kernel"
    long_route = numba.route(request(16))
    assert long_route.impl == "numpy BLAS"
    assert "T=16 queries > 8" in long_route.rejected["numba kernel"]
    # the CUDA prefill kernels take the tree (their TREE flag) at every t_q, T = 1 too; the
    # decode kernels do not, and say so
    for t_q in (16, 8, 1):
        cupy_route = cupy_routing.route_attention(request(t_q))
        assert cupy_route.impl == "gqakv_prefill", cupy_route
        assert "does not implement tree" in cupy_route.rejected["gqakv_decode"], cupy_route
    seen: list = []
    real_item = numpy_attention._attend_item
    monkeypatch.setattr(numpy_attention, "_attend_item",
                        lambda *a, **k: seen.append(("blas", k["tree"])) or real_item(*a, **k))
    real_kernel = numba_kernels.attention_items
    monkeypatch.setattr(numba_kernels, "attention_items",
                        lambda *a: seen.append(("kernel", a[-1])) or real_kernel(*a))
    for name, want in (("numpy", "blas"), ("numba", "kernel")):
        seen.clear()
        cache = gqakv.KVCache(1, 1, 16, 4, dtype="float32", backend=name)
        x = np.ones((1, 1, 4, 4), np.float32)
        cache.append(x, x, [4])
        gqakv.gqa_attention(np.ones((1, 2, 4, 4), np.float32), cache, [4], tree=[[-1, 0, 0, 2]])
        assert seen and all(kind == want for kind, _ in seen), seen
        for _, tree in seen:
            if want == "blas":
                assert tree.parents.tolist() == [-1, 0, 0, 2]
            else:  # the kernels' Tree: ancestor rows and depths
                assert tree.depth.tolist() == [[0, 1, 1, 2]]
                assert tree.ancestors[0].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0],
                                                      [1, 0, 1, 1]]


#: (storage, dtype) points of the numba kernels' tree tests: every layout and codec the
#: kernels read, and each 16-bit dtype once (each point compiles its own kernels).
KERNEL_POINTS = [({}, "float32"), ({"storage": "paged", "page_size": 4}, "float32"),
                 ({"kv_dtype": "int8"}, "float32"), ({"kv_dtype": "float8_e4m3fn"}, "float32"),
                 ({"storage": "paged", "page_size": 4, "kv_dtype": "int8"}, "float32"),
                 ({}, "bfloat16"), ({"storage": "paged", "page_size": 8}, "float16")]


def _kernel_calls(monkeypatch):
    """The trees the numba kernels were called with (None: a call without one)."""
    from gqakv_backends import numba_kernels

    trees: list = []
    real = numba_kernels.attention_items
    monkeypatch.setattr(numba_kernels, "attention_items",
                        lambda *a: trees.append(a[-1]) or real(*a))
    return trees


@pytest.mark.parametrize("storage,dtype", KERNEL_POINTS,
                         ids=[f"{s.get('storage', 'contiguous')}-{s.get('kv_dtype', '')}-{d}"
                              for s, d in KERNEL_POINTS])
def test_numba_kernels_serve_trees_of_up_to_8_tokens(storage, dtype, monkeypatch):
    """Ragged trees of up to 8 tokens (every shape, an empty draft) through the numba
    kernels in every storage they read, plain and with every variant: the float64 loop
    reference on what the cache holds (16-bit dtypes by the same-dtype naive rule), and
    every call ran the kernels with its tree."""
    from .support.arrays import BackendArrays
    from .support.parity import assert_matches_reference, low_precision_bounds

    backend = gqakv.get_backend("numba")
    arrays = BackendArrays(backend)
    trees = _kernel_calls(monkeypatch)
    rng = np.random.default_rng(len(str(storage)) * 7 + len(dtype))
    B, Hkv, G, d = 4, 2, 2, 16
    cache = gqakv.KVCache(B, Hkv, 96, d, dtype=dtype, backend=backend, **storage)
    pre = [50, 0, 13, 33]  # the 50-token row's chunk straddles key blocks
    k0 = rng.standard_normal((B, Hkv, max(pre), d))
    cache.append(arrays.asarray(k0, dtype), arrays.asarray(rng.standard_normal(k0.shape), dtype), pre)
    n, parents = _draw(rng, B, 8)
    T = parents.shape[1]
    k = rng.standard_normal((B, Hkv, T, d))
    cache.append(arrays.asarray(k, dtype), arrays.asarray(rng.standard_normal(k.shape), dtype), n)
    rows = [cache.live_kv(b) for b in range(B)]
    k_rows = [arrays.to_numpy(r[0]).astype(np.float64) for r in rows]
    v_rows = [arrays.to_numpy(r[1]).astype(np.float64) for r in rows]
    qd = arrays.asarray(rng.standard_normal((B, Hkv * G, T, d)), dtype)
    q = arrays.to_numpy(qd).astype(np.float64)  # the queries as the dtype holds them
    for variant in VARIANTS:
        trees.clear()
        out, lse = gqakv.gqa_attention(qd, cache, n, tree=parents, return_lse=True, **variant)
        assert trees and all(t is not None for t in trees), f"{variant}: the kernels did not run"
        want, want_lse = reference_attention(q, k_rows, v_rows, n, parents=parents, **variant)
        bounds = None
        if dtype != "float32":
            bounds = low_precision_bounds(dtype, want, want_lse, q, k_rows, v_rows, n, None,
                                          tree=parents, **variant)
        got = arrays.to_numpy(out).astype(np.float64)
        assert_matches_reference(got, arrays.to_numpy(lse), want, want_lse, dtype, bounds,
                                 what=f"{storage} {variant}")
        for b in range(B):
            assert not got[b, :, n[b]:].any()  # padding: exactly 0


@pytest.mark.parametrize("variant", [{}, {"window": 40},
                                     {"alibi_slopes": [0.25, -0.125, 0.0625, 0.5], "window": 45}],
                         ids=["plain", "window", "alibi+window"])
def test_numba_tree_kernels_with_small_blocks_and_key_splits(variant):
    """The kernels' tree clause where a key block straddles the prefix and the chunk, over
    query blocks of 3 and keys split across 2 threads (merged by their LSE): blocks of 8
    keys, pieces of at least 16, against the float64 reference. Keys are cut only where
    every query of a block sees them, and under a window each query's keys start
    elsewhere: there the blocks hold one query each and are too small to be cut (the
    plain tree's blocks are)."""
    from gqakv_backends.numba_backend import plan_numba, run_numba

    from gqakv.core.semantics import AttentionParams

    rng = np.random.default_rng(17)
    B, Hkv, G, d, S = 3, 2, 2, 8, 90
    pre, n = np.array([61, 5, 30]), np.array([8, 7, 0])
    parents = np.array([[-1, 0, 1, 1, 0, -1, 5, 2], [-1, 0, -1, 2, 2, 0, 4, -1], [-1] * 8])
    lens = pre + n
    k = rng.standard_normal((B, Hkv, S, d)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, S, d)).astype(np.float32)
    q = rng.standard_normal((B, Hkv * G, 8, d)).astype(np.float32)
    params = AttentionParams(scale=1 / np.sqrt(d), **{key: (tuple(val) if isinstance(val, list) else val)
                                                      for key, val in variant.items()})
    query_block = 1 if "window" in variant else 3
    work = plan_numba(lens, n, q.shape, Hkv, params, workers=2, query_block=query_block, min_key_split=16,
                      key_block=8, parallel_min_work=0, tree=DraftTree.of(parents, n))
    assert (work.groups is not None) == ("window" not in variant)  # key pieces, merged
    out, lse = run_numba(work, q, k, v, np.arange(B), lens, n, return_lse=True)
    want, want_lse = reference_attention(q.astype(np.float64), [k[b, :, :L] for b, L in enumerate(lens)],
                                         [v[b, :, :L] for b, L in enumerate(lens)], n,
                                         parents=parents, **variant)
    np.testing.assert_allclose(out, want, atol=3e-6, rtol=0)
    real = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[real], want_lse[real], atol=3e-5, rtol=0)
    assert np.isneginf(lse[~real]).all()


def test_numba_kernels_serve_long_trees_in_batch_invariant_mode(monkeypatch):
    """In batch-invariant mode the numba kernels serve every chunk length, so a 40-token
    tree runs there too (one query per item): the reference, and a row's bits alone equal
    its bits in the batch."""
    trees = _kernel_calls(monkeypatch)
    rng = np.random.default_rng(23)
    B, Hkv, G, d = 3, 1, 4, 8
    cache = gqakv.KVCache(B, Hkv, 120, d, dtype="float32", backend="numba")
    k0 = rng.standard_normal((B, Hkv, 60, d)).astype(np.float32)
    cache.append(k0, k0 * 0.5, [60, 12, 0])
    n, parents = _draw(rng, B, 40)
    T = parents.shape[1]
    k = rng.standard_normal((B, Hkv, T, d)).astype(np.float32)
    cache.append(k, -k, n)
    q = rng.standard_normal((B, Hkv * G, T, d)).astype(np.float32)
    with gqakv.batch_invariant():
        out = gqakv.gqa_attention(q, cache, n, tree=parents, window=17)
        alone = gqakv.gqa_attention(q[:1], cache, n[:1], tree=parents[:1], rows=[0], window=17)
    assert trees and all(t is not None for t in trees)
    rows = [cache.live_kv(b) for b in range(B)]
    want, _ = reference_attention(q.astype(np.float64), [np.asarray(r[0], np.float64) for r in rows],
                                  [np.asarray(r[1], np.float64) for r in rows], n, parents=parents,
                                  window=17)
    np.testing.assert_allclose(out, want, atol=3e-6, rtol=0)
    np.testing.assert_array_equal(alone[0], out[0])


def test_a_packed_mixed_batch_with_a_tree_splits_between_kernels_and_blas(monkeypatch):
    """A packed batch mixing a 12-token tree (the BLAS path: its row is longer than
    KERNEL_SHORT_ROW_KEYS) with trees of up to 8 tokens (the kernels) keeps each part's
    tree: the reference for every row."""
    from .support.packing import pack_tokens

    trees = _kernel_calls(monkeypatch)
    rng = np.random.default_rng(29)
    B, Hkv, G, d = 3, 2, 2, 8
    model = gqakv.ModelKVCache(2, B, Hkv, 160, d, "float32", "numba")
    hist = rng.standard_normal((B, Hkv, 140, d)).astype(np.float32)
    with model.step([140, 9, 3]) as step:
        for layer in range(2):
            step.write(layer, hist, hist)
    n = np.array([12, 5, 3])
    parents = np.full((B, 12), -1)
    parents[0] = random_parents(rng, 12, "random")
    parents[1, :5] = [-1, 0, 0, 2, -1]
    parents[2, :3] = [-1, 0, 1]
    q = rng.standard_normal((B, Hkv * G, 12, d)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, 12, d)).astype(np.float32)
    with model.step(n, tree=parents) as step:
        assert step.plan_attention(Hkv * G, packed=True).work.long is not None  # split
        kp = np.ascontiguousarray(pack_tokens(k, n))
        out = step.attend(0, np.ascontiguousarray(pack_tokens(q, n)), kp, kp)
        step.write(1, kp, kp)
    assert trees and all(t is not None for t in trees)
    rows = [model.live_kv(0, b) for b in range(B)]
    want, _ = reference_attention(q.astype(np.float64), [np.asarray(r[0], np.float64) for r in rows],
                                  [np.asarray(r[1], np.float64) for r in rows], n, parents=parents)
    np.testing.assert_allclose(out, pack_tokens(want, n), atol=3e-6, rtol=0)


def test_model_step_with_a_tree_masks_every_layer_and_gives_rope_positions():
    """``step(tree=)`` masks each layer's attend by the tree; ``step.positions`` are the
    prefix plus each token's depth; the plan is made once for every layer."""
    rng = np.random.default_rng(11)
    L, B, Hkv, G, d = 3, 2, 1, 2, 4
    model = gqakv.ModelKVCache(L, B, Hkv, 40, d, "float64", "numpy")
    with model.step([6, 2]) as step:
        for layer in range(L):
            x = rng.standard_normal((B, Hkv, 6, d))
            step.write(layer, x, x)
    parents = [[-1, 0, 1, 1, -1], [-1, 0, -1, -1, -1]]
    n = [5, 2]
    with model.step(n, tree=parents) as step:
        assert step.positions.tolist() == [[6, 7, 8, 8, 6], [2, 3, 2, 2, 2]]
        outs = []
        for layer in range(L):
            k = rng.standard_normal((B, Hkv, 5, d))
            q = rng.standard_normal((B, Hkv * G, 5, d))
            outs.append((q, step.attend(layer, q, k, k)))
        assert len(step._plans) == 1
    for layer, (q, out) in enumerate(outs):
        view = model.layer(layer)
        rows = [view.live_kv(b) for b in range(B)]
        want, _ = reference_attention(q, [r[0] for r in rows], [r[1] for r in rows], n,
                                      parents=parents)
        np.testing.assert_allclose(out, want, atol=1e-12, rtol=0)


def test_paged_functional_attention_takes_a_tree():
    """``paged_attention(..., tree=)`` over caller-owned pools equals ``gqa_attention`` over a
    KVCache holding the same tokens."""
    rng = np.random.default_rng(2)
    P, lens, n = 4, [19, 11], [6, 5]
    k_pages = rng.standard_normal((12, 1, P, 4))
    v_pages = rng.standard_normal((12, 1, P, 4))
    table = np.array([[7, 2, 9, 0, 5], [3, 11, 1, -1, -1]], dtype=np.int32)
    cache = gqakv.KVCache(2, 1, 32, 4, dtype="float64", backend="numpy")
    for b, L in enumerate(lens):  # the same tokens, contiguous
        k = np.concatenate([k_pages[p] for p in table[b, :-(-L // P)]], axis=1)[:, :L]
        v = np.concatenate([v_pages[p] for p in table[b, :-(-L // P)]], axis=1)[:, :L]
        one = [L if r == b else 0 for r in range(2)]
        pad = np.zeros((2, 1, L, 4))
        pad[b] = k
        padv = np.zeros((2, 1, L, 4))
        padv[b] = v
        cache.append(pad, padv, one)
    q = rng.standard_normal((2, 2, 6, 4))
    parents = [[-1, 0, 0, 2, 2, 1], [-1, -1, 0, 0, 1, 2]]
    want = gqakv.gqa_attention(q, cache, n, tree=parents)
    got = gqakv.paged_attention(q, k_pages, v_pages, table, lens, n, tree=parents)
    np.testing.assert_allclose(got, want, atol=1e-14, rtol=0)


def test_the_cupy_backend_serves_trees_with_its_prefill_kernels(monkeypatch):
    """The cupy backend (on the CPU emulation harness) runs a tree call on its prefill
    kernels' tree instantiation (the generic code is made to fail), which matches the
    reference on contiguous and paged storage (tests/test_cupy_emulated_tree.py covers
    the kernels further)."""
    from .cuda_emu import harness

    if harness.compiler() is None:
        pytest.skip("no C++ compiler (g++) for the CUDA emulation harness")
    from .cuda_emu.emulated_backend import kernels_only

    backend = kernels_only(monkeypatch, "CUDA tree kernels")
    arrays = BackendArrays(backend)
    rng = np.random.default_rng(9)
    for storage in ({}, {"storage": "paged", "page_size": 4}):
        cache = gqakv.KVCache(2, 2, 64, 8, dtype="float32", backend=backend, **storage)
        k = rng.standard_normal((2, 2, 12, 8))
        cache.append(arrays.asarray(k, "float32"), arrays.asarray(rng.standard_normal(k.shape), "float32"), [12, 7])
        n, parents = [9, 4], [[-1, 0, 0, 1, 1, 2, -1, 6, 3], [-1, 0, 0, 1, -1, -1, -1, -1, -1]]
        k = rng.standard_normal((2, 2, 9, 8))
        cache.append(arrays.asarray(k, "float32"), arrays.asarray(rng.standard_normal(k.shape), "float32"), n)
        q = rng.standard_normal((2, 4, 9, 8)).astype(np.float32).astype(np.float64)
        out = gqakv.gqa_attention(arrays.asarray(q, "float32"), cache, n, tree=parents, softcap=3.0)
        rows = [cache.live_kv(b) for b in range(2)]
        want, _ = reference_attention(q, [arrays.to_numpy(r[0]) for r in rows],
                                      [arrays.to_numpy(r[1]) for r in rows], n, softcap=3.0,
                                      parents=parents)
        np.testing.assert_allclose(arrays.to_numpy(out), want, atol=3e-5, rtol=0)
        # softcap 2 + tree 16 (the fp32-FMA prefill: float32), paged: KVPages
        assert any(name.startswith("gqakv_prefill<float, 8, 18") for name in backend.kernels)


@pytest.mark.parametrize("variant", [{}, {"window": 6, "alibi_slopes": [0.3, -0.2, 0.1, 0.05],
                                          "sinks": [0.0, 1.0, -1.0, 2.0]}], ids=["plain", "all"])
def test_blas_items_split_keys_and_queries_of_a_tree(variant):
    """The BLAS path's blocking forced small (3-query blocks, 4-key pieces on 2 workers,
    tiny score blocks): key pieces are cut only in the prefix and merged, query blocks
    span ragged trees; still the reference."""
    from gqakv.core.inputs import validate_attention
    from gqakv_backends import numpy_attention

    rng = np.random.default_rng(12)
    B, Hkv, G, d = 3, 2, 2, 8
    cache = gqakv.KVCache(B, Hkv, 80, d, dtype="float64", backend="numpy")
    cache.append(rng.standard_normal((B, Hkv, 40, d)), rng.standard_normal((B, Hkv, 40, d)), [40, 23, 9])
    n, parents = _draw(rng, B, 13)
    T = parents.shape[1]
    cache.append(rng.standard_normal((B, Hkv, T, d)), rng.standard_normal((B, Hkv, T, d)), n)
    q = rng.standard_normal((B, Hkv * G, T, d))
    inputs = validate_attention(cache, q, n, tree=parents, **variant)
    out, lse = numpy_attention.attention_store(q, cache.store, inputs, inputs.params, return_lse=True,
                                               workers=2, query_block=3, min_key_split=4,
                                               score_block_elements=64, parallel_min_work=0)
    rows = [cache.live_kv(b) for b in range(B)]
    want, want_lse = reference_attention(q, [r[0] for r in rows], [r[1] for r in rows], n,
                                         parents=parents, **variant)
    np.testing.assert_allclose(out, want, atol=1e-12, rtol=0)
    real = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[real], want_lse[real], atol=1e-12, rtol=0)
