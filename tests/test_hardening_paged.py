"""Hardening of paged storage and the row operations (issue 24, defects 1, 2, 4, 5, 11):
copies on write are filled before the table names them (a reader never sees an empty
page), reorder changes nothing when its temporary cannot be allocated, an aborted step
gives back every page it took, and the functional paged layer refuses a row that names
one page twice and takes one length convention for both of its calls."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import gqakv
from gqakv.storage.store import KVStore

from .support.pages import audit
from .support.reference import reference_attention

HKV, D, P = 2, 8, 4
POISON = -7.0  # what a page holds before a copy or an append fills it


def _backend(name: str):
    for b in gqakv.list_backends():
        if b.name == name:
            why = b.unavailable_reason()
            if why:
                pytest.skip(f"backend {name}: {why}")
            return b
    pytest.skip(f"backend {name} is not registered")


HOST_BACKENDS = ["numpy", "numba"]  # their pools are NumPy arrays the tests can watch


def _tokens(positions, layer: int = 0) -> np.ndarray:
    """K for tokens at ``positions`` of any row, ``[Hkv, n, d]``: a function of the position
    only, so every row that holds a prefix holds the same values (V is ``-K``)."""
    j = np.asarray(positions, dtype=np.float64)[None, :, None]
    h = np.arange(HKV, dtype=np.float64)[:, None, None]
    c = np.arange(D, dtype=np.float64)[None, None, :]
    return (1.0 + j + 0.25 * h + 0.01 * c + 100.0 * layer).astype(np.float32)


def _entry(positions, layer: int = 0):
    k = _tokens(positions, layer)[None]
    return k, -k


def _table_state(page_table) -> tuple:
    t = page_table
    return t.entries.copy(), t.held.copy(), t.refs.copy(), list(t._free), t.pages_used


def _assert_same_state(a: tuple, b: tuple) -> None:
    """Pages used, then the tables, held counts and reference counts, then the free list
    (the same pages in the same order: the next append takes the same pages)."""
    assert b[4] == a[4], f"pages_used {a[4]} -> {b[4]}"
    for what, x, y in zip(("entries", "held", "refs"), a[:3], b[:3]):
        np.testing.assert_array_equal(y, x, err_msg=what)
    assert b[3] == a[3], "the free list changed"


# -- 1. a copy on write is filled before the table names it ------------------------------------


class _WatchedTable(np.ndarray):
    """A page table that calls ``watch(before, after)`` after each write into it."""

    watch = None

    def __setitem__(self, key, value) -> None:
        before = self.view(np.ndarray).copy()
        super().__setitem__(key, value)
        if _WatchedTable.watch is not None:
            _WatchedTable.watch(before, self.view(np.ndarray))


def _watch_live_entries(cache, lens_of):
    """Make every change of a live table entry check, at that instant, that the page it
    now names holds the row's tokens the old page held (what a reader would read).
    Returns the list of changes seen (row, entry, old page, new page)."""
    store = cache.store
    seen = []

    def watch(before, after):
        lens = lens_of()
        for r, j in np.argwhere(before != after):
            m = min(P, int(lens[r]) - j * P)
            if m <= 0:  # past the live tokens: no reader looks there
                continue
            old, new = int(before[r, j]), int(after[r, j])
            seen.append((int(r), int(j), old, new))
            for pool in (np.asarray(store.k), np.asarray(store.v)):
                np.testing.assert_array_equal(
                    pool[..., new, :, :m, :], pool[..., old, :, :m, :],
                    err_msg=f"row {r}'s entry {j} names page {new} before it holds tokens "
                            f"{j * P}..{j * P + m - 1}")

    store.page_table.entries = store.page_table.entries.view(_WatchedTable)
    _WatchedTable.watch = watch
    return seen


@pytest.fixture
def unwatch():
    yield
    _WatchedTable.watch = None


@pytest.mark.parametrize("name", HOST_BACKENDS)
@pytest.mark.parametrize("through", ["append", "step"])
def test_copy_on_write_is_filled_before_the_table_names_it(name, through, unwatch):
    """Rows 0 and 1 share a partly filled last page; row 1 appends (KVCache.append, or a
    paged ModelKVCache step): at the instant row 1's entry changes, the new page already
    holds the tokens the shared page holds for it."""
    backend = _backend(name)
    if through == "append":
        cache = gqakv.PagedKVCache(2, HKV, 16, D, backend=backend, page_size=P)
        np.asarray(cache.store.k)[...] = POISON
        np.asarray(cache.store.v)[...] = POISON
        cache.append(*_entry(range(6)), [6], rows=[0])
    else:
        cache = gqakv.ModelKVCache(2, 2, HKV, 16, D, backend=backend, page_size=P)
        np.asarray(cache.store.k)[...] = POISON
        np.asarray(cache.store.v)[...] = POISON
        with cache.step([6], rows=[0]) as step:
            for layer in range(2):
                step.write(layer, *_entry(range(6), layer))
    cache.fork(0, [1])
    seen = _watch_live_entries(cache, lambda: cache.host_lens)
    if through == "append":
        cache.append(*_entry([6]), [1], rows=[1])
    else:
        with cache.step([1], rows=[1]) as step:
            for layer in range(2):
                step.write(layer, *_entry([6], layer))
    assert [(r, j) for r, j, _, _ in seen] == [(1, 1)]  # the copy on write was watched
    _WatchedTable.watch = None
    layers = range(2) if through == "step" else [None]
    for layer in layers:
        for row in (0, 1):
            k, v = cache.live_kv(row) if layer is None else cache.live_kv(layer, row)
            want = _tokens(range(6 + row), layer or 0)
            np.testing.assert_array_equal(np.asarray(k), want)
            np.testing.assert_array_equal(np.asarray(v), -want)
    audit(cache if through == "append" else cache.layer(0))


@pytest.mark.parametrize("name", HOST_BACKENDS)
@pytest.mark.parametrize("through", ["append", "step"])
def test_readers_alongside_copies_on_write_read_whole_rows(name, through, monkeypatch):
    """A reader thread reads the row another thread is appending to, which shares its
    partly filled last page with 23 others; each page copy is slowed by 2 ms, so a table
    that named the copy before it was filled is read in that state many times. Every
    read returns a prefix of the row's tokens."""
    backend = _backend(name)
    rows = 24
    if through == "append":
        cache = gqakv.PagedKVCache(rows, HKV, 16, D, backend=backend, page_size=P)
    else:
        cache = gqakv.ModelKVCache(1, rows, HKV, 16, D, backend=backend, page_size=P)
    np.asarray(cache.store.k)[...] = POISON
    np.asarray(cache.store.v)[...] = POISON
    if through == "append":
        cache.append(*_entry(range(6)), [6], rows=[0])
    else:
        with cache.step([6], rows=[0]) as step:
            step.write(0, *_entry(range(6)))
    cache.fork(0, range(1, rows))
    copy = backend.copy_tokens

    def slow_copy(*args):
        time.sleep(0.002)
        copy(*args)

    monkeypatch.setattr(backend, "copy_tokens", slow_copy)
    current, done, bad, reads = [1], threading.Event(), [], [0]
    want = _tokens(range(7))

    def reader():
        while not done.is_set():
            r = current[0]
            k, v = cache.live_kv(r) if through == "append" else cache.live_kv(0, r)
            k, v = np.asarray(k), np.asarray(v)
            n = k.shape[1]
            reads[0] += 1
            if not (np.array_equal(k, want[:, :n]) and np.array_equal(v, -want[:, :n])):
                bad.append((r, n))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for r in range(1, rows):
            current[0] = r
            time.sleep(0.001)  # the reader is reading row r when its append starts
            if through == "append":
                cache.append(*_entry([6]), [1], rows=[r])
            else:
                with cache.step([1], rows=[r]) as step:
                    step.write(0, *_entry([6]))
    finally:
        done.set()
        thread.join()
    assert reads[0] > rows  # the reader ran alongside the appends
    assert bad == [], f"{len(bad)} of {reads[0]} reads saw an unfilled page, e.g. {bad[:3]}"


