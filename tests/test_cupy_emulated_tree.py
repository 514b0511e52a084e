"""Draft-tree attention (speculative verification) in the CUDA prefill kernels, emulated.

The prefill kernels (prefill.cu, prefill_mma.cu) take the draft tree's clause as one more
flag of the variant trait (kernels/variant.cuh: TREE = 16, ``Variant::masked_score``):
chunk query t of a row whose prefix holds P = L - n keys sees every prefix key and the
chunk key P + u iff u is t or one of its ancestors; windows and ALiBi measure logical
positions (query t at P + depth[t], chunk key u at P + depth[u]). The routing step sends a
tree call of any length to them (the decode kernels have no tree clause), the glue uploads
the tree's ancestor sets [B, S, S] uint8 and depths [B, S] int64 once per plan
(work.tree_arrays; AttnParams.tree_mask / tree_depth / tree_stride).

Checked against the independent float64 loop reference (tests/support/reference.py, which
walks each query's parents) with the emulated suites' rule (``cases._check_out``: out within
2 x the reference's rounding to the dtype + 2e-6, lse within 1e-5, padded queries exactly
0 / -inf, no NaN): randomized ragged trees (chains, stars, deep, wide and random ones of up
to 24 tokens, an empty draft) through the cupy backend itself (``EmulatedCupyBackend``,
whose generic code is made to fail, so only the kernels can serve the calls), over
contiguous, paged and int8 storage, plain and with a window, soft-cap + sinks and ALiBi + a
window, in float32 (gqakv_prefill) and bfloat16 (gqakv_prefill_mma; over int8 the fp32-FMA
gqakv_prefill); the bfloat16 fp32-FMA kernel on the harness's plans; one-token trees; and
the tree instantiations under AddressSanitizer over contiguous, paged, int8 and paged int8
storage (``ASAN_SCENARIOS``) with every byte no query may read poisoned.
"""

from __future__ import annotations

import numpy as np
import pytest

import gqakv

from .cuda_emu import harness

if harness.compiler() is None:
    pytest.skip("no C++ compiler (g++) for the CUDA emulation harness", allow_module_level=True)

from gqakv.dispatch.request import Request  # noqa: E402

from gqakv_backends.cupy_backend import instantiations as table  # noqa: E402
from gqakv_backends.cupy_backend import routing, sources  # noqa: E402

from .cuda_emu import cases  # noqa: E402
from .cuda_emu.emulated_backend import kernels_only  # noqa: E402
from .cuda_emu.plans import run_tree, variant_params  # noqa: E402
from .support.arrays import BackendArrays  # noqa: E402
from .support.reference import reference_attention  # noqa: E402

D = harness.TREE_HEAD_DIMS[0]  # both prefill kernels at d = 16 (the tensor cores' k)
SHAPES = ("chain", "star", "deep", "wide", "random")


def tree_parents(rng, n: int, shape: str) -> list[int]:
    """n tokens' parents in topological order (-1: a root): a chain (the causal chunk), a
    star (all roots), a deep tree (mostly the previous token), a wide one (few levels,
    many siblings) or random parents."""
    if shape == "chain":
        return list(range(-1, n - 1))
    if shape == "star":
        return [-1] * n
    if shape == "deep":
        return [-1] + [t - 1 if rng.random() < 0.75 else int(rng.integers(-1, t)) for t in range(1, n)]
    if shape == "wide":
        return [-1] + [int(rng.integers(-1, min(t, 3))) for t in range(1, n)]
    return [int(rng.integers(-1, t)) for t in range(n)]


def draw_trees(rng, B: int, T_max: int):
    """Ragged trees: entry 0 holds T_max tokens, the last an empty draft, the others
    random counts; shapes rotate over the entries. Returns (n_new, parents [B, T_max])."""
    n = [T_max] + [int(rng.integers(1, T_max + 1)) for _ in range(B - 2)] + [0]
    parents = np.full((B, T_max), -1, dtype=np.int64)
    start = int(rng.integers(len(SHAPES)))
    for b in range(B):
        if n[b]:
            parents[b, :n[b]] = tree_parents(rng, n[b], SHAPES[(start + b) % len(SHAPES)])
    return n, parents


#: (window, softcap, sinks, alibi) as variant_params names them: the tree alone, with a
#: window, soft-cap + sinks, ALiBi + a window (harness.TREE_VARIANTS holds their flags).
VARIANTS = [(None, None, None, None), (5, None, None, None), (None, 4.0, "mixed", None),
            (9, None, None, "mixed")]
VIDS = ["plain", "window", "softcap+sinks", "alibi+window"]
STORAGES = [{}, {"storage": "paged", "page_size": 8}, {"kv_dtype": "int8"}]
SIDS = ["contiguous", "paged", "int8"]


