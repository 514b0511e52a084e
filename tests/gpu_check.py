"""One command for a CUDA machine: the parity suite on the cupy backend, then GPU benchmarks.

(tests/gpu_device_run.sh runs ``python3 -m gqakv selftest --backend cupy`` before this.)

    python tests/gpu_check.py            # parity (pytest -k cupy) + decode/prefill benchmarks
    python tests/gpu_check.py --quick    # smaller benchmark grid

1. Runs the backend-parametrized tests for the cupy backend (``pytest -k cupy``, without the
   CPU-only emulation and NVRTC files, which CI runs anyway).
2. Decode at Llama-3.1-8B layer shapes (Hq 32, Hkv 8, d 128, bfloat16): achieved HBM read
   bandwidth (live K+V bytes / step time) against GQAKV_PEAK_HBM_TBS (default 4.8, H200),
   the decode grid the planner chose ((row x KV head) x splits) and the speedup over the
   same backend's non-fused array-API path.
3. Chunked prefill, a 512-token chunk on a 3k..32k cache: TFLOP/s against GQAKV_PEAK_TFLOPS
   (default 989, an H200's dense bf16 tensor-core peak).
4. Attention variants (window / softcap / sinks): decode, split decode and prefill against
   the float64 reference, and windowed decode time against the full row.
5. Paged caches (page sizes 1, 16, 256): the paged kernels (kernels/paged_kv.cuh) against
   the float64 reference through ragged prefill, a fork (copy on write of a shared last
   page) and decode, then paged decode / chunked prefill time against the contiguous
   cache on the same tokens (the issue's targets: at most 1.15x at page size 16, 1.05x at
   256 for decode; 1.1x for chunked prefill).
6. Quantized caches (int8 / float8_e4m3fn K/V): the device append's codes and scales
   against gqakv.storage.quantize bit for bit (hard tokens), decode / split decode / prefill against
   the float64 reference on the dequantized values, the kernels the routes chose, and
   decode time over an int8 cache against bfloat16 (the issue's 0.6x target on bytes).
Designed to finish in under 8 minutes on one H200. Exit status: 0 when the parity suite
passed, 1 when it failed, 2 when cupy cannot run here (the reason is printed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HQ, HKV, D = 32, 8, 128
DTYPE = "bfloat16"


def timed(fn, sync, repeats=10) -> float:
    """Median seconds of fn() after a warm-up call, synchronizing the device each time."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def filled(backend, batch, live, max_len=None):
    import gqakv
    import gqakv.core.inputs

    cache = gqakv.KVCache(batch, HKV, max_len or live, D, dtype=DTYPE, backend=backend)
    import cupy

    block = min(live, 2048)
    data = cupy.random.standard_normal((batch, HKV, block, D), dtype=cupy.float32)
    data = backend.from_numpy(cupy.asnumpy(data), DTYPE)
    while (left := live - cache.host_lens).any():
        cache.append(data, data, np.minimum(left, block))
    return cache


def tensor_cores() -> bool:
    """Whether the current device runs the mma kernels (what CupyBackend tells the planner)."""
    import cupy

    return int(cupy.cuda.Device().compute_capability) >= 80


def decode_grid(batch, live, sms) -> str:
    """The decode launch the planner makes for this shape: CTAs as (row x head) x splits."""
    from gqakv_backends.cupy_backend import plan

    p = plan.plan_attention(DTYPE, D, batch=batch, kv_heads=HKV,
                            group=HQ // HKV, t_q=1, lens=np.full(batch, live),
                            n_new=np.ones(batch, dtype=np.int64), scale=D ** -0.5,
                            q_strides=(HQ * D, D, D), buf_strides=(HKV * live * D, live * D, D),
                            out_strides=(HQ * D, D, D), sm_count=sms, tensor_cores=tensor_cores())
    x, y, _ = p.launches[0].grid
    return f"{x}x{y}"


