"""Greedy speculative decoding with the example Llama model: a drafter proposes a tree of
continuations, the target verifies the whole tree in one cached forward (``tree=``), and
``cache.accept`` keeps the verified path.

The emitted tokens are those of plain greedy decoding of the target (``llama.generate``):
a draft token is kept only when it is the target's own argmax after its kept ancestors,
and every round also emits the target's argmax after the last kept node.

Bookkeeping per row: after prefill the row holds its prompt and a *pending* token x (the
target's argmax, emitted, not yet in the cache). A round appends the chunk
``[x, drafts...]`` (x the root, parent -1; drafts below it), walks the target's argmax
down the tree from x, keeps the walked path (``accept``), and its last node's argmax is
the next pending token. So the cache holds ``prompt + emitted - 1`` tokens after every
round, like plain greedy after the same count; a round with r tokens still to emit
drafts at most ``r - 1`` tokens, so the cache never holds more than plain greedy's final
``prompt + max_new_tokens - 1`` (not even during verification) and nothing is truncated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

import gqakv

from .llama import LlamaModel, _check_prompts

#: A drafter: ``draft(context, budget) -> (tokens, parents)``; context: the row's prompt and
#: emitted tokens (the pending token last), budget: the most draft tokens it may propose.
#: ``parents[j]`` is the index of draft token j's parent in the draft list (< j), or -1
#: for a child of the context's last token.
Drafter = Callable[[np.ndarray, int], tuple[Sequence[int], Sequence[int]]]


class NGramDrafter:
    """Prompt-lookup drafting: for the context's last n tokens (n = ``max_ngram`` down to
    1) find earlier occurrences, most recent first, and propose the ``depth`` tokens that
    followed each as a branch; up to ``branches`` distinct continuations, merged into a
    trie (shared prefixes share nodes), cut to the budget."""

    def __init__(self, depth: int = 4, branches: int = 2, max_ngram: int = 3):
        if depth < 1 or branches < 1 or max_ngram < 1:
            raise ValueError(f"depth, branches and max_ngram must be >= 1, got {depth}, {branches}, "
                             f"{max_ngram}")
        self.depth, self.branches, self.max_ngram = depth, branches, max_ngram

    def continuations(self, context: np.ndarray) -> list[tuple[int, ...]]:
        ctx = np.asarray(context, dtype=np.int64).reshape(-1)
        L = ctx.size
        found: list[tuple[int, ...]] = []
        for n in range(min(self.max_ngram, L - 1), 0, -1):
            key = ctx[L - n:]
            for j in range(L - 2, n - 2, -1):  # occurrence ending at j < L - 1, most recent first
                if np.array_equal(ctx[j - n + 1: j + 1], key):
                    cont = tuple(int(t) for t in ctx[j + 1: j + 1 + self.depth])
                    if cont and cont not in found:
                        found.append(cont)
                        if len(found) == self.branches:
                            return found
        return found

    def __call__(self, context, budget: int):
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent index, token) -> index
        for cont in self.continuations(context):
            parent = -1
            for t in cont:
                node = children.get((parent, t))
                if node is None:
                    if len(tokens) == budget:
                        break
                    node = len(tokens)
                    tokens.append(t)
                    parents.append(parent)
                    children[(parent, t)] = node
                parent = node
        return tokens, parents


@dataclass
class SpeculativeGeneration:
    """Result of ``speculative_generate`` for B rows."""

    tokens: np.ndarray  # [B, max_new_tokens] emitted token ids (plain greedy's)
    target_forwards: int  # batched target forward calls after prefill (verification rounds)
    prefill_forwards: int
    row_forwards: int  # sum over rounds of the rows verified in it
    drafted: int  # draft tokens sent to verification, all rows
    accepted: int  # of those, kept (on the walked path)
    time_to_first_token: float
    decode_seconds: float

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens emitted per row per target forward after the first token (plain greedy: 1)."""
        B, n = self.tokens.shape
        return B * (n - 1) / self.row_forwards if self.row_forwards else float("nan")