def _kernel(dtype: str, storage: dict) -> str:
    """The prefill kernel the backend launches here (an H200: tensor cores for 16-bit
    dtypes over unquantized K/V)."""
    return "gqakv_prefill_mma" if dtype != "float32" and not storage.get("kv_dtype") else "gqakv_prefill"


def _launch_name(dtype: str, storage: dict, params) -> str:
    flags = sum(table.VARIANT_FLAGS[f] for f in params.features) | table.TREE
    kernel, kv = _kernel(dtype, storage), storage.get("kv_dtype")
    if storage.get("storage") == "paged":
        return sources.paged_name_expression(kernel, dtype, D, variant=flags, kv_dtype=kv)
    return sources.name_expression(kernel, dtype, D, variant=flags, kv_dtype=kv)


def _tree_call(be, rng, *, dtype, storage, params, pre, n, parents, kv_heads=2, group=4):
    """Prefix chunks, then the tree chunk, then the tree call on ``be``: checked against
    the reference over what the cache holds."""
    arrays = BackendArrays(be)
    B, Hq = len(pre), kv_heads * group
    T = parents.shape[1]
    cache = gqakv.KVCache(B, kv_heads, 96, D, dtype=dtype, backend=be, **storage)
    k0 = rng.standard_normal((B, kv_heads, max(max(pre), 1), D))
    cache.append(arrays.asarray(k0, dtype), arrays.asarray(rng.standard_normal(k0.shape), dtype), pre)
    k = rng.standard_normal((B, kv_heads, T, D))
    cache.append(arrays.asarray(k, dtype), arrays.asarray(rng.standard_normal(k.shape), dtype), n)
    qd = arrays.asarray(2.0 * rng.standard_normal((B, Hq, T, D)), dtype)
    q = arrays.to_numpy(qd).astype(np.float64)  # the queries as the dtype holds them
    out, lse = gqakv.gqa_attention(qd, cache, n, tree=parents, return_lse=True, scale=params.scale,
                                   window=params.window, softcap=params.softcap,
                                   sinks=params.sinks, alibi_slopes=params.alibi_slopes)
    rows = [cache.live_kv(b) for b in range(B)]
    k_rows = [arrays.to_numpy(r[0]).astype(np.float64) for r in rows]
    v_rows = [arrays.to_numpy(r[1]).astype(np.float64) for r in rows]
    want, want_lse = reference_attention(q, k_rows, v_rows, n, params.scale, window=params.window,
                                         softcap=params.softcap, sinks=params.sinks,
                                         alibi_slopes=params.alibi_slopes, parents=parents)
    got = arrays.to_numpy(out)
    case = type("Case", (), {"name": f"{dtype} {storage} tree {params.variant}", "dtype": dtype})
    stats = {"max_out_err": 0.0, "max_out_tol": 0.0, "max_lse_err": 0.0}
    cases._check_out(case, 0, got, arrays.to_numpy(lse).astype(np.float32), want, want_lse,
                     np.asarray(n), stats)
    return stats


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", VARIANTS, ids=VIDS)
@pytest.mark.parametrize("storage", STORAGES, ids=SIDS)
def test_tree_kernels_match_the_reference(monkeypatch, storage, variant, dtype):
    """Ragged trees of up to 24 tokens (two query blocks of 16 at G = 4; the 50-token
    prefix's chunk straddles key tiles) through the backend: only the kernels run (the
    generic code fails), and the attention launch is the tree instantiation."""
    be = kernels_only(monkeypatch, "CUDA tree kernels")
    rng = np.random.default_rng(VARIANTS.index(variant) * 7 + STORAGES.index(storage) * 3 + len(dtype))
    params = variant_params(D, 8, *variant)
    n, parents = draw_trees(rng, 4, 24)
    _tree_call(be, rng, dtype=dtype, storage=storage, params=params, pre=[50, 0, 13, 33], n=n,
               parents=parents)
    want = _launch_name(dtype, storage, params)
    assert want in be.kernels, (want, be.kernels)
    assert not any(name.startswith("gqakv_decode") for name in be.kernels)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_short_trees_run_on_the_prefill_kernels(monkeypatch, dtype):
    """Trees of 1 to 4 tokens (where a plain call would take the decode kernels) run the
    prefill kernels' tree instantiation, and the route says why the decode kernels do not
    serve them; a chain tree gives the causal chunk's values."""
    be = kernels_only(monkeypatch, "CUDA tree kernels")
    rng = np.random.default_rng(1)
    params = variant_params(D, 8, 3, None, None, "mixed")
    for parents in ([[-1], [-1], [-1]], [[-1, 0, 0, 1], [-1, -1, 0, -1], [-1, 0, 1, 2]]):
        parents = np.array(parents)
        n = [parents.shape[1], 1, 0] if parents.shape[1] == 1 else [4, 3, 0]
        _tree_call(be, rng, dtype=dtype, storage={}, params=params, pre=[20, 7, 3], n=n, parents=parents)
        assert _launch_name(dtype, {}, params) in be.kernels
        assert not any(name.startswith("gqakv_decode") for name in be.kernels)
    route = routing.route_attention(Request("attention", dtype=dtype, head_dim=D, t_q=1,
                                            features=frozenset({"tree", "window"}), capability=90))
    assert route.impl == _kernel(dtype, {})
    for kernel in ("gqakv_decode", "gqakv_decode_mma"):
        assert "does not implement tree" in route.rejected[kernel], route


