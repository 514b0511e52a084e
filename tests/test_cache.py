"""KVCache: in-place appends, validation before any write, views not copies, bounded memory."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

import gqakv
from gqakv.storage import sizing

from .support.direct import assert_unchanged, snapshot


@pytest.fixture
def cache_and_data(backend, arrays):
    """A 3-row cache, Hkv=2, max_len=6, d=4, holding [2, 5, 0] tokens; tail filled with 0."""
    cache = gqakv.KVCache(3, 2, 6, 4, backend=backend)
    cache.store.fill(0.0)
    rng = np.random.default_rng(0)
    k = arrays.asarray(rng.standard_normal((3, 2, 5, 4)), "float32")
    cache.append(k, k, [2, 5, 0])
    return cache, rng


def _new(arrays, shape, dtype="float32", rng=None):
    rng = rng or np.random.default_rng(1)
    return arrays.asarray(rng.standard_normal(shape), dtype)


BAD_APPENDS = {
    # name: (k shape, v shape, n_new, rows, expected error, words the message must contain)
    "k_ndim": ((3, 8), (3, 8), [1, 1, 1], None, ValueError, ["k_new", "2 dims"]),
    # packed [N, Hkv, d]: n_new must add up to N
    "packed_count": ((4, 2, 4), (4, 2, 4), [1, 1, 1], None, ValueError,
                     ["packed with 4 tokens", "adds up to 3"]),
    "packed_negative": ((1, 2, 4), (1, 2, 4), [2, -1, 0], None, ValueError, ["n_new[1]=-1"]),
    "packed_capacity": ((3, 2, 4), (3, 2, 4), [0, 3, 0], None, ValueError, ["max_len"]),
    "k_v_shapes_differ": ((3, 2, 2, 4), (3, 2, 3, 4), [1, 1, 1], None, ValueError, ["differ"]),
    "kv_heads": ((3, 3, 2, 4), (3, 3, 2, 4), [1, 1, 1], None, ValueError, ["Hkv=3", "Hkv=2"]),
    "head_dim": ((3, 2, 2, 5), (3, 2, 2, 5), [1, 1, 1], None, ValueError, ["d=5", "d=4"]),
    "batch": ((2, 2, 2, 4), (2, 2, 2, 4), [1, 1], None, ValueError, ["batch size 2", "3 rows"]),
    "n_new_shape": ((3, 2, 2, 4), (3, 2, 2, 4), [1, 1], None, ValueError, ["n_new", "[3]"]),
    "n_new_float": ((3, 2, 2, 4), (3, 2, 2, 4), [1.0, 1.0, 1.0], None, TypeError, ["integer"]),
    "n_new_negative": ((3, 2, 2, 4), (3, 2, 2, 4), [1, -1, 1], None, ValueError, ["n_new[1]=-1"]),
    "n_new_over_T": ((3, 2, 2, 4), (3, 2, 2, 4), [1, 1, 3], None, ValueError, ["n_new[2]=3", "T=2"]),
    # row 0 fits; row 1 (holding 5 of 6) overflows: row 0 must not be written either
    "overflow": ((3, 2, 2, 4), (3, 2, 2, 4), [2, 2, 0], None, ValueError,
                 ["row 1", "holds 5", "7 > max_len=6"]),
    "rows_out_of_range": ((2, 2, 1, 4), (2, 2, 1, 4), [1, 1], [0, 3], ValueError, ["rows[1]=3"]),
    "rows_repeat": ((2, 2, 1, 4), (2, 2, 1, 4), [1, 1], [2, 2], ValueError, ["row 2 repeats"]),
}


@pytest.mark.parametrize("case", list(BAD_APPENDS))
def test_bad_append_raises_and_changes_nothing(arrays, cache_and_data, case):
    cache, rng = cache_and_data
    kshape, vshape, n_new, rows, error, words = BAD_APPENDS[case]
    before = snapshot(cache, arrays)
    with pytest.raises(error) as info:
        cache.append(_new(arrays, kshape, rng=rng), _new(arrays, vshape, rng=rng), n_new, rows=rows)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert_unchanged(cache, arrays, before)


def test_wrong_dtype_and_library_rejected(backend, arrays, cache_and_data):
    cache, _ = cache_and_data
    before = snapshot(cache, arrays)
    with pytest.raises(TypeError, match="dtype float64, the cache holds float32"):
        x = _new(arrays, (3, 2, 1, 4), "float64")
        cache.append(x, x, [1, 1, 1])
    if backend.array_library != "numpy":
        with pytest.raises(TypeError, match="holds"):
            x = np.zeros((3, 2, 1, 4), np.float32)
            cache.append(x, x, [1, 1, 1])
    else:
        import array_api_strict as xs

        x = xs.zeros((3, 2, 1, 4), dtype=xs.float32)
        with pytest.raises(TypeError, match="numpy arrays"):
            cache.append(x, x, [1, 1, 1])
    assert_unchanged(cache, arrays, before)


def test_append_writes_in_place_at_each_rows_length(backend, arrays):
    cache = gqakv.KVCache(2, 1, 10, 2, dtype="float64", backend=backend)
    k_buf, v_buf = cache.k, cache.v
    ptr = k_buf.__array_interface__["data"][0] if isinstance(k_buf, np.ndarray) else None
    want = [[], []]
    rng = np.random.default_rng(2)
    for step in range(12):
        n_new = [int(rng.integers(0, 2)), int(rng.integers(0, 2))]
        if any(len(want[b]) + n_new[b] > 10 for b in range(2)):
            break
        k = rng.standard_normal((2, 1, 2, 2))
        cache.append(arrays.asarray(k, "float64"), arrays.asarray(-k, "float64"), n_new)
        for b in range(2):
            want[b].extend(k[b, 0, : n_new[b]])
    assert cache.k is k_buf and cache.v is v_buf  # never reallocated
    if ptr is not None:
        assert cache.k.__array_interface__["data"][0] == ptr
    np.testing.assert_array_equal(cache.host_lens, [len(w) for w in want])
    np.testing.assert_array_equal(arrays.to_numpy(cache.lens), [len(w) for w in want])
    for b in range(2):
        live_k, live_v = cache.live_kv(b)
        np.testing.assert_array_equal(arrays.to_numpy(live_k)[0], np.reshape(want[b], (-1, 2)))
        np.testing.assert_array_equal(arrays.to_numpy(live_v)[0], -np.reshape(want[b], (-1, 2)))


def test_padding_slots_are_not_written(backend, arrays):
    cache = gqakv.KVCache(1, 1, 4, 2, backend=backend)
    cache.store.fill(7.0)
    cache.append(_new(arrays, (1, 1, 3, 2)), _new(arrays, (1, 1, 3, 2)), [1])
    assert (arrays.to_numpy(cache.k)[0, 0, 1:] == 7.0).all()


def test_rows_indirection_append(backend, arrays):
    cache = gqakv.KVCache(4, 1, 4, 2, dtype="float64", backend=backend)
    k = np.arange(2 * 1 * 1 * 2, dtype=float).reshape(2, 1, 1, 2) + 1
    cache.append(arrays.asarray(k, "float64"), arrays.asarray(k, "float64"), [1, 1], rows=[3, 1])
    np.testing.assert_array_equal(cache.host_lens, [0, 1, 0, 1])
    np.testing.assert_array_equal(arrays.to_numpy(cache.k)[3, 0, 0], k[0, 0, 0])
    np.testing.assert_array_equal(arrays.to_numpy(cache.k)[1, 0, 0], k[1, 0, 0])


def test_lens_are_read_only(backend):
    cache = gqakv.KVCache(2, 1, 4, 2, backend=backend)
    with pytest.raises(ValueError):
        cache.host_lens[0] = 3
    assert list(cache.host_lens) == [0, 0]


BAD_ATTENTION = {
    "q_ndim": ((3, 16), [1, 1, 0], ValueError, ["q must be", "2 dims"]),
    # packed [N, Hq, d]: n_new must add up to N, and still fit the rows' lengths
    "packed_count": ((3, 4, 4), [1, 1, 0], ValueError, ["q is packed with 3 tokens", "adds up to 2"]),
    "packed_over_lens": ((3, 4, 4), [3, 0, 0], ValueError, ["n_new[0]=3", "holds only 2"]),
    "packed_head_dim": ((2, 4, 5), [1, 1, 0], ValueError, ["d=5", "d=4"]),
    "head_dim": ((3, 4, 1, 5), [1, 1, 0], ValueError, ["d=5", "d=4"]),
    "hq_not_multiple": ((3, 3, 1, 4), [1, 1, 0], ValueError, ["Hq=3", "Hkv=2"]),
    "n_new_over_lens": ((3, 4, 3, 4), [3, 1, 0], ValueError, ["n_new[0]=3", "holds only 2"]),
    "n_new_over_T": ((3, 4, 1, 4), [1, 2, 0], ValueError, ["n_new[1]=2", "T=1"]),
    "n_new_shape": ((3, 4, 1, 4), [1, 1], ValueError, ["n_new", "[3]"]),
}


@pytest.mark.parametrize("case", list(BAD_ATTENTION))
def test_bad_attention_inputs(arrays, cache_and_data, case):
    cache, rng = cache_and_data
    shape, n_new, error, words = BAD_ATTENTION[case]
    with pytest.raises(error) as info:
        gqakv.gqa_attention(_new(arrays, shape, rng=rng), cache, n_new)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_bad_scale_and_dtype(arrays, cache_and_data):
    cache, rng = cache_and_data
    q = _new(arrays, (3, 4, 1, 4), rng=rng)
    for bad in (math.nan, math.inf, True, "0.5", [0.5]):
        with pytest.raises(TypeError, match="scale"):
            gqakv.gqa_attention(q, cache, [1, 1, 0], scale=bad)
    # NumPy scalars are real numbers too; the output keeps q's dtype
    for ok in (np.float32(0.5), np.float64(0.5), 1):
        assert gqakv.gqa_attention(q, cache, [1, 1, 0], scale=ok).dtype == q.dtype
    with pytest.raises(TypeError, match="dtype float64"):
        gqakv.gqa_attention(_new(arrays, (3, 4, 1, 4), "float64"), cache, [1, 1, 0])


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(batch=-1), ValueError, ["batch", ">= 0"]),
    (dict(kv_heads=0), ValueError, ["kv_heads", ">= 1"]),
    (dict(head_dim=2.5), TypeError, ["head_dim", "int"]),
    (dict(dtype="int8"), TypeError, ["int8", "supported"]),
    (dict(backend="no-such-backend"), gqakv.BackendError, ["unknown backend", "numpy"]),
])
def test_bad_construction(kwargs, error, words):
    args = dict(batch=1, kv_heads=1, max_len=4, head_dim=4) | kwargs
    with pytest.raises(error) as info:
        gqakv.KVCache(**args)
    for w in words:
        assert w in str(info.value)


def test_size_is_known_before_allocating_and_failure_names_it():
    n = gqakv.KVCache.nbytes_for(4, 8, 4096, 128, "bfloat16")
    assert n == 2 * 4 * 8 * 4096 * 128 * 2
    assert gqakv.KVCache(2, 2, 8, 4, dtype="float16").nbytes == 2 * 2 * 2 * 8 * 4 * 2
    huge = gqakv.KVCache.nbytes_for(1 << 20, 1024, 1 << 20, 1024, "float32")
    with pytest.raises(MemoryError) as info:
        gqakv.KVCache(1 << 20, 1024, 1 << 20, 1024, backend="numpy")
    assert f"{huge:,} bytes" in str(info.value)


def test_attention_reads_views_of_live_length(backend, arrays, monkeypatch):
    """K/V handed to the computation are views of the buffers sliced to lens, never Hq-repeated."""
    cache = gqakv.KVCache(2, 2, 1000, 4, backend=backend)
    k = _new(arrays, (2, 2, 7, 4))
    cache.append(k, k, [7, 3])
    seen = []
    real = gqakv.storage.store.KVStore.blocks

    def spy(store, row, j0, j1):
        # The generic path reads the cache only through the store's blocks. Any library's
        # array, seen through DLPack (zero-copy on the CPU): the blocks handed to the
        # computation must lie inside the cache's buffer, at the row's own bytes.
        k_row, v_row = real(store, row, j0, j1)
        for blk, buf in ((k_row, cache.k), (v_row, cache.v)):
            host_row, host_buf = _host_view(blk), _host_view(buf)
            assert np.shares_memory(host_row, host_buf)
            seen.append(tuple(host_row.shape))
        return k_row, v_row

    monkeypatch.setattr(gqakv.storage.store.KVStore, "blocks", spy)
    if type(backend).attention is not gqakv.Backend.attention:
        pytest.skip(f"{backend.name} runs its own attention kernels")
    gqakv.gqa_attention(_new(arrays, (2, 8, 2, 4)), cache, [2, 1])
    assert seen == [(2, 7, 4), (2, 7, 4), (2, 3, 4), (2, 3, 4)]


def _host_view(x) -> np.ndarray:
    """A NumPy view of a CPU array of any library, sharing its memory (never a copy)."""
    if isinstance(x, np.ndarray):
        return x
    inner = getattr(x, "_array", None)  # array-api-strict wraps a NumPy array
    if isinstance(inner, np.ndarray):
        return inner
    return np.from_dlpack(x)


def _numpy_attention_bytes(lens, n_new, Hkv: int, G: int, d: int, workers: int) -> int:
    """The bytes the NumPy backend's float32 attention holds at once for one call, from its
    blocking (backends/numpy_attention.py): the output [B, Hq, T, d]; for each worker
    running at once, one item's scaled queries, its block of scores (a thin tile's k-major
    scores made contiguous: twice), the block's mask and its negation (bool), the block's
    P @ V and the running output with its max and sum; and the state (o, m, l) of every key
    piece until the pieces are merged. Nothing in it grows with the cache's capacity, and
    it holds no copy of K or V."""
    from gqakv_backends import numpy_attention as na

    items, total = na._plan(np.asarray(lens), np.asarray(n_new), Hkv, G, workers,
                            na.QUERY_BLOCK, na.MIN_KEY_SPLIT, max_tile_rows=na.MAX_TILE_ROWS)
    Hq, T = Hkv * G, max(n_new)
    out = len(lens) * Hq * T * d * 4
    per_item, pieces = [], 0
    for i, h0, h1, t0, t1, j0, j1, _ in items:
        rows, nq = (h1 - h0) * G * (t1 - t0), t1 - t0
        keys = min(j1 - j0, max(16, na.SCORE_BLOCK_ELEMENTS // rows))  # one key block
        scores = rows * keys * 4 * (2 if rows <= na.THIN_QUERIES else 1)
        per_item.append(scores + 2 * nq * keys + 3 * rows * d * 4 + 4 * rows * 4)
        if (j0, j1) != (0, int(lens[i])):  # a key piece: its state waits for the merge
            pieces += rows * (d + 2) * 4
    at_once = 1 if total < na.PARALLEL_MIN_WORK or len(items) == 1 else workers
    return out + sum(sorted(per_item)[-at_once:]) + pieces


def test_memory_follows_live_length_and_is_bounded(monkeypatch):
    """NumPy: a decode step and a 256-token chunk over a 20,000-token row hold no more
    than the attention's own temporaries (``_numpy_attention_bytes``) plus a 10% and
    64 KiB margin (Python's own objects: items, states, futures): no copy of the live K
    or V (each larger than that bound), no float64 promotion, the chunk's scores never
    whole."""
    monkeypatch.setenv("GQAKV_NUM_THREADS", "2")  # the bound follows the worker count
    Hkv, G, d, L = 2, 4, 64, 20_000
    cache = gqakv.KVCache(1, Hkv, 4 * L, d, backend="numpy")  # capacity 4x the live length
    rng = np.random.default_rng(3)
    T = 256
    for start in range(0, L, T):
        kv = rng.standard_normal((1, Hkv, T, d), dtype=np.float32)
        cache.append(kv, kv, [min(T, L - start)])
    live_bytes = Hkv * L * d * 4  # the live K (the live V as much)
    for n in (1, T):
        q = rng.standard_normal((1, Hkv * G, n, d), dtype=np.float32)
        bound = int(1.1 * _numpy_attention_bytes([L], [n], Hkv, G, d, workers=2)) + 64 * 1024
        assert bound < live_bytes, (bound, live_bytes)  # so one copy of K cannot fit in it
        gqakv.gqa_attention(q, cache, [n])  # once untraced: the first call imports threadpoolctl
        tracemalloc.start()
        gqakv.gqa_attention(q, cache, [n], scale=np.float64(0.125))  # a float64 scale: no promotion
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak <= bound, (n, peak, bound, live_bytes)


def test_live_kv_rejects_rows_outside_the_cache(backend):
    cache = gqakv.KVCache(2, 1, 4, 2, backend=backend)
    for bad in (-1, 2, 1.0, True):
        with pytest.raises(ValueError, match="not a row of this cache"):
            cache.live_kv(bad)


# -- integers: Python ints checked before any arithmetic, no bools, errors name the argument --

BIG = 2**63 - 1


def _int_env():
    """A KVCache and a ModelKVCache (numpy, float64, 2 rows, max_len 8, d 4) holding [4, 2]
    tokens each, their tails NaN (so a stray write shows), plus matching inputs."""
    rng = np.random.default_rng(3)
    cache = gqakv.KVCache(2, 1, 8, 4, dtype="float64", backend="numpy")
    model = gqakv.ModelKVCache(2, 2, 1, 8, 4, dtype="float64", backend="numpy")
    for c in (cache, model):
        c.store.fill(np.nan)
    kv = rng.standard_normal((2, 1, 4, 4))
    cache.append(kv, kv, [4, 2])
    with model.step([4, 2]) as s:
        for l in range(2):
            s.write(l, kv, kv)
    return dict(cache=cache, model=model, kv=rng.standard_normal((2, 1, 2, 4)),
                q=rng.standard_normal((2, 2, 2, 4)))


def _attend(e, **kw):
    """A bad Step.attend inside a step (the with block aborts it on the error)."""
    args = dict(layer=0, q=e["q"], k_new=e["kv"], v_new=e["kv"]) | kw
    with e["model"].step([1, 1]) as s:
        s.attend(args.pop("layer"), args.pop("q"), args.pop("k_new"), args.pop("v_new"), **args)


# name: (call, exception, words the message must contain: the argument and the value)
BAD_INTS = {
    "step_n_new_huge": (lambda e: e["model"].step([BIG, 0]), ValueError,
                        [f"n_new[0]={BIG}", "holds 4 tokens", "max_len=8"]),
    "step_n_new_past_int64": (lambda e: e["model"].step([2**64, 0]), ValueError,
                              [f"n_new[0]={2**64}", "int64"]),
    "step_n_new_negative": (lambda e: e["model"].step([-1, 0]), ValueError, ["n_new[0]=-1", "negative"]),
    "step_n_new_int_and_bool": (lambda e: e["model"].step([1, True]), TypeError, ["n_new[1]=True", "bool"]),
    "step_n_new_bools": (lambda e: e["model"].step([True, False]), TypeError, ["n_new[0]=True", "bool"]),
    "step_n_new_numpy_bool": (lambda e: e["model"].step([1, np.True_]), TypeError, ["n_new[1]=", "bool"]),
    "step_n_new_bool_array": (lambda e: e["model"].step(np.array([True, False])), TypeError,
                              ["n_new", "bool"]),
    "step_n_new_bool_scalar": (lambda e: e["model"].step(True), TypeError, ["n_new", "True"]),
    "step_rows_bool": (lambda e: e["model"].step([1], rows=[True]), TypeError, ["rows[0]=True", "bool"]),
    "append_n_new_int_and_bool": (lambda e: e["cache"].append(e["kv"], e["kv"], [1, True]), TypeError,
                                  ["n_new[1]=True", "bool"]),
    "append_n_new_huge": (lambda e: e["cache"].append(e["kv"], e["kv"], [BIG, 0]), ValueError,
                          [f"n_new[0]={BIG}", "T=2"]),
    "append_n_new_past_int64": (lambda e: e["cache"].append(e["kv"], e["kv"], [-1, 2**70]), ValueError,
                                [f"n_new[1]={2**70}"]),
    "append_rows_bool": (lambda e: e["cache"].append(e["kv"], e["kv"], [1, 1], rows=[1, False]),
                         TypeError, ["rows[1]=False", "bool"]),
    "append_rows_vs_batch": (lambda e: e["cache"].append(e["kv"][:1], e["kv"][:1], [1], rows=[0, 1]),
                             ValueError, ["rows has 2 entries", "k_new has batch 1"]),
    "attention_return_lse_int": (lambda e: gqakv.gqa_attention(e["q"], e["cache"], [2, 2], return_lse=1),
                                 TypeError, ["return_lse", "1"]),
    "attention_return_lse_str": (lambda e: gqakv.gqa_attention(e["q"], e["cache"], [2, 2],
                                                               return_lse="no"),
                                 TypeError, ["return_lse", "'no'"]),
    "attention_scale_huge_int": (lambda e: gqakv.gqa_attention(e["q"], e["cache"], [2, 2], scale=10**400),
                                 TypeError, ["scale", "1000000"]),
    "attention_n_new_bool": (lambda e: gqakv.gqa_attention(e["q"], e["cache"], [2, True]), TypeError,
                             ["n_new[1]=True"]),
    "attention_q_batch_vs_rows": (lambda e: gqakv.gqa_attention(e["q"], e["cache"], [1, 1, 1],
                                                                rows=[0, 1, 1]),
                                  ValueError, ["rows has 3 entries", "q has batch 2"]),
    "attend_return_lse_int": (lambda e: _attend(e, return_lse=1), TypeError, ["return_lse", "1"]),
    "attend_return_lse_none": (lambda e: _attend(e, return_lse=None), TypeError, ["return_lse", "None"]),
    "attend_q_batch": (lambda e: _attend(e, q=np.ones((3, 2, 2, 4))), ValueError,
                       ["q [3, 2, 2, 4]", "batch B'=2"]),
    "attend_k_new_batch": (lambda e: _attend(e, k_new=np.ones((3, 1, 2, 4))), ValueError,
                           ["k_new has batch 3", "2 entries"]),
    "attend_layer_bool": (lambda e: _attend(e, layer=True), TypeError, ["layer", "True"]),
    "fork_src_bool": (lambda e: e["cache"].fork(True, [1]), TypeError, ["src", "True"]),
    "fork_src_huge": (lambda e: e["model"].fork(2**64, [1]), ValueError, [f"src={2**64}"]),
    "fork_dst_bool": (lambda e: e["model"].fork(0, [1, True]), TypeError, ["dst_rows[1]=True"]),
    "reorder_bool": (lambda e: e["cache"].reorder([0, True]), TypeError, ["src_rows[1]=True"]),
    "reorder_past_int64": (lambda e: e["model"].reorder([0, 2**64]), ValueError, [f"src_rows[1]={2**64}"]),
    "truncate_new_len_bool": (lambda e: e["cache"].truncate([0], [True]), TypeError, ["new_lens[0]=True"]),
    "truncate_new_len_huge": (lambda e: e["model"].truncate([0], [2**64]), ValueError,
                              [f"new_lens[0]={2**64}"]),
    "truncate_new_len_negative": (lambda e: e["cache"].truncate([0], [-1]), ValueError,
                                  ["new_lens[0]=-1", "0..4"]),
    "truncate_rows_bool": (lambda e: e["model"].truncate([False], [1]), TypeError, ["rows[0]=False"]),
    "reset_rows_bool": (lambda e: e["cache"].reset([1, True]), TypeError, ["rows[1]=True"]),
    "live_kv_bool": (lambda e: e["cache"].live_kv(True), ValueError, ["row=True"]),
    "layer_bool": (lambda e: e["model"].layer(False), TypeError, ["layer", "False"]),
    "nbytes_for_negative": (lambda e: gqakv.KVCache.nbytes_for(-1, 8, 4096, 128), ValueError,
                            ["batch", "-1"]),
    "nbytes_for_bool": (lambda e: gqakv.KVCache.nbytes_for(2, True, 4096, 128), TypeError,
                        ["kv_heads", "True"]),
    "nbytes_for_float": (lambda e: gqakv.KVCache.nbytes_for(2, 8, 4096.0, 128), TypeError,
                         ["max_len", "4096.0"]),
    "model_nbytes_for_layers": (lambda e: gqakv.ModelKVCache.nbytes_for(0, 1, 8, 16, 128), ValueError,
                                ["layers", "0"]),
    "model_nbytes_for_head_dim": (lambda e: gqakv.ModelKVCache.nbytes_for(2, 1, 8, 16, np.int64(-3)),
                                  ValueError, ["head_dim", "-3"]),
    "sizing_max_len_bool": (lambda e: sizing.cache_bytes("gpt2", max_len=True), TypeError,
                            ["max_len", "True"]),
    "sizing_batch_negative": (lambda e: sizing.cache_bytes("gpt2", max_len=8, batch=-2),
                              ValueError, ["batch", "-2"]),
    "sizing_budget_overflow": (lambda e: sizing.max_batch("gpt2", max_len=8, budget="1e400"),
                               ValueError, ["1e400"]),
    "sizing_budget_negative": (lambda e: sizing.max_len_for("gpt2", batch=1, budget=-5),
                               ValueError, ["budget", "-5"]),
    "alloc_beyond_64_bits": (lambda e: gqakv.KVCache(2**40, 2**20, 2**20, 2**10, backend="numpy"),
                             MemoryError, [f"{2 * 2**90 * 4:,} bytes", "64-bit"]),
    "model_alloc_beyond_64_bits": (lambda e: gqakv.ModelKVCache(2**20, 2**20, 2**20, 2**20, 2**4),
                                   MemoryError, [f"{2 * 2**84 * 4:,} bytes"]),
}


@pytest.mark.parametrize("case", list(BAD_INTS))
def test_bad_integers_are_named_and_change_nothing(case):
    call, error, words = BAD_INTS[case]
    e = _int_env()
    before = {name: (c.k.copy(), c.v.copy(), c.host_lens.copy()) for name, c in
              (("cache", e["cache"]), ("model", e["model"]))}
    with pytest.raises(error) as info:
        call(e)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    for name, c in (("cache", e["cache"]), ("model", e["model"])):
        k, v, lens = before[name]
        assert c.host_lens.tolist() == lens.tolist() == ([4, 2] if name == "cache" else [4, 2])
        assert c.k.tobytes() == k.tobytes() and c.v.tobytes() == v.tobytes(), f"{name} buffers changed"
    assert e["model"]._open_step is None
    e["model"].step([1, 1]).abort()  # the refused call left no step open


def test_sizes_are_exact_python_ints():
    """nbytes_for takes NumPy ints too and never wraps (int64 would give 0 or a negative)."""
    args = (np.int64(2**40), 2**20, np.int64(2**20), np.int32(2**10))
    n = gqakv.KVCache.nbytes_for(*args, "float32")
    assert type(n) is int and n == 2 * 2**90 * 4
    m = gqakv.ModelKVCache.nbytes_for(np.int64(80), *args, "bfloat16")
    assert type(m) is int and m == 80 * 2 * 2**90 * 2
    assert sizing.cache_bytes("gpt2", max_len=np.int64(2**62), batch=np.int64(2**10)) == \
        2**72 * sizing.get_preset("gpt2").bytes_per_token("bfloat16")
    assert sizing.parse_bytes(np.int64(5)) == 5


def test_return_lse_accepts_bools_only(backend, arrays, cache_and_data):
    cache, rng = cache_and_data
    q = _new(arrays, (3, 4, 1, 4), rng=rng)
    assert isinstance(gqakv.gqa_attention(q, cache, [1, 1, 0], return_lse=np.True_), tuple)
    assert not isinstance(gqakv.gqa_attention(q, cache, [1, 1, 0], return_lse=False), tuple)


@pytest.mark.parametrize("key, value", [("num_hidden_layers", True), ("num_attention_heads", 32.5),
                                        ("num_key_value_heads", 0), ("head_dim", "64"),
                                        ("max_position_embeddings", -1)])
def test_config_integers_are_checked(key, value):
    config = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "hidden_size": 4096, "max_position_embeddings": 8192} | {key: value}
    with pytest.raises(ValueError) as info:
        sizing.config_from_hf(config)
    assert f"{key}={value!r}" in str(info.value)


def test_lens_is_a_snapshot_that_cannot_write_the_cache(backend, arrays):
    """``cache.lens`` on torch/array_api_strict used to alias the host lengths and be
    writable: ``cache.lens[0] = 7`` silently set row 0's length past its data, and an
    old ``lens`` object changed under its holder after the next append."""
    cache = gqakv.KVCache(2, 1, 8, 4, backend=backend)
    kv = arrays.asarray(np.ones((2, 1, 3, 4), np.float32))
    cache.append(kv, kv, [2, 3])
    lens = cache.lens
    try:
        lens[0] = 7
    except (ValueError, TypeError, RuntimeError):
        pass  # a read-only array is fine too
    np.testing.assert_array_equal(cache.host_lens, [2, 3])
    cache.reset()
    cache.append(kv, kv, [1, 1])
    np.testing.assert_array_equal(cache.host_lens, [1, 1])
    np.testing.assert_array_equal(arrays.to_numpy(cache.lens, np.int64), [1, 1])
    if int(arrays.to_numpy(lens, np.int64)[0]) != 7:  # a read-only array refused the write
        np.testing.assert_array_equal(arrays.to_numpy(lens, np.int64), [2, 3])


def test_huge_unsigned_n_new_is_reported_as_given(backend, arrays):
    """A uint64 n_new above the int64 range was reported as a negative number."""
    cache = gqakv.KVCache(2, 1, 8, 4, backend=backend)
    kv = arrays.asarray(np.ones((2, 1, 3, 4), np.float32))
    before = snapshot(cache, arrays)
    with pytest.raises(ValueError, match="9223372036854775809"):
        cache.append(kv, kv, np.array([2**63 + 1, 0], dtype=np.uint64))
    assert_unchanged(cache, arrays, before)


@pytest.mark.parametrize("n_new", [[2**70, 0], [0, -(2**64)]])
def test_python_ints_beyond_int64_are_reported_as_given(backend, arrays, n_new):
    """Python ints NumPy cannot hold were refused as 'integer dtype, got object'."""
    cache = gqakv.KVCache(2, 1, 8, 4, backend=backend)
    kv = arrays.asarray(np.ones((2, 1, 3, 4), np.float32))
    before = snapshot(cache, arrays)
    i = 0 if n_new[0] else 1
    with pytest.raises(ValueError, match=rf"n_new\[{i}\]={n_new[i]} is out of range"):
        cache.append(kv, kv, n_new)
    assert_unchanged(cache, arrays, before)
