"""How much memory a KV cache takes, and how much cache fits a budget (the library side of
``gqakv size``, whose command is ``gqakv.tools.size``).

Per token, a model's cache holds K and V for every layer and KV head:

    bytes_per_token = 2 x layers x kv_heads x head_dim x bytes_per_element

Llama 3.1 8B in bfloat16: 2 x 32 x 8 x 128 x 2 = 131,072 bytes (128 KiB), so a
4,096-token row takes 512 MiB. A cache of ``batch`` rows of ``max_len`` tokens takes
``batch x max_len x bytes_per_token`` (what ``ModelKVCache.nbytes_for`` computes).

With ``kv_dtype="int8"`` or ``"float8_e4m3fn"`` K and V take one byte per value plus a
float32 scale per token and KV head each: ``2 x layers x kv_heads x (head_dim + 4)``
(Llama 3.1 8B: 67,584 bytes per token, 0.52x of bfloat16).

A model's sliding-window layers (Mistral: all 32, window 4,096; Gemma 2 / gpt-oss: every
other layer) need only their last ``W`` tokens: in window-sized paged storage
(``PagedKVCache(window=W)``, ``ModelKVCache(windows=...)``; or contiguous storage with a
window, ``KVCache(window=W, max_chunk=chunk)``, a ring of such pages, ``gqakv.storage.ring``)
a sliding layer's row holds at
most ``ceil((W - 1 + chunk + page_size - 1) / page_size)`` pages (``window_pages``), so
``window_cache_bytes`` sets one row of every layer at ``max_len`` against that (Mistral 7B
at 32,768 tokens, bfloat16, decode: 4.0 GiB against 0.50 GiB).

A paged cache (``gqakv.PagedKVCache``, ``ModelKVCache(page_size=...)``) holds each row's
live tokens rounded up to whole pages, ``sum(ceil(L_b / page_size)) x page_size x
bytes_per_token``, plus a small page table on the host; ``paged_cache_bytes`` compares
it with the contiguous cache for a mix of row lengths (``gqakv size --rows``); with a
``kv_dtype`` each page slot holds the codes and the float32 scales of its token.

Split over P devices by heads (``gqakv.distributed``, ``gqakv size --tensor-parallel P``)
each device holds ``Hkv / P`` KV heads (one, replicated, when P > Hkv), so its cache is
the formula above with ``kv_heads`` replaced by that (``ModelConfig.per_device``);
``tensor_parallel_traffic`` sets the two all-reduces per layer and token against the
K/V bytes each device reads per decode step; ``context_parallel_traffic`` the one
all-gather per layer of context parallelism against them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core import dtypes as _dtypes
from ..core.shard import HeadShard
from . import store as _store
from .paged import PageTable, check_page_args, pages_for, window_pages  # noqa: F401  (window_pages: re-exported)


@dataclass(frozen=True)
class ModelConfig:
    """The attention shapes of a model that size its KV cache."""

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    max_position: int  # context length the model's config declares
    source: str = ""  # where the numbers come from (a Hugging Face repo's config.json)
    hidden: int = 0  # the model's hidden size D, when its config gives one that is not Hq x d
    #: the sliding window W of the model's sliding layers (0: none)
    sliding_window: int = 0
    #: per layer "full" or "sliding" (empty: every layer sliding when ``sliding_window``
    #: is set, else every layer full)
    layer_types: tuple[str, ...] = ()

    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer: None (full attention) or the sliding window W (``ModelKVCache``'s
        ``windows``)."""
        if not self.sliding_window:
            return (None,) * self.layers
        types = self.layer_types or ("sliding",) * self.layers
        return tuple(self.sliding_window if t == "sliding" else None for t in types)

    def bytes_per_token(self, dtype="bfloat16", kv_dtype=None) -> int:
        """K + V bytes of one token over all layers (with ``kv_dtype``: codes plus scales)."""
        spec = _store.StorageSpec.of(dtype, kv_dtype=kv_dtype)
        return spec.nbytes(self.layers, self.kv_heads, self.head_dim)  # the one formula

    def per_device(self, tensor_parallel: int) -> "ModelConfig":
        """The heads one of ``tensor_parallel`` devices holds (``HeadShard.plan``'s split:
        ``Hkv / P`` KV heads and ``Hq / P`` query heads; one replicated KV head when P >
        Hkv); ValueError when the heads do not split over P."""
        shard = HeadShard.plan(self.q_heads, self.kv_heads, tensor_parallel)
        return dataclasses.replace(self, q_heads=shard.local_heads, kv_heads=shard.local_kv_heads)

    @property
    def hidden_size(self) -> int:
        """What each all-reduce carries per token: ``hidden`` where the config gave it
        (``config_from_hf``), else ``Hq x d``, the hidden size of the Llama family (every
        preset's; Gemma 2's or Mistral Nemo's config.json differ, and say so)."""
        return self.hidden or self.q_heads * self.head_dim


