"""``gqakv generate``: greedy generation with the example Llama model, cached vs uncached.

Runs a batch of prompts of different lengths through chunked prefill and batched
ragged decode on gqakv's KV cache, then the same generation re-running the full
prefix every step (no cache), and reports time to first token and tokens/s for
both, and whether the greedy tokens agree.
"""

from __future__ import annotations

import math
import time

import numpy as np

from . import real_model
from .llama import CONFIGS, LlamaModel, generate, generate_uncached


def add_arguments(parser) -> None:
    parser.add_argument("--config", choices=sorted(CONFIGS), default="llama3-8b-shaped",
                        help="model shape (default: Llama-3.1-8B layer shapes, fewer layers)")
    parser.add_argument("--layers", type=int, default=None,
                        help="number of decoder layers (default: the config's; 8B-shaped: 2 of 32)")
    parser.add_argument("--vocab", type=int, default=None,
                        help="vocabulary size (default: the config's; 8B-shaped: 32768)")
    parser.add_argument("--tied", action="store_true", help="tie the output head to the embedding")
    parser.add_argument("--batch", type=int, default=4, help="rows (default 4)")
    parser.add_argument("--prompt-len", type=int, default=64,
                        help="longest prompt; rows get ragged lengths down to 1/4 of it (default 64)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated per row (default 16)")
    parser.add_argument("--chunk", type=int, default=32, help="prefill chunk size (default 32)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--backend", default=None, help="gqakv backend (default: gqakv's choice)")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts seed")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the uncached (re-run the full prefix) comparison")
    variants = parser.add_argument_group("attention variants (default: plain causal)")
    variants.add_argument("--window", type=int, default=None, metavar="W",
                          help="sliding window: each query sees the W most recent positions, its own included")
    variants.add_argument("--global-every", type=int, default=None, metavar="K",
                          help="with --window: every K-th layer attends to everything "
                               "(K=2: Gemma 2 / gpt-oss alternation, K=6: Gemma 3)")
    variants.add_argument("--softcap", type=float, default=None, metavar="C",
                          help="soft-cap each scaled attention score s to C * tanh(s / C) (Gemma 2 uses 50)")
    variants.add_argument("--sinks", action="store_true",
                          help="a learned sink logit per query head and layer (gpt-oss), drawn with the weights")
    real_model.add_arguments(parser)  # --model / --gguf: real weights and text (real_model.py)


def _check_variant_options(args, UsageError) -> None:
    if args.window is not None and args.window < 1:
        raise UsageError(f"--window must be >= 1, got {args.window}")
    if args.global_every is not None and (args.global_every < 2 or args.window is None):
        raise UsageError(f"--global-every {args.global_every}: needs --window and a value >= 2 "
                         "(every K-th layer global, the others sliding)")
    if args.softcap is not None and not (math.isfinite(args.softcap) and args.softcap > 0):
        raise UsageError(f"--softcap must be a finite number > 0, got {args.softcap}")


def _prompt_lengths(batch: int, longest: int) -> list[int]:
    """Evenly spread from ``longest`` down to about a quarter of it: ragged rows."""
    if batch == 1:
        return [longest]
    shortest = max(1, longest // 4)
    return [int(round(longest - (longest - shortest) * i / (batch - 1))) for i in range(batch)]


def _say(msg: str) -> None:
    print(msg, flush=True)


def run(args) -> int:
    if real_model.wants_real_model(args):
        return real_model.run(args)
    from gqakv.cli import UsageError
    from gqakv.registry import get_backend

    for name in ("batch", "prompt_len", "new_tokens", "chunk", "layers", "vocab"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    config = CONFIGS[args.config]
    changes = {}
    if args.layers is not None:
        changes["n_layers"] = args.layers
    if args.vocab is not None:
        changes["vocab_size"] = args.vocab
    if args.tied:
        changes["tie_embeddings"] = True
    _check_variant_options(args, UsageError)
    changes.update(sliding_window=args.window, global_every=args.global_every, softcap=args.softcap,
                   sinks=args.sinks)
    config = config.replace(**changes)
    # An unknown backend, or one that cannot run here, fails before any output.
    get_backend(args.backend, dtype=args.dtype, head_dim=config.head_dim)

    _say(f"gqakv generate: {args.config} model, {config.n_layers} layers, {config.n_heads} query / "
         f"{config.n_kv_heads} KV heads, head dim {config.head_dim}, hidden {config.hidden_size}, "
         f"MLP {config.intermediate_size}, vocab {config.vocab_size} "
         f"({config.n_params / 1e6:.1f}M params, {args.dtype}, "
         f"{'tied' if config.tie_embeddings else 'untied'} head)")
    _say(f"  attention: {config.variant}")
    t = time.perf_counter()
    model = LlamaModel(config, seed=args.seed, dtype=args.dtype, backend=args.backend)
    _say(f"  weights drawn from seed {args.seed} in {time.perf_counter() - t:.1f} s; "
         f"backend {model.backend.name}")

    lengths = _prompt_lengths(args.batch, args.prompt_len)
    rng = np.random.default_rng(args.seed + 1)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in lengths]
    _say(f"  {args.batch} rows, prompts of {', '.join(map(str, lengths))} tokens, "
         f"{args.new_tokens} new tokens each, prefill in chunks of {args.chunk}")

    # Warm-up (BLAS threads, first touch of the weights) so neither run pays it.
    generate(model, [prompts[0][:4]], 2)
    generate_uncached(model, [prompts[0][:4]], 2)
    _say("  running with the gqakv KV cache ...")
    cached = generate(model, prompts, args.new_tokens, chunks=args.chunk)
    rows = [("KV cache (gqakv)", cached)]
    if not args.no_baseline:
        _say("  running without a cache (re-running the full prefix every step) ...")
        uncached = generate_uncached(model, prompts, args.new_tokens)
        rows.append(("full prefix each step", uncached))

    print()
    print(f"  {'':<24}{'time to first token':>21}{'decode tokens/s':>18}{'overall tokens/s':>19}")
    for name, g in rows:
        print(f"  {name:<24}{g.time_to_first_token:>19.3f} s{g.decode_tokens_per_s:>18.1f}"
              f"{g.tokens_per_s:>19.1f}")
    print(f"  KV cache: {cached.cache_nbytes / 2**20:.1f} MiB, allocated once")
    if not args.no_baseline:
        same = bool((cached.tokens == uncached.tokens).all())
        diff = float(np.max(np.abs(cached.logits - uncached.logits)))
        speedup = cached.decode_tokens_per_s / uncached.decode_tokens_per_s
        print(f"  decode speedup from the cache: x{speedup:.1f}; greedy tokens identical: "
              f"{'yes' if same else 'NO'}; max |logit difference| {diff:.2e}")
        if not same:
            return 1
    return 0
