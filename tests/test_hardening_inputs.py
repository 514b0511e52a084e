"""Hardening, round two (issue 24, defects 3, 6, 7, 8, 9): inputs that used to pass
unchecked or break a fast path.

- ``merge_attention`` / ``apply_sinks`` check every shape (no broadcasting of a
  transposed output or a batch-1 lse) and name the argument of every rejection;
- numba's append takes any strided or read-only ``k_new`` / ``v_new``, in any mix, and
  writes exactly the bits the NumPy backend writes, on every storage kind;
- a ``scale`` past ``gqakv.core.inputs.SCALE_MAX`` is refused before anything runs;
- ``cache.lens`` / ``host_lens`` hand each caller a copy (NumPy: an immutable one), so
  nothing a caller does to it moves the cache's lengths or what the next caller reads;
- ``HeadShard.plan`` range-checks its ints.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import gqakv
from gqakv.distributed import HeadShard
from gqakv.ops.merge import apply_sinks, merge_attention

from .support.reference import reference_attention


def _shape(a):
    return np.zeros(a, np.float32)


# -- defect 3 and 9: merge_attention / apply_sinks shapes and arguments -----------------------

# (name, out_a, lse_a, out_b, lse_b shapes, the argument the error must name)
MERGE_SHAPE_CASES = [
    # the reported case: out as [B, T, Hq, d] (T = 1) with lse [B, Hq, T] broadcast to (2, 4, 4, 8)
    ("out_transposed", (2, 1, 4, 8), (2, 4, 1), (2, 1, 4, 8), (2, 4, 1), "lse_a"),
    # an lse of batch 1 was broadcast over every row
    ("lse_batch_1", (2, 4, 3, 8), (1, 4, 3), (2, 4, 3, 8), (1, 4, 3), "lse_a"),
    ("lse_b_batch_1", (2, 4, 3, 8), (2, 4, 3), (2, 4, 3, 8), (1, 4, 3), "lse_b"),
    ("out_b_other_queries", (2, 4, 3, 8), (2, 4, 3), (2, 4, 2, 8), (2, 4, 2), "out_b"),
    ("out_b_other_head_dim", (2, 4, 3, 8), (2, 4, 3), (2, 4, 3, 1), (2, 4, 3), "out_b"),
    ("lse_with_a_d_axis", (2, 4, 3, 8), (2, 4, 3, 1), (2, 4, 3, 8), (2, 4, 3, 1), "lse_a"),
    ("out_scalar", (), (), (), (), "out_a"),
]


@pytest.mark.parametrize("name, sa, sla, sb, slb, arg", MERGE_SHAPE_CASES,
                         ids=[c[0] for c in MERGE_SHAPE_CASES])
def test_merge_attention_refuses_shapes_that_do_not_match(backend, arrays, name, sa, sla, sb, slb, arg):
    """Every part must be out [..., d] with its lse [...] = out.shape[:-1], both parts the
    same shape: nothing is broadcast. The error names the argument and both shapes."""
    parts = [arrays.asarray(_shape(s)) for s in (sa, sla, sb, slb)]
    with pytest.raises(ValueError, match=rf"^{arg}\b") as info:
        merge_attention(*parts)
    text = str(info.value)
    got = dict(zip(("out_a", "lse_a", "out_b", "lse_b"), (sa, sla, sb, slb)))[arg]
    assert str(list(got)) in text, text


def test_merge_attention_still_takes_any_leading_axes(backend, arrays):
    """The check is out [..., d] with lse [...]: [n, d], [B, Hq, T, d] and [d] (one
    query) all merge, as before."""
    for shape in ((5, 4), (2, 3, 2, 4), (4,)):
        out = arrays.asarray(np.ones(shape, np.float32))
        lse = arrays.asarray(np.zeros(shape[:-1], np.float32))
        o, lse_out = merge_attention(out, lse, out, lse)
        assert tuple(o.shape) == shape and tuple(lse_out.shape) == shape[:-1]
        np.testing.assert_allclose(arrays.to_numpy(o), 1.0, rtol=1e-6)
        np.testing.assert_allclose(arrays.to_numpy(lse_out), np.log(2.0), rtol=1e-6)


@pytest.mark.parametrize("which", [0, 1, 2, 3])
@pytest.mark.parametrize("bad", [0, 1.5, [0.0, 1.0], None])
def test_merge_attention_names_a_non_array_argument(backend, arrays, which, bad):
    """An int (or float, list, None) lse or out is a TypeError naming the argument and
    the value (it was an AttributeError: 'int' object has no attribute 'dtype')."""
    args = [arrays.asarray(np.ones((2, 4), np.float32)), arrays.asarray(np.zeros(2, np.float32)),
            arrays.asarray(np.ones((2, 4), np.float32)), arrays.asarray(np.zeros(2, np.float32))]
    args[which] = bad
    name = ("out_a", "lse_a", "out_b", "lse_b")[which]
    with pytest.raises(TypeError, match=rf"^{name} must be an array .* got {re.escape(type(bad).__name__)}"):
        merge_attention(*args)


def test_merge_attention_refuses_lse_dtypes_that_differ(backend, arrays):
    if "float64" not in backend.dtypes:
        pytest.skip(f"backend {backend.name} has no float64")
    out = arrays.asarray(np.ones((2, 4), np.float32))
    with pytest.raises(TypeError, match=r"^lse_b has dtype float64 but lse_a has float32"):
        merge_attention(out, arrays.asarray(np.zeros(2), "float32"), out,
                        arrays.asarray(np.zeros(2), "float64"))


def test_merge_attention_names_a_part_of_another_library(backend, arrays):
    out = arrays.asarray(np.ones((2, 4), np.float32))
    if isinstance(out, np.ndarray):
        pytest.skip("needs a second array library")
    lse = arrays.asarray(np.zeros(2, np.float32))
    with pytest.raises(TypeError, match=r"^lse_b is a numpy\.ndarray, but out_a is"):
        merge_attention(out, lse, out, np.zeros(2, np.float32))


# (name, out shape, lse shape, sinks: shape or a Python value, error type, pattern)
SINK_CASES = [
    ("sinks_list", (2, 4, 3, 8), (2, 4, 3), [0.0] * 4, TypeError,
     r"^sinks must be an array of lse's library .* got list"),
    ("sinks_int", (2, 4, 3, 8), (2, 4, 3), 0, TypeError, r"^sinks must be an array .* got int"),
    ("lse_int", (2, 4, 3, 8), None, (4,), TypeError, r"^lse must be an array .* got int"),
    ("lse_fewer_queries", (2, 4, 3, 8), (2, 4, 2), (4,), ValueError,
     r"^lse has shape \[2, 4, 2\], but out \[2, 4, 3, 8\] needs lse of shape \[2, 4, 3\]"),
    # out without its batch axis was broadcast against lse's: a (2, 4, 3, 8) result
    ("out_without_batch", (4, 3, 8), (2, 4, 3), (4,), ValueError, r"^lse has shape \[2, 4, 3\]"),
    ("lse_1d", (3, 8), (3,), (4,), ValueError, r"^lse must be \[\.\.\., Hq, T\]"),
]


@pytest.mark.parametrize("name, so, sl, sinks, exc, pattern", SINK_CASES, ids=[c[0] for c in SINK_CASES])
def test_apply_sinks_names_every_rejection(backend, arrays, name, so, sl, sinks, exc, pattern):
    out = arrays.asarray(np.ones(so, np.float32))
    lse = 0 if sl is None else arrays.asarray(np.zeros(sl, np.float32))
    if isinstance(sinks, tuple):
        sinks = arrays.asarray(np.zeros(sinks, np.float32))
    with pytest.raises(exc, match=pattern):
        apply_sinks(out, lse, sinks)


# -- defect 9: HeadShard.plan's ints ----------------------------------------------------------

@pytest.mark.parametrize("args, exc, pattern", [
    ((2**70, 8, 2), ValueError, r"n_heads=1180591620717411303424 is out of range: n_heads must be at most 2147483647"),
    ((32, 2**40, 2), ValueError, r"n_kv_heads=1099511627776 is out of range"),
    ((2**31, 2**31, 2**31), ValueError, r"world_size=2147483648 is out of range"),
    ((32, 8, 4, 2**63), ValueError, r"rank=9223372036854775808 is out of range for world_size=4"),
    ((32, 8, 4, -1), ValueError, r"rank must be >= 0, got -1"),
    ((32.0, 8, 4), TypeError, r"n_heads must be an int, got 32\.0"),
    ((32, True, 4), TypeError, r"n_kv_heads must be an int, got True"),
    ((32, 8, "4"), TypeError, r"world_size must be an int, got '4'"),
    ((32, 8, 4, None), TypeError, r"rank must be an int, got None"),
    ((0, 8, 4), ValueError, r"n_heads must be >= 1, got 0"),
])
def test_head_shard_plan_checks_its_ints(args, exc, pattern):
    with pytest.raises(exc, match=pattern):
        HeadShard.plan(*args)


def test_head_shard_plan_takes_numpy_ints_and_the_largest_counts():
    s = HeadShard.plan(np.int64(32), np.int32(8), np.int64(4), np.int16(3))
    assert (s.q_start, s.q_stop, s.kv_start, s.kv_stop) == (24, 32, 6, 8)
    assert all(type(getattr(s, f)) is int for f in ("n_heads", "n_kv_heads", "world_size", "rank"))
    big = 2**31 - 1
    s = HeadShard.plan(big, big, 1)
    assert (s.q_stop, s.kv_stop) == (big, big)


# -- defect 7: the scale's range --------------------------------------------------------------

#: The documented bound (``gqakv.core.inputs.SCALE_MAX``), spelled out so that a change to it is seen.
SCALE_MAX = 1e38


def test_the_scale_bound_is_the_documented_one():
    from gqakv.core import inputs

    assert inputs.SCALE_MAX == SCALE_MAX

@pytest.mark.parametrize("scale", [1e39, -1e39, 3.4e38, np.float64(1e39), 10**39, 1.0000001e38])
def test_a_scale_beyond_the_range_is_refused(backend, arrays, scale):
    """scale=1e39 gave NaN everywhere (it is inf in float32; 3.4e38 too, as soon as a
    |q . k| > 1). Refused before anything runs, naming the value and the range."""
    cache = gqakv.KVCache(1, 1, 4, 2, backend=backend)
    x = arrays.asarray(np.ones((1, 1, 1, 2), np.float32))
    cache.append(x, x, [1])
    with pytest.raises(ValueError, match=r"scale=.* is outside the supported range \|scale\| <= 1e\+38"):
        gqakv.gqa_attention(x, cache, [1], scale=scale)
    with pytest.raises(ValueError, match=r"\|scale\| <= 1e\+38"):
        gqakv.gqa_attention(x, cache, [1], params=gqakv.AttentionParams(scale=scale))


@pytest.mark.parametrize("scale", [SCALE_MAX, -SCALE_MAX, 1e30, -0.5, 0.0, 5e-324])
def test_scales_inside_the_range_match_the_reference(backend, arrays, scale):
    """The range's edges, negative, zero and subnormal scales all give the float64
    reference's answer whenever every |scale * q . k| stays inside float32's range."""
    rng = np.random.default_rng(7)
    B, hkv, G, d, L = 2, 1, 2, 4, 6
    # q . k in [-1e-38 * 4, 1e-38 * 4] keeps SCALE_MAX * q . k inside float32's range
    small = abs(scale) > 1e10
    k = rng.standard_normal((B, hkv, L, d)).astype(np.float32)
    v = rng.standard_normal((B, hkv, L, d)).astype(np.float32)
    q = rng.standard_normal((B, hkv * G, 1, d)).astype(np.float32)
    if small:
        q = (q * np.float32(1e-39)).astype(np.float32)
    cache = gqakv.KVCache(B, hkv, L, d, backend=backend)
    cache.append(arrays.asarray(k), arrays.asarray(v), [L, L - 2])
    out, lse = gqakv.gqa_attention(arrays.asarray(q), cache, [1, 1], scale=scale, return_lse=True)
    want, want_lse = reference_attention(q, [k[0], k[1, :, :L - 2]], [v[0], v[1, :, :L - 2]], [1, 1],
                                         scale=float(scale))
    got = arrays.to_numpy(out)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(arrays.to_numpy(lse), want_lse, atol=2e-5, rtol=2e-5)


# -- defect 8: lengths handed out as copies ---------------------------------------------------

def _force_write(x, value: int) -> bool:
    """Write ``value`` into ``x[0]`` by any means its library allows (NumPy: first make it
    writable again); False when the array refuses."""
    if isinstance(x, np.ndarray):
        try:
            x.setflags(write=True)
        except ValueError:
            return False
    try:
        x[0] = value
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


def _assert_lengths_and_next_append(arrays, cache, want):
    np.testing.assert_array_equal(cache.host_lens, want)
    np.testing.assert_array_equal(arrays.to_numpy(cache.lens, np.int64), want)


@pytest.mark.parametrize("model", [False, True], ids=["KVCache", "ModelKVCache"])
def test_what_one_caller_does_to_the_lengths_never_reaches_the_cache(backend, arrays, model):
    """torch handed every caller the same cached ``lens`` tensor, so one caller's write
    changed what the next read; NumPy's ``host_lens`` (a read-only view of the lengths
    themselves) could be made writable again and then moved the real lengths. Every
    caller now gets its own copy (NumPy: one that cannot be made writable)."""
    if model:
        cache = gqakv.ModelKVCache(2, 2, 1, 8, 4, backend=backend)
        step = cache.step([2, 3])
        kv = arrays.asarray(np.ones((2, 1, 3, 4), np.float32))
        for layer in range(2):
            step.write(layer, kv, kv)
        step.commit()
    else:
        cache = gqakv.KVCache(2, 1, 8, 4, backend=backend)
        kv = arrays.asarray(np.ones((2, 1, 3, 4), np.float32))
        cache.append(kv, kv, [2, 3])
    for take in ("host_lens", "lens"):
        held = getattr(cache, take)
        _force_write(held, 7)
        _assert_lengths_and_next_append(arrays, cache, [2, 3])
    # two callers' lens are never the same object (torch's cached tensor was)
    assert cache.lens is not cache.lens
    assert cache.host_lens is not cache.host_lens


def test_a_forced_host_lens_write_does_not_move_where_append_writes(backend, arrays):
    """Before: ``host_lens.setflags(write=True); host_lens[0] = 0`` made the next append
    overwrite row 0's first token."""
    cache = gqakv.KVCache(1, 1, 8, 2, backend=backend)
    first = arrays.asarray(np.full((1, 1, 1, 2), 1.0, np.float32))
    second = arrays.asarray(np.full((1, 1, 1, 2), 2.0, np.float32))
    cache.append(first, first, [1])
    _force_write(cache.host_lens, 0)
    cache.append(second, second, [1])
    k, _ = cache.live_kv(0)
    np.testing.assert_array_equal(arrays.to_numpy(k)[0, :, 0], [1.0, 2.0])


