"""The prefix cache: full pages found again by the tokens they hold.

The direct model here is a function, not a cache: the K/V of position p of a sequence is
drawn from a generator seeded by the tokens ``0..p`` (and the layer), as a real model's
K/V depends on the whole prefix. So a matched page is right exactly when it holds what
the new prompt would have produced, and every row of the cache must equal the direct
K/V of its tokens after every operation, with the page audit exact (``support.pages``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import gqakv
from gqakv.storage.prefix_index import PrefixIndex, chain_keys

from .support.pages import audit
from .support.reference import reference_attention

HKV, D, G = 2, 8, 2


def direct_kv(tokens, layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """K, V ``[Hkv, len(tokens), d]`` float64 of a sequence: position p from its prefix."""
    k = np.empty((HKV, len(tokens), D))
    v = np.empty((HKV, len(tokens), D))
    for p in range(len(tokens)):
        seed = hash((layer, tuple(int(t) for t in tokens[:p + 1]))) % 2**63
        kv = np.random.default_rng(seed).standard_normal((2, HKV, D))
        k[:, p], v[:, p] = kv
    return k, v


def batch_of(kvs):
    """[B, Hkv, T, d] padded from per-entry [Hkv, n, d] arrays, and n_new."""
    n = [x.shape[1] for x in kvs]
    out = np.zeros((len(kvs), HKV, max(n, default=0), D))
    for i, x in enumerate(kvs):
        out[i, :, :n[i]] = x
    return out, n


def assert_rows(cache, tokens, layers=(0,)):
    lens = cache.host_lens
    for b, toks in enumerate(tokens):
        assert int(lens[b]) == len(toks), f"row {b}"
        for layer in layers:
            k, v = cache.live_kv(layer, b) if hasattr(cache, "layers") else cache.live_kv(b)
            want_k, want_v = direct_kv(toks, layer)
            np.testing.assert_array_equal(np.asarray(k), want_k, err_msg=f"K row {b} layer {layer}")
            np.testing.assert_array_equal(np.asarray(v), want_v, err_msg=f"V row {b} layer {layer}")


def index_state(cache):
    t = cache.store.page_table
    ix = t.index
    return (cache.host_lens.copy(), t.entries.copy(), t.held.copy(), t.refs.copy(), list(t._free),
            dict(ix.page_of), list(ix.unused))


def append(cache, row, toks, start):
    k, v = direct_kv(toks)
    cache.append(k[None, :, start:], v[None, :, start:], [len(toks) - start], rows=[row])


def new_cache(num_pages=None, page_size=4, batch=4, max_len=48, backend="numpy", **kw):
    return gqakv.PagedKVCache(batch, HKV, max_len, D, dtype="float64", backend=backend,
                              page_size=page_size, num_pages=num_pages, prefix_cache=True, **kw)


# -- the index ------------------------------------------------------------------------------


def test_keys_chain_the_whole_prefix_and_the_salt():
    a = chain_keys(np.arange(10), 4)
    assert len(a) == 2  # full pages only
    b = chain_keys(np.r_[np.arange(4), 9, 5, 6, 7], 4)
    assert a[0] == b[0] and a[1] != b[1]
    c = chain_keys(np.r_[99, np.arange(1, 8)], 4)
    assert c[1] != a[1]  # page 1 holds the same ids, but its prefix differs
    assert chain_keys(np.arange(8), 4, "lora-1")[0] != a[0]
    assert chain_keys(np.arange(8), 4, 7) != chain_keys(np.arange(8), 4, "7")
    with pytest.raises(TypeError, match="salt"):
        chain_keys(np.arange(8), 4, 1.5)


def test_standalone_index_for_caller_owned_pools():
    """An engine that owns its pools (the functional API) drives the index itself: insert
    what a prompt filled, match a new prompt, release, evict least recently released first;
    the matched pages read through paged_attention as if the prompt had been prefilled."""
    P, num_pages = 4, 8
    ix = PrefixIndex(P, num_pages)
    prompt = list(range(11))
    k_pages = np.full((num_pages, HKV, P, D), np.nan)
    v_pages = np.full((num_pages, HKV, P, D), np.nan)
    table = np.array([[5, 2, 7]], dtype=np.int32)
    k, v = direct_kv(prompt)
    gqakv.paged_append(k_pages, v_pages, table, [11], k[None], v[None], [11])
    assert ix.insert(prompt, table[0, :2]) == 2 and ix.pages_cached == 2
    assert ix.insert(prompt, table[0, :2]) == 0  # already cached
    assert ix.release([5, 2, 7]).tolist() == [7]  # the uncached page is the caller's to free
    assert list(ix.unused) == [5, 2]
    pages = ix.match(prompt[:9] + [50, 51])
    assert pages.tolist() == [5, 2] and ix.pages_unused == 0
    # the second request: its 8 matched tokens from the cache, its own 3 appended
    second = prompt[:9] + [50, 51]
    table2 = np.array([[5, 2, 0]], dtype=np.int32)
    k2, v2 = direct_kv(second)
    gqakv.paged_append(k_pages, v_pages, table2, [11], k2[None, :, 8:], v2[None, :, 8:], [3])
    q = np.random.default_rng(0).standard_normal((1, HKV * G, 3, D))
    got = gqakv.paged_attention(q, k_pages, v_pages, table2, [11], [3])
    want, _ = reference_attention(q, [k2], [v2], [3])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert ix.release([5, 2]).size == 0
    assert ix.evict(1).tolist() == [5] and ix.match(prompt).size == 0  # page 0's key is gone
    with pytest.raises(ValueError, match="cannot evict 2 pages: 1 cached pages are unused"):
        ix.evict(2)
    assert ix.audit() == []
    with pytest.raises(ValueError, match="need 8 token ids"):
        ix.insert([1, 2, 3], [0, 1])
    with pytest.raises(ValueError, match="not a page of the pool"):
        ix.insert(range(8), [0, 8])


# -- the cache's calls ----------------------------------------------------------------------


def test_match_attaches_cached_pages_without_copies():
    cache = new_cache()
    prompt = list(range(100, 118))  # 4 full pages and 2 tokens
    append(cache, 0, prompt, 0)
    assert cache.cache_prefix(0, prompt) == 4
    audit(cache)
    before = cache.pages_used
    second = prompt[:13] + [7, 7, 7]
    assert cache.match_prefix(1, second) == 12  # pages 0..2 match, page 3 differs
    assert cache.pages_used == before  # named by reference: no page taken
    t = cache.store.page_table
    np.testing.assert_array_equal(t.row_pages(1), t.row_pages(0)[:3])
    assert t.refs[t.row_pages(0)[:3]].tolist() == [2, 2, 2]
    append(cache, 1, second, 12)
    assert_rows(cache, [prompt, second, [], []])
    audit(cache)
    # a whole cached prompt still leaves its last token to run (its logits start the answer)
    assert cache.match_prefix(2, prompt[:16]) == 12
    assert cache.match_prefix(3, prompt[:17]) == 16
    audit(cache)


def test_salt_separates_equal_ids():
    cache = new_cache()
    prompt = list(range(12))
    append(cache, 0, prompt, 0)
    cache.cache_prefix(0, prompt, salt="adapter-a")
    assert cache.match_prefix(1, prompt + [1], salt="adapter-b") == 0
    assert cache.match_prefix(2, prompt + [1]) == 0
    assert cache.match_prefix(3, prompt + [1], salt="adapter-a") == 12
    audit(cache)


def test_finished_rows_stay_matchable_until_the_pool_needs_their_pages():
    """Released cached pages go to an LRU, not the free list: a later request finds them;
    an append that finds no free page evicts the least recently released first."""
    cache = new_cache(num_pages=6, batch=3)
    a, b = list(range(8)) + [1], list(range(50, 58)) + [2]  # 2 full pages + 1 token each
    append(cache, 0, a, 0)
    cache.cache_prefix(0, a)
    append(cache, 1, b, 0)
    cache.cache_prefix(1, b)
    cache.reset([0])  # a's pages released first
    cache.reset([1])
    assert cache.pages_free == 6 and cache.pages_reusable == 4 and cache.pages_used == 0
    audit(cache)
    # 2 free pages, then the LRU: a's two pages go before b's
    append(cache, 2, list(range(200, 216)), 0)  # 4 pages
    assert cache.pages_reusable == 2  # 2 free pages taken, then a's 2 evicted; b's kept
    assert cache.match_prefix(0, a) == 0  # evicted
    assert cache.match_prefix(1, b) == 8  # still cached
    audit(cache)
    assert_rows(cache, [[], b[:8], list(range(200, 216))])


def test_out_of_pages_counts_cached_pages_and_changes_nothing():
    cache = new_cache(num_pages=4, batch=2)
    a = list(range(9))
    append(cache, 0, a, 0)
    cache.cache_prefix(0, a)
    cache.reset([0])
    assert cache.pages_free == 4 and cache.pages_reusable == 2
    before = index_state(cache)
    k, v = direct_kv(list(range(17)))
    with pytest.raises(gqakv.OutOfPages, match=r"4 of 4 pages .* are free \(2 of them cached, unused\)"):
        cache.append(k[None], v[None], [17], rows=[1])
    after = index_state(cache)
    for x, y in zip(before, after):
        assert (np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y)
    audit(cache)


def test_a_write_into_a_cached_page_copies_it_first():
    """A row truncated into a cached page and written again must not change the cached
    tokens (another request may match them later): the page is copied first, even though
    no other row names it."""
    cache = new_cache()
    prompt = list(range(16))
    append(cache, 0, prompt, 0)
    cache.cache_prefix(0, prompt)
    page = int(cache.store.page_table.row_pages(0)[3])
    cache.truncate([0], [14])
    other = prompt[:14] + [90, 91, 92]
    append(cache, 0, other, 14)
    assert int(cache.store.page_table.row_pages(0)[3]) != page
    assert_rows(cache, [other, [], [], []])
    assert cache.match_prefix(1, prompt + [3]) == 16
    assert_rows(cache, [other, prompt, [], []])
    audit(cache)


def test_bad_calls_name_the_problem_and_change_nothing():
    cache = new_cache()
    append(cache, 0, list(range(9)), 0)
    before = index_state(cache)
    with pytest.raises(ValueError, match="row 0 holds 9 tokens; match_prefix starts an empty row"):
        cache.match_prefix(0, list(range(20)))
    with pytest.raises(ValueError, match="token_ids has 12 ids, but row 0 holds 9 tokens"):
        cache.cache_prefix(0, list(range(12)))
    with pytest.raises(ValueError, match="row=4 is out of range"):
        cache.match_prefix(4, [1, 2])
    with pytest.raises(TypeError, match="integer dtype"):
        cache.match_prefix(1, np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="1-D"):
        cache.cache_prefix(0, np.zeros((2, 2), dtype=np.int64))
    after = index_state(cache)
    for x, y in zip(before, after):
        assert (np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y)
    plain = gqakv.PagedKVCache(2, HKV, 16, D, page_size=4)
    with pytest.raises(ValueError, match="no prefix cache"):
        plain.match_prefix(0, [1, 2, 3])
    with pytest.raises(ValueError, match="prefix_cache=True applies to storage='paged' only"):
        gqakv.KVCache(2, HKV, 16, D, prefix_cache=True)
    with pytest.raises(TypeError, match="prefix_cache must be a bool"):
        gqakv.PagedKVCache(2, HKV, 16, D, prefix_cache="yes")
    model = gqakv.ModelKVCache(2, 2, HKV, 16, D, storage="paged", page_size=4, prefix_cache=True)
    with model.step([1, 0]) as step:
        with pytest.raises(RuntimeError, match="match a prefix"):
            model.match_prefix(1, [1, 2, 3])
        for layer in range(2):
            step.write(layer, np.zeros((2, HKV, 1, D), np.float32), np.zeros((2, HKV, 1, D), np.float32))
    with pytest.raises(RuntimeError, match="cache a prefix"):
        model.layer(0).cache_prefix(0, [1])


# -- randomized serving sequences -----------------------------------------------------------


SYSTEM_PROMPTS = [list(range(1000, 1000 + n)) for n in (0, 9, 21, 30)]


def _serve(cache, rng, ops: int, *, model: bool):
    """Requests arrive on empty rows (a system prompt + their own tokens, matched, the
    rest prefilled), rows decode, fork, truncate and finish, with a small pool: after every
    operation each row holds the direct K/V of its tokens and the audit is exact; an
    operation the pool cannot serve changes nothing."""
    B = cache.batch
    layers = range(cache.layers) if model else (0,)
    tokens: list[list[int]] = [[] for _ in range(B)]
    salts: list = [None] * B
    hits = 0

    def write(rows, kvs_per_layer, n):
        if model:
            with cache.step(n, rows=rows) as step:
                for layer in layers:
                    k, _ = batch_of([kv[0] for kv in kvs_per_layer[layer]])
                    v, _ = batch_of([kv[1] for kv in kvs_per_layer[layer]])
                    step.write(layer, k, v)
        else:
            k, _ = batch_of([kv[0] for kv in kvs_per_layer[0]])
            v, _ = batch_of([kv[1] for kv in kvs_per_layer[0]])
            cache.append(k, v, n, rows=rows)

    def extend(rows, news):
        """Append news[i] to rows[i]; True if it fit."""
        kvs = {layer: [] for layer in layers}
        for r, new in zip(rows, news):
            full = tokens[r] + new
            for layer in layers:
                k, v = direct_kv(full, layer)
                kvs[layer].append((k[:, len(tokens[r]):], v[:, len(tokens[r]):]))
        before = index_state(cache)
        try:
            write(list(rows), kvs, [len(x) for x in news])
        except gqakv.OutOfPages:
            after = index_state(cache)
            for x, y in zip(before, after):
                assert (np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y)
            return False
        for r, new in zip(rows, news):
            tokens[r] = tokens[r] + new
        return True

    for _ in range(ops):
        op = rng.choice(["arrive", "arrive", "decode", "decode", "fork", "truncate", "finish"])
        empty = [b for b in range(B) if not tokens[b]]
        busy = [b for b in range(B) if tokens[b]]
        if op == "arrive" and empty:
            r = int(rng.choice(empty))
            system = SYSTEM_PROMPTS[int(rng.integers(len(SYSTEM_PROMPTS)))]
            prompt = system + rng.integers(0, 5, int(rng.integers(1, 9))).tolist()
            salt = [None, "b"][int(rng.integers(2))]
            m = cache.match_prefix(r, prompt, salt=salt)
            assert m % cache.page_size == 0 and m <= len(prompt) - 1
            hits += m
            tokens[r], salts[r] = prompt[:m], salt
            assert_rows(cache, tokens, layers)  # the matched pages hold this prompt's K/V
            if extend([r], [prompt[m:]]):
                cache.cache_prefix(r, prompt, salt=salt)
            else:
                cache.reset([r])
                tokens[r] = []
        elif op == "decode" and busy:
            rows = [b for b in busy if rng.random() < 0.7 and len(tokens[b]) < cache.max_len] or busy[:1]
            rows = [b for b in rows if len(tokens[b]) < cache.max_len]
            if rows and extend(rows, [[int(rng.integers(0, 5))] for _ in rows]):
                # the step's attention over matched, forked and own pages: the direct K/V's
                q = rng.standard_normal((len(rows), HKV * G, 1, D))
                view = cache.layer(len(layers) - 1) if model else cache
                got = gqakv.gqa_attention(q, view, [1] * len(rows), rows=rows)
                kvs = [direct_kv(tokens[r], len(layers) - 1) for r in rows]
                want, _ = reference_attention(q, [k for k, _ in kvs], [v for _, v in kvs], [1] * len(rows))
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        elif op == "fork" and busy and empty:
            src = int(rng.choice(busy))
            dst = [int(x) for x in rng.choice(empty, size=int(rng.integers(1, len(empty) + 1)), replace=False)]
            cache.fork(src, dst)
            for d in dst:
                tokens[d], salts[d] = list(tokens[src]), salts[src]
        elif op == "truncate" and busy:
            r = int(rng.choice(busy))
            n = int(rng.integers(0, len(tokens[r]) + 1))
            cache.truncate([r], [n])
            tokens[r] = tokens[r][:n]
        elif op == "finish" and busy:
            r = int(rng.choice(busy))
            cache.cache_prefix(r, tokens[r], salt=salts[r])
            cache.reset([r])
            tokens[r] = []
        assert_rows(cache, tokens, layers)
        audit(cache)
    return hits


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("page_size", [3, 8])
def test_randomized_serving_paged_cache(seed, page_size):
    cache = new_cache(num_pages=20, page_size=page_size, batch=5, max_len=60)
    hits = _serve(cache, np.random.default_rng(seed), 60, model=False)
    assert hits > 0  # the sequence really reused pages


@pytest.mark.parametrize("seed", range(2))
def test_randomized_serving_model_cache(seed):
    cache = gqakv.ModelKVCache(2, 4, HKV, 60, D, dtype="float64", backend="numpy", storage="paged",
                               page_size=4, num_pages=24, prefix_cache=True)
    hits = _serve(cache, np.random.default_rng(10 + seed), 50, model=True)
    assert hits > 0


def test_matched_rows_attend_like_prefilled_ones(backend, arrays):
    """A request started on matched pages attends (every backend, its paged path) as one
    that prefilled its whole prompt: the float64 reference over the direct K/V."""
    dtype = "float64" if "float64" in backend.dtypes else "float32"
    cache = gqakv.PagedKVCache(3, HKV, 48, D, dtype=dtype, backend=backend, page_size=4,
                               prefix_cache=True)
    prompt = list(range(19))
    k, v = direct_kv(prompt)
    cache.append(arrays.asarray(k[None], dtype), arrays.asarray(v[None], dtype), [19], rows=[0])
    cache.cache_prefix(0, prompt)
    second = prompt[:17] + [4, 4]
    m = cache.match_prefix(1, second)
    assert m == 16
    k2, v2 = direct_kv(second)
    n = len(second) - m
    cache.append(arrays.asarray(k2[None, :, m:], dtype), arrays.asarray(v2[None, :, m:], dtype), [n], rows=[1])
    q = np.random.default_rng(1).standard_normal((1, HKV * G, n, D))
    got = gqakv.gqa_attention(arrays.asarray(q, dtype), cache, [n], rows=[1])
    held = [arrays.to_numpy(arrays.asarray(x, dtype)).astype(np.float64) for x in (k2, v2, q)]
    want, _ = reference_attention(held[2], [held[0]], [held[1]], [n])
    tol = 1e-12 if dtype == "float64" else 2e-5
    np.testing.assert_allclose(arrays.to_numpy(got).astype(np.float64), want, rtol=tol, atol=tol)
    audit(cache)
    assert math.isfinite(float(np.abs(arrays.to_numpy(got)).max()))


def test_an_aborted_step_gives_back_a_copied_cached_page():
    """A step that copies a cached page (the row was truncated into it) and then aborts
    names the cached page again, out of the LRU, with the table, counts, free list and
    index as before."""
    cache = gqakv.ModelKVCache(2, 2, HKV, 32, D, dtype="float64", backend="numpy", storage="paged",
                               page_size=4, num_pages=8, prefix_cache=True)
    ids = list(range(8))
    with cache.step([8, 0]) as step:
        for layer in range(2):
            k, v = direct_kv(ids, layer)
            step.write(layer, np.stack([k, np.zeros_like(k)]), np.stack([v, np.zeros_like(v)]))
    cache.cache_prefix(0, ids)
    cache.truncate([0], [6])  # into cached page 1
    before = index_state(cache)
    step = cache.step([1, 0])  # copies page 1 (cached) for row 0; page 1 joins the LRU
    assert cache.pages_reusable == 1
    step.abort()
    after = index_state(cache)
    for x, y in zip(before, after):
        assert (np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y)
    audit(cache)
    assert cache.match_prefix(1, ids + [0]) == 8
    assert_rows(cache, [ids[:6], ids], layers=(0, 1))


@pytest.mark.parametrize("backend_name", ["numpy", "numba"])
def test_requests_matched_from_the_cache_share_their_pages_in_attention(backend_name):
    """Eight requests start on the cached pages of one 592-token system prompt: the step's
    plan reads those pages once for all of them (``plan.shared_prefix``), and the result is
    the float64 reference over each request's own K/V."""
    P, system = 16, list(range(2000, 2592))  # 7 x 592 key reads saved: past MIN_SAVED_TOKENS
    cache = gqakv.PagedKVCache(9, HKV, 640, D, dtype="float32", backend=backend_name, page_size=P,
                               prefix_cache=True)
    first = system + [1, 2, 3]
    k, v = direct_kv(first)
    cache.append(k[None].astype(np.float32), v[None].astype(np.float32), [len(first)], rows=[0])
    cache.cache_prefix(0, first)
    cache.reset([0])
    prompts = [system + [9, t, t] for t in range(8)]
    for r, prompt in enumerate(prompts, start=1):
        m = cache.match_prefix(r, prompt)
        assert m == 592
        k, v = direct_kv(prompt)
        cache.append(k[None, :, m:].astype(np.float32), v[None, :, m:].astype(np.float32),
                     [len(prompt) - m], rows=[r])
    rows = list(range(1, 9))
    plan = gqakv.plan_attention(cache, [1] * 8, q_heads=HKV * G, rows=rows)
    assert plan.shared_prefix.used, plan.shared_prefix
    q = np.random.default_rng(5).standard_normal((8, HKV * G, 1, D)).astype(np.float32)
    got = plan.run(q, cache)
    kvs = [direct_kv(p) for p in prompts]
    want, _ = reference_attention(q, [x.astype(np.float32) for x, _ in kvs],
                                  [y.astype(np.float32) for _, y in kvs], [1] * 8)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    audit(cache)
