"""The functional paged layer (``gqakv.paged_attention`` / ``gqakv.paged_append``) over
caller-owned pools: the results of PagedKVCache, KVCache and the float64 reference for
ragged rows, a shuffled page assignment and pages two rows share; bad input raises and
changes nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest

import gqakv
from gqakv.storage.paged import pages_for

from .support.reference import reference_attention

B, HKV, G, D, P, NUM_PAGES, MAX_LEN = 3, 2, 2, 8, 4, 24, 32


def _dtype(backend):
    return "float64" if "float64" in backend.dtypes else "float32"


def _tol(dtype):
    return 1e-12 if dtype == "float64" else 3e-6


class Pools:
    """The caller's side: NaN-filled pools, a table filled from a shuffled free list."""

    def __init__(self, arrays, dtype, seed=0):
        self.arrays, self.dtype = arrays, dtype
        nan = np.full((NUM_PAGES, HKV, P, D), math.nan)
        # two host arrays: from_numpy may wrap its argument without a copy
        self.k, self.v = arrays.asarray(nan, dtype), arrays.asarray(nan.copy(), dtype)
        self.page_table = np.full((B, pages_for(MAX_LEN, P)), -1, dtype=np.int32)
        self.free = list(np.random.default_rng(seed).permutation(NUM_PAGES))
        self.lens = np.zeros(B, dtype=np.int64)

    def grow(self, n_new):
        """Give each row the pages its next n_new tokens need (fresh, shuffled)."""
        for b, n in enumerate(n_new):
            for j in range(pages_for(self.lens[b], P), pages_for(self.lens[b] + n, P)):
                self.page_table[b, j] = self.free.pop()

    def host(self):
        return self.arrays.to_numpy(self.k), self.arrays.to_numpy(self.v)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_functional_matches_caches_and_reference(backend, arrays, dtype, route_spy):
    """Ragged prefill, a shared two-page prefix (row 1 names row 0's first pages), chunks
    and decode steps with an idle row, then every variant: paged_attention equals a
    PagedKVCache and a KVCache fed the same tokens (forked where the table shares) and the
    float64 reference (bfloat16: each within the same-dtype naive rule of it); dead slots
    hold NaN, so a read past a length fails. float32 and bfloat16 are the kernels' dtypes:
    every append and attention ran what ``route()`` names and the path meant
    (tests/support/routes.py)."""
    from .support.parity import LOW_PRECISION, assert_matches_reference, low_precision_bounds
    from .support.routes import assert_product_routes

    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} has no {dtype}")
    spy = route_spy(backend)
    tol = _tol(dtype)
    rng = np.random.default_rng(1)
    pools = Pools(arrays, dtype)
    caches = [gqakv.KVCache(B, HKV, MAX_LEN, D, dtype=dtype, backend=backend),
              gqakv.PagedKVCache(B, HKV, MAX_LEN, D, dtype=dtype, backend=backend, page_size=P)]
    rows_k = [np.zeros((HKV, 0, D))] * B
    rows_v = list(rows_k)

    def step(T, n_new, share=False):
        nonlocal rows_k, rows_v
        k, v = rng.standard_normal((2, B, HKV, T, D))
        # the reference sees the stored values
        k, v = (arrays.to_numpy(arrays.asarray(x, dtype)) for x in (k, v))
        pools.grow(n_new)
        pools.lens += n_new  # lengths after the append, for paged_append and paged_attention
        kn, vn = arrays.asarray(k, dtype), arrays.asarray(v, dtype)
        assert gqakv.paged_append(pools.k, pools.v, pools.page_table, pools.lens, kn, vn, n_new,
                                  backend=backend) is None
        for c in caches:
            c.append(kn, vn, n_new)
        rows_k = [np.concatenate([rows_k[b], k[b, :, :n_new[b]]], axis=1) for b in range(B)]
        rows_v = [np.concatenate([rows_v[b], v[b, :, :n_new[b]]], axis=1) for b in range(B)]
        if share:  # row 1 takes row 0's full pages: a shared prefix, no K/V copied
            keep = pools.lens[0]
            assert keep % P == 0
            pools.page_table[1, :keep // P] = pools.page_table[0, :keep // P]
            pools.lens[1] = keep
            for c in caches:
                c.fork(0, [1])
            rows_k[1], rows_v[1] = rows_k[0], rows_v[0]
        return T

    def check(T, n_new, **variant):
        q = arrays.to_numpy(arrays.asarray(rng.standard_normal((B, HKV * G, T, D)), dtype))
        qa = arrays.asarray(q, dtype)
        want, want_lse = reference_attention(q, rows_k, rows_v, n_new, **variant)
        table = pools.page_table.copy()
        out, lse = gqakv.paged_attention(qa, pools.k, pools.v, table, pools.lens, n_new,
                                         return_lse=True, backend=backend, **variant)
        np.testing.assert_array_equal(table, pools.page_table)  # the caller's table is not touched
        o, lse = arrays.to_numpy(out), arrays.to_numpy(lse)
        bounds = None
        if dtype in LOW_PRECISION:
            bounds = low_precision_bounds(dtype, want, want_lse, q, rows_k, rows_v, n_new,
                                          variant.get("scale"),
                                          **{k: x for k, x in variant.items() if k != "scale"})
            assert_matches_reference(o, lse, want, want_lse, dtype, bounds, what=str(variant))
        else:
            np.testing.assert_allclose(o, want, atol=tol, rtol=tol)
            np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))
            fin = np.isfinite(want_lse)
            np.testing.assert_allclose(lse[fin], want_lse[fin], atol=tol, rtol=tol)
        for c in caches:
            np.testing.assert_array_equal(c.host_lens, pools.lens)
            got = arrays.to_numpy(gqakv.gqa_attention(qa, c, n_new, **variant))
            if dtype in LOW_PRECISION:  # other kernels: each within the rule of the reference
                assert_matches_reference(got, None, want, want_lse, dtype, bounds,
                                         what=f"{type(c).__name__} {variant}")
            else:
                np.testing.assert_allclose(o, got, atol=tol, rtol=tol, err_msg=type(c).__name__)

    check(step(9, [8, 0, 5], share=True), [8, 0, 5])
    check(step(6, [3, 6, 1]), [3, 6, 1])  # rows 0 and 1 grow apart past the shared pages
    for n in ([1, 1, 0], [1, 0, 1], [1, 1, 1]):
        check(step(1, n), n)
    check(step(5, [2, 5, 4]), [2, 5, 4])
    assert (pools.page_table[0, :2] == pools.page_table[1, :2]).all()
    sinks = rng.standard_normal(HKV * G).astype(np.float32).astype(np.float64)  # held as float32
    for variant in ({"window": 3}, {"softcap": 0.7}, {"sinks": sinks},
                    {"window": 5, "softcap": 2.0, "sinks": sinks}, {"scale": 0.3}):
        check(1, [1, 1, 1], **variant)
        check(4, [4, 2, 0], **variant)
    assert_product_routes(spy)


