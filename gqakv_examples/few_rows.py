"""The example model's matmul for decode's few rows: ``x [M, in] @ w [in, out]`` streamed.

A decode step multiplies a handful of token rows (the batch) by every weight matrix of the
model, so its matmuls read each weight once for little arithmetic: they are bound by how
fast the weights stream from memory. OpenBLAS's sgemm does not stream them at that size:
it packs each weight into its own buffers first. On the project's 2-core machine, all of
SmolLM2-135M's decode matmuls (30 layers' seven weights and the tied head, 540 MB of
float32, cold caches) took 68-73 ms at 8 rows (7.5 GB/s of weights) and 29-35 ms at one
row (OpenBLAS's sgemv) against about 27 GB/s of read bandwidth; this kernel took
33-34 ms and 20 ms (2026-12-05, load 1-3).

The kernel computes each output as a dot product of a row of ``x`` and a column of ``w``,
which must lie contiguously: ``w`` stored in Fortran order (its transpose ``[out, in]`` C
contiguous, as a GGUF file and torch's ``Linear`` store weights). Two rows of ``x`` meet
four columns at a time (eight sums in registers; the columns stay in L1 for the next
pair), the columns cut into blocks spread over numba's threads. Against OpenBLAS on the
same Fortran-order weights (the 30 layers' seven products) it leads up to about 40 rows
(32 rows: 62 against 73 ms; 48: 84 against 81; 64: 111 against 88), so the model keeps
``x @ w`` for more than ``MAX_ROWS`` rows.

In batch-invariant mode (``gqakv.batch_invariant``) the model runs every product on it,
prefill's too, with ``invariant=True``: every row is then summed by the pair loop (an odd
count's last row paired with itself), so a row's bits do not depend on the other rows or
the thread count, where BLAS picks its blocking by the row count. Measured in one process
(load 4.9): pairing the last row with itself costs 15% at one row (26.9 against 22.8 ms)
and nothing at 2 and 8; summing every row alone instead costs 10-15% at 8 and 16 rows.
"""

from __future__ import annotations

import numpy as np

from gqakv_backends.cpu_plan import blas_workers

try:
    import numba
    from numba import njit, prange
except ImportError:  # numba is optional where it has no wheels: x @ w serves
    numba = None

#: The model's products of more rows than this take ``x @ w`` (outside batch-invariant
#: mode; see the module docstring).
MAX_ROWS = 32
#: Output columns per parallel task: each task streams its columns' weights once.
COLUMN_BLOCK = 32
#: Rows a task takes at a time over its columns (for long products: those rows and the
#: task's columns, 74 KB each at 576 inputs, stay in L2 while they meet).
ROW_CHUNK = 32
#: The kernel's float32 flags: reassociation lets LLVM vectorize each dot product's sum;
#: never 'nnan' / 'ninf', so NaN and inf propagate as in ``x @ w``.
FASTMATH = {"contract", "reassoc", "arcp"}


