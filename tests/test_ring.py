"""Contiguous sliding layers as rings (``KVCache(..., window=W, max_chunk=C)``,
``ModelKVCache(..., windows=[...], storage="contiguous", max_chunk=C)``,
``gqakv.storage.ring``): each row keeps ``window_pages(W, max_len, P, C)`` pages.

The standard: under random chunks (longer than the window too, up to ``max_chunk``),
decode steps, idle and ragged rows, forks, reorders, truncates and resets, the ring's
outputs and LSE equal bit for bit those of the paged cache keeping every token, and both
it and the contiguous full-history cache match the float64 loop reference; the pool is
exactly ``rows x window_pages`` pages and never runs out; pages no row names hold NaN,
so a read of a released page would show. An append longer than ``max_chunk`` and a
truncate into released history are refused with a ValueError naming the numbers (the
window for the truncate), and change nothing.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import gqakv
from gqakv.storage.sizing import ModelConfig, window_cache_bytes, window_pages

from .support.arrays import BackendArrays
from .support.direct import Direct
from .support.pages import (float_bits, assert_same_state, audit, float64_sequence_backend_or_skip,
                            poison_unnamed, state)
from .support.parity import assert_matches_reference
from .support.reference import reference_attention


def _ring_ops(backend, seed, steps, page_size, window, chunk, dtype="float64"):
    """Random operations on a ring (contiguous storage with a window), on the paged cache
    keeping every token (the bits to equal) and on the contiguous full-history cache;
    returns the operations seen and the pages the ring's window released."""
    arrays = BackendArrays(backend)
    rng = np.random.default_rng(seed)
    B, Hkv, G, d, S = 4, 2, 2, 4, 90
    plain = gqakv.KVCache(B, Hkv, S, d, dtype=dtype, backend=backend)
    full = gqakv.PagedKVCache(B, Hkv, S, d, dtype=dtype, backend=backend, page_size=page_size)
    ring = gqakv.KVCache(B, Hkv, S, d, dtype=dtype, backend=backend, page_size=page_size,
                         window=window, max_chunk=chunk)
    per_row = window_pages(window, S, page_size, min(chunk, S))
    assert ring.store.kind == "paged" and ring.num_pages == B * per_row
    assert ring.window == window and ring.store.page_table.max_chunk == chunk
    caches = (plain, full, ring)
    direct = Direct(B, Hkv, d)
    seen: set[str] = set()
    for _ in range(steps):
        op = rng.choice(["append", "append", "append", "decode", "fork", "reorder", "truncate",
                         "reset", "too long"])
        if op in ("append", "decode"):
            T = 1 if op == "decode" else int(rng.integers(1, chunk + 1))
            n = np.minimum(rng.integers(0, T + 1, B), S - full.host_lens)
            k, v = rng.standard_normal((2, B, Hkv, T, d))
            q = rng.standard_normal((B, Hkv * G, T, d))
            ka, va, qa = (arrays.asarray(x, dtype) for x in (k, v, q))
            k, v, q = (arrays.to_numpy(x).astype(np.float64) for x in (ka, va, qa))  # as held
            for c in caches:
                c.append(ka, va, n)  # never OutOfPages: the ring's pool suffices
            direct.append(range(B), k, v, n)
            poison_unnamed(ring)
            got = [gqakv.gqa_attention(qa, c, n, window=window, return_lse=True) for c in caches]
            for a, b in zip(got[1], got[2]):
                np.testing.assert_array_equal(float_bits(arrays.to_numpy(a)), float_bits(arrays.to_numpy(b)))
            want, want_lse = reference_attention(q, direct.k, direct.v, n, window=window)
            for c, (o, lse) in zip(("contiguous", "ring"), (got[0], got[2])):
                assert_matches_reference(arrays.to_numpy(o), arrays.to_numpy(lse), want, want_lse,
                                         dtype, what=f"{c} window={window} n={n}")
            if dtype == "float64":
                np.testing.assert_allclose(arrays.to_numpy(got[2][0]), want, atol=1e-12)
            if (n > window).any():
                seen.add("chunk longer than the window")
        elif op == "too long":  # one row past max_chunk: refused, nothing changed
            if chunk + 1 > S - int(ring.host_lens.min()):
                continue
            r = int(np.argmin(ring.host_lens))
            n = np.zeros(B, dtype=np.int64)
            n[r] = chunk + 1
            k, v = rng.standard_normal((2, B, Hkv, chunk + 1, d))
            before = state(ring, arrays)
            with pytest.raises(ValueError, match=rf"n_new\[{r}\]={chunk + 1} tokens to row {r} "
                                                 rf"exceeds .*max_chunk={chunk} \(window={window}"):
                ring.append(arrays.asarray(k, dtype), arrays.asarray(v, dtype), n)
            assert_same_state(before, state(ring, arrays))
        elif op == "fork":
            src = int(rng.integers(0, B))
            dst = rng.permutation(B)[:rng.integers(1, B)]
            for c in caches:
                c.fork(src, dst)
            direct.fork(src, dst)
        elif op == "reorder":
            src = rng.integers(0, B, B)
            for c in caches:
                c.reorder(src)
            direct.reorder(src)
        elif op == "truncate":
            r = int(rng.integers(0, B))
            have = int(ring.host_lens[r])
            gone = int(ring.store.first_held([r])[0])
            shortest = gone + window - 1 if gone else 0
            if gone and shortest > 1 and rng.random() < 0.3:  # into released history: refused
                before = state(ring, arrays)
                with pytest.raises(ValueError, match=rf"truncate row {r} to {shortest - 1} tokens: "
                                                     rf"its sliding window \(window={window}\)"):
                    ring.truncate([r], [shortest - 1])
                assert_same_state(before, state(ring, arrays))
                seen.add("truncate refused")
                continue
            lo = min(have, shortest)
            n = int(rng.integers(lo, have + 1)) if rng.random() < 0.8 else 0
            for c in caches:
                c.truncate([r], [n])
            direct.truncate([r], [n])
        else:
            r = rng.permutation(B)[:rng.integers(1, B + 1)]
            for c in caches:
                c.reset(r)
            direct.truncate(r, [0] * r.size)
        seen.add(str(op))
        audit(ring)
        for c in caches[1:]:
            assert c.host_lens.tolist() == plain.host_lens.tolist() == direct.lens
        if (ring.store.page_table.refs > 1).any():
            seen.add("shared pages")
        if ring.store.page_table.released.any():
            seen.add("released pages")
    return seen, ring.store.page_table.window_released


