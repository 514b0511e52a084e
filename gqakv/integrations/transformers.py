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
  ``kv_caches[i].host_lens`` gives the real tokens of each row. ``kv_dtype="int8"`` or
  ``"float8_e4m3fn"`` stores every layer's K/V quantized (``gqakv.storage.quantize``: 8-bit
  codes and a float32 scale per token and KV head); queries and outputs keep the
  model's dtype. The layer's ``keys``/``values`` are then the code buffers.
- Without a cache (``use_cache=False``), ``gqakv_attention`` attends through a
  temporary cache that holds just that call's real keys and values.
- Beam search (``num_beams > 1``), assisted decoding (``assistant_model=``) and
  transformers' batch hooks work through gqakv's row operations on the buffers
  allocated at the first forward, never by making new tensors: ``reorder_cache`` is
  ``KVCache.reorder`` (copies only live tokens), ``crop`` is ``KVCache.truncate``
  (O(1)), ``batch_repeat_interleave``/``batch_select_indices`` are reorders within the
  ``max_batch_size`` rows allocated. Per call the layer records which slots were real,
  so each row loses only its own real tokens when slots are cropped.
  ``generate`` expands the prompts for beams before the first forward, so the cache is
  simply allocated with ``batch x num_beams`` rows.
- Attention variants, taken from the keywords a model's attention layer passes to the
  attention function: ``sliding_window=W`` (Mistral, Qwen2 with ``use_sliding_window``,
  the ``"sliding_attention"`` layers of Gemma 2/3 and gpt-oss) becomes gqakv's
  ``window=W`` (the query at position p sees keys p-W+1..p, transformers' convention),
  ``softcap=c`` (Gemma 2's ``attn_logit_softcapping``) becomes ``softcap=c``, and
  ``s_aux`` (gpt-oss's learned per-head sink logits ``[Hq]``) becomes ``sinks=``
  (as float32 values, read to the host once per weight update).
  ``scaling`` is the model's own (e.g. Gemma's ``query_pre_attn_scalar ** -0.5``).
  Memory: by default a sliding layer's GqakvLayer keeps the whole history
  (``max_cache_len`` real tokens per row, like a full layer); the window limits what
  attention *reads* (min(L, W) keys per query), not what is stored. A model of F full
  and S sliding layers thus holds ``(F + S) * rows * max_cache_len * Hkv * d * 2 *
  itemsize`` bytes, where transformers' own DynamicCache keeps about ``W`` tokens in a
  sliding layer. ``GqakvCache(..., window_storage=True)`` gives each sliding layer
  window-sized storage instead: a ``gqakv.PagedKVCache(window=W)`` whose pool holds
  ``rows x window_pages(W, max_cache_len, 16, max_chunk)`` pages (``max_chunk``: the most
  real tokens one forward appends, default the first forward's), the pages behind the
  window released as rows grow; outputs are bit for bit the same. Cropping (assisted
  decoding) works within the last forward's tokens; a crop into released history, or a
  later forward longer than ``max_chunk`` that the pool cannot serve, is refused with the
  numbers (ValueError / ``gqakv.OutOfPages``).
  Sliding windows count positions (real tokens); transformers counts token slots, which
  is the same for left padding but not for pads between real tokens, so such a mask is
  refused for a model with sliding layers.
- Refused, with the reason: explicit 4D masks, attention dropout, layer types other
  than ``"full_attention"``/``"sliding_attention"``, bidirectional attention
  (``is_causal=False``), a GqakvCache used with another attention implementation (or
  gqakv attention with another cache), a batch that outgrows the rows allocated.

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

import numpy as np

import gqakv

NAME = "gqakv"


def _torch_backend(device):
    """gqakv's torch backend bound to ``device`` (through the registry, as any backend)."""
    return gqakv.get_backend("torch").for_device(device)


SUPPORTED_TRANSFORMERS = ">=5.23,<5.25"



# The keyword ``forward``/``generate`` take the cache under: ``cache`` from transformers
# 5.24 (``past_key_values`` still accepted there, with a deprecation warning), and
# ``past_key_values`` before. ``model.generate(ids, **{CACHE_KWARG: cache})`` works on both.
# A version without a leading "major.minor" (the docs build's mocked transformers) counts as
# the newest supported.
def _cache_kwarg() -> str:
    import re

    import transformers

    m = re.match(r"(\d+)\.(\d+)", str(getattr(transformers, "__version__", "")))
    if m is None:
        return "cache"
    return "cache" if (int(m.group(1)), int(m.group(2))) >= (5, 24) else "past_key_values"


CACHE_KWARG = _cache_kwarg()

# The transformers layer types gqakv runs: a sliding layer is a full one attending with
# gqakv's window= (its cache keeps the whole history, see the module docstring).
LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

# Attribute set on the key tensor returned by GqakvLayer.update: the layer that will write it.
_HANDLE = "_gqakv_layer"

# Appended to the errors a reused cache runs into: a second ``generate`` with the same
# GqakvCache starts a new sequence on top of the tokens the first one left in it.
REUSE_HINT = ("If this GqakvCache already served a generate() call, call cache.reset() before the next one: "
              "one GqakvCache holds one generation's tokens until it is reset")


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
        real: ``[B, T]`` host bools, which of this call's slots are real (what ``crop``
            needs to know how many real tokens each row loses with the last slots).
    """

    def __init__(self, n_new, n_past, order, inverse, real=None):
        self.n_new, self.n_past, self.order, self.inverse = n_new, n_past, order, inverse
        self.real = real

    @classmethod
    def from_mask(cls, mask: torch.Tensor, q_offset: int, q_length: int) -> "Padding | None":
        """``mask``: ``[B, q_offset + T]`` (1 = real token) over every slot seen so far and this
        call's ``T = q_length`` slots. Returns None when there is no padding at all."""
        B, width = (int(s) for s in mask.shape)
        if width != q_offset + q_length:
            raise ValueError(
                f"attention_mask has {width} columns; with gqakv it must have one per token slot seen so far "
                f"plus one per token of this call: {q_offset} + {q_length} = {q_offset + q_length}. {REUSE_HINT}")
        host = mask.to(device="cpu", dtype=torch.bool).numpy()  # one device sync for all the counts
        if host.all():
            return None
        real = host[:, q_offset:].copy()  # [B, T] real slots of this call, kept for crop (host may alias the mask)
        n_new, n_past = real.sum(1).tolist(), host[:, :q_offset].sum(1).tolist()
        order = inverse = None
        if any(n != q_length for n in n_new):
            # Stable sort on "is pad" puts each row's real slots first, in their order.
            chunk = mask[:, q_offset:].to(torch.bool)
            order = torch.argsort((~chunk).to(torch.uint8), dim=1, stable=True)
            inverse = torch.argsort(order, dim=1)
        return cls(n_new, n_past, order, inverse, real)

    def check_left_padded(self, mask: torch.Tensor, window: int) -> None:
        """For sliding-window layers: every row's pads come before its first real token.
        transformers' window spans ``window`` token slots and gqakv's ``window`` positions
        (real tokens); they agree exactly when no pad follows a real token."""
        host = mask.to(device="cpu", dtype=torch.bool).numpy()
        gap = (np.cumsum(host, axis=1) > 0) & ~host  # a pad after the row's first real token
        rows = np.flatnonzero(gap.any(axis=1))
        if rows.size:
            b = int(rows[0])
            raise ValueError(
                f"attention_mask row {b} has a pad after a real token (slot {int(np.argmax(gap[b]))}); with "
                f"sliding-window layers (sliding_window={window}) gqakv takes left padding only: transformers "
                "counts the window in token slots, pads included, gqakv in real tokens")

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
                f"this call's columns, that was used for the earlier calls). {REUSE_HINT}")


class GqakvLayer(CacheLayerMixin):
    """One decoder layer's cache: a ``gqakv.KVCache`` ``[R, Hkv, max_cache_len, d]``.

    ``update`` only hands the new chunk to ``gqakv_attention`` (which knows the padding
    from the mask); ``write`` then appends its real tokens in place. ``get_seq_length``
    counts token *slots* seen (pads included), as transformers' own caches do, so
    transformers' positions and mask widths stay what they would be with its caches;
    ``kv.host_lens`` counts the real tokens each row holds.

    The batch transformers sees (``batch_size``, B) uses cache rows ``0..B-1`` of the
    ``R = max_batch_size`` rows allocated (default R = the first batch). The batch hooks
    are row operations on those buffers, never new tensors: ``reorder_cache`` (beam
    search) is ``KVCache.reorder``, ``batch_repeat_interleave`` and
    ``batch_select_indices`` are reorders over the first rows (then B changes, within R),
    and ``crop`` is ``KVCache.truncate``. Each acts on the real tokens of each row: the
    layer keeps, per call, which slots were real (``_calls``), so cropping slots takes
    from each row only the real tokens among them.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, max_cache_len: int, batch_size: int | None = None, max_batch_size: int | None = None,
                 kv_dtype=None, window: int | None = None, max_chunk: int | None = None):
        super().__init__()
        self.max_cache_len = int(max_cache_len)
        self.kv_dtype = kv_dtype  # None, "int8" or "float8_e4m3fn" (validated by GqakvCache)
        # window-sized storage: the sliding window W of this layer (None: keep every token), and
        # the most real tokens one forward appends (None: the first forward's)
        self.window, self.max_chunk = window, max_chunk
        self.batch_size = batch_size
        self.max_batch_size = max_batch_size
        self.kv: gqakv.KVCache = None  # type: ignore[assignment]  # made at the first forward
        self.seen = 0  # token slots seen by this layer, padding included
        # Per call, in order: T (every slot real in every row) or a host bool [B, T] of real slots.
        self._calls: list = []
        self._unwritten = False  # update handed out a chunk that write has not taken yet

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, hkv, _, d = key_states.shape
        if self.batch_size is not None and B != self.batch_size:
            raise ValueError(f"GqakvCache was made for batch_size={self.batch_size}, got a batch of {B} "
                             "(with num_beams=N, generate runs N rows per prompt)")
        rows = int(B) if self.max_batch_size is None else int(self.max_batch_size)
        if rows < B:
            raise ValueError(f"GqakvCache was made for max_batch_size={rows} rows, got a batch of {B}")
        self.batch_size = int(B)
        self.device = key_states.device
        backend = _torch_backend(key_states.device)
        if self.window is None:
            self.kv = gqakv.KVCache(rows, int(hkv), self.max_cache_len, int(d), dtype=key_states.dtype,
                                    backend=backend, kv_dtype=self.kv_dtype)
        else:  # window-sized: a pool for rows appending at most max_chunk tokens per forward
            from gqakv.storage.paged import DEFAULT_PAGE_SIZE
            from gqakv.storage.sizing import window_pages

            chunk = int(key_states.shape[2]) if self.max_chunk is None else self.max_chunk
            pages = rows * window_pages(self.window, self.max_cache_len, DEFAULT_PAGE_SIZE,
                                        min(max(1, chunk), self.max_cache_len))
            self.kv = gqakv.PagedKVCache(rows, int(hkv), self.max_cache_len, int(d), dtype=key_states.dtype,
                                         backend=backend, kv_dtype=self.kv_dtype, window=self.window,
                                         num_pages=pages)
        self.keys, self.values = self.kv.k, self.kv.v
        self.is_initialized = True

    @property
    def rows(self):
        """The cache rows of the batch entries, ``[B]`` host ints, or None when they are all rows."""
        return None if self.batch_size == self.kv.batch else np.arange(self.batch_size)

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
        B = int(key_states.shape[0])
        if B != self.batch_size:
            if B > self.kv.batch:  # the buffers were allocated at the first forward: they cannot grow
                raise ValueError(
                    f"GqakvCache allocated {self.kv.batch} rows at its first forward, got keys for {B} rows: "
                    f"make the cache with max_batch_size={B} or more (GqakvCache(config, max_cache_len, "
                    f"max_batch_size={B})); reset() empties the rows but keeps their number")
            if self.seen:
                raise ValueError(
                    f"GqakvCache holds a batch of {self.batch_size} rows ({self.kv.batch} allocated, {self.seen} token "
                    f"slots seen), got keys "
                    f"for {B} rows; a new batch size needs an empty cache: call cache.reset() first")
            self.batch_size = B  # an empty cache takes any batch that fits its rows
        self._unwritten = True
        setattr(key_states, _HANDLE, self)
        return key_states, value_states

    def check_window(self, sliding_window) -> None:
        """A layer in window-sized storage attends with its own window (a full-attention call,
        or another window, would need keys the storage let go)."""
        if self.window is not None and sliding_window != self.window:
            self._unwritten = False  # refused before anything is written
            raise ValueError(f"this GqakvCache layer keeps window-sized storage for sliding_window="
                             f"{self.window}, but the model's attention passed sliding_window="
                             f"{sliding_window!r} (make the cache with window_storage=False)")

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, padding: Padding | None):
        """Append the real tokens of ``[B, Hkv, T, d]`` keys/values in place at each row's length.

        Returns ``(kv, n_new, rows)`` for ``gqakv.gqa_attention``. On error nothing is written.
        """
        self._unwritten = False
        B, _, T, _ = (int(s) for s in key_states.shape)
        lens = self.kv.host_lens[:B]
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
        rows = self.rows
        self.kv.append(key_states, value_states, n_new, rows=rows)
        self.seen += T
        self._calls.append(T if padding is None else padding.real)
        return self.kv, n_new, rows

    def check_positions(self, position_ids) -> None:
        """Unpadded calls on a non-empty cache must continue at its length: a new prompt
        (positions from 0) on a cache that still holds an earlier generation is refused."""
        if self.seen == 0 or not torch.is_tensor(position_ids) or position_ids.ndim != 2:
            return
        if bool((position_ids[:, 0] != self.seen).any()):  # one host sync per forward (layer 0 only)
            first = sorted(set(position_ids[:, 0].tolist()))
            self._unwritten = False  # refused before anything is written
            raise ValueError(
                f"this call's tokens start at position {first[0] if len(first) == 1 else first}, but the gqakv "
                f"cache already holds {self.seen} tokens per row, so they would be appended after them. "
                f"{REUSE_HINT}")

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        """The real tokens each row can hold: ``max_cache_len``."""
        return self.max_cache_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def reset(self) -> None:
        """Forget every token (lengths to 0); the buffers stay allocated."""
        self.seen = 0
        self._calls = []
        self._unwritten = False
        if self.is_initialized:
            self.kv.reset()

    # -- batch operations: gqakv row operations on the preallocated buffers ----------------------

    def _host_rows(self, index, what: str) -> np.ndarray:
        """A transformers batch index (int tensor, bool mask or list) as host int64 rows."""
        index = torch.as_tensor(index)
        if index.dtype == torch.bool:
            if index.shape != (self.batch_size,):
                raise ValueError(f"{what}: a boolean mask must have shape [{self.batch_size}], got {list(index.shape)}")
            index = index.nonzero().flatten()
        index = index.to("cpu").numpy()
        if index.ndim != 1 or not np.issubdtype(index.dtype, np.integer):
            raise ValueError(f"{what} must be a 1-D integer batch index, got {index.dtype} shape {list(index.shape)}")
        bad = [int(i) for i in index if not 0 <= i < self.batch_size]
        if bad:
            raise ValueError(f"{what} holds row {bad[0]}, out of range for a batch of {self.batch_size}")
        return index.astype(np.int64)

    def _take_rows(self, src: np.ndarray) -> None:
        """Batch entry b takes what entry ``src[b]`` holds (``len(src)`` entries, at most the
        rows allocated): ``KVCache.reorder`` in place, copying only live tokens; rows past the
        new batch are emptied. The per-call slot records follow the rows."""
        n, rows = len(src), self.kv.batch
        if n > rows:
            raise ValueError(f"the batch would grow to {n} rows but GqakvCache allocated {rows} "
                             f"(make it with max_batch_size={n} or more)")
        # Rows past the new batch keep their contents during the reorder (they may be sources).
        mapping = np.arange(rows, dtype=np.int64)
        mapping[:n] = src
        self.kv.reorder(mapping)
        if n < rows:
            self.kv.reset(np.arange(n, rows))
        self._calls = [c if isinstance(c, int) else c[src] for c in self._calls]
        self.batch_size = n

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: row b takes row ``beam_idx[b]``'s tokens and length, in place."""
        if not self.is_initialized:
            return
        src = self._host_rows(beam_idx, "beam_idx")
        if len(src) != self.batch_size:
            raise ValueError(f"beam_idx must have one entry per row ({self.batch_size}), got {len(src)}")
        if (src != np.arange(len(src))).any():
            self._take_rows(src)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Row b becomes rows ``b*repeats .. b*repeats+repeats-1`` (copies of its live tokens),
        within the rows allocated; before the first forward nothing is allocated yet, so the
        next batch simply comes ``repeats`` times larger."""
        if not self.is_initialized:
            if self.batch_size is not None:
                self.batch_size *= int(repeats)
            return
        r = int(repeats)
        assert self.batch_size is not None  # set at the first forward
        self._take_rows(np.arange(self.batch_size * r, dtype=np.int64) // r)  # 0,0,..,1,1,..

    def batch_select_indices(self, indices) -> None:
        """Keep only the batch entries ``indices`` (in that order): rows move to the front."""
        if not self.is_initialized:
            return
        self._take_rows(self._host_rows(indices, "indices"))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` token slots (assisted decoding's rejected drafts):
        each row is truncated by the real tokens among them (``KVCache.truncate``, O(1))."""
        tokens_to_remove = int(tokens_to_remove)
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count of token slots to remove "
                             "(a positive value, the legacy absolute size, is not supported)")
        drop = -tokens_to_remove
        if drop == 0 or not self.is_initialized:
            return
        if drop > self.seen:
            raise ValueError(f"crop({tokens_to_remove}): the cache holds only {self.seen} token slots")
        B = self.batch_size
        assert B is not None  # set at the first forward
        removed = np.zeros(B, dtype=np.int64)
        calls, left = list(self._calls), drop
        while left:
            last = calls.pop()
            width = last if isinstance(last, int) else last.shape[1]
            take = min(left, width)
            removed += take if isinstance(last, int) else last[:, width - take:].sum(1)
            if take < width:
                calls.append(width - take if isinstance(last, int) else last[:, :width - take])
            left -= take
        self.kv.truncate(np.arange(B), self.kv.host_lens[:B] - removed)
        self._calls = calls
        self.seen -= drop


