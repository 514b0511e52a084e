"""The fused kernels at head dims the main emulated scenarios do not use.

The fused path serves any head dim up to 256, and each kernel's tiling changes with d
(vector width, lanes per key row, key tile, whether K and V share shared memory in the
tensor-core prefill). The scenario suite covers d = 20, 64, 80, 128, 256; here the cupy
backend itself (``cupy_emulated``: its planner, glue and kernels, emulated on the CPU)
runs chunked prefill, small-T and one-token decode with ragged rows at d = 16, 32, 48,
96, 160 and 240 (real models use 96 and 160, e.g. Phi-3 and some MoE models), in every
fused dtype, against the float64 loop reference with the scenario suite's tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

import gqakv
from gqakv_backends.cupy_backend import plan as planmod

from .cuda_emu import harness
from .cuda_emu.cases import STORAGE, _check_out
from .support.reference import reference_attention

if harness.compiler() is None:
    pytest.skip("no C++ compiler (g++) for the CUDA emulation harness", allow_module_level=True)

from .cuda_emu.emulated_backend import EmulatedCupyBackend  # noqa: E402

HKV, G, B, MAX_LEN = 2, 3, 3, 40
STEPS = ([9, 0, 6], [1, 1, 0], [3, 4, 2], [1, 1, 1])  # prefill, decode, small T, decode


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [16, 32, 48, 96, 160, 240])
def test_fused_kernels_at_other_head_dims(head_dim, dtype):
    backend = EmulatedCupyBackend()
    st = STORAGE[dtype]
    rng = np.random.default_rng(head_dim)
    cache = gqakv.KVCache(B, HKV, MAX_LEN, head_dim, dtype=dtype, backend=backend)
    k_rows = [np.zeros((HKV, 0, head_dim)) for _ in range(B)]
    v_rows = [np.zeros((HKV, 0, head_dim)) for _ in range(B)]
    kernels = set()
    for step, n_new in enumerate(STEPS):
        n_new = np.array(n_new)
        T = int(n_new.max())
        k = rng.standard_normal((B, HKV, T, head_dim)).astype(st)
        v = rng.standard_normal((B, HKV, T, head_dim)).astype(st)
        q = rng.standard_normal((B, HKV * G, T, head_dim)).astype(st)
        launches = backend.launches
        cache.append(backend.from_numpy(k), backend.from_numpy(v), n_new)
        out, lse = gqakv.gqa_attention(backend.from_numpy(q), cache, n_new, return_lse=True)
        assert backend.launches - launches >= 2, "append and attention ran the fused kernels"
        for b in range(B):
            k_rows[b] = np.concatenate([k_rows[b], k[b, :, :n_new[b]].astype(np.float64)], axis=1)
            v_rows[b] = np.concatenate([v_rows[b], v[b, :, :n_new[b]].astype(np.float64)], axis=1)
        ref, ref_lse = reference_attention(q.astype(np.float64), k_rows, v_rows, n_new)
        stats = {"max_out_err": 0.0, "max_out_tol": 0.0, "max_lse_err": 0.0}
        case = type("Case", (), {"dtype": dtype, "name": f"{dtype}-d{head_dim}"})
        _check_out(case, step, backend.to_numpy(out), backend.to_numpy(lse), ref, ref_lse,
                   n_new, stats)
        plan = planmod.plan_attention(
            dtype, head_dim, batch=B, kv_heads=HKV, group=G, t_q=T, lens=cache.host_lens,
            n_new=n_new, scale=head_dim ** -0.5, q_strides=(1, 1, 1), buf_strides=(1, 1, 1),
            out_strides=(1, 1, 1), sm_count=132)
        kernels |= {launch.kernel for launch in plan.launches}
    want = {"gqakv_decode", "gqakv_prefill_mma" if dtype != "float32" else "gqakv_prefill"}
    assert want <= kernels, kernels


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unpadded_steps_write_every_output_without_fills(dtype):
    """With no padded query the backend skips the out/lse fill launches (cupy.empty; NaN
    in the emulator): every element must then come from the kernels, also when the
    decode is split and merged and when rows are ragged."""
    backend = EmulatedCupyBackend()
    st = STORAGE[dtype]
    rng = np.random.default_rng(3)
    d, lens0 = 64, np.array([600, 300])
    cache = gqakv.KVCache(2, HKV, 700, d, dtype=dtype, backend=backend)
    k = rng.standard_normal((2, HKV, 600, d)).astype(st)
    v = rng.standard_normal((2, HKV, 600, d)).astype(st)
    cache.append(backend.from_numpy(k), backend.from_numpy(v), lens0)
    k_rows = [k[b, :, :lens0[b]].astype(np.float64) for b in range(2)]
    v_rows = [v[b, :, :lens0[b]].astype(np.float64) for b in range(2)]
    for T in (1, 8):  # split decode + merge, then prefill
        n_new = np.array([T, T])
        kn = rng.standard_normal((2, HKV, T, d)).astype(st)
        vn = rng.standard_normal((2, HKV, T, d)).astype(st)
        q = rng.standard_normal((2, HKV * G, T, d)).astype(st)
        cache.append(backend.from_numpy(kn), backend.from_numpy(vn), n_new)
        plan = planmod.plan_attention(
            dtype, d, batch=2, kv_heads=HKV, group=G, t_q=T, lens=cache.host_lens, n_new=n_new,
            scale=d ** -0.5, q_strides=(1, 1, 1), buf_strides=(1, 1, 1), out_strides=(1, 1, 1),
            sm_count=132)
        if T == 1:
            assert plan.num_splits > 1  # the merge writes the outputs
        out, lse = gqakv.gqa_attention(backend.from_numpy(q), cache, n_new, return_lse=True)
        for b in range(2):
            k_rows[b] = np.concatenate([k_rows[b], kn[b].astype(np.float64)], axis=1)
            v_rows[b] = np.concatenate([v_rows[b], vn[b].astype(np.float64)], axis=1)
        ref, ref_lse = reference_attention(q.astype(np.float64), k_rows, v_rows, n_new)
        stats = {"max_out_err": 0.0, "max_out_tol": 0.0, "max_lse_err": 0.0}
        case = type("Case", (), {"dtype": dtype, "name": f"unpadded-{dtype}-T{T}"})
        _check_out(case, T, backend.to_numpy(out), backend.to_numpy(lse), ref, ref_lse, n_new, stats)
