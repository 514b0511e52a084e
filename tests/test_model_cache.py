"""ModelKVCache: one allocation for all layers, a transactional forward step, row
operations and the row indirection, checked step by step against a direct model of
the cache (tests/test_row_ops.DirectCache) and the float64 reference attention."""

from __future__ import annotations

import re

import numpy as np
import pytest

import gqakv

from .support.direct import DirectCache, assert_matches, assert_unchanged, fill_nan, snapshot
from .support.reference import reference_attention

TOL = {"float64": 1e-10, "float32": 2e-5}  # as in test_attention: O(1) data, ~170 float32 ulps


def _dtypes(backend, wanted=("float32", "float64")):
    return [d for d in wanted if d in backend.dtypes]


def random_step(cache, direct, arrays, rng, rows, n_new, *, group=2, T=None, dtype="float64",
                check=True):
    """One forward step over all layers with random q/k/v; compares each layer's output
    with the reference over the direct model's rows (which it updates)."""
    B = len(rows)
    T = max(1, int(max(n_new, default=0))) if T is None else T
    hkv, d = cache.kv_heads, cache.head_dim
    with cache.step(n_new, rows=rows) as step:
        np.testing.assert_array_equal(step.starts, [direct.lens[r] for r in rows])
        for l in range(cache.layers):
            q, k, v = (arrays.to_numpy(arrays.asarray(rng.standard_normal(s), dtype))
                       for s in ((B, hkv * group, T, d), (B, hkv, T, d), (B, hkv, T, d)))
            out, lse = step.attend(l, arrays.asarray(q, dtype), arrays.asarray(k, dtype),
                                   arrays.asarray(v, dtype), return_lse=True)
            direct.append(l, rows, k, v, n_new)
            if check:
                want, want_lse = reference_attention(
                    q, [direct.k[l][r] for r in rows], [direct.v[l][r] for r in rows], n_new)
                np.testing.assert_allclose(arrays.to_numpy(out), want, rtol=0, atol=TOL[dtype],
                                           err_msg=f"layer {l}")
                np.testing.assert_allclose(arrays.to_numpy(lse), want_lse, rtol=0, atol=TOL[dtype])
        # inside the step, nothing is live yet: other readers still see the old lengths
        np.testing.assert_array_equal(cache.host_lens, [
            direct.lens[b] - (int(n_new[list(rows).index(b)]) if b in rows else 0)
            for b in range(cache.batch)])


# -- one allocation, layer views --------------------------------------------------------------


def test_one_allocation_with_layer_views(backend, arrays):
    cache = gqakv.ModelKVCache(3, 2, 2, 8, 4, backend=backend)
    assert tuple(cache.k.shape) == tuple(cache.v.shape) == (3, 2, 2, 8, 4)
    assert cache.nbytes == 2 * 3 * 2 * 2 * 8 * 4 * 4 == gqakv.ModelKVCache.nbytes_for(3, 2, 2, 8, 4)
    fill_nan(cache)
    direct = DirectCache(3, 2, 2, 4)
    random_step(cache, direct, arrays, np.random.default_rng(0), [0, 1], [3, 1], dtype="float32")
    # layer views read the shared buffers and the shared lengths
    for l in range(3):
        view = cache.layer(l)
        assert view.host_lens is not None and list(view.host_lens) == [3, 1]
        np.testing.assert_array_equal(arrays.to_numpy(cache.k[l, 0, :, :3, :]), direct.k[l][0])
        np.testing.assert_array_equal(arrays.to_numpy(view.k[0, :, :3, :]), direct.k[l][0])
    if backend.name == "numpy":
        assert all(np.shares_memory(cache.layer(l).k, cache.k) for l in range(3))
    assert_matches(cache, direct, arrays)