@pytest.mark.parametrize("fixed", [False, True], ids=["planned", "fixed"])
def test_planned_tree_calls_upload_the_tree_once(monkeypatch, fixed):
    """``gqakv.plan_attention(..., tree=)`` (a planned batch, and a fixed plan sized for the
    capacities): the work holds the tree's device arrays (uploaded once) and every run of
    the plan (two layers here) gives ``gqa_attention``'s result, on the kernels only."""
    be = kernels_only(monkeypatch, "CUDA tree kernels")
    arrays = BackendArrays(be)
    rng = np.random.default_rng(21)
    B, Hkv, G, T = 3, 2, 4, 12
    caches = [gqakv.KVCache(B, Hkv, 64, D, dtype="float32", backend=be) for _ in range(2)]
    n, parents = draw_trees(rng, B, T)
    for cache in caches:
        for m in ([17, 4, 30], n):
            k = rng.standard_normal((B, Hkv, max(m), D))
            cache.append(arrays.asarray(k, "float32"), arrays.asarray(rng.standard_normal(k.shape), "float32"), m)
    params = variant_params(D, Hkv * G, 4, None, None, "mixed")  # alibi + window (built: 25)
    kw = dict(window=params.window, sinks=params.sinks, alibi_slopes=params.alibi_slopes)
    plan = gqakv.plan_attention(caches[0], n, q_heads=Hkv * G, t_q=T, tree=parents, fixed=fixed, **kw)
    assert plan.work is not None and {"tree_mask", "tree_depth"} <= set(plan.work.arrays)
    assert plan.work.arrays["tree_mask"].shape == (B, T, T)
    for cache in caches:
        q = arrays.asarray(rng.standard_normal((B, Hkv * G, T, D)), "float32")
        got = arrays.to_numpy(plan.run(q, cache))
        want = arrays.to_numpy(gqakv.gqa_attention(q, cache, n, tree=parents, **kw))
        np.testing.assert_array_equal(got, want)  # the same launches, bit for bit
    assert _launch_name("float32", {}, params) in be.kernels


@pytest.mark.parametrize("variant", VARIANTS, ids=VIDS)
def test_bfloat16_fma_tree_kernel(variant):
    """The fp32-FMA prefill in bfloat16 (the tensor-core one serves bfloat16 on the backend
    here) on the harness's plans, ragged trees over ragged prefixes."""
    emu = _emulator()
    rng = np.random.default_rng(5 + VARIANTS.index(variant))
    n, parents = draw_trees(rng, 4, 24)
    lens = [50 + n[0], n[1], 13 + n[2], 33]
    plan = run_tree(emu, dtype="bfloat16", d=D, kv_heads=2, group=4, lens=lens, n_new=n, parents=parents,
                    params=variant_params(D, 8, *variant), tensor_cores=False, seed=int(rng.integers(100)))
    assert plan.launches[0].kernel == "gqakv_prefill"


@pytest.mark.parametrize("dtype,tensor_cores", [("float32", False), ("bfloat16", True)], ids=["fma", "mma"])
def test_64_token_trees_over_long_prefixes(dtype, tensor_cores):
    """EAGLE-sized trees (64 tokens: four query blocks at G = 4; every shape across the
    entries) over prefixes of up to 300 keys (many key tiles before the chunk), plain and
    with ALiBi + a window that starts inside the prefix."""
    emu = _emulator()
    rng = np.random.default_rng(64)
    n = [64, 64, 37, 64, 0]
    parents = np.full((5, 64), -1, dtype=np.int64)
    for b, shape in enumerate(SHAPES):
        parents[b, :n[b]] = tree_parents(rng, n[b], shape)
    lens = [300 + 64, 64, 150 + 37, 77 + 64, 12]
    for variant in VARIANTS[:1] + VARIANTS[3:]:
        plan = run_tree(emu, dtype=dtype, d=D, kv_heads=1, group=4, lens=lens, n_new=n, parents=parents,
                        params=variant_params(D, 4, *variant), tensor_cores=tensor_cores, seed=2)
        assert plan.launches[0].grid[1] == 4  # query blocks of 16 tokens


