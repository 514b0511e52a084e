"""``gqakv selftest``: passes on a correct backend, fails (exit 1, a FAIL line) on a broken
kernel of each family, prints one line per family and dtype, and its reference agrees
with the test suite's independent loop reference."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import gqakv
from gqakv.tools import cli, selftest
from gqakv.ops.reference import naive_low_precision, reference_attention
from gqakv_backends.numpy_backend import NumpyBackend

from .support.reference import reference_attention as loop_reference

LINE = re.compile(r"^(\S+(?: \S+)?)\s+(all|float16|bfloat16|float32|float64)\s+(\d+|-)\s+(\S+)\s+"
                  r"(PASS|FAIL|SKIP)(?:  (.*))?$")


def run_selftest(capsys, *argv):
    status = cli.main(["selftest", *argv])
    return status, capsys.readouterr().out


def result_lines(out):
    return [LINE.match(l).groups() for l in out.splitlines() if LINE.match(l)]


def test_numpy_quick_passes_with_one_line_per_family_and_dtype(capsys):
    status, out = run_selftest(capsys, "--backend", "numpy", "--quick", "--seed", "0")
    assert status == 0, out
    lines = result_lines(out)
    backend = gqakv.get_backend("numpy")
    want = [("compile", "all")] + [(f, d) for d in backend.dtypes for f in selftest.FAMILIES[1:]]
    assert [(f, d) for f, d, *_ in lines] == want
    for family, dtype, cases, worst, result, note in lines:
        if family in QUANT_LINES | PAGED_QUANT_LINES | {selftest.LONG_PREFILL_INT8} and dtype == "float64":
            assert result == "SKIP" and "float32, float16 or bfloat16" in note
            continue
        assert result == "PASS"
        if family != "compile":
            assert int(cases) > 0 and 0 <= float(worst) <= 1.0
    assert "selftest passed in" in out.splitlines()[-1]
    header = out.splitlines()[0]
    assert header.startswith("gqakv selftest: backend numpy") and "seed 0" in header


def _broken(monkeypatch, method, wrap):
    original = getattr(NumpyBackend, method)
    monkeypatch.setattr(NumpyBackend, method, lambda self, *a, **kw: wrap(original, self, *a, **kw))


def _perturb_one_output(original, self, q, store, inputs, params, **kw):
    out, lse = original(self, q, store, inputs, params, **kw)
    if int(inputs.n_new[0]) > 0:
        out[0, 0, 0, 0] += 0.05  # one element of one real query
    return out, lse


def _read_one_key_too_many(original, self, q, store, inputs, params, **kw):
    # reads the slot past each row's length (NaN in the selftest's buffers)
    return original(self, q, store, dataclasses.replace(inputs, lens=inputs.lens + 1), params, **kw)


def _write_padding_too(original, self, store, k_new, v_new, inputs):
    T = k_new.shape[2]
    n = np.minimum(inputs.n_new + 1, np.minimum(T, store.max_len - inputs.starts))
    return original(self, store, k_new, v_new, dataclasses.replace(inputs, n_new=n))


def _copy_one_token_more(original, self, dst, dst_rows, src, src_rows, n_tokens):
    n = np.minimum(np.asarray(n_tokens) + 1, min(dst.max_len, src.max_len))
    return original(self, dst, dst_rows, src, src_rows, n)


@pytest.mark.parametrize("method, wrap, families", [
    ("attention", _perturb_one_output, {"decode", "prefill"}),
    ("attention", _read_one_key_too_many, {"decode", "prefill"}),
    ("write_kv", _write_padding_too, {"append"}),
    ("copy_tokens", _copy_one_token_more, {"row copies"}),
])
def test_a_broken_kernel_fails(capsys, monkeypatch, method, wrap, families):
    _broken(monkeypatch, method, wrap)
    status, out = run_selftest(capsys, "--backend", "numpy", "--quick", "--seed", "1")
    assert status == 1, out
    failed = {(f, d) for f, d, _, _, result, _ in result_lines(out) if result == "FAIL"}
    assert {f for f, _ in failed} >= families, out
    assert {d for f, d in failed if f in families} == set(gqakv.get_backend("numpy").dtypes)
    assert any(l.startswith(f"FAIL {sorted(families)[0]} ") and "worst case" in l for l in out.splitlines())
    assert "selftest FAILED" in out


def test_forced_split_path_is_checked(capsys, monkeypatch):
    """The split family drives attention_numpy's key splits: break the merge of pieces."""
    from gqakv_backends import numpy_attention

    original = numpy_attention._merge

    def bad_merge(out, lse, pieces, G):
        original(out, lse, pieces[:-1] if len(pieces) > 1 else pieces, G)  # drop a piece
    monkeypatch.setattr(numpy_attention, "_merge", bad_merge)
    status, out = run_selftest(capsys, "--backend", "numpy", "--quick", "--seed", "2")
    assert status == 1
    failed = {f for f, _, _, _, result, _ in result_lines(out) if result == "FAIL"}
    assert "split+merge" in failed


