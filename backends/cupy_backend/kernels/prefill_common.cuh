// Helpers shared by the chunked-prefill kernels (prefill.cu: fp32 FMA; prefill_mma.cu:
// tensor cores).
#pragma once
#include "variant.cuh"

// The work of one prefill CTA in the grid (B * Hkv * n_gchunks, n_tblocks) that
// plan.plan_attention launches: entry b, KV head kvh, group chunk gc, first chunk token t0
// of its query block, the entry's length L and new tokens n, the position of the chunk's
// token 0 (start = L - n), and the block's key span [k_begin, k_end) (gqakv.semantics.
// block_keys): k_begin the first key its first token sees (0, or the window's start),
// k_end one past its last token's last key. With a draft tree (TREE) a query's window
// starts by its logical position start + depth >= start, so the window start of a root
// (start itself) is a safe k_begin for every block of the entry (semantics.block_keys'
// tree span starts there or later; the keys between are masked).
struct PrefillCta {
    int gc, kvh, b, t0;
    i64 L, n, start, k_begin, k_end;
};

template <class V>
__device__ __forceinline__ PrefillCta prefill_cta(const i64* __restrict__ lens,
                                                  const i64* __restrict__ n_new, int Hkv,
                                                  int n_gchunks, int BQ, const AttnParams& params) {
    PrefillCta w;
    w.gc = blockIdx.x % n_gchunks;
    w.kvh = (blockIdx.x / n_gchunks) % Hkv;
    w.b = blockIdx.x / (n_gchunks * Hkv);
    w.t0 = blockIdx.y * BQ;
    w.L = lens[w.b];
    w.n = n_new[w.b];
    w.start = w.L - w.n;
    w.k_begin = V::key_lo(params, V::TREE ? w.start : w.start + w.t0);
    w.k_end = w.start + (w.t0 + BQ < w.n ? w.t0 + BQ : w.n);
    return w;
}
