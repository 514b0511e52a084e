"""Row operations (reorder, fork, truncate, reset) against a direct model of the cache.

The direct model is what the operations mean, written without gqakv: per layer, a
list of per-row float64 arrays ``[Hkv, L, d]`` that are concatenated, sliced and
copied by plain Python. Every test compares the cache's lengths and live tokens with
it exactly (copies must be bit-exact), and checks that only live tokens move.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import gqakv
from gqakv import row_ops


class DirectCache:
    """What a (model) KV cache should hold: ``k[layer][row]`` is ``[Hkv, L, d]`` float64."""

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int):
        empty = np.zeros((kv_heads, 0, head_dim))
        self.k = [[empty] * batch for _ in range(layers)]
        self.v = [[empty] * batch for _ in range(layers)]

    @property
    def lens(self) -> list[int]:
        return [r.shape[1] for r in self.k[0]]

    def append(self, layer, rows, k_new, v_new, n_new):
        """k_new, v_new: [B', Hkv, T, d] float64; entry i's first n_new[i] go to rows[i]."""
        for i, r in enumerate(rows):
            n = int(n_new[i])
            self.k[layer][r] = np.concatenate([self.k[layer][r], k_new[i, :, :n]], axis=1)
            self.v[layer][r] = np.concatenate([self.v[layer][r], v_new[i, :, :n]], axis=1)

    def reorder(self, src):
        for kv in (self.k, self.v):
            for layer in kv:
                layer[:] = [layer[s].copy() for s in src]

    def fork(self, src, dst):
        for kv in (self.k, self.v):
            for layer in kv:
                for d in dst:
                    layer[d] = layer[src].copy()

    def truncate(self, rows, new_lens):
        for kv in (self.k, self.v):
            for layer in kv:
                for r, n in zip(rows, new_lens):
                    layer[r] = layer[r][:, :n]

    def reset(self, rows):
        self.truncate(rows, [0] * len(rows))


def layer_caches(cache):
    """Per-layer KVCache objects of a KVCache (itself) or a ModelKVCache (its views)."""
    if isinstance(cache, gqakv.ModelKVCache):
        return [cache.layer(l) for l in range(cache.layers)]
    return [cache]


def assert_matches(cache, direct: DirectCache, arrays):
    """Lengths equal and every row's live K/V bit-equal to the direct model, on every layer."""
    np.testing.assert_array_equal(cache.host_lens, direct.lens)
    for l, layer in enumerate(layer_caches(cache)):
        for b in range(layer.batch):
            k, v = layer.live_kv(b)
            np.testing.assert_array_equal(arrays.to_numpy(k), direct.k[l][b], err_msg=f"K layer {l} row {b}")
            np.testing.assert_array_equal(arrays.to_numpy(v), direct.v[l][b], err_msg=f"V layer {l} row {b}")


def snapshot(cache, arrays):
    """Full copies of the buffers (dead slots too) and the lengths."""
    return (arrays.to_numpy(cache.k).copy(), arrays.to_numpy(cache.v).copy(), cache.host_lens.copy())


def assert_unchanged(cache, arrays, before):
    k, v, lens = before
    np.testing.assert_array_equal(cache.host_lens, lens)
    np.testing.assert_array_equal(arrays.to_numpy(cache.k), k)  # NaN == NaN here
    np.testing.assert_array_equal(arrays.to_numpy(cache.v), v)


def fill_nan(cache):
    """Poison every slot: a dead token that leaks into live data or attention shows up."""
    cache.store.fill(float("nan"))


def make_cache(kind, backend, *, layers=2, batch=4, kv_heads=2, max_len=12, head_dim=3,
               dtype="float64"):
    if kind == "model":
        cache = gqakv.ModelKVCache(layers, batch, kv_heads, max_len, head_dim, dtype, backend)
    else:
        cache = gqakv.KVCache(batch, kv_heads, max_len, head_dim, dtype, backend)
    fill_nan(cache)
    nl = layers if kind == "model" else 1
    return cache, DirectCache(nl, batch, kv_heads, head_dim)


def fill_rows(cache, direct, arrays, lens, rng, dtype="float64"):
    """Append ``lens[b]`` random tokens to each row (all layers) and mirror them."""
    lens = np.asarray(lens)
    T = max(1, int(lens.max()))
    B, hkv, d = cache.batch, cache.kv_heads, cache.head_dim
    layers = layer_caches(cache)
    data = [(rng.standard_normal((B, hkv, T, d)), rng.standard_normal((B, hkv, T, d)))
            for _ in layers]
    # Round to the cache dtype first so the direct model holds exactly what is stored.
    data = [tuple(arrays.to_numpy(arrays.asarray(x, dtype)) for x in kv) for kv in data]
    if isinstance(cache, gqakv.ModelKVCache):
        with cache.step(lens) as step:
            for l, (k, v) in enumerate(data):
                step.write(l, arrays.asarray(k, dtype), arrays.asarray(v, dtype))
    else:
        cache.append(arrays.asarray(data[0][0], dtype), arrays.asarray(data[0][1], dtype), lens)
    for l, (k, v) in enumerate(data):
        direct.append(l, range(B), k, v, lens)


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
