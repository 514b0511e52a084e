"""Every fused-kernel instantiation compiles with NVRTC for sm_80 and sm_90, no GPU needed.

Compiles the same composed sources with the same options as the cupy backend
(``gqakv_backends.cupy_backend.sources``) straight to CUBIN with ``ptxas -v``, prints
registers / spills / shared memory per kernel (see ``pytest -s`` or the summary at the
end of the module) and fails on any local-memory spill in the fast paths: every kernel at
head dims 64, 128 and 256 in every dtype. NVRTC comes from the nvidia-cuda-nvrtc-cu12
wheel (the ``test`` extra); without it the module skips with that reason.
"""

from __future__ import annotations

import pytest

from gqakv_backends.cupy_backend import instantiations as table
from gqakv_backends.cupy_backend import sources

nvrtc_mod = pytest.importorskip("gqakv_backends.cupy_backend.nvrtc")

try:
    NVRTC = nvrtc_mod.Nvrtc()
    NVRTC.version()
except (nvrtc_mod.NvrtcError, OSError) as exc:  # pragma: no cover - depends on the install
    pytest.skip(f"NVRTC not available: {exc}", allow_module_level=True)

ARCHS = ("sm_80", "sm_90")
FAST_HEAD_DIMS = (64, 128, 256)
#: Odd head dims the fused path also serves (scalar loads); compiled, spills reported only.
OTHER_HEAD_DIMS = (20, 32, 72, 96, 100, 160)
REPORT: list[str] = []


def _tile_id(entry) -> str:
    return f"-qb{entry.tile}" if entry.tile is not None else ""


def _params():
    """The instantiation table's plain-causal entries (contiguous, K/V as the q dtype) at
    every head dim above, in every dtype."""
    for kernel in table.KERNELS:
        for dtype in table.CTYPES:
            for d in FAST_HEAD_DIMS + OTHER_HEAD_DIMS:
                for e in table.select([kernel], [dtype], [d], [None], ["contiguous"], [0]):
                    yield pytest.param(kernel, dtype, d, e.name, id=f"{kernel}-{dtype}-d{d}" + _tile_id(e))


def _variant_params():
    """The variant instantiations with every feature a kernel takes on (its variant mask:
    window, softcap, sinks, alibi; gqakv_merge: sinks) at the fast head dims 64 and 128
    (the draft tree's bit is ``_tree_params``')."""
    for kernel, decl in table.KERNELS.items():
        if not decl.variant_mask:
            continue
        flags = decl.variant_mask & ~table.TREE
        for dtype in table.CTYPES:
            for d in (64, 128):
                for e in table.select([kernel], [dtype], [d], [None], ["contiguous"], [flags]):
                    yield pytest.param(kernel, dtype, d, e.name, id=f"{kernel}-{dtype}-d{d}-v{flags}" + _tile_id(e))


def _quantized_params():
    """The instantiations over quantized K/V at d = 128, two pairings (q bfloat16 over int8
    codes, q float32 over e4m3 codes) to keep the compile time modest: decode (every query
    tile), prefill, the quantizing append and the code copy; decode (the smallest tile) and
    prefill with every variant feature (int8); and the scale copy
    gqakv_copy_tokens<float, 1>. (gqakv_merge reads fp32 partials: its plain
    instantiations serve quantized caches.)"""
    for dtype, kv_dtype in (("bfloat16", "int8"), ("float32", "float8_e4m3fn")):
        for kernel in ("gqakv_decode", "gqakv_prefill", "gqakv_write_kv_quantized", "gqakv_copy_tokens"):
            entries = table.select([kernel], [dtype], [128], [kv_dtype], ["contiguous"], [0])
            if kernel in ("gqakv_decode", "gqakv_prefill") and kv_dtype == "int8":
                entries += table.select([kernel], [dtype], [128], [kv_dtype], ["contiguous"], [table.ALL])[:1]
            for e in entries:
                yield pytest.param(kernel, dtype, 128, e.name, id=e.name)
    s = table.SCALE_COPY
    yield pytest.param(s.kernel, s.dtype, s.head_dim, s.name, id=s.name)


@pytest.mark.parametrize("kernel,dtype,head_dim,name",
                         list(_params()) + list(_variant_params()) + list(_quantized_params()))
def test_kernel_compiles_without_spills(kernel, dtype, head_dim, name):
    for arch in ARCHS:
        r = NVRTC.compile(kernel, dtype, head_dim, arch, name=name)
        line = (f"{r.name:34s} {arch}: {r.registers:3d} regs, {r.spill_stores}/{r.spill_loads} B "
                f"spill st/ld, {r.stack_bytes} B stack, {r.shared_bytes} B smem, {r.cubin_bytes} B cubin")
        REPORT.append(line)
        print(line)
        assert r.cubin_bytes > 0
        assert r.registers <= 255
        # Static shared memory must fit the 48 KiB a kernel gets without opting in.
        assert r.shared_bytes <= 48 * 1024, line
        if head_dim in FAST_HEAD_DIMS:
            assert r.spill_stores == 0 and r.spill_loads == 0, f"local-memory spills: {line}"


