"""NumPy attention: BLAS matmuls on views of the live cache, spread over the cores.

The generic array-API code (``gqakv.ops.attention.attention_array_api``) is correct on
NumPy but runs one row after another through NumPy's stacked matmul, which lets
OpenBLAS thread each small product on its own: a decode step is a handful of
``[G, d] @ [d, L]`` products, too thin for BLAS threading to pay, so the step ran
near one core's speed. Here the same blocked online softmax is cut into independent
*items*, each ``(batch entry i, KV heads h0:h1, queries t0:t1, keys j0:j1)``, and
the items are shared among a few threads, with BLAS held to one thread meanwhile
so the two levels of threading never fight over the cores. NumPy's matmul and
ufuncs release the GIL, so the threads run in parallel.

One item kernel serves every storage: it reads each item's K/V key blocks through a
block reader (``numpy_readers``: a base reader per layout, contiguous rows or pages
through the page table, under a value reader per codec kind, plain values or codes
dequantized through the store's codec), so a layout or codec is a reader, never a
kernel of its own (``attention_store``; ``attention_numpy`` takes bare contiguous
buffers).

Work and memory:
- every item reads blocks of the live cache (views of contiguous rows, never past
  the row's length; pages: views or bounded gathers), so work follows the sum of live
  lengths;
- a row with more work than its share is split over its KV heads, then, if still
  too big (one long row with few KV heads), over its keys; key pieces are merged
  afterwards through their log-sum-exp;
- inside an item, keys are walked in blocks so that one block of scores
  ``[heads, G * nq, keys]`` holds at most ``score_block_elements`` values (1 MiB of
  float32 by default, sized to stay in a core's L2 cache). Peak temporary memory is
  therefore about ``workers x 3 x score_block_elements`` compute-dtype values (the
  scores and, for float16/bfloat16 caches, the K and V blocks cast to float32) plus
  the queries, the output and the partial outputs of split rows, independent of the
  cache length;
- an item holds at most ``MAX_TILE_ROWS`` query rows (a prefill chunk's heads are split
  into items of fewer heads), so its key blocks stay hundreds of keys long and its
  running output stays in L2: the online softmax rescales that output once per block, so
  short blocks over a large output cost more in memory traffic than the matmuls;
- float16 and bfloat16 caches are computed in float32: each K/V block is cast on the
  fly into a reused float32 buffer (NumPy's half-precision matmul is about 10x slower
  than float32, and its float16 cast is scalar code, so ``to_float32`` converts
  float16 through its bits; a backend may pass a faster cast, as numba's
  ``widen_block``, through ``attention_store``'s ``widen``), and the result is cast back
  to the cache's dtype.

A block's online-softmax step is ``attend``'s ``state_class`` (``SoftmaxState``: NumPy
passes over the scores; a backend may pass a faster one, as numba's
``FusedSoftmaxState``, whose ``add_causal`` masks causal and windowed blocks itself).

Attention variants (``gqakv.core.semantics``): a sliding window moves each query block's
first key (the planner's items start at ``block_keys``), so work and bytes read follow
min(L, W); the score hook ``semantics.transform`` (the soft-cap, then ALiBi's per-head
bias from each query's and key's positions, ``tile_heads``) runs on each block of scaled
scores before the mask; sinks join once per query, after its key pieces are merged
(``_with_sinks``).
"""

from __future__ import annotations

import os

import numpy as np

from gqakv.ops.merge import SoftmaxState
from gqakv.core.semantics import (AttentionParams, block_keys, common_keys, key_positions, query_positions,
                                  transform, transform_scores, visible_mask)

# Threads, work items and their sharing are planned in cpu_plan (shared with the numba
# backend); the names stay importable from here.
from .cpu_plan import (ENV_THREADS, INVARIANT_NO_SPLIT, ITEMS_PER_WORKER,  # noqa: F401
                       K_MAJOR_KERNELS, THIN_QUERIES, _plan, _share, _threads, _Threads, blas_spins)
from . import numpy_readers as readers
from .numpy_readers import MIN_BLOCK_KEYS, to_float32  # noqa: F401 (to_float32: its old home)