@pytest.mark.parametrize("op", ["copy_tokens", "write_kv"])
def test_a_failed_copy_or_write_gives_every_page_back(op, monkeypatch):
    """The page copy (copy on write) or the K/V write after it raising inside an append
    leaves the tables, counts and free list exactly as they were, no length changed, and
    the next append works."""
    backend = _backend("numpy")
    cache = gqakv.PagedKVCache(3, HKV, 16, D, backend=backend, page_size=P)
    cache.append(*_entry(range(6)), [6], rows=[0])
    cache.fork(0, [1, 2])
    before, lens = _table_state(cache.store.page_table), cache.host_lens.copy()

    def broken(*args, **kwargs):
        raise RuntimeError(f"{op} failed")

    with monkeypatch.context() as m:
        m.setattr(backend, op, broken)
        with pytest.raises(RuntimeError, match=f"{op} failed"):
            cache.append(*_entry(range(6, 11)), [5], rows=[1])
    _assert_same_state(before, _table_state(cache.store.page_table))
    np.testing.assert_array_equal(cache.host_lens, lens)
    audit(cache)
    cache.append(*_entry(range(6, 11)), [5], rows=[1])
    k, _ = cache.live_kv(1)
    np.testing.assert_array_equal(np.asarray(k), _tokens(range(11)))


