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

import gqakv

from gqakv.tools.cli import main as cli_main
from gqakv_examples.llama import (
    TINY,
    LlamaModel,
    causal_attention,
    generate,
    generate_uncached,
)

from .support.reference import reference_attention

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


def test_generate_from_a_prefix_cache():
    """Requests served one after another from one prefix-cached cache: each starts on the
    pages of its prompt's longest cached prefix, prefills only the rest, and generates what
    re-running the whole prefix every step generates (float64 logits within 1e-10)."""
    model = LlamaModel(TINY, seed=3, dtype="float64", backend="numpy")
    rng = np.random.default_rng(4)
    system = rng.integers(0, TINY.vocab_size, 21).tolist()
    prompts = [system + rng.integers(0, TINY.vocab_size, n).tolist() for n in (5, 2, 9)]
    cache = model.new_cache(2, 40, storage="paged", page_size=4, prefix_cache=True)
    first = generate(model, [prompts[0]], 4, chunks=3, cache=cache)
    assert first.prefix_hits.tolist() == [0]
    later = generate(model, prompts[1:], 4, chunks=3, cache=cache)
    assert later.prefix_hits.tolist() == [20, 20]  # 5 full pages of the 21-token system prompt
    again = generate(model, [prompts[0]], 4, cache=cache)  # its prompt and 3 generated tokens cached
    assert again.prefix_hits.tolist() == [24]
    for got, ps in ((first, prompts[:1]), (later, prompts[1:]), (again, prompts[:1])):
        want = generate_uncached(model, ps, 4)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_allclose(got.logits, want.logits, rtol=1e-10, atol=1e-10)
    assert cache.store.page_table.audit(cache.host_lens) == []
    with pytest.raises(ValueError, match="the cache has 2 rows of 40 tokens; 3 rows"):
        generate(model, prompts, 4, cache=cache)


