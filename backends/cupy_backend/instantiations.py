"""The kernel instantiation table: every template instantiation of the fused kernels, as data.

One declaration, read by everything that names an instantiation: ``sources.name_expression``
(the NVRTC name expressions the cupy backend compiles), the CPU emulator's registrations
(tests/cuda_emu/harness.py generates the C++ that driver.cpp includes), the selftest's
compile list and tests/test_cupy_nvrtc.py's parametrization.

The table's axes:
  kernel     ``KERNELS``: its source file, its template parameters in order (which fixes
             how a name is spelled), the storages it reads, the variant flags it takes;
  type tag   the q (input) dtype, and the K/V storage: ``None`` (stored as the q dtype) or a
             quantized code dtype (``CODE_CTYPES``: the kernels' ``gqakv_quantized<T, C>``);
  reader     ``READERS``: how K/V is reached (contiguous rows, or the page table: ``KVPages``);
  variant    the variant trait's flags (``VARIANT_FLAGS``; kernels/variant.cuh);
  head dim   1..MAX_FUSED_HEAD_DIM, the tensor-core kernels only where limits.py allows;
  tile       the decode kernel's query tile (limits.DECODE_QUERY_TILES).
Which (storage, reader) pairs exist is ``LAYOUTS``. ``select`` enumerates the table (every
axis may be narrowed); ``Instantiation.name`` spells one entry as C++.

Storages: "plain" (K/V as the q dtype), "quantized" (8-bit codes, a scale per token) and
"grouped" (a scale per block of ``GROUPS[codec]`` values, 8-bit or 4-bit codes; only head
dims that hold whole blocks). The grouped storage takes every variant flag: the variant
trait is orthogonal to the reader, and nothing compiles the table whole (the backend
compiles a name on its first launch; the NVRTC tests, the emulator's libraries and the
selftest's compile line select from it). Per head dim that is a multiple of 64 the table
has 1,170 grouped entries (decode 576 = 16 flag sets x 2 tiles x 3 dtypes x 3 code types
x 2 readers, prefill 576 with the tree's bit, the append 18; the rotated codec shares
int4_g32's), beside 782 8-bit and 2,543 in all; the emulator builds 160 of them
(tests/cuda_emu/harness.grouped_units: 4 flag sets, 2 dtypes) and NVRTC compiles 96.

Row copies: ``copy_entries`` names the copy kernel's launches for a storage, one per part
of a token (values; codes and scales), each over rows of that part's width: a grouped
cache's codes as bytes (``<gqakv_i8, d * bits / 8>``) and its block scales as floats
(``<float, d / g>``), so the copy kernel serves every storage with no code of its own.

Adding to the table:
  a variant feature   one entry in ``VARIANT_FLAGS`` (its bit, as kernels/variant.cuh spells
                      it); every kernel whose ``variant_mask`` is ``ALL`` takes it (the draft
                      tree's bit, ``TREE``, is added to the prefill kernels' masks only);
  a (storage, reader) one line in ``LAYOUTS``, e.g. ``("quantized", "paged")``: every kernel
                      that reads that storage and has a reader parameter ("R") gets it;
  a kernel            one ``Kernel`` in ``KERNELS``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gqakv.storage.codecs import GROUPED

from . import limits

#: gqakv dtype name -> C++ storage type in the kernels (16-bit types are raw bits).
CTYPES = {"float32": "float", "float16": "gqakv_half", "bfloat16": "gqakv_bf16"}
#: Quantized K/V storage (gqakv codecs) -> the kernels' code type (kernels/quantized_kv.cuh):
#: 8-bit codes with a scale per token, and the grouped codes with a scale per block of G
#: values (``gqakv_i8g<G>``, ``gqakv_i4g<G>``: 4-bit codes two per byte). The rotated codec
#: stores its keys as int4_g32 does (the host rotates q), so it shares that code type and
#: its instantiations (``select`` keeps one entry per name).
CODE_CTYPES = {"int8": "gqakv_i8", "float8_e4m3fn": "gqakv_e4m3",
               "int8_g32": "gqakv_i8g<32>", "int4_g32": "gqakv_i4g<32>", "int4_g64": "gqakv_i4g<64>",
               "int4_g32_rotated": "gqakv_i4g<32>"}
#: The grouped codes' block (values per scale: gqakv.storage.codecs.Grouped.group): only
#: head dims holding whole blocks are instantiated.
GROUPS = {name: group for name, (_, group, _) in GROUPED.items()}


def block_rejection(kv_dtype: str | None, head_dim: int) -> str | None:
    """Why a grouped codec has no kernels at ``head_dim`` (one that splits a block), or None."""
    group = GROUPS.get(kv_dtype or "")
    if group and head_dim % group:
        return (f"kv_dtype={kv_dtype!r} at head_dim={head_dim} (blocks of {group} values: head "
                f"dims that are multiples of {group})")
    return None

#: The variant trait's flags (kernels/variant.cuh: GQAKV_VARIANT_*), by feature name of
#: ``gqakv.core.inputs.AttentionInputs.features``: the ``AttentionParams`` features, and
#: ``tree`` (a draft tree's mask clause: speculative verification, gqakv.core.tree).
VARIANT_FLAGS = {"window": 1, "softcap": 2, "sinks": 4, "alibi": 8, "tree": 16}
#: The draft-tree bit: only the prefill kernels take it (their ``variant_mask`` is
#: ``ALL | TREE``); a tree call of any length runs on them (routing.py), so the decode
#: kernels and the merge keep their instantiations.
TREE = VARIANT_FLAGS["tree"]
#: Every score / window feature at once (window, softcap, sinks, alibi): the variant mask
#: of a kernel that implements all of them.
ALL = sum(v for name, v in VARIANT_FLAGS.items() if name != "tree")
#: The largest flag set of the table (every bit).
_ANY = sum(VARIANT_FLAGS.values())

#: Reader -> the template argument naming it ("" for the default: the K/V pack is empty).
READERS = {"contiguous": "", "paged": "KVPages"}
#: Storage kind -> the K/V storages of that kind (None: K/V stored as the q dtype).
STORAGES: dict[str, tuple[str | None, ...]] = {
    "plain": (None,), "quantized": tuple(c for c in CODE_CTYPES if c not in GROUPS), "grouped": tuple(GROUPS)}
#: The (storage kind, reader) pairs instantiated, one line each.
LAYOUTS = (
    ("plain", "contiguous"),
    ("plain", "paged"),
    ("quantized", "contiguous"),
    ("quantized", "paged"),  # QuantizedKV<C, PagedKV>: 8-bit pages
    ("grouped", "contiguous"),  # the same reader: a scale per block, 4-bit codes two a byte
    ("grouped", "paged"),
)


def _any_head_dim(dtype: str, head_dim: int) -> str | None:
    return None


@dataclass(frozen=True)
class Kernel:
    """One kernel template: ``params`` spells its template parameters in order, as
    ``Instantiation.name`` renders them:
      "S" the K/V storage tag (the q type, or ``gqakv_quantized<q type, code type>``),
      "T" the q (input) type, "C" the code type,
      "E" the element type it moves (the code type for a quantized storage, else the q type),
      "D" the head dim, "QB" the query tile, "V" the variant flags (default 0),
      "R" the reader (a trailing pack: empty for contiguous rows).
    Trailing parameters at their default are left out (C++ default template arguments)."""

    name: str
    file: str
    params: tuple[str, ...]
    storages: tuple[str, ...] = ("plain",)
    variant_mask: int = 0  # the flags its VARIANT parameter takes (0: none)
    #: reads no K/V (the merge: fp32 partials), so a quantized cache launches its plain one
    storage_blind: bool = False
    #: why (dtype, head_dim) is not instantiated (None: it is), beyond 1..MAX_FUSED_HEAD_DIM
    rejection: Callable[[str, int], str | None] = _any_head_dim

    @property
    def readers(self) -> tuple[str, ...]:
        return tuple(READERS) if "R" in self.params else ("contiguous",)

    def variants(self) -> tuple[int, ...]:
        """The variant flags it is instantiated for (0: plain causal), ascending."""
        return tuple(v for v in range(_ANY + 1) if v & ~self.variant_mask == 0)


#: Every kernel, one line each (the tensor-core ones have no quantized storage: routing.py
#: says why; the merge reads fp32 partials, so a quantized cache uses its plain one; its
#: variant parameter takes only the sink term).
KERNELS = {k.name: k for k in (
    Kernel("gqakv_write_kv", "write_kv.cu", ("T", "D", "R")),
    Kernel("gqakv_write_kv_quantized", "write_kv_quantized.cu", ("T", "C", "D", "R"), ("quantized", "grouped")),
    Kernel("gqakv_copy_tokens", "copy_tokens.cu", ("E", "D"), ("plain", "quantized")),
    Kernel("gqakv_decode", "decode.cu", ("S", "D", "QB", "V", "R"), ("plain", "quantized", "grouped"), ALL),
    Kernel("gqakv_decode_mma", "decode_mma.cu", ("S", "D", "V", "R"), ("plain",), ALL,
           rejection=limits.decode_mma_rejection),
    Kernel("gqakv_merge", "merge.cu", ("T", "D", "V"), ("plain",), VARIANT_FLAGS["sinks"],
           storage_blind=True),
    # the prefill kernels also take the draft tree's clause (TREE): tree calls of every t_q
    Kernel("gqakv_prefill", "prefill.cu", ("S", "D", "V", "R"), ("plain", "quantized", "grouped"),
           ALL | TREE),
    Kernel("gqakv_prefill_mma", "prefill_mma.cu", ("S", "D", "V", "R"), ("plain",), ALL | TREE,
           rejection=limits.prefill_mma_rejection),
)}


def storage_kind(kv_dtype: str | None) -> str:
    """The STORAGES kind holding ``kv_dtype`` (None: "plain")."""
    return next(kind for kind, names in STORAGES.items() if kv_dtype in names)


@dataclass(frozen=True)
class Instantiation:
    """One entry of the table: ``kernel`` at q dtype ``dtype``, K/V storage ``kv_dtype``
    (None: as ``dtype``; else a key of CODE_CTYPES), ``reader``, ``variant`` flags,
    ``head_dim`` and (decode only) query ``tile``."""

    kernel: str
    dtype: str
    head_dim: int
    kv_dtype: str | None = None
    reader: str = "contiguous"
    variant: int = 0
    tile: int | None = None

    @property
    def name(self) -> str:
        """The C++ template-id, e.g. ``gqakv_decode<gqakv_bf16, 128, 4>``,
        ``gqakv_prefill<gqakv_quantized<float, gqakv_i8>, 64, 7>`` or
        ``gqakv_write_kv<float, 64, KVPages>``: valid as an NVRTC name expression and as
        C++ (the emulator takes its address)."""
        t = CTYPES[self.dtype]
        c = CODE_CTYPES[self.kv_dtype] if self.kv_dtype is not None else None
        values = {"S": f"gqakv_quantized<{t}, {c}>" if c else t, "T": t, "C": c or "", "E": c or t,
                  "D": str(self.head_dim), "QB": str(self.tile), "V": str(self.variant),
                  "R": READERS[self.reader]}
        params = list(KERNELS[self.kernel].params)
        defaults = {"V": "0", "R": ""}
        while params and params[-1] in defaults and values[params[-1]] == defaults[params[-1]]:
            params.pop()
        return f"{self.kernel}<{', '.join(values[p] for p in params)}>"

    @property
    def file(self) -> str:
        return KERNELS[self.kernel].file


def rejection(inst: Instantiation) -> str | None:
    """Why ``inst`` is not in the table (naming the axis and what it allows), or None."""
    k = KERNELS.get(inst.kernel)
    if k is None:
        return f"unknown kernel {inst.kernel!r} (known: {', '.join(KERNELS)})"
    if inst.dtype not in CTYPES:
        return f"no fused kernels for dtype {inst.dtype!r} (fused: {', '.join(CTYPES)})"
    if inst.kv_dtype is not None and inst.kv_dtype not in CODE_CTYPES:
        return f"kv_dtype={inst.kv_dtype!r} (quantized: {', '.join(CODE_CTYPES)})"
    kind = storage_kind(inst.kv_dtype)
    if kind not in k.storages:
        return f"{k.name} has no {kind} instantiation ({kind}: {', '.join(kernels_with(storage=kind))})"
    blocks = block_rejection(inst.kv_dtype, inst.head_dim)
    if blocks:
        return f"no instantiation: {blocks}"
    if inst.reader not in READERS:
        return f"reader={inst.reader!r} (readers: {', '.join(READERS)})"
    if inst.reader not in k.readers:
        return (f"{k.name} has no {inst.reader} instantiation ({inst.reader}: "
                f"{', '.join(kernels_with(reader=inst.reader))})")
    if (kind, inst.reader) not in LAYOUTS:
        return f"no {kind} x {inst.reader} instantiations (instantiated: {LAYOUTS})"
    if inst.variant not in k.variants():
        with_variants = ", ".join(n for n, x in KERNELS.items() if x.variant_mask)
        return (f"{k.name} has no variant={inst.variant} (variants: flags 1..{_ANY} of "
                f"{with_variants}; {k.name} takes {k.variants()})")
    if not 1 <= inst.head_dim <= limits.MAX_FUSED_HEAD_DIM:
        return f"no fused kernels for head_dim={inst.head_dim} (fused: 1..{limits.MAX_FUSED_HEAD_DIM})"
    if "QB" in k.params:
        if inst.tile not in limits.DECODE_QUERY_TILES:
            return (f"{k.name} has no query_tile={inst.tile} "
                    f"(instantiated: {', '.join(map(str, limits.DECODE_QUERY_TILES))})")
    elif inst.tile is not None:
        return f"{k.name} takes no query_tile (got {inst.tile})"
    why = k.rejection(inst.dtype, inst.head_dim)
    if why is not None:
        return f"{k.name} has no {why}"
    return None


def kernels_with(storage: str | None = None, reader: str | None = None) -> list[str]:
    """Kernels with instantiations over ``storage`` (a storage kind) and ``reader``."""
    return [n for n, k in KERNELS.items()
            if (storage is None or storage in k.storages) and (reader is None or reader in k.readers)
            and any((s, r) in LAYOUTS for s in k.storages for r in k.readers
                    if (storage is None or s == storage) and (reader is None or r == reader))]


def select(kernels: Iterable[str] | None = None, dtypes: Iterable[str] | None = None,
           head_dims: Iterable[int] = (), kv_dtypes: Iterable[str | None] | None = None,
           readers: Iterable[str] | None = None,
           variants: Iterable[int] | None = None) -> list[Instantiation]:
    """The table's entries on the axes given (None: all of that axis; head dims must be
    given: the table holds every d in 1..MAX_FUSED_HEAD_DIM), in the order of the axes'
    values (kernel, then dtype, head dim, storage, reader, variant, tile), without entries
    whose name another already has (none do: each entry spells its own name)."""
    out: dict[str, Instantiation] = {}
    axes = itertools.product(
        KERNELS if kernels is None else kernels, CTYPES if dtypes is None else dtypes, head_dims,
        (None, *CODE_CTYPES) if kv_dtypes is None else kv_dtypes,
        READERS if readers is None else readers,
        range(_ANY + 1) if variants is None else variants)
    for kernel, dtype, d, kv, reader, v in axes:
        tiles = limits.DECODE_QUERY_TILES if "QB" in KERNELS[kernel].params else (None,)
        for tile in tiles:
            inst = Instantiation(kernel, dtype, d, kv, reader, v, tile)
            if rejection(inst) is None:
                out.setdefault(inst.name, inst)
    return list(out.values())


def names(entries: Iterable[Instantiation]) -> list[str]:
    return [e.name for e in entries]


#: The scale copy a quantized cache's token copies launch beside the codes' (plan.py): the
#: copy kernel over fp32 rows of one element.
SCALE_COPY = Instantiation("gqakv_copy_tokens", "float32", 1)
#: Bits per code of the grouped codecs (gqakv.storage.codecs.GROUPED): their code row is
#: d * bits / 8 bytes.
BITS = {name: bits for name, (bits, _, _) in GROUPED.items()}


def copy_entries(dtype: str, head_dim: int, kv_dtype: str | None = None) -> tuple[Instantiation, ...]:
    """The copy kernel's launches for one ``Backend.copy_tokens`` call over a store of
    ``dtype`` (q dtype) / ``kv_dtype`` at ``head_dim`` d, in launch order: what plan.py
    plans, and what the NVRTC tests and the emulator's libraries build.

    The kernel copies rows of ``D`` elements of type ``E``, whatever they mean, so each
    part of a token is one launch over rows of that part's width:
      plain       values ``[.., S, d]``:                    ``<T, d>``;
      per token   codes ``[.., S, d]``, scales ``[.., S]``:  ``<C, d>``, ``<float, 1>``;
      grouped     codes ``[.., S, d * bits / 8]`` bytes:     ``<gqakv_i8, d * bits / 8>``
                  (4-bit codes two a byte are moved as bytes: a copy never looks inside),
                  scales ``[.., S, d / g]`` float32:        ``<float, d / g>``.
    The grouped codes' own code types are not copy instantiations (the table refuses the
    copy kernel a grouped storage: its ``D`` would count values, not bytes). KeyError
    naming the axis when a part has no instantiation (e.g. a head dim that splits a block).
    """
    parts: tuple[Instantiation, ...]
    if kv_dtype is not None and kv_dtype in GROUPS:
        why = block_rejection(kv_dtype, head_dim)
        if why:
            raise KeyError(f"gqakv_copy_tokens has no {why}")
        parts = (Instantiation("gqakv_copy_tokens", dtype, head_dim * BITS[kv_dtype] // 8, "int8"),
                 Instantiation("gqakv_copy_tokens", "float32", head_dim // GROUPS[kv_dtype]))
    elif kv_dtype is not None:
        parts = (Instantiation("gqakv_copy_tokens", dtype, head_dim, kv_dtype), SCALE_COPY)
    else:
        parts = (Instantiation("gqakv_copy_tokens", dtype, head_dim),)
    for inst in parts:
        why = rejection(inst)
        if why is not None:
            raise KeyError(why)
    return parts
