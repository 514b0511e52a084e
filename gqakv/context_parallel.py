"""Decode context parallelism over ``torch.distributed``: each rank holds a slice of every
row's tokens.

Tensor parallelism splits heads, so it stops at Hkv devices and every device still holds
every token of its heads. Context parallelism (vLLM's DCP, TensorRT-LLM's Helix) splits
the sequence instead, over C ranks of a *CP group*:

- **Placement: interleaved fixed-size chunks** (``Interleaved``). Absolute position ``a``
  of a row lives on rank ``(a // S) % C`` at local slot ``(a // (S * C)) * S + a % S``
  (S tokens per chunk, ``chunk=``). Appends stay balanced: at any length the ranks hold
  within S tokens of each other, so a rank needs ``ceil(max_len / (S * C)) * S`` slots
  (``1 / C`` of one process's cache when ``S * C`` divides ``max_len``) and a decode step
  writes on one rank and reads ``L / C`` keys on each. Contiguous slices (rank r holds
  ``[r * M, (r + 1) * M)``) would make the mask a plain offset, but every decode write and
  every growing row would land on the last rank in use, and a rank's capacity could not
  be used by a shorter row's later tokens; the interleaved rule keeps both even.
- **Local order is absolute order**: local slot ``j`` of rank r holds absolute position
  ``((j // S) * C + r) * S + j % S``, increasing in j. So for a query at absolute
  position p the keys of a rank it may see (``semantics.allowed``: causal, window) are
  one contiguous range of local slots, ``[count(lo), count(p + 1))`` with ``count(x)``
  the rank's tokens below absolute x. The rank's cache is an ordinary ``ModelKVCache``
  (contiguous, paged or 8-bit) whose rows hold ``count(L)`` tokens.
- **Each rank attends over its slice**, queries replicated, and returns the partial
  ``(out, lse)`` with the natural-log LSE and *without sinks*; ``gather_attention`` packs
  them as ``[B, Hq, T, d + 1]`` (compute dtype: float32, float64 for float64 models),
  runs **one all-gather per layer** over the CP group, merges the C parts with
  ``gqakv.ops.merge.merge_attention`` and applies the sinks once, after the merge
  (``apply_sinks``). A rank that holds no key a query may see contributes lse = -inf and
  out = 0, which the merge ignores (no NaN); the query's own key is always on some rank.
- **Which attention runs.** Decode steps (every ``n_new <= 1``) without a window or ALiBi
  go through the backend's own ``gqa_attention`` over the rank's cache (each rank's keys
  all precede the query, so the plain rule over the local row is exact). Chunked prefill,
  windows and ALiBi need the absolute position of every key: those run
  ``attend_positions``, the generic array-API loop (``gqakv.ops.attention``'s) reading
  ``store.blocks`` of any storage kind, masked by ``semantics.allowed`` and transformed by
  ``semantics.transform`` at absolute positions. That path is exact but not a fused
  kernel; a CP kernel with a position map is left for the fast paths.
- **With tensor parallelism**: ranks form a TP x CP grid (``grid``): TP groups of P
  consecutive ranks split heads as ``gqakv.distributed`` does, CP groups (every P-th rank)
  split tokens of those heads. The attention all-gather runs in the CP group, the two
  row-parallel all-reduces per layer in the TP group.

Failure protocol (``ContextParallelGuard``), as ``gqakv.distributed.StepGuard``'s: a rank
whose local work raises keeps its exception, computes nothing more and still joins every
collective of the step (zeros, with a "failure known" flag in the gathered or reduced
buffer); every rank that sees a flag stops computing too but keeps joining, so all ranks
of the grid make the same collectives whatever failed where (no rank waits for a peer
that stopped). ``finish`` ends the step with one vote over the whole grid (an all-reduce
of one flag per rank) and raises ``ContextParallelError`` naming the ranks that raised;
the model aborts its cache step on every rank (lengths and pages as before). A peer that
dies makes the survivors' next collective raise (gloo: at once or within the group's
timeout, ``gqakv.distributed.init``); that is reported as ``ContextParallelError`` with
``dead=True``, the group's ranks and the seconds waited, and the step is aborted.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from array_api_compat import array_namespace

from .caches.model_cache import ModelKVCache
from .core.dims import check_dim as _int
from .core.inputs import check_queries, host_ints, validate_attention_batch
from .core.semantics import AttentionParams, allowed, transform
from .dispatch.backend import Backend
from .distributed import TensorParallel, _torch, rank_backend
from .ops.attention import SCORE_BLOCK_ELEMENTS, gqa_attention
from .ops.merge import SoftmaxState, apply_sinks, merge_attention

#: Tokens per chunk of the interleaved placement (``ContextParallel``'s default).
DEFAULT_CHUNK = 16


class ContextParallelError(RuntimeError):
    """A context-parallel step failed on some rank (``failed_ranks``, ranks of the grid
    group) or a collective failed (``dead``: a peer died or timed out); every rank
    aborted its cache step."""

    def __init__(self, message: str, failed_ranks: tuple[int, ...] = (), dead: bool = False):
        super().__init__(message)
        self.failed_ranks = failed_ranks
        self.dead = dead


# -- the placement (no torch) -----------------------------------------------------------------


@dataclass(frozen=True)
class Interleaved:
    """Where a row's tokens live: chunks of ``chunk`` (S) absolute positions dealt round
    robin over ``ranks`` (C); this is rank ``rank``'s view. Every method takes Python ints
    or NumPy int arrays (elementwise)."""

    ranks: int
    rank: int
    chunk: int

    @classmethod
    def plan(cls, ranks: int, rank: int, chunk: int = DEFAULT_CHUNK) -> "Interleaved":
        ranks = _int("ranks", ranks, 1)
        chunk = _int("chunk", chunk, 1)
        rank = _int("rank", rank, 0)
        if rank >= ranks:
            raise ValueError(f"rank={rank} is out of range for {ranks} context-parallel ranks")
        return cls(ranks, rank, chunk)

    def owner(self, pos):
        """The rank holding absolute position ``pos``."""
        return (pos // self.chunk) % self.ranks

    def count(self, end):
        """How many of the absolute positions ``0 .. end - 1`` this rank holds."""
        S, C = self.chunk, self.ranks
        cycles, rest = end // (S * C), end % (S * C)
        return cycles * S + np.clip(rest - self.rank * S, 0, S)

    def absolute(self, local):
        """The absolute position of this rank's local slot ``local`` (increasing in it)."""
        S, C = self.chunk, self.ranks
        return ((local // S) * C + self.rank) * S + local % S

    def capacity(self, max_len: int) -> int:
        """Local slots per row for rows of up to ``max_len`` tokens: the most any rank holds
        (every rank allocates the same), ``ceil(max_len / (S * C)) * S``."""
        S, C = self.chunk, self.ranks
        return -(-int(max_len) // (S * C)) * S


# -- the rank's attention over its slice --------------------------------------------------------


def attend_positions(q, store, rows, starts, n_new, placement: Interleaved, params: AttentionParams,
                     *, score_block_elements: int = SCORE_BLOCK_ELEMENTS):
    """Attention of replicated queries over one rank's slice, at absolute positions.

    q: ``[B, Hq, T, d]``: entry i's first ``n_new[i]`` queries sit at absolute positions
    ``starts[i] + t``; store: the rank's layer store (no leading axes), row ``rows[i]``
    holding ``placement.count(starts[i] + n_new[i])`` tokens (this step's written);
    params: scale, window, softcap, ALiBi (its ``sinks`` are ignored: they join once, after
    the merge). Query p sees local slot j when ``semantics.allowed(params, p,
    placement.absolute(j))``; scores go through ``semantics.transform`` at those positions.

    Returns ``(out [B, Hq, T, d] in q's dtype, lse [B, Hq, T] in the compute dtype)``; a
    query that sees no key of this rank (or a padded slot) has out 0 and lse -inf.
    """
    xp = array_namespace(q)
    B, Hq, T, d = (int(s) for s in q.shape)
    Hkv = store.kv_heads
    G = Hq // Hkv
    acc = xp.float64 if q.dtype == xp.float64 else xp.float32
    dev = getattr(q, "device", None)
    out = xp.zeros((B, Hq, T, d), dtype=q.dtype, device=dev)
    lse = xp.full((B, Hq, T), -math.inf, dtype=acc, device=dev)
    neg_inf = xp.asarray(-math.inf, dtype=acc, device=dev)
    heads = (None if params.alibi_slopes is None else
             xp.reshape(xp.arange(Hq, device=dev), (Hkv, G, 1, 1)))
    codec = store.spec.codec
    if getattr(codec, "rotates_keys", False):  # keys stored in a rotated basis: q . k needs q in it
        q = codec.rotate_queries(xp, q)
    for i in range(B):
        n, p0 = int(n_new[i]), int(starts[i])
        if n == 0:
            continue
        q_row = xp.reshape(xp.astype(q[i, :, :n, :], acc), (Hkv, G * n, d)) * params.scale
        q_abs = np.arange(p0, p0 + n, dtype=np.int64)  # [n] absolute query positions
        first = 0 if params.window is None else max(0, p0 - (params.window - 1))
        lo, hi = int(placement.count(first)), int(placement.count(p0 + n))  # local slots any query sees
        k_block = max(1, score_block_elements // max(1, Hkv * G * n))
        state = SoftmaxState(xp)
        for j0, j1 in store.key_blocks(int(rows[i]), lo, hi, k_block):
            kb, vb = store.blocks(int(rows[i]), j0, j1)
            if kb.dtype != acc:
                kb, vb = xp.astype(kb, acc), xp.astype(vb, acc)
            k_abs = placement.absolute(np.arange(j0, j1, dtype=np.int64))  # [keys]
            s = xp.reshape(q_row @ xp.matrix_transpose(kb), (Hkv, G, n, j1 - j0))
            if heads is None:
                s = transform(params, s, 0, 0, 0, xp)
            else:
                qp = xp.reshape(xp.asarray(q_abs.tolist(), dtype=xp.int64, device=dev), (1, 1, n, 1))
                kp = xp.reshape(xp.asarray(k_abs.tolist(), dtype=xp.int64, device=dev), (1, 1, 1, j1 - j0))
                s = transform(params, s, qp, kp, heads, xp)
            visible = allowed(params, q_abs[:, None], k_abs[None, :])  # [n, keys], host bools
            if not visible.all():
                s = xp.where(xp.asarray(visible, device=dev), s, neg_inf)
            state.add(xp.reshape(s, (Hkv, G * n, j1 - j0)), vb)
        if state.m is None:  # no local key for any query of the row: out 0, lse -inf
            continue
        o_b, l_b = state.result()
        out[i, :, :n, :] = xp.astype(xp.reshape(o_b, (Hq, n, d)), q.dtype)
        lse[i, :, :n] = xp.reshape(l_b, (Hq, n))
    return out, lse


# -- the cache of one rank ---------------------------------------------------------------------


class ContextParallelCache:
    """One rank's share of a context-parallel model cache: a ``ModelKVCache`` (``local``)
    holding, per row, the tokens ``placement`` deals to this rank, plus every row's
    absolute length (the same on every rank of the CP group, which makes every step).

    Args: as ``ModelKVCache`` (``max_len``: absolute tokens per row); ``placement``: the
    rank's ``Interleaved``. ``prefix_cache`` is refused (pages of one rank hold no whole
    prefix).
    """

    def __init__(self, placement: Interleaved, layers: int, batch: int, kv_heads: int, max_len: int,
                 head_dim: int, dtype="float32", backend=None, **options):
        if options.get("prefix_cache"):
            raise ValueError("prefix_cache=True is not supported under context parallelism (each "
                             "rank holds a slice of every row, not whole prefixes)")
        max_len = _int("max_len", max_len, 1)
        self.placement = placement
        self.local = ModelKVCache(layers, batch, kv_heads, placement.capacity(max_len), head_dim, dtype,
                                  backend, **options)
        self.max_len = max_len
        self._lens = np.zeros(self.local.batch, dtype=np.int64)

    # what generate() and the tests read, as ModelKVCache spells it
    layers = property(lambda self: self.local.layers)
    batch = property(lambda self: self.local.batch)
    kv_heads = property(lambda self: self.local.kv_heads)
    head_dim = property(lambda self: self.local.head_dim)
    backend = property(lambda self: self.local.backend)
    store = property(lambda self: self.local.store)
    nbytes = property(lambda self: self.local.nbytes)  # this rank's bytes
    _open_step = property(lambda self: self.local._open_step)
    prefix_index = None  # refused above

    def live_kv(self, layer: int, row: int):
        """This rank's live K and V of ``row`` (``ModelKVCache.live_kv`` of ``local``)."""
        return self.local.live_kv(layer, row)

    @property
    def host_lens(self) -> np.ndarray:
        """``[B]`` absolute lengths (NumPy, a read-only copy)."""
        lens = self._lens.copy()
        lens.flags.writeable = False
        return lens

    # Row operations: call them with the same arguments on every rank of the CP group (each
    # moves its own tokens; the absolute lengths follow). The local cache validates first.

    def reset(self, rows=None) -> None:
        """Empty ``rows`` (default every row) on this rank."""
        self.local.reset(rows)
        self._lens[np.arange(self.batch) if rows is None else np.asarray(rows, dtype=np.int64)] = 0

    def reorder(self, src_rows) -> None:
        """Row b takes row ``src_rows[b]``'s tokens (this rank's) and length."""
        self.local.reorder(src_rows)
        self._lens[:] = self._lens[np.asarray(src_rows, dtype=np.int64)]

    def fork(self, src: int, dst_rows) -> None:
        """Copy row ``src``'s tokens (this rank's) and length into each of ``dst_rows``."""
        self.local.fork(src, dst_rows)
        self._lens[np.asarray(dst_rows, dtype=np.int64)] = self._lens[int(src)]

    def truncate(self, rows, new_lens) -> None:
        """Shorten ``rows[i]`` to ``new_lens[i] <= lens[rows[i]]`` absolute tokens."""
        r = host_ints(rows, "rows", len(rows))
        n = host_ints(new_lens, "new_lens", r.size)
        if r.size and (r.min() < 0 or r.max() >= self.batch):
            raise ValueError(f"rows={r.tolist()} must be rows of 0..{self.batch - 1}")
        bad = np.flatnonzero((n < 0) | (n > self._lens[r]))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"new_lens[{i}]={int(n[i])} must be within 0..{int(self._lens[r[i]])} "
                             f"(row {int(r[i])}'s length)")
        self.local.truncate(r, self.placement.count(n))
        self._lens[r] = n

    def step(self, n_new, *, rows=None, tree=None) -> "ContextParallelStep":
        """Begin a step appending ``n_new[i]`` tokens to row ``rows[i]`` at absolute
        positions ``lens[rows[i]] ..``; this rank writes the ones it holds. Checked here,
        before anything is written: n_new, rows and the absolute capacity."""
        if tree is not None:
            raise ValueError("tree= (speculative verification) is not supported under context "
                             "parallelism")
        count = self.batch if rows is None else len(rows)
        r = np.arange(self.batch, dtype=np.int64) if rows is None else host_ints(rows, "rows", count)
        if r.size and (r.min() < 0 or r.max() >= self.batch or np.unique(r).size != r.size):
            raise ValueError(f"rows={r.tolist()} must be distinct rows of 0..{self.batch - 1}")
        n = host_ints(n_new, "n_new", count)
        if n.size and n.min() < 0:
            i = int(np.argmin(n))
            raise ValueError(f"n_new[{i}]={int(n[i])} is negative (row {int(r[i])})")
        starts = self._lens[r].copy()
        over = np.flatnonzero(starts + n > self.max_len)
        if over.size:
            i = int(over[0])
            raise ValueError(f"row {int(r[i])} holds {int(starts[i])} tokens; {int(n[i])} more exceed "
                             f"max_len={self.max_len} (absolute tokens per row over "
                             f"{self.placement.ranks} context-parallel ranks)")
        return ContextParallelStep(self, r, starts, n)

    def __repr__(self) -> str:
        p = self.placement
        return (f"ContextParallelCache(rank {p.rank} of {p.ranks}, chunk {p.chunk}, max_len={self.max_len}, "
                f"local={self.local!r})")


class ContextParallelStep:
    """One forward step of a ``ContextParallelCache`` on this rank.

    Attributes: ``rows``, ``starts`` (absolute lengths before the step: RoPE positions
    continue from them), ``n_new``, ``lens`` (after); ``local_n`` the tokens of each entry
    this rank writes, ``local`` the rank's ``ModelKVCache`` step.
    """

    def __init__(self, cache: ContextParallelCache, rows, starts, n_new):
        self.cache, self.rows, self.starts, self.n_new = cache, rows, starts, n_new
        self.lens = starts + n_new
        pl = cache.placement
        self.local_n = (pl.count(self.lens) - pl.count(starts)).astype(np.int64)
        T = int(n_new.max(initial=0))
        t = np.arange(T, dtype=np.int64)
        mine = (pl.owner(starts[:, None] + t[None, :]) == pl.rank) & (t[None, :] < n_new[:, None])  # [B, T]
        self._T_local = max(1, int(self.local_n.max(initial=0)))
        self._idx = np.zeros((rows.size, self._T_local), dtype=np.int64)  # [B, T_local]; padding reads 0
        for i in range(rows.size):
            picked = np.flatnonzero(mine[i])
            self._idx[i, :picked.size] = picked
        self._checked: set = set()  # (q shape, params) validated in this step
        self.local = cache.local.step(self.local_n, rows=rows)  # local capacity checked there

    @property
    def positions(self) -> np.ndarray:
        T = int(self.n_new.max(initial=0))
        return self.starts[:, None] + np.arange(T, dtype=np.int64)[None, :]

    def _mine(self, x):
        """This rank's new tokens of ``x`` ``[B, Hkv, T, d]``, padded ``[B, Hkv, T_local, d]``."""
        xp = array_namespace(x)
        B, H, T, d = (int(s) for s in x.shape)
        flat = xp.reshape(xp.permute_dims(x, (0, 2, 1, 3)), (B * T, H, d))
        take = (np.arange(B, dtype=np.int64)[:, None] * T + self._idx).reshape(-1)  # rows of flat
        ids = self.cache.backend.from_host_ints(take, device=self.cache.backend.device_of(x))
        picked = xp.reshape(xp.take(flat, ids, axis=0), (B, self._T_local, H, d))
        return xp.permute_dims(picked, (0, 2, 1, 3))

    def attend(self, layer: int, q, k_new, v_new, *, params: AttentionParams):
        """Write this rank's share of layer ``layer``'s new K/V (``[B, Hkv, T, d]``, every
        entry's T slots, ``n_new[i]`` real), then the partial attention of ``q``
        ``[B, Hq, T, d]`` over the rank's keys: ``(out, lse)``, sinks not applied."""
        need = int(self.n_new.max(initial=0))
        for what, x in (("q", q), ("k_new", k_new), ("v_new", v_new)):
            shape = [int(s) for s in getattr(x, "shape", ())]
            if len(shape) != 4 or shape[0] != self.rows.size or shape[2] < need:
                raise ValueError(f"{what} has shape {shape}; a context-parallel step takes padded "
                                 f"[B'={self.rows.size}, H, T >= {need}, d] (the largest n_new)")
        if int(q.shape[2]) != int(k_new.shape[2]):
            raise ValueError(f"q {list(q.shape)} and k_new {list(k_new.shape)} have different token "
                             "slots T (dim 2)")
        plain = AttentionParams(scale=params.scale, window=params.window, softcap=params.softcap,
                                alibi_slopes=params.alibi_slopes)  # sinks: after the merge
        view = self.cache.local.layer(layer)
        key = (tuple(int(s) for s in q.shape), plain)
        if key not in self._checked:  # q and the variant against the cache, once per step
            check_queries(view, q)
            validate_attention_batch(view, key[0], np.zeros(self.rows.size, dtype=np.int64), self.rows,
                                     params=plain)
            self._checked.add(key)
        self.local.write(layer, self._mine(k_new), self._mine(v_new))
        view = self.local.layer(layer)
        if int(self.n_new.max(initial=0)) <= 1 and params.window is None and params.alibi_slopes is None:
            # decode: every key of this rank precedes the query; the backend's own kernel
            n_q = ((self.n_new == 1) & (view.host_lens[self.rows] > 0)).astype(np.int64)
            return gqa_attention(q, view, n_q, rows=self.rows, params=plain, return_lse=True)
        return attend_positions(q, view.store, self.rows, self.starts, self.n_new, self.cache.placement,
                                plain)

    def commit(self) -> None:
        self.local.commit()
        self.cache._lens[self.rows] = self.lens
        want = self.cache.placement.count(self.cache._lens)
        if not np.array_equal(want, self.cache.local.host_lens):  # an invariant, never a user error
            raise AssertionError(f"context-parallel lengths out of step: {want} vs {self.cache.local.host_lens}")

    def abort(self) -> None:
        self.local.abort()


# -- the group, its collectives and the step guard -------------------------------------------------


def _rank_list(group) -> list[int]:
    _, dist = _torch()
    return list(dist.get_process_group_ranks(group)) if group is not None else \
        list(range(dist.get_world_size()))


class ContextParallel:
    """This rank's place in a context-parallel group, and its collectives.

    Args:
        group: the CP group (None: the default group).
        chunk: S, tokens per chunk of the interleaved placement (``Interleaved``).
        tensor_parallel: None, or the ``TensorParallel`` of this rank's TP group (a grid;
            see ``grid``).
        grid_group: the group spanning every rank of the grid (the step's final vote);
            default: ``group`` without tensor parallelism, else the default group.
    """

    def __init__(self, group=None, *, chunk: int = DEFAULT_CHUNK, tensor_parallel: TensorParallel | None = None,
                 grid_group=None):
        _, dist = _torch()
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call gqakv.distributed.init() "
                               "or torch.distributed.init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.chunk = _int("chunk", chunk, 1)
        self.placement = Interleaved.plan(self.world_size, self.rank, self.chunk)
        self.tp = tensor_parallel
        self.grid_group = group if grid_group is None and tensor_parallel is None else grid_group
        self.grid_rank = dist.get_rank(self.grid_group)
        self.grid_size = dist.get_world_size(self.grid_group)
        self.comm_backend = str(dist.get_backend(group))
        #: what this rank's all-gathers sent (its parts) and received (the whole gathered
        #: buffers, its own part included), in bytes, and how many ran
        self.bytes_sent = self.bytes_gathered = self.gathers = 0

    def model_cache(self, layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                    dtype="float32", backend=None, **options) -> ContextParallelCache:
        """This rank's ``ContextParallelCache``: ``kv_heads`` as this rank holds them (the
        full model's, or its TP shard's), ``max_len`` absolute."""
        if not isinstance(backend, Backend):
            backend = rank_backend(backend, dtype=dtype, head_dim=head_dim)
        return ContextParallelCache(self.placement, layers, batch, kv_heads, max_len, head_dim, dtype,
                                    backend, **options)

    def _collective(self, what: str, group, fn):
        _, dist = _torch()
        t0 = time.monotonic()
        try:
            fn()
        except Exception as exc:  # gloo: a peer closed its connection or the timeout passed
            me = dist.get_rank()
            members = _rank_list(group)
            peers = ", ".join(str(r) for r in members if r != me)
            raise ContextParallelError(
                f"context-parallel {what} failed after {time.monotonic() - t0:.1f} s on rank {me} (of the "
                f"group of ranks {members}): a peer among ranks [{peers}] died or stopped answering "
                f"({type(exc).__name__}: {str(exc)[:300]}); this rank's cache step is aborted",
                dead=True) from exc

    def all_gather(self, x, out):
        """``out`` ``[C * n]`` <- every rank's ``x`` ``[n]`` in rank order (arrays of any
        backend, by DLPack)."""
        torch, dist = _torch()
        tx = x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)
        to = out if isinstance(out, torch.Tensor) else torch.from_dlpack(out)
        foreign_cuda = tx.is_cuda and not isinstance(x, torch.Tensor)
        if foreign_cuda:
            import cupy

            cupy.cuda.get_current_stream().synchronize()
        # torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns there)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._collective("all-gather", self.group, lambda: gather(to, tx, group=self.group))
        self.bytes_sent += tx.numel() * tx.element_size()
        self.bytes_gathered += to.numel() * to.element_size()
        self.gathers += 1
        if foreign_cuda:
            torch.cuda.current_stream(to.device).synchronize()
        return out

    def all_reduce(self, x, group):
        torch, dist = _torch()
        t = x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)
        foreign_cuda = t.is_cuda and not isinstance(x, torch.Tensor)
        if foreign_cuda:
            import cupy

            cupy.cuda.get_current_stream().synchronize()
        self._collective("all-reduce", group, lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group))
        if foreign_cuda:
            torch.cuda.current_stream(t.device).synchronize()
        return x

    def guard(self, backend, shape, dtype: str, attention: tuple[int, int, int, int]) -> "ContextParallelGuard":
        """A guard for one forward step: reduced activations ``shape`` ``[B, T, D]``,
        attention outputs ``attention`` ``(B, Hq, T, d)`` (this rank's heads)."""
        return ContextParallelGuard(self, backend, shape, dtype, attention)

    def __repr__(self) -> str:
        tp = "" if self.tp is None else f" x TP {self.tp.world_size}"
        return (f"<ContextParallel rank {self.rank} of {self.world_size}{tp}, chunk {self.chunk} "
                f"({self.comm_backend})>")


