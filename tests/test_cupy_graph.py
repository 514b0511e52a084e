"""A fixed attention plan (``fixed=True``) captured in a CUDA graph and replayed for later
lengths: the cupy backend on a GPU only (the emulator has no graphs; its half of the
contract, launches that stay the same and no allocation or upload in a run, is
tests/test_cupy_emulated_plan.py). Skipped everywhere else; not run by its author, who
had no GPU: tests/gpu_check.py runs it where there is one."""

from __future__ import annotations

import numpy as np
import pytest

import gqakv

B, HKV, G, D = 3, 2, 4, 64


def test_cupy_fixed_plan_replays_in_a_cuda_graph(backend):
    if backend.name != "cupy":
        pytest.skip("CUDA graphs: the cupy backend on a GPU")
    import cupy as cp

    rng = np.random.default_rng(0)
    cache = gqakv.KVCache(batch=B, kv_heads=HKV, max_len=512, head_dim=D, backend=backend)
    x = backend.from_numpy(rng.standard_normal((B, HKV, 300, D)), "float32")
    cache.append(x, x, [300, 40, 150])
    q = backend.from_numpy(rng.standard_normal((B, HKV * G, 1, D)), "float32")
    out = backend.empty((B, HKV * G, 1, D), "float32")
    lse = backend.empty((B, HKV * G, 1), "float32")
    plan = gqakv.plan_attention(cache, [1, 1, 1], q_heads=HKV * G, t_q=1, fixed=True, splits=4)
    plan.run(q, cache, out=out, lse_out=lse)  # compiles the kernels: not allowed in a capture
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        plan.run(q, cache, out=out, lse_out=lse)
        graph = stream.end_capture()
    for n_new in ([1, 1, 1], [1, 0, 1], [0, 1, 1]):
        k = backend.from_numpy(rng.standard_normal((B, HKV, 1, D)), "float32")
        cache.append(k, k, n_new)
        plan.update(cache, n_new)
        q[...] = backend.from_numpy(rng.standard_normal((B, HKV * G, 1, D)), "float32")
        cp.cuda.Device().synchronize()  # the append, update and q on the default stream first
        graph.launch(stream)
        stream.synchronize()
        want, want_lse = gqakv.gqa_attention(q, cache, n_new, return_lse=True)
        np.testing.assert_allclose(out.get(), want.get(), rtol=1e-5, atol=1e-6)
        got_lse, want_lse = lse.get(), want_lse.get()
        np.testing.assert_array_equal(np.isfinite(got_lse), np.isfinite(want_lse))
        live = np.isfinite(want_lse)
        np.testing.assert_allclose(got_lse[live], want_lse[live], rtol=1e-5, atol=1e-6)