# From each model's published config.json (num_hidden_layers, num_attention_heads,
# num_key_value_heads, hidden_size / num_attention_heads, max_position_embeddings).
PRESETS: dict[str, ModelConfig] = {c.name: c for c in [
    ModelConfig("gpt2", 12, 12, 12, 64, 1024, "openai-community/gpt2 (n_layer, n_head, n_embd=768)"),
    ModelConfig("llama-2-7b", 32, 32, 32, 128, 4096, "meta-llama/Llama-2-7b-hf"),
    ModelConfig("llama-2-70b", 80, 64, 8, 128, 4096, "meta-llama/Llama-2-70b-hf"),
    ModelConfig("llama-3.1-8b", 32, 32, 8, 128, 131072, "meta-llama/Llama-3.1-8B"),
    ModelConfig("llama-3.1-70b", 80, 64, 8, 128, 131072, "meta-llama/Llama-3.1-70B"),
    ModelConfig("llama-3.1-405b", 126, 128, 8, 128, 131072, "meta-llama/Llama-3.1-405B"),
    ModelConfig("llama-3.2-1b", 16, 32, 8, 64, 131072, "meta-llama/Llama-3.2-1B"),
    ModelConfig("llama-3.2-3b", 28, 24, 8, 128, 131072, "meta-llama/Llama-3.2-3B"),
    ModelConfig("mistral-7b", 32, 32, 8, 128, 32768, "mistralai/Mistral-7B-v0.1 (sliding_window 4096)",
                sliding_window=4096),
    ModelConfig("mixtral-8x7b", 32, 32, 8, 128, 32768, "mistralai/Mixtral-8x7B-v0.1"),
    ModelConfig("qwen2.5-7b", 28, 28, 4, 128, 32768, "Qwen/Qwen2.5-7B"),
    ModelConfig("qwen2.5-72b", 80, 64, 8, 128, 32768, "Qwen/Qwen2.5-72B"),
    ModelConfig("gemma-2-9b", 42, 16, 8, 256, 8192, "google/gemma-2-9b (sliding_window 4096, "
                "sliding and full layers alternate)", hidden=3584, sliding_window=4096,
                layer_types=("sliding", "full") * 21),
    ModelConfig("gpt-oss-20b", 24, 64, 8, 64, 131072, "openai/gpt-oss-20b (sliding_window 128, "
                "sliding and full layers alternate)", hidden=2880, sliding_window=128,
                layer_types=("sliding", "full") * 12),
]}

_ALIASES = {"gpt2-small": "gpt2", "gpt-2": "gpt2", "gpt-2-small": "gpt2"}


def _key(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().lower()).removeprefix("meta-")


def get_preset(name: str) -> ModelConfig:
    """A preset by name (case, '_' and '-' do not matter: 'Llama_3.1_8B' works)."""
    key = _key(name)
    key = _ALIASES.get(key, key)
    if key not in PRESETS:
        raise ValueError(f"unknown model {name!r} (presets: {', '.join(PRESETS)}; or give the "
                         "path of a model's config.json, or of the directory holding it)")
    return PRESETS[key]


