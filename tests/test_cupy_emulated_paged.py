"""The cupy backend's paged kernels (kernels/paged_kv.cuh), run on the CPU emulator.

A ``PagedKVCache`` (and a paged ``ModelKVCache``) on the emulated cupy backend
(tests/cuda_emu/emulated_backend.py: the backend's own code, kernels on the emulator)
goes through a serving sequence: chunked prefill of ragged rows (an idle row), a fork
that shares the prompt's pages (its partly filled last page copied on write by
gqakv_copy_tokens over the pool's pages), small-T and T = 1 decode. Every attention is
compared with the float64 loop reference (tests/support/reference.py) on a direct per-row model
of the appended tokens, with the rule of the other emulated suites (cases._check_out),
and every row's pages with the model (``live_kv``); the launches must be the paged
instantiations (``..., KVPages>``), never the generic path.

Covered: page sizes 1, 5 (not a power of two: the division path), 16 and 64 (larger
than most rows); float32 / float16 / bfloat16; the tensor-core kernels and the fp32-FMA
ones (a device without mma); split decode + merge; window / softcap / sinks over pages;
d = 64 and 20 (scalar loads). The AddressSanitizer run (a subprocess, as in the other
emulated suites) poisons every pool byte no row's live tokens occupy and the table
entries past the live pages, so a kernel that looks up a page it should not, or writes
anywhere but its slots, aborts.
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np
import pytest

import gqakv
from gqakv.dispatch.backend import GENERIC

from .cuda_emu import cases, harness
from .support.reference import reference_attention

if harness.compiler() is None:
    pytest.skip("no C++ compiler (g++) for the CUDA emulation harness", allow_module_level=True)

from gqakv_backends.cupy_backend import plan as planmod  # noqa: E402

from .cuda_emu.emulated_backend import EmulatedCupyBackend  # noqa: E402
from .cuda_emu.plans import (pool_poison, run_paged_plan, shuffled_pool, sinks_pattern,  # noqa: E402
                              table_poison)


def _backend(capability: int | None = None):
    """An emulated cupy backend recording the name of every launch; ``capability`` below
    80 keeps 16-bit dtypes on the fp32-FMA kernels (no tensor cores)."""
    be = EmulatedCupyBackend()
    names: list[str] = []
    run = be._run_plan

    def recording(plan, arrays, dtype, d):
        names.extend(launch.name for launch in plan.launches)
        return run(plan, arrays, dtype, d)

    be._run_plan = recording
    if capability is not None:
        be._device_facts[0] = (132, capability)
    return be, names


class _Model:
    """The direct per-row model: each row's live K/V ``[Hkv, L, d]`` in the storage dtype."""

    def __init__(self, batch, kv_heads, d, st):
        empty = np.zeros((kv_heads, 0, d), st)
        self.k = [empty] * batch
        self.v = [empty] * batch

    def append(self, k, v, n):
        for b, m in enumerate(n):
            self.k[b] = np.concatenate([self.k[b], k[b, :, :m]], axis=1)
            self.v[b] = np.concatenate([self.v[b], v[b, :, :m]], axis=1)

    def fork(self, src, dst):
        for r in dst:
            self.k[r], self.v[r] = self.k[src], self.v[src]


# (n_new per row, or ("fork", src, dst)): a ragged prefill in two chunks (row 1 idle in
# the first), a fork of row 0's prompt into row 1, small-T decode, T = 1 decode.
SEQUENCE = (
    (13, 0, 7, 10),
    (6, 9, 0, 3),
    ("fork", 0, (1,)),
    (3, 2, 0, 1),
    (1, 1, 1, 1),
    (1, 1, 1, 1),
)