@pytest.mark.parametrize("seed, page_size, window, chunk", [
    (0, 4, 6, 14), (1, 3, 1, 5), (2, 5, 11, 3), (3, 1, 4, 9), (4, 16, 9, 20), (5, 2, 2, 1)])
def test_random_operations_match_full_history_numpy(seed, page_size, window, chunk):
    seen, released = _ring_ops(gqakv.get_backend("numpy"), seed, 150, page_size, window, chunk)
    want = {"append", "decode", "fork", "reorder", "truncate", "reset", "released pages"}
    if chunk > window:
        want.add("chunk longer than the window")
    if chunk + 1 <= 90:
        want.add("too long")
    assert want <= seen, want - seen
    assert released > 0


def test_random_operations_match_full_history_every_backend(backend, route_spy):
    """Every backend, through the path it routes paged storage to (the spy checks that each
    append and attention ran what ``route()`` names and the path meant)."""
    from .support.routes import assert_product_routes

    float64_sequence_backend_or_skip(backend, "test_cuda_kernels_read_the_ring_on_the_emulator")
    spy = route_spy(backend)
    seen, released = _ring_ops(backend, 7, 50, 4, 5, 12)
    assert {"released pages", "chunk longer than the window", "fork"} <= seen and released > 0
    assert_product_routes(spy)