@pytest.mark.parametrize("name", ["lens", "rows", "starts", "n_new"])
def test_a_steps_read_only_arrays_cannot_be_made_writable(name):
    """``Step.lens`` (and rows, starts, n_new) were NumPy arrays marked read-only, which
    ``setflags(write=True)`` undoes: then ``step.lens[0] = 7`` set row 0's length to 7 at
    commit, past the tokens written."""
    cache = gqakv.ModelKVCache(1, 2, 1, 8, 2, backend="numpy")
    step = cache.step([1, 2])
    assert not _force_write(getattr(step, name), 7)
    kv = np.ones((2, 1, 2, 2), np.float32)
    step.write(0, kv, kv)
    step.commit()
    np.testing.assert_array_equal(cache.host_lens, [1, 2])


def test_numpy_lengths_cannot_be_made_writable():
    cache = gqakv.KVCache(2, 1, 4, 2, backend="numpy")
    for held in (cache.host_lens, cache.lens):
        assert not held.flags.writeable
        with pytest.raises(ValueError):
            held.setflags(write=True)


# -- defect 6: numba append of strided and read-only inputs ----------------------------------

try:
    import ml_dtypes

    from gqakv_backends import numba_kernels as nk
except ImportError as exc:  # numba (or ml_dtypes) missing: its tests skip, the rest run
    nk = ml_dtypes = None
    _NO_NUMBA = f"numba kernels unavailable ({exc})"
