"""The attention variants (sliding window, soft-cap, sinks, ALiBi) in the CUDA kernels, emulated.

Each kernel family is one template composed with the variant trait (kernels/variant.cuh:
compile-time flags window 1, softcap 2, sinks 4, alibi 8); the planner picks the flags from the
call's ``AttentionParams`` (plan.variant_flags) and starts decode splits and prefill key
tiles at the window (semantics.keys_read / block_keys). Every scenario runs the plan the
backend builds on the CPU emulator (tests/cuda_emu) and is compared with the independent
float64 loop reference (tests/support/reference.py, which takes window=, softcap=, sinks=,
alibi_slopes=) with
the suite's rule (tests/cuda_emu/cases._check_out): out within 2 x the reference's rounding
to the dtype + 2e-6, lse within 1e-5, padded queries exactly 0 / -inf, no NaN anywhere.

Covered: decode (fp32 FMA and tensor-core), split decode + merge (splits start at the
window; the sink joins once in the merge), small-T decode whose queries see different
windows, both chunked prefills; float32 / float16 / bfloat16; d = 64 and 20; W = 1, W
larger than every row, W smaller than the chunk; a tiny soft-cap (tanh saturates); sinks
large, -inf and mixed; ALiBi slopes BLOOM's (powers of two) and mixed (negative and 0
among them), alone and with every other feature; ragged rows with padding and an idle entry.
"""

from __future__ import annotations

import numpy as np
import pytest

from gqakv.core import semantics

from .cuda_emu import harness

if harness.compiler() is None:
    pytest.skip("no C++ compiler (g++) for the CUDA emulation harness", allow_module_level=True)

from gqakv_backends.cupy_backend import plan as planmod  # noqa: E402

from .cuda_emu.plans import run_variant, variant_params  # noqa: E402


@pytest.fixture(scope="module")
def emulator():
    return harness.Emulator(harness.build(asan=False))


DTYPES = ("float32", "float16", "bfloat16")
# (window, softcap, sinks[, alibi]): each feature alone, the pairs and all three; W = 1, W
# larger than every row, tiny soft-caps where tanh saturates, large / -inf / mixed sinks;
# ALiBi alone and with all three (the flag sets built: 8 and 15).
VARIANTS = [
    (1, None, None), (5, None, None), (1000, None, None), (None, 0.001, None), (None, 3.0, None),
    (None, None, "large"), (None, None, "-inf"), (None, None, "mixed"), (7, 2.0, None),
    (4, None, "mixed"), (None, 0.5, "mixed"), (3, 1.5, "mixed"), (1, 1e-3, "large"),
    (None, None, None, "bloom"), (None, None, None, "mixed"), (5, 2.0, "mixed", "bloom"),
    (1, 1e-3, "large", "mixed"),
]
VIDS = [f"W{v[0]}-c{v[1]}-s{v[2]}" + (f"-alibi{v[3]}" if len(v) > 3 else "") for v in VARIANTS]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS, ids=VIDS)
def test_decode_variants(emulator, dtype, variant):
    """T = 1 decode, one CTA per (row, KV head): ragged rows, an idle entry, padding."""
    d, Hkv, G = 64, 2, 4
    params = variant_params(d, Hkv * G, *variant)
    plan = run_variant(emulator, dtype=dtype, d=d, kv_heads=Hkv, group=G, lens=[37, 9, 20],
                       n_new=[1, 1, 0], params=params, seed=VARIANTS.index(variant))
    assert plan.launches[0].name.endswith(f", {planmod.variant_flags(params)}>") or not params.features


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", [(6, None, "mixed"), (1, 2.0, "large"), (1000, None, "-inf"),
                                     (None, 0.01, "mixed"), (13, None, None),
                                     (None, None, None, "bloom"), (6, 2.0, "mixed", "mixed")],
                         ids=["W6-sinks", "W1-cap-sinks", "Wbig-sinks-inf", "cap-sinks", "W13",
                              "alibi", "W6-cap-sinks-alibi"])
def test_split_decode_variants(emulator, dtype, variant):
    """Split decode + merge: splits start at each row's window (a row's splits past its
    keys write lse -inf, the merge reads the planner's layout) and the sink joins once,
    in the merge; also small T = 3, where queries of one row see different windows."""
    d, Hkv, G = 64, 1, 4
    params = variant_params(d, Hkv * G, *variant)
    for T, lens, n in ((1, [70, 12, 41], [1, 1, 1]), (3, [50, 3, 29], [3, 2, 3])):
        plan = run_variant(emulator, dtype=dtype, d=d, kv_heads=Hkv, group=G, lens=lens, n_new=n,
                           params=params, force_splits=4, seed=T)
        keys = semantics.keys_read(params, np.array(lens), np.array(n))
        assert plan.num_splits * plan.keys_per_split >= keys.max()  # sized by the window's span
        if keys.max() < 4:  # W = 1, T = 1: one key per row, nothing to split
            continue
        assert plan.num_splits > 1 and plan.launches[-1].kernel == "gqakv_merge"
        if params.sinks is not None:
            assert plan.launches[-1].name.endswith(", 4>")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", [(1, None, None), (7, None, None), (1000, 0.001, None),
                                     (None, 2.0, "mixed"), (5, 1.0, "large"), (3, None, "-inf"),
                                     (None, None, None, "bloom"), (5, 1.0, "large", "mixed")],
                         ids=["W1", "W7", "Wbig-tinycap", "cap-sinks", "W5-cap-sinks", "W3-sinks-inf",
                              "alibi", "W5-cap-sinks-alibi"])
