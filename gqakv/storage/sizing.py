"""How much memory a KV cache takes, and how much cache fits a budget (``gqakv size``).

Per token, a model's cache holds K and V for every layer and KV head:

    bytes_per_token = 2 x layers x kv_heads x head_dim x bytes_per_element

Llama 3.1 8B in bfloat16: 2 x 32 x 8 x 128 x 2 = 131,072 bytes (128 KiB), so a
4,096-token row takes 512 MiB. A cache of ``batch`` rows of ``max_len`` tokens takes
``batch x max_len x bytes_per_token`` (what ``ModelKVCache.nbytes_for`` computes).

With ``kv_dtype="int8"`` or ``"float8_e4m3fn"`` K and V take one byte per value plus a
float32 scale per token and KV head each: ``2 x layers x kv_heads x (head_dim + 4)``
(Llama 3.1 8B: 67,584 bytes per token, 0.52x of bfloat16).

A paged cache (``gqakv.PagedKVCache``, ``ModelKVCache(page_size=...)``) holds each row's
live tokens rounded up to whole pages, ``sum(ceil(L_b / page_size)) x page_size x
bytes_per_token``, plus a small page table on the host; ``paged_cache_bytes`` compares
it with the contiguous cache for a mix of row lengths (``gqakv size --rows``); with a
``kv_dtype`` each page slot holds the codes and the float32 scales of its token.

Split over P devices by heads (``gqakv.distributed``, ``gqakv size --tensor-parallel P``)
each device holds ``Hkv / P`` KV heads (one, replicated, when P > Hkv), so its cache is
the formula above with ``kv_heads`` replaced by that (``ModelConfig.per_device``);
``tensor_parallel_traffic`` sets the two all-reduces per layer and token against the
K/V bytes each device reads per decode step.
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
from . import store as _store
from ..caches.cache import human_bytes


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

    def bytes_per_token(self, dtype="bfloat16", kv_dtype=None) -> int:
        """K + V bytes of one token over all layers (with ``kv_dtype``: codes plus scales)."""
        spec = _store.StorageSpec.of(dtype, kv_dtype=kv_dtype)
        return spec.nbytes(self.layers, self.kv_heads, self.head_dim)  # the one formula

    def per_device(self, tensor_parallel: int) -> "ModelConfig":
        """The heads one of ``tensor_parallel`` devices holds (``HeadShard.plan``'s split:
        ``Hkv / P`` KV heads and ``Hq / P`` query heads; one replicated KV head when P >
        Hkv); ValueError when the heads do not split over P."""
        from ..distributed import HeadShard

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
    ModelConfig("mistral-7b", 32, 32, 8, 128, 32768, "mistralai/Mistral-7B-v0.1"),
    ModelConfig("mixtral-8x7b", 32, 32, 8, 128, 32768, "mistralai/Mixtral-8x7B-v0.1"),
    ModelConfig("qwen2.5-7b", 28, 28, 4, 128, 32768, "Qwen/Qwen2.5-7B"),
    ModelConfig("qwen2.5-72b", 80, 64, 8, 128, 32768, "Qwen/Qwen2.5-72B"),
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
    return ModelConfig(name or config.get("model_type", "model"), layers, q_heads, kv_heads,
                       head_dim, max_pos, "config.json", hidden=hidden)


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
    from .paged import PageTable, check_page_args, pages_for

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


# -- the command -------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument("model", nargs="?", default="llama-3.1-8b",
                        help="preset name (see --list) or a config.json path (default: llama-3.1-8b)")
    parser.add_argument("--max-len", type=int, default=4096, help="tokens per row (default 4096)")
    parser.add_argument("--batch", type=int, default=1, help="rows (default 1)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_dtypes.ITEMSIZE),
                        help="cache dtype (default bfloat16)")
    parser.add_argument("--kv-dtype", default=None, choices=sorted(_dtypes.QUANTIZED_ITEMSIZE),
                        help="store K/V quantized: 1 byte per value plus a float32 scale per "
                        "token and KV head (default: K/V stored as --dtype)")
    parser.add_argument("--budget", help="memory for the cache (e.g. 40GiB): print the largest "
                        "batch at --max-len and the largest max-len at --batch that fit")
    parser.add_argument("--list", action="store_true", help="list the presets and their per-token size")
    parser.add_argument("--rows", default=None,
                        help="comma-separated live lengths of the rows (e.g. 100,100000): print "
                        "the paged cache's memory for them beside the contiguous cache at --max-len")
    parser.add_argument("--page-size", type=int, default=16,
                        help="tokens per page for --rows (default 16)")
    parser.add_argument("--tensor-parallel", type=int, default=None, metavar="P",
                        help="split the heads over P devices (gqakv.distributed): print the "
                        "bytes per device (every number below, --budget included, is per "
                        "device) and the all-reduce bytes per token")


def run(args) -> int:
    kv_dtype = getattr(args, "kv_dtype", None)
    stored = kv_dtype or args.dtype  # what K/V are stored as
    if args.list:
        print(f"{'model':16} {'layers':>6} {'Hq':>4} {'Hkv':>4} {'d':>4} {'context':>8} "
              f"{'bytes/token':>12}  {'4,096 tokens':>12}  ({stored})")
        for c in PRESETS.values():
            per = c.bytes_per_token(args.dtype, kv_dtype)
            print(f"{c.name:16} {c.layers:6d} {c.q_heads:4d} {c.kv_heads:4d} {c.head_dim:4d} "
                  f"{c.max_position:8d} {per:12,d}  {human_bytes(per * 4096):>12}")
        return 0
    from ..tools.cli import UsageError

    for flag, value in (("--max-len", args.max_len), ("--batch", args.batch)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    try:
        cfg = resolve_model(args.model)
    except OSError as exc:  # a config.json that cannot be read
        raise UsageError(f"cannot read the model config {args.model!r}: {exc}") from exc
    full, P = cfg, getattr(args, "tensor_parallel", None)
    if P is not None:
        if P < 1:
            raise UsageError(f"--tensor-parallel must be >= 1, got {P}")
        try:
            cfg = full.per_device(P)  # every count below is one device's
        except ValueError as exc:
            raise UsageError(f"--tensor-parallel {P}: {exc}") from None
    total = cache_bytes(cfg, max_len=args.max_len, batch=args.batch, dtype=args.dtype,
                        kv_dtype=kv_dtype)
    budget = _cli_budget(args.budget) if args.budget is not None else None
    rows = _paged_rows(args)  # checked before any output
    item = _dtypes.itemsize(stored)
    per = cfg.bytes_per_token(args.dtype, kv_dtype)
    what = args.dtype if kv_dtype is None else f"{args.dtype}, K/V stored as {kv_dtype}"
    print(f"{cfg.name}: {cfg.layers} layers, {full.q_heads} query heads, {full.kv_heads} KV heads, "
          f"head dim {cfg.head_dim}, {what}" + (f"  [{cfg.source}]" if cfg.source else ""))
    if P is not None:
        _print_tensor_parallel(full, cfg, P, args, kv_dtype)
    if kv_dtype is None:
        print(f"  per token : {per:,} bytes ({human_bytes(per)}) = 2 x {cfg.layers} layers x "
              f"{cfg.kv_heads} KV heads x {cfg.head_dim} x {item} bytes")
    else:
        plain = cfg.bytes_per_token(args.dtype)
        print(f"  per token : {per:,} bytes ({human_bytes(per)}) = 2 x {cfg.layers} layers x "
              f"{cfg.kv_heads} KV heads x ({cfg.head_dim} x {item} byte + 4-byte scale); "
              f"{per / plain:.2f}x of {args.dtype}'s {plain:,}")
    print(f"  cache     : {total:,} bytes ({human_bytes(total)}) for batch {args.batch} x "
          f"max_len {args.max_len:,}")
    if cfg.max_position and args.max_len > cfg.max_position:
        print(f"  note      : max_len {args.max_len:,} exceeds the model's context "
              f"{cfg.max_position:,}")
    if rows is not None:
        _print_paged(cfg, args, rows)
    if budget is not None:
        b = max_batch(cfg, max_len=args.max_len, budget=budget, dtype=args.dtype, kv_dtype=kv_dtype)
        n = max_len_for(cfg, batch=args.batch, budget=budget, dtype=args.dtype, kv_dtype=kv_dtype)
        print(f"  budget    : {budget:,} bytes ({human_bytes(budget)})")
        print(f"    largest batch at max_len {args.max_len:,}: {b:,}")
        print(f"    largest max_len at batch {args.batch}: {n:,} tokens")
    return 0


def _print_tensor_parallel(full: ModelConfig, dev: ModelConfig, P: int, args, kv_dtype) -> None:
    rep = full.kv_heads < P
    held = (f"1 KV head (each KV head replicated on {P // full.kv_heads} devices)" if rep
            else f"{dev.kv_heads} of {full.kv_heads} KV heads")
    print(f"  tensor parallel: {P} devices, each holding {held} and {dev.q_heads} of "
          f"{full.q_heads} query heads; every size below is per device")
    t = tensor_parallel_traffic(full, P, context=args.max_len, dtype=args.dtype, kv_dtype=kv_dtype)
    tot = t.per_token
    print(f"  all-reduce: 2 per layer of hidden {t.hidden_size:,} x {_dtypes.itemsize(args.dtype)} "
          f"bytes = {t.all_reduce_bytes:,} bytes per token and layer, {tot['all_reduce_bytes']:,} "
          f"({human_bytes(tot['all_reduce_bytes'])}) over {t.layers} layers; a ring sends "
          f"{tot['ring_send_bytes']:,} of them per device")
    ratio = f"{tot['kv_read_bytes'] / tot['all_reduce_bytes']:,.0f}x" if tot["all_reduce_bytes"] else "-"
    print(f"  K/V read : {tot['kv_read_bytes']:,} bytes ({human_bytes(tot['kv_read_bytes'])}) per "
          f"device to decode one token of a row at {args.max_len:,} tokens ({ratio} the all-reduced bytes)")


def _paged_rows(args) -> list[int] | None:
    """``--rows`` as a list of ints (None when not given), or a UsageError naming the flag."""
    from ..tools.cli import UsageError

    if getattr(args, "rows", None) is None:
        return None
    try:
        lens = [int(x) for x in str(args.rows).split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--rows must be comma-separated ints >= 0, got {args.rows!r}") from None
    if not lens or min(lens) < 0:
        raise UsageError(f"--rows must be comma-separated ints >= 0, got {args.rows!r}")
    if max(lens) > args.max_len:
        raise UsageError(f"--rows has a row of {max(lens):,} tokens > --max-len {args.max_len:,}")
    if args.page_size < 1:
        raise UsageError(f"--page-size must be >= 1, got {args.page_size}")
    return lens


def _print_paged(cfg: ModelConfig, args, lens: list[int]) -> None:
    p = paged_cache_bytes(cfg, lens, max_len=args.max_len, page_size=args.page_size,
                          dtype=args.dtype, kv_dtype=getattr(args, "kv_dtype", None))
    shown = ", ".join(f"{n:,}" for n in lens[:8]) + (" ..." if len(lens) > 8 else "")
    print(f"  paged     : rows of {shown} tokens, page_size {p.page_size}: {p.pages:,} pages = "
          f"{p.pages * p.page_size:,} token slots (live {sum(lens):,})")
    kv = "K/V" if getattr(args, "kv_dtype", None) is None else "K/V codes + scales"
    print(f"              {kv} {p.pool_bytes:,} bytes ({human_bytes(p.pool_bytes)}) + page table "
          f"{p.metadata_bytes:,} bytes on the host ({100 * p.metadata_bytes / max(1, p.pool_bytes):.3f}%)")
    print(f"  contiguous: {len(lens)} rows x max_len {args.max_len:,} = {p.contiguous_bytes:,} bytes "
          f"({human_bytes(p.contiguous_bytes)}), {p.contiguous_bytes / max(1, p.total_bytes):.2f}x "
          "the paged cache")


def _cli_budget(text: str) -> int:
    """``--budget`` as a byte count, or a UsageError naming the flag."""
    from ..tools.cli import UsageError

    try:
        budget = parse_bytes(text)
    except OverflowError:  # '1e400' reads as an infinite float
        raise UsageError(f"--budget {text!r} is not a finite byte count (examples: 80GiB, 24GB, "
                         "512MiB, 1e9)") from None
    except ValueError as exc:
        raise UsageError(f"--budget: {exc}") from None
    if budget < 0:
        raise UsageError(f"--budget must be >= 0 bytes, got {text!r}")
    return budget
