"""The NumPy backend's small calls as one pass over the whole batch.

A decode step of a small model is many tiny products. The item kernel
(``numpy_attention``) runs one item per row and KV-head range, each a dozen NumPy calls,
so at B=8 rows of 16 tokens (Hkv=8, G=4, d=64) a layer's attention cost about 0.5 ms of
call overhead for 260K multiply-adds, and the append's per-row slice assignments another
0.1 ms. Here both are one set of NumPy calls over every row at once:

- ``write_tokens``: every entry's new tokens land by one fancy-indexed assignment per
  buffer (plain storage, contiguous rows or pages); ``write_coded``: the same for codes
  and scales, every new token encoded by one call of the codec (both for appends of at
  most ``WRITE_MAX_ROW_TOKENS`` per entry; longer ones are written row by row);
- ``attend_batch``: the keys ``k0..k1`` that some query of the call sees, of every row
  side by side (a view where the rows are consecutive), one stacked matmul for the
  scores ``[B, Hkv, G * T, k1 - k0]``, the mask of each row's own causal window (built
  once per step by ``plan_batch``), one softmax and one stacked matmul for P V;
- over pages, ``gather_pages`` first copies those keys and values of every row into this
  thread's reused buffers ``[B, Hkv, k1 - k0, d]``: one ``np.take`` per pool through an
  index of pool rows built once per step (``PageIndex``), so no buffer is allocated per
  layer (fresh ones cost their page faults: a one-pass attempt that allocated them ran
  slower than the items); in codes, the codes and scales are read so and decoded at once
  (``decode_values``) into reused float32 buffers.

A row shorter than the longest (or whose window starts later) reads columns past its own
keys: its scores there are masked, and its values there are read as zeros (such rows'
values are copied with those columns zeroed: a slot past a row's length may hold anything,
NaN included, and p = 0 times NaN is NaN). A query that sees no key (padding, an empty row) gives
exactly 0 and lse -inf. The padded work is bounded: ``plan_batch`` takes a call only when
its scores are at most ``BATCH_MAX_SCORES`` and at most ``BATCH_MAX_WASTE`` times the
scores the item kernel would compute; otherwise the items run.
"""

from __future__ import annotations

import contextlib

import numpy as np

from gqakv.core.semantics import block_keys, transform_scores, visible_mask
from gqakv.ops.cache_ops import write_kv_array_api
from gqakv.storage.store import CONTIGUOUS, PAGED

from .cpu_plan import THIN_QUERIES, _threads
from .scratch import thread_buffer

_QUIET = contextlib.nullcontext()

#: Scores ``B x Hq x T x keys`` of a call at most (512 KiB of float32). Below
#: ``numpy_attention.PARALLEL_MIN_WORK`` (2^18) the items run on one thread too, and the
#: one pass costs what they do less their per-item overhead; at 2^18 their two threads
#: pay. numpy backend, float32, one pass / items, alternating in one process (2-core AMD
#: EPYC, load 1.5): decode B=8 Hkv=8 G=4 d=64 at L=16 0.55-0.58, L=128 0.27-0.67, L=256
#: 0.67-0.68, L=512 0.93, L=1,024 0.95; B=32 L=64 d=128 0.65-0.70; B=1 L=512 d=128 0.98;
#: a 16-query chunk over 256 keys (Hq 32, d 128, 2^17 scores) 1.02-1.08; B=4 L=2,048
#: d=128 (2^18) 1.13.
BATCH_MAX_SCORES = 1 << 17
#: Over codes, at most this many scores (and ``BATCH_MAX_SCORES``): the one pass decodes
#: every key of the call into float32 buffers, which outgrow the caches where the items
#: decode block by block. numpy backend, one thread, one pass / items (2-core AMD EPYC,
#: load about 1; B=8 Hkv=8 G=4 d=64 unless named): int8 L=16 0.36, L=128 (2^15 scores)
#: 0.75, e4m3 L=128 0.85, int8_g32 L=128 (pages of 16) 0.66; L=256 (2^16) int8 0.88,
#: int4_g32 0.84, e4m3 1.11; L=512 int8 1.24, B=1 d=128 1.18.
BATCH_MAX_CODED_SCORES = 1 << 15
#: The padded scores at most this many times the items' own (rows of unequal length pad
#: to the longest; padded query slots count too).
BATCH_MAX_WASTE = 2


