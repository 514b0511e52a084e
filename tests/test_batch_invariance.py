"""Batch-invariant mode (``gqakv.core.invariance``): a query's output bits depend on its
own row only: not on the other rows of the batch, on how its row's tokens were cut into
chunks, on the thread split, on padded or packed layout, or on whether its prefix pages
came from the prefix cache. Every comparison here is bit for bit (``array_equal`` of the
raw bytes), and the results also match the float64 reference, so an invariant but wrong
result fails too."""

from __future__ import annotations

import numpy as np
import pytest

import gqakv
from gqakv.core import invariance

from .support.packing import pack_tokens
from .support.reference import reference_attention

HKV, G, D = 2, 3, 16
INVARIANT_BACKENDS = ["numpy", "numba", "torch", "array_api_strict"]
STORAGES = [{}, {"storage": "paged", "page_size": 16}, {"storage": "paged", "page_size": 5},
            {"kv_dtype": "int8"}]


def same_bits(a, b) -> bool:
    a, b = np.ascontiguousarray(np.asarray(a)), np.ascontiguousarray(np.asarray(b))
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def host(backend, x) -> np.ndarray:
    """A backend's array as NumPy, its dtype (so its bits) kept."""
    return gqakv.get_backend(backend).to_numpy(x)


def make_cache(backend, dtype, storage, batch=1, max_len=400):
    return gqakv.KVCache(batch, HKV, max_len, D, dtype=dtype, backend=backend, **storage)


def held(backend, x, dtype):
    return gqakv.get_backend(backend).from_numpy(np.asarray(x), dtype)


def fill(cache, backend, dtype, k, v, chunks, rows=None):
    """Append row ``rows[0]``'s tokens ``k``/``v`` ``[Hkv, L, d]`` in chunks of these sizes."""
    start = 0
    for n in chunks:
        cache.append(held(backend, k[None, :, start:start + n], dtype),
                     held(backend, v[None, :, start:start + n], dtype), [n], rows=rows)
        start += n


@pytest.fixture(params=INVARIANT_BACKENDS)
def inv_backend(request):
    """numpy (its BLAS path), numba (its kernels), and the generic array-API code on torch
    and array_api_strict (``Backend.generic_invariant``)."""
    try:
        gqakv.get_backend(request.param)
    except gqakv.BackendError as exc:
        pytest.skip(str(exc))
    return request.param


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("storage", STORAGES, ids=["contiguous", "paged16", "paged5", "int8"])
@pytest.mark.parametrize("params", [{}, {"window": 40}, {"softcap": 0.7, "sinks": "yes"}],
                         ids=["causal", "window", "softcap+sinks"])
