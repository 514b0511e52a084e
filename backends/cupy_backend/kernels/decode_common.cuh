// Helpers shared by the decode kernels (decode.cu: fp32 FMA; decode_mma.cu: tensor cores).
#pragma once
#include "common.cuh"

// 2^x in fp32 (one MUFU.EX2 on the GPU; the flush of results below 2^-126 to 0 is far
// below the fp32 accumulation error of a softmax weight).
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef GQAKV_EMULATION
    return exp2f(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

// NW 32-bit words loaded with the widest aligned vector accesses (16 bytes when NW is a
// multiple of 4): raw 16-bit pairs kept in registers until used.
template <int NW>
struct alignas(NW % 4 == 0 ? 16 : (NW % 2 == 0 ? 8 : 4)) Words {
    unsigned w[NW];
};

template <int NW>
__device__ __forceinline__ void load_words(Words<NW>& dst, const void* __restrict__ p) {
    dst = *reinterpret_cast<const Words<NW>*>(p);
}

// NW words (a multiple of 4) from NW / 4 16-byte chunks, chunk i at p + i * stride elements.
template <int NW, class T>
__device__ __forceinline__ void load_chunks(Words<NW>& dst, const T* __restrict__ p, int stride) {
    static_assert(NW % 4 == 0, "load_chunks: whole 16-byte chunks");
#pragma unroll
    for (int i = 0; i < NW / 4; ++i) {
        Words<4> c;
        load_words(c, p + i * stride);
#pragma unroll
        for (int k = 0; k < 4; ++k) dst.w[4 * i + k] = c.w[k];
    }
}
