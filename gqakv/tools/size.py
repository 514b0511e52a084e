"""``gqakv size``: KV cache bytes for a model, and the largest batch/length that fit a budget
(the formulas: ``gqakv.storage.sizing``)."""

from __future__ import annotations

from ..core import dtypes as _dtypes
from ..storage import codecs as _codecs
from ..core.units import human_bytes
from ..storage.sizing import (PRESETS, ModelConfig, cache_bytes, max_batch, max_len_for, paged_cache_bytes,
                              parse_bytes, resolve_model, tensor_parallel_traffic,
                              context_parallel_traffic, window_cache_bytes)
from .errors import UsageError


def add_arguments(parser) -> None:
    parser.add_argument("model", nargs="?", default="llama-3.1-8b",
                        help="preset name (see --list) or a config.json path (default: llama-3.1-8b)")
    parser.add_argument("--max-len", type=int, default=4096, help="tokens per row (default 4096)")
    parser.add_argument("--batch", type=int, default=1, help="rows (default 1)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_dtypes.ITEMSIZE),
                        help="cache dtype (default bfloat16)")
    parser.add_argument("--kv-dtype", default=None, choices=sorted(_codecs.names()),
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
    parser.add_argument("--chunk", type=int, default=1,
                        help="for a model with sliding-window layers: the most tokens one append "
                        "adds (1: decode; a prefill chunk's length), which sizes the window-sized "
                        "storage of a sliding layer (default 1)")
    parser.add_argument("--tensor-parallel", type=int, default=None, metavar="P",
                        help="split the heads over P devices (gqakv.distributed): print the "
                        "bytes per device (every number below, --budget included, is per "
                        "device) and the all-reduce bytes per token")
    parser.add_argument("--context-parallel", type=int, default=None, metavar="C",
                        help="spread every row's tokens over C devices (gqakv.context_parallel; with "
                        "--tensor-parallel a P x C grid): print the bytes per device and the "
                        "all-gather bytes per decoded token against the K/V bytes each device reads")
    parser.add_argument("--cp-chunk", type=int, default=16, metavar="S",
                        help="with --context-parallel: tokens per chunk of the interleaved placement "
                        "(default 16)")


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
    C = getattr(args, "context_parallel", None)
    local_len = args.max_len  # tokens of a row one device holds
    if C is not None:
        if C < 1:
            raise UsageError(f"--context-parallel must be >= 1, got {C}")
        if args.cp_chunk < 1:
            raise UsageError(f"--cp-chunk must be >= 1, got {args.cp_chunk}")
        S = args.cp_chunk
        local_len = -(-args.max_len // (S * C)) * S  # gqakv.context_parallel.Interleaved.capacity
    total = cache_bytes(cfg, max_len=local_len, batch=args.batch, dtype=args.dtype,
                        kv_dtype=kv_dtype)
    budget = _cli_budget(args.budget) if args.budget is not None else None
    rows = _paged_rows(args)  # checked before any output
    codec = _codecs.of(stored)
    item = codec.code_bytes if codec.scaled else _dtypes.itemsize(stored)
    per = cfg.bytes_per_token(args.dtype, kv_dtype)
    what = args.dtype if kv_dtype is None else f"{args.dtype}, K/V stored as {kv_dtype}"
    print(f"{cfg.name}: {cfg.layers} layers, {full.q_heads} query heads, {full.kv_heads} KV heads, "
          f"head dim {cfg.head_dim}, {what}" + (f"  [{cfg.source}]" if cfg.source else ""))
    if P is not None:
        _print_tensor_parallel(full, cfg, P, args, kv_dtype)
    if C is not None:
        _print_context_parallel(full, C, P or 1, local_len, args, kv_dtype)
    if kv_dtype is None:
        print(f"  per token : {per:,} bytes ({human_bytes(per)}) = 2 x {cfg.layers} layers x "
              f"{cfg.kv_heads} KV heads x {cfg.head_dim} x {item} bytes")
    else:
        plain = cfg.bytes_per_token(args.dtype)
        head = codec.bytes_per_token_head(cfg.head_dim, item)
        print(f"  per token : {per:,} bytes ({human_bytes(per)}) = 2 x {cfg.layers} layers x "
              f"{cfg.kv_heads} KV heads x {head} bytes ({codec.describe(cfg.head_dim)}); "
              f"{per / plain:.2f}x of {args.dtype}'s {plain:,}")
    held = "" if C is None else f" ({local_len:,} of each row's tokens on this device)"
    print(f"  cache     : {total:,} bytes ({human_bytes(total)}) for batch {args.batch} x "
          f"max_len {args.max_len:,}{held}")
    if cfg.max_position and args.max_len > cfg.max_position:
        print(f"  note      : max_len {args.max_len:,} exceeds the model's context "
              f"{cfg.max_position:,}")
    if cfg.sliding_window:
        _print_window(cfg, args, kv_dtype)
    if rows is not None:
        _print_paged(cfg, args, rows)
    if budget is not None:
        b = max_batch(cfg, max_len=local_len, budget=budget, dtype=args.dtype, kv_dtype=kv_dtype)
        n = max_len_for(cfg, batch=args.batch, budget=budget, dtype=args.dtype, kv_dtype=kv_dtype)
        if C is not None:  # whole chunks per device, C devices per row
            n = (n // args.cp_chunk) * args.cp_chunk * C
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


def _print_window(cfg: ModelConfig, args, kv_dtype) -> None:
    chunk, P = getattr(args, "chunk", 1), args.page_size
    if chunk < 1:
        raise UsageError(f"--chunk must be >= 1, got {chunk}")
    if P < 1:
        raise UsageError(f"--page-size must be >= 1, got {P}")
    w = window_cache_bytes(cfg, max_len=args.max_len, page_size=P, chunk=chunk, dtype=args.dtype,
                           kv_dtype=kv_dtype)
    kinds = f"{w.sliding_layers} sliding layers (window {w.window:,})" + (
        f" and {w.full_layers} full layers" if w.full_layers else "")
    print(f"  window    : {kinds}; per row at {args.max_len:,} tokens, appends of up to {chunk:,} "
          f"token{'s' if chunk > 1 else ''}, page_size {P}:")
    print(f"              full history  {w.full_history_bytes:,} bytes ({human_bytes(w.full_history_bytes)})")
    print(f"              window-sized  {w.window_bytes:,} bytes ({human_bytes(w.window_bytes)}): a sliding "
          f"layer holds at most {w.pages_sliding:,} pages ({w.pages_sliding * P:,} token slots), "
          f"{w.full_history_bytes / max(1, w.window_bytes):.2f}x less (gqakv.ModelKVCache.for_model("
          f"..., window_storage=True), or ModelKVCache(..., windows=..., storage='contiguous', "
          f"max_chunk={chunk}): rings" + (", its full layers contiguous: max_len slots, not whole pages"
                                          if w.full_layers else "") + ")")


def _print_context_parallel(full: ModelConfig, C: int, P: int, local_len: int, args, kv_dtype) -> None:
    grid = "" if P == 1 else f" (a {P} x {C} grid with the tensor parallelism: {P * C} devices)"
    print(f"  context parallel: {C} devices per row{grid}, interleaved chunks of {args.cp_chunk} tokens: "
          f"each holds {local_len:,} of a {args.max_len:,}-token row; every size below is per device")
    t = context_parallel_traffic(full, C, context=args.max_len, dtype=args.dtype, kv_dtype=kv_dtype,
                                 tensor_parallel=P)
    tot = t.per_token
    print(f"  all-gather: 1 per layer; each device sends {t.all_gather_send_bytes:,} bytes ([Hq, d + 1] "
          f"float32 partials and a flag) and receives {t.all_gather_recv_bytes:,}: "
          f"{tot['all_gather_send_bytes']:,} sent and {tot['all_gather_recv_bytes']:,} "
          f"({human_bytes(tot['all_gather_recv_bytes'])}) received per token over {t.layers} layers")
    ratio = (f"{tot['kv_read_bytes'] / tot['all_gather_recv_bytes']:,.0f}x the received bytes"
             if tot["all_gather_recv_bytes"] else "no all-gather with one device")
    print(f"  K/V read : {tot['kv_read_bytes']:,} bytes ({human_bytes(tot['kv_read_bytes'])}) per device "
          f"to decode one token of a row at {args.max_len:,} tokens ({ratio})")


def _paged_rows(args) -> list[int] | None:
    """``--rows`` as a list of ints (None when not given), or a UsageError naming the flag."""
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
