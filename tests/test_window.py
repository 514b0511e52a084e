"""Window-sized storage for sliding layers (``PagedKVCache(window=W)``,
``ModelKVCache(windows=...)``): the pages behind every query's window go back to the pool
as rows grow, and nothing else changes.

The standard: a windowed cache gives bit for bit the outputs (and LSE) of the same paged
cache keeping its whole history, under random chunks (longer than the window too),
decode steps, idle and ragged rows, forks, reorders, truncates, resets and accepted draft
paths; both match the float64 loop reference; pages are released as the window moves
(counted), the audit stays exact after every operation, and pages no row names hold NaN,
so a reader that touched a released page would show it. Reading, truncating or caching
into released history is refused with a ValueError naming the numbers, and changes
nothing.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import gqakv
from gqakv.storage.paged import pages_for
from gqakv.storage.sizing import ModelConfig, window_cache_bytes, window_pages

from .support.arrays import BackendArrays
from .support.direct import Direct
from .support.pages import (float_bits, assert_same_state, audit, float64_sequence_backend_or_skip,
                            poison_unnamed, state)
from .support.parity import assert_matches_reference
from .support.reference import reference_attention


def _random_window_ops(backend, seed, steps, page_size, window, num_pages=None, dtype="float64"):
    """Random operations on a windowed cache and on the same cache keeping every token;
    returns the operations seen and the pages the window released."""
    arrays = BackendArrays(backend)
    rng = np.random.default_rng(seed)
    B, Hkv, G, d, S = 4, 2, 2, 4, 90
    full = gqakv.PagedKVCache(B, Hkv, S, d, dtype=dtype, backend=backend, page_size=page_size)
    win = gqakv.PagedKVCache(B, Hkv, S, d, dtype=dtype, backend=backend, page_size=page_size,
                             window=window, num_pages=num_pages)
    direct = Direct(B, Hkv, d)
    seen: set[str] = set()
    last = np.zeros(B, dtype=np.int64)  # tokens of each row's latest append (what it may attend)
    for _ in range(steps):
        op = rng.choice(["append", "append", "append", "decode", "fork", "reorder", "truncate",
                         "reset"])
        if op in ("append", "decode"):
            T = 1 if op == "decode" else int(rng.integers(1, 2 * window + 3))  # longer than W too
            n = np.minimum(rng.integers(0, T + 1, B), S - full.host_lens)
            if op == "decode":
                n = np.minimum(rng.integers(0, 2, B), S - full.host_lens)
            k, v = rng.standard_normal((2, B, Hkv, T, d))
            q = rng.standard_normal((B, Hkv * G, T, d))
            ka, va, qa = (arrays.asarray(x, dtype) for x in (k, v, q))
            k, v, q = (arrays.to_numpy(x).astype(np.float64) for x in (ka, va, qa))  # as held
            for c in (full, win):
                c.append(ka, va, n)
            direct.append(range(B), k, v, n)
            last = n.copy()
            poison_unnamed(win)
            got = [gqakv.gqa_attention(qa, c, n, window=window, return_lse=True) for c in (full, win)]
            for a, b in zip(got[0], got[1]):
                np.testing.assert_array_equal(float_bits(arrays.to_numpy(a)), float_bits(arrays.to_numpy(b)))
            want, want_lse = reference_attention(q, direct.k, direct.v, n, window=window)
            assert_matches_reference(arrays.to_numpy(got[1][0]), arrays.to_numpy(got[1][1]),
                                     want, want_lse, dtype, what=f"window={window} n={n}")
            if dtype == "float64":  # as tests/test_paged.py's random operations
                np.testing.assert_allclose(arrays.to_numpy(got[1][0]), want, atol=1e-12)
            if (n > window).any():
                seen.add("chunk longer than the window")
        elif op == "fork":
            src = int(rng.integers(0, B))
            dst = rng.permutation(B)[:rng.integers(1, B)]
            for c in (full, win):
                c.fork(src, dst)
            direct.fork(src, dst)
            last[dst[dst != src]] = 0
        elif op == "reorder":
            src = rng.integers(0, B, B)
            for c in (full, win):
                c.reorder(src)
            direct.reorder(src)
            last = last[src]
        elif op == "truncate":
            r = int(rng.integers(0, B))
            have = int(win.host_lens[r])
            shortest = int(win.store.first_held([r])[0]) + window - 1 if win.store.first_held([r])[0] else 0
            lo = min(have, shortest)
            n = int(rng.integers(lo, have + 1)) if rng.random() < 0.8 else 0
            for c in (full, win):
                c.truncate([r], [n])
            direct.truncate([r], [n])
            last[r] = 0
        else:
            r = rng.permutation(B)[:rng.integers(1, B + 1)]
            for c in (full, win):
                c.reset(r)
            direct.truncate(r, [0] * r.size)
            last[r] = 0
        seen.add(str(op))
        audit(win)
        audit(full)
        if (win.store.page_table.refs > 1).any():
            seen.add("shared pages")
        if win.store.page_table.released.any():
            seen.add("released pages")
    return seen, win.pages_released


@pytest.mark.parametrize("seed, page_size, window", [(0, 4, 6), (1, 3, 1), (2, 5, 11), (3, 1, 4),
                                                     (4, 16, 9), (5, 2, 2)])
def test_random_operations_match_full_history_numpy(seed, page_size, window):
    seen, released = _random_window_ops(gqakv.get_backend("numpy"), seed, 120, page_size, window)
    assert {"append", "decode", "fork", "reorder", "truncate", "reset", "released pages",
            "chunk longer than the window"} <= seen
    assert released > 0


def test_random_operations_match_full_history_every_backend(backend, route_spy):
    """Every backend, through the path it routes paged storage to (the spy checks that each
    append and attention ran what ``route()`` names and the path meant)."""
    from .support.routes import assert_product_routes

    float64_sequence_backend_or_skip(backend, "test_cuda_kernels_read_from_the_window_on_the_emulator")
    spy = route_spy(backend)
    seen, released = _random_window_ops(backend, 7, 40, 4, 5)
    assert "released pages" in seen and released > 0
    assert_product_routes(spy)


def test_float32_on_every_backend(backend, route_spy):
    """The kernels' dtype (numba's paged kernel, NumPy's BLAS path over the page table):
    windowed and full-history caches agree bit for bit, and match the reference."""
    from .support.routes import assert_product_routes

    if "float32" not in backend.dtypes or backend.name == "cupy_emulated":
        pytest.skip(f"{backend.name}: no float32, or the emulator's time (its own test below)")
    spy = route_spy(backend)
    seen, released = _random_window_ops(backend, 11, 30, 4, 7, dtype="float32")
    assert released > 0
    assert_product_routes(spy)


def test_cuda_kernels_read_from_the_window_on_the_emulator(backend, route_spy):
    """The cupy backend's paged kernels (append, chunked prefill, decode), run on the CPU
    emulator: the windowed cache equals the full-history one bit for bit, with every free,
    released or never-written page slot NaN, and each call ran the kernel ``route()`` names."""
    from .support.routes import assert_product_routes

    if backend.name != "cupy_emulated":
        pytest.skip("the CUDA kernels' check (the other backends run the tests above)")
    arrays = BackendArrays(backend)
    spy = route_spy(backend)
    rng = np.random.default_rng(0)
    B, Hkv, d, S, W, P, dt = 2, 1, 8, 48, 5, 4, "bfloat16"
    full, win = (gqakv.PagedKVCache(B, Hkv, S, d, dtype=dt, backend=backend, page_size=P, window=w)
                 for w in (None, W))
    for c in (full, win):
        c.store.fill(math.nan)
    for T, n in [(9, [9, 7]), (1, [1, 1]), (12, [12, 3]), (1, [1, 0]), (1, [1, 1]), (4, [4, 4])]:
        k, v = rng.standard_normal((2, B, Hkv, T, d))
        q = rng.standard_normal((B, 2, T, d))
        outs = []
        for c in (full, win):
            c.append(arrays.asarray(k, dt), arrays.asarray(v, dt), n)
            outs.append(arrays.to_numpy(gqakv.gqa_attention(arrays.asarray(q, dt), c, n, window=W)))
        np.testing.assert_array_equal(float_bits(outs[0]), float_bits(outs[1]))
        assert np.isfinite(outs[1].astype(np.float32)).all()
        audit(win)
    assert win.pages_released == 7
    assert_product_routes(spy)


def test_decode_releases_pages_as_the_window_moves_and_a_window_pool_suffices():
    """Rows decoding to max_len in a pool of ``window_pages`` pages per row: never out of
    pages; each row ends holding only its window's pages; the released count is exact."""
    B, Hkv, d, S, W, P = 3, 1, 4, 200, 17, 4
    per_row = window_pages(W, S, P, 1)
    # keys s - 16..s on pages of 4: five pages however they fall (ceil((16 + 1 + 3) / 4))
    assert per_row == 5 < pages_for(S, P)
    cache = gqakv.PagedKVCache(B, Hkv, S, d, dtype="float64", backend="numpy", page_size=P,
                               window=W, num_pages=B * per_row)
    rng = np.random.default_rng(0)
    for s in range(S):
        k, v = rng.standard_normal((2, B, Hkv, 1, d))
        cache.append(k, v, [1] * B)
        q = rng.standard_normal((B, 2, 1, d))
        gqakv.gqa_attention(q, cache, [1] * B, window=W)
        audit(cache)
        assert cache.pages_used <= B * per_row
        want = cache.store.page_table.window_releasable(s)  # the append started at s
        assert cache.store.page_table.released.tolist() == [want] * B
    assert cache.pages_released == B * ((S - 1 - W + 1) // P)
    for b in range(B):
        assert cache.store.page_table.row_pages(b).size == pages_for(S, P) - (S - W) // P


def test_refusals_name_the_numbers_and_change_nothing():
    arrays = BackendArrays(gqakv.get_backend("numpy"))
    B, Hkv, d, S, W, P = 2, 1, 4, 64, 5, 4
    cache = gqakv.PagedKVCache(B, Hkv, S, d, dtype="float64", backend="numpy", page_size=P,
                               window=W, prefix_cache=True)
    rng = np.random.default_rng(3)
    for n in ([20, 3], [2, 2]):
        k, v = rng.standard_normal((2, B, Hkv, max(n), d))
        cache.append(k, v, n)
    assert cache.store.first_held([0, 1]).tolist() == [16, 0]  # (20 - 5 + 1) // 4 pages
    q = rng.standard_normal((B, 2, 2, d))
    before = state(cache, arrays)
    with pytest.raises(ValueError, match=r"row 0 holds keys 16\.\.21 only.*window=5.*from 0 on "
                                         r"with window=None"):
        gqakv.gqa_attention(q, cache, [2, 2])
    with pytest.raises(ValueError, match=r"from 13 on with window=8"):
        gqakv.gqa_attention(q, cache, [2, 2], window=8)
    q6 = rng.standard_normal((B, 2, 6, d))
    with pytest.raises(ValueError, match=r"position 16\) would read keys from 12 on"):
        gqakv.gqa_attention(q6, cache, [6, 2], window=W)
    gqakv.gqa_attention(q, cache, [2, 2], window=W)  # the window itself: fine
    gqakv.gqa_attention(q, cache, [2, 2], window=3)  # a smaller one too
    with pytest.raises(ValueError, match=r"truncate row 0 to 19 tokens: its sliding window "
                                         r"\(window=5\) already released tokens 0\.\.15.*shortest "
                                         r"length allowed is 20"):
        cache.truncate([0, 1], [19, 3])
    with pytest.raises(ValueError, match=r"truncate row 0 to 19"):
        cache.truncate([1, 0], [1, 19])
    with pytest.raises(ValueError, match=r"live_kv cannot return the whole row"):
        cache.live_kv(0)
    with pytest.raises(ValueError, match=r"cannot cache a prefix of row 0.*released its tokens 0\.\.15"):
        cache.cache_prefix(0, np.arange(16))
    assert_same_state(before, state(cache, arrays))
    cache.live_kv(1)  # row 1 released nothing
    cache.truncate([0], [20])  # the shortest allowed
    audit(cache)
    cache.truncate([0], [0])  # emptied: starts again at its first page
    assert cache.store.page_table.released[0] == 0
    audit(cache)
    with pytest.raises(ValueError, match=r"window=4 with storage='contiguous'.*give max_chunk"):
        gqakv.KVCache(B, Hkv, S, d, window=4)  # a contiguous ring needs max_chunk (test_ring.py)
    with pytest.raises(ValueError, match=r"window"):
        gqakv.PagedKVCache(B, Hkv, S, d, window=0)
    with pytest.raises(TypeError, match=r"window"):
        gqakv.PagedKVCache(B, Hkv, S, d, window=2.5)


def test_out_of_pages_takes_the_window_releases_back():
    """An append the pool cannot serve, even with the pages its window would release,
    changes nothing: not the releases either."""
    arrays = BackendArrays(gqakv.get_backend("numpy"))
    B, Hkv, d, S, W, P = 2, 1, 2, 64, 3, 2
    cache = gqakv.PagedKVCache(B, Hkv, S, d, dtype="float64", backend="numpy", page_size=P,
                               window=W, num_pages=12)
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, B, Hkv, 10, d))
    cache.append(k, v, [10, 10])  # 10 pages
    before = state(cache, arrays)
    k, v = rng.standard_normal((2, B, Hkv, 12, d))
    with pytest.raises(gqakv.OutOfPages):
        cache.append(k, v, [12, 12])  # releases 4 per row, needs 6 per row: 2 + 8 < 12
    assert_same_state(before, state(cache, arrays))
    audit(cache)
    cache.append(k, v, [6, 6])  # 2 free + 8 released >= 6 + 6 - ... fits
    audit(cache)


