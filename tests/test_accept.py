"""accept (speculative decoding): keep one root-down path of each entry's draft tree.

After ``accept`` every row must hold its untouched prefix, then the accepted chunk tokens
in path order, bit for bit (stored codes and scales compared, never dequantized), with
exact lengths; other rows and refused calls change nothing.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import gqakv
from gqakv.core.tree import DraftTree

from .support.pages import audit

B, HKV, D, MAX_LEN = 4, 2, 8, 160
BACKENDS = ["numpy", "numba"]


# -- helpers ---------------------------------------------------------------------------------


def random_parents(rng, n: int, kind: str) -> list[int]:
    if kind == "chain":
        return list(range(-1, n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1) if n else []
    if kind == "roots":
        return [-1] * n
    return [int(rng.integers(-1, t)) if t else -1 for t in range(n)]


def random_path(rng, parents: list[int]) -> list[int]:
    n = len(parents)
    if n == 0 or rng.random() < 0.15:
        return []
    u = int(rng.integers(0, n))
    path = []
    while u >= 0:
        path.append(u)
        u = parents[u]
    path.reverse()
    return path[:int(rng.integers(1, len(path) + 1))]  # a prefix of a root path is a path


def make_tree(rng, ns, kinds) -> tuple[DraftTree, list[list[int]]]:
    T = max(max(ns), 1)
    parents = np.full((len(ns), T), -1, dtype=np.int64)
    plist = []
    for i, n in enumerate(ns):
        p = random_parents(rng, n, kinds[i % len(kinds)])
        parents[i, :n] = p
        plist.append(p)
    return DraftTree.of(parents, ns), [random_path(rng, p) for p in plist]


def make(kind: str, backend: str, page_size=None, layers: int = 3):
    if kind == "model":
        return gqakv.ModelKVCache(layers, B, HKV, MAX_LEN, D, "float32", backend=backend,
                                  page_size=page_size)
    if kind == "int8":
        return gqakv.KVCache(B, HKV, MAX_LEN, D, "float32", backend=backend, kv_dtype="int8")
    if kind == "paged_int8":
        return gqakv.PagedKVCache(B, HKV, MAX_LEN, D, "float32", backend=backend,
                                  page_size=page_size, kv_dtype="int8")
    if kind == "paged":
        return gqakv.PagedKVCache(B, HKV, MAX_LEN, D, "float32", backend=backend, page_size=page_size)
    return gqakv.KVCache(B, HKV, MAX_LEN, D, "float32", backend=backend)


def append(cache, rng, n_new, rows=None):
    n_new = np.asarray(n_new, dtype=np.int64)
    T = max(int(n_new.max(initial=0)), 1)
    shape = (len(n_new), HKV, T, D)
    if isinstance(cache, gqakv.ModelKVCache):
        with cache.step(n_new, rows=rows) as step:
            for layer in range(cache.layers):
                step.write(layer, rng.standard_normal(shape).astype(np.float32),
                           rng.standard_normal(shape).astype(np.float32))
    else:
        cache.append(rng.standard_normal(shape).astype(np.float32),
                     rng.standard_normal(shape).astype(np.float32), n_new, rows=rows)


def slot_of(cache, row: int, j: int) -> tuple[int, int]:
    store = cache.store
    if store.kind == "paged":
        P = store.page_size
        return int(store.page_table.entries[row, j // P]), j % P
    return row, j


def token(cache, row: int, j: int) -> list[np.ndarray]:
    """Every stored array's slot of row ``row``'s token ``j``, every layer (codes, scales)."""
    store = cache._row_store()
    r, o = slot_of(cache, row, j)
    return [np.array(buf[:, r, :, o, ...]) for buf in store.buffers]


def live(cache) -> list[list[list[np.ndarray]]]:
    lens = cache.host_lens
    return [[token(cache, b, j) for j in range(int(lens[b]))] for b in range(cache.batch)]


def everything(cache):
    """Copies of every buffer, the lengths and (paged) the table: to show nothing changed."""
    out = [np.array(b).copy() for b in cache._row_store().buffers] + [cache.host_lens.copy()]
    if cache.store.kind == "paged":
        t = cache.store.page_table
        out += [t.entries.copy(), t.held.copy(), t.refs.copy()]
    return out


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x.view(np.uint8) if x.dtype.kind == "f" else x,
                              y.view(np.uint8) if y.dtype.kind == "f" else y)


def assert_tokens_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for x, y in zip(g, w):
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


def check_accept(cache, rng, ns, rows, kinds):
    """Append a draft chunk of ns[i] tokens to rows[i], accept random paths, check."""
    append(cache, rng, ns, rows=rows)
    tree, paths = make_tree(rng, ns, kinds)
    before, lens = live(cache), cache.host_lens.copy()
    cache.accept(paths, tree, rows=rows)
    after, new = live(cache), cache.host_lens
    want_lens = lens.copy()
    for i, r in enumerate(rows):
        P = int(lens[r]) - ns[i]
        want_lens[r] = P + len(paths[i])
        assert_tokens_equal(after[r], before[r][:P] + [before[r][P + u] for u in paths[i]])
    assert np.array_equal(new, want_lens)
    for b in range(cache.batch):
        if b not in rows:
            assert_tokens_equal(after[b], before[b])
    if cache.store.kind == "paged":
        audit(cache)
    return tree, paths


# -- randomized trees ------------------------------------------------------------------------


CASES = [("contiguous", None), ("int8", None), ("paged", 4), ("paged", 16), ("paged_int8", 4),
         ("model", None), ("model", 4)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,page_size", CASES)
def test_accept_random_trees(kind, page_size, backend):
    rng = np.random.default_rng(zlib.crc32(f"{kind}{page_size}{backend}".encode()))
    for trial in range(6):
        cache = make(kind, backend, page_size)
        prefix = [int(rng.integers(0, 60)) for _ in range(B)]
        append(cache, rng, prefix)
        ns = [int(rng.integers(0, 65)) for _ in range(3)]
        ns[trial % 3] = 0 if trial % 2 else 64  # n = 0 and the largest tree, T = 64
        rows = [int(r) for r in rng.permutation(B)[:3]]  # row B-? untouched
        check_accept(cache, rng, ns, rows, ["chain", "star", "random", "roots"][trial % 4:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [4, 16])
def test_accept_after_fork_shares_prefix_pages(page_size, backend):
    """Rows forked from one prompt share its pages; each appends its own chunk (copy on
    write of the shared last page) and accepts: the shared prefix stays intact for all."""
    rng = np.random.default_rng(page_size)
    for kind in ("paged", "model"):
        cache = make(kind, backend, page_size)
        prefix = int(rng.integers(1, 40))
        append(cache, rng, [prefix, 0, 0, 0])
        cache.fork(0, [1, 2, 3])
        assert int(cache.store.page_table.refs.max()) == 4
        check_accept(cache, rng, [int(rng.integers(0, 65)) for _ in range(B)], list(range(B)),
                     ["random", "chain", "star"])
        rows = live(cache)
        for b in range(1, B):  # the prefix is the same tokens in every row
            assert_tokens_equal(rows[b][:prefix], rows[0][:prefix])


def test_accept_default_rows_and_chain_is_truncate():
    rng = np.random.default_rng(1)
    cache = make("contiguous", "numpy")
    append(cache, rng, [5, 6, 7, 8])
    append(cache, rng, [3, 3, 3, 3])
    before = live(cache)
    tree = gqakv.DraftTree.of(np.array([[-1, 0, 1]] * B), [3] * B)
    cache.accept([[0, 1, 2], [0, 1], [], [0]], tree)
    assert cache.host_lens.tolist() == [8, 8, 7, 9]
    for b in range(B):
        assert_tokens_equal(live(cache)[b], before[b][:int(cache.host_lens[b])])


# -- refusals change nothing -----------------------------------------------------------------


def _bad_calls(tree):
    return [
        (ValueError, [[1], [], []], {}),          # 1 is not a root
        (ValueError, [[0, 1, 2], [], []], {}),    # 2 is a child of 0, not of 1 (a star)
        (ValueError, [[0, 7], [], []], {}),       # out of range
        (ValueError, [[0, 0], [], []], {}),       # duplicate
        (TypeError, [[0.0], [], []], {}),         # wrong type
        (TypeError, [[True], [], []], {}),
        (TypeError, [None, [], []], {}),
        (TypeError, ["01", [], []], {}),
        (ValueError, [[0], [], [], []], {}),      # too many entries
        (ValueError, [[0], []], {}),              # too few
        (ValueError, [[0], [], []], {"rows": [0, 0, 1]}),
        (ValueError, [[0], [], []], {"rows": [0, 1, 9]}),
        (ValueError, [[0], [], []], {"rows": [0, 1]}),
        (TypeError, [[0], [], []], {"tree": np.array([[-1, 0, 0]] * 3)}),
    ]


@pytest.mark.parametrize("kind,page_size", [("contiguous", None), ("paged", 4), ("model", 4),
                                            ("int8", None)])
def test_bad_calls_change_nothing(kind, page_size):
    rng = np.random.default_rng(2)
    cache = make(kind, "numpy", page_size)
    append(cache, rng, [5, 6, 7, 0])
    append(cache, rng, [3, 3, 3, 0])
    tree = gqakv.DraftTree.of(np.array([[-1, 0, 0]] * 3), [3, 3, 3])
    snap = everything(cache)
    for exc, paths, kw in _bad_calls(tree):
        kw = dict(kw)
        t = kw.pop("tree", tree)
        with pytest.raises(exc):
            cache.accept(paths, t, **kw)
        assert_same(everything(cache), snap)
    # the later entries are bad: the first one's valid path must not have moved anything
    with pytest.raises(ValueError, match="paths\\[2\\]"):
        cache.accept([[0, 2], [0, 1], [5]], gqakv.DraftTree.of(np.array([[-1, 0, 0]] * 3), [3] * 3))
    assert_same(everything(cache), snap)
    # n > L: row 3 is empty
    with pytest.raises(ValueError, match="row 3 holds 0 tokens"):
        cache.accept([[0, 1], [0]], gqakv.DraftTree.of(np.array([[-1, 0, 0]] * 2), [3, 3]),
                     rows=[0, 3])
    assert_same(everything(cache), snap)


def test_open_step_refuses():
    cache = make("model", "numpy")
    with cache.step([1, 0, 0, 0]) as step:
        with pytest.raises(RuntimeError):
            cache.accept([[]], gqakv.DraftTree.of(np.array([[-1]]), [1]))
        for layer in range(cache.layers):
            step.write(layer, np.zeros((4, HKV, 1, D), np.float32), np.zeros((4, HKV, 1, D), np.float32))


# -- the functional paged API ----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_accept_equals_cache(page_size, backend):
    rng = np.random.default_rng(4 + page_size)
    cache = make("paged", backend, page_size)
    append(cache, rng, [int(rng.integers(0, 50)) for _ in range(B)])
    ns = [int(rng.integers(0, 65)) for _ in range(B)]
    append(cache, rng, ns)
    tree, paths = make_tree(rng, ns, ["random", "chain", "star", "roots"])
    table = cache.store.page_table.entries.copy()
    k, v = np.array(cache.k).copy(), np.array(cache.v).copy()
    lens = cache.host_lens.copy()
    new = gqakv.paged_accept(k, v, table, lens, paths, tree, backend=backend)
    cache.accept(paths, tree)
    assert new.dtype == np.int64 and np.array_equal(new, cache.host_lens)
    for b in range(B):
        for j in range(int(new[b])):
            p, o = int(table[b, j // page_size]), j % page_size
            assert np.array_equal(k[p, :, o], np.asarray(cache.k)[p, :, o])
            assert np.array_equal(v[p, :, o], np.asarray(cache.v)[p, :, o])


def test_paged_accept_refusals():
    rng = np.random.default_rng(5)
    cache = make("paged", "numpy", 4)
    append(cache, rng, [6, 6, 0, 0])
    append(cache, rng, [5, 5, 0, 0])
    table = cache.store.page_table.entries.copy()
    table[1, 1] = table[0, 1]  # row 1's page 1 is row 0's: shared
    k, v = np.array(cache.k).copy(), np.array(cache.v).copy()
    lens = cache.host_lens.copy()
    tree = gqakv.DraftTree.of(np.array([[-1, -1, 1, 2, 3]] * B), [5, 5, 0, 0])
    k0, v0 = k.copy(), v.copy()
    with pytest.raises(ValueError, match="also name it"):
        gqakv.paged_accept(k, v, table, lens, [[1, 2], [], [], []], tree)
    with pytest.raises(ValueError, match="paths\\[1\\]"):
        gqakv.paged_accept(k, v, cache.store.page_table.entries, lens, [[1, 2], [2], [], []], tree)
    with pytest.raises(TypeError, match="DraftTree.of"):
        gqakv.paged_accept(k, v, table, lens, [[1, 2], [], [], []], np.array([[-1]] * B))
    assert np.array_equal(k.view(np.uint8), k0.view(np.uint8))  # bits: the pool is uninitialized
    assert np.array_equal(v.view(np.uint8), v0.view(np.uint8))
    assert np.array_equal(gqakv.paged_accept(k, v, table, lens, [[0], [], [], []], tree),
                          [7, 6, 0, 0])


@pytest.mark.parametrize("backend", ["torch", "array_api_strict"])
@pytest.mark.parametrize("kind", ["contiguous", "paged", "int8"])
def test_accept_other_array_libraries(kind, backend):
    """The moves are plain slice assignments: torch and array_api_strict buffers too."""
    try:
        be = gqakv.get_backend(backend)
    except gqakv.BackendError as exc:
        pytest.skip(str(exc))
    xp = be.namespace()
    kw = ({"storage": "paged", "page_size": 4} if kind == "paged"
          else {"kv_dtype": "int8"} if kind == "int8" else {})
    cache = gqakv.KVCache(2, HKV, 32, D, "float32", backend=backend, **kw)
    k = np.random.default_rng(0).standard_normal((2, HKV, 9, D)).astype(np.float32)
    cache.append(xp.asarray(k), xp.asarray(k + 1), [9, 9])
    before = [np.asarray(x).copy() for x in cache.live_kv(0)]
    tree = gqakv.DraftTree.of(np.array([[-1, 0, 0, 2, 2, 4]] * 2), [6, 6])
    cache.accept([[0, 2, 4, 5], []], tree)
    assert cache.host_lens.tolist() == [7, 3]
    keep = [0, 1, 2, 3, 5, 7, 8]
    for got, was in zip(cache.live_kv(0), before):
        assert np.array_equal(np.asarray(got), was[:, keep])


# -- copy on write: accept into pages other rows or the prefix cache hold ---------------------
#
# The expected K/V of every row is built by plain NumPy from the arrays appended (``want``:
# row -> layer -> [K, V] ``[Hkv, L, d]``), forked and accepted the same way, independently
# of the cache's pages.


def make_cow(kind: str, backend: str, page_size: int = 4, num_pages=None, prefix_cache=False):
    if kind == "groups":  # a full and a sliding kind: two page tables (LayerGroups)
        return gqakv.ModelKVCache(3, B, HKV, MAX_LEN, D, "float32", backend=backend,
                                  page_size=page_size, windows=[None, 96, None],
                                  num_pages=num_pages)
    if kind == "model":
        return gqakv.ModelKVCache(3, B, HKV, MAX_LEN, D, "float32", backend=backend,
                                  page_size=page_size, num_pages=num_pages,
                                  prefix_cache=prefix_cache)
    return gqakv.PagedKVCache(B, HKV, MAX_LEN, D, "float32", backend=backend, page_size=page_size,
                              num_pages=num_pages, prefix_cache=prefix_cache,
                              kv_dtype="int8" if kind == "paged_int8" else None)


def n_layers(cache) -> int:
    return cache.layers if isinstance(cache, gqakv.ModelKVCache) else 1


def empty_want(cache) -> dict:
    z = np.zeros((HKV, 0, D), np.float32)
    return {b: [[z, z] for _ in range(n_layers(cache))] for b in range(B)}


def append_into(cache, rng, n_new, rows, want) -> None:
    """Append random K/V to ``rows``; extend ``want`` with the real tokens."""
    n_new = np.asarray(n_new, dtype=np.int64)
    shape = (len(rows), HKV, max(int(n_new.max()), 1), D)
    kv = [(rng.standard_normal(shape).astype(np.float32),
           rng.standard_normal(shape).astype(np.float32)) for _ in range(n_layers(cache))]
    if isinstance(cache, gqakv.ModelKVCache):
        with cache.step(n_new, rows=rows) as step:
            for layer, (k, v) in enumerate(kv):
                step.write(layer, k, v)
    else:
        cache.append(*kv[0], n_new, rows=rows)
    for i, r in enumerate(rows):
        n = int(n_new[i])
        want[r] = [[np.concatenate([w, x[i, :, :n]], axis=1) for w, x in zip(wl, xl)]
                   for wl, xl in zip(want[r], kv)]


def accept_want(want, row: int, n: int, path) -> None:
    """The accepted row: its prefix, then chunk tokens ``path`` in order."""
    def keep(x):
        P = x.shape[1] - n
        return np.concatenate([x[:, :P], x[:, P + np.asarray(path, dtype=np.int64)]], axis=1)

    want[row] = [[keep(x) for x in wl] for wl in want[row]]


def stored(cache, row: int) -> list[list[np.ndarray]]:
    if isinstance(cache, gqakv.ModelKVCache):
        return [[np.asarray(x) for x in cache.live_kv(l, row)] for l in range(cache.layers)]
    return [[np.asarray(x) for x in cache.live_kv(row)]]


def assert_rows(cache, want) -> None:
    for b in range(B):
        for l, (got, exp) in enumerate(zip(stored(cache, b), want[b])):
            for name, g, w in zip("KV", got, exp):
                assert g.shape == w.shape, (b, l, name, g.shape, w.shape)
                assert np.array_equal(g, w), f"row {b} layer {l} {name} differs"


def tables(cache) -> list:
    store = cache.store
    return list(store.page_tables.values()) if hasattr(store, "page_tables") else [store.page_table]


def pools(cache) -> list:
    """``(page table, its pool's buffers)`` of each pool; buffers (codes and scales)
    ``[layers, num_pages, ...]``."""
    store = cache._row_store()
    stores = [g[2] for g in store.groups] if hasattr(store, "groups") else [store]
    return [(st.page_table, st.buffers) for st in stores]


def audit_all(cache) -> None:
    for t in tables(cache):
        assert t.audit(cache.host_lens) == []


def snapshot(cache) -> list:
    """Every byte of every pool, the lengths and every table's bookkeeping (free list and
    the prefix cache's LRU order included)."""
    store = cache.store
    stores = [g[2] for g in store.groups] if hasattr(store, "groups") else [store]
    out = [np.array(b).copy() for st in stores for b in st.buffers] + [cache.host_lens.copy()]
    for t in tables(cache):
        out += [t.entries.copy(), t.held.copy(), t.released.copy(), t.refs.copy(),
                np.asarray(t._free, dtype=np.int64)]
        if t.index is not None:
            out += [np.asarray(list(t.index.unused), dtype=np.int64),
                    np.asarray(sorted(t.index.key_of), dtype=np.int64)]
    return out


def tree_with_leaves(rng, n: int, leaves: int) -> tuple[list[int], list[int]]:
    """Random parents (parents before children, node 1 a second root) with at least
    ``leaves`` leaves, and ``leaves`` distinct leaves: their root paths all move tokens and
    none is a prefix of another."""
    while True:
        parents = [-1, -1] + [int(rng.integers(-1, t)) for t in range(2, n)]
        leaf = [t for t in range(1, n) if t not in parents]  # not 0: [0] moves nothing
        if len(leaf) >= leaves:
            return parents, [int(u) for u in rng.permutation(leaf)[:leaves]]


def root_path(parents, u: int) -> list[int]:
    path = []
    while u >= 0:
        path.append(u)
        u = parents[u]
    return path[::-1]


FORK_KINDS = [("paged", 4), ("paged", 16), ("paged_int8", 4), ("model", 4), ("groups", 4)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,page_size", FORK_KINDS)
def test_accept_into_forked_rows_copies_shared_pages(kind, page_size, backend):
    """Rows forked after the draft chunk was appended name the same chunk pages; each
    accepts a different path (some rows of the fork not at all): every written shared page
    is copied first, so each row, accepted or not, holds exactly its own tokens."""
    rng = np.random.default_rng(zlib.crc32(f"cow{kind}{page_size}{backend}".encode()))
    for trial in range(4):
        cache = make_cow(kind, backend, page_size)
        want = empty_want(cache)
        append_into(cache, rng, [int(rng.integers(1, 30)), 7], [0, 3], want)
        n = int(rng.integers(8, 24))
        append_into(cache, rng, [n], [0], want)
        cache.fork(0, [1, 2])
        want[1], want[2] = list(want[0]), list(want[0])
        shared = {int(p) for p in tables(cache)[0].row_pages(0)}
        parents, ends = tree_with_leaves(rng, n, 3)
        k = 3 if trial % 2 else 2  # all three forked rows (the last writes in place), or two
        rows = [int(r) for r in rng.permutation(3)[:k]]
        paths = [root_path(parents, u) for u in ends[:k]]
        tree = DraftTree.of(np.array([parents] * k), [n] * k)
        before = None if kind == "groups" else live(cache)
        bytes_before = [[np.array(b).copy() for b in bufs] for _, bufs in pools(cache)]
        cache.accept(paths, tree, rows=rows)
        for r, path in zip(rows, paths):
            accept_want(want, r, n, path)
        if kind == "paged_int8":  # codes and scales: bit for bit the tokens appended
            after = live(cache)
            for b in range(B):
                P = int(cache.host_lens[b]) - (len(paths[rows.index(b)]) if b in rows else n)
                expect = (before[b][:P] + [before[b][P + u] for u in paths[rows.index(b)]]
                          if b in rows else before[b])
                assert_tokens_equal(after[b], expect)
        else:
            assert_rows(cache, want)
        audit_all(cache)
        # every page no accepted row names now kept its bytes (the shared pages they copied)
        for (table, bufs), before_bufs in zip(pools(cache), bytes_before):
            mine = {int(p) for r in rows for p in table.row_pages(r)}
            for was, now in zip(before_bufs, bufs):
                now = np.asarray(now)
                for p in set(range(was.shape[1])) - mine:
                    assert was[:, p].tobytes() == now[:, p].tobytes(), f"page {p} changed"
        # the page each accepted row first wrote is named by that row alone
        for i, r in enumerate(rows):
            first = (int(cache.host_lens[r]) - len(paths[i])) + next(
                s for s, u in enumerate(paths[i]) if u != s)
            page = int(tables(cache)[0].entries[r, first // page_size])
            others = [b for b in range(B) if b != r and page in tables(cache)[0].row_pages(b)]
            assert others == [], (r, page, others)
        assert shared  # the fork shared the chunk's pages


@pytest.mark.parametrize("kind", ["paged", "model"])
def test_accept_into_prefix_cached_page(kind):
    """A page the prefix cache holds keeps its tokens: accept copies it (also when two
    rows name it) and a later match still reads the tokens it was cached with."""
    rng = np.random.default_rng(6)
    cache = make_cow(kind, "numpy", 4, prefix_cache=True)
    want = empty_want(cache)
    append_into(cache, rng, [4], [0], want)
    append_into(cache, rng, [6], [0], want)
    assert cache.cache_prefix(0, list(range(8))) == 2  # page 1 holds chunk slots 4..7
    cached = [[x[:, :8].copy() for x in wl] for wl in want[0]]
    cache.fork(0, [2])
    want[2] = list(want[0])
    table = tables(cache)[0]
    old = int(table.entries[0, 1])
    tree = DraftTree.of(np.array([[-1, -1, 1, 2, 3, 4]] * 2), [6, 6])
    cache.accept([[1, 2, 3], [1, 2]], tree, rows=[0, 2])  # slots 4..6 and 4..5: page 1
    accept_want(want, 0, 6, [1, 2, 3])
    accept_want(want, 2, 6, [1, 2])
    assert_rows(cache, want)
    copies = {int(table.entries[0, 1]), int(table.entries[2, 1])}
    assert old not in copies and len(copies) == 2  # cached: copied for each writer
    assert int(table.refs[old]) == 0 and old in table.index.unused
    audit_all(cache)
    assert cache.match_prefix(1, list(range(9))) == 8  # the cached pages, as cached
    want[1] = cached
    assert_rows(cache, want)
    audit_all(cache)


@pytest.mark.parametrize("kind", ["paged", "paged_prefix", "model", "groups_full", "groups_window"])
def test_out_of_pages_during_accept_changes_nothing(kind):
    """An accept whose copies the pool cannot supply raises OutOfPages and changes nothing:
    lengths, tables, counts, the free list, the prefix cache's LRU, every byte of every
    pool; with one more page free, the same call succeeds."""
    rng = np.random.default_rng(7)
    # rows 0 and 1 share 4 pages (6 prompt tokens + a 10-token chunk, page_size 4); row 3
    # holds 1; the accept needs 3 copies (row 0 writes pages 1..3 while row 1 names them;
    # row 1, the last namer, writes page 1 in place): 2 free pages are one short (with a
    # prefix cache, 1 free and 1 cached unused; after the reset the copies evict that one)
    pool = 4 + 1 + 2
    if kind.startswith("groups"):  # the short table is one group's; the other has plenty
        full, window = (pool, 100) if kind == "groups_full" else (100, pool)
        cache = make_cow("groups", "numpy", 4, num_pages={None: full, 96: window})
    else:
        cache = make_cow("model" if kind == "model" else "paged", "numpy", 4, num_pages=pool,
                         prefix_cache=kind == "paged_prefix")
    want = empty_want(cache)
    if kind == "paged_prefix":  # an unused cached page: counted free, evicted only if needed
        append_into(cache, rng, [4], [3], want)
        cache.cache_prefix(3, [9, 9, 9, 9])
        cache.reset([3])
        want[3] = empty_want(cache)[3]
    append_into(cache, rng, [6, 3], [0, 3], want)
    append_into(cache, rng, [10], [0], want)
    cache.fork(0, [1])
    want[1] = list(want[0])
    tree = DraftTree.of(np.array([[-1, -1, 1, 2, 3, 4, 5, 6, 7, 8]] * 2), [10, 10])
    paths = [[1, 2, 3, 4, 5, 6, 7], [1, 2]]
    snap = snapshot(cache)
    with pytest.raises(gqakv.OutOfPages, match="cannot supply 3 pages"):
        cache.accept(paths, tree, rows=[0, 1])
    assert_same(snapshot(cache), snap)
    audit_all(cache)
    assert_rows(cache, want)
    cache.reset([3])  # one more page free: now it fits
    want[3] = empty_want(cache)[3]
    cache.accept(paths, tree, rows=[0, 1])
    if kind == "paged_prefix":
        assert tables(cache)[0].index.pages_unused == 0  # the third copy evicted it
    accept_want(want, 0, 10, paths[0])
    accept_want(want, 1, 10, paths[1])
    assert_rows(cache, want)
    audit_all(cache)
