"""The numba kernels over grouped codes (issue 29: ``int8_g32``, ``int4_g32``, ``int4_g64``,
``int4_g32_rotated``): a float32 scale per block of g values along d, 8-bit codes or two
4-bit codes per byte, decoded by the kernels in registers or a key block at a time
(``run_dots``; tests/support/dots_check.py holds the two to the same bits).

Every case appends chunked, ragged tokens (chunks the kernels serve, up to
``KERNEL_MAX_QUERIES``), forks a row and decodes, on contiguous rows and on pages (16,
and 5: not a power of two), and compares out and lse with the float64 loop reference over
the values the cache holds (the documented rule's dequantized values, rotated keys turned
back: tests/support/quantization.py, written apart from the library). A spy asserts that
the kernels ran, with the grouped layout; key splits over threads are forced once through
``attention_numba`` with tiny blocks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import gqakv

numba = pytest.importorskip("numba")

from gqakv_backends import numba_kernels as nk  # noqa: E402
from gqakv_backends.numba_backend import KERNEL_MAX_QUERIES, attention_numba, kernel_layout  # noqa: E402
from gqakv.core.inputs import validate_attention  # noqa: E402
from gqakv.core.semantics import AttentionParams  # noqa: E402
from gqakv.storage.codecs import GROUPED  # noqa: E402
from gqakv.tools.selftest import KV_DTYPES as SELFTEST_KV_DTYPES  # noqa: E402
from gqakv.tools.selftest import PAGED_KV_DTYPES as SELFTEST_PAGED_KV_DTYPES  # noqa: E402

from .support.quantization import held_grouped  # noqa: E402
from .support.reference import reference_attention  # noqa: E402
from .support.seeds import stable_seed  # noqa: E402
from .support.spies import kernel_layouts as spy_layouts  # noqa: E402

#: Small head dims that hold whole blocks: one block of 32 (or 64) and two.
HEAD_DIM = {32: 64, 64: 64}
STORAGES = {"contiguous": {}, "paged 16": {"storage": "paged", "page_size": 16},
            "paged 5": {"storage": "paged", "page_size": 5}}
SPLIT_EVERYTHING = dict(workers=3, query_block=2, min_key_split=2, key_block=5, parallel_min_work=0)


@pytest.fixture
def kernel_layouts(monkeypatch):
    """The K layout of every ``attention_items`` call, by type name."""
    return spy_layouts(monkeypatch)


def _prefilled(name, B, Hkv, d, L, n_new, rng, **storage):
    """A float32 numba cache of codec ``name`` holding ``n_new`` random tokens per row, and
    the rows it holds (float64, ``held_grouped``): (cache, rows_k, rows_v)."""
    cache = gqakv.KVCache(B, Hkv, L, d, dtype="float32", backend="numba", kv_dtype=name, **storage)
    T = max(n_new)
    k = rng.standard_normal((B, Hkv, T, d)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, T, d)).astype(np.float32)
    cache.append(k, v, n_new)
    rows_k = [np.zeros((Hkv, 0, d)) for _ in range(B)]
    rows_v = [np.zeros((Hkv, 0, d)) for _ in range(B)]
    _held_rows(rows_k, rows_v, k, v, n_new, name)
    return cache, rows_k, rows_v


def _held_rows(rows_k, rows_v, k, v, n_new, name):
    for b, n in enumerate(n_new):
        rows_k[b] = np.concatenate([rows_k[b], held_grouped(k[b, :, :n], name, True)], axis=1)
        rows_v[b] = np.concatenate([rows_v[b], held_grouped(v[b, :, :n], name, False)], axis=1)


def _check(out, lse, want, want_lse, dtype, what):
    # float32 q: the kernels' float32 arithmetic; bfloat16 q: one rounding of the output
    atol = 2e-5 if dtype == "float32" else 2.0 ** -7 * max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=atol, rtol=0, err_msg=what)
    lse = np.asarray(lse, np.float64)
    real = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[real], want_lse[real], atol=2e-4, rtol=0, err_msg=what)
    assert np.isneginf(lse[~real]).all(), what


@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("name", list(GROUPED))
def test_kernels_match_the_reference(name, storage, kernel_layouts):
    """Ragged chunks (an idle entry), a fork, decode steps with a window, soft-cap and
    sinks; the outputs match the float64 reference and every call ran the kernels."""
    dtype = "float32" if storage != "paged 16" else "bfloat16"
    rng = np.random.default_rng(stable_seed("numba grouped", name, storage))
    B, Hkv, G, d = 3, 2, 3, HEAD_DIM[GROUPED[name][1]]
    cache = gqakv.KVCache(B, Hkv, 80, d, dtype=dtype, backend="numba", kv_dtype=name,
                          **STORAGES[storage])
    rows_k = [np.zeros((Hkv, 0, d)) for _ in range(B)]
    rows_v = [np.zeros((Hkv, 0, d)) for _ in range(B)]
    be = cache.backend
    Tk = KERNEL_MAX_QUERIES
    variants = [{}, {}, {"window": 9, "softcap": 3.0, "sinks": [0.5, -1.0, 2.0, -np.inf, 1.0, 0.0]},
                {"window": 4}]
    schedule = [[Tk, 3, 0], [Tk - 1, Tk, 5], [1, 1, 1], [2, 1, 1]]
    for step, (n_new, variant) in enumerate(zip(schedule, variants)):
        if step == 2:
            cache.fork(0, [2])
            rows_k[2], rows_v[2] = rows_k[0].copy(), rows_v[0].copy()
        T = max(n_new)
        k = rng.standard_normal((B, Hkv, T, d)).astype(np.float32)
        k[..., 3] *= 25.0  # an outlier key channel
        v = rng.standard_normal((B, Hkv, T, d)).astype(np.float32)
        q = rng.standard_normal((B, Hkv * G, T, d)).astype(np.float32)
        qx = be.from_numpy(q, dtype)
        q64 = be.to_numpy(qx).astype(np.float64)  # the values q holds
        cache.append(be.from_numpy(k, dtype), be.from_numpy(v, dtype), n_new)
        _held_rows(rows_k, rows_v, np.asarray(be.to_numpy(be.from_numpy(k, dtype)), np.float32),
                   np.asarray(be.to_numpy(be.from_numpy(v, dtype)), np.float32), n_new, name)
        out, lse = gqakv.gqa_attention(qx, cache, n_new, return_lse=True, **variant)
        want, want_lse = reference_attention(q64, rows_k, rows_v, n_new, **variant)
        _check(be.to_numpy(out), be.to_numpy(lse), want, want_lse, dtype, f"step {step}")
    layout = "Grouped" if storage == "contiguous" else "PagedGrouped"
    assert kernel_layouts == [layout] * len(schedule)


@pytest.mark.parametrize("name", ["int4_g32", "int8_g32"])
def test_key_pieces_split_over_threads_merge_exactly(name):
    """Tiny key blocks, query blocks and key splits over 3 workers (``attention_numba``
    direct): the pieces' merge matches the reference, with ALiBi and a window."""
    rng = np.random.default_rng(stable_seed("numba grouped split", name))
    B, Hkv, G, d = 2, 2, 2, 64
    cache, rows_k, rows_v = _prefilled(name, B, Hkv, d, 64, [40, 23], rng, storage="paged",
                                       page_size=4)
    q = rng.standard_normal((B, Hkv * G, 3, d)).astype(np.float32)
    n_q = [3, 2]  # the last queries of each row
    variant = {"window": 17, "alibi_slopes": [0.5, 0.25, 0.125, 0.0625]}
    params = AttentionParams(scale=1 / math.sqrt(d), window=17,
                             alibi_slopes=np.asarray(variant["alibi_slopes"], np.float32))
    inputs = validate_attention(cache, q, n_q, params=params)
    k_buf, v_buf = kernel_layout(cache.store)
    assert isinstance(k_buf, nk.PagedGrouped)
    out, lse = attention_numba(q, k_buf, v_buf, inputs.rows, inputs.lens, inputs.n_new,
                               scale=params.scale, return_lse=True, params=params,
                               **SPLIT_EVERYTHING)
    want, want_lse = reference_attention(q, rows_k, rows_v, n_q, **variant)
    _check(out, lse, want, want_lse, "float32", "split")


