"""The example Llama model: cached generation through gqakv equals the uncached forward pass.

The uncached path (``forward_uncached``) runs the whole sequence with plain causal
attention written directly in the example (no gqakv cache), itself checked here
against the independent float64 loop reference. Tolerances:
- float64: logits agree to 1e-10 absolute (logits are O(1); observed ~1e-15).
- float32: the cached path's error against the float64 reference is at most
  4x the uncached float32 path's error + 1e-6 (same-dtype naive as the yardstick).
Greedy tokens must be identical in both.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gqakv.cli import main as cli_main
from gqakv.examples.llama import (
    TINY,
    LlamaModel,
    causal_attention,
    generate,
    generate_uncached,
)

from .reference import reference_attention

F64_ATOL = 1e-10

RAGGED_PROMPTS = [
    [5, 17, 3, 88, 42, 9, 61, 2, 30, 77, 14],
    [8, 1],
    [64, 23, 23, 5, 90, 11, 46],
    [33],
]


def _model(backend, dtype="float64", seed=3, **changes):
    return LlamaModel(TINY.replace(**changes), seed=seed, dtype=dtype, backend=backend)


def test_causal_attention_matches_loop_reference():
    rng = np.random.default_rng(0)
    B, Hq, Hkv, S, d = 2, 6, 2, 9, 4
    q = rng.standard_normal((B, Hq, S, d))
    k = rng.standard_normal((B, Hkv, S, d))
    v = rng.standard_normal((B, Hkv, S, d))
    import array_api_compat.numpy as xp

    got = causal_attention(xp, q, k, v, 1 / math.sqrt(d))
    want, _ = reference_attention(q, list(k), list(v), [S] * B)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def _assert_same_generation(cached, uncached, atol):
    np.testing.assert_array_equal(cached.tokens, uncached.tokens)
    np.testing.assert_allclose(cached.logits, uncached.logits, rtol=0, atol=atol)


@pytest.mark.parametrize("chunks", [None, 3, [4, 1, 2, 5], [1]], ids=["one-chunk", "chunks-of-3",
                                                                     "uneven-4-1-2-5", "token-by-token"])
def test_single_prompt_cached_equals_uncached(backend, chunks):
    if "float64" not in backend.dtypes:
        pytest.skip(f"backend {backend.name} has no float64")
    model = _model(backend)
    prompt = [[12, 4, 56, 7, 81, 3, 3, 40, 19, 66, 2, 95, 50]]
    cached = generate(model, prompt, 8, chunks=chunks)
    _assert_same_generation(cached, generate_uncached(model, prompt, 8), F64_ATOL)


@pytest.mark.parametrize("chunks", [None, [3, 1, 5, 2]], ids=["one-chunk", "uneven-3-1-5-2"])
def test_ragged_batch_cached_equals_uncached(backend, chunks):
    if "float64" not in backend.dtypes:
        pytest.skip(f"backend {backend.name} has no float64")
    model = _model(backend)
    cached = generate(model, RAGGED_PROMPTS, 7, chunks=chunks)
    _assert_same_generation(cached, generate_uncached(model, RAGGED_PROMPTS, 7), F64_ATOL)
    # The random model must not be degenerate: otherwise token equality proves little.
    assert len(np.unique(cached.tokens)) > 4


def test_tied_head_cached_equals_uncached():
    model = _model("numpy", tie_embeddings=True, seed=2)
    cached = generate(model, RAGGED_PROMPTS, 6, chunks=[2, 5])
    _assert_same_generation(cached, generate_uncached(model, RAGGED_PROMPTS, 6), F64_ATOL)


def test_every_prefill_position_matches_full_forward():
    """All T logits of every chunk (not only the last) equal the full pass at those positions."""
    model = _model("numpy")
    B = len(RAGGED_PROMPTS)
    lens = np.array([len(p) for p in RAGGED_PROMPTS])
    S = int(lens.max())
    full = np.zeros((B, S), dtype=np.int64)
    for b, p in enumerate(RAGGED_PROMPTS):
        full[b, : len(p)] = p
    want = model.forward_uncached(full, lens)  # [B, S, V]

    cache = model.new_cache(B, S)
    fed = np.zeros(B, dtype=np.int64)
    for chunk in [3, 1, 4, 2, 5]:
        n_new = np.minimum(chunk, lens - fed)
        tokens = np.zeros((B, chunk), dtype=np.int64)
        for b in range(B):
            tokens[b, : n_new[b]] = full[b, fed[b] : fed[b] + n_new[b]]
        got = model.forward(tokens, n_new, cache)  # [B, chunk, V]
        for b in range(B):
            np.testing.assert_allclose(got[b, : n_new[b]], want[b, fed[b] : fed[b] + n_new[b]],
                                       rtol=0, atol=F64_ATOL)
        fed += n_new
    assert (fed == lens).all()
    np.testing.assert_array_equal(cache.host_lens, lens)


def test_float32_error_is_that_of_float32_uncached(backend):
    if "float32" not in backend.dtypes:
        pytest.skip(f"backend {backend.name} has no float32")
    ref = generate_uncached(_model("numpy", "float64"), RAGGED_PROMPTS, 6)
    m32 = _model(backend, "float32")
    cached = generate(m32, RAGGED_PROMPTS, 6, chunks=[3, 1, 5])
    uncached = generate_uncached(m32, RAGGED_PROMPTS, 6)
    np.testing.assert_array_equal(cached.tokens, ref.tokens)
    np.testing.assert_array_equal(uncached.tokens, ref.tokens)
    err_cached = np.max(np.abs(cached.logits - ref.logits))
    err_naive = np.max(np.abs(uncached.logits - ref.logits))
    assert err_cached <= 4 * err_naive + 1e-6, (err_cached, err_naive)


def test_positions_continue_from_cache_length():
    """Feeding a prompt in two calls must equal one call only because RoPE positions continue;
    restarting positions at 0 for the second chunk would change the logits."""
    model = _model("numpy")
    prompt = np.array([[12, 4, 56, 7, 81, 3, 3, 40]])
    one = model.forward(prompt, [8], model.new_cache(1, 8))
    cache = model.new_cache(1, 8)
    model.forward(prompt[:, :5], [5], cache)
    two = model.forward(prompt[:, 5:], [3], cache)
    np.testing.assert_allclose(two[0], one[0, 5:], rtol=0, atol=F64_ATOL)
    # Control: the same tokens at positions 0..2 give different logits.
    fresh = model.forward(prompt[:, 5:], [3], model.new_cache(1, 3))
    assert np.max(np.abs(fresh[0] - one[0, 5:])) > 1e-3


@pytest.mark.parametrize("prompts, n, match", [
    ([[1, 2], []], 3, "prompt 1 is empty"),
    ([[1, 200]], 3, "outside 0..96"),
    ([[1, 2]], 0, "max_new_tokens must be >= 1"),
])
def test_bad_generation_requests(prompts, n, match):
    model = _model("numpy")
    with pytest.raises(ValueError, match=match):
        generate(model, prompts, n)
    with pytest.raises(ValueError, match=match):
        generate_uncached(model, prompts, n)


def test_generate_command_tiny(capsys):
    rc = cli_main(["generate", "--config", "tiny", "--batch", "3", "--prompt-len", "9",
                   "--new-tokens", "4", "--chunk", "4", "--dtype", "float64"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "greedy tokens identical: yes" in out
    assert "time to first token" in out and "KV cache (gqakv)" in out