else:
    _NO_NUMBA = ""
needs_numba = pytest.mark.skipif(bool(_NO_NUMBA), reason=_NO_NUMBA or "numba importable")

#: storage name -> KVCache keyword arguments (every kind the numba backend writes)
WRITE_STORAGES = {
    "contiguous": {},
    "paged": {"storage": "paged", "page_size": 4},
    "int8": {"kv_dtype": "int8"},
    "fp8": {"kv_dtype": "float8_e4m3fn"},
    "paged_int8": {"storage": "paged", "page_size": 4, "kv_dtype": "int8"},
}


def _as_input(a: np.ndarray, how: str) -> np.ndarray:
    """``a`` [B, Hkv, T, d] in the memory layout ``how`` (same values)."""
    if how in ("transposed", "readonly_transposed"):
        # a model's [B, T, H, d] projection viewed as [B, H, T, d]
        x = np.ascontiguousarray(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    elif how == "every_other_token":
        wide = np.zeros(a.shape[:2] + (2 * a.shape[2],) + a.shape[3:], a.dtype)
        wide[:, :, ::2] = a
        x = wide[:, :, ::2]
    elif how == "reversed_heads":
        x = np.ascontiguousarray(a[:, ::-1])[:, ::-1]
    else:
        x = a.copy()
    if how.startswith("readonly"):
        x.flags.writeable = False
    assert (x == a).all() or np.isnan(a).any()
    return x


MIXES = [("readonly", "contiguous"), ("contiguous", "readonly"), ("transposed", "contiguous"),
         ("contiguous", "transposed"), ("readonly_transposed", "every_other_token"),
         ("reversed_heads", "readonly")]


@pytest.fixture
def write_calls(monkeypatch):
    """The number of calls of the numba write kernel."""
    calls = []
    real = nk.write_tokens

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(nk, "write_tokens", spy)
    return calls


def _buffers(cache) -> list[np.ndarray]:
    store = cache.store
    bufs = [store.k, store.v]
    if store.quantized:
        bufs += [store.k_scale, store.v_scale]
    if store.kind == "paged":
        bufs.append(store.page_table.entries)
    return [np.ascontiguousarray(b).view(np.uint8) for b in bufs]


@needs_numba
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("storage", list(WRITE_STORAGES))
@pytest.mark.parametrize("k_how, v_how", MIXES, ids=[f"{a}-{b}" for a, b in MIXES])
def test_numba_append_takes_any_strided_or_read_only_input(storage, dtype, k_how, v_how, write_calls):
    """numba raised an internal TypingError for a read-only k_new with a writable v_new,
    or a transposed k_new with a contiguous v_new (its write kernel iterated K and V as
    one tuple, which numba types only when both arrays have one type). Every mix now
    writes exactly the bytes the NumPy backend writes (codes, scales and page tables
    too), through the kernel where the storage has one (contiguous, unquantized)."""
    st = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(11)
    B, hkv, d, L = 3, 2, 8, 12
    caches = {name: gqakv.KVCache(B, hkv, L, d, dtype, backend=name, **WRITE_STORAGES[storage])
              for name in ("numba", "numpy")}
    for c in caches.values():
        c.store.fill(0.0)
    for n_new, rows in (([4, 0, 3], None), ([1, 2], [2, 0]), ([5, 1, 1], None)):
        T = max(n_new)
        k = rng.standard_normal((len(n_new), hkv, T, d)).astype(st)
        v = rng.standard_normal((len(n_new), hkv, T, d)).astype(st)
        caches["numba"].append(_as_input(k, k_how), _as_input(v, v_how), n_new, rows=rows)
        caches["numpy"].append(k, v, n_new, rows=rows)
    np.testing.assert_array_equal(caches["numba"].host_lens, caches["numpy"].host_lens)
    for got, want in zip(_buffers(caches["numba"]), _buffers(caches["numpy"])):
        np.testing.assert_array_equal(got, want)
    kernel = storage == "contiguous"
    assert len(write_calls) == (3 if kernel else 0), "the write kernel was not (or wrongly) used"


@needs_numba
def test_numba_write_kernel_alone_with_mixed_array_types():
    """write_tokens itself, K read-only and C-contiguous with V a transposed view (two
    array types): what the NumPy slice assignment writes."""
    rng = np.random.default_rng(2)
    k_buf = np.zeros((3, 2, 10, 4), np.uint32)
    v_buf = np.zeros_like(k_buf)
    k_new = rng.integers(0, 2**32, (2, 2, 5, 4), dtype=np.uint32)
    k_new.flags.writeable = False
    v_new = np.ascontiguousarray(k_new.transpose(0, 2, 1, 3) + 1).transpose(0, 2, 1, 3)
    rows, starts, n_new = (np.array(a, np.int64) for a in ([2, 0], [3, 0], [5, 2]))
    nk.write_tokens(k_buf, v_buf, k_new, v_new, rows, starts, n_new, np.zeros(0, np.int64))
    want_k, want_v = np.zeros_like(k_buf), np.zeros_like(v_buf)
    for i in range(2):
        want_k[rows[i], :, starts[i]:starts[i] + n_new[i]] = k_new[i, :, :n_new[i]]
        want_v[rows[i], :, starts[i]:starts[i] + n_new[i]] = v_new[i, :, :n_new[i]]
    np.testing.assert_array_equal(k_buf, want_k)
    np.testing.assert_array_equal(v_buf, want_v)


def test_head_shard_plan_refuses_a_bad_split_of_huge_counts_at_once():
    """The error's suggestions were found by scanning 1..n_kv_heads: minutes for 2**31 - 1
    KV heads. Now by the divisors (the same suggestions for small counts)."""
    import time

    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"world_size=3 cannot split n_kv_heads=2147483647: .* "
                                         r"e\.g\. world_size in \[1, 2147483647\]$"):
        HeadShard.plan(2**31 - 1, 2**31 - 1, 3)  # a prime
    assert time.perf_counter() - t0 < 2.0
    with pytest.raises(ValueError, match=r"e\.g\. world_size in \[1, 2, 4, 8, 16, 32\]$"):
        HeadShard.plan(32, 8, 3)
    with pytest.raises(ValueError, match=r"e\.g\. world_size in \[1, 2, 3, 6, 12, 24\]$"):
        HeadShard.plan(24, 6, 5)
