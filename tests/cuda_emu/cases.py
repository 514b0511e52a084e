"""Scenarios that drive the emulated kernels exactly as the cupy backend would, and
check every result against the float64 loop reference (tests/support/reference.py).

A scenario is a cache (``cache_rows`` rows of ``max_len`` tokens, NaN everywhere it has
not been written) and a list of steps; each step appends ``n_new`` tokens per batch entry
(through the write_kv plan) and then runs attention for those tokens (decode plan for
T <= 4, chunked-prefill plan above; split-KV + merge when the plan chooses it). Padding
slots of k_new, v_new and q hold NaN; with ``poison=True`` (AddressSanitizer build) every
byte a kernel must not touch is poisoned: dead cache tails, rows no entry uses, padding
slots of the inputs, and for the append everything outside the slots being written.

A scenario may also put a NaN into a real query or a live K / V token (``nan_q``,
``nan_kv``): the reference then has NaN exactly where that NaN reaches (out and lse of
the queries that see a NaN score, out elements of those that weight a NaN value), and the
kernels must match that pattern (never 0 / -inf for a NaN) while everything else still
matches the reference.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from gqakv_backends.cupy_backend import plan as planmod

try:
    from ..support.reference import reference_attention  # imported as tests.cuda_emu.cases
except ImportError:  # run_cases.py: tests/ itself is on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support.reference import reference_attention  # noqa: E402

STORAGE = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
           "bfloat16": np.dtype(ml_dtypes.bfloat16)}
#: fp32 accumulation error allowed on top of the output's rounding (outputs are O(1)).
ACC_ATOL = 2e-6
#: fp32 error allowed in the natural-log LSE (values O(1..10)).
LSE_ATOL = 1e-5


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    head_dim: int
    kv_heads: int
    group: int
    steps: tuple[tuple[int, ...], ...]  # n_new per batch entry, per step
    max_len: int = 48
    cache_rows: int | None = None  # default: batch size
    rows: tuple[int, ...] | None = None  # entry -> cache row
    pad: int = 1  # padding slots beyond the longest n_new of a step
    sm_count: int = 132
    min_keys_per_split: int = planmod.MIN_KEYS_PER_SPLIT
    expect_splits: bool = False  # some decode step must use split-KV + merge
    force_splits: int | None = None  # decode steps cut in this many splits (short rows too)
    expect_kernels: tuple[str, ...] = ()  # kernels (names before '<') some step must launch
    seed: int = 0
    # One NaN element in a real query: (step, entry, query head, token < n_new).
    nan_q: tuple[tuple[int, int, int, int], ...] = ()
    # One NaN element in a new K or V token (live once appended, seen by every later step):
    # (step, "k" or "v", entry, KV head, token < n_new).
    nan_kv: tuple[tuple[int, str, int, int, int], ...] = ()


def _element_strides(a: np.ndarray) -> tuple[int, ...]:
    return tuple(s // a.itemsize for s in a.strides)


def _token_ranges(a: np.ndarray, row: int, head: int, t0: int, t1: int) -> tuple[int, int]:
    """Byte range of a[row, head, t0:t1, :] in the contiguous array a [R, H, S, d]."""
    off = ((row * a.shape[1] + head) * a.shape[2] + t0) * a.shape[3] * a.itemsize
    return off, (t1 - t0) * a.shape[3] * a.itemsize


def _check_out(case, step, out, lse, ref_out, ref_lse, n_new, stats):
    st = STORAGE[case.dtype]
    T = out.shape[2]
    pad = np.arange(T)[None, :] >= n_new[:, None]  # [B, T]
    pad_out = np.broadcast_to(pad[:, None, :, None], out.shape)
    pad_lse = np.broadcast_to(pad[:, None, :], lse.shape)
    out64 = out.astype(np.float64)
    # NaN exactly where the reference has it (a NaN query or live K / V reaching it; none
    # without nan_q / nan_kv): never hidden as 0 / -inf, never leaking to other queries.
    nan_out, nan_lse = np.isnan(ref_out), np.isnan(ref_lse)
    hidden = nan_out & ~np.isnan(out64)
    assert not hidden.any(), (f"{case.name} step {step}: NaN hidden at {np.argwhere(hidden)[:4].tolist()} "
                              f"(out {out64[hidden][:4].tolist()})")
    leaked = np.isnan(out64) & ~nan_out
    assert not leaked.any(), f"{case.name} step {step}: NaN in the output at {np.argwhere(leaked)[:4].tolist()}"
    assert np.array_equal(np.isnan(lse), nan_lse), (
        f"{case.name} step {step}: NaN lse at {np.argwhere(np.isnan(lse)).tolist()[:4]}, "
        f"reference at {np.argwhere(nan_lse).tolist()[:4]}")
    assert np.all(out64[pad_out] == 0.0), f"{case.name} step {step}: padded queries are not 0"
    assert np.all(np.isneginf(lse[pad_lse])), f"{case.name} step {step}: padded lse is not -inf"
    # (callers outside run_case pass a stats dict without the NaN counters)
    stats["nan_queries"] = stats.get("nan_queries", 0) + int(np.count_nonzero(nan_lse))
    stats["nan_outputs"] = stats.get("nan_outputs", 0) + int(np.count_nonzero(nan_out))
    real_out, real_lse = ~pad_out & ~nan_out, ~pad_lse & ~nan_lse
    if real_out.any():
        rounding = np.abs(ref_out.astype(st).astype(np.float64) - ref_out)[real_out].max()
        err = np.abs(out64 - ref_out)[real_out].max()
        tol = 2 * rounding + ACC_ATOL
        assert err <= tol, f"{case.name} step {step}: out error {err:.3g} > {tol:.3g}"
        stats["max_out_err"] = max(stats["max_out_err"], float(err))
        stats["max_out_tol"] = max(stats["max_out_tol"], float(tol))
    if real_lse.any():
        lerr = np.abs(lse.astype(np.float64)[real_lse] - ref_lse[real_lse]).max()
        assert lerr <= LSE_ATOL, f"{case.name} step {step}: lse error {lerr:.3g} > {LSE_ATOL}"
        stats["max_lse_err"] = max(stats["max_lse_err"], float(lerr))


def run_case(emu, case: Case, poison: bool = False) -> dict:
    """Run the scenario on the emulator; AssertionError on any mismatch. Returns stats."""
    rng = np.random.default_rng(case.seed)
    st = STORAGE[case.dtype]
    D, Hkv, G = case.head_dim, case.kv_heads, case.group
    Hq = Hkv * G
    B = len(case.steps[0])
    R = case.cache_rows or B
    rows = np.array(case.rows if case.rows is not None else range(B), dtype=np.int64)
    k_buf = np.full((R, Hkv, case.max_len, D), np.nan, dtype=st)
    v_buf = np.full_like(k_buf, np.nan)
    lens_rows = np.zeros(R, dtype=np.int64)
    stats = {"steps": 0, "splits": 0, "kernels": set(), "max_out_err": 0.0, "max_out_tol": 0.0,
             "max_lse_err": 0.0, "nan_queries": 0, "nan_outputs": 0}
    for step, n in enumerate(case.steps):
        n_new = np.array(n, dtype=np.int64)
        T = int(n_new.max()) + case.pad
        starts = lens_rows[rows].copy()
        k_new = rng.standard_normal((B, Hkv, T, D)).astype(st)
        v_new = rng.standard_normal((B, Hkv, T, D)).astype(st)
        for b in range(B):
            k_new[b, :, n_new[b]:] = np.nan
            v_new[b, :, n_new[b]:] = np.nan
        for s_, which, b, h, t in case.nan_kv:
            if s_ == step:
                assert t < n_new[b], f"{case.name}: NaN {which} at token {t} is not a new token"
                (k_new if which == "k" else v_new)[b, h, t, D // 2] = np.nan  # live once appended
        k_exp, v_exp = k_buf.copy(), v_buf.copy()
        for b in range(B):
            s, m = int(starts[b]), int(n_new[b])
            k_exp[rows[b], :, s:s + m] = k_new[b, :, :m]
            v_exp[rows[b], :, s:s + m] = v_new[b, :, :m]
        wplan = planmod.plan_write_kv(case.dtype, D, n_new, Hkv, T, _element_strides(k_new)[:3],
                                      _element_strides(k_buf)[:3])
        bufs = {"k_new": k_new, "v_new": v_new, "k_buf": k_buf, "v_buf": v_buf, "rows": rows,
                "starts": starts, "n_new": n_new}
        wpoison = None
        if poison:
            # Writes touch only [starts, starts + n) of each written row; inputs only t < n.
            targets = {int(rows[b]): (int(starts[b]), int(starts[b] + n_new[b])) for b in range(B)}
            buf_ranges = []
            for r in range(R):
                s, e = targets.get(r, (0, 0))
                for h in range(Hkv):
                    buf_ranges += [_token_ranges(k_buf, r, h, 0, s), _token_ranges(k_buf, r, h, e, case.max_len)]
            new_ranges = [_token_ranges(k_new, b, h, int(n_new[b]), T) for b in range(B) for h in range(Hkv)]
            wpoison = {"k_buf": buf_ranges, "v_buf": buf_ranges, "k_new": new_ranges, "v_new": new_ranges}
        emu.run(wplan, bufs, poison=wpoison)
        assert k_buf.tobytes() == k_exp.tobytes(), f"{case.name} step {step}: K cache differs after append"
        assert v_buf.tobytes() == v_exp.tobytes(), f"{case.name} step {step}: V cache differs after append"
        stats["kernels"].update(l.name for l in wplan.launches)
        lens_rows[rows] = starts + n_new

        lens = lens_rows[rows]
        q = rng.standard_normal((B, Hq, T, D)).astype(st)
        for b in range(B):
            q[b, :, n_new[b]:] = np.nan
        for s_, b, h, t in case.nan_q:
            if s_ == step:
                assert t < n_new[b], f"{case.name}: NaN query token {t} is a padding slot"
                q[b, h, t, D - 1] = np.nan
        out = np.zeros((B, Hq, T, D), dtype=st)
        lse = np.full((B, Hq, T), -np.inf, dtype=np.float32)
        scale = 1.0 / math.sqrt(D)
        aplan = planmod.plan_attention(
            case.dtype, D, batch=B, kv_heads=Hkv, group=G, t_q=T, lens=lens, n_new=n_new,
            scale=scale, q_strides=_element_strides(q)[:3], buf_strides=_element_strides(k_buf)[:3],
            out_strides=_element_strides(out)[:3], sm_count=case.sm_count,
            min_keys_per_split=case.min_keys_per_split, force_splits=case.force_splits)
        apoison = None
        if poison:
            live = {int(rows[b]): int(lens[b]) for b in range(B)}
            buf_ranges = [_token_ranges(k_buf, r, h, live.get(r, 0), case.max_len)
                          for r in range(R) for h in range(Hkv)]
            q_ranges = [_token_ranges(q, b, h, int(n_new[b]), T) for b in range(B) for h in range(Hq)]
            apoison = {"k_buf": buf_ranges, "v_buf": buf_ranges, "q": q_ranges, "out": q_ranges}
        emu.run(aplan, {"q": q, "k_buf": k_buf, "v_buf": v_buf, "rows": rows, "lens": lens,
                        "n_new": n_new, "out": out, "lse": lse}, poison=apoison)
        stats["kernels"].update(l.name for l in aplan.launches)
        stats["splits"] = max(stats["splits"], aplan.num_splits)
        k_rows = [k_buf[rows[b], :, :lens[b]] for b in range(B)]
        v_rows = [v_buf[rows[b], :, :lens[b]] for b in range(B)]
        ref_out, ref_lse = reference_attention(q.astype(np.float64), k_rows, v_rows, n_new, scale)
        _check_out(case, step, out, lse, ref_out, ref_lse, n_new, stats)
        stats["steps"] += 1
    if case.expect_splits:
        assert stats["splits"] > 1, f"{case.name}: no step used split-KV"
    if case.nan_q or any(w == "k" for _, w, *_ in case.nan_kv):
        assert stats["nan_queries"] >= len(case.nan_q), f"{case.name}: the NaN reached no query"
    if any(w == "v" for _, w, *_ in case.nan_kv):
        assert stats["nan_outputs"] > 0, f"{case.name}: the NaN value reached no output"
    launched = {k.split("<")[0] for k in stats["kernels"]}
    for kernel in case.expect_kernels:
        assert kernel in launched, f"{case.name}: {kernel} was never launched ({sorted(launched)})"
    return stats


#: Quiet-NaN bit pattern per dtype (a payload may be or'ed into the low bits).
_QNAN = {"float32": 0x7FC00000, "float16": 0x7E00, "bfloat16": 0x7FC0}


@dataclass(frozen=True)
class CopyCase:
    """One ``Backend.copy_tokens`` call (a wave of reorder or fork) on ``[layers, R, Hkv, S, d]``
    buffers. mode "same": dst and src are the same cache buffers (fork, a reorder wave, a
    paged cache's copy on write: pool pages as rows); "to_temp" / "from_temp": one side is
    the reorder temporary ``[layers, 1, Hkv, n, d]``. ``kv_dtype``: a quantized cache, whose
    codes and scales (``copy_parts``) are copied by one launch each."""

    name: str
    dtype: str
    head_dim: int
    layers: int
    kv_heads: int
    lens: tuple[int, ...]  # live tokens per cache row
    dst_rows: tuple[int, ...]
    src_rows: tuple[int, ...]
    n_tokens: tuple[int, ...]
    mode: str = "same"
    max_len: int = 24
    seed: int = 0
    kv_dtype: str | None = None


def copy_parts(case: CopyCase) -> list[tuple[tuple[str, ...], np.dtype, tuple[int, ...]]]:
    """The parts of a token a copy moves, in ``plan.plan_copy_tokens``' launch order:
    (dst K, dst V, src K, src V buffer names, element dtype, shape of one token's part):
    the values ``[d]``; or a quantized cache's codes (``[d]``, grouped ``[d * bits / 8]``
    bytes) and float32 scales (``[]`` per token, grouped ``[d / g]``)."""
    from gqakv.storage.codecs import GROUPED

    values = ("dst_k", "dst_v", "src_k", "src_v")
    scales = ("dst_k_scale", "dst_v_scale", "src_k_scale", "src_v_scale")
    d, kv = case.head_dim, case.kv_dtype
    if kv is None:
        return [(values, STORAGE[case.dtype], (d,))]
    if kv in GROUPED:
        bits, group, _ = GROUPED[kv]
        code = np.dtype(np.int8 if bits == 8 else np.uint8)
        return [(values, code, (d * bits // 8,)), (scales, np.dtype(np.float32), (d // group,))]
    return [(values, np.dtype(np.int8 if kv == "int8" else np.uint8), (d,)), (scales, np.dtype(np.float32), ())]


def _prefix_poison(a: np.ndarray, allowed: np.ndarray) -> list[tuple[int, int]]:
    """Byte ranges of a [layers, R, H, S, ...] (contiguous) outside token prefix [0, allowed[r])."""
    layers, R, H, S = a.shape[:4]
    row = a.itemsize * math.prod(a.shape[4:])
    return [((((l * R + r) * H + h) * S + int(allowed[r])) * row, (S - int(allowed[r])) * row)
            for l in range(layers) for r in range(R) for h in range(H)]


def run_copy_case(emu, case: CopyCase, poison: bool = False) -> dict:
    """Run the copy plan on the emulator and compare every buffer (values, or codes and
    scales) bit for bit with a NumPy model. Under ``poison`` only the copied slots of dst
    and the copied prefixes of src (never past the source row's live length) are
    touchable, in every part."""
    rng = np.random.default_rng(case.seed)
    Lyr, H, D, S = case.layers, case.kv_heads, case.head_dim, case.max_len
    lens = np.array(case.lens, dtype=np.int64)
    dst_rows, src_rows = np.array(case.dst_rows), np.array(case.src_rows)
    n = np.array(case.n_tokens, dtype=np.int64)
    temp_len = max(1, int(n.max()))

    def fill(shape, dt, live=None):
        if dt.kind in "iu":  # codes: every byte value (dead tails random, unlike any copy)
            return rng.integers(np.iinfo(dt).min, np.iinfo(dt).max + 1, size=shape, dtype=dt)
        a = rng.standard_normal(shape).astype(dt)
        if live is not None:
            bits = a.view(f"u{dt.itemsize}")
            qnan = _QNAN[next(name for name, st in STORAGE.items() if st == dt)]
            for r in range(shape[1]):  # dead tails: NaN whose payload names the row, so a copy
                bits[:, r, :, live[r]:] = qnan | (r + 1)  # past n shows bitwise
        return a

    if case.mode == "same":  # a wave: no destination is read by the same call
        assert set(dst_rows.tolist()).isdisjoint(src_rows.tolist()), f"{case.name}: not a wave"
    elif case.mode not in ("to_temp", "from_temp"):
        raise ValueError(case.mode)
    src_live = lens if case.mode != "from_temp" else np.full(1, temp_len)
    assert np.all(n <= src_live[src_rows]), f"{case.name}: copies past a live prefix"
    arrays = {"pairs": np.stack([dst_rows, src_rows, n]).astype(np.int64)}
    strides, ppoison, checks = [], {}, []
    for names, dt, tail in copy_parts(case):
        cache = [fill((Lyr, len(lens), H, S, *tail), dt, lens) for _ in range(2)]
        temp = [fill((Lyr, 1, H, temp_len, *tail), dt) for _ in range(2)]
        dst, src = {"same": (cache, cache), "to_temp": (temp, cache), "from_temp": (cache, temp)}[case.mode]
        expect = [x.copy() for x in dst]
        for i in range(n.size):
            for e, x in zip(expect, src):
                e[:, dst_rows[i], :, :n[i]] = x[:, src_rows[i], :, :n[i]]
        # In mode "same" src is dst: the emulator gives both names one allocation.
        arrays.update(zip(names, (*dst, *src)))
        strides.append((_element_strides(dst[0])[:4], _element_strides(src[0])[:4]))
        checks.append((names, dst, expect, src, [x.tobytes() for x in src]))
        if poison:
            dst_allowed = np.zeros(dst[0].shape[1], dtype=np.int64)
            src_allowed = np.zeros(src[0].shape[1], dtype=np.int64)
            for i in range(n.size):
                dst_allowed[dst_rows[i]] = max(dst_allowed[dst_rows[i]], n[i])
                src_allowed[src_rows[i]] = max(src_allowed[src_rows[i]], n[i])
            if case.mode == "same":
                ranges = _prefix_poison(dst[0], np.maximum(dst_allowed, src_allowed))
                ppoison.update({names[0]: ranges, names[1]: ranges})
            else:
                d_ranges, s_ranges = _prefix_poison(dst[0], dst_allowed), _prefix_poison(src[0], src_allowed)
                ppoison.update(zip(names, (d_ranges, d_ranges, s_ranges, s_ranges)))

    plan = planmod.plan_copy_tokens(case.dtype, D, n, Lyr, H, *strides[0], case.kv_dtype,
                                    *(strides[1] if len(strides) > 1 else (None, None)))
    emu.run(plan, arrays, poison=ppoison if poison else None)
    for names, dst, expect, src, src_before in checks:
        for name, x, e in zip(names, dst, expect):
            assert x.tobytes() == e.tobytes(), f"{case.name}: {name} differs from the model after the copy"
        if case.mode != "same":
            assert [x.tobytes() for x in src] == src_before, f"{case.name}: the source {names[2:]} changed"
    assert len(plan.launches) == (len(checks) if n.max() > 0 else 0)
    return {"steps": 1, "splits": 1, "kernels": {l.name for l in plan.launches}}


def run_any(emu, case, poison: bool = False) -> dict:
    """Run an attention scenario (Case, or QuantCase over a quantized cache) or a row-copy
    call (CopyCase)."""
    from .quantized_cases import QuantCase, run_quantized_case

    if isinstance(case, QuantCase):
        return run_quantized_case(emu, case, poison)
    if isinstance(case, CopyCase):
        return run_copy_case(emu, case, poison)
    return run_case(emu, case, poison)


def copy_cases() -> list[CopyCase]:
    """Row copies: fork and reorder waves in one cache, the temporary on either side,
    ragged counts (0, shorter than live, full live rows), several layers, every dtype."""
    lens = (7, 0, 12, 3, 9, 5)
    cases = []
    for dtype, d in (("float32", 20), ("float16", 64), ("bfloat16", 128), ("float16", 20)):
        tag = f"{dtype}-d{d}"
        # fork: row 2 into rows 1, 3, 5
        cases.append(CopyCase(f"copy-fork-{tag}", dtype, d, 3, 2, lens, (1, 3, 5), (2, 2, 2),
                              (12, 12, 12), seed=1))
        # a reorder wave: duplicate sources, an empty source row, a partial prefix
        cases.append(CopyCase(f"copy-wave-{tag}", dtype, d, 2, 3, lens, (0, 3, 5, 2), (4, 4, 1, 4),
                              (9, 9, 0, 6), seed=2))
    for dtype in ("float32", "float16", "bfloat16"):
        cases.append(CopyCase(f"copy-to-temp-{dtype}-d64", dtype, 64, 4, 2, lens, (0,), (4,), (9,),
                              mode="to_temp", seed=3))
        cases.append(CopyCase(f"copy-from-temp-{dtype}-d64", dtype, 64, 4, 2, lens, (2,), (0,), (7,),
                              mode="from_temp", seed=4))
    cases.append(CopyCase("copy-all-empty-float32-d64", "float32", 64, 2, 1, lens, (1, 3), (0, 2),
                          (0, 0), seed=5))
    return cases


def prefill_mma_cases() -> list[Case]:
    """Chunked prefill on tensor cores (gqakv_prefill_mma: float16 / bfloat16, head_dim a
    multiple of 16; 64 query rows per CTA, key tiles of 64 keys at d <= 112, 32 at d = 128,
    16 with K and V sharing one buffer at d = 256): several query blocks and key tiles per
    CTA, the diagonal tile, ragged rows, idle entries, padding, NaN tails, rows indirection,
    G 1 / 3 / 4 / 8, d 64 / 128 / 256 and 80 (not a power of two: 5 k-steps of Q K^T)."""
    return [
        # G = 1: 64 tokens per query block, so 70 and 75 tokens span two blocks and two tiles.
        Case("mma-longchunk-float16-G1-d64", "float16", 64, 2, 1, ((70, 0, 33), (10, 75, 1)),
             max_len=160, seed=21),
        # G = 3: 21 tokens x 3 heads per CTA (one padded row in each); 32-key tiles.
        Case("mma-longchunk-bfloat16-G3-d128", "bfloat16", 128, 1, 3, ((40, 5), (30, 50), (1, 1)),
             max_len=96, seed=22),
        # G = 4 over a larger cache through rows indirection; rows 1 and 3 never touched.
        Case("mma-rows-float16-G4-d128", "float16", 128, 2, 4, ((33, 20), (1, 1), (25, 40)),
             max_len=100, cache_rows=4, rows=(2, 0), seed=23),
        # G = 8: 8 tokens per query block, many blocks; a long row beside a short one.
        Case("mma-G8-bfloat16-d64", "bfloat16", 64, 1, 8, ((20, 70), (9, 1), (30, 6)),
             max_len=112, seed=24),
        Case("mma-G4-float16-d80", "float16", 80, 1, 4, ((70, 3), (2, 66)), max_len=144, seed=25),
        Case("mma-G1-bfloat16-d80", "bfloat16", 80, 2, 1, ((66, 9), (5, 70)), max_len=144, seed=26),
        Case("mma-G4-bfloat16-d256", "bfloat16", 256, 1, 4, ((20, 37), (1, 1), (18, 0)),
             max_len=80, seed=27),
        Case("mma-G1-float16-d256", "float16", 256, 2, 1, ((40, 7), (3, 33)), max_len=80, seed=28),
    ]


def nan_cases() -> list[Case]:
    """A NaN in a real query or in a live K / V token shows as NaN in exactly the results
    it reaches (the reference's NaN pattern), through every attention kernel: the decode
    kernels (fp32 FMA in float32 / bfloat16 d = 20 and 80 / float16 d = 20; tensor cores in
    float16 d = 64, bfloat16 d = 128), split decode with its merge, and both prefill kernels.

    Per scenario: a prefill chunk with a NaN query token and a NaN key in its middle (the
    tokens before that key must not see it, even in the same key tile), T = 1 decode with
    NaN queries sharing a CTA with finite ones, and small-T decode where the last new key
    is NaN (hidden from the earlier queries of the step). The NaN key of step 0 stays live,
    so every later query of its KV head is NaN too; the other KV head stays finite.
    """
    cases = []
    nan_q = ((0, 0, 1, 4), (1, 0, 2, 0), (1, 1, 2, 0), (2, 0, 5, 1))
    nan_kv = ((0, "k", 1, 1, 3), (2, "k", 0, 0, 2))
    for dtype, d in (("float32", 64), ("float16", 64), ("bfloat16", 128), ("float16", 20),
                     ("bfloat16", 20), ("bfloat16", 80)):
        cases.append(Case(f"nan-{dtype}-G4-d{d}", dtype, d, 2, 4, ((9, 6), (1, 1), (3, 2)),
                          max_len=24, nan_q=nan_q, nan_kv=nan_kv, seed=40))
    # Split decode (3 splits forced on rows of ~40 and ~26 keys): a NaN key in the middle
    # of entry 1's prefill (so one split of each later decode sees it), a NaN value at key 0
    # of entry 0 (out NaN in one element, lse finite, through the merge), NaN queries, and
    # a NaN key in the last, short split hidden from the step's first query.
    for dtype, d, kernel in (("float32", 64, "gqakv_decode"), ("bfloat16", 128, "gqakv_decode_mma"),
                             ("float16", 80, "gqakv_decode")):
        cases.append(Case(f"nan-split-{dtype}-G4-d{d}", dtype, d, 2, 4, ((40, 25), (1, 1), (3, 1)),
                          max_len=48, pad=0, force_splits=3, expect_splits=True,
                          expect_kernels=(kernel, "gqakv_merge"),
                          nan_q=((1, 0, 5, 0), (2, 0, 1, 0)),
                          nan_kv=((0, "k", 1, 0, 20), (0, "v", 0, 1, 0), (2, "k", 0, 1, 1)), seed=41))
    return cases


def all_cases() -> list:
    """The emulated parity grid: kernels x dtypes x group sizes x head dims, small shapes."""
    cases = []
    # Prefill chunk (with padding), decode, decode with an idle entry, small-T decode.
    base = ((5, 0, 9), (1, 1, 1), (0, 1, 1), (3, 2, 0), (1, 1, 1))
    for dtype in ("float32", "float16", "bfloat16"):
        for group in (1, 3, 4, 8):
            cases.append(Case(f"mixed-{dtype}-G{group}-d64", dtype, 64, 2, group, base,
                              seed=group))
    for dtype in ("float32", "float16", "bfloat16"):
        # d = 20: not a multiple of 8, so f16/bf16 take the scalar-load path.
        cases.append(Case(f"mixed-{dtype}-G3-d20", dtype, 20, 2, 3, base, seed=7))
        # Split-KV + merge on a pretend 4-SM device (12 tile-4 CTA slots): rows of ~200 and
        # ~120 keys cut into chunks of ~34, both ending in a short chunk; T = 2 and T = 4
        # steps (tile 8, the last keys hidden from the earlier queries) split too.
        cases.append(Case(f"splitkv-{dtype}-G4-d64", dtype, 64, 1, 4,
                          ((200, 120), (1, 1), (3, 1), (1, 0)), max_len=208, sm_count=4,
                          min_keys_per_split=8, expect_splits=True, seed=11))
    for dtype in ("float16", "bfloat16"):
        cases.append(Case(f"mixed-{dtype}-G4-d128", dtype, 128, 1, 4, ((6, 3), (1, 1)), seed=5))
    # Rows indirection over a larger cache (continuous batching); rows 0 and 2 never touched.
    cases.append(Case("rows-bfloat16-G3-d20", "bfloat16", 20, 2, 3, ((4, 7), (1, 1), (2, 0)),
                      cache_rows=4, rows=(3, 1), seed=3))
    # Several query blocks and key tiles per prefill CTA (BQ = 64 at G = 1, 8 at G = 8).
    cases.append(Case("longchunk-float32-G1-d20", "float32", 20, 1, 1, ((70, 0), (10, 75)),
                      max_len=96, pad=0, seed=9))
    cases.append(Case("longchunk-bfloat16-G8-d64", "bfloat16", 64, 1, 8, ((20, 3), (19, 25)),
                      max_len=64, seed=10))
    # More query heads than a decode tile holds (G = 12 > 8): several query chunks per KV head.
    cases.append(Case("widegroup-float16-G12-d20", "float16", 20, 1, 12, ((3, 2), (1, 1), (2, 2)),
                      seed=12))
    # Decode query tiles (sources.DECODE_QUERY_TILES): exactly G * T = 4 (Llama-style G = 4,
    # T = 1, no padding slot) and G = 2, T = 2 in tile 4; G = 5 (3 empty slots) and G = 9
    # (two chunks, the second holding one query) in tile 8.
    for dtype, d in (("float32", 64), ("float16", 128), ("bfloat16", 64)):
        cases.append(Case(f"tile4-{dtype}-G4T1-d{d}", dtype, d, 2, 4, ((6, 2), (1, 1), (1, 0), (1, 1)),
                          pad=0, seed=13))
    cases.append(Case("tile4-bfloat16-G2T2-d20", "bfloat16", 20, 2, 2, ((3, 5), (2, 2), (2, 1)),
                      pad=0, seed=14))
    cases.append(Case("tile8-float16-G5T1-d64", "float16", 64, 1, 5, ((4, 3), (1, 1), (0, 1)),
                      pad=0, seed=15))
    cases.append(Case("tile8x2-float32-G9T1-d20", "float32", 20, 1, 9, ((4, 3), (1, 1), (1, 0)),
                      pad=0, seed=16))
    # Decode kernels: gqakv_decode_mma (tensor cores) for float16 / bfloat16 at d = 64 and
    # 128, gqakv_decode (fp32 FMA, key pipeline of PIPE steps of NG keys per lane) for the
    # rest, here float32 and 16-bit d = 80 and 256. Rows shorter than one step, lengths that
    # are no multiple of a step, idle entries; splits whose last chunk is short on pretend
    # 1- and 2-SM devices; small-T decode (the last keys hidden from earlier queries);
    # G * T above 16 (two tensor-core query chunks).
    for dtype, d in (("bfloat16", 128), ("float16", 64), ("float32", 128), ("float16", 256),
                     ("bfloat16", 80)):
        kernel = "gqakv_decode_mma" if dtype != "float32" and d in (64, 128) else "gqakv_decode"
        cases.append(Case(f"pipe-short-{dtype}-G4T1-d{d}", dtype, d, 2, 4,
                          ((1, 2, 0), (1, 1, 1), (1, 0, 1)), max_len=8, pad=0,
                          expect_kernels=(kernel,), seed=17))
    cases.append(Case("pipe-split-bfloat16-G4T1-d128", "bfloat16", 128, 1, 4,
                      ((150, 77), (1, 1), (1, 1)), max_len=160, pad=0, sm_count=2,
                      min_keys_per_split=8, expect_splits=True,
                      expect_kernels=("gqakv_decode_mma", "gqakv_merge"), seed=18))
    cases.append(Case("pipe-split-float16-G8T1-d64", "float16", 64, 1, 8,
                      ((203, 60), (1, 1), (0, 1)), max_len=224, pad=0, sm_count=2,
                      min_keys_per_split=16, expect_splits=True,
                      expect_kernels=("gqakv_decode_mma", "gqakv_merge"), seed=19))
    cases.append(Case("pipe-split-bfloat16-G4T1-d256", "bfloat16", 256, 1, 4,
                      ((150, 77), (1, 1), (1, 1)), max_len=160, pad=0, sm_count=2,
                      min_keys_per_split=8, expect_splits=True,
                      expect_kernels=("gqakv_decode", "gqakv_merge"), seed=20))
    cases.append(Case("pipe-split-float16-G5T2-d80", "float16", 80, 1, 5,
                      ((200, 41), (2, 1), (2, 2)), max_len=208, pad=0, sm_count=4,
                      min_keys_per_split=8, expect_splits=True,
                      expect_kernels=("gqakv_decode", "gqakv_merge"), seed=21))
    # d = 20: the merge's split groups (25 groups of 5 threads) leave 3 threads idle.
    cases.append(Case("pipe-split-float32-G3T1-d20", "float32", 20, 1, 3,
                      ((150, 77), (1, 1), (1, 0)), max_len=160, pad=0, sm_count=2,
                      min_keys_per_split=8, expect_splits=True,
                      expect_kernels=("gqakv_decode", "gqakv_merge"), seed=24))
    # A last split shorter than T: its early queries (positions before the split) see none
    # of its keys while the later ones do (rows of 82 keys in 9 splits of 10, T = 4).
    cases.append(Case("lastsplit-float32-G1T4-d64", "float32", 64, 1, 1, ((78,), (4,)),
                      max_len=88, pad=0, sm_count=4, min_keys_per_split=8, expect_splits=True,
                      expect_kernels=("gqakv_decode", "gqakv_merge"), seed=25))
    cases.append(Case("lastsplit-float16-G4T4-d64", "float16", 64, 1, 4, ((78,), (4,)),
                      max_len=88, pad=0, sm_count=3, min_keys_per_split=8, expect_splits=True,
                      expect_kernels=("gqakv_decode_mma", "gqakv_merge"), seed=26))
    cases.append(Case("mma-decode-float16-G8T3-d128", "float16", 128, 2, 8,
                      ((20, 7), (3, 2), (1, 3), (3, 0)), max_len=40, pad=0,
                      expect_kernels=("gqakv_decode_mma",), seed=22))
    cases.append(Case("mma-decode-rows-bfloat16-G3T4-d64", "bfloat16", 64, 2, 3,
                      ((9, 33), (4, 1), (2, 4)), max_len=48, cache_rows=4, rows=(3, 1), pad=0,
                      expect_kernels=("gqakv_decode_mma",), seed=23))
    from .quantized_cases import quantized_cases

    return cases + prefill_mma_cases() + nan_cases() + copy_cases() + quantized_cases()
