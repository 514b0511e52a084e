"""Decode speed on the real model: gqakv's example model against transformers (sdpa +
DynamicCache) on the same weights, in alternating blocks.

    python -m gqakv_examples.real_bench --batch 1 8 --prompt-len 64 --steps 32 --repeats 3
    python -m gqakv_examples.real_bench --batch 1 --blas-threads 1   # also gqakv with 1 BLAS thread

Both sides get the weights of the packaged SmolLM2-135M GGUF file (read once, dequantized
by the ``gguf`` package; transformers' model is built from the same float32 arrays, which
the real-model tests prove equal to transformers' own GGUF load). Each block prefills B
rows of ``--prompt-len`` tokens (not timed), then times ``--steps`` greedy decode steps;
blocks alternate gqakv / transformers ``--repeats`` times so that a load change on a
shared machine hits both; each side's median and range of tokens/s, the range of the
per-block speedup and the share of a decode step spent in attention (gqakv: the cache's
``attend``, K/V write + attention; transformers: ``DynamicCache.update`` + the sdpa call)
are reported with the load average.
Needs torch and transformers (the comparison side only).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def _hf_model(checkpoint):
    """A transformers LlamaForCausalLM holding the checkpoint's float32 weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    c = checkpoint.config
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
                      num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_eps,
                      rope_theta=c.rope_theta, tie_word_embeddings=c.tie_embeddings,
                      max_position_embeddings=8192)
    model = LlamaForCausalLM(cfg).eval()
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj", "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    sd = {"model.embed_tokens.weight": checkpoint.tensors["embed"],
          "model.norm.weight": checkpoint.tensors["final_norm"]}
    for i, layer in enumerate(checkpoint.layers):
        for key, hf in names.items():
            w = layer[key]
            sd[f"model.layers.{i}.{hf}.weight"] = w if w.ndim == 1 else w.T  # back to [out, in]
    if not c.tie_embeddings:
        sd["lm_head.weight"] = checkpoint.tensors["head"].T
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()},
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.set_attn_implementation("sdpa")
    return model


class _Clock:
    """Wraps a callable and adds the wall time spent inside it to ``seconds`` while ``on``."""

    def __init__(self):
        self.seconds, self.on = 0.0, False

    def wrap(self, fn):
        def timed(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t
        return timed


def _hf_decode(model, prompts: np.ndarray, steps: int) -> tuple[float, np.ndarray, float]:
    """Prefill (untimed), then ``steps`` greedy steps with a DynamicCache: seconds, tokens,
    and the seconds of those steps spent in attention (DynamicCache.update + the sdpa call)."""
    import torch
    from transformers import DynamicCache
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ids = torch.from_numpy(prompts)
    cache = DynamicCache()
    clock = _Clock()
    cache.update = clock.wrap(cache.update)
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = clock.wrap(sdpa)
    out = []
    try:
        with torch.no_grad():
            logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
            tok = logits.argmax(-1, keepdim=True)
            clock.on = True
            t = time.perf_counter()
            for _ in range(steps):
                out.append(tok)
                tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            return time.perf_counter() - t, torch.cat(out, 1).numpy(), clock.seconds
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa


class _TimedStep:
    """A ModelKVCache step whose ``attend`` (K/V write + attention) is timed."""

    def __init__(self, step, clock):
        # used with or without ``with`` (LlamaModel.forward commits or aborts the step itself)
        self._step, self._clock = step, clock
        self.attend = clock.wrap(step.attend)

    def __enter__(self):
        self._step.__enter__()
        return self

    def __exit__(self, *exc):
        return self._step.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._step, name)


class _TimedCache:
    def __init__(self, cache, clock):
        self._cache, self._clock = cache, clock

    def step(self, n_new, **options):
        # Prefill (T > 1) untimed: only decode steps count toward the attention share.
        # options: what LlamaModel.forward passes on (rows=, tree=)
        self._clock.on = int(np.max(n_new)) == 1
        return _TimedStep(self._cache.step(n_new, **options), self._clock)

    def __getattr__(self, name):
        return getattr(self._cache, name)


