"""The example model's few-row matmul (``gqakv_examples.few_rows``) against float64 products,
where it applies and where it declines, and the model's use of it."""

from __future__ import annotations

import numpy as np
import pytest

from gqakv_examples import few_rows

needs_numba = pytest.mark.skipif(few_rows.numba is None, reason="numba is not installed")


def _weights(rng, k, n):
    """``[k, n]`` float32 in Fortran order (what the kernel reads)."""
    return np.asfortranarray(rng.standard_normal((k, n)).astype(np.float32))


def _assert_product(got, x, w):
    """``got`` is ``x @ w`` up to float32 rounding: within the worst-case bound of a K-term
    float32 sum in any order, 2 K eps times the sum of the terms' magnitudes."""
    ref = x.astype(np.float64) @ w.astype(np.float64)
    bound = 2 * x.shape[1] * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))
    assert got.shape == ref.shape and got.dtype == np.float32
    err = np.abs(got - ref)
    assert np.all(err <= bound + 1e-30), f"max error {err.max()} over bound {bound[err > bound].min()}"


@needs_numba
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 32, 33, 70])
@pytest.mark.parametrize("k, n", [(1, 1), (5, 3), (64, 4), (577, 33), (96, 130)])
def test_matches_float64_products(rows, k, n):
    """Row counts within one chunk of rows and over several (the last partly filled),
    column counts that leave blocks and groups of four partly filled, and short and odd
    sums."""
    rng = np.random.default_rng(rows * 1000 + k * 7 + n)
    x, w = rng.standard_normal((rows, k)).astype(np.float32), _weights(rng, k, n)
    assert few_rows.why_not(x, w) is None
    _assert_product(few_rows.few_rows_matmul(x, w), x, w)
    _assert_product(few_rows.few_rows_matmul(x, w, invariant=True), x, w)


@needs_numba
def test_strided_rows_and_thread_counts():
    """Rows sliced out of a wider array are read as their values; each output is one
    thread's sum, so one thread and two give the same bits."""
    rng = np.random.default_rng(3)
    wide = rng.standard_normal((9, 700)).astype(np.float32)
    x = wide[1::2, 50:626]  # [4, 576], neither row- nor column-contiguous in memory
    w = _weights(rng, 576, 1000)
    one = few_rows.few_rows_matmul(x, w, threads=1)
    _assert_product(one, x, w)
    np.testing.assert_array_equal(one, few_rows.few_rows_matmul(x, w, threads=2))


@needs_numba
def test_a_rows_bits_do_not_depend_on_the_other_rows():
    """What batch-invariant mode relies on (``invariant=True``): row i of a product of any
    number of rows (odd or even, one chunk of rows or several) is the product of row i
    alone, bit for bit, on any number of threads."""
    rng = np.random.default_rng(8)
    x, w = rng.standard_normal((75, 96)).astype(np.float32), _weights(rng, 96, 71)
    whole = few_rows.few_rows_matmul(x, w, invariant=True)
    _assert_product(whole, x, w)
    for i in (0, 1, 31, 32, 33, 74):
        np.testing.assert_array_equal(whole[i:i + 1], few_rows.few_rows_matmul(x[i:i + 1], w, invariant=True))
    for part in (slice(10, 50), slice(3, 6), slice(0, 33)):
        np.testing.assert_array_equal(whole[part], few_rows.few_rows_matmul(x[part], w, invariant=True))
    np.testing.assert_array_equal(whole, few_rows.few_rows_matmul(x, w, invariant=True, threads=1))
    # not vacuous: summed alone (the default for an odd count's last row), row 0 differs
    assert not np.array_equal(whole[:1], few_rows.few_rows_matmul(x[:1], w))


@needs_numba
def test_nan_and_inf_propagate_as_in_a_product():
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((3, 40)).astype(np.float32), _weights(rng, 40, 9)
    x[1, 7] = np.nan
    x[2, 0] = np.inf
    w[:, 4] = 0  # inf * 0: NaN in row 2's column 4, as in x @ w
    got = few_rows.few_rows_matmul(x, w)
    with np.errstate(invalid="ignore"):
        ref = x @ w
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
    assert np.isnan(got[1]).all() and np.isnan(got[2, 4]) and np.isinf(got[2, :4]).all()
    _assert_product(got[0:1], x[0:1], w)


