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

from transformers import DynamicCache  # noqa: E402

from gqakv.integrations.transformers import CACHE_KWARG, GqakvCache, register  # noqa: E402

from .support.hf import greedy_generate, tiny_llama, token_ids  # noqa: E402

F64_ATOL = 1e-10
register()


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """These models are tiny: one intra-op thread is fastest, and torch's spinning pool slows the
    module ~15x on a loaded 2-core machine (3 s vs 50 s). Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _perturbed_assistant(model, attn: str, drafts: int):
    """``model`` with its weights perturbed (seeded), as an assistant drafting ``drafts``
    tokens per step with ``attn`` attention: some drafts accepted, some not."""
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.03 * torch.randn_like(p))
    model.set_attn_implementation(attn)
    model.generation_config.num_assistant_tokens = drafts
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.generation_config.assistant_confidence_threshold = 0.0
    return model


def test_generate_matches_transformers_attention_float64(monkeypatch):
    import gqakv

    model = tiny_llama(torch.float64)
    ids = token_ids()
    sdpa_seq, sdpa_logits = greedy_generate(model, ids, "sdpa")
    eager_seq, eager_logits = greedy_generate(model, ids, "eager")
    calls = []
    real = gqakv.gqa_attention
    monkeypatch.setattr(gqakv, "gqa_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = GqakvCache(model.config, max_cache_len=32)
    got_seq, got_logits = greedy_generate(model, ids, "gqakv", cache=cache)
    assert len(calls) == 2 * 10  # gqakv did the attention: 2 layers x 10 forward calls
    assert torch.equal(got_seq, sdpa_seq) and torch.equal(got_seq, eager_seq)
    assert (got_logits - sdpa_logits).abs().max().item() <= F64_ATOL
    eager_own_error = (sdpa_logits - eager_logits).abs().max().item()
    assert (got_logits - eager_logits).abs().max().item() <= eager_own_error + F64_ATOL
    # gqakv really did the caching: every layer holds prompt + 9 fed tokens per row.
    assert all(kv.host_lens.tolist() == [11 + 9] * 2 for kv in cache.kv_caches)


def test_generate_float32_error_is_that_of_eager_float32():
    ids = token_ids(batch=3, length=7, seed=5)
    ref_seq, ref_logits = greedy_generate(tiny_llama(torch.float64), ids, "eager")
    model = tiny_llama(torch.float32)
    eager_seq, eager_logits = greedy_generate(model, ids, "eager")
    got_seq, got_logits = greedy_generate(model, ids, "gqakv", cache=GqakvCache(model.config, max_cache_len=24))
    assert torch.equal(got_seq, ref_seq) and torch.equal(eager_seq, ref_seq)
    err_gqakv = (got_logits.double() - ref_logits).abs().max().item()
    err_eager = (eager_logits.double() - ref_logits).abs().max().item()
    assert err_gqakv <= 4 * err_eager + 1e-6, (err_gqakv, err_eager)


def test_chunked_prefill_through_repeated_forward_calls():
    """Uneven prompt chunks, then decode steps, each through model(...) with the gqakv cache;
    every position's logits equal the sdpa model's single full forward pass."""
    model = tiny_llama(torch.float64)
    ids = token_ids(batch=2, length=14, seed=7)
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
    model = tiny_llama(torch.float64)
    ids = token_ids(batch=2, length=9, seed=3)
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

    model = tiny_llama(torch.float64)
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
    ref_seq, ref_logits = _generate_padded(tiny_llama(torch.float64), ids, mask, "sdpa")
    model = tiny_llama(torch.float32)
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
    model = tiny_llama(torch.float64)
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
    model = tiny_llama(torch.float64)
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
    model = tiny_llama(torch.float64)
    ids, mask = _left_padded([9, 4, 1], seed=11)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        want = model(ids, attention_mask=mask, use_cache=False).logits
        model.set_attn_implementation("gqakv")
        got = model(ids, attention_mask=mask, use_cache=False).logits
    assert (got - want)[mask.bool()].abs().max().item() <= F64_ATOL


def test_mask_that_disagrees_with_the_cache_is_refused():
    model = tiny_llama(torch.float64)
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
    model = tiny_llama()
    model.set_attn_implementation("gqakv")
    cache = GqakvCache(model.config, max_cache_len=8)
    with torch.no_grad(), pytest.raises(ValueError, match="max_len=8"):
        model(token_ids(batch=1, length=9), use_cache=True, **{CACHE_KWARG: cache})


def _spy(monkeypatch, cls, name, record):
    """Record the (self, args) of every call of ``cls.name`` and let it run."""
    real = getattr(cls, name)
    monkeypatch.setattr(cls, name, lambda self, *a: record.append((self, a)) or real(self, *a))


def _beam_search(model, ids, mask, impl, beams, n, cache=None):
    model.set_attn_implementation(impl)
    kwargs = {} if cache is None else {CACHE_KWARG: cache}  # None: transformers' default DynamicCache
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, num_beams=beams,
                             num_return_sequences=beams, output_scores=True, return_dict_in_generate=True,
                             eos_token_id=None, pad_token_id=0, **kwargs)
    return out.sequences, out.sequences_scores  # [B * beams, W + n], [B * beams]


@pytest.mark.parametrize("beams", [2, 4])
@pytest.mark.parametrize("lens", [[7], [9, 2, 5]], ids=["one-prompt", "left-padded"])
def test_beam_search_matches_sdpa_with_dynamic_cache(monkeypatch, lens, beams):
    """num_beams > 1: every returned beam and its score equal sdpa's with transformers' own
    DynamicCache. The cache is allocated once for batch x beams rows (generate expands the
    prompts before the first forward); beams move by KVCache.reorder, in place."""
    import gqakv

    model = tiny_llama(torch.float64)
    ids, mask = _left_padded(lens, seed=13)
    n = 6
    want_seq, want_scores = _beam_search(model, ids, mask, "sdpa", beams, n)
    pointers, reorders = set(), []
    real = gqakv.gqa_attention
    monkeypatch.setattr(gqakv, "gqa_attention",
                        lambda q, kv, *a, **k: pointers.add((kv.k.data_ptr(), kv.v.data_ptr())) or real(q, kv, *a, **k))
    _spy(monkeypatch, gqakv.KVCache, "reorder", reorders)
    cache = GqakvCache(model.config, max_cache_len=max(lens) + n)
    got_seq, got_scores = _beam_search(model, ids, mask, "gqakv", beams, n, cache=cache)
    assert torch.equal(got_seq, want_seq)
    assert (got_scores - want_scores).abs().max().item() <= F64_ATOL
    assert pointers == {(kv.k.data_ptr(), kv.v.data_ptr()) for kv in cache.kv_caches}  # allocated once
    # Beams really moved, through every layer's gqakv cache alike (identity steps are skipped).
    per_layer = [[list(src) for kv_, (src,) in reorders if kv_ is kv] for kv in cache.kv_caches]
    assert 0 < len(per_layer[0]) <= n and per_layer[0] == per_layer[1] and len(reorders) == 2 * len(per_layer[0])
    assert all(src != list(range(len(lens) * beams)) for src in per_layer[0])
    # Padding bookkeeping stays per row: slots count pads, each row holds its prompt's real tokens + n - 1.
    assert cache.get_seq_length() == ids.shape[1] + n - 1
    for kv in cache.kv_caches:
        assert kv.batch == len(lens) * beams
        assert kv.host_lens.tolist() == [length + n - 1 for length in lens for _ in range(beams)]


def test_beam_search_with_finished_beams_then_reuse_for_a_smaller_batch():
    """Beams that end on EOS (length penalty 0.7, 3 beams) match sdpa; the reset cache then
    serves a greedy batch of 2 in the first 2 of its 9 rows, same buffers; a batch change
    mid-sequence or beyond the rows allocated is refused."""
    model = tiny_llama(torch.float64)
    ids, mask = _left_padded([9, 2, 5], seed=13)
    eos = [2, 5, 7, 9, 11, 13]
    outs = {}
    for impl, cache in (("sdpa", None), ("gqakv", GqakvCache(model.config, max_cache_len=30))):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = model.generate(
                ids, attention_mask=mask, max_new_tokens=15, do_sample=False, num_beams=3, num_return_sequences=3,
                length_penalty=0.7, eos_token_id=eos, pad_token_id=0, output_scores=True,
                return_dict_in_generate=True, **({} if cache is None else {CACHE_KWARG: cache}))
    assert torch.equal(outs["gqakv"].sequences, outs["sdpa"].sequences)
    assert (outs["gqakv"].sequences_scores - outs["sdpa"].sequences_scores).abs().max().item() <= F64_ATOL
    assert torch.isin(outs["sdpa"].sequences[:, ids.shape[1]:], torch.tensor(eos)).any()  # some beams ended on EOS
    ptr = cache.kv_caches[0].k.data_ptr()
    cache.reset()
    want_seq, want_logits = _generate_padded(model, ids[:2], mask[:2], "sdpa")
    got_seq, got_logits = _generate_padded(model, ids[:2], mask[:2], "gqakv", cache=cache)
    assert torch.equal(got_seq, want_seq) and (got_logits - want_logits).abs().max().item() <= F64_ATOL
    assert cache.batch_size == 2 and cache.kv_caches[0].host_lens.tolist() == [9 + 7, 2 + 7] + [0] * 7
    assert cache.kv_caches[0].k.data_ptr() == ptr
    with torch.no_grad(), pytest.raises(ValueError, match=r"holds a batch of 2 rows \(9 allocated, 16 token slots"):
        model(ids[:, :1], use_cache=True, **{CACHE_KWARG: cache})
    cache.reset()
    with torch.no_grad(), pytest.raises(ValueError, match=r"allocated 9 rows .*max_batch_size=10 or more"):
        model(token_ids(batch=10, length=2), use_cache=True, **{CACHE_KWARG: cache})


def test_beam_search_is_sensitive_to_the_reorder(monkeypatch):
    """Control: with reorder_cache a no-op the beams differ from sdpa's, so the test above
    really checks the reorder."""
    from gqakv.integrations.transformers import GqakvLayer

    model = tiny_llama(torch.float64)
    ids, mask = _left_padded([9, 2, 5], seed=13)
    want_seq, _ = _beam_search(model, ids, mask, "sdpa", 2, 6)
    monkeypatch.setattr(GqakvLayer, "reorder_cache", lambda self, beam_idx: None)
    got_seq, _ = _beam_search(model, ids, mask, "gqakv", 2, 6, cache=GqakvCache(model.config, max_cache_len=20))
    assert not torch.equal(got_seq, want_seq)


def test_assisted_decoding_matches_greedy(monkeypatch):
    """assistant_model=: the main model verifies 5 drafted tokens per forward and crops the
    rejected ones (KVCache.truncate); tokens and logits equal plain greedy sdpa generation."""
    from gqakv.integrations.transformers import GqakvLayer

    model = tiny_llama(torch.float64)
    # the same weights, perturbed: some drafts accepted, some not
    assistant = _perturbed_assistant(tiny_llama(torch.float64), "sdpa", drafts=5)
    ids = token_ids(batch=1, length=7, seed=14)
    n = 12
    want_seq, want_logits = greedy_generate(model, ids, "sdpa", n=n)
    crops = []
    _spy(monkeypatch, GqakvLayer, "crop", crops)
    cache = GqakvCache(model.config, max_cache_len=ids.shape[1] + n + 5)
    model.set_attn_implementation("gqakv")
    ptr = None
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             assistant_model=assistant, output_logits=True, return_dict_in_generate=True,
                             eos_token_id=None, pad_token_id=0, **{CACHE_KWARG: cache})
    ptr = cache.kv_caches[0].k.data_ptr()
    assert torch.equal(out.sequences, want_seq)
    assert (torch.stack(out.logits) - want_logits).abs().max().item() <= F64_ATOL
    removed = {-a[0] for _, a in crops}
    assert max(removed) > 1 and 0 in removed  # rejected drafts of several tokens, and fully accepted ones
    assert cache.get_seq_length() == ids.shape[1] + n - 1
    assert all(kv.host_lens.tolist() == [ids.shape[1] + n - 1] for kv in cache.kv_caches)
    assert cache.kv_caches[0].k.data_ptr() == ptr


def test_crop_takes_only_the_real_tokens_of_each_row():
    """Forward calls on a padded batch, then crop slots of which some are padding in some rows:
    each row loses only its real tokens among them; what follows equals sdpa's full forward pass
    over the kept tokens."""
    model = tiny_llama(torch.float64)
    ids, mask = _left_padded([6, 2, 4], seed=15)          # prefill, W = 6
    g = torch.Generator().manual_seed(16)
    draft = torch.randint(3, 101, (3, 3), generator=g)     # 3 slots, later 2 of them cropped
    draft_mask = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 0, 1]])
    tail = torch.randint(3, 101, (3, 2), generator=g)      # fed after the crop
    model.set_attn_implementation("gqakv")
    cache = GqakvCache(model.config, max_cache_len=12)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True, **{CACHE_KWARG: cache})
        m = torch.cat([mask, draft_mask], 1)
        model(draft, attention_mask=m, position_ids=_positions(m)[:, -3:], use_cache=True, **{CACHE_KWARG: cache})
        assert cache.kv_caches[0].host_lens.tolist() == [9, 4, 5]
        cache.crop(-2)  # drops slots 7, 8: real in row 0 (2), pad + real in row 1 (1), pad + real in row 2 (1)
        assert cache.get_seq_length() == 7
        assert all(kv.host_lens.tolist() == [7, 3, 4] for kv in cache.kv_caches)
        kept_ids, kept_mask = torch.cat([ids, draft[:, :1], tail], 1), torch.cat([m[:, :7], torch.ones_like(tail)], 1)
        got = model(tail, attention_mask=kept_mask, position_ids=_positions(kept_mask)[:, -2:], use_cache=True,
                    **{CACHE_KWARG: cache}).logits
        model.set_attn_implementation("sdpa")
        want = model(kept_ids, attention_mask=kept_mask, position_ids=_positions(kept_mask), use_cache=False).logits
    assert (got - want[:, -2:]).abs().max().item() <= F64_ATOL
    with pytest.raises(ValueError, match=r"crop\(-10\): the cache holds only 9 token slots"):
        cache.crop(-10)
    with pytest.raises(ValueError, match="negative count"):
        cache.crop(3)
    assert cache.get_seq_length() == 9 and cache.kv_caches[0].host_lens.tolist() == [9, 5, 6]


def test_batch_repeat_interleave_and_select_as_row_operations():
    """batch_repeat_interleave / batch_select_indices move rows within the rows allocated
    (max_batch_size), and the next step's logits equal sdpa with a DynamicCache given the
    same operations; beyond the rows allocated a clear error, nothing changed."""
    model = tiny_llama(torch.float64)
    ids, mask = _left_padded([5, 3], seed=17)
    step = torch.tensor([[11], [12], [13]])
    caches, logits = {}, {}
    for impl in ("sdpa", "gqakv"):
        model.set_attn_implementation(impl)
        cache = (GqakvCache(model.config, max_cache_len=8, max_batch_size=6) if impl == "gqakv"
                 else DynamicCache(config=model.config))
        with torch.no_grad():
            model(ids, attention_mask=mask, use_cache=True, **{CACHE_KWARG: cache})
            cache.batch_repeat_interleave(3)                      # rows: 0 0 0 1 1 1
            cache.batch_select_indices(torch.tensor([5, 0, 2]))   # rows: 1 0 0
            m = torch.cat([mask[[1, 0, 0]], torch.ones(3, 1, dtype=torch.long)], 1)
            logits[impl] = model(step, attention_mask=m, position_ids=_positions(m)[:, -1:], use_cache=True,
                                 **{CACHE_KWARG: cache}).logits
        caches[impl] = cache
    assert (logits["gqakv"] - logits["sdpa"]).abs().max().item() <= F64_ATOL
    cache = caches["gqakv"]
    assert cache.batch_size == 3 and all(kv.host_lens.tolist() == [4, 6, 6, 0, 0, 0] for kv in cache.kv_caches)
    ptr = cache.kv_caches[0].k.data_ptr()
    with pytest.raises(ValueError, match=r"grow to 9 rows but GqakvCache allocated 6 \(make it with max_batch_size=9"):
        cache.batch_repeat_interleave(3)
    with pytest.raises(ValueError, match="beam_idx holds row 3, out of range for a batch of 3"):
        cache.reorder_cache(torch.tensor([0, 1, 3]))
    assert cache.batch_size == 3 and cache.kv_caches[0].host_lens.tolist() == [4, 6, 6, 0, 0, 0]
    assert cache.kv_caches[0].k.data_ptr() == ptr


def test_cache_with_another_attention_is_refused():
    model = tiny_llama()
    model.set_attn_implementation("eager")
    ids = token_ids(batch=1, length=4)
    cache = GqakvCache(model.config, max_cache_len=16)
    with torch.no_grad():
        model(ids, use_cache=True, **{CACHE_KWARG: cache})
        with pytest.raises(RuntimeError, match="works only with model.set_attn_implementation"):
            model(ids[:, :1], use_cache=True, **{CACHE_KWARG: cache})


def test_eager_reference_is_independent_of_gqakv():
    """The reference really uses transformers' own cache and attention (control for the tests above)."""
    model = tiny_llama(torch.float64)
    ids = token_ids()
    model.set_attn_implementation("eager")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, use_cache=True, **{CACHE_KWARG: cache})
    assert cache.get_seq_length() == ids.shape[1]
    assert not isinstance(cache, GqakvCache)