def test_float32_on_every_backend(backend, route_spy):
    from .support.routes import assert_product_routes

    if "float32" not in backend.dtypes or backend.name == "cupy_emulated":
        pytest.skip(f"{backend.name}: no float32, or the emulator's time (its own test below)")
    spy = route_spy(backend)
    seen, released = _ring_ops(backend, 11, 40, 4, 7, 10, dtype="float32")
    assert released > 0
    assert_product_routes(spy)


def test_cuda_kernels_read_the_ring_on_the_emulator(backend, route_spy):
    """The cupy backend's paged kernels on the CPU emulator: the ring (every free or
    released slot NaN) equals the full-history paged cache bit for bit, with a chunk longer
    than the window and a fork, and each call ran the kernel ``route()`` names."""
    from .support.routes import assert_product_routes

    if backend.name != "cupy_emulated":
        pytest.skip("the CUDA kernels' check (the other backends run the tests above)")
    arrays = BackendArrays(backend)
    spy = route_spy(backend)
    rng = np.random.default_rng(0)
    B, Hkv, d, S, W, P, C, dt = 2, 1, 8, 48, 5, 4, 12, "bfloat16"
    full = gqakv.PagedKVCache(B, Hkv, S, d, dtype=dt, backend=backend, page_size=P)
    ring = gqakv.KVCache(B, Hkv, S, d, dtype=dt, backend=backend, page_size=P, window=W,
                         max_chunk=C)
    for c in (full, ring):
        c.store.fill(math.nan)
    for T, n in [(9, [9, 7]), (1, [1, 1]), (12, [12, 3]), ("fork", None), (1, [1, 1]), (4, [4, 4])]:
        if T == "fork":
            for c in (full, ring):
                c.fork(0, [1])
            continue
        k, v = rng.standard_normal((2, B, Hkv, T, d))
        q = rng.standard_normal((B, 2, T, d))
        outs = []
        for c in (full, ring):
            c.append(arrays.asarray(k, dt), arrays.asarray(v, dt), n)
            outs.append(arrays.to_numpy(gqakv.gqa_attention(arrays.asarray(q, dt), c, n, window=W)))
        np.testing.assert_array_equal(float_bits(outs[0]), float_bits(outs[1]))
        assert np.isfinite(outs[1].astype(np.float32)).all()
        audit(ring)
    assert ring.store.page_table.window_released > 0
    assert_product_routes(spy)


