"""Row operations (reorder, fork, truncate, reset) against a direct model of the cache.

The direct model (tests/support/direct.py) is what the operations mean, written without
gqakv: per layer, a list of per-row float64 arrays ``[Hkv, L, d]`` that are concatenated,
sliced and copied by plain Python. Every test compares the cache's lengths and live tokens
with it exactly (copies must be bit-exact), and checks that only live tokens move.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import gqakv
from gqakv.ops import row_ops

from .support.direct import assert_matches, assert_unchanged, fill_rows, make_cache, snapshot

KINDS = ["model", "single"]
# Copies are bit-exact in every dtype. On the cupy backend float64 takes the generic slice
# copies; at head_dim 4 float32 takes the fused copy kernel's 16-byte vector loads and
# bfloat16 its scalar loads.
COPY_DTYPES = ["float64", "float32", "bfloat16"]


@pytest.fixture
def copies(monkeypatch, backend):
    """Records every Backend.copy_tokens call as (dst_rows, src_rows, n_tokens)."""
    calls = []
    original = backend.copy_tokens

    def recording(dst, dst_rows, src, src_rows, n_tokens):
        calls.append((list(map(int, dst_rows)), list(map(int, src_rows)), list(map(int, n_tokens))))
        return original(dst, dst_rows, src, src_rows, n_tokens)

    monkeypatch.setattr(backend, "copy_tokens", recording)
    return calls


def _cycles_extra(src, lens):
    """Tokens the temporary costs: the shortest row of each permutation cycle, once."""
    seen, extra = set(), 0
    src = list(src)
    for b in range(len(src)):
        if b in seen or src[b] == b:
            continue
        path, x = [], b
        while x not in seen and x not in path:
            path.append(x)
            x = src[x]
        if x in path:  # found a cycle: x ... back to x
            cyc = path[path.index(x):]
            extra += min(lens[c] for c in cyc) if len(cyc) > 1 else 0
        seen.update(path)
    return extra


# -- reorder ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("src", [
    [0, 1, 2, 3],  # identity: nothing moves
    [0, 0, 1, 1],  # beam search: two survivors, each duplicated
    [1, 0, 3, 2],  # two swaps (cycles of 2)
    [1, 2, 3, 0],  # one 4-cycle
    [3, 3, 3, 3],  # one row everywhere
    [2, 0, 0, 1],  # chain feeding a duplicate
    [1, 0, 2, 2],  # a cycle next to a duplicate
])
@pytest.mark.parametrize("dtype", COPY_DTYPES)
def test_reorder_matches_direct_model(kind, src, dtype, backend, arrays, copies):
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} has no {dtype}")
    cache, direct = make_cache(kind, backend, dtype=dtype, head_dim=4)
    lens = [5, 0, 7, 2]
    fill_rows(cache, direct, arrays, lens, np.random.default_rng(1), dtype=dtype)
    cache.reorder(src)
    direct.reorder(src)
    assert_matches(cache, direct, arrays)
    moved = sum(n for _, _, ns in copies for n in ns)
    want = sum(lens[s] for b, s in enumerate(src) if s != b) + _cycles_extra(src, lens)
    assert moved == want  # live tokens only, never max_len
    assert all(n <= max(lens) for _, _, ns in copies for n in ns)


def _simulate(plan, src, lens):
    """Run a plan on labelled rows; returns final row labels and checks wave independence."""
    rows = [(b, lens[b]) for b in range(len(src))]  # (label of the content, its length)
    temp = None
    for w in plan:
        dst, srcs = list(w.dst_rows), list(w.src_rows)
        assert not set(dst) & set(srcs), f"wave {w} reads a row it writes"
        assert len(set(dst)) == len(dst)
        if row_ops.TEMP in dst or row_ops.TEMP in srcs:
            assert len(dst) == 1
        reads = [temp if s == row_ops.TEMP else rows[s] for s in srcs]
        for (label, n), ntok in zip(reads, w.n_tokens):
            assert ntok == n  # copies the live tokens of what it reads, exactly
        for d, r in zip(dst, reads):
            if d == row_ops.TEMP:
                temp = r
            else:
                rows[d] = r
    return [label for label, _ in rows]


def test_plan_reorder_is_correct_for_every_small_mapping():
    for B in range(1, 6):
        lens = [(3 * b + 1) % 7 for b in range(B)]
        for src in itertools.product(range(B), repeat=B):
            plan = row_ops.plan_reorder(np.array(src), np.array(lens))
            assert _simulate(plan, src, lens) == list(src)
            temps = sum(1 for w in plan if w.dst_rows[0] == row_ops.TEMP)
            perm_cycles = _count_pure_cycles(src)
            assert temps == perm_cycles  # the temporary only breaks real cycles


def _count_pure_cycles(src):
    """Cycles of length > 1 in the mapping b <- src[b] (each needs the temporary once)."""
    count, seen = 0, set()
    for b in range(len(src)):
        x, path = b, []
        while x not in seen and x not in path:
            path.append(x)
            x = src[x]
        if x in path and len(path) - path.index(x) > 1:
            count += 1
        seen.update(path)
    return count


def test_plan_reorder_waves_batch_independent_copies():
    # beam search over 8 rows: survivors 0, 3 and 5 fan out; writes form 2 waves, no temp
    src = np.array([0, 0, 0, 3, 3, 5, 5, 5])
    plan = row_ops.plan_reorder(src, np.arange(8) + 1)
    assert len(plan) <= 2 and all(w.dst_rows[0] != row_ops.TEMP for w in plan)


# -- fork, truncate, reset ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", COPY_DTYPES)
def test_fork_copies_live_prefix(kind, dtype, backend, arrays, copies):
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} has no {dtype}")
    cache, direct = make_cache(kind, backend, dtype=dtype, head_dim=4)
    fill_rows(cache, direct, arrays, [4, 6, 0, 1], np.random.default_rng(2), dtype=dtype)
    cache.fork(1, [0, 3, 1])  # src listed among dst: a no-op for it
    direct.fork(1, [0, 3])
    assert_matches(cache, direct, arrays)
    assert sum(n for _, _, ns in copies for n in ns) == 2 * 6


@pytest.mark.parametrize("kind", KINDS)
def test_truncate_moves_no_data_and_next_append_overwrites(kind, backend, arrays, copies):
    rng = np.random.default_rng(3)
    cache, direct = make_cache(kind, backend)
    fill_rows(cache, direct, arrays, [5, 3, 2, 6], rng)
    before_k = arrays.to_numpy(cache.k).copy()
    cache.truncate([0, 3, 2], [2, 6, 0])
    direct.truncate([0, 3, 2], [2, 6, 0])
    assert copies == []
    np.testing.assert_array_equal(arrays.to_numpy(cache.k), before_k)  # O(1): nothing moved
    assert_matches(cache, direct, arrays)
    # speculative decoding: the rejected tokens' slots are overwritten by the next append
    fill_rows(cache, direct, arrays, [3, 1, 4, 0], rng)
    assert_matches(cache, direct, arrays)


@pytest.mark.parametrize("kind", KINDS)
def test_reset_empties_rows_for_reuse(kind, backend, arrays, copies):
    rng = np.random.default_rng(4)
    cache, direct = make_cache(kind, backend)
    fill_rows(cache, direct, arrays, [5, 3, 2, 6], rng)
    cache.reset([1, 3])
    direct.reset([1, 3])
    assert copies == []
    assert_matches(cache, direct, arrays)
    fill_rows(cache, direct, arrays, [0, 4, 0, 2], rng)
    assert_matches(cache, direct, arrays)
    cache.reset()
    direct.reset(range(4))
    assert_matches(cache, direct, arrays)


# -- validation: a clear error, and nothing changed -------------------------------------------


BAD = [
    ("reorder", ([0, 1, 4, 2],), ValueError, ["src_rows[2]=4", "4 rows"]),
    ("reorder", ([0, -1, 2, 3],), ValueError, ["src_rows[1]=-1"]),
    ("reorder", ([0, 1, 2],), ValueError, ["one entry per cache row (4)", "got 3"]),
    ("reorder", ([0.0, 1.0, 2.0, 3.0],), TypeError, ["integer dtype"]),
    ("fork", (4, [0]), ValueError, ["src=4", "4 rows"]),
    ("fork", (0, [1, 7]), ValueError, ["dst_rows[1]=7"]),
    ("fork", (0, [1, 1]), ValueError, ["distinct", "row 1 repeats"]),
    ("fork", (1.0, [0]), TypeError, ["src must be an int"]),
    ("truncate", ([0, 1], [2, 4]), ValueError, ["new_lens[1]=4", "0..3", "row 1"]),
    ("truncate", ([0], [-1]), ValueError, ["new_lens[0]=-1", "0..5"]),
    ("truncate", ([0, 0], [1, 1]), ValueError, ["distinct"]),
    ("truncate", ([0, 1], [1]), ValueError, ["new_lens must have shape [2]"]),
    ("truncate", ([9], [0]), ValueError, ["rows[0]=9"]),
    ("reset", ([0, 5],), ValueError, ["rows[1]=5"]),
    ("reset", ([2, 2],), ValueError, ["distinct"]),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op,args,exc,words", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_row_operation_changes_nothing(kind, op, args, exc, words, backend, arrays, copies):
    cache, direct = make_cache(kind, backend)
    fill_rows(cache, direct, arrays, [5, 3, 0, 6], np.random.default_rng(5))
    before = snapshot(cache, arrays)
    with pytest.raises(exc) as info:
        getattr(cache, op)(*args)
    for w in words:
        assert w in str(info.value)
    assert copies == []
    assert_unchanged(cache, arrays, before)


def test_layer_views_refuse_to_move_rows(backend):
    cache = gqakv.ModelKVCache(2, 2, 1, 4, 2, backend=backend)
    view = cache.layer(1)
    for call in (lambda: view.reorder([1, 0]), lambda: view.fork(0, [1]),
                 lambda: view.truncate([0], [0]), lambda: view.reset()):
        with pytest.raises(RuntimeError, match="one layer of a ModelKVCache"):
            call()