# One block of scores [heads, G * nq, keys], in elements (1 MiB of float32).
SCORE_BLOCK_ELEMENTS = 1 << 18
# Queries of one item (per row): 128 queries x G heads share each K/V block read.
QUERY_BLOCK = 128
#: Query rows (KV heads x G x queries) of one item at most: a prefill item's heads are
#: split further so that its key blocks stay long (SCORE_BLOCK_ELEMENTS / 512 = 512 keys)
#: and its running output (rows x d) stays in L2. With all 8 KV heads of a 256-query block
#: in one item (1,024 rows x 8), blocks were 32 keys long and every block streamed the
#: 4 MiB running output through memory twice: a 4,096-token prompt (Llama-3.1-8B heads,
#: float32, 2 threads) ran at 66 GFLOP/s, 158 with one head per item, 170 with 128-query
#: blocks of one head (the same quiet minute; sgemm 310).
MAX_TILE_ROWS = 512
#: Batch-invariant mode (``gqakv.core.invariance``): keys per block, from each query's first
#: visible key (each query is its own item, and keys are never split among threads).
INVARIANT_BLOCK_KEYS = 512
# A row's keys are split across threads only into pieces at least this long.
MIN_KEY_SPLIT = 1024
# Below this much work (query-key-head products) threads cost more than they save.
PARALLEL_MIN_WORK = 1 << 18
#: Where BLAS keeps its idle threads spinning (``cpu_plan.blas_spins``: NumPy's OpenBLAS
#: wheels), a call of fewer multiply-adds (query-key-head products x d) than this, planned
#: with the default worker count, runs its items on the calling thread and leaves their
#: matmuls to BLAS's own threads instead of two workers with BLAS held to one. In a model,
#: attention follows the model's own matmuls, whose workers still spin when it starts and
#: take a core from a second worker; a call this small ends inside their spin (about
#: 0.1 s). SmolLM2 and Llama-3.1-8B layers, float32, on the 2-core AMD machine (prompts
#: of 256 to 1,536 tokens at batch 1 to 8, and decode; rounds of alternating calls): right
#: after the layer's QKV matmul one worker took 0.53-1.1x the time of two (most rounds
#: 0.55-0.85), and 0.6-1.2x after idle threads; at 2^30.2 multiply-adds and above it lost
#: up to 1.8x after idle threads (performance guide, "Threads shared with the model's
#: BLAS"). Not measured on the Xeon.
SPINNING_BLAS_ONE_WORKER_MACS = 1 << 30


# -- the kernel ----------------------------------------------------------------------------

def item_queries(q, item, G: int, params, acc, offsets=None, widen=None):
    """An item's queries as one tile per KV head, scaled, in the compute dtype ``acc``:
    ``[hh, G * nq, d]`` (query head h0*G + kv*G + g reads KV head h0 + kv). q: padded
    [B, Hq, T, d], or packed [N, Hq, d] with ``offsets`` (entry i's first query's row).
    ``widen``: a faster cast of float16/bfloat16 queries (``attend``'s)."""
    tile = _tile(q, item, G, offsets)
    qb = None
    if widen is not None and tile.dtype != acc:
        qb = widen(tile, np.empty(tile.shape, dtype=acc))
    if qb is None:
        qb = tile.astype(acc)
    qb *= params.scale  # a Python float: no promotion
    i, h0, h1, t0, t1 = item[:5]
    return qb.reshape(h1 - h0, G * (t1 - t0), q.shape[-1])


def item_tiles(q, item, G: int, offsets=None):
    """An item's queries as they are stored (unscaled): ``[hh, G * nq, d]``."""
    i, h0, h1, t0, t1 = item[:5]
    return _tile(q, item, G, offsets).reshape(h1 - h0, G * (t1 - t0), q.shape[-1])


def _tile(x, item, G: int, offsets):
    """The item's part of a queries-shaped array, heads first: ``x[i, heads, t0:t1]``
    padded, ``x[offsets[i] + t0 : offsets[i] + t1, heads]`` transposed packed (a view)."""
    i, h0, h1, t0, t1 = item[:5]
    if offsets is None:
        return x[i, h0 * G:h1 * G, t0:t1]
    s = int(offsets[i])
    return x[s + t0:s + t1, h0 * G:h1 * G].swapaxes(0, 1)


