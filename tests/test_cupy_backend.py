"""The cupy backend at the registry level, without a GPU: availability reasons, choice,
lazy import, packaged kernel sources, and the launch planner's decisions."""

from __future__ import annotations

import ast
import operator
import re
import subprocess
import sys
import types

import numpy as np
import pytest

import gqakv
from gqakv_backends.cupy_backend import CupyBackend, plan, sources


def _fake_cupy(device_count):
    """A stand-in cupy module whose runtime reports ``device_count`` (or raises it)."""
    def get_count():
        if isinstance(device_count, Exception):
            raise device_count
        return device_count

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=get_count),
                                      nvrtc=types.SimpleNamespace(getVersion=lambda: (12, 6)))
    return cupy


def test_registered_through_entry_point():
    names = [b.name for b in gqakv.list_backends()]
    assert "cupy" in names
    cupy_backend = next(b for b in gqakv.list_backends() if b.name == "cupy")
    assert cupy_backend.priority > next(b for b in gqakv.list_backends() if b.name == "numpy").priority


def test_reason_when_cupy_is_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    assert CupyBackend().unavailable_reason() == "cupy: not installed (pip install 'gqakv[cupy]')"


def test_reason_without_driver_or_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(RuntimeError("cudaErrorInsufficientDriver")))
    assert CupyBackend().unavailable_reason() == (
        "cupy: no CUDA driver found (cudaErrorInsufficientDriver)")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(0))
    assert CupyBackend().unavailable_reason() == "cupy: no CUDA device"
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(1))
    assert CupyBackend().unavailable_reason() is None


def test_explicit_choice_raises_the_reason():
    backend = next(b for b in gqakv.list_backends() if b.name == "cupy")
    why = backend.unavailable_reason()
    if why is None:
        pytest.skip("cupy can run here")
    with pytest.raises(gqakv.BackendError, match="cupy: "):
        gqakv.KVCache(1, 1, 4, 8, backend="cupy")
    with pytest.raises(gqakv.BackendError) as info:
        gqakv.get_backend("cupy", dtype="bfloat16", head_dim=128)
    assert why in str(info.value)
    # 'auto' skips it and picks a backend that runs
    assert gqakv.get_backend("auto", dtype="float32", head_dim=64).name != "cupy"


