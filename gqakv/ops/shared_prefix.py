"""Shared-prefix attention: pages that several rows share are read once per step.

Rows that share pages (after ``fork`` / ``reorder``, beams, parallel sampling, or a
prefix cache) name the same page ids in their leading page-table entries. Attention over
such a batch reads every shared key once per row; here a plan splits each grouped row's
keys in two disjoint parts (FlashInfer's cascade attention, vLLM's cascade path):

- the **shared part**: one *virtual* attention call per group over the group's shared
  pages, ``S = k * page_size`` tokens, with every query of the group stacked into the
  head dimension. Virtual row: the shared pages, ``lens = S``, ``n_new = 1``: its one
  query position ``S - 1`` sees keys ``0 .. S - 1``, all of them. Virtual heads:
  ``G' = G * Q`` per KV head (Q the group's queries, ``sum(n_new)`` of its members);
  virtual head ``kv * G' + j`` is the group's j-th query of KV head kv (query j = member
  token ``j // G``, head ``kv * G + j % G``). Every backend's fast path serves it
  unchanged, and each shared K/V block is read once for the whole group;
- the **suffix part**: one call over the whole batch through a page table whose rows
  are the rows' entries shifted left by their group's ``k`` shared pages, ``lens - S``,
  the same ``n_new``. Every key and query position moves by ``S``, so the bottom-right
  causal mask is exact (an ungrouped entry keeps its row: ``S = 0``).

Each query's two (out, lse) pairs are then merged through their log-sum-exp
(``gqakv.ops.merge.merge_attention``). Every shared key is visible to every query of its
group because ``S <= lens - n_new`` for each member (a grouped query sits at ``S`` or
later). Variants: the soft-cap is a function of each score alone (both parts apply it);
sinks are one more term of each query's denominator, so only the suffix part gets them
(every grouped query sees at least its own key there, so the merge counts the sink
once). ALiBi adds ``slope_h * (j - p)`` to query p's score of key j: the suffix part keeps
``j - p`` (both move by S); the shared call gives each virtual head its query head's slope
and sees its one query at ``S - 1``, so its scores differ from the true ones by the same
``slope_h * (p - S + 1)`` for every key: its output is the true one and its LSE is moved
back by that constant before the merge (exact). Negative slopes are refused: the
farthest keys would score highest, by up to ``|slope| x position``, and LSEs of that size
lose float32 precision in the merge (measured: twice the normal path's error at 4,000
keys). A sliding window of W makes which keys a query sees depend on its position, which
the virtual call does not keep, except where no query's window reaches into the shared
keys: an entry of ``lens <= W`` (its last query, at ``lens - 1``, sees keys from
``lens - W <= 0``). Such entries are grouped (the shared call has no window, the suffix
call keeps it: it moves with the positions); longer ones take the normal path, and a
batch with no short enough sharing entries is refused (``decide`` says so). That is the
common case of sliding layers serving prompts shorter than their window.

``decide`` is the one place that chooses the groups (``MIN_SHARED_TOKENS``,
``MIN_SAVED_TOKENS``, ``MIN_GROUP_ROWS``, ``MAX_GROUP_QUERIES``) or the reason none is
formed; a plan keeps its answer as ``plan.shared_prefix`` (``SharedPrefix``), shown in
the plan's repr.
``SharedPrefixWork`` holds what the plan built once (the page tables of both parts,
their inputs, the backend's sub-plans, the gather / scatter indices); ``launch`` runs it
over one layer's store.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from array_api_compat import array_namespace

from ..core.dtypes import canonical_name
from ..core.inputs import AttentionInputs
from ..storage.paged import PageTableView, PagedStore
from ..storage.store import PAGED
from .merge import merge_attention
from .outputs import write_into

#: The fewest shared tokens (``k * page_size``) a group must read once to be formed.
MIN_SHARED_TOKENS = 256
#: The fewest key reads a group must save, ``(members - 1) * shared tokens``, over float32
#: storage (narrower storage: times the backend's ``shared_prefix_read_factor``,
#: ``min_saved_tokens``): the decomposition adds a call, the queries' gather and the merge
#: (about 0.3 to 1 ms a layer on numba at Llama-3.1-8B's layer, 2 threads), so a group
#: pays only past a few thousand saved reads. Measured (numba, 2 threads, loaded 2-core
#: machine; shared / unshared time): float32 pays from about 600 saved reads (2 rows x
#: 512: 0.88x, 4 x 256: 0.76x; 4 x 128: 1.30x). See docs/guides/performance.md, "Shared
#: prefixes, read once".
MIN_SAVED_TOKENS = 4096
#: The fewest batch entries of a group (2: one shared read instead of two).
MIN_GROUP_ROWS = 2
#: The most virtual query heads per KV head of one group's shared call (``G * Q``): a
#: longer group is cut into several groups over the same pages, so a prefill chunk's
#: virtual call stays within every backend's launch grid and temporaries.
MAX_GROUP_QUERIES = 4096


@dataclass(frozen=True)
class SharedGroup:
    """One group: batch ``entries`` (indices into the call's batch) whose rows share their
    first ``pages`` page ids, ``tokens = pages * page_size`` keys read once."""

    entries: tuple[int, ...]
    pages: int
    tokens: int

    def __str__(self) -> str:
        return f"entries {list(self.entries)} share {self.tokens} tokens"


@dataclass(frozen=True)
class SharedPrefix:
    """What a plan decided (``AttentionPlan.shared_prefix``): the ``groups`` whose shared
    pages are read once, or, when there are none, the ``reason`` (a sentence)."""

    groups: tuple[SharedGroup, ...] = ()
    reason: str | None = None

    @property
    def used(self) -> bool:
        return bool(self.groups)

    def __str__(self) -> str:
        if not self.groups:
            return f"shared prefix not used: {self.reason}"
        return "shared prefix: " + "; ".join(str(g) for g in self.groups)


def min_saved_tokens(backend, spec, head_dim: int) -> int:
    """The fewest key reads a group must save on ``backend`` over storage ``spec``:
    ``MIN_SAVED_TOKENS`` times the backend's ``shared_prefix_read_factor`` for the
    storage's bytes per value (4 and more, 2, or 1 and less: codes with their scales)."""
    per_value = spec.bytes_per_slot(1, head_dim) / (2 * head_dim)
    width = 4 if per_value >= 3 else 2 if per_value >= 1.5 else 1
    factor = 1 if backend is None else backend.shared_prefix_read_factor.get(width, 1)
    return MIN_SAVED_TOKENS * factor


def decide(store, inputs, q_shape, *, fixed: bool = False, off: str | None = None,
           backend=None) -> SharedPrefix:
    """The groups of batch entries whose shared pages one plan reads once, or why none.

    The one decision point (a mode that turns the decomposition off passes its sentence
    as ``off``; batch-invariant mode, ``inputs.invariant``, turns it off here: results must
    not depend on the batch's composition, and the split changes the order of the sums).
    Refused: ``off``, batch-invariant mode, fixed
    plans (CUDA graphs: launches must not depend on the batch), storage that is not paged,
    a sliding window that every sharing entry outgrows (``lens > W``; shorter entries are
    grouped, longer ones left out), ALiBi with a
    negative slope (LSEs as large as the positions: float32 precision), and batches where no two entries with
    queries share ``MIN_SHARED_TOKENS`` tokens of full pages before their chunks, or whose
    groups would save fewer than ``min_saved_tokens(backend, ...)`` key reads
    (``MIN_SAVED_TOKENS`` where ``backend`` is None).

    Grouping (greedy): entries with queries, by their first page; in each bucket the first
    entry is the pivot, the others sorted by the pages they share with it (only full pages
    before each entry's chunk start count: ``S <= lens - n_new``), and the group is the
    prefix of that order that saves most reads, ``(members - 1) * shared pages``, within
    ``MAX_GROUP_QUERIES``; the bucket's other entries are grouped again the same way.
    """
    if off is not None:
        return SharedPrefix(reason=off)
    if getattr(inputs, "invariant", False):
        return SharedPrefix(reason="batch-invariant mode (gqakv.core.invariance): a query's bits "
                                   "must not depend on which rows share its pages")
    if fixed:
        return SharedPrefix(reason="a fixed plan (CUDA graphs) keeps the same launches for "
                                   "every batch")
    if store.kind != PAGED:
        return SharedPrefix(reason=f"{store.kind} storage (only paged rows share pages)")
    params = inputs.params
    if getattr(inputs, "tree", None) is not None:
        return SharedPrefix(reason="a draft tree: its chunk keys are masked per query, which the "
                                   "suffix call does not take")
    if params.alibi_slopes is not None and min(params.alibi_slopes) < 0:
        return SharedPrefix(reason="ALiBi with a negative slope: the farthest keys score highest "
                                   "(by up to |slope| x position), and the two parts' LSEs at that "
                                   "size would lose float32 precision in the merge")
    n_new, lens = inputs.n_new, inputs.lens
    min_saved = min_saved_tokens(backend, store.spec, int(q_shape[-1]))
    usable = np.where(n_new > 0, (lens - n_new) // int(store.page_size), 0)  # full pages before the chunk
    if params.window is not None:
        # the shared call shows every shared key to its one query: exact for an entry whose
        # every query's window reaches back to key 0 (its last, at lens - 1, sees keys from
        # lens - W), so entries whose window bites (lens > W) take the normal path
        bites = lens > int(params.window)
        left_out = int(((usable > 0) & bites).sum())
        usable = np.where(bites, 0, usable)
        if left_out:
            decision = _groups(store, inputs, q_shape, usable, min_saved)
            if decision.used:
                return decision
            return SharedPrefix(reason=f"sliding window={params.window}: {left_out} entries "
                                       "are longer than the window (which shared keys their "
                                       f"queries see depends on their positions); of the others, "
                                       f"{decision.reason}")
    return _groups(store, inputs, q_shape, usable, min_saved)


def _groups(store, inputs, q_shape, usable, min_saved: int) -> SharedPrefix:
    """``decide``'s grouping of the entries with ``usable[i]`` full shared-candidate pages,
    keeping groups that save at least ``min_saved`` key reads."""
    P = int(store.page_size)
    n_new, rows = inputs.n_new, inputs.rows
    G = int(q_shape[1]) // int(store.kv_heads)
    live = np.flatnonzero(usable > 0)
    if live.size < MIN_GROUP_ROWS:
        return SharedPrefix(reason=f"{live.size} entries with queries hold a full page before "
                                   f"their new tokens (a group needs {MIN_GROUP_ROWS})")
    entries = store.page_table.entries
    first = entries[np.asarray(rows)[live], 0].tolist()  # each live entry's first page
    if len(set(first)) == len(first):
        # every entry's first page is its own (the common batch of unrelated rows): no
        # bucket below has two members, so the greedy grouping would find nothing
        return SharedPrefix(reason="no two entries' rows share a page before their new tokens")
    pages = {int(i): entries[int(rows[i]), :int(usable[i])] for i in live}
    buckets: dict[int, list[int]] = {}
    for i, page in zip(live.tolist(), first):
        buckets.setdefault(page, []).append(i)
    min_pages = -(-MIN_SHARED_TOKENS // P)
    groups, best_seen, best_saved, capped = [], 0, 0, False
    for members in buckets.values():
        while len(members) >= MIN_GROUP_ROWS:
            pivot = pages[members[0]]
            common = [(_common_pages(pivot, pages[m]), m) for m in members[1:]]
            common.sort(key=lambda c: -c[0])
            best, best_c, k, used = 0, 0, len(pivot), G * int(n_new[members[0]])
            for c, (shared, m) in enumerate(common, start=2):
                used += G * int(n_new[m])
                if used > MAX_GROUP_QUERIES:
                    capped = capped or c == 2
                    break
                k = min(k, shared)
                best_seen = max(best_seen, k)
                if k >= min_pages and (c - 1) * k > best:  # reads saved, in pages
                    best, best_c = (c - 1) * k, c
            if best_c == 0:  # the pivot shares too little with any other entry
                members = members[1:]
                continue
            chosen = [members[0]] + [m for _, m in common[:best_c - 1]]
            k = min([len(pivot)] + [s for s, _ in common[:best_c - 1]])
            best_saved = max(best_saved, best * P)
            if best * P >= min_saved:
                groups.append(SharedGroup(tuple(sorted(chosen)), k, k * P))
            members = [m for m in members if m not in chosen]
    if not groups:
        if best_seen == 0 and capped:
            return SharedPrefix(reason=f"two entries' queries (G x n_new each) exceed "
                                       f"MAX_GROUP_QUERIES={MAX_GROUP_QUERIES} per KV head")
        if best_seen < min_pages:
            return SharedPrefix(reason=f"rows share at most {best_seen * P} tokens of full pages "
                                       f"(fewer than MIN_SHARED_TOKENS={MIN_SHARED_TOKENS})")
        least = (f"MIN_SAVED_TOKENS={MIN_SAVED_TOKENS}" if min_saved == MIN_SAVED_TOKENS else
                 f"{min_saved}: MIN_SAVED_TOKENS={MIN_SAVED_TOKENS} x "
                 f"{min_saved // max(1, MIN_SAVED_TOKENS)}, the backend's factor for "
                 f"{store.spec.dtype} storage")
        return SharedPrefix(reason=f"the best group saves {best_saved} key reads (fewer than "
                                   f"{least})")
    return SharedPrefix(tuple(sorted(groups, key=lambda g: g.entries)))


def _common_pages(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading page ids ``a`` and ``b`` have in common."""
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class SharedPrefixWork:
    """The decomposition of one plan's batch (see the module docstring), built once:
    the shared and suffix page tables, each part's ``AttentionInputs`` and backend
    sub-plan, and the host indices that gather the groups' queries and scatter their
    results back. ``launch`` runs it over one layer's store."""

    __slots__ = ("backend", "decision", "q_shape", "kv_heads", "group", "shared_table",
                 "shared_rows", "shared_len", "shared", "suffix_table", "suffix", "gather",
                 "pick", "rows", "planned", "live", "lse_shift", "_device_arrays")

    def __init__(self, backend, store, inputs, q_shape, decision: SharedPrefix):
        self.backend, self.decision = backend, decision
        self.q_shape = tuple(q_shape)
        self.kv_heads = int(store.kv_heads)
        Hq = int(q_shape[1])
        G = self.group = Hq // self.kv_heads
        P, table = int(store.page_size), store.page_table
        entries = table.entries
        packed = inputs.offsets is not None
        groups = decision.groups
        # -- the shared part: one table row per group, its shared pages
        k_max = max(g.pages for g in groups)
        shared_entries = np.full((len(groups), k_max), -1, dtype=np.int32)
        shift = np.zeros(len(inputs.rows), dtype=np.int64)  # pages each entry's suffix skips
        for gi, g in enumerate(groups):
            shared_entries[gi, :g.pages] = entries[int(inputs.rows[g.entries[0]]), :g.pages]
            shift[list(g.entries)] = g.pages
        self.shared_table = PageTableView(shared_entries, P, table.num_pages)
        self.shared_rows, self.shared_len = len(groups), k_max * P
        params = inputs.params
        # sinks: the suffix part's alone; a window: no grouped query's reaches into the
        # shared keys (``decide``), so the shared call has none
        shared_params = replace(params, sinks=None, window=None)
        slopes = None if params.alibi_slopes is None else np.asarray(params.alibi_slopes, np.float64)
        # per group, with ALiBi: [Q, Hq] slope_h * (p - S + 1) (else None)
        self.lse_shift: list[np.ndarray | None] = []
        shared_store = self.shared_store(store)
        self.shared = []  # per group: (inputs, q_shape, work)
        T = 0 if packed else int(q_shape[2])
        self.gather = []  # per group: token-major indices of its queries
        for gi, g in enumerate(groups):
            tokens: list[int] = []
            positions: list[int] = []  # each query's absolute position in its row
            for i in g.entries:
                n, L = int(inputs.n_new[i]), int(inputs.lens[i])
                first = int(inputs.offsets[i]) if packed else i * T
                tokens.extend(range(first, first + n))
                positions.extend(range(L - n, L))
            self.gather.append(np.asarray(tokens, dtype=np.int64))
            Q = len(tokens)
            v_shape = (1, self.kv_heads * G * Q, 1, int(q_shape[-1]))
            v_params = shared_params
            if slopes is None:
                self.lse_shift.append(None)
            else:  # virtual head kv * (Q * G) + t * G + g has query head kv * G + g's slope
                v_slopes = np.broadcast_to(slopes.reshape(self.kv_heads, 1, G),
                                           (self.kv_heads, Q, G))
                v_params = replace(shared_params,
                                   alibi_slopes=tuple(float(x) for x in v_slopes.ravel()))
                shift_q = np.asarray(positions, np.float64) - (g.tokens - 1)  # p - (S - 1)
                self.lse_shift.append(shift_q[:, None] * slopes[None, :])  # [Q, Hq]
            v_inputs = AttentionInputs(rows=np.array([gi], np.int64),
                                       lens=np.array([g.tokens], np.int64),
                                       n_new=np.ones(1, np.int64), params=v_params)
            work = backend.plan_attention(shared_store, v_inputs, v_params, v_shape)
            self.shared.append((v_inputs, v_shape, work))
        # token-major row r of the whole call -> its row in the groups' results (all groups
        # end to end), or the extra last row (out 0, lse -inf) for queries of no group
        R = int(q_shape[0]) if packed else int(q_shape[0]) * T
        total = sum(int(x.size) for x in self.gather)
        pick = np.full(R, total, dtype=np.int64)
        if total:
            pick[np.concatenate(self.gather)] = np.arange(total, dtype=np.int64)
        self.pick = pick
        # -- the suffix part: every entry's row past its group's shared pages
        suffix_entries = np.full((len(inputs.rows), entries.shape[1]), -1, dtype=np.int32)
        for i, r in enumerate(inputs.rows):
            s = int(shift[i])
            row = entries[int(r)]
            suffix_entries[i, :row.size - s] = row[s:]
        self.suffix_table = PageTableView(suffix_entries, P, table.num_pages)
        s_inputs = AttentionInputs(rows=np.arange(len(inputs.rows), dtype=np.int64),
                                   lens=inputs.lens - shift * P, n_new=inputs.n_new,
                                   params=inputs.params, offsets=inputs.offsets)
        s_work = backend.plan_attention(self.suffix_store(store), s_inputs, inputs.params,
                                        self.q_shape)
        self.suffix = (s_inputs, s_work)
        # what moved_row compares: each entry's live page ids as planned
        self.rows = inputs.rows
        self.live = np.arange(entries.shape[1])[None, :] < -(-inputs.lens[:, None] // P)
        self.planned = np.where(self.live, entries[inputs.rows], -1)
        self._device_arrays: dict[tuple[str, str], object] = {}

    def moved_row(self, store) -> int | None:
        """The first planned row whose live pages ``store``'s page table no longer names
        as it did when planned (None: none moved)."""
        now = np.where(self.live, store.page_table.entries[self.rows], -1)
        bad = np.flatnonzero((now != self.planned).any(axis=1))
        return int(self.rows[bad[0]]) if bad.size else None

    # -- per-layer store views (the layer's pool, the planned tables) ----------------------

    def shared_store(self, store) -> PagedStore:
        return PagedStore(store.spec, store.k, store.v, self.shared_table, self.shared_rows,
                          self.shared_len, store.k_scale, store.v_scale)

    def suffix_store(self, store) -> PagedStore:
        return PagedStore(store.spec, store.k, store.v, self.suffix_table,
                          int(self.suffix_table.entries.shape[0]), store.max_len,
                          store.k_scale, store.v_scale)

    def _ints(self, q, key: str, host: np.ndarray):
        """``host`` as an int64 array of q's library and device (kept per device)."""
        dev = self.backend.device_of(q)
        k = (key, str(dev))
        got = self._device_arrays.get(k)
        if got is None:
            got = self._device_arrays[k] = self.backend.from_host_ints(host, device=dev)
        return got

    def _floats(self, key: str, host: np.ndarray, dtype):
        """``host`` as an array of the backend's library in ``dtype`` (the LSE's; kept)."""
        got = self._device_arrays.get((key, str(dtype)))
        if got is None:
            name = "float64" if "64" in str(dtype) else "float32"
            got = self._device_arrays[(key, str(dtype))] = self.backend.from_numpy(host, name)
        return got

    # -- running ----------------------------------------------------------------------------

    def launch(self, q, store, return_lse: bool, out=None, lse_out=None):
        """Both parts over ``store`` (a layer's paged store of the planned pool and table)
        and their merge; returns what ``AttentionPlan.launch`` returns, written into
        ``out`` / ``lse_out`` when given."""
        backend = self.backend
        xp = array_namespace(q)
        q_dtype = q.dtype
        if backend.wide_queries and canonical_name(q_dtype) in ("float16", "bfloat16"):
            # both parts in float32 and one rounding after the merge: rounding each
            # partial to 16 bits first doubled the error (two roundings where one call has one)
            q = xp.astype(q, xp.float32)
        packed = len(self.q_shape) == 3
        Hkv, G = self.kv_heads, self.group
        Hq, d = int(self.q_shape[1]), int(self.q_shape[-1])
        if packed:
            q_tok = q
        else:  # [B, Hq, T, d] -> token-major [B * T, Hq, d]
            B, _, T, _ = self.q_shape
            q_tok = xp.reshape(xp.permute_dims(q, (0, 2, 1, 3)), (B * T, Hq, d))
        shared_store = self.shared_store(store)
        outs, lses = [], []
        for gi, (v_inputs, v_shape, work) in enumerate(self.shared):
            Q = int(self.gather[gi].size)
            qg = xp.take(q_tok, self._ints(q, f"gather{gi}", self.gather[gi]), axis=0)
            # [Q, Hkv, G, d] -> [Hkv, Q, G, d]: virtual head kv * (Q * G) + t * G + g
            qv = xp.reshape(xp.permute_dims(xp.reshape(qg, (Q, Hkv, G, d)), (1, 0, 2, 3)), v_shape)
            o_v, lse_v = _attend(backend, qv, shared_store, v_inputs, work)
            outs.append(xp.reshape(xp.permute_dims(xp.reshape(o_v, (Hkv, Q, G, d)), (1, 0, 2, 3)),
                                   (Q, Hq, d)))
            lse_g = xp.reshape(xp.permute_dims(xp.reshape(lse_v, (Hkv, Q, G)), (1, 0, 2)), (Q, Hq))
            shift = self.lse_shift[gi]
            if shift is not None:  # ALiBi: the true positions' constant
                lse_g = lse_g - self._floats(f"alibi{gi}", shift, lse_g.dtype)
            lses.append(lse_g)
        # the suffix call after the shared ones: on numba the two run on different threads
        # (the shared call's large tiles on the BLAS path's thread pool, the suffix on the
        # kernels' OpenMP workers, which spin a while after each call and slowed the next
        # layer's shared call; this order leaves the merge between them: 32 rows x 4,096
        # bfloat16, 13.1-13.2 -> 11.4-12.3 ms a call)
        s_inputs, s_work = self.suffix
        o_suf, lse_suf = _attend(backend, q, self.suffix_store(store), s_inputs, s_work)
        dev = getattr(o_suf, "device", None)
        outs.append(xp.zeros((1, Hq, d), dtype=o_suf.dtype, device=dev))
        lses.append(xp.full((1, Hq), -np.inf, dtype=lse_suf.dtype, device=dev))
        pick = self._ints(q, "pick", self.pick)
        o_sh = xp.take(xp.concat(outs, axis=0), pick, axis=0)  # token-major [R, Hq, d]
        lse_sh = xp.take(xp.concat(lses, axis=0), pick, axis=0)  # [R, Hq]
        if not packed:  # back to [B, Hq, T, d] / [B, Hq, T]
            o_sh = xp.permute_dims(xp.reshape(o_sh, (B, T, Hq, d)), (0, 2, 1, 3))
            lse_sh = xp.permute_dims(xp.reshape(lse_sh, (B, T, Hq)), (0, 2, 1))
        o, lse = merge_attention(o_suf, lse_suf, o_sh, lse_sh)
        if o.dtype != q_dtype:
            o = xp.astype(o, q_dtype)
        return write_into((o, lse), return_lse, out, lse_out)


def _attend(backend, q, store, inputs, work):
    """(out, lse) of one part: the backend's attention with its sub-plan (if any)."""
    if work is None:
        return backend.attention(q, store, inputs, inputs.params, return_lse=True)
    return backend.attention(q, store, inputs, inputs.params, return_lse=True, work=work,
                             out=None, lse_out=None)


__all__ = ["MAX_GROUP_QUERIES", "MIN_GROUP_ROWS", "MIN_SAVED_TOKENS", "MIN_SHARED_TOKENS", "SharedGroup",
           "SharedPrefix", "SharedPrefixWork", "decide", "min_saved_tokens"]
