"""The cupy backend at the registry level, without a GPU: availability reasons, choice,
lazy import, packaged kernel sources, and the launch planner's decisions."""

from __future__ import annotations

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
    assert f"void __launch_bounds__(128" in src and kernel in src
    assert '#include "' not in src  # local includes inlined: NVRTC needs no include path
    assert "to_float" in src


def test_split_count_follows_live_lengths_and_sms():
    # One CTA, a 32k-token live row: split to fill 132 SMs twice, chunks >= 256 keys.
    splits, keys = plan.choose_splits(ctas=8, max_len=32768, sm_count=132)
    assert splits > 1 and keys >= plan.MIN_KEYS_PER_SPLIT and splits * keys >= 32768
    # Enough CTAs or short rows: no split.
    assert plan.choose_splits(ctas=512, max_len=32768, sm_count=132) == (1, 32768)
    assert plan.choose_splits(ctas=8, max_len=100, sm_count=132) == (1, 100)


def test_attention_plan_does_not_depend_on_capacity():
    kw = dict(batch=2, kv_heads=8, group=4, t_q=1, lens=np.array([3000, 10]),
              n_new=np.array([1, 1]), scale=0.1, q_strides=(32 * 128, 128, 128),
              out_strides=(32 * 128, 128, 128), sm_count=132)
    small = plan.plan_attention("bfloat16", 128, buf_strides=(8 * 4096 * 128, 4096 * 128, 128), **kw)
    large = plan.plan_attention("bfloat16", 128, buf_strides=(8 * 65536 * 128, 65536 * 128, 128), **kw)
    assert [l.grid for l in small.launches] == [l.grid for l in large.launches]
    assert small.num_splits > 1 and [l.kernel for l in small.launches] == ["gqakv_decode", "gqakv_merge"]


def test_plans_use_explicitly_typed_scalars():
    p = plan.plan_attention("float16", 64, batch=1, kv_heads=2, group=3, t_q=9,
                            lens=np.array([9]), n_new=np.array([9]), scale=0.125,
                            q_strides=(6 * 9 * 64, 9 * 64, 64), buf_strides=(2 * 16 * 64, 16 * 64, 64),
                            out_strides=(6 * 9 * 64, 9 * 64, 64), sm_count=132)
    (launch,) = p.launches
    assert launch.kernel == "gqakv_prefill"
    for a in launch.args:
        assert isinstance(a, (plan.Buf, np.int32, np.int64, np.float32)), a
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
    # Llama 3.1 8B decode (G = 4, T = 1): one tile-4 CTA per (row, KV head)
    p = plan.plan_attention("bfloat16", 128, batch=64, kv_heads=8, group=4, t_q=1,
                            lens=np.full(64, 4096), n_new=np.ones(64, dtype=np.int64), scale=0.1,
                            q_strides=(32 * 128, 128, 128), buf_strides=(8 * 8192 * 128, 8192 * 128, 128),
                            out_strides=(32 * 128, 128, 128), sm_count=132)
    (launch,) = p.launches
    assert launch.name == "gqakv_decode<gqakv_bf16, 128, 4>" and launch.grid == (64 * 8, 1, 1)
