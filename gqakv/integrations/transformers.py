"""Hugging Face transformers integration: gqakv does the attention and the KV caching.

    from gqakv.integrations.transformers import CACHE_KWARG, GqakvCache, register
    register()                                   # adds "gqakv" to transformers' registries
    model.set_attn_implementation("gqakv")       # any model whose attention uses the registry
    tokenizer.padding_side = "left"              # batches of prompts of different lengths
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    cache = GqakvCache(model.config, max_cache_len=256)   # real tokens per row: prompt + new
    out = model.generate(**batch, max_new_tokens=32, do_sample=False, **{CACHE_KWARG: cache})

- ``register()`` adds ``gqakv_attention`` to ``transformers.AttentionInterface`` and
  ``gqakv_mask`` to ``AttentionMaskInterface`` under the name ``"gqakv"``. No mask
  tensor is ever built: gqakv masks bottom-right causal from each row's cache length.
- Padding: the 2D ``attention_mask`` (1 = real token) becomes a ``Padding``, computed
  once per forward: per row, how many of the call's T slots are real (``n_new``) and
  a permutation putting them first. Each layer packs its T new keys/values/queries
  (a copy of the T new slots only, never of the cache), appends just the real tokens
  in place (pads are never written), attends, and unpacks the output to the slots
  (pad slots get 0; transformers ignores them). So each gqakv row holds exactly its
  real tokens, and query t of a row sits at that row's own length, which is also the
  position transformers' ``generate`` gives it (``attention_mask.cumsum(-1) - 1``).
  Left padding is what ``generate`` expects; pads anywhere (right padding, gaps) work
  in ``model(...)`` calls too. For calls after the first, pass the 2D mask of all
  slots seen so far plus this call's (as ``generate`` does); a mask that disagrees
  with what the cache holds is refused, naming the row.
- ``GqakvCache`` is a ``transformers.Cache`` whose layers each hold one
  ``gqakv.KVCache`` on the torch backend, allocated once (on the first forward, on
  the keys' device and dtype) for ``max_cache_len`` real tokens per row and written in
  place. ``update`` hands the new chunk to ``gqakv_attention``, which writes it (it
  knows the padding); query head h reads KV head h // G, K/V are never repeated.
  ``get_seq_length()`` counts token slots including pads, as transformers' caches do;
  ``kv_caches[i].host_lens`` gives the real tokens of each row.
- Without a cache (``use_cache=False``), ``gqakv_attention`` attends through a
  temporary cache that holds just that call's real keys and values.
- Refused, with the reason: beam search, assisted/speculative decoding (cache
  reorder/crop), explicit 4D masks, attention dropout, non-full-attention layers,
  and a GqakvCache used with another attention implementation.

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

# Attribute set on the key tensor returned by GqakvLayer.update: the layer that will write it.
_HANDLE = "_gqakv_layer"


class Padding:
    """Which of a call's T token slots are real, per row, from transformers' 2D attention mask.

    Made once per forward by ``gqakv_mask`` and handed to every layer's attention call
    as its ``attention_mask``. gqakv rows hold only real tokens, packed at the front, so a
    chunk is *packed* before it reaches gqakv (its real slots first, in order; this
    copies only the T new slots, never the cache) and gqakv's output is *unpacked* back
    to the slots afterwards (pad slots get 0).

    Attributes:
        n_new: ``[B]`` host ints, real tokens among this call's T slots.
        n_past: ``[B]`` host ints, real tokens among the earlier slots (what each
            gqakv row must already hold).
        order: ``[B, T]`` int64 slot indices, real slots first (stable), or None when
            every slot of this call is real.
        inverse: ``[B, T]`` the inverse permutation of ``order`` (or None).
    """

    def __init__(self, n_new, n_past, order, inverse):
        self.n_new, self.n_past, self.order, self.inverse = n_new, n_past, order, inverse

    @classmethod
    def from_mask(cls, mask: torch.Tensor, q_offset: int, q_length: int) -> "Padding | None":
        """``mask``: ``[B, q_offset + T]`` (1 = real token) over every slot seen so far and this
        call's ``T = q_length`` slots. Returns None when there is no padding at all."""
        B, width = (int(s) for s in mask.shape)
        if width != q_offset + q_length:
            raise ValueError(
                f"attention_mask has {width} columns; with gqakv it must have one per token slot seen so far "
                f"plus one per token of this call: {q_offset} + {q_length} = {q_offset + q_length}")
        mask = mask.to(torch.bool)
        if bool(mask.all()):
            return None
        chunk = mask[:, q_offset:]
        counts = torch.stack([chunk.sum(1), mask[:, :q_offset].sum(1)]).tolist()  # one host sync
        n_new, n_past = counts
        order = inverse = None
        if any(n != q_length for n in n_new):
            # Stable sort on "is pad" puts each row's real slots first, in their order.
            order = torch.argsort((~chunk).to(torch.uint8), dim=1, stable=True)
            inverse = torch.argsort(order, dim=1)
        return cls(n_new, n_past, order, inverse)

    @staticmethod
    def _take(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        """``x[b, h, index[b, t], :]`` for ``x`` ``[B, H, T, d]`` (a copy of the T slots only)."""
        if index is None:
            return x
        B, H, T, d = x.shape
        return torch.gather(x, 2, index[:, None, :, None].expand(B, H, T, d))

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, T, d]`` slots -> the same with each row's real slots first."""
        return self._take(x, self.order)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of ``pack``; gqakv's zeros past ``n_new`` land on the pad slots."""
        return self._take(x, self.inverse)

    def check_rows(self, B: int, T: int, past) -> None:
        """The mask must describe this call (B rows, T slots) and the tokens each row holds (``past``)."""
        if len(self.n_new) != B or (self.order is not None and self.order.shape[1] != T):
            raise ValueError(f"attention_mask describes {len(self.n_new)} rows of this call, "
                             f"the keys have {B} rows of {T} tokens")
        wrong = [b for b in range(B) if int(past[b]) != self.n_past[b]]
        if wrong:
            b = wrong[0]
            raise ValueError(
                f"attention_mask does not match the gqakv cache: row {b} has {self.n_past[b]} real earlier "
                f"tokens in the mask but the cache holds {int(past[b])} (pass the same 2D mask, extended by "
                f"this call's columns, that was used for the earlier calls)")