def config_from_hf(config, name: str | None = None) -> ModelConfig:
    """A ModelConfig from a Hugging Face ``config.json`` (a dict or a path).

    Reads Llama/Mistral/Qwen-style keys (``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads`` defaulting to the query heads, ``head_dim`` defaulting to
    ``hidden_size // num_attention_heads``) and GPT-2's (``n_layer``, ``n_head``, ``n_embd``).
    """
    if not isinstance(config, dict):
        path = Path(config)
        config = json.loads(path.read_text())
        name = name or path.parent.name or path.stem
    config = config.get("text_config", config)  # multimodal wrappers nest the LM's config

    def first(*keys, default=None, minimum=1):
        """The first of ``keys`` the config sets, as an int >= minimum (JSON ints only: a
        bool, a fraction or a string is an error naming the key)."""
        for k in keys:
            if config.get(k) is not None:
                v = config[k]
                if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                    raise ValueError(f"config {k}={v!r} must be an int >= {minimum}")
                return v
        if default is None:
            raise ValueError(f"config has none of {', '.join(keys)}")
        return default

    layers = first("num_hidden_layers", "n_layer")
    q_heads = first("num_attention_heads", "n_head")
    kv_heads = first("num_key_value_heads", "multi_query_group_num", default=q_heads)
    hidden = first("hidden_size", "n_embd", default=0)
    head_dim = first("head_dim", default=hidden // q_heads if hidden else 0)
    if head_dim <= 0:
        raise ValueError("config gives neither head_dim nor hidden_size")
    max_pos = first("max_position_embeddings", "n_positions", "n_ctx", default=0, minimum=0)
    window = 0
    types: tuple[str, ...] = ()
    if config.get("sliding_window") is not None and config.get("use_sliding_window", True) is not False:
        window = first("sliding_window")
        given = config.get("layer_types")
        if given is not None:
            if len(given) != layers or not set(given) <= {"full_attention", "sliding_attention"}:
                raise ValueError(f"config layer_types must be {layers} of 'full_attention' / "
                                 f"'sliding_attention', got {given!r}")
            types = tuple("sliding" if t == "sliding_attention" else "full" for t in given)
    return ModelConfig(name or config.get("model_type", "model"), layers, q_heads, kv_heads,
                       head_dim, max_pos, "config.json", hidden=hidden, sliding_window=window,
                       layer_types=types)


def resolve_model(model) -> ModelConfig:
    """A ModelConfig, a preset name, or a path to a config.json."""
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, str) and (model.endswith(".json") or Path(model).is_dir()):
        path = Path(model)
        return config_from_hf(path / "config.json" if path.is_dir() else path)
    if isinstance(model, str):
        return get_preset(model)
    raise TypeError(f"model must be a preset name, a config.json path or a ModelConfig, got {model!r}")


