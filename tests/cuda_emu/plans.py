"""Launch plans the cupy backend's planner builds over hand-made buffers, run on the CPU
emulator and checked against the float64 loop reference (tests/support/reference.py) with
the emulated suites' rule (``cases._check_out``): the plan runners and pool helpers that
several emulated suites share (test_cupy_emulated_variants, _paged, _paged_quantized and
_alibi), kept here so no test module imports another.

- ``run_variant``: one attention plan over contiguous rows (``alibi_pattern`` names the
  ALiBi slope patterns); ``run_tree``: one with a draft tree (the prefill kernels' tree
  instantiation) over contiguous, paged, int8 or paged int8 storage (``TREE_STORAGES``);
- ``run_paged_plan``: one attention plan over a shuffled pool of pages (``shuffled_pool``,
  ``pool_row``; ``sinks_pattern`` names the sink patterns);
- ``run_paged_quantized_plan``: the same over shuffled 8-bit pages (``quantized_pool``,
  ``quantized_row``; ``held_values``: what an 8-bit cache holds for tokens);
- ``pool_poison`` and ``table_poison``: the byte ranges no kernel may touch, for the
  AddressSanitizer build.
"""

from __future__ import annotations

import math
import types

import numpy as np

import gqakv
from gqakv.core import semantics
from gqakv.storage import quantize as Q

from gqakv.core.tree import DraftTree

from gqakv_backends.cupy_backend import plan as planmod
from gqakv_backends.cupy_backend import work as workmod

from . import cases, quantized_cases
from ..support.reference import reference_attention

D = 64  # the head dim of the paged 8-bit instantiations of the default library (harness.PAGED_QUANTIZED_*)


