// Warp-level tensor-core multiply-accumulate for 16-bit inputs with fp32 accumulation:
//   mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32   (sm_80 and newer)
//
// Fragment layout, from the PTX ISA, section 9.7.14.5.8 "Matrix Fragments for mma.m16n8k16
// with floating point type" (figures 79, 81, 83). Per lane: groupID = lane >> 2,
// tig = lane % 4 (threadID_in_group). 16-bit elements are packed two to a 32-bit register,
// the lower-indexed element in the low half ("elements low to high").
//   A (16 x 16, row): a0..a7 in 4 registers; row = groupID for a0, a1, a4, a5, else
//                     groupID + 8; col = 2 * tig + (i & 1), + 8 for a4..a7.
//   B (16 x 8, col):  b0..b3 in 2 registers; row (k) = 2 * tig + (i & 1), + 8 for b2, b3;
//                     col (n) = groupID.
//   C, D (16 x 8 fp32): c0..c3; row = groupID for c0, c1, else groupID + 8;
//                     col = 2 * tig + (i & 1).
// So register r of A holds (row, cols) = (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)
// for r = 0..3, and register r of B holds k rows 2t..2t+1 (r = 0) or 2t+8..2t+9 (r = 1).
//
// Every lane of the warp must call mma_m16n8k16 together (it is a warp-collective .sync
// instruction). Under GQAKV_EMULATION the CPU shim's warp-collective emulation of the same
// instruction and layout runs instead (tests/cuda_emu/cuda_emu.h).
#pragma once
#include "common.cuh"

// acc (a 16 x 8 C/D fragment) += A (16 x 16) * B (16 x 8), inputs of storage type T.
template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&acc)[4], const unsigned (&a)[4],
                                             const unsigned (&b)[2]);

template <>
__device__ __forceinline__ void mma_m16n8k16<gqakv_half>(float (&acc)[4], const unsigned (&a)[4],
                                                         const unsigned (&b)[2]) {
#ifdef GQAKV_EMULATION
    gqakv_emu_mma_m16n8k16(acc, a, b, /*bf16=*/false);
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

template <>
__device__ __forceinline__ void mma_m16n8k16<gqakv_bf16>(float (&acc)[4], const unsigned (&a)[4],
                                                         const unsigned (&b)[2]) {
#ifdef GQAKV_EMULATION
    gqakv_emu_mma_m16n8k16(acc, a, b, /*bf16=*/true);
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Two fp32 values rounded to T (nearest even) and packed as one fragment register:
// lo in the low half (the lower-indexed element), hi in the high half.
template <class T>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return (unsigned)from_float<T>(lo).bits | ((unsigned)from_float<T>(hi).bits << 16);
}
