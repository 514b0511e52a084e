"""``gqakv generate --prefix-cache N``: two requests that share an N-token system prompt.

The first request prefills the whole prompt on a paged cache with a prefix cache and
caches its pages; the second, with the same system prompt and its own question, starts
on those pages (``ModelKVCache.match_prefix``) and prefills only its own tokens. Its
time to first token is compared with the first request's, and its greedy tokens and
logits with the same request served alone on a cache without a prefix cache.
"""

from __future__ import annotations

import numpy as np

from .llama import generate

#: Tokens per page of the demo's cache (the library's default page size).
PAGE_SIZE = 16


def run(model, system: list[int], questions: list[list[int]], new_tokens: int, chunk: int, *,
        say=print) -> int:
    """Serve ``system + questions[0]``, then ``system + questions[1]`` from the same prefix
    cache, then the second alone without one; print the comparison. Returns 0 when the
    second request's greedy tokens equal the uncached run's, else 1."""
    longest = len(system) + max(len(q) for q in questions) + new_tokens
    first_prompt, second_prompt = (system + q for q in questions[:2])

    def serve(salt):
        cache = model.new_cache(1, longest, storage="paged", page_size=PAGE_SIZE, prefix_cache=True)
        first = generate(model, [first_prompt], new_tokens, chunks=chunk, cache=cache, salt=salt)
        second = generate(model, [second_prompt], new_tokens, chunks=chunk, cache=cache, salt=salt)
        alone = generate(model, [second_prompt], new_tokens, chunks=chunk,
                         cache_options={"storage": "paged", "page_size": PAGE_SIZE})
        return first, second, alone

    # A warm-up round of the same calls (BLAS threads, numba's compilation of each shape, the
    # first touch of the weights), under another salt so that its pages never match the next.
    serve("warm-up")
    first, second, alone = serve(None)
    hit = int(second.prefix_hits[0])
    say(f"  prefix cache: a {len(system)}-token system prompt, questions of "
        f"{len(questions[0])} and {len(questions[1])} tokens, pages of {PAGE_SIZE}")
    say(f"  {'':<34}{'prompt tokens':>14}{'prefilled':>10}{'time to first token':>21}")
    for name, g, prompt in (("first request", first, first_prompt),
                            ("second, from the prefix cache", second, second_prompt),
                            ("second, alone (no prefix cache)", alone, second_prompt)):
        fed = len(prompt) - int(g.prefix_hits[0]) if g.prefix_hits is not None else len(prompt)
        say(f"  {name:<34}{len(prompt):>14}{fed:>10}{g.time_to_first_token:>19.3f} s")
    ratio = second.time_to_first_token / first.time_to_first_token
    same = bool(np.array_equal(second.tokens, alone.tokens))
    bits = bool(np.array_equal(second.logits, alone.logits))
    diff = float(np.max(np.abs(second.logits - alone.logits)))
    say(f"  second request: {hit} prompt tokens from the cache, time to first token x{ratio:.3f} of "
        f"the first's; greedy tokens identical to serving it alone: {'yes' if same else 'NO'}; logits "
        + ("bit-identical" if bits else f"not bit-identical (max |difference| {diff:.2e}: its prefill "
                                         "chunk differs, see docs/serving.md)"))
    return 0 if same else 1
