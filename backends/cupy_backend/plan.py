"""Launch planning for the fused kernels: grids, blocks and exact argument lists.

Pure Python and NumPy: a plan names its array arguments symbolically (``Buf``) and
types every scalar explicitly (``np.int32``, ``np.int64``, ``np.float32``), so the cupy
backend and the CPU emulation harness (tests/cuda_emu) execute the very same launches;
only the executor that turns ``Buf`` names into pointers differs.

Buffers a plan refers to:
  copy_tokens: dst_k, dst_v ``[layers, R, Hkv, S, d]`` and src_k, src_v (the same arrays
             or others, e.g. the reorder temporary ``[layers, 1, Hkv, n, d]``); pairs
             ``[3, P]`` int64 (dst rows, src rows, token counts).
  write_kv:  k_new, v_new ``[B, Hkv, Tn, d]``; k_buf, v_buf ``[R, Hkv, S, d]``;
             rows, starts, n_new ``[B]`` int64 (device copies of the host values).
  attention: q ``[B, Hq, T, d]``; k_buf, v_buf; rows, lens, n_new ``[B]`` int64;
             out ``[B, Hq, T, d]`` (pre-filled with 0); lse ``[B, Hq, T]`` fp32
             (pre-filled with -inf); workspace part_o ``[B, Hq, T, splits, d]`` and
             part_lse ``[B, Hq, T, splits]`` fp32 when split-KV is used; dummy (1 fp32);
             sinks ``[Hq]`` fp32 (only under the sinks variant); alibi ``[Hq]`` fp32
             slopes (only under the alibi variant); a draft tree's tree_mask ``[B, S, S]``
             uint8 (its ancestor sets) and tree_depth ``[B, S]`` int64 (S: the tree's
             tokens per entry, ``tree_stride``; only under the tree variant).
  paged (write_kv, attention with ``pages``): k_buf, v_buf are the page pools
             ``[num_pages, Hkv, page_size, d]`` (their strides: page, head, token) and
             table the page table ``[R, pages_per_row]`` int32 (kernels/paged_kv.cuh);
             the launch is the kernel's paged instantiation, its last argument a
             ``PageTableArg`` (the kernels' ``KVPages``, by value).
  quantized caches (``kv_dtype``): k_buf, v_buf hold codes and k_scale, v_scale
             ``[R, Hkv, S]`` fp32 their scales (paged: ``[num_pages, Hkv, page_size]``) (copy_tokens: dst_k_scale, dst_v_scale,
             src_k_scale, src_v_scale ``[layers, R, Hkv, S]``); attention reaches them
             through ``KernelParams`` (laid out like the codes: scale strides x d equal
             the code strides, checked by the caller).
The attention kernels take their runtime parameters as one struct (``KernelParams``, the
kernels' ``AttnParams`` in kernels/variant.cuh) and the variant as a template flag
(``variant_flags``): which of window / softcap / sinks / alibi the instantiation implements,
and the draft tree's bit (``tree_stride``: a tree call, served by the prefill kernels at
any t_q).
Strides are in elements; the head-dim stride is 1 and row strides keep vector alignment.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from gqakv.core import semantics

from . import instantiations, limits, sources, structs

# The kernels' limits (declared once in limits.py, which the kernels read too).
BLOCK = (limits.THREADS_PER_CTA, 1, 1)
MAX_GRID_X = limits.MAX_GRID_X
MAX_GRID_Y = limits.MAX_GRID_Y
#: Query tokens per row up to which attention uses the decode kernel.
DECODE_MAX_T = limits.DECODE_MAX_T
#: Fewest keys a split-KV chunk holds: each split CTA also loads its queries and writes
#: QB x d fp32 partials the merge reads back (~4 KB at d = 128, tile 4: 3% of the 128 KB of
#: K and V in 128 keys).
MIN_KEYS_PER_SPLIT = 128
#: The decode kernel counts the keys of one split in an int (decode.cu).
MAX_KEYS_PER_SPLIT = limits.MAX_KEYS_PER_SPLIT
#: Resident decode CTAs per SM, per query tile: the minimum in decode.cu's __launch_bounds__
#: (DecodeOccupancy); tests/test_cupy_nvrtc.py checks ptxas' register counts allow it.
DECODE_CTAS_PER_SM = limits.DECODE_CTAS_PER_SM
#: Query rows per tensor-core decode CTA (DecodeMmaShape::QB) and its resident CTAs per SM
#: by head dim (DecodeMmaShape::CTAS_PER_SM).
DECODE_MMA_ROWS = limits.DECODE_MMA_ROWS
DECODE_MMA_CTAS_PER_SM = limits.DECODE_MMA_CTAS_PER_SM
#: Split planner cost model, in key rows streamed by one CTA: the fixed cost of a CTA (its
#: queries' load latency, the shared-memory merge of its key slots, its output writes) and
#: of the merge launch.
SPLIT_CTA_OVERHEAD_KEYS = 32
SPLIT_MERGE_OVERHEAD_KEYS = 64
#: The split planner considers grids of up to about this many waves of resident CTAs.
DECODE_MAX_WAVES = 8


@dataclass(frozen=True)
class Buf:
    """A named array argument, resolved to a device pointer by the executor."""

    name: str


@dataclass(frozen=True)
class Launch:
    kernel: str  # key of sources.KERNEL_FILES
    name: str  # template instantiation, e.g. "gqakv_decode<gqakv_bf16, 128>"
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple


#: The variant trait's flags (kernels/variant.cuh: GQAKV_VARIANT_*), by feature name of
#: ``gqakv.core.semantics.AttentionParams.features``: declared in the instantiation table.
VARIANT_FLAGS = instantiations.VARIANT_FLAGS

#: The kernels' ``AttnParams`` (kernels/params.cuh), field for field: both from structs.ATTN_PARAMS.
PARAMS_DTYPE = structs.ATTN_PARAMS.dtype


def variant_flags(params: semantics.AttentionParams, tree: bool = False) -> int:
    """The template flag of the kernels implementing ``params``' variant (0: causal), with
    the draft tree's bit when ``tree``."""
    return sum(VARIANT_FLAGS[f] for f in params.features) | (instantiations.TREE if tree else 0)