def fold_block(state, qb, kb, vb, *, params, L: int, n: int, t0: int, t1: int, js: int, je: int,
               heads=None, tree=None):
    """Fold keys ``js..je-1`` into ``state``: ``qb`` [hh, G*nq, d] from ``item_queries``,
    ``kb``/``vb`` [hh, je-js, d] in the compute dtype (however the storage was read).
    Scores, the score hook (``semantics.transform``: the soft-cap, then ALiBi's bias of
    each query head at its position against each key's), the mask of the row's last
    ``n`` of ``L`` queries ``t0..t1-1`` (``gqakv.core.semantics``), then the online softmax.
    ``heads``: the tile's query heads ``[hh, G, 1, 1]`` (``tile_heads``) when the hook
    needs positions (ALiBi), else None. The one block step of the item kernel, whatever
    the reader. ``tree``: the entry's draft tree (its mask, and positions by depth).
    """
    hh, rows_, _ = qb.shape
    nq = t1 - t0
    if rows_ <= THIN_QUERIES and _threads.k_major_scores():
        # same scores through the faster kernel; made contiguous because P @ V on a
        # transposed P is slow there too (the copy is only [hh, G*nq, keys])
        s = np.ascontiguousarray(np.matmul(kb, qb.swapaxes(-1, -2)).swapaxes(-1, -2))
    else:
        s = np.matmul(qb, kb.swapaxes(-1, -2))  # [hh, G*nq, je-js]
    if heads is None:  # the soft-cap, if any: before the mask
        s = transform_scores(params, s, np)
    else:  # positions matter: [hh, G, nq, keys], query head h at position L - n + t
        q_pos = query_positions(L, n, t0, t1, tree).reshape(1, 1, nq, 1)
        k_pos = key_positions(L, n, js, je, tree).reshape(1, 1, 1, je - js)
        s4 = transform(params, s.reshape(hh, rows_ // nq, nq, je - js), q_pos, k_pos, heads, np)
        s = s4.reshape(hh, rows_, je - js)
    # a state that masks causal / window blocks itself (numba_backend.FusedSoftmaxState)
    add_causal = None if tree is not None else getattr(state, "add_causal", None)
    if add_causal is not None and add_causal(s, vb, nq, L - n + t0 - js, params.window or 0):
        return
    _mask(s.reshape(hh, rows_ // nq, nq, je - js), params, L, n, t0, t1, js, je, tree)
    state.add(s, vb)


def _mask(s4, params, L: int, n: int, t0: int, t1: int, js: int, je: int, tree) -> None:
    """-inf into the scores ``s4`` ``[hh, G, nq, je - js]`` of keys a query does not see.
    Only the key columns outside the range every query of the block sees (``common_keys``:
    a causal block's diagonal part, a window's left edge) are looked at: the same values
    as masking the whole block, without building and applying a mask over the columns
    every query sees."""
    if tree is None:
        lo, hi = common_keys(params, L, n, t0, t1)
        a, b = min(max(lo, js), je), max(min(hi, je), js)  # [a, b): seen by all (a >= b: none)
        if a < b:
            for u, w in ((js, a), (b, je)):  # the columns left and right of it
                if u < w:
                    visible = visible_mask(params, L, n, t0, t1, u, w)
                    if visible is not None:
                        np.copyto(s4[..., u - js:w - js], -np.inf, where=~visible)
            return
    visible = visible_mask(params, L, n, t0, t1, js, je, tree=tree)  # None: nothing masked
    if visible is not None:
        np.copyto(s4, -np.inf, where=~visible)


def _attend_item(q, reader, lens, n_new, item, *, params, acc, score_block_elements, offsets=None,
                 block_keys_fixed=None, tree=None, state_class=SoftmaxState, widen=None):
    """Online softmax of one item over the blocks ``reader`` hands it (``numpy_readers``:
    a value reader over the store's base reader); returns its ``state_class`` state (o
    unnormalized). o: [hh, G * nq, d]; m, l: [hh, G * nq, 1], in ``acc``."""
    i, h0, h1, t0, t1, j0, j1, _ = item
    G = q.shape[1] // reader.kv_heads  # Hq: dim 1 padded and packed
    d = q.shape[-1]
    hh, nq = h1 - h0, t1 - t0
    L, n = int(lens[i]), int(n_new[i])
    qb = item_queries(q, item, G, params, acc, offsets, widen)
    heads = tile_heads(params, h0, h1, G)
    keys = (max(MIN_BLOCK_KEYS, score_block_elements // (hh * G * nq)) if block_keys_fixed is None
            else block_keys_fixed)  # batch-invariant: the same blocks whatever the tile
    state = state_class(np)
    for js, je, kb, vb in reader.blocks(i, h0, h1, j0, j1, keys=keys, acc=acc,
                                        block_elements=score_block_elements, d=d):
        fold_block(state, qb, kb, vb, params=params, L=L, n=n, t0=t0, t1=t1, js=js, je=je,
                   heads=heads, tree=tree)
    return state


def tile_heads(params, h0: int, h1: int, G: int):
    """The query heads of an item's tile as ``[h1 - h0, G, 1, 1]`` (KV head h0 + kv's
    query head g is (h0 + kv) * G + g), for a score hook that reads them (ALiBi); None
    when the call's hook does not (positions are then never formed)."""
    if params.alibi_slopes is None:
        return None
    return (np.arange(h0, h1)[:, None] * G + np.arange(G)).reshape(h1 - h0, G, 1, 1)


def _with_sinks(state, sinks, h0, h1, G, nq):
    """``state`` (every key of its queries summed) with the sink logits joined: a
    softmax term of value 0, i.e. a merge with a state of max ``sink``, sum 1, output 0.

    sinks: [Hq] in the compute dtype; the state's rows are [h1 - h0, G * nq] (query
    head h0 * G + row // nq). A query that saw no key (m = -inf) keeps out 0 and lse
    -inf (its sink is taken as -inf); a NaN max stays NaN.
    """
    m = state.m  # [hh, G * nq, 1]
    sink = np.repeat(sinks[h0 * G:h1 * G], nq).reshape(m.shape)
    sink = np.where(m > -np.inf, sink, -np.inf)
    pseudo = SoftmaxState(np, sink, np.ones_like(m), np.zeros_like(m))  # o broadcasts over d
    return SoftmaxState.merge(np, [state, pseudo])


def _finish(out, lse, item, state, G, sinks=None, offsets=None, narrow=None):
    """Normalize and store one item's (merged) result into out (q's layout) and lse;
    ``sinks`` ([Hq] or None) join here, once every key of the item's queries is summed.
    ``narrow``: a faster store of results into a lower-precision out (``attend``'s)."""
    i, h0, h1, t0, t1 = item[:5]
    if sinks is not None:
        state = _with_sinks(state, sinks, h0, h1, G, t1 - t0)
    o, lse_item = state.result()
    hh, nq, d = h1 - h0, t1 - t0, o.shape[-1]
    dst, o = _tile(out, item, G, offsets), o.reshape(hh * G, nq, d)
    if narrow is None or dst.dtype == o.dtype or narrow(o, dst) is None:
        dst[...] = o
    if lse is not None:
        _tile(lse, item, G, offsets)[...] = lse_item.reshape(hh * G, nq)


def attention_numpy(q, k_buf, v_buf, rows, lens, n_new, *, scale: float, return_lse: bool,
                    params: AttentionParams | None = None, **blocking):
    """NumPy attention over plain contiguous buffers; see ``gqakv.gqa_attention`` for the
    semantics. q: [B, Hq, T, d]; k_buf, v_buf: [rows_total, Hkv, max_len, d]; rows,
    lens, n_new: host int arrays [B]. ``params``: the call's ``AttentionParams``
    (default: plain causal with ``scale``); ``blocking``: ``attend``'s keywords."""
    if params is None:
        params = AttentionParams(scale=scale)
    reader = readers.Plain(readers.Rows((k_buf, v_buf), rows))
    return attend(q, reader, lens, n_new, params=params, return_lse=return_lse, **blocking)


class NumpyWork:
    """The planned part of a BLAS-path call (``plan_items``): the work items, their total
    cost and the worker count, for every layer of a step."""

    __slots__ = ("items", "total", "workers", "inputs", "block_keys", "batch")

    def __init__(self, items, total, workers: int, block_keys=None):
        self.items, self.total, self.workers = items, total, workers
        self.batch = None  # numpy_batch.BatchPlan: the call runs as one pass instead (set by the backend)
        self.inputs = None  # the AttentionInputs it was planned for (set by plan_attention)
        self.block_keys = block_keys  # fixed keys per block (batch-invariant), else None


def plan_items(lens, n_new, q_shape, kv_heads: int, params: AttentionParams, *,
               workers: int | None = None, query_block: int = QUERY_BLOCK,
               min_key_split: int = MIN_KEY_SPLIT, invariant: bool = False,
               trees=None, max_tile_rows: int = MAX_TILE_ROWS, blas_items: bool = True) -> NumpyWork:
    """``attend``'s items for these lengths and queries ``[B, Hq, T, d]`` (see ``_plan``).
    ``invariant`` (batch-invariant mode): one query and one KV head per item, no key
    splits, blocks of ``INVARIANT_BLOCK_KEYS`` keys (then capped by the readers for the
    head dim and dtype only), so a query's bits depend on its own row alone.
    ``max_tile_rows``: query rows per item at most (``MAX_TILE_ROWS``). ``workers``: None
    for the default (``cpu_plan._Threads.default_workers``), one where BLAS spins, the
    items' matmuls run on BLAS (``blas_items``: not an item kernel of the backend's own,
    whose one worker would run on one core) and the call is below
    ``SPINNING_BLAS_ONE_WORKER_MACS`` (GQAKV_NUM_THREADS unset)."""
    one_worker_below = 0  # work (products) below which the call is planned for one worker
    if workers is None:
        workers = _threads.default_workers()
        # invariant items hold one query each: too small for BLAS to thread them
        if (workers > 1 and blas_items and not invariant and not os.environ.get(ENV_THREADS)
                and blas_spins()):
            one_worker_below = -(-SPINNING_BLAS_ONE_WORKER_MACS // int(q_shape[-1]))
    G = int(q_shape[1]) // kv_heads
    if invariant:
        query_block, min_key_split = 1, INVARIANT_NO_SPLIT
    items, total = _plan(lens, n_new, kv_heads, G, workers, query_block, min_key_split, params=params,
                         one_head=invariant, trees=trees, max_tile_rows=max_tile_rows,
                         parallel_min_work=one_worker_below)
    if total < one_worker_below:
        workers = 1  # attend runs one worker's items outside the guard: BLAS keeps its threads
    return NumpyWork(items, total, workers, INVARIANT_BLOCK_KEYS if invariant else None)


def attention_store(q, store, inputs, params, *, return_lse: bool, gather=None, widen=None,
                    narrow=None, dequantize=None, **blocking):
    """The NumPy backend's fast path: attention of ``q`` [B, Hq, T, d] over a KVStore
    without leading axes of any layout and codec ``numpy_readers.reader_of`` reads
    (``numpy_backend.FAST_PATHS`` declares which); see ``gqakv.gqa_attention``.
    ``gather``: the paged reader's faster page copy (``numpy_readers.Pages``); ``widen``,
    ``narrow``: faster float16/bfloat16 casts of K/V blocks and queries and of results
    (``numpy_readers.Plain``, ``attend``); ``dequantize``: a faster dequantization of
    code blocks (``numpy_readers.Coded``); ``blocking``: ``attend``'s keywords
    (``planned``: a ``plan_items`` of this batch)."""
    reader = readers.reader_of(store, inputs.rows, gather, widen, dequantize)
    return attend(q, reader, inputs.lens, inputs.n_new, params=params, return_lse=return_lse,
                  widen=widen, narrow=narrow,
                  offsets=getattr(inputs, "offsets", None), trees=entry_trees(inputs),
                  invariant=getattr(inputs, "invariant", False), **blocking)


def entry_trees(inputs):
    """``inputs.entry_tree`` (entry i -> its draft tree) when the call has a tree, else None."""
    return inputs.entry_tree if getattr(inputs, "tree", None) is not None else None


def attend(q, reader, lens, n_new, *, params: AttentionParams, return_lse: bool,
           workers: int | None = None,
           score_block_elements: int = SCORE_BLOCK_ELEMENTS,
           query_block: int = QUERY_BLOCK,
           min_key_split: int = MIN_KEY_SPLIT,
           parallel_min_work: int = PARALLEL_MIN_WORK,
           max_tile_rows: int = MAX_TILE_ROWS,
           planned: NumpyWork | None = None, offsets=None, into=None, invariant: bool = False,
           trees=None, state_class=SoftmaxState, item_kernel=None, widen=None, narrow=None):
    """The item kernel over validated inputs: plan the items, share them among threads,
    read each item's K/V blocks through ``reader`` (``numpy_readers``), merge key pieces.

    q: [B, Hq, T, d], or packed [N, Hq, d] with ``offsets`` ([B]: entry i's first query's
    row; out and lse are then [N, Hq, d] and [N, Hq]); lens, n_new: host int arrays [B].
    ``workers`` threads (default:
    GQAKV_NUM_THREADS, else the BLAS thread count) share the items; the remaining
    keywords expose the blocking so tests can drive every split on small shapes;
    ``planned``: the items ``plan_items`` made for this batch (planned here when None).
    ``into``: ``(out, lse)`` arrays (q's shape, and without d) receiving this batch's
    queries' results in place, left as they are elsewhere (another part of a packed
    batch writes there); returned. ``invariant``: batch-invariant items and blocks when
    planned here (``plan_items``; a ``planned`` work keeps its own). ``trees``: None, or
    entry i -> its draft tree (``gqakv.core.tree.EntryTree``). ``state_class``: the online
    softmax a block is folded by (``SoftmaxState``'s interface; the numba backend fuses its
    passes, ``numba_backend.FusedSoftmaxState``). ``widen(x, out)`` / ``narrow(x, out)``:
    a backend's faster casts of float16/bfloat16 queries to the compute dtype and of
    results back to q's dtype (``numba_backend.widen_block`` / ``narrow_block``), each
    returning ``out``, or None to leave that cast to NumPy.
    """
    Hq = q.shape[1]  # dim 1 in both layouts
    Hkv = reader.kv_heads
    G = Hq // Hkv
    acc = np.float64 if q.dtype == np.float64 else np.float32
    if into is None:
        out = np.zeros(q.shape, dtype=q.dtype)
        lse = np.full(q.shape[:-1], -np.inf, dtype=acc) if return_lse else None
    else:
        out, lse = into
    sinks = None if params.sinks is None else np.asarray(params.sinks, dtype=acc)  # [Hq]
    fast_item = None if item_kernel is None else item_kernel(q, reader, params, trees)
    if planned is None:
        planned = plan_items(lens, n_new, q.shape, Hkv, params, workers=workers,
                             query_block=query_block, min_key_split=min_key_split,
                             invariant=invariant, trees=trees, max_tile_rows=max_tile_rows,
                             blas_items=fast_item is None)
    items, total, workers = planned.items, planned.total, planned.workers
    if not items:
        return (out, lse) if return_lse else out
    if total < parallel_min_work:
        workers = 1

    def run(batch):
        """Compute a run of items; finish whole ones, hand back key pieces for merging."""
        pieces = []
        for item in batch:
            i, t0, t1, j0, j1 = item[0], item[3], item[4], item[5], item[6]
            tree = None if trees is None else trees(i)
            state = None if fast_item is None else fast_item(
                q, reader, lens, n_new, item, params=params, score_block_elements=score_block_elements,
                tiles=item_tiles(q, item, G, offsets), block_keys_fixed=planned.block_keys)
            if state is None:  # no fast item kernel, or it declined this item
                state = _attend_item(q, reader, lens, n_new, item, params=params, acc=acc,
                                     score_block_elements=score_block_elements, offsets=offsets,
                                     block_keys_fixed=planned.block_keys, tree=tree,
                                     state_class=state_class, widen=widen)
            if (j0, j1) == block_keys(params, int(lens[i]), int(n_new[i]), t0, t1, tree):  # all its keys
                # items write disjoint parts of out
                _finish(out, lse, item, state, G, sinks, offsets, narrow)
            else:
                pieces.append((item, state))
        return pieces

    if workers == 1 or len(items) == 1:
        pieces = run(items)
    else:
        with _threads:
            futures = [_threads.pool(workers).submit(run, batch) for batch in _share(items, workers)]
            pieces = [p for f in futures for p in f.result()]
    _merge(out, lse, pieces, G, sinks, offsets, narrow)
    return (out, lse) if return_lse else out


def _merge(out, lse, pieces, G, sinks=None, offsets=None, narrow=None):
    """Combine the key pieces of split items (``SoftmaxState.merge``) and store them
    (sinks join after the merge, never per piece)."""
    groups: dict[tuple, list] = {}
    for item, state in pieces:
        groups.setdefault(item[:5], []).append(state)
    for key, states in groups.items():
        _finish(out, lse, key, SoftmaxState.merge(np, states), G, sinks, offsets, narrow)
