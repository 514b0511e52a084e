"""The prefix cache's index: full pages found by what they hold, and the pages no row
needs any more kept for reuse until the pool needs them.

Keys (a hash chain, as vLLM's automatic prefix caching keys its blocks): page i of a
token sequence is keyed by ``blake2b(key of page i - 1, its page_size token ids)``, and
page 0's parent is a root key made from the caller's ``salt`` (None, a str, bytes or an
int: an adapter, a modality hash, a tenant), so a page's key names the whole prefix
up to its end: two sequences share a key exactly when they share every token up to
there (and the salt). Only full pages are keyed; the chain stops at the last full page.

State (host only; the pools are the caller's or the PageTable's):

- ``page_of``: key -> page, ``key_of``: page -> key, a bijection over the cached pages;
- ``unused``: the cached pages no row names, least recently released first (an LRU).
  They keep their tokens and stay matchable; ``evict`` hands the oldest back for reuse
  (forgetting its key) when the pool has no free page left.

Used two ways: a ``PageTable`` made with an index (``PagedKVCache(prefix_cache=True)``,
``ModelKVCache(storage="paged", prefix_cache=True)``) drives it from its reference counts;
an engine that owns its pools (the functional paged API) drives it itself: ``insert`` the
pages a prompt filled, ``match`` a new prompt, ``release`` pages its rows stopped naming,
``evict`` when it needs pages. The index never touches K/V.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from ..core.inputs import ints_1d

_DIGEST = 16  # bytes per key: 128-bit keys make an accidental collision negligible


def _salt_bytes(salt) -> bytes:
    if salt is None:
        return b"n"
    if isinstance(salt, bool):
        raise TypeError(f"salt must be None, a str, bytes or an int, got {salt!r}")
    if isinstance(salt, str):
        return b"s" + salt.encode()
    if isinstance(salt, (bytes, bytearray)):
        return b"b" + bytes(salt)
    if isinstance(salt, (int, np.integer)):
        return b"i" + str(int(salt)).encode()
    raise TypeError(f"salt must be None, a str, bytes or an int, got {type(salt).__name__}")


def token_ids_of(token_ids) -> np.ndarray:
    """``token_ids`` (a 1-D sequence or array of ints, not one int) as host int64 ``[n]``
    (``ints_1d``)."""
    if isinstance(token_ids, (int, np.integer)):
        raise ValueError(f"token_ids must be a 1-D sequence of token ids, got {token_ids!r}")
    return ints_1d(token_ids, "token_ids")


def chain_keys(token_ids: np.ndarray, page_size: int, salt=None) -> list[bytes]:
    """The key of each full page of ``token_ids`` (host int64 ``[n]``): ``n // page_size``
    keys, key i naming tokens ``0 .. (i + 1) * page_size - 1`` and the salt."""
    parent = hashlib.blake2b(b"gqakv-prefix" + _salt_bytes(salt), digest_size=_DIGEST).digest()
    keys = []
    ids = np.ascontiguousarray(token_ids, dtype="<i8")
    for i in range(ids.size // page_size):
        h = hashlib.blake2b(parent, digest_size=_DIGEST)
        h.update(ids[i * page_size:(i + 1) * page_size].tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


class PrefixIndex:
    """Cached full pages by key, and an LRU of the cached pages no row names (see the
    module docstring).

    Args:
        page_size: tokens per page of the pool it indexes.
        num_pages: pages in that pool (page ids are ``0 .. num_pages - 1``).
    """

    def __init__(self, page_size: int, num_pages: int):
        for name, value in (("page_size", page_size), ("num_pages", num_pages)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if page_size < 1 or num_pages < 0:
            raise ValueError(f"page_size must be >= 1 and num_pages >= 0, got page_size="
                             f"{int(page_size)}, num_pages={int(num_pages)}")
        self.page_size, self.num_pages = int(page_size), int(num_pages)
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.unused: OrderedDict[int, None] = OrderedDict()

    # -- counts ------------------------------------------------------------------------------

    @property
    def pages_cached(self) -> int:
        """Pages the index holds a key for (named by rows or not)."""
        return len(self.key_of)

    @property
    def pages_unused(self) -> int:
        """Cached pages no row names: reusable, evicted only when the pool needs them."""
        return len(self.unused)

    def holds(self, page: int) -> bool:
        """Whether ``page`` is cached (its tokens must not change while it is)."""
        return int(page) in self.key_of

    # -- the engine's calls ------------------------------------------------------------------

    def keys(self, token_ids, salt=None) -> list[bytes]:
        """The chain keys of ``token_ids``' full pages (``chain_keys``), ids validated."""
        return chain_keys(token_ids_of(token_ids), self.page_size, salt)

    def lookup(self, keys: list[bytes]) -> np.ndarray:
        """The cached pages of the longest leading run of ``keys``, int32 ``[k]`` (no state
        changes)."""
        pages = []
        for key in keys:
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return np.asarray(pages, dtype=np.int32)

    def match(self, token_ids, salt=None, *, max_tokens: int | None = None) -> np.ndarray:
        """The cached pages that hold the longest prefix of ``token_ids`` made of full
        pages (at most ``max_tokens`` tokens; default ``len(token_ids) - 1``, so a
        prompt always leaves one token to run for its logits), int32 ``[k]``: tokens
        ``0 .. k * page_size - 1``. Matched pages leave the unused LRU (the caller is
        about to name them); nothing else changes."""
        ids = token_ids_of(token_ids)
        limit = max(ids.size - 1, 0) if max_tokens is None else int(max_tokens)
        pages = self.lookup(chain_keys(ids[:max(0, min(limit, ids.size))], self.page_size, salt))
        self.use(pages)
        return pages

    def insert(self, token_ids, pages, salt=None) -> int:
        """Cache ``pages`` (int ``[k]``) as holding the first ``k`` full pages of
        ``token_ids`` (at least ``k * page_size`` ids). A key already cached keeps its
        page, and a page already cached under some key keeps that key (each page holds
        one thing). Returns how many pages became cached."""
        ids = token_ids_of(token_ids)
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        if ids.size < pages.size * self.page_size:
            raise ValueError(f"{pages.size} pages of {self.page_size} tokens need "
                             f"{pages.size * self.page_size} token ids, got {ids.size}")
        bad = np.flatnonzero((pages < 0) | (pages >= self.num_pages))
        if bad.size:
            raise ValueError(f"pages[{int(bad[0])}]={int(pages[bad[0]])} is not a page of the "
                             f"pool (0..{self.num_pages - 1})")
        added = 0
        for key, page in zip(chain_keys(ids[:pages.size * self.page_size], self.page_size, salt),
                             pages.tolist()):
            if key in self.page_of or page in self.key_of:
                continue
            self.page_of[key], self.key_of[page] = page, key
            added += 1
        return added

    def use(self, pages) -> None:
        """``pages`` are named by a row again: they leave the unused LRU."""
        for page in np.asarray(pages, dtype=np.int64).reshape(-1).tolist():
            self.unused.pop(page, None)

    def release(self, pages) -> np.ndarray:
        """``pages`` are named by no row any more (distinct ints): cached ones join the
        unused LRU as its most recent; returns the rest, int64, for the caller's free list."""
        rest = []
        for page in np.asarray(pages, dtype=np.int64).reshape(-1).tolist():
            if page in self.key_of:
                self.unused[page] = None
                self.unused.move_to_end(page)
            else:
                rest.append(page)
        return np.asarray(rest, dtype=np.int64)

    def evict(self, n: int = 1) -> np.ndarray:
        """Forget the ``n`` least recently released unused pages and return them (int64) for
        reuse; ValueError when fewer are unused (nothing changes then)."""
        if n > len(self.unused):
            raise ValueError(f"cannot evict {n} pages: {len(self.unused)} cached pages are unused")
        out = []
        for _ in range(int(n)):
            page, _ = self.unused.popitem(last=False)
            del self.page_of[self.key_of.pop(page)]
            out.append(page)
        return np.asarray(out, dtype=np.int64)

    def forget(self, pages) -> None:
        """Drop ``pages``' keys (their tokens are about to change): they are no longer cached."""
        for page in np.asarray(pages, dtype=np.int64).reshape(-1).tolist():
            key = self.key_of.pop(page, None)
            if key is not None:
                del self.page_of[key]
            self.unused.pop(page, None)

    # -- checks ------------------------------------------------------------------------------

    def audit(self) -> list[str]:
        """Broken invariants of the index itself, as sentences (empty: sound)."""
        problems = []
        if len(self.page_of) != len(self.key_of) or any(
                self.key_of.get(p) != k for k, p in self.page_of.items()):
            problems.append("the key -> page and page -> key maps disagree")
        stray = [p for p in self.unused if p not in self.key_of]
        if stray:
            problems.append(f"unused pages without a key: {stray[:8]}")
        outside = [p for p in self.key_of if not 0 <= p < self.num_pages]
        if outside:
            problems.append(f"cached pages outside the pool: {outside[:8]}")
        return problems

    def __repr__(self) -> str:
        return (f"PrefixIndex(page_size={self.page_size}, num_pages={self.num_pages}, "
                f"cached={self.pages_cached}, unused={self.pages_unused})")


__all__ = ["PrefixIndex", "chain_keys", "token_ids_of"]
