"""The cupy backend on a machine with more than one GPU, on the emulated backend.

CuPy launches kernels on the *current* device; a cache made on device 1 and used while
device 0 is current must still work, with every launch, index upload, output and
reorder temporary on device 1. The emulated backend (tests/cuda_emu/emulated_backend.py)
offers two devices, records which one each array lives on, and refuses a launch that
hands a kernel an array of another device (where a GPU would fault), so these tests fail
if any hot operation launches or allocates on the caller's device instead of the cache's.
"""

from __future__ import annotations

import numpy as np
import pytest

import gqakv

from .cuda_emu import harness
from .support.reference import reference_attention

if harness.compiler() is None:
    pytest.skip("no C++ compiler (g++) for the CUDA emulation harness", allow_module_level=True)

from .cuda_emu.emulated_backend import EmulatedCupyBackend, EmulatedDevice  # noqa: E402

HKV, G, D = 2, 3, 64


@pytest.fixture
def backend():
    return EmulatedCupyBackend()


def _on(backend, device: int, a: np.ndarray, dtype: str = "float32"):
    """A device copy of ``a`` on emulated device ``device``."""
    with EmulatedDevice(device):
        return backend.from_numpy(a, dtype)


def _cache_on(backend, device: int, **kwargs):
    with EmulatedDevice(device):
        return gqakv.KVCache(backend=backend, **kwargs)


def test_a_cache_on_device_1_works_while_device_0_is_current(backend):
    rng = np.random.default_rng(0)
    cache = _cache_on(backend, 1, batch=3, kv_heads=HKV, max_len=40, head_dim=D, dtype="float32")
    assert backend.device_of(cache.k) == 1 and backend.device_of(cache.v) == 1
    k_rows = [np.zeros((HKV, 0, D)) for _ in range(3)]  # host model: live tokens per row
    v_rows = [np.zeros((HKV, 0, D)) for _ in range(3)]
    before = backend.launches
    for n_new in ([5, 0, 7], [1, 1, 1], [3, 2, 0]):  # prefill-sized and decode-sized steps
        n_new = np.array(n_new)
        T = int(n_new.max())
        k = rng.standard_normal((3, HKV, T, D)).astype(np.float32)
        v = rng.standard_normal((3, HKV, T, D)).astype(np.float32)
        q = rng.standard_normal((3, HKV * G, T, D)).astype(np.float32)
        # device 0 is current here: the calls below must move to the cache's device
        cache.append(_on(backend, 1, k), _on(backend, 1, v), n_new)
        out, lse = gqakv.gqa_attention(_on(backend, 1, q), cache, n_new, return_lse=True)
        assert backend.device_of(out) == 1 and backend.device_of(lse) == 1
        for b in range(3):
            k_rows[b] = np.concatenate([k_rows[b], k[b, :, :n_new[b]]], axis=1)
            v_rows[b] = np.concatenate([v_rows[b], v[b, :, :n_new[b]]], axis=1)
        ref, ref_lse = reference_attention(q, k_rows, v_rows, n_new)
        np.testing.assert_allclose(backend.to_numpy(out), ref, atol=2e-5, rtol=0)
        np.testing.assert_array_equal(np.isfinite(backend.to_numpy(lse)), np.isfinite(ref_lse))
        live = np.isfinite(ref_lse)
        np.testing.assert_allclose(backend.to_numpy(lse)[live], ref_lse[live], atol=1e-5, rtol=0)
    assert backend.launches > before  # the fused kernels ran (not only generic fallbacks)