class PageIndex:
    """Where each key ``k0..k1`` of each entry and KV head lies in a paged store's pools,
    as rows of the pool seen as ``[num_pages * Hkv * P, d]``: ``rows`` ``[B, Hkv, k1 -
    k0]`` int64 (keys outside an entry's own range point at row 0: their scores are
    masked and their values zeroed). Built for one page table state: ``stamp`` is the
    table's entries array and ``version`` (``PageTable.version``), checked before each use."""

    __slots__ = ("stamp", "rows")

    def __init__(self, stamp, rows):
        self.stamp, self.rows = stamp, rows


def _page_index(store, rows, k0: int, k1: int, ranges) -> PageIndex | None:
    """The ``PageIndex`` of entries ``rows`` (``[B]``) over keys ``k0..k1`` (each entry's own
    ``ranges``, or all of them when None), or None when a key an entry sees is on no page
    or on a page outside the pool (the items raise those errors) or the pools are not
    C-contiguous."""
    table = store.page_table
    if not all(buf.flags.c_contiguous for buf in store.buffers):
        return None
    P, Hkv = store.page_size, store.kv_heads
    keys = np.arange(k0, k1)
    pages = table.entries[np.asarray(rows)[:, None], keys // P].astype(np.int64)  # [B, K]
    if ranges is not None:
        outside = (keys < np.array([lo for lo, _ in ranges])[:, None]) | (
            keys >= np.array([hi for _, hi in ranges])[:, None])
        if (pages[~outside] < 0).any():
            return None
        pages[outside] = 0
    elif (pages < 0).any():
        return None
    if pages.size and int(pages.max()) >= store.k.shape[0]:
        return None  # an entry outside the pool: the items' reads raise
    # pool row of (page, head, offset): (page * Hkv + head) * P + offset
    index = (pages[:, None, :] * Hkv + np.arange(Hkv)[None, :, None]) * P + (keys % P)
    return PageIndex((table.entries, table.version), index)


class BatchPlan:
    """What ``attend_batch`` needs of one batch, worked out once per step.

    rows: ``slice`` of consecutive rows (K/V read as views) or ``[B]`` row indices;
    k0, k1: the keys read, the union of every entry's (``block_keys``); T: query slots
    per entry (packed: n_new, equal for every entry); hidden: bool ``[B, 1, 1, T, k1 -
    k0]`` (True: the query does not see the key) or None when every query sees every key;
    empty: bool ``[B, Hkv, G * T, 1]`` (True: the tile row's query sees no key) or None
    when none is;
    ranges: ``[(lo, hi)]`` per entry, the keys its queries see, when some entry's differ
    from ``k0..k1`` (its values there are copied, the rest zeroed), else None; packed:
    whether q is ``[B * T, Hq, d]``; pages: the ``PageIndex`` of a paged store (None:
    contiguous).
    """

    __slots__ = ("rows", "k0", "k1", "T", "hidden", "empty", "ranges", "packed", "pages")

    def __init__(self, rows, k0: int, k1: int, T: int, hidden, empty, ranges, packed: bool,
                 pages: PageIndex | None = None):
        self.rows, self.k0, self.k1, self.T = rows, k0, k1, T
        self.hidden, self.empty, self.ranges, self.packed = hidden, empty, ranges, packed
        self.pages = pages


def plan_batch(store, inputs, params, q_shape) -> BatchPlan | None:
    """The batch's ``BatchPlan`` when one pass serves it (storage without leading axes,
    contiguous or paged in C-contiguous pools, plain or in the codes the BLAS path reads;
    no ALiBi, draft tree or batch-invariant mode; packed queries only when every entry has
    as many; scores within ``BATCH_MAX_SCORES`` (codes: ``BATCH_MAX_CODED_SCORES``) and
    ``BATCH_MAX_WASTE``), else None (the items run)."""
    if (store.kind not in (CONTIGUOUS, PAGED) or store.leading
            or not isinstance(store.k, np.ndarray) or params.alibi_slopes is not None
            or getattr(inputs, "tree", None) is not None or inputs.invariant):
        return None
    lens, n_new = inputs.lens, inputs.n_new
    B = len(n_new)
    packed = len(q_shape) == 3
    if packed:
        if B == 0 or int(n_new.min()) != int(n_new.max()):
            return None
        T = int(n_new[0])
    else:
        T = int(q_shape[2])
    spans = [block_keys(params, int(lens[i]), int(n_new[i]), 0, int(n_new[i])) if n_new[i] else None
             for i in range(B)]
    live = [s for s in spans if s is not None and s[1] > s[0]]
    if not live:
        return None  # nothing to read: the items return zeros at once
    k0, k1 = min(s[0] for s in live), max(s[1] for s in live)
    own = sum(int(n_new[i]) * (s[1] - s[0]) for i, s in enumerate(spans) if s is not None)
    padded = B * T * (k1 - k0)
    limit = min(BATCH_MAX_SCORES, BATCH_MAX_CODED_SCORES) if store.quantized else BATCH_MAX_SCORES
    if padded * int(q_shape[1]) > limit or padded > BATCH_MAX_WASTE * own:
        return None  # (q_shape[1]: Hq in both layouts)
    hidden = np.zeros((B, 1, 1, T, k1 - k0), dtype=bool)
    for i, span in enumerate(spans):
        L, n = int(lens[i]), int(n_new[i])
        if span is None:
            hidden[i] = True
            continue
        hidden[i, ..., n:, :] = True  # padding slots
        visible = visible_mask(params, L, n, 0, n, k0, k1)
        if visible is not None:
            hidden[i, ..., :n, :] = ~visible
    uneven = any(s != (k0, k1) for s in spans)
    ranges = [s if s is not None else (k0, k0) for s in spans] if uneven else None
    rows = np.asarray(inputs.rows, dtype=np.int64)
    pages = None
    if store.kind == PAGED:
        pages = _page_index(store, rows, k0, k1, ranges)
        if pages is None:
            return None
    r0 = int(rows[0])
    consecutive = bool(np.array_equal(rows, np.arange(r0, r0 + B)))
    empty = hidden.all(axis=-1, keepdims=True)  # [B, 1, 1, T, 1]
    if empty.any():  # as the tiles' rows (row g * T + t of KV head h), once per step
        Hkv = store.kv_heads
        G = int(q_shape[1]) // Hkv
        empty = np.ascontiguousarray(np.broadcast_to(empty, (B, Hkv, G, T, 1))).reshape(B, Hkv, G * T, 1)
    return BatchPlan(slice(r0, r0 + B) if consecutive else rows, k0, k1, T,
                     hidden if hidden.any() else None, empty if empty.any() else None, ranges,
                     packed, pages)


def attention(plan: BatchPlan, q, store, params, *, return_lse: bool):
    """Attention of ``q`` (``[B, Hq, T, d]``, packed ``[B * T, Hq, d]``) over ``store`` by
    ``plan``: out in q's shape and dtype and, if asked, lse (``[B, Hq, T]`` / ``[B * T,
    Hq]``, float32; float64 for float64 q). The keys are read and ``attend_batch`` does
    the arithmetic."""
    acc = np.float64 if q.dtype == np.float64 else np.float32
    out = np.zeros(q.shape, dtype=q.dtype)
    lse = np.full(q.shape[:-1], -np.inf, dtype=acc) if return_lse else None
    k, v = _keys_and_values(plan, store)
    if plan.packed:  # [B * T, Hq, d] as [B, Hq, T, d] (views)
        B = q.shape[0] // plan.T
        q4 = q.reshape(B, plan.T, *q.shape[1:]).swapaxes(1, 2)
        out4 = out.reshape(B, plan.T, *out.shape[1:]).swapaxes(1, 2)
        lse4 = None if lse is None else lse.reshape(B, plan.T, -1).swapaxes(1, 2)
    else:
        q4, out4, lse4 = q, out, lse
    attend_batch(q4, k, v, plan.hidden, plan.empty, params, acc, out4, lse4)
    return (out, lse) if return_lse else out


def attend_batch(q, k, v, hidden, empty, params, acc, out, lse) -> None:
    """The arithmetic (the host-time benchmark's kernel entry): ``q`` ``[B, Hq, T, d]``,
    ``k``/``v`` ``[B, Hkv, K, d]`` (any dtype, computed in ``acc``), ``hidden`` bool
    ``[B, 1, 1, T, K]`` or None, ``empty`` bool ``[B, Hkv, G * T, 1]`` (the tile row's
    query sees no key) or None; results into ``out`` ``[B, Hq, T, d]`` and ``lse`` ``[B, Hq, T]`` (or
    None). Query head h reads KV head h // G (row g * T + t of KV head h // G's tile)."""
    B, Hq, T, d = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qb = np.multiply(q, params.scale, dtype=acc)  # as the items: cast, then scaled
    kb = k if k.dtype == acc else k.astype(acc)
    vb = v if v.dtype == acc else v.astype(acc)
    qb = qb.reshape(B, Hkv, G * T, d)
    # hidden keys may be slots past a row's length, holding anything: their scores are
    # replaced, so what they hold (inf, NaN) makes no warning
    with np.errstate(invalid="ignore", over="ignore") if hidden is not None else _QUIET:
        if G * T <= THIN_QUERIES and _threads.k_major_scores():  # as the items' thin tiles
            s = np.ascontiguousarray(np.matmul(kb, qb.swapaxes(-1, -2)).swapaxes(-1, -2))
        else:
            s = np.matmul(qb, kb.swapaxes(-1, -2))  # [B, Hkv, G*T, K]
        s = transform_scores(params, s, np)
    if hidden is not None:
        np.copyto(s.reshape(B, Hkv, G, T, K), -np.inf, where=hidden)
    m = s.max(axis=-1, keepdims=True)  # [B, Hkv, G*T, 1]; -inf: the query sees no key
    # the lowest finite float where no key is seen (exp(-inf - it) = 0); NaN stays NaN
    shift = np.maximum(m, np.finfo(acc).min)
    sink = None
    if params.sinks is not None:  # a softmax term of value 0 per query head, where keys are seen
        sink = np.repeat(np.asarray(params.sinks, dtype=acc).reshape(1, Hkv, G), T, axis=-1)
        sink = np.where(m > -np.inf, sink.reshape(1, Hkv, G * T, 1), -np.inf)
        np.maximum(shift, sink, out=shift)
    s -= shift
    np.exp(s, out=s)
    total = s.sum(axis=-1, keepdims=True)
    if sink is not None:
        total += np.exp(sink - shift)
    o = np.matmul(s, vb)  # [B, Hkv, G*T, d]
    if empty is None:
        o /= total
    else:  # out 0 (p = 0 times values the query never sees), lse -inf
        o /= np.where(empty, 1, total)
        np.copyto(o, 0, where=empty)
    out[...] = o.reshape(B, Hq, T, d)
    if lse is not None:
        with np.errstate(divide="ignore"):  # log(0) = -inf where no key is seen
            lse[...] = (shift + np.log(total)).reshape(B, Hq, T)


def _current_index(plan: BatchPlan, store) -> PageIndex:
    """``plan``'s ``PageIndex``, rebuilt first if ``store``'s page table is another or
    changed since it was planned."""
    table, index = store.page_table, plan.pages
    assert index is not None
    if index.stamp[0] is not table.entries or index.stamp[1] != table.version:
        rows = np.arange(plan.rows.start, plan.rows.stop) if isinstance(plan.rows, slice) else plan.rows
        fresh = _page_index(store, rows, plan.k0, plan.k1, plan.ranges)
        if fresh is None:
            raise RuntimeError("a key the batch reads is no longer on a page of its row "
                               "(the page table changed since the step was planned)")
        index = plan.pages = fresh
    return index


def _keys_and_values(plan: BatchPlan, store):
    """The keys and values ``plan`` reads, ``[B, Hkv, k1 - k0, d]`` each, values outside
    an entry's own keys zero: of contiguous plain rows, views (a copy where values are
    zeroed); over pages, gathered into this thread's scratch buffers (``gather_pages``);
    in codes, their codes and scales read so (views or gathered), then decoded into
    float32 scratch buffers (``decode_values``)."""
    k0, k1, ranges = plan.k0, plan.k1, plan.ranges
    index = None if plan.pages is None else _current_index(plan, store)
    if index is None:  # contiguous rows: views (or, for rows out of order, copies)
        parts = [buf[plan.rows, :, k0:k1] for buf in store.buffers]
    else:
        parts = [thread_buffer(f"batch part {i}", (*index.rows.shape, *buf.shape[3:]), buf.dtype)
                 for i, buf in enumerate(store.buffers)]
        gather_pages(store.buffers, index.rows, parts)
    if store.quantized:  # parts: K codes, V codes, K scales, V scales
        shape = (*parts[0].shape[:3], store.head_dim)
        k, v = thread_buffer("batch k", shape, np.float32), thread_buffer("batch v", shape, np.float32)
        # slots past an entry's own keys hold anything (codes with NaN or huge scales): their
        # values are zeroed and their scores masked below, so their decoding makes no warning
        with np.errstate(invalid="ignore", over="ignore") if ranges is not None else _QUIET:
            decode_values(store.codec, parts, k, v)
    else:
        k, v = parts
    if ranges is not None:
        if index is None and not store.quantized:  # the cache's own values: zeroed in a copy
            v = v.copy()
        _zero_outside(v, ranges, k0)
    return k, v


def _zero_outside(v, ranges, k0: int) -> None:
    """Zero ``v`` ``[B, Hkv, K, d]`` (keys from ``k0``) outside each entry's own keys
    ``ranges[i]`` (``(lo, hi)``): what those slots hold is never read as a value (it may
    be NaN, and p = 0 times NaN is NaN)."""
    for i, (lo, hi) in enumerate(ranges):
        v[i, :, :lo - k0] = 0
        v[i, :, hi - k0:] = 0


def gather_pages(pools, index, outs) -> None:
    """Paged parts side by side (the host-time benchmark's kernel entry): rows ``index``
    (``[B, Hkv, K]`` into each pool ``[num_pages, Hkv, P, *tail]`` seen as ``[num_pages *
    Hkv * P, *tail]``) into each out ``[B, Hkv, K, *tail]``."""
    for pool, out in zip(pools, outs):
        # mode "clip": the index is checked when built (``_page_index``), and "raise" would
        # gather into a temporary and copy it to out
        np.take(pool.reshape(-1, *pool.shape[3:]), index, axis=0, out=out, mode="clip")


def decode_values(codec, parts, k_out, v_out) -> None:
    """Codes to values (the host-time benchmark's kernel entry): ``parts`` (K codes, V
    codes, K scales, V scales, ``[B, Hkv, K, ...]``) decoded by ``codec`` into the float32
    ``k_out`` / ``v_out`` ``[B, Hkv, K, d]`` (``dequantize_into``: the values the items'
    blocks hold)."""
    kc, vc, ks, vs = parts
    codec.dequantize_into(kc, ks, k_out)
    codec.dequantize_into(vc, vs, v_out)


def write_tokens(k_buf, v_buf, k_new, v_new, dst_rows, dst_slots, src) -> None:
    """The append's byte moves (the host-time benchmark's kernel entry): token ``j`` of
    the call, ``src[j]`` (``(entries, slots)`` of padded ``[B, Hkv, T, d]`` or
    ``(rows,)`` of packed ``[N, Hkv, d]``), into ``[dst_rows[j], :, dst_slots[j]]`` of
    ``k_buf``/``v_buf`` ``[rows, Hkv, max_len, d]`` (paged: pages and page offsets of a
    pool ``[num_pages, Hkv, P, d]``), cast to their dtype."""
    if len(src) == 2:
        e, t = src
        k_buf[dst_rows, :, dst_slots] = k_new[e, :, t]
        v_buf[dst_rows, :, dst_slots] = v_new[e, :, t]
    else:
        k_buf[dst_rows, :, dst_slots] = k_new[src[0]]
        v_buf[dst_rows, :, dst_slots] = v_new[src[0]]


def write_coded(k_parts, v_parts, codec, k_new, v_new, dst_rows, dst_slots, src) -> None:
    """``write_tokens`` for a codec that stores codes and scales (the host-time benchmark's
    kernel entry): the call's new tokens gathered ``[N, Hkv, d]``, encoded at once
    (``codec.encode_keys`` / ``encode``: each token from its own values alone, so the
    parts are those of per-row writes), each part into its buffer by one assignment.
    ``k_parts`` / ``v_parts``: ``(codes, scales)`` buffers ``[rows, Hkv, max_len, ...]``
    (paged: ``[num_pages, Hkv, P, ...]``)."""
    if len(src) == 2:
        e, t = src
        k_tok, v_tok = k_new[e, :, t], v_new[e, :, t]
    else:
        k_tok, v_tok = k_new[src[0]], v_new[src[0]]
    for parts, values in ((k_parts, codec.encode_keys(np, k_tok)), (v_parts, codec.encode(np, v_tok))):
        for buf, value in zip(parts, values):
            buf[dst_rows, :, dst_slots] = value


#: Appends with more new tokens than this in some entry are written row by row
#: (``write_rows``): one fancy-indexed assignment (and one encode) of every token pays for
#: a decode step's rows but not for prefill chunks, whose slices copy faster and whose
#: whole-call temporaries (over 128 KiB) are fresh mappings each time. numba backend, Hkv
#: 8, d 128, float32 input, one assignment / row by row (2-core AMD EPYC, load 3, the
#: median of 5): int8 B=8 n=1 0.12 / 0.58 ms, n=4 0.25 / 0.69, n=8 1.07 / 0.80, B=64
#: n=1 1.5 / 6.6 (16-token pages), B=1 n=512 18.1 / 7.0; plain B=8 n=8 0.084 / 0.073
#: (numpy), B=4 n=512 7.4 / 1.06.
WRITE_MAX_ROW_TOKENS = 4


def write_rows(store, k_new, v_new, inputs) -> None:
    """An append written entry by entry (the host-time benchmark's kernel entry): the
    generic per-row writes (``write_kv_array_api``: ``store.put`` of each entry's tokens,
    page by page through the table; codes encoded per entry)."""
    write_kv_array_api(store, k_new, v_new, inputs.rows, inputs.starts, inputs.n_new,
                       inputs.offsets)


def append(store, k_new, v_new, inputs) -> None:
    """Every entry's new tokens into ``store`` (storage without leading axes, NumPy
    buffers, a codec ``route_write`` declares) by ``write_tokens`` (plain values) or
    ``write_coded`` (codes and scales), or row by row (``write_rows``) when an entry has
    more than ``WRITE_MAX_ROW_TOKENS``: entry i's first ``n_new[i]`` tokens at slots
    ``starts[i]...`` of row ``rows[i]``; paged, slot j of a row at offset j % P of the
    page its table names for j // P (reserved before: a slot on no page raises
    RuntimeError, nothing written)."""
    index = _write_index(inputs)
    if index is None:
        return
    rows, dst, src, by_rows = index
    if store.kind == PAGED:  # raises, before anything is written, for a slot on no page
        rows, dst = _paged_slots(store, rows, dst)
    if by_rows:
        return write_rows(store, k_new, v_new, inputs)
    if store.quantized:
        write_coded((store.k, store.k_scale), (store.v, store.v_scale), store.codec, k_new,
                    v_new, rows, dst, src)
    else:
        write_tokens(store.k, store.v, k_new, v_new, rows, dst, src)


#: The last paged append's ``(key, (pages, offsets))``: a step's layers share one page
#: table, so they translate their slots once (``_paged_slots``).
_last_paged: list = [(None, None)]


def _paged_slots(store, rows, dst):
    """(pages, offsets in them) of slots ``dst`` of ``rows`` by ``store``'s page table;
    RuntimeError (nothing written) for a slot on no page. Kept for the next call with the
    same index arrays, table entries and table version."""
    table = store.page_table
    entries, version = table.entries, table.version
    key_then, slots = _last_paged[0]  # one read: another thread may set it meanwhile
    if (key_then is not None and key_then[0] is rows and key_then[1] is dst
            and key_then[2] is entries and key_then[3] == version):
        return slots
    P = store.page_size
    pages = entries[rows, dst // P]
    if int(pages.min()) < 0:
        bad = int(np.flatnonzero(pages < 0)[0])
        raise RuntimeError(f"row {int(rows[bad])}'s slot {int(dst[bad])} is on no page (its "
                           "table entry is -1): appends need their pages reserved first")
    slots = (pages, dst % P)
    _last_paged[0] = ((rows, dst, entries, version), slots)
    return slots


#: The last append's ``(inputs, index)``: a step's layers append by one ``AppendInputs``
#: (frozen), so their index arrays are made once per step.
_last_append: list = [(None, None)]


def _write_index(inputs):
    """``(dst_rows, dst_slots, src, by_rows)`` of ``write_tokens`` for ``inputs`` (``by_rows``:
    an entry has more than ``WRITE_MAX_ROW_TOKENS``, so ``write_rows`` writes it; the slots
    still serve the page check), None for no token."""
    inputs_then, index = _last_append[0]  # one read: another thread may set it meanwhile
    if inputs_then is inputs:
        return index
    n = np.asarray(inputs.n_new, dtype=np.int64)
    count = int(n.sum())
    index = None
    if count:
        entry = np.repeat(np.arange(len(n)), n)
        slot = np.arange(count) - np.repeat(np.cumsum(n) - n, n)  # token index within its entry
        rows = np.asarray(inputs.rows, dtype=np.int64)[entry]
        dst = np.asarray(inputs.starts, dtype=np.int64)[entry] + slot
        if inputs.offsets is None:
            src: tuple = (entry, slot)
        else:
            src = (np.asarray(inputs.offsets, dtype=np.int64)[entry] + slot,)
        index = (rows, dst, src, int(n.max()) > WRITE_MAX_ROW_TOKENS)
    _last_append[0] = (inputs, index)
    return index