PAGED_LINES = {f"paged P={p}" for p in selftest.PAGE_SIZES}
QUANT_LINES = set(selftest.KV_DTYPES.values())
PAGED_QUANT_LINES = set(selftest.PAGED_KV_DTYPES.values())


def _failed_lines(out):
    return {(f, d) for f, d, _, _, result, _ in result_lines(out) if result == "FAIL"}


def test_paged_and_quantized_lines_exist():
    assert PAGED_LINES == {"paged P=1", "paged P=16"}
    assert QUANT_LINES == {"quant int8", "quant e4m3", "quant i8/32", "quant i4/32r", "quant i4/64"}
    assert PAGED_QUANT_LINES == {"paged int8", "paged i4/32"}
    assert PAGED_LINES | QUANT_LINES | PAGED_QUANT_LINES <= set(selftest.FAMILIES)


def _second_page_first(table):
    """``table`` with each row's first page replaced by its second (rows of two or more)."""
    bad = table.copy()
    two = (bad >= 0).sum(axis=1) >= 2
    bad[two, 0] = table[two, 1]
    return bad


def test_a_broken_paged_read_fails_only_the_paged_lines(capsys, monkeypatch):
    """The NumPy paged readers (the items' ``numpy_readers.Pages`` and the one pass's page
    index, ``numpy_batch._page_index``) reading a row's second page in place of its first
    (a swap would not do: attention over all of a row's keys does not depend on their
    order); every other family but the paged quantized ones (the same readers) runs on
    contiguous storage and must still pass."""
    from types import SimpleNamespace

    from gqakv_backends import numpy_batch, numpy_readers

    original = numpy_readers.Pages.__init__

    def wrong_first_page(self, arrays, rows, table, page_size, gather=None):
        original(self, arrays, rows, _second_page_first(table), page_size, gather)
    monkeypatch.setattr(numpy_readers.Pages, "__init__", wrong_first_page)
    index_of = numpy_batch._page_index

    def wrong_first_index(store, rows, k0, k1, ranges):
        table = store.page_table
        bad = SimpleNamespace(entries=_second_page_first(table.entries), version=table.version)
        index = index_of(SimpleNamespace(page_table=bad, buffers=store.buffers, k=store.k,
                                         page_size=store.page_size, kv_heads=store.kv_heads),
                         rows, k0, k1, ranges)
        return None if index is None else numpy_batch.PageIndex((table.entries, table.version),
                                                                index.rows)
    monkeypatch.setattr(numpy_batch, "_page_index", wrong_first_index)
    status, out = run_selftest(capsys, "--backend", "numpy", "--quick", "--seed", "7")
    assert status == 1, out
    dtypes = set(gqakv.get_backend("numpy").dtypes)
    # paged quantized storage reads its codes and scales through the same page reader, and
    # so do the shared-pages line's two parts
    quant = {(line, d) for line in PAGED_QUANT_LINES for d in dtypes - {"float64"}}
    shared = {(selftest.SHARED_PREFIX, d) for d in dtypes}
    assert _failed_lines(out) == {(f, d) for f in PAGED_LINES for d in dtypes} | quant | shared, out
    assert any(l.startswith("FAIL paged P=") and "worst case" in l for l in out.splitlines())


