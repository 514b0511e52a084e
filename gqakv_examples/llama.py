"""A Llama-architecture decoder whose attention runs through gqakv.

Written once against the array API (``xp``), so it runs on any gqakv backend
(numpy, torch, array_api_strict): token embedding, per layer RMSNorm -> GQA
attention with RoPE -> residual -> RMSNorm -> SwiGLU MLP -> residual, final RMSNorm,
and a tied or untied output head. Weights are drawn from a fixed seed (no checkpoint
is needed or loaded).

Attention variants (off by default; ``LlamaConfig`` fields, ``gqakv generate`` options):
a sliding window of W keys (``sliding_window``) on every layer or, with ``global_every=K``,
on all but every K-th layer (Gemma 2 and gpt-oss: K = 2; Gemma 3: K = 6), logit
soft-capping (``softcap``) and learned per-head sink logits (``sinks``), passed to
gqakv per layer as an ``AttentionParams`` (see ``gqakv.core.semantics`` for the formulas).

Tensor parallel (``tensor_parallel=``, a ``gqakv.distributed.TensorParallel``): every rank
draws the same full weights from the seed and keeps its shard: the Q/K/V columns of its
heads (``HeadShard``) and its ``F / P`` gate/up columns (column-parallel), the matching
rows of the attention output and MLP down projections (row-parallel, their partial sums
joined by one all-reduce each), the embedding, norms and head whole. Attention runs on
the rank's own heads through its own ``ModelKVCache`` (``new_cache``), so the logits
equal one process's up to the order of the all-reduce's sums; a step that fails on one
rank aborts on all of them (``gqakv.distributed.StepGuard``).

Context parallel (``context_parallel=``, a ``gqakv.context_parallel.ContextParallel``): every
rank of a CP group keeps the same weights (its TP shard's, in a TP x CP grid) and the same
activations; its cache (``new_cache``) holds the tokens the interleaved placement deals
it, each layer's attention is this rank's partial ``(out, lse)`` over them, and one
all-gather per layer merges the C parts (sinks applied once, after the merge:
``ContextParallelGuard.gather_attention``). A failure on any rank of the grid aborts the
step everywhere.

Two forward passes share every weight and op except attention:

- ``forward`` (cached): the new tokens of each row are written to the model-wide
  ``gqakv.ModelKVCache`` at the row's length (one step per forward), and RoPE positions continue from that length, so a prompt can be
  prefilled in any chunks and rows of different lengths decode in one batch.
- ``forward_uncached``: the whole sequence at once with plain causal attention
  written directly here (no gqakv), the reference the cached path must reproduce and
  the "re-run the full prefix every step" baseline of ``gqakv generate``.

Shapes: B rows, T new tokens per call (entry b's first ``n_new[b]`` are real, the rest
padding), S full sequence length, D hidden size, Hq query heads, Hkv KV heads,
G = Hq // Hkv, d head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

import gqakv
from gqakv.core import invariance
from gqakv.distributed import rank_backend

from . import few_rows


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int  # V
    hidden_size: int  # D
    n_layers: int
    n_heads: int  # Hq
    n_kv_heads: int  # Hkv
    head_dim: int  # d
    intermediate_size: int  # F
    rope_theta: float = 500_000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    # Attention variants (None/False: plain causal attention).
    sliding_window: int | None = None  # W: a query sees the W most recent positions, its own included
    global_every: int | None = None  # K: layers K-1, 2K-1, ... attend to everything (need sliding_window)
    softcap: float | None = None  # c: each scaled score s becomes c * tanh(s / c)
    sinks: bool = False  # a learned sink logit per query head and layer (drawn with the weights)

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        for name, low in (("sliding_window", 1), ("global_every", 2)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{name}={value!r} must be None or an int >= {low}")
        if self.global_every is not None and self.sliding_window is None:
            raise ValueError(f"global_every={self.global_every} alternates sliding and global layers; "
                             "it needs a sliding_window")
        c = self.softcap
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                              or not (math.isfinite(c) and c > 0)):
            raise ValueError(f"softcap={self.softcap!r} must be None or a finite number > 0")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it attends to every earlier position).
        With ``global_every=K`` layer i is global when (i + 1) % K == 0, as Gemma's and gpt-oss's
        ``layer_types`` are laid out (sliding first)."""
        if self.sliding_window is None:
            return None
        if self.global_every is not None and (layer + 1) % self.global_every == 0:
            return None
        return self.sliding_window

    @property
    def variant(self) -> str:
        """A readable summary of the attention variants, e.g. ``"window 8 (every 2nd layer global), softcap 20"``."""
        parts = []
        if self.sliding_window is not None:
            parts.append(f"window {self.sliding_window}" + (
                "" if self.global_every is None else f" (every {_ordinal(self.global_every)} layer global)"))
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:g}")
        if self.sinks:
            parts.append("sinks")
        return ", ".join(parts) or "plain causal"

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    @property
    def n_params(self) -> int:
        D, F, V, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        attn = D * d * (self.n_heads * 2 + self.n_kv_heads * 2) + (self.n_heads if self.sinks else 0)
        per_layer = attn + 3 * D * F + 2 * D
        return V * D * (1 if self.tie_embeddings else 2) + self.n_layers * per_layer + D