def test_reset_reuses_the_buffers():
    model = tiny_llama(torch.float64)
    ids = token_ids(batch=2, length=6, seed=9)
    cache = GqakvCache(model.config, max_cache_len=20)
    first_seq, first_logits = greedy_generate(model, ids, "gqakv", n=4, cache=cache)
    ptr = cache.kv_caches[0].k.data_ptr()
    cache.reset()
    assert cache.get_seq_length() == 0
    again_seq, again_logits = greedy_generate(model, ids, "gqakv", n=4, cache=cache)
    assert torch.equal(again_seq, first_seq) and torch.equal(again_logits, first_logits)
    assert cache.kv_caches[0].k.data_ptr() == ptr


def test_second_generate_without_reset_is_refused_with_the_hint():
    """A GqakvCache serves one generation: a second generate from a new prompt is refused,
    naming cache.reset(), writes nothing, and works once the cache is reset."""
    model = tiny_llama(torch.float64)
    ids = token_ids(batch=2, length=6, seed=9)
    cache = GqakvCache(model.config, max_cache_len=40)
    first_seq, first_logits = greedy_generate(model, ids, "gqakv", n=4, cache=cache)
    held = [kv.host_lens.tolist() for kv in cache.kv_caches]
    assert held == [[6 + 3, 6 + 3]] * 2  # the last new token is never fed back
    # Unpadded prompt: its positions restart while the cache still holds 9 tokens per row.
    with pytest.raises(ValueError, match=r"start at position .* already holds 9 tokens.*call cache\.reset\(\)"):
        greedy_generate(model, ids, "gqakv", n=4, cache=cache)
    # Left-padded prompt: the mask's width no longer fits the slots the cache has seen.
    padded, mask = _left_padded([6, 4], seed=3)
    with pytest.raises(ValueError, match=r"attention_mask has 6 columns.*call cache\.reset\(\)"), torch.no_grad():
        model.generate(padded, attention_mask=mask, max_new_tokens=2, do_sample=False, **{CACHE_KWARG: cache})
    assert [kv.host_lens.tolist() for kv in cache.kv_caches] == held  # nothing was written
    cache.reset()
    again_seq, again_logits = greedy_generate(model, ids, "gqakv", n=4, cache=cache)
    assert torch.equal(again_seq, first_seq) and torch.equal(again_logits, first_logits)