def test_padding_and_idle_rows(backend, arrays):
    """n_new 0 rows return exactly 0 (lse -inf) and rows of length 0 need no pages."""
    dtype = _dtype(backend)
    pools = Pools(arrays, dtype)
    k = arrays.asarray(np.ones((B, HKV, 2, D)), dtype)
    pools.grow([2, 0, 0])
    # backend=None: the default backend, or the first registered one holding the library
    gqakv.paged_append(pools.k, pools.v, pools.page_table, [2, 0, 0], k, k, [2, 0, 0])
    q = arrays.asarray(np.ones((B, HKV * G, 2, D)), dtype)
    out, lse = gqakv.paged_attention(q, pools.k, pools.v, pools.page_table, [2, 0, 0], [1, 0, 0],
                                     return_lse=True, backend=backend)
    o, lse = arrays.to_numpy(out), arrays.to_numpy(lse)
    np.testing.assert_array_equal(o[0, :, 0], np.ones((HKV * G, D)))
    np.testing.assert_array_equal(o[0, :, 1:], 0)
    np.testing.assert_array_equal(o[1:], 0)
    assert np.isneginf(lse[1:]).all() and np.isfinite(lse[0, :, 0]).all()


def _filled(arrays, dtype):
    """Pools whose rows hold [5, 6, 0] tokens (rows 0 and 1 share page 0's first 4)."""
    pools = Pools(arrays, dtype)
    rng = np.random.default_rng(2)
    pools.grow([4, 0, 0])
    k = arrays.asarray(rng.standard_normal((B, HKV, 4, D)), dtype)
    pools.lens[:] = [4, 0, 0]
    gqakv.paged_append(pools.k, pools.v, pools.page_table, pools.lens, k, k, [4, 0, 0],
                       backend=arrays.backend)
    pools.page_table[1, 0] = pools.page_table[0, 0]
    pools.lens[1] = 4
    pools.grow([1, 2, 0])
    k = arrays.asarray(rng.standard_normal((B, HKV, 2, D)), dtype)
    pools.lens += [1, 2, 0]
    gqakv.paged_append(pools.k, pools.v, pools.page_table, pools.lens, k, k, [1, 2, 0],
                       backend=arrays.backend)
    return pools


