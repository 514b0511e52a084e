"""Draft trees: which chunk keys a speculative draft token may see.

Speculative decoding verifies a *tree* of draft tokens in one forward pass: the chunk of
``n`` tokens just appended to a row is a forest whose roots continue the row's cached
prefix (the ``P = L - n`` tokens before the chunk). Draft token ``t`` sees every key of
the prefix and, of the chunk, only itself and its ancestors. A chain (token t's parent
is t - 1) is the plain causal chunk.

Two forms are accepted (``DraftTree.of``), for B batch entries of up to T tokens:

- ``parents`` ``[B, T]`` ints: the chunk index of each token's parent, -1 for a child of
  the last cached token (EAGLE / Medusa trees). Parents precede their children
  (``-1 <= parents[i, t] < t``: topological order, as every tree drafter emits them).
- ``mask`` ``[B, T, T]`` bools: ``mask[i, t, u]`` is True when chunk token u is t or one of
  its ancestors. It must be such a closure: ``mask[i, t, t]`` True, nothing above the
  diagonal, and each row is its parent's row (the last u < t it holds) plus t.

Only ``t < n_new[i]`` counts; the rest of each entry is padding and is ignored.

Positions. A draft token at depth ``depth[t]`` (0 for a root) stands at *logical*
position ``P + depth[t]``: the position it would have after acceptance, once its path is
compacted right after the prefix. A sliding window and ALiBi measure distance in these
logical positions (a prefix key j stands at j, a chunk key u at ``P + depth[u]``), so
verifying a tree gives the scores sequential decoding of each path would. RoPE is the
caller's: rotate q and k at ``P + depth`` (``DraftTree.positions``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .host_arrays import to_numpy as _to_numpy


@dataclass(frozen=True, eq=False)
class EntryTree:
    """One batch entry's tree of ``n`` chunk tokens (host arrays).

    ancestors: ``[n, n]`` bool, ``ancestors[t, u]``: u is t or an ancestor of t;
    depth: ``[n]`` int64, a root's depth is 0;
    parents: ``[n]`` int64 (-1: a root).
    """

    ancestors: np.ndarray
    depth: np.ndarray
    parents: np.ndarray

    @property
    def size(self) -> int:
        return int(self.depth.shape[0])


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A validated draft tree per batch entry (see the module docstring); host arrays,
    read-only when made by ``of`` (each entry's ancestor sets are built from them once).

    parents: ``[B, T]`` int64 (-1: a root, and every padded slot);
    depth: ``[B, T]`` int64 (0 at padded slots);
    n: ``[B]`` int64, each entry's chunk tokens (its ``n_new``).
    """

    parents: np.ndarray
    depth: np.ndarray
    n: np.ndarray
    #: entry i -> its EntryTree, built on first use (``entry``)
    _entries: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, tree, n_new) -> "DraftTree":
        """``tree`` (a DraftTree, ``parents`` ``[B, T]`` ints or a ``[B, T, T]`` bool mask, from
        any library) checked against ``n_new`` ([B] ints: each entry's chunk tokens).
        ValueError / TypeError naming the entry, the token and the numbers otherwise."""
        n = np.asarray(n_new, dtype=np.int64).reshape(-1)
        if isinstance(tree, DraftTree):
            if tree.n.shape != n.shape or not np.array_equal(tree.n, n):
                raise ValueError(f"tree was made for n_new={tree.n.tolist()}, the call has "
                                 f"n_new={n.tolist()}")
            return tree
        if tree is None:
            raise TypeError("tree must be parents [B, T] ints or an ancestor mask [B, T, T] bools, "
                            "got None")
        a = _to_numpy(tree)
        B = int(n.shape[0])
        if a.ndim == 2:
            return cls._of_parents(a, n, B)
        if a.ndim == 3:
            return cls._of_mask(a, n, B)
        raise ValueError(f"tree must be parents [B, T] or an ancestor mask [B, T, T], got "
                         f"{a.ndim} dims {list(a.shape)}")

    @classmethod
    def _of_parents(cls, a, n, B) -> "DraftTree":
        if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"tree parents must be integers, got dtype {a.dtype}")
        if a.shape[0] != B:
            raise ValueError(f"tree parents have {a.shape[0]} entries, n_new has {B}")
        T = int(a.shape[1])
        _check_room(T, n, "tree parents hold")
        parents = np.full((B, T), -1, dtype=np.int64)
        depth = np.zeros((B, T), dtype=np.int64)
        rows = a.tolist()  # Python ints: a call parses its tree each time, so keep it cheap
        for i in range(B):
            k = int(n[i])
            row, d = rows[i][:k], [0] * k
            for t, p in enumerate(row):
                if not -1 <= p < t:
                    raise ValueError(f"tree parents[{i}, {t}]={p}: a token's parent is -1 (the last "
                                     f"cached token) or an earlier chunk token 0..{t - 1}")
                d[t] = 0 if p < 0 else d[p] + 1
            parents[i, :k], depth[i, :k] = row, d
        n = n.copy()
        for x in (parents, depth, n):  # entries are built once from them (``entry``)
            x.flags.writeable = False
        return cls(parents=parents, depth=depth, n=n)

    @classmethod
    def _of_mask(cls, a, n, B) -> "DraftTree":
        if a.dtype != np.bool_:
            raise TypeError(f"a tree mask must hold bools, got dtype {a.dtype}")
        if a.shape[0] != B or a.shape[1] != a.shape[2]:
            raise ValueError(f"a tree mask must be [B, T, T] with B={B} (n_new's length), got "
                             f"{list(a.shape)}")
        T = int(a.shape[1])
        _check_room(T, n, "the tree mask holds")
        parents = np.full((B, T), -1, dtype=np.int64)
        for i in range(B):
            m = a[i, :int(n[i]), :int(n[i])]
            for t in range(int(n[i])):
                row = m[t]
                if not row[t]:
                    raise ValueError(f"tree mask[{i}, {t}, {t}] is False: a draft token sees itself")
                later = np.flatnonzero(row[t + 1:])
                if later.size:
                    raise ValueError(f"tree mask[{i}, {t}, {t + 1 + int(later[0])}] is True: a "
                                     "token's ancestors come before it in the chunk")
                before = np.flatnonzero(row[:t])
                p = int(before[-1]) if before.size else -1
                want = np.zeros(t, dtype=bool)
                if p >= 0:
                    want[:p + 1] = m[p, :p + 1]
                if not np.array_equal(row[:t], want):
                    u = int(np.flatnonzero(row[:t] != want)[0])
                    raise ValueError(f"tree mask[{i}, {t}] is not an ancestor set: its parent is "
                                     f"token {p}, so mask[{i}, {t}, {u}] must be {bool(want[u])} "
                                     "(the parent's ancestors and nothing else)")
                parents[i, t] = p
        return cls._of_parents(parents, n, B)  # the depths, from the parents

    @property
    def batch(self) -> int:
        return int(self.n.shape[0])

    def entry(self, i: int) -> EntryTree:
        """Entry i's tree of its ``n[i]`` tokens, built once per tree (read-only arrays: a
        tree made once per step serves every layer's call)."""
        got = self._entries.get(i)
        if got is None:  # two threads may both build it: the same values, one kept
            got = self._entries.setdefault(i, self._entry(i))
        return got

    def _entry(self, i: int) -> EntryTree:
        k = int(self.n[i])
        parents = self.parents[i, :k].copy()
        # each token's ancestor set as a Python int bitset (its parent's plus itself), then
        # unpacked: a row copy per token in NumPy costs more than the whole unpacking
        bits: list[int] = []
        for t, p in enumerate(parents.tolist()):
            bits.append((bits[p] if p >= 0 else 0) | (1 << t))
        width = (k + 7) // 8
        packed = np.frombuffer(b"".join(b.to_bytes(width, "little") for b in bits), dtype=np.uint8)
        anc = np.unpackbits(packed.reshape(k, width), axis=1, count=k, bitorder="little").view(bool)
        depth = self.depth[i, :k].copy()
        for x in (anc, depth, parents):
            x.flags.writeable = False
        return EntryTree(ancestors=anc, depth=depth, parents=parents)

    def ancestor_mask(self) -> np.ndarray:
        """``[B, T, T]`` bools: ``mask[i, t, u]`` is u in t's ancestor set (t included); False
        at padded slots."""
        B, T = self.parents.shape
        out = np.zeros((B, T, T), dtype=bool)
        for i in range(B):
            k = int(self.n[i])
            out[i, :k, :k] = self.entry(i).ancestors
        return out

    def positions(self, prefix_lens) -> np.ndarray:
        """``[B, T]`` int64 logical positions ``prefix_lens[i] + depth[i, t]`` (the tokens'
        RoPE positions; ``prefix_lens``: each row's length before the chunk)."""
        p = np.asarray(prefix_lens, dtype=np.int64).reshape(-1, 1)
        return p + self.depth

    def is_path(self, i: int, path) -> str | None:
        """None when ``path`` (chunk indices) is a path of entry i's tree from a root down
        (each token the parent of the next), else a sentence saying why not."""
        k = int(self.n[i])
        prev = -1
        for s, u in enumerate(path):
            u = int(u)
            if not 0 <= u < k:
                return f"path[{s}]={u} is outside the entry's chunk 0..{k - 1}"
            if int(self.parents[i, u]) != prev:
                want = "a root (parent -1)" if prev < 0 else f"a child of token {prev}"
                return (f"path[{s}]={u} is not {want} (its parent is {int(self.parents[i, u])})")
            prev = u
        return None


def _check_room(T: int, n: np.ndarray, holds: str) -> None:
    """ValueError unless every entry's n_new fits the tree's T tokens."""
    if n.size and int(n.max()) > T:
        i = int(np.argmax(n))
        raise ValueError(f"{holds} {T} tokens per entry, entry {i} has n_new={int(n[i])}")


def chain(n_new, T: int | None = None) -> DraftTree:
    """The chain tree (token t's parent is t - 1): the plain causal chunk, as a tree."""
    n = np.asarray(n_new, dtype=np.int64).reshape(-1)
    T = int(n.max(initial=0)) if T is None else int(T)
    parents = np.tile(np.arange(-1, T - 1, dtype=np.int64), (n.shape[0], 1))
    return DraftTree.of(parents, n)