@pytest.mark.parametrize("backend_name, dtype", [("numpy", "float64"), ("numba", "float32"),
                                                 ("torch", "float32")])
def test_accept_with_a_window_matches_full_history(backend_name, dtype):
    """Speculative decoding: a draft tree's chunk appended and attended (window, by
    logical position), a path accepted; the windowed cache equals the full-history one,
    and an accept whose next query would need released keys is refused before any move."""
    backend = gqakv.get_backend(backend_name)
    if backend.unavailable_reason():
        pytest.skip(f"{backend_name}: {backend.unavailable_reason()}")
    arrays = BackendArrays(backend)
    B, Hkv, d, S, W, P = 2, 1, 4, 80, 6, 2
    full, win = (gqakv.PagedKVCache(B, Hkv, S, d, dtype=dtype, backend=backend, page_size=P,
                                    window=w) for w in (None, W))
    for c in (full, win):
        c.store.fill(math.nan)  # no slot a reader may not see holds a number
    rng = np.random.default_rng(5)

    def a(x):
        return arrays.asarray(x, dtype)
    k, v = rng.standard_normal((2, B, Hkv, 30, d))
    for c in (full, win):
        c.append(a(k), a(v), [30, 21])
    parents = np.array([[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]])
    tree = gqakv.DraftTree.of(parents, [5, 5])
    for trial in range(3):
        k, v = rng.standard_normal((2, B, Hkv, 5, d))
        q = rng.standard_normal((B, 2, 5, d))
        outs = []
        for c in (full, win):
            c.append(a(k), a(v), [5, 5])
            outs.append(arrays.to_numpy(gqakv.gqa_attention(a(q), c, [5, 5], window=W, tree=parents)))
        np.testing.assert_array_equal(float_bits(outs[0]), float_bits(outs[1]))
        paths = [[0, 1, 3], [0, 1, 2, 3]] if trial % 2 else [[0, 2, 4], []]
        for c in (full, win):
            c.accept(paths, tree)
        audit(win)
        k, v = rng.standard_normal((2, B, Hkv, 1, d))
        q = rng.standard_normal((B, 2, 1, d))
        outs = []
        for c in (full, win):
            c.append(a(k), a(v), [1, 1])
            outs.append(arrays.to_numpy(gqakv.gqa_attention(a(q), c, [1, 1], window=W)))
        np.testing.assert_array_equal(float_bits(outs[0]), float_bits(outs[1]))
    assert win.pages_released > 0
    # a chunk appended in two appends: the window moved in between, so rejecting the whole
    # tree would leave the row shorter than its released history allows
    before = state(win, arrays)
    r0 = int(win.host_lens[0])
    k, v = rng.standard_normal((2, B, Hkv, 20, d))
    win.append(a(k), a(v), [20, 0])
    win.append(a(k[:, :, :2]), a(v[:, :, :2]), [2, 0])
    long_tree = gqakv.DraftTree.of(np.array([list(range(-1, 21)), [-1] * 22]), [22, 0])
    mid = state(win, arrays)
    with pytest.raises(ValueError, match=r"cannot accept draft paths of row 0 to %d tokens" % r0):
        win.accept([[], []], long_tree)
    assert_same_state(mid, state(win, arrays))
    assert before[0].tolist() != mid[0].tolist()