def run_variant(emu, *, dtype, d, kv_heads, group, lens, n_new, params, pad=1,
                force_splits=None, tensor_cores=True, max_len=None, seed=0, poison=False):
    """One attention call of ``params`` on a cache holding ``lens[b]`` tokens (after the
    append of ``n_new[b]``), checked against the reference; returns the plan. With
    ``poison`` (the AddressSanitizer build) every K/V byte no query of a row sees is
    poisoned, the keys before the row's first window as well as the dead tail, so a
    kernel that reads them (instead of starting at the window) fails."""
    rng = np.random.default_rng(seed)
    st = cases.STORAGE[dtype]
    lens = np.asarray(lens, np.int64)
    n_new = np.asarray(n_new, np.int64)
    B, Hq = len(lens), kv_heads * group
    S = max_len or int(lens.max()) + 3
    T = int(n_new.max()) + pad
    k_buf = np.full((B, kv_heads, S, d), np.nan, st)  # dead tails NaN: never read
    v_buf = np.full_like(k_buf, np.nan)
    for b in range(B):
        k_buf[b, :, :lens[b]] = rng.standard_normal((kv_heads, lens[b], d)).astype(st)
        v_buf[b, :, :lens[b]] = rng.standard_normal((kv_heads, lens[b], d)).astype(st)
    q = (2.0 * rng.standard_normal((B, Hq, T, d))).astype(st)  # scores of a few units
    for b in range(B):
        q[b, :, n_new[b]:] = np.nan
    out = np.zeros((B, Hq, T, d), st)
    lse = np.full((B, Hq, T), -np.inf, np.float32)
    strides = lambda a: tuple(s // a.itemsize for s in a.strides)[:3]  # noqa: E731
    plan = planmod.plan_attention(dtype, d, batch=B, kv_heads=kv_heads, group=group, t_q=T,
                                  lens=lens, n_new=n_new, params=params, q_strides=strides(q),
                                  buf_strides=strides(k_buf), out_strides=strides(out),
                                  sm_count=132, force_splits=force_splits,
                                  tensor_cores=tensor_cores)
    arrays = {"q": q, "k_buf": k_buf, "v_buf": v_buf, "rows": np.arange(B, dtype=np.int64),
              "lens": lens, "n_new": n_new, "out": out, "lse": lse}
    if params.sinks is not None:
        arrays["sinks"] = np.asarray(params.sinks, np.float32)
    if params.alibi_slopes is not None:
        arrays["alibi"] = np.asarray(params.alibi_slopes, np.float32)
    ranges = None
    if poison:
        kv_ranges = []
        for b in range(B):
            lo = semantics.key_range(params, int(lens[b]), int(n_new[b]), 0)[0] if n_new[b] else lens[b]
            for h in range(kv_heads):
                kv_ranges += [cases._token_ranges(k_buf, b, h, 0, int(lo)),
                              cases._token_ranges(k_buf, b, h, int(lens[b]), S)]
        q_ranges = [cases._token_ranges(q, b, h, int(n_new[b]), T) for b in range(B) for h in range(Hq)]
        ranges = {"k_buf": kv_ranges, "v_buf": kv_ranges, "q": q_ranges, "out": q_ranges}
    emu.run(plan, arrays, poison=ranges)
    k_rows = [k_buf[b, :, :lens[b]] for b in range(B)]
    v_rows = [v_buf[b, :, :lens[b]] for b in range(B)]
    ref_out, ref_lse = reference_attention(q.astype(np.float64), k_rows, v_rows, n_new, params.scale,
                                           window=params.window, softcap=params.softcap,
                                           sinks=params.sinks, alibi_slopes=params.alibi_slopes)
    assert not np.isnan(ref_out).any() and not np.isnan(out.astype(np.float64)).any()
    assert not np.isnan(lse).any()
    stats = {"max_out_err": 0.0, "max_out_tol": 0.0, "max_lse_err": 0.0}
    case = types.SimpleNamespace(name=f"{dtype} d={d} {params.variant}", dtype=dtype)
    cases._check_out(case, 0, out, lse, ref_out, ref_lse, n_new, stats)
    return plan


#: The storages ``run_tree`` lays its rows out in: contiguous rows, shuffled pages, 8-bit
#: (int8) rows with per-token scales, and 8-bit pages.
TREE_STORAGES = ("contiguous", "paged", "int8", "paged_int8")


def _tree_kv(rng, st, lens, kv_heads, d, S, storage, P):
    """The K/V buffers of ``run_tree`` over ``storage`` (rows of ``lens[b]`` random tokens):
    ``(arrays, plan keyword arguments, k_rows, v_rows, poison)``; the rows float64 as the
    storage holds them (8-bit: codes x scales), ``poison(lo)`` the byte ranges no kernel may
    touch when row b's kernels read keys ``lo[b]..lens[b]-1`` (the K and V buffers alike:
    the same token slots), as a dict over the arrays' names. Unwritten slots are NaN
    (scales; codes 0x55)."""
    B = len(lens)
    quantized, paged = storage in ("int8", "paged_int8"), storage in ("paged", "paged_int8")
    tokens = [[rng.standard_normal((kv_heads, int(L), d)) for L in lens] for _ in range(2)]  # K, V
    if paged:  # pages dealt in a shuffled order, 3 that no row holds
        held = [-(-int(L) // P) for L in lens]
        num_pages = sum(held) + 3
        order = rng.permutation(num_pages)
        table = np.full((B, max(1, max(held) + 1)), -1, np.int32)
        i = 0
        for b in range(B):
            table[b, :held[b]] = order[i:i + held[b]]
            i += held[b]
        shape = (num_pages, kv_heads, P, d)
    else:
        shape = (B, kv_heads, S, d)

    def slots(b, L):  # (index, slot) of row b's tokens 0..L-1 in the buffers
        if paged:
            j = np.arange(L)
            return table[b, j // P], j % P
        return np.full(L, b), np.arange(L)

    arrays, held_rows = {}, []
    for name, rows in zip("kv", tokens):
        if quantized:
            codes = np.full(shape, 0x55, np.int8)
            scales = np.full(shape[:3], np.nan, np.float32)
            held_rows.append([])
            for b, x in enumerate(rows):
                c, sc = Q.quantize(np, x.astype(np.float32), "int8")
                i0, o = slots(b, x.shape[1])
                codes[i0, :, o] = c.transpose(1, 0, 2)  # [L, Hkv, d]: the slot axes first
                scales[i0, :, o] = sc.T
                held_rows[-1].append(Q.dequantize(np, c, sc, "int8").astype(np.float64))
            arrays[f"{name}_buf"], arrays[f"{name}_scale"] = codes, scales
        else:
            buf = np.full(shape, np.nan, st)
            for b, x in enumerate(rows):
                i0, o = slots(b, x.shape[1])
                buf[i0, :, o] = x.astype(st).transpose(1, 0, 2)
            arrays[f"{name}_buf"] = buf
            held_rows.append([x.astype(st).astype(np.float64) for x in rows])
    kw = {"buf_strides": element_strides(arrays["k_buf"])[:3], "kv_dtype": "int8" if quantized else None}
    if paged:
        arrays["table"] = table
        kw["pages"] = planmod.PageTableArg(table.shape[1], P)

    def poison(lo):
        if paged:
            live = lambda b: (int(lo[b]), int(lens[b]))  # noqa: E731
            ranges = {"k_buf": pool_poison(arrays["k_buf"], table, held, lens, P, live),
                      "table": table_poison(table, held)}
            if quantized:
                ranges["k_scale"] = pool_poison(arrays["k_scale"], table, held, lens, P, live)
        else:
            ranges = {"k_buf": [r for b in range(B) for h in range(kv_heads) for r in (
                cases._token_ranges(arrays["k_buf"], b, h, 0, int(lo[b])),
                cases._token_ranges(arrays["k_buf"], b, h, int(lens[b]), S))]}
            if quantized:
                ranges["k_scale"] = [r for b in range(B) for h in range(kv_heads) for r in (
                    quantized_cases._scale_ranges(arrays["k_scale"], b, h, 0, int(lo[b])),
                    quantized_cases._scale_ranges(arrays["k_scale"], b, h, int(lens[b]), S))]
        ranges["v_buf"] = ranges["k_buf"]
        if quantized:
            ranges["v_scale"] = ranges["k_scale"]
        return ranges

    return arrays, kw, held_rows[0], held_rows[1], poison


def run_tree(emu, *, dtype, d, kv_heads, group, lens, n_new, parents, params, tensor_cores=True,
             seed=0, poison=False, storage="contiguous", page_size=8):
    """One draft-tree attention call (``parents`` ``[B, S]``, each entry's first n_new[b]
    tokens its tree) of ``params`` on rows holding ``lens[b]`` tokens in ``storage`` (one of
    ``TREE_STORAGES``; pages of ``page_size``), checked against the loop reference (which
    walks the parents) on the values the storage holds by ``cases._check_out``; returns the
    plan. With ``poison`` (the AddressSanitizer build): the K/V (codes and scales) before
    each row's first window (a root's, the kernels' key span), the dead tails and unheld
    pages, the table past each row's pages, the padded queries and the tree mask's padded
    rows (t >= n_new[b]) may not be touched."""
    rng = np.random.default_rng(seed)
    st = cases.STORAGE[dtype]
    lens = np.asarray(lens, np.int64)
    n_new = np.asarray(n_new, np.int64)
    parents = np.asarray(parents, np.int64)
    B, Hq = len(lens), kv_heads * group
    tree = DraftTree.of(parents, n_new)
    S_tree = int(parents.shape[1])
    S = int(lens.max()) + 3
    T = max(int(n_new.max()), 1)
    kv, kw, k_rows, v_rows, kv_poison = _tree_kv(rng, st, lens, kv_heads, d, S, storage, page_size)
    q = (2.0 * rng.standard_normal((B, Hq, T, d))).astype(st)
    for b in range(B):
        q[b, :, n_new[b]:] = np.nan
    out = np.zeros((B, Hq, T, d), st)
    lse = np.full((B, Hq, T), -np.inf, np.float32)
    strides = lambda a: tuple(s // a.itemsize for s in a.strides)[:3]  # noqa: E731
    plan = planmod.plan_attention(dtype, d, batch=B, kv_heads=kv_heads, group=group, t_q=T,
                                  lens=lens, n_new=n_new, params=params, q_strides=strides(q),
                                  out_strides=strides(out), sm_count=132, tensor_cores=tensor_cores,
                                  tree_stride=S_tree, **kw)
    mask, depth = workmod.tree_arrays(tree)
    arrays = {**kv, "q": q, "rows": np.arange(B, dtype=np.int64), "lens": lens, "n_new": n_new,
              "out": out, "lse": lse, "tree_mask": mask.copy(), "tree_depth": depth.copy()}
    if params.sinks is not None:
        arrays["sinks"] = np.asarray(params.sinks, np.float32)
    if params.alibi_slopes is not None:
        arrays["alibi"] = np.asarray(params.alibi_slopes, np.float32)
    ranges = None
    if poison:
        lo = [semantics.key_range(params, int(lens[b] - n_new[b]) + 1, 1, 0)[0] if n_new[b]
              else int(lens[b]) for b in range(B)]  # a root's window
        q_ranges = [cases._token_ranges(q, b, h, int(n_new[b]), T) for b in range(B) for h in range(Hq)]
        mask_ranges = [((b * S_tree + int(n_new[b])) * S_tree, (S_tree - int(n_new[b])) * S_tree)
                       for b in range(B)]
        ranges = {**kv_poison(lo), "q": q_ranges, "out": q_ranges, "tree_mask": mask_ranges}
    emu.run(plan, arrays, poison=ranges)
    ref_out, ref_lse = reference_attention(q.astype(np.float64), k_rows, v_rows, n_new, params.scale,
                                           window=params.window, softcap=params.softcap,
                                           sinks=params.sinks, alibi_slopes=params.alibi_slopes,
                                           parents=parents)
    assert not np.isnan(ref_out).any() and not np.isnan(out.astype(np.float64)).any()
    assert not np.isnan(lse).any()
    stats = {"max_out_err": 0.0, "max_out_tol": 0.0, "max_lse_err": 0.0}
    case = types.SimpleNamespace(name=f"{dtype} d={d} {storage} tree {params.variant}", dtype=dtype)
    cases._check_out(case, 0, out, lse, ref_out, ref_lse, n_new, stats)
    paged, tag = storage in ("paged", "paged_int8"), "gqakv_i8" if "int8" in storage else None
    for launch in plan.launches:  # the storage's reader was the one launched
        assert launch.name.endswith("KVPages>") == paged, launch.name
        assert (tag in launch.name) if tag else "gqakv_i8" not in launch.name, launch.name
    return plan


def alibi_pattern(name, hq):
    """Named ALiBi slope patterns over the Hq query heads, float32-exact (the kernels take
    float32 slopes): BLOOM's 2^(-8 (h + 1) / Hq) (Hq a power of two), or mixed signs."""
    if name is None:
        return None
    slopes = {"bloom": [2.0 ** (-8 * (h + 1) / hq) for h in range(hq)],
              "mixed": [(0.5, -0.125, 0.0, 0.25)[h % 4] for h in range(hq)]}[name]
    return tuple(float(np.float32(s)) for s in slopes)


def variant_params(d, hq, window=None, softcap=None, sinks=None, alibi=None):
    if isinstance(sinks, str):  # a named pattern over the Hq heads
        sinks = {"large": [40.0 + h for h in range(hq)],
                 "-inf": [-math.inf] * hq,
                 "mixed": [(-math.inf, 0.5, -3.0, 25.0)[h % 4] for h in range(hq)]}[sinks]
    sinks = None if sinks is None else tuple(float(np.float32(s)) for s in sinks)
    return semantics.AttentionParams(scale=1.0 / math.sqrt(d), window=window, softcap=softcap,
                                     sinks=sinks, alibi_slopes=alibi_pattern(alibi, hq))


def sinks_pattern(hq: int, kind):
    """A named sink pattern (None, "mixed" or "large") over the ``hq`` query heads, float32-exact."""
    if kind is None:
        return None
    pattern = {"mixed": (-math.inf, 0.5, -3.0, 25.0), "large": (40.0, 41.0, 42.0, 43.0)}[kind]
    return tuple(float(np.float32(pattern[h % 4])) for h in range(hq))


def shuffled_pool(rng, st, lens, kv_heads, d, P, spare=3):
    """A pool whose pages are dealt to the rows in a shuffled order (``spare`` pages no row
    holds), NaN outside the live tokens; returns k, v ``[num_pages, Hkv, P, d]``, the table
    ``[B, pages_per_row]`` int32 (-1 past each row's pages) and each row's held pages."""
    held = [-(-int(L) // P) for L in lens]
    num_pages = sum(held) + spare
    order = rng.permutation(num_pages)
    per_row = max(1, max(held) + 1)
    table = np.full((len(lens), per_row), -1, np.int32)
    k = np.full((num_pages, kv_heads, P, d), np.nan, st)
    v = np.full_like(k, np.nan)
    i = 0
    for b, L in enumerate(lens):
        table[b, :held[b]] = order[i:i + held[b]]
        i += held[b]
        for j in range(int(L)):
            k[table[b, j // P], :, j % P] = rng.standard_normal((kv_heads, d)).astype(st)
            v[table[b, j // P], :, j % P] = rng.standard_normal((kv_heads, d)).astype(st)
    return k, v, table, held


def pool_row(pool, table, b, L, P):
    """Row b's live tokens ``[Hkv, L, d]`` gathered through the table."""
    return np.stack([pool[table[b, j // P], :, j % P] for j in range(L)], axis=1)


def pool_poison(pool, table, held, lens, P, live=None):
    """Byte ranges of the pool no kernel may touch: pages no row holds, and each held page's
    slots past its row's live tokens (``live(b)``: the slots [lo, hi) a row may touch,
    default [0, lens[b]))."""
    page_bytes = pool[0].nbytes
    slot = pool.strides[2]
    allowed = np.zeros(pool.shape[:1] + pool.shape[2:3], bool)  # [num_pages, P]
    for b, L in enumerate(lens):
        lo, hi = live(b) if live else (0, int(L))
        for j in range(lo, hi):
            allowed[table[b, j // P], j % P] = True
    ranges = []
    for p in range(pool.shape[0]):
        if not allowed[p].any():
            ranges.append((p * page_bytes, page_bytes))
            continue
        for h in range(pool.shape[1]):
            for s in np.flatnonzero(~allowed[p]):
                ranges.append((p * pool.strides[0] + h * pool.strides[1] + int(s) * slot, slot))
    return ranges


def table_poison(table, held):
    """The table entries past each row's held pages (never looked up)."""
    ranges = []
    for b, h in enumerate(held):
        ranges.append((table[b].ctypes.data - table.ctypes.data + 4 * h, 4 * (table.shape[1] - h)))
    return ranges


def run_paged_plan(emu, *, dtype, d=64, P, lens, n_new, params, tensor_cores=True,
                   force_splits=None, kv_heads=2, group=2, seed=0, poison=False):
    """One attention plan over a shuffled pool (the backend's planner, pages argument),
    checked against the reference; with ``poison`` every byte outside the live tokens and
    the live table entries is poisoned (the AddressSanitizer build)."""
    rng = np.random.default_rng(seed)
    st = cases.STORAGE[dtype]
    lens, n_new = np.asarray(lens, np.int64), np.asarray(n_new, np.int64)
    B, hq = len(lens), kv_heads * group
    T = int(n_new.max()) + 1
    k, v, table, held = shuffled_pool(rng, st, lens, kv_heads, d, P)
    q = (2.0 * rng.standard_normal((B, hq, T, d))).astype(st)
    for b in range(B):
        q[b, :, n_new[b]:] = np.nan
    out = np.zeros((B, hq, T, d), st)
    lse = np.full((B, hq, T), -np.inf, np.float32)
    strides = lambda a: tuple(s // a.itemsize for s in a.strides)[:3]  # noqa: E731
    plan = planmod.plan_attention(dtype, d, batch=B, kv_heads=kv_heads, group=group, t_q=T,
                                  lens=lens, n_new=n_new, params=params, q_strides=strides(q),
                                  buf_strides=strides(k), out_strides=strides(out), sm_count=132,
                                  force_splits=force_splits, tensor_cores=tensor_cores,
                                  pages=planmod.PageTableArg(table.shape[1], P))
    arrays = {"q": q, "k_buf": k, "v_buf": v, "rows": np.arange(B, dtype=np.int64), "lens": lens,
              "n_new": n_new, "out": out, "lse": lse, "table": table}
    if params.sinks is not None:
        arrays["sinks"] = np.asarray(params.sinks, np.float32)
    if params.alibi_slopes is not None:
        arrays["alibi"] = np.asarray(params.alibi_slopes, np.float32)
    ranges = None
    if poison:
        kv = pool_poison(k, table, held, lens, P)
        q_ranges = [cases._token_ranges(q, b, h, int(n_new[b]), T) for b in range(B) for h in range(hq)]
        ranges = {"k_buf": kv, "v_buf": kv, "table": table_poison(table, held), "q": q_ranges,
                  "out": q_ranges}
    emu.run(plan, arrays, poison=ranges)
    k_rows = [pool_row(k, table, b, int(lens[b]), P) for b in range(B)]
    v_rows = [pool_row(v, table, b, int(lens[b]), P) for b in range(B)]
    ref_out, ref_lse = reference_attention(q.astype(np.float64), k_rows, v_rows, n_new, params.scale,
                                           window=params.window, softcap=params.softcap,
                                           sinks=params.sinks, alibi_slopes=params.alibi_slopes)
    case = types.SimpleNamespace(name=f"paged plan {dtype} P={P} {params.variant}", dtype=dtype)
    cases._check_out(case, 0, out, lse, ref_out, ref_lse, n_new,
                     {"max_out_err": 0.0, "max_out_tol": 0.0, "max_lse_err": 0.0})
    assert all(launch.name.endswith("KVPages>") for launch in plan.launches
               if launch.kernel != "gqakv_merge")
    return plan


def held_values(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """What an 8-bit cache holds for tokens ``x`` ``[..., d]``: codes x scales, float64."""
    return Q.dequantize(np, *Q.quantize(np, x.astype(np.float32), kv_dtype), kv_dtype).astype(np.float64)


#: The code type of each 8-bit kv dtype in the kernels' instantiation names.
CODE_TAGS = {"int8": "gqakv_i8", "float8_e4m3fn": "gqakv_e4m3"}


def quantized_pool(rng, lens, kv_heads, P, kv_dtype, spare=3):
    """8-bit pools dealt to the rows in a shuffled order (``spare`` pages no row holds):
    codes ``[num_pages, Hkv, P, D]`` and float32 scales ``[num_pages, Hkv, P]`` of random
    tokens, NaN scales (and NaN-or-extreme codes) outside the live tokens; the table
    ``[B, pages_per_row]`` int32 (-1 past each row's pages) and each row's held pages."""
    held = [-(-int(L) // P) for L in lens]
    num_pages = sum(held) + spare
    order = rng.permutation(num_pages)
    table = np.full((len(lens), max(1, max(held) + 1)), -1, np.int32)
    codec = gqakv.storage.codecs.of(kv_dtype)
    pools = []
    for _ in range(2):
        codes = np.full((num_pages, kv_heads, P, D), 0x7F, codec.code_dtype(np))  # e4m3: NaN
        scales = np.full((num_pages, kv_heads, P), np.nan, np.float32)
        pools.append([codes, scales])
    i = 0
    for b, L in enumerate(lens):
        table[b, :held[b]] = order[i:i + held[b]]
        i += held[b]
        for j in range(int(L)):
            pg = table[b, j // P]
            for (codes, scales), mags in zip(pools, ([0.5, 1.0, 1.5], [1e-3, 0.1, 1.0])):
                x = rng.standard_normal((kv_heads, D)) * rng.choice(mags)  # K, then V
                c, s = Q.quantize(np, x.astype(np.float32), kv_dtype)
                codes[pg, :, j % P], scales[pg, :, j % P] = c, s
    return pools, table, held


def quantized_row(pool, table, b, L, P, kv_dtype):
    """Row b's live tokens ``[Hkv, L, D]`` through the table, dequantized (float64)."""
    codes, scales = pool
    c = np.stack([codes[table[b, j // P], :, j % P] for j in range(L)], axis=1)
    s = np.stack([scales[table[b, j // P], :, j % P] for j in range(L)], axis=1)
    return Q.dequantize(np, c, s, kv_dtype).astype(np.float64)


def element_strides(a):
    """``a``'s strides in elements (the plans take element strides)."""
    return tuple(s // a.itemsize for s in a.strides)


def run_paged_quantized_plan(emu, *, kv_dtype, dtype, P, lens, n_new, params,
                             force_splits=None, kv_heads=2, group=2, seed=0, poison=False):
    """One attention plan over shuffled 8-bit pages (the backend's planner with pages and
    kv_dtype), checked against the reference on the dequantized values; with ``poison``
    every code and scale byte outside the live tokens and the live table entries is
    poisoned (the AddressSanitizer build)."""
    rng = np.random.default_rng(seed)
    st = cases.STORAGE[dtype]
    lens, n_new = np.asarray(lens, np.int64), np.asarray(n_new, np.int64)
    B, hq = len(lens), kv_heads * group
    T = int(n_new.max()) + 1
    (kpool, vpool), table, held = quantized_pool(rng, lens, kv_heads, P, kv_dtype)
    q = (2.0 * rng.standard_normal((B, hq, T, D))).astype(st)
    for b in range(B):
        q[b, :, n_new[b]:] = np.nan
    out = np.zeros((B, hq, T, D), st)
    lse = np.full((B, hq, T), -np.inf, np.float32)
    plan = planmod.plan_attention(dtype, D, batch=B, kv_heads=kv_heads, group=group, t_q=T,
                                  lens=lens, n_new=n_new, params=params,
                                  q_strides=element_strides(q)[:3],
                                  buf_strides=element_strides(kpool[0])[:3],
                                  out_strides=element_strides(out)[:3],
                                  sm_count=132, force_splits=force_splits, tensor_cores=True,
                                  pages=planmod.PageTableArg(table.shape[1], P), kv_dtype=kv_dtype)
    arrays = {"q": q, "k_buf": kpool[0], "v_buf": vpool[0], "k_scale": kpool[1], "v_scale": vpool[1],
              "rows": np.arange(B, dtype=np.int64), "lens": lens, "n_new": n_new, "out": out,
              "lse": lse, "table": table}
    if params.sinks is not None:
        arrays["sinks"] = np.asarray(params.sinks, np.float32)
    if params.alibi_slopes is not None:
        arrays["alibi"] = np.asarray(params.alibi_slopes, np.float32)
    ranges = None
    if poison:
        codes = pool_poison(kpool[0], table, held, lens, P)
        scales = pool_poison(kpool[1], table, held, lens, P)
        q_ranges = [cases._token_ranges(q, b, h, int(n_new[b]), T) for b in range(B) for h in range(hq)]
        ranges = {"k_buf": codes, "v_buf": codes, "k_scale": scales, "v_scale": scales,
                  "table": table_poison(table, held), "q": q_ranges, "out": q_ranges}
    emu.run(plan, arrays, poison=ranges)
    k_rows = [quantized_row(kpool, table, b, int(lens[b]), P, kv_dtype) for b in range(B)]
    v_rows = [quantized_row(vpool, table, b, int(lens[b]), P, kv_dtype) for b in range(B)]
    ref_out, ref_lse = reference_attention(q.astype(np.float64), k_rows, v_rows, n_new, params.scale,
                                           window=params.window, softcap=params.softcap,
                                           sinks=params.sinks, alibi_slopes=params.alibi_slopes)
    case = types.SimpleNamespace(name=f"paged {kv_dtype} plan {dtype} P={P} {params.variant}", dtype=dtype)
    cases._check_out(case, 0, out, lse, ref_out, ref_lse, n_new,
                     {"max_out_err": 0.0, "max_out_tol": 0.0, "max_lse_err": 0.0})
    attn = [launch.name for launch in plan.launches if launch.kernel != "gqakv_merge"]
    assert attn and all(CODE_TAGS[kv_dtype] in n and n.endswith("KVPages>") for n in attn), attn
    return plan