# -- 2. reorder is atomic when its temporary cannot be allocated --------------------------------


@pytest.mark.parametrize("name", ["numpy", "numba", "torch"])
@pytest.mark.parametrize("kind", ["KVCache", "int8", "ModelKVCache"])
def test_reorder_changes_nothing_when_its_temporary_fails(name, kind, monkeypatch):
    """reorder([1, 0, 0]) copies row 0 into row 2 in its first wave and needs the one-row
    temporary for the cycle 0 <-> 1: a MemoryError allocating it leaves every byte and
    length as it was; with memory, the same call then does what it says."""
    backend = _backend(name)
    rng = np.random.default_rng(0)
    lens = [5, 3, 7]
    if kind == "ModelKVCache":
        cache = gqakv.ModelKVCache(2, 3, HKV, 8, D, backend=backend)
        with cache.step(lens) as step:
            for layer in range(2):
                k, v = rng.standard_normal((2, 3, HKV, 7, D)).astype(np.float32)
                step.write(layer, backend.from_numpy(k, "float32"), backend.from_numpy(v, "float32"))
    else:
        cache = gqakv.KVCache(3, HKV, 8, D, backend=backend,
                              kv_dtype="int8" if kind == "int8" else None)
        k, v = rng.standard_normal((2, 3, HKV, 7, D)).astype(np.float32)
        cache.append(backend.from_numpy(k, "float32"), backend.from_numpy(v, "float32"), lens)
    store = cache.store
    parts = [store.k, store.v] + ([store.k_scale, store.v_scale] if store.quantized else [])

    def raw():
        return [np.asarray(backend.to_numpy(x)).tobytes() for x in parts]

    before, old_lens = raw(), cache.host_lens.copy()
    want = [cache.live_kv(r) if kind != "ModelKVCache" else cache.live_kv(1, r) for r in (1, 0, 0)]
    want = [tuple(np.asarray(backend.to_numpy(x)).copy() for x in kv) for kv in want]

    def no_memory(self, backend, tokens):
        raise MemoryError(f"cannot allocate a temporary row of {tokens} tokens")

    with monkeypatch.context() as m:
        m.setattr(KVStore, "temporary", no_memory)
        with pytest.raises(MemoryError, match="temporary row"):
            cache.reorder([1, 0, 0])
    assert raw() == before, "reorder wrote rows before its temporary failed"
    np.testing.assert_array_equal(cache.host_lens, old_lens)
    cache.reorder([1, 0, 0])
    np.testing.assert_array_equal(cache.host_lens, [3, 5, 5])
    for r in range(3):
        got = cache.live_kv(r) if kind != "ModelKVCache" else cache.live_kv(1, r)
        for x, y in zip(got, want[r]):
            np.testing.assert_array_equal(np.asarray(backend.to_numpy(x)), y)


# -- 4. paged_append refuses a row that names one page twice -------------------------------------


def _pools(num_pages: int = 4):
    k = np.full((num_pages, HKV, P, D), POISON, dtype=np.float32)
    return k, k.copy()


