"""transformers integration: a randomly initialized GQA LlamaForCausalLM generating through gqakv.

Checked against the same model run by transformers' own eager and sdpa attention.
Tolerances:
- float64 against sdpa: logits agree to 1e-10 absolute (observed 0.0 on this model: the
  attention outputs differ by ~1e-15, which vanishes in its small-weight residual stream).
- float64 against eager: eager computes its softmax in float32 even for float64 models
  (``softmax(..., dtype=torch.float32)``), so its own error is ~1e-8; gqakv must be as
  close to eager as float64 sdpa is, + 1e-10.
- float32: gqakv's error against the float64 eager model is at most 4x eager float32's
  own error + 1e-6.
Greedy tokens must be identical.
Padded batches (left padding for generate; right padding and gaps through forward calls) are
compared at the real positions only: transformers' outputs at pad slots are meaningless, gqakv's
are 0. float64 eager is no reference for padded batches (it gives NaN, see below).
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


def _left_padded(lens, seed=3):
    """Left-padded prompts of the given real lengths: ids and mask ``[B, max(lens)]``."""
    g = torch.Generator().manual_seed(seed)
    width = max(lens)
    ids = torch.zeros(len(lens), width, dtype=torch.long)  # pad_token_id = 0
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lens):
        ids[b, width - n:] = torch.randint(3, 101, (n,), generator=g)
        mask[b, width - n:] = 1
    return ids, mask


def _generate_padded(model, ids, mask, impl, n=8, cache=None, **extra):
    model.set_attn_implementation(impl)
    kwargs = {} if cache is None else {CACHE_KWARG: cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0, **kwargs, **extra)
    return out.sequences, torch.stack(out.logits)  # [B, W+n], [n, B, V]


# Rows of very different lengths; row 0 has no padding.
PADDED_LENS = [37, 1, 9, 2, 20]


def test_left_padded_generate_matches_sdpa_float64(monkeypatch):
    """Left padding (tokenizer.padding_side='left'): every row's greedy tokens and logits equal
    sdpa's on the same padded batch; each gqakv row holds only its real tokens, with the
    keys transformers' own cache holds for that row run alone; the buffers never move.
    (float64 eager is no reference here: it gives NaN for fully padded queries, which then
    spreads through 0 * NaN in the next layer.)"""
    import gqakv

    model = _model(torch.float64)
    ids, mask = _left_padded(PADDED_LENS)
    n = 8
    sdpa_seq, sdpa_logits = _generate_padded(model, ids, mask, "sdpa", n=n)
    pointers = set()
    real = gqakv.gqa_attention
    monkeypatch.setattr(gqakv, "gqa_attention",
                        lambda q, kv, *a, **k: pointers.add((kv.k.data_ptr(), kv.v.data_ptr())) or real(q, kv, *a, **k))
    cache = GqakvCache(model.config, max_cache_len=max(PADDED_LENS) + n)  # capacity counts real tokens only
    got_seq, got_logits = _generate_padded(model, ids, mask, "gqakv", n=n, cache=cache)
    assert torch.equal(got_seq, sdpa_seq)
    assert (got_logits - sdpa_logits).abs().max().item() <= F64_ATOL
    # Allocated once: one K and one V buffer per layer over all 8 forward calls.
    assert pointers == {(kv.k.data_ptr(), kv.v.data_ptr()) for kv in cache.kv_caches}
    assert cache.get_seq_length() == ids.shape[1] + n - 1  # token slots, as transformers counts them
    # No pad was written: row b holds exactly its real prompt + n-1 fed tokens, and they are the
    # keys/values transformers' own DynamicCache holds for that row run alone, unpadded.
    model.set_attn_implementation("sdpa")
    for b, length in enumerate(PADDED_LENS):
        row = got_seq[b, ids.shape[1] - length:-1][None]  # real prompt + fed tokens, [1, length + n - 1]
        ref = DynamicCache(config=model.config)
        with torch.no_grad():
            model(row, use_cache=True, **{CACHE_KWARG: ref})
        for layer, kv in zip(ref.layers, cache.kv_caches):
            assert int(kv.host_lens[b]) == length + n - 1
            held_k, held_v = kv.live_kv(b)
            assert (held_k - layer.keys[0]).abs().max().item() <= F64_ATOL
            assert (held_v - layer.values[0]).abs().max().item() <= F64_ATOL


def test_left_padded_generate_float32_error_is_that_of_sdpa_and_eager():
    ids, mask = _left_padded(PADDED_LENS, seed=4)
    ref_seq, ref_logits = _generate_padded(_model(torch.float64), ids, mask, "sdpa")
    model = _model(torch.float32)
    got_seq, got_logits = _generate_padded(model, ids, mask, "gqakv", cache=GqakvCache(model.config, max_cache_len=48))
    assert torch.equal(got_seq, ref_seq)
    err_gqakv = (got_logits.double() - ref_logits).abs().max().item()
    for impl in ("sdpa", "eager"):
        seq, logits = _generate_padded(model, ids, mask, impl)
        assert torch.equal(seq, ref_seq)
        err = (logits.double() - ref_logits).abs().max().item()
        assert err_gqakv <= 4 * err + 1e-6, (impl, err_gqakv, err)


def test_left_padded_generate_with_chunked_prefill_float64():
    """generate(prefill_chunk_size=4): the padded prompt goes through several forward calls,
    some of which hold only padding for the short rows."""
    model = _model(torch.float64)
    ids, mask = _left_padded([13, 2, 7, 1], seed=6)
    want_seq, want_logits = _generate_padded(model, ids, mask, "sdpa")
    cache = GqakvCache(model.config, max_cache_len=24)
    got_seq, got_logits = _generate_padded(model, ids, mask, "gqakv", cache=cache, prefill_chunk_size=4)
    assert torch.equal(got_seq, want_seq)
    assert (got_logits - want_logits).abs().max().item() <= F64_ATOL
    assert [int(x) for x in cache.kv_caches[1].host_lens] == [13 + 7, 2 + 7, 7 + 7, 1 + 7]


def _positions(mask):
    """Position ids as transformers' generate derives them from a 2D mask (pads at 0)."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def _check_padded_chunks(ids, mask, sizes):
    """Feed ``ids`` through model(...) in chunks of ``sizes`` with the gqakv cache and the mask
    seen so far; logits at every real position equal sdpa's single full forward pass."""
    model = _model(torch.float64)
    positions = _positions(mask)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    model.set_attn_implementation("gqakv")
    cache = GqakvCache(model.config, max_cache_len=ids.shape[1])
    real = mask.bool()
    start, k_ptr = 0, None
    with torch.no_grad():
        for size in sizes:
            end = start + size
            out = model(ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end],
                        use_cache=True, **{CACHE_KWARG: cache})
            live = real[:, start:end]
            if live.any():
                assert (out.logits - full[:, start:end])[live].abs().max().item() <= F64_ATOL
            assert out.logits.isfinite().all()  # pad slots get zero attention output, never NaN
            k_ptr = k_ptr or cache.kv_caches[0].k.data_ptr()
            assert cache.kv_caches[0].k.data_ptr() == k_ptr
            start = end
    assert start == ids.shape[1]
    assert cache.kv_caches[0].host_lens.tolist() == mask.sum(1).tolist()