def _ordinal(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


#: A few-thousand-parameter model for tests: 8 query heads over 2 KV heads (G = 4).
TINY = LlamaConfig(vocab_size=97, hidden_size=32, n_layers=2, n_heads=8, n_kv_heads=2,
                   head_dim=8, intermediate_size=64, rope_theta=10_000.0, tie_embeddings=False)

#: Llama-3.1-8B's layer shapes (32 query heads, 8 KV heads, head dim 128, hidden 4096,
#: MLP 14336, RoPE theta 500000, untied head) with 2 of its 32 layers and a 32k
#: vocabulary instead of 128,256 so it fits and runs on a laptop CPU. The Llama 3.1
#: long-context RoPE frequency rescaling is not modelled (plain RoPE).
LLAMA31_8B_SHAPED = LlamaConfig(vocab_size=32_768, hidden_size=4096, n_layers=2, n_heads=32,
                                n_kv_heads=8, head_dim=128, intermediate_size=14_336,
                                rope_theta=500_000.0, rms_eps=1e-5, tie_embeddings=False)

CONFIGS = {"tiny": TINY, "llama3-8b-shaped": LLAMA31_8B_SHAPED}


def causal_attention(xp, q, k, v, scale: float, *, window: int | None = None,
                     softcap: float | None = None, sinks=None):
    """Causal GQA attention over a whole sequence, no cache (the reference path).

    q ``[B, Hq, S, d]``, k, v ``[B, Hkv, S, d]`` -> ``[B, Hq, S, d]``. Query head h reads
    KV head h // G; query i sees keys 0..i, or ``max(0, i - window + 1)..i`` with a
    window. ``softcap``: each scaled score s becomes ``softcap * tanh(s / softcap)``
    before the mask. ``sinks``: ``[Hq]`` logits (an array of ``xp``) added to each
    softmax denominator as ``e^{sink_h}``, with no value. Right-padded rows are fine: a
    real query never sees a key after it.
    """
    B, Hq, S, d = (int(s) for s in q.shape)
    Hkv = int(k.shape[1])
    G = Hq // Hkv
    dev = getattr(q, "device", None)
    q5 = xp.reshape(q, (B, Hkv, G, S, d))
    k5 = xp.expand_dims(k, axis=2)  # [B, Hkv, 1, S, d] broadcasts over the G query heads
    v5 = xp.expand_dims(v, axis=2)
    scores = (q5 @ xp.matrix_transpose(k5)) * scale  # [B, Hkv, G, S, S]
    if softcap is not None:
        scores = xp.tanh(scores / softcap) * softcap
    pos = xp.arange(S, device=dev)
    visible = pos[None, :] <= pos[:, None]  # [S query, S key]
    if window is not None:
        visible = visible & (pos[None, :] > pos[:, None] - window)
    neg_inf = xp.asarray(-math.inf, dtype=scores.dtype, device=dev)
    scores = xp.where(visible, scores, neg_inf)
    m = xp.max(scores, axis=-1, keepdims=True)  # finite: a query always sees its own key
    if sinks is not None:
        sink = xp.reshape(sinks, (1, Hkv, G, 1, 1))
        m = xp.maximum(m, sink)  # the sink joins the max, so e^{sink - m} cannot overflow
    p = xp.exp(scores - m)
    denom = xp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + xp.exp(sink - m)
    return xp.reshape((p @ v5) / denom, (B, Hq, S, d))


class LlamaModel:
    """Llama decoder with weights drawn from ``seed``, on a gqakv backend.

    Args:
        config: a LlamaConfig (``TINY``, ``LLAMA31_8B_SHAPED`` or your own).
        seed: weights are a deterministic function of (config, seed).
        dtype: "float32" or "float64".
        backend: a gqakv backend (name or instance); None uses gqakv's choice.
        tensor_parallel: None (one process), or a ``gqakv.distributed.TensorParallel``:
            this rank keeps its shard of the weights (the module docstring says which).
        context_parallel: None, or a ``gqakv.context_parallel.ContextParallel``: this rank
            holds its slice of every row's tokens (with a TP x CP grid, its ``tp`` is the
            tensor parallelism).
    """

    def __init__(self, config: LlamaConfig, *, seed: int = 0, dtype="float32", backend=None,
                 tensor_parallel=None, context_parallel=None):
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype={dtype!r}: the example model runs in float32 or float64")
        self.config = c = config
        self.dtype = dtype
        self.cp = context_parallel
        if context_parallel is not None and context_parallel.tp is not None:
            if tensor_parallel is not None and tensor_parallel is not context_parallel.tp:
                raise ValueError("tensor_parallel= must be the context_parallel's own TensorParallel "
                                 "(gqakv.context_parallel.grid returns both)")
            tensor_parallel = context_parallel.tp
        self.tp = tp = tensor_parallel
        # Checked before anything is drawn: the head split and the MLP columns.
        self.shard = None if tp is None else tp.heads(c.n_heads, c.n_kv_heads)
        mlp = slice(None) if tp is None else tp.columns(c.intermediate_size, "intermediate_size")
        if (tp is not None or self.cp is not None) and not isinstance(backend, gqakv.Backend):  # this rank's device
            backend = rank_backend(backend, dtype=dtype, head_dim=c.head_dim)
        self.backend = gqakv.get_backend(backend, dtype=dtype, head_dim=c.head_dim)
        self.xp = self.backend.namespace()
        whole = slice(None)
        d = c.head_dim
        q_cols = kv_cols = whole
        if self.shard is not None:  # this rank's heads' columns of Q, K, V (rows of the output)
            q_cols = slice(self.shard.q_start * d, self.shard.q_stop * d)
            kv_cols = slice(self.shard.kv_start * d, self.shard.kv_stop * d)
        #: Heads this process computes (all of them without tensor parallelism).
        self.local_heads = c.n_heads if self.shard is None else self.shard.local_heads
        self.local_kv_heads = c.n_kv_heads if self.shard is None else self.shard.local_kv_heads
        rng = np.random.default_rng(seed)

        def uniform(shape, std, rows=whole, cols=whole):  # uniform: ~3x faster to draw than normal
            w = rng.random(shape, dtype=np.float32)  # the full matrix on every rank: same stream
            w -= np.float32(0.5)
            w *= np.float32(std * math.sqrt(12.0))
            return self.backend.from_numpy(np.ascontiguousarray(w[rows, cols]), dtype)

        def dense(fan_in, fan_out, rows=whole, cols=whole):  # [in, out], unit-variance outputs
            # NumPy float32 in Fortran order: each output's weights contiguous (few_rows)
            return few_rows.column_major(uniform((fan_in, fan_out), 1.0 / math.sqrt(fan_in), rows, cols))

        def norm_weight():
            return self.backend.from_numpy(1.0 + 0.1 * rng.standard_normal(c.hidden_size), dtype)

        D = c.hidden_size
        # Embedding rows of norm ~1, so a tied head gives logits of unit scale too.
        self.embed = uniform((c.vocab_size, D), 1.0 / math.sqrt(D))
        self.layers = []
        for _ in range(c.n_layers):
            self.layers.append({
                "attn_norm": norm_weight(),
                "wq": dense(D, c.n_heads * d, cols=q_cols),  # column-parallel
                "wk": dense(D, c.n_kv_heads * d, cols=kv_cols),
                "wv": dense(D, c.n_kv_heads * d, cols=kv_cols),
                "wo": dense(c.n_heads * d, D, rows=q_cols),  # row-parallel: all-reduced
                "mlp_norm": norm_weight(),
                "w_gate": dense(D, c.intermediate_size, cols=mlp),  # column-parallel
                "w_up": dense(D, c.intermediate_size, cols=mlp),
                "w_down": dense(c.intermediate_size, D, rows=mlp),  # row-parallel: all-reduced
            })
        self.final_norm = norm_weight()
        # Tied: the head is the embedding's transpose (a view, no second copy).
        self.head = self.xp.matrix_transpose(self.embed) if c.tie_embeddings else dense(D, c.vocab_size)
        self.inv_freq = c.rope_theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [d/2]
        self.scale = 1.0 / math.sqrt(d)
        if c.sinks:
            # From their own stream, so a model with sinks has the same other weights as one
            # without; float32 values (what gqakv takes), gpt-oss-like magnitudes.
            sink_rng = np.random.default_rng([seed, 1])
            self.sink_logits = [tuple(float(x) for x in (2.0 * sink_rng.standard_normal(c.n_heads)).astype(np.float32))
                                for _ in range(c.n_layers)]

    #: Per layer, the ``[Hq]`` sink logits as Python floats (float32 values), or None.
    sink_logits: list | None = None
    #: The ``ContextParallel`` this rank belongs to, or None (one process; subclasses that
    #: load their own weights leave it None).
    cp = None

    def attention_params(self, layer: int) -> gqakv.AttentionParams:
        """What layer ``layer`` attends with: the scale and the config's variants (the sinks
        of this process's query heads)."""
        c = self.config
        sinks = None
        if self.sink_logits is not None:
            sinks = self.sink_logits[layer]
            if self.shard is not None:
                sinks = sinks[self.shard.q_start:self.shard.q_stop]
        return gqakv.AttentionParams(
            scale=self.scale, window=c.layer_window(layer), softcap=None if c.softcap is None else float(c.softcap),
            sinks=sinks)

    # -- cache ------------------------------------------------------------------------------

    def new_cache(self, batch: int, max_len: int, **options) -> gqakv.ModelKVCache:
        """All layers' K/V in one allocation, ``[layers, B, Hkv, max_len, d]`` each (tensor
        parallel: this rank's ``Hkv_local`` heads only). ``options``: ModelKVCache's
        (``page_size``, ``num_pages``, ``kv_dtype``, ``storage``)."""
        c = self.config
        if self.cp is not None:  # this rank's tokens of its (TP: local) KV heads
            return self.cp.model_cache(c.n_layers, batch, self.local_kv_heads, max_len, c.head_dim,
                                       dtype=self.dtype, backend=self.backend, **options)
        if self.tp is not None:
            return self.tp.model_cache(c.n_layers, batch, c.n_heads, c.n_kv_heads, max_len, c.head_dim,
                                       dtype=self.dtype, backend=self.backend, **options)
        return gqakv.ModelKVCache(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim,
                                  dtype=self.dtype, backend=self.backend, **options)

    def _guard(self, B: int, T: int):
        """How one forward pass runs its local work and joins partial sums (see _decoder)."""
        if self.cp is not None:
            return self.cp.guard(self.backend, (B, T, self.config.hidden_size), self.dtype,
                                 (B, self.local_heads, T, self.config.head_dim))
        if self.tp is None:
            return _OneProcess()
        return self.tp.guard(self.backend, (B, T, self.config.hidden_size), self.dtype)

    # -- building blocks --------------------------------------------------------------------

    def _rmsnorm(self, x, w):
        xp = self.xp
        ms = xp.mean(x * x, axis=-1, keepdims=True)
        return x * (1.0 / xp.sqrt(ms + self.config.rms_eps)) * w

    def _rope_tables(self, positions: np.ndarray):
        """positions ``[B, T]`` host ints -> cos, sin ``[B, 1, T, d/2]`` in the model dtype."""
        angles = positions[:, None, :, None].astype(np.float64) * self.inv_freq  # [B, 1, T, d/2]
        return (self.backend.from_numpy(np.cos(angles), self.dtype),
                self.backend.from_numpy(np.sin(angles), self.dtype))

    def _rope(self, x, cos, sin):
        """Rotate halves (Llama/HF layout): x ``[B, H, T, d]`` -> same shape, new array."""
        half = int(x.shape[-1]) // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = self.xp.empty_like(x)
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:] = x2 * cos + x1 * sin
        return out

    def _linear(self, x, w):
        """``x [..., in] @ w [in, out]``. Products of at most ``few_rows.MAX_ROWS`` rows of
        NumPy float32 over a Fortran-order weight (decode's) run on ``few_rows``' kernel,
        which streams the weight; larger ones on BLAS. In batch-invariant mode
        (``gqakv.batch_invariant``) every product the kernel can take runs on it with
        ``invariant=True`` (each row summed by the same loop whatever the batch); the
        others one token row at a time: a matmul of N rows picks its blocking, so the
        order of each dot product's sum, by N, and a token's logits would then depend on
        the other rows of the batch and on the chunk it came in; a ``[1, in]`` product is
        the same operation whatever the batch (slower: prefill loses its matrix-matrix
        blocking)."""
        n_in, n_out = int(x.shape[-1]), int(w.shape[-1])
        n_rows = math.prod(int(s) for s in x.shape[:-1])
        invariant = invariance.enabled()
        if (invariant or 0 < n_rows <= few_rows.MAX_ROWS) and type(x) is np.ndarray:
            # decode's few token rows: a kernel that streams the weights; it can sum
            # each row the same way whatever the batch, so in batch-invariant mode it
            # takes every product (few_rows)
            rows = x.reshape(n_rows, n_in)
            # outside the mode a product the kernel declines is rows @ w there, as below;
            # in it such a product goes one row at a time (below)
            if not invariant or few_rows.why_not(rows, w) is None:
                out = few_rows.few_rows_matmul(rows, w, invariant=invariant)
                return out.reshape(*x.shape[:-1], n_out)
        if n_rows <= 1 or (x.ndim == 2 and not invariant):
            return x @ w  # one row: NumPy's matrix-vector product
        xp = self.xp
        rows = xp.reshape(x, (n_rows, n_in))
        if not invariant:
            # one [rows, in] @ [in, out] product: a stacked x [B, T, in] @ w is B products
            # to NumPy (its matmul loops over the leading dims), each reading all of w
            # (batch-8 decode of SmolLM2-135M: 1.10x faster)
            out = rows @ w
        else:
            out = xp.concat([rows[i:i + 1, :] @ w for i in range(n_rows)], axis=0)
        return xp.reshape(out, (*tuple(int(s) for s in x.shape[:-1]), n_out))

    def _heads(self, y, B, T, H):
        """``[B, T, H*d]`` -> ``[B, H, T, d]`` (a view where the library allows)."""
        return self.xp.permute_dims(self.xp.reshape(y, (B, T, H, self.config.head_dim)), (0, 2, 1, 3))

    def _embed(self, tokens: np.ndarray):
        B, T = tokens.shape
        ids = self.backend.from_host_ints(np.ascontiguousarray(tokens, dtype=np.int64).reshape(-1),
                                          device=self.backend.device_of(self.embed))
        return self.xp.reshape(self.xp.take(self.embed, ids, axis=0), (B, T, self.config.hidden_size))

    def _decoder(self, tokens: np.ndarray, positions, attend, guard, gathered: bool = False):
        """Shared trunk: tokens ``[B, T]`` -> final hidden states ``[B, T, D]``.

        ``positions()`` gives the ``[B, T]`` RoPE positions; ``attend(layer, q, k, v)`` maps
        q ``[B, Hq, T, d]``, k, v ``[B, Hkv, T, d]`` (RoPE applied; this process's heads) to
        the attention output ``[B, Hq, T, d]``. ``guard`` runs the local work
        (``guard.run``) and adds each row-parallel projection's partial sum, all-reduced
        under tensor parallelism (``guard.add_reduced``); with a StepGuard a failed rank
        gets None here and every other rank too, once the flags are reduced.
        ``gathered`` (context parallel): ``attend`` returns this rank's partial ``(out,
        lse)``, merged over the CP group by ``guard.gather_attention`` (the layer's sinks
        applied there, once).
        """
        xp, c = self.xp, self.config
        B, T = tokens.shape
        Hq, Hkv, d = self.local_heads, self.local_kv_heads, c.head_dim

        def start():
            return self._rope_tables(positions()), self._embed(tokens)

        def attention_in(i, w, x, cos, sin):  # attend's result for this process's heads
            h = self._rmsnorm(x, w["attn_norm"])
            q = self._rope(self._heads(self._linear(h, w["wq"]), B, T, Hq), cos, sin)
            k = self._rope(self._heads(self._linear(h, w["wk"]), B, T, Hkv), cos, sin)
            v = self._heads(self._linear(h, w["wv"]), B, T, Hkv)
            return attend(i, q, k, v)  # [B, Hq, T, d] (gathered: its partial (out, lse))

        def attention_out(w, o):  # [B, Hq, T, d] -> [B, T, D], this process's heads' share
            return self._linear(xp.reshape(xp.permute_dims(o, (0, 2, 1, 3)), (B, T, Hq * d)), w["wo"])

        def attention_part(i, w, x, cos, sin):
            return attention_out(w, attention_in(i, w, x, cos, sin))

        def mlp_part(w, x):  # [B, T, D], this process's MLP columns' share
            h = self._rmsnorm(x, w["mlp_norm"])
            gate = self._linear(h, w["w_gate"])
            return self._linear((gate / (1.0 + xp.exp(-gate))) * self._linear(h, w["w_up"]), w["w_down"])  # SwiGLU

        started = guard.run(start)
        (cos, sin), x = started if started is not None else ((None, None), None)
        for i, w in enumerate(self.layers):
            if gathered:
                o = guard.gather_attention(lambda: attention_in(i, w, x, cos, sin),
                                           self.attention_params(i).sinks)
                x = guard.add_reduced(x, lambda: attention_out(w, o))
            else:
                x = guard.add_reduced(x, lambda: attention_part(i, w, x, cos, sin))
            x = guard.add_reduced(x, lambda: mlp_part(w, x))
        return guard.run(lambda: self._rmsnorm(x, self.final_norm))

    def _logits(self, x, last: np.ndarray | None):
        """x ``[B, T, D]`` -> logits ``[B, T, V]``, or ``[B, V]`` at index ``last[b]`` of each row."""
        xp = self.xp
        if last is not None:
            B, T, D = (int(s) for s in x.shape)
            idx = self.backend.from_host_ints(np.arange(B) * T + last, device=self.backend.device_of(x))
            x = xp.take(xp.reshape(x, (B * T, D)), idx, axis=0)  # [B, D]
        return self.backend.to_numpy(self._linear(x, self.head))

    # -- forward passes ---------------------------------------------------------------------

    def forward(self, tokens, n_new, cache: gqakv.ModelKVCache, *, last_only: bool = False,
                rows=None, tree=None) -> np.ndarray:
        """Cached forward of the next tokens of each row; returns host (NumPy) logits.

        Args:
            tokens: ``[B, T]`` host ints; row b's first ``n_new[b]`` are real, the rest padding.
            n_new: ``[B]`` ints, ``0 <= n_new[b] <= T``.
            cache: from ``new_cache``; row b holds L_b tokens before the call and
                L_b + n_new[b] after. Token t of row b gets RoPE position L_b + t.
            last_only: return only each row's last real token's logits, ``[B, V]``
                (rows with n_new[b] = 0 give meaningless values).
            rows: ``[B]`` distinct cache rows the batch's entries are (default ``0..B-1``,
                the whole cache).
            tree: None, or each entry's draft tree over its new tokens (parents ``[B, T]``
                or a ``gqakv.DraftTree``; speculative verification): token t attends to the
                prefix and its ancestors only, and its RoPE position is L_b + depth[b, t]
                (``step.positions``). Follow with ``cache.accept`` to keep one path per row.

        Returns:
            ``[B, T, V]`` logits (padded slots meaningless), or ``[B, V]`` with last_only.
        """
        tokens = np.asarray(tokens)
        n_new = np.asarray(n_new, dtype=np.int64)
        B, T = tokens.shape
        # One step: each layer writes its K/V at the rows' lengths and attends; the
        # lengths advance once, after the last layer and the logits (nothing advances on
        # an error, here or, under tensor parallelism, on any rank).
        params = [self.attention_params(i) for i in range(self.config.n_layers)]
        guard = self._guard(B, T)
        step = None
        try:
            step = guard.run(lambda: cache.step(n_new, rows=rows, tree=tree))
            x = self._decoder(tokens, (lambda: step.starts[:, None] + np.arange(T)) if tree is None
                              else (lambda: step.positions[:, :T]),  # continue from each row's length
                              lambda i, q, k, v: step.attend(i, q, k, v, params=params[i]), guard,
                              gathered=self.cp is not None)
            logits = guard.run(lambda: self._logits(x, np.maximum(n_new - 1, 0) if last_only else None))
            guard.finish()  # tensor parallel: raises on every rank if any rank failed
        except BaseException:
            if step is not None:
                step.abort()
            raise
        step.commit()
        return logits

    def forward_uncached(self, tokens, lengths=None, *, last_only: bool = False) -> np.ndarray:
        """Whole sequences at once, plain causal attention, no cache.

        tokens ``[B, S]`` host ints, row b's first ``lengths[b]`` real (right padding).
        Returns ``[B, S, V]`` logits, or ``[B, V]`` at each row's last real token.
        """
        tokens = np.asarray(tokens)
        B, S = tokens.shape
        lengths = np.full(B, S) if lengths is None else np.asarray(lengths, dtype=np.int64)
        positions = np.broadcast_to(np.arange(S), (B, S))

        def attend(i, q, k, v):
            p = self.attention_params(i)
            sinks = None if p.sinks is None else self.backend.from_numpy(np.array(p.sinks), self.dtype)
            return causal_attention(self.xp, q, k, v, p.scale, window=p.window, softcap=p.softcap, sinks=sinks)

        guard = self._guard(B, S)
        x = self._decoder(tokens, lambda: positions, attend, guard)
        logits = guard.run(lambda: self._logits(x, lengths - 1 if last_only else None))
        guard.finish()
        return logits