def test_a_querys_bits_do_not_depend_on_its_chunk_or_its_batch(inv_backend, dtype, storage, params,
                                                                route_spy):
    """One request (a 300-token row, its last 24 tokens the queries) computed: as the tail
    of one long chunk; as its own 24-token chunk after a differently chunked prefix; as
    single decode steps; in a batch of 8 rows of other lengths and chunk sizes (padded and
    packed); its prefix from the prefix cache (paged storage). All the same bits. Every hot
    call ran what ``route()`` names for it in this mode and the path meant
    (tests/support/routes.py: numba's kernels at every chunk length)."""
    from .support.routes import assert_product_routes

    if "kv_dtype" in storage and dtype == "float64":
        pytest.skip("8-bit storage takes float32/float16/bfloat16 q")
    if inv_backend == "torch" and dtype == "float64":
        pytest.skip("the generic code in float64 runs on array_api_strict (same code, and torch "
                    "is the slowest here)")
    unsupported = gqakv.get_backend(inv_backend).not_supported_reasons(dtype=dtype)
    if unsupported:
        pytest.skip("; ".join(unsupported))
    rng = np.random.default_rng(7)
    L, T = 300, 24
    k, v = rng.standard_normal((2, HKV, L, D))
    q = rng.standard_normal((HKV * G, L, D))
    kw = dict(params)
    if kw.get("sinks") == "yes":
        kw["sinks"] = rng.standard_normal(HKV * G).tolist()
    spy = route_spy(gqakv.get_backend(inv_backend))
    with gqakv.batch_invariant():
        # the tail of one 300-query chunk
        c = make_cache(inv_backend, dtype, storage)
        fill(c, inv_backend, dtype, k, v, [L])
        whole = host(inv_backend, gqakv.gqa_attention(held(inv_backend, q[None], dtype), c, [L], **kw))[0, :, L - T:]
        # its own 24-token chunk after a prefix cut 100 + 176
        c = make_cache(inv_backend, dtype, storage)
        fill(c, inv_backend, dtype, k, v, [100, L - T - 100, T])
        chunk = host(inv_backend, gqakv.gqa_attention(held(inv_backend, q[None, :, L - T:], dtype), c, [T], **kw))[0]
        assert same_bits(chunk, whole)
        # one decode step at a time (the last 4)
        c = make_cache(inv_backend, dtype, storage)
        fill(c, inv_backend, dtype, k, v, [L - 4])
        for t in range(L - 4, L):
            fill(c, inv_backend, dtype, k[:, t:], v[:, t:], [1])
            one = host(inv_backend, gqakv.gqa_attention(held(inv_backend, q[None, :, t:t + 1], dtype), c, [1], **kw))
            assert same_bits(one[0, :, 0], whole[:, t - (L - T)])
        # in a batch of 8 rows (the request in row 5), padded and packed
        B = 8
        others = [rng.standard_normal((2, HKV, n, D)) for n in rng.integers(30, 380, B)]
        n_new = rng.integers(1, 40, B)
        c = make_cache(inv_backend, dtype, storage, batch=B)
        lens = []
        for b in range(B):
            kb, vb = (k, v) if b == 5 else others[b]
            n = L if b == 5 else kb.shape[1]
            fill(c, inv_backend, dtype, kb, vb, [n - (T if b == 5 else min(int(n_new[b]), n))], rows=[b])
            lens.append(n)
        n_new = np.array([T if b == 5 else min(int(n_new[b]), lens[b]) for b in range(B)])
        for b in range(B):
            kb, vb = (k, v) if b == 5 else others[b]
            fill(c, inv_backend, dtype, kb[:, lens[b] - n_new[b]:], vb[:, lens[b] - n_new[b]:], [n_new[b]], rows=[b])
        qs = rng.standard_normal((B, HKV * G, int(n_new.max()), D))
        qs[5, :, :T] = q[:, L - T:]
        padded = host(inv_backend, gqakv.gqa_attention(held(inv_backend, qs, dtype), c, n_new, **kw))
        assert same_bits(padded[5, :, :T], whole)
        packed = host(inv_backend, gqakv.gqa_attention(held(inv_backend, pack_tokens(qs, n_new), dtype), c, n_new, **kw))
        off = int(n_new[:5].sum())
        assert same_bits(np.swapaxes(packed[off:off + T], 0, 1), whole)
        # its prefix from the prefix cache (paged storage)
        if storage.get("storage") == "paged":
            c = gqakv.KVCache(2, HKV, 400, D, dtype=dtype, backend=inv_backend, prefix_cache=True, **storage)
            ids = list(range(L))
            fill(c, inv_backend, dtype, k, v, [L - 50], rows=[0])
            c.cache_prefix(0, ids[:L - 50])
            m = c.match_prefix(1, ids)
            assert m > 200
            fill(c, inv_backend, dtype, k[:, m:], v[:, m:], [L - m], rows=[1])
            hit = host(inv_backend, gqakv.gqa_attention(held(inv_backend, q[None, :, m:], dtype), c, [L - m], rows=[1], **kw))
            assert same_bits(hit[0, :, -T:], whole)
    assert_product_routes(spy)
    # and right: the float64 reference of the request's queries
    want, _ = reference_attention(np.asarray(gqakv.get_backend("numpy").to_numpy(held("numpy", q[None, :, L - T:], dtype)),
                                             dtype=np.float64),
                                  [k], [v], [T], window=kw.get("window"), softcap=kw.get("softcap"),
                                  sinks=kw.get("sinks"))
    tol = {"float64": 1e-10, "float32": 1e-4}.get(dtype, 0.05)
    if "kv_dtype" in storage:
        tol = 0.05
    np.testing.assert_allclose(np.asarray(whole, dtype=np.float64), want[0], rtol=tol, atol=tol)


