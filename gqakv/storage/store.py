"""KV storage: how a cache's keys and values are laid out, typed, sized, allocated and read.

A ``KVStore`` is what the backends' hot operations take (``attention(q, store, ...)``,
``write_kv(store, ...)``, ``copy_tokens(dst, ..., src, ...)``). It owns:

- the layout (``spec.kind``): ``"contiguous"`` rows today, K and V each
  ``[*leading, rows, Hkv, max_len, d]`` (``leading`` is ``()`` for a KVCache and
  ``(layers,)`` for a ModelKVCache); a paged kind would hold pages and a page table;
- the dtypes (``StorageSpec``): the storage dtype of K/V, separate from the dtype of
  queries and outputs (``q_dtype``) and of the new keys/values (``input_dtype``); all
  three are equal today, a quantized kind would store narrower values plus scales;
- the byte count (``nbytes``, the one formula every size in gqakv comes from);
- allocation (``KVStore.allocate``);
- reading for the generic path (``blocks``): key/value blocks ``[Hkv, keys, d]`` of a
  row, views for contiguous storage; a quantized store (``spec.quantized``: int8 or
  float8_e4m3fn codes plus per-token float32 scales ``k_scale``/``v_scale``
  ``[*leading, rows, Hkv, max_len]``, ``gqakv.storage.quantize``) dequantizes each block here,
  in blocks of at most ``DEQUANT_BLOCK_ELEMENTS``, and quantizes in ``put``. Quantized
  storage combines with either layout (paged: the scales are paged with their tokens,
  ``[*leading, num_pages, Hkv, page_size]``).

Fast paths read ``k``/``v`` directly, and only for the kinds they declare (a quantized
store's ``k``/``v`` hold codes: fast paths without a dequantizing reader must refuse
``store.quantized``); any other kind runs on the generic array-API path, which reads
through ``blocks`` and so works on every backend before a fast path exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


import numpy as np

from ..core import dtypes as _dtypes
from ..core.units import human_bytes
from . import codecs as _codecs
from .row_copies import plan_reorder, run_waves

#: Storage kinds. Contiguous: K and V are dense arrays, row r's token j of KV head h at
#: ``[..., r, h, j, :]``.
CONTIGUOUS = "contiguous"
#: Paged: a pool of pages ``[*leading, num_pages, Hkv, page_size, d]`` and a page table
#: per row (``gqakv.storage.paged.PagedStore``).
PAGED = "paged"
KINDS = (CONTIGUOUS, PAGED)

#: Largest buffer, in bytes, any backend can address (a signed 64-bit byte count;
#: NumPy's and torch's limit on 64-bit platforms).
MAX_BUFFER_BYTES = 2**63 - 1

#: Largest dequantized block, in elements of K (and as many of V), a quantized store's
#: reader hands the generic path at once (4 MiB of float32 each): attention never holds
#: a dequantized copy of a whole row.
DEQUANT_BLOCK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class StorageSpec:
    """How K/V are stored: the layout ``kind`` and the dtypes (canonical names).

    dtype: the storage dtype of K and V. q_dtype: the dtype of queries and outputs.
    input_dtype: the dtype of the k_new/v_new an append takes. ``of(dtype)`` makes the
    spec whose three dtypes are equal; ``of(dtype, kv_dtype="int8")`` (or
    ``"float8_e4m3fn"``) one that stores K/V quantized with per-token scales
    (``quantized``) while queries, inputs and outputs stay ``dtype``.
    """

    kind: str
    dtype: str
    q_dtype: str
    input_dtype: str

    @classmethod
    def of(cls, dtype, kind: str = CONTIGUOUS, kv_dtype=None) -> "StorageSpec":
        name = _dtypes.canonical_name(dtype)
        if kind not in KINDS:
            raise ValueError(f"storage kind={kind!r} (known: {', '.join(KINDS)})")
        stored = _codecs.kv_dtype_name(kv_dtype)
        if stored is not None:
            if name == "float64":
                raise ValueError(f"kv_dtype={stored!r} needs dtype float32, float16 or bfloat16, "
                                 "got dtype=float64 (a float64 cache is the reference precision; "
                                 "use dtype='float32' to quantize)")
        return cls(kind, stored or name, name, name)

    @property
    def codec(self) -> _codecs.Codec:
        """How K/V values are stored (``gqakv.storage.codecs``): ``PLAIN`` for a float dtype."""
        return _codecs.of(self.dtype)

    @property
    def quantized(self) -> bool:
        """True when K/V are stored as codes with per-token float32 scales."""
        return self.codec.scaled

    def bytes_per_slot(self, kv_heads: int, head_dim: int) -> int:
        """Bytes of K plus V for one token slot of one row of one layer. The one byte-count
        formula: every size gqakv reports or checks is a multiple of it (Python ints,
        exact). A quantized spec adds each token's two float32 scales (K and V) per KV
        head: ``2 x Hkv x (d x 1 + 4)``."""
        codec = self.codec
        value_bytes = 0 if codec.scaled else _dtypes.itemsize(self.dtype)
        return 2 * int(kv_heads) * codec.bytes_per_token_head(head_dim, value_bytes)

    def nbytes(self, slots: int, kv_heads: int, head_dim: int) -> int:
        """Bytes of K and V for ``slots`` token slots (layers x rows x max_len)."""
        return int(slots) * self.bytes_per_slot(kv_heads, head_dim)


def nbytes(dtype, slots: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of a contiguous store of ``dtype`` with ``slots`` token slots (see ``StorageSpec``)."""
    return StorageSpec.of(dtype).nbytes(slots, kv_heads, head_dim)


