"""Paged KV cache: the same results as KVCache, row operations as page bookkeeping.

Every test checks the pool's accounting (``PageTable.audit``: each page's reference
count equals the table entries naming it, the free list holds exactly the pages no row
names, no page twice, and each row holds ``ceil(L / page_size)`` pages), so a leaked
or doubly freed page fails where it happens.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import gqakv
from gqakv.storage.paged import GATHER_KEYS, OutOfPages, PagedStore, pages_for

from .support.arrays import BackendArrays
from .support.direct import Direct
from .support.pages import audit
from .support.reference import reference_attention


def state(cache, arrays):
    """Everything an operation may change: lengths, tables, counts, free list, the pool."""
    t = cache.store.page_table
    return (cache.host_lens.copy(), t.entries.copy(), t.held.copy(), t.refs.copy(), list(t._free),
            arrays.to_numpy(cache.k).copy(), arrays.to_numpy(cache.v).copy())


def assert_same_state(a, b):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_rows(cache, direct, arrays):
    np.testing.assert_array_equal(cache.host_lens, [k.shape[1] for k in direct.k])
    for b in range(cache.batch):
        k, v = cache.live_kv(b)
        np.testing.assert_array_equal(arrays.to_numpy(k), direct.k[b], err_msg=f"K row {b}")
        np.testing.assert_array_equal(arrays.to_numpy(v), direct.v[b], err_msg=f"V row {b}")


# -- the same results as KVCache ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_matches_contiguous(backend, arrays, page_size, dtype, route_spy):
    """Ragged prefill chunks, then decode steps with an idle row, on both caches: float64
    outputs and LSE agree within float64 rounding of a different key blocking; float32 and
    bfloat16 (the kernels' dtypes) each match the float64 reference (bfloat16 by the
    same-dtype naive rule); every append and attention ran what ``route()`` names and the
    path meant (tests/support/routes.py). Dead pool slots hold NaN, so a read past a row's
    length fails."""
    from .support.parity import LOW_PRECISION, assert_matches_reference, low_precision_bounds
    from .support.routes import assert_product_routes

    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} has no {dtype}")
    if backend.name == "cupy_emulated" and dtype == "float32" and page_size != 3:
        pytest.skip("the emulator's time: float32 paged kernels run here at page size 3 "
                    "(bfloat16 at every page size; the product runs both)")
    spy = route_spy(backend)
    rng = np.random.default_rng(page_size)
    B, Hkv, G, d, S = 3, 2, 2, 8, 48
    plain = gqakv.KVCache(B, Hkv, S, d, dtype=dtype, backend=backend)
    paged = gqakv.PagedKVCache(B, Hkv, S, d, dtype=dtype, backend=backend, page_size=page_size)
    paged.store.fill(math.nan)
    direct = Direct(B, Hkv, d)

    def held(x):  # the values a dtype array holds, as float64
        return arrays.to_numpy(arrays.asarray(x, dtype))

    for T, n in [(9, [9, 4, 0]), (9, [7, 9, 2]), (1, [1, 1, 0]), (1, [1, 0, 1]), (5, [3, 5, 5])]:
        k, v = held(rng.standard_normal((2, B, Hkv, T, d)))
        q = held(rng.standard_normal((B, Hkv * G, T, d)))
        for c in (plain, paged):
            c.append(arrays.asarray(k, dtype), arrays.asarray(v, dtype), n)
        direct.append(range(B), k, v, n)
        want, want_lse = reference_attention(q, direct.k, direct.v, n)
        got = [gqakv.gqa_attention(arrays.asarray(q, dtype), c, n, return_lse=True)
               for c in (plain, paged)]
        if dtype == "float64":
            for (o, lse) in got:
                np.testing.assert_allclose(arrays.to_numpy(o), want, atol=1e-12)
            np.testing.assert_allclose(arrays.to_numpy(got[1][0]), arrays.to_numpy(got[0][0]),
                                       atol=1e-13)
            a, b = arrays.to_numpy(got[0][1]), arrays.to_numpy(got[1][1])
            np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))
            np.testing.assert_allclose(b[np.isfinite(a)], a[np.isfinite(a)], atol=1e-13)
        else:
            bounds = (low_precision_bounds(dtype, want, want_lse, q, direct.k, direct.v, n, None)
                      if dtype in LOW_PRECISION else None)
            for name, (o, lse) in zip(("contiguous", "paged"), got):
                assert_matches_reference(arrays.to_numpy(o), arrays.to_numpy(lse), want,
                                         want_lse, dtype, bounds, what=f"{name} n={n}")
        audit(paged)
    assert_rows(paged, direct, arrays)
    assert paged.pages_used == sum(pages_for(L, page_size) for L in paged.host_lens)
    assert_product_routes(spy)


@pytest.mark.parametrize("page_size, length", [(5, 23), (3, 700), (300, 700)])
def test_generic_path_walks_pages(backend, arrays, monkeypatch, page_size, length):
    """The generic path (every backend's arrays) walks a paged row in key blocks that end
    at page boundaries and never hold more than GATHER_KEYS keys (a bounded gather of
    small pages) or one page (pages of GATHER_KEYS keys or more: views), never the row."""
    from gqakv.ops.attention import attention_array_api
    from gqakv.core.inputs import validate_attention

    if "float32" not in backend.dtypes:
        pytest.skip(f"{backend.name} has no float32")
    spans = []
    blocks = PagedStore.blocks

    def recording(self, row, j0, j1):
        spans.append((row, j0, j1, self.page_size))
        return blocks(self, row, j0, j1)

    monkeypatch.setattr(PagedStore, "blocks", recording)
    rng = np.random.default_rng(3)
    cache = gqakv.PagedKVCache(2, 1, length, 4, backend=backend, page_size=page_size)
    k = arrays.asarray(rng.standard_normal((2, 1, length, 4)), "float32")
    cache.append(k, k, [length, 11])
    q = arrays.asarray(rng.standard_normal((2, 2, 1, 4)), "float32")
    spans.clear()
    inputs = validate_attention(cache, q, [1, 1])
    attention_array_api(q, cache.store, inputs, inputs.params, return_lse=False)
    most = page_size if page_size >= GATHER_KEYS else GATHER_KEYS
    assert spans and all(j1 - j0 <= most for _, j0, j1, _ in spans)
    for row, L in ((0, length), (1, 11)):
        assert all(j1 % page_size == 0 or j1 == L for r, _, j1, _ in spans if r == row)
    if page_size >= GATHER_KEYS:
        assert all(j0 // P == (j1 - 1) // P for _, j0, j1, P in spans)
    for row, L in ((0, length), (1, 11)):  # each row's keys read exactly once
        got = sorted((j0, j1) for r, j0, j1, _ in spans if r == row)
        assert got[0][0] == 0 and got[-1][1] == L
        assert all(a[1] == b[0] for a, b in zip(got, got[1:]))


# -- randomized operations against the direct model -------------------------------------------


def _random_ops(backend, seed, steps, page_size, num_pages):
    arrays = BackendArrays(backend)
    rng = np.random.default_rng(seed)
    B, Hkv, d, S = 4, 1, 3, 24
    cache = gqakv.PagedKVCache(B, Hkv, S, d, dtype="float64", backend=backend,
                               page_size=page_size, num_pages=num_pages)
    cache.store.fill(math.nan)
    direct = Direct(B, Hkv, d)
    seen = set()
    for _ in range(steps):
        op = rng.choice(["append", "append", "reorder", "fork", "truncate", "reset", "attend"])
        before = state(cache, arrays)
        if op == "append":
            sub = rng.permutation(B)[:rng.integers(1, B + 1)]
            T = int(rng.integers(1, 7))
            room = S - cache.host_lens[sub]
            n = np.minimum(rng.integers(0, T + 1, sub.size), room)
            k, v = rng.standard_normal((2, sub.size, Hkv, T, d))
            try:
                cache.append(arrays.asarray(k, "float64"), arrays.asarray(v, "float64"), n,
                             rows=sub)
            except OutOfPages:
                assert_same_state(before, state(cache, arrays))
                op = "out of pages"
            else:
                direct.append(sub, k, v, n)
        elif op == "reorder":
            src = rng.integers(0, B, B)
            cache.reorder(src)
            direct.reorder(src)
        elif op == "fork":
            src = int(rng.integers(0, B))
            dst = rng.permutation(B)[:rng.integers(1, B)]
            cache.fork(src, dst)
            direct.fork(src, dst)
        elif op == "truncate":
            rows = rng.permutation(B)[:rng.integers(1, B + 1)]
            lens = [int(rng.integers(0, cache.host_lens[r] + 1)) for r in rows]
            cache.truncate(rows, lens)
            direct.truncate(rows, lens)
        elif op == "reset":
            rows = rng.permutation(B)[:rng.integers(1, B + 1)]
            cache.reset(rows)
            direct.truncate(rows, [0] * rows.size)
        else:
            n = np.minimum(rng.integers(0, 3, B), cache.host_lens)
            q = rng.standard_normal((B, 2 * Hkv, 2, d))
            want, _ = reference_attention(q, direct.k, direct.v, n)
            got = gqakv.gqa_attention(arrays.asarray(q, "float64"), cache, n)
            np.testing.assert_allclose(arrays.to_numpy(got), want, atol=1e-12)
        seen.add(op)
        audit(cache)
        assert_rows(cache, direct, arrays)
        shared = (cache.store.page_table.refs > 1).any()
        if shared:
            seen.add("shared pages")
    return seen


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_numpy(seed):
    """Long random sequences on NumPy: forks of forks, truncation below shared page
    boundaries, writes into shared partly filled pages, an overcommitted pool."""
    backend = gqakv.get_backend("numpy")
    seen = _random_ops(backend, seed, steps=150, page_size=int([2, 3, 4, 5, 1, 8][seed]),
                       num_pages=[12, 20, None, 14, 40, 8][seed])
    assert {"append", "reorder", "fork", "truncate", "reset", "attend", "shared pages"} <= seen


def test_random_operations_every_backend(backend):
    if "float64" not in backend.dtypes:
        pytest.skip(f"{backend.name} has no float64")
    seen = _random_ops(backend, 100, steps=40, page_size=3, num_pages=14)
    assert "append" in seen


def test_out_of_pages_is_reported_and_changes_nothing(backend, arrays):
    if "float32" not in backend.dtypes:
        pytest.skip(f"{backend.name} has no float32")
    cache = gqakv.PagedKVCache(3, 1, 32, 2, backend=backend, page_size=4, num_pages=5)
    x = arrays.asarray(np.ones((3, 1, 8, 2)), "float32")
    cache.append(x, x, [8, 4, 0])  # 2 + 1 pages
    before = state(cache, arrays)
    with pytest.raises(OutOfPages, match=r"cannot supply 3 pages \(row 1 needs 1, row 2 needs 2\).*2 of 5"):
        cache.append(x, x, [0, 4, 8])
    assert isinstance(OutOfPages("x"), MemoryError)
    assert_same_state(before, state(cache, arrays))
    audit(cache)
    cache.append(x, x, [0, 4, 4])  # exactly the 2 free pages
    assert cache.pages_free == 0
    audit(cache)


def test_fork_shares_pages_and_copies_only_a_partial_last_page(monkeypatch):
    backend = gqakv.get_backend("numpy")
    copies = []
    orig = type(backend).copy_tokens

    def recording(self, dst, dst_rows, src, src_rows, n_tokens):
        copies.append(list(np.asarray(n_tokens)))
        return orig(self, dst, dst_rows, src, src_rows, n_tokens)

    monkeypatch.setattr(type(backend), "copy_tokens", recording)
    rng = np.random.default_rng(0)
    cache = gqakv.PagedKVCache(9, 2, 64, 4, backend=backend, page_size=8)
    k = rng.standard_normal((1, 2, 37, 4)).astype(np.float32)
    cache.append(k, k, [37], rows=[0])
    used = cache.pages_used
    cache.fork(0, range(1, 9))
    assert copies == [] and cache.pages_used == used == 5
    one = np.ones((9, 2, 1, 4), np.float32)
    cache.append(one, one, [1] * 9)  # 8 forks write into the shared last page: copy on write
    # 37 % 8 = 5 live tokens each, for 8 of the 9 rows: the last row naming the page
    # writes into it in place
    assert [[int(n) for n in c] for c in copies] == [[5] * 8]
    assert cache.pages_used == used + 8
    audit(cache)
    for b in range(9):
        kb, _ = cache.live_kv(b)
        np.testing.assert_array_equal(kb[:, :37], k[0])
        np.testing.assert_array_equal(kb[:, 37], 1)


def test_truncate_below_a_shared_page_then_write(arrays, backend):
    if "float64" not in backend.dtypes:
        pytest.skip(f"{backend.name} has no float64")
    cache = gqakv.PagedKVCache(2, 1, 16, 1, dtype="float64", backend=backend, page_size=4)
    x = arrays.asarray(np.arange(10, dtype=float).reshape(1, 1, 10, 1), "float64")
    cache.append(x, x, [10], rows=[0])
    cache.fork(0, [1])
    cache.truncate([1], [5])  # row 1 keeps pages 0, 1 (shared); page 2 stays row 0's only
    audit(cache)
    y = arrays.asarray(np.full((1, 1, 3, 1), -1.0), "float64")
    cache.append(y, y, [3], rows=[1])
    audit(cache)
    got0, got1 = (arrays.to_numpy(cache.live_kv(b)[0]).ravel() for b in (0, 1))
    np.testing.assert_array_equal(got0, np.arange(10))
    np.testing.assert_array_equal(got1, [0, 1, 2, 3, 4, -1, -1, -1])
    cache.reset()
    assert cache.pages_used == 0
    audit(cache)


def test_bad_inputs_change_nothing(arrays, backend):
    if "float32" not in backend.dtypes:
        pytest.skip(f"{backend.name} has no float32")
    cache = gqakv.PagedKVCache(2, 1, 8, 2, backend=backend, page_size=4)
    x = arrays.asarray(np.ones((2, 1, 5, 2)), "float32")
    cache.append(x, x, [5, 3])
    cache.fork(0, [1])
    before = state(cache, arrays)
    bad = [
        (lambda: cache.append(x, x, [4, 6]), ValueError, "n_new"),
        (lambda: cache.append(x, x, [4, 4]), ValueError, "max_len=8"),
        (lambda: cache.reorder([0, 2]), ValueError, "src_rows"),
        (lambda: cache.fork(0, [1, 1]), ValueError, "distinct"),
        (lambda: cache.fork(5, [1]), ValueError, "src=5"),
        (lambda: cache.truncate([0], [6]), ValueError, "new_lens"),
        (lambda: cache.reset([3]), ValueError, "rows"),
    ]
    for call, error, words in bad:
        with pytest.raises(error, match=words):
            call()
        assert_same_state(before, state(cache, arrays))
        audit(cache)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(page_size=0), ValueError, "page_size must be >= 1, got 0"),
    (dict(page_size=2.0), TypeError, "page_size must be an int, got 2.0"),
    (dict(page_size=True), TypeError, "page_size must be an int"),
    (dict(num_pages=-1), ValueError, "num_pages must be >= 0"),
])
def test_bad_page_arguments(kwargs, error, words):
    with pytest.raises(error, match=words):
        gqakv.PagedKVCache(1, 1, 8, 2, backend="numpy", **kwargs)
    with pytest.raises(ValueError, match="apply to storage='paged' only"):
        gqakv.KVCache(1, 1, 8, 2, backend="numpy", page_size=4)


def test_contiguous_cache_has_no_pages():
    with pytest.raises(TypeError, match="pages exist only for storage='paged'"):
        gqakv.KVCache(1, 1, 8, 2, backend="numpy").pages_used


def test_sizes():
    cache = gqakv.PagedKVCache(2, 8, 131_072, 128, dtype="bfloat16", backend="numpy",
                               page_size=16, num_pages=pages_for(100, 16) + pages_for(100_000, 16))
    assert cache.num_pages == 7 + 6250
    assert cache.nbytes == 6257 * 16 * 2 * 8 * 128 * 2
    assert cache.nbytes + cache.store.page_table.nbytes <= 1.02 * 100_112 * 2 * 8 * 128 * 2
    default = gqakv.PagedKVCache(3, 1, 10, 2, backend="numpy", page_size=4)
    assert default.num_pages == 3 * 3  # every row at max_len


# -- ModelKVCache over one shared page table ---------------------------------------------------


def test_model_cache_pages_once_for_all_layers(backend, arrays):
    """A paged ModelKVCache gives the contiguous one's results through Step.attend on every
    layer; a step takes each page once for all layers; row operations, an aborted step and
    OutOfPages at step() keep the pool's accounting sound."""
    if "float64" not in backend.dtypes:
        pytest.skip(f"{backend.name} has no float64")
    rng = np.random.default_rng(5)
    layers, B, Hkv, G, d, S, P = 3, 3, 2, 2, 4, 32, 4
    plain = gqakv.ModelKVCache(layers, B, Hkv, S, d, dtype="float64", backend=backend)
    paged = gqakv.ModelKVCache(layers, B, Hkv, S, d, dtype="float64", backend=backend,
                               page_size=P, num_pages=16)
    assert paged.store.kind == "paged" and paged.nbytes == layers * 16 * P * 2 * Hkv * d * 8
    paged.store.fill(math.nan)
    directs = [Direct(B, Hkv, d) for _ in range(layers)]

    def step(n, T):
        data = rng.standard_normal((layers, 3, B, Hkv * G, T, d))
        outs = []
        for c in (plain, paged):
            with c.step(n) as st:
                outs.append([st.attend(l, arrays.asarray(data[l, 0], "float64"),
                                       arrays.asarray(data[l, 1, :, :Hkv], "float64"),
                                       arrays.asarray(data[l, 2, :, :Hkv], "float64"))
                             for l in range(layers)])
        for l in range(layers):
            directs[l].append(range(B), data[l, 1, :, :Hkv], data[l, 2, :, :Hkv], n)
            want, _ = reference_attention(data[l, 0], directs[l].k, directs[l].v, n)
            for o in (outs[0][l], outs[1][l]):
                np.testing.assert_allclose(arrays.to_numpy(o), want, atol=1e-12)
        audit(paged)

    step(np.array([6, 3, 0]), 6)
    assert paged.pages_used == 2 + 1  # once for all 3 layers
    step(np.array([1, 1, 1]), 1)
    for c in (plain, paged):
        c.fork(0, [2])
    for dr in directs:
        dr.fork(0, [2])
    audit(paged)
    step(np.array([2, 0, 3]), 3)  # rows 0 and 2 write into their shared last page
    for c in (plain, paged):
        c.reorder([2, 2, 1])
    for dr in directs:
        dr.reorder([2, 2, 1])
    audit(paged)
    step(np.array([1, 1, 1]), 1)
    for l in range(layers):
        for b in range(B):
            k, v = paged.live_kv(l, b)
            np.testing.assert_array_equal(arrays.to_numpy(k), directs[l].k[b])

    used = paged.pages_used
    with pytest.raises(KeyError):
        with paged.step([4, 4, 4]):  # takes pages, then the block raises
            assert paged.pages_used > used
            raise KeyError("model failed")
    assert paged.pages_used == used
    audit(paged)
    before = state(paged, arrays)
    with pytest.raises(OutOfPages, match="cannot supply"):
        paged.step([20, 20, 20])
    assert_same_state(before[:5], state(paged, arrays)[:5])
    paged.step([1, 0, 0]).abort()  # no step was left open
    audit(paged)


# -- sizing and the bench ------------------------------------------------------------------------


def test_memory_target_rows_of_100_and_100000():
    """The founding notes' case: rows of 100 and 100,000 tokens, max_len 131,072. The paged
    cache holds the live tokens rounded up to pages plus under 2% of metadata; the
    contiguous cache reserves 2 x 131,072 token slots."""
    from gqakv.storage import sizing

    for P in (16, 256):
        p = sizing.paged_cache_bytes("llama-3.1-8b", [100, 100_000], max_len=131_072, page_size=P)
        per = 131_072  # bytes per token, bfloat16, all 32 layers
        rounded = (pages_for(100, P) + pages_for(100_000, P)) * P
        assert p.pool_bytes == rounded * per
        assert p.total_bytes <= 1.02 * rounded * per
        assert p.contiguous_bytes == 2 * 131_072 * per
        assert p.contiguous_bytes / p.total_bytes > 2.6
    # the allocated cache agrees with the sizing (one layer, so 1/32 of the pool)
    cache = gqakv.PagedKVCache(2, 8, 131_072, 128, dtype="bfloat16", backend="numpy",
                               page_size=16, num_pages=pages_for(100, 16) + pages_for(100_000, 16))
    p = sizing.paged_cache_bytes("llama-3.1-8b", [100, 100_000], max_len=131_072, page_size=16)
    assert cache.nbytes * 32 == p.pool_bytes
    assert cache.store.page_table.nbytes == p.metadata_bytes
    with pytest.raises(ValueError, match=r"row_lens\[1\]=200000 exceeds max_len=131072"):
        sizing.paged_cache_bytes("gpt2", [1, 200_000], max_len=131_072)


def test_size_command_prints_paged_and_contiguous(capsys):
    from gqakv.tools import cli

    assert cli.main(["size", "llama-3.1-8b", "--max-len", "131072", "--rows", "100,100000"]) == 0
    out = capsys.readouterr().out
    assert "6,257 pages = 100,112 token slots (live 100,100)" in out
    assert "2 rows x max_len 131,072 = 34,359,738,368 bytes (32.0 GiB), 2.62x the paged cache" in out
    assert cli.main(["size", "--rows", "1,x"]) == 2
    assert capsys.readouterr().err.startswith("gqakv: error: --rows must be comma-separated")
    assert cli.main(["size", "--rows", "5", "--page-size", "0"]) == 2


def test_bench_on_a_paged_cache(capsys):
    import json

    from gqakv.tools import cli

    argv = ["bench", "--backend", "numpy", "--batch", "3", "--prompt-lens", "5,9,5", "--chunk", "4",
            "--steps", "3", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
            "--no-bandwidth", "--quiet"]
    assert cli.main(argv + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli.main(argv + ["--json", "--page-size", "4"]) == 0
    paged = json.loads(capsys.readouterr().out)
    # rows end at 8, 12, 8 tokens: 2 + 3 + 2 pages of 4, against 3 rows x 12 slots
    assert paged["pages"] == 7 and paged["cache_bytes"] == 7 * 4 * 2 * 2 * 8 * 4
    assert paged["contiguous_bytes"] == plain["cache_bytes"] == 3 * 12 * 2 * 2 * 8 * 4
    for key in ("live_bytes", "concat_bytes"):
        assert paged[key] == plain[key]
    assert paged["decode"]["kv_bytes_read"] == plain["decode"]["kv_bytes_read"]
    assert cli.main(argv + ["--page-size", "4"]) == 0
    assert "paged: 7 pages of 4 tokens (3,584 bytes)" in capsys.readouterr().out
    assert cli.main(argv + ["--page-size", "0"]) == 2


# -- the NumPy page-table kernel (numpy and numba backends) ---------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_numpy_paged_kernel_matches_contiguous(dtype, page_size, monkeypatch):
    """backends/numpy_readers.Pages under the item kernel: decode and chunks over shuffled
    pages (rows forked, so pages are shared and out of order), forced key splits on 2
    workers, gathered blocks smaller than a row, against attention_numpy on a contiguous
    cache with the same tokens."""
    from gqakv_backends import numpy_readers
    from gqakv_backends.numpy_attention import attention_numpy, attention_store
    from gqakv.core.inputs import validate_attention

    monkeypatch.setattr(numpy_readers, "GATHER_ELEMENTS", 4 * 8 * 8)  # a few pages per gather
    rng = np.random.default_rng(page_size)
    B, Hkv, G, d, S = 4, 2, 3, 8, 300
    plain = gqakv.KVCache(B, Hkv, S, d, dtype=dtype, backend="numpy")
    paged = gqakv.PagedKVCache(B, Hkv, S, d, dtype=dtype, backend="numpy", page_size=page_size)
    paged.store.fill(np.nan)
    for n in ([70, 0, 13, 200], [5, 1, 0, 31]):
        k, v = rng.standard_normal((2, B, Hkv, max(n), d)).astype(dtype)
        for c in (plain, paged):
            c.append(k, v, n)
    for c in (plain, paged):
        c.fork(3, [1])
    for T, n in ((1, [1, 1, 1, 0]), (9, [9, 4, 0, 9])):
        k, v = rng.standard_normal((2, B, Hkv, T, d)).astype(dtype)
        q = rng.standard_normal((B, Hkv * G, T, d)).astype(dtype)
        for c in (plain, paged):
            c.append(k, v, n)
        inputs = validate_attention(paged, q, n)
        kw = dict(workers=2, min_key_split=16, parallel_min_work=0, score_block_elements=256)
        want = attention_numpy(q, plain.k, plain.v, inputs.rows, inputs.lens, inputs.n_new,
                               scale=inputs.scale, return_lse=True, **kw)
        got = attention_store(q, paged.store, inputs, inputs.params, return_lse=True, **kw)
        tol = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3}[dtype]
        for a, b in zip(got, want):
            a, b = a.astype(np.float64), b.astype(np.float64)
            np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))
            np.testing.assert_allclose(a[np.isfinite(b)], b[np.isfinite(b)], atol=tol, rtol=tol)


