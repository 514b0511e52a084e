"""The emulated tensor-core instruction and the tensor-core prefill's wiring.

1. The CPU emulator's ``mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32``
   (tests/cuda_emu/cuda_emu.h), through the kernels' own ``mma_m16n8k16`` (kernels/mma.cuh):
   fragments are filled here from known matrices with the layout of the PTX ISA, section
   9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with floating point type" (stated once more
   below, in Python), and D is compared with NumPy's A @ B + C. This checks that the
   emulator and this statement of the documented layout agree; it cannot show that the
   hardware follows the document (no GPU here).
2. The planner sends float16 / bfloat16 prefill with head_dim % 16 == 0 to
   gqakv_prefill_mma and everything else to the fp32-FMA gqakv_prefill.
3. The non-emulated source really issues the mma instruction (NVRTC to PTX, both dtypes).

The kernel's results against the float64 reference (several query blocks and key tiles,
G 1/3/4/8, ragged rows, padding, NaN tails, rows indirection, also under AddressSanitizer)
are scenarios of tests/cuda_emu/cases.py, run by tests/test_cupy_emulated.py.
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from gqakv_backends.cupy_backend import plan as planmod
from gqakv_backends.cupy_backend import sources

from .cuda_emu import cases, harness
from .support import hot_ops

STORAGE = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
CTYPE = {"float16": "gqakv_half", "bfloat16": "gqakv_bf16"}


# ---- the documented layout (PTX ISA 9.7.14.5.8, figures 79, 81, 83) -----------------------
# groupID = laneid >> 2, threadID_in_group = laneid % 4; 16-bit elements two per 32-bit
# register, "low to high": element i sits in register i // 2, half i % 2.

def a_coord(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of A element a_i (i = 0..7) held by ``lane``; A is 16 x 16, row-major."""
    group, tig = lane >> 2, lane % 4
    row = group if (i < 2 or 4 <= i < 6) else group + 8
    col = tig * 2 + (i & 1) if i < 4 else tig * 2 + (i & 1) + 8
    return row, col


def b_coord(lane: int, i: int) -> tuple[int, int]:
    """(row, col) = (k, n) of B element b_i (i = 0..3) held by ``lane``; B is 16 x 8."""
    group, tig = lane >> 2, lane % 4
    row = tig * 2 + (i & 1) if i < 2 else tig * 2 + (i & 1) + 8
    return row, group


