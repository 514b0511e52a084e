"""Paged KV storage: memory that follows the live tokens, rows that share pages.

Layout. One pool of pages is allocated once: K and V each
``[*leading, num_pages, Hkv, page_size, d]`` (heads-major inside a page, so one head's
``page_size`` tokens are contiguous; ``leading`` is ``()`` for a cache, ``(layers,)``
for a ModelKVCache, whose layers all page through one table). Row ``b``'s token ``j``
of KV head ``h`` is at ``[..., entries[b, j // P], h, j % P, :]`` (``P = page_size``).

Bookkeeping (``PageTable``, host NumPy, shared by every layer):

- ``entries`` ``[B, pages_per_row]`` int32: row b's pages in token order, ``-1`` past the
  ``held[b]`` pages it holds; ``pages_per_row = ceil(max_len / P)``;
- ``refs`` ``[num_pages]`` int32: how many table entries name each page;
- a free list of the pages no entry names (``refs == 0``);
- optionally a prefix cache (``gqakv.storage.prefix_index.PrefixIndex``, ``prefix_cache=True``):
  full pages keyed by the tokens they hold. A cached page no entry names is not freed
  but kept, matchable, in the index's LRU of unused pages; an append takes free pages
  first and evicts the least recently released unused ones only when none is left.
  A cached page's tokens never change while it is cached: a write into it (a row
  truncated into a cached page, then appending; accept moving draft tokens) copies it
  first, as for a shared page.

- optionally a sliding window W (``window=W``, window-sized storage for a sliding layer):
  ``released`` ``[B]`` counts each row's leading pages given back to the pool, their entries
  -1. When an append starts at a row's length ``s``, its pages whose every key is before
  ``s - W + 1`` (the first key the append's first query, at position ``s``, sees; no
  later query sees an earlier one) are released first (``window_releasable``), so they
  can serve that append. Readers start at the window's first key and so never look at a
  released entry (``PagedStore._page_view`` raises if one does); a length whose next query
  would see a released key is refused (``check_keep``: truncate, accept), as is attention
  over one (``gqakv.core.inputs.check_held_keys``).

Invariant outside an open model step: row b holds exactly ``ceil(lens[b] / P)`` pages
(``held``, the window's released ones included; it names ``held - released`` of them).
Every page a row holds is full except perhaps its last, so the only page an append can
land in that another row may also name is that partly filled last page: it is copied
first (copy on write), and only its live tokens are copied; the table names the copy
only once it holds them, so a reader running alongside an append sees the shared page or
the filled copy. Accept rewrites live slots of a row's last pages: each such page that
another row names or the prefix cache holds is copied the same way first
(``reserve_writes``, ``PagedStore.reserve_moves``). An aborted model step gives back every
page it took, copies included (``PageTable.undo``). Row operations are bookkeeping:
``reorder`` and ``fork`` copy table entries and bump reference counts, ``truncate`` and
``reset`` release pages no row names any more. Appends take pages from the free list;
when it cannot supply a call's pages, ``OutOfPages`` (a MemoryError) is raised before
anything changes.

Reading. ``PagedStore.key_blocks`` walks a row in page-aligned spans and ``blocks`` of
one page's span are views of the pool, so the generic attention path reads a row page
by page without gathering it. ``blocks`` over several pages (``live_kv``) gathers them
into new arrays: copies.

Quantized pages (``kv_dtype``, ``gqakv.storage.quantize``): the pool holds codes and the scales
are paged with their tokens, ``k_scale``/``v_scale`` ``[*leading, num_pages, Hkv,
page_size]`` float32: token j's scale sits at the same (page, slot) as its codes, so
sharing, copy on write and releasing a page carry its scales with no bookkeeping of
their own. ``blocks`` then returns dequantized float32 copies (never views).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from array_api_compat import array_namespace

import dataclasses

from ..core.dims import check_dim
from .prefix_index import PrefixIndex
from .store import CONTIGUOUS, DEQUANT_BLOCK_ELEMENTS, PAGED, KVStore, StorageSpec, check_max_chunk

#: Default tokens per page.
DEFAULT_PAGE_SIZE = 16
#: Most keys one generic-path key block gathers from several small pages (a bounded copy,
#: never a whole row): per-block overhead (a matmul launch, the online softmax's rescale)
#: would otherwise dominate with pages of 16 keys. Pages of at least this size are read
#: one page per block, as views.
GATHER_KEYS = 256


class OutOfPages(MemoryError):
    """The page pool cannot supply the pages a call needs; nothing was changed."""


def pages_for(tokens: int, page_size: int) -> int:
    """Pages holding ``tokens`` tokens: ``ceil(tokens / page_size)``."""
    return -(-int(tokens) // int(page_size))


def window_pages(window: int | None, max_len: int, page_size: int, chunk: int) -> int:
    """Pages one row of a layer kind ever holds at once: ``ceil(max_len / P)`` for a full
    layer (None); for a sliding layer of window W appending at most ``chunk`` tokens at
    once, the keys an append can still need span ``W - 1 + chunk`` tokens (from ``s - W +
    1``, the first key its first query at ``s`` sees, to ``s + chunk - 1``); starting at
    worst on a page's last slot, they lie on at most ``ceil((W - 1 + chunk + P - 1) / P)``
    pages, and never more than the full layer's. A pool of ``rows x window_pages(...)``
    pages never runs out for rows of ``max_len`` tokens (copies on write included: a copy
    replaces the row's last page; ``gqakv.storage.ring`` gives the argument)."""
    max_len, chunk = check_dim("max_len", max_len, 0), check_dim("chunk", chunk, 0)
    page_size, _ = check_page_args(page_size, None, 1, max_len)
    full = pages_for(max_len, page_size)
    if window is None:
        return full
    return min(full, pages_for(int(window) - 1 + chunk + page_size - 1, page_size))


@dataclasses.dataclass
class Reservation:
    """What one ``PageTable.reserve`` took, so it can be finished (``point``) or given back
    (``undo``) exactly.

    copies: ``(row, j, old page, new page, tokens)``: entry ``j`` of ``row`` is to name
        ``new`` once the first ``tokens`` slots of ``old`` are copied into it.
    grown: ``(row, held before)`` for each row that took fresh pages (or none).
    taken: every page taken from the free list, in the order taken.
    evicted: the pages of ``taken`` evicted from the prefix cache to serve it (``undo``
        returns them as free pages, not cached ones: the write may have reused them).
    pointed: whether ``point`` made the table name the copies.
    window_released: pages the window released as the call opened (a sliding-window
        table, ``PageTable.window``): ``undo`` does not take them back (they are behind
        every query the rows can still make at their lengths).
    """

    copies: list[tuple[int, int, int, int, int]] = dataclasses.field(default_factory=list)
    grown: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    taken: list[int] = dataclasses.field(default_factory=list)
    evicted: list[int] = dataclasses.field(default_factory=list)
    pointed: bool = False
    window_released: int = 0


def _changes_entries(method):
    """Marks a ``PageTable`` method that may write ``entries``: ``version`` counts each
    call, even one that raises part way (what a device copy of the table is kept by)."""
    @functools.wraps(method)
    def counted(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            self.version += 1
    return counted


class PageTable:
    """Page tables, reference counts and the free list of one pool (see the module
    docstring). Host NumPy only; every mutation is called under the cache's writer lock,
    after the caller validated its arguments.

    ``entries`` changes only through the methods marked ``_changes_entries``, each of which
    counts ``version`` up: a backend that keeps a device copy of the table (CuPy) knows it
    still holds when ``entries`` is the same array at the same version, without comparing
    its bytes on every layer. Code outside the table reads ``entries`` and never writes it
    (the test suite's page audit checks that every change came with a new version)."""

    def __init__(self, batch: int, max_len: int, page_size: int, num_pages: int, *,
                 prefix_cache: bool = False, window: int | None = None,
                 max_chunk: int | None = None):
        self.page_size, self.num_pages = int(page_size), int(num_pages)
        #: None (every page kept), or the sliding window W of the layers paging through this
        #: table: ``reserve`` releases each row's pages wholly behind the window (see
        #: ``window_releasable``)
        self.window = None if window is None else int(window)
        #: None (appends of any length), or the most tokens one append may add to a row
        #: (a windowed table only): ``reserve`` refuses a longer one before anything
        #: changes (``check_chunk``), which is what lets a pool of ``rows x
        #: window_pages(W, max_len, P, max_chunk)`` pages never run out (``gqakv.storage.ring``)
        self.max_chunk = None if max_chunk is None else int(max_chunk)
        #: the prefix cache's index (None: no prefix cache; pages no entry names are free)
        self.index = PrefixIndex(self.page_size, self.num_pages) if prefix_cache else None
        self.pages_per_row = pages_for(max_len, page_size)
        self.entries = np.full((batch, self.pages_per_row), -1, dtype=np.int32)
        #: counts the calls that may have changed ``entries`` (see the class docstring)
        self.version = 0
        self.held = np.zeros(batch, dtype=np.int64)
        #: ``[B]`` int64: how many of row b's first pages the window released (their entries
        #: are -1; 0 without a window). Row b names ``entries[b, released[b]:held[b]]``.
        self.released = np.zeros(batch, dtype=np.int64)
        self.refs = np.zeros(self.num_pages, dtype=np.int32)
        # A stack: pop() hands out the lowest free page first (deterministic layouts).
        self._free = list(range(self.num_pages - 1, -1, -1))
        #: pages the window has released so far, over the table's life (a count)
        self.window_released = 0

    # -- counts ----------------------------------------------------------------------------

    @property
    def pages_free(self) -> int:
        """Pages an append can take: the free list, plus (prefix cache) the cached pages no
        row names, which are evicted only when the free list runs out."""
        return len(self._free) + self.pages_reusable

    @property
    def pages_reusable(self) -> int:
        """Cached pages no row names (0 without a prefix cache): matchable until evicted."""
        return 0 if self.index is None else self.index.pages_unused

    @property
    def pages_used(self) -> int:
        """Pages some row's entries name."""
        return self.num_pages - self.pages_free

    @property
    def nbytes(self) -> int:
        """Host bytes of the bookkeeping (``nbytes_for`` of this table's sizes)."""
        return self.nbytes_for(self.entries.shape[0], self.pages_per_row * self.page_size,
                               self.page_size, self.num_pages)

    @staticmethod
    def nbytes_for(batch: int, max_len: int, page_size: int, num_pages: int) -> int:
        """Host bytes of the bookkeeping of such a pool: the entries ``[B, ceil(max_len / P)]``
        int32, ``held`` and ``released`` ``[B]`` int64, ``refs`` ``[num_pages]`` int32 and a
        free list of up to ``num_pages`` 8-byte entries."""
        return (4 * batch * pages_for(max_len, page_size) + 16 * batch
                + (4 + 8) * num_pages)

    def row_pages(self, row: int) -> np.ndarray:
        """The pages row ``row`` names, in token order (a view): its first
        ``released[row]`` entries, released by the window, are not among them."""
        return self.entries[row, self.released[row]:self.held[row]]

    # -- the sliding window ------------------------------------------------------------------

    def first_held(self, rows) -> np.ndarray:
        """``[len(rows)]`` int64: the first token each row still holds (``released x P``;
        0 without a window). Keys before it are gone: no reader may ask for them."""
        return self.released[np.asarray(rows, dtype=np.int64)] * self.page_size

    def window_releasable(self, start: int) -> int:
        """How many leading pages a row may release when an append starts at ``start``
        (its length then): the pages whose every key is before ``start - W + 1``, the
        first key the append's first query (at position ``start``) sees; no later query of
        the row sees an earlier key, as long as its length does not fall below ``start``
        (``check_keep`` refuses such a truncate once pages are gone)."""
        if self.window is None:
            return 0
        return max(0, int(start) - self.window + 1) // self.page_size

    def check_keep(self, rows, new_lens, what: str) -> None:
        """Refuse (ValueError naming the row, the window and the numbers; nothing changed)
        lengths ``new_lens[i]`` for rows ``rows[i]`` whose next query would see a released
        key: a row at ``L' > 0`` tokens must still hold keys ``max(0, L' - W + 1)..``
        (``L' = 0`` empties the row: allowed)."""
        if self.window is None:
            return
        W, P = self.window, self.page_size
        for r, n in zip(rows, new_lens):
            r, n = int(r), int(n)
            gone = int(self.released[r]) * P
            if n > 0 and max(0, n - W + 1) < gone:
                raise ValueError(
                    f"cannot {what} row {r} to {n} tokens: its sliding window (window={W}) already "
                    f"released tokens 0..{gone - 1} ({int(self.released[r])} pages of {P}), and a "
                    f"row of {n} tokens needs keys from {max(0, n - W + 1)} on (the next query, at "
                    f"position {n}, sees keys {max(0, n - W + 1)}..{n}); the shortest length "
                    f"allowed is {gone + W - 1} (or 0, which empties the row). Nothing was changed")

    def check_chunk(self, rows, n_new) -> None:
        """Refuse (ValueError naming the row, the numbers and the window; nothing changed) an
        append of more than ``max_chunk`` tokens to a row: the pool was sized for appends
        of at most that many (``gqakv.storage.ring``). No limit without ``max_chunk``."""
        if self.max_chunk is None or self.window is None:  # max_chunk comes with a window
            return
        for i in range(len(rows)):
            n = int(n_new[i])
            if n > self.max_chunk:
                raise ValueError(
                    f"an append of n_new[{i}]={n} tokens to row {int(rows[i])} exceeds this "
                    f"window-sized cache's max_chunk={self.max_chunk} (window={self.window}: its "
                    f"pool of {self.num_pages} pages of {self.page_size} tokens holds, per row, "
                    f"the window's {self.window - 1} earlier keys plus at most {self.max_chunk} "
                    f"new ones); append it in chunks of at most {self.max_chunk} tokens, or make "
                    "the cache with a larger max_chunk. Nothing was written and no length changed")

    def _window_plan(self, rows, starts, n_new) -> list[tuple[int, int]]:
        """``(row, pages)``: each appending row's leading pages the window lets go now
        (``window_releasable`` of its start, past those already released)."""
        if self.window is None:
            return []
        plan = []
        for i in range(len(rows)):
            if int(n_new[i]) == 0:
                continue
            r = int(rows[i])
            k = min(self.window_releasable(int(starts[i])), int(self.held[r]))
            if k > int(self.released[r]):
                plan.append((r, k))
        return plan

    @_changes_entries
    def _window_release(self, plan) -> int:
        """Release ``plan``'s pages (entries set to -1); returns how many pages were released."""
        done = 0
        for r, k in plan:
            a = int(self.released[r])
            self._release(self.entries[r, a:k].copy())
            self.entries[r, a:k] = -1
            self.released[r] = k
            done += k - a
        self.window_released += done
        return done

    # -- taking and releasing --------------------------------------------------------------

    def _take(self, res: "Reservation") -> int:
        if self._free:
            page = self._free.pop()
        else:  # the pool needs a cached page no row names: the least recently released one
            assert self.index is not None  # reserve counted the unused cached pages
            page = int(self.index.evict(1)[0])
            res.evicted.append(page)
        self.refs[page] = 1
        res.taken.append(page)
        return page

    def _release(self, pages) -> None:
        """Drop one reference to each of ``pages``; pages no entry names go back to the pool."""
        pages = np.asarray(pages, dtype=np.int64)
        if pages.size == 0:
            return
        np.subtract.at(self.refs, pages, 1)
        dead = np.unique(pages[self.refs[pages] == 0])
        if self.index is not None:  # cached pages stay matchable, in the unused LRU
            dead = self.index.release(dead)
        self._free.extend(int(p) for p in dead[::-1])

    def _share(self, pages) -> None:
        pages = np.asarray(pages, dtype=np.int64)
        if pages.size:
            np.add.at(self.refs, pages, 1)

    # -- appends -----------------------------------------------------------------------------

    def reserve(self, rows, starts, n_new) -> "Reservation":
        """Take the pages an append of ``n_new[i]`` tokens to row ``rows[i]`` (holding
        ``starts[i]`` tokens; rows distinct) needs: fresh pages past its last, and a private
        copy of its last page when that page is partly filled and shared (copy on write).

        Raises OutOfPages, with nothing changed, when the free list is too short. The table
        names the fresh pages at once (past the live tokens, where no reader looks) but not
        the copies: the caller fills them (``Reservation.copies``), then ``point`` makes the
        table name them, so a reader never sees a page before it holds its tokens.
        ``undo`` gives everything back.

        A sliding-window table (``window``) first releases each appending row's pages
        wholly behind its window (``window_releasable(starts[i])``), so they can serve this
        very append; an OutOfPages takes those releases back too; ``undo`` does not (the
        released pages are behind every query the rows can still make). An append longer
        than ``max_chunk`` is refused first (``check_chunk``: ValueError, nothing changed)."""
        self.check_chunk(rows, n_new)  # before anything changes
        # The window first lets go of the pages behind it (before the pages the write needs
        # are counted: they serve it); refused calls take those releases back.
        window = self._window_plan(rows, starts, n_new)
        undo_window = [(r, int(self.released[r]), self.entries[r, int(self.released[r]):k].copy())
                       for r, k in window]
        released = self._window_release(window)
        try:
            res = self._reserve(rows, starts, n_new)
        except BaseException:
            self._window_unrelease(undo_window)
            raise
        res.window_released = released
        return res

    @_changes_entries
    def _window_unrelease(self, undo) -> None:
        """Take back ``_window_release``'s releases (``(row, released before, pages)``, in
        the order made): a refused ``reserve`` changes nothing."""
        for r, a, pages in reversed(undo):
            for p in pages.tolist():
                if self.refs[p] == 0:  # freed (or left cached, unused) by the release
                    if self.index is not None and p in self.index.unused:
                        self.index.use([p])
                    else:
                        self._free.remove(p)
                self.refs[p] += 1
            self.entries[r, a:a + pages.size] = pages
            self.released[r] = a
            self.window_released -= int(pages.size)

    @_changes_entries
    def _reserve(self, rows, starts, n_new) -> "Reservation":
        P = self.page_size
        # A shared last page is kept (written in place) by one of this call's rows only when
        # every row naming it is in the call, and then by the one with the most tokens in it:
        # its writes land past every other namer's live slots, so they stay intact for a
        # reader still holding the old page and for an abort that points a row back at it.
        writers: dict[int, list[tuple[int, int]]] = {}
        for i in range(len(rows)):
            s = int(starts[i])
            if int(n_new[i]) and s % P:
                page = int(self.entries[int(rows[i]), s // P])
                writers.setdefault(page, []).append((s, i))
        keeps = {max(w)[1] for page, w in writers.items()
                 if len(w) == int(self.refs[page]) and not self._cached(page)}
        plan = []  # (row, start, fresh pages, copy-on-write?)
        need = {}
        for i in range(len(rows)):
            n = int(n_new[i])
            if n == 0:
                continue
            r, s = int(rows[i]), int(starts[i])
            fresh = pages_for(s + n, P) - int(self.held[r])
            cow = bool(s % P) and i not in keeps
            plan.append((r, s, fresh, cow))
            if fresh + cow:
                need[r] = fresh + int(cow)
        self._check_supply(need)
        res = Reservation()
        for r, s, fresh, cow in plan:
            if cow:  # only the live tokens of the shared last page are copied
                self._copy(res, r, s // P, s % P)
            h = int(self.held[r])
            for j in range(h, h + fresh):
                self.entries[r, j] = self._take(res)
            res.grown.append((r, h))
            self.held[r] = h + fresh
        return res

    def _check_supply(self, need: dict[int, int]) -> None:
        """OutOfPages (nothing changed yet) unless the pool can supply ``need`` (row: pages)."""
        total = sum(need.values())
        if total > self.pages_free:
            shown = ", ".join(f"row {r} needs {k}" for r, k in list(need.items())[:8])
            more = " ..." if len(need) > 8 else ""
            raise OutOfPages(
                f"the page pool cannot supply {total} pages ({shown}{more}): {self.pages_free} of "
                f"{self.num_pages} pages (page_size {self.page_size}) are free"
                + (f" ({self.pages_reusable} of them cached, unused)" if self.index is not None else "")
                + "; nothing was written and no "
                "length changed (truncate or reset rows, or make the cache with more num_pages)")

    def _copy(self, res: "Reservation", r: int, j: int, tokens: int) -> None:
        """Take a page for a private copy of row ``r``'s entry ``j`` (its first ``tokens``
        slots to be copied); ``point`` names it once filled."""
        res.copies.append((r, j, int(self.entries[r, j]), self._take(res), int(tokens)))

    def reserve_writes(self, writes) -> "Reservation":
        """Private copies of the pages that writes into live slots would change while another
        row names them or the prefix cache holds them (copy on write; accept's moves).

        ``writes``: ``(row, j, tokens)``: row ``row`` writes into its entry ``j``, whose first
        ``tokens`` slots are live (they are copied). In order: a page named by several rows of
        ``writes`` is copied for each but the last, which then names it alone and writes it
        in place (a cached page is copied for every writer: its tokens never change).
        OutOfPages, with nothing changed, when the pool is short; the caller fills the copies,
        then ``point`` (or ``undo``), as for ``reserve``."""
        left: dict[int, int] = {}  # references a page keeps once the earlier writers' copies are named
        wanted: list[tuple[int, int, int]] = []
        need: dict[int, int] = {}
        for r, j, tokens in writes:
            page = int(self.entries[r, j])
            refs = left.get(page, int(self.refs[page]))
            if refs > 1 or self._cached(page):
                left[page] = refs - 1
                wanted.append((r, j, tokens))
                need[r] = need.get(r, 0) + 1
        self._check_supply(need)
        res = Reservation()
        for r, j, tokens in wanted:
            self._copy(res, r, j, tokens)
        return res

    @_changes_entries
    def point(self, res: "Reservation") -> None:
        """Make the table name ``res``'s copies (filled by now) instead of the shared pages
        they copy; each shared page loses one reference (other rows still name it)."""
        for r, j, old, new, _ in res.copies:
            self.entries[r, j] = new
            self._release([old])
        res.pointed = True

    @_changes_entries
    def undo(self, res: "Reservation") -> None:
        """Give back everything ``res`` took: the table, held counts, reference counts and
        free list return exactly to what they were before ``reserve`` (nothing else may have
        changed the table in between; an open step or the writer lock sees to that)."""
        if res.pointed:
            for r, j, old, new, _ in reversed(res.copies):
                if self.refs[old] == 0:  # freed by point(): it is named again
                    if self.index is not None and old in self.index.unused:
                        self.index.use([old])
                    else:
                        self._free.remove(old)
                self.refs[old] += 1
                self.entries[r, j] = old
            res.pointed = False
        for r, h in reversed(res.grown):
            self.entries[r, h:int(self.held[r])] = -1
            self.held[r] = h
        for page in res.taken:
            self.refs[page] = 0
        self._free.extend(reversed(res.taken))  # the stack as it was: same pages, same order
        res.taken, res.copies, res.grown, res.evicted = [], [], [], []

    def _cached(self, page: int) -> bool:
        return self.index is not None and self.index.holds(page)

    # -- the prefix cache ----------------------------------------------------------------------

    @_changes_entries
    def attach(self, row: int, pages) -> None:
        """Empty row ``row`` names ``pages`` (int ``[k]``, cached pages matched for it) as its
        first ``k`` pages: a reference each, no copy."""
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        assert self.index is not None and int(self.held[row]) == 0 and pages.size <= self.pages_per_row
        assert int(self.released[row]) == 0
        self.index.use(pages)
        self._share(pages)
        self.entries[row, :pages.size] = pages
        self.held[row] = pages.size

    # -- row operations ----------------------------------------------------------------------

    @_changes_entries
    def trim(self, rows, new_lens) -> None:
        """Row ``rows[i]`` keeps the pages of ``new_lens[i]`` tokens and releases the rest."""
        for r, n in zip(rows, new_lens):
            r, keep = int(r), pages_for(n, self.page_size)
            h, gone = int(self.held[r]), int(self.released[r])
            if keep < gone:  # only an emptied row (check_keep): it starts again at its first page
                assert keep == 0, (r, keep, gone)
                self.released[r], keep_from = 0, gone
            else:
                keep_from = keep
            if keep < h:
                self._release(self.entries[r, keep_from:h].copy())
                self.entries[r, keep:h] = -1
                self.held[r] = keep

    @_changes_entries
    def reorder(self, src) -> None:
        """Row b takes row ``src[b]``'s pages (``[B]``, duplicates allowed)."""
        src = np.asarray(src, dtype=np.int64)
        entries, held = self.entries[src].copy(), self.held[src].copy()
        released = self.released[src].copy()
        none = [np.zeros(0, dtype=np.int32)]
        self._share(np.concatenate([entries[b, released[b]:held[b]] for b in range(len(src))] or none))
        self._release(np.concatenate([self.row_pages(b) for b in range(len(src))] or none))
        self.entries[...] = entries
        self.held[...] = held
        self.released[...] = released

    @_changes_entries
    def fork(self, src: int, dst) -> None:
        """Each row of ``dst`` (distinct, without ``src``) takes ``src``'s pages."""
        pages = self.row_pages(src).copy()  # the pages it names (the window's are gone)
        row = self.entries[src].copy()
        for r in dst:
            r = int(r)
            self._share(pages)  # before releasing, in case r already names some of them
            self._release(self.row_pages(r).copy())
            self.entries[r, :] = row
            self.held[r], self.released[r] = self.held[src], self.released[src]

    # -- checks ------------------------------------------------------------------------------

    def audit(self, lens=None) -> list[str]:
        """Every broken invariant of the bookkeeping, as sentences (empty: sound). With
        ``lens`` (``[B]``), also that row b holds exactly ``ceil(lens[b] / P)`` pages
        (``held``; the window's released ones among them named by no entry) and released
        none that its next query sees."""
        problems = []
        counted = np.zeros(self.num_pages, dtype=np.int64)
        for b in range(self.entries.shape[0]):
            h, gone = int(self.held[b]), int(self.released[b])
            live, rest = self.entries[b, gone:h], self.entries[b, h:]
            if not 0 <= gone <= h or (gone and self.window is None):
                problems.append(f"row {b} released {gone} of its {h} pages"
                                + ("" if self.window is not None else " without a window"))
                continue
            if (self.entries[b, :gone] != -1).any():
                problems.append(f"row {b} still names pages the window released: "
                                f"{self.entries[b, :gone].tolist()}")
            if (live < 0).any() or (live >= self.num_pages).any():
                problems.append(f"row {b} names pages outside the pool: {live.tolist()}")
                continue
            if (rest != -1).any():
                problems.append(f"row {b} has entries past its {h} pages: {rest.tolist()}")
            if lens is not None and gone and self.window is not None:
                # every query the row can still make sees keys from max(0, L - W + 1) on
                need = max(0, int(lens[b]) - self.window + 1)
                if gone * self.page_size > need:
                    problems.append(f"row {b} of {int(lens[b])} tokens released {gone} pages "
                                    f"(tokens 0..{gone * self.page_size - 1}), past the first key "
                                    f"{need} its next query sees (window {self.window})")
            if np.unique(live).size != live.size:
                problems.append(f"row {b} names a page twice: {live.tolist()}")
            np.add.at(counted, live, 1)
            if lens is not None and h != pages_for(lens[b], self.page_size):
                problems.append(f"row {b} holds {h} pages for {int(lens[b])} tokens "
                                f"(page_size {self.page_size})")
        bad = np.flatnonzero(counted != self.refs)
        if bad.size:
            p = int(bad[0])
            problems.append(f"page {p} has refcount {int(self.refs[p])} but {int(counted[p])} "
                            f"table entries ({bad.size} pages disagree)")
        free = np.asarray(self._free, dtype=np.int64)
        if np.unique(free).size != free.size:
            problems.append("a page is on the free list twice (double free)")
        unused = set() if self.index is None else set(self.index.unused)
        if unused & set(free.tolist()):
            problems.append(f"pages both free and cached: {sorted(unused & set(free.tolist()))[:8]}")
        if self.index is not None:
            problems += [f"prefix cache: {p}" for p in self.index.audit()]
        unnamed = set(np.flatnonzero(counted == 0).tolist())
        if set(free.tolist()) | unused != unnamed:
            leaked = sorted(unnamed - set(free.tolist()) - unused)[:8]
            wrong = sorted((set(free.tolist()) | unused) - unnamed)[:8]
            problems.append(f"free list and unused cached pages disagree with the tables: "
                            f"leaked {leaked}, free but named {wrong}")
        return problems


class PageTableView:
    """A read-only page table over entries the caller owns (the functional paged API,
    ``gqakv.paged_append`` / ``paged_attention``): what readers and writers of a paged
    store read (``entries`` ``[B, pages_per_row]`` int32, ``page_size``, ``num_pages``,
    ``pages_per_row``), with no reference counts or free list: it cannot reserve,
    share or release pages, and says so."""

    def __init__(self, entries: np.ndarray, page_size: int, num_pages: int):
        self.page_size, self.num_pages = int(page_size), int(num_pages)
        self.pages_per_row = int(entries.shape[1])
        self.entries = np.array(entries, dtype=np.int32)  # our own copy, frozen
        self.entries.flags.writeable = False

    def _refuse(self, *args, **kwargs):
        raise TypeError("this page table belongs to the caller (the functional paged API): "
                        "gqakv reads it and never takes, shares or releases its pages")

    reserve = point = undo = reorder = fork = trim = attach = _refuse
    version = 0  # its entries never change (PageTable.version)
    index = None  # a caller's pools keep their own gqakv.storage.prefix_index.PrefixIndex
    window = None  # a caller's table releases nothing on its own
    max_chunk = None

    def check_chunk(self, rows, n_new) -> None:
        """Nothing to refuse: a caller's table sizes its own pages."""

    def first_held(self, rows) -> np.ndarray:
        """Zeros: gqakv releases none of a caller's pages (the caller's table says what is live)."""
        return np.zeros(len(rows), dtype=np.int64)

    def check_keep(self, rows, new_lens, what: str) -> None:
        """Nothing to refuse: a caller's table keeps what the caller keeps."""


class PagedStore(KVStore):
    """A KVStore of kind ``"paged"``: the pool ``k``, ``v`` ``[*leading, num_pages, Hkv,
    page_size, d]`` (codes when quantized, with ``k_scale``, ``v_scale`` ``[*leading,
    num_pages, Hkv, page_size]``) and the shared ``PageTable`` (``page_table``). ``rows`` and
    ``max_len`` are the cache's, not the pool's."""

    __slots__ = ("_page_table", "page_size", "num_pages")

    def __init__(self, spec: StorageSpec, k, v, page_table: "PageTable | PageTableView", rows: int,
                 max_len: int, k_scale=None, v_scale=None):
        super().__init__(spec, k, v, k_scale, v_scale)  # leading, kv_heads, head_dim
        self.num_pages, self.page_size = int(k.shape[-4]), int(k.shape[-2])
        self.rows, self.max_len = int(rows), int(max_len)
        self._page_table = page_table

    @classmethod
    def layout_args(cls, batch: int, max_len: int, *, page_size=None, num_pages=None,
                    prefix_cache=False, window=None, max_chunk=None) -> dict:
        """``page_size`` (default ``DEFAULT_PAGE_SIZE``), ``num_pages`` (None: every row
        at ``max_len``; with ``max_chunk``: ``batch x window_pages(W, max_len, P,
        max_chunk)``, a ring that never runs out, ``gqakv.storage.ring``), ``prefix_cache``
        (a bool), ``window`` (None, or the layers' sliding window W >= 1: pages behind it
        go back to the pool) and ``max_chunk`` (None, or with a window the most tokens one
        append adds to a row; longer appends are refused), checked (``check_page_args``,
        ``check_window``, ``gqakv.storage.store.check_max_chunk``)."""
        from ..core.inputs import check_window

        page_size, num_pages = check_page_args(DEFAULT_PAGE_SIZE if page_size is None else page_size,
                                               num_pages, batch, max_len)
        if not isinstance(prefix_cache, (bool, np.bool_)):
            raise TypeError(f"prefix_cache must be a bool, got {prefix_cache!r}")
        window = check_window(window)
        max_chunk = check_max_chunk(max_chunk, window)
        if max_chunk is not None and num_pages is None:
            # a ring (gqakv.storage.ring); no append adds more than max_len tokens
            num_pages = batch * window_pages(window, max_len, page_size, min(max_chunk, max_len))
        return {"page_size": page_size, "num_pages": num_pages, "prefix_cache": bool(prefix_cache),
                "window": window, "max_chunk": max_chunk}

    @classmethod
    def allocate(cls, backend, spec: StorageSpec, shape: tuple[int, ...], what: str,
                 device=None, *, page_size: int = DEFAULT_PAGE_SIZE,
                 num_pages: int | None = None, prefix_cache: bool = False,
                 window: int | None = None, max_chunk: int | None = None) -> "PagedStore":
        """A paged store for a cache of ``shape`` = ``(*leading, rows, Hkv, max_len, d)``:
        a pool of ``num_pages`` pages (default: every row at ``max_len``, no overcommit),
        with a prefix cache's index when ``prefix_cache``; ``window``: its table releases
        the pages behind each row's sliding window (``PageTable.window``); ``max_chunk``:
        its table refuses longer appends (``PageTable.check_chunk``)."""
        *leading, rows, kv_heads, max_len, head_dim = shape
        if num_pages is None:
            num_pages = rows * pages_for(max_len, page_size)
        pool = KVStore.allocate(backend, dataclasses.replace(spec, kind=CONTIGUOUS),
                                (*leading, num_pages, kv_heads, page_size, head_dim),
                                f"{what} page pool", device=device)
        table = PageTable(rows, max_len, page_size, num_pages, prefix_cache=prefix_cache,
                          window=window, max_chunk=max_chunk)
        return cls(spec, pool.k, pool.v, table, rows, max_len, pool.k_scale, pool.v_scale)

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V pool (the page bookkeeping is ``page_table.nbytes``, on the host)."""
        return self.spec.nbytes(math.prod(self.leading) * self.num_pages * self.page_size,
                                self.kv_heads, self.head_dim)

    def pool_rows(self, xp) -> KVStore:
        """The pool as a contiguous store whose rows are pages (``[layers, num_pages, Hkv,
        page_size, d]``): page copies run through ``Backend.copy_tokens`` on it."""
        return KVStore(dataclasses.replace(self.spec, kind=CONTIGUOUS), self.k, self.v,
                       self.k_scale, self.v_scale).with_layers(xp)

    # -- the layout's row operations: bookkeeping, no data moves (but copy on write) --------

    def reserve(self, backend, rows, starts, n_new) -> Reservation:
        """The pages an append needs, shared partly filled last pages copied first
        (``reserve`` below); OutOfPages, with nothing changed, when the pool is short."""
        return reserve(backend, self, rows, starts, n_new)

    def give_back(self, reservation) -> None:
        """Every page ``reserve`` took (copies included) back to the pool; the tables as
        they were."""
        if reservation is not None:
            self.page_table.undo(reservation)

    def reorder_rows(self, backend, src_rows, lens) -> int:
        self.page_table.reorder(src_rows)  # rows share their sources' pages
        return 0

    def fork_rows(self, backend, src, dst_rows, n) -> int:
        self.page_table.fork(src, dst_rows)  # shared pages; the last is copied when a row writes into it
        return 0

    def trim_rows(self, rows, new_lens) -> None:
        self.page_table.trim(rows, new_lens)  # pages past the new lengths go back to the pool

    @property
    def window(self) -> int | None:
        """The sliding window whose pages behind it this store releases (None: keeps all)."""
        return self.page_table.window

    def first_held(self, rows) -> np.ndarray:
        """``[len(rows)]`` int64: the first token each row still holds (0 unless the
        window released pages; a caller's table keeps every page)."""
        return self.page_table.first_held(rows)

    def check_keep(self, rows, new_lens, what: str) -> None:
        """ValueError (nothing changed) when a row at ``new_lens[i]`` tokens would need keys
        the window released (``PageTable.check_keep``)."""
        self.page_table.check_keep(rows, new_lens, what)

    def row_kv(self, backend, row: int, n: int):
        """Copies gathered from the row's pages (the pages are shared and move between
        rows), even when the row fits in one page. A row whose window released pages has
        no whole history to give: ValueError naming what it still holds."""
        gone = int(self.first_held([row])[0])
        if gone:
            raise ValueError(
                f"row {row} holds tokens {gone}..{n - 1} of its {n}: its sliding window "
                f"(window={self.window}) released tokens 0..{gone - 1}, so live_kv cannot return "
                "the whole row (attention reads only the window, which the cache holds)")
        k, v = self.blocks(row, 0, n)
        xp = backend.namespace()
        return xp.asarray(k, copy=True), xp.asarray(v, copy=True)

    @property
    def page_table(self) -> "PageTable | PageTableView":
        """The page table this store pages through (shared by every layer's view)."""
        return self._page_table

    # -- views -------------------------------------------------------------------------------

    def layer(self, layer: int) -> "PagedStore":
        k, v, *scales = (a[layer, ...] for a in self.buffers)
        return PagedStore(self.spec, k, v, self.page_table, self.rows, self.max_len, *scales)

    def with_layers(self, xp) -> "PagedStore":
        if self.leading:
            return self
        k, v, *scales = (xp.expand_dims(a, axis=0) for a in self.buffers)
        return PagedStore(self.spec, k, v, self.page_table, self.rows, self.max_len, *scales)

    def temporary(self, backend, tokens: int):
        raise TypeError("paged storage moves rows by bookkeeping; it has no row temporaries")

    # -- reading -----------------------------------------------------------------------------

    def key_blocks(self, row: int, lo: int, hi: int, max_keys: int):
        """Spans ``(j0, j1)`` covering keys ``lo..hi-1``, each of at most ``max_keys`` keys
        and ending at a page boundary (or ``hi``): one page (a view) when pages hold at
        least ``GATHER_KEYS`` keys, else up to ``GATHER_KEYS // page_size`` whole pages
        (``blocks`` gathers them: a bounded copy)."""
        P = self.page_size
        span = P * max(1, GATHER_KEYS // P)
        cap = self.spec.codec.max_block_keys(self.kv_heads, self.head_dim, DEQUANT_BLOCK_ELEMENTS)
        if cap is not None:  # each span is decoded as a whole (a copy): keep it small
            max_keys = min(max_keys, cap)
        if max_keys < span:
            span = max(1, min(P, int(max_keys)))
        j0 = lo
        while j0 < hi:
            end = (j0 // P) * P + span if span >= P else j0 + span
            j1 = min(hi, end, (j0 // P + 1) * P if span <= P else end)
            yield j0, j1
            j0 = j1

    def blocks(self, row: int, j0: int, j1: int):
        """Keys and values ``j0 <= j < j1`` of ``row`` (no leading axes), ``[Hkv, j1 - j0, d]``:
        views of the pool within one page, gathered copies across pages; quantized:
        dequantized float32 copies."""
        P = self.page_size
        xp = array_namespace(self.k)
        if j1 <= j0:
            shape = (self.kv_heads, 0, self.head_dim)
            dev = getattr(self.k, "device", None)
            dt = self.spec.codec.decoded_dtype(xp, self.k.dtype)
            return xp.empty(shape, dtype=dt, device=dev), xp.empty(shape, dtype=dt, device=dev)
        if j0 // P == (j1 - 1) // P:
            return self._page_view(row, j0, j1)
        parts = [self._page_view(row, a, b) for a, b in self.key_blocks(row, j0, j1, P)]
        return (xp.concat([kb for kb, _ in parts], axis=1),
                xp.concat([vb for _, vb in parts], axis=1))

    def _page_view(self, row: int, j0: int, j1: int):
        """Keys/values ``j0..j1-1`` (inside one page) of ``row``: views of the pool
        (quantized: the page's codes x scales, dequantized copies)."""
        P = self.page_size
        page, o = int(self.page_table.entries[row, j0 // P]), (j0 // P) * P
        if page < 0:  # a page the window released (or past the row): no reader may get here
            raise RuntimeError(f"row {row}'s keys {j0}..{j1 - 1} are on no page (entry {j0 // P} "
                               f"is {page}): a reader asked for keys the cache does not hold")
        a, b = j0 - o, j1 - o
        return (self._decode(tuple(p[page, :, a:b, ...] for p in self._k_parts)),
                self._decode(tuple(p[page, :, a:b, ...] for p in self._v_parts)))

    # -- writing (the generic path) ----------------------------------------------------------

    def put(self, row: int, start: int, k, v) -> None:
        """Store ``k``, ``v`` ``[Hkv, n, d]`` as tokens ``start..`` of ``row`` (no leading
        axes), page by page; the pages must have been reserved (``PageTable.reserve``)."""
        P = self.page_size
        n = int(k.shape[1])
        xp = array_namespace(k)
        # each token's parts (quantized: codes and scale, from that token alone), then page by page
        codec = self.spec.codec
        writes = [(self._k_parts, codec.encode_keys(xp, k)), (self._v_parts, codec.encode(xp, v))]
        for j0, j1 in self.key_blocks(row, start, start + n, P):
            page = int(self.page_table.entries[row, j0 // P])
            a, b = j0 - (j0 // P) * P, j1 - (j0 // P) * P
            src = slice(j0 - start, j1 - start)
            for parts, values in writes:
                for buf, value in zip(parts, values):
                    buf[page, :, a:b, ...] = value[:, src, ...]

    def _slot(self, row: int, j: int) -> tuple[int, int]:
        P = self.page_size
        return int(self.page_table.entries[row, j // P]), j % P

    def reserve_moves(self, backend, moves, lens) -> Reservation | None:
        """Make every page accept's ``moves`` (``(row, dst, src)``: slots of ``row``, whose
        length is ``lens[row]``) would write the row's own before anything is written: a
        page another row also names or the prefix cache holds is copied first (its live
        tokens, every layer) and the row names the copy. OutOfPages, with nothing changed
        (not a byte), when the pool is short. A caller's table (``PageTableView``) has no
        counts: None (``paged_accept`` checks the table)."""
        res = self.take_copies(moves, lens)
        return None if res is None else fill_copies(backend, self, res)

    def take_copies(self, moves, lens) -> Reservation | None:
        """The bookkeeping half of ``reserve_moves`` (``PageTable.reserve_writes``): pages
        taken for the copies, nothing copied or named yet."""
        table = self.page_table
        if not isinstance(table, PageTable):
            return None
        P = self.page_size
        writes = [(row, j, min(P, int(lens[row]) - j * P))
                  for row, dst, _ in moves for j in sorted({int(d) // P for d in dst})]
        return table.reserve_writes(writes)

    def copy_row(self, dst_row, src, src_row, n) -> None:
        raise TypeError("paged rows are copied by sharing pages (PageTable.fork/reorder), "
                        "not token by token")

    def __repr__(self) -> str:
        return (f"PagedStore({self.dtype}, leading={self.leading}, rows={self.rows}, "
                f"kv_heads={self.kv_heads}, max_len={self.max_len}, head_dim={self.head_dim}, "
                f"page_size={self.page_size}, num_pages={self.num_pages})")


def reserve(backend, store: PagedStore, rows, starts, n_new) -> Reservation:
    """Take the pages an append of ``n_new[i]`` tokens at ``starts[i]`` to ``rows[i]``
    needs (every layer of ``store``), copying shared partly filled last pages first.
    OutOfPages, with nothing changed, when the pool is short.

    Each copy is filled before the table names it (a reader running alongside sees the
    shared page or the filled copy, never an empty one); if the copy fails, everything is
    given back. Returns the ``Reservation`` (``store.page_table.undo`` gives it back)."""
    return fill_copies(backend, store, store.page_table.reserve(rows, starts, n_new))


def fill_copies(backend, store: PagedStore, res: Reservation) -> Reservation:
    """Copy the live tokens of each page ``res`` copies (every layer, codes and scales),
    then make the table name the copies (``PageTable.point``); if the copy fails,
    everything ``res`` took is given back."""
    if res.copies:
        new, old, count = (np.asarray([c[i] for c in res.copies], dtype=np.int64)
                           for i in (3, 2, 4))
        pool = store.pool_rows(backend.namespace())
        try:
            backend.copy_tokens(pool, new, pool, old, count)
        except BaseException:
            store.page_table.undo(res)
            raise
    store.page_table.point(res)
    return res


def check_page_args(page_size, num_pages, batch: int, max_len: int) -> tuple[int, int | None]:
    """``page_size`` >= 1 and ``num_pages`` (None or >= 0) as ints; TypeError/ValueError
    naming the argument otherwise."""
    for name, value in (("page_size", page_size), ("num_pages", num_pages)):
        if value is None and name == "num_pages":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {int(page_size)}")
    if num_pages is not None and num_pages < 0:
        raise ValueError(f"num_pages must be >= 0 (or None: every row at max_len), got {int(num_pages)}")
    return int(page_size), None if num_pages is None else int(num_pages)


__all__ = ["DEFAULT_PAGE_SIZE", "OutOfPages", "PAGED", "PageTable", "PageTableView", "PagedStore",
           "PrefixIndex", "Reservation", "fill_copies", "pages_for", "reserve"]
