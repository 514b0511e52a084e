"""Paged x 8-bit storage on the cupy backend's kernels, run on the CPU emulator.

The 8-bit reader wraps the paged one (kernels/quantized_kv.cuh ``QuantizedKV<C, PagedKV>``:
codes through the page table, each key's scale at the codes' offset / d in the scale
pools ``[num_pages, Hkv, page_size]``), and the quantizing append writes codes and scales
through the table (``gqakv_write_kv_quantized<..., KVPages>``). Checked here:

* a ``PagedKVCache(kv_dtype=...)`` (int8 and float8_e4m3fn) on the emulated backend with
  the generic path made to fail: ragged chunked appends (an idle row), a copy-on-write
  fork then appends into the shared last page, small-T and T = 1 decode, split decode +
  merge; every attention against the float64 loop reference (tests/support/reference.py)
  on the dequantized values (``gqakv.storage.quantize``), with the other emulated suites' rule
  (``cases._check_out``: the same kernels over exactly representable values), under
  plain causal and window + soft-cap + sinks; the pool's live codes and scales equal,
  byte for byte, the numpy backend's cache after the same operations;
* the plans on a hand-made pool (shuffled pages, NaN outside the live tokens), decode,
  split decode, prefill and the append; and the same under AddressSanitizer with every
  code and scale byte no live token holds poisoned (a subprocess, as in the other
  emulated suites), so a scale looked up at the wrong page or slot aborts;
* routing: the kernels' declarations (``CupyBackend.fast_paths``) cover paged 8-bit
  storage, and refuse a codec no kernel declares (a throwaway one registered here) with
  FastPath's sentence while the generic path still serves it.
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np
import pytest

import gqakv
from gqakv.storage import quantize as Q
from gqakv.dispatch.backend import GENERIC

from gqakv_backends.cupy_backend import instantiations as table

from .cuda_emu import emulated_backend
from .cuda_emu import cases, harness
from .support.reference import reference_attention

if harness.compiler() is None:
    pytest.skip("no C++ compiler (g++) for the CUDA emulation harness", allow_module_level=True)

from gqakv_backends.cupy_backend import plan as planmod  # noqa: E402

from .cuda_emu.emulated_backend import EmulatedCupyBackend  # noqa: E402
from .cuda_emu.plans import (CODE_TAGS, D, element_strides, held_values, pool_poison,  # noqa: E402
                              quantized_pool, run_paged_quantized_plan, sinks_pattern,
                              table_poison)

KV_DTYPES = ("int8", "float8_e4m3fn")


@pytest.fixture
def backend(monkeypatch):
    """The emulated CupyBackend, the generic fallbacks made to fail for it, every launch
    name recorded in ``backend.kernels``."""
    return emulated_backend.kernels_only(monkeypatch, "paged 8-bit kernels")


# (n_new per row, or ("fork", src, dst)): a ragged prefill in two chunks (row 1 idle in the
# first), a fork of row 0 (19 tokens: its last page shared, copied on write before either
# writes into it), appends into the copies, small-T decode, T = 1 decode.
SEQUENCE = (
    (13, 0, 7, 10),
    (6, 9, 0, 3),
    ("fork", 0, (1,)),
    (3, 2, 0, 1),
    (1, 1, 1, 1),
    (1, 1, 1, 1),
)


def run_paged_quantized(backend, *, kv_dtype, dtype, page_size, window=None, softcap=None,
                        sinks=None, capability=None, kv_heads=2, group=2, seed=0,
                        sequence=SEQUENCE, max_len=48):
    """``sequence`` on a paged 8-bit cache of the emulated backend and on the numpy
    backend's twin; each attention checked against the reference on the dequantized
    values, the live codes and scales compared with the twin's at the end."""
    if capability is not None:
        backend._device_facts[0] = (132, capability)
    st = cases.STORAGE[dtype]
    rng = np.random.default_rng(seed)
    B = len(sequence[0])
    hq = kv_heads * group
    ref_be = gqakv.get_backend("numpy")
    cache, twin = (gqakv.PagedKVCache(B, kv_heads, max_len, D, dtype=dtype, backend=be,
                                      page_size=page_size, kv_dtype=kv_dtype)
                   for be in (backend, ref_be))
    cache.store.fill(np.nan)  # slots no kernel may read dequantize to NaN
    rows_k = [np.zeros((kv_heads, 0, D)) for _ in range(B)]
    rows_v = [np.zeros((kv_heads, 0, D)) for _ in range(B)]
    kw = dict(window=window, softcap=softcap, sinks=sinks_pattern(hq, sinks))
    stats = {"max_out_err": 0.0, "max_out_tol": 0.0, "max_lse_err": 0.0}
    for step, item in enumerate(sequence):
        if item[0] == "fork":
            for c in (cache, twin):
                c.fork(item[1], list(item[2]))
            for r in item[2]:
                rows_k[r], rows_v[r] = rows_k[item[1]], rows_v[item[1]]
            continue
        n = np.asarray(item, np.int64)
        T = int(n.max()) + 1  # one padding slot
        # token magnitudes that differ (scales differ between neighbouring slots, so a scale
        # read at the wrong slot or page shows), at the scores' usual size
        k = rng.standard_normal((B, kv_heads, T, D)) * rng.choice([0.5, 1.0, 1.5], (B, kv_heads, T, 1))
        v = rng.standard_normal((B, kv_heads, T, D)) * rng.choice([1e-3, 0.1, 1.0], (B, kv_heads, T, 1))
        k, v = k.astype(st), v.astype(st)
        q = (2.0 * rng.standard_normal((B, hq, T, D))).astype(st)
        for b in range(B):
            k[b, :, n[b]:] = v[b, :, n[b]:] = q[b, :, n[b]:] = np.nan  # padding: never read
        cache.append(backend.from_numpy(k), backend.from_numpy(v), n)
        twin.append(k, v, n)
        for b in range(B):
            rows_k[b] = np.concatenate([rows_k[b], held_values(k[b, :, :n[b]], kv_dtype)], axis=1)
            rows_v[b] = np.concatenate([rows_v[b], held_values(v[b, :, :n[b]], kv_dtype)], axis=1)
        out, lse = gqakv.gqa_attention(backend.from_numpy(q), cache, n, return_lse=True, **kw)
        ref_out, ref_lse = reference_attention(q.astype(np.float64), rows_k, rows_v, n,
                                               1.0 / math.sqrt(D), **kw)
        case = types.SimpleNamespace(name=f"paged {kv_dtype} {dtype} P={page_size}", dtype=dtype)
        cases._check_out(case, step, np.asarray(backend.to_numpy(out)),
                         np.asarray(backend.to_numpy(lse)), ref_out, ref_lse, n, stats)
        assert cache.store.page_table.audit(cache.host_lens) == []
    _assert_same_live_storage(cache, twin, backend)
    return backend.kernels