@dataclass(frozen=True)
class KernelParams:
    """The attention kernels' parameter struct (``AttnParams``), with the sinks array named
    symbolically: the executor packs it with the array's device address (``record``)."""

    scale: float
    softcap: float = 0.0
    window: int = 0
    sinks: Buf | None = None
    k_scale: Buf | None = None  # a quantized cache's scales
    v_scale: Buf | None = None
    alibi: Buf | None = None  # [Hq] float32 ALiBi slopes
    tree_mask: Buf | None = None  # a draft tree: [B, S, S] uint8 ancestor sets
    tree_depth: Buf | None = None  # and [B, S] int64 depths
    tree_stride: int = 0  # S (0: no tree)

    @classmethod
    def of(cls, params: semantics.AttentionParams, quantized: bool = False,
           tree_stride: int | None = None) -> "KernelParams":
        scales = (Buf("k_scale"), Buf("v_scale")) if quantized else (None, None)
        tree = tree_stride is not None
        return cls(scale=float(params.scale), softcap=float(params.softcap or 0.0),
                   window=int(params.window or 0), sinks=Buf("sinks") if params.sinks is not None else None,
                   k_scale=scales[0], v_scale=scales[1],
                   alibi=Buf("alibi") if params.alibi_slopes is not None else None,
                   tree_mask=Buf("tree_mask") if tree else None,
                   tree_depth=Buf("tree_depth") if tree else None,
                   tree_stride=0 if tree_stride is None else int(tree_stride))

    def record(self, address) -> np.void:
        """The struct as a NumPy record of ``PARAMS_DTYPE``; ``address(buf)`` gives a Buf's
        device address."""
        r = np.zeros((), PARAMS_DTYPE)
        r["scale"], r["softcap"], r["window"] = self.scale, self.softcap, self.window
        r["tree_stride"] = self.tree_stride
        for name in ("sinks", "k_scale", "v_scale", "alibi", "tree_mask", "tree_depth"):
            buf = getattr(self, name)
            r[name] = 0 if buf is None else int(address(buf))
        return cast(np.void, r[()])  # a 0-d record indexed by () is its np.void


#: The kernels' ``KVPages`` (kernels/params.cuh), field for field: both from structs.KV_PAGES.
PAGES_DTYPE = structs.KV_PAGES.dtype
#: The paged kernels compute a key's page in 32 bits: rows hold fewer slots than this.
MAX_PAGED_ROW_SLOTS = 2**31


