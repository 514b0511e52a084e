"""The torch backend plugin: registration, choice, dtypes, devices and DLPack sharing.

Attention parity on torch runs in the backend-parametrized suites (test_attention,
test_cache, test_model); this file covers what is specific to torch.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed (pip install 'gqakv[test]')")

import gqakv  # noqa: E402
from gqakv_backends.torch_backend import TorchBackend  # noqa: E402

from .support.reference import reference_attention  # noqa: E402


def test_registered_through_entry_point_below_numpy(monkeypatch):
    monkeypatch.delenv("GQAKV_BACKEND", raising=False)
    backend = gqakv.get_backend("torch")
    assert isinstance(backend, TorchBackend) and backend.unavailable_reason() is None
    names = [b.name for b in gqakv.list_backends()]
    assert names.index("numpy") < names.index("torch")
    # On a CPU-only machine 'auto' keeps NumPy (a GPU backend may rank above both).
    assert gqakv.get_backend(None).name != "torch"


def test_importing_gqakv_does_not_import_torch():
    code = "import sys, gqakv; gqakv.KVCache(1, 1, 4, 2); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unavailable_reason_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    assert "torch: not installed" in TorchBackend().unavailable_reason()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when CUDA is absent")
def test_cuda_device_unavailable_reason():
    why = TorchBackend(device="cuda").unavailable_reason()
    assert "cuda" in why and "is_available() is False" in why
    with pytest.raises(gqakv.BackendError, match="is_available"):
        gqakv.KVCache(1, 1, 4, 2, backend=TorchBackend(device="cuda"))


def _ragged_run(backend, dtype):
    """Chunked ragged appends on torch; returns per-call (out, q, k_rows, v_rows, n_new)."""
    rng = np.random.default_rng(4)
    B, Hkv, G, d = 3, 2, 3, 16
    cache = gqakv.KVCache(B, Hkv, 32, d, dtype=dtype, backend=backend)
    results = []
    for n_new in ([5, 0, 3], [1, 4, 2], [2, 2, 0]):
        T = max(n_new)
        k, v = rng.standard_normal((2, B, Hkv, T, d))
        q = rng.standard_normal((B, Hkv * G, T, d))
        cache.append(backend.from_numpy(k, dtype), backend.from_numpy(v, dtype), n_new)
        out = gqakv.gqa_attention(backend.from_numpy(q, dtype), cache, n_new)
        k_rows = [backend.to_numpy(cache.live_kv(b)[0]).astype(np.float64) for b in range(B)]
        v_rows = [backend.to_numpy(cache.live_kv(b)[1]).astype(np.float64) for b in range(B)]
        q_rounded = backend.to_numpy(backend.from_numpy(q, dtype)).astype(np.float64)
        results.append((backend.to_numpy(out).astype(np.float64), q_rounded, k_rows, v_rows, n_new))
    return results


@pytest.mark.parametrize("dtype, atol", [("float64", 1e-12), ("float32", 2e-6),
                                         ("float16", 2e-3), ("bfloat16", 1.6e-2)])
def test_ragged_chunks_match_reference(dtype, atol):
    """atol: about 2 units in the last place of an O(1) output in each dtype."""
    for out, q, k_rows, v_rows, n_new in _ragged_run(gqakv.get_backend("torch"), dtype):
        want, _ = reference_attention(q, k_rows, v_rows, n_new)
        np.testing.assert_allclose(out, want, rtol=0, atol=atol)


def test_bfloat16_round_trip_is_exact():
    import ml_dtypes

    backend = gqakv.get_backend("torch")
    a = np.random.default_rng(0).standard_normal((3, 5)).astype(ml_dtypes.bfloat16)
    t = backend.from_numpy(a, "bfloat16")
    assert t.dtype == torch.bfloat16
    back = backend.to_numpy(t)
    assert back.dtype == a.dtype and np.array_equal(back.view(np.int16), a.view(np.int16))


def test_from_numpy_copies():
    backend = gqakv.get_backend("torch")
    a = np.zeros(4, dtype=np.float32)
    t = backend.from_numpy(a, "float32")
    a[0] = 7
    assert float(t[0]) == 0.0


def test_dlpack_shares_the_cache_buffer_with_numpy():
    """A torch cache viewed from NumPy through DLPack sees in-place appends: no copies."""
    cache = gqakv.KVCache(2, 1, 8, 4, dtype="float32", backend="torch")
    k_np = np.from_dlpack(cache.k)
    assert k_np.ctypes.data == cache.k.data_ptr()
    k = torch.ones(2, 1, 3, 4)
    cache.append(k, 2 * k, [3, 1])
    assert (k_np[0, 0, :3] == 1).all() and (k_np[1, 0, :1] == 1).all()

    host = np.arange(6, dtype=np.float32)
    t = TorchBackend.from_dlpack(host)
    assert t.data_ptr() == host.ctypes.data
    host[2] = -1
    assert float(t[2]) == -1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch here")
def test_cuda_cache_matches_cpu():
    cpu = _ragged_run(gqakv.get_backend("torch"), "float32")
    gpu = _ragged_run(TorchBackend(device="cuda"), "float32")
    for (a, *_), (b, *_) in zip(cpu, gpu):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch here")
def test_dlpack_shares_cuda_memory_with_cupy():
    cupy = pytest.importorskip("cupy", reason="cupy not installed")
    cache = gqakv.KVCache(1, 1, 8, 4, dtype="float32", backend=TorchBackend(device="cuda"))
    k_cp = cupy.from_dlpack(cache.k)
    assert k_cp.data.ptr == cache.k.data_ptr()
    cache.append(torch.ones(1, 1, 2, 4, device="cuda"), torch.ones(1, 1, 2, 4, device="cuda"), [2])
    assert float(k_cp[0, 0, :2].sum()) == 8.0
    back = torch.from_dlpack(k_cp)
    assert back.data_ptr() == cache.k.data_ptr()


def test_appending_tensors_that_require_grad_keeps_the_cache_out_of_autograd():
    """The cache stores values: a k_new with requires_grad must not chain a graph onto the
    buffer (it would grow with every step and keep every step's tensors alive)."""
    cache = gqakv.KVCache(2, 2, 8, 4, backend="torch")
    for step in range(3):
        k = torch.randn(2, 2, 1, 4, requires_grad=True)
        cache.append(k * 2, k * 3, [1, 1])
        assert not cache.k.requires_grad and cache.k.grad_fn is None
        assert not cache.v.requires_grad and cache.v.grad_fn is None
    np.testing.assert_array_equal(cache.host_lens, [3, 3])
    cache.reorder([1, 0])
    assert not cache.k.requires_grad and cache.k.grad_fn is None
    # attention stays differentiable in q (the cache is a constant to it)
    q = torch.randn(2, 4, 1, 4, requires_grad=True)
    gqakv.gqa_attention(q, cache, [1, 1]).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and torch.count_nonzero(q.grad) > 0