def test_the_mode_is_what_makes_the_bits_equal():
    """Without the mode the same comparison can differ (a 24-query chunk and the tail of a
    300-query chunk take different tiles and key blocks): the test above is not vacuous."""
    rng = np.random.default_rng(7)
    L, T = 300, 100
    k, v = rng.standard_normal((2, HKV, L, D)).astype(np.float32)
    q = rng.standard_normal((1, HKV * G, L, D)).astype(np.float32)
    c = make_cache("numpy", "float32", {})
    fill(c, "numpy", "float32", k, v, [L])
    whole = gqakv.gqa_attention(q, c, [L])[0, :, L - T:]
    c2 = make_cache("numpy", "float32", {})
    fill(c2, "numpy", "float32", k, v, [L - T, T])
    chunk = gqakv.gqa_attention(np.ascontiguousarray(q[:, :, L - T:]), c2, [T])[0]
    assert not same_bits(chunk, whole)
    with gqakv.batch_invariant():
        chunk = gqakv.gqa_attention(np.ascontiguousarray(q[:, :, L - T:]), c2, [T])[0]
        whole = gqakv.gqa_attention(q, c, [L])[0, :, L - T:]
    assert same_bits(chunk, whole)


def test_routes_and_plans_follow_the_mode():
    numba = gqakv.get_backend("numba")
    long_chunk = dict(dtype="float32", head_dim=64, t_q=64)
    assert numba.route("attention", **long_chunk).impl == "numpy BLAS"
    route = numba.route("attention", invariant=True, **long_chunk)
    assert route.impl == "numba kernel" and "batch-invariant" in str(route)
    cache = gqakv.PagedKVCache(2, HKV, 64, D, page_size=8, backend="numba")
    cache.append(np.zeros((2, HKV, 20, D), np.float32), np.zeros((2, HKV, 20, D), np.float32), [20, 20])
    plan = gqakv.plan_attention(cache, [20, 1], q_heads=HKV * G)
    assert not plan.inputs.invariant
    with gqakv.batch_invariant():
        plan = gqakv.plan_attention(cache, [20, 1], q_heads=HKV * G)
    assert plan.inputs.invariant  # kept by the plan for every run, whatever the mode later
    assert plan.work.items[:, 4].max() - plan.work.items[:, 3].min() >= 1
    assert ((plan.work.items[:, 4] - plan.work.items[:, 3]) == 1).all()  # one query per item
    assert invariance.enabled() is False


def test_backends_without_an_invariant_path_refuse_the_mode():
    """A backend that does not declare its generic code invariant (``generic_invariant``,
    the default for a third-party backend) refuses a call in the mode that would take it."""
    from gqakv_backends.strict_backend import StrictBackend

    class Unsure(StrictBackend):
        name = "strict-unsure"
        generic_invariant = False

    backend = Unsure()
    name = backend.name
    xp = backend.namespace()
    cache = gqakv.KVCache(1, HKV, 16, D, backend=backend)
    kv = xp.zeros((1, HKV, 3, D), dtype=backend.dtype("float32"))
    cache.append(kv, kv, [3])
    q = xp.zeros((1, HKV * G, 3, D), dtype=backend.dtype("float32"))
    with gqakv.batch_invariant():
        with pytest.raises(ValueError, match=f"batch-invariant mode: backend {name!r} would run"):
            gqakv.gqa_attention(q, cache, [3])
    gqakv.gqa_attention(q, cache, [3])  # outside the mode: as always


def test_the_switches():
    assert invariance.enabled() is False
    gqakv.set_batch_invariant(True)
    try:
        assert invariance.enabled() is True
        with gqakv.batch_invariant(False):
            assert invariance.enabled() is False
        assert invariance.enabled() is True
    finally:
        gqakv.set_batch_invariant(False)
    with pytest.raises(TypeError, match="on must be a bool"):
        gqakv.set_batch_invariant(1)
    with pytest.raises(TypeError, match="on must be a bool"):
        with gqakv.batch_invariant("yes"):
            pass


def test_the_environment_variable(monkeypatch):
    monkeypatch.setattr(invariance, "_DEFAULT", [None])
    monkeypatch.setenv(invariance.ENV, "1")
    assert invariance.enabled() is True
    monkeypatch.setattr(invariance, "_DEFAULT", [None])
    monkeypatch.setenv(invariance.ENV, "maybe")
    with pytest.raises(ValueError, match="GQAKV_BATCH_INVARIANT='maybe': use 1 or 0"):
        invariance.enabled()
    monkeypatch.setattr(invariance, "_DEFAULT", [None])
    monkeypatch.delenv(invariance.ENV)
    assert invariance.enabled() is False


@pytest.mark.parametrize("d,dtype,kernel", [(8, "float32", "gqakv_prefill"), (8, "bfloat16", "gqakv_prefill"),
                                             (64, "bfloat16", "gqakv_prefill_mma")])
