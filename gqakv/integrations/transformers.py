"""Hugging Face transformers integration: gqakv does the attention and the KV caching.

    from gqakv.integrations.transformers import GqakvCache, register
    register()                                   # adds "gqakv" to transformers' registries
    model.set_attn_implementation("gqakv")       # any model whose attention uses the registry
    cache = GqakvCache(model.config, batch_size=1, max_cache_len=256)
    out = model.generate(input_ids, cache=cache, max_new_tokens=32, do_sample=False)
    # transformers 5.23: past_key_values=cache (or **{CACHE_KWARG: cache} for both)

- ``register()`` adds ``gqakv_attention`` to ``transformers.AttentionInterface`` and a
  mask function to ``AttentionMaskInterface`` under the name ``"gqakv"``. gqakv applies
  the causal mask itself (bottom-right, from each row's cache length), so no 4D mask
  is ever built; a padding mask with zeros is refused with an explanation (gqakv rows
  are ragged at the end, not left-padded).
- ``GqakvCache`` is a ``transformers.Cache`` whose layers each hold one
  ``gqakv.KVCache`` on the torch backend, allocated once (on the first update, on the
  keys' device and dtype) for ``max_cache_len`` tokens and written in place;
  ``update`` returns views of the live part of the buffers, tagged so that
  ``gqakv_attention`` reads the cache directly (query head h reads KV head h // G; K/V
  are never repeated).
- Without a cache (``use_cache=False``), ``gqakv_attention`` attends through a
  temporary cache that holds just that call's keys and values.

Supported transformers versions: see ``SUPPORTED_TRANSFORMERS`` (the ``gqakv[transformers]``
extra pins the same range; install torch for your hardware alongside it). The cache keyword of ``forward``/``generate`` is ``cache``
(``past_key_values`` is its deprecated alias in these versions).
"""

from __future__ import annotations

try:
    import torch
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as exc:  # say what to install instead of a bare module name
    raise ImportError(
        f"gqakv.integrations.transformers needs torch and transformers>=5.23,<5.25 ({exc}); "
        "pip install 'gqakv[transformers]' plus torch (e.g. pip install torch==2.13.0)") from exc

import gqakv
from gqakv_backends.torch_backend import TorchBackend

NAME = "gqakv"
SUPPORTED_TRANSFORMERS = ">=5.23,<5.25"

# The keyword ``forward``/``generate`` take the cache under: ``cache`` from transformers
# 5.24 (``past_key_values`` still accepted there, with a deprecation warning), and
# ``past_key_values`` before. ``model.generate(ids, **{CACHE_KWARG: cache})`` works on both.
def _cache_kwarg() -> str:
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "cache" if (major, minor) >= (5, 24) else "past_key_values"


CACHE_KWARG = _cache_kwarg()

# Attribute set on the K view returned by GqakvLayer.update: (KVCache, n_new).
_HANDLE = "_gqakv_handle"