def run_paged(*, dtype, d=64, page_size, kv_heads=2, group=2, window=None, softcap=None,
              sinks=None, capability=None, force_splits=None, seed=0, monkeypatch=None,
              sequence=SEQUENCE, max_len=48):
    """Run ``sequence`` on a PagedKVCache of the emulated cupy backend, each attention step
    checked against the reference; returns the launch names and the copy-on-write count."""
    if force_splits:
        monkeypatch.setattr(planmod, "plan_attention",
                            functools.partial(planmod.plan_attention, force_splits=force_splits))
    be, names = _backend(capability)
    st = cases.STORAGE[dtype]
    rng = np.random.default_rng(seed)
    B = len(sequence[0])
    hq = kv_heads * group
    cache = gqakv.PagedKVCache(B, kv_heads, max_len, d, dtype=dtype, backend=be,
                               page_size=page_size)
    cache.store.fill(np.nan)  # slots no kernel may read are NaN
    model = _Model(B, kv_heads, d, st)
    kw = dict(window=window, softcap=softcap, sinks=sinks_pattern(hq, sinks))
    stats = {"max_out_err": 0.0, "max_out_tol": 0.0, "max_lse_err": 0.0}
    for step, item in enumerate(sequence):
        if item[0] == "fork":
            cache.fork(item[1], list(item[2]))
            model.fork(item[1], item[2])
            continue
        n = np.asarray(item, np.int64)
        T = int(n.max()) + 1  # one padding slot
        k = rng.standard_normal((B, kv_heads, T, d)).astype(st)
        v = rng.standard_normal((B, kv_heads, T, d)).astype(st)
        q = (2.0 * rng.standard_normal((B, hq, T, d))).astype(st)
        for b in range(B):
            k[b, :, n[b]:] = v[b, :, n[b]:] = q[b, :, n[b]:] = np.nan  # padding: never read
        cache.append(be.from_numpy(k), be.from_numpy(v), n)
        model.append(k, v, n)
        out, lse = gqakv.gqa_attention(be.from_numpy(q), cache, n, return_lse=True, **kw)
        ref_out, ref_lse = reference_attention(q.astype(np.float64), model.k, model.v, n,
                                               1.0 / math.sqrt(d), **kw)
        case = types.SimpleNamespace(name=f"paged {dtype} P={page_size}", dtype=dtype)
        cases._check_out(case, step, np.asarray(be.to_numpy(out)), np.asarray(be.to_numpy(lse)),
                         ref_out, ref_lse, n, stats)
        assert cache.store.page_table.audit(cache.host_lens) == []
    for b in range(B):  # the pages hold exactly the appended tokens
        k_live, v_live = (np.asarray(be.to_numpy(x)) for x in cache.live_kv(b))
        assert np.array_equal(k_live.view(np.uint8), model.k[b].view(np.uint8)), f"row {b} K"
        assert np.array_equal(v_live.view(np.uint8), model.v[b].view(np.uint8)), f"row {b} V"
    return names


def _assert_paged_kernels(names, *, prefill, decode, split=False):
    attn = [n for n in names if not n.startswith(("gqakv_write_kv", "gqakv_copy_tokens", "gqakv_merge"))]
    assert attn and all(n.endswith(", KVPages>") for n in attn), attn
    assert any(n.startswith("gqakv_write_kv") and n.endswith(", KVPages>") for n in names)
    assert any(n.startswith(prefill + "<") for n in attn), (prefill, attn)
    assert any(n.startswith(decode + "<") for n in attn), (decode, attn)
    assert split == any(n.startswith("gqakv_merge") for n in names)


