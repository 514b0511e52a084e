"""Decode and prompt speed on the real model: gqakv's example model against transformers
(sdpa + DynamicCache) and, optionally, llama.cpp on the same weights, in alternating blocks.

    python -m gqakv_examples.real_bench --batch 1 8 --prompt-len 64 --steps 32 --repeats 3
    python -m gqakv_examples.real_bench --batch 1 --blas-threads 1   # also gqakv with 1 BLAS thread
    python -m gqakv_examples.real_bench --llamacpp /path/to/venv-with-llama-cpp/bin/python

gqakv and transformers get the weights of the packaged SmolLM2-135M GGUF file (read once,
dequantized by the ``gguf`` package; transformers' model is built from the same float32
arrays, which the real-model tests prove equal to transformers' own GGUF load). llama.cpp
(``--llamacpp PYTHON``: an interpreter with llama-cpp-python, which gqakv does not depend
on; build it from its PyPI sdist) runs the file itself (``q4_1``) and the same file with
every weight dequantized to float32 by llama.cpp's quantize tool (``f32``), each block in a
process of its own (``llamacpp_bench.py``: B sequences of one context, flash attention,
float16 K/V, 2 threads).

Each block prefills B rows of ``--prompt-len`` tokens in one chunk (timed: prompt tok/s),
then times ``--steps`` greedy decode steps (decode tok/s); blocks alternate the sides
``--repeats`` times so that a load change on a shared machine hits all of them. Reported
per side: median and range over blocks, the per-block decode speed over transformers', how
many rows produced transformers' greedy tokens, and the shares of decode and of prefill
time spent in attention (gqakv: the cache's ``attend``, K/V write + attention, split into
the backend's kernels (``Backend.kernel_entries``) and the host work around them;
transformers: ``DynamicCache.update`` + the sdpa call), with the load average.
Needs torch and transformers (the comparison side only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

#: llama.cpp's side, run by path with the ``--llamacpp`` interpreter (it imports nothing
#: from gqakv).
LLAMACPP_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamacpp_bench.py")


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


def _hf_decode(model, prompts: np.ndarray, steps: int) -> dict:
    """Prefill, then ``steps`` greedy steps with a DynamicCache, each timed; the seconds of
    those steps spent in attention (DynamicCache.update + the sdpa call)."""
    import torch
    from transformers import DynamicCache
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ids = torch.from_numpy(prompts)
    cache = DynamicCache()
    clock, prefill_clock = _Clock(), _Clock()
    cache.update = clock.wrap(prefill_clock.wrap(cache.update))
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = clock.wrap(prefill_clock.wrap(sdpa))
    out = []
    try:
        with torch.no_grad():
            prefill_clock.on = True
            t0 = time.perf_counter()
            logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
            tok = logits.argmax(-1, keepdim=True)
            prefill_clock.on, clock.on = False, True
            t = time.perf_counter()
            for _ in range(steps):
                out.append(tok)
                tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            return {"prefill": t - t0, "decode": time.perf_counter() - t, "tokens": torch.cat(out, 1).numpy(),
                    "attention": clock.seconds, "kernels": None, "prefill_attention": prefill_clock.seconds}
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa


def _llamacpp_decode(python: str, gguf: str, prompts: np.ndarray, steps: int, threads: int) -> dict:
    """llama.cpp's prefill and ``steps`` greedy decode steps, in a process of its own
    (``llamacpp_bench.py`` run by ``python``, which has llama-cpp-python)."""
    import json
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts.tolist(), f)
    try:
        run = subprocess.run([python, LLAMACPP_SCRIPT, "--gguf", gguf,
                              "--prompts", f.name, "--steps", str(steps + 1), "--threads", str(threads)],
                             capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if run.returncode != 0:
        raise RuntimeError(f"llama.cpp side failed (status {run.returncode}): {run.stderr[-2000:]}")
    got = json.loads(run.stdout.strip().splitlines()[-1])
    return {"prefill": got["prefill_seconds"], "decode": got["decode_seconds"],
            "tokens": np.array(got["tokens"])[:, :steps], "attention": None, "kernels": None,
            "prefill_attention": None, "version": got["version"]}


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
    """A cache whose steps' ``attend`` is timed on ``attend["decode"]`` for one-token
    steps and on ``attend["prefill"]`` otherwise; ``kernel_clock`` (the backend's kernels,
    wrapped by the caller) runs during decode steps only."""

    def __init__(self, cache, attend, kernel_clock):
        self._cache, self._attend, self._kernel_clock = cache, attend, kernel_clock

    def step(self, n_new, **options):
        # options: what LlamaModel.forward passes on (rows=, tree=)
        phase = "decode" if int(np.max(n_new)) == 1 else "prefill"
        for name, clock in self._attend.items():
            clock.on = name == phase
        self._kernel_clock.on = phase == "decode"
        return _TimedStep(self._cache.step(n_new, **options), self._attend[phase])

    def __getattr__(self, name):
        return getattr(self._cache, name)


def _gqakv_decode(model, prompts: np.ndarray, steps: int, blas_threads=None) -> dict:
    """Prefill, then ``steps`` greedy steps, each timed; the seconds of those steps in
    attention (the cache's attend: K/V write + attention) and, of that, in the backend's
    kernels (``Backend.kernel_entries``; None where it declares none). ``blas_threads``:
    cap BLAS to this many."""
    import contextlib

    from gqakv.tools.host_time import kernels_wrapped

    from .real_model import generate_text

    attend, kernels = {"decode": _Clock(), "prefill": _Clock()}, _Clock()
    cache = _TimedCache(model.new_cache(prompts.shape[0], prompts.shape[1] + steps + 1), attend, kernels)
    limit = contextlib.nullcontext()
    if blas_threads is not None:
        from threadpoolctl import threadpool_limits

        limit = threadpool_limits(blas_threads, user_api="blas")
    has_kernels = bool(model.backend.kernel_entries())
    with limit, kernels_wrapped(model.backend, kernels.wrap):
        g = generate_text(model, prompts.tolist(), steps + 1, chunk=prompts.shape[1], cache=cache)
    return {"prefill": g.time_to_first_token, "decode": g.decode_seconds, "tokens": np.array(g.tokens)[:, :steps],
            "attention": attend["decode"].seconds, "kernels": kernels.seconds if has_kernels else None,
            "prefill_attention": attend["prefill"].seconds}


def _range(values, fmt="{:.1f}") -> str:
    v = sorted(values)
    return f"{fmt.format(statistics.median(v))} ({fmt.format(v[0])}-{fmt.format(v[-1])})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default=None, help="gqakv backend (default: gqakv's choice)")
    ap.add_argument("--blas-threads", type=int, default=None, metavar="N",
                    help="also time gqakv with BLAS capped to N threads (threadpoolctl), in the same blocks")
    ap.add_argument("--llamacpp", default=None, metavar="PYTHON",
                    help="also time llama.cpp: a Python interpreter that has llama-cpp-python")
    ap.add_argument("--llamacpp-weights", nargs="+", default=["f32", "q4_1"], choices=["f32", "q4_1"],
                    help="llama.cpp's weights: the GGUF file's own (q4_1) and/or all dequantized to float32")
    args = ap.parse_args(argv)

    import subprocess
    import tempfile

    import torch

    from .gguf import GGUFLlamaModel, model_path, read_checkpoint

    path = model_path("smollm2-135m")
    checkpoint = read_checkpoint(path)
    ours = GGUFLlamaModel(checkpoint, dtype="float32", backend=args.backend)
    theirs = _hf_model(checkpoint)
    try:
        from threadpoolctl import threadpool_info

        blas = [f"{i['internal_api']} {i['num_threads']} threads" for i in threadpool_info()
                if i["user_api"] == "blas"]
    except ImportError:
        blas = ["threads unknown (threadpoolctl missing)"]
    sides = ["gqakv"] + ([f"gqakv blas={args.blas_threads}"] if args.blas_threads else []) + ["transformers"]
    workdir = tempfile.TemporaryDirectory()
    llama: dict[str, str] = {}
    if args.llamacpp:
        for w in args.llamacpp_weights:
            if w == "q4_1":
                llama[f"llama.cpp {w}"] = path
            else:  # the same file with every weight dequantized to float32 by llama.cpp's quantize
                f32 = os.path.join(workdir.name, "smollm2-135m-f32.gguf")
                subprocess.run([args.llamacpp, LLAMACPP_SCRIPT, "--to-f32", path, f32], check=True,
                               capture_output=True)
                llama[f"llama.cpp {w}"] = f32
        sides += list(llama)
    print(f"SmolLM2-135M ({os.path.basename(path)}; gqakv and transformers on its float32 dequantized weights), "
          f"prompts of {args.prompt_len} tokens, {args.steps} decode steps, {args.repeats} alternating blocks; "
          f"gqakv backend {ours.backend.name} (BLAS: {', '.join(blas)}), torch {torch.__version__} with "
          f"{torch.get_num_threads()} threads" + (", llama.cpp 2 threads, flash attention, float16 K/V"
                                                 if llama else "")
          + f"; load average {os.getloadavg()[0]:.1f}")
    timeout, note = os.environ.get("OPENBLAS_THREAD_TIMEOUT"), ours.backend.thread_note()
    if timeout:  # it changes every side's BLAS threads: say so beside the numbers
        print(f"OPENBLAS_THREAD_TIMEOUT={timeout}: OpenBLAS's idle workers sleep after 2**{timeout} ticks")
    elif note:
        print(f"note: {note}")
    rng = np.random.default_rng(0)
    for B in args.batch:
        prompts = rng.integers(100, checkpoint.config.vocab_size, (B, args.prompt_len))
        _gqakv_decode(ours, prompts[:, :8], 2)  # warm-up: first touch, JIT, thread pools
        _hf_decode(theirs, prompts[:, :8], 2)
        runs: dict[str, list[dict]] = {s: [] for s in sides}
        loads = []
        for _ in range(args.repeats):  # alternating blocks
            runs["gqakv"].append(_gqakv_decode(ours, prompts, args.steps))
            if args.blas_threads:
                runs[sides[1]].append(_gqakv_decode(ours, prompts, args.steps, blas_threads=args.blas_threads))
            runs["transformers"].append(_hf_decode(theirs, prompts, args.steps))
            for name, gguf in llama.items():
                runs[name].append(_llamacpp_decode(args.llamacpp, gguf, prompts, args.steps, threads=2))
            loads.append(os.getloadavg()[0])
        hf_tokens = runs["transformers"][0]["tokens"]  # the same in every block (greedy)
        print(f"batch {B}, prompt {args.prompt_len}: load average {min(loads):.1f}-{max(loads):.1f}")
        for s in sides:
            r = runs[s]
            decode = [B * args.steps / x["decode"] for x in r]
            prompt = [B * args.prompt_len / x["prefill"] for x in r]
            same = min(sum(bool((a == b).all()) for a, b in zip(x["tokens"], hf_tokens)) for x in r)  # every block
            line = (f"  {s:<17} decode tok/s {_range(decode)}, prompt tok/s {_range(prompt, '{:.0f}')}; "
                    f"rows with transformers' tokens {same}/{B}")
            if s != "transformers":
                ratio = [h["decode"] / x["decode"] for h, x in zip(runs["transformers"], r)]
                line += f"; decode speed / transformers per block {_range(ratio, '{:.2f}')}"
            if r[0]["attention"] is not None:
                share = [x["attention"] / x["decode"] for x in r]
                line += f"; attention {_range([100 * v for v in share], '{:.0f}')}% of decode"
                if r[0]["kernels"] is not None:
                    kern = [100 * x["kernels"] / x["decode"] for x in r]
                    host = [100 * (x["attention"] - x["kernels"]) / x["decode"] for x in r]
                    line += (f" (kernels {_range(kern, '{:.0f}')}%, host {_range(host, '{:.0f}')}%; "
                             f"host per layer {_range([1e6 * (x['attention'] - x['kernels']) / args.steps / checkpoint.config.n_layers for x in r], '{:.0f}')} us)")
            if r[0]["prefill_attention"] is not None:
                # no kernel split: numba sends chunks of more than 8 queries to the NumPy
                # BLAS path, which declares no kernel entries
                share = [100 * x["prefill_attention"] / x["prefill"] for x in r]
                line += f"; attention {_range(share, '{:.0f}')}% of prefill"
            print(line, flush=True)
    workdir.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
