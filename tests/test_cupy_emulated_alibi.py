"""ALiBi in the cupy backend's kernels, run on the CPU emulator.

ALiBi is one flag of the variant trait (kernels/variant.cuh: GQAKV_VARIANT_ALIBI, the score
hook ``transform`` adding ``slope[h] * (k_pos - q_pos)`` after the soft-cap, before the mask
and the softmax; the slopes, one per query head, reach the kernels in AttnParams). Shown
here on decode (T = 1, small T, split + merge) and chunked prefill, over contiguous, paged
and 8-bit (int8 / e4m3, contiguous and paged) caches, through the backend itself (the
generic path made to fail), alone and with window + soft-cap + sinks: every attention
against the float64 loop reference (tests/support/reference.py, ``alibi_slopes=``) on the
values the cache holds, with the emulated suites' rule (``cases._check_out``). The
AddressSanitizer run (a subprocess) repeats the plans over contiguous rows, shuffled pages
and shuffled 8-bit pages with every byte no query may read poisoned.

The slope patterns are float32-exact (the kernels take float32 slopes): BLOOM's
2^(-8 (h + 1) / Hq) and a mixed one with negative and zero slopes.
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np
import pytest

import gqakv

from gqakv_backends.cupy_backend import instantiations as table

from .cuda_emu import emulated_backend
from .cuda_emu import cases, harness
from .support.reference import reference_attention

if harness.compiler() is None:
    pytest.skip("no C++ compiler (g++) for the CUDA emulation harness", allow_module_level=True)

from gqakv_backends.cupy_backend import plan as planmod  # noqa: E402

from .cuda_emu.plans import (alibi_pattern, held_values, run_paged_plan,  # noqa: E402
                              run_paged_quantized_plan, run_variant, sinks_pattern,
                              variant_params)

D = 64  # the default emulation library's ALiBi instantiations (flags 8 and 15; paged: 15)


@pytest.fixture
def backend(monkeypatch):
    """The emulated CupyBackend, the generic fallbacks made to fail for it, every launch
    name recorded in ``backend.kernels``."""
    return emulated_backend.kernels_only(monkeypatch, "ALiBi kernels")


#: (n_new per row): a ragged chunked prefill (an idle row), small-T decode, T = 1 decode.
SEQUENCE = ((13, 0, 7), (6, 9, 0), (3, 2, 1), (1, 1, 1), (1, 1, 1))


def run_alibi_cache(backend, *, storage, kv_dtype, dtype, alibi, window=None, softcap=None,
                    sinks=None, capability=None, kv_heads=2, group=4, seed=0, max_len=48):
    """SEQUENCE on a cache of ``storage`` ("contiguous" / "paged", page size 5) and
    ``kv_dtype`` (None or 8-bit) under ALiBi (``alibi``: a pattern of alibi_pattern), each
    attention against the reference on the values the cache holds; the launch names."""
    if capability is not None:
        backend._device_facts[0] = (132, capability)
    st = cases.STORAGE[dtype]
    rng = np.random.default_rng(seed)
    B, hq = len(SEQUENCE[0]), kv_heads * group
    kw = dict(kv_dtype=kv_dtype, backend=backend, dtype=dtype)
    cache = (gqakv.PagedKVCache(B, kv_heads, max_len, D, page_size=5, **kw) if storage == "paged"
             else gqakv.KVCache(B, kv_heads, max_len, D, **kw))
    cache.store.fill(np.nan)  # slots no kernel may read are NaN
    rows = [[np.zeros((kv_heads, 0, D)) for _ in range(B)] for _ in range(2)]
    params = dict(window=window, softcap=softcap, sinks=sinks_pattern(hq, sinks),
                  alibi_slopes=alibi_pattern(alibi, hq))
    held = ((lambda x: held_values(x, kv_dtype)) if kv_dtype else (lambda x: x.astype(np.float64)))
    for step, item in enumerate(SEQUENCE):
        n = np.asarray(item, np.int64)
        T = int(n.max()) + 1  # one padding slot
        k = rng.standard_normal((B, kv_heads, T, D)).astype(st)
        v = rng.standard_normal((B, kv_heads, T, D)).astype(st)
        q = (2.0 * rng.standard_normal((B, hq, T, D))).astype(st)
        for b in range(B):
            k[b, :, n[b]:] = v[b, :, n[b]:] = q[b, :, n[b]:] = np.nan  # padding: never read
        cache.append(backend.from_numpy(k), backend.from_numpy(v), n)
        for b in range(B):
            for i, x in enumerate((k, v)):
                rows[i][b] = np.concatenate([rows[i][b], held(x[b, :, :n[b]])], axis=1)
        out, lse = gqakv.gqa_attention(backend.from_numpy(q), cache, n, return_lse=True, **params)
        ref_out, ref_lse = reference_attention(q.astype(np.float64), rows[0], rows[1], n,
                                               1.0 / math.sqrt(D), **params)
        case = types.SimpleNamespace(name=f"alibi {storage} {kv_dtype} {dtype}", dtype=dtype)
        cases._check_out(case, step, np.asarray(backend.to_numpy(out)),
                         np.asarray(backend.to_numpy(lse)), ref_out, ref_lse, n,
                         {"max_out_err": 0.0, "max_out_tol": 0.0, "max_lse_err": 0.0})
    return backend.kernels


def _attention_kernels(names):
    return [n for n in names if n.startswith(("gqakv_decode", "gqakv_prefill"))]


def _flag(names, flags):
    """Every attention launch is the instantiation of variant ``flags``."""
    attn = _attention_kernels(names)
    assert attn and all(n.endswith((f", {flags}>", f", {flags}, KVPages>")) for n in attn), attn
    assert any(n.startswith("gqakv_decode") for n in attn) and any(n.startswith("gqakv_prefill") for n in attn)
    return attn


#: (storage, kv_dtype, dtype, alibi, (window, softcap, sinks)): ALiBi alone (flags 8) and
#: with every feature (15; the flag set the paged instantiations are built for).
CACHE_SCENARIOS = [
    ("contiguous", None, "float32", "bloom", (None, None, None)),
    ("contiguous", None, "bfloat16", "mixed", (None, None, None)),
    ("contiguous", None, "float16", "bloom", (4, 1.5, "mixed")),
    ("paged", None, "float32", "mixed", (4, 1.5, "mixed")),
    ("paged", None, "bfloat16", "bloom", (6, 3.0, "large")),
    ("contiguous", "int8", "float32", "bloom", (None, None, None)),
    ("contiguous", "float8_e4m3fn", "bfloat16", "mixed", (5, 2.0, "mixed")),
    ("paged", "int8", "bfloat16", "mixed", (4, 1.5, "mixed")),
    ("paged", "float8_e4m3fn", "float32", "bloom", (6, 3.0, "large")),
]


@pytest.mark.parametrize("scenario", CACHE_SCENARIOS,
                         ids=[f"{s[0]}-{s[1] or 'plain'}-{s[2]}-{s[3]}" + ("-all" if s[4][0] else "")
                              for s in CACHE_SCENARIOS])
def test_alibi_caches_match_reference(backend, scenario):
    """Chunked prefill, small-T and T = 1 decode under ALiBi on each storage (16-bit plain
    caches on the tensor-core kernels, as an H200 is emulated; the rest fp32-FMA)."""
    storage, kv_dtype, dtype, alibi, (window, softcap, sinks) = scenario
    names = run_alibi_cache(backend, storage=storage, kv_dtype=kv_dtype, dtype=dtype, alibi=alibi,
                            window=window, softcap=softcap, sinks=sinks, seed=CACHE_SCENARIOS.index(scenario))
    attn = _flag(names, 15 if window else 8)
    if storage == "paged":
        assert all(n.endswith("KVPages>") for n in attn)
    if kv_dtype:
        assert all("gqakv_quantized<" in n for n in attn)
    elif dtype != "float32":
        assert {n.split("<")[0] for n in attn} == {"gqakv_decode_mma", "gqakv_prefill_mma"}


def test_alibi_fma_kernels_for_16_bit(backend):
    """A device without tensor cores: 16-bit caches under ALiBi through the fp32-FMA kernels."""
    names = run_alibi_cache(backend, storage="contiguous", kv_dtype=None, dtype="bfloat16",
                            alibi="mixed", capability=75, seed=5)
    assert {n.split("<")[0] for n in _flag(names, 8)} == {"gqakv_decode", "gqakv_prefill"}


@pytest.mark.parametrize("storage,kv_dtype", [("contiguous", None), ("paged", "int8")])
def test_alibi_split_decode(backend, monkeypatch, storage, kv_dtype):
    """Split-KV decode + merge under ALiBi and every feature: each split biases its keys by
    their absolute distance to the query (splits start inside the row), the sink joins once."""
    monkeypatch.setattr(planmod, "plan_attention",
                        functools.partial(planmod.plan_attention, force_splits=3))
    names = run_alibi_cache(backend, storage=storage, kv_dtype=kv_dtype, dtype="float32",
                            alibi="mixed", window=20, softcap=2.0, sinks="mixed", seed=9)
    _flag(names, 15)
    assert any(n.startswith("gqakv_merge") and n.endswith(", 4>") for n in names)


def test_alibi_routes(backend):
    """The kernels declare ALiBi (FastPath features): every attention kernel serves it."""
    declared = {p.name: p for p in backend.fast_paths if p.op == "attention"}
    assert all("alibi" in p.features for p in declared.values())
    for t_q, kernel in ((1, "gqakv_decode_mma"), (64, "gqakv_prefill_mma")):
        route = backend.route("attention", dtype="bfloat16", head_dim=128, t_q=t_q, capability=90,
                              features={"alibi", "window", "softcap", "sinks"}, layout="paged")
        assert route.impl == kernel, route
    assert planmod.variant_flags(gqakv.AttentionParams(scale=1.0, alibi_slopes=(0.5,))) == 8


# ---- AddressSanitizer: the plans with every byte no query may read poisoned ------------------

#: ("contiguous" | "paged" | "paged-int8" | "paged-e4m3", dtype, tensor cores, force_splits,
#: lens, n_new, (window, softcap, sinks, alibi))
ASAN_SCENARIOS = [
    ("contiguous", "float32", False, None, [37, 9, 20], [1, 1, 0], (None, None, None, "bloom")),
    ("contiguous", "bfloat16", True, 3, [70, 12, 41], [1, 1, 1], (20, 1.0, "mixed", "mixed")),
    ("contiguous", "float16", True, None, [30, 21, 8], [21, 9, 0], (None, None, None, "mixed")),
    ("paged", "bfloat16", True, None, [30, 21, 8], [21, 9, 0], (6, 1.5, "mixed", "bloom")),
    ("paged", "float32", False, 4, [70, 12, 41], [1, 1, 1], (20, 1.0, "mixed", "mixed")),
    ("paged-int8", "float32", False, None, [37, 9, 20], [3, 1, 2], (4, 0.5, "mixed", "bloom")),
    ("paged-e4m3", "bfloat16", False, None, [30, 21, 8], [21, 9, 0], (6, 1.5, "mixed", "mixed")),
]


def run_asan_scenario(emu, scenario, i, poison):
    kind, dtype, tc, splits, lens, n_new, (window, softcap, sinks, alibi) = scenario
    hq = 4
    if kind == "contiguous":
        params = variant_params(D, hq, window, softcap, sinks, alibi)
        plan = run_variant(emu, dtype=dtype, d=D, kv_heads=2, group=2, lens=lens, n_new=n_new,
                           params=params, tensor_cores=tc, force_splits=splits, seed=i,
                           poison=poison)
    else:
        params = gqakv.AttentionParams(scale=1.0 / math.sqrt(D), window=window, softcap=softcap,
                                       sinks=sinks_pattern(hq, sinks), alibi_slopes=alibi_pattern(alibi, hq))
        if kind == "paged":
            plan = run_paged_plan(emu, dtype=dtype, P=5, lens=lens, n_new=n_new, params=params,
                                  tensor_cores=tc, force_splits=splits, seed=i, poison=poison)
        else:
            kv_dtype = {"paged-int8": "int8", "paged-e4m3": "float8_e4m3fn"}[kind]
            plan = run_paged_quantized_plan(emu, kv_dtype=kv_dtype, dtype=dtype, P=5, lens=lens,
                                            n_new=n_new, params=params, force_splits=splits,
                                            seed=i, poison=poison)
    flags = planmod.variant_flags(params)
    assert flags & planmod.VARIANT_FLAGS["alibi"]
    assert all(f", {flags}" in launch.name for launch in plan.launches if launch.kernel != "gqakv_merge")
    return plan


@pytest.fixture(scope="module")
def emulator():
    return harness.Emulator(harness.build(asan=False))


@pytest.mark.parametrize("i", range(len(ASAN_SCENARIOS)), ids=[f"{s[0]}-{s[1]}" for s in ASAN_SCENARIOS])
def test_alibi_plans(emulator, i):
    run_asan_scenario(emulator, ASAN_SCENARIOS[i], i, poison=False)


#: The AddressSanitizer library of this module: only the instantiations ASAN_SCENARIOS
#: launch (the instantiation table's entries; contiguous and paged, compiled in parallel).
ASAN_UNITS = [
    harness.unit("asan alibi contiguous", 64, table.select(
        dtypes=("float32", "float16", "bfloat16"), head_dims=(64,), kv_dtypes=(None,),
        readers=("contiguous",), variants=(0, 4, 8, 15))),
    harness.unit("asan alibi paged", 64, table.select(
        dtypes=("float32", "bfloat16"), head_dims=(64,), kv_dtypes=(None, "int8", "float8_e4m3fn"),
        readers=("paged",), variants=(0, 15))),
]


def asan_main() -> int:
    """ASAN_SCENARIOS on the AddressSanitizer build, poisoned; prints 'N passed'."""
    emu = harness.Emulator(harness.build_registrations(True, ASAN_UNITS))
    for i, scenario in enumerate(ASAN_SCENARIOS):
        run_asan_scenario(emu, scenario, i, poison=True)
        print(f"ok {scenario[0]} {scenario[1]} variant={scenario[-1]}", flush=True)
    print(f"{len(ASAN_SCENARIOS)} passed")
    return 0


def test_alibi_kernels_under_asan():
    """AddressSanitizer (a subprocess with libasan preloaded) over ASAN_UNITS' library."""
    harness.check_asan_main("test_cupy_emulated_alibi", len(ASAN_SCENARIOS), units=ASAN_UNITS)