@pytest.mark.parametrize("tensor_cores", [True, False], ids=["mma", "fma"])
def test_prefill_variants(emulator, dtype, variant, tensor_cores):
    """Chunked prefill (W smaller than the chunk of 21 tokens), ragged rows with padding;
    the tensor-core prefill for 16-bit dtypes and the fp32-FMA one."""
    if tensor_cores and dtype == "float32":
        pytest.skip("float32 has only the fp32-FMA prefill")
    d, Hkv, G = 64, 2, 2
    params = variant_params(d, Hkv * G, *variant)
    plan = run_variant(emulator, dtype=dtype, d=d, kv_heads=Hkv, group=G, lens=[30, 21, 8],
                       n_new=[21, 9, 0], params=params, tensor_cores=tensor_cores, seed=3)
    want = "gqakv_prefill_mma" if tensor_cores else "gqakv_prefill"
    assert plan.launches[0].kernel == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_variants_scalar_head_dim(emulator, dtype):
    """d = 20 (scalar loads; the fp32-FMA kernels for every dtype): decode, split decode
    and prefill with window, soft-cap and sinks on, without and with ALiBi."""
    d, Hkv, G = 20, 1, 3
    for alibi in (None, "mixed"):
        params = variant_params(d, Hkv * G, 4, 1.5, "mixed", alibi)
        run_variant(emulator, dtype=dtype, d=d, kv_heads=Hkv, group=G, lens=[19, 6], n_new=[1, 1],
                    params=params)
        run_variant(emulator, dtype=dtype, d=d, kv_heads=Hkv, group=G, lens=[40, 6], n_new=[1, 1],
                    params=params, force_splits=3)
        run_variant(emulator, dtype=dtype, d=d, kv_heads=Hkv, group=G, lens=[25, 6], n_new=[12, 6],
                    params=params)


def test_window_reads_only_the_window():
    """Work follows the window: a 100,000-token row decoded with W = 4,096 is planned over
    4,096 keys (the split planner sizes splits by semantics.keys_read)."""
    params = semantics.AttentionParams(scale=0.125, window=4096)
    lens, n = np.array([100_000]), np.array([1])
    plan = planmod.plan_attention("bfloat16", 128, batch=1, kv_heads=8, group=4, t_q=1, lens=lens,
                                  n_new=n, params=params, q_strides=(4096, 128, 128),
                                  buf_strides=(8 * 2**17 * 128, 2**17 * 128, 128),
                                  out_strides=(4096, 128, 128), sm_count=132)
    assert plan.num_splits * plan.keys_per_split < 4096 + plan.keys_per_split
    full = planmod.plan_attention("bfloat16", 128, batch=1, kv_heads=8, group=4, t_q=1, lens=lens,
                                  n_new=n, scale=0.125, q_strides=(4096, 128, 128),
                                  buf_strides=(8 * 2**17 * 128, 2**17 * 128, 128),
                                  out_strides=(4096, 128, 128), sm_count=132)
    assert full.num_splits * full.keys_per_split >= 100_000


# ---- AddressSanitizer: the keys before each row's window are never touched ----------------

#: (dtype, tensor_cores, force_splits, lens, n_new, (window, softcap, sinks)) run under ASan:
#: decode, split decode + merge, both prefills, with windows that start inside the rows.
ASAN_SCENARIOS = [
    ("float16", True, None, [37, 9, 20], [1, 1, 0], (5, None, "mixed")),
    ("float32", False, None, [37, 9, 20], [1, 1, 0], (4, 0.5, None)),
    ("bfloat16", True, 3, [70, 12, 41], [1, 1, 1], (20, None, "large")),
    ("float32", False, None, [30, 21, 8], [21, 9, 0], (3, 1.5, "mixed")),
    ("bfloat16", True, None, [30, 21, 8], [21, 9, 0], (6, None, "mixed")),
    ("bfloat16", True, None, [37, 9, 20], [1, 1, 0], (None, None, None, "bloom")),
    ("float32", False, 3, [70, 12, 41], [1, 1, 1], (20, 1.0, "mixed", "mixed")),
    ("float16", True, None, [30, 21, 8], [21, 9, 0], (6, 2.0, "mixed", "bloom")),
]


def asan_main() -> int:
    """Run ASAN_SCENARIOS on the AddressSanitizer build with the out-of-window keys poisoned
    (started by the test below with LD_PRELOAD=libasan); prints 'N passed'."""
    emu = harness.Emulator(harness.build(asan=True))
    for i, (dtype, tc, splits, lens, n_new, variant) in enumerate(ASAN_SCENARIOS):
        d, Hkv, G = 64, 2, 2
        run_variant(emu, dtype=dtype, d=d, kv_heads=Hkv, group=G, lens=lens, n_new=n_new,
                    params=variant_params(d, Hkv * G, *variant), tensor_cores=tc, force_splits=splits,
                    seed=i, poison=True)
        print(f"ok {dtype} tc={tc} splits={splits} variant={variant}", flush=True)
    print(f"{len(ASAN_SCENARIOS)} passed")
    return 0


def test_variants_under_address_sanitizer():
    harness.check_asan_main("test_cupy_emulated_variants", len(ASAN_SCENARIOS))