if numba is not None:
    f32 = np.float32

    @njit(parallel=True, fastmath=FASTMATH, nogil=True, cache=True)
    def _rows_times_columns(x, wt, out, pair_last):  # pragma: no cover - compiled
        """``out[m, o] = x[m] . wt[o]``: x ``[M, K]``, wt ``[N, K]``, out ``[M, N]``
        float32, x and wt C-contiguous. Rows go in pairs; an odd M's last row alone, or
        with ``pair_last`` paired with itself, so that every row is summed by the same loop
        whatever M (which column loop sums it depends on o and N alone)."""
        M, K = x.shape
        N = wt.shape[0]
        for task in prange((N + COLUMN_BLOCK - 1) // COLUMN_BLOCK):
            first = task * COLUMN_BLOCK
            end = min(N, first + COLUMN_BLOCK)
            for m0 in range(0, M, ROW_CHUNK):  # rows and columns both stay in L2
                m1 = min(M, m0 + ROW_CHUNK)
                o = first
                while o + 4 <= end:
                    w0, w1, w2, w3 = wt[o], wt[o + 1], wt[o + 2], wt[o + 3]
                    for m in range(m0, m1, 2):
                        xa = x[m]
                        if m + 1 == m1 and not pair_last:  # the last row alone
                            a0 = a1 = a2 = a3 = f32(0)
                            for k in range(K):
                                s = xa[k]
                                a0 += s * w0[k]
                                a1 += s * w1[k]
                                a2 += s * w2[k]
                                a3 += s * w3[k]
                            out[m, o], out[m, o + 1], out[m, o + 2], out[m, o + 3] = a0, a1, a2, a3
                            continue
                        mb = min(m + 1, m1 - 1)
                        xb = x[mb]
                        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = f32(0)
                        for k in range(K):
                            u0, u1, u2, u3 = w0[k], w1[k], w2[k], w3[k]
                            s = xa[k]
                            a0 += s * u0
                            a1 += s * u1
                            a2 += s * u2
                            a3 += s * u3
                            t = xb[k]
                            b0 += t * u0
                            b1 += t * u1
                            b2 += t * u2
                            b3 += t * u3
                        out[m, o], out[m, o + 1], out[m, o + 2], out[m, o + 3] = a0, a1, a2, a3
                        out[mb, o], out[mb, o + 1], out[mb, o + 2], out[mb, o + 3] = b0, b1, b2, b3
                    o += 4
                while o < end:  # the block's last columns, one at a time
                    w0 = wt[o]
                    for m in range(m0, m1):
                        xa = x[m]
                        a0 = f32(0)
                        for k in range(K):
                            a0 += xa[k] * w0[k]
                        out[m, o] = a0
                    o += 1


def why_not(x, w) -> str | None:
    """None when ``few_rows_matmul(x, w)`` runs the kernel, else why it does not."""
    if numba is None:
        return "numba is not installed"
    if not (type(x) is np.ndarray and type(w) is np.ndarray):  # a subclass would lose its type
        return "not NumPy arrays"
    if x.dtype != np.float32 or w.dtype != np.float32:
        return f"dtypes {x.dtype} @ {w.dtype}, not float32"
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        return f"shapes {list(x.shape)} @ {list(w.shape)} are not [M, in] @ [in, out]"
    if not w.flags.f_contiguous:
        return "w is not in Fortran order (its columns do not lie contiguously)"
    return None


def few_rows_matmul(x, w, *, invariant: bool = False, threads: int | None = None) -> np.ndarray:
    """``x @ w`` for ``x [M, in]`` and ``w [in, out]``: the kernel when ``why_not`` says
    it applies, else ``x @ w`` itself. ``invariant``: each row's bits the same whatever M
    (an odd M's last row is paired with itself: the same loop as every other row, at the
    cost of a second copy of its sums). ``threads``: numba threads for the kernel
    (default: as many as BLAS would use for ``x @ w``, GQAKV_NUM_THREADS if set)."""
    if why_not(x, w) is not None:
        return x @ w
    out = np.empty((x.shape[0], w.shape[1]), dtype=np.float32)
    if out.size == 0 or x.shape[1] == 0:
        out[...] = 0
        return out
    if threads is None:
        threads = blas_workers()
    # the gqakv numba backend sets numba's thread count per call too: set it every time
    numba.set_num_threads(max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS)))
    _rows_times_columns(np.ascontiguousarray(x), w.T, out, bool(invariant))
    return out


def column_major(w):
    """``w`` (a NumPy float32 matrix) in Fortran order, the layout ``few_rows_matmul``
    reads; anything else unchanged. Same values, and ``x @ w`` runs as fast for many
    rows (OpenBLAS takes the transposed layout as it is)."""
    if numba is not None and type(w) is np.ndarray and w.ndim == 2 and w.dtype == np.float32:
        return np.asfortranarray(w)
    return w