@pytest.mark.parametrize("storage", [{}, {"storage": "paged", "page_size": 4}], ids=["contiguous", "paged"])
@pytest.mark.parametrize("window", [None, 5, 23])
def test_cupy_emulated_kernels_are_batch_invariant(d, dtype, kernel, storage, window):
    """The CUDA kernels (on the CPU emulator): in the mode every call runs the prefill
    kernels (fp32 FMA, and tensor cores at d = 64), whose key tiles start at multiples of
    their width, so a query gives the same bits in a long chunk, its own chunk, one decode
    step or a batch. (Emulated, not a GPU.)"""
    from .support.product import _emulated_cupy

    if d == 64 and storage and window:
        pytest.skip("the emulation library instantiates windowed paged kernels at d = 8 only")
    backend = _emulated_cupy()
    L, T = 45, 6
    rng = np.random.default_rng(3)
    k, v = rng.standard_normal((2, HKV, L, d))
    q = rng.standard_normal((HKV * G, L, d))
    A = lambda x: backend.from_numpy(np.asarray(x), dtype)  # noqa: E731
    out = lambda x: np.asarray(backend.to_numpy(x))  # noqa: E731

    def cache(batch=1):
        return gqakv.KVCache(batch, HKV, 64, d, dtype=dtype, backend=backend, **storage)

    with gqakv.batch_invariant():
        capability = backend._facts()[1]
        assert backend.route("attention", dtype=dtype, head_dim=d, t_q=1, invariant=True,
                             capability=capability).impl == kernel
        c = cache()
        c.append(A(k[None]), A(v[None]), [L])
        whole = out(gqakv.gqa_attention(A(q[None]), c, [L], window=window))[0, :, L - T:]
        c = cache()
        c.append(A(k[None, :, :L - T]), A(v[None, :, :L - T]), [L - T])
        c.append(A(k[None, :, L - T:]), A(v[None, :, L - T:]), [T])
        chunk = out(gqakv.gqa_attention(A(q[None, :, L - T:]), c, [T], window=window))[0]
        assert same_bits(chunk, whole)
        c = cache()
        c.append(A(k[None, :, :L - 1]), A(v[None, :, :L - 1]), [L - 1])
        c.append(A(k[None, :, L - 1:]), A(v[None, :, L - 1:]), [1])
        step = out(gqakv.gqa_attention(A(q[None, :, L - 1:]), c, [1], window=window))[0, :, 0]
        assert same_bits(step, whole[:, -1])
        c = cache(3)
        other = rng.standard_normal((2, HKV, 60, d))
        c.append(A(np.stack([other[0][:, :50], np.pad(k[:, :L - T], ((0, 0), (0, 50 - L + T), (0, 0))), other[0][:, :50]])),
                 A(np.stack([other[1][:, :50], np.pad(v[:, :L - T], ((0, 0), (0, 50 - L + T), (0, 0))), other[1][:, :50]])),
                 [50, L - T, 21])
        tail_k = np.stack([other[0][:, 50:56], k[:, L - T:], other[0][:, 50:56]])
        tail_v = np.stack([other[1][:, 50:56], v[:, L - T:], other[1][:, 50:56]])
        c.append(A(tail_k), A(tail_v), [3, T, 1])
        qs = rng.standard_normal((3, HKV * G, T, d))
        qs[1] = q[:, L - T:]
        batch = out(gqakv.gqa_attention(A(qs), c, [3, T, 1], window=window))
        assert same_bits(batch[1], whole)


def test_the_generic_code_is_invariant_where_the_backend_says_so():
    """``Backend.invariant_attention``: numpy's BLAS path and generic code, numba's kernels
    and generic code (its fallbacks run numpy's), torch's generic code on the CPU only (a
    torch backend on a CUDA device keeps refusing the mode), cupy's prefill kernels."""
    from gqakv.dispatch.backend import GENERIC

    pytest.importorskip("torch")
    from gqakv_backends.torch_backend import TorchBackend

    assert GENERIC in gqakv.get_backend("numpy").invariant_attention()
    assert GENERIC in gqakv.get_backend("array_api_strict").invariant_attention()
    assert GENERIC in TorchBackend("cpu").invariant_attention()
    assert GENERIC not in TorchBackend("cuda:0").invariant_attention()  # constructing needs no GPU
    from gqakv_backends.cupy_backend import CupyBackend

    assert GENERIC not in CupyBackend().invariant_attention()  # its prefill kernels only