def test_generate_prefix_cache_command(capsys):
    rc = cli_main(["generate", "--config", "tiny", "--prefix-cache", "40", "--new-tokens", "3",
                   "--backend", "numpy", "--dtype", "float64"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "second request: 32 prompt tokens from the cache" in out
    assert "greedy tokens identical to serving it alone: yes" in out


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_generate_prefix_cache_command_batch_invariant(capsys, backend):
    """In batch-invariant mode the second request's logits are the bits of serving it alone:
    its 8 prefilled tokens and the other run's 40-token chunk reduce each query alike."""
    rc = cli_main(["generate", "--config", "tiny", "--prefix-cache", "40", "--new-tokens", "3",
                   "--backend", backend, "--batch-invariant"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "second request: 32 prompt tokens from the cache" in out
    assert "logits bit-identical" in out and "not bit-identical" not in out


def _request_logits(model, prompt, *, batch_prompts, row, chunk):
    """Logits ``[len(prompt), V]`` of ``prompt`` prefilled in chunks of ``chunk`` tokens as
    row ``row`` of a batch whose other rows prefill ``batch_prompts`` alongside."""
    prompts = list(batch_prompts)
    prompts.insert(row, prompt)
    B, longest = len(prompts), max(len(p) for p in prompts)
    cache = model.new_cache(B, longest + 1)
    got, done = [], np.zeros(B, dtype=np.int64)
    while done[row] < len(prompt):
        n_new = np.array([min(chunk, len(p) - int(t)) for p, t in zip(prompts, done)])
        tokens = np.zeros((B, int(n_new.max())), dtype=np.int64)
        for b, (p, t, n) in enumerate(zip(prompts, done, n_new)):
            tokens[b, :n] = p[t:t + n]
        logits = model.forward(tokens, n_new, cache)
        got.append(logits[row, :n_new[row]])
        done += n_new
    return np.concatenate(got)


@pytest.mark.parametrize("backend,dtype", [("numpy", "float32"), ("numba", "float32"),
                                           ("torch", "float32")])
def test_a_requests_logits_do_not_depend_on_its_batch_in_batch_invariant_mode(backend, dtype):
    """The whole model, not attention alone (``LlamaModel._linear``): a 23-token request's
    logits at every position have the same bits served alone in one chunk and as row 2 of
    a batch of 4 other-length prompts in 5-token chunks, and one token per forward (as
    decode steps) as row 1; without the mode they do not."""
    try:
        model = _model(backend, dtype=dtype, seed=5, hidden_size=64, n_heads=8, n_kv_heads=2,
                       intermediate_size=256)
    except gqakv.BackendError as exc:
        pytest.skip(str(exc))
    rng = np.random.default_rng(6)
    prompt = rng.integers(0, TINY.vocab_size, 23)
    others = [rng.integers(0, TINY.vocab_size, n) for n in (9, 31, 17)]
    with gqakv.batch_invariant():
        alone = _request_logits(model, prompt, batch_prompts=[], row=0, chunk=23)
        batched = _request_logits(model, prompt, batch_prompts=others, row=2, chunk=5)
        stepped = _request_logits(model, prompt, batch_prompts=others, row=1, chunk=1)  # decode-like
    assert alone.dtype == batched.dtype and np.array_equal(alone.view(np.uint8), batched.view(np.uint8))
    assert np.array_equal(alone.view(np.uint8), stepped.view(np.uint8))
    plain_alone = _request_logits(model, prompt, batch_prompts=[], row=0, chunk=23)
    plain_batched = _request_logits(model, prompt, batch_prompts=others, row=2, chunk=5)
    assert not np.array_equal(plain_alone, plain_batched)  # the test above is not vacuous
    # and right: the uncached path's logits (its own attention, written in the model)
    want = model.forward_uncached(prompt[None])[0]
    # float32 through 2 layers (errors seen: 3e-6 of logits up to 3.8): 100 ulps of the largest
    np.testing.assert_allclose(alone, want, rtol=0, atol=100 * np.finfo(np.float32).eps * np.abs(want).max())


# -- attention variants: sliding windows (alternating with global layers), soft-cap, sinks ------

VARIANTS = {  # name -> LlamaConfig changes; windows shorter than the longest prompt (11)
    "window-3": dict(sliding_window=3),
    "window-1": dict(sliding_window=1),
    "window-4-global-every-2": dict(sliding_window=4, global_every=2),
    "softcap-0.3": dict(softcap=0.3),
    "sinks": dict(sinks=True),
    "all": dict(sliding_window=5, global_every=2, softcap=2.0, sinks=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_causal_attention_variants_match_loop_reference(variant):
    """The uncached path's attention (window, softcap, sinks) equals the independent float64 loop."""
    changes = dict(VARIANTS[variant])
    rng = np.random.default_rng(1)
    B, Hq, Hkv, S, d = 2, 6, 2, 9, 4
    q = 2 * rng.standard_normal((B, Hq, S, d))
    k = rng.standard_normal((B, Hkv, S, d))
    v = rng.standard_normal((B, Hkv, S, d))
    sinks = np.array([-np.inf, 3.0, -1.0, 0.5, 20.0, -4.0]) if changes.get("sinks") else None
    import array_api_compat.numpy as xp

    got = causal_attention(xp, q, k, v, 0.5, window=changes.get("sliding_window"),
                           softcap=changes.get("softcap"), sinks=sinks)
    want, _ = reference_attention(q, list(k), list(v), [S] * B, 0.5, window=changes.get("sliding_window"),
                                  softcap=changes.get("softcap"), sinks=sinks)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_model_cached_equals_uncached(backend, variant):
    """Chunked prefill of ragged prompts longer than the window, then ragged decode, through
    gqakv (each layer its own AttentionParams) equals the uncached variant forward."""
    if "float64" not in backend.dtypes:
        pytest.skip(f"backend {backend.name} has no float64")
    model = _model(backend, **VARIANTS[variant])
    cached = generate(model, RAGGED_PROMPTS, 6, chunks=[3, 1, 5, 2])
    _assert_same_generation(cached, generate_uncached(model, RAGGED_PROMPTS, 6), F64_ATOL)
    assert len(np.unique(cached.tokens)) > 4
    # The variant changes the model: the plain model (same weights) generates other logits.
    plain = generate_uncached(_model("numpy"), RAGGED_PROMPTS, 6)
    assert np.max(np.abs(plain.logits - cached.logits)) > 1e-3


def test_variant_layers_and_weights():
    c = TINY.replace(n_layers=6, sliding_window=4, global_every=3)
    assert [c.layer_window(i) for i in range(6)] == [4, 4, None, 4, 4, None]  # Gemma-3-like: layers 2, 5 global
    assert [TINY.replace(sliding_window=2).layer_window(i) for i in range(2)] == [2, 2]
    assert c.variant == "window 4 (every 3rd layer global)"
    assert TINY.replace(softcap=20.0, sinks=True).variant == "softcap 20, sinks"
    # Sinks come from their own stream: every other weight is the plain model's.
    plain, sunk = _model("numpy"), _model("numpy", sinks=True)
    assert plain.sink_logits is None and len(sunk.sink_logits) == TINY.n_layers
    assert all(len(s) == TINY.n_heads and all(float(np.float32(x)) == x for x in s) for s in sunk.sink_logits)
    for a, b in zip(plain.layers, sunk.layers):
        assert all(np.array_equal(a[key], b[key]) for key in a)
    assert sunk.config.n_params == plain.config.n_params + TINY.n_layers * TINY.n_heads


def test_variant_limits_equal_the_plain_model():
    """W >= every sequence is no window; sinks of -inf add nothing; the cached path agrees."""
    plain = generate(_model("numpy"), RAGGED_PROMPTS, 5, chunks=4)
    wide = generate(_model("numpy", sliding_window=11 + 5, global_every=2), RAGGED_PROMPTS, 5, chunks=4)
    _assert_same_generation(wide, plain, F64_ATOL)
    silent = _model("numpy", sinks=True)
    silent.sink_logits = [(-math.inf,) * TINY.n_heads] * TINY.n_layers
    _assert_same_generation(generate(silent, RAGGED_PROMPTS, 5, chunks=4), plain, F64_ATOL)


@pytest.mark.parametrize("changes, match", [
    (dict(sliding_window=0), r"sliding_window=0 must be None or an int >= 1"),
    (dict(sliding_window=2.5), r"sliding_window=2.5 must be None or an int >= 1"),
    (dict(global_every=2), r"global_every=2 .* needs a sliding_window"),
    (dict(sliding_window=4, global_every=1), r"global_every=1 must be None or an int >= 2"),
    (dict(softcap=0.0), r"softcap=0.0 must be None or a finite number > 0"),
    (dict(softcap=math.inf), r"softcap=inf must be None or a finite number > 0"),
])
def test_bad_variant_configs(changes, match):
    with pytest.raises(ValueError, match=match):
        TINY.replace(**changes)


def test_generate_command_with_variants(capsys):
    rc = cli_main(["generate", "--config", "tiny", "--batch", "3", "--prompt-len", "9", "--new-tokens", "4",
                   "--chunk", "4", "--dtype", "float64", "--window", "3", "--global-every", "2",
                   "--softcap", "5", "--sinks"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "attention: window 3 (every 2nd layer global), softcap 5, sinks" in out
    assert "greedy tokens identical: yes" in out


@pytest.mark.parametrize("options, match", [
    (["--window", "0"], "--window must be >= 1, got 0"),
    (["--global-every", "2"], "--global-every 2: needs --window"),
    (["--window", "3", "--global-every", "1"], "--global-every 1: needs --window and a value >= 2"),
    (["--softcap", "0"], "--softcap must be a finite number > 0, got 0.0"),
])
def test_generate_command_bad_variant_options(capsys, options, match):
    rc = cli_main(["generate", "--config", "tiny", *options])
    captured = capsys.readouterr()
    assert rc == 2 and match in captured.err and captured.out == ""


def test_every_layer_of_a_step_runs_on_one_plan(monkeypatch):
    """A generation step validates and plans its attention batch once for all its layers
    (gqakv.ops.plan; the example model calls Step.attend per layer with its variant): one
    batch validation and one backend plan per step, not one per layer."""
    from gqakv.caches import model_cache

    from .support.spies import counting

    model = _model("numba", dtype="float32", n_layers=4)
    validated = counting(monkeypatch, model_cache, "validate_attention_batch")
    planned = counting(monkeypatch, model.backend, "plan_attention")
    result = generate(model, RAGGED_PROMPTS, 3)  # a prefill step, then 2 decode steps
    steps = 3
    assert (len(validated), len(planned)) == (steps, steps), (validated, planned)
    assert np.asarray(result.tokens).shape[0] == len(RAGGED_PROMPTS)
