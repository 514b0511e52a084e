"""``gqakv generate``: greedy generation with the example Llama model, cached vs uncached.

Runs a batch of prompts of different lengths through chunked prefill and batched
ragged decode on gqakv's KV cache, then the same generation re-running the full
prefix every step (no cache), and reports time to first token and tokens/s for
both, and whether the greedy tokens agree.

``--tensor-parallel P`` splits the model over P processes by heads
(``gqakv.distributed``); start them with torch's launcher, one per device::

    torchrun --standalone --nproc-per-node 2 -m gqakv generate --tensor-parallel 2 --config tiny

Every rank runs the same generation on its shard (all-reducing the projections'
partial sums) and rank 0 prints.

``--context-parallel C`` spreads every row's tokens over C processes
(``gqakv.context_parallel``; with ``--tensor-parallel P`` a P x C grid of P * C
processes)::

    torchrun --standalone --nproc-per-node 2 -m gqakv generate --context-parallel 2 --config tiny
"""

from __future__ import annotations

import math
import time

import numpy as np

import gqakv
from gqakv import distributed
from gqakv.dispatch.registry import get_backend
from gqakv.distributed import HeadShard, even_slice
from gqakv.tools.errors import UsageError

from . import prefix_demo, real_model
from .llama import CONFIGS, LlamaModel, generate, generate_uncached


#: Prefill chunk of ``gqakv generate`` (random or real weights). Each forward call reads every
#: weight once (the 8B-shaped example: 2.8 GB in float32), so a prompt cut into 32-token chunks
#: paid that read once per chunk and reached its first token later than the uncached run,
#: which feeds the whole prompt at once. 512 puts the default prompts in one call.
DEFAULT_CHUNK = 512


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
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK,
                        help=f"prefill chunk: prompt tokens of each row per forward call (default {DEFAULT_CHUNK}). "
                             "Every call reads all the weights once, so fewer, larger chunks reach the first "
                             "token sooner; smaller ones bound the activations' memory")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--backend", default=None, help="gqakv backend (default: gqakv's choice)")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts seed")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the uncached (re-run the full prefix) comparison")
    parser.add_argument("--prefix-cache", type=int, default=None, metavar="N",
                        help="serve two requests sharing an N-token system prompt from a prefix cache: "
                             "the second prefills only its own tokens (time to first token of both, and "
                             "the second against serving it alone)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="batch-invariant mode (gqakv.set_batch_invariant): attention and the model's "
                             "projections (one token row at a time) give a token's logits the same bits "
                             "whatever its chunk or batch (with --prefix-cache: the second request's "
                             "logits bit-identical to serving it alone)")
    parser.add_argument("--tensor-parallel", type=int, default=None, metavar="P",
                        help="split the model by heads over P processes started by torchrun "
                             "(torchrun --standalone --nproc-per-node P -m gqakv generate "
                             "--tensor-parallel P ...); needs torch")
    parser.add_argument("--tp-timeout", type=float, default=300.0, metavar="S",
                        help="with --tensor-parallel: seconds a collective waits for the other "
                             "ranks before failing (default 300)")
    parser.add_argument("--context-parallel", type=int, default=None, metavar="C",
                        help="spread every row's tokens over C processes started by torchrun (decode "
                             "context parallelism, gqakv.context_parallel; with --tensor-parallel P, a "
                             "P x C grid of P * C processes); needs torch")
    parser.add_argument("--cp-chunk", type=int, default=16, metavar="S",
                        help="with --context-parallel: tokens per chunk of the interleaved placement "
                             "(default 16)")
    parser.add_argument("--speculative", type=int, default=None, metavar="N",
                        help="also decode speculatively: an n-gram drafter (prompt lookup) proposes a tree of "
                             "up to N tokens per row per round, the model verifies it in one forward; prints "
                             "the acceptance rate, tokens per target forward, and whether the tokens equal "
                             "plain greedy's")
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


def _refuse_real_model_options(args, UsageError) -> None:
    """--prompt, --chat, --compare-cache and --decode-blas-threads need real weights (and a
    tokenizer): without --model/--gguf they would be ignored while the random-weight demo runs."""
    given = [flag for flag, value in (("--prompt", getattr(args, "prompt", None)),
                                      ("--chat", getattr(args, "chat", False)),
                                      ("--compare-cache", getattr(args, "compare_cache", None)),
                                      ("--decode-blas-threads",
                                       getattr(args, "decode_blas_threads", "auto") != "auto")) if value]
    if given:
        raise UsageError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} a real model: add "
                         "--model smollm2-135m or --gguf PATH (without them gqakv generate runs the example "
                         "model with random weights and no tokenizer)")