def test_a_broken_dequantization_fails_only_the_quantized_lines(capsys, monkeypatch):
    """The NumPy 8-bit reader (and the one pass's ``decode_values``) dequantizing each
    token with its neighbour's scale."""
    from gqakv_backends import numpy_readers

    original = numpy_readers.Coded.__init__

    class Shifted:  # the store's codec, handed each block's scales rolled by one token
        def __init__(self, codec):
            self.codec = codec

        def dequantize_into(self, codes, scales, out):
            return self.codec.dequantize_into(codes, np.roll(scales, 1, axis=-1), out)

    monkeypatch.setattr(numpy_readers.Coded, "__init__",
                        lambda self, base, codec: original(self, base, Shifted(codec)))
    from gqakv_backends import numpy_batch

    decode = numpy_batch.decode_values  # the one pass's decoding, broken alike

    def shifted(codec, parts, k_out, v_out):
        kc, vc, ks, vs = parts
        decode(codec, (kc, vc, np.roll(ks, 1, axis=2), np.roll(vs, 1, axis=2)), k_out, v_out)
    monkeypatch.setattr(numpy_batch, "decode_values", shifted)
    status, out = run_selftest(capsys, "--backend", "numpy", "--quick", "--seed", "8")
    assert status == 1, out
    dtypes = set(gqakv.get_backend("numpy").dtypes) - {"float64"}  # float64: SKIP
    # the reader over pages too, and the long chunks over int8
    lines = QUANT_LINES | PAGED_QUANT_LINES | {selftest.LONG_PREFILL_INT8}
    assert _failed_lines(out) == {(f, d) for f in lines for d in dtypes}, out


def test_a_broken_quantizing_append_fails_the_quantized_lines(capsys, monkeypatch):
    """Appends storing every token with scale x 1.01 (contiguous and paged stores both
    quantize through gqakv.storage.quantize): the buffer checks catch it."""
    from gqakv.storage import quantize

    original = quantize.quantize

    original_groups = quantize.quantize_groups

    def off_scale(xp, x, kv_dtype):
        codes, scale = original(xp, x, kv_dtype)
        return codes, scale * 1.01

    def off_group_scales(xp, x, bits, group):
        codes, scale = original_groups(xp, x, bits, group)
        return codes, scale * 1.01
    monkeypatch.setattr(quantize, "quantize", off_scale)
    monkeypatch.setattr(quantize, "quantize_groups", off_group_scales)
    honest = selftest._dequantized_rule  # the selftest's host rule, through the originals
    monkeypatch.setattr(selftest, "_dequantized_rule",
                        lambda x, kv, keys=False: _honest_rule(original, original_groups, honest,
                                                               x, kv, keys))
    status, out = run_selftest(capsys, "--backend", "numpy", "--quick", "--seed", "9")
    assert status == 1, out
    assert {f for f, _ in _failed_lines(out)} == (QUANT_LINES | PAGED_QUANT_LINES
                                                  | {selftest.LONG_PREFILL_INT8}), out


