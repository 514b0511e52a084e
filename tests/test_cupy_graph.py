"""A fixed attention plan (``fixed=True``) captured in a CUDA graph and replayed for later
lengths, and a whole model step (every layer's append and attention) captured and
replayed with ``Step.replay``: the cupy backend on a GPU only (the emulator has no
graphs; its half of the contract, launches that stay the same, no allocation or copy
after ``adopt``, and a recorded step replayed bit for bit as the eager one in
batch-invariant mode, is tests/test_cupy_emulated_plan.py). Skipped everywhere else; not
run by their author, who had no GPU: tests/gpu_check.py runs them where there is one."""

from __future__ import annotations

import numpy as np
import pytest

import gqakv

from .support.reference import reference_on_buffers
from .support.tolerance import max_error, plain_float32_attention

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


LAYERS, MAX_LEN, PAGE = 4, 512, 16
HISTORY = (303, 46, 158)  # the decode steps below cross page boundaries (304, 48, 160)
STEPS = ([1, 1, 1], [1, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 1])


def _filled_model_cache(backend, storage, rng_seed):
    kw = dict(page_size=PAGE) if storage == "paged" else {}
    cache = gqakv.ModelKVCache(LAYERS, B, HKV, MAX_LEN, D, dtype="float32", backend=backend, **kw)
    rng = np.random.default_rng(rng_seed)
    with cache.step(list(HISTORY)) as step:
        for l in range(LAYERS):
            x = backend.from_numpy(rng.standard_normal((B, HKV, max(HISTORY), D)), "float32")
            step.write(l, x, x)
    return cache


@pytest.mark.parametrize("invariant", [True, False], ids=["batch-invariant", "default"])
@pytest.mark.parametrize("storage", ["contiguous", "paged"])
def test_cupy_whole_step_replays_in_a_cuda_graph(backend, storage, invariant):
    """Step 1 plans a fixed decode plan and runs every layer eagerly through it (kernels
    compiled); step 2 adopts it and captures every layer's ``attend`` (the fixed append and
    the attention, into per-layer out / lse buffers) on a side stream, then launches the
    graph once; steps 3.. adopt the plan, refill the q / K / V buffers in place and
    ``Step.replay`` the graph. Every step's every layer is compared with a second cache
    stepped eagerly (plain ``attend``): the same bits in batch-invariant mode, float32
    rounding apart otherwise (the fixed plan splits keys by the capacity); and with the
    float64 reference."""
    if backend.name != "cupy":
        pytest.skip("CUDA graphs: the cupy backend on a GPU")
    import contextlib

    import cupy as cp

    fixed_cache = _filled_model_cache(backend, storage, 1)
    eager_cache = _filled_model_cache(backend, storage, 1)
    rng = np.random.default_rng(2)
    hq = HKV * G
    qs = [backend.empty((B, hq, 1, D), "float32") for _ in range(LAYERS)]
    ks = [backend.empty((B, HKV, 1, D), "float32") for _ in range(LAYERS)]
    outs = [backend.empty((B, hq, 1, D), "float32") for _ in range(LAYERS)]
    lses = [backend.empty((B, hq, 1), "float32") for _ in range(LAYERS)]
    stream = cp.cuda.Stream(non_blocking=True)
    plan = graph = None
    mode = gqakv.batch_invariant() if invariant else contextlib.nullcontext()
    with mode:
        for i, n_new in enumerate(STEPS):
            q_host = [rng.standard_normal((B, hq, 1, D)).astype(np.float32) for _ in range(LAYERS)]
            k_host = [rng.standard_normal((B, HKV, 1, D)).astype(np.float32) for _ in range(LAYERS)]
            for l in range(LAYERS):  # in place: the graph reads these very buffers
                qs[l].set(q_host[l])
                ks[l].set(k_host[l])
            with fixed_cache.step(n_new) as step:
                if plan is None:
                    plan = step.plan_attention(hq, t_q=1, fixed=True)
                else:
                    step.adopt(plan)
                cp.cuda.Device().synchronize()  # the uploads above before the side stream
                if i == 0:  # eager: compiles every kernel (no compiling inside a capture)
                    for l in range(LAYERS):
                        step.attend(l, qs[l], ks[l], ks[l], plan=plan, out=outs[l],
                                    lse_out=lses[l])
                elif i == 1:
                    with stream:
                        stream.begin_capture()
                        for l in range(LAYERS):
                            step.attend(l, qs[l], ks[l], ks[l], plan=plan, out=outs[l],
                                        lse_out=lses[l])
                        graph = stream.end_capture()
                    graph.launch(stream)  # the capture ran nothing: this step's run
                else:
                    step.replay(lambda: graph.launch(stream))
                stream.synchronize()
                cp.cuda.Device().synchronize()
            with eager_cache.step(n_new) as step:
                eager = [step.attend(l, backend.from_numpy(q_host[l], "float32"),
                                     *(2 * [backend.from_numpy(k_host[l], "float32")]),
                                     return_lse=True) for l in range(LAYERS)]
            for l in range(LAYERS):
                got, got_lse = outs[l].get(), lses[l].get()
                want, want_lse = eager[l][0].get(), eager[l][1].get()
                np.testing.assert_array_equal(np.isfinite(got_lse), np.isfinite(want_lse))
                if invariant:
                    np.testing.assert_array_equal(got, want, err_msg=f"step {i} layer {l}")
                    np.testing.assert_array_equal(got_lse, want_lse, err_msg=f"step {i} layer {l}")
                else:
                    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
                    live = np.isfinite(want_lse)
                    np.testing.assert_allclose(got_lse[live], want_lse[live], rtol=1e-5, atol=1e-6)
                rows = [np.asarray(backend.to_numpy(fixed_cache.live_kv(l, b)[0]), np.float64)
                        for b in range(B)]
                for b in range(B):  # the graph's appends: the eager cache's K/V
                    np.testing.assert_array_equal(
                        rows[b], backend.to_numpy(eager_cache.live_kv(l, b)[0]))
                lens = [r.shape[1] for r in rows]
                full = np.zeros((B, HKV, max(lens), D))
                for b, r in enumerate(rows):
                    full[b, :, :r.shape[1]] = r
                ref, _ = reference_on_buffers(q_host[l], full, full, lens, n_new)
                plain = plain_float32_attention(q_host[l], rows, rows, n_new, D ** -0.5)
                assert max_error(got, ref) <= 4 * max_error(plain, ref) + 1e-6
    assert list(fixed_cache.host_lens) == [h + sum(n[b] for n in STEPS) for b, h in enumerate(HISTORY)]