class GqakvLayer(CacheLayerMixin):
    """One decoder layer's cache: a ``gqakv.KVCache`` ``[B, Hkv, max_cache_len, d]``.

    ``update`` only hands the new chunk to ``gqakv_attention`` (which knows the padding
    from the mask); ``write`` then appends its real tokens in place. ``get_seq_length``
    counts token *slots* seen (pads included), as transformers' own caches do, so
    transformers' positions and mask widths stay what they would be with its caches;
    ``kv.host_lens`` counts the real tokens each row holds.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, max_cache_len: int, batch_size: int | None = None):
        super().__init__()
        self.max_cache_len = int(max_cache_len)
        self.batch_size = batch_size
        self.kv: gqakv.KVCache | None = None
        self.seen = 0  # token slots seen by this layer, padding included
        self._unwritten = False  # update handed out a chunk that write has not taken yet

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
        """Take this call's keys/values ``[B, Hkv, T, d]`` and return them, tagged for
        ``gqakv_attention``, which writes their real tokens (``write``) and attends."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._unwritten:
            raise RuntimeError(
                "GqakvCache: the previous call's keys were never written; the cache works only with "
                "model.set_attn_implementation('gqakv') (after gqakv.integrations.transformers.register()). "
                "Call cache.reset() to start over")
        self._unwritten = True
        setattr(key_states, _HANDLE, self)
        return key_states, value_states

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, padding: Padding | None):
        """Append the real tokens of ``[B, Hkv, T, d]`` keys/values in place at each row's length.

        Returns ``(kv, n_new)`` for ``gqakv.gqa_attention``. On error nothing is written.
        """
        self._unwritten = False
        B, _, T, _ = (int(s) for s in key_states.shape)
        lens = self.kv.host_lens
        if padding is None:
            if (lens != self.seen).any():
                raise ValueError(
                    f"the gqakv cache rows hold {lens.tolist()} real tokens after earlier padded calls, but "
                    f"this call's attention_mask is missing or all ones, which says every row holds all "
                    f"{self.seen} earlier slots; pass the 2D attention_mask of the earlier calls extended by "
                    f"this call's {T} columns")
            n_new = [T] * B
        else:
            padding.check_rows(B, T, lens)
            key_states, value_states = padding.pack(key_states), padding.pack(value_states)
            n_new = padding.n_new
        self.kv.append(key_states, value_states, n_new)
        self.seen += T
        return self.kv, n_new

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def reset(self) -> None:
        """Forget every token (lengths to 0); the buffers stay allocated."""
        self.seen = 0
        self._unwritten = False
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
        max_cache_len: capacity per row in real tokens (prompt without its padding + new tokens).
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
    """transformers attention function: query ``[B, Hq, T, d]``, key/value ``[B, Hkv, T, d]``
    (this call's tokens), ``attention_mask`` a ``Padding`` from ``gqakv_mask`` or None.

    Returns ``(out [B, T, Hq, d], None)``, 0 at pad slots. With a GqakvCache the real
    tokens are appended to the cache and gqakv attends over it; otherwise over a
    temporary cache holding just this call's real tokens.
    """
    if dropout:
        raise NotImplementedError("gqakv attention is inference-only (attention dropout must be 0; call model.eval())")
    if attention_mask is not None and not isinstance(attention_mask, Padding):
        raise ValueError("gqakv attention computes its own causal mask; got an explicit attention mask "
                         f"({type(attention_mask).__name__}; pass a 2D padding mask [batch, tokens], and set the "
                         "model's attn_implementation to 'gqakv' after gqakv...register())")
    padding = attention_mask
    layer = getattr(key, _HANDLE, None)
    if layer is not None:
        kv, n_new = layer.write(key, value, padding)
    else:
        B, hkv, S, d = key.shape
        if query.shape[2] != S:
            raise ValueError(f"without a cache, queries ({query.shape[2]}) and keys ({S}) must cover the same tokens")
        kv = gqakv.KVCache(int(B), int(hkv), int(S), int(d), dtype=key.dtype,
                           backend=TorchBackend(device=key.device))
        if padding is None:
            n_new = [int(S)] * int(B)
        else:
            padding.check_rows(int(B), int(S), [0] * int(B))
            key, value, n_new = padding.pack(key), padding.pack(value), padding.n_new
        kv.append(key, value, n_new)
    if query.dtype != kv.k.dtype:  # e.g. autocast: gqakv never casts silently, so do it here explicitly
        query = query.to(kv.k.dtype)
    if padding is not None:
        query = padding.pack(query)
    out = gqakv.gqa_attention(query, kv, n_new, scale=scaling)  # [B, Hq, T, d], real slots first
    if padding is not None:
        out = padding.unpack(out)
    return out.transpose(1, 2), None


def gqakv_mask(*, attention_mask=None, q_offset=0, q_length=None, **kwargs):
    """transformers mask function: no mask tensor is built; a 2D padding mask becomes a
    ``Padding`` (real slots per row), or None when nothing is padded."""
    if attention_mask is None:
        return None
    if attention_mask.ndim != 2:
        raise ValueError(f"gqakv takes a 2D padding mask [batch, tokens], got shape {list(attention_mask.shape)}")
    return Padding.from_mask(attention_mask, int(q_offset), int(q_length))


def register() -> None:
    """Add ``"gqakv"`` to transformers' attention and mask registries (idempotent)."""
    AttentionInterface.register(NAME, gqakv_attention)
    AttentionMaskInterface.register(NAME, gqakv_mask)