def kernel_seconds(cache, q, n_new, sms, reps=20) -> float:
    """Device seconds per step of the decode launches alone: CUDA events around ``reps``
    back-to-back launches of one plan whose inputs are prepared once. The timed call above
    also pays the per-call host work (checks, planning, allocations, the upload of the row
    lengths, the synchronization); this separates what the kernels achieve from that."""
    import cupy

    from gqakv_backends.cupy_backend import plan
    from gqakv_backends.cupy_backend.modules import run_plan

    def strides(x):
        return tuple(s // x.itemsize for s in x.strides)[:3]

    batch = q.shape[0]
    out = cupy.zeros(q.shape, dtype=q.dtype)
    lse = cupy.full(q.shape[:3], -np.inf, dtype=cupy.float32)
    lens = np.asarray(cache.host_lens, dtype=np.int64)
    p = plan.plan_attention(DTYPE, D, batch=batch, kv_heads=HKV, group=HQ // HKV, t_q=q.shape[2],
                            lens=lens, n_new=n_new, scale=D ** -0.5, q_strides=strides(q),
                            buf_strides=strides(cache.k), out_strides=strides(out), sm_count=sms,
                            tensor_cores=tensor_cores())
    ints = cupy.asarray(np.array([np.arange(batch), lens, n_new], dtype=np.int64))
    arrays = {"q": q, "k_buf": cache.k, "v_buf": cache.v, "rows": ints[0], "lens": ints[1],
              "n_new": ints[2], "out": out, "lse": lse}
    run_plan(p, arrays, DTYPE, D)  # compile and warm up
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(reps):
        run_plan(p, arrays, DTYPE, D)
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / reps


def decode_bench(backend, grid, peak_tbs) -> None:
    import cupy

    import gqakv
    import gqakv.core.inputs
    from gqakv.dispatch.backend import Backend

    from gqakv_backends.cupy_backend import plan

    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    kernel = plan.decode_kernel(DTYPE, D, HQ // HKV, tensor_cores())[0]
    print(f"\ndecode, bf16, Hq={HQ} Hkv={HKV} d={D}, {kernel}, grid (rows x heads) x splits"
          f"   (peak {peak_tbs} TB/s)")
    print("(call: gqa_attention timed per call, host work included; kernels: the launches alone)")
    print(f"{'batch':>5} {'live':>6} {'grid':>8} {'us/call':>9} {'TB/s':>6} {'%peak':>6} "
          f"{'us/kern':>9} {'TB/s':>6} {'%peak':>6} {'vs array-API':>13}")
    rng = np.random.default_rng(0)
    for batch, live in grid:
        cache = filled(backend, batch, live)
        q = backend.from_numpy(rng.standard_normal((batch, HQ, 1, D), dtype=np.float32), DTYPE)
        n_new = np.ones(batch, dtype=np.int64)
        fused = timed(lambda: gqakv.gqa_attention(q, cache, n_new), backend.synchronize)
        nbytes = batch * live * 2 * HKV * D * 2
        tbs = nbytes / fused / 1e12
        kern = kernel_seconds(cache, q, n_new, sms)
        ktbs = nbytes / kern / 1e12
        ratio = ""
        if batch * live <= 8 * 8192:  # the array-API path is slow: only the smaller sizes
            inp = gqakv.core.inputs.validate_attention(cache, q, n_new, None, D ** -0.5)
            generic = timed(lambda: Backend.attention(backend, q, cache.store, inp, inp.params,
                                                      return_lse=False),
                            backend.synchronize, repeats=3)
            ratio = f"{generic / fused:12.1f}x"
        print(f"{batch:5d} {live:6d} {decode_grid(batch, live, sms):>8} {fused * 1e6:9.1f} {tbs:6.2f} "
              f"{100 * tbs / peak_tbs:5.1f}% {kern * 1e6:9.1f} {ktbs:6.2f} {100 * ktbs / peak_tbs:5.1f}% "
              f"{ratio:>13}", flush=True)
        cache = None  # frees the device memory (a del would unbind the lambda's name)


def prefill_bench(backend, lens, peak_tflops) -> None:
    import gqakv
    import gqakv.core.inputs

    from gqakv_backends.cupy_backend import plan

    kernel = plan.prefill_kernel(DTYPE, D, tensor_cores())
    print(f"\nchunked prefill, 512-token chunk, bf16, {kernel}   (peak {peak_tflops} TFLOP/s)")
    rng = np.random.default_rng(1)
    for cache_len in lens:
        cache = filled(backend, 1, cache_len)
        q = backend.from_numpy(rng.standard_normal((1, HQ, 512, D), dtype=np.float32), DTYPE)
        n_new = np.array([512])
        t = timed(lambda: gqakv.gqa_attention(q, cache, n_new), backend.synchronize, repeats=5)
        flops = 4 * HQ * D * sum(cache_len - 512 + i + 1 for i in range(512))
        print(f"cache {cache_len:6d}: {t * 1e3:8.2f} ms  {flops / t / 1e12:6.2f} TFLOP/s "
              f"({100 * flops / t / 1e12 / peak_tflops:.1f}% of peak)", flush=True)
        cache = None  # frees the device memory (a del would unbind the lambda's name)


def variant_check(backend, quick: bool) -> bool:
    """The attention variants (window / softcap / sinks, kernels/variant.cuh) on the device:
    decode, split decode and prefill of each variant against the float64 reference
    (tests/support/reference.py), then decode time with a window of 4,096 against none on a long
    row (it must follow min(L, W)). Returns whether every parity check passed."""
    import math

    import ml_dtypes

    import gqakv

    sys.path.insert(0, str(ROOT / "tests"))
    from support.reference import reference_attention

    rng = np.random.default_rng(2)
    hq = HQ
    variants = {"window": dict(window=37), "softcap": dict(softcap=20.0),
                "sinks": dict(sinks=[float(np.float32(x)) for x in rng.standard_normal(hq)]),
                "all": dict(window=1, softcap=0.01, sinks=[-math.inf, 30.0] * (hq // 2))}
    ok = True
    print("\nattention variants, bf16 (max |out - ref|, tolerance 2 x rounding + 2e-6):")
    for name, kw in variants.items():
        for T, live in ((1, 300), (1, 5000), (40, 300)):
            cache = gqakv.KVCache(2, HKV, live + 64, D, dtype=DTYPE, backend=backend)
            k = rng.standard_normal((2, HKV, live, D)).astype(np.float32)
            v = rng.standard_normal((2, HKV, live, D)).astype(np.float32)
            cache.append(backend.from_numpy(k, DTYPE), backend.from_numpy(v, DTYPE), np.array([live, live - 7]))
            qh = rng.standard_normal((2, HQ, T, D)).astype(np.float32)
            n_new = np.array([T, max(1, T - 3)])
            out, lse = gqakv.gqa_attention(backend.from_numpy(qh, DTYPE), cache, n_new, return_lse=True, **kw)
            got = backend.to_numpy(out).astype(np.float64)

            q64 = qh.astype(ml_dtypes.bfloat16).astype(np.float64)
            lens = np.asarray(cache.host_lens)
            kr = [k[b, :, :lens[b]].astype(ml_dtypes.bfloat16).astype(np.float64) for b in range(2)]
            vr = [v[b, :, :lens[b]].astype(ml_dtypes.bfloat16).astype(np.float64) for b in range(2)]
            ref, _ = reference_attention(q64, kr, vr, n_new, D ** -0.5, **kw)
            real = np.arange(T)[None, None, :, None] < n_new[:, None, None, None]
            real = np.broadcast_to(real, ref.shape)
            rounding = np.abs(ref.astype(ml_dtypes.bfloat16).astype(np.float64) - ref)[real].max()
            err = np.abs(got.astype(np.float64) - ref)[real].max()
            good = err <= 2 * rounding + 2e-6 and not np.isnan(got).any() and (got[~real] == 0).all()
            ok &= bool(good)
            print(f"  {name:8s} T={T:3d} L={live:5d}: {err:.3g} ({'ok' if good else 'FAILED'})", flush=True)
            del cache
    live = 32768 if quick else 131072
    cache = filled(backend, 1, live)
    q = backend.from_numpy(rng.standard_normal((1, HQ, 1, D), dtype=np.float32), DTYPE)
    n_new = np.ones(1, dtype=np.int64)
    full = timed(lambda: gqakv.gqa_attention(q, cache, n_new), backend.synchronize)
    win = timed(lambda: gqakv.gqa_attention(q, cache, n_new, window=4096), backend.synchronize)
    print(f"decode on a {live}-token row: {full * 1e6:.1f} us without a window, {win * 1e6:.1f} us "
          f"with window=4096 (keys {live} vs 4096: ratio {full / win:.1f}x)", flush=True)
    return ok


def paged_check(backend, quick: bool) -> bool:
    """PagedKVCache on the paged kernels: parity with the float64 reference (ragged prefill,
    a fork whose shared last page is copied on write, decode; every launch must be a paged
    instantiation), then paged / contiguous time for decode and a 512-token chunk on the
    same tokens. Returns whether every parity check passed."""
    import ml_dtypes

    import gqakv
    from gqakv_backends.cupy_backend import modules

    sys.path.insert(0, str(ROOT / "tests"))
    from support.reference import reference_attention

    rng = np.random.default_rng(3)
    bf16 = lambda x: x.astype(ml_dtypes.bfloat16)  # noqa: E731
    names: list[str] = []
    run_plan = modules.run_plan

    def recording(plan, arrays, dtype, head_dim):
        names.extend(launch.name for launch in plan.launches)
        return run_plan(plan, arrays, dtype, head_dim)

    ok = True
    print("\npaged caches, bf16 (max |out - ref|, tolerance 2 x rounding + 2e-6):")
    modules.run_plan = recording
    try:
        for P in (1, 16, 256):
            B, S = 4, 700
            cache = gqakv.PagedKVCache(B, HKV, S, D, dtype=DTYPE, backend=backend, page_size=P)
            rows_k = [np.zeros((HKV, 0, D))] * B
            rows_v = [np.zeros((HKV, 0, D))] * B
            names.clear()
            for step, n in enumerate(([300, 0, 517, 45], "fork", [40, 37, 1, 0], [1, 1, 1, 1])):
                if n == "fork":  # row 0's 300 tokens into rows 1 and 3 (a partly filled last page)
                    cache.fork(0, [1, 3])
                    rows_k[1] = rows_k[3] = rows_k[0]
                    rows_v[1] = rows_v[3] = rows_v[0]
                    continue
                n = np.asarray(n, np.int64)
                T = int(n.max())
                k = bf16(rng.standard_normal((B, HKV, T, D), dtype=np.float32))
                v = bf16(rng.standard_normal((B, HKV, T, D), dtype=np.float32))
                q = bf16(rng.standard_normal((B, HQ, T, D), dtype=np.float32))
                dev = lambda x: backend.from_numpy(x.astype(np.float32), DTYPE)  # noqa: E731 (exact)
                cache.append(dev(k), dev(v), n)
                for b in range(B):
                    rows_k[b] = np.concatenate([rows_k[b], k[b, :, :n[b]].astype(np.float64)], axis=1)
                    rows_v[b] = np.concatenate([rows_v[b], v[b, :, :n[b]].astype(np.float64)], axis=1)
                out = backend.to_numpy(gqakv.gqa_attention(dev(q), cache, n)).astype(np.float64)
                ref, _ = reference_attention(q.astype(np.float64), rows_k, rows_v, n, D ** -0.5)
                real = np.broadcast_to(np.arange(T)[None, None, :, None] < n[:, None, None, None], ref.shape)
                rounding = np.abs(bf16(ref).astype(np.float64) - ref)[real].max()
                err = np.abs(out - ref)[real].max()
                good = err <= 2 * rounding + 2e-6 and not np.isnan(out).any() and (out[~real] == 0).all()
                ok &= bool(good)
                print(f"  P={P:3d} step {step} T={T:3d}: {err:.3g} ({'ok' if good else 'FAILED'})", flush=True)
            attn = [x for x in names if x.startswith(("gqakv_decode", "gqakv_prefill", "gqakv_write_kv"))]
            paged = bool(attn) and all(x.endswith("KVPages>") for x in attn)
            ok &= paged
            print(f"  P={P:3d} kernels: {sorted(set(x.split('<')[0] for x in attn))} "
                  f"{'all paged' if paged else 'NOT ALL PAGED: ' + str(attn)}", flush=True)
            del cache
    finally:
        modules.run_plan = run_plan

    print("\npaged / contiguous time, same tokens (decode: B=4 L=4096, B=32 L=1024; prefill: 512 "
          "tokens on 8192)")
    shapes = [(4, 4096, 1), (32, 1024, 1)] + ([] if quick else [(1, 8192, 512)])
    for batch, live, T in shapes:
        k = backend.from_numpy(rng.standard_normal((batch, HKV, live, D), dtype=np.float32), DTYPE)
        v = backend.from_numpy(rng.standard_normal((batch, HKV, live, D), dtype=np.float32), DTYPE)
        q = backend.from_numpy(rng.standard_normal((batch, HQ, T, D), dtype=np.float32), DTYPE)
        n_new = np.full(batch, T, dtype=np.int64)
        caches = {"contiguous": gqakv.KVCache(batch, HKV, live, D, dtype=DTYPE, backend=backend)}
        for P in (16, 256):
            caches[f"P={P}"] = gqakv.PagedKVCache(batch, HKV, live, D, dtype=DTYPE, backend=backend,
                                                  page_size=P)
        times = {}
        for name, c in caches.items():
            c.append(k, v, np.full(batch, live, dtype=np.int64))
            times[name] = timed(lambda: gqakv.gqa_attention(q, c, n_new), backend.synchronize)
        base = times["contiguous"]
        print(f"  B={batch:2d} L={live:5d} T={T:3d}: contiguous {base * 1e6:8.1f} us; "
              + "; ".join(f"{n} {t * 1e6:8.1f} us ({t / base:.2f}x)" for n, t in times.items()
                          if n != "contiguous"), flush=True)
        del caches
    return ok


def quantized_check(backend, quick: bool) -> bool:
    """Quantized K/V on the device (kernels/quantized_kv.cuh): returns whether every
    parity check passed (see the module docstring, item 6)."""
    import ml_dtypes

    import gqakv
    from gqakv.storage import quantize as Q

    sys.path.insert(0, str(ROOT / "tests"))
    from support.reference import reference_attention

    rng = np.random.default_rng(3)
    ok = True
    print("\nquantized K/V, bf16 q (append bit-exact; max |out - ref on dequantized|, "
          "tolerance 2 x rounding + 2e-6):")
    for kv in ("int8", "float8_e4m3fn"):
        # The append: hard tokens (zero, huge, tiny, NaN, ties at scale 1) bit for bit.
        x = rng.standard_normal((2, HKV, 64, D)).astype(np.float32)
        x[0, 0, 0] = 0.0
        x[0, 1, 1] *= 1e30
        x[0, 2, 2] *= 1e-38
        x[0, 3, 3, 5] = np.nan
        x[1, 0, 4, :8] = [127.0 if kv == "int8" else 448.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 126.5]
        xb = x.astype(ml_dtypes.bfloat16)
        cache = gqakv.KVCache(2, HKV, 64, D, dtype=DTYPE, backend=backend, kv_dtype=kv)
        cache.append(backend.from_numpy(xb, DTYPE), backend.from_numpy(xb, DTYPE), np.array([64, 64]))
        codes, scales = Q.quantize(np, xb.astype(np.float32), kv)
        same = (backend.to_numpy(cache.store.k).view(np.uint8).tobytes() == codes.view(np.uint8).tobytes()
                and backend.to_numpy(cache.store.k_scale).view(np.uint32).tobytes()
                == scales.view(np.uint32).tobytes())
        ok &= same
        route = backend.route("write_kv", dtype=DTYPE, head_dim=D, codec=kv).impl
        print(f"  {kv:13s} append ({route}): {'bit-exact' if same else 'CODES OR SCALES DIFFER'}", flush=True)
        for T, live in ((1, 300), (1, 5000), (40, 300)):
            cache = gqakv.KVCache(2, HKV, live + 64, D, dtype=DTYPE, backend=backend, kv_dtype=kv)
            k = rng.standard_normal((2, HKV, live, D)).astype(ml_dtypes.bfloat16)
            v = rng.standard_normal((2, HKV, live, D)).astype(ml_dtypes.bfloat16)
            cache.append(backend.from_numpy(k, DTYPE), backend.from_numpy(v, DTYPE), np.array([live, live - 7]))
            qh = rng.standard_normal((2, HQ, T, D)).astype(ml_dtypes.bfloat16)
            n_new = np.array([T, max(1, T - 3)])
            got = backend.to_numpy(gqakv.gqa_attention(backend.from_numpy(qh, DTYPE), cache, n_new)).astype(np.float64)
            lens = np.asarray(cache.host_lens)
            deq = [[Q.dequantize(np, *Q.quantize(np, a[b, :, :lens[b]].astype(np.float32), kv), kv)
                    .astype(np.float64) for b in range(2)] for a in (k, v)]
            ref, _ = reference_attention(qh.astype(np.float64), deq[0], deq[1], n_new, D ** -0.5)
            real = np.broadcast_to(np.arange(T)[None, None, :, None] < n_new[:, None, None, None], ref.shape)
            rounding = np.abs(ref.astype(ml_dtypes.bfloat16).astype(np.float64) - ref)[real].max()
            err = np.abs(got - ref)[real].max()
            good = err <= 2 * rounding + 2e-6 and not np.isnan(got).any() and (got[~real] == 0).all()
            ok &= bool(good)
            impl = backend.route("attention", dtype=DTYPE, head_dim=D, t_q=T, codec=kv,
                                 capability=int(cupy_capability())).impl
            print(f"  {kv:13s} T={T:3d} L={live:5d} ({impl}): {err:.3g} ({'ok' if good else 'FAILED'})",
                  flush=True)
            del cache
    for batch, live in ((4, 4096), (1, 32768)):
        q = backend.from_numpy(rng.standard_normal((batch, HQ, 1, D), dtype=np.float32), DTYPE)
        n_new = np.ones(batch, dtype=np.int64)
        times = {}
        for kv in (None, "int8"):
            cache = gqakv.KVCache(batch, HKV, live, D, dtype=DTYPE, backend=backend, kv_dtype=kv)
            data = backend.from_numpy(rng.standard_normal((batch, HKV, live, D), dtype=np.float32), DTYPE)
            cache.append(data, data, np.full(batch, live))
            times[kv] = timed(lambda: gqakv.gqa_attention(q, cache, n_new), backend.synchronize)
            cache = data = None  # frees the device memory
        print(f"decode B={batch} L={live}: int8 {times['int8'] * 1e6:.1f} us, bf16 {times[None] * 1e6:.1f} us "
              f"(ratio {times['int8'] / times[None]:.2f}, target <= 0.6)", flush=True)
    return ok


def cupy_capability() -> int:
    import cupy

    return int(cupy.cuda.Device().compute_capability)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller benchmark grid")
    ap.add_argument("--no-tests", action="store_true", help="benchmarks only")
    args = ap.parse_args()

    import gqakv
    import gqakv.core.inputs

    backend = next((b for b in gqakv.list_backends() if b.name == "cupy"), None)
    why = "the cupy backend is not registered" if backend is None else backend.unavailable_reason()
    if why:
        print(f"gpu_check: cannot run: {why}")
        return 2
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    print(f"device: {props['name'].decode()}  SMs: {props['multiProcessorCount']}  "
          f"memory: {props['totalGlobalMem'] / 2**30:.0f} GiB")

    status = 0
    if not args.no_tests:
        # All failures, not only the first (device time is scarce); a test module that
        # cannot import on the GPU machine (another transformers version, say) must not
        # hide the cupy results.
        cmd = [sys.executable, "-m", "pytest", "-q", "--maxfail=25", "--continue-on-collection-errors",
               str(ROOT / "tests"), "-k", "cupy and not emulated and not nvrtc",
               "-p", "no:cacheprovider"]
        print("$ " + " ".join(cmd), flush=True)
        status = 0 if subprocess.run(cmd, cwd=ROOT, timeout=300).returncode == 0 else 1

    peak_tbs = float(os.environ.get("GQAKV_PEAK_HBM_TBS", "4.8"))
    # H200 dense bf16 tensor-core peak (the bf16 prefill runs on mma.sync); 67 is its fp32 FMA peak
    peak_tflops = float(os.environ.get("GQAKV_PEAK_TFLOPS", "989"))
    if args.quick:
        decode_bench(backend, [(1, 8192), (8, 8192), (64, 4096)], peak_tbs)
        prefill_bench(backend, [3072], peak_tflops)
    else:
        grid = [(b, L) for b in (1, 8, 64) for L in (1024, 8192, 32768)]
        decode_bench(backend, grid, peak_tbs)
        prefill_bench(backend, [3072, 8192, 32768], peak_tflops)
    if not variant_check(backend, args.quick):
        status = 1
    if not paged_check(backend, args.quick):
        status = 1
    if not quantized_check(backend, args.quick):
        status = 1
    print("\nparity suite: " + ("passed" if status == 0 else "FAILED"))
    return status


if __name__ == "__main__":
    sys.exit(main())