def _paged_params():
    """The paged instantiations (kernels/paged_kv.cuh: the page-table reader) at the fast
    head dims 64 and 128 in float32 and bfloat16, plain causal, and with every feature on
    for bfloat16 at 128; sm_90 only (the reader's arithmetic is the same on sm_80, and
    these double the compile time of the kernels they shadow)."""
    for kernel in table.kernels_with(reader="paged"):
        decl = table.KERNELS[kernel]
        for dtype, d, flags in (("float32", 64, 0), ("float32", 128, 0), ("bfloat16", 64, 0),
                                ("bfloat16", 128, 0), ("bfloat16", 128, table.ALL)):
            if flags and not decl.variant_mask:
                continue
            for e in table.select([kernel], [dtype], [d], [None], ["paged"], [flags]):
                yield pytest.param(kernel, dtype, d, e.name, id=f"{kernel}-{dtype}-d{d}-v{flags}-paged" + _tile_id(e))


@pytest.mark.parametrize("kernel,dtype,head_dim,name", list(_paged_params()))
def test_paged_kernel_compiles_without_spills(kernel, dtype, head_dim, name):
    """Reading K/V through the page table costs registers (the table row, the page size);
    the paged instantiations must still fit their __launch_bounds__ occupancy unspilled."""
    r = NVRTC.compile(kernel, dtype, head_dim, "sm_90", name=name)
    line = (f"{r.name:46s} sm_90: {r.registers:3d} regs, {r.spill_stores}/{r.spill_loads} B "
            f"spill st/ld, {r.stack_bytes} B stack, {r.shared_bytes} B smem")
    REPORT.append(line)
    print(line)
    assert r.cubin_bytes > 0 and r.registers <= 255
    assert r.shared_bytes <= 48 * 1024, line
    assert r.spill_stores == 0 and r.spill_loads == 0, f"local-memory spills: {line}"


def _paged_quantized_params():
    """The paged 8-bit instantiations (QuantizedKV over PagedKV) at d = 128 in the two
    pairings of ``_quantized_params``: decode (every query tile), prefill and the paged
    quantizing append, plain causal; decode (tile 4) and prefill with every variant
    feature (flags 7, int8); sm_90 only, as for ``_paged_params``."""
    for dtype, kv_dtype in (("bfloat16", "int8"), ("float32", "float8_e4m3fn")):
        for kernel in ("gqakv_decode", "gqakv_prefill", "gqakv_write_kv_quantized"):
            names = sources.paged_instantiations(kernel, dtype, 128, kv_dtype=kv_dtype)
            if kernel != "gqakv_write_kv_quantized" and kv_dtype == "int8":
                names.append(sources.paged_name_expression(kernel, dtype, 128, 4 if kernel == "gqakv_decode"
                                                           else None, 7, kv_dtype=kv_dtype))
            for name in names:
                yield pytest.param(kernel, dtype, 128, name, id=name)


@pytest.mark.parametrize("kernel,dtype,head_dim,name", list(_paged_quantized_params()))
def test_paged_quantized_kernel_compiles_without_spills(kernel, dtype, head_dim, name):
    """The 8-bit reader over the page table (a second, scale, reader through the same
    table) must still fit the kernels' __launch_bounds__ occupancy unspilled."""
    test_paged_kernel_compiles_without_spills(kernel, dtype, head_dim, name)


def _grouped_params():
    """The grouped codecs' instantiations (a scale per block; 4-bit codes two a byte) at the
    fast head dims 64, 128 and 256, one q dtype per code type (bfloat16 over int4_g32,
    float16 over int4_g64, float32 over int8_g32; the rotated codec shares int4_g32's
    kernels): the append, decode (every query tile) and prefill, contiguous and paged,
    plain causal and, at d = 128, decode (both tiles) and prefill with every feature on
    (flags 15; prefill with the draft tree's too, 31); and the row copies of every grouped
    codec at those head dims (``copy_entries``, those ``_quantized_params`` does not list);
    sm_90 only, as for ``_paged_params``."""
    for dtype, kv_dtype in (("bfloat16", "int4_g32"), ("float16", "int4_g64"), ("float32", "int8_g32")):
        for d in FAST_HEAD_DIMS:
            for kernel in ("gqakv_write_kv_quantized", "gqakv_decode", "gqakv_prefill"):
                flags = [0]
                if d == 128 and kernel != "gqakv_write_kv_quantized":
                    flags += [table.ALL] + ([table.ALL | table.TREE] if kernel == "gqakv_prefill" else [])
                for e in table.select([kernel], [dtype], [d], [kv_dtype], None, flags):
                    yield pytest.param(kernel, dtype, d, e.name, id=e.name)
    # the grouped row copies (instantiations.copy_entries: codes as byte rows of d * bits / 8,
    # scales as float rows of d / g) of every grouped codec, not already listed above
    listed = set(table.names(table.copy_entries("bfloat16", 128, "int8")))  # _quantized_params' copies
    for d in FAST_HEAD_DIMS:
        for kv_dtype in table.STORAGES["grouped"]:
            for e in table.copy_entries("float32", d, kv_dtype):
                if e.name not in listed:
                    listed.add(e.name)
                    yield pytest.param(e.kernel, e.dtype, e.head_dim, e.name, id=f"{e.name}-{kv_dtype}-d{d}")


