"""The kernel instantiation table (backends/cupy_backend/instantiations.py) and what is
generated from it: the name expressions the cupy backend compiles (sources), the CPU
emulator's registrations (tests/cuda_emu/harness.py), each checked against the other and,
where g++ is there, against a built emulation library. (NVRTC resolving every row's names:
tests/test_cupy_nvrtc.py::test_table_names_resolve.)"""

from __future__ import annotations

import pytest

from gqakv_backends.cupy_backend import instantiations as table
from gqakv_backends.cupy_backend import sources

from .cuda_emu import emulated_backend, harness

HEAD_DIMS = (1, 8, 20, 64, 80, 128, 256)


def test_names_are_unique_and_the_sources_api_spells_them():
    """Every entry spells its own name (the copy over codes once), and sources'
    name_expression / paged_name_expression give exactly the entry's name."""
    entries = table.select(head_dims=HEAD_DIMS)
    assert len({e.name for e in entries}) == len(entries) > 1000
    for e in entries:
        if e.reader == "paged":
            assert sources.paged_name_expression(e.kernel, e.dtype, e.head_dim, e.tile, e.variant,
                                                 e.kv_dtype) == e.name
        else:
            assert sources.name_expression(e.kernel, e.dtype, e.head_dim, e.tile, e.variant, e.kv_dtype) == e.name


def test_entries_spell_template_arguments_in_declared_order():
    """Trailing defaults are left out, a variant before a reader is spelled even when 0."""
    e = table.Instantiation
    assert e("gqakv_decode", "bfloat16", 128, tile=4).name == "gqakv_decode<gqakv_bf16, 128, 4>"
    assert e("gqakv_decode", "float32", 64, reader="paged", tile=8).name == "gqakv_decode<float, 64, 8, 0, KVPages>"
    assert (e("gqakv_prefill", "float16", 20, "int8", variant=5).name
            == "gqakv_prefill<gqakv_quantized<gqakv_half, gqakv_i8>, 20, 5>")
    assert (e("gqakv_write_kv_quantized", "float32", 64, "float8_e4m3fn").name
            == "gqakv_write_kv_quantized<float, gqakv_e4m3, 64>")
    assert e("gqakv_copy_tokens", "bfloat16", 64, "int8").name == "gqakv_copy_tokens<gqakv_i8, 64>"
    assert table.SCALE_COPY.name == "gqakv_copy_tokens<float, 1>"
    assert (e("gqakv_decode", "bfloat16", 64, "int4_g32", "paged", 7, 4).name
            == "gqakv_decode<gqakv_quantized<gqakv_bf16, gqakv_i4g<32>>, 64, 4, 7, KVPages>")
    # the rotated codec stores keys as int4_g32 does (q is rotated on the host): same kernels
    assert (e("gqakv_write_kv_quantized", "float32", 64, "int4_g32_rotated").name
            == e("gqakv_write_kv_quantized", "float32", 64, "int4_g32").name
            == "gqakv_write_kv_quantized<float, gqakv_i4g<32>, 64>")


def test_grouped_table_matches_the_codecs():
    """The table's grouped storages are the library's Grouped codecs, with their blocks."""
    from gqakv.storage import codecs

    grouped = {n for n in codecs.names() if isinstance(codecs.of(n), codecs.Grouped)}
    assert set(table.STORAGES["grouped"]) == set(table.GROUPS) == grouped
    for name, group in table.GROUPS.items():
        codec = codecs.of(name)
        assert codec.group == group
        assert table.CODE_CTYPES[name] == f"gqakv_i{codec.bits}g<{group}>"


def test_copy_entries_move_each_part_of_a_token_as_rows_of_its_width():
    """A copy launches the copy kernel once per part of a token, over rows of that part's
    width and element type: values ``<T, d>``; per-token codes ``<C, d>`` and scales
    ``<float, 1>``; grouped codes as bytes ``<gqakv_i8, d * bits / 8>`` and block scales
    ``<float, d / g>`` (every codec's parts, from its own byte formula); a head dim that
    splits a block has none."""
    from gqakv.storage import codecs

    names = lambda *args: table.names(table.copy_entries(*args))  # noqa: E731
    assert names("bfloat16", 64) == ["gqakv_copy_tokens<gqakv_bf16, 64>"]
    assert names("float16", 64, "int8") == ["gqakv_copy_tokens<gqakv_i8, 64>", "gqakv_copy_tokens<float, 1>"]
    assert names("float32", 128, "int4_g32") == ["gqakv_copy_tokens<gqakv_i8, 64>", "gqakv_copy_tokens<float, 4>"]
    assert names("float32", 256, "int4_g64") == ["gqakv_copy_tokens<gqakv_i8, 128>", "gqakv_copy_tokens<float, 4>"]
    assert names("bfloat16", 64, "int8_g32") == ["gqakv_copy_tokens<gqakv_i8, 64>", "gqakv_copy_tokens<float, 2>"]
    for name in table.STORAGES["grouped"]:
        codec = codecs.of(name)
        for d in (64, 128, 256):
            codes, scales = table.copy_entries("float32", d, name)
            # the two rows hold exactly one token's bytes of one KV head (the codec's formula)
            assert codes.head_dim + 4 * scales.head_dim == codec.bytes_per_token_head(d, 4)
            assert scales.head_dim == d // codec.group and table.rejection(codes) is None
        with pytest.raises(KeyError, match=f"multiples of {codec.group}"):
            table.copy_entries("float32", 48, name)


