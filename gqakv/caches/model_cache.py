"""A model-wide KV cache: every layer in one allocation, lengths shared by all layers.

``k`` and ``v`` are each ``[layers, B, Hkv, max_len, d]``; ``cache.layer(l)`` is a
KVCache whose buffers are the views ``k[l]``, ``v[l]`` and whose lengths are the
model's, so attention and the row indirection run through the same code as a
single-layer cache. A forward pass is one *step*::

    with cache.step(n_new) as step:              # validates lengths and capacity once
        for l, block in enumerate(model.layers):
            q, k_new, v_new = block.qkv(x, positions=step.starts)   # [B, H, T, d]
            x = block.finish(step.attend(l, q, k_new, v_new))
    # here, and only here, every row's length advanced by n_new[b]

Inside the step each layer's K/V is written at the rows' current lengths, i.e. past
the live tokens, where no reader of the cache looks; attention inside the step sees
them. The lengths advance once, when the block exits normally and every layer was
written exactly once. If anything raises inside the block, nothing advances, so no
live token and no length has changed (only dead slots past the lengths were written).

CUDA graphs (the cupy backend): a fixed plan (``step.plan_attention(..., fixed=True)``)
taken by each later step with ``step.adopt(plan)`` holds the step's device side, the
append's included, so a step's layers can be captured once and replayed with
``step.replay(launch)`` (docs/guides/serving.md, "Fixed plans").
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from ..core.dims import check_dim, check_dims
from ..core.inputs import (_rows, check_capacity, check_flag, check_queries, check_same_layout,
                           host_ints, immutable_ints, validate_append, validate_attention_batch)
from ..ops.plan import AttentionPlan, packed_or_padded_shape
from ..core.units import human_bytes
from ..storage.ring import storage_for
from ..storage.sizing import resolve_model
from ..storage.store import PAGED, StorageSpec
from . import cache as _cache
from .cache import KVCache, Lengths, RowsAndLengths

_LAYER_VIEW = ("it is one layer of a ModelKVCache, whose lengths are shared by all layers; "
               "write through ModelKVCache.step(...) and move rows with the ModelKVCache's "
               "reorder/fork/truncate/reset")


class ModelKVCache(RowsAndLengths):
    """K/V for every layer of a model, allocated once, with lengths shared by all layers.

    Args:
        layers: number of attention layers.
        batch: B, number of rows (sequences or request slots).
        kv_heads: Hkv; max_len: capacity in tokens of every row; head_dim: d.
        dtype: "float32" (default), "float16", "bfloat16", "float64" or a dtype object.
        backend: a backend name, a Backend, "auto" or None (see ``gqakv.get_backend``).
        storage: the storage kind (``gqakv.storage.store.KINDS``): "contiguous" (default) or "paged".
        page_size: tokens per page; giving it makes the storage paged (``gqakv.storage.paged``):
            every layer pages through one shared page table, and a step takes its pages
            once, for all layers, when it opens (``gqakv.OutOfPages`` there, with nothing
            changed, when the pool is short). Default for ``storage="paged"``: 16.
        num_pages: paged storage: pages in the pool (each page holds ``page_size`` tokens
            of every layer); default every row at ``max_len`` (no overcommit).
        kv_dtype: None, "int8" or "float8_e4m3fn": K/V stored quantized with per-token
            scales, as in ``KVCache``.
        prefix_cache: paged storage: a prefix cache over the shared page table, as
            ``PagedKVCache``'s (``match_prefix`` / ``cache_prefix`` act on every layer at
            once: a page holds its tokens of every layer). Default False.
        windows: None (default: every layer keeps every token), or one entry per layer:
            None for a full-attention layer, W for a sliding-window layer (window-sized
            storage, as ``PagedKVCache``'s ``window``; the layer must attend with
            ``window=W`` or a smaller one). ``storage`` defaults to "paged" then; with
            ``storage="contiguous"`` (and ``max_chunk``) each sliding layer's rows are rings
            of pages (``gqakv.storage.ring``: paged storage whose pools hold ``batch x
            window_pages(W, max_len, P, max_chunk)`` pages and never run out), and the
            full layers of a mixed model stay contiguous (``[n_full, B, Hkv, max_len,
            d]``). Layers of one kind share a store (paged: a page table and pool): all
            of one kind, ``store`` is one store as without windows; of several kinds,
            ``store`` is a ``gqakv.storage.layer_groups.LayerGroups`` (a store per kind;
            ``page_tables`` of the paged ones) and ``num_pages`` may be a dict ``{window:
            pages}`` (None: the full layers', when paged).
            A prefix cache takes layers of one kind only.
        max_chunk: with sliding layers only: None, or the most tokens one step appends to a
            row; a longer step is refused when it opens (ValueError naming the numbers,
            nothing changed), and a sliding kind's ``num_pages`` defaults to ``batch x
            window_pages(W, max_len, P, max_chunk)``. Needed by ``storage="contiguous"``.

    Attributes:
        store: the KVStore, leading axis ``(layers,)``; what the backend's operations take.
        k, v: ``[layers, B, Hkv, max_len, d]`` each, allocated once, written in place
            (contiguous storage: views of the store's memory; contract as ``KVCache.k``).
        lens / host_lens: ``[B]`` int64 live tokens per row (backend array / NumPy, read-only).
        backend: the Backend holding the buffers.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype="float32", backend=None, *, storage: str | None = None,
                 page_size: int | None = None, num_pages=None, kv_dtype=None,
                 prefix_cache: bool = False, windows=None, max_chunk=None):
        self.layers = check_dim("layers", layers, 1)
        kinds = _layer_windows(windows, self.layers)
        if storage is None:
            storage = PAGED if page_size is not None or any(w is not None for w in kinds) else "contiguous"
        # contiguous sliding layers are rings of pages (gqakv.storage.ring): paged storage
        # whose windowed pools are sized by max_chunk; full layers keep the storage asked for
        storage_for(storage, kinds, max_chunk=max_chunk, num_pages=num_pages,
                    prefix_cache=prefix_cache)  # refuses what a ring cannot take
        if max_chunk is not None and all(w is None for w in kinds):
            raise ValueError(f"max_chunk={max_chunk!r} sizes window-sized storage; it applies with "
                             "sliding layers (windows=[...]), and this cache has none")
        distinct = list(dict.fromkeys(kinds))  # the layer kinds, in order of first layer
        if isinstance(num_pages, dict):
            unknown = [w for w in num_pages if w not in distinct]
            if unknown:
                raise ValueError(f"num_pages has entries for windows {unknown} no layer has "
                                 f"(the layers' kinds: {distinct}; None: full attention)")
        pages = {w: num_pages.get(w) if isinstance(num_pages, dict) else num_pages for w in distinct}
        if len(distinct) > 1 and prefix_cache:
            raise ValueError(f"prefix_cache=True needs layers of one kind, got {len(distinct)} "
                             f"({distinct}; None: full attention): each kind pages through its "
                             "own table, and the prefix cache indexes one")
        members = {w: [l for l in range(self.layers) if kinds[l] == w] for w in distinct}
        # each kind's storage: sliding layers asked to be contiguous are rings (paged, sized
        # by page_size); full layers keep the storage asked for (page_size is the rings')
        kind_of = {w: storage_for(storage, [w], max_chunk=max_chunk, num_pages=pages[w],
                                  prefix_cache=prefix_cache) for w in distinct}
        page_of = {w: page_size if kind_of[w] == PAGED else None for w in distinct}
        first = distinct[0]
        self._allocate((len(members[first]),), batch, kv_heads, max_len, head_dim, dtype, backend,
                       "model KV cache", storage, page_of[first], pages[first], kv_dtype=kv_dtype,
                       prefix_cache=prefix_cache, window=first,
                       max_chunk=None if first is None else max_chunk)
        self.windows: tuple[int | None, ...] = tuple(kinds)
        if len(distinct) > 1:
            from ..storage.layer_groups import LayerGroups
            from ..storage.layouts import store_class

            groups = [(first, members[first], self.store)]
            for w in distinct[1:]:
                layout = store_class(kind_of[w])
                args = layout.layout_args(self.batch, self.max_len, page_size=page_of[w],
                                          num_pages=pages[w], window=w,
                                          max_chunk=None if w is None else max_chunk)
                shape = (len(members[w]), self.batch, self.kv_heads, self.max_len, self.head_dim)
                spec = dataclasses.replace(self.store.spec, kind=kind_of[w])
                groups.append((w, members[w], layout.allocate(
                    self.backend, spec, shape,
                    f"model KV cache ({'full' if w is None else f'window={w}'} layers)", **args)))
            self.store = LayerGroups(groups, self.layers)
        self._layer_stores = [self.store.layer(l) for l in range(self.layers)]
        self._views = [KVCache._view_of(st, self._lengths, backend=self.backend, frozen=_LAYER_VIEW)
                       for st in self._layer_stores]
        self._open_step: Step | None = None

    @classmethod
    def for_model(cls, model, *, batch: int, max_len: int, dtype="bfloat16", backend=None,
                  window_storage: bool = False, page_size: int | None = None,
                  num_pages=None, chunk: int | None = None):
        """A cache shaped for ``model``: a preset name (``gqakv size --list``) or a
        ``gqakv.storage.sizing.ModelConfig``. ``window_storage``: paged, each sliding layer
        of the model (``ModelConfig.layer_windows``) in window-sized storage, its pool
        sized for rows of ``max_len`` appending at most ``chunk`` tokens at once
        (``gqakv.storage.sizing.window_pages``; default: ``max_len``, no saving) unless
        ``num_pages`` is given. With ``chunk`` and no ``num_pages``, a step longer than
        ``chunk`` is refused when it opens (``max_chunk``: a ValueError naming the numbers,
        not an OutOfPages part-way through a model)."""
        cfg = resolve_model(model)
        if not window_storage:
            if page_size is not None or num_pages is not None or chunk is not None:
                raise ValueError("page_size, num_pages and chunk apply with window_storage=True")
            return cls(cfg.layers, batch, cfg.kv_heads, max_len, cfg.head_dim, dtype, backend)
        from ..storage.paged import DEFAULT_PAGE_SIZE

        P = DEFAULT_PAGE_SIZE if page_size is None else page_size
        windows = cfg.layer_windows()
        # max_chunk sizes the sliding pools (window_pages) and caps each step; without it
        # every pool defaults to every row at max_len (what window_pages gives a chunk of
        # max_len)
        ring = num_pages is None and any(w is not None for w in windows)
        return cls(cfg.layers, batch, cfg.kv_heads, max_len, cfg.head_dim, dtype, backend,
                   storage=PAGED, page_size=P, num_pages=num_pages, windows=windows,
                   max_chunk=min(chunk, max_len) if ring and chunk is not None else None)

    # -- sizing ----------------------------------------------------------------------------

    @staticmethod
    def nbytes_for(layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                   dtype="float32", kv_dtype=None) -> int:
        """Bytes of K and V for all layers, computed before allocating:
        ``2 * layers * batch * kv_heads * max_len * head_dim * itemsize`` (with ``kv_dtype``:
        ``2 * layers * batch * kv_heads * max_len * (head_dim + 4)``, codes plus scales;
        every dimension checked as the constructor checks it; exact Python ints)."""
        layers = check_dim("layers", layers, 1)
        batch, kv_heads, max_len, head_dim = check_dims(batch, kv_heads, max_len, head_dim)
        return StorageSpec.of(dtype, kv_dtype=kv_dtype).nbytes(layers * batch * max_len,
                                                               kv_heads, head_dim)

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    # -- lengths and views -----------------------------------------------------------------

    def layer(self, layer: int) -> KVCache:
        """Layer ``layer`` as a KVCache over views of the shared buffers (read side:
        ``gqa_attention(q, cache.layer(l), n_new, rows=...)``, ``live_kv``)."""
        return self._views[self._layer_index(layer)]

    def _layer_index(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer must be an int, got {layer!r}")
        if not 0 <= layer < self.layers:
            raise ValueError(f"layer={int(layer)} is out of range for a cache of {self.layers} layers")
        return int(layer)

    def live_kv(self, layer: int, row: int):
        """Layer ``layer``, row ``row``'s live K and V, ``[Hkv, L, d]`` each (views for
        contiguous storage; see ``KVCache.live_kv``)."""
        return self.layer(layer).live_kv(row)

    # -- the forward step ------------------------------------------------------------------

    def step(self, n_new, *, rows=None, tree=None) -> "Step":
        """Begin a forward step that appends ``n_new[i]`` tokens to cache row ``rows[i]``.

        Args:
            n_new: ``[B']`` ints >= 0 (the first n_new[i] of entry i's T slots are real).
            rows: ``[B']`` distinct cache rows (default ``0..B-1``, then ``B' = B``).
            tree: None, or each entry's draft tree over its new tokens (speculative
                verification; ``gqakv.core.tree``: parents ``[B', T]`` or an ancestor mask
                ``[B', T, T]``): every layer's ``attend`` then masks by it, and
                ``step.positions`` gives the tokens' logical positions (prefix + depth)
                for RoPE. Follow with ``accept`` after the commit.

        Validated here, before any layer runs: shapes, row indices, and
        ``lens[rows[i]] + n_new[i] <= max_len`` for every entry. Use it as a context
        manager (commit on normal exit, abort on exception), or call ``commit()`` /
        ``abort()``. While a step is open, other writes and row operations raise, and so
        does opening a second step (from any thread: RuntimeError at once, no waiting).
        """
        try:
            count = self.batch if rows is None else len(rows)
        except TypeError:  # an int or a 0-d array
            raise TypeError(f"rows must be a 1-D list of cache row indices, got {rows!r}") from None
        with self._lengths.lock:  # the open-step check and the opening are one step
            self._check_can_change("begin a step")
            r = _rows(self, rows, count, distinct=True)
            n = host_ints(n_new, "n_new", count)
            starts = self._lengths.host[r].copy()
            for i in range(count):
                if n[i] < 0:
                    raise ValueError(f"n_new[{i}]={int(n[i])} is negative (row {int(r[i])})")
            check_capacity(r, starts, n, self.max_len)
            if tree is not None:
                from ..core.tree import DraftTree

                tree = DraftTree.of(tree, n)
            # what every layer's write needs, once (paged: pages; OutOfPages: no change)
            reservation = self.store.reserve(self.backend, r, starts, n)
            try:
                step = Step(self, r, starts, n, reservation, tree=tree)
            except BaseException:
                self.store.give_back(reservation)
                raise
            self._open_step = step
        return step

    def _check_can_change(self, what: str) -> None:
        if self._open_step is not None:
            raise RuntimeError(f"cannot {what}: a step is open on this cache (commit or abort it first)")

    # -- row operations (RowsAndLengths) ---------------------------------------------------------

    def _row_store(self):
        return self.store

    def __repr__(self) -> str:
        return (f"ModelKVCache(layers={self.layers}, batch={self.batch}, kv_heads={self.kv_heads}, "
                f"max_len={self.max_len}, head_dim={self.head_dim}, dtype={self.dtype!r}, "
                f"backend={self.backend.name!r}, {human_bytes(self.nbytes)})")


def _layer_windows(windows, layers: int) -> list[int | None]:
    """``windows`` (None, or one entry per layer: None or a window W >= 1) as a checked list."""
    from ..core.inputs import check_window

    if windows is None:
        return [None] * layers
    if isinstance(windows, (str, bytes)) or not hasattr(windows, "__len__"):
        raise TypeError(f"windows must be a sequence of {layers} entries (None or a window W >= 1 "
                        f"per layer), got {windows!r}")
    if len(windows) != layers:
        raise ValueError(f"windows has {len(windows)} entries, the cache {layers} layers: one per "
                         "layer (None for a full-attention layer, W for a sliding one)")
    out = []
    for l, w in enumerate(windows):
        try:
            out.append(check_window(w))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"windows[{l}]: {exc}") from None
    return out


class Step:
    """One forward step of a ModelKVCache (made by ``ModelKVCache.step``).

    Attributes:
        rows: ``[B']`` cache row of each batch entry (host int64).
        starts: ``[B']`` each row's length before the step: entry i's token t sits at
            absolute position ``starts[i] + t`` (the positions for rotary embeddings).
        n_new: ``[B']`` real tokens per entry.
        lens: ``[B']`` each row's length after the step (``starts + n_new``).
        tree: None, or the step's ``gqakv.core.tree.DraftTree`` (every layer's attention
            masks by it).
    """

    def __init__(self, cache: ModelKVCache, rows, starts, n_new, reservation=None, tree=None):
        self.cache = cache
        self.tree = tree
        self._reservation = reservation  # paged: the pages the step took (abort returns them)
        # immutable copies (gqakv.core.inputs.immutable_ints): a read-only flag can be undone,
        # and commit writes ``lens`` into the cache's lengths
        self.rows, self.starts, self.n_new = (immutable_ints(a) for a in (rows, starts, n_new))
        self.lens = immutable_ints(starts + n_new)
        pending = cache._lengths.host.copy()
        pending[rows] = self.lens
        self._pending = Lengths.of(pending)
        self._written = np.zeros(cache.layers, dtype=bool)
        self._views: dict[int, KVCache] = {}  # layer -> its view (_view)
        # planned once, used by every layer: attention plans by query shape and variant,
        # and the validated append by the new K/V's library, shape and dtype
        self._plans: dict = {}
        self._append: tuple | None = None  # (signature, AppendInputs)
        self._queries_checked: tuple | None = None  # (q's signature, spec) check_queries passed
        self._fixed: AttentionPlan | None = None  # the fixed plan every write goes through
        self._state = "open"
        self._lock = cache._lengths.lock  # the cache's writer lock (see Lengths)

    @property
    def positions(self) -> np.ndarray:
        """``[B', T]`` int64 positions of the step's new tokens for RoPE: ``starts[i] + t``,
        or with a tree ``starts[i] + depth[i, t]`` (T: the tree's, else the largest n_new)."""
        if self.tree is not None:
            return self.tree.positions(self.starts)
        T = int(self.n_new.max(initial=0))
        return self.starts[:, None] + np.arange(T, dtype=np.int64)[None, :]

    # -- per layer -------------------------------------------------------------------------

    def layer(self, layer: int) -> KVCache:
        """Layer ``layer`` as the step sees it, after ``write(layer, ...)``: lengths include
        this step's tokens. For ``gqa_attention(q, step.layer(l), step.n_new, rows=step.rows)``.
        Before the layer is written its new slots hold nothing yet, so this raises."""
        self._check_open()
        l = self.cache._layer_index(layer)
        if not self._written[l]:
            raise RuntimeError(f"layer {l} is not written yet in this step: write(...) it first "
                               "(or use attend(...), which writes then attends)")
        return self._view(l)

    def _view(self, l: int) -> KVCache:
        """Layer ``l`` as a cache at the step's pending lengths (made once per step: the
        view shares ``_pending``, which the step never replaces)."""
        view = self._views.get(l)
        if view is None:
            c = self.cache
            view = self._views[l] = KVCache._view_of(c._layer_stores[l], self._pending,
                                                     backend=c.backend,
                                                     frozen="it is a step's view of one layer")
        return view

    def write(self, layer: int, k_new, v_new) -> None:
        """Write layer ``layer``'s new K and V (``[B', Hkv, T, d]``, ``n_new[i] <= T``, or
        packed ``[sum(n_new), Hkv, d]``) at the rows' current lengths, past the live
        tokens. Each layer is written exactly once."""
        l = self.cache._layer_index(layer)
        with self._lock:
            self._check_open()
            inputs = self._validate_write(l, k_new, v_new)
            self._write(l, k_new, v_new, inputs)

    def attend(self, layer: int, q, k_new, v_new, *, scale: float | None = None,
               window: int | None = None, softcap: float | None = None, sinks=None,
               return_lse: bool = False, params=None, alibi_slopes=None, plan=None,
               out=None, lse_out=None):
        """Write layer ``layer``'s new K/V, then grouped-query attention of ``q`` over the
        row's live tokens plus this step's (bottom-right causal; see ``gqa_attention``).

        Args:
            q: ``[B', Hq, T, d]``, same B' and T as ``k_new``; ``Hq`` a multiple of ``Hkv``.
                Packed: ``[N, Hq, d]`` with ``N = sum(n_new)``, entry i's queries at rows
                ``offsets[i]..offsets[i] + n_new[i] - 1`` (``offsets`` = the exclusive
                cumulative sum of n_new, FlashAttention's ``cu_seqlens[:-1]``); no padding.
            k_new, v_new: ``[B', Hkv, T, d]``; entry i's first ``n_new[i]`` slots are real.
                Packed like q: ``[N, Hkv, d]`` (q and K/V are both packed or both padded).
            plan: optional, this step's ``plan_attention(...)``: the variant and query
                shape it was made for (then no variant keyword is given).
            out, lse_out: optional caller's buffers, as in ``gqa_attention``.

        Returns ``out`` ``[B', Hq, T, d]`` (padded query slots exactly 0; packed: ``[N, Hq,
        d]``), or ``(out, lse)`` with ``return_lse`` (a bool; lse ``[B', Hq, T]`` / ``[N, Hq]``). ``window``, ``softcap``, ``sinks``,
        ``alibi_slopes``, ``params``: as in ``gqa_attention``.
        Everything is validated before the write. The step validates and plans its batch
        once (the first layer that attends with a query shape and variant, or
        ``plan_attention``); later layers check only their tensors.
        """
        c = self.cache
        l = c._layer_index(layer)
        if return_lse is not False:  # (the common case without a call)
            return_lse = check_flag(return_lse, "return_lse")
        with self._lock:
            self._check_open()
            inputs = self._validate_write(l, k_new, v_new)
            view = self._view(l)  # validated against before the write; read only after it
            q_shape = tuple(getattr(q, "shape", ()))
            check_same_layout(q, k_new)
            if len(q_shape) == 4 and q_shape[::2] != tuple(k_new.shape[::2]):
                raise ValueError(
                    f"q {list(q_shape)} does not match k_new {list(k_new.shape)}: q must have the "
                    f"same batch B'={int(k_new.shape[0])} (dim 0) and tokens T={int(k_new.shape[2])} "
                    "(dim 2)")
            if len(q_shape) == 3 and q_shape[0] != k_new.shape[0]:
                raise ValueError(
                    f"packed q {list(q_shape)} and k_new {list(k_new.shape)} hold different "
                    "numbers of tokens (dim 0)")
            if plan is None:  # _plan_for checks q (check_queries) before it reads q.shape
                if (scale is None and window is None and softcap is None and sinks is None
                        and params is None and alibi_slopes is None and self.tree is None):
                    plan = self._plan_for(view, q, None)
                else:
                    plan = self._plan_for(view, q, dict(scale=scale, window=window,
                                                        softcap=softcap, sinks=sinks,
                                                        params=params, alibi_slopes=alibi_slopes,
                                                        tree=self.tree))
                plan.check_checked_queries(view, q, out, lse_out)
            else:
                self._check_plan(plan, scale, window, softcap, sinks, params, alibi_slopes)
                self._check_queries(view, q)  # plan.check_tensors, q by its signature
                plan.check_checked_queries(view, q, out, lse_out)
            self._write(l, k_new, v_new, inputs)
        # Attention reads only this step's rows up to their pending lengths, which no other
        # writer touches while the step is open, so it runs outside the lock.
        return plan.launch(q, view.store, return_lse, out, lse_out)

    def plan_attention(self, q_heads: int, *, t_q: int | None = None, packed: bool = False,
                       scale: float | None = None, window: int | None = None,
                       softcap: float | None = None, sinks=None, params=None,
                       alibi_slopes=None, fixed: bool = False,
                       splits: int | None = None) -> AttentionPlan:
        """The attention plan of this step's batch for queries ``[B', q_heads, t_q, d]``
        (``t_q`` default: the largest n_new), or packed ``[sum(n_new), q_heads, d]`` with
        ``packed=True`` (no ``t_q``), and this variant, validated and planned once for
        every layer: pass it as ``attend(..., plan=plan)``. ``fixed`` / ``splits``: a
        fixed-capacity plan (``gqakv.ops.plan``; later steps take it with ``adopt``)."""
        self._check_open()
        view = self._view(0)
        q_shape = packed_or_padded_shape(self.n_new, int(q_heads), self.cache.head_dim,
                                         t_q=t_q, packed=packed)
        inputs = validate_attention_batch(view, q_shape, self.n_new, self.rows, scale, params,
                                          window=window, softcap=softcap, sinks=sinks,
                                          alibi_slopes=alibi_slopes, tree=self.tree)
        plan = AttentionPlan(view, q_shape, inputs, owner=self, fixed=fixed, splits=splits)
        if plan.fixed:
            self._fixed = plan
        return plan

    def adopt(self, plan: AttentionPlan) -> AttentionPlan:
        """A fixed plan (``plan_attention(..., fixed=True)`` of an earlier step of this
        cache, or ``gqakv.plan_attention(..., fixed=True)``) updated in place for this
        step's batch (``AttentionPlan.update``) and made this step's: pass it as
        ``attend(..., plan=plan)``. Its launches stay the same (CUDA graphs), and so do
        the appends of the layers written after this (``AttentionPlan.write``: K/V
        ``[B', Hkv, T, d]`` at the plan's T)."""
        self._check_open()
        if not isinstance(plan, AttentionPlan):
            raise TypeError(f"adopt takes an AttentionPlan, got {type(plan).__name__}")
        plan.update(self._view(0), self.n_new, rows=self.rows)
        plan.owner = self
        self._fixed = plan  # every later write of this step through its buffers
        return plan

    def replay(self, launch) -> None:
        """Every layer's append and attention by a replay of a captured step: ``launch()``
        runs it (``lambda: graph.launch(stream)``, a CUDA graph captured around the
        ``attend(..., plan=plan)`` of every layer of an earlier step), after this step
        adopted ``plan`` (so its device buffers hold this step's rows, lengths, n_new and
        page table); then every layer counts as written, and commit advances the lengths.
        The graph itself is the caller's: this step cannot check what it launches."""
        with self._lock:
            self._check_open()
            if self._fixed is None:
                raise ValueError("replay needs this step to adopt(plan) the fixed plan the "
                                 "replayed step was captured with")
            if self._written.any():
                raise ValueError(f"replay writes every layer; layers "
                                 f"{np.flatnonzero(self._written).tolist()} were written already")
            launch()
            self._written[:] = True

    def _plan_for(self, view, q, variant: dict | None) -> AttentionPlan:
        """This step's plan for q's shape and the call's variant keywords (None: none given
        and no tree), made on first use; keywords that cannot be a dict key (an array of
        sinks) plan each call."""
        self._check_queries(view, q)
        shape = q.shape
        q_shape = shape if type(shape) is tuple else tuple(int(s) for s in shape)
        try:  # values with their types: window=True must not find window=1's plan
            key = (q_shape, None if variant is None or all(v is None for v in variant.values())
                   else tuple((type(v), v) for v in variant.values()))
            plan = self._plans.get(key)
        except TypeError:  # unhashable keywords: validated and planned for this call
            key, plan = None, None
        if plan is None:
            inputs = validate_attention_batch(view, q_shape, self.n_new, self.rows,
                                              **(variant or {}))
            plan = AttentionPlan(view, q_shape, inputs, owner=self)
            if key is not None:
                self._plans[key] = plan
        return plan

    def _check_plan(self, plan, *variant) -> None:
        if not isinstance(plan, AttentionPlan) or plan.owner is not self:
            raise ValueError("plan= takes this step's own plan_attention(...) (a plan holds one "
                             "step's rows and lengths)")
        given = [v for v in variant if v is not None]
        if given:
            raise TypeError("give plan= or variant keywords (scale, window, softcap, sinks, params, "
                            "alibi_slopes), not both: the plan carries its variant")

    def _validate_write(self, l: int, k_new, v_new):
        if self._written[l]:
            raise ValueError(f"layer {l} was already written in this step (each layer exactly once)")
        # Every layer appends the same rows, starts and n_new: validated once for new K/V of
        # this library, device, shape and dtype, then only that signature is compared (the
        # tensors that passed had the step's batch too).
        sig = self._signature(k_new, v_new)
        if self._append is not None and sig is not None and self._append[0] == sig:
            return self._append[1]
        for what, x in (("k_new", k_new), ("v_new", v_new)):
            shape = tuple(getattr(x, "shape", ()))
            if len(shape) == 4 and int(shape[0]) != self.rows.size:  # packed: checked by sum
                raise ValueError(f"{what} has batch {int(shape[0])} (dim 0 of {list(shape)}), but "
                                 f"this step has {self.rows.size} entries (B' = len(rows))")
        inputs = validate_append(self.cache.layer(l), k_new, v_new, self.n_new, self.rows)
        self._append = (sig, inputs)
        return inputs

    def _signature(self, k_new, v_new):
        """What ``validate_append`` judged of the tensors (library, device, shape, dtype;
        ``Backend.signature``), or None for objects that are not arrays of the cache's
        backend."""
        signature = self.cache.backend.signature
        k, v = signature(k_new), signature(v_new)
        return None if k is None or v is None else (k, v)

    def _check_queries(self, view, q) -> None:
        """``check_queries(view, q)``, in full once per signature of q and spec of the
        layer (``Backend.signature``): the layers of a step pass alike shaped queries."""
        sig = self.cache.backend.signature(q)
        spec = view.store.spec
        if sig is not None and self._queries_checked == (sig, spec):
            return
        check_queries(view, q)
        self._queries_checked = (sig, spec)

    def _write(self, l: int, k_new, v_new, inputs) -> None:
        c = self.cache
        if self._fixed is not None:  # over the fixed plan's device buffers (CUDA graphs)
            self._fixed.write(c._layer_stores[l], k_new, v_new, inputs)
        else:
            _cache.write(c.backend, c._layer_stores[l], k_new, v_new, inputs)
        self._written[l] = True

    # -- ending ----------------------------------------------------------------------------

    def commit(self) -> None:
        """Advance the lengths of the step's rows by ``n_new``, for all layers at once.

        Every layer must have been written; otherwise RuntimeError and the step is
        aborted (nothing advances)."""
        with self._lock:
            self._check_open()
            missing = np.flatnonzero(~self._written)
            if missing.size:
                self._close("aborted")
                shown = ", ".join(str(int(m)) for m in missing[:8]) + (" ..." if missing.size > 8 else "")
                raise RuntimeError(
                    f"step not committed: {missing.size} of {self.cache.layers} layers were never "
                    f"written (layers {shown}); lengths are unchanged"
                )
            self.cache._lengths.set(self.rows, self.lens)
            self._close("committed")

    def abort(self) -> None:
        """End the step without advancing any length (the written slots stay dead). Paged
        storage: every page the step took (fresh pages and copies on write) goes back to the
        pool and the page tables are as they were when the step opened."""
        with self._lock:
            if self._state == "open":
                self._close("aborted")

    def _close(self, state: str) -> None:
        self._state = state
        store = self.cache.store
        if state == "aborted":
            # every page the step took, copies on write included; the tables as they were
            store.give_back(self._reservation)
        self._reservation = None
        self.cache._open_step = None

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"this step is already {self._state}")

    def __enter__(self) -> "Step":
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        if exc_type is not None:
            self.abort()
        elif self._state == "open":
            self.commit()
        return False

    def __repr__(self) -> str:
        return (f"<Step {self._state}: rows={self.rows.tolist()} n_new={self.n_new.tolist()} "
                f"layers written {int(self._written.sum())}/{self.cache.layers}>")