class _OneProcess:
    """The single-process counterpart of ``gqakv.distributed.StepGuard``: local work runs
    as is (exceptions propagate) and partial sums are already whole."""

    @staticmethod
    def run(fn):
        return fn()

    @staticmethod
    def add_reduced(x, fn):
        return x + fn()

    @staticmethod
    def finish():
        pass


# -- generation -------------------------------------------------------------------------------


@dataclass
class Generation:
    """Greedy generation result for B rows."""

    tokens: np.ndarray  # [B, n_new_tokens] generated token ids
    logits: np.ndarray  # [n_new_tokens, B, V] logits each generated token was chosen from
    time_to_first_token: float  # seconds from start to every row's first token
    decode_seconds: float  # seconds for the remaining n_new_tokens - 1 steps
    cache_nbytes: int = 0
    prefix_hits: np.ndarray | None = None  # [B] prompt tokens each row found in the prefix cache

    @property
    def decode_tokens_per_s(self) -> float:
        B, n = self.tokens.shape
        return B * (n - 1) / self.decode_seconds if n > 1 and self.decode_seconds > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        total = self.time_to_first_token + self.decode_seconds
        return self.tokens.size / total if total > 0 else float("nan")


def _chunk_schedule(chunks, prompt_lens: np.ndarray):
    """Chunk sizes to feed: None -> the longest prompt at once; int -> that size
    repeated; a sequence -> those sizes, the last one repeated."""
    if chunks is None:
        return lambda step: int(prompt_lens.max())
    if isinstance(chunks, (int, np.integer)):
        sizes = [int(chunks)]
    else:
        sizes = [int(s) for s in chunks]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"chunk sizes must be >= 1, got {chunks!r}")
    return lambda step: sizes[min(step, len(sizes) - 1)]