def test_prefix_cache_pages_survive_the_window():
    """A prompt's pages cached right after prefill stay matchable when the window
    releases them (they become cached pages no row names); a request matching them
    attends exactly as one that prefilled the whole prompt."""
    B, Hkv, d, S, W, P = 3, 1, 4, 96, 5, 4
    win = gqakv.PagedKVCache(B, Hkv, S, d, dtype="float64", backend="numpy", page_size=P,
                             window=W, prefix_cache=True)
    full = gqakv.PagedKVCache(B, Hkv, S, d, dtype="float64", backend="numpy", page_size=P)
    rng = np.random.default_rng(9)
    ids = np.arange(100, 124)
    k, v = rng.standard_normal((2, 1, Hkv, 24, d))
    for c in (win, full):
        c.append(k, v, [24], rows=[0])
    assert win.cache_prefix(0, ids) == 6
    for _ in range(10):  # the window moves past the cached pages
        kk, vv = rng.standard_normal((2, 1, Hkv, 1, d))
        for c in (win, full):
            c.append(kk, vv, [1], rows=[0])
    assert win.store.page_table.released[0] > 0
    audit(win)
    win.reset([0])
    assert win.pages_reusable == 6
    audit(win)
    matched = win.match_prefix(1, np.concatenate([ids, [7]]))
    assert matched == 24
    kk, vv = rng.standard_normal((2, 1, Hkv, 1, d))
    win.append(kk, vv, [1], rows=[1])
    full.append(k, v, [24], rows=[1])
    full.append(kk, vv, [1], rows=[1])
    q = rng.standard_normal((1, 2, 1, d))
    a = gqakv.gqa_attention(q, win, [1], rows=[1], window=W)
    b = gqakv.gqa_attention(q, full, [1], rows=[1], window=W)
    np.testing.assert_array_equal(a, b)
    audit(win)