@needs_numba
def test_empty_sums_give_zeros():
    x, w = np.ones((2, 0), np.float32), np.asfortranarray(np.ones((0, 5), np.float32))
    np.testing.assert_array_equal(few_rows.few_rows_matmul(x, w), np.zeros((2, 5), np.float32))
    assert few_rows.few_rows_matmul(np.ones((0, 4), np.float32), np.asfortranarray(np.ones((4, 3), np.float32))).shape == (0, 3)


@needs_numba
def test_declines_with_reasons_and_falls_back_to_blas():
    """Outside its case it says why, and ``few_rows_matmul`` is ``x @ w`` bit for bit."""
    rng = np.random.default_rng(5)
    w = _weights(rng, 16, 8)
    cases = {
        "Fortran order": (rng.standard_normal((2, 16)).astype(np.float32), np.ascontiguousarray(w)),
        "not float32": (rng.standard_normal((2, 16)), np.asfortranarray(w, dtype=np.float64)),
        "not [M, in] @ [in, out]": (rng.standard_normal((2, 15)).astype(np.float32), w),
    }
    for words, (x, ww) in cases.items():
        reason = few_rows.why_not(x, ww)
        assert reason is not None and words in reason, (words, reason)
        if x.shape[-1] == ww.shape[0]:
            np.testing.assert_array_equal(few_rows.few_rows_matmul(x, ww), x @ ww)
    assert "NumPy" in few_rows.why_not([[1.0]], w)


def test_column_major_keeps_values_and_leaves_the_rest():
    rng = np.random.default_rng(6)
    w = rng.standard_normal((5, 7)).astype(np.float32)
    f = few_rows.column_major(w)
    np.testing.assert_array_equal(f, w)
    assert f.flags.f_contiguous == (few_rows.numba is not None)
    w64 = w.astype(np.float64)
    assert few_rows.column_major(w64) is w64  # only float32 matrices: the kernel's case
    v = w[0]
    assert few_rows.column_major(v) is v


@needs_numba
def test_model_decode_runs_on_it_and_agrees_with_blas(monkeypatch):
    """The example model's decode products take the kernel (counted), prefill's stay with
    BLAS, and the logits agree with the model run on BLAS alone to float32 rounding; in
    batch-invariant mode every product takes it, prefill's too."""
    import gqakv
    from gqakv_examples.llama import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, n_layers=2,
                         n_heads=4, n_kv_heads=2, head_dim=16)
    model = LlamaModel(config, seed=1, backend="numpy")
    assert all(model.layers[0][k].flags.f_contiguous for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    calls = []
    kernel = few_rows._rows_times_columns
    monkeypatch.setattr(few_rows, "_rows_times_columns",
                        lambda x, wt, out, pair_last: (calls.append(x.shape[0]), kernel(x, wt, out, pair_last)))
    rng = np.random.default_rng(7)
    prompts = rng.integers(0, 97, (3, 40))
    nxt = rng.integers(0, 97, (3, 1))

    def run():
        cache = model.new_cache(3, 48)
        model.forward(prompts, [40, 40, 40], cache)
        return model.forward(nxt, [1, 1, 1], cache, last_only=True)

    fast = run()
    # prefill: 120 rows, BLAS; decode: 3 rows, 7 products per layer and the head
    assert calls == [3] * (7 * config.n_layers + 1)
    monkeypatch.setattr(few_rows, "MAX_ROWS", 0)
    calls.clear()
    slow = run()
    assert calls == []
    np.testing.assert_allclose(fast, slow, rtol=1e-4, atol=1e-4)
    with gqakv.batch_invariant():  # every product: each row is summed alone
        invariant = run()
    assert calls == [120] * (7 * config.n_layers + 1) + [3] * (7 * config.n_layers + 1)
    np.testing.assert_allclose(invariant, slow, rtol=1e-4, atol=1e-4)