def _prompt_lengths(batch: int, longest: int) -> list[int]:
    """Evenly spread from ``longest`` down to about a quarter of it: ragged rows."""
    if batch == 1:
        return [longest]
    shortest = max(1, longest // 4)
    return [int(round(longest - (longest - shortest) * i / (batch - 1))) for i in range(batch)]


def _say(msg: str) -> None:
    print(msg, flush=True)


def _silent(*args, **kwargs) -> None:
    pass


def _tensor_parallel(args, config, UsageError):
    """The TensorParallel of ``--tensor-parallel`` (None without it), the split checked
    against the model before any weight is drawn; with ``--context-parallel``, the
    ``(TensorParallel or None, ContextParallel)`` of the grid."""
    C = getattr(args, "context_parallel", None)
    if C is not None:
        return _context_parallel(args, config, UsageError)
    P = args.tensor_parallel
    if P is None:
        return None
    if P < 1:
        raise UsageError(f"--tensor-parallel must be >= 1, got {P}")
    if not (math.isfinite(args.tp_timeout) and args.tp_timeout > 0):
        raise UsageError(f"--tp-timeout must be a finite number of seconds > 0, got {args.tp_timeout}")
    try:  # the same split on every rank: refuse it before joining the group
        HeadShard.plan(config.n_heads, config.n_kv_heads, P)
        even_slice(config.intermediate_size, P, 0, "intermediate_size")
    except ValueError as exc:
        raise UsageError(f"--tensor-parallel {P}: {exc}") from None
    try:
        import torch
    except ImportError as exc:
        raise UsageError(f"--tensor-parallel needs torch.distributed: {exc}") from None
    # GPU arrays (torch on CUDA, CuPy) communicate over NCCL, host arrays over gloo.
    name = get_backend(args.backend, dtype=args.dtype, head_dim=config.head_dim).name
    gpu = name in ("torch", "cupy") and torch.cuda.is_available()
    return distributed.init(P, device_kind="cuda" if gpu else "cpu", timeout_s=args.tp_timeout)


def _context_parallel(args, config, UsageError):
    """``(TensorParallel or None, ContextParallel)`` of ``--context-parallel C`` (and
    ``--tensor-parallel P``): P * C processes, everything checked before joining."""
    import os

    C, P = args.context_parallel, args.tensor_parallel or 1
    if C < 1:
        raise UsageError(f"--context-parallel must be >= 1, got {C}")
    if P < 1:
        raise UsageError(f"--tensor-parallel must be >= 1, got {P}")
    if args.cp_chunk < 1:
        raise UsageError(f"--cp-chunk must be >= 1, got {args.cp_chunk}")
    if not (math.isfinite(args.tp_timeout) and args.tp_timeout > 0):
        raise UsageError(f"--tp-timeout must be a finite number of seconds > 0, got {args.tp_timeout}")
    try:
        HeadShard.plan(config.n_heads, config.n_kv_heads, P)
        even_slice(config.intermediate_size, P, 0, "intermediate_size")
    except ValueError as exc:
        raise UsageError(f"--tensor-parallel {P}: {exc}") from None
    launch = (f"torchrun --nproc-per-node {P * C} -m gqakv generate --context-parallel {C}"
              + ("" if P == 1 else f" --tensor-parallel {P}"))
    world = os.environ.get("WORLD_SIZE") if "RANK" in os.environ else None
    if world is None and P * C > 1:
        raise UsageError(f"--context-parallel {C} x --tensor-parallel {P} needs {P * C} processes started "
                         f"by a launcher, e.g. {launch} ... (no RANK/WORLD_SIZE in this process's environment)")
    if world is not None and int(world) != P * C:
        raise UsageError(f"--context-parallel {C} x --tensor-parallel {P} needs {P * C} processes, but the "
                         f"launcher started WORLD_SIZE={world} ({launch} ...)")
    try:
        import torch
    except ImportError as exc:
        raise UsageError(f"--context-parallel needs torch.distributed: {exc}") from None
    from gqakv import context_parallel

    name = get_backend(args.backend, dtype=args.dtype, head_dim=config.head_dim).name
    gpu = name in ("torch", "cupy") and torch.cuda.is_available()
    distributed.init(P * C, device_kind="cuda" if gpu else "cpu", timeout_s=args.tp_timeout)
    return context_parallel.grid(P, C, chunk=args.cp_chunk)


def run(args) -> int:
    if getattr(args, "batch_invariant", False):
        with gqakv.batch_invariant():
            return _dispatch(args)
    return _dispatch(args)


def _dispatch(args) -> int:
    if real_model.wants_real_model(args):
        if getattr(args, "context_parallel", None) is not None:
            raise UsageError("--context-parallel runs the example model (random weights, --config); "
                             "it does not split --model / --gguf")
        if getattr(args, "tensor_parallel", None) is not None:
            raise UsageError("--tensor-parallel runs the example model (random weights, --config); "
                             "it does not split --model / --gguf")
        return real_model.run(args)
    _refuse_real_model_options(args, UsageError)
    for name in ("batch", "prompt_len", "new_tokens", "chunk", "layers", "vocab", "prefix_cache", "speculative"):
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
    if args.page_size is not None and args.page_size < 1:
        raise UsageError(f"--page-size must be >= 1, got {args.page_size}")
    cache_options = {k: v for k, v in (("page_size", args.page_size), ("kv_dtype", args.kv_dtype))
                     if v is not None}
    tp = _tensor_parallel(args, config, UsageError)
    try:
        return _run(args, config, tp, cache_options)
    finally:
        if tp is not None:
            import torch.distributed as dist

            dist.destroy_process_group()


def _run(args, config, tp, cache_options) -> int:
    cp = None
    if isinstance(tp, tuple):  # --context-parallel: (TensorParallel or None, ContextParallel)
        tp, cp = tp
    first = (tp is None or tp.rank == 0) and (cp is None or cp.rank == 0)
    speaks = first  # under tensor / context parallelism rank 0 prints, the others compute
    say = _say if speaks else _silent
    out = print if speaks else _silent
    say(f"gqakv generate: {args.config} model, {config.n_layers} layers, {config.n_heads} query / "
        f"{config.n_kv_heads} KV heads, head dim {config.head_dim}, hidden {config.hidden_size}, "
        f"MLP {config.intermediate_size}, vocab {config.vocab_size} "
        f"({config.n_params / 1e6:.1f}M params, {args.dtype}, "
        f"{'tied' if config.tie_embeddings else 'untied'} head)")
    say(f"  attention: {config.variant}")
    t = time.perf_counter()
    model = LlamaModel(config, seed=args.seed, dtype=args.dtype, backend=args.backend, tensor_parallel=tp,
                       context_parallel=cp)
    say(f"  weights drawn from seed {args.seed} in {time.perf_counter() - t:.1f} s; "
        f"backend {model.backend.name}")
    if tp is not None:
        F = config.intermediate_size // tp.world_size
        say(f"  tensor parallel: {tp.world_size} ranks ({tp.comm_backend}); {model.shard}; "
            f"MLP columns {tp.rank * F}..{(tp.rank + 1) * F - 1}; 2 all-reduces of "
            f"[B, T, {config.hidden_size}] per layer")
    if cp is not None:
        say(f"  context parallel: {cp.world_size} ranks per row ({cp.comm_backend}), interleaved chunks of "
            f"{cp.chunk} tokens; rank {cp.rank}/{cp.world_size} holds positions "
            f"{cp.rank * cp.chunk}..{(cp.rank + 1) * cp.chunk - 1} of every {cp.chunk * cp.world_size}; "
            f"1 all-gather of [B, {model.local_heads}, T, {config.head_dim + 1}] per layer")

    rng = np.random.default_rng(args.seed + 1)
    if args.prefix_cache is not None:
        if tp is not None or cp is not None:
            raise UsageError("--prefix-cache runs in one process (no --tensor-parallel or --context-parallel)")
        system = rng.integers(0, config.vocab_size, args.prefix_cache).tolist()
        questions = [rng.integers(0, config.vocab_size, n).tolist() for n in (24, 17)]
        return prefix_demo.run(model, system, questions, args.new_tokens, args.chunk, say=say)
    lengths = _prompt_lengths(args.batch, args.prompt_len)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in lengths]
    calls = math.ceil(max(lengths) / args.chunk)
    prefill = (f"prefill in one forward call (--chunk {args.chunk} covers the longest prompt)" if calls == 1 else
               f"prefill in {calls} forward calls of up to {args.chunk} tokens per row (each call reads every "
               "weight once, so the first token comes later than with one call)")
    say(f"  {args.batch} rows, prompts of {', '.join(map(str, lengths))} tokens, "
        f"{args.new_tokens} new tokens each, {prefill}")

    # Warm-up (BLAS threads, first touch of the weights) so neither run pays it.
    generate(model, [prompts[0][:4]], 2)
    generate_uncached(model, [prompts[0][:4]], 2)
    say("  running with the gqakv KV cache ...")
    gathered0 = 0 if cp is None else cp.bytes_gathered
    cached = generate(model, prompts, args.new_tokens, chunks=args.chunk, cache_options=cache_options)
    rows = [("KV cache (gqakv)", cached)]
    if not args.no_baseline:
        say("  running without a cache (re-running the full prefix every step) ...")
        uncached = generate_uncached(model, prompts, args.new_tokens)
        rows.append(("full prefix each step", uncached))

    out()
    out(f"  {'':<24}{'time to first token':>21}{'decode tokens/s':>18}{'overall tokens/s':>19}")
    for name, g in rows:
        out(f"  {name:<24}{g.time_to_first_token:>19.3f} s{g.decode_tokens_per_s:>18.1f}"
            f"{g.tokens_per_s:>19.1f}")
    ranks = (1 if tp is None else tp.world_size) * (1 if cp is None else cp.world_size)
    per = "" if ranks == 1 else f" on each of {ranks} ranks"
    out(f"  KV cache: {cached.cache_nbytes / 2**20:.1f} MiB{per}, allocated once")
    if cp is not None:
        out(f"  all-gathered by this rank during the cached run: {cp.bytes_gathered - gathered0:,} bytes "
            f"({cp.gathers} all-gathers so far)")
    if not args.no_baseline:
        same = bool((cached.tokens == uncached.tokens).all())
        diff = float(np.max(np.abs(cached.logits - uncached.logits)))
        speedup = cached.decode_tokens_per_s / uncached.decode_tokens_per_s
        out(f"  decode speedup from the cache: x{speedup:.1f}; greedy tokens identical: "
            f"{'yes' if same else 'NO'}; max |logit difference| {diff:.2e}")
        if not same:
            return 1
    if getattr(args, "speculative", None) is not None:
        if tp is not None or cp is not None:
            raise UsageError("--speculative runs in one process (no --tensor-parallel or --context-parallel)")
        return _speculative(model, prompts, args.new_tokens, args.speculative, cached, out, cache_options)
    return 0


def _speculative(model, prompts, new_tokens, max_draft, plain, out, cache_options) -> int:
    """``--speculative N``: the same prompts decoded speculatively (n-gram draft trees)."""
    from .speculative import speculative_generate

    spec = speculative_generate(model, prompts, new_tokens, max_draft=max_draft, cache_options=cache_options)
    same = bool((spec.tokens == plain.tokens).all())
    out(f"  speculative (n-gram drafts, up to {max_draft} tokens per row per round): "
        f"{spec.target_forwards} target forwards after prefill for {new_tokens - 1} tokens per row; "
        f"acceptance rate {spec.acceptance_rate:.2f} ({spec.accepted}/{spec.drafted} draft tokens); "
        f"{spec.tokens_per_forward:.2f} tokens per target forward; decode {spec.decode_seconds:.3f} s "
        f"(plain {plain.decode_seconds:.3f} s); tokens identical to plain greedy: {'yes' if same else 'NO'}")
    return 0 if same else 1