def test_a_draft_tree_and_batch_invariant_mode_run_on_the_kernels(kernel_layouts):
    """A draft tree over rotated 4-bit keys (the tree clause composes with the reader), and
    batch-invariant mode: the same row's bits alone and in a batch."""
    name = "int4_g32_rotated"
    rng = np.random.default_rng(stable_seed("numba grouped tree"))
    B, Hkv, G, d = 2, 2, 2, 64
    cache, rows_k, rows_v = _prefilled(name, B, Hkv, d, 64, [30, 30], rng)
    T = 5
    parents = np.array([[-1, 0, 0, 1, -1], [-1, 0, 1, 2, 3]])
    k = rng.standard_normal((B, Hkv, T, d)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, T, d)).astype(np.float32)
    q = rng.standard_normal((B, Hkv * G, T, d)).astype(np.float32)
    cache.append(k, v, [T, T])
    _held_rows(rows_k, rows_v, k, v, [T, T], name)
    out, lse = gqakv.gqa_attention(q, cache, [T, T], tree=parents, return_lse=True)
    want, want_lse = reference_attention(q, rows_k, rows_v, [T, T], parents=parents)
    _check(out, lse, want, want_lse, "float32", "tree")
    with gqakv.batch_invariant():
        both = gqakv.gqa_attention(q, cache, [T, T], tree=parents)
        alone = gqakv.gqa_attention(q[1:], cache, [T], tree=parents[1:], rows=[1])
    np.testing.assert_array_equal(np.asarray(both)[1:], np.asarray(alone))
    assert kernel_layouts == ["Grouped"] * 3


