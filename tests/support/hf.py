"""A tiny randomly initialized GQA Llama (transformers) and greedy generation through it,
for the tests of the transformers integration. Needs torch and transformers: import this
after ``pytest.importorskip`` of both. Importing it registers gqakv's attention with
transformers (``gqakv.integrations.transformers.register``, idempotent)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gqakv.integrations.transformers import CACHE_KWARG, register

register()


def tiny_llama(dtype=torch.float32, seed=0, layers=2):
    """A seeded LlamaForCausalLM: vocabulary 101, hidden 64, 8 query heads over 2 KV heads
    (head_dim 8), ``layers`` layers, in eval mode."""
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def token_ids(batch=2, length=11, seed=1):
    """Seeded prompt ids [batch, length] (no pad, BOS or EOS ids)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 101, (batch, length), generator=g)


def greedy_generate(model, ids, impl, n=10, cache=None):
    """``n`` greedy tokens with attention ``impl`` (and the cache ``cache`` if given):
    (sequences [B, S+n], logits [n, B, V])."""
    model.set_attn_implementation(impl)
    kwargs = {} if cache is None else {CACHE_KWARG: cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, eos_token_id=None, **kwargs)
    return out.sequences, torch.stack(out.logits)  # [B, S+n], [n, B, V]
