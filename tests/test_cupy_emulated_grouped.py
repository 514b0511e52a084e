"""Grouped K/V codecs (a float32 scale per block of 32 or 64 values, 8-bit codes or 4-bit
codes two per byte, keys optionally Hadamard-rotated) on the cupy backend's kernels, run on
the CPU emulator.

The reader (kernels/quantized_kv.cuh ``QuantizedKV<C, Base>`` with ``C`` a grouped code
type) dequantizes each 8-value vector by its block's scale in registers (decode) or as a
key row lands in shared memory (prefill), over contiguous rows or the page table; the
append (``gqakv_write_kv_quantized``) quantizes each block on the device. Checked here,
with the generic path made to fail (``emulated_backend.kernels_only``):

* chunked ragged prefill then decode (plain, window, window + soft-cap, window + soft-cap
  + sinks), contiguous and paged (a fork sharing a page), q float32 and bfloat16, every
  grouped codec: out and LSE against the float64 loop reference over the values the cache
  holds (the rule's dequantized values written apart from the library, keys rotated back);
* after the kernels' append, stored codes and scales equal the rule bit for bit (hard
  tokens: outlier channels, zero, huge, tiny, NaN and inf blocks), contiguous and paged;
* a paged int4 decode plan over shuffled pages under AddressSanitizer, every code and
  scale byte no live token holds poisoned (a subprocess, as in the other emulated suites);
* row copies (fork, reorder, truncate then append; a paged cache's copy on write) on the
  copy kernel, codes as byte rows and block scales as float rows
  (``instantiations.copy_entries``), with the generic copy made to fail: every live code
  and scale byte equal to a plain-NumPy model's; and grouped copy plans under
  AddressSanitizer, every byte outside the copied slots poisoned.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

import gqakv

from gqakv.tools.selftest import KV_DTYPES as SELFTEST_KV_DTYPES
from gqakv.tools.selftest import PAGED_KV_DTYPES as SELFTEST_PAGED_KV_DTYPES
from gqakv_backends.cupy_backend import instantiations as table

from .cuda_emu import cases, harness
from .support.quantization import GROUPED, hard_tokens, held_grouped, reference_grouped
from .support.reference import reference_attention

if harness.compiler() is None:
    pytest.skip("no C++ compiler (g++) for the CUDA emulation harness", allow_module_level=True)

from gqakv_backends.cupy_backend import plan as planmod  # noqa: E402

from .cuda_emu import emulated_backend  # noqa: E402
from .cuda_emu.plans import element_strides, pool_poison, table_poison  # noqa: E402

NAMES = list(GROUPED)
#: The selftest's grouped lines: (kv_dtype, paged).
SELFTEST_GROUPED_LINES = [*((kv, False) for kv in SELFTEST_KV_DTYPES if kv in GROUPED),
                          *((kv, True) for kv in SELFTEST_PAGED_KV_DTYPES if kv in GROUPED)]
D = 64  # every grouped codec's blocks fit; the one grouped emulation library (harness.grouped_units)
STORAGES = {"contiguous": {}, "paged": {"storage": "paged", "page_size": 4}}


@pytest.fixture
def backend(monkeypatch):
    """The emulated backend whose generic append, attention and row copies fail."""
    return emulated_backend.kernels_only(monkeypatch, "grouped-codec kernels")


def _tag(name: str) -> str:
    return table.CODE_CTYPES[name]


def _check(name, dtype, out, lse, want, want_lse, n_new):
    """out within 2 roundings of the reference to ``dtype`` plus 2e-5 (rotation and fp32
    accumulation); lse 2e-4; padded queries exactly 0 / -inf."""
    out = np.asarray(out).astype(np.float64)
    lse = np.asarray(lse)
    T = out.shape[2]
    pad = np.arange(T)[None, :] >= np.asarray(n_new)[:, None]
    real = ~np.broadcast_to(pad[:, None, :, None], out.shape)
    st = cases.STORAGE[dtype]
    rounding = np.abs(want.astype(st).astype(np.float64) - want)[real].max(initial=0.0)
    err = np.abs(out - want)[real].max(initial=0.0)
    assert err <= 2 * rounding + 2e-5, f"{name} {dtype}: out error {err:.3g}"
    real_lse = ~np.broadcast_to(pad[:, None, :], lse.shape)
    np.testing.assert_allclose(lse[real_lse], want_lse[real_lse], atol=2e-4, rtol=0)
    assert np.all(out[~real] == 0.0) and np.all(np.isneginf(lse[~real_lse]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("name", NAMES)
def test_prefill_and_decode_match_the_reference(backend, name, storage, dtype):
    """Chunked ragged prefill (an idle row), a fork, decode under each variant the grouped
    library holds; every call on the kernels (the generic path fails), against the
    reference over what the cache holds."""
    rng = np.random.default_rng(sum(map(ord, name + storage + dtype)))
    st = cases.STORAGE[dtype]
    B, Hkv, G = 3, 2, 2
    cache = gqakv.KVCache(B, Hkv, 32, D, dtype=dtype, backend=backend, kv_dtype=name, **STORAGES[storage])
    rows = [[np.zeros((Hkv, 0, D)) for _ in range(B)] for _ in range(2)]
    hq = Hkv * G
    sinks = (np.linspace(-1.0, 1.0, hq)).tolist()

    def step(n_new, variant):
        T = max(n_new)
        k = rng.standard_normal((B, Hkv, T, D)).astype(np.float32)
        k[..., 3] *= 25.0  # an outlier key channel
        v = rng.standard_normal((B, Hkv, T, D)).astype(np.float32)
        q = rng.standard_normal((B, hq, T, D)).astype(np.float32)
        k, v, q = (x.astype(st) for x in (k, v, q))
        for b, n in enumerate(n_new):
            q[b, :, n:] = np.nan  # padded queries: never read
            for i, (x, keys) in enumerate(((k, True), (v, False))):
                held = held_grouped(x[b, :, :n].astype(np.float32), name, keys)
                rows[i][b] = np.concatenate([rows[i][b], held], axis=1)
        cache.append(backend.from_numpy(k), backend.from_numpy(v), n_new)
        out, lse = gqakv.gqa_attention(backend.from_numpy(q), cache, n_new, return_lse=True, **variant)
        want, want_lse = reference_attention(q.astype(np.float64), rows[0], rows[1], n_new,
                                             1.0 / math.sqrt(D), **variant)
        _check(name, dtype, backend.to_numpy(out), backend.to_numpy(lse), want, want_lse, n_new)

    step([9, 4, 0], {})
    step([3, 6, 7], {"window": 6})
    cache.fork(0, [2])
    for i in range(2):
        rows[i][2] = rows[i][0].copy()
    step([1, 1, 1], {"window": 5, "softcap": 4.0})
    step([2, 1, 1], {"window": 7, "softcap": 3.0, "sinks": sinks})
    step([1, 1, 1], {})
    tag = _tag(name)
    # the fork's copies (contiguous rows; pages are shared): the copy kernel over the codes'
    # bytes and the block scales' floats (instantiations.copy_entries), names with no code type
    copies = {n for n in backend.kernels if n.startswith("gqakv_copy_tokens<")}
    assert copies == (set(table.names(table.copy_entries("float32", D, name))) if storage == "contiguous"
                      else set()), copies
    launched = [n for n in backend.kernels if not n.startswith(("gqakv_merge", "gqakv_copy_tokens"))]
    assert all(tag in n for n in launched), launched
    for kernel in ("gqakv_write_kv_quantized<", "gqakv_prefill<", "gqakv_decode<"):
        assert any(n.startswith(kernel) for n in launched), (kernel, launched)
    assert all(n.endswith("KVPages>") == (storage == "paged") for n in launched), launched


def _live_parts(cache, b, L):
    """(K codes, K scales, V codes, V scales) of row b's first L tokens, [Hkv, L, ...]."""
    store, host = cache.store, cache.backend.to_numpy
    parts = [np.asarray(host(x)) for x in (store.k, store.k_scale, store.v, store.v_scale)]
    if store.kind != "paged":
        return [p[b, :, :L] for p in parts]
    P = store.page_size
    entries = np.asarray(store.page_table.entries)
    return [np.stack([p[entries[b, j // P], :, j % P] for j in range(L)], axis=1) for p in parts]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("name", NAMES)
def test_append_stores_the_rule_bit_for_bit(backend, name, storage, dtype):
    """Two ragged appends of hard tokens through gqakv_write_kv_quantized: every live
    token's codes and scales equal the rule's (written apart from the library) bit for
    bit, NaN scales where a block holds a NaN or an infinity."""
    rng = np.random.default_rng(len(name) + len(storage) + len(dtype))
    st = cases.STORAGE[dtype]
    B, Hkv = 2, 2
    cache = gqakv.KVCache(B, Hkv, 16, D, dtype=dtype, backend=backend, kv_dtype=name, **STORAGES[storage])
    k = hard_tokens(rng, (B, Hkv, 7, D), dtype).astype(st)
    v = hard_tokens(rng, (B, Hkv, 7, D), dtype).astype(st)
    k[1, 0, 4, 5] = np.nan
    v[1, 1, 3, 40] = np.inf
    v[0, 1, 2, :32] = 0.0  # an all-zero block beside a live one
    cache.append(backend.from_numpy(k[:, :, :4]), backend.from_numpy(v[:, :, :4]), [4, 3])
    cache.append(backend.from_numpy(k[:, :, 4:]), backend.from_numpy(v[:, :, 4:]), [3, 2])
    for b, taken in enumerate((np.r_[0:4, 4:7], np.r_[0:3, 4:6])):
        got = _live_parts(cache, b, len(taken))
        for (codes, scales), x, keys in ((got[:2], k, True), (got[2:], v, False)):
            want_c, want_s, _ = reference_grouped(x[b][:, taken].astype(np.float32), name, keys)
            np.testing.assert_array_equal(codes, want_c)
            assert scales.tobytes() == want_s.tobytes()  # NaN payloads too
    launched = backend.kernels
    assert launched and all(n.startswith("gqakv_write_kv_quantized<") and _tag(name) in n for n in launched)


@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("name", NAMES)
def test_row_operations_move_grouped_rows_bit_for_bit(backend, route_spy, name, storage):
    """fork, an append (a paged cache copies its shared last pages on write), reorder
    (duplicates, then a permutation cycle: the one-row temporary), truncate and an append
    over the cut, on a 2-layer ModelKVCache of grouped codes: every live token's codes and
    scales, every layer, equal byte for byte the rule's codes (``reference_grouped``) of
    the tokens a plain-NumPy model of the same operations says each row holds. Rows carry
    magnitudes 1e-3 .. 1e4, so a scale moved without its codes shows. Every copy with
    tokens to move runs gqakv_copy_tokens (its route says so; the generic copy fails here):
    the codes as byte rows and the scales as float rows (``instantiations.copy_entries``),
    contiguous rows and a paged cache's copy on write of pool pages alike; the appends run
    the kernels."""
    from .support.routes import assert_product_routes

    rng = np.random.default_rng(sum(map(ord, name + storage)))
    layers, B, Hkv, S = 2, 4, 2, 24
    cache = gqakv.ModelKVCache(layers, B, Hkv, S, D, "float32", backend=backend, kv_dtype=name,
                               **STORAGES[storage])
    spy = route_spy(backend)
    mags = np.array([1e-3, 1.0, 40.0, 1e4])[:, None, None, None]
    rows = [np.zeros((2, layers, Hkv, 0, D), np.float32) for _ in range(B)]  # (K, V) per row

    def append(n_new):
        T = max(n_new)
        kv = (rng.standard_normal((2, layers, B, Hkv, T, D)) * mags).astype(np.float32)
        with cache.step(n_new) as step:
            for layer in range(layers):
                step.write(layer, backend.from_numpy(kv[0, layer]), backend.from_numpy(kv[1, layer]))
        for b, n in enumerate(n_new):
            rows[b] = np.concatenate([rows[b], kv[:, :, b, :, :n]], axis=3)

    def check(what):
        np.testing.assert_array_equal(cache.host_lens, [r.shape[3] for r in rows])
        store, host = cache.store, backend.to_numpy
        parts = [np.asarray(host(x)) for x in (store.k, store.k_scale, store.v, store.v_scale)]
        for b, r in enumerate(rows):
            L = r.shape[3]
            if storage == "paged":  # token j of row b: page entries[b, j // P], slot j % P
                P, entries = store.page_size, np.asarray(store.page_table.entries)
                live = [np.stack([p[:, entries[b, j // P], :, j % P] for j in range(L)], axis=2)
                        for p in parts]
            else:
                live = [p[:, b, :, :L] for p in parts]
            for i, keys in ((0, True), (1, False)):
                want_c, want_s, _ = reference_grouped(r[i], name, keys)
                assert live[2 * i].tobytes() == want_c.tobytes(), (what, b, "codes", keys)
                assert live[2 * i + 1].tobytes() == want_s.tobytes(), (what, b, "scales", keys)

    append([5, 9, 3, 7])
    cache.fork(1, [0, 3])
    rows[0] = rows[3] = rows[1].copy()
    check("fork")
    append([2, 1, 0, 3])  # into the forked rows' shared last page (9 = 2 pages + 1)
    for src in ([3, 0, 0, 2], [1, 2, 3, 0]):
        cache.reorder(src)
        rows = [rows[s].copy() for s in src]
        check(f"reorder {src}")
    cache.truncate([0, 2], [6, 1])
    rows[0], rows[2] = rows[0][..., :6, :], rows[2][..., :1, :]
    append([3, 0, 4, 1])  # over the cut: what was past it must not come back
    check("truncate, append")
    copies = [c for c in spy.calls if c.op == "copy_tokens" and c.work]
    assert copies and all(c.ran[:1] == ["gqakv_copy_tokens"] for c in copies), [c.ran for c in copies]
    for c in copies:
        assert backend.route("copy_tokens", **c.facts).impl == "gqakv_copy_tokens", c.facts
    launched = {n for n in backend.kernels if n.startswith("gqakv_copy_tokens<")}
    assert launched == set(table.names(table.copy_entries("float32", D, name))), launched
    assert_product_routes(spy, ops=("write_kv", "copy_tokens"))


# ---- a paged int4 decode plan over shuffled pages, and AddressSanitizer ------------------------

def grouped_pool(rng, lens, kv_heads, P, name, spare=3):
    """Grouped pools dealt to the rows in a shuffled order (``spare`` pages no row holds):
    codes ``[num_pages, Hkv, P, D * bits / 8]`` and float32 scales ``[num_pages, Hkv, P, D / g]``
    of random tokens quantized by the rule, NaN scales outside the live tokens; the table
    and each row's held pages."""
    bits, g, _ = GROUPED[name]
    held = [-(-int(L) // P) for L in lens]
    num_pages = sum(held) + spare
    order = rng.permutation(num_pages)
    tbl = np.full((len(lens), max(1, max(held) + 1)), -1, np.int32)
    pools = [[np.full((num_pages, kv_heads, P, D * bits // 8), 0x7F, np.int8 if bits == 8 else np.uint8),
              np.full((num_pages, kv_heads, P, D // g), np.nan, np.float32)] for _ in range(2)]
    values = [[np.zeros((kv_heads, int(L), D)) for L in lens] for _ in range(2)]
    i = 0
    for b, L in enumerate(lens):
        tbl[b, :held[b]] = order[i:i + held[b]]
        i += held[b]
        for j in range(int(L)):
            for part, ((codes, scales), vals) in enumerate(zip(pools, values)):
                x = (rng.standard_normal((kv_heads, D)) * (1.0 + 9.0 * part)).astype(np.float32)
                c, s, deq = reference_grouped(x, name)
                codes[tbl[b, j // P], :, j % P], scales[tbl[b, j // P], :, j % P] = c, s
                vals[b][:, j] = deq
    return pools, tbl, held, values


def run_grouped_paged_decode(emu, *, name, dtype, P, lens, force_splits=None, params=None, seed=0,
                             poison=False):
    """One decode plan (T = 1) over shuffled grouped pages, against the reference on the
    stored (dequantized) values; with ``poison`` every code and scale byte outside the live
    tokens and the table entries past the held pages are poisoned."""
    rng = np.random.default_rng(seed)
    st = cases.STORAGE[dtype]
    kv_heads, group = 2, 2
    lens = np.asarray(lens, np.int64)
    B, hq = len(lens), kv_heads * group
    n_new = np.ones(B, np.int64)
    (kpool, vpool), tbl, held, (k_rows, v_rows) = grouped_pool(rng, lens, kv_heads, P, name)
    q = rng.standard_normal((B, hq, 1, D)).astype(st)
    out = np.zeros((B, hq, 1, D), st)
    lse = np.full((B, hq, 1), -np.inf, np.float32)
    params = params or gqakv.AttentionParams(scale=1.0 / math.sqrt(D))
    plan = planmod.plan_attention(dtype, D, batch=B, kv_heads=kv_heads, group=group, t_q=1, lens=lens,
                                  n_new=n_new, params=params, q_strides=element_strides(q)[:3],
                                  buf_strides=element_strides(kpool[0])[:3],
                                  out_strides=element_strides(out)[:3], sm_count=132,
                                  force_splits=force_splits, tensor_cores=True,
                                  pages=planmod.PageTableArg(tbl.shape[1], P), kv_dtype=name)
    arrays = {"q": q, "k_buf": kpool[0], "v_buf": vpool[0], "k_scale": kpool[1], "v_scale": vpool[1],
              "rows": np.arange(B, dtype=np.int64), "lens": lens, "n_new": n_new, "out": out,
              "lse": lse, "table": tbl}
    if params.sinks is not None:
        arrays["sinks"] = np.asarray(params.sinks, np.float32)
    ranges = None
    if poison:
        codes, scales = pool_poison(kpool[0], tbl, held, lens, P), pool_poison(kpool[1], tbl, held, lens, P)
        ranges = {"k_buf": codes, "v_buf": codes, "k_scale": scales, "v_scale": scales,
                  "table": table_poison(tbl, held)}
    emu.run(plan, arrays, poison=ranges)
    want, want_lse = reference_attention(q.astype(np.float64), k_rows, v_rows, n_new, params.scale,
                                         window=params.window, softcap=params.softcap, sinks=params.sinks)
    case = types.SimpleNamespace(name=f"paged {name} decode {dtype} P={P}", dtype=dtype)
    cases._check_out(case, 0, out, lse, want, want_lse, n_new,
                     {"max_out_err": 0.0, "max_out_tol": 0.0, "max_lse_err": 0.0})
    attn = [launch.name for launch in plan.launches if launch.kernel != "gqakv_merge"]
    assert attn and all(_tag(name) in n and n.endswith("KVPages>") for n in attn), attn
    return plan


#: (codec, dtype, page size, lens, force_splits, (window, softcap, sinks)): paged 4-bit decode.
DECODE_SCENARIOS = [
    ("int4_g32", "float32", 5, [37, 9, 20], None, (None, None, None)),
    ("int4_g64", "bfloat16", 16, [70, 12, 41], 3, (20, 1.0, True)),
]


def _params(window, softcap, sinks):
    return gqakv.AttentionParams(scale=1.0 / math.sqrt(D), window=window, softcap=softcap,
                                 sinks=np.linspace(-0.5, 0.5, 4).tolist() if sinks else None)


@pytest.mark.parametrize("scenario", DECODE_SCENARIOS, ids=[f"{s[0]}-{s[1]}-P{s[2]}" for s in DECODE_SCENARIOS])
def test_paged_int4_decode_over_shuffled_pages(scenario):
    name, dtype, P, lens, splits, variant = scenario
    plan = run_grouped_paged_decode(emulated_backend._grouped_library(D), name=name, dtype=dtype, P=P,
                                    lens=lens, force_splits=splits, params=_params(*variant), seed=P)
    assert bool(splits) == any(launch.kernel == "gqakv_merge" for launch in plan.launches)


#: This module's AddressSanitizer library: the paged 4-bit decode instantiations its
#: scenarios launch, and the merge of the split one.
ASAN_UNITS = harness.grouped_units(D, dtypes=tuple(dict.fromkeys(s[1] for s in DECODE_SCENARIOS)),
                                   variants=(0, 7), readers=("paged",), kind="asan grouped")
ASAN_UNITS = [harness.unit(u.kind, D, [e for e in u.entries if e.kernel in ("gqakv_decode", "gqakv_merge")
                                       and (e.kv_dtype is None or e.kv_dtype.startswith("int4"))])
              for u in ASAN_UNITS]


def asan_main() -> int:
    """DECODE_SCENARIOS on the AddressSanitizer build with every byte outside the live
    tokens poisoned; prints 'N passed'."""
    emu = harness.Emulator(harness.build_registrations(True, ASAN_UNITS))
    for name, dtype, P, lens, splits, variant in DECODE_SCENARIOS:
        run_grouped_paged_decode(emu, name=name, dtype=dtype, P=P, lens=lens, force_splits=splits,
                                 params=_params(*variant), seed=P, poison=True)
        print(f"ok paged {name} decode {dtype} P={P} splits={splits}", flush=True)
    print(f"{len(DECODE_SCENARIOS)} passed")
    return 0


def test_paged_int4_decode_under_asan():
    """AddressSanitizer (a subprocess with libasan preloaded) over ASAN_UNITS' library."""
    harness.check_asan_main("test_cupy_emulated_grouped", len(DECODE_SCENARIOS), units=ASAN_UNITS)


# ---- grouped row copies under AddressSanitizer -------------------------------------------------

#: Row copies of grouped storage (cases.CopyCase with a grouped kv_dtype: codes as byte rows,
#: scales as float rows, one launch each): a fork, a reorder wave (duplicate sources, an
#: empty copy), the reorder temporary on either side, and pool pages as rows (a paged
#: cache's copy on write: rows of page_size slots, partly filled pages); head dims 64 and
#: 128, so the block scales are rows of 1, 2 and 4 floats (4: 16-byte vector loads) and the
#: code rows 32, 64 and 128 bytes.
_LENS = (7, 0, 12, 3, 9, 5)
COPY_CASES = [
    cases.CopyCase("grouped-fork-int4_g32-d64", "bfloat16", 64, 2, 2, _LENS, (1, 3, 5), (2, 2, 2),
                   (12, 12, 12), seed=1, kv_dtype="int4_g32"),
    cases.CopyCase("grouped-wave-int8_g32-d128", "float32", 128, 2, 3, _LENS, (0, 3, 5, 2), (4, 4, 1, 4),
                   (9, 9, 0, 6), seed=2, kv_dtype="int8_g32"),
    cases.CopyCase("grouped-to-temp-int4_g64-d128", "bfloat16", 128, 2, 2, _LENS, (0,), (4,), (9,),
                   mode="to_temp", seed=3, kv_dtype="int4_g64"),
    cases.CopyCase("grouped-from-temp-int4_g32_rotated-d64", "float32", 64, 2, 2, _LENS, (2,), (0,), (7,),
                   mode="from_temp", seed=4, kv_dtype="int4_g32_rotated"),
    cases.CopyCase("grouped-pages-int4_g64-d64", "float32", 64, 2, 2, (3, 4, 0, 0, 2, 0), (2, 3), (0, 4),
                   (3, 2), max_len=4, seed=5, kv_dtype="int4_g64"),
    cases.CopyCase("grouped-pages-int8_g32-d64", "bfloat16", 64, 1, 2, (4, 1, 0, 0, 0), (2, 3, 4), (0, 1, 0),
                   (4, 1, 4), max_len=4, seed=6, kv_dtype="int8_g32"),
]
#: Their AddressSanitizer library: the grouped copy instantiations at both head dims
#: (harness.grouped_copy_entries: the table's copy_entries of every grouped codec).
COPY_ASAN_UNITS = [harness.Unit("asan grouped copies", None, tuple(
    {e.name: e for d in (64, 128) for e in harness.grouped_copy_entries(d)}.values()))]


def asan_copies_main() -> int:
    """COPY_CASES on the AddressSanitizer build, every code and scale byte outside the
    copied destination slots and the copied source prefixes poisoned; prints 'N passed'."""
    emu = harness.Emulator(harness.build_registrations(True, COPY_ASAN_UNITS))
    for case in COPY_CASES:
        stats = cases.run_copy_case(emu, case, poison=True)
        want = set(table.names(table.copy_entries(case.dtype, case.head_dim, case.kv_dtype)))
        assert stats["kernels"] == want, (case.name, stats["kernels"], want)
        print(f"ok {case.name}", flush=True)
    print(f"{len(COPY_CASES)} passed")
    return 0


def test_grouped_row_copies_under_asan():
    """AddressSanitizer (a subprocess with libasan preloaded) over COPY_ASAN_UNITS: each
    grouped copy moves exactly the model's codes and scales (every byte of every buffer
    compared) and touches nothing outside them."""
    harness.check_asan_main("test_cupy_emulated_grouped", len(COPY_CASES), units=COPY_ASAN_UNITS,
                            main="asan_copies_main")


@pytest.mark.parametrize("kv_dtype,paged", SELFTEST_GROUPED_LINES)
def test_selftest_grouped_lines_run_the_grouped_kernels(backend, monkeypatch, kv_dtype, paged):
    """``gqakv selftest --backend cupy``'s grouped lines (contiguous and paged) reach the
    grouped kernels (here on the emulated backend, quick, at d = 64 where the grouped
    library has them; row copies on the copy kernel's grouped entries) and pass."""
    from gqakv.tools import selftest

    monkeypatch.setattr(selftest, "GROUPED_HEAD_DIMS", (D,))
    line = (selftest.PAGED_KV_DTYPES if paged else selftest.KV_DTYPES)[kv_dtype]
    checks = {line: selftest.Check(line, "bfloat16")}
    rng = np.random.default_rng(0)
    if paged:
        selftest._paged(16, backend, "bfloat16", rng, True, checks, kv_dtype=kv_dtype)
    else:
        selftest._quantized(kv_dtype, backend, "bfloat16", rng, True, checks)
    assert checks[line].cases > 0 and checks[line].passed, checks[line].line()
    # row copies (a paged fork's copy on write: pool pages as rows) are the grouped copies
    copies = {n for n in backend.kernels if n.startswith("gqakv_copy_tokens<")}
    assert copies <= set(table.names(table.copy_entries("float32", D, kv_dtype))), copies
    launched = [n for n in backend.kernels if not n.startswith(("gqakv_merge", "gqakv_copy_tokens"))]
    assert launched and all(_tag(kv_dtype) in n for n in launched), launched
    assert all(n.endswith("KVPages>") == paged for n in launched), launched