class GqakvLayer(CacheLayerMixin):
    """One decoder layer's cache: a ``gqakv.KVCache`` ``[B, Hkv, max_cache_len, d]``."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, max_cache_len: int, batch_size: int | None = None):
        super().__init__()
        self.max_cache_len = int(max_cache_len)
        self.batch_size = batch_size
        self.kv: gqakv.KVCache | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, hkv, _, d = key_states.shape
        if self.batch_size is not None and B != self.batch_size:
            raise ValueError(f"GqakvCache was made for batch_size={self.batch_size}, got a batch of {B}")
        self.batch_size = int(B)
        self.device = key_states.device
        self.kv = gqakv.KVCache(int(B), int(hkv), self.max_cache_len, int(d), dtype=key_states.dtype,
                                backend=TorchBackend(device=key_states.device))
        self.keys, self.values = self.kv.k, self.kv.v
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new ``[B, Hkv, T, d]`` keys/values in place at every row's length.

        Returns views ``[B, Hkv, L, d]`` of the live part of the buffers (L = longest row).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, _, T, _ = key_states.shape
        n_new = [int(T)] * int(B)
        self.kv.append(key_states, value_states, n_new)
        live = int(self.kv.host_lens.max(initial=0))
        k_live, v_live = self.kv.k[:, :, :live, :], self.kv.v[:, :, :live, :]
        setattr(k_live, _HANDLE, (self.kv, n_new))
        return k_live, v_live

    def get_seq_length(self) -> int:
        return int(self.kv.host_lens.max(initial=0)) if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def reset(self) -> None:
        """Forget every token (lengths to 0); the buffers stay allocated."""
        if self.is_initialized:
            self.kv.reset()

    def _unsupported(self, what: str):
        raise NotImplementedError(
            f"GqakvCache does not support {what}: gqakv's rows are fixed, preallocated slots "
            "(use greedy or sampling generation with one row per sequence)")

    def reorder_cache(self, beam_idx) -> None:
        self._unsupported("beam search (reorder_cache)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("batch_repeat_interleave (num_return_sequences > 1 or beams)")

    def batch_select_indices(self, indices) -> None:
        self._unsupported("batch_select_indices")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("crop (assisted / speculative decoding)")


class GqakvCache(Cache):
    """A transformers Cache backed by gqakv's preallocated, in-place KV caches (one per layer).

    Args:
        config: the model's config (its decoder text config is used for the layer count).
        max_cache_len: capacity per row in tokens (prompt + new tokens).
        batch_size: optional; checked against the first batch seen.
    """

    def __init__(self, config, max_cache_len: int, batch_size: int | None = None):
        text = config.get_text_config(decoder=True)
        types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        if any(t != "full_attention" for t in types):
            raise ValueError(f"GqakvCache supports full-attention layers only, the model has {sorted(set(types))}")
        super().__init__(layers=[GqakvLayer(max_cache_len, batch_size) for _ in types])
        self.max_cache_len = int(max_cache_len)

    @property
    def kv_caches(self) -> list[gqakv.KVCache | None]:
        """The gqakv.KVCache of each layer (None until the first forward)."""
        return [layer.kv for layer in self.layers]


def gqakv_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers attention function: query ``[B, Hq, T, d]``, key/value ``[B, Hkv, S, d]``.

    Returns ``(out [B, T, Hq, d], None)``. With a GqakvCache, key/value are the cache's
    live views and gqakv reads the cache directly; otherwise they are this call's
    keys/values and gqakv attends through a temporary cache of exactly that size.
    """
    if dropout:
        raise NotImplementedError("gqakv attention is inference-only (attention dropout must be 0; call model.eval())")
    if attention_mask is not None:
        raise ValueError("gqakv attention computes its own causal mask; got an explicit attention mask "
                         "(set the model's attn_implementation to 'gqakv' after gqakv...register())")
    handle = getattr(key, _HANDLE, None)
    if handle is not None:
        kv, n_new = handle
    else:
        B, hkv, S, d = key.shape
        kv = gqakv.KVCache(int(B), int(hkv), int(S), int(d), dtype=key.dtype,
                           backend=TorchBackend(device=key.device))
        n_new = [int(S)] * int(B)
        kv.append(key, value, n_new)
        if query.shape[2] != S:
            raise ValueError(f"without a cache, queries ({query.shape[2]}) and keys ({S}) must cover the same tokens")
    if query.dtype != kv.k.dtype:  # e.g. autocast: gqakv never casts silently, so do it here explicitly
        query = query.to(kv.k.dtype)
    out = gqakv.gqa_attention(query, kv, n_new, scale=scaling)
    return out.transpose(1, 2), None


def gqakv_mask(*, attention_mask=None, **kwargs):
    """transformers mask function: gqakv needs no mask tensor; refuses real padding."""
    if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
        raise ValueError(
            "gqakv attention does not take padding masks: the attention_mask has zeros (padded rows). "
            "gqakv masks by each row's cache length (bottom-right causal); generate rows of different "
            "lengths one at a time, or use gqakv's ragged API (KVCache.append with n_new) directly")
    return None


def register() -> None:
    """Add ``"gqakv"`` to transformers' attention and mask registries (idempotent)."""
    AttentionInterface.register(NAME, gqakv_attention)
    AttentionMaskInterface.register(NAME, gqakv_mask)