def _positive(name: str, value) -> int:
    """``value`` as a Python int >= 0 (NumPy ints too; bools and other types rejected)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a non-negative int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def cache_bytes(model, *, max_len: int, batch: int = 1, dtype="bfloat16", kv_dtype=None) -> int:
    """Bytes of K and V for ``batch`` rows of ``max_len`` tokens over all layers
    (``kv_dtype``: None, "int8" or "float8_e4m3fn", as ``KVCache``'s)."""
    cfg = resolve_model(model)
    return (_positive("batch", batch) * _positive("max_len", max_len)
            * cfg.bytes_per_token(dtype, kv_dtype))


@dataclass(frozen=True)
class PagedSize:
    """Memory of a paged cache holding rows of given lengths, beside the contiguous cache.

    pages: pages the rows hold (``sum(ceil(L_b / page_size))``, no sharing).
    pool_bytes: K/V bytes of exactly those pages, all layers (a pool sized to the rows).
    metadata_bytes: host bytes of the page table, counts and free list.
    live_bytes: K/V bytes of the live tokens alone.
    contiguous_bytes: the contiguous cache of the same rows at ``max_len``.
    """

    page_size: int
    row_lens: tuple[int, ...]
    max_len: int
    pages: int
    pool_bytes: int
    metadata_bytes: int
    live_bytes: int
    contiguous_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.pool_bytes + self.metadata_bytes


def paged_cache_bytes(model, row_lens, *, max_len: int, page_size: int = 16,
                      dtype="bfloat16", kv_dtype=None) -> PagedSize:
    """Paged memory for rows holding ``row_lens`` tokens (capacity ``max_len`` each) against
    the contiguous cache of ``len(row_lens)`` rows of ``max_len`` tokens. With ``kv_dtype``
    ("int8" or "float8_e4m3fn", as ``PagedKVCache``'s) every byte count is of codes plus
    the float32 scales (paged with their tokens: a scale per token slot and KV head, for K
    and for V), on both sides."""
    cfg = resolve_model(model)
    max_len = _positive("max_len", max_len)
    lens = tuple(_positive(f"row_lens[{i}]", n) for i, n in enumerate(row_lens))
    for i, n in enumerate(lens):
        if n > max_len:
            raise ValueError(f"row_lens[{i}]={n} exceeds max_len={max_len}")
    page_size, _ = check_page_args(page_size, None, len(lens), max_len)
    per = cfg.bytes_per_token(dtype, kv_dtype)  # the scales' slots are paged too
    pages = sum(pages_for(n, page_size) for n in lens)
    return PagedSize(page_size=page_size, row_lens=lens, max_len=max_len, pages=pages,
                     pool_bytes=pages * page_size * per,
                     metadata_bytes=PageTable.nbytes_for(len(lens), max_len, page_size, pages),
                     live_bytes=sum(lens) * per, contiguous_bytes=len(lens) * max_len * per)


@dataclass(frozen=True)
class WindowSize:
    """Per row, a model's K/V bytes with every layer keeping ``max_len`` tokens against
    its sliding layers in window-sized paged storage (``window_cache_bytes``).

    full_layers / sliding_layers: how many layers of each kind; window: their W (0: none).
    pages_full / pages_sliding: pages per row a full / sliding layer holds at most
        (``window_pages``).
    full_history_bytes: every layer at ``max_len`` tokens (the contiguous cache's row).
    window_bytes: the full layers' pages plus the sliding layers' window pages.
    """

    max_len: int
    page_size: int
    chunk: int
    window: int
    full_layers: int
    sliding_layers: int
    pages_full: int
    pages_sliding: int
    full_history_bytes: int
    window_bytes: int


def window_cache_bytes(model, *, max_len: int, page_size: int = 16, chunk: int = 1,
                       dtype="bfloat16", kv_dtype=None) -> WindowSize:
    """One row's K/V bytes over all layers at ``max_len`` tokens, every layer keeping its
    history against each sliding layer in window-sized storage (pages of ``page_size``,
    appends of at most ``chunk`` tokens: 1 for decode; a prefill chunk needs its own
    length). Mistral 7B at 32,768 tokens, bfloat16: 4.0 GiB against 0.50 GiB."""
    cfg = resolve_model(model)
    max_len = _positive("max_len", max_len)
    windows = cfg.layer_windows()
    sliding = sum(w is not None for w in windows)
    one_layer = _store.StorageSpec.of(dtype, kv_dtype=kv_dtype).nbytes(1, cfg.kv_heads, cfg.head_dim)
    full_pages = window_pages(None, max_len, page_size, chunk)
    slide_pages = window_pages(cfg.sliding_window or None, max_len, page_size, chunk)
    return WindowSize(max_len=max_len, page_size=page_size, chunk=chunk,
                      window=cfg.sliding_window, full_layers=cfg.layers - sliding,
                      sliding_layers=sliding, pages_full=full_pages, pages_sliding=slide_pages,
                      full_history_bytes=cfg.layers * max_len * one_layer,
                      window_bytes=((cfg.layers - sliding) * full_pages + sliding * slide_pages)
                      * page_size * one_layer)


@dataclass(frozen=True)
class TensorParallelTraffic:
    """Per layer, what one of P devices sends (all-reduces) and reads (K/V) per token.

    all_reduce_bytes: the two all-reduced activations of one token, ``2 x D x
        activation bytes`` (attention output and MLP down projection).
    ring_send_bytes: what each device sends for them in a ring all-reduce,
        ``2 (P - 1) / P`` of ``all_reduce_bytes`` (0 for P = 1).
    kv_read_bytes: K/V bytes this device reads to decode one token of a row holding
        ``context`` tokens, ``context x bytes per token`` of its own heads.
    """

    world_size: int
    layers: int
    hidden_size: int
    context: int
    all_reduce_bytes: int
    ring_send_bytes: int
    kv_read_bytes: int

    @property
    def per_token(self) -> dict[str, int]:
        """The same three numbers over all layers."""
        return {"all_reduce_bytes": self.layers * self.all_reduce_bytes,
                "ring_send_bytes": self.layers * self.ring_send_bytes,
                "kv_read_bytes": self.layers * self.kv_read_bytes}


def tensor_parallel_traffic(model, tensor_parallel: int, *, context: int, dtype="bfloat16",
                            kv_dtype=None, hidden_size: int | None = None) -> TensorParallelTraffic:
    """Communication against K/V reads per layer and decoded token, on one of
    ``tensor_parallel`` devices (activations in ``dtype``; ``hidden_size`` default
    ``Hq x d``)."""
    cfg = resolve_model(model)
    P = _positive("tensor_parallel", tensor_parallel)
    dev = cfg.per_device(P)
    D = cfg.hidden_size if hidden_size is None else _positive("hidden_size", hidden_size)
    msg = 2 * D * _dtypes.itemsize(dtype)
    one_layer = dataclasses.replace(dev, layers=1)
    return TensorParallelTraffic(world_size=P, layers=cfg.layers, hidden_size=D,
                                 context=_positive("context", context), all_reduce_bytes=msg,
                                 ring_send_bytes=msg * 2 * (P - 1) // P,
                                 kv_read_bytes=context * one_layer.bytes_per_token(dtype, kv_dtype))


@dataclass(frozen=True)
class ContextParallelTraffic:
    """Per layer and decoded token of one row, what one of the C ranks of a context-parallel
    group sends and reads (``gqakv.context_parallel``; in a TP x CP grid, one device's heads).

    all_gather_send_bytes: this rank's part of the layer's one all-gather, the packed
        ``[Hq, d + 1]`` partial (out and lse) of its heads in the compute dtype (float32;
        float64 for float64 models) plus one failure flag: ``(Hq (d + 1) + 1) x 4``.
    all_gather_recv_bytes: what it receives, ``(C - 1)`` such parts.
    kv_read_bytes: K/V bytes this rank reads, its ``ceil(context / C)``-token share of
        the row (interleaved placement: within one chunk of ``context / C``) of its heads.
    """

    context_parallel: int
    tensor_parallel: int
    layers: int
    context: int
    local_tokens: int
    all_gather_send_bytes: int
    all_gather_recv_bytes: int
    kv_read_bytes: int

    @property
    def per_token(self) -> dict[str, int]:
        """The same numbers over all layers."""
        return {"all_gather_send_bytes": self.layers * self.all_gather_send_bytes,
                "all_gather_recv_bytes": self.layers * self.all_gather_recv_bytes,
                "kv_read_bytes": self.layers * self.kv_read_bytes}


def context_parallel_traffic(model, context_parallel: int, *, context: int, dtype="bfloat16",
                             kv_dtype=None, tensor_parallel: int = 1) -> ContextParallelTraffic:
    """The all-gather against the K/V reads of one rank of ``context_parallel`` (C) to
    decode one token of a row holding ``context`` tokens (``ContextParallelTraffic``); the
    heads are one of ``tensor_parallel`` devices' (``ModelConfig.per_device``)."""
    cfg = resolve_model(model)
    C = _positive("context_parallel", context_parallel)
    dev = cfg.per_device(_positive("tensor_parallel", tensor_parallel))
    context = _positive("context", context)
    acc = 8 if _dtypes.canonical_name(dtype) == "float64" else 4
    part = (dev.q_heads * (dev.head_dim + 1) + 1) * acc
    local = -(-context // C)
    one_layer = dataclasses.replace(dev, layers=1)
    return ContextParallelTraffic(context_parallel=C, tensor_parallel=int(tensor_parallel),
                                  layers=cfg.layers, context=context, local_tokens=local,
                                  all_gather_send_bytes=part, all_gather_recv_bytes=(C - 1) * part,
                                  kv_read_bytes=local * one_layer.bytes_per_token(dtype, kv_dtype))


def max_batch(model, *, max_len: int, budget: int, dtype="bfloat16", kv_dtype=None) -> int:
    """Largest batch of ``max_len``-token rows whose cache fits in ``budget`` bytes."""
    per_row = cache_bytes(model, max_len=max_len, batch=1, dtype=dtype, kv_dtype=kv_dtype)
    return _positive("budget", parse_bytes(budget)) // per_row if per_row else 0


def max_len_for(model, *, batch: int, budget: int, dtype="bfloat16", kv_dtype=None) -> int:
    """Largest per-row capacity in tokens for ``batch`` rows within ``budget`` bytes."""
    per_token = cache_bytes(model, max_len=1, batch=batch, dtype=dtype, kv_dtype=kv_dtype)
    return _positive("budget", parse_bytes(budget)) // per_token if per_token else 0


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(text) -> int:
    """``'80GiB'`` -> 85899345920; ``'1.5GB'`` -> 1500000000; ints pass through."""
    if isinstance(text, (int, np.integer)) and not isinstance(text, (bool, np.bool_)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a byte count from {text!r} (examples: 80GiB, 24GB, 512MiB, "
                         "1e9)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value):  # '1e400' reads as inf
        raise ValueError(f"byte count {text!r} is too large (it does not fit a float)")
    return int(value)