@pytest.mark.parametrize("page_size", [1, 5, 16, 64])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_paged_kernels_match_reference(dtype, page_size):
    """Chunked prefill, fork, small-T and T = 1 decode over pages: tensor-core kernels for
    the 16-bit dtypes (an H200 is emulated), fp32-FMA for float32."""
    names = run_paged(dtype=dtype, page_size=page_size, seed=page_size)
    mma = dtype != "float32"
    _assert_paged_kernels(names, prefill="gqakv_prefill_mma" if mma else "gqakv_prefill",
                          decode="gqakv_decode_mma" if mma else "gqakv_decode")
    # the fork's shared last page is copied before row 0 or 1 writes into it
    copies = [n for n in names if n.startswith("gqakv_copy_tokens")]
    assert copies if 19 % page_size else not copies


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_paged_fma_kernels_for_16_bit(dtype):
    """A device without tensor cores: 16-bit pages through the fp32-FMA kernels."""
    names = run_paged(dtype=dtype, page_size=16, capability=75, seed=7)
    _assert_paged_kernels(names, prefill="gqakv_prefill", decode="gqakv_decode")


@pytest.mark.parametrize("dtype,capability", [("float32", None), ("bfloat16", None),
                                              ("float16", 75)])
def test_paged_split_decode(monkeypatch, dtype, capability):
    """Split-KV decode + merge over pages (3 splits: a split starts inside a page)."""
    names = run_paged(dtype=dtype, page_size=4, capability=capability, force_splits=3,
                      monkeypatch=monkeypatch, seed=11)
    mma = dtype != "float32" and capability is None
    _assert_paged_kernels(names, prefill="gqakv_prefill_mma" if mma else "gqakv_prefill",
                          decode="gqakv_decode_mma" if mma else "gqakv_decode", split=True)


# (window, softcap, sinks): all three together (the paged flags the emulator builds,
# harness.PAGED_VARIANTS): a window starting inside a page with a mild soft-cap and mixed
# sinks (-inf among them); W = 1 with a saturating soft-cap and sinks far above the scores.
PAGED_VARIANTS = [(4, 1.5, "mixed"), (1, 1e-3, "large")]


@pytest.mark.parametrize("variant", PAGED_VARIANTS, ids=["W4-cap-sinks", "W1-tinycap-largesinks"])
@pytest.mark.parametrize("dtype,page_size,capability", [("bfloat16", 16, None), ("float32", 3, None),
                                                        ("float16", 1, 75)])
def test_paged_variants(dtype, page_size, capability, variant):
    """Window (starting inside a page), soft-cap and sinks over pages."""
    window, softcap, sinks = variant
    names = run_paged(dtype=dtype, page_size=page_size, capability=capability, window=window,
                      softcap=softcap, sinks=sinks, seed=3)
    flags = (window is not None) * 1 + (softcap is not None) * 2 + (sinks is not None) * 4
    attn = [n for n in names if n.startswith(("gqakv_decode", "gqakv_prefill"))]
    assert attn and all(n.endswith(f", {flags}, KVPages>") for n in attn), attn


def test_paged_split_decode_with_sinks(monkeypatch):
    """The sink joins once, in the merge, after the paged splits."""
    names = run_paged(dtype="bfloat16", page_size=16, window=6, softcap=3.0, sinks="large", force_splits=3,
                      monkeypatch=monkeypatch, seed=5)
    assert any(n.startswith("gqakv_merge") and n.endswith(", 4>") for n in names)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_scalar_head_dim(dtype):
    """d = 20: scalar loads, the fp32-FMA kernels for every dtype."""
    names = run_paged(dtype=dtype, d=20, page_size=16, kv_heads=1, group=3, seed=2)
    _assert_paged_kernels(names, prefill="gqakv_prefill", decode="gqakv_decode")