@pytest.mark.parametrize("kv_dtype,paged", [
    *((kv, False) for kv in SELFTEST_KV_DTYPES if kv in GROUPED),
    *((kv, True) for kv in SELFTEST_PAGED_KV_DTYPES if kv in GROUPED)])
def test_selftest_grouped_lines_run_the_kernels(kernel_layouts, kv_dtype, paged):
    """``gqakv selftest --backend numba``'s grouped lines (contiguous and paged; quick,
    bfloat16) pass, and their decode and short chunks ran the kernels over the grouped
    layout (longer chunks: the BLAS path, by route)."""
    from gqakv.tools import selftest

    line = (selftest.PAGED_KV_DTYPES if paged else selftest.KV_DTYPES)[kv_dtype]
    checks = {line: selftest.Check(line, "bfloat16")}
    backend, rng = gqakv.get_backend("numba"), np.random.default_rng(0)
    if paged:
        selftest._paged(16, backend, "bfloat16", rng, True, checks, kv_dtype=kv_dtype)
    else:
        selftest._quantized(kv_dtype, backend, "bfloat16", rng, True, checks)
    assert checks[line].cases > 0 and checks[line].passed, checks[line].line()
    want = "PagedGrouped" if paged else "Grouped"
    assert kernel_layouts and set(kernel_layouts) == {want}, kernel_layouts


@numba.njit(cache=False)
def _dequantized(rows, scales, out):
    nk.dequantize_rows(rows, scales, rows.shape[0], out, 0)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [32, 64, 16, 8, 24])
def test_dequantized_rows_are_the_exact_products(bits, group):
    """``dequantize_rows`` (the kernels' decoder of grouped codes) gives exactly code x scale
    in float32, value 2i of a 4-bit byte from its low nibble, for every code: by 16-byte
    vectors where a group's codes fill whole vectors (32 and 64 values; 16 for 8-bit) and
    by the element loop otherwise (8, 24; and 16 values for 4-bit, 8 bytes a group); the
    expected values are NumPy's float32 products, compared bit for bit (a NaN, an infinite
    and a zero scale included)."""
    rng = np.random.default_rng(stable_seed("dequantized", bits, group))
    d, n = group * 6, 40
    scales = rng.standard_normal((n, d // group)).astype(np.float32)
    scales[0, 0], scales[1, 1], scales[2, 2] = np.nan, -np.inf, 0.0
    if bits == 8:
        rows = rng.integers(-128, 128, (n, d)).astype(np.int8)
        rows[3, :] = np.resize(np.arange(-128, 128), d)  # every code
        values = rows.astype(np.float32)
    else:
        rows = rng.integers(0, 256, (n, d // 2)).astype(np.uint8)
        rows[3, :] = np.resize(np.arange(256), d // 2)
        values = np.empty((n, d), np.float32)
        values[:, 0::2] = (rows & 15).astype(np.float32) - 8
        values[:, 1::2] = (rows >> 4).astype(np.float32) - 8
    want = values * np.repeat(scales, group, axis=1)
    got = np.full((n, d), 7.0, np.float32)
    _dequantized(rows, scales, got)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (
        f"{bits}-bit, groups of {group}: {np.sum(got.view(np.uint32) != want.view(np.uint32))} "
        "values differ from code x scale")