class GqakvCache(Cache):
    """A transformers Cache backed by gqakv's preallocated, in-place KV caches (one per layer).

    Args:
        config: the model's config (its decoder text config is used for the layer count).
        max_cache_len: capacity per row in real tokens (prompt without its padding + new tokens).
        batch_size: optional; checked against the first batch seen (with ``num_beams=N``,
            ``generate`` runs N rows per prompt).
        max_batch_size: rows allocated per layer (default: the first batch's size). More
            rows let ``batch_repeat_interleave`` grow the batch in place, and let a reset
            cache take a different batch size.
        kv_dtype: how K/V are stored: None (in the model's dtype), "int8" or
            "float8_e4m3fn" (``gqakv.KVCache``'s ``kv_dtype``: per-token scales; the model's
            dtype must be float32, float16 or bfloat16, checked at the first forward).
        window_storage: give each ``sliding_attention`` layer (every layer of a model whose
            config sets ``sliding_window`` without ``layer_types``, as Mistral's) window-sized
            paged storage (``gqakv.PagedKVCache(window=sliding_window)``; see the module
            docstring). Default False: every layer keeps every token.
        max_chunk: with ``window_storage``: the most real tokens one forward appends per row
            (the prompt, a prefill chunk, a draft); sizes the sliding layers' pools (default:
            the first forward's length).

    Beam search, batch selection and crop are gqakv row operations on the buffers
    allocated at the first forward (see ``GqakvLayer``); nothing is ever reallocated.
    """

    def __init__(self, config, max_cache_len: int, batch_size: int | None = None,
                 max_batch_size: int | None = None, kv_dtype=None, *, window_storage: bool = False,
                 max_chunk: int | None = None):
        kv_dtype = gqakv.storage.codecs.kv_dtype_name(kv_dtype)  # a bad name is refused here, naming it
        text = config.get_text_config(decoder=True)
        given = getattr(text, "layer_types", None)
        types = given or ["full_attention"] * text.num_hidden_layers
        other = sorted(set(types) - LAYER_TYPES)
        if other:
            raise ValueError(f"GqakvCache supports the layer types {sorted(LAYER_TYPES)}, the model also has {other}")
        if not isinstance(window_storage, bool):
            raise TypeError(f"window_storage must be a bool, got {window_storage!r}")
        if max_chunk is not None and (isinstance(max_chunk, bool) or not isinstance(max_chunk, int)
                                      or max_chunk < 1):
            raise ValueError(f"max_chunk must be None or an int >= 1, got {max_chunk!r}")
        windows: list[int | None] = [None] * len(types)
        if window_storage:
            W = getattr(text, "sliding_window", None)
            if W is None or getattr(text, "use_sliding_window", True) is False:
                raise ValueError("window_storage=True, but the model's config has no sliding window "
                                 f"(sliding_window={W!r}, use_sliding_window="
                                 f"{getattr(text, 'use_sliding_window', None)!r})")
            sliding = [t == "sliding_attention" for t in types] if given else [True] * len(types)
            windows = [int(W) if s else None for s in sliding]
        super().__init__(layers=[GqakvLayer(max_cache_len, batch_size, max_batch_size, kv_dtype,
                                            window=w, max_chunk=max_chunk)
                                 for w in windows])
        self.max_cache_len = int(max_cache_len)
        self.kv_dtype = kv_dtype

    @property
    def kv_caches(self) -> list[gqakv.KVCache | None]:  # PagedKVCache for window-sized layers
        """The gqakv.KVCache of each layer (None until the first forward)."""
        return [layer.kv for layer in self.layers]