def test_left_padded_chunked_prefill_and_decode_through_forward_calls():
    ids, mask = _left_padded([17, 3, 9, 1], seed=8)
    tail = torch.randint(3, 101, (4, 3), generator=torch.Generator().manual_seed(9))  # 3 decode steps
    ids, mask = torch.cat([ids, tail], 1), torch.cat([mask, torch.ones_like(tail)], 1)
    _check_padded_chunks(ids, mask, [5, 1, 7, 4, 1, 1, 1])  # chunk 1 is all padding for rows 1 and 3


def test_right_padded_and_gapped_masks_through_forward_calls():
    """Padding anywhere (right padding, then tokens after it) is skipped the same way."""
    g = torch.Generator().manual_seed(10)
    ids = torch.randint(3, 101, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:9] = 0   # right-padded prompt of 5, then 3 tokens fed after the padding
    mask[2, 2:3] = 0
    mask[2, 7:11] = 0
    _check_padded_chunks(ids, mask, [6, 3, 1, 2])


def test_padded_forward_without_cache_matches_sdpa():
    model = _model(torch.float64)
    ids, mask = _left_padded([9, 4, 1], seed=11)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        want = model(ids, attention_mask=mask, use_cache=False).logits
        model.set_attn_implementation("gqakv")
        got = model(ids, attention_mask=mask, use_cache=False).logits
    assert (got - want)[mask.bool()].abs().max().item() <= F64_ATOL


def test_mask_that_disagrees_with_the_cache_is_refused():
    model = _model(torch.float64)
    model.set_attn_implementation("gqakv")
    ids, mask = _left_padded([6, 3], seed=12)
    cache = GqakvCache(model.config, max_cache_len=16)
    step = torch.tensor([[5], [7]])
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True, **{CACHE_KWARG: cache})
        lens = [kv.host_lens.tolist() for kv in cache.kv_caches]
        wrong = torch.ones(2, 7, dtype=torch.long)
        wrong[1, 1:3] = 0  # row 0 right (6 real), row 1 claims 4 real earlier tokens, not 3
        with pytest.raises(ValueError, match=r"row 1 has 4 real earlier tokens in the mask but the cache holds 3"):
            model(step, attention_mask=wrong, use_cache=True, **{CACHE_KWARG: cache})
        with pytest.raises(ValueError, match=r"attention_mask has 6 columns.*6 \+ 1 = 7"):
            model(step, attention_mask=mask, use_cache=True, **{CACHE_KWARG: cache})
        assert [kv.host_lens.tolist() for kv in cache.kv_caches] == lens  # nothing was written
        cache.reset()
        model(ids, attention_mask=mask, use_cache=True, **{CACHE_KWARG: cache})
        for all_real in (None, torch.ones(2, 7, dtype=torch.long)):
            with pytest.raises(ValueError, match=r"hold \[6, 3\] real tokens.*missing or all ones"):
                model(step, attention_mask=all_real, use_cache=True, **{CACHE_KWARG: cache})


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


def test_cache_with_another_attention_is_refused():
    model = _model()
    model.set_attn_implementation("eager")
    ids = _ids(batch=1, length=4)
    cache = GqakvCache(model.config, max_cache_len=16)
    with torch.no_grad():
        model(ids, use_cache=True, **{CACHE_KWARG: cache})
        with pytest.raises(RuntimeError, match="works only with model.set_attn_implementation"):
            model(ids[:, :1], use_cache=True, **{CACHE_KWARG: cache})


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