def _check_prompts(prompts, vocab_size: int) -> list[np.ndarray]:
    rows = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
    for b, p in enumerate(rows):
        if p.size == 0:
            raise ValueError(f"prompt {b} is empty; every row needs at least one token")
        if p.min() < 0 or p.max() >= vocab_size:
            raise ValueError(f"prompt {b} has token ids outside 0..{vocab_size - 1}")
    return rows


def _has_prefix_cache(cache) -> bool:
    return cache.store.kind == "paged" and cache.prefix_index is not None


def generate(model: LlamaModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             chunks=None, pad_id: int = 0, cache_options: dict | None = None,
             cache: gqakv.ModelKVCache | None = None, salt=None) -> Generation:
    """Greedy generation through the KV cache: chunked prefill, then batched ragged decode.

    Prefill feeds every row its next ``chunk`` prompt tokens per call (rows whose prompt
    is consumed get n_new = 0 and are padding), so rows of different prompt lengths
    share each call. A row's first token comes from its last prompt token's logits;
    then every row decodes one token per step, each at its own position.
    ``cache_options``: passed to ``model.new_cache`` (``page_size``, ``kv_dtype``, ...).

    ``cache``: an existing ``model.new_cache(...)`` to serve from instead of a new one
    (rows ``0..B-1`` are reset first, which returns their pages to its pool). With a
    prefix cache (``prefix_cache=True``), each row starts on the cached pages of its
    prompt's longest cached prefix (``match_prefix``, ``salt``) and prefills only the
    rest; every row's prompt, and at the end its prompt and generated tokens, are
    cached for the next call (``cache_prefix``). ``Generation.prefix_hits`` says how
    many prompt tokens each row found.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    rows = _check_prompts(prompts, model.config.vocab_size)
    B = len(rows)
    lens = np.array([p.size for p in rows], dtype=np.int64)
    chunk_of = _chunk_schedule(chunks, lens)
    V = model.config.vocab_size
    out_tokens = np.empty((B, max_new_tokens), dtype=np.int64)
    out_logits = np.empty((max_new_tokens, B, V), dtype=np.float64)
    if cache is not None and (cache.batch < B or cache.max_len < int(lens.max()) + max_new_tokens):
        raise ValueError(f"the cache has {cache.batch} rows of {cache.max_len} tokens; {B} rows of up "
                         f"to {int(lens.max()) + max_new_tokens} tokens are needed")

    t0 = time.perf_counter()
    if cache is None:
        cache = model.new_cache(B, int(lens.max()) + max_new_tokens, **(cache_options or {}))
    else:
        cache.reset(list(range(B)))
    prefix = _has_prefix_cache(cache)
    rows_used = None if cache.batch == B else list(range(B))
    fed = np.zeros(B, dtype=np.int64)
    if prefix:
        for b in range(B):
            fed[b] = cache.match_prefix(b, rows[b], salt=salt)
    hits = fed.copy()
    step = 0
    while (fed < lens).any():
        n_new = np.minimum(chunk_of(step), lens - fed)
        tokens = np.full((B, int(n_new.max())), pad_id, dtype=np.int64)
        for b in range(B):
            tokens[b, : n_new[b]] = rows[b][fed[b] : fed[b] + n_new[b]]
        logits = model.forward(tokens, n_new, cache, last_only=True, rows=rows_used)  # [B, V]
        done_now = (n_new > 0) & (fed + n_new == lens)
        out_logits[0, done_now] = logits[done_now]
        fed += n_new
        step += 1
    out_tokens[:, 0] = np.argmax(out_logits[0], axis=-1)
    t1 = time.perf_counter()
    if prefix:
        for b in range(B):
            cache.cache_prefix(b, rows[b], salt=salt)

    ones = np.ones(B, dtype=np.int64)
    for i in range(1, max_new_tokens):
        logits = model.forward(out_tokens[:, i - 1 : i], ones, cache, last_only=True, rows=rows_used)
        out_logits[i] = logits
        out_tokens[:, i] = np.argmax(logits, axis=-1)
    t2 = time.perf_counter()
    if prefix:  # the generated tokens the cache holds (all but the last) are reusable too
        for b in range(B):
            cache.cache_prefix(b, np.concatenate([rows[b], out_tokens[b, :-1]]), salt=salt)
    return Generation(out_tokens, out_logits, t1 - t0, t2 - t1, cache.nbytes, hits)


def generate_uncached(model: LlamaModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      *, pad_id: int = 0) -> Generation:
    """Greedy generation that re-runs the full prefix every step (no KV cache)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    rows = _check_prompts(prompts, model.config.vocab_size)
    B = len(rows)
    lens = np.array([p.size for p in rows], dtype=np.int64)
    S = int(lens.max()) + max_new_tokens
    seqs = np.full((B, S), pad_id, dtype=np.int64)
    for b in range(B):
        seqs[b, : lens[b]] = rows[b]
    out_tokens = np.empty((B, max_new_tokens), dtype=np.int64)
    out_logits = np.empty((max_new_tokens, B, model.config.vocab_size), dtype=np.float64)
    t0 = time.perf_counter()
    t1 = t0
    for i in range(max_new_tokens):
        cur = lens + i
        logits = model.forward_uncached(seqs[:, : int(cur.max())], cur, last_only=True)
        out_logits[i] = logits
        out_tokens[:, i] = np.argmax(logits, axis=-1)
        seqs[np.arange(B), cur] = out_tokens[:, i]
        if i == 0:
            t1 = time.perf_counter()
    t2 = time.perf_counter()
    return Generation(out_tokens, out_logits, t1 - t0, t2 - t1)
