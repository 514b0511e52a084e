// Shared device helpers for the gqakv CUDA kernels.
//
// The same sources compile with NVRTC for the GPU and with g++ plus the emulation shim
// (tests/cuda_emu/cuda_emu.h, which defines GQAKV_EMULATION) for the CPU. Kernels use
// only what the shim reproduces: __syncthreads, full-mask __shfl_xor_sync, __shared__
// arrays, and the conversions below. No implicit warp-synchronous code.
//
// 16-bit types are plain 16-bit storage (CuPy has no bfloat16 dtype on every version):
// gqakv_half holds IEEE binary16 bits, gqakv_bf16 holds bfloat16 bits. Everything is
// computed in fp32. Offsets into the cache are 64-bit (long long) everywhere.
#pragma once
#include "limits.cuh"

typedef long long i64;

struct gqakv_half { unsigned short bits; };
struct gqakv_bf16 { unsigned short bits; };

#define GQAKV_FULL_MASK 0xffffffffu
#define GQAKV_NEG_INF (-__int_as_float(0x7f800000))

// ---- conversions --------------------------------------------------------------------

__device__ __forceinline__ float to_float(float x) { return x; }

__device__ __forceinline__ float to_float(gqakv_bf16 x) {
    return __uint_as_float(((unsigned)x.bits) << 16);  // bf16 is the top half of an fp32
}

__device__ __forceinline__ float to_float(gqakv_half x) {
#ifdef GQAKV_EMULATION
    return gqakv_emu_half_to_float(x.bits);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
#endif
}

template <class T> __device__ __forceinline__ T from_float(float f);

template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }

template <> __device__ __forceinline__ gqakv_bf16 from_float<gqakv_bf16>(float f) {
    // Round to nearest even, NaN stays NaN (what cvt.rn.bf16.f32 does), in portable code.
    unsigned u = __float_as_uint(f);
    gqakv_bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x0040u);
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        r.bits = (unsigned short)(u >> 16);
    }
    return r;
}

template <> __device__ __forceinline__ gqakv_half from_float<gqakv_half>(float f) {
    gqakv_half r;
#ifdef GQAKV_EMULATION
    r.bits = gqakv_emu_float_to_half(f);
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
#endif
    return r;
}

// ---- vector access ----------------------------------------------------------------------

// How a K/V element type holds values: PACK values per element (2 for 4-bit codes), one
// scale per GROUP values (0: none, or one per token). Plain types and 8-bit per-token
// codes keep this default; quantized_kv.cuh specializes it for the grouped codes.
template <class T>
struct CodeLayout {
    static constexpr int PACK = 1, GROUP = 0;
};

// Elements per vector access: 16 bytes when a head-dim row is a whole number of 16-byte
// vectors (so every row start is 16-byte aligned in a contiguous buffer), else 1.
template <class T, int D>
struct VecWidth {
    static_assert(D >= 1 && D <= GQAKV_MAX_HEAD_DIM, "head dim beyond GQAKV_MAX_HEAD_DIM");
    static constexpr int value = (D * (int)sizeof(T)) % 16 == 0 ? 16 / (int)sizeof(T) : 1;
};

template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
    T v[N];
};

// Load N consecutive elements at p (aligned to N elements) into fp32.
template <class T, int N>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float* out) {
    Vec<T, N> x = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = to_float(x.v[e]);
}

// ---- warp reductions (full mask: every lane of the warp must call them) ----------------------

// Sum / max over aligned groups of W consecutive lanes (W a power of two <= 32).
template <int W>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int off = W / 2; off > 0; off /= 2) x += __shfl_xor_sync(GQAKV_FULL_MASK, x, off);
    return x;
}

template <int W>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
    for (int off = W / 2; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(GQAKV_FULL_MASK, x, off));
    return x;
}

__host__ __device__ constexpr int gqakv_pow2_ceil(int x) { return x <= 1 ? 1 : 2 * gqakv_pow2_ceil((x + 1) / 2); }
__host__ __device__ constexpr int gqakv_cmin(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int gqakv_cmax(int a, int b) { return a > b ? a : b; }
