"""Decode speed on the real model: gqakv's example model against transformers (sdpa +
DynamicCache) on the same weights, in alternating blocks.

    python -m gqakv.examples.real_bench --batch 1 8 --prompt-len 64 --steps 32 --repeats 3

Both sides get the weights of the packaged SmolLM2-135M GGUF file (read once, dequantized
by the ``gguf`` package; transformers' model is built from the same float32 arrays, which
the real-model tests prove equal to transformers' own GGUF load). Each block prefills B
rows of ``--prompt-len`` tokens (not timed), then times ``--steps`` greedy decode steps;
blocks alternate gqakv / transformers ``--repeats`` times so that a load change on a
shared machine hits both, and the median of each is reported with the per-block ratio.
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


def _hf_decode(model, prompts: np.ndarray, steps: int) -> tuple[float, np.ndarray]:
    """Prefill (untimed), then ``steps`` greedy steps with a DynamicCache: seconds, tokens."""
    import torch
    from transformers import DynamicCache

    ids = torch.from_numpy(prompts)
    cache = DynamicCache()
    out = []
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
        tok = logits.argmax(-1, keepdim=True)
        t = time.perf_counter()
        for _ in range(steps):
            out.append(tok)
            tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - t, torch.cat(out, 1).numpy()


def _gqakv_decode(model, prompts: np.ndarray, steps: int) -> tuple[float, np.ndarray]:
    from .real_model import generate_text

    g = generate_text(model, prompts.tolist(), steps + 1, chunk=prompts.shape[1])
    return g.decode_seconds, np.array(g.tokens)[:, :steps]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default=None, help="gqakv backend (default: gqakv's choice)")
    args = ap.parse_args(argv)

    import torch

    from .gguf import GGUFLlamaModel, model_path, read_checkpoint

    checkpoint = read_checkpoint(model_path("smollm2-135m"))
    ours = GGUFLlamaModel(checkpoint, dtype="float32", backend=args.backend)
    theirs = _hf_model(checkpoint)
    print(f"SmolLM2-135M float32, prompts of {args.prompt_len} tokens, {args.steps} decode steps; "
          f"gqakv backend {ours.backend.name}, torch {torch.__version__} with {torch.get_num_threads()} threads")
    print(f"{'batch':>5} {'gqakv tok/s':>12} {'transformers tok/s':>19} {'gqakv speedup (median)':>25}  same tokens")
    rng = np.random.default_rng(0)
    for B in args.batch:
        prompts = rng.integers(100, checkpoint.config.vocab_size, (B, args.prompt_len))
        _gqakv_decode(ours, prompts[:, :8], 2)  # warm-up: first touch, JIT, thread pools
        _hf_decode(theirs, prompts[:, :8], 2)
        ours_s, theirs_s, ratios, same = [], [], [], True
        for _ in range(args.repeats):  # alternating blocks
            s1, t1 = _gqakv_decode(ours, prompts, args.steps)
            s2, t2 = _hf_decode(theirs, prompts, args.steps)
            ours_s.append(s1)
            theirs_s.append(s2)
            ratios.append(s2 / s1)
            same &= bool((t1 == t2).all())
        tok = B * args.steps
        print(f"{B:>5} {tok / statistics.median(ours_s):>12.1f} {tok / statistics.median(theirs_s):>19.1f} "
              f"{statistics.median(ratios):>25.2f}  {'yes' if same else 'NO'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
