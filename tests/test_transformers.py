"""transformers integration: a randomly initialized GQA LlamaForCausalLM generating through gqakv.

Checked against the same model run by transformers' own eager and sdpa attention.
Tolerances:
- float64 against sdpa: logits agree to 1e-10 absolute (observed ~1e-15).
- float64 against eager: eager computes its softmax in float32 even for float64 models
  (``softmax(..., dtype=torch.float32)``), so its own error is ~1e-8; gqakv must be as
  close to eager as float64 sdpa is, + 1e-10.
- float32: gqakv's error against the float64 eager model is at most 4x eager float32's
  own error + 1e-6.
Greedy tokens must be identical.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch not installed (pip install 'gqakv[test]')")
transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install 'gqakv[transformers]')")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from gqakv.integrations.transformers import CACHE_KWARG, GqakvCache, register  # noqa: E402

F64_ATOL = 1e-10
register()


def _model(dtype=torch.float32, seed=0, layers=2):
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def _ids(batch=2, length=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 101, (batch, length), generator=g)


def _generate(model, ids, impl, n=10, cache=None):
    model.set_attn_implementation(impl)
    kwargs = {} if cache is None else {CACHE_KWARG: cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, eos_token_id=None, **kwargs)
    return out.sequences, torch.stack(out.logits)  # [B, S+n], [n, B, V]


def test_generate_matches_transformers_attention_float64(monkeypatch):
    import gqakv

    model = _model(torch.float64)
    ids = _ids()
    sdpa_seq, sdpa_logits = _generate(model, ids, "sdpa")
    eager_seq, eager_logits = _generate(model, ids, "eager")
    calls = []
    real = gqakv.gqa_attention
    monkeypatch.setattr(gqakv, "gqa_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = GqakvCache(model.config, max_cache_len=32)
    got_seq, got_logits = _generate(model, ids, "gqakv", cache=cache)
    assert len(calls) == 2 * 10  # gqakv did the attention: 2 layers x 10 forward calls
    assert torch.equal(got_seq, sdpa_seq) and torch.equal(got_seq, eager_seq)
    assert (got_logits - sdpa_logits).abs().max().item() <= F64_ATOL
    eager_own_error = (sdpa_logits - eager_logits).abs().max().item()
    assert (got_logits - eager_logits).abs().max().item() <= eager_own_error + F64_ATOL
    # gqakv really did the caching: every layer holds prompt + 9 fed tokens per row.
    assert all(kv.host_lens.tolist() == [11 + 9] * 2 for kv in cache.kv_caches)


def test_generate_float32_error_is_that_of_eager_float32():
    ids = _ids(batch=3, length=7, seed=5)
    ref_seq, ref_logits = _generate(_model(torch.float64), ids, "eager")
    model = _model(torch.float32)
    eager_seq, eager_logits = _generate(model, ids, "eager")
    got_seq, got_logits = _generate(model, ids, "gqakv", cache=GqakvCache(model.config, max_cache_len=24))
    assert torch.equal(got_seq, ref_seq) and torch.equal(eager_seq, ref_seq)
    err_gqakv = (got_logits.double() - ref_logits).abs().max().item()
    err_eager = (eager_logits.double() - ref_logits).abs().max().item()
    assert err_gqakv <= 4 * err_eager + 1e-6, (err_gqakv, err_eager)


def test_chunked_prefill_through_repeated_forward_calls():
    """Uneven prompt chunks, then decode steps, each through model(...) with the gqakv cache;
    every position's logits equal the sdpa model's single full forward pass."""
    model = _model(torch.float64)
    ids = _ids(batch=2, length=14, seed=7)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = model(ids, use_cache=False).logits  # [B, 14, V]

    model.set_attn_implementation("gqakv")
    cache = GqakvCache(model.config, max_cache_len=14)
    k_ptr = None
    start = 0
    with torch.no_grad():
        for size in [5, 1, 3, 4, 1]:
            out = model(ids[:, start:start + size], use_cache=True, **{CACHE_KWARG: cache})
            assert (out.logits - full[:, start:start + size]).abs().max().item() <= F64_ATOL
            k_ptr = k_ptr or cache.kv_caches[0].k.data_ptr()
            assert cache.kv_caches[0].k.data_ptr() == k_ptr  # written in place, never reallocated
            start += size
    assert start == 14 and cache.get_seq_length() == 14


def test_forward_without_cache_matches_sdpa():
    model = _model(torch.float64)
    ids = _ids(batch=2, length=9, seed=3)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        want = model(ids, use_cache=False).logits
        model.set_attn_implementation("gqakv")
        got = model(ids, use_cache=False).logits
    assert (got - want).abs().max().item() <= F64_ATOL


def test_padded_batch_is_refused_with_reason():
    model = _model()
    model.set_attn_implementation("gqakv")
    ids = _ids(batch=2, length=6)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    with torch.no_grad(), pytest.raises(ValueError, match="does not take padding masks"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                       **{CACHE_KWARG: GqakvCache(model.config, max_cache_len=16)})


def test_cache_capacity_error_names_the_numbers():
    model = _model()
    model.set_attn_implementation("gqakv")
    cache = GqakvCache(model.config, max_cache_len=8)
    with torch.no_grad(), pytest.raises(ValueError, match="max_len=8"):
        model(_ids(batch=1, length=9), use_cache=True, **{CACHE_KWARG: cache})


def test_beam_search_is_refused_with_reason():
    model = _model()
    model.set_attn_implementation("gqakv")
    ids = _ids(batch=1, length=4)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="GqakvCache does not support"):
        model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=2, max_new_tokens=3,
                       do_sample=False, **{CACHE_KWARG: GqakvCache(model.config, max_cache_len=16)})


def test_eager_reference_is_independent_of_gqakv():
    """The reference really uses transformers' own cache and attention (control for the tests above)."""
    model = _model(torch.float64)
    ids = _ids()
    model.set_attn_implementation("eager")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, use_cache=True, **{CACHE_KWARG: cache})
    assert cache.get_seq_length() == ids.shape[1]
    assert not isinstance(cache, GqakvCache)


def test_reset_reuses_the_buffers():
    model = _model(torch.float64)
    ids = _ids(batch=2, length=6, seed=9)
    cache = GqakvCache(model.config, max_cache_len=20)
    first_seq, first_logits = _generate(model, ids, "gqakv", n=4, cache=cache)
    ptr = cache.kv_caches[0].k.data_ptr()
    cache.reset()
    assert cache.get_seq_length() == 0
    again_seq, again_logits = _generate(model, ids, "gqakv", n=4, cache=cache)
    assert torch.equal(again_seq, first_seq) and torch.equal(again_logits, first_logits)
    assert cache.kv_caches[0].k.data_ptr() == ptr