def gqakv_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask, scaling: float | None = None, dropout: float = 0.0,
                    sliding_window: int | None = None, softcap: float | None = None,
                    s_aux: torch.Tensor | None = None, **kwargs):
    """transformers attention function: query ``[B, Hq, T, d]``, key/value ``[B, Hkv, T, d]``
    (this call's tokens), ``attention_mask`` a ``Padding`` from ``gqakv_mask`` or None.

    ``sliding_window``, ``softcap`` and ``s_aux`` (sink logits ``[Hq]``) are what the
    model's attention layer passes; they become gqakv's ``window``, ``softcap`` and
    ``sinks`` (validated by gqakv: W >= 1, c > 0, Hq finite-or--inf float32 logits).

    Returns ``(out [B, T, Hq, d], None)``, 0 at pad slots. With a GqakvCache the real
    tokens are appended to the cache and gqakv attends over it; otherwise over a
    temporary cache holding just this call's real tokens.
    """
    if dropout:
        raise NotImplementedError("gqakv attention is inference-only (attention dropout must be 0; call model.eval())")
    _check_layer_type(module)
    if not getattr(module, "is_causal", True):
        raise NotImplementedError(f"gqakv attention is causal; {type(module).__name__} has is_causal=False "
                                  "(bidirectional attention, e.g. use_bidirectional_attention=True)")
    if attention_mask is not None and not isinstance(attention_mask, Padding):
        raise ValueError("gqakv attention computes its own causal mask; got an explicit attention mask "
                         f"({type(attention_mask).__name__}; pass a 2D padding mask [batch, tokens], and set the "
                         "model's attn_implementation to 'gqakv' after gqakv...register())")
    padding = attention_mask
    layer = getattr(key, _HANDLE, None)
    rows = None
    if layer is not None:
        if padding is None and getattr(module, "layer_idx", 0) == 0:
            layer.check_positions(kwargs.get("position_ids"))
        layer.check_window(sliding_window)
        kv, n_new, rows = layer.write(key, value, padding)
    else:
        B, hkv, S, d = key.shape
        if query.shape[2] != S:
            raise ValueError(
                f"gqakv attention got {query.shape[2]} queries but keys for {S} tokens: without a GqakvCache they "
                "must cover the same tokens (a transformers cache such as DynamicCache hands back past keys too; "
                f"pass {CACHE_KWARG}=GqakvCache(model.config, max_cache_len=...) to generate/forward)")
        kv = gqakv.KVCache(int(B), int(hkv), int(S), int(d), dtype=key.dtype,
                           backend=_torch_backend(key.device))
        if padding is None:
            n_new = [int(S)] * int(B)
        else:
            padding.check_rows(int(B), int(S), [0] * int(B))
            key, value, n_new = padding.pack(key), padding.pack(value), padding.n_new
        kv.append(key, value, n_new)
    q_dtype = kv.backend.dtype(kv.dtype)  # the cache's query dtype (its K/V may be stored quantized)
    if query.dtype != q_dtype:  # e.g. autocast: gqakv never casts silently, so do it here explicitly
        query = query.to(q_dtype)
    if padding is not None:
        query = padding.pack(query)
    # [B, Hq, T, d], real slots first
    out = gqakv.gqa_attention(query, kv, n_new, scale=scaling, window=sliding_window, softcap=softcap,
                              sinks=_host_sinks(s_aux), rows=rows)
    if padding is not None:
        out = padding.unpack(out)
    return out.transpose(1, 2), None