@pytest.mark.parametrize("backend_name", ["numpy", "numba"])
def test_model_cache_layers_by_kind(backend_name):
    """A model of full and sliding layers (two windows): a pool per kind, each layer's
    outputs bit for bit those of the full-history model cache, through step/attend, forks,
    reorders, truncates and resets; the sliding pools release pages, the full one none."""
    if gqakv.get_backend(backend_name).unavailable_reason():
        pytest.skip(f"{backend_name} unavailable")
    rng = np.random.default_rng(1)
    layers, B, Hkv, d, S, P = 4, 3, 1, 4, 120, 4
    windows = [5, None, 5, 9]
    ref = gqakv.ModelKVCache(layers, B, Hkv, S, d, dtype="float64", backend=backend_name, page_size=P)
    win = gqakv.ModelKVCache(layers, B, Hkv, S, d, dtype="float64", backend=backend_name,
                             page_size=P, windows=windows,
                             num_pages={None: B * pages_for(S, P),
                                        5: B * window_pages(5, S, P, 12),
                                        9: B * window_pages(9, S, P, 12)})
    assert win.windows == tuple(windows)
    assert win.nbytes < ref.nbytes
    with pytest.raises(TypeError, match="3 stores by kind"):
        win.pages_used  # several pools: no single count (win.store.page_tables has each)
    assert win.prefix_index is None
    for step in range(40):
        T = int(rng.integers(1, 13))
        n = np.minimum(rng.integers(0, T + 1, B), S - ref.host_lens)
        kv = rng.standard_normal((layers, 2, B, Hkv, T, d))
        q = rng.standard_normal((layers, B, 2, T, d))
        outs = []
        for c in (ref, win):
            o = []
            with c.step(n) as st:
                for l in range(layers):
                    o.append(st.attend(l, q[l], kv[l, 0], kv[l, 1], window=windows[l]))
            outs.append(o)
        for l in range(layers):
            np.testing.assert_array_equal(outs[0][l], outs[1][l], err_msg=f"step {step} layer {l}")
        if step % 7 == 3:
            for c in (ref, win):
                c.fork(int(step % B), [(step + 1) % B])
        if step % 11 == 5:
            src = rng.integers(0, B, B)
            for c in (ref, win):
                c.reorder(src)
        if step % 13 == 8:
            r = int(rng.integers(0, B))
            gone = int(win.store.first_held([r])[0])
            n_keep = max(int(win.host_lens[r]) - 3, gone + 9 - 1 if gone else 0)
            n_keep = min(n_keep, int(win.host_lens[r]))
            for c in (ref, win):
                c.truncate([r], [n_keep])
        if step == 30:
            for c in (ref, win):
                c.reset([0])
        if step % 9 == 4:  # an aborted step: its pages go back, its window releases stand
            qa, ka, va = rng.standard_normal((3, B, 2, 3, d))
            for c in (ref, win):
                with pytest.raises(KeyError):
                    with c.step(np.minimum([3, 3, 3], S - c.host_lens)) as st:
                        st.attend(0, qa, ka[:, :Hkv], va[:, :Hkv], window=windows[0])
                        raise KeyError("abort")
        for w, table in win.store.page_tables.items():
            assert table.audit(win.host_lens) == [], w
    tables = win.store.page_tables
    assert tables[None].window_released == 0
    assert tables[5].window_released > 0 and tables[9].window_released > 0
    # truncating into any group's released history is refused for all, before any change
    r = int(np.argmax(tables[5].released))
    gone = int(tables[5].first_held([r])[0])
    with pytest.raises(ValueError, match="window=5"):
        win.truncate([r], [gone + 1])
    assert win.host_lens[r] >= gone + 1


