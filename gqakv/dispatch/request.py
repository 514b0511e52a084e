"""One call as a backend judges it: the ``Request`` that ``Backend.route`` and
``Backend.not_supported_reasons`` take.

A request names what decides which implementation may serve a call: the operation, the
dtype of q / new K/V / the output, the head dim, the query tokens per row, the storage
layout and codec (``gqakv.storage``), the attention variant's features, and the per-call
conditions a backend measured on the call's arrays (``buffers``: why the buffers do not
suit its kernels; ``grid``: why its launch grid does not fit; ``capability``: the
device's compute capability). Fields left out are the favourable case, so
``Request("attention", dtype="float16", head_dim=128)`` asks which implementation would
serve the best such call. Requests are frozen and hashable: backends keep their routing
decisions keyed by them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..core import dtypes as _dtypes
from ..core.inputs import PACKED, PADDED
from ..storage.codecs import PLAIN_NAME
from ..storage.store import CONTIGUOUS

#: The hot operations a backend routes.
HOT_OPS = ("write_kv", "copy_tokens", "attention")


@dataclass(frozen=True)
class Request:
    """What a backend judges about one call (see the module docstring).

    op: one of ``HOT_OPS``, or None for "a cache of this kind" (``not_supported_reasons``).
    dtype: canonical dtype name of q, the new K/V and the output (a quantized cache's
      ``q_dtype``); None: not judged.
    head_dim: d; None: not judged.
    t_q: query tokens per row (attention).
    group: query heads per KV head, ``G = Hq // Hkv`` (attention; a kernel that folds the G
      heads x t_q queries of a KV head into one tile judges its size by it).
    layout: the storage layout kind (``"contiguous"``, ``"paged"``).
    codec: the storage codec's name (``gqakv.storage.codecs``; ``"none"`` or None: plain
      values).
    features: the attention variant's ``AttentionParams.features``.
    tokens: how the call's new tokens (q, k_new, v_new, out) are laid out: ``"padded"``
      ``[B, H, T, d]`` or ``"packed"`` ``[N, H, d]`` (every entry's tokens end to end).
    buffers: why the call's buffers do not suit a backend's kernels (strides, alignment,
      ...), None when they do.
    grid: why a backend's launch grid for the call does not fit, None when it does.
    capability: the device's compute capability as CuPy spells it (90 for 9.0), None
      when not known.
    invariant: batch-invariant mode (``gqakv.core.invariance``): the call's bits must not
      depend on the batch, so only implementations that declare it may serve it.
    keys: the keys of the call's longest row (attention: its live tokens after the
      append), rounded up to a power of two so that routes stay few enough to keep;
      None: not known (judged as long rows).
    """

    op: str | None = None
    dtype: str | None = None
    head_dim: int | None = None
    t_q: int = 1
    group: int = 1
    layout: str = CONTIGUOUS
    codec: str = PLAIN_NAME
    features: frozenset[str] = frozenset()
    tokens: str = PADDED
    buffers: str | None = None
    grid: str | None = None
    capability: int | None = None
    invariant: bool = False
    keys: int | None = None  # the newest field, last: positional Requests keep their meaning

    def __post_init__(self):
        if self.op is not None and self.op not in HOT_OPS:
            raise ValueError(f"op={self.op!r} (routed operations: {', '.join(HOT_OPS)})")
        if self.dtype is not None and self.dtype not in _dtypes.ITEMSIZE:  # canonical: kept
            object.__setattr__(self, "dtype", _dtypes.canonical_name(self.dtype))
        if self.head_dim is not None:
            object.__setattr__(self, "head_dim", int(self.head_dim))
        object.__setattr__(self, "t_q", int(self.t_q))
        if self.keys is not None:  # its power-of-two bucket (0 and 1 stay)
            keys = int(self.keys)
            if keys < 0:
                raise ValueError(f"keys={keys} must be >= 0")
            object.__setattr__(self, "keys", key_bucket(keys))
        object.__setattr__(self, "group", int(self.group))
        if self.codec is None:  # the kv_dtype=None of an unquantized cache
            object.__setattr__(self, "codec", PLAIN_NAME)
        object.__setattr__(self, "features", frozenset(self.features))
        if self.tokens not in (PADDED, PACKED):
            raise ValueError(f"tokens={self.tokens!r} (the layouts: {PADDED!r}, {PACKED!r})")
        if self.capability is not None:
            object.__setattr__(self, "capability", int(self.capability))
        object.__setattr__(self, "invariant", bool(self.invariant))

    @classmethod
    def make(cls, op: str | None, **facts) -> "Request":
        """``Request(op, **facts)`` with a sentence naming any fact that is not a field."""
        if not _FACTS.issuperset(facts):
            known = [f.name for f in fields(cls) if f.name != "op"]
            unknown = sorted(set(facts) - _FACTS)
            raise ValueError(f"{op or 'request'} facts {', '.join(unknown)} (known: {', '.join(known)})")
        return cls(op, **facts)

    @classmethod
    def of_store(cls, op: str, store, **facts) -> "Request":
        """The request of a call over ``store`` (a ``gqakv.storage.store.KVStore``): its
        layout, codec, head dim and q dtype, plus ``facts`` (t_q, features, buffers, ...)."""
        spec = store.spec
        return cls.make(op, dtype=spec.q_dtype, head_dim=store.head_dim, layout=spec.kind,
                        codec=spec.codec.name, **facts)

    def with_(self, **changes) -> "Request":
        """This request with ``changes`` (fields, as for ``make``)."""
        return replace(self, **changes)

    @property
    def quantized_dtype(self) -> str | None:
        """The codec's name when K/V are stored as codes (not ``"none"``), else None: the
        ``kv_dtype=`` a user gave for such a cache."""
        return None if self.codec == PLAIN_NAME else self.codec


def key_bucket(keys: int) -> int:
    """``Request.keys`` as a request keeps it: the power of two at or above ``keys`` (0
    and 1 stay), so that routes stay few enough to keep."""
    keys = int(keys)
    return keys if keys <= 1 else 1 << (keys - 1).bit_length()


_FACTS = frozenset(f.name for f in fields(Request) if f.name != "op")


def as_request(request: "Request | str | None", facts: dict) -> Request:
    """``request`` itself (no ``facts`` allowed beside it), or ``Request.make(request, **facts)``
    for an operation name (the keyword form of ``route``)."""
    if isinstance(request, Request):
        if facts:
            raise TypeError(f"give a Request or facts, not both (got facts {', '.join(sorted(facts))})")
        return request
    return Request.make(request, **facts)