def test_layer_view_refuses_append(backend, arrays):
    cache = gqakv.ModelKVCache(2, 1, 1, 4, 2, backend=backend)
    k = arrays.asarray(np.zeros((1, 1, 1, 2)), "float32")
    with pytest.raises(RuntimeError, match="ModelKVCache.step"):
        cache.layer(0).append(k, k, [1])
    assert list(cache.host_lens) == [0]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_chunked_prefill_then_decode_with_row_indirection(dtype, backend, arrays):
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} does not declare {dtype}")
    rng = np.random.default_rng(1)
    cache = gqakv.ModelKVCache(2, 5, 2, 20, 4, dtype, backend)
    fill_nan(cache)
    direct = DirectCache(2, 5, 2, 4)
    rows = [3, 0, 4]  # the active requests sit in arbitrary rows of a larger cache
    random_step(cache, direct, arrays, rng, rows, [6, 2, 0], dtype=dtype, T=8)  # padded chunk
    random_step(cache, direct, arrays, rng, rows, [3, 5, 4], dtype=dtype)       # chunked prefill
    for _ in range(3):
        random_step(cache, direct, arrays, rng, rows, [1, 1, 1], dtype=dtype)   # decode
    random_step(cache, direct, arrays, rng, [1], [2], dtype=dtype)              # a newcomer
    assert_matches(cache, direct, arrays)
    # read-side attention through a layer view, with the row indirection
    q = rng.standard_normal((2, 4, 2, 4))
    out = gqakv.gqa_attention(arrays.asarray(q, dtype), cache.layer(1), [2, 1], rows=[0, 3])
    want, _ = reference_attention(q, [direct.k[1][0], direct.k[1][3]],
                                  [direct.v[1][0], direct.v[1][3]], [2, 1])
    np.testing.assert_allclose(arrays.to_numpy(out), want, rtol=0, atol=TOL[dtype])


# -- the step is a transaction ----------------------------------------------------------------


def test_exception_inside_step_changes_nothing_live(backend, arrays):
    rng = np.random.default_rng(2)
    cache = gqakv.ModelKVCache(3, 2, 1, 10, 2, backend=backend)
    fill_nan(cache)
    direct = DirectCache(3, 2, 1, 2)
    random_step(cache, direct, arrays, rng, [0, 1], [4, 2], dtype="float32")
    k = arrays.asarray(rng.standard_normal((2, 1, 3, 2)), "float32")
    q = arrays.asarray(rng.standard_normal((2, 2, 3, 2)), "float32")
    with pytest.raises(ZeroDivisionError):
        with cache.step([3, 1]) as step:
            step.attend(0, q, k, k)
            step.attend(1, q, k, k)
            1 / 0  # the model fails in layer 2
    assert_matches(cache, direct, arrays)  # lengths and every live token as before
    # the cache is usable again, and the dead slots written above get overwritten
    random_step(cache, direct, arrays, rng, [0, 1], [3, 1], dtype="float32")
    assert_matches(cache, direct, arrays)


def test_step_missing_a_layer_does_not_commit(backend, arrays):
    cache = gqakv.ModelKVCache(3, 1, 1, 4, 2, backend=backend)
    k = arrays.asarray(np.ones((1, 1, 1, 2)), "float32")
    with pytest.raises(RuntimeError, match=r"1 of 3 layers were never written \(layers 2\)"):
        with cache.step([1]) as step:
            step.write(0, k, k)
            step.write(1, k, k)
    assert list(cache.host_lens) == [0]
    with cache.step([1]) as step:  # not locked
        for l in range(3):
            step.write(l, k, k)
    assert list(cache.host_lens) == [1]


def test_step_rejects_writing_a_layer_twice(backend, arrays):
    cache = gqakv.ModelKVCache(2, 1, 1, 4, 2, backend=backend)
    k = arrays.asarray(np.ones((1, 1, 1, 2)), "float32")
    with pytest.raises(ValueError, match="layer 0 was already written"):
        with cache.step([1]) as step:
            step.write(0, k, k)
            step.write(0, k, k)
    assert list(cache.host_lens) == [0]


def test_step_validates_capacity_up_front(backend, arrays):
    cache = gqakv.ModelKVCache(2, 3, 1, 4, 2, backend=backend)
    direct = DirectCache(2, 3, 1, 2)
    random_step(cache, direct, arrays, np.random.default_rng(3), [0, 1, 2], [1, 3, 0],
                dtype="float32", check=False)
    before = snapshot(cache, arrays)
    with pytest.raises(ValueError, match=r"row 1 holds 3 tokens; appending n_new\[1\]=2 would make 5 > max_len=4"):
        cache.step([1, 2, 0])
    with pytest.raises(ValueError, match=r"rows\[1\]=3 is out of range"):
        cache.step([1, 1], rows=[0, 3])
    with pytest.raises(ValueError, match="distinct"):
        cache.step([1, 1], rows=[2, 2])
    with pytest.raises(ValueError, match=r"n_new\[0\]=-1"):
        cache.step([-1, 0, 0])
    with pytest.raises(ValueError, match=r"shape \[3\]"):
        cache.step([1, 1])
    assert_unchanged(cache, arrays, before)
    cache.step([1, 1, 1]).abort()  # and no step was left open by the failures