def _emulator():
    return harness.Emulator(harness.build(asan=False, head_dims=(D,), families=("tree",)))


def test_tree_flag_is_the_prefill_kernels_only():
    """The table gives the tree bit to the prefill kernels alone: every other kernel keeps
    its instantiations (no doubling of the decode kernels)."""
    for name, k in table.KERNELS.items():
        tree = [v for v in k.variants() if v & table.TREE]
        if name.startswith("gqakv_prefill"):
            assert len(tree) == len(k.variants()) // 2 == 16
        else:
            assert not tree, name
    with pytest.raises(KeyError, match="no variant=16"):
        sources.name_expression("gqakv_decode", "float32", 64, 4, variant=16)
    assert sources.name_expression("gqakv_prefill", "float32", 64, variant=31) == "gqakv_prefill<float, 64, 31>"


# ---- AddressSanitizer ----------------------------------------------------------------------

#: (dtype, tensor_cores, variant, storage) run under ASan over ragged trees: contiguous rows,
#: pages of 8 (the chunk and the windows straddle pages), int8 rows and int8 pages (8-bit
#: K/V run the fp32-FMA kernel).
ASAN_SCENARIOS = [("float32", False, (5, None, None, None), "contiguous"),
                  ("bfloat16", True, (9, 2.0, "mixed", "mixed"), "contiguous"),
                  ("bfloat16", False, (None, None, None, None), "contiguous"),
                  ("float32", False, (3, 1.5, "mixed", "bloom"), "contiguous"),
                  ("float32", False, (5, None, None, None), "paged"),
                  ("bfloat16", True, (9, 2.0, "mixed", "mixed"), "paged"),
                  ("float32", False, (None, None, None, None), "int8"),
                  ("bfloat16", False, (None, 4.0, "mixed", None), "int8"),
                  ("float32", False, (9, None, None, "mixed"), "paged_int8")]


def _asan_name(dtype, tc, variant, storage) -> str:
    """The instantiation a scenario launches (the planner picks it; run_tree checks the reader)."""
    flags = sum(table.VARIANT_FLAGS[f] for f in variant_params(D, 8, *variant).features) | table.TREE
    kernel, kv = ("gqakv_prefill_mma" if tc else "gqakv_prefill"), ("int8" if "int8" in storage else None)
    if storage.startswith("paged"):
        return sources.paged_name_expression(kernel, dtype, D, variant=flags, kv_dtype=kv)
    return sources.name_expression(kernel, dtype, D, variant=flags, kv_dtype=kv)


def _asan_units():
    """One ASan build unit of exactly the instantiations ASAN_SCENARIOS launch: an ASan
    build's cost is mostly parsing, once per unit, and compiling instantiations no scenario
    runs would only add to it."""
    names = {_asan_name(*s) for s in ASAN_SCENARIOS}
    prefill = [k for k in table.KERNELS if table.KERNELS[k].variant_mask & table.TREE]
    entries = [e for e in table.select(kernels=prefill, dtypes=harness.TREE_DTYPES, head_dims=(D,),
                                       kv_dtypes=(None, "int8"), readers=("contiguous", "paged"),
                                       variants=harness.TREE_VARIANTS) if e.name in names]
    assert sorted(e.name for e in entries) == sorted(names), names
    return [harness.Unit("tree", None, tuple(entries))]


def asan_main() -> int:
    """ASAN_SCENARIOS on the AddressSanitizer build of their instantiations, with the K/V
    (codes and scales) before each row's first window, the dead tails, the pages no row
    holds, the table past each row's pages, the padded queries and the tree mask's padded
    rows poisoned (started by the test below with LD_PRELOAD=libasan); prints 'N passed'."""
    emu = harness.Emulator(harness.build_registrations(True, _asan_units()))
    for i, (dtype, tc, variant, storage) in enumerate(ASAN_SCENARIOS):
        rng = np.random.default_rng(40 + i)
        n, parents = draw_trees(rng, 4, 24)
        lens = [50 + n[0], n[1], 13 + n[2], 33]
        plan = run_tree(emu, dtype=dtype, d=D, kv_heads=2, group=4, lens=lens, n_new=n, parents=parents,
                        params=variant_params(D, 8, *variant), tensor_cores=tc, seed=i, poison=True,
                        storage=storage, page_size=8)
        assert {launch.name for launch in plan.launches} == {_asan_name(dtype, tc, variant, storage)}
        print(f"ok {dtype} tc={tc} variant={variant} {storage}", flush=True)
    print(f"{len(ASAN_SCENARIOS)} passed")
    return 0


def test_tree_kernels_under_address_sanitizer():
    harness.check_asan_main("test_cupy_emulated_tree", len(ASAN_SCENARIOS), units=_asan_units())
