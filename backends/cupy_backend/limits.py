"""The fused kernels' limits, declared once.

Everything the planner (``plan.py``), the kernel table (``sources.py``), the routing step
(``routing.py``) and the kernels themselves must agree on is written here and nowhere
else. The kernels see the values as preprocessor macros: ``c_defines()`` turns the table
into ``-D`` options, which every compile passes (``sources.COMPILE_OPTIONS`` for NVRTC
and CuPy, ``tests/cuda_emu/harness.py`` for the emulator's g++), and ``kernels/limits.cuh``
refuses to compile without them. Where a kernel's shape is fixed by its arithmetic (the
mma's 16 rows, 4 warps of 32 threads) the kernel keeps its constant and a
``static_assert`` checks it against the macro, so the two cannot drift apart.

Pure Python (no CuPy, no NumPy): imported by ``gqakv info`` and the tests.
"""

from __future__ import annotations

#: Threads per CTA of every fused kernel (4 warps; the kernels index warps by it).
THREADS_PER_CTA = 128
#: CUDA's launch limits: gridDim.x < 2^31, gridDim.y <= 65535.
MAX_GRID_X = 2**31 - 1
MAX_GRID_Y = 65535

#: Largest head dim the fused kernels are instantiated for (any d <= this works).
MAX_FUSED_HEAD_DIM = 256

#: Query tokens per row up to which attention uses the decode kernels (the prefill above).
DECODE_MAX_T = 4
#: Query tiles (queries per CTA) gqakv_decode is instantiated for, smallest first, and the
#: resident CTAs per SM each is compiled for (its ``__launch_bounds__`` minimum; the split
#: planner's occupancy; tests/test_cupy_backend.py checks ptxas' registers allow it).
DECODE_QUERY_TILES = (4, 8)
DECODE_CTAS_PER_SM = {4: 3, 8: 2}
#: The decode kernel counts the keys of one split in an int.
MAX_KEYS_PER_SPLIT = 2**30
#: The K/V readers (kernels/variant.cuh) find key j of a (row, KV head) at element offset
#: j * key_stride in 32-bit arithmetic (64-bit offsets cost registers in every kernel), so
#: the last key's row must end within this many elements of the first key's.
MAX_KEY_SPAN = 2**31 - 1

#: Tensor-core kernels run mma.m16n8k16 with 16-bit inputs: compute capability 8.0+
#: (CuPy's spelling: 80).
MMA_MIN_CAPABILITY = 80
MMA_DTYPES = ("float16", "bfloat16")
#: gqakv_decode_mma: head dims served, query rows per CTA (the mma's m) and resident CTAs
#: per SM by head dim.
DECODE_MMA_HEAD_DIMS = (64, 128)
DECODE_MMA_ROWS = 16
DECODE_MMA_CTAS_PER_SM = {64: 4, 128: 2}
#: gqakv_prefill_mma: head dims a multiple of the mma's k, 64 query rows per CTA (4 warps
#: x the mma's 16 rows).
PREFILL_MMA_HEAD_DIM_MULTIPLE = 16
PREFILL_MMA_ROWS = 64
#: gqakv_prefill (fp32 FMA): query rows per CTA by head dim, as (largest head dim, rows).
PREFILL_ROWS = ((64, 64), (128, 32), (MAX_FUSED_HEAD_DIM, 16))


def prefill_rows(head_dim: int) -> int:
    """Query rows per gqakv_prefill CTA at ``head_dim`` (``PREFILL_ROWS``)."""
    return next(rows for top, rows in PREFILL_ROWS if head_dim <= top)


def _pairs(table) -> str:
    items = table.items() if isinstance(table, dict) else table
    return ",".join(f"{k},{v}" for k, v in items)