def test_bad_layer_input_is_rejected_before_writing(backend, arrays):
    cache = gqakv.ModelKVCache(1, 2, 2, 6, 4, backend=backend)
    fill_nan(cache)
    before = snapshot(cache, arrays)
    k = arrays.asarray(np.ones((2, 2, 2, 4)), "float32")
    bad = {
        "q heads": (arrays.asarray(np.ones((2, 3, 2, 4)), "float32"), k, "multiple of"),
        "q tokens": (arrays.asarray(np.ones((2, 4, 3, 4)), "float32"), k, "same batch"),
        "k head dim": (arrays.asarray(np.ones((2, 4, 2, 4)), "float32"),
                       arrays.asarray(np.ones((2, 2, 2, 3)), "float32"), "d=3"),
        "T < n_new": (arrays.asarray(np.ones((2, 4, 1, 4)), "float32"),
                      arrays.asarray(np.ones((2, 2, 1, 4)), "float32"), "n_new[0]=2"),
    }
    with cache.step([2, 1]) as step:
        for name, (q, kk, words) in bad.items():
            with pytest.raises((ValueError, TypeError), match=re.escape(words)):
                step.attend(0, q, kk, kk)
        assert_unchanged(cache, arrays, before)  # not even dead slots were written
        step.attend(0, arrays.asarray(np.ones((2, 4, 2, 4)), "float32"), k, k)  # retry works
    assert list(cache.host_lens) == [2, 1]


def test_no_other_write_while_a_step_is_open(backend):
    cache = gqakv.ModelKVCache(1, 2, 1, 4, 2, backend=backend)
    step = cache.step([1, 0])
    for call in (lambda: cache.step([1, 1]), lambda: cache.reorder([1, 0]),
                 lambda: cache.fork(0, [1]), lambda: cache.truncate([0], [0]), cache.reset):
        with pytest.raises(RuntimeError, match="a step is open"):
            call()
    step.abort()
    with pytest.raises(RuntimeError, match="already aborted"):
        step.layer(0)
    cache.reset()


# -- randomized serving loop: hundreds of operations, step by step ------------------------------


def _random_rows(rng, batch, k):
    return sorted(rng.choice(batch, size=k, replace=False).tolist())


@pytest.mark.parametrize("seed", [0, 1])
def test_random_serving_loop_matches_direct_model(seed, backend, arrays):
    dtype = "float64" if "float64" in backend.dtypes else "float32"
    rng = np.random.default_rng(seed)
    layers, B, hkv, S, d = 2, 4, 2, 16, 3
    cache = gqakv.ModelKVCache(layers, B, hkv, S, d, dtype, backend)
    fill_nan(cache)
    direct = DirectCache(layers, B, hkv, d)
    counts = {}
    for _ in range(400):
        op = rng.choice(["step", "step", "reorder", "fork", "truncate", "reset", "attend",
                         "bad", "abort"])
        counts[op] = counts.get(op, 0) + 1
        lens = np.array(direct.lens)
        if op == "step":
            rows = _random_rows(rng, B, int(rng.integers(1, B + 1)))
            n = [int(rng.integers(0, min(4, S - lens[r]) + 1)) for r in rows]
            random_step(cache, direct, arrays, rng, rows, n, group=int(rng.integers(1, 3)),
                        dtype=dtype)
        elif op == "reorder":
            src = (rng.permutation(B) if rng.random() < 0.4 else rng.integers(0, B, B)).tolist()
            cache.reorder(src)
            direct.reorder(src)
        elif op == "fork":
            src = int(rng.integers(B))
            dst = _random_rows(rng, B, int(rng.integers(0, B)))
            cache.fork(src, dst)
            direct.fork(src, [x for x in dst if x != src])
        elif op == "truncate":
            rows = _random_rows(rng, B, int(rng.integers(1, B + 1)))
            new = [int(rng.integers(0, lens[r] + 1)) for r in rows]
            cache.truncate(rows, new)
            direct.truncate(rows, new)
        elif op == "reset":
            rows = _random_rows(rng, B, int(rng.integers(1, B + 1)))
            cache.reset(rows)
            direct.reset(rows)
        elif op == "attend":  # read-only attention over the last n live tokens of some rows
            rows = rng.integers(0, B, int(rng.integers(1, 4))).tolist()  # repeats allowed
            n = [int(rng.integers(0, lens[r] + 1)) for r in rows]
            l = int(rng.integers(layers))
            q = rng.standard_normal((len(rows), hkv * 2, max(1, max(n)), d))
            out = gqakv.gqa_attention(arrays.asarray(q, dtype), cache.layer(l), n, rows=rows)
            want, _ = reference_attention(q, [direct.k[l][r] for r in rows],
                                          [direct.v[l][r] for r in rows], n)
            np.testing.assert_allclose(arrays.to_numpy(out), want, rtol=0, atol=TOL[dtype])
        elif op == "bad":  # an invalid call of some kind: an error, and nothing changed
            before = snapshot(cache, arrays)
            full = [r for r in range(B) if lens[r] == S] or [int(np.argmax(lens))]
            call = [
                lambda: cache.reorder([B] + [0] * (B - 1)),
                lambda: cache.fork(0, [B]),
                lambda: cache.truncate([0], [lens[0] + 1]),
                lambda: cache.reset([0, 0]),
                lambda: cache.step([S - lens[full[0]] + 1], rows=[full[0]]),
            ][int(rng.integers(5))]
            with pytest.raises(ValueError):
                call()
            assert_unchanged(cache, arrays, before)
        elif op == "abort":  # the model raises in the middle of a step
            rows = _random_rows(rng, B, int(rng.integers(1, B + 1)))
            n = [int(rng.integers(0, S - lens[r] + 1)) for r in rows]
            k = arrays.asarray(rng.standard_normal((len(rows), hkv, max(1, max(n)), d)), dtype)
            with pytest.raises(KeyError):
                with cache.step(n, rows=rows) as step:
                    step.write(0, k, k)
                    raise KeyError("model failed")
        assert_matches(cache, direct, arrays)  # no drift, after every operation
    assert counts.get("step", 0) > 30 and all(counts.get(o, 0) > 5 for o in
                                             ("reorder", "fork", "truncate", "reset", "bad"))