def test_model_cache_with_one_window_is_one_pool():
    cache = gqakv.ModelKVCache(3, 2, 1, 64, 4, windows=[8, 8, 8])
    assert cache.store.kind == "paged" and cache.store.window == 8
    cache.page_size  # one table: the single-kind API works
    with pytest.raises(ValueError, match="windows has 2 entries, the cache 3 layers"):
        gqakv.ModelKVCache(3, 2, 1, 64, 4, windows=[8, 8])
    with pytest.raises(ValueError, match=r"windows\[1\]"):
        gqakv.ModelKVCache(3, 2, 1, 64, 4, windows=[8, 0, 8])
    with pytest.raises(ValueError, match="window=8 with storage='contiguous'.*give max_chunk"):
        gqakv.ModelKVCache(2, 2, 1, 64, 4, windows=[None, 8], storage="contiguous")
    with pytest.raises(ValueError, match="prefix_cache=True needs layers of one kind"):
        gqakv.ModelKVCache(2, 2, 1, 64, 4, windows=[8, None], prefix_cache=True)


def test_mistral_shape_bytes_and_a_measured_cache():
    """Mistral 7B at 32,768 tokens, bfloat16, decode: 4.0 GiB per row with every layer's
    history against 514 MiB in window-sized storage (``gqakv size``'s numbers); a real
    two-layer cache of that shape allocates exactly its layers' share of it."""
    w = window_cache_bytes("mistral-7b", max_len=32768)
    assert w.full_history_bytes == 4 * 2**30
    assert w.pages_sliding == 257 and w.window_bytes == 32 * 257 * 16 * 2 * 8 * 128 * 2
    cfg = ModelConfig("mistral-2-layers", 2, 32, 8, 128, 32768, sliding_window=4096)
    cache = gqakv.ModelKVCache.for_model(cfg, batch=1, max_len=32768, backend="numpy",
                                         window_storage=True, chunk=1)
    assert cache.nbytes == 2 * w.window_bytes // 32
    plain = gqakv.ModelKVCache.nbytes_for(2, 1, 8, 32768, 128, "bfloat16")
    assert plain == 2 * w.full_history_bytes // 32


