"""Regression tests from a review that probed the public API as an inference engine would."""

from __future__ import annotations

import numpy as np
import pytest

import gqakv

from .reference import reference_attention


def _snapshot(cache, arrays):
    return (arrays.to_numpy(cache.k).copy(), arrays.to_numpy(cache.v).copy(),
            cache.host_lens.copy())


def _unchanged(before, after):
    return all(np.array_equal(a, b, equal_nan=True) for a, b in zip(before, after))


def test_lens_is_a_snapshot_that_cannot_write_the_cache(backend, arrays):
    """``cache.lens`` on torch/array_api_strict used to alias the host lengths and be
    writable: ``cache.lens[0] = 7`` silently set row 0's length past its data, and an
    old ``lens`` object changed under its holder after the next append."""
    cache = gqakv.KVCache(2, 1, 8, 4, backend=backend)
    kv = arrays.asarray(np.ones((2, 1, 3, 4), np.float32))
    cache.append(kv, kv, [2, 3])
    lens = cache.lens
    try:
        lens[0] = 7
    except (ValueError, TypeError, RuntimeError):
        pass  # a read-only array is fine too
    np.testing.assert_array_equal(cache.host_lens, [2, 3])
    cache.reset()
    cache.append(kv, kv, [1, 1])
    np.testing.assert_array_equal(cache.host_lens, [1, 1])
    np.testing.assert_array_equal(arrays.to_numpy(cache.lens, np.int64), [1, 1])
    if int(arrays.to_numpy(lens, np.int64)[0]) != 7:  # a read-only array refused the write
        np.testing.assert_array_equal(arrays.to_numpy(lens, np.int64), [2, 3])


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


def test_huge_unsigned_n_new_is_reported_as_given(backend, arrays):
    """A uint64 n_new above the int64 range was reported as a negative number."""
    cache = gqakv.KVCache(2, 1, 8, 4, backend=backend)
    kv = arrays.asarray(np.ones((2, 1, 3, 4), np.float32))
    before = _snapshot(cache, arrays)
    with pytest.raises(ValueError, match="9223372036854775809"):
        cache.append(kv, kv, np.array([2**63 + 1, 0], dtype=np.uint64))
    assert _unchanged(before, _snapshot(cache, arrays))


@pytest.mark.parametrize("n_new", [[2**70, 0], [0, -(2**64)]])
def test_python_ints_beyond_int64_are_reported_as_given(backend, arrays, n_new):
    """Python ints NumPy cannot hold were refused as 'integer dtype, got object'."""
    cache = gqakv.KVCache(2, 1, 8, 4, backend=backend)
    kv = arrays.asarray(np.ones((2, 1, 3, 4), np.float32))
    before = _snapshot(cache, arrays)
    i = 0 if n_new[0] else 1
    with pytest.raises(ValueError, match=rf"n_new\[{i}\]={n_new[i]} is out of range"):
        cache.append(kv, kv, n_new)
    assert _unchanged(before, _snapshot(cache, arrays))


@pytest.mark.parametrize("rows", [np.array(1), 1])
def test_step_rows_without_length_is_a_clear_error(backend, rows):
    cache = gqakv.ModelKVCache(1, 3, 1, 4, 2, backend=backend)
    with pytest.raises((TypeError, ValueError), match="rows"):
        cache.step(np.array([1]), rows=rows)
    cache.step([0, 0, 0]).abort()  # no step was left open by the refused call


def test_merge_ignores_the_output_of_a_part_that_saw_no_key(backend, arrays):
    """A part with lse = -inf contributes nothing, even when its output slots hold NaN
    (a kernel's uninitialized output for an empty key split)."""
    d = 4
    out_a = arrays.asarray(np.full((3, d), np.nan, np.float32))
    lse_a = arrays.asarray(np.array([-np.inf, -np.inf, 0.25], np.float32))
    vals = np.arange(3 * d, dtype=np.float32).reshape(3, d)
    out_b = arrays.asarray(vals)
    lse_b = arrays.asarray(np.array([0.5, -np.inf, -np.inf], np.float32))
    out, lse = gqakv.merge_attention(out_a, lse_a, out_b, lse_b)
    out = arrays.to_numpy(out)
    np.testing.assert_array_equal(out[0], vals[0])
    np.testing.assert_array_equal(out[1], 0.0)
    assert np.isnan(out[2]).all()  # a part that saw keys keeps its (NaN) output
    np.testing.assert_allclose(arrays.to_numpy(lse), [0.5, -np.inf, 0.25])


def test_transposed_query_view_and_extreme_scales(backend, arrays):
    """q as a transposed (non-contiguous) view, scale 0 and a huge scale, d = 1, G = 3."""
    rng = np.random.default_rng(7)
    B, Hkv, G, T, d = 3, 2, 3, 7, 1
    cache = gqakv.KVCache(B, Hkv, 40, d, dtype="float64", backend=backend)
    k, v = rng.standard_normal((2, B, Hkv, T, d))
    n_new = [3, 0, 7]
    cache.append(arrays.asarray(k), arrays.asarray(v), n_new)
    q_np = rng.standard_normal((B, T, Hkv * G, d)) * 3
    q_t = arrays.asarray(q_np)
    q = q_t.permute(0, 2, 1, 3) if hasattr(q_t, "permute") else arrays.xp.permute_dims(q_t, (0, 2, 1, 3))
    k_rows = [arrays.to_numpy(cache.live_kv(b)[0]) for b in range(B)]
    v_rows = [arrays.to_numpy(cache.live_kv(b)[1]) for b in range(B)]
    for scale in (None, 0.0, 1e3):
        out, lse = gqakv.gqa_attention(q, cache, n_new, scale=scale, return_lse=True)
        want, want_lse = reference_attention(q_np.transpose(0, 2, 1, 3), k_rows, v_rows, n_new,
                                             scale=scale)
        np.testing.assert_allclose(arrays.to_numpy(out), want, rtol=0, atol=1e-10)
        np.testing.assert_allclose(arrays.to_numpy(lse), want_lse, rtol=1e-12, atol=1e-9)


def test_from_numpy_takes_negative_strides(backend, arrays):
    """``Backend.from_numpy`` of a reversed NumPy view (torch refuses negative strides)."""
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)[:, ::-1, ::-2]
    got = backend.from_numpy(a)
    np.testing.assert_array_equal(arrays.to_numpy(got, np.float32), a)
    np.testing.assert_array_equal(arrays.to_numpy(backend.from_numpy(a, "float64")), a)