def test_importing_gqakv_does_not_import_cupy():
    """Importing gqakv and loading every plugin (cupy's included) leaves cupy unimported."""
    code = ("import sys, gqakv; gqakv.list_backends(); "
            "import gqakv_backends.cupy_backend.plan, gqakv_backends.cupy_backend.sources; "
            "print(sorted(m for m in sys.modules if m == 'cupy' or m.startswith('cupy.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("kernel", sorted(sources.KERNEL_FILES))
def test_kernel_sources_ship_as_package_data(kernel):
    src = sources.compose_source(kernel)
    assert "void __launch_bounds__(128" in src and kernel in src
    assert '#include "' not in src  # local includes inlined: NVRTC needs no include path
    assert "to_float" in src


#: Llama-3.1-8B decode (Hq 32, Hkv 8, G = 4, T = 1, d = 128) on an H200: bfloat16 runs the
#: tensor-core kernel (one 16-row query chunk, 2 CTAs per SM), float32 the FMA kernel (tile 4,
#: 3 CTAs per SM).
SMS = 132


def _llama_splits(batch, live, dtype="bfloat16"):
    kernel, tile, chunks, per_sm = plan.decode_kernel(dtype, 128, 4)
    assert chunks == 1
    return plan.choose_splits(np.full(batch, live), 8 * chunks, SMS, per_sm)


def test_decode_kernel_choice():
    assert plan.decode_kernel("bfloat16", 128, 4) == ("gqakv_decode_mma", None, 1, 2)
    assert plan.decode_kernel("float16", 64, 4) == ("gqakv_decode_mma", None, 1, 4)
    assert plan.decode_kernel("float16", 128, 17) == ("gqakv_decode_mma", None, 2, 2)
    assert plan.decode_kernel("float32", 128, 4) == ("gqakv_decode", 4, 1, 3)
    assert plan.decode_kernel("bfloat16", 256, 4) == ("gqakv_decode", 4, 1, 3)
    assert plan.decode_kernel("bfloat16", 80, 8) == ("gqakv_decode", 8, 1, 2)
    # A device without mma.m16n8k16 (compute capability < 8.0) keeps the FMA kernel.
    assert plan.decode_kernel("bfloat16", 128, 4, tensor_cores=False) == ("gqakv_decode", 4, 1, 3)
    kw = dict(batch=1, kv_heads=8, group=4, t_q=1, lens=np.array([4096]), n_new=np.array([1]),
              scale=0.1, q_strides=(32 * 128, 128, 128), buf_strides=(8 * 4096 * 128, 4096 * 128, 128),
              out_strides=(32 * 128, 128, 128), sm_count=80)
    assert plan.plan_attention("float16", 128, **kw).launches[0].kernel == "gqakv_decode_mma"
    assert plan.plan_attention("float16", 128, tensor_cores=False, **kw).launches[0].name == \
        "gqakv_decode<gqakv_half, 128, 4>"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("batch", [1, 4, 8, 16, 64])
@pytest.mark.parametrize("live", [1024, 8192, 32768])
def test_splits_at_llama_shapes_fill_the_gpu(batch, live, dtype):
    splits, keys = _llama_splits(batch, live, dtype)
    # Every split holds keys, chunks are at least the minimum, and they cover the row.
    assert splits * keys >= live and (splits - 1) * keys < live
    assert splits == 1 or keys >= plan.MIN_KEYS_PER_SPLIT
    slots = SMS * plan.decode_kernel(dtype, 128, 4)[3]
    ctas = batch * 8 * splits
    waves = ctas / slots
    if live >= 8192:  # long rows: the grid fills the resident slots of every SM
        assert ctas >= 0.95 * slots, (splits, keys, ctas)
        # ... with little wave quantization: the last wave is nearly full.
        assert waves / np.ceil(waves) >= 0.9, (splits, keys, waves)


def test_split_plans_for_the_issue_shapes():
    """The planner's choices at the benchmark's shapes (cost model in choose_splits).
    Tensor-core kernel (bf16, 2 x 132 CTA slots): B = 1 fills one wave with 33 splits,
    B = 64 needs none (512 CTAs, 1.94 waves). FMA kernel (fp32, 3 x 132 slots): B = 64
    cuts rows in 3 so 1536 CTAs run in 3.9 waves instead of 512 CTAs in 1.3 (a
    third-full second wave)."""
    assert _llama_splits(1, 32768) == (33, 993)
    assert _llama_splits(1, 8192) == (33, 249)
    assert _llama_splits(4, 32768) == (8, 4096)
    assert _llama_splits(64, 32768) == (1, 32768)
    assert _llama_splits(1, 1024) == (8, 128)  # as many as the minimum chunk allows
    assert _llama_splits(1, 32768, "float32") == (48, 683)
    assert _llama_splits(4, 32768, "float32") == (12, 2731)
    assert _llama_splits(64, 32768, "float32") == (3, 10923)


def test_splits_follow_live_lengths_only():
    # Rows without keys do not count; longer live rows never mean fewer keys per split.
    assert plan.choose_splits(np.array([0, 32768, 0]), 8, SMS, 3) == _llama_splits(1, 32768, "float32")
    assert plan.choose_splits(np.array([0, 0]), 8, SMS, 3) == (1, 1)
    # Short rows or a full GPU: no split.
    assert plan.choose_splits(np.array([100]), 8, SMS, 3) == (1, 100)
    assert plan.choose_splits(np.full(4096, 4096), 8, SMS, 3)[0] == 1
    # More SMs, more splits (the same rows).
    assert _llama_splits(1, 32768, "float32")[0] < plan.choose_splits(np.array([32768]), 8, 4 * SMS, 3)[0]


def test_splits_respect_the_minimum_and_the_kernel_limits():
    rng = np.random.default_rng(0)
    for _ in range(200):
        lens = rng.integers(0, 50000, size=int(rng.integers(1, 40)))
        min_keys = int(rng.choice([8, 64, 128, 256]))
        splits, keys = plan.choose_splits(lens, int(rng.integers(1, 17)), int(rng.integers(1, 200)),
                                          int(rng.integers(1, 5)), min_keys)
        top = max(1, int(lens.max()))
        assert splits * keys >= top and (splits - 1) * keys < top
        assert splits == 1 or keys >= min_keys
        assert 1 <= splits <= plan.MAX_GRID_Y
    # A row past 2^30 keys is always split (the kernel counts a split's keys in an int).
    splits, keys = plan.choose_splits(np.array([3 * 2**30 + 5]), 4096, 1, 1)
    assert splits >= 4 and keys <= plan.MAX_KEYS_PER_SPLIT


def test_split_plan_skips_idle_rows():
    """An entry without new tokens gets no work, so its length must not shape the plan."""
    kw = dict(kv_heads=8, group=4, t_q=1, scale=0.1, q_strides=(32 * 128, 128, 128),
              buf_strides=(8 * 65536 * 128, 65536 * 128, 128), out_strides=(32 * 128, 128, 128),
              sm_count=SMS)
    one = plan.plan_attention("bfloat16", 128, batch=1, lens=np.array([8192]),
                              n_new=np.array([1]), **kw)
    two = plan.plan_attention("bfloat16", 128, batch=2, lens=np.array([8192, 60000]),
                              n_new=np.array([1, 0]), **kw)
    assert (one.num_splits, one.keys_per_split) == (two.num_splits, two.keys_per_split) == (33, 249)


def test_plans_kept_by_extent_equal_fresh_plans():
    """The backend keeps attention plans by ``plan.attention_extent`` and the keywords but
    the lengths, so that a decode step one token longer finds its plan: over randomized
    lengths, n_new, windows and query counts (decode, split and not, and prefill), the kept
    plan is the one ``plan_attention`` makes for the call's own lengths, launch for launch."""
    backend = CupyBackend()
    rng = np.random.default_rng(7)
    hits = 0
    for _ in range(300):
        B, T = int(rng.integers(1, 6)), int(rng.choice([1, 1, 2, 3, 16]))
        n_new = rng.integers(0, T + 1, B)
        lens = n_new + rng.integers(0, int(rng.choice([40, 300, 5000])), B)
        window = None if rng.random() < 0.5 else int(rng.integers(1, 600))
        params = gqakv.AttentionParams(scale=0.125, window=window)
        strides = (4 * T * 64, T * 64, 64)
        kwargs = dict(batch=B, kv_heads=2, group=2, t_q=T, lens=lens, n_new=n_new,
                      params=params, q_strides=strides, buf_strides=(2 * 8192 * 64, 8192 * 64, 64),
                      out_strides=strides, sm_count=int(rng.choice([2, 16, 132])),
                      tensor_cores=True, pages=None, kv_dtype=None)
        before = len(backend._plans._values)
        kept = backend._kernel_plan("float16", 64, kwargs)
        hits += len(backend._plans._values) == before
        fresh = plan.plan_attention("float16", 64, **kwargs)
        assert kept == fresh, (lens, n_new, T, window)
        if fresh.launches and fresh.num_splits == 1 and T <= plan.DECODE_MAX_T:
            keys = plan.attention_extent("float16", 64, **kwargs).keys
            read = gqakv.core.semantics.keys_read(params, lens, n_new)[n_new > 0]
            assert keys & (keys - 1) == 0 and keys >= int(read.max())
    assert hits > 30  # the cache served lengths it was not made for


def test_decode_occupancy_matches_the_kernel_registers():
    """The resident CTAs per SM the split planner assumes (plan.DECODE_CTAS_PER_SM per
    tile, plan.DECODE_MMA_CTAS_PER_SM per head dim) hold on the GPU: ptxas' register count
    lets that many 128-thread CTAs share an SM's 64K registers (allocated per warp in units
    of 256, i.e. 8 per thread), and their static shared memory fits."""
    nvrtc_mod = pytest.importorskip("gqakv_backends.cupy_backend.nvrtc")
    try:
        compiler = nvrtc_mod.Nvrtc()
        compiler.version()
    except (nvrtc_mod.NvrtcError, OSError) as exc:
        pytest.skip(f"NVRTC not available: {exc}")
    checks = [("gqakv_decode", dtype, 128, tile, ctas) for dtype in sources.CTYPES
              for tile, ctas in plan.DECODE_CTAS_PER_SM.items()]
    checks += [("gqakv_decode_mma", dtype, d, None, ctas) for dtype in sources.DECODE_MMA_DTYPES
               for d, ctas in plan.DECODE_MMA_CTAS_PER_SM.items()]
    for arch in ("sm_80", "sm_90"):
        for kernel, dtype, d, tile, ctas in checks:
            name = sources.name_expression(kernel, dtype, d, tile)
            r = compiler.compile(kernel, dtype, d, arch, name=name)
            regs = -(-r.registers // 8) * 8
            assert regs * plan.BLOCK[0] * ctas <= 65536, (name, arch, r.registers, ctas)
            assert r.shared_bytes * ctas <= 100 * 1024, (name, arch, r.shared_bytes)
    assert set(plan.DECODE_MMA_CTAS_PER_SM) == set(sources.DECODE_MMA_HEAD_DIMS)
    assert set(plan.DECODE_CTAS_PER_SM) == set(sources.DECODE_QUERY_TILES)


def test_attention_plan_does_not_depend_on_capacity():
    kw = dict(batch=2, kv_heads=8, group=4, t_q=1, lens=np.array([3000, 10]),
              n_new=np.array([1, 1]), scale=0.1, q_strides=(32 * 128, 128, 128),
              out_strides=(32 * 128, 128, 128), sm_count=132)
    small = plan.plan_attention("bfloat16", 128, buf_strides=(8 * 4096 * 128, 4096 * 128, 128), **kw)
    large = plan.plan_attention("bfloat16", 128, buf_strides=(8 * 65536 * 128, 65536 * 128, 128), **kw)
    assert [l.grid for l in small.launches] == [l.grid for l in large.launches]
    assert small.num_splits > 1 and [l.kernel for l in small.launches] == ["gqakv_decode_mma", "gqakv_merge"]


def test_plans_use_explicitly_typed_scalars():
    p = plan.plan_attention("float16", 64, batch=1, kv_heads=2, group=3, t_q=9,
                            lens=np.array([9]), n_new=np.array([9]), scale=0.125,
                            q_strides=(6 * 9 * 64, 9 * 64, 64), buf_strides=(2 * 16 * 64, 16 * 64, 64),
                            out_strides=(6 * 9 * 64, 9 * 64, 64), sm_count=132)
    (launch,) = p.launches
    assert launch.kernel == "gqakv_prefill_mma"  # float16, d = 64: the tensor-core prefill
    for a in launch.args:
        assert isinstance(a, (plan.Buf, np.int32, np.int64, np.float32, plan.KernelParams)), a
    # The params struct goes as a record of the kernels' AttnParams layout (72 bytes:
    # float scale, float softcap, int64 window, pointers sinks, k_scale, v_scale, alibi, the
    # draft tree's tree_mask and tree_depth pointers and its int64 tree_stride).
    (params,) = [a for a in launch.args if isinstance(a, plan.KernelParams)]
    rec = params.record(lambda buf: 0)
    assert rec.dtype == plan.PARAMS_DTYPE and plan.PARAMS_DTYPE.itemsize == 72
    assert [plan.PARAMS_DTYPE.fields[f][1] for f in ("scale", "softcap", "window", "sinks", "k_scale",
                                                    "v_scale", "alibi", "tree_mask", "tree_depth",
                                                    "tree_stride")] == [0, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert (float(rec["scale"]), int(rec["window"]), int(rec["sinks"]), int(rec["tree_stride"])) == (0.125, 0, 0, 0)
    assert plan.plan_write_kv("float32", 64, np.array([0, 0]), 2, 3, (1, 1, 1), (1, 1, 1)).launches == []


def test_copy_plan_is_one_launch_for_every_layer_and_pair():
    n = np.array([0, 300, 5])
    p = plan.plan_copy_tokens("bfloat16", 128, n, 32, 8, (1, 2, 3, 128), (4, 5, 6, 128))
    (launch,) = p.launches
    assert launch.kernel == "gqakv_copy_tokens" and launch.block == plan.BLOCK
    # x: (pair, layer, head); y: enough 128-thread blocks for the longest copy's 16-byte vectors
    assert launch.grid == (3 * 32 * 8, -(-300 * 16 // 128), 1)
    assert all(isinstance(a, (plan.Buf, np.int32, np.int64)) for a in launch.args)
    assert [a for a in launch.args if isinstance(a, np.int64)] == [1, 2, 3, 128, 4, 5, 6, 128]
    assert plan.plan_copy_tokens("float32", 64, np.array([0, 0]), 2, 2, (1,) * 4, (1,) * 4).launches == []


def test_decode_query_tile_is_the_smallest_that_fits():
    assert [plan.choose_query_tile(q) for q in (1, 4, 5, 8, 9, 12, 32)] == [
        (4, 1), (4, 1), (8, 1), (8, 1), (8, 2), (8, 2), (8, 4)]
    # Llama 3.1 8B decode (G = 4, T = 1) in float32: one tile-4 CTA per (row, KV head)
    p = plan.plan_attention("float32", 128, batch=64, kv_heads=8, group=4, t_q=1,
                            lens=np.full(64, 4096), n_new=np.ones(64, dtype=np.int64), scale=0.1,
                            q_strides=(32 * 128, 128, 128), buf_strides=(8 * 8192 * 128, 8192 * 128, 128),
                            out_strides=(32 * 128, 128, 128), sm_count=132)
    # x: (row, KV head) pairs; y: splits (3 here, so 1536 CTAs fill ~4 waves of 396 slots)
    launch, merge = p.launches
    assert launch.name == "gqakv_decode<float, 128, 4>" and launch.grid == (64 * 8, 3, 1)
    assert merge.kernel == "gqakv_merge" and merge.grid == (64 * 32, 1, 1)
    # In bfloat16 the tensor-core kernel: one 16-row CTA per (row, KV head), 512 CTAs in
    # ~2 waves of its 2 x 132 slots, no split.
    p = plan.plan_attention("bfloat16", 128, batch=64, kv_heads=8, group=4, t_q=1,
                            lens=np.full(64, 4096), n_new=np.ones(64, dtype=np.int64), scale=0.1,
                            q_strides=(32 * 128, 128, 128), buf_strides=(8 * 8192 * 128, 8192 * 128, 128),
                            out_strides=(32 * 128, 128, 128), sm_count=132)
    (launch,) = p.launches
    assert launch.name == "gqakv_decode_mma<gqakv_bf16, 128>" and launch.grid == (64 * 8, 1, 1)


def test_kept_plans_are_least_recently_used_and_made_once():
    from gqakv_backends.cupy_backend import _LruCache

    made = []
    cache = _LruCache(2)

    def get(key):
        return cache.get(key, lambda: made.append(key) or f"plan {key}")

    assert [get("a"), get("b"), get("a")] == ["plan a", "plan b", "plan a"]
    get("c")  # evicts b, the least recently used
    assert get("a") == "plan a" and get("b") == "plan b"
    assert made == ["a", "b", "c", "b"]


# -- routing: which implementation runs a call, and why not the others ------------------------

ATTENTION_KERNELS = {"gqakv_decode_mma", "gqakv_decode", "gqakv_prefill_mma", "gqakv_prefill"}


def _route(op, **facts):
    return CupyBackend().route(op, **facts)


def _covers_everything_else(route, implementations):
    """Every implementation but the chosen one has a non-empty reason."""
    assert set(route.rejected) == set(implementations) - {route.impl}, route
    assert all(isinstance(r, str) and r for r in route.rejected.values()), route


def test_route_float64_is_generic_with_a_reason_for_every_kernel():
    from gqakv.dispatch.backend import GENERIC

    for t_q in (1, 9):
        r = _route("attention", dtype="float64", head_dim=128, t_q=t_q, capability=90)
        assert r.impl == GENERIC
        _covers_everything_else(r, ATTENTION_KERNELS | {GENERIC})
        family = ("gqakv_decode_mma", "gqakv_decode") if t_q == 1 else ("gqakv_prefill_mma", "gqakv_prefill")
        for kernel in family:
            assert r.rejected[kernel] == "dtype=float64 (supported: float32, float16, bfloat16)"
        for kernel in ATTENTION_KERNELS - set(family):
            assert f"t_q={t_q}" in r.rejected[kernel]
    for op, kernel in (("write_kv", "gqakv_write_kv"), ("copy_tokens", "gqakv_copy_tokens")):
        r = _route(op, dtype="float64", head_dim=128)
        assert (r.impl, dict(r.rejected)) == (GENERIC, {kernel: "dtype=float64 (supported: float32, "
                                                                "float16, bfloat16)"})
        r = _route(op, dtype="bfloat16", head_dim=300)
        assert r.impl == GENERIC and r.rejected[kernel] == "head_dim=300 (supported: 1..256)"
        r = _route(op, dtype="bfloat16", head_dim=128)
        assert r.impl == kernel and set(r.rejected) == {GENERIC}


def test_route_decode_by_device_capability():
    """bf16, d = 128, T = 1: the tensor-core decode on a 9.0 device; on 7.5 the FMA decode,
    with the mma kernel's rejection naming the capability."""
    from gqakv.dispatch.backend import GENERIC

    r = _route("attention", dtype="bfloat16", head_dim=128, t_q=1, capability=90)
    assert r.impl == "gqakv_decode_mma"
    _covers_everything_else(r, ATTENTION_KERNELS | {GENERIC})
    assert "gqakv_decode_mma" in r.rejected["gqakv_decode"]
    r = _route("attention", dtype="bfloat16", head_dim=128, t_q=1, capability=75)
    assert r.impl == "gqakv_decode"
    _covers_everything_else(r, ATTENTION_KERNELS | {GENERIC})
    assert r.rejected["gqakv_decode_mma"] == "compute capability 7.5 (mma.m16n8k16 needs 8.0+)"
    # Head dims and dtypes the mma decode has no instantiation for.
    r = _route("attention", dtype="bfloat16", head_dim=80, t_q=1, capability=90)
    assert (r.impl, r.rejected["gqakv_decode_mma"]) == ("gqakv_decode", "head_dim=80 (supported: 64, 128)")
    r = _route("attention", dtype="float32", head_dim=128, t_q=4, capability=90)
    assert (r.impl, r.rejected["gqakv_decode_mma"]) == ("gqakv_decode",
                                                        "dtype=float32 (supported: float16, bfloat16)")
    # Prefill: the tensor-core kernel at multiples of 16, the FMA one otherwise.
    r = _route("attention", dtype="float16", head_dim=64, t_q=5, capability=80)
    assert r.impl == "gqakv_prefill_mma" and "t_q=5" in r.rejected["gqakv_decode_mma"]
    r = _route("attention", dtype="float16", head_dim=72, t_q=5, capability=80)
    assert r.impl == "gqakv_prefill" and "multiples of 16" in r.rejected["gqakv_prefill_mma"]


def test_route_layout_and_grid_facts_make_the_call_generic():
    from gqakv.dispatch.backend import GENERIC

    r = _route("attention", dtype="float16", head_dim=64, t_q=1, buffers="K and V strided differently")
    assert r.impl == GENERIC
    assert r.rejected["gqakv_decode_mma"] == r.rejected["gqakv_decode"] == "K and V strided differently"
    refusal = "gqakv_merge: 1 entries x 4 heads x 4 tokens is a grid of (2147483648, 1) CTAs"
    r = _route("attention", dtype="float16", head_dim=64, t_q=4, capability=90, grid=refusal)
    assert r.impl == GENERIC and r.rejected["gqakv_decode_mma"] == refusal
    assert r.rejected["gqakv_decode"] == "gqakv_decode_mma serves this call (tensor cores first)"
    r = _route("write_kv", dtype="float32", head_dim=64, grid="gqakv_write_kv: too many CTAs")
    assert (r.impl, dict(r.rejected)) == (GENERIC, {"gqakv_write_kv": "gqakv_write_kv: too many CTAs"})
    assert "not gqakv_write_kv: gqakv_write_kv: too many CTAs" in str(r)


def test_route_agrees_with_the_planner():
    """The planner's kernel choice and the route are one decision (same predicates)."""
    for dtype in sources.CTYPES:
        for d in (20, 64, 72, 80, 128, 256):
            for t_q in (1, 4, 5, 9):
                for capability in (75, 80, 90):
                    group = 3
                    kw = dict(batch=1, kv_heads=2, group=group, t_q=t_q, lens=np.array([40]),
                              n_new=np.array([t_q]), scale=0.1,
                              q_strides=(2 * group * t_q * d, t_q * d, d),
                              buf_strides=(2 * 64 * d, 64 * d, d),
                              out_strides=(2 * group * t_q * d, t_q * d, d), sm_count=132,
                              tensor_cores=capability >= 80)
                    kernel = plan.plan_attention(dtype, d, **kw).launches[0].kernel
                    route = _route("attention", dtype=dtype, head_dim=d, t_q=t_q, capability=capability)
                    assert route.impl == kernel, (dtype, d, t_q, capability, route)


def test_route_refuses_unknown_operations_and_facts():
    from gqakv.dispatch.backend import GENERIC, Backend

    with pytest.raises(ValueError, match=r"op='prefill' \(routed operations: write_kv, copy_tokens, attention\)"):
        _route("prefill", dtype="float32", head_dim=64)
    with pytest.raises(ValueError, match=r"attention facts colour \(known: dtype, head_dim"):
        _route("attention", dtype="float32", head_dim=64, colour="red")
    with pytest.raises(ValueError, match="needs the facts head_dim"):
        _route("attention", dtype="float32")
    # The base class: the generic code, nothing else to choose from.
    base = Backend().route("attention", dtype="float32", head_dim=64)
    assert base.impl == GENERIC and base.rejected == {}
    with pytest.raises(ValueError, match="op='x'"):
        Backend().route("x")


def test_implementations_declare_their_limits():
    impls = CupyBackend().implementations()
    assert set(sources.KERNEL_FILES) <= set(impls)
    assert "head_dim in 64, 128" in impls["gqakv_decode_mma"] and "8.0+" in impls["gqakv_decode_mma"]
    assert "head_dim 1..256" in impls["gqakv_write_kv"]


# -- kernel limits: one declaration (limits.py) read by the planner, NVRTC and the emulator ----


def test_limits_are_declared_once_and_reach_every_reader():
    """Read, not changed: plan.py and sources.py hold the declaration's own objects, NVRTC
    (sources.COMPILE_OPTIONS) and the emulator's g++ (harness._flags) get every value as a
    -D option, the kernels refuse to compile without any of them, and each is used."""
    from pathlib import Path

    from gqakv_backends.cupy_backend import limits

    from .cuda_emu import harness

    assert plan.DECODE_CTAS_PER_SM is limits.DECODE_CTAS_PER_SM
    assert plan.DECODE_MMA_CTAS_PER_SM is limits.DECODE_MMA_CTAS_PER_SM
    assert (plan.MAX_GRID_X, plan.MAX_GRID_Y, plan.DECODE_MAX_T, plan.MAX_KEYS_PER_SPLIT,
            plan.DECODE_MMA_ROWS, plan.BLOCK[0]) == (
        limits.MAX_GRID_X, limits.MAX_GRID_Y, limits.DECODE_MAX_T, limits.MAX_KEYS_PER_SPLIT,
        limits.DECODE_MMA_ROWS, limits.THREADS_PER_CTA)
    assert sources.DECODE_QUERY_TILES is limits.DECODE_QUERY_TILES
    assert sources.DECODE_MMA_HEAD_DIMS is limits.DECODE_MMA_HEAD_DIMS
    assert sources.MAX_FUSED_HEAD_DIM == limits.MAX_FUSED_HEAD_DIM
    assert [plan.prefill_rows(d) for d in (64, 65, 128, 129, 256)] == [64, 32, 32, 16, 16]
    assert plan.prefill_rows(80, "gqakv_prefill_mma") == limits.PREFILL_MMA_ROWS
    defines = limits.c_defines()
    # the values as written in the declaration
    assert defines["GQAKV_DECODE_CTAS_PER_SM"] == ",".join(
        f"{k},{v}" for k, v in limits.DECODE_CTAS_PER_SM.items())
    assert defines["GQAKV_DECODE_QUERY_TILES"] == ",".join(map(str, limits.DECODE_QUERY_TILES))
    emu_flags = harness._flags(False)
    for name, value in defines.items():
        assert f"-D{name}={value}" in sources.COMPILE_OPTIONS, name
        assert f"-D{name}={value}" in emu_flags, name
    kernels = harness.kernel_dir()
    guard = (kernels / "limits.cuh").read_text()
    assert set(re.findall(r"!defined\((\w+)\)", guard)) == set(defines)
    uses = "".join((kernels / f).read_text() for f in sources.KERNEL_FILES.values())
    uses += "".join(p.read_text() for p in kernels.glob("*.cuh") if p.name != "limits.cuh")
    uses += (Path(harness.__file__).parent / "driver.cpp").read_text()
    for name in defines:
        assert name in uses, f"{name} is declared but no kernel reads it"


def _declared_limits() -> dict:
    """limits.py's declarations: every upper-case module name and its value."""
    from gqakv_backends.cupy_backend import limits

    return {n: v for n, v in vars(limits).items() if n.isupper() and not n.startswith("_")}


def _folded_int(node) -> int | None:
    """The value of an integer constant expression (2**31 - 1, 1 << 30, 65535), else None."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Pow: operator.pow, ast.LShift: operator.lshift}
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in ops:
        a, b = _folded_int(node.left), _folded_int(node.right)
        return None if a is None or b is None else ops[type(node.op)](a, b)
    return None


def _python_copies(path, declared: dict) -> list[str]:
    """In one Python module that reads the limits: every binding of a declared name whose
    value does not read ``limits``, and every integer constant expression equal to a
    declared scalar too large to be a coincidence (>= 1024: the grid, split and key-span
    limits), with its line."""
    tree = ast.parse(path.read_text())
    distinctive = {v for v in declared.values() if type(v) is int and v >= 1024}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            reads_limits = any(isinstance(n, ast.Name) and n.id == "limits" for n in ast.walk(node.value))
            for t in targets:
                if isinstance(t, ast.Name) and t.id in declared and not reads_limits:
                    found.append(f"{path.name}:{node.lineno}: {t.id} bound without reading limits")
        if isinstance(node, (ast.Constant, ast.BinOp)) and _folded_int(node) in distinctive:
            found.append(f"{path.name}:{node.lineno}: the literal {_folded_int(node)} "
                         f"({ast.unparse(node)})")
    return sorted(set(found))


#: Conditionals in the kernels that pick a value a limits table also holds, but for another
#: quantity (reviewed): prefill.cu's keys per tile BK, not PREFILL_ROWS' rows per CTA.
NOT_LIMIT_COPIES = {("prefill.cu", "D <= 128 ? 32")}


def _kernel_copies(name: str, code: str, declared: dict) -> list[str]:
    """In one kernel or driver source (comments removed): each spelling of a declared value
    that is not its macro. From the declaration itself: a conditional that picks a table's
    value for its key (``X <= k ? v`` / ``X == k ? v``, DECODE_CTAS_PER_SM, PREFILL_ROWS,
    ...); a test of membership in a declared list (``X == a || X == b``); the decode kernel
    instantiated at a literal query tile (DECODE_QUERY_TILES); the literal of a
    scalar >= 1024 (grid and split limits), decimal or as a shift. (A shape the kernel's
    arithmetic fixes, 128 threads or the mma's 16 rows, stays a literal there with a
    static_assert against its macro: limits.py's rule.)"""
    found = []
    for table_name, table in declared.items():
        pairs = table.items() if isinstance(table, dict) else (
            table if isinstance(table, tuple) and table and all(
                isinstance(p, tuple) and len(p) == 2 for p in table) else ())
        for k, v in pairs:
            for m in re.finditer(rf"\b[A-Za-z_]\w*\s*(?:==|<=)\s*{k}\s*\?\s*\(?\s*{v}\b", code):
                if (name, m.group(0)) not in NOT_LIMIT_COPIES:
                    found.append(f"{name}: {m.group(0)!r} copies {table_name}")
        if isinstance(table, tuple) and all(type(x) is int for x in table):
            for a in table:
                for b in table:
                    pattern = rf"\b(\w+)\s*==\s*{a}\s*\|\|\s*\1\s*==\s*{b}\b"
                    found += [f"{name}: {m.group(0)!r} copies {table_name}"
                              for m in re.finditer(pattern, code)]
        if table_name == "DECODE_QUERY_TILES":  # the decode kernel instantiated at literal tiles
            for m in re.finditer(r"\b(?:register_decode|GQAKV_REG_DECODE)\s*[<(]([^>)]*)[>)]", code):
                if any(str(tile) in re.findall(r"\b\d+\b", m.group(1)) for tile in table):
                    found.append(f"{name}: {m.group(0)!r} copies {table_name}")
        if type(table) is int and table >= 1024:
            for m in re.finditer(r"\b(\d+)u?l?l?\b(?:\s*<<\s*(\d+))?", code, flags=re.I):
                value = int(m.group(1)) << int(m.group(2)) if m.group(2) else int(m.group(1))
                if value in (table, table + 1):
                    found.append(f"{name}: {m.group(0)!r} copies {table_name}")
    return found


def test_no_site_keeps_its_own_copy_of_a_limit():
    """The limits exist once, in limits.py: every Python module of the cupy backend and of
    the emulator binds a declared name only by reading ``limits`` and spells no large
    declared value itself (AST), and no kernel or driver source spells a declared table,
    list or large scalar in place of its macro (patterns generated from the declaration,
    so a new entry is checked too)."""
    from pathlib import Path

    from gqakv_backends.cupy_backend import limits

    from .cuda_emu import harness

    declared = _declared_limits()
    package = Path(limits.__file__).parent
    readers = [p for p in package.glob("*.py") if p.name != "limits.py"]
    readers += sorted(Path(harness.__file__).parent.glob("*.py"))
    copies = [c for p in readers for c in _python_copies(p, declared)]
    sources_ = sorted(harness.kernel_dir().glob("*.cu*")) + [Path(harness.__file__).parent / "driver.cpp"]
    for path in sources_:
        if path.name == "limits.cuh":
            continue
        code = re.sub(r"/\*.*?\*/|//[^\n]*", "", path.read_text(), flags=re.S)
        copies += _kernel_copies(path.name, code, declared)
    assert copies == [], "\n".join(copies)


def test_info_lists_the_kernels_and_their_limits(capsys):
    import json

    from gqakv.tools import cli

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "gqakv_decode_mma: t_q <= 4; float16, bfloat16; head_dim in 64, 128; compute capability 8.0+" in out
    assert "generic array-API: everything else (float64" in out
    assert cli.main(["info", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["cupy"]["implementations"] == CupyBackend().implementations()
    from gqakv_backends.numpy_backend import NumpyBackend

    assert rows["numpy"]["implementations"] == NumpyBackend().implementations()
    assert {"numpy BLAS", "generic array-API"} <= set(
        rows["numpy"]["implementations"])  # its BLAS path, as route() names it


# ---- 3. launch grids within CUDA's limits -------------------------------------------------
# gridDim.x < 2^31 and gridDim.y <= 65535. The planner checked only the prefill's query
# blocks and copy_tokens' CTAs; a decode, merge, prefill or append grid past the limits
# went to the device as planned (an invalid launch there). It now raises
# NotImplementedError naming the kernel, which CupyBackend.attention turns into the
# generic path (as it did for the prefill's query blocks). Many KV heads stand in for a
# large batch here so the host arrays stay small.

_ATTN = dict(scale=0.1, q_strides=(64, 64, 64), buf_strides=(64, 64, 64),
             out_strides=(64, 64, 64), sm_count=132)


def test_decode_grid_beyond_the_x_limit_is_refused():
    hkv = 2**30  # 2 entries x 2^30 KV heads = 2^31 CTAs
    with pytest.raises(NotImplementedError, match=r"gqakv_decode.*2147483648"):
        plan.plan_attention("float32", 64, batch=2, kv_heads=hkv, group=1, t_q=1,
                               lens=np.array([5, 5]), n_new=np.array([1, 1]), **_ATTN)
    # One fewer KV head fits.
    p = plan.plan_attention("float32", 64, batch=1, kv_heads=2**31 - 1, group=1, t_q=1,
                               lens=np.array([5]), n_new=np.array([1]), **_ATTN)
    assert p.launches[0].grid[0] == 2**31 - 1


def test_forced_splits_beyond_the_y_limit_are_refused():
    lens = np.array([200000])
    with pytest.raises(NotImplementedError, match=r"gqakv_decode.*66667 splits"):
        plan.plan_attention("float16", 64, batch=1, kv_heads=1, group=4, t_q=1, lens=lens,
                               n_new=np.array([1]), force_splits=70000, **_ATTN)
    p = plan.plan_attention("float16", 64, batch=1, kv_heads=1, group=4, t_q=1, lens=lens,
                               n_new=np.array([1]), force_splits=50000, **_ATTN)
    assert p.num_splits <= plan.MAX_GRID_Y and p.launches[1].kernel == "gqakv_merge"


def test_merge_grid_beyond_the_x_limit_is_refused():
    # Decode CTAs fit (2^27 KV heads x 1 chunk of 16 queries) but the merge's one CTA per
    # query (2^27 x 4 heads x 4 tokens = 2^31) does not.
    with pytest.raises(NotImplementedError, match=r"gqakv_merge.*2147483648"):
        plan.plan_attention("float16", 64, batch=1, kv_heads=2**27, group=4, t_q=4,
                               lens=np.array([4096]), n_new=np.array([4]), force_splits=2,
                               **_ATTN)


def test_prefill_grid_beyond_the_x_limit_is_refused():
    with pytest.raises(NotImplementedError, match=r"gqakv_prefill.*2147483648"):
        plan.plan_attention("float32", 64, batch=2, kv_heads=2**30, group=1, t_q=8,
                               lens=np.array([8, 8]), n_new=np.array([8, 8]), **_ATTN)


def test_append_grid_beyond_the_x_limit_is_refused():
    with pytest.raises(NotImplementedError, match=r"gqakv_write_kv.*2147483648"):
        plan.plan_write_kv("float32", 64, np.array([1, 1]), 2**30, 1, (64, 64, 64), (64, 64, 64))


def test_rows_beyond_32_bit_key_offsets_go_generic():
    """The readers address key j at j * key_stride in 32 bits (limits.MAX_KEY_SPAN): a
    cache whose rows span more elements is refused with the numbers, one that fits is not."""
    from gqakv_backends.cupy_backend import _attention_layout_rejection, limits

    assert limits.key_span_rejection(2**23 - 1, 256, 256) is None  # 2^31 - 256 elements
    why = limits.key_span_rejection(2**23, 256, 256)  # exactly 2^31
    assert why == ("a row's keys span 2147483648 elements (max_len=8388608 x key stride 256; "
                   "the kernels address keys in 32 bits: at most 2147483647)")
    base = np.zeros(256, dtype=np.float32)  # [1, 1, 2^23, 256] views of one row: no memory
    for max_len, expect in ((2**23 - 1, None), (2**23, why)):
        buf = np.lib.stride_tricks.as_strided(base, shape=(1, 1, max_len, 256),
                                              strides=(0, 0, 256 * 4, 4))
        assert _attention_layout_rejection(buf, buf, "float32", 256) == expect


def test_out_overlap_check_sees_flipped_views():
    """The planned run's check that ``out`` shares no memory with q covers every byte a
    view reaches, negative strides included (a flipped view starts at its last row)."""
    from gqakv_backends.cupy_backend import _disjoint, _extent

    a = np.zeros((4, 6), np.float32)
    assert _extent(a[::-1]) == _extent(a)
    assert not _disjoint(a[::-1], _extent(a[1:2]))
    assert _disjoint(a[:2], _extent(a[2:])) and _disjoint(a[2:][::-1], _extent(a[:2]))
    assert _extent(a[:0]) == (0, 0)