def test_allocation_that_cannot_fit_names_its_size():
    layers, B, hkv, S, d = 80, 4096, 8, 131072, 128  # 2.5 PiB of float32
    want = gqakv.ModelKVCache.nbytes_for(layers, B, hkv, S, d)
    with pytest.raises(MemoryError, match=f"model KV cache of {want:,} bytes"):
        gqakv.ModelKVCache(layers, B, hkv, S, d, backend="numpy")


def test_step_layer_view_only_after_the_layer_is_written(backend, arrays):
    """A step's view of a layer counts the step's tokens; before the layer is written those
    slots hold nothing, so the view is refused until then."""
    cache = gqakv.ModelKVCache(2, 1, 1, 4, 2, backend=backend)
    kv = arrays.asarray(np.ones((1, 1, 2, 2)), "float32")
    with cache.step([2]) as step:
        with pytest.raises(RuntimeError, match="layer 1 is not written yet"):
            step.layer(1)
        step.write(0, kv, kv)
        out = gqakv.gqa_attention(arrays.asarray(np.ones((1, 2, 2, 2)), "float32"), step.layer(0),
                                  step.n_new, rows=step.rows)
        np.testing.assert_allclose(arrays.to_numpy(out), 1.0, atol=1e-6)
        step.attend(1, arrays.asarray(np.ones((1, 2, 2, 2)), "float32"), kv, kv)
    assert list(cache.host_lens) == [2]


def test_model_cache_lens_snapshot(backend, arrays):
    cache = gqakv.ModelKVCache(2, 2, 1, 4, 2, backend=backend)
    lens = cache.lens
    try:
        lens[1] = 3
    except (ValueError, TypeError, RuntimeError):
        pass
    np.testing.assert_array_equal(cache.host_lens, [0, 0])
    with pytest.raises(ValueError, match="holds 0 tokens"):
        cache.truncate([1], [1])


@pytest.mark.parametrize("rows", [np.array(1), 1])
def test_step_rows_without_length_is_a_clear_error(backend, rows):
    cache = gqakv.ModelKVCache(1, 3, 1, 4, 2, backend=backend)
    with pytest.raises((TypeError, ValueError), match="rows"):
        cache.step(np.array([1]), rows=rows)
    cache.step([0, 0, 0]).abort()  # no step was left open by the refused call