def test_reorder_temporary_is_made_on_the_cache_device(backend):
    """A permutation cycle needs a one-row temporary: it must be on the cache's device."""
    rng = np.random.default_rng(1)
    cache = _cache_on(backend, 1, batch=3, kv_heads=HKV, max_len=16, head_dim=D, dtype="float16")
    k = rng.standard_normal((3, HKV, 9, D)).astype(np.float16)
    cache.append(_on(backend, 1, k, "float16"), _on(backend, 1, -k, "float16"), [9, 4, 6])
    before_k = backend.to_numpy(cache.k).copy()
    calls = []
    copy_tokens = backend.copy_tokens
    backend.copy_tokens = lambda *args: calls.append(1) or copy_tokens(*args)
    launches = backend.launches
    cache.reorder([1, 2, 0])  # a 3-cycle: wave through the temporary
    # every wave ran the copy kernel (a temporary on another device would have sent the
    # waves touching it to the generic cross-device slice copies instead)
    assert len(calls) >= 3 and backend.launches - launches == len(calls)
    after_k = backend.to_numpy(cache.k)
    assert list(cache.host_lens) == [4, 6, 9]
    for b, src, n in ((0, 1, 4), (1, 2, 6), (2, 0, 9)):
        np.testing.assert_array_equal(after_k[b, :, :n], before_k[src, :, :n])


def test_inputs_on_another_device_are_refused_before_anything_changes(backend):
    cache = _cache_on(backend, 1, batch=2, kv_heads=HKV, max_len=8, head_dim=D, dtype="float32")
    k = np.ones((2, HKV, 2, D), np.float32)
    with pytest.raises(ValueError, match="device 0, the cache is on 1"):
        cache.append(_on(backend, 0, k), _on(backend, 0, k), [2, 2])
    assert list(cache.host_lens) == [0, 0]


def test_the_emulated_launcher_refuses_arrays_of_another_device(backend):
    """The check the tests above rely on can fail: a launch handed a device-0 array while
    device 1 is current is refused."""
    from gqakv_backends.cupy_backend import plan as planmod

    k_buf = _on(backend, 0, np.zeros((1, 1, 4, D), np.float32))
    plan = planmod.plan_write_kv("float32", D, np.array([1]), 1, 1, (D, D, D), (4 * D, 4 * D, D))
    ints = _on(backend, 1, np.zeros(1, np.int64))
    with EmulatedDevice(1), pytest.raises(RuntimeError, match="k_buf is on device 0"):
        backend._run_plan(plan, {"k_new": ints, "v_new": ints, "k_buf": k_buf, "v_buf": k_buf,
                                 "rows": ints, "starts": ints, "n_new": ints}, "float32", D)



def test_a_model_step_plans_and_uploads_once_for_all_layers(backend, monkeypatch):
    """Every layer of a step has the same lengths: the planner runs once per step and the
    rows/lengths reach the device once per step, not once per layer (host overhead)."""
    from gqakv_backends import cupy_backend

    calls = {"plan_attention": 0, "plan_write_kv": 0}
    for name in calls:
        real = getattr(cupy_backend._plan, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(cupy_backend._plan, name, counting)
    uploads = {"asked": 0, "made": 0}
    keep = backend._uploads.get

    def counting_get(key, make):
        uploads["asked"] += 1
        return keep(key, lambda: uploads.__setitem__("made", uploads["made"] + 1) or make())

    monkeypatch.setattr(backend._uploads, "get", counting_get)
    layers, rng = 4, np.random.default_rng(2)
    cache = gqakv.ModelKVCache(layers, 2, HKV, 32, D, "float16", backend=backend)
    for n_new in ([6, 3], [1, 1], [1, 1]):
        T = max(n_new)
        uploads.update(asked=0, made=0)
        with cache.step(n_new) as step:
            for layer in range(layers):
                kv = backend.from_numpy(rng.standard_normal((2, HKV, T, D)), "float16")
                q = backend.from_numpy(rng.standard_normal((2, HKV * G, T, D)), "float16")
                out = step.attend(layer, q, kv, kv)
                assert np.isfinite(backend.to_numpy(out)).all()
        # write_kv's indices, asked for by the first layer (the later ones append the same
        # inputs: CupyBackend._append_arrays), and attention's, by the step's plan
        # (work.py: its layers run on the plan's arrays), copied at most once each
        assert uploads["asked"] == 2 and 1 <= uploads["made"] <= 2
    # at most once per step: the appends of steps 2 and 3 plan alike, and so do their
    # attentions (rows one token longer, the same Extent: one plan serves both)
    assert calls == {"plan_attention": 2, "plan_write_kv": 2}