def c_coord(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of C/D element c_i (i = 0..3) held by ``lane``; C is 16 x 8 fp32."""
    group, tig = lane >> 2, lane % 4
    return (group if i < 2 else group + 8), tig * 2 + (i & 1)


def pack_fragments(m: np.ndarray, coord, n_elems: int) -> np.ndarray:
    """[32, n_elems // 2] uint32 registers of the 16-bit matrix m, per lane."""
    bits = m.view(np.uint16)
    regs = np.zeros((32, n_elems // 2), dtype=np.uint32)
    for lane in range(32):
        for i in range(n_elems):
            regs[lane, i // 2] |= np.uint32(bits[coord(lane, i)]) << np.uint32(16 * (i % 2))
    return regs


@pytest.fixture(scope="module")
def emulator():
    if harness.compiler() is None:
        pytest.skip("no C++ compiler (g++) for the CUDA emulation harness")
    return harness.Emulator(harness.build(asan=False))


def run_mma(emulator, dtype, a_regs, b_regs, c_frag) -> np.ndarray:
    """One warp of emu_mma_selftest<T>: returns the [32, 4] D fragments."""
    d = np.full((32, 4), np.nan, dtype=np.float32)
    launch = planmod.Launch("emu_mma_selftest", f"emu_mma_selftest<{CTYPE[dtype]}>", (1, 1, 1),
                            (32, 1, 1), (planmod.Buf("a"), planmod.Buf("b"), planmod.Buf("c"),
                                         planmod.Buf("d")))
    emulator.run(planmod.Plan(launches=[launch]),
                 {"a": a_regs, "b": b_regs, "c": c_frag.astype(np.float32), "d": d})
    return d


def unpack_d(d: np.ndarray) -> np.ndarray:
    out = np.full((16, 8), np.nan)
    for lane in range(32):
        for i in range(4):
            out[c_coord(lane, i)] = d[lane, i]
    return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_emulated_mma_matches_numpy(emulator, dtype, seed):
    rng = np.random.default_rng(seed)
    st = STORAGE[dtype]
    A = rng.standard_normal((16, 16)).astype(st)
    B = rng.standard_normal((16, 8)).astype(st)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    c_frag = np.array([[C[c_coord(lane, i)] for i in range(4)] for lane in range(32)])
    d = run_mma(emulator, dtype, pack_fragments(A, a_coord, 8), pack_fragments(B, b_coord, 4), c_frag)
    expected = A.astype(np.float64) @ B.astype(np.float64) + C.astype(np.float64)
    got = unpack_d(d)
    # Exact 16-bit products, one final rounding to fp32 in the emulator.
    np.testing.assert_allclose(got, expected, rtol=2e-7, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_emulated_mma_places_every_element(emulator, dtype):
    """One-hot A and B: D[r][c] = 1 exactly where A's 1 (row r, col k) meets B's 1 (row k,
    col c), so each element must come from exactly the documented lane and register."""
    st = STORAGE[dtype]
    for r, k, c in ((0, 0, 0), (9, 3, 5), (15, 12, 7), (8, 15, 1), (3, 8, 6)):
        A = np.zeros((16, 16), dtype=st)
        B = np.zeros((16, 8), dtype=st)
        A[r, k], B[k, c] = 1, 1
        got = unpack_d(run_mma(emulator, dtype, pack_fragments(A, a_coord, 8),
                               pack_fragments(B, b_coord, 4), np.zeros((32, 4))))
        want = np.zeros((16, 8))
        want[r, c] = 1
        assert np.array_equal(got, want), (r, k, c)


def test_wrong_layout_is_detected(emulator):
    """The check can fail: B fragments laid out as if B were row-major (k = groupID) give a
    different D."""
    rng = np.random.default_rng(3)
    A = rng.standard_normal((16, 16)).astype(np.float16)
    B = rng.standard_normal((16, 8)).astype(np.float16)

    def b_rowmajor(lane, i):
        return lane >> 2 if i < 2 else (lane >> 2) + 8, (lane % 4) * 2 + (i & 1)

    d = run_mma(emulator, "float16", pack_fragments(A, a_coord, 8),
                pack_fragments(B, b_rowmajor, 4), np.zeros((32, 4)))
    expected = A.astype(np.float64) @ B.astype(np.float64)
    assert not np.allclose(unpack_d(d), expected, atol=1e-3)


def test_planner_picks_tensor_cores_for_16_bit_multiples_of_16():
    kw = dict(batch=2, kv_heads=2, group=4, t_q=20, lens=np.array([30, 20]), n_new=np.array([20, 7]),
              scale=0.1, sm_count=132)
    for dtype, d, kernel in (("float16", 64, "gqakv_prefill_mma"), ("bfloat16", 128, "gqakv_prefill_mma"),
                             ("bfloat16", 256, "gqakv_prefill_mma"), ("float16", 48, "gqakv_prefill_mma"),
                             ("float32", 64, "gqakv_prefill"), ("float16", 20, "gqakv_prefill"),
                             ("bfloat16", 72, "gqakv_prefill")):
        strides = (8 * 20 * d, 20 * d, d)
        p = planmod.plan_attention(dtype, d, q_strides=strides, buf_strides=(2 * 64 * d, 64 * d, d),
                                   out_strides=strides, **kw)
        (launch,) = p.launches
        assert launch.kernel == kernel, (dtype, d)
        assert launch.name == f"{kernel}<{sources.CTYPES[dtype]}, {d}>"
        rows = planmod.prefill_rows(d, kernel)
        gc = min(4, rows)
        assert launch.grid == (2 * 2 * -(-4 // gc), -(-20 // (rows // gc)), 1)
    with pytest.raises(KeyError, match="head_dim=72"):
        sources.name_expression("gqakv_prefill_mma", "bfloat16", 72)
    with pytest.raises(KeyError, match="float32"):
        sources.name_expression("gqakv_prefill_mma", "float32", 64)
    assert sources.instantiations("gqakv_prefill_mma", "float32", 64) == []


def test_prefill_scenarios_reach_the_tensor_core_kernel():
    """The emulated scenarios include prefill steps planned onto gqakv_prefill_mma for both
    16-bit dtypes, with several query blocks and key tiles (so the tile loop is exercised)."""
    seen = set()
    for case in cases.all_cases():
        if not isinstance(case, cases.Case) or not sources.prefill_mma_supported(case.dtype, case.head_dim):
            continue
        for n in case.steps:
            if max(n) + case.pad > planmod.DECODE_MAX_T:
                seen.add(case.dtype)
    assert seen == {"float16", "bfloat16"}


def _ptx(kernel: str, dtype: str, head_dim: int, arch: str) -> str:
    nvrtc_mod = pytest.importorskip("gqakv_backends.cupy_backend.nvrtc")
    try:
        nv = nvrtc_mod.Nvrtc()
    except (nvrtc_mod.NvrtcError, OSError) as exc:
        pytest.skip(f"NVRTC not available: {exc}")
    c, lib = ctypes, nv.lib
    prog = c.c_void_p()
    src = sources.compose_source(kernel).encode()
    assert lib.nvrtcCreateProgram(c.byref(prog), src, b"k.cu", 0, None, None) == 0
    try:
        name = sources.name_expression(kernel, dtype, head_dim).encode()
        assert lib.nvrtcAddNameExpression(prog, name) == 0
        opts = [o.encode() for o in (*sources.COMPILE_OPTIONS, f"--gpu-architecture={arch}")]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (c.c_char_p * len(opts))(*opts))
        assert rc == 0, nv._log(prog)
        size = c.c_size_t()
        assert lib.nvrtcGetPTXSize(prog, c.byref(size)) == 0
        buf = c.create_string_buffer(size.value)
        assert lib.nvrtcGetPTX(prog, buf) == 0
        return buf.value.decode()
    finally:
        lib.nvrtcDestroyProgram(c.byref(prog))


@pytest.mark.parametrize("dtype,ptx_type", [("float16", "f16"), ("bfloat16", "bf16")])
def test_compiled_kernel_issues_the_mma(dtype, ptx_type):
    ptx = _ptx("gqakv_prefill_mma", dtype, 128, "compute_80")
    instr = f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32"
    # Q K^T: 8 k-steps x 4 n-tiles, P V: 2 k-steps x 16 n-tiles (BK = 32 at d = 128), unrolled.
    assert ptx.count(instr) == 8 * 4 + 2 * 16, ptx.count(instr)


def test_devices_without_tensor_cores_keep_the_fma_prefill():
    kw = dict(batch=1, kv_heads=1, group=2, t_q=9, lens=np.array([9]), n_new=np.array([9]),
              scale=0.1, q_strides=(2 * 9 * 64, 9 * 64, 64), buf_strides=(16 * 64, 16 * 64, 64),
              out_strides=(2 * 9 * 64, 9 * 64, 64), sm_count=80)
    assert planmod.plan_attention("bfloat16", 64, **kw).launches[0].kernel == "gqakv_prefill_mma"
    (launch,) = planmod.plan_attention("bfloat16", 64, tensor_cores=False, **kw).launches
    assert launch.kernel == "gqakv_prefill" and launch.name == "gqakv_prefill<gqakv_bf16, 64>"


@pytest.mark.parametrize("capability,expected", [("90", True), ("80", True), ("75", False)])
def test_backend_passes_the_device_compute_capability(monkeypatch, capability, expected):
    """CupyBackend plans with tensor_cores from the current device's compute capability."""
    import math

    from gqakv_backends import cupy_backend

    from .cuda_emu.emulated_backend import EmulatedCupyBackend, EmulatedDevice
    from .support.reference import reference_attention

    seen = []
    real = planmod.plan_attention

    def recording(*args, **kwargs):
        seen.append(kwargs.get("tensor_cores"))
        return real(*args, **kwargs)

    monkeypatch.setattr(EmulatedDevice, "compute_capability", capability)
    monkeypatch.setattr(cupy_backend._plan, "plan_attention", recording)
    backend = EmulatedCupyBackend()
    rng = np.random.default_rng(4)
    D, n = 64, np.array([7])
    k_buf, v_buf = backend.empty((1, 1, 16, D), "float16"), backend.empty((1, 1, 16, D), "float16")
    kv = [backend.from_numpy(rng.standard_normal((1, 1, 7, D)), "float16") for _ in range(2)]
    hot_ops.write_kv(backend, k_buf, v_buf, kv[0], kv[1], np.array([0]), np.array([0]), n)
    q = backend.from_numpy(rng.standard_normal((1, 2, 7, D)), "float16")
    out = hot_ops.attention(backend, q, k_buf, v_buf, np.array([0]), n, n,
                            scale=1 / math.sqrt(D), return_lse=False)
    out = out[0] if isinstance(out, tuple) else out
    assert seen == [expected]
    ref, _ = reference_attention(q.astype(np.float64), [k_buf[0, :, :7]], [v_buf[0, :, :7]], n)
    rounding = np.abs(ref.astype(np.float16).astype(np.float64) - ref).max()
    assert np.abs(np.asarray(out, dtype=np.float64) - ref).max() <= 2 * rounding + cases.ACC_ATOL
