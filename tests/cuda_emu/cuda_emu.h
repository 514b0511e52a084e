// CPU emulation of the small part of CUDA the gqakv kernels use (force-included by g++).
//
// Model: a launch runs its blocks one after another; within a block every CUDA thread is
// a fiber (its own stack and context, driver.cpp), all of them taking turns on the one OS
// thread that called emu_launch: a thread runs until it waits at a barrier, then the next
// one that can go on runs. Created once per launch and reused for each block. (They were
// OS threads until 2026-12-06: a barrier of a 128-thread block woke 128 threads through
// the kernel, and on a 2-core machine the emulated tests spent most of their time there.)
//   __syncthreads()      a barrier over the block's threads (gqakv_emu::Barrier)
//   __shfl_xor_sync      full mask only: each lane writes its value to a per-warp slot,
//                        a 32-thread warp barrier, reads its partner's slot, and a second
//                        warp barrier before the slots are reused
//   divergence checks    every thread counts its __syncthreads and every lane its warp
//                        collectives (shuffles, mma); after each barrier all of them must
//                        be at the same count and the same kind of collective (shuffle
//                        with the same lane mask, mma, leaving the kernel), else the run
//                        aborts naming the primitive. A barrier is a counter, so without
//                        this a thread at the end of the block, or a lane at a different
//                        shuffle, would complete another's barrier and the divergence would
//                        pass unseen (on a GPU: a hang or undefined values).
//   deadlock             when every unfinished thread waits at a barrier that cannot
//                        complete (e.g. one lane at an extra shuffle while the rest of the
//                        block is at __syncthreads) the run aborts at once; a watchdog also
//                        aborts a launch in which no barrier completes for
//                        GQAKV_EMU_DEADLOCK_S seconds (default 300: a thread that never
//                        reaches its next barrier).
//   order                threads run in index order between barriers, so code that reads
//                        another thread's writes without a barrier between sees a fixed
//                        interleaving: a missing __syncthreads is caught only where that
//                        order gives a wrong result (as on a GPU, where it is a race).
//   __shared__           `static` storage: one copy, used by one block at a time
//   threadIdx/blockIdx   per thread, swapped in by the scheduler; blockDim/gridDim per launch
//   half / bfloat16      conversions through _Float16 (binary16 with round to nearest even)
//   mma m16n8k16         warp-collective, f16/bf16 inputs, fp32 accumulators (see below)
// Anything else a kernel might use is missing on purpose, so the build fails on it.
#pragma once
#define GQAKV_EMULATION 1

#include <atomic>
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
// A barrier of `expected` threads (fibers): arrive_and_wait returns once all have arrived
// in this phase; the last to arrive goes on without yielding (driver.cpp).
struct Barrier {
    unsigned expected;
    unsigned arrived = 0;
    uint64_t phase = 0;
    void arrive_and_wait();
};
struct Warp {
    Barrier* bar;
    uint64_t slot[32];
    uint64_t seq[32];       // each lane's count of warp collectives (divergence check)
    uint32_t mma_a[32][4];  // each lane's A fragment registers (mma exchange)
    uint32_t mma_b[32][2];  // each lane's B fragment registers
};
struct Block {
    Barrier* bar;
    Warp* warps;
    unsigned nthreads;
    uint64_t* sync_seq[2];  // each thread's __syncthreads count, by its parity
};
extern Block g_block;               // the block being run (one at a time)
extern unsigned g_tid;  // linear thread index within the block (of the running fiber)
// Per-thread counts of __syncthreads and of warp collectives since the launch began
// (never reset between blocks, so a stale count from an earlier block cannot match).
extern uint64_t g_sync_count, g_warp_count;
// Completed barriers (counted by one thread of each), watched for deadlock by emu_launch.
extern std::atomic<uint64_t> g_progress;
// The tag a lane publishes at a warp collective: its count, and what it is at (bits 48+).
enum : uint64_t { EMU_SHFL = 1, EMU_MMA = 2, EMU_EXIT = 3 };
inline uint64_t warp_tag(uint64_t kind, unsigned detail) {
    return (kind << 56) | ((uint64_t)(detail & 0xffu) << 48) | ++g_warp_count;
}
[[noreturn]] void fail(const char* what);

// After the first barrier of a warp collective: every lane must be at the same collective.
inline void check_warp_converged(const Warp& w, const char* what) {
    const uint64_t mine = w.seq[g_tid % 32];
    for (int l = 0; l < 32; ++l)
        if (w.seq[l] != mine) fail(what);
}
}  // namespace gqakv_emu

extern dim3 threadIdx;  // the running fiber's (driver.cpp swaps them in)
extern dim3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;

// The count is published in the slot of its parity: a thread can only write the same
// parity again two barriers later, which needs this thread's arrival at the next one.
inline void __syncthreads() {
    using namespace gqakv_emu;
    const uint64_t mine = ++g_sync_count;
    g_block.sync_seq[mine & 1][g_tid] = mine;
    g_block.bar->arrive_and_wait();
    if (g_tid == 0) g_progress.fetch_add(1, std::memory_order_relaxed);
    for (unsigned t = 0; t < g_block.nthreads; ++t)
        if (g_block.sync_seq[mine & 1][t] != mine)
            fail("__syncthreads: not every thread of the block reached this barrier (divergent __syncthreads)");
}