def _check_layer_type(module) -> None:
    """Refuse a layer whose config names a type gqakv does not compute (e.g. Llama 4's
    ``chunked_attention``, which passes no window of its own and would otherwise run as
    full causal attention), with or without a GqakvCache."""
    types = getattr(getattr(module, "config", None), "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if types is None or idx is None or not 0 <= idx < len(types):
        return
    if types[idx] not in LAYER_TYPES:
        raise NotImplementedError(f"gqakv attention supports the layer types {sorted(LAYER_TYPES)}; layer {idx} "
                                  f"({type(module).__name__}) is {types[idx]!r}")


def _host_sinks(s_aux):
    """gpt-oss's sink logits ``[Hq]`` (a parameter, maybe on a GPU) as a tuple of Python floats,
    kept on the tensor until it changes (in place or its data replaced): one device-to-host copy
    per weight update, not one per layer and forward. gqakv takes sinks as float32 values
    (gpt-oss stores bfloat16)."""
    if s_aux is None or not torch.is_tensor(s_aux):
        return s_aux
    key = (s_aux._version, s_aux.data_ptr())  # in-place updates bump the version; .data = moves the pointer
    held = getattr(s_aux, "_gqakv_host", None)
    if held is None or held[0] != key:
        held = (key, tuple(s_aux.detach().to("cpu", torch.float32).tolist()))
        s_aux._gqakv_host = held
    return held[1]


def gqakv_mask(*, attention_mask=None, q_offset=0, q_length=None, local_size=None, **kwargs):
    """transformers mask function: no mask tensor is built; a 2D padding mask becomes a
    ``Padding`` (real slots per row), or None when nothing is padded.

    ``local_size`` is set for the sliding-window layers' mask: there a pad after a real
    token is refused, since transformers' window counts slots and gqakv's positions."""
    if attention_mask is None:
        return None
    if attention_mask.ndim != 2:
        raise ValueError(f"gqakv takes a 2D padding mask [batch, tokens], got shape {list(attention_mask.shape)}")
    padding = Padding.from_mask(attention_mask, int(q_offset), int(q_length))
    if padding is not None and local_size is not None:
        padding.check_left_padded(attention_mask, int(local_size))
    return padding


def register() -> None:
    """Add ``"gqakv"`` to transformers' attention and mask registries (idempotent)."""
    AttentionInterface.register(NAME, gqakv_attention)
    AttentionMaskInterface.register(NAME, gqakv_mask)