def test_paged_model_cache_layers():
    """A paged ModelKVCache: every layer's pool (a view of [layers, num_pages, Hkv, P, d])
    through one table; each layer's attention checked against the reference."""
    be, names = _backend()
    st = cases.STORAGE["bfloat16"]
    rng = np.random.default_rng(4)
    layers, B, Hkv, G, d = 2, 3, 2, 2, 64
    cache = gqakv.ModelKVCache(layers, B, Hkv, 40, d, dtype="bfloat16", backend=be, page_size=8)
    cache.store.fill(np.nan)
    models = [_Model(B, Hkv, d, st) for _ in range(layers)]
    for n in ((11, 0, 5), (1, 1, 1)):
        n = np.asarray(n, np.int64)
        T = int(n.max())
        with cache.step(n) as step:
            for layer in range(layers):
                k = rng.standard_normal((B, Hkv, T, d)).astype(st)
                v = rng.standard_normal((B, Hkv, T, d)).astype(st)
                q = rng.standard_normal((B, Hkv * G, T, d)).astype(st)
                for b in range(B):
                    k[b, :, n[b]:] = v[b, :, n[b]:] = q[b, :, n[b]:] = np.nan
                out, lse = step.attend(layer, be.from_numpy(q), be.from_numpy(k), be.from_numpy(v),
                                       return_lse=True)
                models[layer].append(k, v, n)
                ref_out, ref_lse = reference_attention(q.astype(np.float64), models[layer].k,
                                                       models[layer].v, n, 1.0 / math.sqrt(d))
                case = types.SimpleNamespace(name=f"paged model layer {layer}", dtype="bfloat16")
                cases._check_out(case, 0, np.asarray(be.to_numpy(out)), np.asarray(be.to_numpy(lse)),
                                 ref_out, ref_lse, n, {"max_out_err": 0.0, "max_out_tol": 0.0,
                                                       "max_lse_err": 0.0})
    for layer in range(layers):
        for b in range(B):
            k_live, _ = (np.asarray(be.to_numpy(x)) for x in cache.live_kv(layer, b))
            assert np.array_equal(k_live.view(np.uint8), models[layer].k[b].view(np.uint8))
    assert all(n.endswith("KVPages>") for n in names if not n.startswith("gqakv_copy_tokens"))


# ---- the plans on a hand-made pool: shuffled pages, and AddressSanitizer --------------------