def test_bad_input_raises_and_changes_nothing(backend, arrays):
    dtype = _dtype(backend)
    pools = _filled(arrays, dtype)
    before = pools.host()
    table, lens = pools.page_table, pools.lens
    other = "float32" if dtype == "float64" else ("float16" if "float16" in backend.dtypes else None)

    def new(T=2, dt=dtype, heads=HKV):
        return arrays.asarray(np.ones((B, heads, T, D)), dt)

    def bad_table(b, j, value):
        t = table.copy()
        t[b, j] = value
        return t

    appends = [
        # a page id outside the pool where row 0 writes (its second page)
        (ValueError, r"page_table\[0, 1\]=24 is not a page", dict(page_table=bad_table(0, 1, 24))),
        (ValueError, r"page_table\[2, 0\]=-1 is not a page",
         dict(lens=[5, 6, 1], n_new=[0, 0, 1])),
        # the table has no entries for row 0's tokens 8..
        (ValueError, r"page_table has 2 entries per row",
         dict(page_table=table[:, :2].copy(), lens=[9, 6, 0], n_new=[4, 0, 0], k_new=new(4),
              v_new=new(4))),
        # row 0 names its first page twice: token 5 would land on token 1
        (ValueError, r"row 0 names page \d+ twice \(page_table\[0, 0\] and page_table\[0, 1\]\)",
         dict(page_table=bad_table(0, 1, table[0, 0]))),
        # lengths before the append: paged_append takes them after, as paged_attention
        (ValueError, r"n_new\[0\]=1 is more than lens\[0\]=0", dict(lens=[0, 7, 0])),
        # rows 0 and 1 would both write into page 0 (shared, partly filled)
        (ValueError, r"would be written by rows 0 and 1",
         dict(page_table=bad_table(1, 1, table[0, 1]), n_new=[1, 1, 0])),
        (ValueError, r"lens\[1\]=-1 is negative", dict(lens=[5, -1, 0])),
        (TypeError, r"page_table must have an integer dtype",
         dict(page_table=table.astype(np.float64))),
        (ValueError, r"page_table must be \[B=3", dict(page_table=table[:2].copy())),
        (ValueError, r"n_new\[0\]=3 is outside 0..T=2", dict(n_new=[3, 0, 0])),
        (ValueError, r"k_new/v_new are", dict(k_new=new(heads=1), v_new=new(heads=1))),
        (ValueError, r"k_pages \[24, 2, 4, 8\].*v_pages \[24, 2, 2, 8\]",
         dict(v_pages=arrays.asarray(np.zeros((NUM_PAGES, HKV, 2, D)), dtype))),
        (ValueError, r"k_pages must be \[num_pages, Hkv, page_size, d\]",
         dict(k_pages=pools.k[0, ...])),
    ]
    if other is not None:
        appends += [(TypeError, r"k_new has dtype", dict(k_new=new(dt=other), v_new=new(dt=other))),
                    (TypeError, r"v_pages .*one dtype for both",
                     dict(v_pages=arrays.asarray(np.zeros((NUM_PAGES, HKV, P, D)), other)))]
    for error, match, changes in appends:
        args = dict(k_pages=pools.k, v_pages=pools.v, page_table=table, lens=lens + [1, 1, 0],
                    k_new=new(), v_new=new(), n_new=[1, 1, 0])
        args.update(changes)
        with pytest.raises(error, match=match):
            gqakv.paged_append(backend=backend, **args)
        for x, y in zip(before, pools.host()):
            np.testing.assert_array_equal(x, y, err_msg=match)
    np.testing.assert_array_equal(lens, [5, 6, 0])

    q = arrays.asarray(np.ones((B, HKV * G, 1, D)), dtype)
    attends = [
        (ValueError, r"page_table\[1, 1\]=-1 is not a page",
         dict(page_table=bad_table(1, 1, -1))),
        (ValueError, r"page_table has 1 entries per row", dict(page_table=table[:, :1].copy())),
        (ValueError, r"row 1 names page \d+ twice", dict(page_table=bad_table(1, 1, table[1, 0]))),
        (ValueError, r"n_new\[2\]=1 but row 2 holds only 0", dict(n_new=[1, 1, 1])),
        (ValueError, r"query heads Hq=3", dict(q=arrays.asarray(np.ones((B, 3, 1, D)), dtype))),
        (ValueError, r"page_table must be \[B=3", dict(page_table=table[:2].copy())),
        (TypeError, r"return_lse must be a bool", dict(return_lse=1)),
    ]
    if other is not None:
        attends.append((TypeError, r"q has dtype",
                        dict(q=arrays.asarray(np.ones((B, HKV * G, 1, D)), other))))
    for error, match, changes in attends:
        args = dict(q=q, k_pages=pools.k, v_pages=pools.v, page_table=table, lens=lens,
                    n_new=[1, 1, 0])
        args.update(changes)
        with pytest.raises(error, match=match):
            gqakv.paged_attention(backend=backend, **args)
    # the valid call still runs on the untouched pools
    gqakv.paged_attention(q, pools.k, pools.v, table, lens, [1, 1, 0], backend=backend)


