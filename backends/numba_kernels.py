"""Numba kernels of the numba backend: attention over the live cache, one pass over K/V.

The attention loop is composed of small ``@njit`` pieces that LLVM inlines into it,
so later storage kinds and attention variants replace one piece, not the loop:

- how K/V are read: ``load_keys(buf, r, h, j0, n, kind, scratch)`` returns keys
  ``j0 .. j0+n-1`` of KV head ``h`` of cache row ``r`` as float32 ``[n * d]``
  (contiguous rows: a view of float32 buffers; float16/bfloat16 bits converted into
  ``scratch`` in registers, see ``half_to_float`` and ``bfloat16_to_float``);
- which keys a query sees: ``visible_keys(q_pos)`` gives the key range ``lo, hi``
  (bottom-right causal: ``0, q_pos + 1``);
- how a score is modified: ``score(dot, scale)`` (plain scaling now; a soft-cap
  would act on this natural scaled score).

The online softmax keeps a running max ``m`` and sum ``l`` in float32 per tile row and
is correct when a whole key block is masked (rows whose max is still -inf add
nothing). Exponentials go through ``exp_nonpos``, a vectorizable float32 exp (LLVM
from pip has no vector math library, and a scalar ``expf`` call per score costs as
much as reading the key).

fastmath is limited to {contract, reassoc, arcp}: never 'nnan'/'ninf', since masked
scores are -inf and a NaN in a live K/V value must reach the output as it does in
the reference.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

FASTMATH = {"contract", "reassoc", "arcp"}
#: ``kind`` of a K/V buffer passed as uint16 bits (float32 buffers are passed as is).
KIND_FLOAT16 = 1
KIND_BFLOAT16 = 2

_NEG_INF = np.float32(-np.inf)


# -- bits ----------------------------------------------------------------------------------

@intrinsic
def _bits_to_float32(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as a float32 (a register move)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        value = args[0]
        if bits.bitwidth > 32:
            value = builder.trunc(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return types.float32(bits), codegen


@njit(cache=True)
def half_to_float(h):
    """float16 bits (uint16) -> float32, exact: normals re-biased, subnormals through an
    exact integer-to-float product, inf/NaN keep sign and payload (as NumPy's cast)."""
    x = np.uint32(h)
    sign = (x & np.uint32(0x8000)) << np.uint32(16)
    e = x & np.uint32(0x7C00)
    m = x & np.uint32(0x03FF)
    normal = _bits_to_float32(sign | (((x & np.uint32(0x7FFF)) << np.uint32(13)) + np.uint32(112 << 23)))
    special = _bits_to_float32(sign | np.uint32(0x7F800000) | (m << np.uint32(13)))
    sub = np.float32(m) * np.float32(2.0 ** -24)  # m * 2**-24: exact, a normal float32
    if sign:
        sub = -sub
    if e == np.uint32(0x7C00):
        return special
    if e == 0:
        return sub
    return normal


@njit(cache=True)
def bfloat16_to_float(h):
    """bfloat16 bits (uint16) -> float32: the upper half of the float32 bits."""
    return _bits_to_float32(np.uint32(h) << np.uint32(16))


@njit(cache=True)
def convert_bits(src, kind, dst):
    """dst[:] = values of the uint16 bit patterns src (float16 or bfloat16 per ``kind``)."""
    if kind == KIND_FLOAT16:
        for x in range(src.size):
            dst[x] = half_to_float(src[x])
    else:
        for x in range(src.size):
            dst[x] = bfloat16_to_float(src[x])


@njit(cache=True)
def exp_nonpos(x):
    """exp(x) in float32 for x <= 0 (-inf gives 0, NaN stays NaN), vectorizable.

    Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, Cephes' degree-6 polynomial
    (about 1 ulp), times 2**n built from bits. Compiled without fastmath so the
    reduction is not reassociated (flags are per instruction after inlining).
    """
    if x < np.float32(-87.0):  # below float32's normal range (NaN compares false)
        return np.float32(0.0)
    n = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
    r = x - n * np.float32(0.693359375)
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = p * r * r + r + np.float32(1.0)
    if not (n == n):  # NaN input
        return x
    return y * _bits_to_float32((np.int32(n) + np.int32(127)) << np.int32(23))


# -- the pieces: reader, visibility, score --------------------------------------------------

def load_keys(buf, r, h, j0, n, kind, scratch):
    """Keys j0..j0+n-1 of KV head h of row r as float32 [n * d] (implemented per buffer
    dtype by the overload below; plain Python cannot call it)."""
    raise NotImplementedError


@overload(load_keys, jit_options={"cache": True})
def _load_keys(buf, r, h, j0, n, kind, scratch):
    if buf.dtype == types.float32:
        def read_float32(buf, r, h, j0, n, kind, scratch):
            d = buf.shape[3]
            base = ((r * buf.shape[1] + h) * buf.shape[2] + j0) * d
            return buf.reshape(buf.size)[base:base + n * d]  # a view: no copy
        return read_float32
    if buf.dtype == types.uint16:
        def read_bits(buf, r, h, j0, n, kind, scratch):
            d = buf.shape[3]
            base = ((r * buf.shape[1] + h) * buf.shape[2] + j0) * d
            src = buf.reshape(buf.size)[base:base + n * d]
            dst = scratch[:n * d]
            convert_bits(src, kind, dst)
            return dst
        return read_bits
    return None


@njit(cache=True)
def visible_keys(q_pos):
    """Keys [lo, hi) seen by the query at absolute position q_pos: bottom-right causal."""
    return 0, q_pos + 1


@njit(cache=True)
def score(dot, scale):
    """The score of one (query, key) pair from its dot product."""
    return dot * scale


# -- attention -----------------------------------------------------------------------------

@njit(fastmath=FASTMATH, cache=True)
def _attend(qt, k_buf, v_buf, kind, r, h, start, t0, nq, G, j0, j1, scale, key_block,
            kscr, vscr, s, acc, m, l):
    """Online softmax of one tile (KV head h of row r, queries t0..t0+nq) over keys j0:j1.

    qt: [nq * G, d] float32, row t * G + g is query t0 + t of query head h * G + g;
    acc: [>= nq * G, d], m, l: [>= nq * G] are reset here and hold the unnormalized
    output, running max and sum on return; s: [>= nq * G, key_block] scratch.
    """
    d = qt.shape[1]
    R = nq * G
    for rr in range(R):
        m[rr] = _NEG_INF
        l[rr] = 0.0
        for c in range(d):
            acc[rr, c] = 0.0
    for js in range(j0, j1, key_block):
        n = min(key_block, j1 - js)
        kb = load_keys(k_buf, r, h, js, n, kind, kscr)
        for jj in range(n):
            j = js + jj
            kofs = jj * d
            for t in range(nq):
                lo, hi = visible_keys(start + t0 + t)
                seen = lo <= j and j < hi
                for g in range(G):
                    rr = t * G + g
                    if seen:
                        dot = np.float32(0.0)
                        for c in range(d):
                            dot += qt[rr, c] * kb[kofs + c]
                        s[rr, jj] = score(dot, scale)
                    else:
                        s[rr, jj] = _NEG_INF
        for rr in range(R):
            bm = _NEG_INF
            for jj in range(n):
                bm = max(bm, s[rr, jj])
            mn = max(m[rr], bm)
            if mn == _NEG_INF:  # every key so far is masked: nothing to add
                for jj in range(n):
                    s[rr, jj] = 0.0
                continue
            if mn != m[rr]:
                alpha = exp_nonpos(m[rr] - mn)
                l[rr] *= alpha
                for c in range(d):
                    acc[rr, c] *= alpha
                m[rr] = mn
            tot = np.float32(0.0)
            for jj in range(n):
                p = exp_nonpos(s[rr, jj] - mn)
                s[rr, jj] = p
                tot += p
            l[rr] += tot
        vb = load_keys(v_buf, r, h, js, n, kind, vscr)
        for rr in range(R):
            for jj in range(n):
                p = s[rr, jj]
                vofs = jj * d
                for c in range(d):
                    acc[rr, c] += p * vb[vofs + c]


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def attention_items(q, k_buf, v_buf, kind, rows, lens, n_new, items, run_starts, part_rows,
                    scale, key_block, out, lse, o_part, ml_part):
    """Every item of the plan; runs of items go to threads (one prange index per run).

    q: [B, Hq, T, d] float32; k_buf, v_buf: [rows_total, Hkv, max_len, d] float32, or
    uint16 bits of float16/bfloat16 (``kind``); items: int64 [n_items, 7] rows
    (i, h0, h1, t0, t1, j0, j1), run r being items run_starts[r]:run_starts[r+1];
    part_rows[it]: -1 when the item covers every key its queries see (it writes
    out [B, Hq, T, d] and lse [B, Hq, T] itself), else the first row of its
    (h1-h0) * nq * G rows in o_part [P, d] (unnormalized output) and ml_part [P, 2]
    (running max, sum), merged by ``merge_pieces``.
    """
    d = q.shape[3]
    Hkv = k_buf.shape[1]
    G = q.shape[1] // Hkv
    qmax = 1
    for it in range(items.shape[0]):
        qmax = max(qmax, items[it, 4] - items[it, 3])
    Rmax = qmax * G
    for run in prange(run_starts.size - 1):
        kscr = np.empty(key_block * d, np.float32)
        vscr = np.empty(key_block * d, np.float32)
        s = np.empty((Rmax, key_block), np.float32)
        acc = np.empty((Rmax, d), np.float32)
        m = np.empty(Rmax, np.float32)
        l = np.empty(Rmax, np.float32)
        qt = np.empty((Rmax, d), np.float32)
        for it in range(run_starts[run], run_starts[run + 1]):
            i, h0, h1, t0, t1, j0, j1 = (items[it, 0], items[it, 1], items[it, 2], items[it, 3],
                                         items[it, 4], items[it, 5], items[it, 6])
            nq = t1 - t0
            R = nq * G
            r = rows[i]
            start = lens[i] - n_new[i]  # query t sits at absolute position start + t
            for h in range(h0, h1):
                for t in range(nq):
                    for g in range(G):
                        for c in range(d):
                            qt[t * G + g, c] = q[i, h * G + g, t0 + t, c]
                _attend(qt, k_buf, v_buf, kind, r, h, start, t0, nq, G, j0, j1, scale,
                        key_block, kscr, vscr, s, acc, m, l)
                base = part_rows[it]
                for t in range(nq):
                    for g in range(G):
                        rr = t * G + g
                        if base < 0:
                            inv = np.float32(1.0) / l[rr]
                            for c in range(d):
                                out[i, h * G + g, t0 + t, c] = acc[rr, c] * inv
                            lse[i, h * G + g, t0 + t] = m[rr] + np.log(l[rr])
                        else:
                            p = base + (h - h0) * R + rr
                            for c in range(d):
                                o_part[p, c] = acc[rr, c]
                            ml_part[p, 0] = m[rr]
                            ml_part[p, 1] = l[rr]


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def merge_pieces(groups, group_starts, piece_rows, o_part, ml_part, G, out, lse):
    """Combine the key pieces of split items through their log-sum-exp.

    groups: int64 [n_groups, 5] (i, h0, h1, t0, t1); group gi's pieces start at rows
    piece_rows[group_starts[gi]:group_starts[gi+1]] of o_part / ml_part (layout of
    ``attention_items``). Writes the normalized out and lse of the group's queries.
    """
    d = o_part.shape[1]
    for gi in prange(groups.shape[0]):
        i, h0, h1, t0, t1 = groups[gi, 0], groups[gi, 1], groups[gi, 2], groups[gi, 3], groups[gi, 4]
        nq = t1 - t0
        R = nq * G
        for hh in range(h1 - h0):
            for rr in range(R):
                row = hh * R + rr
                mx = _NEG_INF
                for pi in range(group_starts[gi], group_starts[gi + 1]):
                    mx = max(mx, ml_part[piece_rows[pi] + row, 0])
                if mx == _NEG_INF:  # no piece saw a key: the query stays 0 / -inf
                    continue
                t, g = rr // G, rr % G
                hq = (h0 + hh) * G + g
                tot = np.float32(0.0)
                for pi in range(group_starts[gi], group_starts[gi + 1]):
                    p = piece_rows[pi] + row
                    w = exp_nonpos(ml_part[p, 0] - mx)
                    tot += w * ml_part[p, 1]
                    for c in range(d):
                        out[i, hq, t0 + t, c] += w * o_part[p, c]
                inv = np.float32(1.0) / tot
                for c in range(d):
                    out[i, hq, t0 + t, c] *= inv
                lse[i, hq, t0 + t] = mx + np.log(tot)