def test_a_broken_paged_dequantization_fails_only_the_paged_quantized_lines(capsys, monkeypatch):
    """Quantized pages read with each token's scales taken from its neighbour (the generic
    path and live_kv both read through PagedStore._page_view; the store's own decoding of
    codes and scales, ``_decode``, per-token and grouped alike)."""
    from gqakv.storage.paged import PagedStore

    original = PagedStore._page_view

    def neighbour_scale(self, row, j0, j1):
        if not self.quantized:
            return original(self, row, j0, j1)
        P = self.page_size
        page, a, b = int(self.page_table.entries[row, j0 // P]), j0 % P, j0 % P + (j1 - j0)

        def read(parts):  # (codes, scales) of the span, the scales rolled along its tokens
            codes, scales = (p[page, :, a:b, ...] for p in parts)
            return self._decode((codes, np.roll(np.asarray(scales), 1, axis=1)))
        return read(self._k_parts), read(self._v_parts)
    monkeypatch.setattr(PagedStore, "_page_view", neighbour_scale)
    status, out = run_selftest(capsys, "--backend", "numpy", "--quick", "--seed", "10")
    assert status == 1, out
    dtypes = set(gqakv.get_backend("numpy").dtypes) - {"float64"}
    assert _failed_lines(out) == {(line, d) for line in PAGED_QUANT_LINES for d in dtypes}, out


def _honest_rule(quantize_fn, groups_fn, rule, x, kv_dtype, keys=False):
    """The selftest's host rule with the unpatched quantizers (``rule`` reads the module's
    ``quantize`` / ``quantize_groups`` names: swapped back while it runs)."""
    patched = selftest.quantize, selftest.quantize_groups
    selftest.quantize, selftest.quantize_groups = quantize_fn, groups_fn
    try:
        return rule(x, kv_dtype, keys)
    finally:
        selftest.quantize, selftest.quantize_groups = patched


class _ProbeBackend(NumpyBackend):
    """A registered backend declaring only float32 and bfloat16 (bfloat16 refused here)."""

    name = "selftest_probe"
    priority = -1000
    dtypes = ("float32", "bfloat16")

    def not_supported_reasons(self, request=None, **facts):
        if gqakv.dispatch.request.as_request(request, facts).dtype == "bfloat16":
            return ["dtype=bfloat16 (the probe refuses it)"]
        return super().not_supported_reasons(request, **facts)


def test_selftest_iterates_what_a_new_backend_declares(capsys):
    gqakv.register_backend(_ProbeBackend)
    try:
        status, out = run_selftest(capsys, "--backend", "selftest_probe", "--quick", "--seed", "3")
    finally:
        gqakv.unregister_backend("selftest_probe")
    assert status == 0, out
    lines = result_lines(out)
    assert {d for _, d, *_ in lines} == {"all", "float32", "bfloat16"}
    assert all(r == "SKIP" and "probe refuses" in note for _, d, _, _, r, note in lines if d == "bfloat16")
    assert all(r == "PASS" for _, d, _, _, r, _ in lines if d == "float32")


def test_default_backend_is_the_auto_choice(capsys, monkeypatch):
    monkeypatch.setenv("GQAKV_BACKEND", "numpy")
    status, out = run_selftest(capsys, "--quick", "--seed", "4")
    assert status == 0 and out.startswith("gqakv selftest: backend numpy ")


def test_reference_agrees_with_the_test_suites_loop_reference():
    rng = np.random.default_rng(0)
    Hq, Hkv, d, T = 6, 2, 8, 4
    lens, n_new = [9, 3, 0], [4, 2, 0]
    k = [rng.standard_normal((Hkv, L, d)) for L in lens]
    v = [rng.standard_normal((Hkv, L, d)) for L in lens]
    q = rng.standard_normal((3, Hq, T, d))
    out, lse = reference_attention(q, k, v, n_new)
    want_out, want_lse = loop_reference(q, k, v, n_new)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], rtol=1e-12)
    # the naive low-precision yardstick: close to the reference, but not exact
    f16 = lambda x: np.asarray(x, np.float32).astype(np.float16).astype(np.float32)  # noqa: E731
    k16 = [f16(x) for x in k]
    v16 = [f16(x) for x in v]
    q16 = f16(q)
    ref16, _ = reference_attention(q16, k16, v16, n_new)
    naive, _ = naive_low_precision(q16, k16, v16, n_new, f16)
    err = np.abs(naive - ref16).max()
    assert 0 < err < 2e-2
    assert (naive[2] == 0).all() and (naive[1, :, 2:] == 0).all()  # padding stays 0


def test_tolerance_rule():
    ref = np.array([0.5, -2.0])
    assert selftest._tolerance("float32", ref, None) == pytest.approx(1e-5 * 3.0)
    assert selftest._tolerance("float64", ref, None) == pytest.approx(1e-12 * 3.0)
    assert selftest._tolerance("float16", ref, 1e-3) == pytest.approx(2e-3 + 2.0**-11 * 2.0)
    c = selftest.Check("decode", "float16")
    c.cases = 1
    c.add("x", 0.5, 1.0)
    c.add("y", float("nan"), 1.0)  # a NaN output is a failure, never a pass
    assert not c.passed and "FAIL" in c.line()


def _ignore_the_variant(original, self, q, store, inputs, params, **kw):
    # plain causal attention whatever window / softcap / sinks were asked for
    plain = dataclasses.replace(params, window=None, softcap=None, sinks=None)
    return original(self, q, store, dataclasses.replace(inputs, params=plain), plain, **kw)