template <class T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
    static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
    if (mask != 0xffffffffu || width != 32) gqakv_emu::fail("__shfl_xor_sync: only the full mask and width 32 are emulated");
    if (lane_mask < 0 || lane_mask > 31) gqakv_emu::fail("__shfl_xor_sync: lane mask out of range");
    gqakv_emu::Warp& w = gqakv_emu::g_block.warps[gqakv_emu::g_tid / 32];
    const unsigned lane = gqakv_emu::g_tid % 32;
    std::memcpy(&w.slot[lane], &value, sizeof(T));
    w.seq[lane] = gqakv_emu::warp_tag(gqakv_emu::EMU_SHFL, (unsigned)lane_mask);
    w.bar->arrive_and_wait();
    if (lane == 0) gqakv_emu::g_progress.fetch_add(1, std::memory_order_relaxed);
    gqakv_emu::check_warp_converged(w, "__shfl_xor_sync: not every lane of the warp is at this shuffle (divergent warp collective)");
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

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32: acc (D = C) += A * B for
// the whole warp. Layout as documented in the PTX ISA, section 9.7.14.5.8 "Matrix Fragments
// for mma.m16n8k16 with floating point type" (groupID = lane >> 2, tig = lane % 4; two
// 16-bit elements per register, the lower-indexed one in the low half):
//   A 16x16: a_i (register i / 2, half i % 2) is A[row][col] with
//            row = groupID if i < 2 or 4 <= i < 6, else groupID + 8;
//            col = 2 * tig + (i & 1) if i < 4, else 2 * tig + (i & 1) + 8
//   B 16x8:  b_i (register i / 2, half i % 2) is B[row][col] with
//            row = 2 * tig + (i & 1) if i < 2, else 2 * tig + (i & 1) + 8; col = groupID
//   C/D 16x8 fp32: c_i is C[row][col] with row = groupID if i < 2, else groupID + 8;
//            col = 2 * tig + (i & 1)
// Each lane deposits its registers in the warp's exchange, a warp barrier, each lane
// rebuilds the whole A and B from every lane's registers through the mapping above
// (failing if the mapping does not cover each element exactly once) and computes its own
// four D elements, and a second warp barrier before the exchange is reused. Products of
// 16-bit values are exact; the 16-term sum is formed in double and added to C once, a
// model of the fp32 tensor-core accumulation (whose internal rounding it does not claim to
// reproduce bit for bit). It proves a kernel right given the documented layout; it cannot
// prove that the hardware follows the document.
inline float gqakv_emu_16bit_to_float(uint32_t bits, bool bf16) {
    return bf16 ? __uint_as_float(bits << 16) : gqakv_emu_half_to_float((unsigned short)bits);
}

inline void gqakv_emu_mma_m16n8k16(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                   bool bf16) {
    gqakv_emu::Warp& w = gqakv_emu::g_block.warps[gqakv_emu::g_tid / 32];
    const unsigned lane = gqakv_emu::g_tid % 32;
    std::memcpy(w.mma_a[lane], a, sizeof(w.mma_a[lane]));
    std::memcpy(w.mma_b[lane], b, sizeof(w.mma_b[lane]));
    w.seq[lane] = gqakv_emu::warp_tag(gqakv_emu::EMU_MMA, bf16 ? 1u : 0u);
    w.bar->arrive_and_wait();
    if (lane == 0) gqakv_emu::g_progress.fetch_add(1, std::memory_order_relaxed);
    gqakv_emu::check_warp_converged(w, "mma_m16n8k16: not every lane of the warp is at this mma (divergent warp collective)");
    float A[16][16], B[16][8];
    int seen_a[16][16] = {}, seen_b[16][8] = {};
    for (unsigned l = 0; l < 32; ++l) {
        const unsigned group = l >> 2, tig = l % 4;
        for (unsigned i = 0; i < 8; ++i) {
            const unsigned row = (i < 2 || (i >= 4 && i < 6)) ? group : group + 8;
            const unsigned col = i < 4 ? tig * 2 + (i & 1) : tig * 2 + (i & 1) + 8;
            A[row][col] = gqakv_emu_16bit_to_float((w.mma_a[l][i / 2] >> (16 * (i % 2))) & 0xffffu, bf16);
            ++seen_a[row][col];
        }
        for (unsigned i = 0; i < 4; ++i) {
            const unsigned row = i < 2 ? tig * 2 + (i & 1) : tig * 2 + (i & 1) + 8;
            const unsigned col = group;
            B[row][col] = gqakv_emu_16bit_to_float((w.mma_b[l][i / 2] >> (16 * (i % 2))) & 0xffffu, bf16);
            ++seen_b[row][col];
        }
    }
    w.bar->arrive_and_wait();
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c)
            if (seen_a[r][c] != 1 || (c < 8 && seen_b[r][c] != 1))
                gqakv_emu::fail("mma_m16n8k16: fragment mapping does not cover A or B exactly once");
    const unsigned group = lane >> 2, tig = lane % 4;
    for (unsigned i = 0; i < 4; ++i) {
        const unsigned row = i < 2 ? group : group + 8;
        const unsigned col = tig * 2 + (i & 1);
        double sum = 0.0;
        for (int k = 0; k < 16; ++k) sum += (double)A[row][k] * (double)B[k][col];
        acc[i] = (float)((double)acc[i] + sum);
    }
}