# numba serves paged decode with its own kernels (tests/test_numba_storage.py) and hands
# long chunks here (test_long_chunks_over_paged_and_quantized_take_the_numpy_paths there)
@pytest.mark.parametrize("one_pass", [True, False])
def test_cpu_backends_route_paged_storage_to_the_page_table_kernel(one_pass, monkeypatch):
    """numpy reads pages through the page table: a small call's one pass gathers every
    row's keys once (``numpy_batch.gather_pages``), the items read each row's pages
    (``numpy_readers.Pages.read``)."""
    from gqakv_backends import numpy_batch, numpy_readers

    backend = gqakv.get_backend("numpy")
    if not one_pass:
        monkeypatch.setattr(numpy_batch, "BATCH_MAX_SCORES", 0)
    calls = []
    real = numpy_readers.Pages.read
    monkeypatch.setattr(numpy_readers.Pages, "read",
                        lambda *a, **k: calls.append("items") or real(*a, **k))
    gather = numpy_batch.gather_pages
    monkeypatch.setattr(numpy_batch, "gather_pages",
                        lambda *a, **k: calls.append("one pass") or gather(*a, **k))
    cache = gqakv.PagedKVCache(2, 1, 40, 4, backend=backend, page_size=4)
    x = np.random.default_rng(0).standard_normal((2, 1, 9, 4)).astype(np.float32)
    cache.append(x, x, [9, 5])
    q = np.random.default_rng(1).standard_normal((2, 2, 1, 4)).astype(np.float32)
    out = gqakv.gqa_attention(q, cache, [1, 1])
    # one gather for the batch, or one item per row, each read through its page table
    assert calls == (["one pass"] if one_pass else ["items", "items"])
    want, _ = reference_attention(q, [x[0], x[1, :, :5]], [x[0], x[1, :, :5]], [1, 1])
    np.testing.assert_allclose(out, want, atol=1e-5)