def test_for_model_with_a_chunk_refuses_a_longer_step_before_it_opens():
    """for_model(window_storage=True, chunk=C) sizes its sliding pools for C tokens per
    step: a longer step is refused when it opens, naming max_chunk, with nothing taken."""
    cfg = ModelConfig("mistral-2-layers", 2, 4, 2, 8, 64, sliding_window=6)
    cache = gqakv.ModelKVCache.for_model(cfg, batch=2, max_len=64, dtype="float32", backend="numpy",
                                         window_storage=True, chunk=3)
    with pytest.raises(ValueError, match=r"max_chunk=3"):
        cache.step([4, 1])
    assert list(cache.host_lens) == [0, 0]
    rng = np.random.default_rng(0)
    for _ in range(5):  # 3 per step fits, whatever the history (15 tokens > the window)
        with cache.step([3, 3]) as step:
            for layer in range(2):
                k, v = rng.standard_normal((2, 2, 2, 3, 8), dtype=np.float32)
                step.attend(layer, rng.standard_normal((2, 4, 3, 8), dtype=np.float32), k, v)
    assert list(cache.host_lens) == [15, 15]


def test_config_from_hf_reads_windows():
    from gqakv.storage.sizing import config_from_hf, get_preset

    cfg = config_from_hf({"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                          "hidden_size": 256, "sliding_window": 64,
                          "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert cfg.layer_windows() == (64, None, 64, None)
    qwen = config_from_hf({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 256,
                           "sliding_window": 64, "use_sliding_window": False})
    assert qwen.layer_windows() == (None, None)
    assert get_preset("gpt-oss-20b").layer_windows()[:2] == (128, None)
    w = window_cache_bytes("gpt-oss-20b", max_len=131072)
    assert w.full_history_bytes == 6 * 2**30 and w.sliding_layers == 12


def test_size_command_prints_window_storage(capsys):
    from gqakv.tools.cli import main

    assert main(["size", "mistral-7b", "--max-len", "32768"]) == 0
    out = capsys.readouterr().out
    assert "32 sliding layers (window 4,096)" in out
    assert "full history  4,294,967,296 bytes (4.0 GiB)" in out
    assert "window-sized  538,968,064 bytes" in out


# -- transformers: GqakvCache(window_storage=True) ----------------------------------------------


def _tiny_sliding_model(family: str, seed: int = 0):
    """A tiny random float64 model with sliding window 5: Mistral (every layer sliding) or
    gpt-oss (sliding and full layers alternate, sinks)."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    common = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, sliding_window=5)
    if family == "mistral":
        config, model_cls = tf.MistralConfig(**common), tf.MistralForCausalLM
    else:
        common.update(head_dim=8, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
        config, model_cls = tf.GptOssConfig(**common), tf.GptOssForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float64).eval()
    if family == "gpt_oss":
        model.set_experts_implementation("eager")
    return model


@pytest.mark.parametrize("family", ["mistral", "gpt_oss"])
def test_transformers_window_storage_generates_the_same_bits(family):
    """Left-padded prompts longer than the window, greedy generate (rows of 200 tokens
    capacity): the window-sized cache's
    tokens and logits equal the full-history cache's bit for bit; its sliding layers are
    windowed paged caches that released pages, its full layers unchanged."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import gqakv
    from gqakv.integrations.transformers import CACHE_KWARG, GqakvCache, register

    register()
    model = _tiny_sliding_model(family)
    model.set_attn_implementation("gqakv")
    g = torch.Generator().manual_seed(4)
    lens, width = [13, 9], 13
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lens):
        ids[b, width - n:] = torch.randint(3, 101, (n,), generator=g)
        mask[b, width - n:] = 1
    runs = []
    for window_storage in (False, True):
        cache = GqakvCache(model.config, max_cache_len=200, window_storage=window_storage)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                                 pad_token_id=0, **{CACHE_KWARG: cache})
        runs.append((out.sequences, torch.stack(out.logits), cache))
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])
    types = getattr(model.config, "layer_types", None) or ["sliding_attention"] * 2
    for t, full, win in zip(types, runs[0][2].kv_caches, runs[1][2].kv_caches):
        assert full.host_lens.tolist() == win.host_lens.tolist() == [13 + 23, 9 + 23]
        if t == "sliding_attention":
            assert isinstance(win, gqakv.PagedKVCache) and win.window == 5
            assert win.pages_released > 0 and win.nbytes < full.nbytes
            assert win.num_pages == 2 * window_pages(5, 200, 16, 13)  # sized by the prompt
            assert win.store.page_table.audit(win.host_lens) == []
        else:
            assert type(win) is gqakv.KVCache and win.nbytes == full.nbytes


