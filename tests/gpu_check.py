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
    import gqakv.inputs

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
    import gqakv.inputs
    from gqakv.backend import Backend

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
            inp = gqakv.inputs.validate_attention(cache, q, n_new, None, D ** -0.5)
            generic = timed(lambda: Backend.attention(backend, q, cache.store, inp, inp.params,
                                                      return_lse=False),
                            backend.synchronize, repeats=3)
            ratio = f"{generic / fused:12.1f}x"
        print(f"{batch:5d} {live:6d} {decode_grid(batch, live, sms):>8} {fused * 1e6:9.1f} {tbs:6.2f} "
              f"{100 * tbs / peak_tbs:5.1f}% {kern * 1e6:9.1f} {ktbs:6.2f} {100 * ktbs / peak_tbs:5.1f}% "
              f"{ratio:>13}", flush=True)
        del cache


def prefill_bench(backend, lens, peak_tflops) -> None:
    import gqakv
    import gqakv.inputs

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
        del cache


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller benchmark grid")
    ap.add_argument("--no-tests", action="store_true", help="benchmarks only")
    args = ap.parse_args()

    import gqakv
    import gqakv.inputs

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
    print("\nparity suite: " + ("passed" if status == 0 else "FAILED"))
    return status


if __name__ == "__main__":
    sys.exit(main())
