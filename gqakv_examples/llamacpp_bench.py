"""llama.cpp's side of ``real_bench``: prefill and greedy decode of B rows on a GGUF file,
timed, in a process of its own (run by path with a Python that has llama-cpp-python; it
imports nothing from gqakv).

    python gqakv_examples/llamacpp_bench.py --gguf FILE --prompts prompts.json --steps 32
    python gqakv_examples/llamacpp_bench.py --to-f32 IN.gguf OUT.gguf   # dequantize all weights

``prompts.json`` holds a list of B token-id lists of one length. The rows run as B
sequences of one llama.cpp context (llama.cpp's own batched decoding: the prompts as one
batch, then one token per row per ``llama_decode``), flash attention on, a float16 K/V
cache (with flash attention llama.cpp casts an F32 cache to F16 anyway), ``--threads``
threads. Prints one JSON line: prefill seconds, decode seconds, the greedy tokens, the
llama.cpp version and system info.

llama.cpp's AMX / repacked weight buffers are off (``use_extra_bufts = False``, as
llama-cli's ``--no-repack``): on this project's machine its AMX matmul crashes at the first
tile load (see docs/figures/llamacpp_kv_agreement.py). ``OMP_WAIT_POLICY`` is left as the
environment has it: unset, libgomp spins a while before its threads sleep, which is what
llama.cpp's speed needs (on the idle machine ``PASSIVE`` decoded one row at 33 tok/s
instead of 97 on the Q4_1 file); the accuracy script sets ``PASSIVE`` because spinning
stalls on a loaded machine, where speed is not what it measures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def to_f32(src: str, dst: str) -> None:
    """Write ``src`` with every weight dequantized to float32 (llama.cpp's own quantize tool
    with ftype ALL_F32, requantizing allowed)."""
    import llama_cpp as L

    params = L.llama_model_quantize_default_params()
    params.ftype = L.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    params.nthread = 2
    tmp = dst + ".tmp"
    if L.llama_model_quantize(src.encode(), tmp.encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize({src!r} -> {tmp!r}, ALL_F32) failed")
    os.replace(tmp, dst)


def run(gguf: str, prompts: list[list[int]], steps: int, threads: int) -> dict:
    import ctypes

    import llama_cpp as L
    import numpy as np

    B, P = len(prompts), len(prompts[0])
    if any(len(p) != P for p in prompts):
        raise ValueError(f"prompts must share one length, got {sorted({len(p) for p in prompts})}")
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False
    model = L.llama_model_load_from_file(gguf.encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    cp = L.llama_context_default_params()
    cp.n_ctx = B * (P + steps + 8)
    cp.n_batch = cp.n_ubatch = max(512, B)
    cp.n_seq_max = B
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
    cp.type_k = cp.type_v = L.GGML_TYPE_F16
    cp.kv_unified = False  # the rows share nothing
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama.cpp could not make the context")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cap = max(B * P, B)
    batch = L.llama_batch_init(cap, 0, 1)

    def decode(entries):
        """entries: (token, position, row, wants_logits); returns the rows' greedy tokens
        in the order of the entries that want logits."""
        for i, (tok, pos, row, out) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, out
            batch.seq_id[i][0] = row
        batch.n_tokens = len(entries)
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        picked = []
        for i, (_, _, _, out) in enumerate(entries):
            if out:
                logits = np.ctypeslib.as_array(ctypes.cast(L.llama_get_logits_ith(ctx, i),
                                                           ctypes.POINTER(ctypes.c_float)), (n_vocab,))
                picked.append(int(np.argmax(logits)))
        return picked

    def one_pass():
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        rows_per_batch = max(1, cp.n_batch // P)  # whole prompts per llama_decode call
        t0 = time.perf_counter()
        nxt: list[int] = []
        for r0 in range(0, B, rows_per_batch):
            rows = range(r0, min(B, r0 + rows_per_batch))
            if P <= cp.n_batch:
                nxt += decode([(prompts[r][t], t, r, t == P - 1) for r in rows for t in range(P)])
            else:  # a long prompt: n_batch tokens per call
                for r in rows:
                    for s in range(0, P, cp.n_batch):
                        got = decode([(prompts[r][t], t, r, t == P - 1) for t in range(s, min(P, s + cp.n_batch))])
                    nxt += got
        L.llama_synchronize(ctx)
        t1 = time.perf_counter()
        tokens = [[] for _ in range(B)]
        for step in range(steps):
            for r in range(B):
                tokens[r].append(nxt[r])
            if step + 1 < steps:
                nxt = decode([(nxt[r], P + step, r, True) for r in range(B)])
        L.llama_synchronize(ctx)
        return t1 - t0, time.perf_counter() - t1, tokens

    decode([(prompts[0][t], t, 0, t == 7) for t in range(min(8, P))])  # warm-up: first touch of the weights
    prefill_s, decode_s, tokens = one_pass()
    out = {"prefill_seconds": prefill_s, "decode_seconds": decode_s, "tokens": tokens,
           "decode_steps": steps - 1, "version": L.__version__,
           "system_info": L.llama_print_system_info().decode(errors="replace")}
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf")
    ap.add_argument("--prompts", help="a JSON file: B token-id lists of one length")
    ap.add_argument("--steps", type=int, default=32, help="greedy tokens per row (the first comes from prefill)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--to-f32", nargs=2, metavar=("IN", "OUT"))
    args = ap.parse_args(argv)
    if args.to_f32:
        to_f32(*args.to_f32)
        return 0
    if not (args.gguf and args.prompts):
        ap.error("--gguf and --prompts are needed (or --to-f32)")
    with open(args.prompts) as f:
        prompts = json.load(f)
    print(json.dumps(run(args.gguf, prompts, args.steps, args.threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
