"""Codecs: how one token's K or V values are stored (as themselves, or as codes plus a scale).

A storage spec names its codec by the stored dtype (``StorageSpec.dtype``): a float
dtype is stored as itself (``PLAIN``); ``"int8"`` and ``"float8_e4m3fn"`` are 8-bit codes
with one float32 scale per (row, KV head, token) (``gqakv.storage.quantize`` has the exact
rule); ``"int8_g32"``, ``"int4_g32"``, ``"int4_g64"`` and ``"int4_g32_rotated"`` keep a
float32 scale per block of 32 or 64 values along d (``Grouped``; 4 bits pack two codes
per byte; the rotated one stores keys Hadamard-rotated and attention rotates the queries
alike). A codec owns everything that depends on the scheme: the dtype its codes are kept
in, the shape of its scales, bytes per token, quantize / dequantize, and the code that
dequantizes to 1 (``fill_code``, what ``KVStore.fill`` writes). Callers ask the codec
instead of branching on a name, so a new codec is one class plus ``register`` here, and
runs at once on every backend's generic path (which reads and writes only through these
methods); a fast path serves only the codecs its backend declares it implements
(``gqakv.dispatch.backend.FastPath.codecs``) and refuses any other one by itself.
"""

from __future__ import annotations

from typing import Any, ClassVar

from . import quantize as _quantize
from ..core.dtypes import ITEMSIZE

#: The name of the plain codec (values stored as themselves) in capability tables.
PLAIN_NAME = "none"