# -- sizing a quantized paged cache -------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_paged_sizing_counts_the_scales(kv_dtype, capsys):
    """paged_cache_bytes with a kv_dtype: each page slot holds its token's codes and two
    float32 scales per KV head and layer; the allocated quantized PagedKVCache agrees."""
    from gqakv.tools import cli
    from gqakv.storage import sizing

    lens, P = [100, 100_000], 16
    p = sizing.paged_cache_bytes("llama-3.1-8b", lens, max_len=131_072, page_size=P,
                                 kv_dtype=kv_dtype)
    per = 2 * 32 * 8 * (128 * 1 + 4)  # codes plus a float32 scale, K and V, every layer
    slots = (pages_for(100, P) + pages_for(100_000, P)) * P
    assert (p.pool_bytes, p.live_bytes, p.contiguous_bytes) == (
        slots * per, sum(lens) * per, 2 * 131_072 * per)
    plain = sizing.paged_cache_bytes("llama-3.1-8b", lens, max_len=131_072, page_size=P)
    assert p.metadata_bytes == plain.metadata_bytes and p.pages == plain.pages
    cache = gqakv.PagedKVCache(2, 8, 131_072, 128, dtype="bfloat16", backend="numpy",
                               page_size=P, num_pages=p.pages, kv_dtype=kv_dtype)
    assert cache.nbytes * 32 == p.pool_bytes
    assert cli.main(["size", "llama-3.1-8b", "--max-len", "131072", "--rows", "100,100000",
                     "--kv-dtype", kv_dtype]) == 0
    out = capsys.readouterr().out
    assert f"K/V codes + scales {slots * per:,} bytes" in out
    assert f"2 rows x max_len 131,072 = {2 * 131_072 * per:,} bytes" in out