def check_max_chunk(max_chunk, window) -> int | None:
    """None, or ``max_chunk`` as a Python int >= 1 for a store of sliding ``window`` W;
    TypeError / ValueError naming it (also when there is no window: max_chunk sizes
    window-sized storage, ``gqakv.storage.ring``)."""
    if max_chunk is None:
        return None
    if isinstance(max_chunk, (bool, np.bool_)) or not isinstance(max_chunk, (int, np.integer)):
        raise TypeError(f"max_chunk must be an int >= 1 (the most tokens one append adds to a "
                        f"row) or None, got {max_chunk!r}")
    if int(max_chunk) < 1:
        raise ValueError(f"max_chunk={int(max_chunk)} is not allowed: the most tokens one "
                         "append adds to a row must be >= 1 (1: decode only)")
    if window is None:
        raise ValueError(f"max_chunk={int(max_chunk)} sizes window-sized storage; it applies with "
                         "a sliding window (window=W), and this cache has none")
    return int(max_chunk)


class KVStore:
    """K/V storage of a cache (see the module docstring).

    Attributes:
        spec: the StorageSpec.
        k, v: contiguous kind: the buffers ``[*leading, rows, Hkv, max_len, d]`` (codes
            when quantized).
        k_scale, v_scale: quantized only: float32 ``[*leading, rows, Hkv, max_len]``, the
            scale of each token's codes (None otherwise).
        leading: ``()`` or ``(layers,)``; rows, kv_heads, max_len, head_dim: ints.
        kind, dtype, quantized, codec: the spec's (its layout kind, storage dtype's name,
            whether ``k``/``v`` hold codes with scales, its ``gqakv.storage.codecs`` codec),
            read once: every layer's call asks.
        memo: a dict where a backend keeps what it derived from these buffers for its
            kernels (views of them as its kernels take them), by the backend's own key.
            Derived data only, made on first use and dropped with the store: the buffers
            never move, so it stays true (a paged store's table changes in place; a
            backend that keeps table views checks that the table is the same object).
    """

    __slots__ = ("spec", "k", "v", "leading", "rows", "kv_heads", "max_len", "head_dim",
                 "k_scale", "v_scale", "_codec_lookup", "_k_parts", "_v_parts", "memo",
                 "kind", "dtype", "quantized", "codec")

    def __init__(self, spec: StorageSpec, k, v, k_scale=None, v_scale=None):
        self.spec = spec
        self.kind, self.dtype = spec.kind, spec.dtype
        self.codec = spec.codec
        self.quantized = self.codec.scaled
        self.k, self.v = k, v
        self.k_scale, self.v_scale = k_scale, v_scale
        # K's and V's parts as the codec keeps them (gqakv.storage.codecs: values, or codes
        # and scales), indexed alike on the leading axes
        self._k_parts = (k,) if k_scale is None else (k, k_scale)
        self._v_parts = (v,) if v_scale is None else (v, v_scale)
        self._codec_lookup: tuple | None = None  # (the codec's lookup_table,), made on first read
        self.memo: dict = {}
        shape = tuple(int(s) for s in k.shape)
        self.leading = shape[:-4]
        self.rows, self.kv_heads, self.max_len, width = shape[-4:]
        self.head_dim = self.codec.head_dim_of(width)  # 4-bit codes: two values a byte

    @classmethod
    def of(cls, k, v) -> "KVStore":
        """A contiguous store over existing buffers ``k``, ``v`` (``[*leading, rows, Hkv,
        max_len, d]``, same shape and dtype), e.g. to call a backend's hot operations on
        buffers made elsewhere; nothing is copied."""
        if tuple(k.shape) != tuple(v.shape) or k.dtype != v.dtype or len(k.shape) < 4:
            raise ValueError(f"K {list(k.shape)} {k.dtype} and V {list(v.shape)} {v.dtype} must "
                             "be equal shapes [..., rows, Hkv, max_len, d] of one dtype")
        return cls(StorageSpec.of(k.dtype), k, v)

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes(math.prod(self.leading) * self.rows * self.max_len,
                                self.kv_heads, self.head_dim)

    # -- allocation ------------------------------------------------------------------------

    @classmethod
    def layout_args(cls, batch: int, max_len: int, *, page_size=None, num_pages=None,
                    prefix_cache=False, window=None, max_chunk=None) -> dict:
        """The checked keyword arguments of ``allocate`` for this layout (contiguous rows
        take none: ``page_size`` / ``num_pages`` / ``prefix_cache`` / ``window`` /
        ``max_chunk`` are refused, naming them). A contiguous cache with a sliding window
        never gets here: it is allocated as a ring of pages (``gqakv.storage.ring``)."""
        if window is not None:
            raise ValueError(f"window={window!r}: contiguous rows keep max_len slots; a contiguous "
                             "sliding layer is a ring of pages (gqakv.storage.ring.storage_for)")
        check_max_chunk(max_chunk, window)  # no window here: any max_chunk is refused
        if page_size is not None or num_pages is not None:
            raise ValueError(f"page_size={page_size!r} and num_pages={num_pages!r} apply to "
                             f"storage='paged' only, not storage={CONTIGUOUS!r}")
        if prefix_cache is not False:
            raise ValueError(f"prefix_cache={prefix_cache!r} applies to storage='paged' only (the "
                             f"prefix cache shares pages), not storage={CONTIGUOUS!r}")
        return {}

    @classmethod
    def allocate(cls, backend, spec: StorageSpec, shape: tuple[int, ...], what: str,
                 device=None) -> "KVStore":
        """A store of ``shape`` = ``(*leading, rows, Hkv, max_len, d)`` on ``backend``
        (uninitialized); a MemoryError names the bytes asked for."""
        *_, kv_heads, _, head_dim = shape
        spec.codec.check_head_dim(head_dim)  # a block codec's d must hold whole blocks
        total = spec.nbytes(math.prod(shape[:-4]) * shape[-4] * shape[-2], kv_heads, head_dim)

        def fail(why: str):
            return MemoryError(
                f"cannot allocate a {what} of {total:,} bytes ({human_bytes(total)}; K and V "
                f"each {list(shape)} {spec.dtype}) on backend {backend.name!r}: {why}"
            )

        if total // 2 > MAX_BUFFER_BYTES:
            raise fail(f"each buffer exceeds the {MAX_BUFFER_BYTES:,} bytes a 64-bit size can address")
        try:
            k = spec.codec.allocate_parts(backend, spec.dtype, shape, device)
            v = spec.codec.allocate_parts(backend, spec.dtype, shape, device)
        except MemoryError as exc:
            raise fail(str(exc)) from None
        return cls(spec, k[0], v[0], *k[1:], *v[1:])

    def temporary(self, backend, tokens: int) -> "KVStore":
        """A one-row store like this one, ``[*leading, 1, Hkv, tokens, d]`` (a row operation's
        temporary), on the same device."""
        shape = (*self.leading, 1, self.kv_heads, max(1, tokens), self.head_dim)
        return KVStore.allocate(backend, self.spec, shape, "temporary row",
                                device=backend.device_of(self.k))

    # -- the layout's row operations ---------------------------------------------------------
    # Validated by the caller (gqakv.ops.row_ops, the caches); a paged layout overrides each.
    # Reorder and fork take the store with a leading layer axis (``with_layers``).

    def reserve(self, backend, rows, starts, n_new):
        """Take what an append of ``n_new[i]`` tokens at ``starts[i]`` to ``rows[i]`` needs
        before anything is written (every layer); returns what ``give_back`` undoes.
        Contiguous rows are allocated whole: nothing to take (None)."""
        return None

    def give_back(self, reservation) -> None:
        """Undo a ``reserve`` whose append did not complete (nothing for contiguous rows)."""

    def reorder_rows(self, backend, src_rows: np.ndarray, lens: np.ndarray) -> int:
        """Row b takes row ``src_rows[b]``'s tokens (``lens``: the lengths before), by copies
        in a safe order (``gqakv.storage.row_copies``); returns tokens copied per layer."""
        return run_waves(backend, self, plan_reorder(src_rows, lens))

    def fork_rows(self, backend, src: int, dst_rows: np.ndarray, n: int) -> int:
        """Each row of ``dst_rows`` takes the first ``n`` tokens of row ``src`` (one wave of
        copies); returns tokens copied per layer."""
        backend.copy_tokens(self, dst_rows, self, np.full(dst_rows.size, src), np.full(dst_rows.size, n))
        return n * int(dst_rows.size)

    def trim_rows(self, rows: np.ndarray, new_lens: np.ndarray) -> None:
        """Rows ``rows`` now hold ``new_lens`` tokens: nothing moves or is released here."""

    @property
    def window(self) -> int | None:
        """The sliding window whose history the store lets go of (None: it keeps every token)."""
        return None

    def first_held(self, rows) -> np.ndarray:
        """``[len(rows)]`` int64: the first token each row still holds (0: contiguous rows
        hold their whole history)."""
        return np.zeros(len(rows), dtype=np.int64)

    def check_keep(self, rows, new_lens, what: str) -> None:
        """Raise (ValueError, before anything changes) when a row cut to ``new_lens[i]``
        tokens would need keys the store no longer holds (never, for contiguous rows)."""

    def row_kv(self, backend, row: int, n: int):
        """Row ``row``'s first ``n`` keys and values ``[Hkv, n, d]`` for ``KVCache.live_kv``:
        views of the buffers for plain contiguous storage (what ``blocks`` reads)."""
        return self.blocks(row, 0, n)

    @property
    def page_table(self):
        """The page table of a paged layout; TypeError for this one."""
        raise TypeError(f"this cache's storage is {self.kind!r}; pages exist only for "
                        "storage='paged' (gqakv.PagedKVCache)")

    # -- views -----------------------------------------------------------------------------

    def layer(self, layer: int) -> "KVStore":
        """Layer ``layer`` of a store with one leading axis, as a store of its own (views)."""
        return KVStore(self.spec, *(a[layer, ...] for a in self.buffers))

    def with_layers(self, xp) -> "KVStore":
        """This store with a leading layer axis (of 1 when it has none): the layout the row
        operations work on."""
        if self.leading:
            return self
        return KVStore(self.spec, *(xp.expand_dims(a, axis=0) for a in self.buffers))

    @property
    def any_buffer(self):
        """An array of the storage (``k``): where its device is read from."""
        return self.k

    @property
    def buffers(self) -> tuple:
        """Every array of the store, in the constructor's order: ``(k, v)``, then
        ``(k_scale, v_scale)`` for a scaled codec."""
        return (self.k, self.v, *self._k_parts[1:], *self._v_parts[1:])

    # -- reading (the generic path) --------------------------------------------------------

    def key_blocks(self, row: int, lo: int, hi: int, max_keys: int):
        """Spans ``(j0, j1)``, in order, covering keys ``lo..hi-1`` of ``row`` with at most
        ``max_keys`` keys each, that ``blocks`` reads without copying (the generic path
        walks a row through them; a paged kind ends every span at a page boundary)."""
        step = max(1, int(max_keys))
        cap = self.spec.codec.max_block_keys(self.kv_heads, self.head_dim, DEQUANT_BLOCK_ELEMENTS)
        if cap is not None:  # each span is decoded as a whole (a copy): keep it small
            step = min(step, cap)
        for j0 in range(lo, hi, step):
            yield j0, min(hi, j0 + step)

    def blocks(self, row: int, j0: int, j1: int):
        """Keys and values ``j0 <= j < j1`` of ``row`` of a store without leading axes, as
        ``[Hkv, j1 - j0, d]`` arrays: views in the storage dtype for plain values;
        quantized: new float32 arrays, dequantized (keep ``j1 - j0`` small, as
        ``key_blocks`` does)."""
        return (self._decode(tuple(p[row, :, j0:j1, ...] for p in self._k_parts)),
                self._decode(tuple(p[row, :, j0:j1, ...] for p in self._v_parts)))

    def _decode(self, parts):
        codec = self.spec.codec
        if self._codec_lookup is None:
            from array_api_compat import array_namespace

            self._codec_lookup = (codec.lookup_table(array_namespace(parts[0]),
                                                     getattr(parts[0], "device", None)),)
        return codec.decode(parts, self._codec_lookup[0])

    # -- writing (the generic path) --------------------------------------------------------

    def put(self, row: int, start: int, k, v) -> None:
        """Store ``k``, ``v`` ``[Hkv, n, d]`` (the input dtype) as tokens ``start..start+n-1``
        of ``row`` of a store without leading axes, in place (quantized: each token's codes
        and scale, from that token alone)."""
        from array_api_compat import array_namespace

        n = int(k.shape[1])
        xp = array_namespace(k)
        codec = self.spec.codec
        for parts, values in ((self._k_parts, codec.encode_keys(xp, k)),
                              (self._v_parts, codec.encode(xp, v))):
            for buf, value in zip(parts, values):
                buf[row, :, start:start + n, ...] = value

    def copy_row(self, dst_row: int, src: "KVStore", src_row: int, n: int) -> None:
        """Tokens ``0..n-1`` of ``src``'s row ``src_row`` into this store's row ``dst_row``,
        every layer (both stores have the same leading axes); scales travel with their
        codes."""
        lead = (slice(None),) * len(self.leading)
        dst = (*lead, dst_row, slice(None), slice(0, n), ...)
        at = (*lead, src_row, slice(None), slice(0, n), ...)
        for to, of in zip(self.buffers, src.buffers):
            to[dst] = of[at]

    def _slot(self, row: int, j: int) -> tuple[int, int]:
        """Where token slot ``j`` of ``row`` lives: (index on the rows axis, slot on the token axis)."""
        return row, j

    def reserve_moves(self, backend, moves, lens):
        """Take what accept's ``moves`` (``(row, dst, src)`` slots; ``lens``: the host
        lengths) need before anything is written; returns what ``give_back`` undoes.
        Contiguous rows are private: nothing to take (None)."""
        return None

    def move_tokens(self, row: int, dst, src) -> None:
        """Slot ``dst[s]`` of ``row`` takes slot ``src[s]``'s stored K and V (codes and
        scales, bit for bit: nothing is decoded), every layer, for ``s = 0, 1, ...`` in
        order (so a source may be a slot written earlier only if the caller wants that).
        Plain slice assignments on the buffers, so every array-API library serves it."""
        lead = (slice(None),) * len(self.leading)
        for d, s_ in zip(dst, src):
            (rd, od), (rs, os_) = self._slot(row, int(d)), self._slot(row, int(s_))
            to = (*lead, rd, slice(None), slice(od, od + 1), ...)
            of = (*lead, rs, slice(None), slice(os_, os_ + 1), ...)
            for buf in self.buffers:
                buf[to] = buf[of]

    def fill(self, value, v_value=None) -> None:
        """Set every K slot, live or not, to ``value`` and every V slot to ``v_value``
        (default: ``value``). The supported way for tests to poison the slots no reader
        may see; nothing else should write storage except through the backend.
        Quantized: every code is the code of 1 and every scale the value, so each slot
        dequantizes to exactly the value (NaN and inf too)."""
        for parts, x in ((self._k_parts, value), (self._v_parts, value if v_value is None else v_value)):
            for buf, part in zip(parts, self.spec.codec.fill_parts(x)):
                buf[...] = part

    def __repr__(self) -> str:
        return (f"KVStore({self.kind}, {self.dtype}, leading={self.leading}, rows={self.rows}, "
                f"kv_heads={self.kv_heads}, max_len={self.max_len}, head_dim={self.head_dim})")