def c_defines() -> dict[str, str]:
    """The table as macros for the kernels (``kernels/limits.cuh`` says how each is used).

    Lists are comma-separated (read with ``gqakv_one_of``), tables are comma-separated
    (key, value) pairs (read with ``gqakv_lookup`` / ``gqakv_lookup_at_most``).
    """
    return {
        "GQAKV_THREADS_PER_CTA": str(THREADS_PER_CTA),
        "GQAKV_MAX_GRID_X": str(MAX_GRID_X),
        "GQAKV_MAX_GRID_Y": str(MAX_GRID_Y),
        "GQAKV_MAX_HEAD_DIM": str(MAX_FUSED_HEAD_DIM),
        "GQAKV_DECODE_QUERY_TILES": ",".join(map(str, DECODE_QUERY_TILES)),
        "GQAKV_DECODE_CTAS_PER_SM": _pairs(DECODE_CTAS_PER_SM),
        "GQAKV_DECODE_MMA_HEAD_DIMS": ",".join(map(str, DECODE_MMA_HEAD_DIMS)),
        "GQAKV_DECODE_MMA_ROWS": str(DECODE_MMA_ROWS),
        "GQAKV_DECODE_MMA_CTAS_PER_SM": _pairs(DECODE_MMA_CTAS_PER_SM),
        "GQAKV_PREFILL_MMA_HEAD_DIM_MULTIPLE": str(PREFILL_MMA_HEAD_DIM_MULTIPLE),
        "GQAKV_PREFILL_MMA_ROWS": str(PREFILL_MMA_ROWS),
        "GQAKV_PREFILL_ROWS": _pairs(PREFILL_ROWS),
    }


def define_options() -> tuple[str, ...]:
    """``c_defines()`` as compiler options (``-DNAME=value``), for NVRTC and g++ alike."""
    return tuple(f"-D{name}={value}" for name, value in c_defines().items())


# -- why a kernel cannot serve a call (one sentence each; None: it can) ----------------------


def dtype_rejection(dtype: str, fused_dtypes) -> str | None:
    if dtype in fused_dtypes:
        return None
    return f"dtype={dtype} (supported: {', '.join(fused_dtypes)})"


def head_dim_rejection(head_dim: int) -> str | None:
    if 1 <= head_dim <= MAX_FUSED_HEAD_DIM:
        return None
    return f"head_dim={head_dim} (supported: 1..{MAX_FUSED_HEAD_DIM})"


def key_span_rejection(max_len: int, key_stride: int, head_dim: int) -> str | None:
    """Why the readers' 32-bit key offsets cannot address a cache whose rows hold
    ``max_len`` keys ``key_stride`` elements apart (None: they can)."""
    span = (max_len - 1) * key_stride + head_dim if max_len > 0 else 0
    if span <= MAX_KEY_SPAN:
        return None
    return (f"a row's keys span {span} elements (max_len={max_len} x key stride {key_stride}; "
            f"the kernels address keys in 32 bits: at most {MAX_KEY_SPAN})")


def capability_rejection(capability: int | None) -> str | None:
    """The tensor-core kernels' device requirement; ``capability`` as CuPy spells it (90
    for 9.0), None when not known (not checked)."""
    if capability is None or capability >= MMA_MIN_CAPABILITY:
        return None
    return (f"compute capability {capability // 10}.{capability % 10} (mma.m16n8k16 needs "
            f"{MMA_MIN_CAPABILITY // 10}.{MMA_MIN_CAPABILITY % 10}+)")


def decode_mma_rejection(dtype: str, head_dim: int) -> str | None:
    """Why gqakv_decode_mma has no instantiation for (dtype, head_dim)."""
    if dtype not in MMA_DTYPES:
        return f"dtype={dtype} (supported: {', '.join(MMA_DTYPES)})"
    if head_dim not in DECODE_MMA_HEAD_DIMS:
        return f"head_dim={head_dim} (supported: {', '.join(map(str, DECODE_MMA_HEAD_DIMS))})"
    return None


def prefill_mma_rejection(dtype: str, head_dim: int) -> str | None:
    """Why gqakv_prefill_mma has no instantiation for (dtype, head_dim)."""
    if dtype not in MMA_DTYPES:
        return f"dtype={dtype} (supported: {', '.join(MMA_DTYPES)})"
    if head_dim % PREFILL_MMA_HEAD_DIM_MULTIPLE or not 0 < head_dim <= MAX_FUSED_HEAD_DIM:
        return (f"head_dim={head_dim} (supported: multiples of {PREFILL_MMA_HEAD_DIM_MULTIPLE} "
                f"up to {MAX_FUSED_HEAD_DIM})")
    return None