@pytest.mark.parametrize("inst,match", [
    (table.Instantiation("gqakv_merge", "float32", 64, variant=1), "no variant=1"),
    (table.Instantiation("gqakv_decode", "float32", 96, "int4_g64", tile=4), "multiples of 64"),
    (table.Instantiation("gqakv_copy_tokens", "float32", 64, "int4_g32"), "no grouped instantiation"),
    (table.Instantiation("gqakv_decode_mma", "bfloat16", 64, "int8_g32"), "no grouped instantiation"),
    (table.Instantiation("gqakv_decode_mma", "float32", 64), "dtype=float32"),
    (table.Instantiation("gqakv_prefill_mma", "bfloat16", 72), "head_dim=72"),
    (table.Instantiation("gqakv_decode_mma", "bfloat16", 64, "int8"), "no quantized instantiation"),
    (table.Instantiation("gqakv_copy_tokens", "float32", 64, reader="paged"), "no paged instantiation"),
    (table.Instantiation("gqakv_prefill_mma", "bfloat16", 64, "int8", "paged"), "no quantized instantiation"),
    (table.Instantiation("gqakv_decode", "bfloat16", 64, tile=3), "query_tile=3"),
    (table.Instantiation("gqakv_write_kv", "float64", 64), "float64"),
])
def test_rejections_name_the_axis(inst, match):
    assert match in (table.rejection(inst) or "")
    assert inst not in table.select(head_dims=(inst.head_dim,))


def _emulator_units() -> list[harness.Unit]:
    units = harness.registrations()
    for families in ((), ("paged",), ("quantized",), ("paged", "quantized"), ("paged", "quantized", "tree")):
        units += emulated_backend.product_registrations(families)
    return units + harness.grouped_units(64)


def test_emulator_units_hold_every_row_of_the_table():
    """Each (kernel, storage, reader) of the table, plain causal and with all its features,
    is registered in the emulator's default library or the product suite's, and so is each
    feature alone wherever the product's head dim has the kernel (the tensor-core kernels'
    single features under the paged reader have no emulated head dim): a row added to the
    table (a LAYOUTS pair, a variant flag) reaches the emulator."""
    def rows(entries):
        return {(e.kernel, table.storage_kind(e.kv_dtype), e.reader, e.variant) for e in entries}

    have = rows(e for u in _emulator_units() for e in u.entries)
    want = rows(table.select(head_dims=(64,), variants=(0, table.ALL),
                             kv_dtypes=(None, *table.STORAGES["quantized"])))
    want |= rows(e for e in table.select(head_dims=(emulated_backend.PRODUCT_HEAD_DIM,),
                                         variants=tuple(table.VARIANT_FLAGS.values())))
    # the grouped codecs' library (harness.grouped_units): every variant flag set of the
    # parity product, each with a draft tree too (every feature and the tree: the richest)
    want |= rows(table.select(head_dims=(64,), kv_dtypes=table.STORAGES["grouped"],
                              variants=(0, table.ALL, table.TREE, table.TREE | table.ALL)))
    assert max(harness.GROUPED_VARIANTS) == table.TREE | table.ALL
    assert len(want) > 40 and want - have == set()
    assert {k for k, s, _, _ in have if s == "grouped"} == {"gqakv_write_kv_quantized", "gqakv_decode",
                                                          "gqakv_prefill"}


def test_a_layout_is_one_line(monkeypatch):
    """Declaring a (storage, reader) pair adds its entries to the names, the emulator's
    units and the NVRTC rows, with no other change (paged x quantized, not instantiated yet)."""
    monkeypatch.setattr(table, "LAYOUTS", (*table.LAYOUTS, ("quantized", "paged")))
    e = sources.entry("gqakv_decode", "float32", 64, 4, 7, kv_dtype="int8", reader="paged")
    assert e.name == "gqakv_decode<gqakv_quantized<float, gqakv_i8>, 64, 4, 7, KVPages>"
    units = [u for u in harness.registrations(families=("paged", "quantized")) if u.kind == "paged quantized"]
    assert {u.head_dim for u in units} == set(harness.PAGED_HEAD_DIMS)
    assert e.name in {x.name for u in units for x in u.entries}


def test_emulator_registers_exactly_its_unit():
    """A built unit's registry holds its entries' names (plus the emulator's self-tests)
    and nothing else: the generated registration code is what the table says."""
    if harness.compiler() is None:
        pytest.skip("no C++ compiler (g++)")
    unit = harness.registrations(head_dims=(20,), families=())[0]
    assert unit.kind == "plain" and unit.head_dim == 20
    emu = harness.Emulator(harness.build_registrations(False, [unit]))
    (names,) = emu.lib.kernel_names()
    selftests = {"emu_mma_selftest<gqakv_half>", "emu_mma_selftest<gqakv_bf16>", "emu_divergence_selftest"}
    assert sorted(names) == sorted({e.name for e in unit.entries} | selftests)


def test_variant_flags_match_the_kernels_macros():
    """Each feature of the table's VARIANT_FLAGS is a GQAKV_VARIANT_<NAME> bit of
    kernels/variant.cuh (the kernels test the same bits)."""
    import re

    text = (harness.kernel_dir() / "variant.cuh").read_text()
    macros = {m.group(1).lower(): int(m.group(2)) for m in re.finditer(r"#define GQAKV_VARIANT_(\w+) (\d+)", text)}
    assert macros == table.VARIANT_FLAGS
    # ALL: every feature but the draft tree's bit, which only the prefill kernels take
    assert table.ALL | table.TREE == sum(table.VARIANT_FLAGS.values()) and not table.ALL & table.TREE
    assert all(bin(v).count("1") == 1 for v in table.VARIANT_FLAGS.values())
    assert [k for k, decl in table.KERNELS.items() if decl.variant_mask & table.TREE] == [
        "gqakv_prefill", "gqakv_prefill_mma"]