def run_paged_write(emu, *, dtype, d=64, P, lens, n_new, kv_heads=2, seed=0, poison=False):
    """gqakv_write_kv's paged instantiation into a shuffled pool: tokens lens - n_new ..
    lens - 1 of each row (pages already held); the pool must equal the direct writes,
    bit for bit, and with ``poison`` no other byte may be touched."""
    rng = np.random.default_rng(seed)
    st = cases.STORAGE[dtype]
    lens, n_new = np.asarray(lens, np.int64), np.asarray(n_new, np.int64)
    B, T = len(lens), int(n_new.max()) + 1
    k, v, table, held = shuffled_pool(rng, st, lens, kv_heads, d, P)
    starts = lens - n_new
    k_new = rng.standard_normal((B, kv_heads, T, d)).astype(st)
    v_new = rng.standard_normal((B, kv_heads, T, d)).astype(st)
    want_k, want_v = k.copy(), v.copy()
    for b in range(B):
        for t in range(int(n_new[b])):
            j = int(starts[b]) + t
            want_k[table[b, j // P], :, j % P] = k_new[b, :, t]
            want_v[table[b, j // P], :, j % P] = v_new[b, :, t]
    strides = lambda a: tuple(s // a.itemsize for s in a.strides)[:3]  # noqa: E731
    plan = planmod.plan_write_kv(dtype, d, n_new, kv_heads, T, strides(k_new), strides(k),
                                 pages=planmod.PageTableArg(table.shape[1], P))
    arrays = {"k_new": k_new, "v_new": v_new, "k_buf": k, "v_buf": v,
              "rows": np.arange(B, dtype=np.int64), "starts": starts, "n_new": n_new, "table": table}
    ranges = None
    if poison:
        kv = pool_poison(k, table, held, lens, P, live=lambda b: (int(starts[b]), int(lens[b])))
        ranges = {"k_buf": kv, "v_buf": kv, "table": table_poison(table, held)}
    emu.run(plan, arrays, poison=ranges)
    assert np.array_equal(k.view(np.uint8), want_k.view(np.uint8))
    assert np.array_equal(v.view(np.uint8), want_v.view(np.uint8))
    assert plan.launches[0].name.endswith(", KVPages>")


def _params(d, hq, window=None, softcap=None, sinks=None):
    return gqakv.AttentionParams(scale=1.0 / math.sqrt(d), window=window, softcap=softcap,
                                 sinks=sinks_pattern(hq, sinks))


#: (dtype, tensor_cores, force_splits, page_size, lens, n_new, (window, softcap, sinks)):
#: decode, split decode + merge, both prefills, over shuffled pages of sizes 1, 5, 16, 64
#: (variant flags among harness.PAGED_VARIANTS, the paged ones built).
PLAN_SCENARIOS = [
    ("float16", True, None, 16, [37, 9, 20], [1, 1, 0], (None, None, None)),
    ("float32", False, None, 5, [37, 9, 20], [3, 1, 2], (4, 0.5, "mixed")),
    ("bfloat16", True, 3, 1, [70, 12, 41], [1, 1, 1], (None, None, None)),
    ("bfloat16", False, 4, 16, [70, 12, 41], [1, 1, 1], (20, 1.0, "mixed")),
    ("float32", False, None, 64, [30, 21, 8], [21, 9, 0], (None, None, None)),
    ("bfloat16", True, None, 5, [30, 21, 8], [21, 9, 0], (6, 1.5, "mixed")),
]
#: (dtype, page_size, lens, n_new) of the paged append.
WRITE_SCENARIOS = [("float32", 1, [9, 4, 6], [3, 0, 6]), ("bfloat16", 16, [40, 17, 3], [30, 2, 3]),
                   ("float16", 5, [12, 5, 20], [8, 5, 1])]


@pytest.fixture(scope="module")
def emulator():
    return harness.Emulator(harness.build(asan=False))


@pytest.mark.parametrize("scenario", PLAN_SCENARIOS, ids=[f"{s[0]}-P{s[3]}" + ("-mma" if s[1] else "")
                                                          + (f"-split{s[2]}" if s[2] else "")
                                                          for s in PLAN_SCENARIOS])
def test_paged_plans_over_shuffled_pages(emulator, scenario):
    dtype, tc, splits, P, lens, n_new, variant = scenario
    run_paged_plan(emulator, dtype=dtype, P=P, lens=lens, n_new=n_new, tensor_cores=tc,
                   force_splits=splits, params=_params(64, 4, *variant), seed=P)


@pytest.mark.parametrize("scenario", WRITE_SCENARIOS, ids=[f"{s[0]}-P{s[1]}" for s in WRITE_SCENARIOS])
def test_paged_append_writes_only_its_slots(emulator, scenario):
    dtype, P, lens, n_new = scenario
    run_paged_write(emulator, dtype=dtype, P=P, lens=lens, n_new=n_new, seed=P)


def asan_main() -> int:
    """PLAN_SCENARIOS and WRITE_SCENARIOS on the AddressSanitizer build, every byte outside
    the live tokens (and the live table entries) poisoned; prints 'N passed'."""
    emu = harness.Emulator(harness.build(asan=True))
    for dtype, tc, splits, P, lens, n_new, variant in PLAN_SCENARIOS:
        run_paged_plan(emu, dtype=dtype, P=P, lens=lens, n_new=n_new, tensor_cores=tc,
                       force_splits=splits, params=_params(64, 4, *variant), seed=P, poison=True)
        print(f"ok attention {dtype} P={P} tc={tc} splits={splits} variant={variant}", flush=True)
    for dtype, P, lens, n_new in WRITE_SCENARIOS:
        run_paged_write(emu, dtype=dtype, P=P, lens=lens, n_new=n_new, seed=P, poison=True)
        print(f"ok write_kv {dtype} P={P}", flush=True)
    print(f"{len(PLAN_SCENARIOS) + len(WRITE_SCENARIOS)} passed")
    return 0


def test_paged_kernels_under_address_sanitizer():
    harness.check_asan_main("test_cupy_emulated_paged", len(PLAN_SCENARIOS) + len(WRITE_SCENARIOS))


@pytest.mark.parametrize("page_size", [1, 16])
def test_selftest_paged_lines_run_the_paged_kernels(monkeypatch, page_size):
    """``gqakv selftest --backend cupy``'s paged lines reach the paged kernels (here on the
    emulated backend, quick, at d = 64 where the emulation library has them) and pass."""
    from gqakv.tools import selftest

    monkeypatch.setitem(selftest.HEAD_DIMS, True, (64,))
    be, names = _backend()
    line = f"paged P={page_size}"
    checks = {line: selftest.Check(line, "bfloat16")}
    selftest._paged(page_size, be, "bfloat16", np.random.default_rng(0), True, checks)
    assert checks[line].cases > 0 and checks[line].passed, checks[line].line()
    attn = [n for n in names if n.startswith(("gqakv_decode", "gqakv_prefill", "gqakv_write_kv"))]
    assert attn and all(n.endswith("KVPages>") for n in attn), attn


def test_paged_routes_and_rejections():
    """What the route table says about pages: the kernels take them (8-bit pages too: see
    test_cupy_emulated_paged_quantized.py); rows the kernels' 32-bit key index cannot hold
    keep the generic path, with the reason; copy_tokens copies contiguous rows only (pages
    move as rows of the pool)."""
    from gqakv_backends.cupy_backend import _store_rejection, routing

    be, names = _backend()
    cache = gqakv.PagedKVCache(2, 1, 32, 64, dtype="float32", backend=be, page_size=8)
    assert _store_rejection(cache.store) is None
    route = be.route("copy_tokens", dtype="float32", head_dim=64, layout="paged")
    assert route.impl == GENERIC and "storage layout 'paged'" in route.rejected["gqakv_copy_tokens"]
    impls = routing.implementations()
    assert all("paged" in impls[k] for k in ("gqakv_write_kv", "gqakv_write_kv_quantized", "gqakv_decode",
                                             "gqakv_decode_mma", "gqakv_prefill", "gqakv_prefill_mma"))
    huge = gqakv.PagedKVCache(1, 1, 8, 64, dtype="float32", backend=be, page_size=8, num_pages=1)
    huge.store.page_table.entries = np.zeros((1, 2**28), np.int32)  # 2^31 slots per row, never allocated
    assert "32 bits" in _store_rejection(huge.store)
    with pytest.raises(NotImplementedError, match="32 bits"):
        planmod.PageTableArg(table_stride=2**28, page_size=8)
    x = be.from_numpy(np.ones((2, 1, 3, 64), np.float32))
    names.clear()
    cache.append(x, x, [3, 1])
    assert names == ["gqakv_write_kv<float, 64, KVPages>"]


def test_page_divisor_is_exact():
    """The kernels' key / P (multiply-high, add, shift; kernels/paged_kv.cuh page_of) equals
    the division for every page size up to 4,096 and its tricky keys (multiples of P and
    their neighbours, the largest keys below 2^31), and for a few huge page sizes."""
    rng = np.random.default_rng(0)
    for P in [*range(1, 4097), 65_537, 1_000_003, 2**30, 2**31 - 1]:
        magic, shift = planmod.page_divisor(P)
        assert 0 < magic < 2**32
        edges = [m * P + e for m in (1, 2, 2**31 // P - 1, 2**31 // P) for e in (-1, 0, 1)]
        keys = [k for k in edges + [0, 2**31 - 1, *rng.integers(0, 2**31, 8).tolist()]
                if 0 <= k < 2**31]
        keys = np.array(keys, dtype=np.uint64)
        got = (((np.uint64(magic) * keys) >> np.uint64(32)) + keys) >> np.uint64(shift)
        assert np.array_equal(got, keys // np.uint64(P)), P