def test_decode_fills_the_ring_exactly():
    """Rows decoding to max_len: each row's pages peak at exactly ``window_pages`` (the ring
    is as small as it can be), the pool is never short, and lengths reach max_len."""
    B, Hkv, d, S, W, P = 3, 1, 4, 200, 17, 4
    ring = gqakv.KVCache(B, Hkv, S, d, dtype="float64", backend="numpy", page_size=P, window=W,
                         max_chunk=1)
    per_row = window_pages(W, S, P, 1)
    assert ring.num_pages == B * per_row and per_row < -(-S // P)
    rng = np.random.default_rng(0)
    peak = 0
    for _ in range(S):
        k, v = rng.standard_normal((2, B, Hkv, 1, d))
        ring.append(k, v, [1] * B)
        peak = max([peak] + [ring.store.page_table.row_pages(b).size for b in range(B)])
        audit(ring)
    assert peak == per_row and ring.host_lens.tolist() == [S] * B
    assert ring.nbytes == B * per_row * P * 2 * Hkv * d * 8


def test_refusals_name_the_numbers_and_change_nothing():
    arrays = BackendArrays(gqakv.get_backend("numpy"))
    B, Hkv, d, S, W, P, C = 2, 1, 4, 64, 5, 4, 20
    ring = gqakv.KVCache(B, Hkv, S, d, dtype="float64", backend="numpy", page_size=P, window=W,
                         max_chunk=C)
    rng = np.random.default_rng(3)
    for n in ([20, 3], [2, 2]):
        k, v = rng.standard_normal((2, B, Hkv, max(n), d))
        ring.append(k, v, n)
    assert ring.store.first_held([0, 1]).tolist() == [16, 0]
    before = state(ring, arrays)
    k, v = rng.standard_normal((2, B, Hkv, 21, d))
    with pytest.raises(ValueError, match=r"n_new\[1\]=21 tokens to row 1 exceeds this window-sized "
                                         r"cache's max_chunk=20 \(window=5: its pool of 14 pages of 4 "
                                         r"tokens.*chunks of at most 20 tokens"):
        ring.append(k, v, [1, 21])
    with pytest.raises(ValueError, match=r"truncate row 0 to 19 tokens: its sliding window "
                                         r"\(window=5\) already released tokens 0\.\.15.*shortest "
                                         r"length allowed is 20"):
        ring.truncate([1, 0], [1, 19])
    with pytest.raises(ValueError, match=r"live_kv cannot return the whole row"):
        ring.live_kv(0)
    with pytest.raises(ValueError, match=r"row 0 holds keys 16\.\.21 only.*window=None"):
        gqakv.gqa_attention(rng.standard_normal((B, 2, 1, d)), ring, [1, 1])
    assert_same_state(before, state(ring, arrays))
    ring.truncate([0], [20])  # the shortest allowed
    ring.reset([0])
    assert ring.store.page_table.released.tolist() == [0, 0]
    audit(ring)
    # what a ring cannot be made with, named
    with pytest.raises(ValueError, match=r"window=4 with storage='contiguous'.*give max_chunk=C"):
        gqakv.KVCache(B, Hkv, S, d, window=4)
    with pytest.raises(ValueError, match=r"num_pages=3 does not apply.*window=4"):
        gqakv.KVCache(B, Hkv, S, d, window=4, max_chunk=2, num_pages=3)
    with pytest.raises(ValueError, match=r"prefix_cache=True applies to storage='paged' only"):
        gqakv.KVCache(B, Hkv, S, d, window=4, max_chunk=2, prefix_cache=True)
    with pytest.raises(ValueError, match=r"max_chunk=2 sizes window-sized storage"):
        gqakv.KVCache(B, Hkv, S, d, max_chunk=2)
    with pytest.raises(ValueError, match=r"max_chunk=0"):
        gqakv.KVCache(B, Hkv, S, d, window=4, max_chunk=0)
    with pytest.raises(TypeError, match=r"max_chunk must be an int"):
        gqakv.KVCache(B, Hkv, S, d, window=4, max_chunk=2.0)
    with pytest.raises(ValueError, match=r"max_chunk=2 sizes window-sized storage"):
        gqakv.ModelKVCache(2, B, Hkv, S, d, max_chunk=2)
    with pytest.raises(ValueError, match=r"window=\[4, 8\] with storage='contiguous'"):
        gqakv.ModelKVCache(2, B, Hkv, S, d, windows=[4, 8], storage="contiguous")


def test_paged_cache_with_max_chunk_is_the_same_ring():
    """``PagedKVCache(window=W, max_chunk=C)`` sizes its pool as the ring and refuses
    longer appends; with an explicit ``num_pages`` it keeps that pool."""
    ring = gqakv.KVCache(3, 1, 100, 4, backend="numpy", page_size=8, window=10, max_chunk=6)
    paged = gqakv.PagedKVCache(3, 1, 100, 4, backend="numpy", page_size=8, window=10, max_chunk=6)
    assert paged.num_pages == ring.num_pages == 3 * window_pages(10, 100, 8, 6)
    assert gqakv.PagedKVCache(3, 1, 100, 4, page_size=8, window=10, max_chunk=6,
                              num_pages=40).num_pages == 40
    with pytest.raises(ValueError, match="max_chunk=6"):
        paged.append(*np.zeros((2, 3, 1, 7, 4), np.float32), [0, 7, 0])
    assert paged.host_lens.tolist() == [0, 0, 0]
    # a chunk longer than max_len sizes no more than every row at max_len
    big = gqakv.KVCache(2, 1, 30, 4, backend="numpy", page_size=8, window=10, max_chunk=1000)
    assert big.num_pages == 2 * 4


def test_model_cache_rings_match_full_history_through_steps():
    """A model of full and sliding layers (two windows) with storage="contiguous": its full
    layer keeps contiguous rows and its sliding layers are rings; steps of chunks up to
    max_chunk, a fork, a reorder, a truncate and an aborted step give bit for bit the
    outputs of the full-history model caches (the sliding layers the paged one's, the full
    layer the contiguous one's), match the reference, and a step longer than max_chunk is
    refused when it opens, before any group changes."""
    B, Hkv, d, S, P, C = 3, 1, 4, 200, 4, 9
    windows = [5, None, 9, 5]
    ring = gqakv.ModelKVCache(4, B, Hkv, S, d, dtype="float64", backend="numpy", page_size=P,
                              windows=windows, storage="contiguous", max_chunk=C)
    paged = gqakv.ModelKVCache(4, B, Hkv, S, d, dtype="float64", backend="numpy", page_size=P)
    contiguous = gqakv.ModelKVCache(4, B, Hkv, S, d, dtype="float64", backend="numpy")
    kinds = {w: store.kind for w, _, store in ring.store.groups}
    assert kinds == {5: "paged", None: "contiguous", 9: "paged"}
    assert ring.layer(1).store.k.shape == (B, Hkv, S, d)  # the full layer's rows, whole
    tables = ring.store.page_tables
    assert sorted(tables) == [5, 9]  # the paged kinds only
    slots = B * S + sum(windows.count(w) * B * window_pages(w, S, P, C) * P for w in (5, 9))
    assert ring.nbytes == slots * 2 * Hkv * d * 8  # K and V, float64
    assert tables[5].num_pages == B * window_pages(5, S, P, C)
    assert tables[9].num_pages == B * window_pages(9, S, P, C)
    rng = np.random.default_rng(1)
    directs = [Direct(B, Hkv, d) for _ in windows]
    for step in range(40):
        T = int(rng.integers(1, C + 1)) if step % 3 == 0 else 1
        n = np.minimum(rng.integers(0, T + 1, B), S - ring.host_lens)
        qs = rng.standard_normal((4, B, 2, T, d))
        ks, vs = rng.standard_normal((2, 4, B, Hkv, T, d))
        outs = {}
        for name, c in (("ring", ring), ("paged", paged), ("contiguous", contiguous)):
            with c.step(n) as st:
                outs[name] = [st.attend(l, qs[l], ks[l], vs[l], window=w, return_lse=True)
                              for l, w in enumerate(windows)]
        for l, w in enumerate(windows):
            directs[l].append(range(B), ks[l], vs[l], n)
            for a, b in zip(outs["ring"][l], outs["paged" if w else "contiguous"][l]):
                np.testing.assert_array_equal(float_bits(a), float_bits(b))
            want, _ = reference_attention(qs[l], directs[l].k, directs[l].v, n, window=w)
            np.testing.assert_allclose(outs["ring"][l][0], want, atol=1e-12)
        if step == 12:
            for c in (ring, paged, contiguous):
                c.fork(0, [2])
            for dr in directs:
                dr.fork(0, [2])
        if step == 20:
            src = np.array([1, 0, 0])
            for c in (ring, paged, contiguous):
                c.reorder(src)
            for dr in directs:
                dr.reorder(src)
        if step == 25:
            gone = int(ring.store.first_held([1])[0])
            keep = max(int(ring.host_lens[1]) - 2, gone + 9 - 1 if gone else 0)
            keep = min(keep, int(ring.host_lens[1]))
            for c in (ring, paged, contiguous):
                c.truncate([1], [keep])
            for dr in directs:
                dr.truncate([1], [keep])
        if step == 30:  # an aborted step: lengths stay, the pages it took go back
            with pytest.raises(KeyError):
                with ring.step([1, 1, 1]) as st:
                    st.attend(0, qs[0][:, :, :1], ks[0][:, :, :1], vs[0][:, :, :1], window=5)
                    raise KeyError("abort")
        for w, table in tables.items():
            assert table.audit(ring.host_lens) == [], w
    assert tables[5].window_released > 0 and tables[9].window_released > 0
    before = {w: (t.entries.copy(), t.released.copy(), list(t._free)) for w, t in tables.items()}
    lens = ring.host_lens.copy()
    with pytest.raises(ValueError, match=rf"n_new\[0\]={C + 1} tokens to row 0 exceeds .*"
                                         rf"max_chunk={C}"):
        ring.step([C + 1, 1, 1])
    for w, t in tables.items():
        np.testing.assert_array_equal(before[w][0], t.entries)
        np.testing.assert_array_equal(before[w][1], t.released)
        assert before[w][2] == list(t._free)
    assert ring.host_lens.tolist() == lens.tolist()
    with ring.step([1, 1, 1]) as st:  # the cache is still usable
        for l, w in enumerate(windows):
            q = rng.standard_normal((B, 2, 1, d))
            k, v = rng.standard_normal((2, B, Hkv, 1, d))
            st.attend(l, q, k, v, window=w)


def test_cuda_kernels_read_a_mixed_models_contiguous_and_ring_layers_on_the_emulator(backend, route_spy):
    """The cupy backend on the CPU emulator: a model of full and sliding layers with
    storage="contiguous" (its full layers contiguous, its sliding one a ring) gives bit for
    bit the contiguous full-history model's outputs on the full layers and the paged one's
    on the sliding layer, through chunks longer than the window, a fork and decode, each
    call on the kernel ``route()`` names."""
    from .support.routes import assert_product_routes

    if backend.name != "cupy_emulated":
        pytest.skip("the CUDA kernels' check (numpy and numba: the test below)")
    arrays = BackendArrays(backend)
    spy = route_spy(backend)
    B, Hkv, d, S, P, C, dt = 2, 1, 8, 48, 4, 12, "bfloat16"
    windows = [None, 5, None]
    caches = {"ring": gqakv.ModelKVCache(3, B, Hkv, S, d, dtype=dt, backend=backend, page_size=P,
                                         windows=windows, storage="contiguous", max_chunk=C),
              "contiguous": gqakv.ModelKVCache(3, B, Hkv, S, d, dtype=dt, backend=backend),
              "paged": gqakv.ModelKVCache(3, B, Hkv, S, d, dtype=dt, backend=backend, page_size=P)}
    assert [st.kind for st in caches["ring"]._layer_stores] == ["contiguous", "paged", "contiguous"]
    rng = np.random.default_rng(2)
    for T, n in [(9, [9, 7]), (1, [1, 1]), (12, [12, 3]), ("fork", None), (1, [1, 1]), (4, [4, 4])]:
        if T == "fork":
            for c in caches.values():
                c.fork(0, [1])
            continue
        qs = rng.standard_normal((3, B, 2, T, d))
        ks, vs = rng.standard_normal((2, 3, B, Hkv, T, d))
        outs = {}
        for name, c in caches.items():
            with c.step(n) as st:
                outs[name] = [arrays.to_numpy(st.attend(l, *(arrays.asarray(x[l], dt) for x in (qs, ks, vs)),
                                                        window=w), np.float32)
                              for l, w in enumerate(windows)]
        for l, w in enumerate(windows):
            np.testing.assert_array_equal(float_bits(outs["ring"][l]),
                                          float_bits(outs["paged" if w else "contiguous"][l]))
    assert caches["ring"].store.page_tables[5].window_released > 0
    assert_product_routes(spy)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_contiguous_full_layers_of_a_mixed_model_through_trees_and_accept(backend):
    """storage="contiguous" with full and sliding layers: the full layers' rows are
    contiguous ([layers, B, Hkv, max_len, d], read by the backend's contiguous path), the
    sliding ones rings. Draft-tree steps, accepted paths (moves within the contiguous
    rows and copies on write in the rings' pages), forks and decode give bit for bit the
    outputs of a contiguous full-history cache on the full layers and of a paged one on
    the sliding layers; ``live_kv`` of a full layer is its rows, and the rings' audit holds."""
    B, Hkv, d, S, P, C, T = 3, 2, 8, 96, 4, 6, 5
    windows = [None, 7, None]
    ring = gqakv.ModelKVCache(3, B, Hkv, S, d, "float32", backend=backend, page_size=P,
                              windows=windows, storage="contiguous", max_chunk=C)
    paged = gqakv.ModelKVCache(3, B, Hkv, S, d, "float32", backend=backend, page_size=P)
    contiguous = gqakv.ModelKVCache(3, B, Hkv, S, d, "float32", backend=backend)
    assert [st.kind for st in ring._layer_stores] == ["contiguous", "paged", "contiguous"]
    caches = {"ring": ring, "paged": paged, "contiguous": contiguous}
    rng = np.random.default_rng(11)  # both backends hold NumPy arrays

    def step(n, tree=None):
        qs = rng.standard_normal((3, B, 4, max(n), d)).astype(np.float32)
        ks, vs = rng.standard_normal((2, 3, B, Hkv, qs.shape[3], d)).astype(np.float32)
        outs = {}
        for name, c in caches.items():
            with c.step(n, tree=tree) as st:
                outs[name] = [st.attend(l, qs[l], ks[l], vs[l], window=w) for l, w in enumerate(windows)]
        for l, w in enumerate(windows):
            np.testing.assert_array_equal(float_bits(outs["ring"][l]),
                                          float_bits(outs["paged" if w else "contiguous"][l]))

    step([C, C - 1, 2])
    step([C, 3, C])
    for trial in range(6):
        parents = np.array([[-1] + [int(rng.integers(-1, t)) for t in range(1, T)] for _ in range(B)])
        tree = gqakv.DraftTree.of(parents, [T] * B)
        step([T] * B, tree)
        paths = []
        for b in range(B):  # a root path's prefix (or nothing)
            u, path = int(rng.integers(0, T)), []
            while u >= 0:
                path.append(u)
                u = int(parents[b, u])
            paths.append(path[::-1][:int(rng.integers(0, len(path) + 1))])
        for c in caches.values():
            c.accept(paths, tree)
        assert ring.host_lens.tolist() == contiguous.host_lens.tolist()
        if trial == 2:
            for c in caches.values():
                c.fork(1, [0])
        step([1] * B)
        for table in ring.store.page_tables.values():
            assert table.audit(ring.host_lens) == []
    for b in range(B):
        for got, want in zip(ring.live_kv(0, b), contiguous.live_kv(0, b)):
            np.testing.assert_array_equal(got, want)


def test_mistral_shape_ring_bytes():
    """A Mistral-shaped model cache (8 KV heads, d 128, window 4,096, bfloat16) at 32,768
    tokens in contiguous rings: per layer and row exactly ``window_pages`` pages, so 32
    layers take 538,968,064 bytes for decode (as ``gqakv size`` prints) against 4 GiB with
    every layer's history; measured on a real two-layer cache."""
    w = window_cache_bytes("mistral-7b", max_len=32768)
    assert w.full_history_bytes == 4 * 2**30 and w.window_bytes == 538_968_064
    cfg = ModelConfig("mistral-2-layers", 2, 32, 8, 128, 32768, sliding_window=4096)
    for chunk, pages in ((1, 257), (512, 289)):
        ring = gqakv.ModelKVCache(cfg.layers, 1, 8, 32768, 128, "bfloat16", backend="numpy",
                                  windows=cfg.layer_windows(), storage="contiguous",
                                  max_chunk=chunk)
        assert ring.num_pages == pages
        assert ring.nbytes == 2 * pages * 16 * 2 * 8 * 128 * 2
    assert gqakv.ModelKVCache.nbytes_for(2, 1, 8, 32768, 128, "bfloat16") == 2 * 2**27