def page_divisor(page_size: int) -> tuple[int, int]:
    """(magic, shift) with ``key // page_size == ((magic * key >> 32) + key) >> shift`` for
    every ``0 <= key < 2**31`` (kernels/paged_kv.cuh: page_of)."""
    P = int(page_size)
    shift = (P - 1).bit_length()  # ceil(log2 P)
    return (2**32 * (2**shift - P)) // P + 1, shift


@dataclass(frozen=True)
class PageTableArg:
    """The paged kernels' last argument (``KVPages``): the page table ``[R, table_stride]``
    int32 named symbolically (``table``), packed with its device address by ``record``.
    Raises NotImplementedError for rows of ``MAX_PAGED_ROW_SLOTS`` slots or more (the
    kernels' 32-bit page arithmetic; the backend then takes the generic path)."""

    table_stride: int
    page_size: int
    table: Buf = Buf("table")

    def __post_init__(self):
        if int(self.table_stride) * int(self.page_size) >= MAX_PAGED_ROW_SLOTS:
            raise NotImplementedError(
                f"paged rows of {int(self.table_stride)} pages x {int(self.page_size)} tokens reach "
                f"{MAX_PAGED_ROW_SLOTS} slots (the paged kernels index a row's keys in 32 bits)")

    def record(self, address) -> np.void:
        """The struct as a NumPy record of ``PAGES_DTYPE``; ``address(buf)`` gives the
        table's device address."""
        r = np.zeros((), PAGES_DTYPE)
        r["table"] = int(address(self.table))
        r["table_stride"], r["page_size"] = self.table_stride, self.page_size
        r["page_magic"], r["page_shift"] = page_divisor(self.page_size)
        return cast(np.void, r[()])  # a 0-d record indexed by () is its np.void


@dataclass
class Plan:
    launches: list[Launch] = field(default_factory=list)
    #: workspace buffers to allocate: name -> shape (fp32)
    workspace: dict[str, tuple[int, ...]] = field(default_factory=dict)
    num_splits: int = 1
    keys_per_split: int = 0


def prefill_kernel(dtype: str, head_dim: int, tensor_cores: bool = True) -> str:
    """The chunked-prefill kernel for (dtype, head_dim): tensor cores (gqakv_prefill_mma)
    for float16 / bfloat16 with head_dim a multiple of 16 on a device that has them
    (``tensor_cores``: compute capability 8.0+), fp32 FMA (gqakv_prefill) otherwise."""
    if tensor_cores and sources.prefill_mma_supported(dtype, head_dim):
        return "gqakv_prefill_mma"
    return "gqakv_prefill"


def prefill_rows(head_dim: int, kernel: str = "gqakv_prefill") -> int:
    """Query rows per prefill CTA: PrefillShape::ROWS (gqakv_prefill) and
    PrefillMmaShape::ROWS (gqakv_prefill_mma: 4 warps x the mma's 16 rows), both read from
    limits.py."""
    if kernel == "gqakv_prefill_mma":
        return limits.PREFILL_MMA_ROWS
    return limits.prefill_rows(head_dim)


def _i64(*xs):
    return tuple(np.int64(x) for x in xs)


def _check_grid(kernel: str, what: str, grid_x: int, grid_y: int = 1) -> None:
    """NotImplementedError naming the launch when its grid exceeds CUDA's limits (the
    cupy backend then takes the generic path; a launch would fail on the device)."""
    if grid_x > MAX_GRID_X or grid_y > MAX_GRID_Y:
        raise NotImplementedError(f"{kernel}: {what} is a grid of ({grid_x}, {grid_y}) CTAs "
                                  f"(limits {MAX_GRID_X}, {MAX_GRID_Y})")