def _walk(logits: np.ndarray, tokens: np.ndarray, parents: np.ndarray, n: int) -> tuple[list[int], int]:
    """Greedy walk from the root (chunk index 0): path of kept chunk indices and the
    target's argmax after the path's last node."""
    node, path = 0, [0]
    while True:
        nxt = int(np.argmax(logits[node]))
        child = next((c for c in range(node + 1, n) if parents[c] == node and tokens[c] == nxt), None)
        if child is None:
            return path, nxt
        node = child
        path.append(node)


def speculative_generate(target: LlamaModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                         draft: Drafter | None = None, max_draft: int = 8,
                         cache: gqakv.ModelKVCache | None = None, cache_options: dict | None = None,
                         pad_id: int = 0) -> SpeculativeGeneration:
    """Greedy decoding of ``target`` verified against draft trees; the same tokens as
    ``llama.generate(target, prompts, max_new_tokens)`` (up to float ties of the argmax).

    draft: a ``Drafter`` (default ``NGramDrafter()``); max_draft: the most draft tokens a
    row verifies per round. cache: an existing ``target.new_cache(...)`` (rows 0..B-1 are
    reset first) with at least ``max(prompt) + max_new_tokens`` slots, else a new one
    (``cache_options``). The prompt is prefilled in one forward call.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if max_draft < 0:
        raise ValueError(f"max_draft must be >= 0, got {max_draft}")
    draft = NGramDrafter() if draft is None else draft
    rows = _check_prompts(prompts, target.config.vocab_size)
    B = len(rows)
    lens = np.array([p.size for p in rows], dtype=np.int64)
    need = int(lens.max()) + max_new_tokens
    t0 = time.perf_counter()
    if cache is None:
        cache = target.new_cache(B, need, **(cache_options or {}))
    else:
        if cache.batch < B or cache.max_len < need:
            raise ValueError(f"the cache has {cache.batch} rows of {cache.max_len} tokens; {B} rows of up "
                             f"to {need} tokens are needed")
        cache.reset(list(range(B)))
    all_rows = list(range(B))

    tokens = np.full((B, int(lens.max())), pad_id, dtype=np.int64)
    for b in range(B):
        tokens[b, : lens[b]] = rows[b]
    logits = target.forward(tokens, lens, cache, last_only=True, rows=all_rows)
    out: list[list[int]] = [[int(np.argmax(logits[b]))] for b in range(B)]
    t1 = time.perf_counter()

    forwards = row_forwards = drafted = accepted = 0
    while True:
        active = [b for b in range(B) if len(out[b]) < max_new_tokens]
        if not active:
            break
        chunks = []
        for b in active:
            budget = min(max_draft, max_new_tokens - len(out[b]) - 1)
            ctx = np.concatenate([rows[b], np.asarray(out[b], dtype=np.int64)])
            d_tok, d_par = draft(ctx, budget) if budget > 0 else ([], [])
            d_tok, d_par = list(d_tok)[:budget], list(d_par)[:budget]
            chunk_tok = [out[b][-1]] + [int(t) for t in d_tok]
            chunk_par = [-1] + [int(p) + 1 for p in d_par]  # x is chunk index 0
            chunks.append((chunk_tok, chunk_par))
            drafted += len(d_tok)
        n = np.array([len(c[0]) for c in chunks], dtype=np.int64)
        T = int(n.max())
        tok = np.full((len(active), T), pad_id, dtype=np.int64)
        par = np.full((len(active), T), -1, dtype=np.int64)
        for i, (ct, cp) in enumerate(chunks):
            tok[i, : len(ct)] = ct
            par[i, : len(cp)] = cp
        tree = gqakv.DraftTree.of(par, n)
        logits = target.forward(tok, n, cache, rows=active, tree=tree)  # [B', T, V]
        forwards += 1
        row_forwards += len(active)
        paths = []
        for i, b in enumerate(active):
            path, nxt = _walk(logits[i], tok[i], par[i], int(n[i]))
            paths.append(path)
            accepted += len(path) - 1
            out[b].extend(int(t) for t in tok[i, path[1:]])
            out[b].append(nxt)
        cache.accept(paths, tree, rows=active)
    t2 = time.perf_counter()
    return SpeculativeGeneration(np.array(out, dtype=np.int64), forwards, 1, row_forwards, drafted,
                                 accepted, t1 - t0, t2 - t1)