def grid(tensor_parallel: int, context_parallel: int, *, chunk: int = DEFAULT_CHUNK):
    """Split the default group (``tensor_parallel * context_parallel`` ranks) into a grid:
    TP groups of consecutive ranks ``[c * P, (c + 1) * P)``, CP groups of every P-th rank
    ``[t, t + P, ...]``. Every rank calls it (torch creates groups collectively). Returns
    ``(TensorParallel or None, ContextParallel)`` of this rank."""
    _, dist = _torch()
    P = _int("tensor_parallel", tensor_parallel, 1)
    C = _int("context_parallel", context_parallel, 1)
    world = dist.get_world_size()
    if P * C != world:
        raise ValueError(f"tensor_parallel={P} x context_parallel={C} = {P * C} ranks, but the process "
                         f"group has {world}")
    me = dist.get_rank()
    tp_groups = [dist.new_group(list(range(c * P, (c + 1) * P))) for c in range(C)]
    cp_groups = [dist.new_group(list(range(t, world, P))) for t in range(P)]
    tp = TensorParallel(tp_groups[me // P]) if P > 1 else None
    return tp, ContextParallel(cp_groups[me % P], chunk=chunk, tensor_parallel=tp,
                               grid_group=None if tp is None else dist.group.WORLD)


class ContextParallelGuard:
    """One forward step whose failure on any rank of the grid aborts it on every rank.

    ``run(fn)``: local work (an exception is kept, nothing more is computed here);
    ``gather_attention(fn, sinks)``: the layer's all-gather and merge; ``add_reduced(x,
    fn)``: the TP all-reduce (no communication without TP); ``finish()``: the vote. Every
    rank makes the same collectives, in the same order, whether or not anything failed.
    """

    def __init__(self, cp: ContextParallel, backend, shape, dtype: str, attention):
        self.cp, self.backend, self.dtype = cp, backend, dtype
        self.shape = tuple(int(s) for s in shape)
        self.size = math.prod(self.shape)
        self.attention = tuple(int(s) for s in attention)  # (B, Hq, T, d)
        self.error: BaseException | None = None
        self.known = False  # some rank failed (this one, or one whose flag reached here)
        self.gathers = self.reduces = 0
        #: bytes this rank put into collectives this step (the all-gathers' own parts)
        self.gathered_bytes = 0

    @property
    def failed(self) -> bool:
        return self.error is not None or self.known

    def run(self, fn):
        if self.failed:
            return None
        try:
            return fn()
        except Exception as exc:  # re-raised everywhere by finish()
            self.error = exc
            return None

    def _acc(self):
        return "float64" if self.dtype == "float64" else "float32"

    def _zeros(self, n: int):
        xp = self.backend.namespace()
        device = getattr(self.backend, "_target_device", lambda: None)()
        dt = self.backend.dtype(self._acc())
        return xp.zeros((n,), dtype=dt) if device is None else xp.zeros((n,), dtype=dt, device=device)

    def gather_attention(self, fn, sinks=None):
        """``fn()`` is this rank's partial ``(out [B, Hq, T, d], lse [B, Hq, T])``; returns
        the merged attention over every rank's keys with ``sinks`` (``[Hq]`` floats or None)
        applied once, in out's dtype, or None once the step failed anywhere."""
        B, Hq, T, d = self.attention
        n = B * Hq * T * (d + 1)
        C = self.cp.world_size
        xp = self.backend.namespace()
        acc = self.backend.dtype(self._acc())

        def pack():
            out, lse = fn()
            part = xp.concat([xp.astype(out, acc), xp.astype(lse, acc)[..., None]], axis=-1)
            return xp.reshape(part, (n,))

        part = self.run(pack)
        mine = self._zeros(n + 1)
        if part is not None:
            mine[:n] = part
        if self.failed:
            mine[n] = 1
        gathered = self._zeros(C * (n + 1))
        self.cp.all_gather(mine, gathered)
        self.gathers += 1
        self.gathered_bytes += (n + 1) * _itemsize(self._acc())
        all_parts = xp.reshape(gathered, (C, n + 1))
        if np.any(self.backend.to_numpy(all_parts[:, n]) != 0):
            self.known = True
        if self.failed:
            return None

        def merge():
            parts = xp.reshape(all_parts[:, :n], (C, B, Hq, T, d + 1))
            out, lse = parts[0, ..., :d], parts[0, ..., d]
            for c in range(1, C):
                out, lse = merge_attention(out, lse, parts[c, ..., :d], parts[c, ..., d])
            if sinks is not None:
                out, lse = apply_sinks(out, lse, xp.asarray(list(sinks), dtype=acc,
                                                            device=self.backend.device_of(out)))
            return xp.astype(out, self.backend.dtype(self.dtype))

        return self.run(merge)

    def add_reduced(self, x, fn):
        """``x + fn()``, the partial sum all-reduced over the TP group when there is one; None
        once the step failed anywhere."""
        tp = self.cp.tp
        if tp is None:
            return self.run(lambda: x + fn())
        xp = self.backend.namespace()
        part = self.run(lambda: xp.reshape(fn(), (self.size,)))
        buf = self._zeros(self.size + 1)
        if part is not None:
            buf[: self.size] = xp.astype(part, buf.dtype)
        if self.failed:
            buf[self.size] = 1
        self.cp.all_reduce(buf, tp.group)
        self.reduces += 1
        if float(self.backend.to_numpy(buf[self.size:])[0]) != 0:
            self.known = True
        if self.failed:
            return None
        model_dtype = self.backend.dtype(self.dtype)
        return self.run(lambda: x + xp.astype(xp.reshape(buf[: self.size], self.shape), model_dtype))

    def finish(self) -> None:
        """The vote: every rank of the grid learns which ranks raised; raises
        ``ContextParallelError`` on every rank if any did."""
        W, me = self.cp.grid_size, self.cp.grid_rank
        flags = self._zeros(W)
        if self.error is not None:
            flags[me] = 1
        self.cp.all_reduce(flags, self.cp.grid_group)
        failed = tuple(int(i) for i in np.flatnonzero(self.backend.to_numpy(flags)))
        if failed:
            ranks = ", ".join(map(str, failed))
            here = (f"; here: {type(self.error).__name__}: {self.error}" if self.error is not None else "")
            raise ContextParallelError(
                f"context-parallel step aborted on all {W} ranks: rank(s) {ranks} raised (this is rank "
                f"{me}){here}; every rank's cache is unchanged", failed) from self.error


def _itemsize(dtype: str) -> int:
    return 8 if dtype == "float64" else 4