def plan_write_kv(dtype: str, head_dim: int, n_new: np.ndarray, kv_heads: int, t_new: int,
                  new_strides, buf_strides, *, pages: PageTableArg | None = None,
                  kv_dtype: str | None = None, scale_strides=None) -> Plan:
    """One launch writing every entry's first n_new[b] tokens (nothing when all are 0).

    new_strides, buf_strides: element strides (batch, head, token) of k_new and k_buf
    (paged: of the pool, page / head / token). pages: the page table of a paged cache
    (the pages were taken on the host; the kernel only writes into them).
    kv_dtype: a quantized cache's storage (gqakv_write_kv_quantized quantizes on the
    device, one warp per token); scale_strides: then the (row, head, token) strides of
    k_scale (and v_scale; paged: of the scale pools, page, head, token). Paged and
    quantized at once: the quantizing append through the page table.
    """
    plan = Plan()
    B = int(n_new.shape[0])
    max_n = int(n_new.max()) if B else 0
    if max_n == 0:
        return plan
    _check_grid("gqakv_write_kv", f"{B} entries x {kv_heads} heads", B * kv_heads)
    if kv_dtype is not None:
        kernel = "gqakv_write_kv_quantized"
        grid_y = min(MAX_GRID_Y, -(-max_n // (BLOCK[0] // 32)))  # a warp per token
        args = (Buf("k_new"), Buf("v_new"), Buf("k_buf"), Buf("v_buf"), Buf("k_scale"),
                Buf("v_scale"), Buf("rows"), Buf("starts"), Buf("n_new"), np.int32(kv_heads),
                np.int32(t_new), *_i64(*new_strides), *_i64(*buf_strides), *_i64(*scale_strides))
        name = sources.name_expression(kernel, dtype, head_dim, kv_dtype=kv_dtype)
        if pages is not None:
            args += (pages,)
            name = sources.paged_name_expression(kernel, dtype, head_dim, kv_dtype=kv_dtype)
        plan.launches.append(Launch(kernel, name, (B * kv_heads, grid_y, 1), BLOCK, args))
        return plan
    vectors = max_n * (head_dim // sources.vec_width(dtype, head_dim))
    grid_y = min(MAX_GRID_Y, -(-vectors // BLOCK[0]))
    args = (Buf("k_new"), Buf("v_new"), Buf("k_buf"), Buf("v_buf"), Buf("rows"), Buf("starts"),
            Buf("n_new"), np.int32(kv_heads), np.int32(t_new), *_i64(*new_strides),
            *_i64(*buf_strides))
    name = sources.name_expression("gqakv_write_kv", dtype, head_dim)
    if pages is not None:
        args += (pages,)
        name = sources.paged_name_expression("gqakv_write_kv", dtype, head_dim)
    plan.launches.append(Launch("gqakv_write_kv", name, (B * kv_heads, grid_y, 1), BLOCK, args))
    return plan


def plan_copy_tokens(dtype: str, head_dim: int, n_tokens: np.ndarray, layers: int, kv_heads: int,
                     dst_strides, src_strides, kv_dtype: str | None = None,
                     dst_scale_strides=None, src_scale_strides=None) -> Plan:
    """One launch for every copy of a ``Backend.copy_tokens`` call (nothing when all n are 0).

    n_tokens: host int array [P]; dst_strides, src_strides: element strides (layer, row,
    head, token) of dst_k and src_k. Raises NotImplementedError beyond the grid limits.
    kv_dtype: a quantized cache: the codes' launch, then a second one of the same kernel
    moving the scales (``*_scale_strides``: their element strides (layer, row, head,
    token); the value axis, if any, of stride 1). Each launch's instantiation and row
    width are ``instantiations.copy_entries``': per-token codes ``<C, d>`` and scales
    ``<float, 1>``; grouped codes as bytes ``<gqakv_i8, d * bits / 8>`` and scales
    ``<float, d / g>``.
    """
    plan = Plan()
    P = int(n_tokens.shape[0])
    max_n = int(n_tokens.max()) if P else 0
    if max_n == 0:
        return plan
    ctas = P * layers * kv_heads
    if ctas > MAX_GRID_X:
        raise NotImplementedError(f"{P} copies x {layers} layers x {kv_heads} heads = {ctas} CTAs "
                                  f"(grid limit {MAX_GRID_X})")
    # (buffer names, strides) of each part, in copy_entries' order: the values or codes, then the scales
    parts = ((("dst_k", "dst_v", "src_k", "src_v"), dst_strides, src_strides),
             (("dst_k_scale", "dst_v_scale", "src_k_scale", "src_v_scale"), dst_scale_strides,
              src_scale_strides))
    for entry, (names, dst_s, src_s) in zip(instantiations.copy_entries(dtype, head_dim, kv_dtype), parts):
        # vectors of the part's row: its element type's width (copy_tokens.cu's VecWidth<E, D>)
        vectors = max_n * (entry.head_dim // sources.vec_width(entry.kv_dtype or entry.dtype, entry.head_dim))
        grid_y = min(MAX_GRID_Y, -(-vectors // BLOCK[0]))
        args = (*map(Buf, names), Buf("pairs"), np.int32(P), np.int32(layers), np.int32(kv_heads),
                *_i64(*dst_s), *_i64(*src_s))
        plan.launches.append(Launch("gqakv_copy_tokens", entry.name, (ctas, grid_y, 1), BLOCK, args))
    return plan


def choose_query_tile(queries: int) -> tuple[int, int]:
    """(query tile, query chunks) for ``queries`` = G * T queries per KV head.

    The smallest instantiated tile that holds them all (registers grow with the tile, so
    G = 4, T = 1 should not carry 8 query slots); beyond the largest tile, the fewest
    chunks of the largest, then the smallest tile that still covers them in that many.
    """
    tiles = sources.DECODE_QUERY_TILES
    chunks = -(-queries // tiles[-1])
    per_chunk = -(-queries // chunks)
    return next(t for t in tiles if t >= per_chunk), chunks


@functools.lru_cache(maxsize=1024)  # every step's plan asks
def decode_kernel(dtype: str, head_dim: int, queries: int,
                  tensor_cores: bool = True) -> tuple[str, int | None, int, int]:
    """(kernel, query tile, query chunks, resident CTAs per SM) of the decode launch for
    ``queries`` = G * T queries per KV head: the tensor-core kernel (16 query rows per CTA)
    where it serves (dtype, head_dim) and the device has mma.m16n8k16 (``tensor_cores``:
    compute capability 8.0+), else gqakv_decode with ``choose_query_tile``'s tile."""
    if tensor_cores and sources.decode_mma_supported(dtype, head_dim):
        return ("gqakv_decode_mma", None, -(-queries // DECODE_MMA_ROWS),
                DECODE_MMA_CTAS_PER_SM[head_dim])
    tile, chunks = choose_query_tile(queries)
    return "gqakv_decode", tile, chunks, DECODE_CTAS_PER_SM[tile]


def choose_splits(lens, ctas_per_row: int, sm_count: int, ctas_per_sm: int = 1,
                  min_keys_per_split: int = MIN_KEYS_PER_SPLIT) -> tuple[int, int]:
    """(num_splits, keys_per_split) for the decode kernel.

    lens: live lengths of the rows that get queries (never the cache's capacity: results
    must not depend on it); ctas_per_row: decode CTAs per row and split (KV heads x query
    chunks); ctas_per_sm: how many of them one SM holds at once (DECODE_CTAS_PER_SM).

    Decode is bound by HBM bandwidth, which the kernel reaches only with every SM holding
    its full complement of CTAs. Row b's keys are cut into ceil(L_b / keys) chunks, one CTA
    each; CTAs run in waves of ``sm_count * ctas_per_sm``, and a wave lasts as long as its
    longest chunk (a part-filled wave is charged in full: its SMs stream with fewer bytes
    in flight). Among split counts whose chunks hold at least ``min_keys_per_split`` keys,
    the fewest splits whose waves x (keys + SPLIT_CTA_OVERHEAD_KEYS) + SPLIT_MERGE_OVERHEAD_KEYS
    (when split) is within 2% of the least wins. Considered: up to ~DECODE_MAX_WAVES waves.
    """
    lens = np.asarray(lens, dtype=np.int64).reshape(-1)
    lens = lens[lens > 0]
    if lens.size == 0:
        return 1, 1
    max_len = int(lens.max())
    slots = max(1, int(sm_count)) * max(1, int(ctas_per_sm))
    ctas_per_row = max(1, int(ctas_per_row))
    # The kernel counts the keys of a split in an int: rows above 2^30 keys must split.
    lo = -(-max_len // MAX_KEYS_PER_SPLIT)
    hi = min(-(-max_len // max(1, int(min_keys_per_split))), MAX_GRID_Y,
             -(-DECODE_MAX_WAVES * slots // (ctas_per_row * lens.size)))
    hi = max(lo, hi)
    keys = -(-max_len // np.arange(lo, hi + 1, dtype=np.int64))  # keys per split, descending
    splits = -(-max_len // keys)  # the splits that hold keys (<= the count asked for)
    ctas = ctas_per_row * (-(-lens[None, :] // keys[:, None])).sum(axis=1)
    waves = -(-ctas // slots)
    cost = waves * (keys + SPLIT_CTA_OVERHEAD_KEYS) + (splits > 1) * SPLIT_MERGE_OVERHEAD_KEYS
    # The fewest splits within 2% of the best: a marginal gain is not worth more merging.
    best = int(np.argmax(cost <= 1.02 * cost.min()))
    return (1, max_len) if splits[best] == 1 else (int(splits[best]), int(keys[best]))


def plan_attention(dtype: str, head_dim: int, *, batch: int, kv_heads: int, group: int,
                   t_q: int, lens: np.ndarray, n_new: np.ndarray, scale: float | None = None,
                   q_strides, buf_strides, out_strides, sm_count: int,
                   min_keys_per_split: int = MIN_KEYS_PER_SPLIT,
                   force_splits: int | None = None,
                   tensor_cores: bool = True,
                   params: semantics.AttentionParams | None = None,
                   pages: PageTableArg | None = None, kv_dtype: str | None = None,
                   invariant: bool = False, tree_stride: int | None = None) -> Plan:
    """Launches computing attention of q over the cache into out and lse.

    lens, n_new: host int arrays [B] (lens are post-append lengths of each entry's row).
    Decode kernel for t_q <= DECODE_MAX_T (with split-KV + merge when the batch is too
    small to fill the GPU), chunked-prefill kernel otherwise. Entries with n_new = 0
    need no work: out and lse are pre-filled by the caller. tensor_cores: whether the
    device runs mma.m16n8k16 on float16 / bfloat16 (compute capability 8.0+); without,
    the prefill and the decode stay on the fp32-FMA kernels. params: the attention
    parameters (default: plain causal at ``scale``); its variant picks the kernels' flag.
    Decode splits start at each entry's first visible key (a window's start). pages: the
    page table of a paged cache (buf_strides are then the pool's): the same launches with
    the kernels' paged instantiations. kv_dtype: a quantized cache's storage: the fp32-FMA
    kernels over its codes and scales (the tensor-core kernels have no quantized
    instantiation, see routing.py). Both: the quantized reader over pages (QuantizedKV
    over PagedKV, the scales' page pools found from the codes' strides). invariant
    (batch-invariant mode): the prefill kernel for every t_q, whose per-query results do
    not depend on the batch (no split-KV). tree_stride: a draft-tree call (None: none), S
    the tree's tokens per entry (its arrays ``tree_mask`` [B, S, S], ``tree_depth`` [B, S]):
    the prefill kernels' tree instantiation at every t_q, T = 1 included (the decode
    kernels have no tree clause); each block's keys start at its entry's prefix window
    (the window start of a depth-0 query: semantics.block_keys(tree=) starts there or
    later, masked between).
    """
    extent = attention_extent(dtype, head_dim, batch=batch, kv_heads=kv_heads, group=group,
                              t_q=t_q, lens=lens, n_new=n_new, scale=scale, sm_count=sm_count,
                              min_keys_per_split=min_keys_per_split, force_splits=force_splits,
                              tensor_cores=tensor_cores, params=params, kv_dtype=kv_dtype,
                              invariant=invariant, tree_stride=tree_stride)
    return plan_attention_extent(dtype, head_dim, extent, batch=batch, kv_heads=kv_heads,
                                 group=group, t_q=t_q, scale=scale, q_strides=q_strides,
                                 buf_strides=buf_strides, out_strides=out_strides,
                                 tensor_cores=tensor_cores, params=params, pages=pages,
                                 kv_dtype=kv_dtype, invariant=invariant, tree_stride=tree_stride)


@dataclass(frozen=True)
class Extent:
    """What an attention plan takes from the batch's lengths and n_new (everything else in
    it follows from shapes, strides and the variant): the decode launch's split count and
    keys per split, or the prefill launch's longest chunk. A backend keeps plans by it, so
    the next decode step, one token longer, finds its plan (``plan_attention_extent``)."""

    decode: bool
    splits: int = 1
    keys: int = 0
    max_n: int = 0


def _attention_params(params, scale) -> semantics.AttentionParams:
    if params is None:
        if scale is None:
            raise TypeError("plan_attention needs scale= or params=")
        params = semantics.AttentionParams(scale=scale)
    return params


#: plan_attention's keywords that only one of its two stages reads (the other passes them over).
_LAYOUT_KEYWORDS = frozenset({"q_strides", "buf_strides", "out_strides", "pages"})
_LENGTH_KEYWORDS = frozenset({"lens", "n_new", "sm_count", "min_keys_per_split", "force_splits"})


def _check_keywords(given: dict, known: frozenset) -> None:
    unknown = sorted(set(given) - known)
    if unknown:
        raise TypeError(f"unexpected keyword arguments {unknown}")


def _decodes(t_q: int, invariant: bool, tree_stride) -> bool:
    """Whether the decode kernel serves the call (else the prefill kernel)."""
    return t_q <= DECODE_MAX_T and not invariant and tree_stride is None


def attention_extent(dtype: str, head_dim: int, *, batch: int, kv_heads: int, group: int,
                     t_q: int, lens: np.ndarray, n_new: np.ndarray, scale: float | None = None,
                     sm_count: int, min_keys_per_split: int = MIN_KEYS_PER_SPLIT,
                     force_splits: int | None = None, tensor_cores: bool = True,
                     params: semantics.AttentionParams | None = None,
                     kv_dtype: str | None = None, invariant: bool = False,
                     tree_stride: int | None = None, **layout) -> Extent | None:
    """``plan_attention``'s ``Extent`` for these lengths (None: no entry has queries, the
    plan launches nothing). ``layout``: the rest of plan_attention's keywords (strides,
    pages), which the extent does not depend on. One split covers a power of two of keys
    at least as long as the longest row's (the kernel stops at each row's end), so the
    plan stays the same while rows grow."""
    _check_keywords(layout, _LAYOUT_KEYWORDS)
    params = _attention_params(params, scale)
    live = n_new > 0
    if batch == 0 or t_q == 0 or not live.any():
        return None
    if not _decodes(t_q, invariant, tree_stride):
        return Extent(decode=False, max_n=int(n_new.max()))
    if kv_dtype is not None:
        tensor_cores = False
    # Keys each entry's queries read (the one definition, gqakv.core.semantics): what splits
    # are sized by. The kernels apply the same rule on the device (variant.cuh).
    keys_read = semantics.keys_read(params, lens, n_new)
    max_len = int(keys_read[live].max())
    _, _, n_qchunks, per_sm = decode_kernel(dtype, head_dim, group * t_q, tensor_cores)
    if force_splits:
        keys = -(-max_len // force_splits)
        splits = -(-max_len // keys)
    else:
        splits, keys = choose_splits(keys_read[live], kv_heads * n_qchunks, sm_count, per_sm,
                                     min_keys_per_split)
    if splits == 1:  # a power of two of keys (the kernel stops at each row's end)
        keys = max(max_len, min(1 << (max_len - 1).bit_length(), MAX_KEYS_PER_SPLIT))
    return Extent(decode=True, splits=splits, keys=keys)


def plan_attention_extent(dtype: str, head_dim: int, extent: Extent | None, *, batch: int,
                          kv_heads: int, group: int, t_q: int, scale: float | None = None,
                          q_strides, buf_strides, out_strides, tensor_cores: bool = True,
                          params: semantics.AttentionParams | None = None,
                          pages: PageTableArg | None = None, kv_dtype: str | None = None,
                          invariant: bool = False, tree_stride: int | None = None,
                          **lengths) -> Plan:
    """``plan_attention``'s plan for ``extent`` (``attention_extent``'s): the same
    keywords but the lengths, which it does not read (``lengths``: lens, n_new and the
    split planner's, passed over)."""
    _check_keywords(lengths, _LENGTH_KEYWORDS)
    params = _attention_params(params, scale)
    tree = tree_stride is not None
    variant = variant_flags(params, tree)
    kparams = KernelParams.of(params, quantized=kv_dtype is not None, tree_stride=tree_stride)
    if kv_dtype is not None:
        tensor_cores = False
    plan = Plan()
    if extent is None:
        return plan
    strides = (*_i64(*q_strides), *_i64(*buf_strides), *_i64(*out_strides))
    bufs = (Buf("q"), Buf("k_buf"), Buf("v_buf"), Buf("rows"), Buf("lens"), Buf("n_new"),
            Buf("out"), Buf("lse"))
    if extent.decode:
        kernel, tile, n_qchunks, _ = decode_kernel(dtype, head_dim, group * t_q, tensor_cores)
        ctas = batch * kv_heads * n_qchunks
        splits, keys = extent.splits, extent.keys
        _check_grid(kernel, f"{batch} entries x {kv_heads} KV heads x {n_qchunks} query chunks, "
                    f"{splits} splits", ctas, splits)
        if splits > 1:
            _check_grid("gqakv_merge", f"{batch} entries x {kv_heads * group} heads x {t_q} tokens",
                        batch * kv_heads * group * t_q)
        if splits == 1:
            part = (Buf("dummy"), Buf("dummy"))
        else:
            hq = kv_heads * group
            plan.workspace["part_o"] = (batch, hq, t_q, splits, head_dim)
            plan.workspace["part_lse"] = (batch, hq, t_q, splits)
            part = (Buf("part_o"), Buf("part_lse"))
        plan.num_splits, plan.keys_per_split = splits, keys
        args = (*bufs, *part, np.int32(kv_heads), np.int32(group), np.int32(t_q),
                np.int32(n_qchunks), np.int32(splits), np.int64(keys), kparams, *strides)
        name = sources.name_expression(kernel, dtype, head_dim, tile, variant=variant, kv_dtype=kv_dtype)
        if pages is not None:
            args += (pages,)
            name = sources.paged_name_expression(kernel, dtype, head_dim, tile, variant, kv_dtype=kv_dtype)
        plan.launches.append(Launch(kernel, name, (ctas, splits, 1), BLOCK, args))
        if splits > 1:
            # The merge reads every split of this layout (a split past an entry's keys
            # wrote lse -inf) and adds the sink term once, after all of them.
            margs = (Buf("part_o"), Buf("part_lse"), Buf("n_new"), Buf("out"), Buf("lse"),
                     np.int32(kv_heads * group), np.int32(t_q), np.int32(splits), kparams,
                     *_i64(*out_strides))
            name = sources.name_expression("gqakv_merge", dtype, head_dim,
                                           variant=variant & VARIANT_FLAGS["sinks"])
            plan.launches.append(Launch("gqakv_merge", name,
                                        (batch * kv_heads * group * t_q, 1, 1), BLOCK, margs))
        return plan
    max_n = extent.max_n
    kernel = prefill_kernel(dtype, head_dim, tensor_cores)
    rows_per_cta = prefill_rows(head_dim, kernel)
    gc = min(group, rows_per_cta)
    bq = max(1, rows_per_cta // gc)
    n_gchunks = -(-group // gc)
    n_tblocks = -(-max_n // bq)
    if n_tblocks > MAX_GRID_Y:
        raise NotImplementedError(
            f"a chunk of {max_n} tokens needs {n_tblocks} query blocks (grid limit {MAX_GRID_Y})")
    _check_grid(kernel, f"{batch} entries x {kv_heads} KV heads x {n_gchunks} group chunks",
                batch * kv_heads * n_gchunks, n_tblocks)
    args = (*bufs, np.int32(kv_heads), np.int32(group), np.int32(t_q), np.int32(gc), np.int32(bq),
            np.int32(n_gchunks), kparams, *strides)
    name = sources.name_expression(kernel, dtype, head_dim, variant=variant, kv_dtype=kv_dtype)
    if pages is not None:
        args += (pages,)
        name = sources.paged_name_expression(kernel, dtype, head_dim, variant=variant, kv_dtype=kv_dtype)
    plan.launches.append(Launch(kernel, name, (batch * kv_heads * n_gchunks, n_tblocks, 1), BLOCK, args))
    return plan


def aligned_for_vectors(ptr: int, strides_el: tuple[int, ...], dtype: str, head_dim: int) -> bool:
    """True when every row start is aligned for the kernels' vector loads."""
    nbytes = vector_alignment(strides_el, dtype, head_dim)
    return nbytes != 0 and ptr % nbytes == 0


def vector_alignment(strides_el: tuple[int, ...], dtype: str, head_dim: int) -> int:
    """The bytes an array of these element strides must start at a multiple of for every
    row start to be aligned for the kernels' vector loads; 0 when its strides break them
    (a strided head dim, or rows that are not whole vectors apart)."""
    # a vector's elements (4-bit codes: half its values) and bytes (codes: 1 byte each)
    vec = max(1, sources.vec_width(dtype, head_dim) // sources.values_per_element(dtype))
    nbytes = vec * (1 if dtype in sources.CODE_CTYPES else sources.ITEMSIZE[dtype])
    return nbytes if strides_el[-1] == 1 and all(s % vec == 0 for s in strides_el[:-1]) else 0


__all__ = ["Buf", "KernelParams", "PageTableArg", "PAGES_DTYPE", "page_divisor", "Launch", "Plan", "PARAMS_DTYPE", "VARIANT_FLAGS", "variant_flags", "plan_write_kv", "plan_copy_tokens", "plan_attention",
           "Extent", "attention_extent", "plan_attention_extent", "choose_splits", "choose_query_tile", "decode_kernel", "prefill_kernel", "prefill_rows", "aligned_for_vectors",
           "vector_alignment"]