def _assert_same_live_storage(cache, twin, backend):
    """Every row's live codes and scales, looked up through each cache's own table, equal
    the numpy twin's byte for byte (the append quantized each token as gqakv.storage.quantize
    does; the copy on write moved codes and scales together)."""
    np.testing.assert_array_equal(cache.host_lens, twin.host_lens)
    P = cache.store.page_size
    got = {name: np.asarray(backend.to_numpy(getattr(cache.store, name)))
           for name in ("k", "v", "k_scale", "v_scale")}
    want = {name: np.asarray(getattr(twin.store, name)) for name in got}
    for b, L in enumerate(cache.host_lens):
        for j in range(int(L)):
            pg = int(cache.store.page_table.entries[b, j // P])
            pw = int(twin.store.page_table.entries[b, j // P])
            for name in got:
                g, w = got[name][pg, :, j % P], want[name][pw, :, j % P]
                assert g.tobytes() == w.tobytes(), (name, b, j)


def _assert_paged_quantized_kernels(names, code, *, split=False):
    attn = [n for n in names if n.startswith(("gqakv_decode", "gqakv_prefill"))]
    assert attn and all("gqakv_quantized<" in n and code in n and n.endswith(", KVPages>")
                        for n in attn), attn
    assert any(n.startswith("gqakv_decode<") for n in attn), attn
    assert any(n.startswith("gqakv_prefill<") for n in attn), attn
    writes = [n for n in names if n.startswith("gqakv_write_kv")]
    assert writes and all(n.startswith("gqakv_write_kv_quantized<") and n.endswith(", KVPages>")
                          for n in writes), writes
    assert split == any(n.startswith("gqakv_merge") for n in names), names


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("kv_dtype,dtype", [("int8", "float32"), ("float8_e4m3fn", "bfloat16"),
                                            ("int8", "bfloat16"), ("float8_e4m3fn", "float32")])
def test_paged_quantized_cache_matches_reference(backend, kv_dtype, dtype, page_size):
    """Chunked prefill, copy-on-write fork then appends, small-T and T = 1 decode over
    8-bit pages (the fp32-FMA kernels: the tensor-core ones take 16-bit fragments)."""
    names = run_paged_quantized(backend, kv_dtype=kv_dtype, dtype=dtype, page_size=page_size,
                                seed=page_size)
    _assert_paged_quantized_kernels(names, CODE_TAGS[kv_dtype])
    copies = [n for n in names if n.startswith("gqakv_copy_tokens")]
    if 19 % page_size:  # row 0's last page was shared by the fork: codes and scales copied
        assert f"gqakv_copy_tokens<{CODE_TAGS[kv_dtype]}, {D}>" in copies
        assert "gqakv_copy_tokens<float, 1>" in copies
    else:
        assert not copies


@pytest.mark.parametrize("variant", [(4, 1.5, "mixed"), (1, 1e-3, "large")],
                         ids=["W4-cap-sinks", "W1-tinycap-largesinks"])
@pytest.mark.parametrize("kv_dtype,dtype,page_size", [("int8", "bfloat16", 5), ("float8_e4m3fn", "float32", 3)])
def test_paged_quantized_variants(backend, kv_dtype, dtype, page_size, variant):
    """Window (starting inside a page), soft-cap and sinks over 8-bit pages."""
    window, softcap, sinks = variant
    names = run_paged_quantized(backend, kv_dtype=kv_dtype, dtype=dtype, page_size=page_size,
                                window=window, softcap=softcap, sinks=sinks, seed=3)
    attn = [n for n in names if n.startswith(("gqakv_decode", "gqakv_prefill"))]
    assert attn and all(n.endswith(", 7, KVPages>") and CODE_TAGS[kv_dtype] in n for n in attn), attn


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_paged_quantized_split_decode(backend, monkeypatch, kv_dtype):
    """Split-KV decode + merge over 8-bit pages (3 splits: a split starts inside a page),
    with every variant feature (the sink joins once, in the merge)."""
    monkeypatch.setattr(planmod, "plan_attention",
                        functools.partial(planmod.plan_attention, force_splits=3))
    names = run_paged_quantized(backend, kv_dtype=kv_dtype, dtype="bfloat16", page_size=4,
                                window=6, softcap=3.0, sinks="mixed", seed=11)
    _assert_paged_quantized_kernels(names, CODE_TAGS[kv_dtype], split=True)
    assert any(n.startswith("gqakv_merge") and n.endswith(", 4>") for n in names)


def test_paged_quantized_model_cache_layers(backend):
    """A paged 8-bit ModelKVCache: every layer's code and scale pools through one table."""
    rng = np.random.default_rng(4)
    layers, B, Hkv, G = 2, 3, 2, 2
    cache = gqakv.ModelKVCache(layers, B, Hkv, 40, D, dtype="float32", backend=backend,
                               page_size=8, kv_dtype="int8")
    rows = [[[np.zeros((Hkv, 0, D)) for _ in range(B)] for _ in range(2)] for _ in range(layers)]
    for n in ((11, 0, 5), (1, 1, 1)):
        n = np.asarray(n, np.int64)
        T = int(n.max())
        with cache.step(n) as step:
            for layer in range(layers):
                k = rng.standard_normal((B, Hkv, T, D)).astype(np.float32)
                v = rng.standard_normal((B, Hkv, T, D)).astype(np.float32)
                q = rng.standard_normal((B, Hkv * G, T, D)).astype(np.float32)
                for b in range(B):
                    q[b, :, n[b]:] = np.nan
                out, lse = step.attend(layer, backend.from_numpy(q), backend.from_numpy(k),
                                       backend.from_numpy(v), return_lse=True)
                for b in range(B):
                    for i, x in enumerate((k, v)):
                        rows[layer][i][b] = np.concatenate(
                            [rows[layer][i][b], held_values(x[b, :, :n[b]], "int8")], axis=1)
                ref_out, ref_lse = reference_attention(q.astype(np.float64), rows[layer][0],
                                                       rows[layer][1], n, 1.0 / math.sqrt(D))
                case = types.SimpleNamespace(name=f"paged int8 model layer {layer}", dtype="float32")
                cases._check_out(case, 0, np.asarray(backend.to_numpy(out)),
                                 np.asarray(backend.to_numpy(lse)), ref_out, ref_lse, n,
                                 {"max_out_err": 0.0, "max_out_tol": 0.0, "max_lse_err": 0.0})
    _assert_paged_quantized_kernels(backend.kernels, "gqakv_i8")


# ---- the plans on a hand-made pool: shuffled pages, and AddressSanitizer --------------------

def run_paged_quantized_write(emu, *, kv_dtype, dtype, P, lens, n_new, kv_heads=2, seed=0,
                              poison=False):
    """gqakv_write_kv_quantized's paged instantiation into shuffled pages: tokens
    lens - n_new .. lens - 1 of each row (pages already held); codes and scales must equal
    gqakv.storage.quantize's, bit for bit, every other byte unchanged (with ``poison``: untouched)."""
    rng = np.random.default_rng(seed)
    st = cases.STORAGE[dtype]
    lens, n_new = np.asarray(lens, np.int64), np.asarray(n_new, np.int64)
    B, T = len(lens), int(n_new.max()) + 1
    (kpool, vpool), table, held = quantized_pool(rng, lens, kv_heads, P, kv_dtype)
    starts = lens - n_new
    k_new = (rng.standard_normal((B, kv_heads, T, D)) * 3.0).astype(st)
    v_new = rng.standard_normal((B, kv_heads, T, D)).astype(st)
    want = [[a.copy() for a in pool] for pool in (kpool, vpool)]
    for x, (codes, scales) in zip((k_new, v_new), want):
        c, s = Q.quantize(np, x.astype(np.float32), kv_dtype)
        for b in range(B):
            for t in range(int(n_new[b])):
                j = int(starts[b]) + t
                codes[table[b, j // P], :, j % P] = c[b, :, t]
                scales[table[b, j // P], :, j % P] = s[b, :, t]
    plan = planmod.plan_write_kv(dtype, D, n_new, kv_heads, T, element_strides(k_new)[:3],
                                 element_strides(kpool[0])[:3],
                                 pages=planmod.PageTableArg(table.shape[1], P),
                                 kv_dtype=kv_dtype, scale_strides=element_strides(kpool[1])[:3])
    arrays = {"k_new": k_new, "v_new": v_new, "k_buf": kpool[0], "v_buf": vpool[0],
              "k_scale": kpool[1], "v_scale": vpool[1], "rows": np.arange(B, dtype=np.int64),
              "starts": starts, "n_new": n_new, "table": table}
    ranges = None
    if poison:
        live = lambda b: (int(starts[b]), int(lens[b]))  # noqa: E731
        codes = pool_poison(kpool[0], table, held, lens, P, live=live)
        scales = pool_poison(kpool[1], table, held, lens, P, live=live)
        ranges = {"k_buf": codes, "v_buf": codes, "k_scale": scales, "v_scale": scales,
                  "table": table_poison(table, held)}
    emu.run(plan, arrays, poison=ranges)
    for got, exp in zip((kpool, vpool), want):
        for g, w in zip(got, exp):
            assert g.tobytes() == w.tobytes()
    assert plan.launches[0].name == (f"gqakv_write_kv_quantized<{planmod.sources.CTYPES[dtype]}, "
                                     f"{CODE_TAGS[kv_dtype]}, {D}, KVPages>")


def _params(hq, window=None, softcap=None, sinks=None):
    return gqakv.AttentionParams(scale=1.0 / math.sqrt(D), window=window, softcap=softcap,
                                 sinks=sinks_pattern(hq, sinks))


#: (kv_dtype, dtype, force_splits, page_size, lens, n_new, (window, softcap, sinks)):
#: decode, split decode + merge, prefill over shuffled 8-bit pages of sizes 1, 5, 16
#: (variant flags 0 and 7: the paged 8-bit ones built, harness.PAGED_QUANTIZED_VARIANTS).
PLAN_SCENARIOS = [
    ("int8", "float32", None, 16, [37, 9, 20], [1, 1, 0], (None, None, None)),
    ("float8_e4m3fn", "bfloat16", None, 5, [37, 9, 20], [3, 1, 2], (4, 0.5, "mixed")),
    ("int8", "bfloat16", 3, 1, [70, 12, 41], [1, 1, 1], (None, None, None)),
    ("float8_e4m3fn", "float32", 4, 16, [70, 12, 41], [1, 1, 1], (20, 1.0, "mixed")),
    ("int8", "float32", None, 5, [30, 21, 8], [21, 9, 0], (6, 1.5, "mixed")),
    ("float8_e4m3fn", "bfloat16", None, 16, [30, 21, 8], [21, 9, 0], (None, None, None)),
]
#: (kv_dtype, dtype, page_size, lens, n_new) of the paged quantizing append.
WRITE_SCENARIOS = [("int8", "float32", 1, [9, 4, 6], [3, 0, 6]),
                   ("float8_e4m3fn", "bfloat16", 16, [40, 17, 3], [30, 2, 3]),
                   ("int8", "bfloat16", 5, [12, 5, 20], [8, 5, 1])]


@pytest.fixture(scope="module")
def emulator():
    return harness.Emulator(harness.build(asan=False))


@pytest.mark.parametrize("scenario", PLAN_SCENARIOS, ids=[f"{s[0]}-{s[1]}-P{s[3]}" + (f"-split{s[2]}" if s[2] else "")
                                                          for s in PLAN_SCENARIOS])
def test_paged_quantized_plans_over_shuffled_pages(emulator, scenario):
    kv_dtype, dtype, splits, P, lens, n_new, variant = scenario
    plan = run_paged_quantized_plan(emulator, kv_dtype=kv_dtype, dtype=dtype, P=P, lens=lens,
                                    n_new=n_new, force_splits=splits, params=_params(4, *variant), seed=P)
    assert bool(splits) == any(launch.kernel == "gqakv_merge" for launch in plan.launches)


@pytest.mark.parametrize("scenario", WRITE_SCENARIOS, ids=[f"{s[0]}-{s[1]}-P{s[2]}" for s in WRITE_SCENARIOS])
def test_paged_quantized_append_writes_only_its_slots(emulator, scenario):
    kv_dtype, dtype, P, lens, n_new = scenario
    run_paged_quantized_write(emulator, kv_dtype=kv_dtype, dtype=dtype, P=P, lens=lens, n_new=n_new, seed=P)


#: The AddressSanitizer library of this module: only the instantiations its scenarios launch
#: (driver.cpp registration code, two units compiled in parallel), not the whole default
#: library (six units, each much longer to compile with -fsanitize).
ASAN_UNITS = [
    harness.unit("asan paged 8-bit", 64, table.select(
        dtypes=("float32", "bfloat16"), head_dims=(64,), kv_dtypes=("int8", "float8_e4m3fn"),
        readers=("paged",), variants=(0, 7))),
    harness.unit("asan paged 8-bit merge and copies", 64, table.select(
        kernels=["gqakv_merge", "gqakv_copy_tokens"], dtypes=("float32", "bfloat16"), head_dims=(64,),
        variants=(0, 4)) + [table.SCALE_COPY]),
]


def asan_main() -> int:
    """PLAN_SCENARIOS and WRITE_SCENARIOS on the AddressSanitizer build, every code and
    scale byte outside the live tokens (and the table entries past the live pages)
    poisoned; prints 'N passed'."""
    emu = harness.Emulator(harness.build_registrations(True, ASAN_UNITS))
    for kv_dtype, dtype, splits, P, lens, n_new, variant in PLAN_SCENARIOS:
        run_paged_quantized_plan(emu, kv_dtype=kv_dtype, dtype=dtype, P=P, lens=lens, n_new=n_new,
                                 force_splits=splits, params=_params(4, *variant), seed=P, poison=True)
        print(f"ok attention {kv_dtype} {dtype} P={P} splits={splits} variant={variant}", flush=True)
    for kv_dtype, dtype, P, lens, n_new in WRITE_SCENARIOS:
        run_paged_quantized_write(emu, kv_dtype=kv_dtype, dtype=dtype, P=P, lens=lens, n_new=n_new,
                                  seed=P, poison=True)
        print(f"ok write_kv_quantized {kv_dtype} {dtype} P={P}", flush=True)
    print(f"{len(PLAN_SCENARIOS) + len(WRITE_SCENARIOS)} passed")
    return 0


def test_paged_quantized_kernels_under_asan():
    """AddressSanitizer (a subprocess with libasan preloaded) over ASAN_UNITS' library."""
    harness.check_asan_main("test_cupy_emulated_paged_quantized", len(PLAN_SCENARIOS) + len(WRITE_SCENARIOS), units=ASAN_UNITS)


# ---- routing: the declarations ----------------------------------------------------------------

def test_paged_quantized_routes(backend):
    """The declarations cover paged 8-bit storage on every kernel family but the row copy
    (pages are copied as rows of the pool, a contiguous store); the tensor-core kernels
    say why they do not read codes."""
    for t_q, fma, mma in ((1, "gqakv_decode", "gqakv_decode_mma"), (64, "gqakv_prefill", "gqakv_prefill_mma")):
        route = backend.route("attention", dtype="bfloat16", head_dim=128, t_q=t_q, capability=90,
                              codec="int8", layout="paged", features={"window", "sinks"})
        assert route.impl == fma, route
        assert "16-bit copy" in route.rejected[mma]
    assert backend.route("write_kv", dtype="float16", head_dim=64, codec="float8_e4m3fn",
                         layout="paged").impl == "gqakv_write_kv_quantized"
    route = backend.route("copy_tokens", dtype="float16", head_dim=64, codec="int8", layout="paged")
    assert route.impl == GENERIC and "storage layout 'paged'" in route.rejected["gqakv_copy_tokens"]
    declared = {p.name: p for p in backend.fast_paths}
    assert {"int8", "float8_e4m3fn"} <= declared["gqakv_decode"].codecs
    assert "paged" in declared["gqakv_write_kv_quantized"].layouts


def test_unknown_codec_is_refused_by_every_kernel(monkeypatch):
    """A codec no kernel declares (a throwaway 8-bit one, registered here, stored like
    int8) is refused by every kernel with FastPath's sentence, contiguous and paged, and
    the generic path computes it."""
    from gqakv.storage import codecs

    class Dummy8(codecs.Int8PerToken):
        """int8's scheme under another name: what a new codec looks like to the kernels."""

        name = "dummy8"

        def quantize(self, xp, x):
            return Q.quantize(xp, x, "int8")

        def dequantize(self, xp, codes, scales, table=None):
            return Q.dequantize(xp, codes, scales, "int8")

    codecs.register(Dummy8())
    try:
        be = EmulatedCupyBackend()
        for op, kernels in (("write_kv", ("gqakv_write_kv_quantized",)), ("copy_tokens", ("gqakv_copy_tokens",)),
                            ("attention", ("gqakv_decode", "gqakv_decode_mma"))):
            for storage in ("contiguous",) if op == "copy_tokens" else ("contiguous", "paged"):
                route = be.route(op, dtype="float32", head_dim=64, codec="dummy8", layout=storage)
                assert route.impl == GENERIC, (op, storage, route)
                why = route.rejected[kernels[0]]
                assert "kv_dtype='dummy8'" in why and "reads" in why, why
        rng = np.random.default_rng(0)
        k, v = rng.standard_normal((2, 2, 1, 5, D)).astype(np.float32)
        q = rng.standard_normal((2, 4, 1, D)).astype(np.float32)
        for make in (lambda: gqakv.KVCache(2, 1, 16, D, "float32", backend=be, kv_dtype="dummy8"),
                     lambda: gqakv.PagedKVCache(2, 1, 16, D, "float32", backend=be, kv_dtype="dummy8",
                                                page_size=4)):
            cache = make()
            before = be.launches
            cache.append(be.from_numpy(k), be.from_numpy(v), [5, 3])
            out = be.to_numpy(gqakv.gqa_attention(be.from_numpy(q), cache, [1, 1]))
            assert be.launches == before  # no kernel ran
            rows = [[held_values(x[b, :, :n], "int8") for b, n in enumerate((5, 3))] for x in (k, v)]
            want, _ = reference_attention(q.astype(np.float64), rows[0], rows[1], [1, 1])
            np.testing.assert_allclose(out, want, atol=2e-6)
    finally:
        codecs.unregister("dummy8")