@pytest.mark.parametrize("how", ["beams", "assisted"])
def test_transformers_window_storage_beams_and_assisted_decoding(how, monkeypatch):
    """Beam search (reorders of the rows) and assisted decoding with an assistant of other
    weights (drafts rejected: crops of the last forward's tokens): the same sequences bit for
    bit with window-sized sliding layers as with the full-history cache."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gqakv.integrations.transformers import CACHE_KWARG, GqakvCache, GqakvLayer, register

    register()
    crops, real_crop = [], GqakvLayer.crop

    def crop(self, tokens_to_remove):
        crops.append(int(tokens_to_remove))
        return real_crop(self, tokens_to_remove)

    monkeypatch.setattr(GqakvLayer, "crop", crop)
    model = _tiny_sliding_model("mistral")
    model.set_attn_implementation("gqakv")
    ids = torch.randint(3, 101, (1 if how == "assisted" else 2, 11),
                        generator=torch.Generator().manual_seed(6))
    extra: dict = {"num_beams": 2} if how == "beams" else {}
    if how == "assisted":
        assistant = _tiny_sliding_model("mistral", seed=1)
        assistant.set_attn_implementation("eager")
        extra = {"assistant_model": assistant}
    runs = []
    for window_storage in (False, True):
        cache = GqakvCache(model.config, max_cache_len=64, max_batch_size=4,
                           window_storage=window_storage, max_chunk=11)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                                 do_sample=False, eos_token_id=None, pad_token_id=0,
                                 **{CACHE_KWARG: cache}, **extra)
        runs.append((out, cache))
    assert torch.equal(runs[0][0], runs[1][0])
    if how == "assisted":
        assert any(c < 0 for c in crops)  # rejected drafts were cropped, window-sized layers too
    win = runs[1][1].kv_caches[0]
    assert win.window == 5 and win.pages_released > 0
    assert win.store.page_table.audit(win.host_lens) == []


def test_transformers_window_storage_needs_a_window():
    pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    from gqakv.integrations.transformers import GqakvCache

    config = tf.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2)
    with pytest.raises(ValueError, match="no sliding window"):
        GqakvCache(config, max_cache_len=16, window_storage=True)
    with pytest.raises(ValueError, match="max_chunk"):
        GqakvCache(config, max_cache_len=16, max_chunk=0)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4_g32_rotated"])
@pytest.mark.parametrize("backend_name", ["numpy", "numba", "torch"])
def test_quantized_pages_release_with_their_scales(backend_name, kv_dtype):
    """Quantized pages (codes and scales paged together; int8 per token, 4-bit with a
    scale per block of 32 and rotated keys): the windowed cache's outputs equal the
    full-history cache's of the same codec bit for bit while pages are released."""
    backend = gqakv.get_backend(backend_name)
    if backend.unavailable_reason():
        pytest.skip(f"{backend_name}: {backend.unavailable_reason()}")
    arrays = BackendArrays(backend)
    B, Hkv, d, S, W, P = 2, 2, 32, 64, 7, 4
    full, win = (gqakv.PagedKVCache(B, Hkv, S, d, dtype="float32", backend=backend, page_size=P,
                                    kv_dtype=kv_dtype, window=w) for w in (None, W))
    rng = np.random.default_rng(2)
    for T, n in [(10, [10, 4]), (1, [1, 1]), (9, [3, 9]), (1, [1, 1]), (16, [16, 2]), (1, [0, 1])]:
        k, v = rng.standard_normal((2, B, Hkv, T, d))
        q = rng.standard_normal((B, 2 * Hkv, T, d))
        outs = []
        for c in (full, win):
            c.append(arrays.asarray(k, "float32"), arrays.asarray(v, "float32"), n)
            outs.append(arrays.to_numpy(gqakv.gqa_attention(arrays.asarray(q, "float32"), c, n,
                                                            window=W)))
        np.testing.assert_array_equal(float_bits(outs[0]), float_bits(outs[1]))
        audit(win)
    assert win.pages_released > 0