def _gqakv_decode(model, prompts: np.ndarray, steps: int, blas_threads=None) -> tuple[float, np.ndarray, float]:
    """Prefill (untimed), then ``steps`` greedy steps: seconds, tokens, seconds in attention
    (the cache's attend: K/V write + attention). ``blas_threads``: cap BLAS to this many."""
    import contextlib

    from .real_model import generate_text

    clock = _Clock()
    cache = _TimedCache(model.new_cache(prompts.shape[0], prompts.shape[1] + steps + 1), clock)
    limit = contextlib.nullcontext()
    if blas_threads is not None:
        from threadpoolctl import threadpool_limits

        limit = threadpool_limits(blas_threads, user_api="blas")
    with limit:
        g = generate_text(model, prompts.tolist(), steps + 1, chunk=prompts.shape[1], cache=cache)
    return g.decode_seconds, np.array(g.tokens)[:, :steps], clock.seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default=None, help="gqakv backend (default: gqakv's choice)")
    ap.add_argument("--blas-threads", type=int, default=None, metavar="N",
                    help="also time gqakv with BLAS capped to N threads (threadpoolctl), in the same blocks")
    args = ap.parse_args(argv)

    import os

    import torch

    from .gguf import GGUFLlamaModel, model_path, read_checkpoint

    checkpoint = read_checkpoint(model_path("smollm2-135m"))
    ours = GGUFLlamaModel(checkpoint, dtype="float32", backend=args.backend)
    theirs = _hf_model(checkpoint)
    try:
        from threadpoolctl import threadpool_info

        blas = [f"{i['internal_api']} {i['num_threads']} threads" for i in threadpool_info()
                if i["user_api"] == "blas"]
    except ImportError:
        blas = ["threads unknown (threadpoolctl missing)"]
    print(f"SmolLM2-135M float32, prompts of {args.prompt_len} tokens, {args.steps} decode steps, {args.repeats} "
          f"alternating blocks; gqakv backend {ours.backend.name} (BLAS: {', '.join(blas)}), torch "
          f"{torch.__version__} with {torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.1f}")
    sides = ["gqakv"] + ([f"gqakv blas={args.blas_threads}"] if args.blas_threads else []) + ["transformers"]
    rng = np.random.default_rng(0)
    for B in args.batch:
        prompts = rng.integers(100, checkpoint.config.vocab_size, (B, args.prompt_len))
        _gqakv_decode(ours, prompts[:, :8], 2)  # warm-up: first touch, JIT, thread pools
        _hf_decode(theirs, prompts[:, :8], 2)
        secs: dict[str, list[float]] = {s: [] for s in sides}
        attn: dict[str, list[float]] = {s: [] for s in sides}
        same, loads = True, []
        for _ in range(args.repeats):  # alternating blocks
            runs = {"gqakv": _gqakv_decode(ours, prompts, args.steps)}
            if args.blas_threads:
                runs[sides[1]] = _gqakv_decode(ours, prompts, args.steps, blas_threads=args.blas_threads)
            runs["transformers"] = _hf_decode(theirs, prompts, args.steps)
            for s, (sec, toks, att) in runs.items():
                secs[s].append(sec)
                attn[s].append(att / sec)
                same &= bool((toks == runs["transformers"][1]).all())
            loads.append(os.getloadavg()[0])
        tok = B * args.steps
        print(f"batch {B}, prompt {args.prompt_len}: load average {min(loads):.1f}-{max(loads):.1f}; "
              f"same tokens: {'yes' if same else 'NO'}")
        for s in sides:
            rate = sorted(tok / x for x in secs[s])
            ratio = sorted(t / x for t, x in zip(secs["transformers"], secs[s]))
            print(f"  {s:<17} tok/s median {statistics.median(rate):7.1f} range {rate[0]:.1f}-{rate[-1]:.1f}; "
                  f"attention {100 * min(attn[s]):.0f}-{100 * max(attn[s]):.0f}% of a step"
                  + ("" if s == "transformers" else
                     f"; speedup over transformers per block {ratio[0]:.2f}-{ratio[-1]:.2f}x"
                     f" (median {statistics.median(ratio):.2f})"), flush=True)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