def test_an_attention_ignoring_the_variant_fails_only_the_variants_line(capsys, monkeypatch):
    _broken(monkeypatch, "attention", _ignore_the_variant)
    status, out = run_selftest(capsys, "--backend", "numpy", "--quick", "--seed", "6")
    assert status == 1, out
    failed = {(f, d) for f, d, _, _, result, _ in result_lines(out) if result == "FAIL"}
    # the shared-pages line's last step is a soft-capped decode with sinks, and the
    # draft-tree line's second call has a window and a soft-cap
    assert failed == {(f, d) for f in ("variants", selftest.SHARED_PREFIX, selftest.DRAFT_TREE)
                      for d in gqakv.get_backend("numpy").dtypes}, out


def _ignore_the_tree(original, self, q, store, inputs, params, **kw):
    # plain causal attention whatever tree was given
    return original(self, q, store, dataclasses.replace(inputs, tree=None), params, **kw)


def test_an_attention_ignoring_the_tree_fails_only_the_draft_tree_line(capsys, monkeypatch):
    _broken(monkeypatch, "attention", _ignore_the_tree)
    status, out = run_selftest(capsys, "--backend", "numpy", "--quick", "--seed", "6")
    assert status == 1, out
    failed = {(f, d) for f, d, _, _, result, _ in result_lines(out) if result == "FAIL"}
    assert failed == {(selftest.DRAFT_TREE, d) for d in gqakv.get_backend("numpy").dtypes}, out


def test_references_agree_on_trees():
    """gqakv.ops.reference's tree rule (semantics.tree_visible) against the suite's loop
    reference walking parents, with a window, soft-cap and ALiBi."""
    rng = np.random.default_rng(4)
    Hq, Hkv, d, T = 4, 2, 8, 6
    lens, n_new = [15, 6, 3], [6, 6, 0]
    parents = [[-1, 0, 0, 1, 3, -1], [-1, -1, 1, 2, 0, 4], [-1] * 6]
    k = [rng.standard_normal((Hkv, L, d)) for L in lens]
    v = [rng.standard_normal((Hkv, L, d)) for L in lens]
    q = rng.standard_normal((3, Hq, T, d))
    for variant in ({}, {"window": 3, "softcap": 2.0, "alibi_slopes": [0.5, -0.25, 0.1, 0.0]}):
        out, lse = reference_attention(q, k, v, n_new, 0.4, tree=parents, **variant)
        want_out, want_lse = loop_reference(q, k, v, n_new, 0.4, parents=parents, **variant)
        np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("variant", [dict(window=1), dict(window=3, softcap=0.2),
                                     dict(softcap=1e-3, sinks=[0.5, -np.inf, 40.0, -2.0, 0.0, 1.0]),
                                     dict(window=2, softcap=4.0, sinks=[1.0] * 6)],
                         ids=["w1", "w3+softcap", "softcap+sinks", "all"])
def test_references_agree_on_the_variants(variant):
    """gqakv.ops.reference (key rule from gqakv.core.semantics, vectorized over keys) against the
    suite's loop reference, and the naive low-precision yardstick close to both."""
    rng = np.random.default_rng(1)
    Hq, Hkv, d, T = 6, 2, 8, 4
    lens, n_new = [9, 3, 0], [4, 2, 0]
    k = [rng.standard_normal((Hkv, L, d)) * 2 for L in lens]
    v = [rng.standard_normal((Hkv, L, d)) for L in lens]
    q = rng.standard_normal((3, Hq, T, d)) * 2
    out, lse = reference_attention(q, k, v, n_new, 0.4, **variant)
    want_out, want_lse = loop_reference(q, k, v, n_new, 0.4, **variant)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], rtol=1e-12)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    naive, naive_lse = naive_low_precision(q, k, v, n_new, f32, 0.4, **variant)
    np.testing.assert_allclose(naive, want_out, atol=1e-5)
    np.testing.assert_array_equal(np.isinf(naive_lse), np.isinf(want_lse))
    np.testing.assert_allclose(naive_lse[np.isfinite(want_lse)], want_lse[np.isfinite(want_lse)],
                               atol=1e-4)