@pytest.mark.parametrize("name", HOST_BACKENDS)
def test_paged_append_refuses_a_row_naming_a_page_twice(name):
    """A table naming page 3 twice for a row holding 4 tokens: appending tokens 4..7 would
    land on tokens 0..3. Refused before any write, naming the row, the page, the entries
    and the tokens; the pools are unchanged."""
    backend = _backend(name)
    kp, vp = _pools()
    kp[3, :, :, :] = _tokens(range(4))
    vp[3, :, :, :] = -_tokens(range(4))
    before = kp.copy(), vp.copy()
    k, v = _entry(range(4, 8))
    with pytest.raises(ValueError, match=r"row 0 names page 3 twice \(page_table\[0, 0\] and "
                                         r"page_table\[0, 1\]\): its tokens 0\.\.3 and 4\.\.7"):
        gqakv.paged_append(kp, vp, np.array([[3, 3]], np.int32), [8], k, v, [4], backend=backend)
    np.testing.assert_array_equal(kp, before[0])
    np.testing.assert_array_equal(vp, before[1])
    # a page named twice only past the row's tokens is never used: accepted
    gqakv.paged_append(kp, vp, np.array([[3, 1, 1]], np.int32), [8], k, v, [4], backend=backend)
    np.testing.assert_array_equal(kp[1], _tokens(range(4, 8)))
    np.testing.assert_array_equal(kp[3], before[0][3])
    q = backend.from_numpy(np.ones((1, HKV, 1, D), np.float32), "float32")
    with pytest.raises(ValueError, match=r"row 0 names page 3 twice"):
        gqakv.paged_attention(q, kp, vp, np.array([[3, 3]], np.int32), [8], [1], backend=backend)


# -- 11. one length convention for paged_append and paged_attention ------------------------------


@pytest.mark.parametrize("name", HOST_BACKENDS)
def test_paged_append_and_attention_take_the_same_lengths(name):
    """A caller's step: allocate pages, advance the lengths, then pass paged_append and
    paged_attention the same (table, lens, n_new); the result is the float64 reference
    over the rows' tokens. An n_new larger than lens (lengths before the append passed
    where they are after) is refused, naming the convention."""
    backend = _backend(name)
    rng = np.random.default_rng(3)
    B, G, T = 2, 2, 3
    kp, vp = _pools(8)
    table = np.array([[5, 2, -1], [7, 0, 4]], np.int32)
    lens = np.zeros(B, np.int64)
    rows_k = [np.zeros((HKV, 0, D))] * B
    rows_v = list(rows_k)
    for n_new in ([3, 2], [1, 3], [2, 0], [1, 3]):
        lens += n_new
        k, v = rng.standard_normal((2, B, HKV, T, D)).astype(np.float32)
        q = rng.standard_normal((B, HKV * G, T, D)).astype(np.float32)
        gqakv.paged_append(kp, vp, table, lens, k, v, n_new, backend=backend)
        out = gqakv.paged_attention(q, kp, vp, table, lens, n_new, backend=backend)
        rows_k = [np.concatenate([rows_k[b], k[b, :, :n_new[b]]], axis=1) for b in range(B)]
        rows_v = [np.concatenate([rows_v[b], v[b, :, :n_new[b]]], axis=1) for b in range(B)]
        want, _ = reference_attention(q, rows_k, rows_v, n_new)
        np.testing.assert_allclose(np.asarray(out), want, atol=3e-6, rtol=3e-6)
    assert lens.tolist() == [7, 8]
    before = kp.copy()
    k = np.ones((B, HKV, 2, D), np.float32)
    with pytest.raises(ValueError, match=r"n_new\[1\]=2 is more than lens\[1\]=1: lens counts "
                                         r"row 1's tokens after this append"):
        gqakv.paged_append(kp, vp, table, [7, 1], k, k, [0, 2], backend=backend)
    np.testing.assert_array_equal(kp, before)


# -- 5. an aborted step gives back every page it took ---------------------------------------------


def _live(cache) -> list:
    return [[tuple(np.asarray(x).copy() for x in cache.live_kv(layer, r))
             for r in range(cache.batch)] for layer in range(cache.layers)]