@pytest.mark.parametrize("kernel,dtype,head_dim,name", list(_grouped_params()))
def test_grouped_kernel_compiles_without_spills(kernel, dtype, head_dim, name):
    """The grouped reader (a block scale per 8-value vector, nibbles unpacked from 32-bit
    words) must fit the kernels' __launch_bounds__ occupancy unspilled, paged too."""
    test_paged_kernel_compiles_without_spills(kernel, dtype, head_dim, name)


def _alibi_params():
    """ALiBi with every other feature (flags 15: the flag set the product runs beside ALiBi
    alone) in every attention kernel at d = 64 and 128, float32 and bfloat16, contiguous
    and paged, and over int8 pages (bfloat16 q); sm_90 only, as for ``_paged_params``."""
    for kernel in ("gqakv_decode", "gqakv_decode_mma", "gqakv_prefill", "gqakv_prefill_mma"):
        for dtype, d in (("float32", 64), ("float32", 128), ("bfloat16", 64), ("bfloat16", 128)):
            for base in sources.instantiations(kernel, dtype, d):
                tile = int(base.rsplit(", ", 1)[1].rstrip(">")) if kernel == "gqakv_decode" else None
                names = [sources.name_expression(kernel, dtype, d, tile, variant=15),
                         sources.paged_name_expression(kernel, dtype, d, tile, 15)]
                if dtype == "bfloat16" and kernel in ("gqakv_decode", "gqakv_prefill"):
                    names.append(sources.paged_name_expression(kernel, dtype, d, tile, 15, kv_dtype="int8"))
                for name in names:
                    yield pytest.param(kernel, dtype, d, name, id=name)


@pytest.mark.parametrize("kernel,dtype,head_dim,name", list(_alibi_params()))
def test_alibi_kernel_compiles_without_spills(kernel, dtype, head_dim, name):
    """The score hook's ALiBi term (a slope and a query position per row) must still fit the
    kernels' __launch_bounds__ occupancy unspilled."""
    test_paged_kernel_compiles_without_spills(kernel, dtype, head_dim, name)


def _tree_params():
    """The draft tree's instantiations (instantiations.TREE: the prefill kernels only) with
    every other feature on (flags 31, the most registers), at the fast head dims in every
    dtype, contiguous, and paged and over int8 pages (bfloat16 q) at d = 128; the tree alone
    (flags 16) at d = 128; sm_90 only, as for ``_paged_params``."""
    every = table.ALL | table.TREE
    for kernel in (k for k, decl in table.KERNELS.items() if decl.variant_mask & table.TREE):
        for dtype in table.CTYPES:
            for d in FAST_HEAD_DIMS:
                names = [e.name for e in table.select([kernel], [dtype], [d], [None], ["contiguous"],
                                                      [every, table.TREE] if d == 128 else [every])]
                if d == 128 and names:
                    names += [sources.paged_name_expression(kernel, dtype, d, variant=every)]
                    if dtype == "bfloat16" and kernel == "gqakv_prefill":
                        names.append(sources.paged_name_expression(kernel, dtype, d, variant=every,
                                                                   kv_dtype="int8"))
                for name in names:
                    yield pytest.param(kernel, dtype, d, name, id=name)


@pytest.mark.parametrize("kernel,dtype,head_dim,name", list(_tree_params()))
def test_tree_kernel_compiles_without_spills(kernel, dtype, head_dim, name):
    """The tree clause (the ancestor row and depths read per key, a logical position per
    row) must still fit the prefill kernels' __launch_bounds__ occupancy unspilled."""
    test_paged_kernel_compiles_without_spills(kernel, dtype, head_dim, name)


