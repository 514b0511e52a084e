"""How close a result must be to the float64 reference, by the cache's dtype.

float64 / float32: a fixed tolerance (float32: ~170 ulps on O(1) outputs). float16 / bfloat16: the
project's rule (FlashAttention's; tests/test_low_precision.py): the error against the
float64 reference at most ``K_ERR`` times the error of the same attention computed
naively in that dtype (``gqakv.ops.reference.naive_low_precision``: every intermediate
rounded) plus a tiny ``EPS``; never a loose fixed atol.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from gqakv.ops.reference import naive_low_precision

#: Tolerances of float64 / float32 results against the float64 reference (outputs O(1),
#: lse O(10)).
ATOL = {"float64": 1e-10, "float32": 2e-5}
K_ERR = 2.0
EPS = 1e-6
LOW_PRECISION = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def rounder(dtype: str):
    """float32 array -> float32 array of the nearest ``dtype`` values."""
    narrow = LOW_PRECISION[dtype]
    return lambda x: np.asarray(x, np.float32).astype(narrow).astype(np.float32)


def low_precision_bounds(dtype: str, want, want_lse, q, k_rows, v_rows, n_new, scale, *,
                         window=None, softcap=None, sinks=None,
                         alibi_slopes=None, tree=None) -> tuple[float, float]:
    """(out bound, lse bound): ``K_ERR x`` the naive same-dtype errors against the float64
    reference ``want`` / ``want_lse`` (finite entries) plus ``EPS``. q, k_rows, v_rows: the
    values the cache holds (float64 arrays, as for the reference). Where the naive
    attention is exact (a row of one key: the output is that key's value) the bound is
    EPS: the result must be exact too."""
    naive, naive_lse = naive_low_precision(q, k_rows, v_rows, n_new, rounder(dtype), scale,
                                           window=window, softcap=softcap, sinks=sinks,
                                           alibi_slopes=alibi_slopes, tree=tree)
    fin = np.isfinite(want_lse)
    err = float(np.max(np.abs(naive - want), initial=0.0))
    err_lse = float(np.max(np.abs(naive_lse[fin] - want_lse[fin]), initial=0.0))
    return K_ERR * err + EPS, K_ERR * err_lse + EPS


def assert_matches_reference(got, got_lse, want, want_lse, dtype: str, bounds=None,
                             what: str = "", lse_atol: float | None = None,
                             lse_rtol: float | None = None) -> None:
    """``got`` (and ``got_lse`` unless None) against the float64 reference: float64 /
    float32 within ATOL (lse: ``lse_atol`` and ``lse_rtol``, default 10x and 1x ATOL),
    float16/bfloat16 within ``bounds`` (``low_precision_bounds``). lse: the same -inf
    entries, the rest close."""
    got = np.asarray(got, np.float64)
    if dtype in LOW_PRECISION:
        out_bound, lse_bound = bounds
        err = float(np.max(np.abs(got - want), initial=0.0))
        assert err <= out_bound, (f"{what}: {dtype} error {err:.3g} vs float64 exceeds {K_ERR} x "
                                  f"the same-dtype naive error + {EPS} ({out_bound:.3g})")
    else:
        np.testing.assert_allclose(got, want, atol=ATOL[dtype], rtol=0, err_msg=what)
    if got_lse is None:
        return
    got_lse = np.asarray(got_lse, np.float64)
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse), err_msg=what)
    fin = np.isfinite(want_lse)
    if dtype in LOW_PRECISION:
        err = float(np.max(np.abs(got_lse[fin] - want_lse[fin]), initial=0.0))
        assert err <= lse_bound, (f"{what}: {dtype} lse error {err:.3g} exceeds {K_ERR} x the "
                                  f"naive lse error + {EPS} ({lse_bound:.3g})")
    else:
        np.testing.assert_allclose(got_lse[fin], want_lse[fin],
                                   atol=10 * ATOL[dtype] if lse_atol is None else lse_atol,
                                   rtol=ATOL[dtype] if lse_rtol is None else lse_rtol,
                                   err_msg=what)