def _assert_live(a: list, b: list) -> None:
    for la, lb in zip(a, b):
        for ra, rb in zip(la, lb):
            for x, y in zip(ra, rb):
                np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", HOST_BACKENDS)
def test_aborted_step_on_forked_rows_returns_its_copies(name):
    """The issue's case: two forked rows, step([1, 1]).abort(): pages_used 1 -> 1 (it went
    to 2). And rows sharing a page at different lengths (row 1 truncated below row 0):
    the step copies, writes and aborts, and both rows read what they held."""
    backend = _backend(name)
    cache = gqakv.ModelKVCache(2, 2, HKV, 16, D, backend=backend, page_size=P)
    with cache.step([2], rows=[0]) as step:
        for layer in range(2):
            step.write(layer, *_entry(range(2), layer))
    cache.fork(0, [1])
    assert cache.pages_used == 1
    before = _table_state(cache.store.page_table)
    step = cache.step([1, 1])
    for layer in range(2):
        step.write(layer, *(np.concatenate([x, x]) for x in _entry([2], layer)))
    step.abort()
    assert cache.pages_used == 1
    _assert_same_state(before, _table_state(cache.store.page_table))

    with cache.step([1], rows=[0]) as step:  # row 0: 3 tokens, row 1: 2, one shared page
        for layer in range(2):
            step.write(layer, *_entry([2], layer))
    cache.fork(0, [1])
    cache.truncate([1], [2])
    before, live = _table_state(cache.store.page_table), _live(cache)
    step = cache.step([1, 1])
    for layer in range(2):
        k = np.full((2, HKV, 1, D), 55.0, np.float32)
        step.write(layer, k, -k)
    step.abort()
    _assert_same_state(before, _table_state(cache.store.page_table))
    _assert_live(live, _live(cache))
    audit(cache.layer(0))


@pytest.mark.parametrize("name", HOST_BACKENDS)
@pytest.mark.parametrize("seed", range(3))
def test_random_aborts_restore_pages_and_tables_exactly(name, seed):
    """Random forks, truncates, committed and aborted steps (ragged rows, shared partly
    filled pages, an overcommitted pool): after each abort the tables, reference counts,
    free list, pages_used, lengths and every row's tokens are exactly as before the step;
    the pool's accounting holds throughout."""
    backend = _backend(name)
    rng = np.random.default_rng(seed)
    B, layers, max_len = 4, 2, 24
    cache = gqakv.ModelKVCache(layers, B, HKV, max_len, D, backend=backend, page_size=P,
                               num_pages=16)
    aborted_copies = 0
    for _ in range(120):
        op = rng.choice(["step", "abort", "fork", "truncate"], p=[0.35, 0.35, 0.15, 0.15])
        lens = cache.host_lens
        if op == "fork":
            src = int(rng.integers(B))
            cache.fork(src, [int(r) for r in rng.choice(B, int(rng.integers(1, B)), replace=False)])
        elif op == "truncate":
            r = int(rng.integers(B))
            cache.truncate([r], [int(rng.integers(lens[r] + 1))])
        else:
            rows = np.sort(rng.choice(B, int(rng.integers(1, B + 1)), replace=False))
            n = np.array([int(rng.integers(0, min(4, max_len - lens[r]) + 1)) for r in rows])
            before, live, old_lens = _table_state(cache.store.page_table), _live(cache), lens.copy()
            try:
                step = cache.step(n, rows=rows)
            except gqakv.OutOfPages:
                _assert_same_state(before, _table_state(cache.store.page_table))
                continue
            # rows writing into a shared, partly filled last page (before: table, held, refs)
            copies = sum(1 for r, m in zip(rows, n) if m and old_lens[r] % P
                         and before[2][before[0][r, old_lens[r] // P]] > 1)
            for layer in range(layers):
                k, v = rng.standard_normal((2, rows.size, HKV, 4, D)).astype(np.float32)
                step.write(layer, k, v)
            if op == "step":
                step.commit()
            else:
                step.abort()
                aborted_copies += copies
                _assert_same_state(before, _table_state(cache.store.page_table))
                np.testing.assert_array_equal(cache.host_lens, old_lens)
                _assert_live(live, _live(cache))
        audit(cache.layer(0))
    assert aborted_copies > 0  # some aborts gave back copies on write