def test_ptxas_report_parsing_sees_spills():
    """The spill check can fail: a kernel forced into local memory reports its spills."""
    log = ("ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'\n"
           "ptxas info    : Function properties for _Z1kv\n"
           "ptxas         .     24 bytes stack frame, 16 bytes spill stores, 48 bytes spill loads\n"
           "ptxas info    : Used 96 registers, used 1 barriers, 36992 bytes smem\n")
    r = nvrtc_mod._parse("k", "_Z1kv", "sm_90", 1, log)
    assert (r.registers, r.spill_stores, r.spill_loads, r.shared_bytes) == (96, 16, 48, 36992)


def test_name_expressions_reject_unsupported():
    with pytest.raises(KeyError, match="head_dim=300"):
        sources.name_expression("gqakv_decode", "float16", 300)
    with pytest.raises(KeyError, match="float64"):
        sources.name_expression("gqakv_decode", "float64", 64, 8)
    with pytest.raises(KeyError, match="query_tile=16"):
        sources.name_expression("gqakv_decode", "float16", 64, 16)
    with pytest.raises(KeyError, match="takes no query_tile"):
        sources.name_expression("gqakv_merge", "float16", 64, 8)
    with pytest.raises(KeyError, match="no variant=32"):
        sources.name_expression("gqakv_prefill", "float16", 64, variant=32)
    with pytest.raises(KeyError, match="no variant=16"):  # the draft tree: prefill kernels only
        sources.name_expression("gqakv_decode", "float16", 64, 8, variant=16)
    with pytest.raises(KeyError, match="no variant=1"):
        sources.name_expression("gqakv_write_kv", "float16", 64, variant=1)
    assert sources.name_expression("gqakv_decode", "float16", 64, 8, variant=5) == "gqakv_decode<gqakv_half, 64, 8, 5>"
    assert (sources.paged_name_expression("gqakv_decode", "float16", 64, 8)
            == "gqakv_decode<gqakv_half, 64, 8, 0, KVPages>")
    assert sources.paged_name_expression("gqakv_write_kv", "bfloat16", 128) == "gqakv_write_kv<gqakv_bf16, 128, KVPages>"
    with pytest.raises(KeyError, match="no paged instantiation"):
        sources.paged_name_expression("gqakv_merge", "float16", 64)
    assert (sources.paged_name_expression("gqakv_decode", "bfloat16", 64, 4, kv_dtype="int8")
            == "gqakv_decode<gqakv_quantized<gqakv_bf16, gqakv_i8>, 64, 4, 0, KVPages>")
    assert (sources.paged_name_expression("gqakv_write_kv_quantized", "float32", 64, kv_dtype="float8_e4m3fn")
            == "gqakv_write_kv_quantized<float, gqakv_e4m3, 64, KVPages>")
    with pytest.raises(KeyError, match="no quantized instantiation"):
        sources.paged_name_expression("gqakv_decode_mma", "bfloat16", 64, kv_dtype="int8")
    assert (sources.paged_name_expression("gqakv_prefill", "float32", 64, variant=7, kv_dtype="int8_g32")
            == "gqakv_prefill<gqakv_quantized<float, gqakv_i8g<32>>, 64, 7, KVPages>")
    with pytest.raises(KeyError, match="multiples of 32"):
        sources.name_expression("gqakv_decode", "float32", 48, 4, kv_dtype="int4_g32")


def test_kernels_need_the_declared_limits(monkeypatch):
    """The limits reach NVRTC only as -D options (limits.py): a compile without them stops
    at kernels/limits.cuh instead of building kernels from other numbers."""
    monkeypatch.setattr(sources, "COMPILE_OPTIONS", ("-std=c++17",))
    with pytest.raises(nvrtc_mod.NvrtcError, match="compile with the -D options"):
        NVRTC.compile("gqakv_write_kv", "float32", 64, "sm_80")


def teardown_module(module):
    if REPORT:
        print("\nptxas report (registers, spills) per kernel:\n" + "\n".join(REPORT))


def _table_rows():
    """One entry of every row of the instantiation table (kernel x storage x reader x
    variant flags 0 / all its features x query tile) at head dim 64 in bfloat16 (served by
    every kernel, the tensor-core ones too), grouped by kernel."""
    for kernel, decl in table.KERNELS.items():
        entries = table.select([kernel], ["bfloat16"], [64], variants=sorted({0, decl.variant_mask}))
        yield pytest.param(kernel, [e.name for e in entries], id=kernel)


@pytest.mark.parametrize("kernel,names", list(_table_rows()))
def test_table_names_resolve(kernel, names):
    """Every name the table spells is a template-id NVRTC resolves to one distinct kernel
    symbol (one compile to PTX per kernel file: no ptxas), and the table holds each row."""
    lowered = NVRTC.lowered_names(kernel, names)
    assert sorted(lowered) == sorted(names)
    assert all(sym.startswith("_Z") for sym in lowered.values()), lowered
    assert len(set(lowered.values())) == len(names), "two names lowered to one kernel"