class Codec:
    """One storage scheme for K and V values (see the module docstring). Stateless:
    one instance per scheme, registered by name."""

    #: The name a cache's ``kv_dtype`` gives (``PLAIN_NAME`` for the plain codec).
    name: ClassVar[str] = "?"
    #: True when each token stores a float32 scale per KV head beside its codes.
    scaled: ClassVar[bool] = False
    #: Bytes of one stored value (a code).
    code_bytes: ClassVar[int] = 1
    #: Bytes of one token's scale, per KV head, for K (and as many for V).
    scale_bytes: ClassVar[int] = 0
    #: How a code turns into its value, as a short tag compiled kernels specialize on
    #: (numba: ``numba_kernels.CODE_VIEWS``); None: no kernel decodes it. A fast path
    #: still serves only the codecs it declares by name.
    kernel_tag: ClassVar[str | None] = None

    def bytes_per_token_head(self, head_dim: int, value_bytes: int) -> int:
        """Bytes of one token of one KV head of K (or of V): its ``d`` codes and its scale.
        ``value_bytes``: bytes per value of the spec's dtype (used by the plain codec)."""
        return int(head_dim) * self.code_bytes + self.scale_bytes

    def code_dtype(self, xp) -> Any:
        """``xp``'s dtype the codes are kept in."""
        raise NotImplementedError

    def quantize(self, xp, x) -> tuple[Any, Any]:
        """``(codes [..., d], scales [...] float32)`` of ``x`` ``[..., d]``, token by token."""
        raise NotImplementedError

    def dequantize(self, xp, codes, scales, table=None):
        """float32 values ``[..., d]`` of ``codes`` ``[..., d]`` with ``scales`` ``[...]``.
        ``table``: what ``lookup_table`` made for ``xp`` (None if it makes none)."""
        raise NotImplementedError

    def dequantize_into(self, codes, scales, out):
        """NumPy: ``dequantize``'s values of ``codes`` ``[..., d]`` with ``scales`` ``[...]``
        written into the float32 array ``out`` (codes' shape, e.g. a reused buffer);
        returns ``out``. A codec may compute them in place, faster (NumPy's fast path
        dequantizes each block it reads through this)."""
        import numpy as np

        out[...] = self.dequantize(np, codes, scales)
        return out

    def lookup_table(self, xp, device) -> Any:
        """A per-store constant the dequantizer needs off NumPy (None: none)."""
        return None

    #: The code that dequantizes to exactly its scale (the value 1).
    fill_code: ClassVar[int] = 1

    # -- the parts a store keeps for K (and as many for V) -----------------------------------
    # A store holds each of K and V as a tuple of parts, indexed alike on their leading
    # (layer, row, head, token) axes: ``(codes [..., d], scales [...] float32)`` for a
    # scaled codec, ``(values [..., d],)`` for the plain one. The store's generic reads,
    # writes, copies and fills go through these methods instead of asking which codec it
    # holds.

    def allocate_parts(self, backend, dtype: str, shape: tuple[int, ...], device) -> tuple:
        """Uninitialized parts of one of K / V, values ``shape`` (``dtype``: the spec's
        storage dtype): float32 scales ``shape[:-1]`` through the backend, codes through its
        namespace on the scales' device (backends only know float dtypes by name)."""
        scales = backend.empty(shape[:-1], "float32", device=device)
        xp = backend.namespace()
        try:
            codes = xp.empty(shape, dtype=self.code_dtype(xp), device=getattr(scales, "device", None))
        except RuntimeError as exc:  # torch's CPU out-of-memory
            raise MemoryError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
        return codes, scales

    def encode(self, xp, x) -> tuple:
        """The parts that store ``x`` ``[..., d]`` (``quantize``'s codes and scales)."""
        return self.quantize(xp, x)

    def decode(self, parts: tuple, lookup=None):
        """The values ``[..., d]`` held by ``parts`` (one block of them, as ``encode``
        makes): float32 copies, dequantized. ``lookup``: ``lookup_table``'s constant."""
        from array_api_compat import array_namespace

        codes, scales = parts
        return self.dequantize(array_namespace(codes), codes, scales, lookup)

    def fill_parts(self, value) -> tuple:
        """What each part is set to so that every slot reads back exactly ``value``: the
        code of 1 and a scale of ``value`` (NaN and inf too)."""
        return self.fill_code, value

    def max_block_keys(self, kv_heads: int, head_dim: int, block_elements: int) -> int | None:
        """The most keys one block ``decode`` may take at once (its float32 copy of K and
        of V holds at most ``block_elements`` values each); None: no bound (views)."""
        return max(1, int(block_elements) // (int(kv_heads) * int(head_dim)))

    def decoded_dtype(self, xp, stored_dtype):
        """``xp``'s dtype of what ``decode`` returns for parts stored as ``stored_dtype``."""
        return xp.float32

    # -- keys in another basis (a rotating codec) --------------------------------------------
    #: True when keys are stored rotated (``encode_keys``): attention then rotates the
    #: queries alike (``rotate_queries``), and a row's keys read back for the caller are
    #: rotated back (``unrotate_keys``).
    rotates_keys: ClassVar[bool] = False

    def encode_keys(self, xp, x) -> tuple:
        """The parts that store keys ``x`` ``[..., d]`` (``encode``, after a rotation)."""
        return self.encode(xp, x)

    def rotate_queries(self, xp, q):
        """Queries ``[..., d]`` in the stored keys' basis (the identity here; a rotating
        codec returns them in float32, float64 for float64 q)."""
        return q

    def unrotate_keys(self, xp, k):
        """Decoded keys ``[..., d]`` back in the caller's basis (the identity here)."""
        return k

    def check_head_dim(self, head_dim: int) -> None:
        """ValueError naming the numbers when this codec cannot store ``head_dim`` values
        per token (every head dim works here)."""

    def head_dim_of(self, code_width: int) -> int:
        """The head dim d of a store whose codes (or values) are ``[..., code_width]``."""
        return int(code_width)

    def describe(self, head_dim: int) -> str:
        """What one token of one KV head stores, in words (``gqakv size``)."""
        return f"{int(head_dim)} x {self.code_bytes}-byte codes + a {self.scale_bytes}-byte scale"

    def __repr__(self) -> str:
        return f"<gqakv codec {self.name!r}>"


class PlainCodec(Codec):
    """Values stored as themselves, in the spec's dtype: no codes, no scales (one part,
    the values; reads are views)."""

    name = PLAIN_NAME

    def bytes_per_token_head(self, head_dim: int, value_bytes: int) -> int:
        return int(head_dim) * int(value_bytes)

    def allocate_parts(self, backend, dtype: str, shape: tuple[int, ...], device) -> tuple:
        return (backend.empty(shape, dtype, device=device),)

    def encode(self, xp, x) -> tuple:
        return (x,)

    def decode(self, parts: tuple, lookup=None):
        return parts[0]

    def fill_parts(self, value) -> tuple:
        return (value,)

    def max_block_keys(self, kv_heads: int, head_dim: int, block_elements: int) -> int | None:
        return None

    def decoded_dtype(self, xp, stored_dtype):
        return stored_dtype


class Int8PerToken(Codec):
    """int8 codes, round half to even of ``x / scale``, ``scale = max|x| / 127`` per token."""

    name = "int8"
    scaled = True
    scale_bytes = _quantize.SCALE_BYTES
    kernel_tag = "int8"  # the code is the value

    def code_dtype(self, xp):
        return xp.int8

    def quantize(self, xp, x):
        return _quantize.quantize(xp, x, self.name)

    def dequantize(self, xp, codes, scales, table=None):
        return _quantize.dequantize(xp, codes, scales, self.name)

    def dequantize_into(self, codes, scales, out):
        import numpy as np

        np.copyto(out, codes, casting="unsafe")  # exact: every int8 is a float32
        return np.multiply(out, scales[..., None], out=out)


class E4M3PerToken(Codec):
    """float8_e4m3fn codes kept as their uint8 bit patterns, ``scale = max|x| / 448`` per
    token; off NumPy the 256 code values are looked up in a table (``lookup_table``)."""

    name = "float8_e4m3fn"
    scaled = True
    scale_bytes = _quantize.SCALE_BYTES
    kernel_tag = "e4m3fn"  # the code is an e4m3fn bit pattern
    fill_code = 0x38  # 1.0 in e4m3fn
    _values: Any = None  # e4m3_table() once needed (dequantize_into)

    def code_dtype(self, xp):
        return xp.uint8

    def quantize(self, xp, x):
        return _quantize.quantize(xp, x, self.name)

    def dequantize(self, xp, codes, scales, table=None):
        return _quantize.dequantize(xp, codes, scales, self.name, table)

    def dequantize_into(self, codes, scales, out):
        import numpy as np

        if self._values is None:
            self._values = _quantize.e4m3_table()  # [256] float32, ml_dtypes' values
        # a lookup per code: several times faster than ml_dtypes' float8 cast
        np.take(self._values, codes, out=out, mode="clip")  # uint8: always in range
        return np.multiply(out, scales[..., None], out=out)

    def lookup_table(self, xp, device):
        import numpy as np

        if xp is np or getattr(xp, "__name__", "") == "numpy":
            return None
        return xp.asarray(_quantize.e4m3_table(), device=device)


class Grouped(Codec):
    """Codes with a float32 scale per block of ``group`` values along d (llama.cpp's q8_0 /
    q4_0 blocks, with a float32 scale): ``bits`` 8 (int8 codes) or 4 (two codes per byte),
    and optionally keys rotated by a fixed Hadamard rotation (``gqakv.storage.quantize``
    has the exact rule). A block's scale follows its own largest value, so one outlier
    channel costs only its block's precision. Parts: codes ``[..., d * bits / 8]`` and
    scales ``[..., d / group]``."""

    scaled = True

    def __init__(self, name: str, bits: int, group: int, rotated: bool = False):
        # one class, several registered codecs: the class-level fields are set per instance
        self.name = name  # type: ignore[misc]
        self.bits, self.group, self.rotated = int(bits), int(group), bool(rotated)
        self.rotates_keys = self.rotated  # type: ignore[misc]
        # the code of 1: 1 itself (8 bits), nibbles 1 + 8 in both halves (4 bits)
        self.fill_code = 1 if bits == 8 else 0x99  # type: ignore[misc]

    def check_head_dim(self, head_dim: int) -> None:
        d = int(head_dim)
        if d % self.group:
            raise ValueError(f"kv_dtype={self.name!r} stores blocks of {self.group} values: "
                             f"head_dim={d} is not a multiple of {self.group}")
        if self.rotated and d & (d - 1):
            raise ValueError(f"kv_dtype={self.name!r} rotates keys by a Hadamard matrix: "
                             f"head_dim={d} is not a power of two")

    def bytes_per_token_head(self, head_dim: int, value_bytes: int) -> int:
        d = int(head_dim)
        return d * self.bits // 8 + (d // self.group) * _quantize.SCALE_BYTES

    def head_dim_of(self, code_width: int) -> int:
        return int(code_width) * 8 // self.bits

    def describe(self, head_dim: int) -> str:
        d = int(head_dim)
        rotated = ", keys Hadamard-rotated" if self.rotated else ""
        return (f"{d} x {self.bits}-bit codes + {d // self.group} x {_quantize.SCALE_BYTES}-byte "
                f"scales, one per {self.group} values{rotated}")

    def code_dtype(self, xp):
        return xp.int8 if self.bits == 8 else xp.uint8

    def allocate_parts(self, backend, dtype: str, shape: tuple[int, ...], device) -> tuple:
        d = int(shape[-1])
        self.check_head_dim(d)
        scales = backend.empty((*shape[:-1], d // self.group), "float32", device=device)
        xp = backend.namespace()
        try:
            codes = xp.empty((*shape[:-1], d * self.bits // 8), dtype=self.code_dtype(xp),
                             device=getattr(scales, "device", None))
        except RuntimeError as exc:  # torch's CPU out-of-memory
            raise MemoryError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
        return codes, scales

    def quantize(self, xp, x):
        return _quantize.quantize_groups(xp, x, self.bits, self.group)

    def dequantize(self, xp, codes, scales, table=None):
        return _quantize.dequantize_groups(xp, codes, scales, self.bits, self.group)

    def dequantize_into(self, codes, scales, out):
        import numpy as np

        if self.bits == 8:
            np.copyto(out, codes, casting="unsafe")  # exact: every int8 is a float32
        else:  # low nibble: even values, high nibble: odd ones (code = nibble - 8)
            np.subtract(codes & 15, 8, out=out[..., 0::2], dtype=np.float32, casting="unsafe")
            np.subtract(codes >> 4, 8, out=out[..., 1::2], dtype=np.float32, casting="unsafe")
        blocks = out.view()  # [..., d / g, g]: splitting the last axis never copies
        blocks.shape = (*out.shape[:-1], out.shape[-1] // self.group, self.group)
        np.multiply(blocks, scales[..., None], out=blocks)  # each block by its scale
        return out

    def encode_keys(self, xp, x) -> tuple:
        return self.encode(xp, _quantize.rotate(xp, x) if self.rotated else x)

    def rotate_queries(self, xp, q):
        return _quantize.rotate(xp, q) if self.rotated else q

    def unrotate_keys(self, xp, k):
        return xp.astype(_quantize.rotate(xp, k, inverse=True), k.dtype) if self.rotated else k


PLAIN = PlainCodec()
_REGISTRY: dict[str, Codec] = {}


def register(codec: Codec) -> Codec:
    """Make ``codec`` a storage choice by its name (``kv_dtype=codec.name``). Raises
    ValueError when the name is taken by another codec or is a float dtype's name."""
    name = codec.name
    if name in ITEMSIZE or name == PLAIN_NAME:
        raise ValueError(f"codec name {name!r} is a float dtype's or the plain codec's")
    known = _REGISTRY.get(name)
    if known is not None and known is not codec:
        raise ValueError(f"codec name {name!r} is taken by {known!r}")
    _REGISTRY[name] = codec
    return codec


def unregister(name: str) -> None:
    """Remove a codec registered with ``register`` (tests register throwaway codecs)."""
    if name in BUILTIN:
        raise ValueError(f"codec {name!r} is built in")
    _REGISTRY.pop(name, None)


def of(stored_dtype: str) -> Codec:
    """The codec of a spec whose stored dtype is ``stored_dtype`` (a float dtype: PLAIN)."""
    return _REGISTRY.get(stored_dtype, PLAIN)


def kv_dtype_name(kv_dtype) -> str | None:
    """The codec name of a ``kv_dtype`` argument: None (K/V stored as the cache's dtype),
    or a registered codec's name (``"int8"``, ``"float8_e4m3fn"``; a dtype object of that
    name such as ``numpy.int8``, ``torch.float8_e4m3fn``, ``ml_dtypes.float8_e4m3fn``)."""
    if kv_dtype is None:
        return None
    attr = getattr(kv_dtype, "name", None)
    name: str = kv_dtype if isinstance(kv_dtype, str) else (
        attr if isinstance(attr, str) else getattr(kv_dtype, "__name__", None) or str(kv_dtype))
    name = name.rsplit(".", 1)[-1].lower()
    if name not in _REGISTRY:
        allowed = ", ".join(repr(n) for n in _REGISTRY)
        raise ValueError(f"kv_dtype={kv_dtype!r} is not supported (allowed: None, {allowed})")
    return name


def names() -> tuple[str, ...]:
    """Every registered codec's name (the ``kv_dtype`` values a cache accepts)."""
    return tuple(_REGISTRY)


#: The grouped codecs (``Grouped``): name -> (bits, group, rotated keys).
GROUPED = {"int8_g32": (8, 32, False), "int4_g32": (4, 32, False), "int4_g64": (4, 64, False),
           "int4_g32_rotated": (4, 32, True)}
for _codec in (Int8PerToken(), E4M3PerToken(),
               *(Grouped(name, *spec) for name, spec in GROUPED.items())):
    register(_codec)
#: The built-in codecs' names.
BUILTIN = frozenset(_REGISTRY)
