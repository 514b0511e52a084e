"""Speculative decoding with the example model: draft trees verified by the target in one
cached forward (tree=) and kept by cache.accept emit exactly plain greedy's tokens."""

from __future__ import annotations

import numpy as np
import pytest

from gqakv_examples.llama import TINY, LlamaModel, generate
from gqakv_examples.speculative import NGramDrafter, speculative_generate

BACKENDS = ["numpy", "numba"]

REPETITIVE = [
    [5, 17, 3, 88, 5, 17, 3, 88, 5, 17, 3, 88, 5, 17],
    [9, 9, 9, 9, 9, 9],
    [40, 41, 42, 43, 44, 40, 41, 42],
]
RANDOM = [
    [5, 17, 3, 88, 42, 9, 61, 2, 30, 77, 14],
    [8, 1],
    [33],
]


def _model(backend, seed=3):
    return LlamaModel(TINY, seed=seed, dtype="float64", backend=backend)


def _plain(model, prompts, n):
    g = generate(model, prompts, n)
    return g.tokens


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prompts", [REPETITIVE, RANDOM, REPETITIVE + RANDOM], ids=["repetitive", "random", "mixed"])
@pytest.mark.parametrize("max_draft", [1, 3, 8])
def test_speculative_equals_plain_greedy(backend, prompts, max_draft):
    model = _model(backend)
    n = 12
    plain = _plain(model, prompts, n)
    spec = speculative_generate(model, prompts, n, max_draft=max_draft)
    np.testing.assert_array_equal(spec.tokens, plain)
    assert spec.tokens.shape == (len(prompts), n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_repetitive_continuations_are_accepted(backend):
    """A model whose greedy output repeats (so the n-gram drafts are right): acceptance > 0
    and more than one token per target forward, tokens still plain greedy's, and the cache
    holds what plain greedy's holds."""
    model = _model(backend)
    n = 16
    # Use the target's own greedy continuation as context: its repetitions feed the drafter.
    seeds = [[5, 17, 3], [8, 1], [64, 23, 23, 5]]
    base = _plain(model, seeds, n)
    prompts = [s + base[b].tolist() + s + base[b, :3].tolist() for b, s in enumerate(seeds)]
    plain_cache = model.new_cache(len(prompts), max(map(len, prompts)) + n)
    plain = generate(model, prompts, n, cache=plain_cache).tokens
    cache = model.new_cache(len(prompts), max(map(len, prompts)) + n)
    spec = speculative_generate(model, prompts, n, cache=cache, draft=NGramDrafter(depth=4, branches=2),
                                max_draft=8)
    np.testing.assert_array_equal(spec.tokens, plain)
    assert spec.accepted > 0 and spec.acceptance_rate > 0
    assert spec.tokens_per_forward > 1
    assert spec.target_forwards < n - 1
    np.testing.assert_array_equal(cache.host_lens, plain_cache.host_lens)
    np.testing.assert_array_equal(cache.host_lens, np.array([len(p) + n - 1 for p in prompts]))


def test_ngram_drafter_builds_a_trie():
    d = NGramDrafter(depth=3, branches=2, max_ngram=2)
    ctx = np.array([1, 2, 3, 4, 1, 2, 5, 6, 1, 2])
    toks, pars = d(ctx, 10)
    # continuations after "1 2": (5, 6, 1) most recent, then (3, 4, 1)
    assert toks == [5, 6, 1, 3, 4, 1] and pars == [-1, 0, 1, -1, 3, 4]
    toks, pars = d(ctx, 4)
    assert toks == [5, 6, 1, 3] and pars == [-1, 0, 1, -1]
    assert d(np.array([7]), 5) == ([], [])


def test_bad_requests():
    model = _model("numpy")
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(model, [[1, 2]], 0)
    with pytest.raises(ValueError, match="rows of"):
        speculative_generate(model, [[1, 2]], 8, cache=model.new_cache(1, 4))


def test_generate_command_speculative(capsys):
    from gqakv.tools.cli import main as cli_main

    rc = cli_main(["generate", "--config", "tiny", "--batch", "3", "--prompt-len", "9",
                   "--new-tokens", "10", "--dtype", "float64", "--speculative", "4", "--no-baseline"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "tokens identical to plain greedy: yes" in out
    assert "acceptance rate" in out and "tokens per target forward" in out
    assert cli_main(["generate", "--config", "tiny", "--speculative", "0"]) == 2
