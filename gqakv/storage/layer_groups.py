"""Layers stored by their kind: a model whose layers differ in what they keep.

A ``ModelKVCache`` of full-attention and sliding-window layers (Gemma 2/3, gpt-oss) stores
each kind in a store of its own: the sliding layers of each window ``W`` page through a
table of their own that releases the pages behind the window
(``gqakv.storage.paged.PageTable.window``), and the full layers keep every token, either
paging through one table of their own (paged storage) or in contiguous rows (a cache asked
for contiguous storage, whose sliding layers are rings: ``gqakv.storage.ring``). One page
table cannot serve both: a full layer needs the very pages a sliding layer lets go.

``LayerGroups`` is the model cache's store then: it hands out each layer's store
(``layer``), and runs every row operation (reserve and give back, reorder, fork, trim,
accept's moves) on each group in turn, all validated before any group changes. The
lengths are the model's, shared by every group.
"""

from __future__ import annotations

import numpy as np

from .paged import fill_copies
from .store import PAGED, KVStore


class LayerGroups:
    """The stores of a model's layer kinds (see the module docstring).

    groups: ``(window, layers, store)`` per kind: ``window`` None (full attention) or W,
        ``layers`` the model's layer indices it holds (ascending), ``store`` a PagedStore
        (or, for the full layers, a contiguous KVStore) with leading axis
        ``(len(layers),)``.
    """

    kind = PAGED  # what a model cache of several kinds reports (its sliding kinds are paged)

    def __init__(self, groups: list[tuple[int | None, list[int], KVStore]], layers: int):
        self.groups = groups
        self._where: dict[int, tuple[KVStore, int]] = {}
        for _, members, store in groups:
            for i, l in enumerate(members):
                self._where[int(l)] = (store, i)
        assert sorted(self._where) == list(range(layers))
        first = groups[0][2]
        self.spec, self.codec = first.spec, first.codec
        self.leading = (int(layers),)
        self.rows, self.kv_heads, self.max_len, self.head_dim = (
            first.rows, first.kv_heads, first.max_len, first.head_dim)

    # -- what a store says about itself ---------------------------------------------------------

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    @property
    def quantized(self) -> bool:
        return self.spec.quantized

    @property
    def nbytes(self) -> int:
        """Bytes of every group's K and V pool."""
        return sum(store.nbytes for _, _, store in self.groups)

    @property
    def window(self) -> None:
        """None: the groups differ (each layer's store has its own ``window``)."""
        return None

    @property
    def any_buffer(self):
        """An array of the storage (its device is the cache's)."""
        return self.groups[0][2].k

    def _refuse(self, what: str):
        windows = ", ".join(("full" if w is None else f"window={w}") + f" ({store.kind})"
                            for w, _, store in self.groups)
        return TypeError(f"this cache stores its layers in {len(self.groups)} stores by kind "
                         f"({windows}): it has no single {what}; use cache.layer(l) (or "
                         "cache.store.page_tables)")

    @property
    def k(self):
        raise self._refuse("K buffer")

    @property
    def v(self):
        raise self._refuse("V buffer")

    @property
    def page_table(self):
        raise self._refuse("page table")

    @property
    def page_tables(self) -> dict:
        """``{window: PageTable}`` of each paged group (None: the full layers', when paged)."""
        return {w: store.page_table for w, _, store in self.groups if store.kind == PAGED}

    def layer(self, layer: int) -> KVStore:
        store, i = self._where[int(layer)]
        return store.layer(i)

    def with_layers(self, xp) -> "LayerGroups":
        return self

    def first_held(self, rows) -> np.ndarray:
        """The first token every group still holds of each row: the latest of the groups'
        (the full layers hold all)."""
        return np.max([store.first_held(rows) for _, _, store in self.groups], axis=0)

    # -- the row operations, every group ---------------------------------------------------------

    def reserve(self, backend, rows, starts, n_new):
        """Every group's pages for the append (OutOfPages from any: the others given back).
        An append longer than ``max_chunk`` is refused by the first windowed group before it
        changes anything (every windowed group has the cache's ``max_chunk``; a full group
        before it is given back exactly)."""
        done = []
        try:
            for _, _, store in self.groups:
                done.append(store.reserve(backend, rows, starts, n_new))
        except BaseException:
            self.give_back(done)
            raise
        return done

    def give_back(self, reservation) -> None:
        if reservation is None:
            return
        for (_, _, store), res in reversed(list(zip(self.groups, reservation))):
            store.give_back(res)

    def reorder_rows(self, backend, src_rows, lens) -> int:
        return sum(store.reorder_rows(backend, src_rows, lens) for _, _, store in self.groups)

    def fork_rows(self, backend, src, dst_rows, n) -> int:
        return sum(store.fork_rows(backend, src, dst_rows, n) for _, _, store in self.groups)

    def check_keep(self, rows, new_lens, what: str) -> None:
        for _, _, store in self.groups:
            store.check_keep(rows, new_lens, what)

    def trim_rows(self, rows, new_lens) -> None:
        for _, _, store in self.groups:
            store.trim_rows(rows, new_lens)

    def reserve_moves(self, backend, moves, lens):
        """Every group's copies for accept's moves: every group's pages are taken before any
        group copies, so an OutOfPages from any changes nothing (not a byte of any pool)."""
        taken = []
        try:
            for _, _, store in self.groups:  # contiguous rows are private: nothing to take
                taken.append(store.take_copies(moves, lens) if store.kind == PAGED else None)
            for (_, _, store), res in zip(self.groups, taken):
                if res is not None:
                    fill_copies(backend, store, res)
        except BaseException:
            self.give_back(taken)
            raise
        return taken

    def move_tokens(self, row: int, dst, src) -> None:
        for _, _, store in self.groups:
            store.move_tokens(row, dst, src)

    def __repr__(self) -> str:
        parts = ", ".join(f"{'full' if w is None else f'window={w}'}: layers {m}" for w, m, _ in self.groups)
        return f"LayerGroups({parts})"