# -- attention variants: sliding windows, logit soft-capping, sinks --------------------------------
#
# Tiny random models of each family that uses a variant, with a window W = 5 shorter than the
# prompts, so every sliding layer really drops keys. The reference is transformers' own eager
# attention with its cache; its float32 softmax upcast (``softmax(..., dtype=torch.float32)``) is
# kept in float64 for float64 inputs (in both runs, so the MoE router of gpt-oss matches too), which
# makes float64 eager exact to ~1e-15 and a 1e-10 reference; the tokens also equal plain eager's.
# Observed: gqakv's attention outputs within ~2e-16 of eager's and the logits identical (0.0), while
# dropping the variant moves the logits by 0.7-0.8 (logits are O(0.6)).

WINDOW = 5
_VARIANT_COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2)


def _variant_model(family: str, dtype=torch.float64, seed=0, **changes):
    """A tiny random model of ``family``; the variant it exercises is in VARIANT_FAMILIES."""
    import transformers as tf

    names = {"mistral": ("MistralConfig", "MistralForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
             "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
             "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}[family]
    if not all(hasattr(tf, name) for name in names):
        pytest.skip(f"transformers {tf.__version__} has no {names[1]}")
    config_cls, model_cls = getattr(tf, names[0]), getattr(tf, names[1])
    kwargs = dict(_VARIANT_COMMON, sliding_window=WINDOW)
    if family == "qwen2":  # layer 0 full, layer 1 sliding
        kwargs.update(use_sliding_window=True, max_window_layers=1)
    elif family == "gemma2":  # sliding/full alternation; a soft-cap small enough to bite on tiny scores
        kwargs.update(head_dim=8, query_pre_attn_scalar=8, attn_logit_softcapping=0.5)
    elif family == "gemma3":
        kwargs.update(head_dim=8, query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"])
    elif family == "gpt_oss":  # sliding/full alternation, sinks; 4 experts, 2 per token
        kwargs.update(head_dim=8, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
    kwargs.update(changes)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).to(dtype).eval()
    if family == "gpt_oss":
        model.set_experts_implementation("eager")  # grouped_mm has no float64 on the CPU
        with torch.no_grad():  # sinks that matter (init gives ~0.02); float32 values, as gqakv takes sinks
            for layer in model.model.layers:
                sinks = layer.self_attn.sinks
                sinks.copy_((2 * torch.randn(sinks.shape, dtype=torch.float32)).to(dtype))
    return model


VARIANT_FAMILIES = {  # family -> the variants its tiny config exercises
    "mistral": "window on every layer",
    "qwen2": "full layer 0, sliding layer 1",
    "gemma2": "sliding/full alternation + softcap 0.5",
    "gemma3": "sliding/full alternation, query_pre_attn_scalar scaling",
    "gpt_oss": "sliding/full alternation + sinks",
}


@pytest.fixture
def float64_softmax(monkeypatch):
    """Eager attention's softmax stays in float64 for float64 scores (see the section comment)."""
    real = torch.nn.functional.softmax

    def softmax(x, dim=None, _stacklevel=3, dtype=None):
        if dtype == torch.float32 and x.dtype == torch.float64:
            dtype = torch.float64
        return real(x, dim=dim, dtype=dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax)


def _variant_generate(model, ids, mask, impl, n=8, cache=None, **extra):
    model.set_attn_implementation(impl)
    kwargs = {} if cache is None else {CACHE_KWARG: cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0, **kwargs, **extra)
    return out.sequences, torch.stack(out.logits)  # [B, W+n], [n, B, V]


def _spy_variants(monkeypatch):
    """Record the window/softcap/sinks of every gqa_attention call and let it run."""
    import gqakv

    seen = []
    real = gqakv.gqa_attention

    def spy(*a, **k):
        seen.append((k.get("window"), k.get("softcap"), k.get("sinks")))
        return real(*a, **k)

    monkeypatch.setattr(gqakv, "gqa_attention", spy)
    return seen


def _expected_variants(model):
    """Per layer, the (window, softcap, sinks) the model's config asks for."""
    text = model.config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None) or ["sliding_attention"] * text.num_hidden_layers
    out = []
    for i, t in enumerate(types):
        attn = model.model.layers[i].self_attn
        sinks = getattr(attn, "sinks", None)
        softcap = getattr(text, "attn_logit_softcapping", None) if type(text).__name__ == "Gemma2Config" else None
        out.append((WINDOW if t == "sliding_attention" else None, softcap,
                    None if sinks is None else tuple(sinks.tolist())))
    return out


@pytest.mark.parametrize("family", sorted(VARIANT_FAMILIES))
def test_variant_models_generate_as_eager_float64(family, float64_softmax, monkeypatch):
    """Greedy generate from 11-token prompts (window 5): gqakv's tokens equal eager's (plain and
    float64-softmax), logits within 1e-10 of float64 eager; each layer got its own variant."""
    model = _variant_model(family)
    ids = token_ids(batch=2, length=11, seed=21)
    mask = torch.ones_like(ids)
    want_seq, want_logits = _variant_generate(model, ids, mask, "eager")
    seen = _spy_variants(monkeypatch)
    cache = GqakvCache(model.config, max_cache_len=11 + 8)
    got_seq, got_logits = _variant_generate(model, ids, mask, "gqakv", cache=cache)
    assert torch.equal(got_seq, want_seq)
    assert (got_logits - want_logits).abs().max().item() <= F64_ATOL
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    assert seen[:layers] == _expected_variants(model) and len(seen) == 8 * layers
    # A sliding layer keeps the whole history: every layer holds prompt + 7 fed tokens, in buffers
    # of max_cache_len = 19 tokens per row (transformers' DynamicSlidingWindowLayer keeps W - 1).
    import gqakv

    text = model.config.get_text_config(decoder=True)
    d = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_layer = gqakv.KVCache.nbytes_for(2, text.num_key_value_heads, 11 + 8, d, "float64")
    assert all(kv.host_lens.tolist() == [11 + 7] * 2 and kv.nbytes == per_layer for kv in cache.kv_caches)
    monkeypatch.undo()  # plain eager (float32 softmax upcast) picks the same tokens
    plain_seq, _ = _variant_generate(model, ids, mask, "eager")
    assert torch.equal(got_seq, plain_seq)


@pytest.mark.parametrize("family", sorted(VARIANT_FAMILIES))
def test_variant_models_left_padded_and_chunked_as_eager_float64(family, float64_softmax):
    """Left-padded rows of 13, 2, 7 and 1 tokens (window 5), then the same prompts through
    prefill chunks of 4 (some all padding for the short rows): tokens equal eager's and logits
    agree to 1e-10 (eager's float64 softmax gives pad queries finite uniform weights, no NaN)."""
    model = _variant_model(family)
    ids, mask = _left_padded([13, 2, 7, 1], seed=22)
    want_seq, want_logits = _variant_generate(model, ids, mask, "eager")
    for extra in ({}, {"prefill_chunk_size": 4}):
        cache = GqakvCache(model.config, max_cache_len=13 + 8)
        got_seq, got_logits = _variant_generate(model, ids, mask, "gqakv", cache=cache, **extra)
        assert torch.equal(got_seq, want_seq), extra
        assert (got_logits - want_logits).abs().max().item() <= F64_ATOL, extra
        assert cache.kv_caches[-1].host_lens.tolist() == [13 + 7, 2 + 7, 7 + 7, 1 + 7]


@pytest.mark.parametrize("family", sorted(VARIANT_FAMILIES))
def test_variant_models_need_their_variant(family, float64_softmax, monkeypatch):
    """Control: gqakv attention with the variant keywords dropped (plain causal) misses eager's
    logits by far more than 1e-10, so the tests above really check windows, soft-caps and sinks."""
    import gqakv

    model = _variant_model(family)
    ids = token_ids(batch=2, length=11, seed=21)
    mask = torch.ones_like(ids)
    _, want_logits = _variant_generate(model, ids, mask, "eager", n=3)
    real = gqakv.gqa_attention
    monkeypatch.setattr(gqakv, "gqa_attention", lambda q, kv, n, **k: real(
        q, kv, n, scale=k["scale"], rows=k["rows"]))
    _, plain_logits = _variant_generate(model, ids, mask, "gqakv", n=3,
                                        cache=GqakvCache(model.config, max_cache_len=16))
    assert (plain_logits - want_logits).abs().max().item() > 1e-4


def test_float32_variant_model_error_is_that_of_eager_float32():
    """gpt-oss (windows + sinks) in float32: gqakv's error against the float64 model is at most 4x
    eager float32's + 1e-6, same tokens."""
    ids, mask = _left_padded([13, 2, 7, 1], seed=23)
    ref_seq, ref_logits = _variant_generate(_variant_model("gpt_oss"), ids, mask, "eager")
    model = _variant_model("gpt_oss", dtype=torch.float32)
    eager_seq, eager_logits = _variant_generate(model, ids, mask, "eager")
    got_seq, got_logits = _variant_generate(model, ids, mask, "gqakv", cache=GqakvCache(model.config, max_cache_len=21))
    assert torch.equal(got_seq, ref_seq) and torch.equal(eager_seq, ref_seq)
    err_gqakv = (got_logits.double() - ref_logits).abs().max().item()
    err_eager = (eager_logits.double() - ref_logits).abs().max().item()
    assert err_gqakv <= 4 * err_eager + 1e-6, (err_gqakv, err_eager)


def test_sliding_model_refuses_a_pad_after_a_real_token():
    """transformers counts a window in token slots, gqakv in real tokens: a gap would make them
    differ, so it is refused (naming the row) before anything is written."""
    model = _variant_model("mistral")
    model.set_attn_implementation("gqakv")
    ids = token_ids(batch=2, length=8, seed=24)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # right padding
    cache = GqakvCache(model.config, max_cache_len=16)
    with torch.no_grad(), pytest.raises(ValueError, match=r"row 1 has a pad after a real token \(slot 5\).*"
                                                           r"sliding_window=5.*left padding only"):
        model(ids, attention_mask=mask, use_cache=True, **{CACHE_KWARG: cache})
    assert all(kv is None or kv.host_lens.tolist() == [0, 0] for kv in cache.kv_caches)


def test_unsupported_layer_types_and_bidirectional_attention_are_refused():
    model = _variant_model("gemma3", use_bidirectional_attention=True)
    model.set_attn_implementation("gqakv")
    with torch.no_grad(), pytest.raises(NotImplementedError, match="is_causal=False"):
        model(token_ids(batch=1, length=4), use_cache=False)
    config = model.config
    config.layer_types = ["sliding_attention", "chunked_attention"]
    with pytest.raises(ValueError, match=r"layer types \['full_attention', 'sliding_attention'\], "
                                         r"the model also has \['chunked_attention'\]"):
        GqakvCache(config, max_cache_len=8)


def test_chunked_attention_layers_are_refused_without_a_cache_too():
    """A layer type gqakv does not compute is refused in the attention call itself: Llama 4's
    chunked_attention passes no window, so without a GqakvCache it would silently run as
    full causal attention (logits 0.26 off eager's at chunk 4 before this check)."""
    config_cls = getattr(transformers, "Llama4TextConfig", None)
    if config_cls is None:
        pytest.skip("the pinned transformers has no Llama 4")
    torch.manual_seed(0)
    config = config_cls(vocab_size=128, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        attention_chunk_size=4, num_local_experts=1, moe_layers=[], no_rope_layers=[1, 1],
                        interleave_moe_layer_step=0, max_position_embeddings=64)
    assert list(config.layer_types) == ["chunked_attention"] * 2
    model = transformers.Llama4ForCausalLM(config).eval()
    model.set_attn_implementation("gqakv")
    with torch.no_grad(), pytest.raises(NotImplementedError, match=r"layer 0 .* is 'chunked_attention'"):
        model(token_ids(batch=1, length=12), use_cache=False)


def test_sinks_updated_in_place_are_used(float64_softmax):
    """The sinks' host copy follows in-place updates of the parameter and replaced data."""
    model = _variant_model("gpt_oss")
    ids = token_ids(batch=2, length=9, seed=25)
    with torch.no_grad():
        for step in range(3):
            logits = {}
            for impl in ("eager", "gqakv"):
                model.set_attn_implementation(impl)
                logits[impl] = model(ids, use_cache=False).logits
            assert (logits["gqakv"] - logits["eager"]).abs().max().item() <= F64_ATOL
            if step == 0:
                before = logits["gqakv"]
                for layer in model.model.layers:
                    layer.self_attn.sinks.mul_(-2.0)  # float32 values stay float32 values
            elif step == 1:
                assert (logits["gqakv"] - before).abs().max().item() > 1e-4
                before = logits["gqakv"]
                for layer in model.model.layers:  # new data, not an in-place update
                    layer.self_attn.sinks.data = layer.self_attn.sinks.data * 0.5
    assert (logits["gqakv"] - before).abs().max().item() > 1e-4


def test_variant_model_beam_search_and_assisted_decoding(float64_softmax, monkeypatch):
    """gpt-oss (windows + sinks): beam search on a left-padded batch and assisted decoding (crops)
    give eager's beams/scores and greedy tokens/logits, with the sliding layers' history moved and
    truncated like the full layers'."""
    model = _variant_model("gpt_oss")
    ids, mask = _left_padded([9, 2, 6], seed=26)
    want_seq, want_scores = _beam_search(model, ids, mask, "eager", 3, 6)
    cache = GqakvCache(model.config, max_cache_len=9 + 6)
    got_seq, got_scores = _beam_search(model, ids, mask, "gqakv", 3, 6, cache=cache)
    assert torch.equal(got_seq, want_seq)
    assert (got_scores - want_scores).abs().max().item() <= F64_ATOL

    assistant = _perturbed_assistant(_variant_model("gpt_oss"), "eager", drafts=4)
    ids = token_ids(batch=1, length=8, seed=27)
    want_seq, want_logits = _variant_generate(model, ids, torch.ones_like(ids), "eager", n=10)
    from gqakv.integrations.transformers import GqakvLayer

    crops = []
    _spy(monkeypatch, GqakvLayer, "crop", crops)
    got_seq, got_logits = _variant_generate(model, ids, torch.ones_like(ids), "gqakv", n=10,
                                            cache=GqakvCache(model.config, max_cache_len=8 + 10 + 4),
                                            assistant_model=assistant)
    assert torch.equal(got_seq, want_seq)
    assert (got_logits - want_logits).abs().max().item() <= F64_ATOL
    assert max(-a[0] for _, a in crops) > 1  # drafts of several tokens were rejected and cropped


def test_larger_batch_after_reset_names_max_batch_size():
    """After reset() the rows are empty but as many as the first batch: a larger batch is
    refused, and the error says how to allow it (max_batch_size=), not to reset again."""
    model = tiny_llama(torch.float32)
    model.set_attn_implementation("gqakv")
    cache = GqakvCache(model.config, max_cache_len=16)
    with torch.no_grad():
        model(token_ids(batch=2, length=4, seed=1), use_cache=True, **{CACHE_KWARG: cache})
        cache.reset()
        with pytest.raises(ValueError) as err:
            model(token_ids(batch=3, length=4, seed=2), use_cache=True, **{CACHE_KWARG: cache})
    assert "allocated 2 rows" in str(err.value) and "max_batch_size=3" in str(err.value)
    assert "call cache.reset()" not in str(err.value)
    with torch.no_grad():  # a smaller batch still fits the rows after reset
        model(token_ids(batch=1, length=4, seed=3), use_cache=True, **{CACHE_KWARG: cache})
    assert cache.kv_caches[0].host_lens.tolist()[:1] == [4]