# -- the serving loop on the fast paths ----------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("storage", ["contiguous", "paged", "int8", "paged+int8"])
def test_serving_loop_on_the_fast_paths(storage, dtype, backend, arrays, route_spy):
    """A short random serving loop (steps of decode and short chunks over some rows, forks,
    reorders, truncates, aborted steps, read-only attention over other rows) in the
    kernels' dtypes, on contiguous, paged and 8-bit caches (tests/conftest.py
    STORAGE_SPECS), against the direct model after every operation and the float64
    reference at every step (bfloat16 by the same-dtype naive rule); every append, copy
    and attention ran what ``route()`` names and the path meant."""
    from .support.product import STORAGE_SPECS
    from .support.parity import LOW_PRECISION, assert_matches_reference, low_precision_bounds
    from .support.routes import assert_product_routes
    from .support.quantization import held

    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} has no {dtype}")
    spec = STORAGE_SPECS[storage]
    spy = route_spy(backend)
    rng = np.random.default_rng([len(storage), len(dtype)])
    layers, B, hkv, S, d, group = 2, 4, 2, 16, 8, 2
    cache = gqakv.ModelKVCache(layers, B, hkv, S, d, dtype, backend, **spec)
    fill_nan(cache)
    direct = DirectCache(layers, B, hkv, d)

    def values(shape):  # random values as the dtype holds them (float64)
        return arrays.to_numpy(arrays.asarray(rng.standard_normal(shape), dtype))

    def check(out, lse, q, rows, n, layer, what):
        k_rows = [direct.k[layer][r] for r in rows]
        v_rows = [direct.v[layer][r] for r in rows]
        want, want_lse = reference_attention(q, k_rows, v_rows, n)
        bounds = (low_precision_bounds(dtype, want, want_lse, q, k_rows, v_rows, n, None)
                  if dtype in LOW_PRECISION else None)
        assert_matches_reference(arrays.to_numpy(out), None if lse is None else
                                 arrays.to_numpy(lse), want, want_lse, dtype, bounds, what=what)

    counts: dict[str, int] = {}
    ops = 30 if backend.name == "cupy_emulated" else 60  # the emulator runs each launch slowly
    for i in range(ops):
        op = ["step", "step", "step", "fork", "reorder", "truncate", "attend",
              "abort"][int(rng.integers(8))] if i >= 2 else "step"
        counts[op] = counts.get(op, 0) + 1
        lens = np.array(direct.lens)
        if op == "step":
            rows = _random_rows(rng, B, int(rng.integers(1, B + 1)))
            n = [int(rng.integers(0 if i else 2, min(4, S - lens[r]) + 1)) for r in rows]
            T = max(1, max(n))
            with cache.step(n, rows=rows) as st:
                for l in range(layers):
                    q, k, v = (values(s) for s in ((len(rows), hkv * group, T, d),
                                                   (len(rows), hkv, T, d), (len(rows), hkv, T, d)))
                    out, lse = st.attend(l, *(arrays.asarray(x, dtype) for x in (q, k, v)),
                                         return_lse=True)
                    direct.append(l, rows, held(k, spec), held(v, spec), n)
                    check(out, lse, q, rows, n, l, f"step {i} layer {l}")
        elif op == "fork":
            src = int(rng.integers(B))
            dst = _random_rows(rng, B, int(rng.integers(1, B)))
            cache.fork(src, dst)
            direct.fork(src, [x for x in dst if x != src])
        elif op == "reorder":
            src = rng.integers(0, B, B).tolist()
            cache.reorder(src)
            direct.reorder(src)
        elif op == "truncate":
            rows = _random_rows(rng, B, int(rng.integers(1, B + 1)))
            new = [int(rng.integers(0, lens[r] + 1)) for r in rows]
            cache.truncate(rows, new)
            direct.truncate(rows, new)
        elif op == "attend":  # read-only, rows repeated
            rows = rng.integers(0, B, 3).tolist()
            n = [int(rng.integers(0, min(lens[r], 3) + 1)) for r in rows]
            l = int(rng.integers(layers))
            q = values((len(rows), hkv * group, max(1, max(n)), d))
            out = gqakv.gqa_attention(arrays.asarray(q, dtype), cache.layer(l), n, rows=rows)
            if max(n) > 0:
                check(out, None, q, rows, n, l, f"attend {i}")
        else:  # the model raises inside a step: nothing of it stays
            rows = _random_rows(rng, B, 2)
            n = [int(rng.integers(0, S - lens[r] + 1)) for r in rows]
            k = arrays.asarray(values((len(rows), hkv, max(1, max(n)), d)), dtype)
            with pytest.raises(KeyError):
                with cache.step(n, rows=rows) as st:
                    st.write(0, k, k)
                    raise KeyError("model failed")
        assert_matches(cache, direct, arrays)
    assert counts["step"] > ops // 4 and all(counts.get(o, 0) >= 1 for o in ("fork", "reorder",
                                                                          "abort"))
    assert_product_routes(spy)