def test_prefill_chunks_then_decode_fit_a_window_pool():
    """Chunks of C tokens then decode, forked rows included, in a pool of exactly
    ``rows x window_pages(W, max_len, P, C)`` pages: never out of pages, and a row's
    peak reaches ``window_pages`` (the bound is not loose)."""
    B, Hkv, d, S, W, P, C = 3, 1, 2, 160, 13, 4, 7
    per_row = window_pages(W, S, P, C)
    cache = gqakv.PagedKVCache(B, Hkv, S, d, dtype="float64", backend="numpy", page_size=P,
                               window=W, num_pages=B * per_row)
    rng = np.random.default_rng(8)
    peak = row_peak = 0
    while cache.host_lens.max() + C <= S:
        n = [C, C, 1] if cache.host_lens[0] < 60 else [1, 1, 1]
        k, v = rng.standard_normal((2, B, Hkv, C, d))
        cache.append(k, v, n)
        peak = max(peak, cache.pages_used)
        row_peak = max([row_peak] + [int(cache.store.page_table.row_pages(b).size) for b in range(B)])
        if int(cache.host_lens[0]) == 63:  # a fork: rows 1 and 2 continue row 0
            cache.fork(0, [1, 2])
        audit(cache)
    assert peak <= B * per_row
    assert row_peak == per_row
    assert cache.pages_released > 0


def test_a_plan_made_on_a_full_layer_is_refused_on_a_windowed_one():
    """A step's plans serve every layer; a plan that reads the whole history (window=None,
    made on a full layer, or by plan_attention) is refused on a layer whose window released
    pages, before that layer is written."""
    rng = np.random.default_rng(0)
    cache = gqakv.ModelKVCache(2, 1, 1, 64, 4, dtype="float64", backend="numpy", page_size=2,
                               windows=[None, 5])

    def qkv(T):
        return rng.standard_normal((3, 1, 1, T, 4))

    with cache.step([20]) as st:
        for l, w in enumerate([None, 5]):
            q, k, v = qkv(20)
            st.attend(l, q, k, v, window=w)
    with cache.step([1]) as st:  # the window releases pages as this step opens
        for l, w in enumerate([None, 5]):
            q, k, v = qkv(1)
            st.attend(l, q, k, v, window=w)
    assert cache.store.page_tables[5].released[0] == (20 - 5 + 1) // 2
    with pytest.raises(ValueError, match=r"row 0 holds keys 16\.\.21 only.*window=None"):
        with cache.step([1]) as st:
            q, k, v = qkv(1)
            st.attend(0, q, k, v)  # a full layer, full attention: fine (plan cached)
            st.attend(1, q, k, v)  # the same plan on the windowed layer: refused
    with pytest.raises(ValueError, match=r"window=None"):
        with cache.step([1]) as st:
            plan = st.plan_attention(1, window=None)
            q, k, v = qkv(1)
            st.attend(0, q, k, v, plan=plan)
            st.attend(1, q, k, v, plan=plan)
    assert cache.host_lens.tolist() == [21]  # both steps aborted
    for table in cache.store.page_tables.values():
        assert table.audit(cache.host_lens) == []
