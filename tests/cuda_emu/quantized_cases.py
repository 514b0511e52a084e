"""Emulated scenarios over a quantized (int8 / float8_e4m3fn) cache, driven exactly as the
cupy backend drives the kernels (cases.py's conventions: NaN in every slot not written,
NaN padding, poisoned bytes under AddressSanitizer).

Each step appends through ``gqakv_write_kv_quantized`` (codes and scales must equal
``gqakv.storage.quantize.quantize`` bit for bit, hard tokens included: an all-zero token, a tiny
one, a huge value token), then runs attention (decode, split decode + merge, chunked prefill) over
the codes and scales, checked against the float64 reference on the dequantized values
with cases.py's tolerance (2x the output dtype's rounding + fp32 accumulation). Under
``poison`` the scales' dead slots are poisoned like the codes'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gqakv.storage import quantize as Q
from gqakv_backends.cupy_backend import plan as planmod

from . import cases as _cases


@dataclass(frozen=True)
class QuantCase(_cases.Case):
    kv_dtype: str = "int8"
    params: tuple = ()  # extra AttentionParams fields (window, softcap, sinks)


def _scale_ranges(a: np.ndarray, row: int, head: int, t0: int, t1: int) -> tuple[int, int]:
    """Byte range of a[row, head, t0:t1] in the contiguous scale array a [R, H, S]."""
    return ((row * a.shape[1] + head) * a.shape[2] + t0) * a.itemsize, (t1 - t0) * a.itemsize


def _hard_tokens(x: np.ndarray, dtype: str, values: bool) -> None:
    """In place, on entry 0: an all-zero token, a tiny one and, for values in 16-bit
    dtypes, a huge one (a huge key would put the lse, and a huge float32 value the fp32
    accumulation, beyond these absolute tolerances; test_cupy_quantized_emulated.py
    bounds those against the unquantized kernels' own error)."""
    T = x.shape[2]
    x[0, 0, 0] = 0.0
    if T >= 2:
        x[0, -1, 1] *= 1e-4 if dtype == "float16" else 1e-35
    if T >= 3 and values and dtype != "float32":
        x[0, 0, 2] *= 2e3 if dtype == "float16" else 1e30


def run_quantized_case(emu, case: QuantCase, poison: bool = False) -> dict:
    """Run the scenario on the emulator; AssertionError on any mismatch. Returns stats."""
    from gqakv.core import semantics

    rng = np.random.default_rng(case.seed)
    st = _cases.STORAGE[case.dtype]
    D, Hkv, G = case.head_dim, case.kv_heads, case.group
    Hq = Hkv * G
    B = len(case.steps[0])
    R = case.cache_rows or B
    rows = np.array(case.rows if case.rows is not None else range(B), dtype=np.int64)
    code_dtype = np.int8 if case.kv_dtype == "int8" else np.uint8
    k_buf = np.full((R, Hkv, case.max_len, D), 0x55, dtype=code_dtype)  # garbage codes
    v_buf = np.full_like(k_buf, 0x55)
    k_scale = np.full((R, Hkv, case.max_len), np.nan, dtype=np.float32)
    v_scale = np.full_like(k_scale, np.nan)
    lens_rows = np.zeros(R, dtype=np.int64)
    stats = {"steps": 0, "splits": 0, "kernels": set(), "max_out_err": 0.0, "max_out_tol": 0.0,
             "max_lse_err": 0.0, "nan_queries": 0, "nan_outputs": 0}
    strides = _cases._element_strides
    for step, n in enumerate(case.steps):
        n_new = np.array(n, dtype=np.int64)
        T = int(n_new.max()) + case.pad
        starts = lens_rows[rows].copy()
        k_new = rng.standard_normal((B, Hkv, T, D))
        v_new = rng.standard_normal((B, Hkv, T, D))
        _hard_tokens(k_new, case.dtype, values=False)
        _hard_tokens(v_new, case.dtype, values=True)
        k_new, v_new = k_new.astype(st), v_new.astype(st)
        for b in range(B):
            k_new[b, :, n_new[b]:] = np.nan
            v_new[b, :, n_new[b]:] = np.nan
        expect = [a.copy() for a in (k_buf, v_buf, k_scale, v_scale)]
        for b in range(B):
            s, m = int(starts[b]), int(n_new[b])
            for (codes, scales), x in zip(((expect[0], expect[2]), (expect[1], expect[3])), (k_new, v_new)):
                c, sc = Q.quantize(np, x[b, :, :m].astype(np.float32), case.kv_dtype)
                codes[rows[b], :, s:s + m] = c.view(code_dtype)
                scales[rows[b], :, s:s + m] = sc
        wplan = planmod.plan_write_kv(case.dtype, D, n_new, Hkv, T, strides(k_new)[:3],
                                      strides(k_buf)[:3], kv_dtype=case.kv_dtype,
                                      scale_strides=strides(k_scale)[:3])
        bufs = {"k_new": k_new, "v_new": v_new, "k_buf": k_buf, "v_buf": v_buf,
                "k_scale": k_scale, "v_scale": v_scale, "rows": rows, "starts": starts, "n_new": n_new}
        wpoison = None
        if poison:
            targets = {int(rows[b]): (int(starts[b]), int(starts[b] + n_new[b])) for b in range(B)}
            code_r, scale_r = [], []
            for r in range(R):
                s, e = targets.get(r, (0, 0))
                for h in range(Hkv):
                    code_r += [_cases._token_ranges(k_buf, r, h, 0, s),
                               _cases._token_ranges(k_buf, r, h, e, case.max_len)]
                    scale_r += [_scale_ranges(k_scale, r, h, 0, s), _scale_ranges(k_scale, r, h, e, case.max_len)]
            new_r = [_cases._token_ranges(k_new, b, h, int(n_new[b]), T) for b in range(B) for h in range(Hkv)]
            wpoison = {"k_buf": code_r, "v_buf": code_r, "k_scale": scale_r, "v_scale": scale_r,
                       "k_new": new_r, "v_new": new_r}
        emu.run(wplan, bufs, poison=wpoison)
        for got, want, what in zip((k_buf, v_buf, k_scale, v_scale), expect,
                                   ("K codes", "V codes", "K scales", "V scales")):
            assert got.tobytes() == want.tobytes(), f"{case.name} step {step}: {what} differ from gqakv.storage.quantize"
        stats["kernels"].update(l.name for l in wplan.launches)
        lens_rows[rows] = starts + n_new

        lens = lens_rows[rows]
        q = rng.standard_normal((B, Hq, T, D)).astype(st)
        for b in range(B):
            q[b, :, n_new[b]:] = np.nan
        out = np.zeros((B, Hq, T, D), dtype=st)
        lse = np.full((B, Hq, T), -np.inf, dtype=np.float32)
        scale = 1.0 / math.sqrt(D)
        extra = dict(case.params)
        params = semantics.AttentionParams(scale=scale, **extra)
        aplan = planmod.plan_attention(
            case.dtype, D, batch=B, kv_heads=Hkv, group=G, t_q=T, lens=lens, n_new=n_new,
            q_strides=strides(q)[:3], buf_strides=strides(k_buf)[:3],
            out_strides=strides(out)[:3], sm_count=case.sm_count,
            min_keys_per_split=case.min_keys_per_split, force_splits=case.force_splits,
            params=params, kv_dtype=case.kv_dtype)
        arrays = {"q": q, "k_buf": k_buf, "v_buf": v_buf, "k_scale": k_scale, "v_scale": v_scale,
                  "rows": rows, "lens": lens, "n_new": n_new, "out": out, "lse": lse}
        if params.sinks is not None:
            arrays["sinks"] = np.asarray(params.sinks, dtype=np.float32)
        apoison = None
        if poison:
            live = {int(rows[b]): int(lens[b]) for b in range(B)}
            code_r = [_cases._token_ranges(k_buf, r, h, live.get(r, 0), case.max_len)
                      for r in range(R) for h in range(Hkv)]
            scale_r = [_scale_ranges(k_scale, r, h, live.get(r, 0), case.max_len)
                       for r in range(R) for h in range(Hkv)]
            q_r = [_cases._token_ranges(q, b, h, int(n_new[b]), T) for b in range(B) for h in range(Hq)]
            apoison = {"k_buf": code_r, "v_buf": code_r, "k_scale": scale_r, "v_scale": scale_r,
                       "q": q_r, "out": q_r}
        emu.run(aplan, arrays, poison=apoison)
        stats["kernels"].update(l.name for l in aplan.launches)
        stats["splits"] = max(stats["splits"], aplan.num_splits)
        deq = [Q.dequantize(np, c, s, case.kv_dtype).astype(np.float64)
               for c, s in ((k_buf.view(code_dtype), k_scale), (v_buf.view(code_dtype), v_scale))]
        k_rows = [deq[0][rows[b], :, :lens[b]] for b in range(B)]
        v_rows = [deq[1][rows[b], :, :lens[b]] for b in range(B)]
        ref_out, ref_lse = _reference(q.astype(np.float64), k_rows, v_rows, n_new, params)
        _cases._check_out(case, step, out, lse, ref_out, ref_lse, n_new, stats)
        stats["steps"] += 1
    if case.expect_splits:
        assert stats["splits"] > 1, f"{case.name}: no step used split-KV"
    launched = {k.split("<")[0] for k in stats["kernels"]}
    for kernel in case.expect_kernels:
        assert kernel in launched, f"{case.name}: {kernel} was never launched ({sorted(launched)})"
    return stats


def _reference(q, k_rows, v_rows, n_new, params):
    """The float64 loop reference, with the variant's parameters when there are any."""
    return _cases.reference_attention(q, k_rows, v_rows, n_new, params.scale, window=params.window,
                                      softcap=params.softcap, sinks=params.sinks)


def quantized_cases() -> list[QuantCase]:
    """Quantized K/V through every kernel that reads it: decode (T = 1, small T, query
    tiles 4 and 8), split decode + merge, chunked prefill; int8 and e4m3; q in float32 /
    float16 / bfloat16; 8-byte code loads (d = 64, 128) and scalar ones (d = 20); rows
    indirection; a variant (window + softcap + sinks)."""
    base = ((9, 0, 13), (1, 1, 1), (3, 2, 0), (1, 1, 1))
    return [
        QuantCase("quant-int8-bfloat16-G4-d64", "bfloat16", 64, 2, 4, base, kv_dtype="int8",
                  expect_kernels=("gqakv_write_kv_quantized", "gqakv_decode", "gqakv_prefill"), seed=61),
        QuantCase("quant-e4m3-float32-G3-d20", "float32", 20, 2, 3, base, kv_dtype="float8_e4m3fn",
                  cache_rows=4, rows=(3, 0, 1), seed=62),
        QuantCase("quant-split-e4m3-float16-G5-d128", "float16", 128, 1, 5,
                  ((150, 77), (1, 1), (2, 1)), max_len=160, pad=0, sm_count=2,
                  min_keys_per_split=8, expect_splits=True, kv_dtype="float8_e4m3fn",
                  expect_kernels=("gqakv_decode", "gqakv_merge"), seed=63),
        QuantCase("quant-split-int8-float32-G4-d64", "float32", 64, 1, 4, ((70, 33), (1, 1), (1, 0)),
                  max_len=80, pad=0, force_splits=3, expect_splits=True, kv_dtype="int8",
                  expect_kernels=("gqakv_decode", "gqakv_merge"), seed=64),
        QuantCase("quant-variant-int8-bfloat16-G4-d64", "bfloat16", 64, 2, 4, ((20, 5), (1, 1), (3, 2)),
                  kv_dtype="int8", params=(("window", 6), ("softcap", 5.0), ("sinks", (0.5,) * 8)),
                  seed=65),
    ]
