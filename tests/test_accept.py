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


def test_shared_destination_page_is_refused():
    """Forking a row after its chunk was appended shares the chunk's pages: accept refuses
    to write them (it does not copy them) and changes nothing."""
    rng = np.random.default_rng(3)
    cache = make("paged", "numpy", 4)
    append(cache, rng, [6, 0, 0, 0])
    append(cache, rng, [5, 0, 0, 0])
    cache.fork(0, [1])
    tree = gqakv.DraftTree.of(np.array([[-1, -1, 1, 2, 3]]), [5])
    snap = everything(cache)
    with pytest.raises(ValueError, match="shared"):
        cache.accept([[1, 2]], tree)
    assert_same(everything(cache), snap)
    cache.accept([[]], tree)  # nothing written: only the length (and pages past it) change
    assert cache.host_lens.tolist() == [6, 11, 0, 0]
    audit(cache)


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


def test_cached_destination_page_is_refused():
    """A page the prefix cache holds keeps its tokens: accept refuses to write into it."""
    rng = np.random.default_rng(6)
    cache = gqakv.PagedKVCache(B, HKV, MAX_LEN, D, "float32", backend="numpy", page_size=4,
                               prefix_cache=True)
    append(cache, rng, [4, 0, 0, 0])
    append(cache, rng, [6, 0, 0, 0])
    cache.cache_prefix(0, list(range(8)))  # pages 0 and 1: the second holds chunk slots 4..7
    tree = gqakv.DraftTree.of(np.array([[-1, -1, 1, 2, 3, 4]]), [6])
    snap = everything(cache)
    with pytest.raises(ValueError, match="prefix cache holds it"):
        cache.accept([[1, 2]], tree)
    assert_same(everything(cache), snap)
    cache.accept([[0]], tree)  # token 0 stays where it is: nothing written
    assert cache.host_lens.tolist() == [5, 0, 0, 0]
    audit(cache)
