"""A codec no fast path declares is refused by every fast path, by name, and computed
right by the generic path (issue 25: a test "int4" codec was accepted by numpy and numba
without a refusal and stored e4m3 codes, 35 and 50 distinct values where 4 bits allow 15).

The throwaway codec ``int4test`` (registered for each test, unregistered after it):
4-bit codes kept in int8, ``scale = max|x| / 7`` per token, codes
``round_half_to_even(x / scale)`` clipped to [-7, 7]; the zero / non-finite rules of
``gqakv.storage.quantize``. Checked on every CPU backend that runs here (numpy, numba, torch,
array-api-strict), contiguous and paged:

- ``route('attention' / 'write_kv' / 'copy_tokens', codec='int4test', layout=...)``
  is the generic code, and every declared fast path of the backend gives a sentence
  naming ``kv_dtype='int4test'`` (``FastPath.rejection`` and the route both);
- real appends, a fork (row copies) and attention under the route spy ran the generic
  code, as ``route`` says and as tests/support/routes.py INTENDED means;
- the attention equals the float64 loop reference over the dequantized values, computed
  here from the rule above (not by the codec's code);
- the stored codes have at most 15 distinct values, all in [-7, 7], and equal the rule's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import gqakv
from gqakv.storage import codecs
from gqakv.dispatch.backend import GENERIC, HOT_OPS, Request

from .support.reference import reference_attention
from .support.routes import assert_product_routes

NAME = "int4test"
QMAX = 7.0


class Int4Test(codecs.Codec):
    """4-bit codes in int8 with a float32 scale per token (max|x| / 7)."""

    name = NAME
    scaled = True
    scale_bytes = 4

    def code_dtype(self, xp):
        return xp.int8

    def quantize(self, xp, x):
        x = xp.astype(x, xp.float32)
        amax = xp.max(xp.abs(x), axis=-1)
        finite = xp.isfinite(amax)
        scale = xp.where(finite, amax / QMAX, xp.asarray(math.nan, dtype=xp.float32))
        ok = finite & (scale > 0)
        y = x / xp.where(ok, scale, xp.asarray(1.0, dtype=xp.float32))[..., None]
        y = xp.where(ok[..., None], y, xp.asarray(0.0, dtype=xp.float32))
        return xp.astype(xp.round(xp.clip(y, -QMAX, QMAX)), xp.int8), scale

    def dequantize(self, xp, codes, scales, table=None):
        return xp.astype(codes, xp.float32) * scales[..., None]


@pytest.fixture
def int4test():
    codec = codecs.register(Int4Test())
    try:
        yield codec
    finally:
        codecs.unregister(NAME)


def _held(x: np.ndarray):
    """(codes, float64 values) of ``x`` [..., d] under the int4test rule (NumPy, here)."""
    x = np.asarray(x, dtype=np.float32)
    scale = np.max(np.abs(x), axis=-1) / np.float32(QMAX)
    codes = np.clip(np.round(x / scale[..., None]), -7, 7).astype(np.int8)
    return codes, codes.astype(np.float64) * scale.astype(np.float64)[..., None]


CPU = ("numpy", "numba", "torch", "array_api_strict")
STORAGES = {"contiguous": {}, "paged": {"storage": "paged", "page_size": 4}}


def _backend(name):
    backend = next((b for b in gqakv.list_backends() if b.name == name), None)
    if backend is None:
        pytest.skip(f"backend {name} is not registered")
    why = backend.unavailable_reason()
    if why:
        pytest.skip(f"backend {name}: {why}")
    return backend


def test_the_codec_registers_and_goes(int4test):
    assert codecs.of(NAME) is int4test and NAME in codecs.names()
    assert codecs.kv_dtype_name(NAME) == NAME
    assert int4test.kernel_tag is None  # no kernel decodes it


def test_unregistered_after_the_fixture():
    assert NAME not in codecs.names()
    with pytest.raises(ValueError, match="kv_dtype='int4test' is not supported"):
        gqakv.KVCache(1, 1, 4, 4, kv_dtype=NAME, backend="numpy")


@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("name", CPU)
def test_every_fast_path_refuses_it_by_name(name, storage, int4test):
    """A fast path that reads the layout refuses the codec by name; one that does not
    read the layout refuses it for that (the codec is not its business then)."""
    backend = _backend(name)
    layout = STORAGES[storage].get("storage", "contiguous")
    paths = {p.name: p for p in backend.fast_paths}

    def check(impl: str, why: str | None) -> None:
        path = paths.get(impl)
        said = (f"kv_dtype={NAME!r}" if path is None or layout in path.layouts
                else f"storage layout {layout!r}")
        assert why is not None and said in why, (impl, why)

    for path in backend.fast_paths:
        check(path.name, path.rejection(Request(path.op, layout=layout, codec=NAME)))
    routed = []
    for op in HOT_OPS:
        facts = {"codec": NAME, "layout": layout, **({"t_q": 1} if op == "attention" else {})}
        route = backend.route(op, **facts) if backend.fast_paths else backend.route(op)
        assert route.impl == GENERIC, (op, str(route))
        for impl, why in route.rejected.items():
            check(impl, why)
        routed.extend(route.rejected)
    # every declared fast path appears, refused, in the route of its operation
    assert set(paths) <= set(routed)
    assert bool(paths) == (name in ("numpy", "numba"))


@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("name", CPU)
def test_the_generic_path_computes_it(name, storage, int4test, route_spy):
    """Appends, a fork and attention (decode and a 9-query chunk, so both sides of
    numba's kernel limit) over an int4test cache: the generic code ran every call (the
    spy, against route() and INTENDED), the result is the float64 reference over the
    rule's values, and the stored codes are the rule's (<= 15 distinct values)."""
    backend = _backend(name)
    rng = np.random.default_rng(4)
    B, Hkv, G, d, S = 2, 2, 3, 16, 48
    dtype = "float32"
    spy = route_spy(backend)
    cache = gqakv.KVCache(B, Hkv, S, d, dtype=dtype, backend=backend, kv_dtype=NAME,
                          **STORAGES[storage])
    k = rng.standard_normal((B, Hkv, 30, d)).astype(np.float32) * 3
    v = rng.standard_normal((B, Hkv, 30, d)).astype(np.float32)
    lens = np.array([30, 17])
    cache.append(backend.from_numpy(k), backend.from_numpy(v), lens)
    _check_codes(backend, cache, lens, _held(k)[0])
    cache.fork(0, [1])  # row 1 becomes row 0 (row copies, or shared pages)
    lens = np.array([30, 30])
    k[1], v[1] = k[0], v[0]
    for T in (1, 9):
        kn = rng.standard_normal((B, Hkv, T, d)).astype(np.float32)
        vn = rng.standard_normal((B, Hkv, T, d)).astype(np.float32)
        cache.append(backend.from_numpy(kn), backend.from_numpy(vn), [T, T])
        k = np.concatenate([k, kn], axis=2)
        v = np.concatenate([v, vn], axis=2)
        lens = lens + T
        q = rng.standard_normal((B, Hkv * G, T, d)).astype(np.float32)
        out = gqakv.gqa_attention(backend.from_numpy(q), cache, [T, T])
        kc, kx = _held(k)
        _, vx = _held(v)
        want, _ = reference_attention(q, [kx[b, :, :lens[b]] for b in range(B)],
                                      [vx[b, :, :lens[b]] for b in range(B)], [T, T])
        got = np.asarray(backend.to_numpy(out), dtype=np.float64)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    ran = {c.op: c.ran[0] for c in spy.calls if c.ran}
    assert set(ran.values()) == {GENERIC}, spy.calls
    assert "attention" in ran and "write_kv" in ran
    assert_product_routes(spy)
    _check_codes(backend, cache, lens, kc)


def _check_codes(backend, cache, lens, want) -> None:
    """K's stored codes of the live tokens: int8, at most 15 distinct values in [-7, 7]
    (4 bits), and the rule's codes ``want`` [B, Hkv, >= L, d]."""
    codes = _codes(backend, cache, lens)
    assert codes.dtype == np.int8
    distinct = np.unique(codes)
    assert len(distinct) <= 15 and distinct.min() >= -7 and distinct.max() <= 7, (
        f"{len(distinct)} distinct stored codes: {distinct}")
    np.testing.assert_array_equal(codes, np.concatenate([want[b, :, :L].ravel()
                                                         for b, L in enumerate(lens)]))


def _codes(backend, cache, lens) -> np.ndarray:
    """K's stored codes of each row's live tokens, in row and token order (pages looked
    up through the table)."""
    store = cache.store
    buf = np.asarray(backend.to_numpy(store.k))
    parts = []
    for b, L in enumerate(lens):
        if store.kind == "paged":
            P = store.page_size
            table = np.asarray(store.page_table.entries)
            rows = np.concatenate([buf[table[b, j // P], :, j % P][:, None] for j in range(L)],
                                  axis=1)  # [Hkv, L, d]
        else:
            rows = buf[b, :, :L]
        parts.append(rows.ravel())
    return np.concatenate(parts)
