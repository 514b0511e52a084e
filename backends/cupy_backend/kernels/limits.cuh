// The fused kernels' limits. Declared once, in backends/cupy_backend/limits.py, and handed
// to every compile as -D options (limits.define_options(): sources.COMPILE_OPTIONS for
// NVRTC and CuPy, tests/cuda_emu/harness.py for the emulator's g++), so the planner, the
// kernel table and the kernels read the same numbers. Lists are comma-separated values
// (read with gqakv_one_of), tables comma-separated (key, value) pairs (gqakv_lookup,
// gqakv_lookup_at_most). Only compile-time constants come from here: no kernel arithmetic.
#pragma once

#if !defined(GQAKV_THREADS_PER_CTA) || !defined(GQAKV_MAX_GRID_X) || !defined(GQAKV_MAX_GRID_Y) || \
    !defined(GQAKV_MAX_HEAD_DIM) || !defined(GQAKV_DECODE_QUERY_TILES) ||                          \
    !defined(GQAKV_DECODE_CTAS_PER_SM) || !defined(GQAKV_DECODE_MMA_HEAD_DIMS) ||                  \
    !defined(GQAKV_DECODE_MMA_ROWS) || !defined(GQAKV_DECODE_MMA_CTAS_PER_SM) ||                   \
    !defined(GQAKV_PREFILL_MMA_HEAD_DIM_MULTIPLE) || !defined(GQAKV_PREFILL_MMA_ROWS) ||           \
    !defined(GQAKV_PREFILL_ROWS)
#error "compile with the -D options of gqakv_backends.cupy_backend.limits.define_options()"
#endif

// Whether x is one of v...
template <class... V>
__host__ __device__ constexpr bool gqakv_one_of(int x, V... v) { return ((x == v) || ... || false); }

// The value paired with `key` in (key, value) pairs; -1 when there is none.
__host__ __device__ constexpr int gqakv_lookup(int) { return -1; }
template <class... R>
__host__ __device__ constexpr int gqakv_lookup(int key, int k, int v, R... rest) {
    return key == k ? v : gqakv_lookup(key, rest...);
}

// The value of the first (top, value) pair with x <= top; -1 when there is none.
__host__ __device__ constexpr int gqakv_lookup_at_most(int) { return -1; }
template <class... R>
__host__ __device__ constexpr int gqakv_lookup_at_most(int x, int top, int v, R... rest) {
    return x <= top ? v : gqakv_lookup_at_most(x, rest...);
}

// Every kernel is written for 4 warps: __launch_bounds__(128, ...) and WARPS = 4.
static_assert(GQAKV_THREADS_PER_CTA == 128, "the kernels are written for 128-thread CTAs");
