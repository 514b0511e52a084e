// CPU emulation of the small part of CUDA the gqakv kernels use (force-included by g++).
//
// Model: a launch runs its blocks one after another; within a block every CUDA thread is
// an OS thread (std::thread), created once per launch and reused for each block.
//   __syncthreads()      a std::barrier over the block's threads
//   __shfl_xor_sync      full mask only: each lane writes its value to a per-warp slot,
//                        a 32-thread warp barrier, reads its partner's slot, and a second
//                        warp barrier before the slots are reused
//   __shared__           `static` storage: one copy, used by one block at a time
//   threadIdx/blockIdx   thread-locals; blockDim/gridDim set per launch
//   half / bfloat16      conversions through _Float16 (binary16 with round to nearest even)
// Anything else a kernel might use is missing on purpose, so the build fails on it.
#pragma once
#define GQAKV_EMULATION 1

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

namespace gqakv_emu {
struct Warp {
    std::barrier<>* bar;
    uint64_t slot[32];
};
struct Block {
    std::barrier<>* bar;
    Warp* warps;
};
extern Block g_block;               // the block being run (one at a time)
extern thread_local unsigned g_tid;  // linear thread index within the block
[[noreturn]] void fail(const char* what);
}  // namespace gqakv_emu

extern thread_local dim3 threadIdx;
extern thread_local dim3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;

inline void __syncthreads() { gqakv_emu::g_block.bar->arrive_and_wait(); }

template <class T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
    static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
    if (mask != 0xffffffffu || width != 32) gqakv_emu::fail("__shfl_xor_sync: only the full mask and width 32 are emulated");
    if (lane_mask < 0 || lane_mask > 31) gqakv_emu::fail("__shfl_xor_sync: lane mask out of range");
    gqakv_emu::Warp& w = gqakv_emu::g_block.warps[gqakv_emu::g_tid / 32];
    const unsigned lane = gqakv_emu::g_tid % 32;
    std::memcpy(&w.slot[lane], &value, sizeof(T));
    w.bar->arrive_and_wait();
    T out;
    std::memcpy(&out, &w.slot[lane ^ (unsigned)lane_mask], sizeof(T));
    w.bar->arrive_and_wait();
    return out;
}

inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }

inline float gqakv_emu_half_to_float(unsigned short bits) {
    _Float16 h;
    std::memcpy(&h, &bits, 2);
    return (float)h;
}
inline unsigned short gqakv_emu_float_to_half(float f) {
    _Float16 h = (_Float16)f;
    unsigned short bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}
